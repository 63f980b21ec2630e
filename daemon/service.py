"""The daemon: wires engine, engine thread, HTTP, metrics and systemd together and runs the
lifecycle — READY after load, watchdog pings from the engine heartbeat, SIGHUP reload,
SIGTERM drain, and the exit after a fatal engine failure (a tensor-parallel rank died or hung),
which systemd answers with a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import json
import logging
import os
import re
import resource
import signal
import socket
import struct
import sys
import termios
import threading
import time
import weakref
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from kvguard.daemon import gc_policy, sdnotify
from kvguard.daemon.api_keys import ApiKeys, load_keys
from kvguard.daemon.audit import AuditStore, utcnow
from kvguard.daemon.audit_migrate import shown
from kvguard.daemon.cli import EXIT_FAILURE, EXIT_USAGE
from kvguard.daemon.cli_serve import token_problem
from kvguard.daemon.config import (
    ENGINE_KNOBS,
    INERT,
    ConfigFileError,
    DaemonConfig,
    Loc,
    apply_overrides,
    inert_keys,
    load_config,
    state_dir,
)
from kvguard.daemon.control_plane import ControlPlane, _where, manual_detail, manual_outcome
from kvguard.daemon.logging_setup import (
    NOT_ACCEPTING,
    NOT_READ,
    PAST_MAX_CONNECTIONS,
    configure_logging,
)
from kvguard.daemon.metrics import ControlPlaneCollector, Metrics, TensorParallelCollector
from kvguard.daemon.nvml import NvmlReader, engine_gpu_ids
from kvguard.daemon.openai_schemas import error_body, new_id
from kvguard.daemon.version import kvguard_version
from kvguard.engine.config import ConfigError
from kvguard.engine.control import ActionResult
from kvguard.engine.control_surface import allowed_name
from kvguard.engine.distributed.sharding import check_tensor_parallel, stage_layers
from kvguard.engine.engine_loop import EngineLoop, EngineUnavailable
from kvguard.engine.host_memory import host_memory_used_ratio
from kvguard.engine.knobs import KnobField, KnobPath
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.engine.snapshot import EngineSnapshot
from kvguard.rules.actions import (
    ActionStillApplying,
    ActionWithdrawn,
    StopSignal,
    await_action,
    run_action,
    wait_or_stop,
)
from kvguard.rules.schema import RuleSet, load_rules, rules_file

log = logging.getLogger("kvguard.daemon")
# an engine loop without a heartbeat this long is stalled: not ready, new requests refused (503)
STALL_AFTER_S = 30.0
# After the drain deadline: how long the engine gets to apply the aborts of the cut requests,
# and then how long connections get to send their 503s / SSE errors, before the stop goes on.
CUT_GRACE_S = 5.0
# Then close() takes CLOSE_BUDGET_S at most: the control plane (control_plane.STOP_WAIT_S at
# most: a tick stuck longer is left behind), the engine loop, then its workers (at least
# STUCK_ENGINE_WAIT_S), then the audit (at least AUDIT_STOP_MIN_S); an engine known stuck is
# waited for STUCK_ENGINE_WAIT_S only. A whole stop thus takes at most api.drain_timeout +
# STOP_AFTER_DRAIN_S: daemon/systemd/kvguard.service's TimeoutStopSec leaves room for that
# with the default 30s (tests/test_drain.py checks the sum against the unit).
CLOSE_BUDGET_S = 10.0
STUCK_ENGINE_WAIT_S = 1.0
AUDIT_STOP_MIN_S = 2.0
STOP_AFTER_DRAIN_S = 2 * CUT_GRACE_S + CLOSE_BUDGET_S
# The process's own exit once the close is done (the interpreter's teardown: with the startup
# heap left frozen, a fraction of a second; see Service.keep_heap_frozen) is given this much on
# top: `stop_budget_s`, which the stop asks systemd for as it begins (EXTEND_TIMEOUT_USEC), so
# that a raised api.drain_timeout or an older copy of the unit does not SIGKILL a stop keeping
# to its bound. The shipped unit's TimeoutStopSec holds the budget of the default drain
# (tests/test_stop_budget.py checks both); a longer one is named at start and reload.
STOP_EXIT_MARGIN_S = 10.0
UNIT_TIMEOUT_STOP_S = 60.0
# The connections whose answer is still unread are closed this long before the end of the
# CUT_GRACE_S for sending answers: their tasks end before uvicorn's timeout cancels them.
UNREAD_CLOSE_EARLY_S = 0.5
# After a fatal engine failure: the status to exit with (systemd's Restart=on-failure restarts
# on any non-zero one), and how long the orderly exit (answers out, audit written, workers
# stopped) may take before the process leaves regardless.
FATAL_EXIT_CODE = 1
FATAL_EXIT_DEADLINE_S = 20.0
ENGINE_SHUTDOWN_S = 15.0  # stopping the workers: the runner asks, waits, then kills
# A reload waits this long for the engine to take its new knobs at a step boundary (not taken,
# they are withdrawn: nothing changed), and as long again for it to finish applying them. A stop
# never waits on a reload: one under way when the stop begins is abandoned at once (`stopping`).
RECONFIGURE_TIMEOUT_S = 30.0
# A reload that applied nothing shows in the STATUS= line until the next good reload: its first
# problem, cut to this many characters (the log has them all), so `systemctl status` stays legible.
RELOAD_PROBLEM_CHARS = 200
# A request's line and headers, at most (h11's default, said here so that the 431 can name it).
MAX_HEADER_BYTES = 16 * 1024
# where a request's line and headers end: the blank line, as h11 finds it
HEAD_END = re.compile(b"\n\r?\n")
# asyncio's message when accept() fails for want of a file descriptor (or of memory)
ACCEPT_OUT_OF_RESOURCE = "socket.accept() out of system resource"
# What api.max_connections left null keeps of the open files limit from the API's connections,
# beyond the descriptors held as the API starts: the audit database's files and spill file,
# the model and tokenizer files a reload reads, the workers' pipes, and the connections past the
# cap (OPERATOR_SPARE and PAST_CAP_HELD, each at most a quarter of it). A quarter of what is
# left where that is less (a limit of a few hundred).
FD_RESERVE = 256
# Past api.max_connections, a connection whose first request is the operator's (OPERATOR_PATHS)
# is served all the same, this many at once (fewer where the open files limit leaves less):
# refused as the API's clients are, the scrapes went unanswered (Prometheus's `up` fell and
# KvguardDown fired) and neither /admin nor Alertmanager's webhook could reach the daemon, just
# when it was saturated. Few, and closed once answered: the operator asks one thing at a time,
# and any client may ask /health, so these cannot take many descriptors either.
OPERATOR_SPARE = 16
# The paths of the operator's requests (daemon/app.py's /health, /ready and /metrics;
# admin_api's /admin/... and Alertmanager's /alertmanager), as a request's target names them.
OPERATOR_PATHS = frozenset({b"/health", b"/ready", b"/metrics", b"/alertmanager"})
OPERATOR_PREFIX = b"/admin/"
# A request line as h11 reads it (`token SP target SP HTTP/d.d`, its CR optional): its method
# and target, told before the rest of the head has come
REQUEST_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+) ([\x21-\x7e]+) HTTP/[0-9]\.[0-9]\r?")
# The connections past api.max_connections held at once, outside the cap: those whose request is
# still awaited (to tell the operator's from the API's), and those refused that linger after
# their 503 (REFUSED_LINGER_S). Past that many, a new one is answered 503 and closed at once,
# unread (its client may then see a reset, not the 503): each held one keeps a descriptor, and
# a flood of connects past the cap ran the daemon out of them, as the cap was set to prevent.
PAST_CAP_HELD = 64
# How long a connection past api.max_connections may take to send its first request's line and
# headers (api.request_read_timeout where that is shorter): held for the whole read timeout,
# PAST_CAP_HELD connections that send nothing took every place past the cap for 20 s, and the
# operator's requests were refused with the API's. An operator's client sends its request as
# it connects.
PAST_CAP_HEAD_S = 2.0
# A connection refused past api.max_connections is closed once its client hangs up, or after
# this: the rest of what the client sends is read first (closed with it unread, the connection
# would be reset, and the 503 lost), and a client that neither reads its answer nor hangs up
# holds a descriptor the cap keeps for others no longer than this.
REFUSED_LINGER_S = 1.0
# Retry-After of a connection refused past api.max_connections: a keep-alive connection left
# idle closes after uvicorn's 5 s, so one is free by then unless every one is busy.
CONNECTIONS_RETRY_S = 5
# what an operator's action withdrawn unapplied (the admin API's wait ran out) is audited with
MANUAL_WITHDRAWN = (
    "withdrawn before it ran: the engine did not take it while the admin API waited (a long "
    "step or a stalled engine thread); nothing changed"
)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the service owns SIGTERM/SIGINT/SIGHUP.
    `on_listening` runs once its sockets accept connections (not if it is already told to
    exit): the moment READY=1 may go out. `cap`: the connections held past
    api.max_connections, which its shutdown closes with the rest."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_listening: Callable[[], None],
        cap: ConnectionCap | None = None,
    ) -> None:
        super().__init__(config)
        self._on_listening = on_listening
        self._cap = cap

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self._on_listening()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown: the answers still being sent get CUT_GRACE_S (its
        timeout_graceful_shutdown). A client that still has not read its answer by then has
        its connection closed, with a warning, just before uvicorn's timeout would cancel the
        task sending it: that logs an error and a traceback per connection, for an end the
        drain expects (the client stopped reading)."""
        aio = asyncio.get_running_loop()
        for server in self.servers:  # uvicorn's own close of them is then a no-op
            server.close()
        _drop_accept_retries(aio)
        if self._cap is not None:  # uvicorn closes the others (idle, or a request half sent)
            self._cap.close_held()
        closing = aio.call_later(CUT_GRACE_S - UNREAD_CLOSE_EARLY_S, self._close_unread)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            closing.cancel()

    def _close_unread(self) -> None:
        """Abort (not close: that would wait for the client to read the buffers) the
        connections whose answer has begun and not been sent whole."""
        unread = [
            conn
            for conn in self.server_state.connections
            if (cycle := getattr(conn, "cycle", None)) is not None
            and cycle.response_started
            and not cycle.response_complete
        ]
        if unread:
            log.warning(
                "%d answers still not read by their clients at the end of the %gs grace: "
                "their connections are closed",
                len(unread),
                CUT_GRACE_S,
            )
        for conn in unread:
            conn.transport.abort()


def _drop_accept_retries(aio: asyncio.AbstractEventLoop) -> int:
    """Cancel asyncio's pending re-reads of listening sockets now closed; how many. After an
    accept() that fails for want of a descriptor, asyncio stops reading the listening socket
    and reads it again ACCEPT_RETRY_DELAY (1 s) later, a timer for each failed accept.
    Closing the server does not cancel them: each one due after the close, the event loop
    still running (the drain's grace for answers being sent), raised `ValueError: Invalid
    file descriptor: -1` on the closed socket and logged it with a traceback. asyncio keeps no
    other hold on them than the loop's own queues: the timers not yet due, and those due
    already, moved to the callbacks this turn of the loop runs (the close may come in the same
    turn); the selector loop's `_start_serving`, its socket the second argument. A loop
    without these (another implementation) has nothing cancelled here."""
    start_serving = getattr(aio, "_start_serving", None)
    if start_serving is None:
        return 0
    pending = [*getattr(aio, "_scheduled", ()), *getattr(aio, "_ready", ())]
    dropped = 0
    for handle in pending:
        args = getattr(handle, "_args", None) or ()
        if getattr(handle, "_callback", None) != start_serving or handle.cancelled():
            continue
        sock = args[1] if len(args) > 1 else None
        if isinstance(sock, socket.socket) and sock.fileno() == -1:
            handle.cancel()
            dropped += 1
    if dropped:
        log.debug("%d re-reads of the closed API socket after failed accepts cancelled", dropped)
    return dropped


def _nothing() -> None:
    return None


def _never() -> bool:
    return False


@dataclass(slots=True)
class ConnectionCap:
    """api.max_connections as the API applies it: `limit` connections served at once (None:
    no cap); `spare` more at once for the operator's requests (OPERATOR_SPARE);
    `held_most` connections past the cap held at once (PAST_CAP_HELD); `on_refused`, run
    for each connection refused past it (the metric); and `draining`, whether the drain has
    begun (the refusals are then its `shutting_down`). `spare_used` counts what the
    connections take of `spare` now, and `held` holds those past the cap (uvicorn's server
    knows nothing of them: the stop ends them here)."""

    limit: int | None = None
    spare: int = OPERATOR_SPARE
    held_most: int = PAST_CAP_HELD
    on_refused: Callable[[], None] = _nothing
    draining: Callable[[], bool] = _never
    spare_used: int = 0
    held: set[Any] = field(default_factory=set)

    def drain_began(self) -> None:
        """The drain refuses new work, but not the operator's: a connection past the cap
        whose request line has come, naming no operator's path, is answered `shutting_down`
        now rather than when the rest of its head comes (`_TimedH11.drain_began`). One that
        has sent less, or nothing yet, is left to send its request: it may be a scrape or
        an admin call, which the drain serves. Those lingering after their 503 are left to
        their client's close (REFUSED_LINGER_S at most). One connection whose answer raises
        is closed and logged: the drain, which calls this, goes on for every other one."""
        for conn in list(self.held):
            try:
                conn.drain_began()
            except Exception:
                log.exception("a connection past the cap could not be answered at the drain")
                conn.transport.close()

    def close_held(self) -> None:
        """The server stops: close the connections still held past the cap, as uvicorn
        closes its idle and half-sent ones, so that none outlives the server or holds its
        close."""
        for conn in list(self.held):
            conn.transport.close()


def operator_target(target: bytes) -> bool:
    """Whether a request's target is one of the operator's paths, which are served past
    api.max_connections (OPERATOR_SPARE)."""
    path = target.partition(b"?")[0]
    return path in OPERATOR_PATHS or path.startswith(OPERATOR_PREFIX)


def request_line(buffered: bytes) -> tuple[bytes, bytes] | None:
    """The method and target of the request whose bytes begin `buffered`, once its request
    line is whole (None before); a whole line that is not `METHOD TARGET HTTP/x.y` gives
    (b"", b""), which names no operator's path (h11 refuses it once the head is whole)."""
    end = buffered.find(b"\n")
    if end < 0:
        return None
    found = REQUEST_LINE.fullmatch(buffered, 0, end)
    return (found.group(1), found.group(2)) if found else (b"", b"")


