"""The API's bind fails: `kvguard serve` says why in one line naming `api.host` or `api.port`
and the fix, and exits so that systemd does the right thing. A port the service has no right
to (EACCES: 80 without CAP_NET_BIND_SERVICE) exits 2, which the unit's
RestartPreventExitStatus=2 does not restart: it exited 1 and was restarted every 5 s for ever.
A port another process holds, an address or a host name the network has not brought up yet
may pass (at boot): exit 1, restarted.

An address no host binds as written (an IPv6 link-local one without its interface: EINVAL;
an IPv6 one where IPv6 is turned off) exits 2 too, naming api.host: it was restarted for ever.
Another kvguard holding the port is said once (its own advice had the taken port's appended).
A host name that resolves only to IPv6 is bound there (it was looked up as IPv4 and said not to
resolve), and a socket that cannot be made is said in the one line, not as a traceback.

Real `kvguard serve` subprocesses of the tiny model (they exit at the bind, before loading
it), and the real bind of `bind_api` for the other failures. Root binds a low port, so the
EACCES start runs in a network namespace of its own (net.ipv4.ip_unprivileged_port_start
there is the kernel's default, 1024, whatever the host's) with CAP_NET_BIND_SERVICE dropped
from its capability bounding set: the kernel itself refuses the bind, as it refuses an
unprivileged service. Where that cannot be arranged (root without CAP_SYS_ADMIN, a user on a
host whose unprivileged ports start at 80 or below), or the daemon binds the port all the
same, the test fails at once saying so."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvguard.daemon.service import ApiBindError, bind_api, bind_error
from tests.test_server import KVGUARD, TEST_DAEMON_ENV, free_port

CLONE_NEWNET = 0x40000000
PR_CAPBSET_DROP = 24
CAP_NET_BIND_SERVICE = 10
LOW_PORT = 80  # under 1024: CAP_NET_BIND_SERVICE's
UNPRIVILEGED_START = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start")
NONLOCAL_BIND = Path("/proc/sys/net/ipv4/ip_nonlocal_bind")
BOUND = "API bound to "  # the daemon's log line once its bind succeeded
WAIT_S = 120  # the bound on a daemon that neither binds nor exits: a hang, not a timing


def serve(tmp: Path, host: str, port: int, preexec: Callable[[], None] | None = None) -> tuple:
    """`kvguard serve` on api.host `host`, api.port `port`, run until it exits: (status, log).
    One that binds is stopped at once, and the test fails saying so: it would load the model
    and serve until the wait ran out."""
    config = tmp / "config.yaml"
    config.write_text(
        "serving: {model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}\n"
        f"api: {{host: '{host}', port: {port}}}\n"
        f"audit: {{url: 'sqlite:///{tmp / 'audit.db'}'}}\n"
    )
    env = {**os.environ, **TEST_DAEMON_ENV, "STATE_DIRECTORY": str(tmp)}
    proc = subprocess.Popen(
        [KVGUARD, "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=preexec,
    )
    with proc, killed_after(proc, WAIT_S):
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if BOUND in line:
                proc.kill()
                raise AssertionError(f"the daemon bound {host}:{port}: {''.join(lines)}")
        return proc.wait(), "".join(lines)


@contextlib.contextmanager
def killed_after(proc: subprocess.Popen, seconds: float) -> Iterator[None]:
    """Kills `proc` should it outlive `seconds` (a hang: the test then fails on its log)."""
    timer = threading.Timer(seconds, proc.kill)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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


def port_rights_problem() -> str | None:
    """Why this host cannot refuse the daemon port LOW_PORT (None: it can): a user's port is
    privileged only under the kernel's unprivileged start (containers often set it to 0)."""
    if os.geteuid() == 0:
        return None  # `without_port_rights` takes the right away, or says why it cannot
    start = int(UNPRIVILEGED_START.read_text())
    if start > LOW_PORT:
        return None
    return (
        f"{UNPRIVILEGED_START} is {start}: any user may bind port {LOW_PORT} here; run this "
        "test as root (with CAP_SYS_ADMIN, for a network namespace) or where it is above "
        f"{LOW_PORT}"
    )


