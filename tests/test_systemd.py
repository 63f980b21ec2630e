"""The systemd unit (checked by systemd's own analyzer) and the sd_notify client (over a real socket).

`systemd-analyze` comes from the Debian package `systemd`; a missing tool fails the tests (.ci/run installs it).
`verify` insists that ExecStart= exists, and /usr/local/bin/kvguard only does on an installed
host, so the unit is checked as a copy whose ExecStart= points at this venv's `kvguard` script
(or /bin/true when the package is not installed); every other line is the shipped one.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvguard.daemon
from kvguard.daemon import sdnotify
from kvguard.daemon.cli import EXIT_USAGE

UNIT = Path(__file__).resolve().parents[1] / "daemon" / "systemd" / "kvguard.service"
SHIPPED_EXEC = "ExecStart=/usr/local/bin/kvguard "
MAX_EXPOSURE = 3.0


@pytest.fixture
def analyzer() -> str:
    """The systemd-analyze binary; a missing tool is a failure, never a skip."""
    exe = shutil.which("systemd-analyze")
    assert exe, "systemd-analyze missing: install the Debian package systemd"
    return exe


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    script = Path(sys.executable).parent / "kvguard"
    exe = script if script.exists() else Path("/bin/true")
    text = UNIT.read_text()
    assert text.count(SHIPPED_EXEC) == 1, "the unit's ExecStart changed: update this test"
    path = tmp_path / UNIT.name
    path.write_text(text.replace(SHIPPED_EXEC, f"ExecStart={exe} "))
    return path


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": "", "LC_ALL": "C.UTF-8"}
    cmd = ["systemd-analyze", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)


def test_unit_verifies_cleanly(analyzer: str, unit_copy: Path) -> None:
    proc = analyze("verify", str(unit_copy))
    assert (proc.returncode, proc.stderr, proc.stdout) == (0, "", "")


def test_the_readmes_admin_drop_in_verifies_and_hands_over_the_token(
    analyzer: str, unit_copy: Path
) -> None:
    """The README's steps turn the admin API on with a drop-in (the unit leaves LoadCredential=
    commented: a missing token file would stop the start); the drop-in is what they write."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    found = re.search(
        r"printf '(\[Service\][^']*)' \|\n\s+sudo install -D -m 0644 /dev/stdin "
        r"(/etc/systemd/system/kvguard\.service\.d/admin\.conf)",
        readme,
    )
    assert found, "the README's systemd steps no longer write the admin drop-in"
    body = found.group(1).replace("\\n", "\n")
    assert "LoadCredential=admin.token:/etc/kvguard/admin.token" in body.splitlines()
    drop_in = unit_copy.parent / f"{unit_copy.name}.d" / "admin.conf"
    drop_in.parent.mkdir()
    drop_in.write_text(body)
    proc = analyze("verify", str(unit_copy))
    assert (proc.returncode, proc.stderr, proc.stdout) == (0, "", "")
    drop_in.write_text(body + "NoSuchKey=1\n")  # and the drop-in is read: a bad key is seen
    assert "NoSuchKey" in analyze("verify", str(unit_copy)).stderr


def test_the_units_worker_key_credential_verifies_and_is_where_the_daemon_looks(
    analyzer: str, unit_copy: Path
) -> None:
    """The daemon's dynamic user cannot read a root-only /etc/kvguard/worker.key: the unit ships
    LoadCredential= for it commented (a missing key would stop every start, remote ranks or
    not), and uncommented it verifies and names the credential the daemon reads when
    serving.distributed.authkey_file is unset, as `kvguard worker` does."""
    from kvguard.daemon.cli_worker import KEY_CREDENTIAL
    from kvguard.daemon.config import WORKER_KEY_CREDENTIAL

    line = f"LoadCredential={KEY_CREDENTIAL}:/etc/kvguard/worker.key"
    text = unit_copy.read_text()
    assert f"#{line}" in text.splitlines() and WORKER_KEY_CREDENTIAL == KEY_CREDENTIAL
    unit_copy.write_text(text.replace(f"#{line}", line))
    proc = analyze("verify", str(unit_copy))
    assert (proc.returncode, proc.stderr, proc.stdout) == (0, "", "")


