"""The daemon's log: one format, one level, and libraries kept to what an operator needs."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from types import TracebackType

import h11

from kvguard.engine.log_level import log_level

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log routine work at INFO: APScheduler writes two lines per job run (each
# evaluation an engine event or an alert starts), which buries kvguard's own lines in a journal. Their warnings and
# errors still show; at DEBUG everything does.
CHATTY = ("apscheduler",)
# Lines a library writes at INFO on every start that say nothing an operator acts on, by logger
# and message: alembic names the audit database's dialect each time it opens it. Its lines that
# say the schema changed ("Running upgrade ...") stay; at DEBUG everything does.
# uvicorn names every request with an `Upgrade:` header it does not serve, and tells the
# operator to install a websocket library: kvguard serves no websockets (it answers such a
# request as plain HTTP), so neither line says anything to act on, and any client could write
# them at will.
ROUTINE = {
    "alembic.runtime.migration": ("Context impl ", "Will assume "),
    "uvicorn.error": ("Unsupported upgrade request.", "No supported WebSocket library detected"),
}
# Lines uvicorn writes once per connection, before the app (and its API key check) runs: bytes
# that are not HTTP (a TLS hello from a client set to https://, a port scanner). Any client could
# write thousands a second and use up journald's rate limit, which then drops kvguard's own
# errors too: the first is logged, the rest counted in one line per BOUNDED_INTERVAL_S.
# So is the daemon's line for a connection it cannot accept for want of a file descriptor
# (service._report_accept_errors): asyncio retries each one, thousands of times a second.
NOT_ACCEPTING = (
    "the API cannot accept connections: %s (%d HTTP connections open, open files limit %d); "
    "clients get no answer until some close: find the client holding them (ss -tn), lower "
    "api.max_connections below what the limit leaves, or raise LimitNOFILE= (systemctl edit "
    "kvguard)"
)
# And the daemon's line for a connection refused as it connected, as many being served as
# api.max_connections allows (service._TimedH11): any client could write one a connection.
PAST_MAX_CONNECTIONS = (
    "%d HTTP connections are served, the most api.max_connections allows (find the clients "
    "holding them: ss -tn; or raise it where the open files limit leaves room): answered 503 "
    "to a connection"
)
# And the daemon's line for a connection reset because its client read nothing more of its
# answer for a whole api.response_write_timeout (service._TimedH11): one per stalled client
# ("from <peer>." is added to the first).
NOT_READ = (
    "a client read nothing more of its answer for %gs (api.response_write_timeout; raise it if "
    "clients pause reading that long on purpose), and any request still running for it is "
    "aborted: resetting the connection"
)
BOUNDED = {
    "uvicorn.error": {"Invalid HTTP request received.": "invalid HTTP requests"},
    "kvguard.daemon": {
        NOT_ACCEPTING: "failed accepts for want of a file descriptor",
        NOT_READ: "connections closed for answers their clients did not read",
        PAST_MAX_CONNECTIONS: "connections refused past api.max_connections",
    },
}
BOUNDED_INTERVAL_S = 60.0
# uvicorn's logger, where it writes `Exception in ASGI application` with the traceback. When the
# headers were HTTP but the body was not (a chunk size that is not a number), the headers have
# started the app, and uvicorn answers 400 and counts the request as above before the app
# answers; h11 then refuses the app's answer, and uvicorn logs that refusal with an 87-line
# traceback, once per request, for any client, on any route, whatever its API key.
# Those records are dropped (the request is already in the line or count above); every other
# exception in the app keeps its traceback.
REFUSED_ANSWERS = ("uvicorn.error",)
# The syslog priority journald reads from a line's `<N>` prefix (SyslogLevelPrefix).
PRIORITY = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


class _DropRoutine(logging.Filter):
    """Drops a logger's records whose message (the unformatted one) starts with a prefix."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


class _Bounded(logging.Filter):
    """Lets the first record with one of `what`'s messages through, then counts the next ones
    and logs their number in one line at the end of each `interval_s` (a timer thread: a
    burst that stops is still counted). Each line names the client it came from where the
    connection that logged it can be found."""

    def __init__(
        self, logger: logging.Logger, what: dict[str, str], interval_s: float = BOUNDED_INTERVAL_S
    ) -> None:
        super().__init__()
        self.logger, self.what, self.interval_s = logger, what, interval_s
        self._lock = threading.Lock()
        self._quiet_until: dict[str, float] = {}  # by message: counted, not logged, until then
        self._counted: dict[str, tuple[int, str | None]] = {}  # by message: count, latest peer
        self._timer: dict[str, threading.Timer] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if not isinstance(msg, str) or msg not in self.what:
            return True
        peer = _peer()
        now = time.monotonic()
        with self._lock:
            if now >= self._quiet_until.get(msg, 0.0) and msg not in self._timer:
                self._quiet_until[msg] = now + self.interval_s
                if peer is not None:
                    record.msg = f"{msg.rstrip('.')} from {_as_literal(peer, record)}."
                return True
            n, _ = self._counted.get(msg, (0, None))
            self._counted[msg] = (n + 1, peer)
            if msg not in self._timer:
                timer = threading.Timer(self._quiet_until[msg] - now, self._flush, (msg,))
                timer.daemon = True
                self._timer[msg] = timer
                timer.start()
        return False

    def _flush(self, msg: str) -> None:
        with self._lock:
            n, peer = self._counted.pop(msg, (0, None))
            self._timer.pop(msg, None)
            self._quiet_until[msg] = time.monotonic() + self.interval_s
        if n:
            self.logger.warning(
                "%d more %s in the last %gs%s (not logged one by one)",
                n,
                self.what[msg],
                self.interval_s,
                f", the latest from {peer}" if peer else "",
            )


