"""Continuous batching: which sequences run this step, and with how many tokens each.

Each step: running sequences first (decodes, a grammar's forced tokens with theirs, then
unfinished prefill chunks), then swapped sequences brought back (once their next token fits:
one back mid-prompt runs the part of its chunk the free blocks hold, never preempting
itself), then waiting ones admitted in (priority,
arrival) order while the token budget, `max_num_seqs` and free blocks allow, and last the
decodes' speculative drafts from the tokens and free blocks left (`_schedule_drafts`: a draft
never holds a prompt back); a swapped sequence that cannot come back yet keeps its place in
that order (the requests queued after it wait, as they wait behind a recomputed one, which is
itself in the queue). When a running sequence needs a block and none is free, the
lowest-priority, newest running sequence is preempted (even one already scheduled for this
step, which then leaves it): swapped to the host pool when offload is on and it has room,
recomputed later otherwise (on an FP8 pool swapped where only cost chose recompute:
`_swaps`; recomputed too where the copy to the host fails: `_swap_out`, or the copy back
fails otherwise than out of memory: `_swap_in_broken`).
Nothing is ever dropped (a sequence holding more tokens than the
whole pool, which could never run again, ends with `length`: `_outgrown`). A waiting `high`
request takes its blocks, and with every `max_num_seqs` slot taken its slot, from
lower-priority running sequences the same way.

The scheduler owns every sequence state change: admission into the batch (asking the admission
policy), preemption, and `update`, which advances a step's sequences from the tokens the model
runner sampled and finishes them. KV copies for swap go through the runner (`kv`), which on a
tensor-parallel engine repeats them on every rank.

Two rules keep a loaded engine responsive. While any sequence decodes, a step runs at most
`prefill_while_decoding` prompt tokens besides the decodes (a high request's excepted), times
the prompts that could start per decode (rounded up; a request admission holds back for KV
cannot), and each prompt at most one bound's worth: one long prompt no longer stalls every
decoding sequence (and a newly arrived request waiting for the step) for a whole
`max_num_batched_tokens` forward, nor for the widened budget meant for the prompts beside it,
and one decode does not hold a burst of queued prompts (and every request behind them) to a
bound's worth a step. And while a `high` priority request
awaits its first text, lower-priority work waits, decodes included, so its first token comes
from a step that holds only high-priority work: its time to first token under load is its
unloaded one plus what is left of the step in flight when it arrived (on an engine that
decodes at all; the others lose a step or two). "First text", not first token: a token whose
text is held back because it may begin a stop string shows the client nothing, and the token
after it would otherwise come from a full step of everyone's work (measured: 0.6-1.0 s of a
1.4 s time to first text under load). That wait lasts at most FIRST_TEXT_TOKENS tokens.
Those steps hold only the work that stands between high requests and their first text (high
requests whose text is out decode with everyone else), and a high request whose next token can
be its text gets it from a step of such decodes before another high prompt runs: in the
overload benchmark a high request's second token had waited for the next high arrival's
whole prompt step (0.4 s).

A waiting request whose prompt begins with full blocks a running prompt is computing now (a
burst with one system prompt, the `n` choices of one request) waits for them and takes them
from the prefix cache, instead of computing them beside it in the same step (`_follows`).

A remedy that narrows the KV dtype (FP8) gives the scheduler the larger pool's every block:
that is the remedy. The switch back waits until the live K/V fit the configured dtype's pool
(the engine refuses it until then, and the rules retry it). While the pool is FP8 (configured,
or switched to by a remedy) no step drafts (`kv_quantized`): an FP8 block's scale only grows,
requantising its bytes, so the K/V a verify step writes for drafts it then rejects would leave
their sequence's last block coarser than plain decode leaves it, and a greedy answer would
depend on drafts. Drafting resumes once the pool is back in an unquantised dtype.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvguard.engine.admission import HIGH
from kvguard.engine.admission_policy import AdmissionPolicy, QueueCounts
from kvguard.engine.block_manager import BlockManager
from kvguard.engine.distributed.errors import RankFailure
from kvguard.engine.kv_cache import is_oom
from kvguard.engine.sequence import Sequence, Status
from kvguard.engine.speculative import (
    ROW_COST_PRIOR,
    Lookup,
    StepCost,
    draft_threshold,
    ngram_sizes,
)

if TYPE_CHECKING:
    from kvguard.engine.model_runner import RunTokens

log = logging.getLogger("kvguard.engine")
EventSink = Callable[..., None]
MIN_BATCHED_TOKENS = 64
# how often a busy engine holds its queue counts to a recount of the queues (`recount_when_due`)
RECOUNT_S = 1.0
# a swap that runs out of memory is said at most once per this many seconds, each way: a
# swap-in that lasts is tried again every step (`Scheduler._swap_in_failed`), and under
# pressure every preemption may find the copy out failing (`Scheduler._swap_out_failed`);
# a copy either way that fails otherwise (a bug) is logged as an error as often, with its
# traceback (`Scheduler._swap_in_broken`)
SWAP_WARN_EVERY_S = 60.0
# A high request keeps steps to high work until its first text is out, for at most this many
# output tokens: a token whose text is held back (it may begin a stop string) is not yet a
# first token to the client, and the next one must not wait for a full step of others' work.
FIRST_TEXT_TOKENS = 4


def first_line(error: BaseException) -> str:
    """`error`'s message for a log line: its first line (a CUDA OOM's runs to several), or
    its type where it has none."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def runs_ahead(seq: Sequence) -> bool:
    """Whether `seq`'s next tokens can be drawn on the device without the host seeing each
    first (`Scheduler.run_ahead`): greedy or sampled with only a temperature (no seed, top-k
    or top-p), and no grammar, drafts, penalties, logit bias or log-probabilities."""
    p = seq.params
    return (
        (p.greedy or (p.temperature_only and seq.generator is None))
        and not p.adjusts_logits
        and p.logprobs is None
        and p.prompt_logprobs is None
        and seq.grammar is None
        and not seq.draft
        and seq.prompt_logprobs is None
        and seq.output_logprobs is None
    )


def one_step(seq: Sequence) -> bool:
    """Whether `seq`'s next step computes its last token (a decode's, or a prompt's last):
    one token left, or the last drawn one with the tokens its grammar forced after it
    (`Sequence.decoding`: those are no prompt chunk to the budget and the order of a step).
    The rest are prompt chunks (a preempted sequence's recomputed text among them)."""
    return seq.num_uncomputed == 1 or seq.decoding


def awaits_first_text(seq: Sequence) -> bool:
    """Whether `seq` is a high request whose client has seen no text yet: its prompt still
    runs, or its first tokens' text is held back (it could begin a stop string)."""
    if seq.priority != HIGH or seq.is_finished:
        return False
    if seq.num_computed_tokens < len(seq.prompt_token_ids):
        return True  # its prompt runs (or runs again, after a preemption)
    return seq.sent_text_len == 0 and len(seq.output_token_ids) < FIRST_TEXT_TOKENS


