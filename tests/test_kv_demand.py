"""`kv_cache_demand_ratio` on a real engine: the device KV blocks the engine would hold at its
configured `max_num_seqs` (those in use, and the blocks of the sequences a restored batch would
run next, in the scheduler's order: swapped ones first, their host blocks, then the waiting
queue, each its tokens' blocks) over the pool. A batch cut moves sequences off the device, so
KV usage falls by the cut's own doing; the demand does not, and the default batch cut's undo
reads it (tests/test_default_rules_flap.py runs the rules against it).

The tiny model on a 128-block pool of 16-token blocks; the numbers below are computed by hand
from the prompts' lengths, not read back from the scheduler."""

from __future__ import annotations

from math import ceil

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.daemon.metrics import SnapshotCollector
from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.snapshot import EngineSnapshot
from kvguard.rules.signals import local_value
from tests.test_engine import make_engine

BLOCK = 16
POOL = 128  # blocks of a 1 MiB pool of the tiny model
PROMPTS = [37, 20, 51, 70, 18, 33]  # tokens of requests r0..r5, each with blocks of its own
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def engine_with(configured: int, offload: bool) -> LLMEngine:
    return make_engine(
        kv_cache_bytes="1MiB",
        num_threads=1,
        max_num_seqs=configured,
        max_model_len=512,
        enable_cpu_offload=offload,
    )


def start(engine: LLMEngine, limit: int) -> None:
    """Queue r0..r5, each a prompt whose first token no other has (nothing found in the prefix
    cache, nobody waits on another's prompt), and run one step at a batch limit of `limit`:
    the first `limit` compute their prompts and draw a token, the rest wait."""
    cut = engine.set_max_num_seqs(limit, hold=True)
    for i, n in enumerate(PROMPTS):
        prompt = [5 + i] + [10 + k % 300 for k in range(n - 1)]
        engine.add_request(prompt, PARAMS, request_id=f"r{i}")
    engine.step()
    assert cut.result(0).ok and engine.latest_snapshot.num_running == limit


def cut_batch(engine: LLMEngine, n: int) -> EngineSnapshot:
    """The batch cut to `n` as the rules' `reduce_batch` applies it (at a step boundary, the
    newest running sequences preempted), and the snapshot of that step."""
    fut = engine.set_max_num_seqs(n, hold=True)
    engine.step()
    assert fut.result(0).ok
    return engine.latest_snapshot


def demand(snap: EngineSnapshot) -> float | None:
    return local_value("kv_cache_demand_ratio", snap, lambda: None, 0.0)


def test_demand_counts_the_swapped_then_the_waiting_sequences_a_restored_batch_would_run() -> None:
    """Configured for 5, r0..r2 running at a cut to 3, then cut to 1 with offload on: r1 and
    r2 swapped out (their host blocks hold their computed prompts), r3..r5 waiting unstarted.
    The configured batch would run r0, the two swapped, r3 and r4 (4 free slots): r5 is not
    counted."""
    engine = engine_with(configured=5, offload=True)
    start(engine, 3)
    snap = cut_batch(engine, 1)
    assert (snap.num_running, snap.num_swapped, snap.num_waiting) == (1, 2, 3), snap.queues
    # r0 ran two steps: its prompt and a token computed, a second drawn
    assert snap.blocks_used == ceil((PROMPTS[0] + 1) / BLOCK)
    swapped = sum(ceil(PROMPTS[i] / BLOCK) for i in (1, 2))  # their computed prompts
    waiting = sum(ceil(PROMPTS[i] / BLOCK) for i in (3, 4))  # r5 is past the configured batch
    assert snap.kv_demand_blocks == snap.blocks_used + swapped + waiting
    assert demand(snap) == (snap.blocks_used + swapped + waiting) / POOL
    assert demand(snap) > snap.kv_cache_usage_ratio


def test_demand_counts_preempted_for_recompute_sequences_in_queue_order() -> None:
    """Configured for 4, r0..r3 running, then cut to 1 with offload off: r1..r3 go back to
    the queue to be computed again, ahead of r4 and r5, which arrived after them. The
    configured batch's 3 free slots take r1..r3, each its prompt and the token it drew."""
    engine = engine_with(configured=4, offload=False)
    start(engine, 4)
    snap = cut_batch(engine, 1)
    assert (snap.num_running, snap.num_swapped, snap.num_waiting) == (1, 0, 5), snap.queues
    recompute = sum(ceil((PROMPTS[i] + 1) / BLOCK) for i in (1, 2, 3))
    assert snap.blocks_used == ceil((PROMPTS[0] + 1) / BLOCK)
    assert demand(snap) == (snap.blocks_used + recompute) / POOL


def test_demand_is_the_usage_when_nothing_waits_and_once_the_batch_is_restored() -> None:
    """Nothing waiting: the demand is the usage. Restored to the configured batch (nothing
    past it waits), the demand the cut left is what the device holds again."""
    engine = engine_with(configured=4, offload=True)
    engine.add_request([7] * 30, PARAMS, request_id="one")
    engine.step()
    snap = engine.latest_snapshot
    assert snap.num_waiting == snap.num_swapped == 0
    assert demand(snap) == snap.kv_cache_usage_ratio == ceil(30 / BLOCK) / POOL
    engine.add_request([8] * 40, PARAMS, request_id="two")
    cut = cut_batch(engine, 1)
    assert cut.num_swapped + cut.num_waiting == 1 and demand(cut) > cut.kv_cache_usage_ratio
    fut = engine.set_max_num_seqs(None)
    engine.step()
    back = engine.latest_snapshot
    assert fut.result(0).ok and back.num_running == 2 and back.num_swapped == back.num_waiting == 0
    assert demand(back) == back.kv_cache_usage_ratio


def test_the_demand_is_exported_as_a_gauge() -> None:
    """`kvguard_kv_cache_demand_ratio` is the snapshot's demand, as every local signal on the
    KV pool is a metric (an alert or a Grafana panel can show what the batch cut reads)."""
    engine = engine_with(configured=5, offload=True)
    start(engine, 3)
    snap = cut_batch(engine, 1)
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: snap, lambda: True))
    text = generate_latest(reg).decode()
    [fam] = [
        f for f in text_string_to_metric_families(text) if f.name == "kvguard_kv_cache_demand_ratio"
    ]
    assert [s.value for s in fam.samples] == [demand(snap)]
    assert fam.type == "gauge"
