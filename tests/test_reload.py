"""A rules reload that fails, for whatever reason, keeps the running rules and their schedule.

The in-process tests drive the real ControlPlane, its rule ticker and audit store with only the
engine left out (a reload never touches it); the last test does the same through a live
`kvguard serve`: /admin/reload answers 400 and SIGHUP logs the refusal, the rules keep ticking.
Also, on the daemon in process: engine knobs a stalled engine does not take in time are
withdrawn (never applied), ones it finishes late land in the config in force; a SIGHUP before
the API listens never says READY=1; a refused one is in the STATUS= line until a good one, and
a good one's audit event names the keys waiting for a restart.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kvguard.daemon import sdnotify
from kvguard.daemon import service as service_module
from kvguard.daemon.audit import AuditStore
from kvguard.daemon.cli_serve import _print_state
from kvguard.daemon.config import load_config
from kvguard.daemon.control_plane import ControlPlane
from kvguard.daemon.service import Service
from kvguard.engine.events import EngineEvent
from tests.test_control_plane import (  # noqa: F401 - service: a fixture
    WAIT_S,
    admin_post,
    admin_post_while_stalled,
    service,
)
from tests.test_operator_cli import Notify
from tests.test_server import Daemon, until

RULES = (
    "version: 1\ninterval: {interval}\nsignals: {{kv: {{local: kv_cache_usage_ratio}}}}\nrules:\n"
    "  - {{name: {name}, signal: kv, above: 0.99, action: halt_admission}}\n"
)


@pytest.fixture
def rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES.format(interval="5s", name="first"))
    return path


@pytest.fixture
def audit(tmp_path: Path) -> Iterator[AuditStore]:
    store = AuditStore(f"sqlite:///{tmp_path / 'audit.db'}")
    store.start()
    yield store
    store.stop(timeout=5)


@pytest.fixture
def plane(tmp_path: Path, rules: Path, audit: AuditStore) -> Iterator[ControlPlane]:
    """A control plane whose rule ticker is not started and whose scheduler is paused: no
    tick reaches for an engine."""
    config = tmp_path / "config.yaml"
    config.write_text(f"rules: {{path: {rules}}}\n")
    svc = SimpleNamespace(
        cfg=load_config(config), engine=None, audit=audit, rules_at_start=None, api_port=None
    )
    cp = ControlPlane(svc)  # type: ignore[arg-type]
    cp.scheduler.start(paused=True)
    yield cp
    cp.stop()


def _interval(cp: ControlPlane) -> float:
    return cp.rule_ticker.interval


def _installed(cp: ControlPlane) -> list[str]:
    return [r.name for r in cp.evaluator.rules.rules]


def test_a_good_reload_swaps_rules_and_schedule(plane: ControlPlane, rules: Path) -> None:
    rules.write_text(RULES.format(interval="7s", name="second"))
    res = plane.reload(rules, dry_run=False)
    assert res["rules_reloaded"] is True and res["rules_changed"][:2] == ["-first", "+second"]
    assert _installed(plane) == ["second"] and _interval(plane) == 7.0


def test_an_infinite_interval_keeps_rules_and_schedule(
    plane: ControlPlane, rules: Path, audit: AuditStore
) -> None:
    before = plane.ruleset
    rules.write_text(RULES.format(interval=".inf", name="second"))
    res = plane.reload(rules, dry_run=False)
    assert res["rules_reloaded"] is False
    assert res["errors"][0].startswith(f"{rules}:2: interval: inf is not finite")
    assert plane.ruleset is before and _installed(plane) == ["first"]
    assert _interval(plane) == 5.0
    audit.flush(timeout=5)
    assert [e["detail"] for e in audit.list_events(kind="config_error")] == [
        f"rules reload refused: {rules}"
    ]


def test_a_failed_reschedule_keeps_the_old_rules(
    plane: ControlPlane, rules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("scheduler is shutting down")

    monkeypatch.setattr(plane.rule_ticker, "set_interval", refuse)
    rules.write_text(RULES.format(interval="7s", name="second"))
    res = plane.reload(rules, dry_run=False)
    assert res["rules_reloaded"] is False
    assert res["errors"] == [f"{rules}: not installed: RuntimeError: scheduler is shutting down"]
    assert _installed(plane) == ["first"] and [r.name for r in plane.ruleset.rules] == ["first"]
    assert _interval(plane) == 5.0


def test_rules_that_cannot_be_installed_put_the_schedule_back(
    plane: ControlPlane, rules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise RuntimeError("evaluator refused the rules")

    monkeypatch.setattr(plane.evaluator, "replace_rules", refuse)
    rules.write_text(RULES.format(interval="7s", name="second"))
    res = plane.reload(rules, dry_run=False)
    assert res["rules_reloaded"] is False and "evaluator refused the rules" in res["errors"][0]
    assert [r.name for r in plane.ruleset.rules] == ["first"] and plane.rules_path == rules
    assert _interval(plane) == 5.0


def _evaluations(d: Daemon) -> float:
    for line in httpx.get(d.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvguard_rule_evaluations_total "):
            return float(line.split()[1])
    return 0.0


def test_a_bad_rules_file_is_refused_by_http_and_sighup_and_the_rules_keep_running(
    tmp_path: Path, rules: Path
) -> None:
    rules.write_text(RULES.format(interval="1s", name="first"))
    d = Daemon(tmp_path, extra=f"rules: {{path: {rules}}}\n")
    try:
        names = lambda: [r["name"] for r in d.admin("GET", "/admin/state").json()["rules"]]  # noqa: E731
        assert names() == ["first"]
        rules.write_text(RULES.format(interval=".inf", name="second"))
        r = d.admin("POST", "/admin/reload")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"{rules}:2: interval: inf is not finite")
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert d.proc.poll() is None and names() == ["first"]
        ticks = _evaluations(d)
        deadline = time.monotonic() + 20
        while _evaluations(d) < ticks + 2 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert _evaluations(d) >= ticks + 2, "the rule job stopped ticking after the reloads"
    finally:
        assert d.stop() == 0
    log = (tmp_path / "daemon.log").read_text()
    assert f"reload refused, keeping the running rules: {rules}:2: interval: inf" in log
    assert "OverflowError" not in log and "Traceback" not in log


def test_a_reload_keeps_the_command_lines_flags(tmp_path: Path, rules: Path) -> None:
    """`kvguard serve --dry-run --model tiny` over a file that sets neither: a reload (HTTP
    or SIGHUP) applies the flags again, so the rules stay in dry run and the model is not
    reported as changed in the file."""
    rules.write_text(RULES.format(interval="1s", name="first"))
    d = Daemon(
        tmp_path,
        serving="{kv_cache_bytes: 8MiB, max_model_len: 512}",  # the default model in the file
        extra=f"rules: {{path: {rules}}}\n",
        args=("--dry-run", "--model", "tiny"),
    )
    log = Path(d.log.name)
    try:
        state = lambda: d.admin("GET", "/admin/state").json()  # noqa: E731
        assert state()["dry_run"] is True and state()["model"] == "tiny"
        rules.write_text(RULES.format(interval="1s", name="second"))
        r = d.admin("POST", "/admin/reload").json()
        assert r["reloaded"] and r["changes"] == {} and r["restart_needed"] == [], r
        assert state()["dry_run"] is True and [x["name"] for x in state()["rules"]] == ["second"]
        rules.write_text(RULES.format(interval="1s", name="third"))
        d.proc.send_signal(signal.SIGHUP)
        until(lambda: "rules -second +third" in log.read_text(), 20, "the SIGHUP reload")
        assert state()["dry_run"] is True
    finally:
        assert d.stop() == 0
    text = log.read_text()
    assert "at the next restart" not in text and "dry_run is now" not in text


def test_relative_rules_and_keys_paths_are_read_beside_the_config_file(
    tmp_path: Path, rules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit runs the daemon in its state directory: `rules.path: rules.yaml` and
    `api.api_keys_file: keys.yaml` are read beside the config file at start and at each
    reload; a rules file gone refuses the reload naming the key, its line and the absolute
    path, and the running rules stay."""
    from kvguard.daemon.api_keys import add_key

    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.chdir(state)  # the daemon's working directory, as under the unit
    add_key(tmp_path / "keys.yaml", "web", "high", None)
    d = Daemon(tmp_path, extra="rules: {path: rules.yaml}\n", api="api_keys_file: keys.yaml")
    try:
        now = d.admin("GET", "/admin/state").json()
        assert [r["name"] for r in now["rules"]] == ["first"]
        assert now["api_keys"] == {"file": str(tmp_path / "keys.yaml"), "keys": 1}
        rules.write_text(RULES.format(interval="5s", name="second"))
        r = d.admin("POST", "/admin/reload").json()
        assert r["reloaded"] and r["rules_changed"] == ["-first", "+second"], r
        rules.rename(tmp_path / "moved.yaml")
        bad = d.admin("POST", "/admin/reload")
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["message"] == (
            f"{d.config}:4: rules.path: cannot read {rules}: No such file or directory"
        )
        assert [r["name"] for r in d.admin("GET", "/admin/state").json()["rules"]] == ["second"]
    finally:
        assert d.stop() == 0


