"""The audit and the operator's commands as an incident responder meets them afterwards: a run
killed outright named at the next start (`unclean_stop`), `kvguard audit export -o` that never
empties the previous export, `kvguard status --config`, an unknown incident id and a database
URL naming a directory as errors saying so, and an incident named after its first remedy that
changed something, with action details in the singular for one.

Real parts throughout: `kvguard serve` processes on loopback (tests/test_server), SQLite files,
the CLI's own entry point, a real tiny engine under the evaluator."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
from contextlib import closing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event as sa_event

from kvguard.daemon.audit import AuditStore, utcnow
from kvguard.daemon.audit_cli import _write_output
from tests.test_audit import _act, kvguard
from tests.test_model_cache import as_a_user_modes_apply_to
from tests.test_remedy_holds import Live
from tests.test_rules_reload_lifecycle import EVICT, FP8_RUNG, greedy
from tests.test_server import TOKEN, Daemon, until

NOW = utcnow()


def _rows(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    try:
        with closing(sqlite3.connect(db)) as c:
            return c.execute(sql, args).fetchall()
    except sqlite3.Error:  # not created or not migrated yet
        return []


def _events(url: str, kind: str) -> list[dict[str, Any]]:
    """The events of `kind`, as `kvguard audit export --table events --json` lists them."""
    rc, out = kvguard("audit", "export", "--table", "events", "--json", "--db", url)
    assert rc == 0
    return [e for e in json.loads(out) if e["kind"] == kind]


# -- a run that ended without its daemon_stop --------------------------------------------------
def test_a_run_killed_outright_is_named_at_the_next_start_and_a_clean_stop_is_not(
    tmp_path: Path,
) -> None:
    """A daemon killed with no incident open (SIGKILL here; SIGBUS, the OOM killer alike) left
    nothing in the audit but a `daemon_start` with no `daemon_stop`. The next start records an
    `unclean_stop` naming that run's start, its pid and its last row; a run stopped in order
    gets none."""
    db = tmp_path / "audit.db"
    url = f"sqlite:///{db}"
    first = Daemon(tmp_path)
    try:
        until(
            lambda: _rows(db, "SELECT time FROM events WHERE kind = 'daemon_start'"),
            60,
            "the first run's daemon_start",
        )
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
        first.log.close()
    [(started,)] = _rows(db, "SELECT time FROM events WHERE kind = 'daemon_start'")

    second = Daemon(tmp_path)
    try:
        until(lambda: _events(url, "unclean_stop"), 60, "the unclean_stop of the killed run")
    finally:
        assert second.stop() == 0
    [event] = _events(url, "unclean_stop")
    assert event["data"]["pid"] == first.proc.pid
    assert event["data"]["started_at"].startswith(started.replace(" ", "T"))
    assert f"(pid {first.proc.pid}) ended without an orderly stop" in event["detail"]
    assert event["incident"] is None  # it had none open
    log = (tmp_path / "daemon.log").read_text()
    assert "ended without an orderly stop" in log, log

    third = Daemon(tmp_path)  # after the second run's orderly stop
    assert third.stop() == 0  # its audit flushed: the start's sweep is written
    assert len(_events(url, "unclean_stop")) == 1
    starts = _rows(db, "SELECT count(*) FROM events WHERE kind = 'daemon_start'")
    assert starts == [(3,)]


def test_an_unclean_stop_is_recorded_once_for_the_run_before_only(tmp_path: Path) -> None:
    """The start's sweep applied twice (a spill file holding it imported again) records one
    event; a start with no earlier run of its instance records none, nor does the next start
    after a run that stopped in order. The dead run's incident gets it in its timeline."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    killed = AuditStore(url, host="h", instance="gpu-0")
    killed.start()
    killed.purge_older_than(90, close_stale=True)  # its own start: no run before it
    killed.record_event("daemon_start", data={"pid": 4242})
    left_open = killed.open_incident(1, "left open")
    _act(killed, incident=left_open)
    assert killed.stop(timeout=10)  # as if killed: no daemon_stop
    assert _events(url, "unclean_stop") == []

    restarted = AuditStore(url, host="h", instance="gpu-0")
    restarted.start()
    restarted.record_event("daemon_start", data={"pid": 4343})
    restarted.purge_older_than(90, close_stale=True)
    restarted.purge_older_than(90, close_stale=True)  # again: nothing more
    restarted.record_event("daemon_stop", detail="exit 0")
    assert restarted.stop(timeout=10)
    [event] = _events(url, "unclean_stop")
    assert event["data"]["pid"] == 4242 and event["incident"] == left_open
    rc, out = kvguard("audit", "timeline", left_open, "--db", url, "--json")
    kinds = [r.get("kind") for r in json.loads(out)["timeline"]]
    assert kinds == [None, "incident_closed", "unclean_stop"], kinds

    after_clean = AuditStore(url, host="h", instance="gpu-0")
    after_clean.start()
    after_clean.record_event("daemon_start", data={"pid": 4444})
    after_clean.purge_older_than(90, close_stale=True)
    assert after_clean.stop(timeout=10)
    assert len(_events(url, "unclean_stop")) == 1


