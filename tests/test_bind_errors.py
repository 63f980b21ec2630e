"""The API's bind fails: `kvguard serve` says why in one line naming `api.host` or `api.port`
and the fix, and exits so that systemd does the right thing. A port the service has no right
to (EACCES: 80 without CAP_NET_BIND_SERVICE) exits 2, which the unit's
RestartPreventExitStatus=2 does not restart: it exited 1 and was restarted every 5 s for ever.
A port another process holds, an address or a host name the network has not brought up yet
may pass (at boot): exit 1, restarted.

Real `kvguard serve` subprocesses of the tiny model (they exit at the bind, before loading
it), and the real bind of `bind_api` for the other failures. Root binds a low port, so the
EACCES start runs in a network namespace of its own (net.ipv4.ip_unprivileged_port_start
there is the kernel's default, 1024, whatever the host's) with CAP_NET_BIND_SERVICE dropped
from its capability bounding set: the kernel itself refuses the bind, as it refuses an
unprivileged service."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kvguard.daemon.service import ApiBindError, bind_api
from tests.test_server import KVGUARD, TEST_DAEMON_ENV, free_port

CLONE_NEWNET = 0x40000000
PR_CAPBSET_DROP = 24
CAP_NET_BIND_SERVICE = 10
LOW_PORT = 80  # under 1024: CAP_NET_BIND_SERVICE's


def serve(tmp: Path, host: str, port: int, preexec: Callable[[], None] | None = None) -> tuple:
    """`kvguard serve` on api.host `host`, api.port `port`, run until it exits: (status, log)."""
    config = tmp / "config.yaml"
    config.write_text(
        "serving: {model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}\n"
        f"api: {{host: '{host}', port: {port}}}\n"
        f"audit: {{url: 'sqlite:///{tmp / 'audit.db'}'}}\n"
    )
    env = {**os.environ, **TEST_DAEMON_ENV, "STATE_DIRECTORY": str(tmp)}
    done = subprocess.run(
        [KVGUARD, "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        preexec_fn=preexec,
    )
    return done.returncode, done.stdout + done.stderr


def without_port_rights() -> None:
    """In the child, before exec: a network namespace of its own (ports under 1024 are
    privileged there) and no CAP_NET_BIND_SERVICE, even as root."""
    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() != 0:  # an unprivileged user has no right to the port anyway
        return
    for call, args in (
        (libc.unshare, (CLONE_NEWNET,)),
        (libc.prctl, (PR_CAPBSET_DROP, CAP_NET_BIND_SERVICE)),
    ):
        if call(*args) != 0:
            raise OSError(ctypes.get_errno(), f"{call.__name__}{args}")


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in line]


def test_a_port_the_service_may_not_bind_exits_2_naming_api_port(tmp_path: Path) -> None:
    code, log = serve(tmp_path, "0.0.0.0", LOW_PORT, without_port_rights)
    assert code == 2, log
    [line] = error_lines(log)
    assert f"cannot bind the API to 0.0.0.0:{LOW_PORT}: Permission denied: " in line, log
    assert f"api.port {LOW_PORT} is under 1024" in line
    assert "set api.port to 1024 or above" in line and "CAP_NET_BIND_SERVICE" in line
    assert line.endswith("a restart alone would meet it again; nothing loaded"), line
    assert "Traceback" not in log and not (tmp_path / "audit.db").exists()


def test_a_port_in_use_exits_1_naming_api_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, log = serve(tmp_path, "127.0.0.1", port)
    assert code == 1, log
    [line] = error_lines(log)
    assert f"cannot bind the API to 127.0.0.1:{port}: Address already in use: " in line, log
    assert f"api.port {port} is taken by another process" in line
    assert "Traceback" not in log


def test_an_address_not_of_this_host_may_come_up_later() -> None:
    """192.0.2.1 (TEST-NET-1) is no address of this host: EADDRNOTAVAIL, which an address the
    network brings up later at boot also gives, so a restart may get past it."""
    port = free_port()
    with pytest.raises(ApiBindError) as e:
        bind_api("192.0.2.1", port).close()
    assert isinstance(e.value.__cause__, OSError)
    assert e.value.__cause__.errno == errno.EADDRNOTAVAIL and not e.value.lasting
    assert "api.host 192.0.2.1 is no address of this host" in str(e.value)


def test_a_host_name_that_does_not_resolve_may_resolve_later() -> None:
    """`.invalid` never resolves (RFC 6761); a name service not up yet at boot answers alike."""
    with pytest.raises(ApiBindError) as e:
        bind_api("no-such-host.invalid", free_port()).close()
    assert isinstance(e.value.__cause__, socket.gaierror) and not e.value.lasting
    assert "api.host 'no-such-host.invalid' does not resolve" in str(e.value)


def test_a_taken_port_may_be_freed() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ApiBindError) as e:
            bind_api("127.0.0.1", port).close()
    assert e.value.__cause__.errno == errno.EADDRINUSE and not e.value.lasting