def test_a_missing_or_broken_rules_file_stops_the_start_before_the_model_loads(
    tmp_path: Path,
) -> None:
    """As a broken config: refused at once, naming the file (and line), with nothing bound or
    loaded."""
    from tests.test_server import serve_refused

    for body, said in ((None, "cannot read"), ("interval: 0\n", ":1: interval: interval 0s")):
        path = tmp_path / "rules.yaml"
        if body is not None:
            path.write_text(body)
        cfg = tmp_path / "config.yaml"
        cfg.write_text(f"serving: {{model: tiny}}\nrules: {{path: {path}}}\n")
        proc = serve_refused(cfg)
        assert proc.returncode == 2 and f"{path}" in proc.stderr and said in proc.stderr
        assert "API bound" not in proc.stderr and "rank 0 loaded" not in proc.stderr, proc.stderr


def test_an_engine_event_never_waits_on_the_schedulers_lock(plane: ControlPlane) -> None:
    """The engine thread reports an OOM while `stop()` holds the scheduler's lock, waiting for
    an evaluation that waits for the engine: the report must return at once (it had to wait
    for the lock: a deadlock of up to 120 s at shutdown)."""
    import threading

    from kvguard.engine.events import EngineEvent

    with plane.scheduler._jobstores_lock:  # as shutdown(wait=True) holds it
        engine_thread = threading.Thread(
            target=plane._on_engine_event, args=(EngineEvent("engine_oom"),), daemon=True
        )
        engine_thread.start()
        engine_thread.join(10)
        assert not engine_thread.is_alive()