def head_too_large(buffered: bytes) -> bool:
    """Whether the request whose bytes begin `buffered` has a line and headers longer than
    MAX_HEADER_BYTES: more than that has come, and their end (the blank line) is not within it."""
    return len(buffered) > MAX_HEADER_BYTES and not HEAD_END.search(buffered, 0, MAX_HEADER_BYTES)


class _HeadLimitedConnection(h11.Connection):
    """h11's server side, holding each request's line and headers to MAX_HEADER_BYTES however
    they arrive. h11's own max_incomplete_event_size counts only what it still waits for: a
    head that came whole in one read (asyncio reads 256 KiB at a time) was parsed at any size,
    so that only a slow or fragmented client met the limit. The check is here, where every
    request's head is parsed (the first, one kept alive, one pipelined behind an answer), and
    raises what h11 raises for a head still incomplete past the limit: the protocol answers
    both with the same 431.

    A connection past api.max_connections looks at its first request before uvicorn does
    (`peek_event`), to serve it only if it is the operator's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peeked: Any = None  # an event read ahead by `peek_event`: the next one returned
        # the status h11 would answer the request it could not parse with (431: a head too
        # long; 400: anything else), for the answer uvicorn asks for without saying why
        self.refusal = 400

    def next_event(self) -> Any:
        if self.peeked is not None:
            event, self.peeked = self.peeked, None
            return event
        try:
            if self.their_state is h11.IDLE and head_too_large(self.trailing_data[0]):
                raise h11.RemoteProtocolError(
                    "request line and headers too long", error_status_hint=431
                )
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.refusal = e.error_status_hint
            raise

    def peek_event(self) -> Any:
        """The next event, left to be the next `next_event` returns (NEED_DATA is not kept:
        more data may make an event of it)."""
        event = self.next_event()
        if event is not h11.NEED_DATA:
            self.peeked = event
        return event


class _TimedH11(H11Protocol):
    """uvicorn's h11 protocol with the read timeouts of a server facing clients it cannot
    trust. uvicorn times a connection only once idle after an answer (timeout_keep_alive, kept
    as it is): one that never finished its request stayed open for ever, and a thousand of
    them took every file descriptor the daemon had. Here a request's line and headers must
    arrive whole within `read_timeout` of their first byte (of the connect, for a connection's
    first request), else the client gets 408 (nothing, if it sent nothing) and the connection
    is closed; and its body may pause no longer than that, else the connection is closed and
    the app sees the client gone. Headers over MAX_HEADER_BYTES answer 431, however they
    arrive (`_HeadLimitedConnection`), and what the client still sends is read before the close: closed with its bytes unread, the connection was
    reset, and the client saw no answer at all.

    The answer's side is timed too: while the daemon cannot send (the socket's buffers are
    full), a client that reads nothing more of its answer for a whole `write_timeout` has its
    connection reset, which the app sees as the client gone (its request, if still running, is
    aborted). A client that stopped reading held its answer's memory and the connection for
    ever. What is timed is the lack of progress, not the pause: a large answer written at once
    (a non-streamed one, logprobs JSON of MBs) stays paused until nearly all of it is sent, and
    a client reading it steadily for longer than `write_timeout` was reset mid-answer.

    Past `cap.limit` connections served (api.max_connections), a new one is read until its
    first request's line and headers are whole (within PAST_CAP_HEAD_S): the operator's
    (OPERATOR_PATHS) is served, `cap.spare` connections at most, and closed once answered;
    any other is answered 503 and closed (`_refuse_past_cap`). The daemon keeps accepting, and
    the connections open are served as before. uvicorn's limit_concurrency does not fit: it
    checks each request, not each connection, so at the cap a request on a connection already
    open was refused too, and it counts running tasks as well, answering plain text."""

    read_timeout = 20.0  # api.request_read_timeout: `timed_h11` sets it
    write_timeout = 60.0  # api.response_write_timeout: `timed_h11` sets it
    cap = ConnectionCap()  # api.max_connections: `timed_h11` sets it
    # what the client owes while the timer runs (`_awaiting`), as the DEBUG line says it
    OWED = {"headers": "its request", "body": "more of its body", "close": "it to hang up"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _HeadLimitedConnection(h11.SERVER, MAX_HEADER_BYTES)
        self._read_timer: asyncio.TimerHandle | None = None
        self._awaiting: str | None = None  # what the timer waits for: a key of OWED
        self._waited = self.read_timeout  # how long the timer waits
        self._refused = False  # answered 431 or 503: what the client still sends is dropped
        self._past_cap = False  # connected past cap.limit: its first request is awaited
        self._held_past = False  # in cap.held: awaited, or lingering after a 503
        self._spare = False  # served past cap.limit: counted in cap.spare_used
        self._write_timer: asyncio.TimerHandle | None = None  # while writing is paused
        self._unsent_then = 0  # `_unsent()` as the timer's current period began

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.cap
        if cap.limit is not None and len(self.connections) - cap.spare_used > cap.limit:
            self._connected_past_cap()
            return
        self._arm("headers")

    def _connected_past_cap(self) -> None:
        """`cap.limit` connections are served already: this one is not among them, which the
        cap and the gauge count, unless its first request is the operator's. That request is
        awaited while fewer than `cap.held_most` are held so, for PAST_CAP_HEAD_S; past that
        many, a 503 at once."""
        self.connections.discard(self)
        if len(self.cap.held) >= self.cap.held_most:
            self._refuse_past_cap(linger=False)
            return
        self._hold_past(True)
        self._past_cap = True
        self._arm("headers", min(self.read_timeout, PAST_CAP_HEAD_S))

    def _hold_past(self, held: bool) -> None:
        """Count this connection in `cap.held`, or no longer."""
        if held != self._held_past:
            self._held_past = held
            if held:
                self.cap.held.add(self)
            else:
                self.cap.held.discard(self)

    def _take_spare(self, taken: bool) -> None:
        """Count this connection in `cap.spare_used`, or no longer."""
        if taken != self._spare:
            self._spare = taken
            self.cap.spare_used += 1 if taken else -1

    def _judge_past_cap(self, data: bytes) -> None:
        """A connection past the cap sent `data`: once its first request's line and headers are
        whole, serve it if it is the operator's and `cap.spare` allows, else refuse it. Until
        then it is only buffered (h11 holds it to MAX_HEADER_BYTES, as any request's head)."""
        self.conn.receive_data(data)
        try:
            event = self.conn.peek_event()
        except h11.RemoteProtocolError:  # not HTTP, or a head too large: not the operator's
            event = None
        if event is h11.NEED_DATA:
            return
        self._past_cap = False
        request = event if isinstance(event, h11.Request) else None
        cap = self.cap
        if request is not None and cap.limit is not None and self._under_cap(cap.limit):
            self._serve_freed()
        elif request is not None and operator_target(request.target) and cap.spare_used < cap.spare:
            self._serve_spare(request)
        else:
            self._refuse_past_cap(head_only=request is not None and request.method == b"HEAD")

    def _under_cap(self, limit: int) -> bool:
        """Whether a connection served now would be within `limit` (this one is not counted):
        one served may have closed since this one connected past the cap."""
        return len(self.connections) - self.cap.spare_used < limit

    def _serve_freed(self) -> None:
        """A connection that came past the cap finds room under it as its request arrives (one
        served closed meanwhile): it is served as any, among those the cap counts, rather than
        refused while a new connection would be served."""
        self._hold_past(False)
        self.connections.add(self)
        self.handle_events()
        self._follow_request()

    def _serve_spare(self, request: h11.Request) -> None:
        """Serve the operator's `request` past the cap, as one of `cap.spare`, and close the
        connection once it is answered (its request is handed on with `Connection: close`),
        so that it takes its place among them no longer than that."""
        self._hold_past(False)
        self._take_spare(True)
        self.connections.add(self)
        headers = [*request.headers.raw_items(), (b"connection", b"close")]
        self.conn.peeked = h11.Request(
            method=request.method,
            target=request.target,
            headers=headers,
            http_version=request.http_version,
        )
        self.handle_events()
        self._follow_request()

    def _refuse_past_cap(self, linger: bool = True, head_only: bool = False) -> None:
        """Answer 503, with Retry-After, and end the connection. With `linger`, what the client
        still sends is read and dropped until it hangs up (its request left unread would reset
        the connection, and the client never see the 503), for REFUSED_LINGER_S at most; else
        (PAST_CAP_HELD held already) the connection is closed at once. `head_only`: the
        request was HEAD, whose answer has no body. Once the drain has begun the answer is
        the drain's `shutting_down`, as for any new request then (told to retry here in 5 s,
        the client would find the daemon gone), and it is neither counted nor logged as a
        refusal for the cap."""
        self._past_cap = False
        draining = self.cap.draining()
        body, retry_s = self._drain_refusal() if draining else self._cap_refusal()
        self._send_closing(
            503,
            json.dumps(body).encode(),
            b"application/json",
            [
                (b"retry-after", str(retry_s).encode()),
                (b"x-request-id", new_id("req").encode()),
            ],
            head_only,
        )
        self._refused = True
        if not draining:
            self.cap.on_refused()
            log.warning(PAST_MAX_CONNECTIONS, self.cap.limit)
        if not linger:
            self.transport.abort()
            return
        self.transport.write_eof()  # the client's close then ends the connection
        self._arm("close", REFUSED_LINGER_S)

    def _cap_refusal(self) -> tuple[dict[str, Any], int]:
        """503 `too_many_connections`'s body and Retry-After."""
        message = (
            f"kvguard is serving {self.cap.limit} connections, the most api.max_connections "
            f"allows: this one is closed unserved; retry after {CONNECTIONS_RETRY_S}s or on "
            "another replica"
        )
        body = error_body(message, "service_unavailable", code="too_many_connections")
        return body, CONNECTIONS_RETRY_S

    @staticmethod
    def _drain_refusal() -> tuple[dict[str, Any], int]:
        """The drain's 503 `shutting_down` (what the API answers every new request then): its
        body and Retry-After."""
        from kvguard.daemon.openai_api import shutting_down

        refusal = shutting_down()
        return refusal.body(), max(1, round(refusal.retry_after or 1))

    def drain_began(self) -> None:
        """The drain has begun, this connection held past the cap (ConnectionCap.drain_began)
        and still awaiting its request: answered `shutting_down` now if its request line is
        whole and names no operator's path (it cannot be one served during the drain). Any
        other is left to come whole, as a request past the cap on a new connection then:
        the operator's is served (a scrape, a `kvguard status` in flight at SIGTERM), the
        rest answered `shutting_down` (`_judge_past_cap`); its PAST_CAP_HEAD_S timer, and
        the server's stop (`close_held`), bound the wait."""
        if not self._past_cap or self.transport.is_closing():
            return
        line = request_line(bytes(self.conn.trailing_data[0]))
        if line is not None and not operator_target(line[1]):
            self._refuse_past_cap(head_only=line[0] == b"HEAD")  # no body to a HEAD

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_write_timer()
        self._hold_past(False)
        self._take_spare(False)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport holds more than it may of what the client has not read: from now the
        client has `write_timeout` to read some of it."""
        super().pause_writing()
        if self._write_timer is None:
            self._start_write_period()

    def _start_write_period(self) -> None:
        """A new `write_timeout` within which the client must take some of what is unsent."""
        self._unsent_then = self._unsent()
        self._write_timer = self.loop.call_later(self.write_timeout, self._write_timed_out)

    def _unsent(self) -> int:
        """Bytes of the answer the client has not taken yet: the transport's buffer and the
        socket's send queue (SIOCOUTQ: sent but unacknowledged, or not sent at all; 0 where
        the kernel cannot tell). Reading moves the kernel's queue first: the transport's buffer
        shrinks only once a third of the socket's send buffer is free again, megabytes with
        autotuned buffers, which a slow but steady reader may take longer than a period for."""
        unsent = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        outq = getattr(termios, "TIOCOUTQ", None)
        if sock is not None and outq is not None:
            with contextlib.suppress(OSError, ValueError):
                unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), outq, bytes(4)))[0]
        return unsent

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_write_timer()  # the client read: a slow reader is not a stopped one

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        """A period of `write_timeout` has passed with writing paused. If the client took some
        of its answer meanwhile, it is slow, not stopped: a new period begins. If it took
        nothing, reset the connection. Not a close, which waits for the client to read what
        is buffered; nor a bare abort, whose socket the kernel still keeps, sending to a client
        that reads nothing, which never sees the end. Logged once, then counted a minute at a
        time (logging_setup.BOUNDED): each stalled client would write a line."""
        self._write_timer = None
        if self._unsent() < self._unsent_then:
            self._start_write_period()
            return
        log.warning(NOT_READ, self.write_timeout)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # linger 0: the close drops what is unsent and sends a reset
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._past_cap:
            self._judge_past_cap(data)
            return
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()  # a request the client sent before the answer ended

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 could not parse: 431 where it is headers too long (not
        where a short malformed head came with more than MAX_HEADER_BYTES behind it: a 400)."""
        if getattr(self.conn, "refusal", 400) != 431:
            super().send_400_response(msg)
            return
        self._answer(
            431,
            f"Request header fields too large: the request line and headers may take at most "
            f"{MAX_HEADER_BYTES // 1024} KiB\n",
        )
        self._refused = True
        self.transport.write_eof()  # the client's close then ends the connection
        self._arm("close")

    def _follow_request(self) -> None:
        """Time what the client owes now: its request's headers (once they have begun), or its
        body's next bytes; nothing while it waits for its answer or idles between requests
        (uvicorn's keep-alive timeout)."""
        if self._refused:
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm("body")  # each read: the body may pause, not stop
        elif state is h11.IDLE:
            begun = self._awaiting is not None or bool(self.conn.trailing_data[0])
            if begun and self._awaiting != "headers":
                self._arm("headers")
        else:
            self._disarm()

    def _arm(self, awaiting: str, timeout: float | None = None) -> None:
        """Close the connection unless the client sends what `awaiting` says within `timeout`
        (default: `read_timeout`)."""
        self._disarm()
        self._awaiting = awaiting
        self._waited = self.read_timeout if timeout is None else timeout
        self._read_timer = self.loop.call_later(self._waited, self._timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer, self._awaiting = None, None

    def _timed_out(self) -> None:
        """The timer ran out (`read_timeout`, or a refused connection's REFUSED_LINGER_S) with
        the client still owing what `_awaiting` says: close (not logged above DEBUG: any client
        could write a line each)."""
        awaiting, self._read_timer = self._awaiting, None
        if self.transport.is_closing():
            return
        if awaiting == "body" and self._not_the_clients_pause():
            self._arm("body")
            return
        if awaiting == "headers" and self.conn.trailing_data[0]:
            self._answer(408, f"Request timeout: no whole request within {self._waited:g}s\n")
        owed = self.OWED.get(awaiting or "", awaiting)
        log.debug("closing %s's connection: waited %gs for %s", self.client, self._waited, owed)
        self.transport.close()

    def _not_the_clients_pause(self) -> bool:
        """Whether the body stopped because of the daemon: it holds as much unread as uvicorn
        buffers (the app has not asked for more), or the client waits for its 100 Continue."""
        cycle = self.cycle
        return self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue)

    def _answer(self, status: int, text: str) -> None:
        """A plain-text answer that closes the connection, written before any request is whole."""
        self._send_closing(status, text.encode(), b"text/plain; charset=utf-8")

    def _send_closing(
        self,
        status: int,
        body: bytes,
        content_type: bytes,
        extra: list[tuple[bytes, bytes]] | None = None,
        head_only: bool = False,
    ) -> None:
        """An answer that closes the connection, written before the request is served (before
        it is whole, or in place of serving it). `head_only`: the answer to a HEAD, the same
        headers without the body, and without h11's end of message: h11 knows a request is
        HEAD (and its answer bodiless) only once it has read the request's head, which a
        refusal at the drain's start (`drain_began`) comes before, and it raised there that
        the body declared was missing. The connection ends after this answer either way."""
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            *(extra or []),
            (b"connection", b"close"),
        ]
        head = h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status])
        rest = [] if head_only else [h11.Data(data=body), h11.EndOfMessage()]
        for event in (head, *rest):
            self.transport.write(self.conn.send(event) or b"")


