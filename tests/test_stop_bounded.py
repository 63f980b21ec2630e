"""A stop is bounded however stuck the engine is: it never waits out a rule's action or a
reload the engine is stuck inside (up to 2 x 120 s and 2 x 30 s: past systemd's TimeoutStopSec,
whose SIGKILL lost the audit rows still queued). What was waited on is audited as not applied,
or not known to have applied.

The daemon serves in process, in the main thread (its signal handlers are the daemon's own),
and is stopped by a real SIGTERM through the whole stop: the drain, close(), and asyncio.run's
wait for its worker threads (the one a SIGHUP's reload runs on included). The engine thread is
held inside the action or the reload's knobs by a slow engine-thread subscriber, as
tests/test_control_plane.py and tests/test_reload.py hold it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvguard.daemon.service import Service, bind_api
from kvguard.engine.events import EngineEvent
from tests.test_control_plane import rows, service  # noqa: F401 - service: a fixture
from tests.test_reload import _file_asks_for
from tests.test_server import until

# The whole stop here (nothing in flight: the drain ends at once), well below the waits it used
# to sit out. A stop still under way then releases the engine so that the test ends, and fails.
BOUND_S = 20.0


class Held:
    """The engine thread held inside whatever emits `kind` (and matches `match`) until
    released: a stuck action."""

    def __init__(self, svc: Service, kind: str, match: Callable[[EngineEvent], bool]) -> None:
        self.inside, self.release = threading.Event(), threading.Event()

        def slow(event: EngineEvent) -> None:  # on the engine thread, inside the command
            if event.kind == kind and match(event):
                self.inside.set()
                self.release.wait(120)

        svc.engine.events.subscribe(slow)


def serve_then_stop(svc: Service, begin: Callable[[], None], held: Held) -> float:
    """Serve `svc` until a SIGTERM sent once `begin` (on a helper thread, once the API
    listens) has returned; the seconds from that SIGTERM until asyncio.run has returned. The
    engine is released once the stop has taken BOUND_S, so a stop that waits on it ends."""
    sock = bind_api("127.0.0.1", 0)
    sent: list[float] = []
    failed: list[BaseException] = []
    served = threading.Event()

    def drive() -> None:
        try:
            until(lambda: svc._listening_now, 60, "the API listening")
            begin()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            failed.append(e)
        finally:  # always: serve() must end
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
        if not served.wait(BOUND_S):
            held.release.set()

    helper = threading.Thread(target=drive, name="test-stop-driver", daemon=True)
    helper.start()
    try:
        code = asyncio.run(svc.serve(sock))
    finally:
        ended = time.monotonic()
        served.set()
        held.release.set()  # the engine steps again (the stop is over either way)
        sock.close()
        helper.join(60)
    if failed:
        raise failed[0]
    assert code == 0
    return ended - sent[0]


def test_a_stop_does_not_wait_out_a_rule_action_the_engine_is_stuck_in(
    service: Service,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An alert's halt the engine took and is stuck inside: the evaluation waited for it up to
    ACTION_TIMEOUT_S twice (240 s) and the stop waited for the evaluation. Now the stop ends
    the wait at once and the action is recorded failed, whether it applied not known."""
    held = Held(service, "admission_halted", lambda _e: True)
    assert service.control is not None
    alert = {"labels": {"alertname": "GPUNearOOM"}, "startsAt": "2025-01-01T00:00:00Z"}

    def begin() -> None:
        service.control.alertmanager({"version": "4", "alerts": [alert]})
        until(held.inside.is_set, 60, "the engine inside the rule's halt")

    took = serve_then_stop(service, begin, held)
    assert took < BOUND_S, f"the stop took {took:.1f}s: it waited on the stuck action"
    sql = "SELECT rule, action, outcome, error FROM actions WHERE trigger != 'manual'"
    [(rule, action, outcome, error)] = rows(tmp_path / "audit.db", sql)
    assert (rule, action, outcome) == ("am-gpu-near-oom", "halt_admission", "failed"), error
    assert "the daemon stopped while the engine was still applying it" in error, error
    [(stop,)] = rows(tmp_path / "audit.db", "SELECT detail FROM events WHERE kind='daemon_stop'")
    assert stop == "exit 0"