def _sweep_steps(tmp_path: Path, rows: int) -> int:
    """The SQLite virtual-machine steps of the start's sweep after a run killed with `rows`
    events of its own: the work it does, counted, not timed."""
    db = tmp_path / f"{rows}.db"
    url = f"sqlite:///{db}"
    killed = AuditStore(url, host="h", instance="gpu-0")
    killed.start()
    killed.record_event("daemon_start", data={"pid": 4242}, time=NOW - timedelta(days=2))
    assert killed.stop(timeout=10)  # as if killed: no daemon_stop
    with closing(sqlite3.connect(db)) as c, c:
        c.executemany(
            "INSERT INTO events (time, host, instance, kind, detail, uid) "
            "VALUES (?, 'h', 'gpu-0', 'engine_oom', '', ?)",
            [((NOW - timedelta(days=1, seconds=i)).isoformat(" "), f"u{i}") for i in range(rows)],
        )
    restarted = AuditStore(url, host="h", instance="gpu-0")
    steps, counting = [0], [False]

    def count() -> int:
        steps[0] += counting[0]
        return 0

    sa_event.listen(
        restarted._engine, "connect", lambda dbapi, _: dbapi.set_progress_handler(count, 1)
    )
    restarted.start()
    restarted.record_event("daemon_start", data={"pid": 4343})
    assert restarted.flush(30)
    counting[0] = True
    restarted.purge_older_than(90, close_stale=True)
    assert restarted.flush(30)
    counting[0] = False
    assert restarted.stop(timeout=10)
    [event] = _events(url, "unclean_stop")
    assert event["data"]["pid"] == 4242
    return steps[0]


def test_the_start_sweep_reads_no_row_of_the_previous_run_to_find_its_stop(
    tmp_path: Path,
) -> None:
    """Whether the run before had its `daemon_stop` was asked by instance and time: SQLite took
    `ix_events_instance_time` and read every row of that run (a million: most of a second,
    inside the start's write transaction; ten million, past WRITE_STALL_S). Asked by kind and
    time, it reads the few starts and stops: the sweep does as much work after a run of 20,000
    rows as after one of 200."""
    small, big = _sweep_steps(tmp_path, 200), _sweep_steps(tmp_path, 20_000)
    assert big < small * 1.5, (small, big)