class _DropRefusedAnswer(logging.Filter):
    """Drops the records of an app's answer that h11 refused because uvicorn had already
    answered the connection's invalid request (see REFUSED_ANSWERS)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        _, exc, tb = record.exc_info
        return not _refused_after_invalid(exc, tb)


def _refused_after_invalid(exc: BaseException | None, tb: TracebackType | None) -> bool:
    """Whether `exc` is h11 refusing to send on a connection whose client side is in h11's
    ERROR state: the request was not HTTP. Only that state tells this refusal from one our own
    code caused (an answer h11 cannot write, on a sound connection), which is a bug to show.
    The connection is that of the uvicorn request cycle that caught `exc`: the traceback's
    first frame is its run_asgi."""
    if not isinstance(exc, h11.LocalProtocolError) or tb is None:
        return False
    cycle = tb.tb_frame.f_locals.get("self")
    if not type(cycle).__module__.startswith("uvicorn.protocols."):
        return False
    conn = getattr(cycle, "conn", None)
    return isinstance(conn, h11.Connection) and conn.their_state is h11.ERROR


def _as_literal(text: str, record: logging.LogRecord) -> str:
    """`text` (a client's address) put into `record`'s message as it is: with arguments, the
    message is a %-format, in which an address's own % (an IPv6 link-local `fe80::1%eth0`)
    was read as a directive, and logging printed its error and a traceback instead."""
    return text.replace("%", "%%") if record.args else text


def _peer() -> str | None:
    """The client address of the uvicorn connection whose code is logging, found on the stack
    (uvicorn's record carries none): `host:port`, or None where it cannot be found."""
    frame = sys._getframe(1)
    for _ in range(16):  # the logging module's own frames, then uvicorn's protocol
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if _uvicorn_protocol(obj):
            client = getattr(obj, "client", None)
            if isinstance(client, tuple) and len(client) == 2:
                return f"{client[0]}:{client[1]}"
            return None
        frame = frame.f_back
    return None


def _uvicorn_protocol(obj: object) -> bool:
    """Whether `obj` is a uvicorn connection: of its classes, or of a subclass (the daemon's
    own, which adds read timeouts)."""
    return any(c.__module__.startswith("uvicorn.protocols.") for c in type(obj).__mro__)


class _JournalFormatter(logging.Formatter):
    """FORMAT, each line of a record (a traceback's, a multi-line message's) prefixed with the
    record's syslog priority `<N>`: journald stores each line as an entry at that priority."""

    def format(self, record: logging.LogRecord) -> str:
        n = next((p for level, p in PRIORITY if record.levelno >= level), 7)
        return "\n".join(f"<{n}>{line}" for line in super().format(record).split("\n"))


def under_journald() -> bool:
    """Whether stderr is the journal's stream: systemd sets $JOURNAL_STREAM to its
    `device:inode` (a stderr redirected elsewhere since then is not)."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(2)
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError):
        return False


def configure_logging(level: int | str | None = None) -> int:
    """Set up the root logger at `level` (default $KVGUARD_LOG_LEVEL, else INFO), quiet the
    CHATTY libraries to WARNING and drop the ROUTINE lines unless the level is DEBUG. Returns
    the level in force. Other libraries' loggers (uvicorn's among them: the daemon gives it
    no logging config of its own) go through the root logger: one format, one level. The
    BOUNDED lines are logged once, then counted, and the REFUSED_ANSWERS dropped (at DEBUG
    too: that is their volume). Under journald each line starts with its syslog priority."""
    numeric = log_level(level)
    debug = numeric <= logging.DEBUG
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig, with the journal's priorities there
        handler = logging.StreamHandler()
        handler.setFormatter(
            _JournalFormatter(FORMAT) if under_journald() else logging.Formatter(FORMAT)
        )
        root.addHandler(handler)
    root.setLevel(numeric)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.WARNING)
    for name, prefixes in ROUTINE.items():
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _DropRoutine)]:
            logger.removeFilter(f)  # called again (tests): one filter, or none at DEBUG
        if not debug:
            logger.addFilter(_DropRoutine(prefixes))
    for name, what in BOUNDED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Bounded) for f in logger.filters):  # one, kept across calls
            logger.addFilter(_Bounded(logger, what))
    for name in REFUSED_ANSWERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRefusedAnswer) for f in logger.filters):
            logger.addFilter(_DropRefusedAnswer())
    return numeric
