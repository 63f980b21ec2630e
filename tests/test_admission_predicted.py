"""Predicted admission (issue 17): the output-length estimator, the overlap peak, an engine whose
predictions undershoot, the FP8 cap that keeps the way back open, and the config key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.daemon.config import load_config
from kvguard.engine.admission import (
    AdmissionConfig,
    AdmissionController,
    OutputLengthEstimator,
    overlap_peak,
)
from kvguard.engine.config import EngineConfig
from kvguard.engine.knobs import ConfigError
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.sampling_params import SamplingParams
from tests.test_remedies import run_all

BLOCK = 16


# -- the estimator ------------------------------------------------------------------------------
def test_cold_start_is_the_worst_case() -> None:
    est = OutputLengthEstimator()
    assert est.ratio(100) == 1.0 and est.predict(100) == 100
    for _ in range(est.min_samples - 1):
        est.observe(100, 10, 100)
    assert est.predict(100) == 100, "too few samples must still plan for max_tokens"


def test_converges_to_the_realised_quantile() -> None:
    est = OutputLengthEstimator(quantile=0.9, window=100)
    realised = [10 + (i * 37) % 41 for i in range(200)]  # 10..50 of max_tokens 100, spread out
    for r in realised:
        est.observe(100, r, est.predict(100))
    window = sorted(x / 100 for x in realised[-100:])
    assert est.ratio(100) == pytest.approx(window[89])  # nearest rank: the 90th of 100
    assert est.predict(100) == round(100 * window[89])
    err = est.error()
    assert err["samples"] == 200 and 0.0 <= err["undershoot_share"] <= 1.0


def test_floor_bounds_the_prediction() -> None:
    est = OutputLengthEstimator(floor=0.2)
    for _ in range(20):
        est.observe(200, 1, 200)
    assert est.ratio(200) == 0.2 and est.predict(200) == 40


def test_buckets_learn_separately_and_a_cold_bucket_borrows_the_pool() -> None:
    est = OutputLengthEstimator(quantile=1.0)
    for _ in range(10):
        est.observe(64, 16, 64)  # 0.25 in the le64 bucket
        est.observe(256, 192, 256)  # 0.75 in the le256 bucket
    assert est.ratio(60) == 0.25 and est.predict(64) == 16
    assert est.ratio(200) == 0.75 and est.predict(256) == 192
    assert est.ratio(1000) == 0.75  # no le1024 samples yet: the pooled quantile
    assert set(est.ratios()) == {"le64", "le256"}


def test_overlap_peak_counts_only_requests_still_running() -> None:
    assert overlap_peak([]) == 0
    # two requests holding 10 tokens: one ends in 2 steps, one in 100
    assert overlap_peak([(10, 2), (10, 100)]) == 110
    assert overlap_peak([(50, 5), (50, 5)]) == 110
    # the old rule would reserve the sum of the peaks: 10+2 + 10+100 = 122
    assert overlap_peak([(10, 2), (10, 100)]) < 122
    # in blocks, each request rounded up: 2 x ceil(55 x 1.0 / 16) at tau = 5
    assert overlap_peak([(50, 5), (50, 5)], 16) == 8
    assert overlap_peak([(60, 20), (60, 20)], 16, 1.15) == 2 * 6


# -- admission ----------------------------------------------------------------------------------
def test_cold_predicted_admission_decides_like_worst_case() -> None:
    worst = AdmissionController(AdmissionConfig(estimate="worst_case"), BLOCK, 1000)
    pred = AdmissionController(AdmissionConfig(estimate="predicted"), BLOCK, 1000)
    for prompt, max_new in ((10, 30), (100, 300), (5, 1)):
        a = worst.decide(prompt, max_new, 1, 64, 0.1, 0, 4096)
        b = pred.decide(prompt, max_new, 1, 64, 0.1, 0, 4096)
        assert (a.decision, a.max_tokens) == (b.decision, b.max_tokens)
        assert b.predicted_tokens == b.max_tokens


def test_warm_predicted_admission_plans_for_the_quantile() -> None:
    ctl = AdmissionController(AdmissionConfig(estimate="predicted"), BLOCK, 1000)
    for _ in range(10):
        ctl.estimator.observe(256, 32, 256)
    d = ctl.decide(20, 256, 1, 64, 0.1, 0, 4096)
    assert d.decision == "admit" and d.max_tokens == 256 and d.predicted_tokens == 32
    # with the pool's worth of admitted work live, the same request waits
    ctl.live = lambda rank: [(200, 300)] * 3
    assert ctl.decide(20, 256, 1, 64, 0.1, 0, 4096).decision == "queue"
    # high priority is judged against high-priority work only: lower work gets preempted
    ctl.live = lambda rank: [] if rank == 0 else [(200, 300)] * 3
    assert ctl.decide(20, 256, 0, 64, 0.1, 0, 4096).decision == "admit"
    assert ctl.decide(20, 256, 2, 64, 0.1, 0, 4096).decision == "queue"


def test_overcommit_grows_while_nothing_is_preempted_and_is_cut_when_something_is() -> None:
    ctl = AdmissionController(AdmissionConfig(max_overcommit=1.5), BLOCK, 1000)
    assert ctl.overcommit == 1.0  # a fresh daemon plans at the budget
    ctl.on_step(0, 0.5)
    assert ctl.overcommit == pytest.approx(1.01)
    for _ in range(200):
        ctl.on_step(0, 0.89)
    assert ctl.overcommit == 1.5  # never past the knob
    ctl.on_step(3, 0.5)  # a step that preempted
    assert ctl.overcommit == pytest.approx(1.125)
    for _ in range(50):
        ctl.on_step(0, 0.3)
    ctl.on_step(0, 0.9)  # a step that ended with KV pressed
    assert ctl.overcommit == pytest.approx(1.125)
    ctl.on_step(1, 0.95)
    assert ctl.overcommit == 1.0  # never below the budget
    never = AdmissionController(AdmissionConfig(max_overcommit=1.0), BLOCK, 1000)
    worst = AdmissionController(AdmissionConfig(estimate="worst_case"), BLOCK, 1000)
    for _ in range(50):
        never.on_step(0, 0.1)
        worst.on_step(0, 0.1)
    assert never.overcommit == 1.0 and worst.overcommit == 1.0


def test_predicted_admission_plans_past_the_budget_by_the_overcommit() -> None:
    ctl = AdmissionController(AdmissionConfig(high_priority_reserve=0), BLOCK, 1000)
    for _ in range(10):
        ctl.estimator.observe(64, 64, 64)  # answers run to their max_tokens
    ctl.live = lambda rank: [(47 * BLOCK, 20)]  # 47 blocks held, 20 tokens to come
    # 20 steps on: 49 blocks + the new request's 20 + 20 tokens in 3 = 52 against a budget of 50
    assert ctl.decide(20, 64, 1, 50, 0.1, 0, 4096).decision == "queue"
    ctl.overcommit = 1.1  # 55 blocks
    assert ctl.decide(20, 64, 1, 50, 0.1, 0, 4096).decision == "admit"
    # what can never fit the budget itself is still refused, whatever the overcommit
    ctl.overcommit = 1.5
    d = ctl.decide(51 * BLOCK, 64, 1, 50, 0.1, 0, 4096)
    assert d.decision == "reject" and d.kind == "never_fits"


@pytest.mark.parametrize(
    ("usage", "predicted_cut", "worst_case_cut"),
    [(0.3, 200, 200), (0.6, 200, 150), (0.8, 200, 100), (0.92, 100, 100)],
)
def test_predicted_admission_cuts_max_tokens_only_in_the_emergency_band(
    usage: float, predicted_cut: int, worst_case_cut: int
) -> None:
    """The ladder's lower bands shrink worst-case reservations; a predicted one is planned from
    realised lengths, so there a cut would only lose tokens."""
    pred = AdmissionController(AdmissionConfig(high_priority_reserve=0), BLOCK, 1000)
    worst = AdmissionController(
        AdmissionConfig(estimate="worst_case", high_priority_reserve=0), BLOCK, 1000
    )
    assert pred.decide(10, 200, 1, 640, usage, 0, 4096).max_tokens == predicted_cut
    assert worst.decide(10, 200, 1, 640, usage, 0, 4096).max_tokens == worst_case_cut


# -- the engine ---------------------------------------------------------------------------------
def make_engine(**kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", "32MiB")
    kw.setdefault("num_threads", 2)
    return LLMEngine.from_config(EngineConfig(model="tiny", **kw), progress=False)


def test_undershooting_predictions_lose_nothing() -> None:
    """The estimator learnt from short answers; then every request runs to max_tokens. Admission
    lets in far more than fits, the overshoot is absorbed by preemption, nothing is lost."""
    adm = AdmissionConfig(estimate="predicted", dynamic_max_tokens=False, high_priority_reserve=0)
    engine = make_engine(num_gpu_blocks=24, max_num_seqs=16, admission=adm)
    for _ in range(16):
        engine.admission.estimator.observe(96, 2, 96)  # answers used to end after 2 tokens
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    rids = [engine.add_request(list(range(3, 3 + 20)), params) for _ in range(8)]
    admitted = sum(engine.admission_policy.is_admitted(engine._seqs[r]) for r in rids)
    assert admitted > 2, "predicted admission should let more start than the worst case"
    done = run_all(engine)
    assert sorted(done) == sorted(rids)
    assert all(o.num_output_tokens == 96 and o.finish_reason == "length" for o in done.values())
    assert engine.scheduler.num_preemptions > 0, "the overshoot was absorbed by preemption"
    assert engine.admission.committed_blocks == 0
    assert engine.admission.estimator.error()["undershoot_share"] > 0  # it saw them outrun


def test_the_engine_loosens_admission_until_steps_preempt_then_tightens_it() -> None:
    """Every scheduled step reports its preemptions and KV usage: overcommit grows on calm
    steps and falls on every step that preempted or pressed the pool, and the long answers
    still lose nothing."""
    adm = AdmissionConfig(dynamic_max_tokens=False, high_priority_reserve=0)
    engine = make_engine(num_gpu_blocks=24, max_num_seqs=16, admission=adm)
    ctl = engine.admission
    for _ in range(16):
        ctl.estimator.observe(96, 2, 96)  # answers used to end after 2 tokens
    trail: list[tuple[float, int, float, float]] = []  # (before, preempted, usage, after)
    report = ctl.on_step

    def recorded(preempted: int, usage: float) -> None:
        before = ctl.overcommit
        report(preempted, usage)
        trail.append((before, preempted, usage, ctl.overcommit))

    ctl.on_step = recorded
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    rids = [engine.add_request(list(range(3, 3 + 20)), params) for _ in range(8)]
    preempted_before = engine.scheduler.num_preemptions
    done = run_all(engine)
    assert sorted(done) == sorted(rids)
    assert sum(p for _, p, _, _ in trail) == engine.scheduler.num_preemptions - preempted_before
    pressed = [(b, a) for b, p, u, a in trail if p or u >= 0.9]
    calm = [(b, a) for b, p, u, a in trail if not p and u < 0.9]
    assert pressed and calm, "the overshoot should have pressed the pool, then let go"
    assert all(a == max(1.0, b * 0.75) for b, a in pressed)
    assert all(a == pytest.approx(min(1.5, b + 0.01)) for b, a in calm)
    assert max(a for *_, a in trail) > 1.0


def test_the_fp8_remedy_gives_the_load_its_larger_pool_and_the_undo_waits_until_it_fits() -> None:
    """FP8 is relief: the load may take every block of the larger pool (4x the tokens) (twelve requests of
    seven blocks each run at once where the fp32 pool holds forty blocks). The switch back is
    refused, naming why, while the live K/V would not fit the fp32 pool, and applies once
    they do."""
    engine = make_engine(num_gpu_blocks=40, max_num_seqs=16)
    full = engine.block_manager.num_blocks
    assert engine.set_kv_cache_dtype("fp8_e4m3") and engine.step() == []
    assert engine.kv_cache.dtype == "fp8_e4m3" and engine.block_manager.num_blocks > 3 * full
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    rids = [
        engine.add_request([3 + (7 * i + j) % 300 for j in range(40)], params) for i in range(12)
    ]
    for _ in range(40):  # the prompts in, and some tokens each
        engine.step()
    assert engine.block_manager.num_used > full and len(engine.scheduler.running) == 12
    fut = engine.set_kv_cache_dtype("auto")
    engine.step()
    res = fut.result(timeout=5)
    assert not res.ok and "retry when usage is lower" in res.detail
    done = run_all(engine)
    assert sorted(done) == sorted(rids) and engine.scheduler.num_preemptions == 0
    fut = engine.set_kv_cache_dtype("auto")
    engine.step()
    assert fut.result(timeout=5).ok and engine.kv_cache.dtype == "fp32"


def test_fp8_undo_applies_while_requests_are_live() -> None:
    """The way back applies under live requests whose K/V, and growth, fit the fp32 pool."""
    engine = make_engine(num_gpu_blocks=40, max_num_seqs=16)
    engine.set_kv_cache_dtype("fp8_e4m3")
    engine.step()
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    for _ in range(2):
        engine.add_request(list(range(3, 3 + 40)), params)
    for _ in range(30):
        engine.step()
    assert engine.block_manager.num_used > 0
    fut = engine.set_kv_cache_dtype("auto")
    engine.step()
    assert fut.result(timeout=5).ok, fut.result().detail
    done = run_all(engine)
    assert len(done) == 2


# -- the config key -----------------------------------------------------------------------------
def test_estimate_key_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("admission_control: {estimate: worst_case, estimate_quantile: 0.8}\n")
    adm = load_config(path).to_engine_config().admission
    assert adm.estimate == "worst_case" and adm.estimate_quantile == 0.8
    assert load_config(None).to_engine_config().admission.estimate == "predicted"
    path.write_text("admission_control: {estimate: optimistic}\n")
    with pytest.raises(Exception, match="estimate"):
        load_config(path)
    with pytest.raises(ConfigError, match="estimate"):
        AdmissionConfig(estimate="optimistic")


# -- what operators see -------------------------------------------------------------------------
def test_estimate_and_error_are_exported_and_shown() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvguard.daemon.cli_serve import _estimate_line
    from kvguard.daemon.metrics import SnapshotCollector

    engine = make_engine(num_gpu_blocks=40, admission=AdmissionConfig())
    for _ in range(5):
        engine.admission.estimator.observe(128, 32, 128)
    snap = engine.snapshot()
    adm = snap.admission
    assert adm["estimate"] == "predicted" and adm["output_ratio"] == {"le128": 0.25}
    assert adm["estimate_error"]["samples"] == 5
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: snap, lambda: True))
    text = generate_latest(reg).decode()
    assert 'kvguard_admission_output_ratio_estimate{bucket="le128"} 0.25' in text
    assert "kvguard_admission_estimate_error_ratio -0.75" in text
    assert "kvguard_admission_estimate_undershoot_ratio 0.0" in text
    assert "kvguard_admission_overcommit_ratio 1.0" in text
    assert f"kvguard_admission_finish_rate {adm['finish_rate']}" in text
    line = _estimate_line(adm)
    assert line.startswith("predicted") and "le128=0.25" in line and "error -0.75" in line
    assert "overcommit 1.00x" in line


def test_the_finish_rate_falls_to_0_on_an_idle_engine() -> None:
    """kvguard_admission_finish_rate is requests finished per second over the last 10 s. The
    snapshot it is read from was rebuilt only by a step, so an engine that went idle reported
    its last busy rate for ever; the idle loop now rebuilds it (at most once a second)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvguard.daemon.metrics import SnapshotCollector
    from kvguard.engine.engine_loop import EngineLoop
    from tests.test_server import until

    engine = make_engine(admission=AdmissionConfig())
    now = [1000.0]
    engine.admission.clock = lambda: now[0]  # the admission window's clock: moved by hand
    loop = EngineLoop(engine).start()

    def rate() -> float:
        return engine.latest_snapshot.admission["finish_rate"]

    try:
        for _ in range(3):
            loop.submit([5, 6, 7, 8], SamplingParams(max_tokens=2)).result(60)
        until(lambda: rate() == 0.3, 30, "3 finishes in the last 10 s")
        now[0] += 11  # nothing finished in the last 10 s
        until(lambda: rate() == 0.0, 30, "the idle engine's finish rate at 0")
    finally:
        loop.stop()
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: engine.latest_snapshot, lambda: True))
    assert "\nkvguard_admission_finish_rate 0.0\n" in generate_latest(reg).decode()