def test_an_event_evaluation_runs_however_late(plane: ControlPlane) -> None:
    """Evaluations stuck on a slow engine may hold the scheduler's threads for minutes; an
    event's evaluation queued behind them must still run (a misfired one is lost, and its alert
    was already marked as seen)."""
    plane._soon("engine_oom")  # the scheduler is paused: the job waits, as behind busy threads
    jobs = [j for j in plane.scheduler.get_jobs() if j.id != "rules"]
    assert len(jobs) == 1 and jobs[0].misfire_grace_time is None


def test_every_rules_actions_are_exported_from_zero(plane: ControlPlane, rules: Path) -> None:
    """Each rule's action and undo by each outcome is a series from 0 before it first runs,
    so its first failure is an increase RemedyFailed sees (a series born at 1 is none); so
    is each catalogue action's failure by an operator (rule "manual")."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvguard.daemon.metrics import ControlPlaneCollector
    from kvguard.rules.actions import ACTIONS

    reg = CollectorRegistry()
    reg.register(ControlPlaneCollector(lambda: plane, lambda: None))

    def series() -> set[str]:  # the rules' (an operator's, rule "manual": see below)
        text = generate_latest(reg).decode()
        lines = {ln for ln in text.splitlines() if ln.startswith("kvguard_actions_total{")}
        manual = {ln for ln in lines if 'rule="manual"' in ln}
        assert manual == {
            f'kvguard_actions_total{{action="{a}",outcome="failed",rule="manual"}} 0.0'
            for a in ACTIONS
        }
        return lines - manual

    assert series() == {
        f'kvguard_actions_total{{action="halt_admission",outcome="{o}",rule="first"}} 0.0'
        for o in ("applied", "failed", "refused")
    }
    rules.write_text(
        RULES.format(interval="5s", name="second").replace(
            "action: halt_admission", "action: halt_admission, undo: resume_admission"
        )
    )
    assert plane.reload(rules, dry_run=False)["rules_reloaded"]
    assert {s.split("{")[1].split("}")[0] for s in series()} == {
        f'action="{a}",outcome="{o}",rule="second"'
        for a in ("halt_admission", "resume_admission")
        for o in ("applied", "failed", "refused")
    }


def test_an_incident_an_oom_opens_begins_with_the_oom_and_ends_at_stop(
    plane: ControlPlane, rules: Path, audit: AuditStore
) -> None:
    """The OOM that starts an incident is the first line of its timeline, the events its
    remedy causes while it runs are the incident's, and the daemon's stop closes it."""
    from kvguard.engine.control import ActionResult
    from kvguard.engine.events import EngineEvent

    rules.write_text(
        "version: 1\ninterval: 5s\nrules:\n"
        "  - {name: oom-chain, on: engine_oom, action: handle_oom, undo: recover_from_oom,"
        " recover_for: 60s}\n"
    )
    assert plane.reload(rules, dry_run=False)["rules_reloaded"]

    def execute(action: str, params: dict) -> ActionResult:  # the engine's switch, reported
        plane._on_engine_event(EngineEvent("kv_dtype_switched", {"from": "fp32", "to": "fp8"}))
        return ActionResult(action, {}, {}, "switched", True)

    plane.evaluator.execute = execute
    plane._on_engine_event(EngineEvent("engine_oom", {"error": "CUDA out of memory"}))
    deadline = time.monotonic() + 10  # the event's job is added from a thread of its own
    while not (jobs := [j for j in plane.scheduler.get_jobs() if j.id != "rules"]):
        assert time.monotonic() < deadline, "the OOM's evaluation was never scheduled"
        time.sleep(0.01)
    jobs[0].func()  # the scheduler is paused: run the evaluation here
    incident = plane.evaluator.incident
    assert incident is not None
    plane.stop()
    assert audit.flush(10)
    steps = [(r["type"], r.get("kind") or r["action"]) for r in audit.timeline(incident)]
    assert steps == [
        ("event", "engine_oom"),
        ("action", "handle_oom"),  # at the time it was decided, before what it caused
        ("event", "kv_dtype_switched"),
    ]
    assert audit.get_incident(incident)["closed_at"] is not None


# -- engine knobs the engine does not take, or does not finish, in time -----------------------
# On the daemon in process (test_control_plane's `service`), the reload's wait shrunk: it waits
# RECONFIGURE_TIMEOUT_S (30 s) for the engine to take its knobs, and as long again for them.


def _file_asks_for(svc: Service, max_num_seqs: int) -> None:
    """The config file, with the live knob serving.max_num_seqs set to `max_num_seqs`."""
    assert svc.config_path is not None
    text = svc.config_path.read_text()
    assert "max_model_len: 512}" in text
    svc.config_path.write_text(
        text.replace("max_model_len: 512}", f"max_model_len: 512, max_num_seqs: {max_num_seqs}}}")
    )


def _events(svc: Service, kind: str) -> list[dict]:
    assert svc.audit is not None and svc.audit.flush(30)
    return svc.audit.list_events(kind=kind)


def test_knobs_the_engine_never_took_are_withdrawn_and_never_apply(
    service: Service,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, the reload gave up (`TimeoutError`, 400) and said it kept the running config,
    while its reconfigure stayed in the mailbox and applied once the engine stepped again: the
    engine ran the file's batch limit, the daemon's config (/admin/state, the next reload's
    comparison) the old one. Now the knobs are withdrawn: nothing changed, and it says so."""
    monkeypatch.setattr(service_module, "RECONFIGURE_TIMEOUT_S", WAIT_S)
    before = service.engine.config.max_num_seqs
    assert before != 3 and service.cfg.serving.max_num_seqs == before
    _file_asks_for(service, 3)
    r = admin_post_while_stalled(service, "/admin/reload")
    service.loop.call(lambda: None).result(60)  # posted after the knobs: they have been passed by
    assert service.engine.config.max_num_seqs == before == service.cfg.serving.max_num_seqs
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "reload_withdrawn" and "nothing changed" in err["message"], err
    [event] = _events(service, "config_error")
    assert event["data"]["engine"] == "withdrawn", event
    # the engine steps again: the same file applies, in the engine and the config in force alike
    # (given the time to take its knobs: a loaded machine may take longer than the shrunk wait)
    monkeypatch.setattr(service_module, "RECONFIGURE_TIMEOUT_S", 30)
    res = service.reload()
    assert res["reloaded"] and res["changes"] == {"serving.max_num_seqs": 3}, res
    assert service.engine.config.max_num_seqs == 3 == service.cfg.serving.max_num_seqs