class KVMover(Protocol):
    """What the scheduler needs of the model runner: copies between the KV tiers."""

    def swap_out(self, device_ids: list[int], host_ids: list[int]) -> None: ...
    def swap_in(self, host_ids: list[int], device_ids: list[int]) -> None: ...


@dataclass(frozen=True, slots=True)
class Speculation:
    """Prompt-lookup drafts (kvguard.engine.speculative): at most `tokens` a step, looked up
    by n-grams of `sizes`, while at most `max_batch` sequences decode; `row_cost` fixes the
    ratio a draft's worth is judged by (None: learnt from the steps, `StepCost`)."""

    tokens: int
    sizes: tuple[int, ...]
    max_batch: int
    row_cost: float | None = None

    @classmethod
    def of(
        cls, tokens: int, ngram: int, max_batch: int, row_cost: float | None = None
    ) -> Speculation | None:
        return cls(tokens, ngram_sizes(ngram), max_batch, row_cost) if tokens > 0 else None


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens to compute per sequence
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def has_decode(self) -> bool:
        """Whether a sequence computes its last token in this step (with any drafts, or the
        tokens its grammar forced after it: `one_step`)."""
        return any(one_step(s) for s in self.seqs)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def drop(self, seq: Sequence) -> None:
        """Take `seq` back out (preempted to make room for a later sequence of the step)."""
        i = self.seqs.index(seq)
        del self.seqs[i], self.num_tokens[i]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        host_block_manager: BlockManager,
        kv: KVMover,
        policy: AdmissionPolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        offload: bool = False,
        emit: EventSink | None = None,
        prefill_while_decoding: int | None = None,
        speculation: Speculation | None = None,
        row_cost_prior: float = ROW_COST_PRIOR["cpu"],
        kv_quantized: Callable[[], bool] = lambda: False,
    ) -> None:
        self.bm = block_manager
        self.host_bm = host_block_manager
        self.kv = kv
        self.policy = policy
        # the queues by priority, kept as sequences move (`_moved`): admission's queue and the
        # snapshot's read them, not a walk of the queues
        self.counts = QueueCounts()
        policy.watch(self.counts, lambda: self.max_num_seqs)  # a full batch queues arrivals
        self.clock: Callable[[], float] = time.monotonic  # when a recount is due
        # when each kind of failed swap is next said (`_due`): "in"/"out", out of memory or
        # failed otherwise ("in!", "out!")
        self._say_at: dict[str, float] = {}
        self._recount_at = 0.0  # the next recount of the queue counts (`recount_when_due`)
        # recounts that found the counts drifted and set them to the recount (`repair_counts`):
        # a kvguard bug each, exported (kvguard_scheduler_count_repairs_total) beside the error
        self.count_repairs = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        # prompt tokens a step may run beside decodes (None: max_num_batched_tokens)
        self.prefill_while_decoding = prefill_while_decoding
        self.offload = offload
        # offload off at the start though a host pool exists: the engine judged swapping not
        # worth it on a device pool this small (offloading.min_gpu_blocks), a choice of cost
        # an FP8 pool overrides (`_swaps`); offload turned off later, on an engine that
        # started swapping, is the operator's choice and stands
        self.recompute_for_cost = not offload and host_block_manager.num_blocks > 0
        self.readmit_usage = 0.80  # evicted sequences return only below this usage
        self.emit: EventSink = emit or (lambda kind, **data: None)
        self.waiting: list[Sequence] = []  # sorted by (priority, order)
        self.swapped: list[Sequence] = []  # sorted by (priority, order)
        self.running: list[Sequence] = []
        # the most sequences an out-of-memory step ran since the OOM chain's last cut: the
        # batch that failed, which the chain's cut halves (`oom_cut_base`)
        self.oom_batch = 0
        self.preemptions = {"swap": 0, "recompute": 0}
        # ended with `length` by a step's scheduling (`_outgrown`), until the engine takes them
        # to hand their outputs out (`take_ended`), also where that scheduling then raised
        self.ended: list[Sequence] = []
        self.speculation = speculation
        # whether the device KV pool is FP8 now: no drafts then (see the module's docstring)
        self.kv_quantized = kv_quantized
        self.step_cost = StepCost(row_cost_prior)  # what a draft row costs, learnt
        self.drafting = False  # this step proposes drafts (few enough sequences decode)
        self._to_draft: list[Sequence] = []  # decodes that may draft, last in the step
        self.draft_threshold = 0.0  # this step's least chance a draft row must have
        self.drafted = 0  # draft tokens computed, and of them accepted, since the start
        self.accepted = 0

    def row_cost(self) -> float:
        """The row cost drafts are judged by: `speculative_row_cost`, or the learnt one."""
        spec = self.speculation
        fixed = spec.row_cost if spec is not None else None
        return self.step_cost.ratio() if fixed is None else fixed

    # -- queues -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=self.policy.queue_key)
        self._moved(seq, None, Status.WAITING)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of whichever queue holds it and release its blocks on both tiers."""
        for status, queue in self._queues():
            if seq in queue:
                queue.remove(seq)
                self._moved(seq, status, None)
                break
        self.bm.free(seq)
        self.host_bm.give(seq.request_id, seq.host_block_table)
        seq.host_block_table = []

    def _queues(self) -> tuple[tuple[Status, list[Sequence]], ...]:
        """Each queue, with the status of the sequences in it."""
        return (
            (Status.RUNNING, self.running),
            (Status.WAITING, self.waiting),
            (Status.SWAPPED, self.swapped),
        )

    def _moved(self, seq: Sequence, src: Status | None, dst: Status | None) -> None:
        """Count `seq`'s move from the queue `src` to `dst` (None: none), with its ticket."""
        self.counts.move(seq, src, dst, self.policy.is_admitted(seq))

    def recount_when_due(self) -> None:
        """Hold the queue counts to a recount of the queues once every RECOUNT_S (a walk of
        the queues: 2.5 ms with 2000 queued on a small shared CPU, once a second). A move or a ticket change
        left uncounted (a bug) would otherwise last for good: admission would answer 429 or
        open slots that are not there, the snapshot's queues and the `num_waiting` rules
        would read it for ever, and a step's walk of the waiting queue, which ends at the
        last admitted request the counts say is queued, could leave one waiting on an idle
        engine. Only `audit` (tests) checked them."""
        now = self.clock()
        if now < self._recount_at:
            return
        self._recount_at = now + RECOUNT_S
        self.repair_counts()

    def repair_counts(self) -> bool:
        """Set the queue counts to a recount where they differ, with an error that names the
        drift, counted (`count_repairs`: an error line alone is seen by nobody who watches
        the metrics); whether they did."""
        recount = self._recount()
        drift = self.counts.differences(recount)
        if drift:
            self.count_repairs += 1
            log.error(
                "queue counts drifted from the queues (%s): set to the recount; a move between "
                "the queues or an admission ticket change went uncounted, a kvguard bug to report",
                "; ".join(drift),
            )
            self.counts.set_to(recount)
        return bool(drift)

    def _recount(self) -> QueueCounts:
        """The queue counts as a walk of the queues and the admission tickets gives them."""
        recount = QueueCounts()
        for status, queue in self._queues():
            for s in queue:
                recount.move(s, None, status, self.policy.is_admitted(s))
        return recount

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def live(self) -> list[Sequence]:
        return self.running + self.swapped + self.waiting

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.recount_when_due()
        batch = ScheduledBatch()
        try:
            self._schedule(batch)
        except BaseException:
            self._unreserve(batch)
            raise
        if not batch.empty:
            self.policy.on_step(len(batch.preempted), self.bm.num_used / self.bm.num_blocks)
        return batch

    def take_ended(self) -> list[Sequence]:
        """The sequences `_outgrown` ended since the last call, their outputs for the engine
        to hand out. Kept here, not in the step's batch: a `schedule()` that raises after
        ending one drops its batch, and with it the only answer its client would get."""
        ended, self.ended = self.ended, []
        return ended

    def _unreserve(self, batch: ScheduledBatch) -> None:
        """A step whose scheduling raised (a device copy out of memory, say) never runs: the
        blocks taken for its tokens go back, so each sequence holds those of its computed
        tokens, as after a step, and the engine, which keeps serving, schedules it afresh."""
        for seq in batch.seqs:
            seq.draft = []
            if seq.status is Status.RUNNING:
                self.bm.trim(seq)

    def _schedule(self, batch: ScheduledBatch) -> None:
        spec = self.speculation
        for seq in self.running:
            seq.draft = []  # a step interrupted before its update leaves its drafts
        decoding = sum(one_step(s) for s in self.running) if spec else 0
        self.drafting = spec is not None and decoding <= spec.max_batch and not self.kv_quantized()
        if self.drafting:
            self.draft_threshold = draft_threshold(self.row_cost(), decoding)
        self._to_draft = []  # this step's decodes that may draft, once everyone has theirs
        if self._urgent_prompt():
            budget = self._schedule_running(batch, self.max_num_batched_tokens, True)
            if not batch.has_decode:  # a first text's next token goes first, alone
                place = min(map(self.policy.queue_key, self.swapped), default=None)
                self._schedule_waiting(batch, budget, True, place)
            if any(awaits_first_text(s) for s in batch.seqs):
                self._schedule_drafts(batch)
                return
            # the high prompt cannot run now (no slot or no blocks for it): never an idle
            # step waiting on it, everyone else runs as usual
        budget = self.max_num_batched_tokens - sum(batch.num_tokens)
        budget = self._schedule_running(batch, budget, False)
        budget = self._schedule_swapped(batch, budget)
        self._schedule_waiting(batch, budget, False, self._swapped_place(batch))
        self._schedule_drafts(batch)

    def _urgent_prompt(self) -> bool:
        """Whether a `high` request awaits its first text while others decode: running (its
        prompt, or a first token whose text is held back), or first in line and admitted, or
        queued for its commitment and committing now (one whose commitment does not fit yet
        does not hold the others up). A queued one must commit here, before the step fills
        with everyone's decodes: in a full pool its blocks can only come from sequences
        outside the step. On an engine with nothing else decoding, prompts that arrived
        together start together."""
        if not any(one_step(s) and not awaits_first_text(s) for s in self.running):
            return False
        if any(awaits_first_text(s) and s.status is Status.RUNNING for s in self.running):
            return True
        head = self.waiting[:1]
        return any(
            s.priority == HIGH and self.policy.try_start(s, self.bm.num_blocks) for s in head
        )

    def _prompt_budget(self, batch: ScheduledBatch, budget: int, urgent: bool) -> int:
        """What is left for prompt tokens once the decodes are in. A high request's prompt
        (the only prompt an urgent step runs) is not cut: its first token is the point."""
        if urgent:
            return budget
        if batch.seqs and self.chunked and self.prefill_while_decoding is not None:
            return min(budget, self.prefill_while_decoding * self._prompts_per_decode(batch))
        return budget

    def _prompts_per_decode(self, batch: ScheduledBatch) -> int:
        """How many times `prefill_while_decoding` a step may run beside its decodes: the
        prompts that could run now (running prompts, and waiting requests that could start,
        `_startable`) per decode, rounded up, at least 1. The bound trades the
        decodes' inter-token latency for the prompts' wait; one sequence decoding must not
        hold a burst of thirty queued prompts to two a step (a burst over HTTP arrives a few
        milliseconds apart: its first request decodes alone by the time the rest are in, and
        the rest, and everything after them, waited 15 steps instead of one)."""
        decodes = sum(one_step(s) for s in batch.seqs)
        prompts = sum(not one_step(s) for s in self.running if s.status is Status.RUNNING)
        prompts += self._startable()
        return max(1, -(-prompts // max(1, decodes)))

    def _startable(self) -> int:
        """The waiting requests that could start now, up to the free `max_num_seqs` slots
        (`startable`). A request admission holds back for KV widens nothing: eight such let
        the one prompt that could run take nine bounds' worth a step while a decode waited
        for it."""
        return len(self.startable(max(0, self.max_num_seqs - len(self.running))))

    def startable(self, slots: int) -> list[Sequence]:
        """The waiting requests that would start next, in queue order, at most `slots` of
        them: admitted ones, and queued ones whose commitment fits beside those ahead (tried
        as `_schedule_waiting` tries them, and given back: nothing stays committed). One rule
        for who starts next, read at the batch limit in force (`_startable`, the step's
        prompt budget) and at the configured one (`snapshot.demand_blocks`, the KV a
        restored batch would hold): a request admission holds back for KV is in neither.
        Past the first such request only admitted ones start: the walk ends with the last of
        them (`admitted_waiting`), not at the end of a queue thousands long."""
        tried: list[Sequence] = []
        out: list[Sequence] = []
        gated = False
        admitted = self.counts.admitted_waiting()  # still to see
        for seq in self.waiting:
            if len(out) >= slots or (gated and admitted <= 0):
                break
            if self.policy.is_admitted(seq):
                admitted -= 1
            elif gated or not self.policy.try_start(seq, self.bm.num_blocks):
                gated = True  # later uncommitted requests wait behind it
                continue
            else:
                tried.append(seq)
            out.append(seq)
        for seq in reversed(tried):
            self.policy.cancel_start(seq)
        return out

    def _prompt_share(self, batch: ScheduledBatch, urgent: bool) -> int:
        """The most prompt tokens one prompt may run this step: `prefill_while_decoding`
        while sequences decode. `_prompts_per_decode` widens the step's prompt budget so that
        several prompts start together; without this share the first prompt in line (a long
        one) would take all of it, none of the others would start, and every decode would
        wait for that whole widened chunk."""
        bound = self.prefill_while_decoding
        if urgent or not self.chunked or bound is None or not batch.has_decode:
            return self.max_num_batched_tokens
        return bound

    def _schedule_running(self, batch: ScheduledBatch, budget: int, urgent: bool) -> int:
        # Decodes (one token, or one and the tokens a grammar forced after it) before prefill
        # chunks keep inter-token latency steady; a decode's forced tokens are no prompt
        # tokens to `_prompt_budget`.
        capped, taken = False, set(batch.seqs)  # each running sequence is visited once
        share = self.max_num_batched_tokens  # what one prompt may take (`_prompt_share`)
        for seq in sorted(self.running, key=lambda s: (not one_step(s), s.sort_key)):
            if seq.status is not Status.RUNNING or budget <= 0 or seq in taken:
                continue
            if self._outgrown(seq):
                continue
            if urgent and not awaits_first_text(seq):
                continue  # a step of the work that stands between high requests and text
            if urgent and not one_step(seq) and batch.has_decode:
                break  # a high request whose next token is its text goes first, alone
            if not one_step(seq) and not capped:
                budget, capped = self._prompt_budget(batch, budget, urgent), True
                share = self._prompt_share(batch, urgent)
            n = self._chunk(seq, min(budget, share))
            if n and self._reserve(seq, n, batch):
                if n == seq.num_uncomputed == 1 and self.drafting:
                    self._to_draft.append(seq)  # its drafts come last (`_schedule_drafts`)
                batch.add(seq, n)
                budget -= n
        return budget if capped else self._prompt_budget(batch, budget, urgent)

    def _schedule_drafts(self, batch: ScheduledBatch) -> None:
        """Drafts go last in a step: the decodes `_schedule_running` found eligible get theirs
        from the tokens (`max_num_batched_tokens`) and free blocks left once running prompt
        chunks, swapped sequences and waiting requests have what they need. A draft may bring
        nothing: its rows and blocks never hold a prompt back or make a chunk preempt. A
        decode preempted later in the step (it left the batch) drafts nothing."""
        budget = self.max_num_batched_tokens - sum(batch.num_tokens)
        for seq in self._to_draft:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING or seq not in batch.seqs:
                continue
            i = batch.seqs.index(seq)
            k = self._speculate(seq, budget)
            batch.num_tokens[i] += k
            budget -= k
        self._to_draft = []

    def _speculate(self, seq: Sequence, budget: int) -> int:
        """Give decoding `seq` draft tokens to verify with its last one (`seq.draft`), at most
        `budget`, and the blocks they need if those are free (never by preempting, and keeping
        a block per running sequence for its next step); how many it got. Not for a request
        held to a grammar (its drafts would have to pass it first)."""
        spec = self.speculation
        if spec is None or seq.grammar is not None:
            return 0
        # the token the step samples after them must still fit both limits
        most = min(
            spec.tokens,
            budget,
            seq.max_tokens - len(seq.output_token_ids) - 1,
            seq.max_total_len - seq.num_tokens - 1,
        )
        if most <= 0:
            return 0
        if seq.lookup is None or seq.lookup.sizes != spec.sizes:
            seq.lookup = Lookup(spec.sizes)
        draft = seq.lookup.propose(seq, seq.lookup.length(self.draft_threshold, most))
        need = self.bm.blocks_needed(seq, 1 + len(draft))
        if need and not self.bm.can_allocate(need, reserve=len(self.running)):
            room = len(seq.block_table) * self.bm.block_size - seq.num_computed_tokens - 1
            draft, need = draft[: max(0, room)], 0
        if need:
            self.bm.allocate(seq, 1 + len(draft))
        seq.draft = draft
        return len(draft)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, budget)
        return 0 if n < seq.num_uncomputed and not self.chunked else n

    def _reserve(
        self, seq: Sequence, n: int, batch: ScheduledBatch, keep: int | None = None
    ) -> int:
        """Get blocks for `n` tokens of `seq`, preempting others (or `seq` itself) if needed:
        the lowest-priority, newest running sequence, even one already in this step's batch
        (a decode scheduled before this prompt chunk), which then leaves the batch before the
        forward (its tokens are not given back to this step's budget). Otherwise a prompt
        beside lower-priority decodes would be the only candidate outside the batch: it would
        throw its own K/V away, come back next step and do it again. Returns the tokens it
        got blocks for (0: none).

        With `keep` (`seq` was just swapped back in, with room for its next token), `seq` is
        never its own victim: once only sequences that outrank it are left, it runs the part
        of its chunk the free blocks hold, leaving `keep` of them free. Preempting itself, it
        went straight back out, and came back next step to do it again: a swap each way and
        a preemption every step, and no progress."""
        need = self.bm.blocks_needed(seq, n)
        while not self.bm.can_allocate(need):
            victim = self.pick_victim()
            if victim is None:
                return 0
            if victim is seq and keep is not None:
                room = len(seq.block_table) + self.bm.num_free - keep
                n = min(n, room * self.bm.block_size - seq.num_computed_tokens)
                if n <= 0:
                    return 0
                break
            if victim in batch.seqs:
                batch.drop(victim)
                self.bm.trim(victim)  # the blocks taken for this step's tokens go back
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return 0
        self.bm.allocate(seq, n)
        return n

    def pick_victim(self, exclude: Iterable[Sequence] = (), max_rank: int = 0) -> Sequence | None:
        """Lowest priority, newest arrival among running sequences of rank >= `max_rank`."""
        skip = set(exclude)  # a step's batch: one lookup a candidate, not a scan
        candidates = [s for s in self.running if s not in skip and s.priority >= max_rank]
        return max(candidates, key=lambda s: s.sort_key, default=None)

    def preempt(self, seq: Sequence) -> str:
        """Move a running sequence off the device: swap if possible, else recompute later.
        The copy to the host comes first, `seq` still running (`_swap_out`): one that fails
        makes it a recompute, which needs no copy (taken off `running` first, it was in no
        queue and its client never answered, its host blocks leaked and its device blocks
        were never freed; raised with it still running, the next step picked the same victim
        and raised again, and no request made progress)."""
        host = self._swap_out(seq)
        self.running.remove(seq)
        self._moved(seq, Status.RUNNING, None)
        seq.draft = []
        seq.num_preemptions += 1
        if host is None:
            return self._recompute(seq)
        n = len(seq.block_table)
        self.bm.free(seq)
        seq.host_block_table = host
        seq.status = Status.SWAPPED
        bisect.insort(self.swapped, seq, key=lambda s: s.sort_key)
        self._moved(seq, None, Status.SWAPPED)
        self.emit("swapped_out", request_id=seq.request_id, blocks=n)
        self.preemptions["swap"] += 1
        self.emit("preempted", request_id=seq.request_id, mode="swap", priority=seq.priority)
        return "swap"

    def _swap_out(self, seq: Sequence) -> list[int] | None:
        """Copy running `seq`'s blocks to the host pool where it swaps (`_swaps`): the host
        blocks holding them, or None where it is to be recomputed. A copy that raises gives
        the host blocks back, and `seq` is recomputed instead (None): the copy only read its
        device blocks, and a recompute needs no copy. Out of memory (on the device, or on the
        host: `is_oom`), under the very pressure that preempts it, a warning says so; anything
        else is a bug, logged as an error with its traceback (`_swap_out_failed`). Raised out
        of the step, such a bug left `seq` running, the next step picked it again, and every
        step raised. A lost tensor-parallel rank (`RankFailure`) still raises: the engine
        cannot go on."""
        n = len(seq.block_table)
        if not self._swaps(n):
            return None
        host = self.host_bm.take(seq.request_id, n)
        try:
            self.kv.swap_out(seq.block_table, host)
        except BaseException as e:
            self.host_bm.give(seq.request_id, host)
            if not isinstance(e, Exception) or isinstance(e, RankFailure):
                raise
            self._swap_out_failed(seq, e)
            return None
        return host

    def _swaps(self, n_blocks: int) -> bool:
        """Whether a preempted sequence holding `n_blocks` goes to the host pool: while it
        has room, with offload on, or on an FP8 pool where offload is off only for cost
        (`recompute_for_cost`). There a recompute would change a greedy answer: its one
        prefill quantises each block once, where the decode steps that wrote the block grew
        its scale and requantised it each time, so the K/V the rest of the answer attends to
        differ by up to an FP8 step (5 of 5 greedy SmolLM2 answers changed within 27
        tokens). A swap copies the blocks' bytes and scales as they are."""
        if not n_blocks or not self.host_bm.can_allocate(n_blocks):
            return False
        return self.offload or (self.recompute_for_cost and self.kv_quantized())

    def _recompute(self, seq: Sequence) -> str:
        self._requeue(seq)
        self.preemptions["recompute"] += 1
        self.emit("preempted", request_id=seq.request_id, mode="recompute", priority=seq.priority)
        return "recompute"

    def _requeue(self, seq: Sequence) -> None:
        """`seq`, in no queue and holding no host blocks, waits to be computed again from its
        text: its device blocks freed, its K/V computed afresh once it starts."""
        seq.draft = []
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.prompt_written = 0  # its whole text is computed again, as prompt rows
        seq.prefill_tokens = seq.num_tokens  # ... of that length (its prompt rows' kernel kind)
        seq.block_contents = []
        seq.kv_converted = False  # its K/V are computed afresh
        self.add(seq)

    def _spare(self) -> int:
        """Free blocks kept in hand when a sequence starts or comes back: one per running
        sequence (at most 1% of the pool), so the next decode step does not preempt it."""
        return min(len(self.running), self.bm.num_blocks // 100 + 1)

    def _room(self, n_blocks: int, seq: Sequence) -> bool:
        # Keep blocks in hand (`_spare`); evicted sequences wait until usage is below
        # readmit_usage.
        if not self.bm.can_allocate(n_blocks, self._spare()):
            return False
        if seq.held:
            after = (self.bm.num_used + n_blocks) / self.bm.num_blocks
            return after < self.readmit_usage or self._nothing_else(seq)
        return True

    def _nothing_else(self, seq: Sequence) -> bool:
        """Nothing runs and nobody waits who could start in its place (evicted sequences and
        requests still waiting for their admission commitment, which `seq`'s own commitment
        may be what holds back, do not count): holding `seq` back then frees room for no one,
        so it returns however much of the pool it needs (a sequence holding more than
        `readmit_usage` of the pool alone would otherwise wait forever). Where admitted
        requests wait behind a held `seq` on an idle engine, `_schedule_waiting` lets them
        start first and makes `seq` an ordinary waiting request (they would otherwise wait
        behind it forever, and it for them), and `_swapped_place` a swapped one."""
        if self.running:
            return False
        return all(s.held or s is seq or not self.policy.is_admitted(s) for s in self.waiting)

    def _room_for(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Room for `n` tokens of a waiting `seq`; a `high` one makes its room by preempting
        lower-priority running sequences (lowest priority, newest first; none of this step's),
        as admission promised when it judged it against high-priority work only."""
        while not self._room(self.bm.blocks_needed(seq, n), seq):
            if seq.priority != HIGH or not self._make_way(batch):
                return False
        return True

    def _slot_for(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """A running slot for a waiting `seq`: with all `max_num_seqs` taken, a `high` one
        takes the slot of lower-priority work as it takes their blocks; with every slot held
        by high work it waits."""
        if len(self.running) < self.max_num_seqs:
            return True
        return seq.priority == HIGH and self._make_way(batch)

    def _make_way(self, batch: ScheduledBatch) -> bool:
        """Preempt the lowest-priority, newest running sequence below `high` that is not in
        this step; False when there is none."""
        victim = self.pick_victim(exclude=batch.seqs, max_rank=HIGH + 1)
        if victim is None:
            return False
        self.preempt(victim)
        batch.preempted.append(victim)
        return True

    def _schedule_swapped(self, batch: ScheduledBatch, budget: int) -> int:
        """Bring swapped sequences back in queue order while their next tokens fit: room for
        one token (a chunk the blocks cannot hold runs shrunk, `_reserve`'s `keep`), or for
        the whole rest of a prompt that is not run in chunks. A copy back that runs out of
        memory leaves the sequence swapped out for a later step (`_swap_in_failed`); one that
        fails otherwise has it recomputed instead (`_swap_in_broken`)."""
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if self._outgrown(seq):
                continue
            share = self._prompt_share(batch, False)
            n = self._chunk(seq, min(budget, share)) if budget > 0 else 0
            least = n if n and not self.chunked else 1
            if seq in batch.preempted or not self._room(self._swap_in_blocks(seq, least), seq):
                break
            keep = self._spare()  # what `_room` kept in hand, before `seq` runs again
            try:
                self._swap_in(seq)
            except Exception as e:
                if isinstance(e, RankFailure):
                    raise  # a lost tensor-parallel rank: the engine cannot go on
                if not is_oom(e):
                    self._swap_in_broken(seq, e)
                    continue  # it waits to run again from its text; the next may come back
                self._swap_in_failed(seq, e)
                break  # the running sequences go on; it is tried again at a later step
            n = self._reserve(seq, n, batch, keep) if n else 0
            if n:
                batch.add(seq, n)
                budget -= n
        return budget

    def _due(self, kind: str) -> bool:
        """Whether a failed swap of `kind` is to be said now: once per SWAP_WARN_EVERY_S each,
        on its own clock (a burst of out-of-memory warnings hides no bug)."""
        now = self.clock()
        if now < self._say_at.get(kind, -math.inf):
            return False
        self._say_at[kind] = now + SWAP_WARN_EVERY_S
        return True

    def _swap_out_failed(self, seq: Sequence, error: Exception) -> None:
        """Copying `seq` to the host failed (`_swap_out`): it is recomputed instead, its K/V
        computed again once it runs. Out of memory, a warning; anything else, an error with
        its traceback (a bug to report). Each said once per SWAP_WARN_EVERY_S, on its own
        clock: a burst of out-of-memory warnings hides no bug."""
        if is_oom(error):
            if self._due("out"):
                log.warning(
                    "%s is preempted by recompute: copying it to the host pool ran out of "
                    "memory (%s); it waits to run again from its text",
                    seq.request_id,
                    first_line(error),
                )
        elif self._due("out!"):
            log.error(
                "%s is preempted by recompute: copying it to the host pool failed (%s), a "
                "kvguard bug to report; it waits to run again from its text",
                seq.request_id,
                first_line(error),
                exc_info=error,
            )

    def _swap_in_failed(self, seq: Sequence, error: BaseException) -> None:
        """Copying `seq` back to the device ran out of memory (`_swap_in` left it swapped out,
        its host copy whole). Raised out of the step, an OOM that lasts (the device held by
        another process) failed every step, and no running sequence made progress: the step
        goes on without it instead. Said once per SWAP_WARN_EVERY_S."""
        if self._due("in"):
            log.warning(
                "%s stays swapped out: copying it back to the device ran out of memory (%s); "
                "the running sequences go on and it is tried again at the next steps",
                seq.request_id,
                first_line(error),
            )

    def _swap_in_broken(self, seq: Sequence, error: Exception) -> None:
        """Copying `seq` back to the device failed with anything but running out of memory, a
        bug (`_swap_in` gave the device blocks taken for it back): it leaves the swapped queue
        and its host blocks, and waits to be computed again from its text (`_requeue`), as a
        sequence whose copy out failed does. Raised out of the step with it left swapped out,
        the next step tried the same copy and raised again, and no request made progress for
        as long as the copy failed. Its one preemption was counted when it was swapped out, so
        this counts none. An error with the traceback, once per SWAP_WARN_EVERY_S."""
        self.swapped.remove(seq)
        self._moved(seq, Status.SWAPPED, None)
        self.host_bm.give(seq.request_id, seq.host_block_table)
        seq.host_block_table = []
        self._requeue(seq)
        if self._due("in!"):
            log.error(
                "%s is recomputed: copying it back to the device from the host pool failed "
                "(%s), a kvguard bug to report; it waits to run again from its text",
                seq.request_id,
                first_line(error),
                exc_info=error,
            )

    def _swapped_place(self, batch: ScheduledBatch) -> tuple | None:
        """The queue place (`queue_key`) of the first sequence still swapped out this step:
        waiting requests behind it wait with it, as they wait behind a preempted sequence that
        is recomputed (it waits in the queue itself). Otherwise a sequence that needs most of
        the pool to come back would stay out for as long as new requests keep taking the room
        it waits for (an evicted one, whose return must also leave usage under
        `readmit_usage`, for as long as anything runs at all). On an idle engine an evicted
        (held) sequence that cannot come back lets the admitted requests queued behind it
        start first and waits on as an ordinary swapped sequence, as a recomputed one does in
        `_schedule_waiting`; None when nothing swapped out holds a place this step."""
        keys = []
        for seq in self.swapped:
            if seq.held and not self.running and seq not in batch.preempted:
                seq.held = False  # it found no room on an idle engine: it follows them
            else:
                keys.append(self.policy.queue_key(seq))
        return min(keys, default=None)

    def _swap_in_blocks(self, seq: Sequence, n: int = 1) -> int:
        """Device blocks a swapped `seq` needs to come back and compute its next `n` tokens:
        its host blocks, and more only where those tokens pass its last block (a sequence that
        filled the whole pool must fit it again, not the pool and one block more)."""
        return max(len(seq.host_block_table), self.bm.blocks_for(seq.num_computed_tokens + n))

    def _swap_in(self, seq: Sequence) -> None:
        """Back on the device: its leading blocks whose content the prefix cache still holds
        there are shared (`BlockManager.rematch`), the rest copied in from the host. A copy
        that raises (out of device memory, under the very pressure that swapped it out) gives
        the device blocks back and leaves it swapped out, its host copy whole: it comes back
        at a later step, where taken off `swapped` first it was in no queue, its client never
        answered, and the queue counts kept it swapped out for good. The caller decides what
        follows (`_schedule_swapped`)."""
        host = seq.host_block_table
        shared = self.bm.rematch(seq, len(host))
        dev: list[int] = []
        try:
            dev = self.bm.take(seq.request_id, len(host) - len(shared))
            if dev:
                self.kv.swap_in(host[len(shared) :], dev)
        except BaseException:
            self.bm.give(seq.request_id, shared + dev)
            raise
        self.host_bm.give(seq.request_id, host)
        seq.host_block_table, seq.block_table = [], shared + dev
        self._start(self.swapped, self.swapped.index(seq), Status.SWAPPED)
        self.emit("swapped_in", request_id=seq.request_id, blocks=len(dev))

    def _start(self, queue: list[Sequence], i: int, src: Status) -> Sequence:
        """`queue[i]` (the `src` queue) runs from now on: it leaves its queue for `running`
        and the counts say so in the same call, so that the lists and the counts never
        disagree. Called once its blocks are in place: whatever failed before left it
        queued."""
        seq = queue.pop(i)
        seq.status, seq.held = Status.RUNNING, False
        self.running.append(seq)
        self._moved(seq, src, Status.RUNNING)
        return seq

    def _schedule_waiting(
        self,
        batch: ScheduledBatch,
        budget: int,
        urgent: bool = False,
        behind: tuple | None = None,
    ) -> None:
        """Admit in queue order (the admission policy's `queue_key`). A request still waiting
        for its admission commitment must not block those behind it that already hold one
        (they would otherwise wait on a commitment that only their own completion can free);
        requests without a commitment never overtake each other. While a high request's
        prompt runs, only high requests start. Requests queued after `behind` (the place of a
        sequence still swapped out, `_swapped_place`) wait for it to come back. Once gated, the
        walk ends with the last admitted request queued (the queue counts say how many are left
        past `i`), not at the end of a queue thousands long that admission holds back for KV."""
        gated = False  # an uncommitted request ahead could not commit: later ones wait too
        share = self._prompt_share(batch, urgent)  # what one prompt may take of `budget`
        # running prompts whose blocks waiting requests may take instead of computing them
        leaders = [s for s in self.running if not one_step(s)] if self.bm.caching else []
        i = deferred = passed = 0  # passed: admitted requests left waiting before `i`
        while i < len(self.waiting) and budget > 0:
            if gated and self.counts.admitted_waiting() <= passed:
                break  # only admitted requests could start, and none waits past `i`
            seq = self.waiting[i]
            if self._outgrown(seq):
                continue  # taken out of the queue: the next one is at `i` now
            if seq in batch.preempted or (urgent and seq.priority != HIGH):
                break  # preempted this very step: let memory settle first
            if behind is not None and self.policy.queue_key(seq) > behind:
                break  # a sequence swapped out ahead of it in the queue comes back first
            if len(self.running) >= self.max_num_seqs and seq.priority != HIGH:
                break  # every slot taken: only a high request makes itself one
            was_admitted = self.policy.is_admitted(seq)
            if not was_admitted and (gated or not self.policy.try_start(seq, self.bm.num_blocks)):
                gated = True
                i += 1
                continue
            if leaders and self._follows(seq, leaders):
                i += 1  # it starts once the blocks it shares are in the cache
                passed += self.policy.is_admitted(seq)  # it committed, if it had not
                deferred += 1
                if deferred >= self.max_num_seqs:
                    break  # no more could start this step: the rest of the queue waits too
                continue
            hit = self._match(seq)
            n = self._chunk(seq, min(budget, share))
            try:  # a slot or room made by preempting (`_make_way`), then its blocks
                fits = bool(n) and self._slot_for(seq, batch) and self._room_for(seq, n, batch)
                if fits:
                    self.bm.allocate(seq, n)
            except BaseException:
                self._not_started(seq, hit, was_admitted)  # it waits on at its place
                raise
            if not fits:
                self._not_started(seq, hit, was_admitted)
                if seq.held and not self.running:
                    # On an idle engine only the readmit threshold holds an evicted sequence
                    # back, and only for admitted requests queued behind it (`_nothing_else`):
                    # they start first, and it waits on as an ordinary request at its place
                    # in the queue (next as room allows, so it cannot starve either).
                    seq.held = False
                    i += 1
                    passed += self.policy.is_admitted(seq)
                    continue
                break
            self._start(self.waiting, i, Status.WAITING)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = hit
                # the prefix cache's counters: prompt tokens, as a request starts (one back
                # from a recompute looks again, its output too: that is no prompt lookup)
                if self.bm.caching and seq.prompt_logprobs is None:
                    self.bm.record(len(seq.prompt_token_ids), hit)
            batch.add(seq, n)
            budget -= n
            if self.bm.caching and not one_step(seq):
                leaders.append(seq)

    def _not_started(self, seq: Sequence, hit: int, was_admitted: bool) -> None:
        """Waiting `seq` does not start after all: the cached blocks it matched (`hit`
        tokens) go back, and a commitment it made just now (`was_admitted` False)."""
        if hit:
            self.bm.unmatch(seq)
        if not was_admitted:
            self.policy.cancel_start(seq)  # committed just now but cannot start

    def _outgrown(self, seq: Sequence) -> bool:
        """Whether `seq` holds more tokens than the whole pool does: its next token needs the
        K/V of them all, so it could never run again, however free the pool were. It ends
        here with `length`, its output kept (the engine hands it out, `take_ended`), as a
        request whose length limit is the pool's ends, instead of preempting itself for ever
        at the head of the queue with every request behind it waiting too. A safety net: the
        engine bounds each request's length by the pool, a prompt by refusing it when the
        whole pool would not hold it with a token after it (`max_total_len`), a request in
        flight when the pool shrinks under it (`_bound_lengths`)."""
        if self.bm.blocks_for(seq.num_tokens) <= self.bm.num_blocks:
            return False
        log.warning(
            "request %s holds %d tokens but the whole KV pool holds %d: it ends (length)",
            seq.request_id,
            seq.num_tokens,
            self.bm.num_blocks * self.bm.block_size,
        )
        seq.draft = []
        seq.finish_reason = "length"
        self.finish(seq)
        self.ended.append(seq)
        return True

    def _follows(self, seq: Sequence, leaders: list[Sequence]) -> bool:
        """Whether waiting `seq` should let a running prompt (one of `leaders`) compute blocks
        it begins with first: a burst of requests with one system prompt (or the `n` choices
        of one request) computes the shared blocks once, the followers taking them from the
        prefix cache a step or a few later, instead of each computing them in the same step.
        Only when the blocks the leader has still to compute are at least half of what `seq`
        would compute (a common chat-template header is not worth a step's wait), and only
        behind a prompt of the same or higher priority (a high request never waits on work
        that high steps hold back). What `seq` would find cached is what the leader has
        computed: the leader started from every cached block it shares, and commits the rest
        as it computes them. Prefixes are compared as slices (a bisection over blocks), so a
        long queue behind one prompt costs microseconds a request, not a lookup a block."""
        if seq.prompt_logprobs is not None or seq.num_computed_tokens:
            return False
        bs = self.bm.block_size
        limit = (seq.num_tokens - 1) // bs  # the blocks match() could give it
        for lead in leaders:
            done = lead.num_computed_tokens // bs  # its blocks in the cache
            top = min(limit, lead.num_tokens // bs)
            if lead.priority > seq.priority or top <= done:
                continue
            if seq.token_slice(0, top * bs) == lead.token_slice(0, top * bs):
                lo = hi = top  # a burst behind one prompt: all it can share is shared
            elif seq.token_slice(0, (done + 1) * bs) != lead.token_slice(0, (done + 1) * bs):
                continue  # not even the next block it computes is shared
            else:
                lo, hi = done + 1, top - 1  # shared blocks: at least lo, at most hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if seq.token_slice(0, mid * bs) == lead.token_slice(0, mid * bs):
                    lo = mid
                else:
                    hi = mid - 1
            if 2 * (lo - done) * bs >= seq.num_tokens - done * bs:
                return True
        return False

    def _match(self, seq: Sequence) -> int:
        """Start `seq` from the cached blocks its tokens begin with (the prefix cache); a
        request for its prompt's log-probabilities computes every position itself."""
        if seq.prompt_logprobs is not None:
            return 0
        return self.bm.match(seq)

    # -- after the model ran ----------------------------------------------------------------
    def update(
        self,
        batch: ScheduledBatch,
        tokens: list[list[int]],
        on_token: Callable[[Sequence, int, int], None],
    ) -> list[Sequence]:
        """Advance the step's sequences by what was computed; hand each token a sequence got
        (one, or with drafts the accepted ones and the one after) to `on_token` (sequence,
        token, its index among them; it appends the token and may set a finish reason), and
        finish those done: a finished sequence takes none of its remaining tokens. `tokens`
        holds the tokens of each sequence that reached its end, in batch order. Returns those
        sequences, in batch order."""
        got = iter(tokens)
        done: list[tuple[Sequence, list[int], int]] = []  # with the drafts it verified
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            sampled = seq.num_computed_tokens + n >= seq.num_tokens  # its last token ran
            if sampled:
                emitted, drafts = next(got), len(seq.draft)
                if drafts:  # the rejected drafts' K/V are not computed tokens
                    n -= drafts - (len(emitted) - 1)
                    seq.draft = []
                done.append((seq, emitted, drafts))
            if not seq.decoding and seq.prompt_written == seq.num_computed_tokens:
                seq.prompt_written += n  # prompt rows (`model_runner.decode_rows`), exact K/V
            seq.num_computed_tokens += n
            self.bm.trim(seq)  # blocks that only rejected drafts needed
            if not sampled:
                self.bm.commit(seq)  # a prompt chunk: its tokens are all there
        for seq, emitted, drafts in done:
            taken = 0
            for i, token in enumerate(emitted):
                on_token(seq, token, i)
                taken = i + 1
                if seq.finish_reason is not None:
                    break
            if drafts:
                # accepted: the drafts that became its tokens, none past the one that
                # finished it (a stop inside the accepted drafts leaves the rest unused)
                kept = min(len(emitted) - 1, taken)
                self.drafted += drafts
                self.accepted += kept
                seq.lookup.record(drafts, kept)
            # only now are the accepted drafts its tokens: a block they filled is keyed by
            # them (registered before, its key was cut short and no lookup ever found it)
            self.bm.commit(seq)
            if seq.finish_reason is not None:
                self.finish(seq)  # its blocks stay cached for a follow-up turn
        return [seq for seq, _, _ in done]

    def run_ahead(self, batch: ScheduledBatch, most: int) -> int:
        """How many decode steps the decode-only `batch` runs back to back
        (`serving.decode_steps`, at most `most`), with the blocks the later ones need taken;
        1 means one step as usual.

        More than one only while every sequence is greedy or sampled with only a temperature
        and asks nothing a step's tokens would have to come back for first (a seed, top-k or
        top-p, a grammar, drafts, penalties, a logit bias, log-probabilities), no sequence's
        first text is held back (it goes out at the step that frees it) and nothing is
        swapped out. With nothing waiting, a run is as long as the sequence with the most
        tokens to go needs (one that ends sooner drops the rest of its run); a request that
        arrives meanwhile waits at most the run. With requests waiting on a full batch (they
        start as sequences finish), a run ends where the first sequence reaches max_tokens,
        so they start when single steps would start them (an EOS or stop string inside the
        run still holds them back to its end); with requests waiting on anything else, no
        run. Always within every sequence's length limit and with free blocks (never
        preempting)."""
        if self.swapped or not all(map(runs_ahead, batch.seqs)):
            return 1
        if any(map(awaits_first_text, batch.seqs)):
            return 1
        to_go = [s.max_tokens - len(s.output_token_ids) for s in batch.seqs]
        if not self.waiting:
            needed = max(to_go)
        elif len(self.running) >= self.max_num_seqs and len(batch.seqs) == len(self.running):
            needed = min(to_go)
        else:
            return 1
        steps = min([most, needed] + [s.max_total_len - s.num_tokens for s in batch.seqs])
        while steps > 1:
            need = sum(self.bm.blocks_needed(s, steps) for s in batch.seqs)
            if self.bm.can_allocate(need):
                for s in batch.seqs:
                    self.bm.allocate(s, steps)
                return steps
            steps -= 1
        return 1

    def update_ahead(
        self,
        batch: ScheduledBatch,
        run: RunTokens,
        on_token: Callable[[Sequence, int, float], None],
    ) -> list[Sequence]:
        """`update` for a run of decode steps (`run_ahead`), step by step as the run's tokens
        come back: each sequence still going takes its token of the step (`on_token`:
        sequence, token, when it was ready) as a step of its own would have handed it over,
        and one that finishes takes no more (the rest of its run is dropped, with the blocks
        only that filled). Returns the sequences, in batch order."""
        for j in range(len(run)):
            if all(seq.is_finished for seq in batch.seqs):
                break  # every sequence is done: the later steps' tokens are nobody's
            tokens, ready = run.step(j)
            for seq, token in zip(batch.seqs, tokens, strict=True):
                if seq.is_finished:
                    continue
                if token < 0:  # its draw was refused: what `sample` raises in a single step
                    raise RuntimeError(
                        f"{seq.request_id}: cannot draw a token: its probabilities are NaN, "
                        "inf or all zero"
                    )
                seq.num_computed_tokens += 1
                self.bm.commit(seq)
                on_token(seq, token, ready)
                if seq.finish_reason is not None:
                    self.finish(seq)
        for seq in batch.seqs:
            if not seq.is_finished:
                self.bm.trim(seq)
        return list(batch.seqs)

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out for good: blocks freed, its admission commitment given back."""
        self.remove(seq)
        seq.status = Status.FINISHED
        self.policy.on_finish(seq)

    def requeue_failed_step(self, batch: ScheduledBatch) -> int:
        """A step ran out of memory: its running sequences go back to recompute (their KV
        may be half written) and the step budget halves. Returns the budget before."""
        failed = [seq for seq in batch.seqs if seq.status is Status.RUNNING]
        self.oom_batch = max(self.oom_batch, len(failed))
        for seq in failed:
            self.running.remove(seq)
            self._moved(seq, Status.RUNNING, None)
            seq.num_preemptions += 1
            self._recompute(seq)
        before = self.max_num_batched_tokens
        self.max_num_batched_tokens = max(MIN_BATCHED_TOKENS, before // 2)
        self.chunked = True  # a halved budget must still fit every prompt
        return before

    def oom_cut_base(self) -> int:
        """The batch an out-of-memory step ran (the most since the OOM chain's last cut, so a
        retried step that failed too counts the first), else the sequences running: the same
        count however many of them the scheduler has taken back by the time the chain applies
        (right after the step failed, none are running), and whatever it admitted since."""
        return self.oom_batch or len(self.running)

    def remap(self, moves: dict[int, int], host: bool = False) -> None:
        """Renumber every live sequence's blocks on one tier after the pool was rebuilt."""
        for seq in self.live():
            if host:
                seq.host_block_table = [moves[b] for b in seq.host_block_table]
            else:
                seq.block_table = [moves[b] for b in seq.block_table]

    # -- control ----------------------------------------------------------------------------
    def shrink_running(self, limit: int) -> list[tuple[str, str]]:
        """Preempt the excess over `limit` running sequences, lowest priority newest first."""
        moved = []
        while len(self.running) > limit:
            victim = self.pick_victim()
            moved.append((victim.request_id, self.preempt(victim)))
        return moved

    def evict(self, count: int, max_rank: int) -> list[tuple[str, str]]:
        """Preempt up to `count` running sequences of rank >= `max_rank`; they are held."""
        moved = []
        for _ in range(count):
            victim = self.pick_victim(max_rank=max_rank)
            if victim is None:
                break
            moved.append((victim.request_id, self.preempt(victim)))
            victim.held = True  # set once it is out: a preemption that raised leaves it running
        return moved

    def audit(self) -> None:
        self._check_counts()
        live = self.live()
        self.bm.audit((s.request_id, s.block_table) for s in live)
        self.host_bm.audit((s.request_id, s.host_block_table) for s in live)
        for s in live:
            if s.status is Status.SWAPPED:
                assert not s.block_table and len(s.host_block_table) == self.bm.blocks_for(
                    s.num_computed_tokens
                )
            else:
                assert not s.host_block_table, f"{s.request_id} is {s.status} but holds host blocks"
                assert len(s.block_table) == self.bm.blocks_for(s.num_computed_tokens), (
                    f"{s.request_id} holds {len(s.block_table)} blocks for {s.num_computed_tokens} tokens"
                )

    def _check_counts(self) -> None:
        """The queue counts (`QueueCounts`) equal a recount of the queues, each sequence's
        status is its queue's, and the admitted waiting requests are those the admission
        tickets count: a transition that moved a sequence or changed its ticket without
        counting it fails here, in every test that audits between steps."""
        for status, queue in self._queues():
            for s in queue:
                assert s.status is status, f"{s.request_id} is {s.status} in the {status} queue"
        recount = self._recount()
        assert self.counts == recount, f"queue counts {self.counts} but recounted {recount}"
        self.policy.check_admitted()
        tickets = self.policy.admitted_waiting(self.running + self.swapped)
        assert self.counts.admitted_waiting() == tickets, (
            f"{self.counts.admitted_waiting()} admitted requests counted waiting, "
            f"{tickets} by their tickets"
        )
