"""`kv_cache_demand_ratio` on a real engine: the device KV blocks the engine would hold at its
configured `max_num_seqs` (those in use, and the blocks of the sequences a restored batch would
start next, in the scheduler's order: swapped ones first, their host blocks, then the waiting
requests that would start, each its tokens' blocks) over the pool. A batch cut moves sequences
off the device, so KV usage falls by the cut's own doing; the demand does not, and the default
batch cut's undo reads it (tests/test_default_rules_flap.py runs the rules against it). A
request admission holds back for KV would not start, so it adds nothing, and a sequence is
charged only the blocks it would not share through the prefix cache.

The tiny model on a 128-block pool of 16-token blocks; the numbers below are computed by hand
from the prompts' lengths, not read back from the scheduler."""

from __future__ import annotations

from math import ceil

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.daemon.metrics import SnapshotCollector
from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.admission import AdmissionConfig
from kvguard.engine.snapshot import EngineSnapshot, build_snapshot
from kvguard.rules.signals import local_value
from tests.test_engine import make_engine

BLOCK = 16
POOL = 128  # blocks of a 1 MiB pool of the tiny model
PROMPTS = [37, 20, 51, 70, 18, 33]  # tokens of requests r0..r5, each with blocks of its own
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


# a system prompt of 4 full blocks every request of the shared-prefix tests begins with
SHARED = [9] + [200 + k % 50 for k in range(63)]


def engine_with(configured: int, offload: bool, **kw: object) -> LLMEngine:
    return make_engine(
        kv_cache_bytes="1MiB",
        num_threads=1,
        max_num_seqs=configured,
        max_model_len=512,
        enable_cpu_offload=offload,
        **kw,
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


def test_a_queue_admission_holds_back_for_kv_adds_nothing_to_the_demand() -> None:
    """No cut in force, configured for 8: worst-case admission commits 300 prompt tokens and
    150 of output for each of twelve requests and holds nine back for KV, so three run and
    five slots stand open. A restored batch is the batch in force: it starts none of the
    nine, and the demand is the usage (it read 1.19 at usage 0.45, and the default rule
    halved the batch of a half-empty pool for as long as the backlog lasted). Reading it
    commits nothing."""
    engine = engine_with(
        configured=8,
        offload=False,
        admission=AdmissionConfig(estimate="worst_case", reserved_headroom_bytes=0),
    )
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    for i in range(12):
        engine.add_request([5 + i] + [10 + k % 240 for k in range(299)], params, request_id=f"g{i}")
    engine.step()
    snap = engine.latest_snapshot
    assert (snap.num_running, snap.num_waiting, snap.max_num_seqs) == (3, 9, 8), snap.queues
    assert snap.blocks_used == 3 * ceil(300 / BLOCK)
    assert snap.kv_demand_blocks == snap.blocks_used
    assert demand(snap) == snap.kv_cache_usage_ratio
    committed = engine.admission.committed_blocks
    assert build_snapshot(engine).kv_demand_blocks == snap.blocks_used
    assert engine.admission.committed_blocks == committed


def test_an_admitted_request_queued_behind_ones_held_back_for_kv_is_charged() -> None:
    """A short `low` request arrives first and is admitted (nothing committed yet), then the
    twelve long ones, of which admission holds nine back for KV; at a batch limit of 3 the
    three admitted long ones run. The low request waits behind the nine (it is served as if
    it had come `low_priority_delay_s` later), admitted: a batch restored to 8 would start
    it, so the demand charges its prompt's 2 blocks. The walk for who starts next stops past
    the last admitted request, not at the end of the queue: this one is the last."""
    engine = engine_with(
        configured=8,
        offload=False,
        admission=AdmissionConfig(estimate="worst_case", reserved_headroom_bytes=0),
    )
    cut = engine.set_max_num_seqs(3, hold=True)
    low = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request([4] + [7] * 19, low, request_id="low", priority="low")
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    for i in range(12):
        engine.add_request([5 + i] + [10 + k % 240 for k in range(299)], params, request_id=f"g{i}")
    engine.step()
    assert cut.result(0).ok
    snap = engine.latest_snapshot
    assert (snap.num_running, snap.num_waiting) == (3, 10), snap.queues
    policy, waiting = engine.admission_policy, engine.scheduler.waiting
    assert [s.request_id for s in waiting if policy.is_admitted(s)] == ["low"]
    assert waiting[-1].request_id == "low"
    assert snap.kv_demand_blocks == 3 * ceil(300 / BLOCK) + ceil(20 / BLOCK)
    assert policy.admitted_waiting(engine.scheduler.running + engine.scheduler.swapped) == 1


def shared_prompt(i: int) -> list[int]:
    """84 tokens: `SHARED` (4 blocks), then a block and 4 tokens of request i's own."""
    return SHARED + [5 + i] + [250 + k % 9 for k in range(19)]


def shared_cut(offload: bool) -> EngineSnapshot:
    """Configured for 4: r0 computes the system prompt (the cache registers its blocks),
    r1..r3 start from those blocks and compute their own 20 tokens, r4 and r5 wait; then the
    batch is cut to 1. r0 runs on, holding the shared blocks; r1..r3 are taken off."""
    engine = engine_with(configured=4, offload=offload)
    engine.add_request(shared_prompt(0), PARAMS, request_id="r0")
    engine.step()
    for i in range(1, 6):
        engine.add_request(shared_prompt(i), PARAMS, request_id=f"r{i}")
    engine.step()
    snap = engine.latest_snapshot
    assert (snap.num_running, snap.num_waiting) == (4, 2), snap.queues
    assert snap.prefix_cache["hit_tokens"] == 3 * len(SHARED)
    return cut_batch(engine, 1)


def test_a_waiting_request_is_not_charged_the_system_prompt_blocks_a_running_one_holds() -> None:
    """Offload off: r1..r3 go back to the queue to be computed again (prompt and the token
    each drew: 85 tokens, 6 blocks). Starting, each finds the 4 system-prompt blocks r0 holds
    and its own first block still cached (free: it takes that one): 2 blocks each, not 6.
    Charged whole, the three read as 18 blocks where a restored batch takes 6, and a cut
    made in a spike was never undone while a queue lasted."""
    snap = shared_cut(offload=False)
    assert (snap.num_running, snap.num_swapped, snap.num_waiting) == (1, 0, 5), snap.queues
    own = ceil((len(shared_prompt(1)) + 1) / BLOCK) - len(SHARED) // BLOCK
    assert own == 2
    assert snap.kv_demand_blocks == snap.blocks_used + 3 * own


def test_a_swapped_sequence_is_not_charged_the_shared_blocks_it_comes_back_to() -> None:
    """Offload on: r1..r3 are swapped out, each with host copies of its 6 computed blocks
    (84 prompt tokens), the 4 system-prompt ones among them. Coming back, each shares the 4
    r0 still holds on the device (`BlockManager.rematch`): it takes 2 blocks, not 6, and the
    prefix its swapped siblings share is not charged three times."""
    snap = shared_cut(offload=True)
    assert (snap.num_running, snap.num_swapped, snap.num_waiting) == (1, 3, 2), snap.queues
    assert snap.host.blocks_used == 3 * ceil(len(shared_prompt(1)) / BLOCK)
    own = ceil(len(shared_prompt(1)) / BLOCK) - len(SHARED) // BLOCK
    assert snap.kv_demand_blocks == snap.blocks_used + 3 * own