def test_unit_exposure_is_low(analyzer: str, unit_copy: Path) -> None:
    proc = analyze("security", "--offline=yes", "--no-pager", str(unit_copy))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # e.g. "Invalid syntax, ignoring" for a bad line
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert m, proc.stdout
    exposure = float(m.group(1))
    print(f"systemd-analyze security: overall exposure {exposure}")
    failed = [line for line in proc.stdout.splitlines() if line.startswith("✗")]
    assert exposure <= MAX_EXPOSURE, "\n".join(failed)


def test_units_stop_on_a_config_error_instead_of_restarting_into_it() -> None:
    """Exit 2 (EXIT_USAGE) is a bad config, flag, key or model: with Restart= alone and
    RestartSec=5s, systemd would start the unit into the same error every 5 s forever (the
    default start limit, 5 starts in 10 s, is never reached). Both units say so."""
    for unit in (UNIT, UNIT.parent / "kvguard-worker@.service"):
        settings = [line.strip() for line in unit.read_text().splitlines()]
        assert f"RestartPreventExitStatus={EXIT_USAGE}" in settings, unit.name
        assert any(line.startswith("Restart=") for line in settings), unit.name


def test_unit_gives_the_daemon_descriptors_for_many_connections() -> None:
    """Each HTTP connection holds a file descriptor: under systemd's default (1024 soft) a
    thousand of them left the daemon unable to accept /health, the API or /admin."""
    settings = [line.strip() for line in UNIT.read_text().splitlines()]
    limits = [
        line.removeprefix("LimitNOFILE=") for line in settings if line.startswith("LimitNOFILE=")
    ]
    assert limits and limits[-1].isdigit() and int(limits[-1]) >= 65536, limits


def test_unit_does_not_forbid_writable_executable_memory() -> None:
    """PyTorch's CPU kernels are JIT-compiled; see the unit's comment on MemoryDenyWriteExecute."""
    settings = [line.strip() for line in UNIT.read_text().splitlines()]
    assert not any(line.startswith("MemoryDenyWriteExecute=") for line in settings)
    assert "Type=notify" in settings and "NotifyAccess=main" in settings


# -- sd_notify -----------------------------------------------------------------------------------
@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket playing systemd's part, at a short path (sun_path holds 108 bytes)."""
    folder = tempfile.mkdtemp(prefix="kvg-")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()
    shutil.rmtree(folder)


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_lifecycle_messages(receiver: socket.socket) -> None:
    assert sdnotify.ready("serving smollm2-135m")
    assert recv(receiver) == "READY=1\nSTATUS=serving smollm2-135m"
    assert sdnotify.status("draining\n3 requests left") and sdnotify.watchdog()
    assert recv(receiver) == "STATUS=draining 3 requests left"  # one line: no forged keys
    assert recv(receiver) == "WATCHDOG=1"
    assert sdnotify.stopping() and sdnotify.extend_timeout(1.5)
    assert recv(receiver) == "STOPPING=1"
    assert recv(receiver) == "EXTEND_TIMEOUT_USEC=1500000"


@pytest.mark.parametrize(
    ("halted", "draining", "said"),
    [
        (False, False, "open"),
        (True, False, "halted"),
        (False, True, "closed"),
        (True, True, "closed"),
    ],
)
def test_status_line_says_admission_is_closed_once_stopping(
    halted: bool, draining: bool, said: str
) -> None:
    """`systemctl status` shows the STATUS line: after STOPPING=1 every new request gets 503
    shutting_down, so it must not say admission is open."""
    from types import SimpleNamespace

    from kvguard.daemon.service import Service

    snap = SimpleNamespace(
        num_running=2, num_waiting=1, num_swapped=0, kv_cache_usage_ratio=0.5,
        kv_cache_dtype="fp32", admission={"halted": halted},
    )  # fmt: skip
    svc = SimpleNamespace(engine=SimpleNamespace(latest_snapshot=snap), draining=draining)
    line = Service._status_line(svc)  # type: ignore[arg-type]
    assert line.endswith(f"admission={said}") and "running=2 waiting=1" in line


