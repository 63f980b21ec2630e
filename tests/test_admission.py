"""Admission control as property tests over random traces (seed §5)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.engine.admission import AdmissionConfig, AdmissionController, dynamic_max_tokens

BLOCK = 16
TOTAL = 64

requests = st.tuples(
    st.integers(1, 1500),  # prompt tokens
    st.integers(1, 600),  # max_new_tokens
    st.integers(0, 2),  # priority rank (0 = high)
    st.floats(0.0, 1.0),  # current KV usage ratio
)
traces = st.lists(st.tuples(st.sampled_from(["arrive", "start", "finish"]), requests), max_size=80)
configs = st.builds(
    AdmissionConfig,
    safety_factor=st.floats(1.0, 1.5),
    reserved_headroom_bytes=st.integers(0, 8).map(lambda b: b * 1000),
    dynamic_max_tokens=st.booleans(),
    max_queue=st.integers(0, 10),
    max_queue_wait_s=st.just(0.0),  # a hard count (the wait-bounded queue: tests below)
    high_priority_reserve=st.sampled_from([0.0, 0.1, 0.3]),
    # the brief's sum of peaks (predicted admission: tests/test_admission_predicted.py)
    estimate=st.just("worst_case"),
)


@settings(max_examples=300, deadline=None)
@given(cfg=configs, trace=traces)
def test_never_admits_past_budget_and_respects_the_queue_bound(cfg, trace) -> None:
    ctl = AdmissionController(cfg, BLOCK, bytes_per_block=1000)
    budget = ctl.budget_blocks(TOTAL)
    queue: list[tuple[int, int]] = []  # (projected blocks, rank) of queued requests
    running: list[int] = []
    for op, (prompt, max_new, rank, usage) in trace:
        limit = ctl.limit_blocks(TOTAL, rank)
        assert limit <= budget and (rank != 0 or limit == budget)
        if op == "arrive":
            d = ctl.decide(prompt, max_new, rank, TOTAL, usage, len(queue), 4096)
            # the known tokens (prompt and first output token) judged exactly, no safety factor
            if -(-(prompt + 1) // BLOCK) > limit:
                assert d.decision == "reject" and d.kind == "never_fits", (
                    "an impossible request got in"
                )
                continue
            if d.decision == "reject":
                assert d.reason and d.kind in ("never_fits", "overloaded", "queue_full")
                if d.kind == "queue_full" and "queue full" in d.reason:
                    assert len(queue) >= cfg.max_queue
                continue
            assert 1 <= d.max_tokens <= max_new
            assert d.truncated == (d.max_tokens < max_new)
            need = ctl.projected_blocks(prompt, d.max_tokens)
            assert -(-(prompt + d.max_tokens) // BLOCK) <= limit, "admitted what can never fit"
            # shortened to the longest answer that fits with the margin (one token at least)
            assert need <= limit or d.max_tokens == 1
            if d.decision == "admit":
                assert ctl.committed_blocks + need <= limit, "admitted into the high reserve"
                ctl.committed_blocks += need
                running.append(need)
            else:
                assert d.queue_position == len(queue) + 1
                queue.append((need, rank))
        elif op == "start" and queue:
            need, r = queue[0]
            before = ctl.committed_blocks
            if ctl.try_commit(need, TOTAL, r):
                # on an idle engine a request starts whatever its projection (try_commit)
                assert before + need <= ctl.limit_blocks(TOTAL, r) or before == 0
                running.append(queue.pop(0)[0])
            else:
                assert before + need > ctl.limit_blocks(TOTAL, r)
        elif op == "finish" and running:
            ctl.release(running.pop(0))
        assert ctl.committed_blocks <= budget or len(running) == 1
        assert ctl.committed_blocks == sum(running)
        assert len(queue) <= cfg.max_queue


def test_high_priority_reserve_keeps_room_for_high() -> None:
    cfg = AdmissionConfig(high_priority_reserve=0.25, estimate="worst_case")  # sum of peaks
    ctl = AdmissionController(cfg, BLOCK, 1000)
    assert (ctl.limit_blocks(TOTAL, 0), ctl.limit_blocks(TOTAL, 1)) == (64, 48)
    admitted = 0
    while (d := ctl.decide(64, 64, 1, TOTAL, 0.0, 0, 4096)).decision == "admit":
        ctl.committed_blocks += ctl.projected_blocks(64, d.max_tokens)
        admitted += 1
    # 64 + 64 × 1.15 tokens: 9 blocks each, a 6th would pass 48
    assert admitted == 5 and ctl.committed_blocks == 45
    assert ctl.decide(64, 64, 2, TOTAL, 0.0, 0, 4096).decision == "queue"  # low: no reserve
    assert ctl.decide(64, 64, 0, TOTAL, 0.0, 0, 4096).decision == "admit"  # high: the reserve
    assert not ctl.try_commit(10, TOTAL, 1) and ctl.try_commit(10, TOTAL, 0)
    with pytest.raises(ValueError, match="high_priority_reserve"):
        AdmissionConfig(high_priority_reserve=1.0)


@settings(max_examples=200, deadline=None)
@given(prompt=st.integers(1, 200), max_new=st.integers(1, 300), usage=st.floats(0.951, 1.0))
def test_emergency_mode_takes_only_high_priority(prompt, max_new, usage) -> None:
    ctl = AdmissionController(AdmissionConfig(estimate="worst_case"), BLOCK, 1000)
    pred = AdmissionController(AdmissionConfig(), BLOCK, 1000)
    for rank in (1, 2):
        d = ctl.decide(prompt, max_new, rank, TOTAL, usage, 0, 4096)
        assert d.decision == "reject" and d.kind == "overloaded" and "only high" in d.reason
        # predicted admission works above 95% by design: others wait in the queue instead
        q = pred.decide(prompt, max_new, rank, TOTAL, usage, 0, 4096)
        assert q.decision in ("queue", "reject") and q.kind != "overloaded", q
    for c in (ctl, pred):
        high = c.decide(prompt, max_new, 0, TOTAL, usage, 0, 4096)
        assert high.decision in ("admit", "queue"), high


@given(st.integers(1, 5000), st.floats(0.0, 1.0), st.integers(1, 5000))
def test_dynamic_max_tokens_ladder_never_grows_and_stays_positive(req, usage, remaining) -> None:
    n = dynamic_max_tokens(req, usage, remaining)
    assert 1 <= n <= max(1, min(req, remaining))
    if usage < 0.5:
        assert n == min(req, remaining)
    if usage >= 0.9:
        assert n <= 100


def test_ladder_matches_the_brief() -> None:
    assert dynamic_max_tokens(1000, 0.3, 4000) == 1000
    assert dynamic_max_tokens(1000, 0.6, 4000) == 750
    assert dynamic_max_tokens(1000, 0.8, 4000) == 500
    assert dynamic_max_tokens(1000, 0.95, 4000) == 100
    assert dynamic_max_tokens(60, 0.8, 4000) == 50  # "at least 50 tokens" (never above the ask)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_past_max_queue_a_request_waits_while_the_queue_drains_in_time() -> None:
    cfg = AdmissionConfig(max_queue=4, max_queue_wait_s=10.0, estimate="worst_case")
    ctl = AdmissionController(cfg, BLOCK, 1000)
    ctl.clock = clock = Clock()
    full = ctl.decide(16, 16, 1, TOTAL, 0.0, 4, 4096)
    # nothing finished yet: the drain rate is unknown and max_queue is the limit
    assert (full.decision, full.kind) == ("reject", "queue_full")
    assert full.reason == "queue full (4 waiting)"
    for _ in range(30):  # 30 finishes in the last 10 s: 3 requests/s
        clock.now += 0.3
        ctl.release(1)
    assert ctl.finish_rate() == pytest.approx(3.0)
    assert ctl.drain_s(24) == pytest.approx(8.0)
    d = ctl.decide(16, 16, 1, TOTAL, 0.0, 24, 4096)  # 24 ahead start within 8 s
    assert d.decision == "queue" and d.queue_position == 25
    far = ctl.decide(16, 16, 1, TOTAL, 0.0, 45, 4096)  # 15 s to drain: 5 s past the bound
    assert (far.decision, far.kind) == ("reject", "queue_full")
    assert far.reason == "queue full (45 waiting, about 15s to drain)"
    assert far.estimated_wait_s == pytest.approx(5.0)
    clock.now += 20  # nothing finished for 20 s: the rate is unknown again
    assert ctl.finish_rate() == 0.0
    assert ctl.decide(16, 16, 1, TOTAL, 0.0, 5, 4096).decision == "reject"
    # under max_queue a request queues however slowly the queue moves
    assert ctl.decide(16, 16, 1, TOTAL, 0.0, 3, 4096).decision == "queue"
    hard = AdmissionController(AdmissionConfig(max_queue=4, max_queue_wait_s=0.0), BLOCK, 1000)
    hard.clock = clock
    for _ in range(30):
        clock.now += 0.01
        hard.release(1)
    assert hard.decide(16, 16, 1, TOTAL, 0.0, 4, 4096).kind == "queue_full"  # 0: a hard limit


def test_the_finish_rate_is_read_without_changing_the_record() -> None:
    """The event loop's 429 reads the finish rate while the engine thread records finishes:
    the engine thread's reading forgot the stale ones, so two rates were computed, one
    read-only for the event loop. Reading changes nothing now, from either thread; the engine
    thread forgets the stale finishes at its next one."""
    ctl = AdmissionController(AdmissionConfig(), BLOCK, 1000)
    ctl.clock = clock = Clock()
    for at in (1000.0, 1000.0, 1008.0):
        clock.now = at
        ctl.release(1)
    clock.now = 1012.0  # the first two are past the 10 s window
    assert ctl.finish_rate() == pytest.approx(0.1)
    assert ctl.slot_wait_s(2) == pytest.approx(20.0)  # two starts, one finish each
    assert list(ctl._finished) == [1000.0, 1000.0, 1008.0]  # read, not forgotten
    ctl.release(1)
    assert list(ctl._finished) == [1008.0, 1012.0]
    assert ctl.finish_rate() == pytest.approx(0.2)


def test_estimated_wait_uses_measured_release_rate() -> None:
    ctl = AdmissionController(AdmissionConfig(), BLOCK, 1000)
    assert ctl.wait_s(10) == 1.0  # unknown rate: a short default hint
    for _ in range(5):
        ctl.release(4)
        time.sleep(0.01)
    rate = ctl.release_rate()
    assert rate > 0
    assert abs(ctl.wait_s(8) - min(30.0, 8 / rate)) < 1e-9
