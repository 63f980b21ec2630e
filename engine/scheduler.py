"""Continuous batching: which sequences run this step, and with how many tokens each.

Each step: running sequences first (decodes, then unfinished prefill chunks), then waiting
sequences admitted in (priority, arrival) order while the token budget, `max_num_seqs` and
free blocks allow. When a running sequence needs a block and none is free, the
lowest-priority, newest running sequence is preempted (recomputed later); nothing is dropped.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvguard.engine.block_manager import BlockManager
from kvguard.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens to compute per sequence
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: list[Sequence] = []  # sorted by (priority, order)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queues -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of whichever queue holds it and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live(self) -> list[Sequence]:
        return self.running + self.waiting

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        # Decodes (one token) before prefill chunks keep inter-token latency steady.
        for seq in sorted(self.running, key=lambda s: (s.num_uncomputed > 1, s.sort_key)):
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            n = min(seq.num_uncomputed, budget)
            if n < seq.num_uncomputed and not self.chunked:
                continue
            if not self._reserve(seq, n, batch):
                continue
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return budget

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Get blocks for `n` tokens of `seq`, preempting others (or `seq` itself) if needed."""
        need = self.bm.blocks_needed(seq, n)
        while not self.bm.can_allocate(need):
            victim = self._pick_victim(exclude=batch.seqs)
            if victim is None:
                return False
            self._preempt(victim, batch)
            if victim is seq:
                return False
        self.bm.allocate(seq, n)
        return True

    def _pick_victim(self, exclude: list[Sequence]) -> Sequence | None:
        """Lowest priority, newest arrival among running sequences not yet in this batch."""
        candidates = [s for s in self.running if s not in exclude]
        return max(candidates, key=lambda s: s.sort_key, default=None)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self.add(seq)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        # Keep a block per running sequence in hand so the next decode step does not preempt
        # what was just admitted.
        reserve = min(len(self.running), self.bm.num_blocks // 100 + 1)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq in batch.preempted:
                break  # preempted this very step: let memory settle first
            n = min(seq.num_uncomputed, budget)
            if n < seq.num_uncomputed and not self.chunked:
                break
            if not self.bm.can_allocate(self.bm.blocks_needed(seq, n), reserve):
                break
            self.waiting.pop(0)
            self.bm.allocate(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