def timed_h11(
    read_timeout: float, write_timeout: float, cap: ConnectionCap | None = None
) -> type[H11Protocol]:
    """The protocol class uvicorn builds each connection with, timing reads at `read_timeout`
    and paused writes at `write_timeout`, and serving `cap.limit` connections at most."""
    settings = {
        "read_timeout": read_timeout,
        "write_timeout": write_timeout,
        "cap": cap or ConnectionCap(),
    }
    return type("TimedH11", (_TimedH11,), settings)


def _report_accept_errors(
    server: uvicorn.Server, on_failure: Callable[[], None] = _nothing
) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """The event loop's exception handler. With no file descriptor left, asyncio's accept loop
    logs each failed accept() with a traceback, retrying until the backlog is empty: some
    10,000 records a second, which buried the journal. One line says so instead, naming the
    fix, and the next are counted once a minute (logging_setup.BOUNDED); each failed accept()
    runs `on_failure` (the metric: the log line alone said nothing to a dashboard or an alert).
    Every other error goes to asyncio's own handler."""

    def handle(aio: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") != ACCEPT_OUT_OF_RESOURCE or not isinstance(exc, OSError):
            aio.default_exception_handler(context)
            return
        on_failure()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.error(NOT_ACCEPTING, exc.strerror or exc, len(server.server_state.connections), soft)

    return handle


def _descriptors_held() -> int:
    """The file descriptors this process holds now (0 where /proc cannot tell)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return 0


def connection_cap(configured: int | None, soft: int, held: int) -> ConnectionCap:
    """The most HTTP connections to serve at once, given the open files limit `soft` and the
    descriptors `held` as the API is about to listen (the model, the audit database and the
    workers are open): api.max_connections, or where it is null the limit less `held` and a
    reserve for what opens later (FD_RESERVE; a quarter of what is left where that is less).
    None where the limit is unbounded. The connections served past it (OPERATOR_SPARE) and
    held past it (PAST_CAP_HELD) take at most a quarter each of what the limit leaves beyond
    the cap. Said in the log either way, with a warning for a cap the limit would not let the
    daemon reach: accepts would fail for want of a descriptor first, each client left
    unanswered."""
    if soft == resource.RLIM_INFINITY:
        return ConnectionCap(configured)
    room = soft - held
    limit = _connection_limit(configured, soft, held)
    beyond = max(room - limit, 0) // 4
    return ConnectionCap(limit, min(OPERATOR_SPARE, beyond), min(PAST_CAP_HELD, beyond))


def _connection_limit(configured: int | None, soft: int, held: int) -> int:
    """`connection_cap`'s limit under a bounded open files limit, logged."""
    room = soft - held
    if configured is None:
        cap = max(1, room - min(FD_RESERVE, room // 4))
        log.info(
            "HTTP connections served at once: at most %d (api.max_connections unset: the open "
            "files limit %d less the %d descriptors held now and %d kept in reserve)",
            cap,
            soft,
            held,
            room - cap,
        )
        return cap
    if configured > room:
        log.warning(
            "api.max_connections is %d, more than the open files limit %d leaves for connections "
            "(%d, with %d descriptors held now): past that, accepts fail and clients get no "
            "answer rather than a 503; lower api.max_connections, or raise LimitNOFILE= "
            "(systemctl edit kvguard)",
            configured,
            soft,
            max(room, 0),
            held,
        )
    log.info("HTTP connections served at once: at most %d (api.max_connections)", configured)
    return configured


def raise_open_files_limit() -> None:
    """The soft limit on open files raised to the hard one: each connection holds a
    descriptor, and the soft default (1024, under systemd too) is kept low for programs that
    still call select(), which kvguard does not (asyncio waits on epoll)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.debug("open files limit: %d, not raised to %d: %s", soft, hard, e)
            return
    log.debug("open files limit: %d (was %d)", hard, soft)


class KnobsNotApplied(RuntimeError):
    """A reload's engine knobs not in force when the reload ends: `outcome` "withdrawn" (the
    engine never took them: nothing changed) or "still_applying" (it took them and had not
    finished: they may yet apply, and are settled when they do; or an earlier reload's were,
    and this one applied nothing). `abandoned`: the daemon began to stop meanwhile, and the
    reload stopped waiting then. `late`: this reload's own knobs, still being applied."""

    def __init__(
        self,
        message: str,
        outcome: str,
        abandoned: bool = False,
        late: LateKnobs | None = None,
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.abandoned = abandoned
        self.late = late


@dataclass(slots=True)
class LateKnobs:
    """A reload's engine knobs the reload stopped waiting for (`Service._knobs_late`), and
    how they ended once the engine finished them: `settled` is None until then, then whether
    they applied and the line that says so (set once, on the engine thread). A failed
    reload's record (/admin/state's `reload_refused`) reads it, so that it says they may
    still apply only while they may."""

    settled: tuple[bool, str] | None = None


class LoadInterrupted(BaseException):
    """SIGINT or SIGTERM while the daemon starts, before serve() takes them over: raised in
    the main thread, by the handler while it waits for the engine to load, else at the start's
    next check (`Service._on_start_signal`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signal.Signals(signum)


class Service:
    def __init__(
        self,
        cfg: DaemonConfig,
        config_path: Path | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        # `kvguard serve`'s flags (apply_overrides' arguments): applied over the file at start
        # and over every file a reload reads, so that a reload keeps --dry-run, --model, ...
        self.overrides: dict[str, Any] = {
            k: v for k, v in (overrides or {}).items() if v is not None
        }
        self.started = int(time.time())
        self.draining = False
        self._reload_lock = threading.Lock()
        # done once the engine has settled knobs a reload stopped waiting for (`_knobs_late`):
        # the next reload waits for it, so that it starts from the config really in force
        self._knobs_settled: Future | None = None
        # set when the stop begins: a reload waiting on the engine gives way at once
        self.stopping = StopSignal()
        # the last reload's refusal (`_refuse_reload`), shown in the STATUS= line and in
        # /admin/state (`kvguard status`): `systemctl reload` only sends SIGHUP and succeeds
        # whatever the file holds, so those are where an operator sees the file was not
        # applied; None after a good reload
        self._reload_refused: dict[str, Any] | None = None
        self._ready = False
        self._listening_now = False  # the API accepts connections: READY=1 may go out
        self.engine: LLMEngine
        self.loop: EngineLoop
        self.nvml = NvmlReader()
        self.metrics: Metrics
        self._stop_watchdog = threading.Event()
        # an engine loop that has not beaten for this long is stalled (`stalled_s`): a test
        # shortens it rather than wait 30 s
        self.stall_after_s = STALL_AFTER_S
        self._stall_logged_at: float | None = None  # the watchdog logged the stall seen then
        self._token_problem_logged = ""  # the admin token problem last logged (`admin_disabled`)
        self._unwatch_gc: Callable[[], None] = lambda: None
        self._watchdog_lock = threading.Lock()
        self.audit: AuditStore | None = None
        self.control: ControlPlane | None = None
        self.api_port: int | None = None  # the bound port (`api.port` 0: the kernel's pick)
        self.exit_code = 0
        # HTTP requests being answered (objects with `cut(message)`): a drain that runs out of
        # time answers each of them at once, even if the engine thread is stalled.
        self.requests: weakref.WeakSet[Any] = weakref.WeakSet()
        self._drain: asyncio.Task[None] | None = None  # held: the loop keeps weak references
        self._cap: ConnectionCap | None = None  # api.max_connections as serve() applies it
        # Set while serve() runs, so that the engine thread can end it after a fatal failure.
        self._aio: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        # HTTP answers begun before the drain and not yet sent whole (app.OpenAnswers.count),
        # and the cut of the requests whose body has not arrived whole (OpenAnswers.cut_uploads)
        self._answering: Callable[[], int] = lambda: 0
        self._cut_uploads: Callable[[], int] = lambda: 0
        self._closed = threading.Event()  # close() finished: the forced exit is not needed
        self._engine_stopped = False
        self._engine_stuck = False  # the drain's aborts timed out: close() waits no more for it
        self.worker_pids: list[int] = []
        self.kv_rank_bytes: list[int] = []  # refreshed on the engine thread when the pool changes
        self._kv_key: tuple[str, int] | None = None
        # None: the OpenAI endpoints are open (api.api_keys_file unset)
        self.api_keys: ApiKeys | None = self._load_keys(cfg)
        self.rules_at_start: RuleSet | None = None  # read_rules(): the control plane's first
        # SIGINT/SIGTERM before serve() takes them over, kept until the start checks for it;
        # raised by the handler itself only while the engine loads (`_on_start_signal`)
        self._start_signal: signal.Signals | None = None
        self._raise_start_signal = False
        # what the control plane's stop left running (a stuck tick): the exit does not wait
        self.left_running: list[str] = []
        # True where the process exits right after close() (`kvguard serve`, see `run`): the
        # startup heap stays frozen (gc_policy). Given back, it only made the interpreter's
        # final collections walk it all: 0.8 s of CPU after the stop with smollm2, 2-3 s of
        # wall time on a busy host, outside every bound the stop keeps. Tests that run several
        # daemons in one process keep the default: each close gives its heap back.
        self.keep_heap_frozen = False
        # what the HTTP app made for itself and ends with the service (`at_close`)
        self._at_close: list[Callable[[], None]] = []

    # -- names ------------------------------------------------------------------------------
    @property
    def engine_model(self) -> str:
        return self.cfg.serving.model

    @property
    def model_name(self) -> str:
        return self.cfg.served_model_name()

    # -- lifecycle --------------------------------------------------------------------------
    def load(self, progress: bool = True) -> None:
        """Load the engine, migrate the audit database, start the control plane; then ready to
        answer (READY=1 waits for the API to listen: see `_listening`). Meanwhile systemd is
        asked for more start time every 30 s (a first start fetches the model; remote ranks may
        take up to their join timeout), within a bound: a hung start is still ended by systemd."""
        limit = sdnotify.EXTEND_LIMIT_S + self.cfg.serving.distributed.join_timeout
        with sdnotify.extending_timeout(limit):
            self._load(progress)
        self._check_start_signal()  # the start's audit rows are queued: its stop row follows
        self._ready = True
        threading.Thread(target=self._watchdog, name="kvguard-watchdog", daemon=True).start()

    def _listening(self) -> None:
        """The API accepts connections: READY=1 and the log's `ready` line now, not when the
        model is loaded (serving starts a second later: a client sent at READY was refused).
        Not after a fatal failure or a stop signal that came first. A reload says READY=1 when
        it ends only from now on (one that ended before said nothing: this is the first)."""
        if self.draining or self.loop.fatal is not None:
            return
        self._listening_now = True
        sdnotify.ready(self._systemd_status())
        log.info("ready: %s", self._status_line())

    def leave_while_loading(self, sig: signal.Signals) -> NoReturn:
        """SIGINT or SIGTERM before serving: nothing is served, so nothing drains. Say so,
        audit the stop if the audit store is up, stop the engine if it is built, and die by the
        signal itself: a shell reports 128 + it (130, 143) and systemd counts a stop during the
        start as clean, as it did before the handler. Never through the interpreter's exit:
        a thread still loading the model (torch, OpenMP) made that abort the process
        ("terminate called without an active exception"). A second signal ends it at once."""
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        self._stop_watchdog.set()
        log.warning("%s: interrupted while loading; exiting", sig.name)
        sdnotify.stopping()
        if self.audit is not None:
            detail = f"exit {128 + sig}: interrupted by {sig.name} while loading"
            self.audit.record_event("daemon_stop", detail=detail)
            self.audit.stop(timeout=2)  # what it cannot write in time goes to its spill file
        loop: EngineLoop | None = getattr(self, "loop", None)  # unset while the engine builds
        if loop is not None:
            loop.stop(timeout=2)
        self.shutdown_engine(timeout=5)
        # a multi-rank start still under way leaves its rendezvous folder (its `finally` will
        # not run); the driver is not imported for that: a start that did not import it has none
        if driver := sys.modules.get("kvguard.engine.distributed.driver"):
            driver.remove_starting_rendezvous()
        logging.shutdown()  # flush the log lines above
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # not reached: the signal's default action ends the process

    def _on_start_signal(self, signum: int, frame: object) -> None:
        """SIGINT/SIGTERM before serve() takes them over. Python runs the handler in the main
        thread wherever that is, and an exception raised there is not always seen: raised in
        a gc callback (the collection of the startup freeze) it was printed and dropped, and
        the daemon went on to serve; raised under pydantic-core (FastAPI's import) it became a
        SchemaError, exit 1. So the signal is kept, and the start ends by it at its next
        check (`_check_start_signal`); only while the main thread just waits for the engine
        to load (minutes, on a first start) is it raised at once."""
        self._start_signal = signal.Signals(signum)
        if self._raise_start_signal:
            raise LoadInterrupted(signum)

    def _check_start_signal(self) -> None:
        if self._start_signal is not None:
            raise LoadInterrupted(self._start_signal)

    @contextlib.contextmanager
    def _interruptible(self) -> Generator[None, None, None]:
        """A start signal ends the block at once (`_on_start_signal`): for a block in which
        the main thread only waits on another one, where no callback can drop the exception
        nor a library wrap it."""
        self._raise_start_signal = True
        try:
            self._check_start_signal()  # after the flag: one that came just before is not missed
            yield
        finally:
            self._raise_start_signal = False

    def _load(self, progress: bool) -> None:
        sdnotify.status(f"loading model {self.engine_model}")
        config = self.cfg.to_engine_config()
        # built on the engine thread, where it steps (see EngineLoop.start)
        loop = EngineLoop()
        # before it starts: a rank lost at once (the idle loop checks them) must still make the
        # daemon exit non-zero, for systemd to restart it
        loop.on_fatal.append(self._on_engine_fatal)
        with self._interruptible():  # built on the engine thread: this thread only waits
            self.loop = loop.start(lambda: LLMEngine.from_config(config, progress=progress))
        self.engine = self.loop.engine
        # the GPUs the engine runs on: the GPU memory rule reads only these (NVML sees the host)
        self.nvml.use_gpus(engine_gpu_ids(self.engine))
        self.worker_pids = _worker_pids(self.engine)
        self._refresh_kv_rank_bytes(self.engine.latest_snapshot)
        self.loop.on_step.append(self._refresh_kv_rank_bytes)
        self.metrics = Metrics(
            lambda: self.engine.latest_snapshot, lambda: self.readiness()[0], self.nvml
        )
        self.metrics.name_keys(self.api_keys)  # each key's series from 0, before its first use
        self._unwatch_gc = gc_policy.watch_pauses(
            lambda gen, s: self.metrics.gc_pause.labels(gen).observe(s)
        )
        self.metrics.registry.register(
            TensorParallelCollector(
                lambda: self.engine.config.tensor_parallel,
                lambda: self.kv_rank_bytes,
                lambda: self.engine.config.pipeline_parallel,
            )
        )
        sdnotify.status("migrating the audit database")
        self.audit = AuditStore(
            self.cfg.audit_url(),
            host=socket.gethostname(),
            spill_dir=state_dir(),
            instance=self.cfg.audit.instance,
        )
        self.audit.start()  # never raises for the database: a bad one leaves audit degraded
        # the version: daemons of several versions may share one audit database (an upgrade)
        detail = f"kvguard {kvguard_version()}, model {self.engine_model}"
        # the pid: a run that ends without its daemon_stop is named by it at the next start
        # (an `unclean_stop` event), to be found in the journal and the kernel log
        self.audit.record_event("daemon_start", detail=detail, data={"pid": os.getpid()})
        self.control = ControlPlane(self)
        self.control.on_tick = self.metrics.rule_tick.observe
        self.metrics.registry.register(
            ControlPlaneCollector(lambda: self.control, lambda: self.audit)
        )
        self.control.start()

    def readiness(self) -> tuple[bool, str]:
        """Ready means requests are served. A degraded audit store does not change that (rows
        queue, then spill at exit), so it stays ready (200) and says so in the reason:
        taking the daemon out of a load balancer for it would turn a logging fault into an
        outage."""
        if not self._ready:
            return False, "loading"
        if self.loop.fatal is not None:
            return False, f"engine failed: {self.loop.fatal}"
        if self.draining:
            return False, "draining"
        if not self.loop.alive:
            return False, "engine loop stopped"
        if self.stalled_s() is not None:
            return False, "engine loop stalled"
        # the engine's own, not its snapshot's: an idle engine's lags an action by a second
        allowed = allowed_name(self.engine.allow_rank)
        if allowed == "none":  # every request answers 503: a load balancer should look elsewhere
            return False, "admission halted for every priority"
        notes = [f"admission halted (allowed: {allowed})"] if allowed else []
        problem = self.audit.problem() if self.audit is not None else None
        notes += [f"audit degraded: {problem}"] if problem else []
        return True, "; ".join(notes) or "ok"

    def stalled_s(self) -> float | None:
        """How long the engine loop has not beaten, once that is past `stall_after_s` (None
        before): the loop is stalled (a step stuck in a kernel, a collective, a lock), and a
        request posted now would wait for it without bound."""
        age = time.monotonic() - self.loop.last_beat
        return age if age > self.stall_after_s else None

    def _status_line(self) -> str:
        s = self.engine.latest_snapshot
        # stopping: every new request gets 503 shutting_down, whatever the remedies say
        adm = "closed" if self.draining else "halted" if s.admission["halted"] else "open"
        return (
            f"running={s.num_running} waiting={s.num_waiting} swapped={s.num_swapped} "
            f"kv={s.kv_cache_usage_ratio:.0%} dtype={s.kv_cache_dtype} admission={adm}"
        )

    def _systemd_status(self) -> str:
        """The STATUS= line: `_status_line`, after the last reload's refusal while it stands
        (a refused reload still ends in READY=1, so nothing else tells systemd of it)."""
        record = self._reload_record()
        if record is None:
            return self._status_line()
        refused, _, errors = record
        problem = _reload_problem(refused["outcome"], errors, refused["at"])
        return f"{problem}; {self._status_line()}"

    def _refuse_reload(
        self, outcome: str, errors: list[str], late: LateKnobs | None = None
    ) -> None:
        """A reload that applied nothing (`outcome`: "refused", or "failed" where the engine
        did not take its knobs or the reload raised), or, where `late` is given, nothing but
        the engine knobs it stopped waiting for, which may still apply: said by the STATUS=
        line and /admin/state until a reload applies."""
        self._reload_refused = {
            "outcome": outcome,
            "at": utcnow(),
            "errors": list(errors),
            "late": late,
        }

    def _reload_record(self) -> tuple[dict[str, Any], str | None, list[str]] | None:
        """The last reload's record while it stands, with what of its file is in force:
        `knobs` None (nothing), "still_applying" (its engine knobs may still apply) or
        "applied_late" (they did, after the reload had stopped waiting), and the problems as
        they stand (once the knobs settled, the line saying how, in place of the reload's
        own, which said they might still apply)."""
        refused = self._reload_refused
        if refused is None:
            return None
        late: LateKnobs | None = refused["late"]
        if late is None:
            return refused, None, refused["errors"]
        if late.settled is None:
            return refused, "still_applying", refused["errors"]
        applied, line = late.settled
        return refused, "applied_late" if applied else None, [line]

    def _watchdog(self) -> None:
        """Ping systemd only while the engine loop beats: a stalled loop stops the pings, and
        systemd aborts the daemon (SIGABRT) one watchdog interval after the last one."""
        interval = sdnotify.watchdog_interval()
        period = interval / 3 if interval else 2.0
        last_ping = time.monotonic()
        while not self._stop_watchdog.wait(period):
            with self._watchdog_lock:  # see _silence_watchdog
                if self._stop_watchdog.is_set():
                    return
                now = time.monotonic()
                beat_age = now - self.loop.last_beat
                if interval and beat_age < interval / 2:
                    sdnotify.watchdog()
                    last_ping = now
                kill_in = last_ping + interval - now if interval else None
                self._log_stall(beat_age, interval, kill_in)
                sdnotify.status(
                    self._systemd_status()
                    if beat_age < period * 2
                    else f"engine loop stalled {beat_age:.0f}s"
                )

    def _stalled_for_the_log(self, beat_age: float, interval: float | None) -> bool:
        """Whether the stall WARNING is due: past `stall_after_s` (the 503s' threshold), or
        under systemd's watchdog as soon as the pings stop (half its `interval`), if that comes
        first. At the shipped WatchdogSec=30s, equal to the 30 s threshold, the WARNING was
        often due at the very tick systemd's SIGABRT came, and the journal never named the
        stuck step; now it comes at the first tick without a ping, 2/3 of an interval before
        the abort."""
        if beat_age > self.stall_after_s:
            return True
        return interval is not None and beat_age >= interval / 2  # the pings have stopped

    def _log_stall(self, beat_age: float, interval: float | None, kill_in: float | None) -> None:
        """One WARNING when the engine loop is first seen stalled (`_stalled_for_the_log`),
        naming where its thread is, and one INFO when it beats again: without them a stall left
        nothing in the journal (systemd's STATUS= line is not kept), where the runbook sends
        on-call for the step that hung. The watchdog thread's, every period; `interval`:
        systemd's watchdog interval and `kill_in` how long it still waits for a ping (None
        without one)."""
        now = time.monotonic()
        stalled = self._stalled_for_the_log(beat_age, interval)
        if stalled and self._stall_logged_at is None:
            self._stall_logged_at = now - beat_age
            thread = self.loop.thread
            log.warning(
                "engine loop has not beaten for %.0fs (%s): %s",
                beat_age,
                _where(thread) if thread is not None else "no engine thread",
                self._stall_outcome(beat_age, interval, kill_in),
            )
        elif not stalled and self._stall_logged_at is not None:
            log.info(
                "engine loop beats again after a stall of about %.0fs: ready, taking requests",
                now - self._stall_logged_at,
            )
            self._stall_logged_at = None

    def _stall_outcome(self, beat_age: float, interval: float | None, kill_in: float | None) -> str:
        """What the stall WARNING says follows: the 503s (now, or from `stall_after_s`), and
        systemd's restart while the loop stays stalled."""
        if beat_age > self.stall_after_s:
            refusing = "not ready, new requests answer 503 engine_stalled until it beats again"
        else:
            refusing = (
                f"new requests answer 503 engine_stalled once it has not beaten for "
                f"{self.stall_after_s:g}s"
            )
        if not interval or kill_in is None:
            return f"{refusing} (no systemd watchdog: nothing restarts a loop that stays stalled)"
        if beat_age < interval / 2:  # still pinging: a stall threshold below the pings' own
            return f"{refusing}; systemd's watchdog restarts the daemon if it stays stalled"
        return (
            f"{refusing}; watchdog pings stopped: unless it beats again, systemd aborts the "
            f"daemon in about {max(kill_in, 0.0):.0f}s, writing every thread's stack to stderr "
            f"(the journal), and restarts it"
        )

    def _silence_watchdog(self) -> None:
        """Stop the pings for good; once this returns, none is sent, not even one the watchdog
        thread was about to send, so a failure's STATUS= line is the last word systemd gets."""
        with self._watchdog_lock:
            self._stop_watchdog.set()

    def _refresh_kv_rank_bytes(self, snap: EngineSnapshot) -> None:
        """Each rank's KV pool bytes, for the metrics (engine thread: the pool is the engine's).
        Recomputed only when the pool changed (dtype switch, resize), not on every step."""
        key = (snap.kv_cache_dtype, snap.device.blocks_total)
        if key != self._kv_key:
            self.kv_rank_bytes = _kv_bytes_per_rank(self.engine)
            self._kv_key = key

    def _on_engine_fatal(self, error: BaseException) -> None:
        """The engine cannot step again (a rank died or hung; the loop has already ended every
        in-flight request with an error and refuses new work). Say why, stop the watchdog pings
        and exit non-zero: systemd restarts the whole service, the one way to get all ranks back
        in step. Engine thread; the HTTP side is ended on the event loop."""
        if self.draining:  # asked to stop (its workers may be stopping first): the exit stays
            log.error("engine failed while the daemon was stopping: %s", error)
        else:
            self.exit_code = FATAL_EXIT_CODE
            log.error(
                "engine failed for good: %s; not ready, answering 503 and exiting with status %d "
                "so that systemd restarts the service",
                error,
                FATAL_EXIT_CODE,
            )
        self._silence_watchdog()
        sdnotify.status(f"engine failed: {error}")
        if self.audit is not None:
            self.audit.record_event(
                "engine_failure",
                detail=str(error),
                data=_failure_data(error),
                incident=self._incident,  # the failure ends it: its timeline says so
            )
        aio, server = self._aio, self._server
        if aio is not None and server is not None:  # else serve() has yet to start: it checks
            self._begin_exit(aio, server)

    def _begin_exit(self, aio: asyncio.AbstractEventLoop, server: uvicorn.Server) -> None:
        """End serve() from any thread, and make sure the process goes even if that stalls."""
        with contextlib.suppress(RuntimeError):  # the event loop already closed: serve() is over
            aio.call_soon_threadsafe(self._stop_serving, server)
        threading.Thread(target=self._exit_by_deadline, name="kvguard-exit", daemon=True).start()

    def _stop_serving(self, server: uvicorn.Server) -> None:
        """End serve(): uvicorn stops accepting and lets the answers already decided go out."""
        sdnotify.stopping()
        server.should_exit = True

    def _exit_by_deadline(self) -> None:
        """The orderly exit after a fatal failure is bounded: a stuck connection, audit write or
        worker must not keep a daemon that serves nothing from being restarted."""
        if self._closed.wait(FATAL_EXIT_DEADLINE_S):
            return
        log.error("orderly exit did not finish within %gs; exiting now", FATAL_EXIT_DEADLINE_S)
        self._exit_now(f"engine failed: {self.loop.fatal}")

    async def serve(self, sock: socket.socket | None = None) -> int:
        """Serve HTTP until stopped: on `sock` (bound by `bind_api`), or on api.host:port."""
        from kvguard.daemon.app import create_app

        app = create_app(self)
        answers = app.state.open_answers
        self._answering = lambda: answers.count
        self._cut_uploads = answers.cut_uploads
        cap = self._connection_cap()
        config = uvicorn.Config(
            app,
            host=self.cfg.api.host,
            port=self.cfg.api.port,
            # no logging set-up of uvicorn's own: its lines take kvguard's format and level
            log_config=None,
            log_level=None,
            lifespan="off",
            # kvguard serves no websockets: a request asking to upgrade is answered as plain
            # HTTP, whatever websocket library happens to be installed
            ws="none",
            access_log=False,
            timeout_graceful_shutdown=CUT_GRACE_S,  # counted from the end of the cut
            http=timed_h11(
                self.cfg.api.request_read_timeout,
                self.cfg.api.response_write_timeout,
                cap,
            ),  # its h11 connections hold each request's head to MAX_HEADER_BYTES
        )
        server = _Server(config, on_listening=self._listening, cap=cap)
        self.metrics.http_connections.set_function(lambda: len(server.server_state.connections))
        gc_policy.freeze_startup_heap()  # everything long-lived exists now (see gc_policy)
        aio = asyncio.get_running_loop()
        aio.set_exception_handler(
            _report_accept_errors(server, self.metrics.http_accept_failures.inc)
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            aio.add_signal_handler(sig, self._on_stop_signal, sig, server)
        aio.add_signal_handler(signal.SIGHUP, self._on_sighup, aio)
        # one that came before these handlers (during the app's import or the freeze) was kept
        # by the start's: the start ends by it, as it would have while loading
        self._check_start_signal()
        self._aio, self._server = aio, server
        if self.loop.fatal is not None:  # failed since loading: the hook found no server
            self._begin_exit(aio, server)
        try:
            await server.serve(sockets=None if sock is None else [sock])
        finally:
            self.close()
        return self.exit_code

    def _connection_cap(self) -> ConnectionCap:
        """api.max_connections as the API applies it (read at start only), its refusals
        counted and the cap exported."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        cap = connection_cap(self.cfg.api.max_connections, soft, _descriptors_held())
        cap.on_refused = self.metrics.http_connections_refused.inc
        cap.draining = lambda: self.draining
        self._cap = cap
        self.metrics.http_connections_max.set(float("inf") if cap.limit is None else cap.limit)
        return cap

    def _on_sighup(self, aio: asyncio.AbstractEventLoop) -> None:
        """SIGHUP while serving: a reload on a worker thread; none once the stop has begun
        (logged): the stop must not wait on a reload."""
        if self.draining:
            log.warning("SIGHUP ignored: the daemon is stopping (no reload once the stop began)")
            return
        aio.run_in_executor(None, self.reload)

    def _on_stop_signal(self, sig: signal.Signals, server: uvicorn.Server) -> None:
        """The first SIGTERM/SIGINT drains; a second one during the drain means the operator
        will not wait for it: exit at once, non-zero (128 + the signal, as a shell reports a
        death by that signal), so that systemd and scripts see the cut was forced."""
        if not self.draining:
            self._drain = asyncio.get_running_loop().create_task(self.shutdown(server))
            return
        if self._closed.is_set():  # the stop is done (its row written, the audit stopped):
            # one that came while close() ran is seen only now, as the loop winds down
            log.info("%s after the stop finished: nothing left to cut", signal.Signals(sig).name)
            return
        code = 128 + int(sig)
        cut = self.loop.in_flight()
        log.warning(
            "second %s during the drain: exiting now with status %d, cutting %d in-flight requests",
            signal.Signals(sig).name,
            code,
            cut,
        )
        self.exit_code = code
        self._exit_now(f"forced by a second {signal.Signals(sig).name}: {cut} requests cut")

    def _exit_now(self, why: str) -> None:
        """Leave without waiting for requests, the engine or connections: only the audit gets
        a short, bounded chance to write (or spill) what it holds."""
        self._stop_watchdog.set()
        self.stopping.set()
        sdnotify.status(f"exiting: {why}")
        if self.audit is not None:
            if self.control is not None:
                self.control.record_pending()  # an OOM whose evaluation has not run yet
            self.audit.record_event(
                "daemon_stop", detail=f"exit {self.exit_code}: {why}", incident=self._incident
            )
            self.audit.stop(timeout=2)
        # no step may run against workers being stopped: it would fail as a dead rank would
        self.loop.stop(timeout=2)
        self.shutdown_engine(timeout=5)
        logging.shutdown()  # flush the log lines above
        os._exit(self.exit_code)

    async def shutdown(self, server: uvicorn.Server) -> None:
        """Stop admitting (503), let in-flight requests finish, and their answers reach their
        clients, up to drain_timeout, then cut the rest: each gets a 503 (or an SSE error
        event) saying the daemon is shutting down, never a response that looks complete; an
        answer still being sent then gets CUT_GRACE_S (uvicorn's graceful shutdown). Exits
        0: the drain did what it promises."""
        if self.draining:
            return
        self.draining = True
        self.stopping.set()  # a reload under way is abandoned: it waits on the engine no more
        if self._cap is not None:  # those past the cap asking the API: refused now
            self._cap.drain_began()
        sdnotify.stopping_within(stop_budget_s(self.cfg.api.drain_timeout))
        deadline = time.monotonic() + self.cfg.api.drain_timeout
        log.info(  # both: the drain waits for each, and a stalled reader holds it to the end
            "draining %d in-flight requests and %d answers being sent (up to %.0fs)",
            self.loop.in_flight(),
            self._answering(),
            self.cfg.api.drain_timeout,
        )
        # the engine's requests, and the answers still being sent of those it has finished
        # (a slow client reading a long one): both are in flight for the client. A request
        # whose body is still arriving is not waited for: it cannot be admitted once the body
        # is whole (the drain refuses new work), and a client that stalls sending it would
        # hold the stop until the deadline; it is cut with the rest
        while (self.loop.in_flight() or self._answering()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if uploading := self._cut_uploads():
            log.warning(
                "drain: cutting %d requests whose body had not arrived whole (clients get 503)",
                uploading,
            )
        left = self.loop.in_flight()
        if left:
            await self._cut_all(left)
        elif sending := self._answering():
            log.warning(
                "drain timeout after %gs: %d answers still being sent get %gs more, then are cut",
                self.cfg.api.drain_timeout,
                sending,
                CUT_GRACE_S,
            )
        server.should_exit = True

    async def _cut_all(self, left: int) -> None:
        """Answer every unfinished request now (HTTP side), then have the engine abort them and
        free their blocks; a stalled engine delays the exit by CUT_GRACE_S at most, and is
        not waited for again (close)."""
        from kvguard.daemon.openai_api import DRAIN_CUT_MESSAGE

        log.warning(
            "drain timeout after %gs: cutting %d unfinished requests (clients get 503)",
            self.cfg.api.drain_timeout,
            left,
        )
        for req in list(self.requests):
            req.cut(DRAIN_CUT_MESSAGE)
        deadline = time.monotonic() + CUT_GRACE_S  # for the aborts and their outputs together
        aborted = self.loop.call(self._abort_all)
        try:
            await asyncio.wait_for(asyncio.wrap_future(aborted), CUT_GRACE_S)
        except TimeoutError:
            self._engine_stuck = True
            log.error("engine did not apply the aborts within %gs; exiting anyway", CUT_GRACE_S)
            return
        except EngineUnavailable:  # it failed meanwhile: it answered its requests already
            return
        while self.loop.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the aborts' outputs reach their requests at the next step

    def _abort_all(self) -> int:
        ids = list(self.loop._streams)
        for rid in ids:
            self.engine.abort(rid)
        return len(ids)

    def at_close(self, release: Callable[[], None]) -> None:
        """`release` runs as the service closes: the workers the HTTP app made for itself (the
        grammar compiles) end with the service, not at the interpreter's exit."""
        self._at_close.append(release)

    def close(self) -> None:
        if self._closed.is_set():  # closed already (serve() ended, then its caller's close)
            return
        self.draining = True  # whatever ended serving: from here no reload, no new request
        for release in self._at_close:  # the compiles still queued never run
            release()
        self.stopping.set()  # a reload still waiting on the engine gives way (see `_reload`)
        self._stop_watchdog.set()
        self._unwatch_gc()
        if not self.keep_heap_frozen:
            gc_policy.unfreeze()
        incident = self._incident  # the stop closes it: the stop's event is in its timeline
        deadline = time.monotonic() + CLOSE_BUDGET_S  # see STOP_AFTER_DRAIN_S
        workers_by = deadline - AUDIT_STOP_MIN_S  # the audit's share is kept for it
        loop_by = workers_by - STUCK_ENGINE_WAIT_S  # and the workers' least

        def left(until: float, least: float) -> float:
            return max(until - time.monotonic(), least)

        # a reload under way, abandoned (`stopping`), records why it ended: queued before the
        # stop's own row and the audit's stop (it waits on nothing now: a moment, not more)
        if self._reload_lock.acquire(timeout=STUCK_ENGINE_WAIT_S):
            self._reload_lock.release()
        # An engine known stuck (the drain's aborts timed out, or no heartbeat for CUT_GRACE_S)
        # is not waited for again: its loop is stopped first, briefly, which also refuses what
        # the rules posted to it, so that an evaluation waiting on that ends now
        stuck = self._engine_stuck or time.monotonic() - self.loop.last_beat > CUT_GRACE_S
        if stuck:
            self.loop.stop(timeout=STUCK_ENGINE_WAIT_S)
        if self.control is not None:  # bounded: what it leaves running is logged, not waited for
            self.left_running = self.control.stop()
        if self.audit is not None:  # queued before the engine waits: written meanwhile
            self.audit.record_event(
                "daemon_stop",
                detail=f"exit {self.exit_code}",
                incident=incident,
                time=self._stop_time(incident),
            )
        if not stuck:
            self.loop.stop(timeout=left(loop_by, STUCK_ENGINE_WAIT_S))
        self.shutdown_engine(timeout=left(workers_by, STUCK_ENGINE_WAIT_S))
        if self.audit is not None:  # logs what it could not write and where it saved it
            self.audit.stop(timeout=left(deadline, AUDIT_STOP_MIN_S))
        if self.exit_code:
            log.error("exiting with status %d", self.exit_code)
        self._closed.set()

    def shutdown_engine(self, timeout: float = ENGINE_SHUTDOWN_S) -> None:
        """Stop the engine's worker processes, once, on every way out: no worker may outlive
        the daemon. Bounded, on a helper thread: a stuck rank must not hold the exit (the
        workers also leave by themselves once the daemon is gone)."""
        engine = getattr(self, "engine", None)
        if engine is None or self._engine_stopped:
            return
        self._engine_stopped = True
        t = threading.Thread(target=engine.shutdown, name="kvguard-engine-stop", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            log.error("engine workers not stopped after %gs; %s", timeout, self.worker_pids)

    # -- operations -------------------------------------------------------------------------
    def _sighup_before_serving(self, signum: int, frame: object) -> None:
        """SIGHUP before the event loop handles it: ignored while loading; in the moment
        between the end of loading and serving, reloaded on a thread (a signal handler must not
        block). That reload says neither RELOADING=1 nor READY=1 while the API does not listen
        yet: READY=1 goes out once it does (`_listening`), never before."""
        if not self._ready:
            log.warning("reload ignored: not ready yet (SIGHUP during start-up)")
            return
        threading.Thread(target=self.reload, name="kvguard-reload", daemon=True).start()

    def reload(self) -> dict[str, Any]:
        """Re-read the config file; a bad file keeps the running config and says why. One at a
        time (SIGHUP and POST /admin/reload may come together: each compares the file with the
        config in force and must see the other's result), and none once the drain has begun
        (the engine is on its way out: a reload would wait on it, and say READY after
        STOPPING); a stop that begins during one ends its waits on the engine at once
        (`stopping`): the reload is abandoned, and audited so."""
        if self.draining:  # not even behind a reload under way (it is being abandoned)
            log.warning("reload refused: shutting down")
            return {"reloaded": False, "reason": "shutting down: reloads are refused"}
        with self._reload_lock:
            if self.draining:
                log.warning("reload refused: shutting down")
                return {"reloaded": False, "reason": "shutting down: reloads are refused"}
            return self._reload()

    def _reload(self) -> dict[str, Any]:
        # Before the API listens systemd has had no READY=1 yet, and the first one comes from
        # `_listening`: a reload in that moment (SIGHUP) tells it nothing.
        if self._listening_now:
            sdnotify.reloading()
        try:
            busy = self._knobs_settled  # an earlier reload's knobs, still being applied
            if busy is not None and not wait_or_stop(busy, RECONFIGURE_TIMEOUT_S, self.stopping):
                stopped = self.stopping.is_set()
                raise KnobsNotApplied(
                    "the daemon began to stop while this reload waited for the engine to finish "
                    "the knobs of an earlier reload: abandoned, nothing of the file was applied"
                    if stopped
                    else "the engine is still applying the knobs of an earlier reload (the log "
                    "says when it has finished): nothing of the file was applied; reload again "
                    "then",
                    "still_applying",
                    abandoned=stopped,
                )
            # started without --config: the built-in defaults stand in for the file, so the
            # rules file (the packaged default) and the flags are read again all the same
            new = apply_overrides(load_config(self.config_path), **self.overrides)
            # what a start refuses (the engine's cross-key checks, unreadable rules or keys
            # file), a reload refuses, with the same lines: else the next restart would fail
            new.check_start(self._device_in_force)  # its live knobs apply to the running engine
            for line in inert_keys(new):  # as at start: a reload does not act on them either
                log.warning("%s", line)
            log_stop_budget(new)
            conflicts = live_conflicts(self.cfg, new) + model_conflicts(self.cfg, new, self.engine)
            if conflicts:  # nothing applied yet: the reload is refused whole
                raise ConfigFileError(conflicts)
            keys = self._load_keys(new)  # a bad keys file refuses the reload like a bad config
            # the engine takes new knobs once the rules file is known good, and its change is
            # all or nothing, so a refused reload has changed nothing
            applied: list[tuple[dict[str, Any], list[str]]] = []
            # the reload's audit row is timed when the rules are swapped in: the actions the
            # swap causes (an alert rule acting again, an undo by trigger `reload`) come after
            # it in the timeline, though recorded before the reload has finished
            installed: list[datetime] = []

            def before_install() -> None:
                applied.append(self._apply_reloadable(new))
                installed.append(utcnow())

            rules = (
                self.control.reload(new.rules.path, new.rules.dry_run, before_install)
                if self.control
                else {}
            )
            if rules.get("rules_reloaded") is False:
                log.error(
                    "reload refused, keeping the running rules: %s", "; ".join(rules["errors"])
                )
                self._refuse_reload("refused", rules["errors"])
                return {"reloaded": False, "reason": "\n".join(rules["errors"])}
            changes, restart = applied[0] if applied else self._apply_reloadable(new)
            changes.update(rules.pop("prometheus_changed", {}))  # PromQL signals' new client
            if restart:
                log.warning(
                    "reload: %s changed in the file and take%s effect at the next restart",
                    ", ".join(restart),
                    "s" if len(restart) == 1 else "",
                )
            if keys != self.api_keys:
                changes["api.api_keys_file"] = (
                    None if keys is None else f"{keys.path} ({len(keys)} keys)"
                )
            self.api_keys = keys
            self.metrics.name_keys(keys)  # a new key's series from 0, as at the start
            if "rules.dry_run" in changes:  # a daemon whose rules start (or stop) acting for real
                log.warning(
                    "reload: rules.dry_run is now %s: %s",
                    str(changes["rules.dry_run"]).lower(),
                    "rules record what they would do and change nothing"
                    if changes["rules.dry_run"]
                    else "rules act for real",
                )
            self.warn_admin_token()
            self.warn_open_api()
            said = [str(changes)] if changes else []
            if rules.get("rules_changed"):
                said.append("rules " + " ".join(rules["rules_changed"]))
            log.info("reloaded %s: %s", self._config_name, "; ".join(said) or "no changes")
            self.audit.record_event(
                "reload",
                detail=self._config_name,
                # the keys waiting for a restart too: until then the daemon runs what the file
                # no longer says (another audit.url: `kvguard audit --config` reads elsewhere)
                data={"changes": changes, "restart_needed": restart, **rules},
                incident=self._incident,
                time=installed[0] if installed else None,
            )
            self._reload_refused = None
            return {"reloaded": True, "changes": changes, "restart_needed": restart, **rules}
        except KnobsNotApplied as e:  # the engine did not take them, or has not finished
            if e.abandoned:  # the stop began: it must not wait on a reload
                log.warning("reload abandoned: the daemon is stopping: %s", e)
                self.audit.record_event(
                    "config_error",
                    detail=f"reload abandoned at the stop: {self._config_name}",
                    data={"errors": [str(e)], "engine": e.outcome, "abandoned": True},
                    incident=self._incident,
                )
                return {"reloaded": False, "reason": str(e), "engine": e.outcome}
            if e.outcome == "withdrawn":
                log.error("reload failed, keeping the running config and rules: %s", e)
            else:
                log.error(
                    "reload failed, keeping the running rules and the rest of the config: %s", e
                )
            self.audit.record_event(
                "config_error",
                detail=f"reload failed: {self._config_name}",
                data={"errors": [str(e)], "engine": e.outcome},
                incident=self._incident,
            )
            self._refuse_reload("failed", [str(e)], e.late)
            return {"reloaded": False, "reason": str(e), "engine": e.outcome}
        except ConfigFileError as e:  # a KeysFileError too
            log.error("reload refused, keeping the running config: %s", e)
            self.audit.record_event(
                "config_error",
                detail=f"reload refused: {self._config_name}",
                data={"errors": e.errors},
                incident=self._incident,
            )
            self._refuse_reload("refused", e.errors)
            return {"reloaded": False, "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - a reload must never take the daemon down
            log.exception("reload failed, keeping the running config and rules")
            self.audit.record_event(
                "config_error",
                detail=f"reload failed: {self._config_name}",
                data={"errors": [f"{type(e).__name__}: {e}"]},
                incident=self._incident,
            )
            self._refuse_reload("failed", [f"{type(e).__name__}: {e}"])
            return {"reloaded": False, "reason": f"{type(e).__name__}: {e}"}
        finally:
            # not once a stop began meanwhile (a reload may wait on the engine for a minute):
            # READY=1 after STOPPING=1 would tell systemd the daemon serves again
            if self._listening_now and not self.draining:
                sdnotify.ready(self._systemd_status())

    @property
    def _incident(self) -> str | None:
        """The incident open now, if any: the daemon's own events during it (an engine failure,
        a reload, its stop) are tagged with it, as the control plane tags the engine's, so that
        `kvguard audit timeline` tells the whole of it."""
        return self.control.evaluator.incident if self.control is not None else None

    def _stop_time(self, incident: str | None) -> datetime:
        """The time of the stop's `daemon_stop` row: now, or, where the stop (or an undo just
        before it) closed `incident`, which the row carries, that incident's closing time, so
        that the row lies inside it (after its other rows, at its end), not just after."""
        now = utcnow()
        closed = self.control.evaluator.last_closed if self.control is not None else None
        if incident is not None and closed is not None and closed[0] == incident:
            return min(now, closed[1])
        return now

    @property
    def _config_name(self) -> str:
        """The config file a reload reads, as logs and the audit name it."""
        if self.config_path is None:
            return f"the built-in defaults (started without --config), rules {rules_file(None)}"
        return str(self.config_path)

    @property
    def _device_in_force(self) -> str:
        """The device the running engine uses (`auto` as it resolved at the start): a reload
        resolves automatic values for it, as serving.device changes only at a restart."""
        engine = getattr(self, "engine", None)  # set once the model is loaded
        device = getattr(getattr(engine, "runner", None), "device", None)
        return str(device) if device is not None else self.cfg.serving.device

    def _apply_reloadable(self, new: DaemonConfig) -> tuple[dict[str, Any], list[str]]:
        """Take what can change without a restart: timeouts, rules, Prometheus, API keys, the
        chat API's special-token policy and
        the engine knobs declared live (batch limits, the step budget, admission control, the
        CPU KV budget), applied to the running engine; (what changed, what changed in the file
        but waits for a restart). `self.cfg` stays what is in force."""
        changes: dict[str, Any] = {}
        if new.api.drain_timeout != self.cfg.api.drain_timeout:
            changes["api.drain_timeout"] = new.api.drain_timeout
        if new.api.special_tokens_in_messages != self.cfg.api.special_tokens_in_messages:
            changes["api.special_tokens_in_messages"] = new.api.special_tokens_in_messages
        if new.rules.dry_run != self.cfg.rules.dry_run:  # the control plane takes it with the rules
            changes["rules.dry_run"] = new.rules.dry_run
        device = self._device_in_force  # a new serving.device waits for the restart
        live, restart = engine_changes(self.cfg, new, device)
        if live:
            values = {k.path: k.to_engine(new.knob_value(k, device)) for k in live}
            res = self._reconfigure(values, new, live)
            if not res.ok:  # the engine changed nothing
                raise ConfigFileError([f"{self._config_name}: {res.detail}"])
            changes |= _knob_changes(new, live, device)
        cfg = _with_knobs(self.cfg, new, live)
        api = cfg.api.model_copy(
            update={
                "drain_timeout": new.api.drain_timeout,
                "api_keys_file": new.api.api_keys_file,
                "special_tokens_in_messages": new.api.special_tokens_in_messages,
            }
        )
        self.cfg = cfg.model_copy(
            update={"api": api, "rules": new.rules, "prometheus": new.prometheus}
        )
        return changes, restart

    def _reconfigure(
        self, values: dict[KnobPath, Any], new: DaemonConfig, live: list[KnobField]
    ) -> ActionResult:
        """The engine's result of taking a reload's knobs, waited for as a rule's action is
        (`await_action`): not taken within RECONFIGURE_TIMEOUT_S, they are withdrawn (they
        never apply: keeping the running config is the truth); taken, their result is waited
        for as long again. They used to stay in the mailbox after the wait ran out and apply
        later, the daemon's config and answer saying otherwise. One the engine is still inside
        then is settled when it finishes (`_knobs_late`); either way KnobsNotApplied says so."""
        fut = self.engine.reconfigure(values)
        names = ", ".join(_knob_changes(new, live, self._device_in_force))
        try:
            return await_action(fut, "reconfigure", RECONFIGURE_TIMEOUT_S, self.stopping)
        except ActionWithdrawn as e:
            if e.stopped:
                raise KnobsNotApplied(
                    f"the daemon began to stop before the engine took {names}: withdrawn, "
                    "nothing changed",
                    "withdrawn",
                    abandoned=True,
                ) from e
            raise KnobsNotApplied(
                f"the engine did not take {names} within {RECONFIGURE_TIMEOUT_S:g}s (a long "
                "step or a stalled engine thread): withdrawn, nothing changed",
                "withdrawn",
            ) from e
        except ActionStillApplying as e:
            late = self._knobs_late(e.future, new, live)
            if e.stopped:
                raise KnobsNotApplied(
                    f"the daemon began to stop while the engine was applying {names}: not "
                    "waited for (they may still apply: the log says so if they do); nothing "
                    "else of the file was applied",
                    "still_applying",
                    abandoned=True,
                ) from e
            raise KnobsNotApplied(
                f"the engine took {names} but had not finished applying them "
                f"{RECONFIGURE_TIMEOUT_S:g}s later: they may still apply, and the log and the "
                "audit log say so when they do; nothing else of the file was applied (rules, "
                "keys, timeouts kept): reload again once they have",
                "still_applying",
                late=late,
            ) from e

    def _knobs_late(self, fut: Future, new: DaemonConfig, live: list[KnobField]) -> LateKnobs:
        """Knobs a reload stopped waiting for, settled when the engine finishes them: the
        config in force takes them if they applied (so that `self.cfg`, /admin/state and the
        next reload's comparison say what the engine runs), and the log, the audit log and
        the failed reload's record (the LateKnobs returned) say how it ended. The next
        reload waits for this first."""
        settled: Future = Future()
        self._knobs_settled = settled
        late = LateKnobs()
        knobs = _knob_changes(new, live, self._device_in_force)
        names = ", ".join(f"{k}={v}" for k, v in knobs.items())
        rest = f"nothing else of {self._config_name} was applied"

        def done(f: Future) -> None:  # on the engine thread, as the command finishes
            try:
                err = None if f.cancelled() else f.exception()
                if f.cancelled() or err is not None:
                    why = "withdrawn" if f.cancelled() else f"{type(err).__name__}: {err}"
                    log.error("reload: the knobs the engine was applying failed (%s)", why)
                    self._audit_late("config_error", {"errors": [why]})
                    late.settled = (False, f"the engine did not apply {names} ({why}); {rest}")
                elif not f.result().ok:
                    detail = f.result().detail
                    log.error("reload: the engine refused %s late: %s", names, detail)
                    self._audit_late("config_error", {"errors": [detail]})
                    late.settled = (False, f"the engine refused {names} late: {detail}; {rest}")
                else:
                    self.cfg = _with_knobs(self.cfg, new, live)
                    late.settled = (
                        True,
                        f"the engine finished applying {names} at "
                        f"{utcnow():%Y-%m-%dT%H:%M:%SZ}, after the reload had stopped waiting: "
                        f"they are in force; {rest} (rules, keys, timeouts kept): reload again "
                        "to apply it",
                    )
                    log.warning(
                        "reload: the engine finished applying %s after the reload had stopped "
                        "waiting; they are in force (nothing else of %s was applied: reload "
                        "again to apply it)",
                        names,
                        self._config_name,
                    )
                    self._audit_late("reload", {"changes": knobs, "late": True})
            finally:
                settled.set_result(None)

        fut.add_done_callback(done)
        return late

    def _audit_late(self, kind: str, data: dict[str, Any]) -> None:
        if self.audit is not None:
            detail = f"reload's engine knobs settled late: {self._config_name}"
            self.audit.record_event(kind, detail=detail, data=data, incident=self._incident)

    def read_rules(self) -> None:
        """Read the rules file now, before the port is bound and the model loaded, so that a
        missing or broken one stops the start at once; the control plane starts with it."""
        self.rules_at_start = load_rules(rules_file(self.cfg.rules.path))

    @staticmethod
    def _load_keys(cfg: DaemonConfig) -> ApiKeys | None:
        path = cfg.api.api_keys_file
        return None if path is None else load_keys(path)

    def admin_token(self) -> str | None:
        return self.admin_token_status()[0]

    def admin_token_status(self) -> tuple[str | None, str]:
        """(the admin token, "") or (None, why the admin API is off). Read at each request, so
        a token file replaced in place takes effect at once. A token no client can send (a
        second line, a control character) turns it off too, saying so at start and reload,
        rather than leaving /admin/* refusing every token; the reason never quotes the file,
        as any client may read it in the 403."""
        path = self.cfg.api.admin_token_path()
        if path is None:
            return None, "no token configured (api.admin_token_file)"
        what = "api.admin_token_file" if self.cfg.api.admin_token_file else "the credential"
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            return None, f"cannot read {what} {path}: {e.strerror or e}"
        except UnicodeDecodeError:  # its message quotes a byte of the file
            return None, f"{what} {path} is not UTF-8 text"
        if not token:
            return None, f"{what} {path} is empty"
        problem = token_problem(token)
        if problem:
            return None, f"{what} {path} {problem}"
        return token, ""

    def warn_admin_token(self) -> None:
        """At start and at each reload: a token file that is set but unusable turns the admin
        API off (403), which must not go unnoticed."""
        token, why = self.admin_token_status()
        if token is None and self.cfg.api.admin_token_path() is not None:
            log.warning("admin API disabled (/admin/* answers 403): %s", why)
            self._token_problem_logged = why

    def admin_disabled(self, why: str) -> str:
        """The 403's message for an admin API that is off (`why`, from `admin_token_status`).
        A token file that is set but unusable is named only in the log, once for each problem
        (start, reload, or the first request to meet a file changed since): the answer goes to
        any client, which need not learn the host's paths or what is wrong with the file."""
        if self.cfg.api.admin_token_path() is None:
            return f"admin API disabled: {why}"
        if why != self._token_problem_logged:
            log.warning("admin API disabled (/admin/* answers 403): %s", why)
            self._token_problem_logged = why
        return (
            "admin API disabled: the admin token file cannot be used; the daemon's log names "
            "the problem (fix the file: it is read again at each request)"
        )

    def warn_open_api(self) -> None:
        """At start and at each reload: an API on a non-loopback address with no keys file lets
        any client that reaches it ask for high priority. A reload that drops the keys file
        (api.host changes only at a restart) must say so as loudly as a start would."""
        host = self.cfg.api.host
        if self.api_keys is None and not _loopback(host):
            log.warning(
                "the API listens on %s with no api.api_keys_file: any client that reaches it "
                "may ask for high priority (kvguard keys add; docs in README, 'API keys')",
                host,
            )

    def manual_action(self, name: str, params: dict[str, Any]) -> Future:
        """An operator's remedy: same catalogue as the rules, audited with trigger `manual`.
        Each outcome is audited and counted when the Future settles: one cancelled (withdrawn
        before the engine took it, see `await_action`) is `failed`, saying it never ran. Its
        time is when it was asked for, as a rule's is its decision's: before the events it
        causes, not after them (its Future settles once the engine has applied it)."""
        decided = utcnow()
        # held from now, not from when it applies: a rule deciding while this waits behind a
        # long step runs after it, and must not loosen or undo it (`manual_requested`)
        ev = self.control.evaluator if self.control is not None else None
        pending = ev.manual_requested(name, params) if ev is not None else None
        try:
            fut = run_action(self.engine, name, params)
        except BaseException:
            if ev is not None:
                ev.manual_settled(pending)
            raise

        def record(f: Future) -> None:
            err: BaseException | None = (
                RuntimeError(MANUAL_WITHDRAWN) if f.cancelled() else f.exception()
            )
            res = None if err else f.result()
            # one that changed nothing (FP8 on an FP8 pool) is `held`, not `applied`
            outcome = "failed" if err else manual_outcome(res)
            detail = manual_detail(res) if res else str(err)
            if ev is not None:
                ev.count_manual(name, outcome)  # kvguard_actions_total{rule="manual"}
                if res is not None and res.ok:  # applied, or already so: held from now
                    try:
                        overrode = ev.manual_applied(name, params, res)
                    except Exception:  # noqa: BLE001 - the action is recorded all the same
                        log.exception("admin action %s: its settings could not be held", name)
                        overrode = ""
                    if overrode:
                        detail = f"{detail}; {overrode}"
                ev.manual_settled(pending)  # after manual_applied: no moment holds neither
            self.audit.record_action(
                rule="manual",
                action=name,
                trigger="manual",
                signal=None,
                value=None,
                threshold=None,
                params=params,
                state_before=res.before if res else None,
                state_after=res.after if res else None,
                outcome=outcome,
                error=str(err) if err else (None if res.ok else res.detail),
                # counted in the incident's actions_count, as its timeline lists it
                incident=ev.count_outside_action() if ev is not None else None,
                is_undo=False,
                detail=detail,
                time=decided,
                data=res.data if res else None,  # e.g. the requests it evicted, as answered
            )

        fut.add_done_callback(record)
        return fut

    def state(self) -> dict[str, Any]:
        s = self.engine.latest_snapshot
        ready, reason = self.readiness()
        return {
            "model": self.model_name,
            "ready": ready,
            "ready_reason": reason,  # what /ready says: why not, or what a ready daemon notes
            "draining": self.draining,
            # requests not finished, those still on their way into the engine included (what
            # a drain waits for)
            "in_flight": self.loop.in_flight(),
            "knobs": s.knobs,
            "queues": s.queues,
            "admission": s.admission,
            "kv": {
                "dtype": s.kv_cache_dtype,
                "device": {
                    "blocks_total": s.device.blocks_total,
                    "blocks_used": s.device.blocks_used,
                    "usage_ratio": s.device.usage_ratio,
                },
                "host": {"blocks_total": s.host.blocks_total, "blocks_used": s.host.blocks_used},
            },
            "counters": s.counters,
            "preemptions": s.preemptions,
            "admission_decisions": s.admission_decisions,
            "tensor_parallel": {
                "size": self.engine.config.tensor_parallel,
                "pipeline_stages": self.engine.config.pipeline_parallel,
                "worker_pids": self.worker_pids,
                "kv_cache_rank_bytes": self.kv_rank_bytes,
                "failure": None if self.loop.fatal is None else str(self.loop.fatal),
            },
            "nvml": {
                "available": self.nvml.available,
                "error": self.nvml.error,
                "own_gpus": self.nvml.own_gpus,  # NVML indices of the engine's GPUs
            },
            "rules": self.control.evaluator.rule_states() if self.control else [],
            # what the operator's actions hold (the rules' acts and undos leave them as asked)
            "manual": self.control.evaluator.manual_holds()
            if self.control
            else {"holds": [], "asked": {}},
            "degradation_level": self.control.evaluator.level() if self.control else 0,
            "incident": self.control.evaluator.incident if self.control else None,
            "dry_run": self.control.evaluator.dry_run if self.control else False,
            "audit": self._audit_state(),
            # None: the OpenAI endpoints are open (no api.api_keys_file)
            "api_keys": None
            if self.api_keys is None
            else {"file": str(self.api_keys.path), "keys": len(self.api_keys)},
            "host_memory_used_ratio": host_memory_used_ratio(),
            # the last reload, if it applied nothing (until one applies): what `kvguard status`
            # says, as the STATUS= line does
            "reload_refused": self._reload_refused_state(),
        }

    def _reload_refused_state(self) -> dict[str, Any] | None:
        """/admin/state's `reload_refused`: `config` is the file the reload read (null: the
        daemon was started without --config, and the reload read the built-in defaults and
        the packaged rules again); `knobs` says what of it is in force (`_reload_record`)."""
        record = self._reload_record()
        if record is None:
            return None
        refused, knobs, errors = record
        return {
            "outcome": refused["outcome"],
            "at": f"{refused['at']:%Y-%m-%dT%H:%M:%SZ}",
            "config": None if self.config_path is None else str(self.config_path),
            "knobs": knobs,
            "errors": errors,
        }

    def _audit_state(self) -> dict[str, Any]:
        a = self.audit
        if a is None:
            return {"degraded": True, "reason": "not started"}
        problem = a.problem()
        return {
            "db": shown(a.url),
            "degraded": problem is not None,
            "reason": problem,
            "queue_depth": a.depth(),
            "dropped": a.dropped,
            "written": a.written,
        }


def _reload_problem(verb: str, errors: list[str], at: datetime | None = None) -> str:
    """A reload that applied nothing (at `at`, default now), for the STATUS= line: `reload
    refused at TIME: FILE:LINE: key: problem (+N more in the journal)`. The first problem only,
    on one line and cut, since `systemctl status` shows it whole; the time (UTC, as `kvguard
    audit` prints it) finds the log's lines and the `config_error` audit event."""
    first = " ".join((errors[0] if errors else "see the journal").split())
    if len(first) > RELOAD_PROBLEM_CHARS:
        first = first[: RELOAD_PROBLEM_CHARS - 3] + "..."
    more = f" (+{len(errors) - 1} more in the journal)" if len(errors) > 1 else ""
    return f"reload {verb} at {at or utcnow():%Y-%m-%dT%H:%M:%SZ}: {first}{more}"


def live_conflicts(running: DaemonConfig, new: DaemonConfig) -> list[str]:
    """`new`'s live values checked against the restart-only values still in force (which a
    reload leaves as they are), one `FILE:LINE: key: problem` line each; [] when they agree.

    The file is validated on its own terms, so a file that lowers max_model_len and the step
    budget together passes; but max_model_len only changes at the restart, and without chunked
    prefill a step must hold the longest prompt the running limit lets in."""
    out = []
    s, n = running.serving, new.serving
    if not s.enable_chunked_prefill and n.max_num_batched_tokens < s.max_model_len:
        out.append(
            new._line(
                ("serving", "max_num_batched_tokens"),
                f"{n.max_num_batched_tokens} < serving.max_model_len {s.max_model_len} in force, "
                "with serving.enable_chunked_prefill off in force: a prompt longer than the "
                "step budget could never be scheduled (both keys take effect only at a "
                f"restart; expected >= {s.max_model_len} until then)",
            )
        )
    return out


# Restart-only keys whose values the model itself must suit: the shape keys are checked on its
# config (heads, MLP width, layers), model_quantization on the format its checkpoint holds.
SHAPE_KEYS: tuple[Loc, ...] = (
    ("serving", "tensor_parallel"),
    ("serving", "pipeline_parallel"),
    ("serving", "pipeline_layers"),
)
CHECKPOINT_KEY: Loc = ("quantization", "model_quantization")


def model_conflicts(running: DaemonConfig, new: DaemonConfig, engine: LLMEngine) -> list[str]:
    """What the next start's load would refuse of the model-dependent keys a reload changes
    (`SHAPE_KEYS`, `CHECKPOINT_KEY`), one `FILE:LINE: key: problem` line each; [] when none.

    They wait for a restart, so the reload used to say `reloaded: true`, and the restart (a
    reboot at night) then failed. They are checked on the model served now, which is cheap:
    its config is in memory and its checkpoint in the cache. A file that also names another
    serving.model leaves them to the start (that model's files may not be fetched yet)."""
    if new.serving.model != running.serving.model:
        return []
    changed = {
        loc for loc in (*SHAPE_KEYS, CHECKPOINT_KEY) if _value(new, loc) != _value(running, loc)
    }
    out: list[tuple[Loc, str]] = []
    if changed & set(SHAPE_KEYS):
        out += _shape_problems(new, engine.model_config)
    if CHECKPOINT_KEY in changed:
        out += _checkpoint_problem(
            new.serving.model, engine.config.home, new.quantization.model_quantization
        )
    return [new._line(loc, msg) for loc, msg in out]


def _value(cfg: DaemonConfig, loc: Loc) -> Any:
    section, key = loc
    return getattr(getattr(cfg, str(section)), str(key))


def _shape_problems(new: DaemonConfig, mcfg: ModelConfig) -> list[tuple[Loc, str]]:
    """The engine's own start checks of the parallel sizes, on the model's config."""
    s = new.serving
    out: list[tuple[Loc, str]] = []
    try:
        check_tensor_parallel(mcfg, s.tensor_parallel)
    except ConfigError as e:
        out.append((("serving", "tensor_parallel"), str(e)))
    try:
        stage_layers(mcfg.num_layers, s.pipeline_parallel, s.pipeline_layers)
    except ConfigError as e:
        key = "pipeline_layers" if str(e).startswith("pipeline_layers") else "pipeline_parallel"
        out.append((("serving", key), str(e)))
    return out


def _checkpoint_problem(model: str, home: Path, knob: str) -> list[tuple[Loc, str]]:
    """The start's check of model_quantization against the checkpoint (`resolve_model`),
    with a GGUF source left unconverted (a reload must not take minutes); any other model is
    resolved as the start resolves it, from the cache, where the model served now is."""
    from kvguard.engine.model_registry import resolve_model

    try:
        resolve_model(model, home, progress=False, quantization=knob, convert=False)
    except ModelLoadError as e:
        return [(CHECKPOINT_KEY, str(e))]
    return []


def engine_changes(
    old: DaemonConfig, new: DaemonConfig, device: str | None = None
) -> tuple[list[KnobField], list[str]]:
    """What differs between two config files: the engine knobs a reload applies (declared
    live), and the keys (`section.key`) of everything else that differs, which wait for a
    restart. Rules, Prometheus, the drain timeout and the API keys file are the reload's own;
    the keys of `INERT` are in neither list (nothing acts on them: they are logged as such).
    Automatic values are resolved for `device`, the one in force (default: `old`'s): a file
    that changes serving.device alone changes no live knob before the restart."""
    live, restart = [], []
    device = device or old.serving.device
    for k in ENGINE_KNOBS:
        if old.knob_value(k, device) != new.knob_value(k, device):
            (live if k.knob.live else restart).append(k)
    later = [f"{k.knob.section}.{k.file_key}" for k in restart]
    reloaded = {
        ("api", "drain_timeout"),
        ("api", "api_keys_file"),
        ("api", "special_tokens_in_messages"),
    }
    inert = {tuple(name.split(".")) for name in INERT}  # no restart applies them either
    knobs = {(k.knob.section, k.file_key) for k in ENGINE_KNOBS}
    for section in DaemonConfig.model_fields:
        if section in ("rules", "prometheus"):
            continue
        was, now = getattr(old, section).model_dump(), getattr(new, section).model_dump()
        for key in sorted(set(was) | set(now)):
            if (section, key) in reloaded | knobs | inert or was.get(key) == now.get(key):
                continue
            later.append(f"{section}.{key}")
    return live, later


def _knob_changes(new: DaemonConfig, live: list[KnobField], device: str) -> dict[str, Any]:
    """The live knobs a reload applies, as its answer lists them: `section.key` -> value, an
    automatic one resolved for `device`, the one in force."""
    return {f"{k.knob.section}.{k.file_key}": new.knob_value(k, device) for k in live}


def _with_knobs(cfg: DaemonConfig, new: DaemonConfig, live: list[KnobField]) -> DaemonConfig:
    """`cfg` with the live knobs `live` as `new` has them (as the file gives them: an automatic
    value stays null, resolved where it is read for the device in force)."""
    for k in live:
        section = getattr(cfg, k.knob.section)
        moved = section.model_copy(
            update={k.file_key: getattr(getattr(new, k.knob.section), k.file_key)}
        )
        cfg = cfg.model_copy(update={k.knob.section: moved})
    return cfg


def stop_budget_s(drain_timeout: float) -> float:
    """How long a stop may take, from SIGTERM to the process's end: the drain, the cut and the
    close (STOP_AFTER_DRAIN_S), and the process's own exit (STOP_EXIT_MARGIN_S)."""
    return drain_timeout + STOP_AFTER_DRAIN_S + STOP_EXIT_MARGIN_S


def log_stop_budget(cfg: DaemonConfig) -> None:
    """Name a drain_timeout whose stop outlasts the shipped unit's TimeoutStopSec=. Under
    systemd ($NOTIFY_SOCKET set) the stop asks for that time as it begins (EXTEND_TIMEOUT_USEC):
    an INFO line says so, as a warning at every start and reload would be one nobody can act
    on. Without it nothing asks: a supervisor that gives less kills the daemon at its own
    timeout, mid-drain or before the audit is written, and nothing would have said why."""
    budget = stop_budget_s(cfg.api.drain_timeout)
    if budget <= UNIT_TIMEOUT_STOP_S:
        return
    if os.environ.get("NOTIFY_SOCKET"):
        log.info(
            "api.drain_timeout is %gs: a stop may take %gs, more than the %gs TimeoutStopSec= "
            "of kvguard's systemd unit; the stop asks systemd for %gs as it begins "
            "(EXTEND_TIMEOUT_USEC)",
            cfg.api.drain_timeout,
            budget,
            UNIT_TIMEOUT_STOP_S,
            budget,
        )
        return
    log.warning(
        "api.drain_timeout is %gs: a stop may take %gs, more than the %gs TimeoutStopSec= of "
        "kvguard's systemd unit, and with no NOTIFY_SOCKET (not a Type=notify systemd unit) "
        "the stop asks no supervisor for that time: give the daemon %gs after its SIGTERM, "
        "or set api.drain_timeout to %gs or less",
        cfg.api.drain_timeout,
        budget,
        UNIT_TIMEOUT_STOP_S,
        budget,
        UNIT_TIMEOUT_STOP_S - STOP_AFTER_DRAIN_S - STOP_EXIT_MARGIN_S,
    )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# The abstract unix socket names (Linux) by which each kvguard claims its API's address while
# its API socket is open: `_claim_port`.
PORT_CLAIM_PREFIX = "kvguard-api:"


def bind_api(host: str, port: int) -> socket.socket:
    """The API's socket, bound before the model loads, so that a taken port fails the start at
    once rather than after minutes of loading, and no connection the daemon itself opens
    meanwhile (tensor-parallel workers, the audit database) can take the port as its own local
    one. Bound, not listening: until the daemon serves, a client is refused at once (a TCP
    health check fails, `kvguard status` says so) rather than held unanswered through the load
    and let in all together as serving begins. SO_REUSEADDR (a restart must not wait out the
    last run's connections in TIME_WAIT) lets any number of sockets bind one port while none
    listens, so the bind does not see another kvguard still loading on it: its claim does."""
    try:
        family, address = _bind_address(host, port)
        # IPPROTO_TCP said, not left 0: asyncio turns TCP_NODELAY on for the connections it
        # accepts only on a socket that says it; without it every answer on a kept-alive
        # connection waited ~40 ms (its body held back until the client's delayed ACK)
        sock = _ClaimingSocket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    except OSError as e:  # a name that does not resolve; IPv6 turned off on this host
        raise bind_error(host, port, e) from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.claim = _claim_port(*sock.getsockname()[:2])
    except OSError as e:
        sock.close()
        raise bind_error(host, port, e) from e
    return sock


def _bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The family and socket address the API binds `host` by: a literal's own, and a host
    name's IPv4 address where it has one (`localhost` stays 127.0.0.1 where it names ::1
    too), else its IPv6 one. The family was chosen by a ':' in the text alone, so a name that
    resolves only to IPv6 (ip6-localhost) was looked up as IPv4 and said not to resolve.
    socket.gaierror where it resolves to neither."""
    found = socket.getaddrinfo(
        host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, socket.IPPROTO_TCP, socket.AI_PASSIVE
    )
    ipv4 = [f for f in found if f[0] == socket.AF_INET]
    family, _type, _proto, _name, address = (ipv4 or found)[0]
    return family, address


def bind_error(host: str, port: int, e: OSError) -> ApiBindError:
    """The API's bind failed with `e`: why, naming the key to fix. No right to the port
    (EACCES, EPERM) and an address no host binds as written (EINVAL, EAFNOSUPPORT) are
    `lasting`: a new start meets them again, and systemd restarting it every 5 s for ever
    fixes nothing. A port another process holds, an address or a host name the network has
    not brought up yet (at boot, before network-online) may pass: a restart tries again."""
    said = f"cannot bind the API to {_address(host, port)}: {e.strerror or e}"
    if isinstance(e, socket.gaierror):
        return ApiBindError(
            f"{said}: api.host {host!r} does not resolve (its name service may not be up yet: "
            "a restart tries again; if the name is wrong, fix api.host)"
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return ApiBindError(f"{said}: {_no_right_to(port)}", lasting=True)
    if e.errno in (errno.EINVAL, errno.EAFNOSUPPORT):
        return ApiBindError(f"{said}: {_unbindable(host, e.errno)}", lasting=True)
    if isinstance(e, PortClaimed):  # names the kvguard that holds it, and the fix: said once
        return ApiBindError(said)
    if e.errno == errno.EADDRINUSE:
        said += (
            f": api.port {port} is taken by another process (stop it, or set api.port to a "
            "free port; a restart tries again)"
        )
    elif e.errno == errno.EADDRNOTAVAIL:
        said += (
            f": api.host {host} is no address of this host (one the network brings up later "
            "is bound by a restart; if it is wrong, fix api.host)"
        )
    return ApiBindError(said)


def _unbindable(host: str, code: int) -> str:
    """Why `host` is no address this host binds at all (EINVAL: an IPv6 link-local address
    without its interface; EAFNOSUPPORT: an IPv6 one, or a name with only IPv6 ones, on a host
    booted with IPv6 turned off), and the fix. The kernel says only "Invalid argument", and a
    restart every 5 s for ever would meet it again."""
    if code == errno.EAFNOSUPPORT:
        return (
            f"api.host {host} {_ipv6_only(host)} and this host has IPv6 turned off: set "
            "api.host to an IPv4 address (0.0.0.0 for all of them) or a name that has one; a "
            "restart alone would meet it again"
        )
    try:
        link_local = ipaddress.ip_address(host).is_link_local
    except ValueError:  # a host name: what it resolves to
        link_local = False
    if link_local:
        return (
            f"api.host {host} is an IPv6 link-local address, which is bound on one interface: "
            f"name it (e.g. {host}%eth0), or set api.host to another address; a restart alone "
            "would meet it again"
        )
    return (
        f"api.host {host} is no address the API can bind: fix api.host; a restart alone would "
        "meet it again"
    )


def _ipv6_only(host: str) -> str:
    """What `host` is, for the EAFNOSUPPORT message: an IPv6 address as written, or a host
    name that `bind_api` found only IPv6 addresses for (calling the name an address misleads
    whoever reads /etc/hosts or DNS for the fix)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "resolves only to IPv6 addresses"
    return "is an IPv6 address"


def _no_right_to(port: int) -> str:
    """Why this process may not bind `port`, and the fix: a port under the kernel's
    net.ipv4.ip_unprivileged_port_start takes CAP_NET_BIND_SERVICE; above it, a security
    policy (SELinux, AppArmor, a cgroup's BPF program) refuses it."""
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    except (OSError, ValueError):
        start = 1024
    if port < start:
        return (
            f"api.port {port} is under {start} (net.ipv4.ip_unprivileged_port_start), which "
            f"takes CAP_NET_BIND_SERVICE: set api.port to {start} or above (e.g. 8000), or give "
            "the service the capability (a drop-in for its unit setting both "
            "AmbientCapabilities=CAP_NET_BIND_SERVICE and "
            "CapabilityBoundingSet=CAP_NET_BIND_SERVICE); a restart alone would meet it again"
        )
    return (
        "this host's security policy (SELinux, AppArmor, a cgroup's BPF program) refuses "
        "api.host:api.port to this service: allow it there, or set api.host and api.port to "
        "an address and port it may bind; a restart alone would meet it again"
    )


class _ClaimingSocket(socket.socket):
    """The API's socket, holding its address's claim (`_claim_port`) until it is closed: by
    uvicorn as serving ends, by `run` after a start that failed, by a test."""

    claim: socket.socket | None = None

    def close(self) -> None:
        super().close()
        if self.claim is not None:
            self.claim.close()


def _claim_port(host: str, port: int) -> socket.socket | None:
    """Claim the bound `host`:`port` among the kvguards of this network namespace, or raise
    OSError naming the one that holds it or an address overlapping it (`_overlaps`). The claim
    is an abstract unix socket's name, bound and never listened on: the kernel refuses a
    second bind of a name, frees it as its process ends however it ends (no stale lock), and
    keeps its names per network namespace, as it keeps ports. The other claims are read after
    this one is made: of two overlapping starts, at least the later sees the other. None off
    Linux (no abstract names): the bind is the only check there."""
    if sys.platform != "linux":
        return None
    mine = PORT_CLAIM_PREFIX + _address(host, port)
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        claim.bind("\0" + mine)
    except OSError as e:
        claim.close()
        if e.errno == errno.EADDRINUSE:
            raise _claimed(_address(host, port)) from e
        log.warning(
            "cannot claim the API's address among kvguards (%s): a second kvguard on it is "
            "found only as one of them begins to serve",
            e,
        )
        return None
    others = [name for name, held in _claims(port) if name != mine and _overlaps(held, host)]
    if others:
        claim.close()
        raise _claimed(others[0].removeprefix(PORT_CLAIM_PREFIX))
    return claim


class PortClaimed(OSError):
    """Another kvguard holds the API's address (`_claim_port`): EADDRINUSE, as the listen()
    would have given once the model was loaded, its message naming that kvguard and the fix
    (`bind_error` adds none of its own)."""


def _claimed(address: str) -> PortClaimed:
    """The kvguard that holds `address`: its own errno would only say the port is taken."""
    return PortClaimed(
        errno.EADDRINUSE,
        f"another kvguard on this host has its API on {address} (loading or serving): stop "
        "it, or give this one another api.port",
    )


def _claims(port: int) -> list[tuple[str, str]]:
    """The kvguard claims on `port` in this network namespace, as (name, host)."""
    found = []
    for name in _abstract_names():
        host, _, claimed = name.removeprefix(PORT_CLAIM_PREFIX).rpartition(":")
        if name.startswith(PORT_CLAIM_PREFIX) and claimed == str(port):
            found.append((name, host.removeprefix("[").removesuffix("]")))
    return found


def _abstract_names() -> list[str]:
    """The bound abstract unix socket names of this network namespace: /proc/net/unix lists
    every unix socket, a bound one's name as its last field, an abstract one's after an @."""
    try:
        lines = Path("/proc/net/unix").read_text(errors="replace").splitlines()[1:]
    except OSError:  # no /proc: the claim's own bind (one address) is the check left
        return []
    fields = (line.split(None, 7) for line in lines)
    return [f[7][1:] for f in fields if len(f) == 8 and f[7].startswith("@")]


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _overlaps(a: str, b: str) -> bool:
    """Whether TCP sockets bound to addresses `a` and `b` on one port could not both listen:
    one address (an IPv4-mapped IPv6 one is its IPv4 one), or a wildcard that covers the
    other: 0.0.0.0 every IPv4 address, :: every address (bind_api leaves IPV6_V6ONLY off, so
    an IPv6 socket takes IPv4 too). An address that does not parse overlaps nothing."""
    try:
        x, y = (_unmapped(ipaddress.ip_address(h)) for h in (a, b))
    except ValueError:
        return False
    if x == y:
        return True
    return any(w.is_unspecified and (w.version == 6 or o.version == 4) for w, o in ((x, y), (y, x)))


def _unmapped(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (::ffff:127.0.0.1) as the IPv4 address it stands for."""
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip if mapped is None else mapped


class ApiBindError(RuntimeError):
    """api.host:api.port cannot be bound (taken, not an address of this host, one no host
    binds as written, or not this service's to bind). `lasting`: a new start would meet it again, so the daemon exits 2 as
    for a config error (the unit's RestartPreventExitStatus=2); otherwise 1, and restarted."""

    def __init__(self, message: str, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


def run(
    cfg: DaemonConfig,
    config_path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> int:
    """Serve `cfg` (the file at `config_path` with the command line's `overrides` applied,
    which every reload applies again)."""
    configure_logging()
    raise_open_files_limit()
    svc = Service(cfg, config_path, overrides)
    svc.keep_heap_frozen = True  # the process ends right after the stop
    # Until serve() takes SIGHUP over, a reload has nothing to act on, and SIGHUP's default
    # action would kill the process in the middle of loading the model or migrating the DB.
    signal.signal(signal.SIGHUP, svc._sighup_before_serving)
    log.info(
        "kvguard %s starting (pid %d); SIGHUP is ignored until ready",
        kvguard_version(),
        os.getpid(),
    )
    for line in inert_keys(cfg):
        log.warning("%s", line)
    log_stop_budget(cfg)
    svc.read_rules()
    try:
        sock = bind_api(cfg.api.host, cfg.api.port)
    except ApiBindError as e:
        log.error("%s; nothing loaded", e)
        return EXIT_USAGE if e.lasting else EXIT_FAILURE  # 1: systemd starts it again
    host, port = sock.getsockname()[:2]  # api.port 0: the port the kernel picked
    svc.api_port = port
    log.info("API bound to %s; it answers once the model is loaded", _address(host, port))
    svc.warn_admin_token()
    svc.warn_open_api()
    if svc.api_keys is not None:
        log.info("API keys: %d from %s", len(svc.api_keys), svc.api_keys.path)
    try:
        # Until serve() takes them over, SIGINT and SIGTERM end the start in order (nothing to
        # drain yet), not by their default actions: the interpreter's exit aborted in the C++
        # of the thread still loading the model, and SIGTERM ended it without a word.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, svc._on_start_signal)
        svc.load()
        code = asyncio.run(svc.serve(sock))
    except LoadInterrupted as e:
        svc.leave_while_loading(e.signum)
    finally:
        sock.close()
        svc.shutdown_engine()  # also when loading or serving raised
    if svc.left_running:
        # a thread the stop could not end (a tick stuck in NVML, an evaluation's worker) must
        # not hold the exit: the interpreter's would wait for it, until systemd's SIGKILL
        log.warning(
            "exiting with status %d without waiting for %d stuck control-plane threads (the "
            "warnings above name them)",
            code,
            len(svc.left_running),
        )
        logging.shutdown()
        os._exit(code)
    return code


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _worker_pids(engine: LLMEngine) -> list[int]:
    """The tensor-parallel worker processes (none with one rank)."""
    return engine.runner.worker_pids()


def _kv_bytes_per_rank(engine: LLMEngine) -> list[int]:
    """Each rank's device KV pool in bytes; one rank: this process's pool."""
    return engine.runner.kv_bytes_per_rank()


def _failure_data(error: BaseException) -> dict[str, Any]:
    """The audit row's data for an engine failure: the rank at fault and why, when known."""
    data: dict[str, Any] = {"error": type(error).__name__}
    for key in ("rank", "reason"):
        if hasattr(error, key):
            data[key] = getattr(error, key)
    return data
