"""Admission as a policy the scheduler consults: who may enter, and who may start.

The policy keeps its own ticket per request (the decision that let it in, its projected peak,
whether it has committed that peak); `Sequence` carries no admission state. The engine asks
`check` when a request arrives (admit, queue or raise AdmissionRejected; the sequences of one
request of several, its choices, one by one, each behind those before it, and `refuse` withdraws
them all when one is refused), the scheduler asks
`try_start` before a queued request takes KV and `cancel_start` when it could not start after
all, and `on_finish` gives a finished request's commitment back and teaches the output-length
estimator what the output really ran to.

Without a controller (library use, `admission_control.enable: false`) every valid request is
admitted at once; the admission halt (a rule's remedy) works either way.

With the prefix cache on, requests whose prompts begin with the same blocks that the cache can
share (every full block before the last prompt token's: the `n` choices of one request, or
identical prompts) form a group, and the group's prefix is committed once, as long as any of
its admitted requests lives: each request's ticket holds only its own part, the group the
prefix (a projected peak's share, worst case) and the overlap peak counts it with the member
that runs longest. The prefix is found by equal prompts up to that block, not by longest
common prefix: prompts that share only some leading blocks are each counted whole (a
conservative plan). A live KV dtype switch drops the cache, and the sequences it converts never
lend a block again (`Sequence.kv_converted`): their groups are sealed, held once by those members
till the last ends but joined by no new request, which commits its prompt whole and starts a
fresh group (`seal_converted_groups`). Any other member that does not share after all (swapped,
recomputed) only costs the preemption the plan did not foresee.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NoReturn

from kvguard.engine.admission import (
    HIGH,
    NORMAL,
    AdmissionController,
    AdmissionDecision,
    overlap_peak,
    stretch,
)
from kvguard.engine.sequence import PRIORITY_NAMES, Sequence, Status

HALT_RETRY_S = 5.0


class AdmissionRejected(ValueError):
    """The admission policy refused a request; `decision` says why (`kind`) and when to retry."""

    def __init__(self, decision: AdmissionDecision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


@dataclass(slots=True)
class Ticket:
    decision: AdmissionDecision | None  # None: admitted without a controller
    projected_blocks: int = 0
    admitted: bool = False  # committed its peak; preemption does not undo that
    # the prompt prefix the prefix cache may share (None: none), its peak outside
    # `projected_blocks`: committed by the first admitted member of its group
    group: GroupKey | None = None
    shared_blocks: int = 0


# a shared prompt prefix: its length in tokens, the hash of its tokens (two prefixes that
# collide would only be planned as one: admission's estimate, never what a request computes)
# and its seal: 0 for the group new requests join, else the serial of a group a KV dtype
# switch sealed (its members' blocks are never found again)
GroupKey = tuple[int, int, int]


QUEUES = (Status.WAITING, Status.RUNNING, Status.SWAPPED)


@dataclass(slots=True)
class QueueCounts:
    """The scheduler's queues counted by priority, kept as each sequence moves (`move`), and
    the waiting requests whose ticket holds its commitment (`admit`). Admission reads the
    queue a request joins at every arrival (`AdmissionPolicy.queue_ahead`) and the snapshot
    the queues' sizes at every step: counted there, each was a walk of the waiting queue in
    Python on the engine thread, thousands long under overload (a burst of n arrivals cost
    O(n²)), time the batch did not decode. `Scheduler.audit` holds them to a recount."""

    queued: dict[Status, dict[int, int]] = field(
        default_factory=lambda: {q: dict.fromkeys(PRIORITY_NAMES, 0) for q in QUEUES}
    )
    admitted: dict[int, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_NAMES, 0))

    def move(self, seq: Sequence, src: Status | None, dst: Status | None, admitted: bool) -> None:
        """`seq` left the queue `src` for `dst` (None: no queue, as it arrives or leaves for
        good); `admitted`: its ticket holds its commitment."""
        for queue, step in ((src, -1), (dst, 1)):
            if queue is not None:
                self.queued[queue][seq.priority] += step
                if queue is Status.WAITING and admitted:
                    self.admitted[seq.priority] += step

    def admit(self, seq: Sequence, step: int) -> None:
        """`seq`'s ticket committed its peak (1) or gave it back (-1): counted while it waits
        (one running or swapped out is not, and counts as it moves, `move`)."""
        if seq.status is Status.WAITING:
            self.admitted[seq.priority] += step

    def waiting(self, rank: int) -> tuple[int, int]:
        """(requests waiting, admitted ones among them) as a request of priority `rank` sees
        the queue: high ones only for a high request (they alone sort ahead of it), all for
        any other."""
        if rank == HIGH:
            return self.queued[Status.WAITING][HIGH], self.admitted[HIGH]
        return sum(self.queued[Status.WAITING].values()), self.admitted_waiting()

    def slots_taken(self, rank: int) -> int:
        """Batch slots the running and swapped-out sequences take as a request of priority
        `rank` sees them: those of high work for a high request (it takes the others'), all
        for any other. (Not `Sequence.held`, an evicted sequence held back.)"""
        ranks = (HIGH,) if rank == HIGH else tuple(PRIORITY_NAMES)
        return sum(self.queued[q][r] for q in (Status.RUNNING, Status.SWAPPED) for r in ranks)

    def admitted_waiting(self) -> int:
        """The waiting requests whose ticket holds its commitment."""
        return sum(self.admitted.values())

    def by_priority(self, queue: Status) -> dict[str, int]:
        """`queue`'s sequences by priority name (the snapshot's)."""
        return {PRIORITY_NAMES[rank]: n for rank, n in self.queued[queue].items()}

    def differences(self, recount: QueueCounts) -> list[str]:
        """Where these counts differ from `recount`, one "what: counted n, recounted m" a
        count: the log of a repair names the drift, not two whole tables to compare."""
        pairs = [
            (f"{queue.name.lower()} {PRIORITY_NAMES[rank]}", n, recount.queued[queue][rank])
            for queue, counts in self.queued.items()
            for rank, n in counts.items()
        ]
        pairs += [
            (f"admitted waiting {PRIORITY_NAMES[rank]}", n, recount.admitted[rank])
            for rank, n in self.admitted.items()
        ]
        return [f"{what}: counted {n}, recounted {m}" for what, n, m in pairs if n != m]

    def set_to(self, recount: QueueCounts) -> None:
        """Take `recount`'s counts, in place: the admission policy holds this very object."""
        for queue, counts in recount.queued.items():
            self.queued[queue].update(counts)
        self.admitted.update(recount.admitted)