def _knobs_stuck(svc: Service, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The engine takes a reload's knobs and is stuck inside them (a slow engine-thread
    subscriber) until the event returned is set; the reload waits WAIT_S for them. Its wait
    starts once the engine is inside the knobs (however slow the machine, they are not
    withdrawn before the engine takes them)."""
    monkeypatch.setattr(service_module, "RECONFIGURE_TIMEOUT_S", WAIT_S)
    inside, release = threading.Event(), threading.Event()

    def slow(event: EngineEvent) -> None:  # on the engine thread, inside the reconfigure
        if event.kind == "knob_changed" and event.data["action"] == "reconfigure":
            inside.set()
            release.wait(120)

    svc.engine.events.subscribe(slow)
    posted = svc.engine.reconfigure

    def taken(values: dict) -> object:
        fut = posted(values)
        until(inside.is_set, 60, "the engine inside the reconfigure")
        return fut

    monkeypatch.setattr(svc.engine, "reconfigure", taken)
    return release


def test_knobs_the_engine_finishes_late_are_in_the_config_in_force_when_they_land(
    service: Service,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine took the knobs and is stuck inside them (a slow engine-thread subscriber):
    the reload does not claim to keep the running config (504: they may still apply), and when
    they land the config in force takes them, the audit log says so, and the next reload starts
    from them (before, the daemon's config kept the old value for good)."""
    release = _knobs_stuck(service, monkeypatch)
    before = service.cfg.serving.max_num_seqs
    _file_asks_for(service, 3)
    try:
        r = admin_post(service, "/admin/reload")
        assert service.cfg.serving.max_num_seqs == before  # not in force yet
    finally:
        release.set()
    until(lambda: service.engine.config.max_num_seqs == 3, 60, "the late knobs applied")
    until(lambda: service.cfg.serving.max_num_seqs == 3, 60, "the late knobs in the config")
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "reload_still_applying" and "may still apply" in err["message"], err
    until(lambda: _events(service, "reload"), 60, "the late knobs audited")
    [event] = _events(service, "reload")
    assert event["data"] == {"changes": {"serving.max_num_seqs": 3}, "late": True}, event
    monkeypatch.setattr(service_module, "RECONFIGURE_TIMEOUT_S", 30)
    res = service.reload()  # the file again: its knobs are the ones in force
    assert res["reloaded"] and res["changes"] == {}, res


