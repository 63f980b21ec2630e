"""An idle engine gets its halved step budget back on time, and the audit says so; a prompt is
counted once per API request, however many choices it asks for.

The budget an out-of-memory fault halved doubled back only inside a step: with no traffic it
stayed halved (on the `kvguard_max_num_batched_tokens` gauge too) until the next request, and
the doubling was never audited, so an incident's timeline ended on the halved value. With n > 1
every choice is an engine request of its own, and each added the prompt to
`kvguard_prompt_tokens_total`, while `usage.prompt_tokens` counts it once.

A step that kept running out of memory once the budget was at its floor was retried at once,
as fast as the engine could run it, and each fault was a warning and an audit row: hundreds a
second, enough to fill the audit queue and push the remedies' own rows out.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvguard.daemon.config import load_config
from kvguard.daemon.service import Service
from kvguard.engine.engine_loop import EngineLoop
from kvguard.engine.events import EngineEvent
from kvguard.engine.sampling_params import SamplingParams
from tests.test_engine import PROMPTS, make_engine
from tests.test_remedies import greedy
from tests.test_server import Daemon, until

QUIET_S = 1.0  # oom_quiet_period: a request of a few tokens ends well inside it
WAIT_S = 60.0  # generous: what the tests wait for comes after a quiet period or two
# what the README promises of an out-of-memory burst at the floor budget: one report per 5 s,
# each retry after a pause of 10 ms doubling up to 0.5 s
REPORT_EVERY_S = 5.0
PAUSES = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5]


def test_idle_engine_doubles_the_budget_back_on_its_deadline() -> None:
    """Two OOMs quarter the budget; with the engine idle from then on, it doubles back after
    each quiet period, on the engine's deadline: the loop's idle wait (an hour here) is cut
    short for it, and every doubling is an event and in the snapshot."""
    engine = make_engine(oom_quiet_period_s=QUIET_S, max_num_batched_tokens=512)
    restored: list[EngineEvent] = []
    back = threading.Event()

    def on_event(event: EngineEvent) -> None:
        if event.kind == "step_budget_restored":
            restored.append(event)
            if event.data["max_num_batched_tokens_after"] == 512:
                back.set()

    engine.events.subscribe(on_event)
    # served on this thread, before the loop starts: no step runs after the request ends
    engine.inject_oom(2)
    rid = engine.add_request(PROMPTS[0], greedy(2))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [rid] and done[0].finish_reason == "length"
    oom = engine.events.recent("engine_oom")
    assert [e.data["max_num_batched_tokens_after"] for e in oom] == [256, 128]
    assert engine.latest_snapshot.max_num_batched_tokens == 128, "restored before going idle"
    loop = EngineLoop(engine, idle_wait_s=3600.0).start()
    try:
        assert back.wait(WAIT_S), f"budget not back: {engine.latest_snapshot.knobs}"
        budgets = [
            (e.data["max_num_batched_tokens_before"], e.data["max_num_batched_tokens_after"])
            for e in restored
        ]
        assert budgets == [(128, 256), (256, 512)]
        # each a whole quiet period after the OOM, or after the doubling before it
        assert restored[0].monotonic - oom[-1].monotonic >= QUIET_S
        assert restored[1].monotonic - restored[0].monotonic >= QUIET_S
        assert all(e.data["configured"] == 512 for e in restored)
        until(
            lambda: engine.latest_snapshot.max_num_batched_tokens == 512,
            WAIT_S,
            "the snapshot to show the budget back",
        )
        assert engine.budget_cut is None and engine.budget_restore_in() is None
    finally:
        loop.stop()


# -- through the daemon ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - (Daemon, audit.db)
    tmp = tmp_path_factory.mktemp("idle_restore")
    d = Daemon(
        tmp,
        serving="{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, "
        f"oom_quiet_period: {QUIET_S:g}s}}",
    )
    yield d, tmp / "audit.db"
    assert d.stop() == 0


def gauge(d: Daemon, name: str) -> float:
    text = httpx.get(d.url + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


def events(db: Path, kind: str) -> list[tuple[str | None, str]]:
    """(incident, detail) of every `kind` event row, in order."""
    with sqlite3.connect(db) as c:
        q = "select incident, detail from events where kind = ? order by id"
        return c.execute(q, (kind,)).fetchall()


def test_prompt_tokens_counted_once_per_prompt_with_n_choices(served) -> None:  # noqa: ANN001
    d, _ = served
    c = d.client()
    before = gauge(d, "kvguard_prompt_tokens_total")
    one = c.completions.create(model="tiny", prompt="Hello there", max_tokens=2, n=3)
    assert len(one.choices) == 3 and one.usage.prompt_tokens == len(b"Hello there")
    two = c.completions.create(model="tiny", prompt=["Hi you", "Good day"], max_tokens=2, n=2)
    assert len(two.choices) == 4 and two.usage.prompt_tokens == len(b"Hi you" + b"Good day")
    counted = gauge(d, "kvguard_prompt_tokens_total") - before
    assert counted == one.usage.prompt_tokens + two.usage.prompt_tokens


def test_idle_daemon_restores_the_budget_and_audits_it(served) -> None:  # noqa: ANN001
    d, db = served
    configured = gauge(d, "kvguard_max_num_batched_tokens")
    assert d.admin("POST", "/admin/debug/inject_oom", json={"times": 1}).status_code == 200
    r = d.client().completions.create(model="tiny", prompt="out of memory", max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    (oom_incident, detail), *_ = until(lambda: events(db, "engine_oom"), WAIT_S, "the OOM row")
    assert f"batch budget {configured:g} -> {configured / 2:g}" in detail
    assert oom_incident is not None  # the oom-chain rule acted: its incident stays open 60s
    # no request from here on: the budget comes back all the same
    until(
        lambda: gauge(d, "kvguard_max_num_batched_tokens") == configured,
        WAIT_S,
        f"kvguard_max_num_batched_tokens back at {configured:g}",
    )
    rows = until(lambda: events(db, "step_budget_restored"), WAIT_S, "the restore row")
    assert rows == [
        (
            oom_incident,
            f"batch budget {configured / 2:g} -> {configured:g} (configured {configured:g}) "
            f"after a quiet {QUIET_S:g}s",
        )
    ]


# -- an out-of-memory loop at the floor budget ------------------------------------------------
class PauseClock:
    """The engine's OOM clock, moved on by its pauses alone (and by the test): what a burst
    reports then depends on its faults, not on how fast this machine runs them."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