def test_a_stop_stamped_before_the_next_start_is_the_run_before_s_own(tmp_path: Path) -> None:
    """The run before's stop counts up to the instance's next `daemon_start`, not only up to
    when this run's store started: a clock a little ahead in the run before stamped its
    orderly stop after that, and the start recorded an `unclean_stop` for a clean stop."""
    url = f"sqlite:///{tmp_path / 'a.db'}"
    restarted = AuditStore(url, host="h", instance="gpu-0")
    restarted.start()
    assert restarted.started_at is not None
    since = restarted.started_at
    clean = AuditStore(url, host="h", instance="gpu-0")
    clean.start()
    clean.record_event("daemon_start", data={"pid": 4242}, time=since - timedelta(hours=1))
    clean.record_event("daemon_stop", detail="exit 0", time=since + timedelta(seconds=1))
    assert clean.stop(timeout=10)
    restarted.record_event("daemon_start", data={"pid": 4343}, time=since + timedelta(seconds=2))
    restarted.purge_older_than(90, close_stale=True)
    assert restarted.stop(timeout=10)
    assert _events(url, "unclean_stop") == []

    # the next start bounds it: a later run's stop (a sweep applied after it, from a spill
    # file) is not the killed run's
    url = f"sqlite:///{tmp_path / 'b.db'}"
    sweeping = AuditStore(url, host="h", instance="gpu-0")
    sweeping.start()
    assert sweeping.started_at is not None
    since = sweeping.started_at
    others = AuditStore(url, host="h", instance="gpu-0")
    others.start()
    others.record_event("daemon_start", data={"pid": 4444}, time=since - timedelta(hours=1))
    others.record_event("daemon_start", data={"pid": 4545}, time=since + timedelta(hours=1))
    others.record_event("daemon_stop", detail="exit 0", time=since + timedelta(hours=2))
    assert others.stop(timeout=10)
    sweeping.purge_older_than(90, close_stale=True)
    assert sweeping.stop(timeout=10)
    [event] = _events(url, "unclean_stop")
    assert event["data"]["pid"] == 4444