def test_reloading_carries_the_monotonic_clock(receiver: socket.socket) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = recv(receiver).split("\n")
    assert first == "RELOADING=1"
    key, _, usec = second.partition("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after
    assert sdnotify.ready()
    assert recv(receiver) == "READY=1"


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"kvguard-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.watchdog()
        assert recv(sock) == "WATCHDOG=1"


def test_outside_systemd_is_a_quiet_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sdnotify.ready() and not sdnotify.notify("WATCHDOG=1")
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/kvguard/notify")
    assert not sdnotify.status("nobody listens")  # reported, never raised


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert sdnotify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert sdnotify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    assert sdnotify.watchdog_interval() is None


# -- kvguard systemd export ----------------------------------------------------------------------
SYSTEMD_DIR = UNIT.parent
SCRIPT = Path(sys.executable).parent / "kvguard"  # this venv's console script
PACKAGE = Path(kvguard.daemon.__file__).resolve().parents[1]  # kvguard/, or the checkout


def hidden(path: Path) -> bool:
    """Whether the units' ProtectHome= and PrivateTmp= hide `path` from the service (the export
    warns: a venv under a home or temporary directory, a CI runner's)."""
    return any(path.is_relative_to(d) for d in ("/home", "/root", "/run/user", "/tmp", "/var/tmp"))


def export(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(SCRIPT), "systemd", "export", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_exported_units_run_this_installation_and_verify(analyzer: str, tmp_path: Path) -> None:
    """After `pip install kvguard` there is no daemon/systemd/ to copy from: the export writes
    the shipped files, their ExecStart= naming the installed script in place of the
    /usr/local/bin/kvguard the shipped units expect, and systemd takes them as they are."""
    out = tmp_path / "out"
    proc = export("--dir", str(out))
    assert proc.returncode == 0, proc.stderr
    python = Path(sys.executable).resolve()  # the script's: this venv's python, links followed
    runs_on = (SCRIPT.resolve(), python, Path(sys.base_prefix).resolve(), PACKAGE)
    assert ("hidden from the service" in proc.stderr) == any(hidden(p) for p in runs_on)
    assert (f"{python} (the Python the script runs) is hidden" in proc.stderr) == hidden(python)
    written = ["kvguard.service", "kvguard-worker@.service", "etc/kvguard/config.yaml"]
    assert proc.stdout.splitlines()[:3] == [str(out / rel) for rel in written]
    for rel in written:
        shipped = (SYSTEMD_DIR / rel).read_text()
        want = shipped.replace(SHIPPED_EXEC, f"ExecStart={SCRIPT.resolve()} ")
        assert (out / rel).read_text() == want, rel
        assert rel.endswith(".yaml") or want != shipped, rel  # each unit's ExecStart= is replaced
    worker = out / "kvguard-worker@3.service"  # verify takes an instance, not the template
    shutil.copy(out / "kvguard-worker@.service", worker)
    for unit in (out / "kvguard.service", worker):
        proc = analyze("verify", str(unit))
        assert (proc.returncode, proc.stderr, proc.stdout) == (0, "", ""), unit
    # run through a link on the operator's PATH: the unit names the script the link leads to
    link = tmp_path / "bin" / "kvguard"
    link.parent.mkdir()
    link.symlink_to(SCRIPT)
    cmd = [str(link), "systemd", "export", "--dir", str(tmp_path / "l")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "l" / "kvguard.service").read_text() == (out / "kvguard.service").read_text()
    # run as `python -m` (no script named kvguard ran): the script beside the interpreter
    cmd = [sys.executable, "-m", "kvguard.daemon.cli", "systemd", "export", "--dir"]
    proc = subprocess.run(cmd + [str(tmp_path / "m")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "m" / "kvguard.service").read_text() == (out / "kvguard.service").read_text()


def test_the_shipped_config_starts_without_a_warning(smollm2_dir: Path, tmp_path: Path) -> None:
    """A fresh install following the README starts kvguard.service on the shipped
    /etc/kvguard/config.yaml, and the README has operators read `journalctl -u kvguard -p
    warning`: the shipped file set the brief's inert recovery and oom_alert_threshold keys, and
    every start logged three warnings that they change nothing. The daemon started on it (only
    the port moved, to a free one) logs no WARNING or ERROR line up to ready and through a stop."""
    from tests.test_server import TEST_DAEMON_ENV, free_port, until

    port = free_port()
    config = SYSTEMD_DIR / "etc" / "kvguard" / "config.yaml"
    env = {**os.environ, **TEST_DAEMON_ENV, "STATE_DIRECTORY": str(tmp_path)}
    env.pop("CREDENTIALS_DIRECTORY", None)  # as a unit without the admin.token credential
    log_path = tmp_path / "daemon.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(SCRIPT), "serve", "--config", str(config), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
        try:
            until(lambda: _ready(proc, port), 120, "the daemon ready")
        finally:
            proc.terminate()
            rc = proc.wait(60)
    text = log_path.read_text()
    assert rc == 0 and " ready: " in text, text
    warned = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
    assert warned == [], text


def _ready(proc: subprocess.Popen, port: int) -> bool:
    """Whether the daemon answers /ready; one that exited is a failure, not a wait."""
    import httpx

    assert proc.poll() is None, f"the daemon exited {proc.returncode}"
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_export_keeps_an_edited_file_unless_forced(tmp_path: Path) -> None:
    assert export("--dir", str(tmp_path)).returncode == 0
    assert export("--dir", str(tmp_path)).returncode == 0  # the same content again: no clash
    unit = tmp_path / "kvguard.service"
    unit.write_text(unit.read_text() + "# an operator's edit\n")
    edited = unit.read_text()
    proc = export("--dir", str(tmp_path))
    assert proc.returncode == 2 and f"{unit} already exist(s)" in proc.stderr, proc.stderr
    assert "--force" in proc.stderr and unit.read_text() == edited
    assert export("--dir", str(tmp_path), "--force").returncode == 0
    assert "# an operator's edit" not in unit.read_text()


def test_export_escapes_an_odd_script_path_and_refuses_what_systemd_cannot_run(
    analyzer: str, tmp_path: Path
) -> None:
    """A blank splits ExecStart= and % starts a specifier: quoted and doubled, the unit still
    verifies; a quote or backslash systemd refuses in an executable's name outright, so the
    export does too, naming the path, before writing anything."""
    odd = tmp_path / "odd 100%dir"
    odd.mkdir()
    (odd / "kvguard").symlink_to(SCRIPT)
    out = tmp_path / "out"
    proc = export("--dir", str(out), "--kvguard", str(odd / "kvguard"))
    assert proc.returncode == 0, proc.stderr
    said = f"{odd / 'kvguard'} (the kvguard script) is hidden from the service"
    assert (said in proc.stderr) == hidden(odd), proc.stderr
    line = f'ExecStart="{str(odd).replace("%", "%%")}/kvguard" serve '
    assert any(x.startswith(line) for x in (out / "kvguard.service").read_text().splitlines())
    proc = analyze("verify", str(out / "kvguard.service"))
    assert (proc.returncode, proc.stderr, proc.stdout) == (0, "", "")
    quoted = tmp_path / 'say "hi"'
    quoted.mkdir()
    (quoted / "kvguard").symlink_to(SCRIPT)
    proc = export("--dir", str(tmp_path / "none"), "--kvguard", str(quoted / "kvguard"))
    assert proc.returncode == 2 and "systemd refuses an executable path holding '\"'" in proc.stderr
    assert not (tmp_path / "none").exists()
    proc = export("--dir", str(tmp_path / "none"), "--kvguard", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "not an executable file" in proc.stderr, proc.stderr


def test_export_warns_of_a_python_the_service_cannot_see(tmp_path: Path) -> None:
    """A venv made from pyenv's Python (under /root or /home) has a script the service can
    see and a bin/python linking to one it cannot: every start fails (203/EXEC). The export
    names that Python, from the script's first line in either form pip writes, and the
    setting that hides it; an `env` line names no file, so nothing is said of it."""
    pyenv = "/home/op/.pyenv/versions/3.11.7/bin/python3.11"
    spaced = "/root/my venvs/base/bin/python3"
    trampoline = f"#!/bin/sh\n'''exec' \"{spaced}\" \"$0\" \"$@\"\n' '''\n"  # pip's, for a blank
    for first_lines, warned in (
        (f"#!{pyenv}\n", pyenv),
        (trampoline, spaced),
        ("#!/usr/bin/env python3\n", None),
    ):
        script = tmp_path / "bin" / "kvguard"
        script.parent.mkdir(exist_ok=True)
        script.write_text(first_lines + "from kvguard.daemon.cli import main\nmain()\n")
        script.chmod(0o755)
        proc = export("--dir", str(tmp_path / "out"), "--kvguard", str(script), "--force")
        assert proc.returncode == 0, proc.stderr
        said = [line for line in proc.stderr.splitlines() if "(the Python the script runs)" in line]
        assert said == (
            []
            if warned is None
            else [
                f"kvguard: warning: {warned} (the Python the script runs) is hidden from the "
                "service (the units set ProtectHome=yes): make the venv from a Python the "
                "service can see (e.g. `sudo /usr/bin/python3 -m venv /opt/kvguard`) and install "
                "kvguard there"
            ]
        ), proc.stderr


def test_export_warns_of_a_kvguard_package_the_service_cannot_see() -> None:
    """An editable install imports kvguard from its checkout, which may lie in a home or
    temporary directory the units hide: the export names where this kvguard was imported
    from. Here a copy of the package under /tmp (PrivateTmp=yes) is imported first."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        package = Path(tmp).resolve() / "src" / "kvguard"
        for sub in ("daemon", "alerts"):  # what `systemd export` imports of kvguard's own
            shutil.copytree(PACKAGE / sub, package / sub, ignore=shutil.ignore_patterns("__py*"))
        proc = subprocess.run(
            [sys.executable, "-m", "kvguard.daemon.cli", "systemd", "export", "--dir", "out"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp,
            env={**os.environ, "PYTHONPATH": str(package.parent)},
        )
        assert proc.returncode == 0, proc.stderr
        assert (
            f"kvguard: warning: {package} (the kvguard package it imports) is hidden from the "
            "service (the units set PrivateTmp=yes): install kvguard where the service can see it"
        ) in proc.stderr, proc.stderr


def test_the_readmes_recipe_installs_what_the_export_writes(tmp_path: Path) -> None:
    """The README's systemd steps work after `pip install kvguard`: every file they install
    from the export's directory is one the export writes."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    found = re.search(r"^kvguard systemd export --dir (\S+)", readme, re.M)
    assert found, "the README's systemd steps no longer export the units"
    sources = re.findall(
        rf"^sudo install -D -m 0644 ({re.escape(found.group(1))}/\S+) ", readme, re.M
    )
    assert len(sources) == 2, sources  # the unit and the config file
    proc = subprocess.run(
        [str(SCRIPT), "systemd", "export", "--dir", found.group(1)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert all((tmp_path / src).is_file() for src in sources), sources