def test_a_port_the_service_may_not_bind_exits_2_naming_api_port(tmp_path: Path) -> None:
    problem = port_rights_problem()
    assert problem is None, problem
    try:
        code, log = serve(tmp_path, "0.0.0.0", LOW_PORT, without_port_rights)
    except subprocess.SubprocessError as e:  # preexec_fn failed: no namespace, no prctl
        raise AssertionError(
            "could not take CAP_NET_BIND_SERVICE from the daemon: unshare(CLONE_NEWNET) or "
            "prctl(PR_CAPBSET_DROP) failed (root without CAP_SYS_ADMIN, e.g. Docker's default "
            "capabilities); run this test as root with full capabilities"
        ) from e
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
    network brings up later at boot also gives, so a restart may get past it. A host that
    binds any address (net.ipv4.ip_nonlocal_bind=1: keepalived's, some Kubernetes nodes')
    binds it: nothing to report there."""
    port = free_port()
    if NONLOCAL_BIND.read_text().strip() == "1":
        bind_api("192.0.2.1", port).close()
        return
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


def test_another_kvguard_on_the_port_is_said_once() -> None:
    """Its claim's message names the kvguard and the fix; the taken port's was appended too,
    giving the advice twice and calling the other kvguard "another process"."""
    first = bind_api("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(ApiBindError) as e:
            bind_api("127.0.0.1", port).close()
    finally:
        first.close()
    assert str(e.value) == (
        f"cannot bind the API to 127.0.0.1:{port}: another kvguard on this host has its API on "
        f"127.0.0.1:{port} (loading or serving): stop it, or give this one another api.port"
    )
    assert not e.value.lasting


def test_a_link_local_address_without_its_interface_exits_2_naming_api_host(
    tmp_path: Path,
) -> None:
    """fe80::1 passes the config's check, but the kernel binds a link-local address only on
    an interface named with it (`fe80::1%eth0`): EINVAL, "Invalid argument", which exited 1
    naming no key, and systemd restarted it every 5 s for ever."""
    code, log = serve(tmp_path, "fe80::1", free_port())
    assert code == 2, log
    [line] = error_lines(log)
    assert "cannot bind the API to [fe80::1]:" in line and ": Invalid argument: " in line, log
    assert "api.host fe80::1 is an IPv6 link-local address" in line
    assert "name it (e.g. fe80::1%eth0), or set api.host to another address" in line
    assert "Traceback" not in log and not (tmp_path / "audit.db").exists()


def test_an_ipv6_address_on_a_host_without_ipv6_is_lasting() -> None:
    """A host booted with ipv6.disable=1 refuses the socket itself (EAFNOSUPPORT), made before
    the bind's error handling: a traceback, and a restart every 5 s. (The error as the kernel
    gives it: IPv6 cannot be turned off here.)"""
    refused = OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
    said = bind_error("::", 8000, refused)
    assert said.lasting
    assert str(said).startswith("cannot bind the API to [::]:8000: Address family not supported")
    assert "api.host :: is an IPv6 address and this host has IPv6 turned off" in str(said)


def test_a_name_with_only_ipv6_addresses_where_ipv6_is_off_is_not_called_an_address() -> None:
    """A host name `bind_api` found only IPv6 addresses for meets the same EAFNOSUPPORT: the
    message called the name "an IPv6 address", sending whoever fixes it to the wrong place;
    it says the name resolves only to IPv6 addresses, and that a name with an IPv4 one does."""
    refused = OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
    said = bind_error("only-ipv6.kvguard.test", 8000, refused)
    assert said.lasting
    assert (
        "api.host only-ipv6.kvguard.test resolves only to IPv6 addresses and this host has "
        "IPv6 turned off: set api.host to an IPv4 address (0.0.0.0 for all of them) or a name "
        "that has one"
    ) in str(said)
    assert "is an IPv6 address" not in str(said)


@pytest.fixture
def no_free_descriptor() -> Iterator[None]:
    """Every file descriptor this process may open is open: the next socket() gets EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    opened = [int(fd) for fd in os.listdir("/proc/self/fd")]
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(opened) + 8, hard))
    held = []
    try:
        while True:
            try:
                held.append(os.dup(0))
            except OSError as e:
                assert e.errno == errno.EMFILE, e
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_socket_that_cannot_be_made_is_said_as_a_bind_error(no_free_descriptor: None) -> None:
    """socket() itself may fail (no descriptor left here; EAFNOSUPPORT on a host without
    IPv6): it was made before the bind's error handling, and its OSError escaped as a
    traceback naming neither the address nor the key."""
    with pytest.raises(ApiBindError) as e:
        bind_api("127.0.0.1", 0).close()
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.EMFILE
    assert str(e.value) == "cannot bind the API to 127.0.0.1:0: Too many open files"


def test_a_host_name_that_resolves_only_to_ipv6_is_bound_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name with only an IPv6 address (`ip6-localhost` in Debian's /etc/hosts) was looked
    up as IPv4, the family chosen by a ':' in the text, and said not to resolve: a restart
    every 5 s for ever. (The name service is faked for one name, which a test cannot add to
    this host's /etc/hosts; it answers as it answers for ::1, and the bind is real.)"""
    name = "only-ipv6.kvguard.test"
    real = socket.getaddrinfo

    def lookup(host: str, *args: object, **kw: object) -> list:
        return real("::1" if host == name else host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    with bind_api(name, 0) as sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"
    with bind_api("localhost", 0) as sock:  # a name with an IPv4 address: bound there, as before
        assert sock.family == socket.AF_INET