# -- kvguard audit export -o ---------------------------------------------------------------------
@pytest.fixture
def two_actions(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    store = AuditStore(url, host="h")
    store.start()
    _act(store, detail="one")
    _act(store, detail="two")
    assert store.stop(timeout=10)
    return url


def test_an_export_that_fails_leaves_the_previous_export_whole(
    tmp_path: Path, two_actions: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The target was opened, and emptied, before the first row was read: an export that then
    failed destroyed the last good one. It is written beside the target and renamed over it
    once whole, keeping the target's mode."""
    out = tmp_path / "actions.csv"
    out.write_text("the previous export\n")
    out.chmod(0o640)
    assert kvguard("audit", "export", "--csv", "-o", str(out), "--db", two_actions)[0] == 0
    good = out.read_text()
    assert good.startswith("id,") and good.count("\n") == 3, good
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    with closing(sqlite3.connect(tmp_path / "audit.db")) as c:
        c.execute("DROP TABLE actions")  # still at head: the failure comes as rows are read
    capsys.readouterr()
    assert kvguard("audit", "export", "--csv", "-o", str(out), "--db", two_actions)[0] == 2
    assert "no such table: actions" in capsys.readouterr().err
    assert out.read_text() == good
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


def test_an_export_to_a_missing_directory_names_the_option_and_the_path(
    tmp_path: Path, two_actions: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing" / "dir" / "x.csv"
    assert kvguard("audit", "export", "--csv", "-o", str(target), "--db", two_actions)[0] == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvguard: error: --output {target}: cannot write in {target.parent}: no such directory\n"
    )
    new = tmp_path / "new.json"  # a new file gets what open() would give it, not 0600
    assert kvguard("audit", "export", "--json", "-o", str(new), "--db", two_actions)[0] == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask
    assert [r["detail"] for r in json.loads(new.read_text())] == ["one", "two"]


def test_an_export_over_a_file_in_a_folder_this_user_cannot_write_writes_it_in_place(
    tmp_path: Path,
) -> None:
    """No temporary file can be made beside the target (a folder this user may not write in):
    an existing file this user may write is written in place, as before the rename came; the
    export errored instead. A new file there is still an error naming --output."""
    base = Path(tempfile.mkdtemp(prefix="kvguard-export-"))  # not under tmp_path: nobody may enter
    folder = base / "ro"
    try:
        base.chmod(0o711)
        folder.mkdir()
        target = folder / "x.json"
        target.write_text("the previous export\n")
        target.chmod(0o666)
        folder.chmod(0o555)
        with as_a_user_modes_apply_to():
            _write_output(target, lambda out: out.write("[]\n"))
            with pytest.raises(ValueError, match=r"^--output .*new\.json: cannot write in"):
                _write_output(folder / "new.json", lambda out: out.write("[]\n"))
        assert target.read_text() == "[]\n"
        assert sorted(p.name for p in folder.iterdir()) == ["x.json"]
    finally:
        folder.chmod(0o755)
        shutil.rmtree(base)


def test_an_export_keeps_the_owner_and_group_of_the_file_it_replaces(
    tmp_path: Path, two_actions: str
) -> None:
    """`sudo kvguard audit export -o ~/x.json` over a user's file made it root's (the temporary
    file renamed over it was). The file keeps its owner and group: as root any; as another
    user a group of theirs."""
    out = tmp_path / "x.json"
    out.write_text("the previous export\n")
    if os.geteuid() == 0:
        owner = (65534, 65534)  # nobody's
    else:  # a group of this user's other than its own, where it has one
        groups = [g for g in os.getgroups() if g != os.getegid()] or [os.getegid()]
        owner = (os.geteuid(), groups[0])
    os.chown(out, *owner)
    assert kvguard("audit", "export", "--json", "-o", str(out), "--db", two_actions)[0] == 0
    assert [r["detail"] for r in json.loads(out.read_text())] == ["one", "two"]
    assert (out.stat().st_uid, out.stat().st_gid) == owner


WRITE_THEN_SIGNAL = """
import os, signal, sys
from pathlib import Path
from kvguard.daemon.audit_cli import _write_output

def write(out):
    out.write("[half")
    out.flush()
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
    out.write("]")

_write_output(Path(sys.argv[1]), write)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_an_export_stopped_by_sigterm_or_sighup_leaves_no_temporary_file(
    tmp_path: Path, sig: str
) -> None:
    """Their default action ended the process midway and left the hidden temporary file
    beside the target. They raise during the write: the file is removed, the previous export
    stays whole, and the export exits 128 + the signal's number, saying so."""
    out = tmp_path / "x.json"
    out.write_text("the previous export\n")
    proc = subprocess.run(
        [sys.executable, "-c", WRITE_THEN_SIGNAL, str(out), sig],
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent)),
        preexec_fn=lambda: signal.signal(getattr(signal, sig), signal.SIG_DFL),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 128 + getattr(signal, sig), (proc.returncode, proc.stderr)
    assert proc.stderr == f"kvguard: export to {out} stopped by {sig}\n"
    assert out.read_text() == "the previous export\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_an_export_puts_the_signal_handlers_back_and_names_a_symlink_loop(
    tmp_path: Path, two_actions: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The handlers set for the write are the ones before it afterwards. A symlink loop as
    --output raised a RuntimeError traceback: it is an error naming --output."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    out = tmp_path / "x.json"
    assert kvguard("audit", "export", "--json", "-o", str(out), "--db", two_actions)[0] == 0
    assert {s: signal.getsignal(s) for s in before} == before
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    capsys.readouterr()
    assert kvguard("audit", "export", "--json", "-o", str(loop), "--db", two_actions)[0] == 2
    assert (
        capsys.readouterr().err == f"kvguard: error: --output {loop}: a symlink loop: name a file\n"
    )


# -- kvguard status --config ---------------------------------------------------------------------
def test_status_reads_the_address_and_token_file_from_the_daemons_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A daemon on another port with its own token file needed --url and --token-file; the
    config gives both, as `kvguard audit --config` takes the database from it. --url and
    --token-file still win; --config wins over $KVGUARD_URL."""
    monkeypatch.setenv("KVGUARD_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("KVGUARD_ADMIN_TOKEN_FILE", raising=False)
    d = Daemon(tmp_path)
    try:
        rc, out = kvguard("status", "--config", str(d.config))
        assert rc == 0 and out.startswith("model        tiny  ready=True"), out
        # a config beside its own token file (a relative path), binding every address
        ops = tmp_path / "ops"
        ops.mkdir()
        (ops / "admin.token").write_text(TOKEN + "\n")
        (ops / "config.yaml").write_text(
            f"api: {{host: 0.0.0.0, port: {d.port}, admin_token_file: admin.token}}\n"
        )
        rc, out = kvguard("status", "--config", str(ops / "config.yaml"), "--json")
        assert rc == 0 and json.loads(out)["model"] == "tiny"
        # the flags win
        wrong = tmp_path / "wrong.token"
        wrong.write_text("not-the-token\n")
        argv = ["status", "--config", str(d.config)]
        assert kvguard(*argv, "--token-file", str(wrong))[0] == 2
        assert f"{d.url} answered 401" in capsys.readouterr().err
        assert kvguard(*argv, "--url", "http://127.0.0.1:9")[0] == 2
        assert "cannot reach kvguard at http://127.0.0.1:9" in capsys.readouterr().err
    finally:
        assert d.stop() == 0
    (ops / "config.yaml").write_text("api: {port: 0}\n")
    assert kvguard("status", "--config", str(ops / "config.yaml"))[0] == 2
    assert "api.port is 0 (any free port)" in capsys.readouterr().err


# -- unknown incident ids, a directory for a database ----------------------------------------------
def test_list_of_an_unknown_incident_is_an_error_as_timelines_is(
    tmp_path: Path, two_actions: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["list", "--incident", "nosuch"], ["timeline", "nosuch"]):
        assert kvguard("audit", *argv, "--db", two_actions)[0] == 2
        err = capsys.readouterr().err
        assert err == "kvguard: error: no incident 'nosuch' (see `kvguard audit incidents`)\n"
    # a rule's name may have no actions: an empty list, as before
    assert kvguard("audit", "list", "--rule", "nosuch", "--db", two_actions) == (0, "")
    assert capsys.readouterr().err == "(no actions)\n"


def test_a_database_url_naming_a_directory_says_it_is_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}"
    for argv in (["audit", "list"], ["audit", "incidents"], ["db", "current"]):
        assert kvguard(*argv, "--db", url)[0] == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvguard: error: {tmp_path} is a directory, not an audit database")
        assert "no audit database" not in err and f"sqlite:///{tmp_path / 'audit.db'}" in err


# -- an incident's summary, an action's detail -----------------------------------------------------
def test_an_incident_is_named_after_its_first_action_that_changed_something(
    tmp_path: Path,
) -> None:
    """The eviction rung opened the incident with nothing of its priority running ("evicted 0
    sequences"), and the FP8 rung, which did act, followed in the same tick: the summary named
    the eviction. It names the FP8 rung now; the eviction's row stays as it was recorded. An
    eviction that did evict opens, and names, its incident itself."""
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    store = AuditStore(url, host="h")
    store.start()
    h = Live(EVICT + FP8_RUNG)
    h.ev.audit = store
    evict = ("evict-low", "evict_lowest_priority", "applied")
    assert h.at(0, kv=0.995) == [evict, ("fp8-kv", "enable_fp8_kv", "applied")]

    h2 = Live(EVICT + FP8_RUNG)
    h2.ev.audit = store
    h2.engine.add_request(list(range(3, 40)), greedy(200), priority="low")
    h2.engine.step()
    assert h2.at(0, kv=0.995) == [evict]
    assert h2.detail() == "evicted 1 sequence of priority <= low"
    assert store.stop(timeout=10)

    rc, out = kvguard("audit", "incidents", "--db", url, "--json")
    assert [i["summary"] for i in json.loads(out)] == ["fp8-kv (kv)", "evict-low (kv)"]
    rc, out = kvguard("audit", "list", "--db", url, "--json")
    details = [a["detail"] for a in json.loads(out)]
    assert details[0] == "evicted 0 sequences of priority <= low"
    assert details[1].startswith("KV cache fp32 -> fp8_e4m3: ")
    assert details[2] == "evicted 1 sequence of priority <= low"