def status_lines(svc: Service, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What `kvguard status` prints of the last reload for the daemon in process: its
    `reload` line and one line per problem ([] when there is none)."""
    capsys.readouterr()
    _print_state(svc.state())
    lines = capsys.readouterr().out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("reload ")), len(lines))
    end = start + 1
    while end < len(lines) and lines[end].startswith(" " * 13):
        end += 1
    return lines[start:end]


def test_a_failed_reload_whose_knobs_may_still_apply_says_so_until_they_do(
    service: Service,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvguard status` (/admin/state's `reload_refused`) said "nothing of FILE applied, the
    config in force stands" of every reload that did not apply, one whose engine knobs were
    still being applied too, and went on saying it once they had applied. Now it says they
    may still apply while they may, and once they have, that they did (the STATUS= line
    too); the record stands until a reload applies, since nothing else of the file did."""
    release = _knobs_stuck(service, monkeypatch)
    _file_asks_for(service, 3)
    path = str(service.config_path)
    try:
        assert admin_post(service, "/admin/reload").status_code == 504
        refused = service.state()["reload_refused"]
        assert refused["outcome"] == "failed" and refused["config"] == path, refused
        assert refused["knobs"] == "still_applying", refused
        [line, problem] = status_lines(service, capsys)
        assert line == (
            f"reload       failed at {refused['at']}: the engine is still applying the live "
            f"knobs of {path}, which may still apply; nothing else of it applied"
        ), line
        assert "may still apply" in problem, problem
    finally:
        release.set()
    until(lambda: service.state()["reload_refused"]["knobs"] == "applied_late", 60, "them landed")
    assert service.cfg.serving.max_num_seqs == 3
    refused = service.state()["reload_refused"]
    [error] = refused["errors"]
    assert error.startswith("the engine finished applying serving.max_num_seqs=3 at "), error
    assert "they are in force; nothing else of" in error and "may still apply" not in error
    [line, problem] = status_lines(service, capsys)
    assert line == (
        f"reload       failed at {refused['at']}: the live knobs of {path} applied late; "
        "nothing else of it: reload again"
    ), line
    assert problem == "             " + error
    status = service._systemd_status()
    assert status.startswith(f"reload failed at {refused['at']}: the engine finished "), status
    monkeypatch.setattr(service_module, "RECONFIGURE_TIMEOUT_S", 30)
    assert service.reload()["reloaded"]
    assert service.state()["reload_refused"] is None and status_lines(service, capsys) == []


def test_a_refused_reload_of_a_daemon_started_without_a_config_file_names_none(
    service: Service,  # noqa: F811
    tiny_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Started without --config, a reload reads the built-in defaults (and the flags) again.
    Refused, /admin/state's `reload_refused.config` held a sentence in place of a path, and
    `kvguard status` said "nothing of the built-in defaults (started without --config),
    rules FILE applied". Now `config` is null, and the line says what the reload read. (The
    flags here are ones the model served cannot take, which the reload reads again.)"""
    monkeypatch.setattr(service, "config_path", None)
    monkeypatch.setattr(service, "overrides", {"model": str(tiny_dir), "tensor_parallel": 3})
    assert not service.reload()["reloaded"]
    refused = service.state()["reload_refused"]
    assert refused["outcome"] == "refused" and refused["config"] is None, refused
    assert refused["knobs"] is None, refused
    [error] = refused["errors"]
    assert error.startswith("--tensor-parallel: serving.tensor_parallel: tensor_parallel=3 "), error
    [line, problem] = status_lines(service, capsys)
    assert line == (
        f"reload       refused at {refused['at']}: nothing of the reload applied (started "
        "without --config: it read the built-in defaults and packaged rules again), the config "
        "in force stands"
    ), line
    assert problem == "             " + error


HOT_RULES = """version: 1
interval: 1s
cooldown: 1s
rules:
  - {{name: hot, on: "alert:Hot", action: halt_admission, params: {{allow_priority: {allow}}},
     undo: resume_admission}}
"""


def test_a_reload_is_in_the_timeline_before_the_actions_it_causes(
    service: Service,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reload that gives a firing alert's rule another remedy: the changed rule acts at once
    and the old remedy is undone (trigger `reload`), in an evaluation the reload queues, which
    may run before the reload has finished (here it always does). The reload's row was timed
    when it finished, so `kvguard audit timeline` listed both actions before their cause."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(HOT_RULES.format(allow="high"))
    assert service.config_path is not None
    service.config_path.write_text(service.config_path.read_text() + f"rules: {{path: {rules}}}\n")
    assert service.reload()["reloaded"]
    plane, ev = service.control, service.control.evaluator
    alert = {"status": "firing", "labels": {"alertname": "Hot"}, "fingerprint": "fp-hot"}
    assert plane.alertmanager({"version": "4", "status": "firing", "alerts": [alert]})
    until(lambda: ev.level() == 1, 60, "the alert's halt")
    incident, seen = ev.incident, ev.decided
    reload = plane.reload

    def slow(*args: object, **kwargs: object) -> dict:
        """Returns once the evaluation the reload queued has acted and undone."""
        out = reload(*args, **kwargs)
        until(lambda: ev.decided == seen + 2 and not ev.retiring, 60, "the act and the undo")
        return out

    monkeypatch.setattr(plane, "reload", slow)
    rules.write_text(HOT_RULES.format(allow="normal"))
    assert service.reload()["reloaded"]
    assert incident is not None and service.audit.flush(30)
    steps = [
        (r["type"], r.get("kind") or r["action"], r.get("trigger"), r.get("outcome"))
        for r in service.audit.timeline(incident)
        if r["type"] == "action" or r["kind"] == "reload"  # not the engine's admission_halted
    ]
    assert steps[-3:] == [
        ("event", "reload", None, None),
        ("action", "halt_admission", "alert", "applied"),  # its alert still fires
        ("action", "resume_admission", "reload", "held"),  # admission stays at `normal`
    ], steps


def test_a_sighup_before_the_api_listens_never_says_ready(
    service: Service,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGHUP between the end of loading and the API listening (the start's own handler,
    `_sighup_before_serving`) ran a reload that said READY=1 when it ended: systemd then
    started what waits for the unit while connections were refused. READY=1 now goes out once
    the API listens (`_listening`, which the server calls then), and only a reload from then on
    says RELOADING=1 and READY=1 again. Driven in that order, in process."""
    notify = Notify()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.path)

    def said(mark: str) -> list[str]:
        """READY=1 and RELOADING=1 received up to `mark` (sent last: datagrams keep order)."""
        sdnotify.notify(mark)
        until(lambda: mark in notify.first(), 30, mark)
        first = notify.first()
        return [m for m in first[: first.index(mark)] if m in ("READY=1", "RELOADING=1")]

    ran_on: list[threading.Thread] = []
    done = threading.Event()
    reload = service.reload

    def recorded() -> dict:  # the thread the handler reloads on (a fast one may be gone already)
        ran_on.append(threading.current_thread())
        try:
            return reload()
        finally:
            done.set()

    try:
        monkeypatch.setattr(service, "reload", recorded)
        service._sighup_before_serving(signal.SIGHUP, None)
        assert done.wait(60), "the SIGHUP's reload did not end"
        monkeypatch.setattr(service, "reload", reload)
        assert [t.name for t in ran_on] == ["kvguard-reload"]
        assert said("X-KVGUARD-TEST=1") == []  # the API does not listen yet
        service._listening()
        assert service.reload()["reloaded"]
        assert said("X-KVGUARD-TEST=2") == ["READY=1", "RELOADING=1", "READY=1"]
    finally:
        notify.close()


