"""A minimal sd_notify(3) client: tells systemd we are ready, alive, reloading or stopping.

With `Type=notify` systemd considers the service started only on READY=1, so clients are not
sent to a daemon still loading its model; WATCHDOG=1 pings let systemd restart an engine loop
that hung rather than crashed. The protocol is one datagram of `KEY=VALUE` lines to the
socket in $NOTIFY_SOCKET, which is simple enough not to warrant a dependency (or libsystemd).

Outside systemd (no $NOTIFY_SOCKET) every call is a no-op returning False, so the daemon runs
the same from a terminal. A failed send is logged and reported, never raised: losing a status
line must not take the server down.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

# While the daemon starts (model fetch and load, remote ranks joining, the audit migration) it
# asks systemd for EXTEND_BY_S more every EXTEND_EVERY_S, so a slow first start is not killed at
# the unit's TimeoutStartSec=; past EXTEND_LIMIT_S (plus what the caller allows on top, e.g. the
# remote ranks' join timeout) it stops asking, and a start that hangs is still ended by systemd.
EXTEND_BY_S = 90.0
EXTEND_EVERY_S = 30.0
EXTEND_LIMIT_S = 3600.0


def notify(state: str) -> bool:
    """Send `state` (newline-separated KEY=VALUE assignments); True if systemd was told."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # Linux abstract namespace: a leading NUL byte, no file
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as e:
        log.warning("sd_notify to %r failed: %s", os.environ.get("NOTIFY_SOCKET"), e)
        return False
    return True


def ready(status: str | None = None) -> bool:
    """Start-up is complete (model loaded, database migrated): systemd may send traffic."""
    return notify("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def status(text: str) -> bool:
    """A one-line state shown by `systemctl status`."""
    return notify(f"STATUS={_one_line(text)}")


def watchdog() -> bool:
    """Proof of life; sent from the engine loop's heartbeat so a hung loop is noticed."""
    return notify("WATCHDOG=1")


def reloading() -> bool:
    """A reload (SIGHUP) has begun; send `ready()` when it is done.

    sd_notify(3) wants MONOTONIC_USEC with RELOADING=1 (systemd 253+) so a reload can be told
    apart from an earlier one; older versions ignore the extra field.
    """
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")


def stopping() -> bool:
    """Shutdown has begun (draining): systemd stops counting it as a failure to respond."""
    return notify("STOPPING=1")


def stopping_within(seconds: float) -> bool:
    """STOPPING=1, then a request for `seconds` from now to finish (EXTEND_TIMEOUT_USEC).

    The daemon bounds its own stop (the drain, then the cut and the close); the unit's
    TimeoutStopSec= is a guess made when the unit was written, and a copy of an older unit or
    a drain_timeout raised since makes it too short: systemd would SIGKILL a stop that keeps
    its promise. systemd (236+) honours the request during a stop and never shortens its own
    timeout for it, so the SIGKILL comes only for a stop that outlasts what it said. Two
    datagrams, in that order: the extension is read once the unit is in its stop, whatever
    order systemd reads the fields of one datagram in."""
    told = stopping()
    return extend_timeout(seconds) and told


def extend_timeout(seconds: float) -> bool:
    """Ask for more time in the current start/stop phase (a first start fetches the model)."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")


@contextmanager
def extending_timeout(
    limit_s: float = EXTEND_LIMIT_S,
    by_s: float = EXTEND_BY_S,
    every_s: float = EXTEND_EVERY_S,
) -> Iterator[None]:
    """For the `with` block (a start), ask systemd for `by_s` more time now and then every
    `every_s`, for `limit_s` at most; the asking stops when the block ends, however it ends, and
    no request is sent after that. Outside systemd nothing is sent and no thread is started."""
    if not os.environ.get("NOTIFY_SOCKET"):
        yield
        return
    stop = threading.Event()
    lock = threading.Lock()  # held while sending: once the block ends, nothing more goes out
    deadline = time.monotonic() + limit_s

    def keep_extending() -> None:
        while not stop.wait(every_s):
            with lock:
                if stop.is_set():
                    return
                if time.monotonic() >= deadline:
                    log.warning(
                        "start-up has taken over %.0fs: no longer extending systemd's start "
                        "timeout (it ends the start within %.0fs unless it finishes)",
                        limit_s,
                        by_s,
                    )
                    return
                extend_timeout(by_s)

    extend_timeout(by_s)  # at once: the first request is there before anything else is said
    thread = threading.Thread(target=keep_extending, name="kvguard-start-timeout", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with lock:
            stop.set()
        thread.join(5.0)


def watchdog_interval() -> float | None:
    """systemd's watchdog period in seconds, or None when no watchdog applies to this process.

    Ping at half this period or faster. WATCHDOG_PID, when set, names the process the
    watchdog is meant for; a child that inherited the environment must not ping.
    """
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1_000_000 if usec > 0 else None


def _one_line(text: str) -> str:
    """A newline would start a new assignment and could forge one (e.g. READY=1)."""
    return " ".join(text.splitlines())