def test_a_stop_abandons_a_reload_the_engine_is_stuck_in(
    service: Service,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A SIGHUP's reload whose knobs the engine took and is stuck inside: it waited
    RECONFIGURE_TIMEOUT_S twice (60 s), on a worker thread asyncio.run waits for at the exit.
    Now the stop abandons it at once, and the audit log says so."""
    held = Held(service, "knob_changed", lambda e: e.data["action"] == "reconfigure")
    _file_asks_for(service, 3)

    def begin() -> None:
        os.kill(os.getpid(), signal.SIGHUP)  # the daemon's own handler: a reload on a thread
        until(held.inside.is_set, 60, "the engine inside the reload's knobs")

    took = serve_then_stop(service, begin, held)
    assert took < BOUND_S, f"the stop took {took:.1f}s: it waited on the stuck reload"
    sql = "SELECT detail, data FROM events WHERE kind = 'config_error'"
    [(detail, data)] = rows(tmp_path / "audit.db", sql)
    assert detail == f"reload abandoned at the stop: {service.config_path}", detail
    data = json.loads(data)
    assert data["engine"] == "still_applying" and data["abandoned"] is True, data
    assert "the daemon began to stop while the engine was applying" in data["errors"][0], data


def test_a_reload_once_the_stop_began_is_refused_at_once(
    service: Service,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Once the stop began, a reload (SIGHUP, POST /admin/reload) is refused at once, not
    after the one under way (it waited for that reload's lock: up to a minute); and a SIGHUP
    starts none at all, saying so."""
    service.draining = True  # as the stop's first step sets it
    answers: list[dict] = []
    with service._reload_lock:  # a reload under way
        asked = threading.Thread(target=lambda: answers.append(service.reload()), daemon=True)
        asked.start()
        asked.join(BOUND_S)
        assert not asked.is_alive(), "a reload after the stop began waited on the one under way"
    assert answers == [{"reloaded": False, "reason": "shutting down: reloads are refused"}]

    reloads: list[str] = []
    monkeypatch.setattr(service, "reload", lambda: reloads.append("reload"))
    aio = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING, logger="kvguard.daemon"):
            service._on_sighup(aio)
    finally:
        aio.close()
    assert reloads == []
    assert "SIGHUP ignored: the daemon is stopping" in caplog.text


# -- a control-plane thread stuck elsewhere than on the engine -------------------------------------
# The daemon's own ticks and event evaluations get stuck for good once a rule has opened an
# incident: the NVML ticker's query (a wedged GPU's driver), the rules ticker's evaluation, and
# an event's evaluation on the scheduler's worker (which the rules ticker starts as it sticks).
# Each says so on stderr first. The daemon runs as a process of its own here: its exit is what
# is checked (the interpreter's exit waits for the scheduler's worker threads).
STUCK_CONTROL_PLANE = """\
import sys, threading
from kvguard.daemon.cli import main
from kvguard.daemon.control_plane import ControlPlane
from kvguard.daemon.nvml import NvmlReader
from kvguard.rules.evaluator import Evaluator

never = threading.Event()
plane = []
def stuck(what):
    print(f"test: stuck in {what} on {threading.current_thread().name}", file=sys.stderr, flush=True)
    never.wait()

start = ControlPlane.start
def start_polling_often(self):
    start(self)
    plane.append(self)
    self.nvml_ticker.set_interval(0.1)
ControlPlane.start = start_polling_often

read = NvmlReader.memory_used_ratio
def memory_used_ratio(self):
    if threading.current_thread().name == "kvguard-nvml" and plane and plane[0].evaluator.incident:
        stuck("an NVML query")
    return read(self)
NvmlReader.memory_used_ratio = memory_used_ratio

tick = Evaluator.try_tick
def try_tick(self):
    if threading.current_thread() is not threading.main_thread() and self.incident:
        if threading.current_thread().name == "kvguard-rules":
            plane[0]._soon("preemption_storm")
        stuck("a rules evaluation")
    return tick(self)
Evaluator.try_tick = try_tick

sys.exit(main(["serve", "--config", sys.argv[1]]))
"""
HALT_ON_ANY_HOST_MEMORY = """\
version: 1
interval: 100ms
signals:
  host_mem: {local: host_memory_used_ratio}
rules:
  - {name: halt, signal: host_mem, above: 0.000001, action: halt_admission,
     recover_below: 0.0000001, undo: resume_admission}
"""


