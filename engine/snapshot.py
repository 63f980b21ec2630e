"""An immutable picture of the engine after a step, for readers that must not lock the loop.

The engine replaces `latest_snapshot` after every step; a reference swap is atomic in CPython,
so metrics exporters and rule evaluators on other threads read it without any lock.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvguard.engine.admission_policy import QUEUES
from kvguard.engine.control_surface import allowed_name

if TYPE_CHECKING:
    from kvguard.engine.block_manager import BlockManager
    from kvguard.engine.llm_engine import LLMEngine
    from kvguard.engine.sequence import Sequence


@dataclass(slots=True, frozen=True)
class TierStats:
    blocks_total: int
    blocks_used: int

    @property
    def blocks_free(self) -> int:
        return self.blocks_total - self.blocks_used

    @property
    def usage_ratio(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    time: float
    step: int
    block_size: int
    device: TierStats
    host: TierStats
    live_tokens: int  # tokens the running sequences hold (a shared prefix counts for each)
    queues: dict[str, dict[str, int]]  # waiting/running/swapped -> priority -> count
    kv_cache_dtype: str
    knobs: dict[str, object]  # every control-surface value now in force
    admission: dict[str, object]
    counters: dict[str, int]
    preemptions: dict[str, int]
    admission_decisions: dict[str, int]
    ttft_p50_s: float | None
    tpot_p50_s: float | None
    events: dict[str, int] = field(default_factory=dict)
    # finish_reason -> priority -> requests finished so far (aborts included: see LLMEngine._finish)
    finished: dict[str, dict[str, int]] = field(default_factory=dict)
    # prefix cache: blocks holding reusable K/V; prompt tokens found / looked up at admission
    prefix_cache: dict[str, int] = field(default_factory=dict)
    # structured output: requests given a JSON schema; seconds their grammars took
    structured: dict[str, float] = field(default_factory=dict)
    # speculative decoding: draft tokens verified, and of them accepted, since the start; and
    # row_cost, a draft row's cost over a decode step's fixed part (learnt, or the knob's)
    speculative: dict[str, float] = field(default_factory=dict)
    # device blocks the engine would hold at its configured batch limit: those in use and
    # those of the sequences a restored batch would run next (`demand_blocks`)
    kv_demand_blocks: int = 0

    # -- shorthands used by benchmarks, rules and metrics ---------------------------------
    @property
    def blocks_total(self) -> int:
        return self.device.blocks_total

    @property
    def blocks_used(self) -> int:
        return self.device.blocks_used

    @property
    def blocks_free(self) -> int:
        return self.device.blocks_free

    @property
    def kv_cache_usage_ratio(self) -> float:
        return self.device.usage_ratio

    @property
    def kv_cache_demand_ratio(self) -> float:
        """KV usage at the configured batch limit, over 1 where that batch would not fit: what
        a batch cut's undo must read, as usage falls by what the cut itself moved off the
        device (swapped or waiting), not by any change in the load."""
        total = self.device.blocks_total
        return self.kv_demand_blocks / total if total else 0.0

    @property
    def num_running(self) -> int:
        return sum(self.queues["running"].values())

    @property
    def num_waiting(self) -> int:
        return sum(self.queues["waiting"].values())

    @property
    def num_swapped(self) -> int:
        return sum(self.queues["swapped"].values())

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    @property
    def max_num_seqs(self) -> int:
        return int(self.knobs["max_num_seqs"])

    @property
    def max_num_batched_tokens(self) -> int:
        return int(self.knobs["max_num_batched_tokens"])

    @property
    def tokens_generated(self) -> int:
        return self.counters["tokens_generated"]


def _median(values) -> float | None:
    vals = list(values)
    return statistics.median(vals) if vals else None


def demand_blocks(engine: LLMEngine) -> int:
    """Device blocks in use plus those the sequences a batch restored to the configured
    `max_num_seqs` would start next would take, in the scheduler's order: swapped ones first
    (their host blocks), then the waiting requests that would start (`Scheduler.startable`:
    admitted ones, and queued ones admission would commit; one it holds back for KV would not
    start, so it adds nothing), as many as that limit leaves slots beside the running ones.
    Each is charged only the blocks it would not share through the prefix cache
    (`_unshared`). Built with every snapshot, once a step: at most `max_num_seqs` sequences
    are charged, each one key lookup per cached block it begins with (and the queue walk
    `startable` shares with the step's prompt budget)."""
    sch, bm = engine.scheduler, engine.block_manager
    slots = max(0, engine.config.max_num_seqs - len(sch.running))
    swapped = sch.swapped[:slots]
    waiting = sch.startable(slots - len(swapped))
    charged: set[int] = set()
    back = sum(_unshared(bm, s, len(s.host_block_table), charged) for s in swapped)
    start = sum(_unshared(bm, s, bm.blocks_for(s.num_tokens), charged) for s in waiting)
    return bm.num_used + back + start


def _unshared(bm: BlockManager, seq: Sequence, blocks: int, charged: set[int]) -> int:
    """Of the `blocks` `seq` would hold on the device, those it would take: a cached block
    it begins with that a running sequence holds (a shared system prompt, its other
    choices) is in use already, and one a sequence counted before it was charged for (a
    free cached block, taken once) is shared. A request for its prompt's log-probabilities
    computes every position itself (`Scheduler._match`)."""
    if seq.prompt_logprobs is not None and not seq.host_block_table:
        return blocks
    shared = 0
    for b in bm.shareable(seq):
        if bm.in_use(b) or b in charged:
            shared += 1
        else:
            charged.add(b)
    return blocks - shared


def build_snapshot(engine: LLMEngine) -> EngineSnapshot:
    sch = engine.scheduler
    adm = engine.admission
    return EngineSnapshot(
        time=time.time(),
        step=engine._step_no,
        block_size=engine.block_manager.block_size,
        device=TierStats(engine.block_manager.num_blocks, engine.block_manager.num_used),
        host=TierStats(engine.host_block_manager.num_blocks, engine.host_block_manager.num_used),
        live_tokens=sum(s.num_computed_tokens for s in sch.running),
        # the scheduler's counts: a walk of a queue thousands long was the step's to wait for
        queues={q.value: sch.counts.by_priority(q) for q in QUEUES},
        kv_cache_dtype=engine.kv_cache.dtype,
        knobs=engine.knobs(),
        admission={
            "enabled": adm is not None,
            "halted": engine.allow_rank is not None,
            "allow_priority": allowed_name(engine.allow_rank),
            "committed_blocks": 0 if adm is None else adm.committed_blocks,
            # predicted admission: what outputs are planned at (share of max_tokens per bucket)
            # and how far recent outputs ran from their plan
            "estimate": None if adm is None else adm.config.estimate,
            "output_ratio": {} if adm is None else adm.estimator.ratios(),
            "estimate_error": {} if adm is None else adm.estimator.error(),
            # how far past the budget predicted admission plans now (1: not at all)
            "overcommit": 1.0 if adm is None else adm.overcommit,
            # requests finished per second lately: how fast the queue drains past max_queue
            "finish_rate": 0.0 if adm is None else adm.finish_rate(),
        },
        # the engine's, and the scheduler's repairs of its queue counts (`repair_counts`)
        counters={**engine._counters, "count_repairs": sch.count_repairs},
        preemptions=dict(sch.preemptions),
        admission_decisions={} if adm is None else dict(adm.decisions),
        ttft_p50_s=_median(engine._ttft),
        tpot_p50_s=_median(engine._tpot),
        events=dict(engine.events.counts),
        finished={reason: dict(n) for reason, n in engine._finished.items()},
        prefix_cache={
            "blocks": engine.block_manager.num_cached,
            "hit_tokens": engine.block_manager.hit_tokens,
            "queried_tokens": engine.block_manager.queried_tokens,
        },
        structured={
            "requests": engine.grammars.requests,
            "grammar_seconds": engine.grammars.seconds,
        },
        speculative={
            "drafted": sch.drafted,
            "accepted": sch.accepted,
            "row_cost": round(sch.row_cost(), 4),
        },
        kv_demand_blocks=demand_blocks(engine),
    )