# -- what a reload leaves for systemd and the audit log -----------------------------------------


def test_a_refused_reload_leads_the_status_line_until_a_reload_applies(
    service: Service,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`systemctl reload` only sends SIGHUP, so it succeeds whatever the file holds, and a
    refused reload ended in READY=1 with the usual STATUS= line: `systemctl status` said
    nothing of it, only the log did. The refusal now leads the STATUS= line (its time and first
    `FILE:LINE` problem) until a reload applies."""
    notify = Notify()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.path)

    def status_at_ready(mark: str) -> str:
        """The STATUS= of the last READY=1 received before `mark` (sent last: datagrams keep
        order; the watchdog's own STATUS= lines come between)."""
        sdnotify.notify(mark)
        until(lambda: mark in notify.first(), 30, mark)
        msgs = list(notify.msgs)
        before = msgs[: [m.split("\n")[0] for m in msgs].index(mark)]
        return [m for m in before if m.startswith("READY=1\n")][-1].split("\n")[1]

    assert service.config_path is not None
    good = service.config_path.read_text()
    try:
        service._listening()
        assert status_at_ready("X-KVGUARD-TEST=1").startswith("STATUS=running=0 ")
        service.config_path.write_text(good.replace("max_model_len: 512}", "max_num_seq: 3}"))
        assert not service.reload()["reloaded"]
        refused = status_at_ready("X-KVGUARD-TEST=2")
        when = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
        where = re.escape(f"{service.config_path}:1: serving.max_num_seq: unknown key")
        assert re.fullmatch(
            rf"STATUS=reload refused at {when}: {where} .{{1,200}}; running=0 .* admission=open",
            refused,
        ), refused
        assert service._systemd_status() == refused.removeprefix("STATUS=")  # the watchdog's too
        service.config_path.write_text(good)
        assert service.reload()["reloaded"]
        assert status_at_ready("X-KVGUARD-TEST=3").startswith("STATUS=running=0 ")
    finally:
        notify.close()


def test_a_refusals_status_is_its_first_problem_cut_short() -> None:
    """Every problem of a file would make a STATUS= line of pages: the first, cut, and a count."""
    line = service_module._reload_problem("refused", ["f.yaml:1: k: " + "x" * 500, "f.yaml:2: j"])
    assert line.startswith("reload refused at ") and "f.yaml:1: k: xxx" in line
    assert line.endswith("x... (+1 more in the journal)") and len(line) < 300, line
    assert "\n" not in service_module._reload_problem("failed", ["two\nlines"])


def test_a_reloads_audit_event_names_the_keys_waiting_for_a_restart(
    service: Service,  # noqa: F811
) -> None:
    """A reload that changes `audit.instance` (or any key only a restart applies) was audited
    with `changes: {}` and nothing else, while its answer and the log said `restart_needed`:
    the audit log did not show that the daemon runs what the file no longer says."""
    assert service.config_path is not None
    text = service.config_path.read_text()
    assert "audit: {url: " in text and "max_model_len: 512}" in text
    service.config_path.write_text(
        text.replace("audit: {url: ", "audit: {instance: node-2, url: ").replace(
            "max_model_len: 512}", "max_model_len: 256}"
        )
    )
    r = service.reload()
    assert r["reloaded"] and r["changes"] == {}, r
    assert r["restart_needed"] == ["serving.max_model_len", "audit.instance"], r
    [event] = _events(service, "reload")
    assert event["data"]["restart_needed"] == r["restart_needed"], event
    assert event["data"]["changes"] == {}, event


def test_a_reload_that_only_changes_the_cooldown_says_so(
    service: Service,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The rules file's top-level `cooldown` paces every rule's remedies from the reload on,
    yet a reload that changed only it logged `no changes` and audited `rules_changed: []`:
    the log and the audit log did not show why remedies began to fire six times as often."""
    from kvguard.rules.schema import default_rules_path

    assert service.config_path is not None
    rules = service.config_path.parent / "rules.yaml"
    text = default_rules_path().read_text()
    assert "\ncooldown: 30s " in text
    rules.write_text(text)
    with service.config_path.open("a") as f:
        f.write(f"rules: {{path: {rules}}}\n")
    assert service.reload()["reloaded"]
    rules.write_text(text.replace("\ncooldown: 30s ", "\ncooldown: 5s "))
    caplog.set_level("INFO", logger="kvguard.daemon")
    r = service.reload()
    assert r["reloaded"] and r["rules_changed"] == ["cooldown 30s -> 5s"], r
    assert f"reloaded {service.config_path}: rules cooldown 30s -> 5s" in caplog.messages
    assert [e["data"]["rules_changed"] for e in _events(service, "reload")][-1] == [
        "cooldown 30s -> 5s"
    ]
    assert service.control is not None and service.control.ruleset.cooldown == 5.0


def test_a_reload_refuses_a_worker_key_the_next_start_would_refuse(
    service: Service,  # noqa: F811
) -> None:
    """Remote ranks whose key is missing or empty: a start refuses them before the bind, so a
    reload refuses them too (it took them, and the restart they wait for then failed)."""
    path = service.config_path
    assert path is not None
    key = path.parent / "worker.key"
    path.write_text(
        path.read_text().replace(
            "max_model_len: 512}",
            "max_model_len: 512, pipeline_parallel: 2,\n"
            "  distributed: {remote_ranks: [1], authkey_file: worker.key}}",
        )
    )
    prefix = f"{path}:2: serving.distributed.authkey_file: "
    for content, said in (
        (None, f"cannot read {key}: No such file or directory"),
        (b"", f"{key} is empty: "),
    ):
        if content is not None:
            key.write_bytes(content)
        res = service.reload()
        assert not res["reloaded"] and res["reason"].startswith(prefix + said), res
    assert service.cfg.serving.pipeline_parallel == 1  # the running config stays