def test_a_stop_does_not_wait_for_a_control_plane_thread_stuck_elsewhere(tmp_path: Path) -> None:
    """A tick or an evaluation stuck outside the engine (an NVML query on a wedged GPU): the
    stop joined them with no bound, before it queued `daemon_stop`, and the process then hung
    silently until systemd's SIGKILL, losing the stop's rows and the incident's close. Now the
    stop waits for them STOP_WAIT_S, names each (thread, where it is) in a WARNING, closes the
    incident, queues `daemon_stop` and exits within api.drain_timeout + STOP_AFTER_DRAIN_S."""
    from kvguard.daemon.service import STOP_AFTER_DRAIN_S

    db, rules, config = tmp_path / "audit.db", tmp_path / "rules.yaml", tmp_path / "config.yaml"
    rules.write_text(HALT_ON_ANY_HOST_MEMORY)
    config.write_text(
        "serving: {model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}\n"
        "api: {host: 127.0.0.1, port: 0, drain_timeout: 1s}\n"
        f"audit: {{url: 'sqlite:///{db}'}}\n"
        f"rules: {{path: {rules}}}\n"
    )
    log = tmp_path / "daemon.log"
    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path)}
    argv = [sys.executable, "-c", STUCK_CONTROL_PLANE, str(config)]
    stuck = (
        "test: stuck in an NVML query on kvguard-nvml",
        "test: stuck in a rules evaluation on kvguard-rules",
        "test: stuck in a rules evaluation on ThreadPoolExecutor",
    )
    bound = 1 + STOP_AFTER_DRAIN_S  # api.drain_timeout + the rest of the stop
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:

        def all_stuck() -> bool:
            text = log.read_text()
            return "ready:" in text and all(s in text for s in stuck)

        until(lambda: proc.poll() is not None or all_stuck(), 120, "three threads stuck")
        assert proc.poll() is None, log.read_text()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(bound)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {bound:g}s after SIGTERM:\n{log.read_text()}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
    out = log.read_text()
    assert code == 0 and took < bound, (code, took, out)
    warnings = [line for line in out.splitlines() if "WARNING kvguard.control: stop: " in line]
    assert len(warnings) == 3, out

    def warning(saying: str) -> str:
        [line] = [w for w in warnings if saying in w]
        return line

    nvml = warning("the nvml tick is running")
    assert "thread kvguard-nvml, in wait (threading.py:" in nvml, nvml
    assert "called from _poll_nvml (control_plane.py:" in nvml, nvml
    assert "thread kvguard-rules" in warning("the rules tick is running"), warnings
    assert "ThreadPoolExecutor" in warning("the evaluation of preemption_storm is running")
    assert "exiting with status 0 without waiting for 3 stuck control-plane threads" in out, out
    [(incident,)] = rows(db, "SELECT id FROM incidents WHERE closed_at IS NOT NULL")
    assert rows(db, "SELECT count(*) FROM incidents WHERE closed_at IS NULL") == [(0,)]
    [(detail, tagged)] = rows(db, "SELECT detail, incident FROM events WHERE kind='daemon_stop'")
    assert (detail, tagged) == ("exit 0", incident)