@dataclass(slots=True)
class Group:
    """The admitted requests of one shared prompt prefix, and the peak it committed for it."""

    blocks: int
    members: set[str] = field(default_factory=set)


class AdmissionPolicy:
    def __init__(
        self, controller: AdmissionController | None, block_size: int, caching: bool = False
    ) -> None:
        self.controller = controller
        self.block_size = block_size
        self.caching = caching  # the prefix cache is on: shared prompt prefixes count once
        self.allow_rank: int | None = None  # halted: only priorities <= this get in
        self._tickets: dict[str, Ticket] = {}
        # the sequences whose tickets hold their commitment: the admitted requests, running,
        # swapped out or queued, that the overlap peak counts (`_live_loads`), without a walk
        # of every live request (thousands queued under overload) at every arrival
        self._admitted: dict[str, Sequence] = {}
        self._groups: dict[GroupKey, Group] = {}  # groups with an admitted member
        self._seals = 0  # groups sealed so far: each sealed group's own key
        self._queues = QueueCounts()  # the scheduler's, once it watches (`watch`)
        # the batch's slots (`max_num_seqs`, which a remedy may change live; None: unbounded)
        self._slots: Callable[[], int | None] = lambda: None
        # (requests queued, batch slots still open) a request posted now would find, for high
        # and for every other priority (`publish_queue`); none published: an idle engine's
        self._published: dict[int, tuple[int, int | float]] = {
            HIGH: (0, math.inf),
            NORMAL: (0, math.inf),
        }
        if controller is not None:
            controller.live = self._live_loads

    def watch(self, queues: QueueCounts, slots: Callable[[], int | None]) -> None:
        """The scheduler's queue counts, kept as its sequences move and as `try_start` and
        `cancel_start` change a waiting request's ticket, and the batch's slots: a request
        waits for a free slot as it waits for KV."""
        self._queues = queues
        self._slots = slots

    # -- arrival ----------------------------------------------------------------------------
    def check(self, seq: Sequence, capacity: int, used: int, configured: int | None = None) -> None:
        """Admit `seq` now, queue it, or raise AdmissionRejected; may lower seq.max_tokens.
        `capacity` is the pool's blocks now, `configured` (None: the same) its blocks at the
        configured bytes, which a remedy (shrink_kv_pool) may hold smaller for a while: what
        only the smaller pool cannot hold waits instead of being refused."""
        if self.allow_rank is not None and seq.priority > self.allow_rank:
            self._refuse_halted(seq, self.allow_rank, capacity, configured)
        ctl = self.controller
        if ctl is None:
            self._issue(seq, Ticket(None, admitted=True))
            return
        queued, slot = self._queue_ahead(seq)
        key = self._group_key(seq)
        shared = key[0] if key is not None and key in self._groups else 0
        prompt = len(seq.prompt_token_ids)
        d = ctl.decide(
            prompt,
            seq.max_tokens,
            seq.priority,
            capacity,
            used / capacity,
            queued,
            seq.max_total_len,
            capacity if configured is None else configured,
            shared,
            key,
            slot,
        )
        if d.decision == "reject":
            raise AdmissionRejected(d)
        seq.max_tokens = d.max_tokens
        whole = ctl.projected_blocks(prompt, d.predicted_tokens, d.max_tokens)
        own = (
            whole
            if key is None
            else ctl.projected_blocks(prompt - key[0], d.predicted_tokens, d.max_tokens)
        )
        ticket = Ticket(d, own, d.decision == "admit", key, whole - own)
        self._issue(seq, ticket)
        if ticket.admitted:
            ctl.commit(self._commitment(ticket))
            self._join(seq.request_id, ticket)

    def _refuse_halted(
        self, seq: Sequence, allow_rank: int, capacity: int, configured: int | None
    ) -> NoReturn:
        """Refuse `seq` while admission is halted: as never_fits where no pool could ever serve
        it (the 400 it gets with admission open), else as halted (retry later): only
        priorities <= `allow_rank` get in. A halt comes
        when the pool is pressed; a retryable refusal there would send the client back for
        the same 400 once the halt lifts, and hide why."""
        ctl = self.controller
        never = None
        if ctl is not None:
            never = ctl.never_fits(
                len(seq.prompt_token_ids),
                seq.max_tokens,
                seq.priority,
                capacity,
                seq.max_total_len,
                configured,
            )
        raise AdmissionRejected(never or _halted(allow_rank, seq.priority))

    def halted(self, rank: int) -> AdmissionDecision | None:
        """The halt's refusal of a request of priority `rank` (None: the halt lets it in, or
        admission is not halted). For a server that refuses such a request before it reaches
        the engine (its API key's limit is full of requests the halt refuses too): the
        refusal the engine would give it, without the never_fits judgement, which needs the
        request's tokens. Any thread: it only reads the halt."""
        allow_rank = self.allow_rank
        if allow_rank is None or rank <= allow_rank:
            return None
        return _halted(allow_rank, rank)

    # -- a request of several sequences, taken in or refused as one ---------------------------
    def never_fits_all(self, size: int) -> AdmissionDecision | None:
        """The never_fits refusal of a request of `size` sequences (its choices, its prompts)
        that a hard queue bound could never take in whole (None: an idle engine would): at
        most `max_num_seqs` start at once and `max_queue` wait, and with `max_queue_wait: 0s`
        nothing waits past that. A 429 would send the client back for the same refusal for
        ever."""
        ctl, slots = self.controller, self._slots()
        if ctl is None or slots is None or ctl.config.max_queue_wait_s > 0:
            return None
        room = slots + ctl.config.max_queue
        if size <= room:
            return None
        return AdmissionDecision(
            "reject",
            f"{size} sequences (choices or prompts) can never all be taken in: at most {slots} "
            f"start at once (max_num_seqs) and {ctl.config.max_queue} wait (max_queue, a hard "
            f"limit with max_queue_wait 0s); ask for at most {room}",
            kind="never_fits",
            about="n",
        )

    def count(self, seqs: Iterable[Sequence]) -> None:
        """Count the decisions of a request's sequences, all taken in (`admit` or `queue`)."""
        ctl = self.controller
        if ctl is None:
            return
        for seq in seqs:
            t = self._tickets.get(seq.request_id)
            if t is not None and t.decision is not None:
                ctl.decisions[t.decision.decision] += 1

    def count_refused(self, size: int) -> None:
        """Count a refused request's `size` sequences, each a `reject`: none was taken in."""
        if self.controller is not None:
            self.controller.decisions["reject"] += size

    def refuse(
        self,
        seqs: list[Sequence],
        taken: list[Sequence],
        refused: AdmissionDecision,
    ) -> AdmissionDecision:
        """A request's sequence `seqs[len(taken)]` was refused: the whole request is. The
        sequences decided before it (`taken`, out of the scheduler's `waiting` already, never
        started) are withdrawn: their tickets dropped, the peaks admitted ones committed given
        back without a finish (the finish rate the queue's drain estimate reads is of requests
        that ran), every sequence counted a `reject`. Returns the refusal to give the request
        (`queue_full_for`: its own sequences are not the queue it is told of)."""
        ctl = self.controller
        for seq in taken:
            t = self._drop(seq.request_id)
            if ctl is not None and t is not None and t.admitted:
                ctl.uncommit(self._leave(seq.request_id, t))
        self.count_refused(len(seqs))
        if ctl is None or not taken or refused.kind != "queue_full":
            return refused
        return ctl.queue_full_for(self._queue_ahead(seqs[0])[0], len(seqs), refused)

    # -- a request posted from another thread, before the engine takes it in ----------------
    def publish_queue(self) -> None:
        """Publish the queue a request posted now would join (`queue_ahead`, for high and for
        every other priority), for `refuse_posted` on the event loop. On the engine thread,
        with each snapshot (after the step that changed the queue): one dict swapped in
        whole, so a reader sees one publication or the next, never a mix. A request taken in
        since is in neither this nor the loop's posted count until the next one: the event
        loop then counts too few, and the engine decides as it takes the request in."""
        self._published = {rank: self.queue_ahead(rank) for rank in (HIGH, NORMAL)}

    def refuse_posted(self, rank: int, posted: int, size: int) -> AdmissionDecision | None:
        """The queue_full refusal the engine would give a request of `size` sequences of
        priority `rank` (its choices, its prompts) as it takes it in, decided as it is
        posted (None: the engine decides): behind the queue last published and the `posted`
        sequences of its priority class on their way in, each taking an open batch slot first
        as admitted requests do, its own sequences each behind those before it
        (`_admit_all`). The engine decides only as it takes requests in, so without this a
        stalled engine thread held every request posted to it. A sequence a slot may start at
        once is the engine's to judge (KV room), and so is a request that could never be
        taken in whole (`never_fits_all`, a 400)."""
        ctl = self.controller
        if ctl is None or self.never_fits_all(size) is not None:
            return None
        queued, open_slots = self._published[HIGH if rank == HIGH else NORMAL]
        first = queued + max(0, posted - open_slots)
        for i in range(size):
            behind = posted + i  # ahead of this sequence and not in the published queue
            if queued == 0 and behind < open_slots:
                continue  # a slot is open to it: admitted if KV holds it
            refused = ctl.queue_full(queued + max(0, behind - open_slots))
            if refused is not None:
                return refused if i == 0 else ctl.queue_full_for(first, size, refused)
        return None

    def _queue_ahead(self, seq: Sequence) -> tuple[int, bool]:
        """(the requests queued ahead of `seq`, whether a batch slot is free for it)."""
        queued, open_slots = self.queue_ahead(seq.priority)
        return queued, open_slots > 0

    def queue_ahead(self, rank: int) -> tuple[int, int | float]:
        """(the requests queued ahead of a new request of priority `rank`, the batch slots
        still open to it). Every request not started counts, whether it waits for its KV
        commitment or for one of the `max_num_seqs` slots: a request admitted on KV room
        behind a full batch waits as long as one queued for KV, and `max_queue` /
        `max_queue_wait` bound that wait. Admitted requests take the free slots first (they
        start at the next step); only those past them count. High priority sorts ahead of
        queued lower ones (`queue_key`) and takes the slots of lower-priority work: only high
        requests are ahead of it, and only high work holds its slots. Read from the
        scheduler's queue counts (`QueueCounts`): O(1) however long the queue."""
        return _ahead(self._queues.waiting(rank), self._queues.slots_taken(rank), self._slots())

    def _group_key(self, seq: Sequence) -> GroupKey | None:
        """The prompt prefix the prefix cache can give `seq` from a request with the same one:
        its full blocks before the last prompt token's (None: none, or the cache is off, or
        the request computes its whole prompt for its log-probabilities)."""
        if not self.caching or seq.prompt_logprobs is not None:
            return None
        n = (len(seq.prompt_token_ids) - 1) // self.block_size * self.block_size
        # (its length, its hash, joinable): hashed once here, not at every admission check, which
        # groups every live request (a long prompt's tokens are thousands)
        return (n, hash(tuple(seq.prompt_token_ids[:n])), 0) if n > 0 else None

    def _commitment(self, t: Ticket) -> int:
        """The blocks admitting `t` commits: its own, and its group's prefix if no admitted
        member of the group holds it."""
        if t.group is None or t.group in self._groups:
            return t.projected_blocks
        return t.projected_blocks + t.shared_blocks

    def _join(self, rid: str, t: Ticket) -> None:
        """`t` was admitted (its `_commitment` committed)."""
        if t.group is not None:
            self._groups.setdefault(t.group, Group(t.shared_blocks)).members.add(rid)

    def _leave(self, rid: str, t: Ticket) -> int:
        """`t`'s commitment ends: the blocks it gives back, its group's prefix with the last
        admitted member of the group."""
        g = None if t.group is None else self._groups.get(t.group)
        if g is None:
            return t.projected_blocks
        g.members.discard(rid)
        if g.members:
            return t.projected_blocks
        del self._groups[t.group]
        return t.projected_blocks + g.blocks

    def seal_converted_groups(self) -> None:
        """The pool's KV dtype was switched: the cache is dropped and the live sequences that
        had computed K/V (`kv_converted`) never register a block again, so a new request with
        their prompt finds none of their blocks and computes its own copy. Left joinable, their
        group would have it commit only its own tokens beside that copy (over-admission and
        preemption, in the very pressure episode the switch is a remedy for). Each such group
        is sealed under a key of its own: its members keep the prefix they committed once,
        given back with the last of them, and no new request joins it. Its admitted members
        yet to compute their prompt (not started, or recomputed) will compute the prefix
        again beside it: they stay in the joinable group, whose prefix is committed anew."""
        converted = {rid for rid, s in self._admitted.items() if s.kv_converted}
        for key, group in list(self._groups.items()):
            holders = group.members & converted
            if key[2] == 0 and holders:
                self._seal(key, group, holders)

    def _seal(self, key: GroupKey, group: Group, holders: set[str]) -> None:
        """Move `holders` (members of the joinable group `key`) to a sealed group holding the
        committed prefix; members left behind commit the prefix again for their own copy."""
        self._seals += 1
        sealed = (key[0], key[1], self._seals)
        self._groups[sealed] = Group(group.blocks, holders)
        for rid in holders:
            self._tickets[rid].group = sealed
        group.members -= holders
        if not group.members:
            del self._groups[key]
        elif self.controller is not None:
            self.controller.commit(group.blocks)

    def queue_key(self, seq: Sequence) -> tuple[int, float, int]:
        """Where `seq` waits in line. Without a controller: strict priority, then arrival.
        With one, `high` goes first and normal and low requests are served by arrival, a low
        one as if it had come `low_priority_delay_s` later: a burst of normal traffic delays
        low requests by that much, never starves them for the whole burst."""
        ctl = self.controller
        if ctl is None or seq.priority == HIGH:
            return (seq.priority, 0.0, seq.order)
        delay = ctl.config.low_priority_delay_s if seq.priority > NORMAL else 0.0
        return (NORMAL, seq.arrival_time + delay, seq.order)

    def decision(self, seq: Sequence) -> AdmissionDecision | None:
        t = self._tickets.get(seq.request_id)
        return None if t is None else t.decision

    def is_admitted(self, seq: Sequence) -> bool:
        t = self._tickets.get(seq.request_id)
        return t is not None and t.admitted

    def admitted_waiting(self, started: Iterable[Sequence]) -> int:
        """The admitted requests not among `started` (the running and swapped-out sequences):
        those in the queue, as every ticket is a live sequence's: from the tickets, what the
        queue counts (`QueueCounts.admitted_waiting`) must agree with. O(`started`)."""
        return len(self._admitted) - sum(map(self.is_admitted, started))

    def check_admitted(self) -> None:
        """The admitted sequences (`_admitted`, what the overlap peak sums) are those whose
        ticket holds its commitment: equal sizes alone would let one request's entry stand
        for another's, and predicted admission would count a load that left and miss one
        that came."""
        tickets = {rid for rid, t in self._tickets.items() if t.admitted}
        assert set(self._admitted) == tickets, (
            f"admitted sequences {sorted(self._admitted)}, admitted tickets {sorted(tickets)}"
        )

    def _issue(self, seq: Sequence, ticket: Ticket) -> None:
        """Keep `ticket` for `seq`, and `seq` among the admitted ones if it is."""
        self._drop(seq.request_id)
        self._tickets[seq.request_id] = ticket
        if ticket.admitted:
            self._admitted[seq.request_id] = seq

    def _drop(self, rid: str) -> Ticket | None:
        """Forget request `rid`'s ticket (None: it had none), and its sequence with it."""
        self._admitted.pop(rid, None)
        return self._tickets.pop(rid, None)

    # -- start ------------------------------------------------------------------------------
    def try_start(self, seq: Sequence, capacity: int) -> bool:
        """Commit a queued request's peak as it is about to start; False: it waits."""
        t = self._tickets.get(seq.request_id)
        if t is None or t.admitted:
            return True
        ctl = self.controller
        made = len(seq.output_token_ids)  # a recomputed request has some output already
        planned = max(1, (t.decision.predicted_tokens if t.decision else 1) - made)
        load, cap = (seq.num_tokens, planned), seq.max_tokens - made
        if ctl is not None and not ctl.try_commit(
            self._commitment(t), capacity, seq.priority, load, cap, t.group
        ):
            return False
        t.admitted = True
        self._admitted[seq.request_id] = seq
        self._queues.admit(seq, 1)
        self._join(seq.request_id, t)
        return True

    def cancel_start(self, seq: Sequence) -> None:
        """`try_start` committed, but the request (still queued) could not take its blocks
        after all."""
        t = self._tickets.get(seq.request_id)
        if t is not None and t.admitted and self.controller is not None:
            self.controller.uncommit(self._leave(seq.request_id, t))
            t.admitted = False
            del self._admitted[seq.request_id]
            self._queues.admit(seq, -1)

    def on_step(self, preempted: int, usage: float) -> None:
        """A step was scheduled, with `preempted` sequences taken off the device for it and
        `usage` of the device KV in use."""
        if self.controller is not None:
            self.controller.on_step(preempted, usage)

    # -- a pool grown for good --------------------------------------------------------------
    def regrow(self, seq: Sequence, capacity: int, configured: int) -> AdmissionDecision | None:
        """The pool grew for good (`configured` blocks at its configured bytes, `capacity` in
        force): give `seq` back what admission shortened its max_tokens by to fit the smaller
        pool, up to what it would be given now (`regrown_max_tokens`), and re-reserve its
        projected peak for the longer answer. An admitted request gets only as much more as
        its commitment can grow by within the budget beside everything else admitted (a
        queued one commits when it starts, against the budget then). Returns the new
        decision, or None where nothing changed; never shortens."""
        t = self._tickets.get(seq.request_id)
        ctl = self.controller
        if t is None or ctl is None or t.decision is None:
            return None
        d = t.decision
        prompt = len(seq.prompt_token_ids)
        whole, target = ctl.regrown_max_tokens(
            prompt, d, seq.priority, capacity, configured, seq.max_total_len
        )
        if target <= d.max_tokens:
            return None
        own_prompt = prompt - (t.group[0] if t.group is not None else 0)
        group = self._groups.get(t.group) if t.admitted and t.group is not None else None

        def plan(n: int) -> int:  # never below the plan it has (the estimator moves on)
            return max(ctl.plan_tokens(n), d.predicted_tokens)

        def own(n: int) -> int:  # the ticket's blocks for an answer of up to n tokens
            return ctl.projected_blocks(own_prompt, plan(n), n)

        def shared(n: int) -> int:  # its group prefix's share of that peak, as `check` splits it
            return ctl.projected_blocks(prompt, plan(n), n) - own(n) if t.group is not None else 0

        def more(n: int) -> tuple[int, int]:  # blocks its commitment and its group's grow by
            return max(0, own(n) - t.projected_blocks), (
                0 if group is None else max(0, shared(n) - group.blocks)
            )

        def fits(n: int) -> bool:
            if not t.admitted:
                return True
            limit = ctl.limit_blocks(capacity, seq.priority)
            if not ctl.predicted:
                return ctl.committed_blocks + sum(more(n)) <= limit
            made = len(seq.output_token_ids)
            rest = max(plan(n) - made, self.block_size)
            load = (seq.num_tokens, stretch(rest, n - made, ctl.config.safety_factor))
            rank = HIGH if seq.priority == HIGH else None
            loads = self._live_loads(rank, (t.group, load), skip=seq.request_id)
            return overlap_peak(loads, self.block_size) <= math.floor(limit * ctl.overcommit)

        lo, hi = d.max_tokens, target  # the largest n in [lo, hi] that fits (lo: as it is)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        if lo == d.max_tokens:
            return None
        t.decision = dataclasses.replace(
            d, max_tokens=lo, truncated=lo < whole, predicted_tokens=plan(lo)
        )
        grown, prefix = more(lo)
        t.projected_blocks += grown
        t.shared_blocks = max(t.shared_blocks, shared(lo))
        if group is not None:
            group.blocks += prefix
        if t.admitted:
            ctl.commit(grown + prefix)
        return t.decision

    # -- finish -----------------------------------------------------------------------------
    def on_finish(self, seq: Sequence) -> None:
        t = self._drop(seq.request_id)
        ctl = self.controller
        if t is None or ctl is None or not t.admitted:
            return
        ctl.release(self._leave(seq.request_id, t))
        d = t.decision
        # a live max-token cap that ended the output below its admitted max_tokens says
        # nothing of how long it would have run either
        capped = d is not None and seq.finish_reason == "length" and seq.max_tokens < d.max_tokens
        if d is not None and seq.finish_reason in ("stop", "length") and not capped:
            # what the output really ran to teaches the estimator (aborts say nothing)
            ctl.estimator.observe(d.max_tokens, len(seq.output_token_ids), d.predicted_tokens)

    def _live_loads(
        self,
        max_rank: int | None = None,
        join: tuple[GroupKey | None, tuple[int, int]] | None = None,
        skip: str | None = None,
    ) -> list[tuple[int, int]]:
        """(tokens held, tokens still expected) of every admitted, unfinished request of rank
        <= max_rank (None: all), the tokens to come stretched by the safety factor (never
        past what max_tokens leaves). A request past its prediction is expected to need at
        least another block (or what its max_tokens leaves), not to end this very step.
        `join` (group, load) adds a new request's load (`skip`: in place of that request's
        own, by id). A group's shared prefix is counted
        once: in full by the member expected to run longest (it is held while any member
        lives, and the prefix is whole blocks), the others hold only their own tokens."""
        out: list[tuple[int, int]] = []
        groups: dict[GroupKey, list[tuple[int, int]]] = {}
        factor = self.controller.config.safety_factor if self.controller else 1.0
        for rid, s in self._admitted.items():
            t = self._tickets[rid]
            if t.decision is None or rid == skip:
                continue
            if max_rank is not None and s.priority > max_rank:
                continue
            made = len(s.output_token_ids)
            rest = max(t.decision.predicted_tokens - made, self.block_size)
            load = (s.num_tokens, stretch(rest, s.max_tokens - made, factor))
            (out if t.group is None else groups.setdefault(t.group, [])).append(load)
        if join is not None:
            key, load = join
            (out if key is None else groups.setdefault(key, [])).append(load)
        for key, loads in groups.items():
            longest = max(range(len(loads)), key=lambda i: loads[i][1])
            out.extend((h if i == longest else h - key[0], r) for i, (h, r) in enumerate(loads))
        return out


def _ahead(waiting: tuple[int, int], taken: int, slots: int | None) -> tuple[int, int | float]:
    """`queue_ahead` of one view: `waiting` (requests, admitted ones) and the slots `taken` of
    `slots` (None: `max_num_seqs` unknown, a policy no scheduler watches: unbounded)."""
    count, admitted = waiting
    free = math.inf if slots is None else max(0, slots - taken)
    return count - admitted + max(0, admitted - free), max(0, free - admitted)


def _halted(allow_rank: int, rank: int) -> AdmissionDecision:
    """The halt's refusal (retry later) of a request of priority `rank`: only priorities
    <= `allow_rank` get in."""
    return AdmissionDecision(
        "reject",
        f"admission is halted: {_allowed(allow_rank)} (this one is {PRIORITY_NAMES[rank]})",
        estimated_wait_s=HALT_RETRY_S,
        kind="halted",
    )


def _allowed(rank: int) -> str:
    """What a halt lets in, for its refusal (-1: nothing)."""
    names = [PRIORITY_NAMES[r] for r in sorted(PRIORITY_NAMES) if r <= rank]
    if not names:
        return "no request of any priority is admitted"
    return f"only {' and '.join(names)} requests are admitted"