@pytest.fixture
def service(tiny_dir: Path, tmp_path: Path) -> Iterator[Service]:
    """A daemon's parts in this process (its log records are caplog's), the default rules'
    OOM chain included, with a SQLite audit database; a halved budget stays halved."""
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"serving: {{model: {tiny_dir}, kv_cache_bytes: 8MiB, max_model_len: 256, "
        "oom_quiet_period: 1h}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    yield svc
    svc.close()


def test_an_oom_loop_at_the_floor_budget_is_reported_once_per_window_and_backs_off(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """200 faults in a row: the 5 that halve the budget (2048 -> 64) are reported one by one,
    the 195 at the floor after a pause each and counted, one warning and one audit row per
    5 s of the clock; the OOM chain still acts on the burst."""
    engine, clock, faults = service.engine, PauseClock(), 200
    engine.oom_clock, engine.oom_sleep = clock, clock.sleep
    start = clock.now

    def request(rid: str) -> None:
        stream = service.loop.submit("out of memory", SamplingParams(max_tokens=2), request_id=rid)
        assert stream.result(WAIT_S).finish_reason == "length"

    def rows(kind: str) -> list[dict]:
        assert service.audit.flush(10)
        return service.audit.list_events(kind=kind, limit=None)

    def counted() -> list[dict] | None:
        got = rows("engine_oom_repeated")
        return got if sum(r["data"]["count"] for r in got) == faults - 5 else None

    def warned() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith("out of memory")]

    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        service.loop.call(lambda: engine.inject_oom(faults)).result(10)
        request("cmpl-oomloop-0")
        windows = (clock.now - start) / REPORT_EVERY_S
        assert len(warned()) <= 5 + windows, f"{len(warned())} warnings for {faults} faults"
        clock.now += REPORT_EVERY_S  # the last window's count comes once it has passed, idle
        repeated = until(counted, WAIT_S, "the count of every fault at the floor")
    windows = (clock.now - start) / REPORT_EVERY_S
    budgets = [
        (r["data"]["max_num_batched_tokens_before"], r["data"]["max_num_batched_tokens_after"])
        for r in until(lambda: rows("engine_oom"), WAIT_S, "the engine_oom rows")
    ]
    assert budgets == [(2048, 1024), (1024, 512), (512, 256), (256, 128), (128, 64)]
    assert len(repeated) <= windows and len(warned()) == 5 + len(repeated)
    assert all(
        r["data"]["requeued"] == ["cmpl-oomloop-0"] and r["data"]["max_num_batched_tokens"] == 64
        for r in repeated
    )
    assert clock.pauses == PAUSES + [PAUSES[-1]] * (faults - 5 - len(PAUSES))
    until(lambda: service.audit.list_actions(action="handle_oom"), WAIT_S, "the OOM chain's row")
    # a step ran since: the next fault at the floor, a burst of its own, is reported on its
    # own and paused after as briefly as the first
    clock.pauses.clear()
    service.loop.call(lambda: engine.inject_oom(1)).result(10)
    request("cmpl-oomloop-1")
    assert clock.pauses == PAUSES[:1]
    last = until(lambda: rows("engine_oom")[5:], WAIT_S, "the new burst's engine_oom row")
    assert [r["data"]["requeued"] for r in last] == [["cmpl-oomloop-1"]]
