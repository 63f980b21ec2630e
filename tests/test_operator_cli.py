"""What an operator meets around the daemon: systemd's start timeout while it loads, `kvguard
bench`'s checkout and paths, `kvguard db downgrade` and upgrade's direction, a reload without a
config file, inert keys on reload, `kvguard status` in dry-run mode, and the documented keys;
READY=1 once the API answers, a stop while the model loads, the log's one format; `python -m
kvguard.daemon` as the command.

Real parts throughout: a real `kvguard serve` process under a datagram socket playing systemd,
real SQLite files, a real fake checkout whose benchmark script records how it was run.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, redirect_stdout
from pathlib import Path

import httpx
import pytest

from kvguard.daemon import sdnotify
from kvguard.daemon.version import kvguard_version
from tests.test_server import KVGUARD, TOKEN, Daemon, free_port, until

REPO = Path(__file__).resolve().parents[1]
EXTEND = "EXTEND_TIMEOUT_USEC=90000000"  # 90 s more, as the unit's comment and README say


class Notify:
    """A datagram socket playing systemd's part, at a short path (sun_path holds 108 bytes);
    every message it gets, in order. `on_ready`, if set, runs as the first READY=1 arrives,
    before the next message is read (as systemd starts what waits for the unit then); its
    result goes to `at_ready`."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="kvg-")
        self.path = os.path.join(self.folder, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.msgs: list[str] = []
        self.on_ready: Callable[[], object] | None = None
        self.at_ready: list[object] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv, daemon=True)
        self._thread.start()

    def _recv(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            if msg.startswith("READY=1") and self.on_ready and not self.at_ready:
                self.at_ready.append(self.on_ready())
            self.msgs.append(msg)

    def first(self) -> list[str]:
        """Each message's first line."""
        return [m.split("\n")[0] for m in list(self.msgs)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        shutil.rmtree(self.folder)


# -- systemd's start timeout -----------------------------------------------------------------------
def _extender_running() -> bool:
    return any(t.name == "kvguard-start-timeout" for t in threading.enumerate())


@pytest.fixture
def notify(monkeypatch: pytest.MonkeyPatch) -> Iterator[Notify]:
    n = Notify()
    monkeypatch.setenv("NOTIFY_SOCKET", n.path)
    yield n
    n.close()


def test_a_start_asks_for_more_time_until_it_ends(notify: Notify) -> None:
    """At once, then every period, until the start ends; nothing once it has ended, even when
    it ends by failing."""
    with sdnotify.extending_timeout(limit_s=600, by_s=90, every_s=0.05):
        assert _extender_running()
        until(lambda: len(notify.msgs) >= 3, 30, "three requests for more time")
    assert not _extender_running()  # joined: it alone sends them, so none can follow
    sent = len(notify.msgs)
    assert set(notify.msgs) == {"EXTEND_TIMEOUT_USEC=90000000"}
    with pytest.raises(RuntimeError), sdnotify.extending_timeout(limit_s=600, every_s=0.05):
        until(lambda: len(notify.msgs) >= sent + 2, 30, "requests in a second start")
        raise RuntimeError("the model failed to load")
    assert not _extender_running()  # joined: no request can follow the failure


def test_a_start_that_takes_too_long_stops_asking(
    notify: Notify, caplog: pytest.LogCaptureFixture
) -> None:
    """A hung start must still be ended by systemd: past the limit the requests stop."""
    with (
        caplog.at_level(logging.WARNING, logger=sdnotify.__name__),
        sdnotify.extending_timeout(limit_s=0.2, by_s=90, every_s=0.05),
    ):
        until(lambda: not _extender_running(), 30, "the requests to stop by themselves")
        assert "no longer extending systemd's start timeout" in caplog.text
        assert notify.msgs  # it did ask first


def test_outside_systemd_nothing_is_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    with sdnotify.extending_timeout(every_s=0.01):
        assert not _extender_running()


def test_the_units_start_timeout_comment_says_what_the_daemon_does() -> None:
    unit = (REPO / "daemon" / "systemd" / "kvguard.service").read_text()
    assert "TimeoutStartSec=5min" in unit and "EXTEND_TIMEOUT_USEC" in unit
    assert (sdnotify.EXTEND_BY_S, sdnotify.EXTEND_EVERY_S) == (90, 30)
    assert "asks for 90s more every 30s" in unit


@contextmanager
def waiting_for_a_remote_rank(
    tmp_path: Path, join_timeout: str, waits: str, **env: str
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A real `kvguard serve` whose start waits up to `join_timeout` for a remote rank that
    never comes (a start that stays in loading for as long as a test needs, without a guessed
    time), once its log says it waits (`waiting up to {waits} for remote ranks`): the process
    and its log; killed after if still running."""
    key = tmp_path / "worker.key"
    key.write_text("a shared secret for the workers\n")
    key.chmod(0o600)
    config = tmp_path / "config.yaml"
    config.write_text(
        "serving:\n  model: tiny\n  pipeline_parallel: 2\n  distributed:\n"
        f"    remote_ranks: [1]\n    join_timeout: {join_timeout}\n    authkey_file: {key}\n"
        f"api:\n  port: {free_port()}\n"
        f"audit:\n  url: sqlite:///{tmp_path / 'audit.db'}\n"
    )
    log = tmp_path / "daemon.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [KVGUARD, "serve", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STATE_DIRECTORY": str(tmp_path), **env},
        )
        try:
            until(lambda: f"waiting up to {waits} for remote ranks" in log.read_text(), 60, "wait")
            yield proc, log
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_start_waiting_for_remote_ranks_asks_for_time_while_it_waits(tmp_path: Path) -> None:
    """The report's case: a remote rank that has not joined holds the start (up to
    join_timeout, 10 min by default, past the unit's TimeoutStartSec=5min). The daemon asks
    for more time while it waits, and the start that then fails says no READY."""
    notify = Notify()
    try:
        waiting = waiting_for_a_remote_rank(tmp_path, "3s", "3s", NOTIFY_SOCKET=notify.path)
        with waiting as (proc, _log):
            until(lambda: EXTEND in notify.first(), 30, "a request for more time")
            assert proc.wait(60) != 0  # the rank never came: the start fails
        assert "READY=1" not in notify.first(), notify.first()
    finally:
        notify.close()


# -- a daemon started without --config, dry run, under systemd ---------------------------------
class Bare(Daemon):
    """`kvguard serve --model tiny --port P --dry-run`: no config file. The admin token comes as
    systemd's credential, the audit database goes to $STATE_DIRECTORY."""

    def __init__(self, tmp: Path, notify: Notify) -> None:  # Daemon's helpers, its own start
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = tmp / "admin.token"
        self.token.write_text(TOKEN + "\n")
        env = {
            **os.environ,
            "NOTIFY_SOCKET": notify.path,
            "CREDENTIALS_DIRECTORY": str(tmp),
            "STATE_DIRECTORY": str(tmp),
        }
        self.log_path = tmp / "daemon.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        notify.on_ready = self.ready_now
        argv = [KVGUARD, "serve", "--model", "tiny", "--port", str(self.port), "--dry-run"]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready(120)

    def ready_now(self) -> object:
        """What /ready answers a client sent the moment READY=1 arrives (or why none came)."""
        try:
            return httpx.get(self.url + "/ready", timeout=30).status_code
        except httpx.HTTPError as e:
            return repr(e)


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Bare, Notify]]:
    notify = Notify()
    d = Bare(tmp_path_factory.mktemp("bare"), notify)
    yield d, notify
    code = d.stop()
    notify.close()
    assert code == 0


def test_the_start_asks_systemd_for_time_before_ready_and_not_after(
    bare: tuple[Bare, Notify],
) -> None:
    _, notify = bare
    until(lambda: "READY=1" in notify.first(), 30, "READY=1")
    first = notify.first()
    ready = first.index("READY=1")
    assert EXTEND in first[:ready], first
    assert EXTEND not in first[ready:], first


def test_ready_goes_out_once_the_api_answers(bare: tuple[Bare, Notify]) -> None:
    """READY=1 (and the log's `ready` line, said together) come once the API accepts
    connections: what systemd starts after the unit, or a client sent then, is answered. They
    went out when the model was loaded, up to a second before serving began: refused."""
    _, notify = bare
    until(lambda: notify.at_ready, 30, "READY=1")
    assert notify.at_ready == [200]


def test_the_log_has_one_format_and_no_routine_library_lines(bare: tuple[Bare, Notify]) -> None:
    """uvicorn's lines in kvguard's format (they had their own, `INFO:     Started ...`);
    alembic's two lines naming the audit database's dialect, at every start, left out, while
    its lines saying the schema changed stay."""
    d, _ = bare
    log = d.log_path.read_text()
    started = r"^\S+ \S+ INFO uvicorn\.error: Started server process \[\d+\]$"
    assert re.search(started, log, re.M), log
    assert not re.search(r"^(INFO|WARNING|ERROR):", log, re.M), log
    assert "Context impl" not in log and "Will assume" not in log, log
    assert "INFO alembic.runtime.migration: Running upgrade  -> 0001" in log, log


def test_status_says_the_rules_run_dry(bare: tuple[Bare, Notify]) -> None:
    d, _ = bare
    out = subprocess.run(
        [KVGUARD, "status", "--url", d.url, "--token-file", str(d.token)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"^dry run      on: rules record what they would do", out.stdout, re.M), (
        out.stdout
    )


def status_of(d: Daemon) -> str:
    """What `kvguard status` prints for the daemon `d`."""
    token = d.config.parent / "admin.token"
    out = subprocess.run(
        [KVGUARD, "status", "--url", d.url, "--token-file", str(token)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_status_says_the_last_reload_was_refused_when_and_why(tmp_path: Path) -> None:
    """`systemctl reload` only sends SIGHUP, which succeeds whatever the file holds: a refused
    reload was said by the log and the STATUS= line, while `kvguard status` (and /admin/state)
    showed the daemon as after any reload. Now they say it was refused, when, and each
    problem, until a reload applies."""
    d = Daemon(tmp_path, debug_hooks=False)
    try:
        good = d.config.read_text()
        assert "max_model_len: 512}" in good
        d.config.write_text(good.replace("max_model_len: 512}", "max_num_seq: 3, block_size: 0}"))
        d.proc.send_signal(signal.SIGHUP)  # as `systemctl reload` does
        log = Path(d.log.name)
        until(lambda: "reload refused" in log.read_text(), 60, "the SIGHUP's reload refused")
        refused = d.admin("GET", "/admin/state").json().get("reload_refused")
        assert (
            refused is not None
            and refused["outcome"] == "refused"
            and refused["config"] == str(d.config)
        ), refused
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", refused["at"]), refused
        where = f"{d.config}:1: serving."
        assert len(refused["errors"]) == 2, refused["errors"]
        assert all(e.startswith(where) for e in refused["errors"]), refused["errors"]
        assert any("max_num_seq: unknown key" in e for e in refused["errors"]), refused["errors"]
        out = status_of(d)
        said = (
            f"reload       refused at {refused['at']}: nothing of {d.config} applied, the "
            "config in force stands"
        )
        lines = out.splitlines()
        assert said in lines, out
        after = lines[lines.index(said) + 1 : lines.index(said) + 3]
        assert sorted(after) == sorted("             " + e for e in refused["errors"]), out

        d.config.write_text(good)
        r = d.admin("POST", "/admin/reload")
        assert r.status_code == 200 and r.json()["reloaded"], r.text
        assert d.admin("GET", "/admin/state").json()["reload_refused"] is None
        out = status_of(d)
        assert not re.search(r"^reload ", out, re.M) and out.startswith("model "), out
    finally:
        assert d.stop() == 0


def test_status_names_the_option_or_variable_of_a_malformed_url(tmp_path: Path) -> None:
    """A URL httpx refuses to parse (a port that is no number, a bracket left open, no
    scheme) is an error naming where it came from, not a traceback."""
    token = tmp_path / "admin.token"
    token.write_text("secret\n")
    env = {k: v for k, v in os.environ.items() if k != "KVGUARD_URL"}
    for url, via, extra, said in (
        ("http://localhost:80a", "--url", {}, "Invalid port: '80a'"),
        ("http://[::1", "--url", {}, "Invalid port"),
        ("localhost:8000", "--url", {}, "missing an 'http://' or 'https://' protocol"),
        ("http://localhost:port", "$KVGUARD_URL", {"KVGUARD_URL": "http://localhost:port"}, ""),
    ):
        argv = [KVGUARD, "status", "--token-file", str(token)]
        out = subprocess.run(
            argv + ([] if extra else ["--url", url]),
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, **extra},
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        head = f"kvguard: error: {via}: {url!r} is not a usable URL: "
        assert out.stderr.startswith(head), out.stderr
        assert said in out.stderr and "(expected e.g. http://127.0.0.1:8000)" in out.stderr


def test_status_names_a_malformed_url_before_a_missing_token_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a host with no /etc/kvguard/admin.token, `kvguard status --url http://localhost:80a`
    said only that the token could not be read, and the README's promised URL error came once
    that was fixed: the URL is checked first, as is a scheme httpx would refuse to send to."""
    from kvguard.daemon.cli import main

    missing = tmp_path / "admin.token"
    for url, said in (
        ("http://localhost:80a", "Invalid port: '80a'"),
        ("ftp://127.0.0.1:8000", "unsupported protocol 'ftp://'"),
        ("http://", "no host"),
    ):
        assert main(["status", "--url", url, "--token-file", str(missing)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvguard: error: --url: {url!r} is not a usable URL: "), err
        assert said in err and str(missing) not in err, err


def test_audit_of_a_config_without_audit_url_does_not_ask_for_that_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvguard audit list --config FILE` from another directory than the daemon's, FILE
    setting no audit.url: the error told the user to "pass --db URL or --config FILE", the
    --config they had passed and that cannot name the daemon's ./var/. It now says why FILE
    does not help and what does."""
    from kvguard.daemon import config
    from kvguard.daemon.cli import main

    monkeypatch.setattr(config, "SYSTEMD_STATE_DIR", tmp_path / "no-var-lib")
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("KVGUARD_STATE_DIR", raising=False)
    (tmp_path / "daemon").mkdir()
    cfg = tmp_path / "daemon" / "config.yaml"
    cfg.write_text("serving: {model: tiny}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "list", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvguard: error: no audit database at {tmp_path}/var/audit.db: "), err
    assert f"{cfg} sets no audit.url" in err and "--config FILE" not in err, err
    assert "--db sqlite:///PATH/audit.db" in err and "KVGUARD_STATE_DIR" in err, err
    assert not (tmp_path / "var").exists()  # nothing created where the daemon does not look


def test_a_reload_without_a_config_file_reads_the_rules_again(bare: tuple[Bare, Notify]) -> None:
    """SIGHUP (and POST /admin/reload) of a daemon started without --config: the rules file,
    the packaged default, is read again and the flags (--dry-run) applied again; it says so."""
    from kvguard.rules.schema import default_rules_path, load_rules

    d, notify = bare
    rules = len(load_rules(default_rules_path()).rules)
    r = d.admin("POST", "/admin/reload")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["reloaded"] and body["rules_reloaded"] and body["rules"] == rules, body
    assert body["changes"] == {} and body["restart_needed"] == [], body
    assert d.admin("GET", "/admin/state").json()["dry_run"] is True  # the flag holds
    readies = notify.first().count("READY=1")
    d.proc.send_signal(signal.SIGHUP)
    until(lambda: notify.first().count("READY=1") > readies, 60, "READY=1 after the SIGHUP")
    said = "reloaded the built-in defaults (started without --config), rules "
    until(lambda: d.log_path.read_text().count(said) >= 2, 30, "both reloads logged")
    assert f"rules {default_rules_path()}: no changes" in d.log_path.read_text()


# -- a stop while the daemon loads ---------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_while_loading_says_so_and_ends_by_the_signal(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Ctrl-C (or SIGTERM) while the start waits on its engine: one line saying so, and the
    process ends by that signal (a shell reports 130 or 143). Ctrl-C left through the
    interpreter's exit, which aborted in the C++ of the thread still loading (134), and
    SIGTERM ended the start without a word."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with waiting_for_a_remote_rank(tmp_path, "10m", "600s", TMPDIR=str(tmp)) as (proc, log):
        assert [p.name[:11] for p in tmp.iterdir()] == ["kvguard-tp-"]  # the rendezvous
        proc.send_signal(sig)
        code = proc.wait(60)
    text = log.read_text()
    assert code == -sig, (code, text)
    assert f"WARNING kvguard.daemon: {sig.name}: interrupted while loading; exiting" in text
    assert "Traceback" not in text, text
    assert list(tmp.iterdir()) == []  # it stayed in /tmp


# The start's last step (the model loaded, the audit store up) sends SIGTERM to the daemon itself:
# the signal arrives at a known point of the start, and the handler runs in the main thread.
SIGTERM_AS_THE_START_ENDS = """\
import os, signal, sys
from kvguard.daemon.cli import main
from kvguard.daemon.control_plane import ControlPlane
start = ControlPlane.start
def start_then_sigterm(self):
    start(self)
    os.kill(os.getpid(), signal.SIGTERM)
ControlPlane.start = start_then_sigterm
sys.exit(main(["serve", "--config", sys.argv[1]]))
"""


def test_a_stop_while_loading_is_audited_once_the_audit_store_is_up(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    config = tmp_path / "config.yaml"
    config.write_text(
        "serving: {model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}\n"
        f"api: {{host: 127.0.0.1, port: {free_port()}}}\n"
        f"audit: {{url: 'sqlite:///{db}'}}\n"
    )
    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path)}
    argv = [sys.executable, "-c", SIGTERM_AS_THE_START_ENDS, str(config)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stderr)
    assert "SIGTERM: interrupted while loading; exiting" in out.stderr, out.stderr
    assert "ready:" not in out.stderr, out.stderr
    with closing(sqlite3.connect(db)) as c:
        rows = c.execute("SELECT kind, detail FROM events ORDER BY id").fetchall()
    assert rows == [
        ("daemon_start", f"kvguard {kvguard_version()}, model tiny"),
        ("daemon_stop", "exit 143: interrupted by SIGTERM while loading"),
    ]


# -- inert keys on reload ------------------------------------------------------------------------
def test_inert_keys_are_never_waiting_for_a_restart(tmp_path: Path) -> None:
    from kvguard.daemon.config import INERT, load_config
    from kvguard.daemon.service import engine_changes

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("monitoring:\n  oom_alert_threshold: 0.9\n")
    b.write_text(
        "monitoring:\n  oom_alert_threshold: 0.8\n  snapshot_interval: 2s\n"
        "  nvml_poll_interval: 1s\nrecovery:\n  target_vram_usage: 0.5\n"
        "  throttle_threshold: 0.6\nserving:\n  max_model_len: 256\n"
    )
    live, restart = engine_changes(load_config(a), load_config(b))
    assert live == []
    assert restart == ["serving.max_model_len", "monitoring.nvml_poll_interval"]
    assert not set(restart) & set(INERT)


# -- kvguard bench -------------------------------------------------------------------------------
FAKE_BENCH = """\
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if "--json" in args:
    Path(args[args.index("--json") + 1]).write_text("{}")
Path(os.environ["FAKE_BENCH_RECORD"]).write_text(
    json.dumps({"script": sys.argv[0], "argv": args, "cwd": os.getcwd()})
)
"""


def _fake_checkout(root: Path) -> Path:
    (root / "bench").mkdir(parents=True)
    for name in ("overload.py", "chaos.py"):
        (root / "bench" / name).write_text(FAKE_BENCH)
    return root


def _kvguard(*argv: str) -> tuple[int, str]:
    from kvguard.daemon.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        return main(list(argv)), out.getvalue()


def test_a_named_checkout_without_bench_is_an_error_never_another_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--repo` or $KVGUARD_REPO naming no checkout (a typo) must not fall through to this
    file's tree or the cwd, which both hold one here."""
    from kvguard.daemon.bench_cli import find_checkout

    cwd = _fake_checkout(tmp_path / "other")
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("KVGUARD_REPO", raising=False)
    with pytest.raises(ValueError, match=r"^--repo /nonexistent/kvguard: not a kvguard checkout"):
        find_checkout(Path("/nonexistent/kvguard"))
    monkeypatch.setenv("KVGUARD_REPO", str(tmp_path / "typo"))
    with pytest.raises(ValueError, match=rf"^\$KVGUARD_REPO {tmp_path}/typo: not a kvguard"):
        find_checkout(None)
    mine = _fake_checkout(tmp_path / "mine")
    monkeypatch.setenv("KVGUARD_REPO", str(mine))
    assert find_checkout(None) == mine  # the one named, found
    assert find_checkout(Path("../mine")) == mine  # --repo wins, relative to the cwd


def test_bench_runs_the_named_checkout_with_the_callers_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A relative --repo is resolved once, against the caller's cwd; relative --json, --png and
    --workdir land where the caller is, not inside the checkout."""
    repo = _fake_checkout(tmp_path / "checkout")
    caller = tmp_path / "here"
    caller.mkdir()
    record = tmp_path / "record.json"
    monkeypatch.chdir(caller)
    monkeypatch.delenv("KVGUARD_REPO", raising=False)
    monkeypatch.setenv("FAKE_BENCH_RECORD", str(record))
    rc, _ = _kvguard(
        "bench", "overload", "--repo", "../checkout", "--quick", "--json", "out.json",
        "--png", "plot.png", "--workdir", "runs",
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    ran = json.loads(record.read_text())
    assert Path(ran["script"]) == repo / "bench" / "overload.py"
    assert Path(ran["cwd"]).resolve() == caller.resolve()
    assert ran["argv"] == [
        "--quick",
        "--json",
        "out.json",
        "--workdir",
        "runs",
        "--png",
        "plot.png",
    ]
    assert (caller / "out.json").is_file() and not (repo / "out.json").exists()
    monkeypatch.setenv("KVGUARD_REPO", "../nothing-here")
    record.unlink()
    rc, _ = _kvguard("bench", "chaos")
    assert rc == 2 and not record.exists()
    assert "$KVGUARD_REPO ../nothing-here: not a kvguard checkout" in capsys.readouterr().err


# -- kvguard db ----------------------------------------------------------------------------------
def _current(url: str) -> str | None:
    from kvguard.daemon.audit_migrate import current

    return current(url)


def test_db_downgrade_goes_back_and_only_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvguard.daemon.audit_migrate import head

    url = f"sqlite:///{tmp_path / 'audit.db'}"
    assert _kvguard("db", "upgrade", "--db", url)[0] == 0
    newest = head()
    rc, out = _kvguard("db", "downgrade", "--db", url, "--revision", "0003")
    assert (rc, out) == (0, f"{url}: at revision 0003\n"), capsys.readouterr().err
    for rev in ("0003", newest, "head", "+1"):  # not older than 0003: refused, nothing done
        rc, _ = _kvguard("db", "downgrade", "--db", url, "--revision", rev)
        err = capsys.readouterr().err
        assert rc == 2 and f"is at revision 0003; {rev} is not older" in err, (rev, err)
        assert _current(url) == "0003"
    rc, out = _kvguard("db", "downgrade", "--db", url, "--revision", "-1")
    assert (rc, out) == (0, f"{url}: at revision 0002\n")
    rc, _ = _kvguard("db", "downgrade", "--db", url, "--revision", "zzz")
    assert rc == 2 and "--revision zzz: unknown revision" in capsys.readouterr().err
    rc, out = _kvguard("db", "downgrade", "--db", url, "--revision", "base")
    assert (rc, out) == (0, f"{url}: at revision base (no audit tables)\n")
    assert _current(url) is None
    with pytest.raises(SystemExit) as e:  # --revision is required: no accidental drop
        _kvguard("db", "downgrade", "--db", url)
    assert e.value.code == 2 and "--revision" in capsys.readouterr().err
    missing = tmp_path / "none.db"  # a downgrade never creates a database
    rc, _ = _kvguard("db", "downgrade", "--db", f"sqlite:///{missing}", "--revision", "base")
    assert rc == 2 and not missing.exists()


def test_db_upgrade_refuses_an_older_revision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    assert _kvguard("db", "upgrade", "--db", url, "--revision", "0003")[0] == 0
    rc, out = _kvguard("db", "upgrade", "--db", url, "--revision", "0002")
    err = capsys.readouterr().err
    assert rc == 2 and out == "" and _current(url) == "0003"
    assert "is at revision 0003, newer than 0002" in err and "kvguard db downgrade" in err, err
    rc, out = _kvguard("db", "upgrade", "--db", url, "--revision", "0003")  # where it is: fine
    assert (rc, out) == (0, f"{url}: at revision 0003\n")


def test_a_failed_db_upgrade_leaves_no_database_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "new" / "state"
    path = folder / "audit.db"
    rc, _ = _kvguard("db", "upgrade", "--db", f"sqlite:///{path}", "--revision", "zzz")
    assert rc == 2 and "zzz" in capsys.readouterr().err
    assert not path.exists() and not (tmp_path / "new").exists()
    # a migration that fails once the file is made (opened for real, then the step raises)
    from alembic import command
    from alembic.util import CommandError

    def broken(*_a: object, **_k: object) -> None:
        assert path.is_file()  # made by the real connection
        raise CommandError("a migration step failed")

    monkeypatch.setattr(command, "upgrade", broken)
    rc, _ = _kvguard("db", "upgrade", "--db", f"sqlite:///{path}")
    assert rc == 2 and "a migration step failed" in capsys.readouterr().err
    assert not path.exists() and not (tmp_path / "new").exists()
    folder.mkdir(parents=True)
    (folder / "keep").write_text("")  # a folder that holds something else stays
    rc, _ = _kvguard("db", "upgrade", "--db", f"sqlite:///{path}")
    assert rc == 2 and not path.exists() and (folder / "keep").is_file()


# -- documentation -----------------------------------------------------------------------------
def test_the_example_config_and_readme_name_the_keys() -> None:
    from kvguard.daemon.config import INERT, DaemonConfig

    text = (REPO / "daemon" / "systemd" / "etc" / "kvguard" / "config.yaml").read_text()
    for section, field in DaemonConfig.model_fields.items():
        for key in field.annotation.model_fields:
            if f"{section}.{key}" not in INERT:
                assert re.search(rf"^\s*#?\s*{key}:", text, re.M), f"{section}.{key}"
    assert "`api.served_model_name`" in (REPO / "README.md").read_text()


def test_status_help_names_the_token_file_variable() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvguard.daemon.cli", "status", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0 and "$KVGUARD_ADMIN_TOKEN_FILE" in out.stdout, out.stdout


def test_serve_and_generate_help_name_every_form_of_model() -> None:
    """`serve --model` takes what `generate --model` and serving.model take, a .gguf file too
    (the README serves one): both help texts say so alike."""
    for command in ("serve", "generate"):
        out = subprocess.run(
            [KVGUARD, command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "1000"},  # no line wrapped, at a hyphen neither
        )
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())
        assert (
            "--model NAME|PATH a known model name (see `kvguard model list`), a Hugging "
            "Face-format model directory or a .gguf file"
        ) in text, (command, text)


def test_version_names_the_installed_distribution() -> None:
    from importlib.metadata import version

    out = subprocess.run([KVGUARD, "--version"], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"kvguard {version('kvguard')}\n", "")


def test_version_from_a_source_tree_that_is_not_installed(tmp_path: Path) -> None:
    """kvguard on PYTHONPATH with no distribution metadata (no site-packages: -S): a plain
    answer that says so, exit 0, no traceback."""
    package = tmp_path / "kvguard"
    package.mkdir()
    for folder in ("daemon", "engine", "kernels", "migrations", "rules", "alerts"):
        (package / folder).symlink_to(REPO / folder)
    out = subprocess.run(
        [sys.executable, "-S", "-m", "kvguard.daemon.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith("kvguard (unknown version: not installed"), out.stdout


def test_the_readme_documents_the_db_commands_that_exist() -> None:
    from kvguard.daemon.cli import build_parser

    readme = (REPO / "README.md").read_text()
    parser = build_parser()
    commands = set(re.findall(r"kvguard db (\w+)", readme))
    assert {"upgrade", "downgrade", "current"} <= commands, commands
    for command in commands:
        with pytest.raises(SystemExit) as e, redirect_stdout(io.StringIO()):
            parser.parse_args(["db", command, "--help"])
        assert e.value.code == 0, command  # 2: argparse's "invalid choice"


def test_python_dash_m_runs_the_kvguard_command(tmp_path: Path) -> None:
    """`python -m kvguard.daemon` is the `kvguard` command for a Python whose scripts folder is
    not on PATH: same usage line, same version, same exit status for a bad command."""
    run = [sys.executable, "-m", "kvguard.daemon"]
    env = {**os.environ, "KVGUARD_HOME": str(tmp_path)}
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: kvguard "), helped.stdout[:200]
    assert "serve" in helped.stdout and "audit" in helped.stdout
    version = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=60)
    script = subprocess.run([KVGUARD, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout == script.stdout
    bad = subprocess.run([*run, "no-such-command"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'no-such-command'" in bad.stderr


def test_status_gives_the_range_of_kv_pool_sizes_of_uneven_stages() -> None:
    """`pipeline_layers: [2, 28]`: rank 0's pool is a fourteenth of rank 1's, and the status
    line said rank 0's size alone, "per rank"."""
    from kvguard.daemon.cli_serve import _ranks_line

    tp = {"size": 1, "pipeline_stages": 2, "worker_pids": [7], "failure": None}
    uneven = _ranks_line({**tp, "kv_cache_rank_bytes": [18 * 2**20, 256 * 2**20]})
    assert "KV 18-256 MiB per rank" in uneven
    even = _ranks_line({**tp, "kv_cache_rank_bytes": [64 * 2**20, 64 * 2**20]})
    assert "KV 64 MiB per rank" in even
