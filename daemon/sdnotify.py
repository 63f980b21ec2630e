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
import time

log = logging.getLogger(__name__)


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


def extend_timeout(seconds: float) -> bool:
    """Ask for more time in the current start/stop phase (a first start fetches the model)."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")


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
