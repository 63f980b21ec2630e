"""The scheduler's queue counts (`QueueCounts`) on a real engine (the tiny model).

Admission reads the queue a request joins at every arrival, and the snapshot the queues' sizes
at every step; both walked the waiting queue in Python on the engine thread, thousands long
under overload (a burst of n arrivals cost O(n²), and every step a walk the batch did not
decode). Now the scheduler counts its queues as sequences move between them, and the policy a
waiting request's ticket as it commits or gives its peak back. These tests drive every move
(arrival, start, swap out and in, recompute, abort, finish, a request refused after some of its
sequences were taken in) and check after each that the counts equal a recount
(`Scheduler.audit`) and that admission's queue and the snapshot read what a walk of the queues
gives; that a move left uncounted fails the audit; that an arrival, a snapshot and a step read
a handful of a 2000-request queue's entries, not all of them; and that a step's walk of the
queue, which now ends with the last admitted request queued, starts what a walk to the end
started; that a start or a swap in whose device work raises leaves the sequence queued where
it was, counted, that a swap out that fails (out of memory or otherwise) recomputes the
sequence instead, as a swap in that fails otherwise than out of memory does (a lost rank still
raises), that a batch cut whose preemption raises leaves the batch limit as it was
and a waiting request whose slot it was making its matched cache blocks given back, and that a
request a step's scheduling ended answers though the rest of that scheduling raised; and that
a count that drifted all the same is repaired, with an error."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.daemon.metrics import SnapshotCollector
from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.admission import HIGH, NORMAL, AdmissionConfig
from kvguard.engine.admission_policy import AdmissionRejected, QueueCounts
from kvguard.engine.distributed.errors import RankFailure
from kvguard.engine.llm_engine import NewRequest, refused_request
from kvguard.engine.scheduler import RECOUNT_S
from kvguard.engine.sequence import PRIORITIES, PRIORITY_NAMES, Sequence, Status
from tests.test_engine import make_engine
from tests.test_kv_pool import apply
from tests.test_live_corners import SWAP, outgrowing
from tests.test_remedies import run_all


def params(n: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def prompt(i: int, n: int = 40) -> list[int]:
    """`n` tokens no other request's prompt begins with: nobody waits on another's prompt."""
    return [5 + i] + [10 + (7 * i + k) % 240 for k in range(n - 1)]


def walked_queues(engine: LLMEngine) -> dict[str, dict[str, int]]:
    """The snapshot's queues as a walk of each queue counts them."""
    sch = engine.scheduler
    queues = {"waiting": sch.waiting, "running": sch.running, "swapped": sch.swapped}
    return {
        name: {PRIORITY_NAMES[r]: sum(s.priority == r for s in q) for r in PRIORITY_NAMES}
        for name, q in queues.items()
    }


def walked_ahead(engine: LLMEngine, rank: int) -> tuple[int, int | float]:
    """`AdmissionPolicy.queue_ahead` as a walk of the queues computes it: the requests waiting
    (high ones only, for a high request), less the admitted ones the batch slots left free
    (those not held by running or swapped-out work, high work only for a high request) start."""
    sch, policy = engine.scheduler, engine.admission_policy
    seen = [s for s in sch.waiting if rank != HIGH or s.priority == HIGH]
    admitted = sum(map(policy.is_admitted, seen))
    held = sum(rank != HIGH or s.priority == HIGH for s in sch.running + sch.swapped)
    free = max(0, sch.max_num_seqs - held)
    return len(seen) - admitted + max(0, admitted - free), max(0, free - admitted)


class Moves:
    """What the scenario has seen of the queues, checked after every step and arrival."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def check(self, engine: LLMEngine) -> None:
        """The counts equal a recount (the audit), and admission's queue, the one it publishes
        and the snapshot's queues equal what a walk of the queues gives."""
        engine.audit_blocks()
        snap = engine.snapshot()
        assert snap.queues == walked_queues(engine)
        for rank in (HIGH, NORMAL):
            assert engine.admission_policy.queue_ahead(rank) == walked_ahead(engine, rank)
            assert engine.admission_policy._published[rank] == walked_ahead(engine, rank)
        sch = engine.scheduler
        self.seen |= {q for q in ("waiting", "running", "swapped") if getattr(sch, q)}
        if sch.counts.admitted_waiting():
            self.seen.add("admitted waiting")
        if any(not engine.admission_policy.is_admitted(s) for s in sch.waiting):
            self.seen.add("queued waiting")

    def step(self, engine: LLMEngine) -> None:
        engine.step()
        self.check(engine)


def overloaded() -> LLMEngine:
    """Three batch slots, 32 blocks of 16 tokens, preempted sequences swapped out, and a queue
    of at most 4 (a hard limit: a request of several sequences can be refused mid-way)."""
    adm = AdmissionConfig(estimate="worst_case", max_queue=4, max_queue_wait_s=0.0)
    engine = make_engine(
        kv_cache_bytes="256KiB", max_model_len=256, max_num_seqs=3, admission=adm, **SWAP
    )
    assert engine.block_manager.num_blocks == 32
    return engine


def low_among_normal() -> tuple[LLMEngine, Moves, list[str]]:
    """An overloaded engine running a normal, a low and a normal request, one step in (each
    step checked, `Moves`): the low one is the next victim of a high arrival or a remedy."""
    engine, moves = overloaded(), Moves()
    ids = [
        engine.add_request(prompt(i), params(), priority=p)
        for i, p in enumerate(["normal", "low", "normal"])
    ]
    moves.step(engine)
    return engine, moves, ids


def test_every_move_between_the_queues_is_counted() -> None:
    engine, moves = overloaded(), Moves()
    ids = [
        engine.add_request(prompt(i), params(), priority=p)
        for i, p in enumerate(["normal", "low", "normal"])
    ]
    moves.check(engine)  # admitted, waiting for the step
    moves.step(engine)  # all three start
    ids += [
        engine.add_request(prompt(i), params(), priority=p)
        for i, p in enumerate(["low", "normal", "high"], start=3)
    ]
    moves.check(engine)
    moves.step(engine)  # the high one takes the low one's slot: it is swapped out
    assert engine.scheduler.preemptions["swap"] == 1
    assert [s.request_id for s in engine.scheduler.swapped] == [ids[1]]
    # a request of three sequences: the queue takes two, refuses the third, and all go
    before = dict(engine.scheduler.counts.queued[Status.WAITING])
    with pytest.raises(AdmissionRejected) as refused:
        engine.add_requests([NewRequest(prompt(9 + i), params()) for i in range(3)])
    assert refused_request(refused.value) == 2  # the third: two were taken in, then withdrawn
    assert engine.scheduler.counts.queued[Status.WAITING] == before
    moves.check(engine)
    res = apply(engine, engine.evict(1, "normal"))  # swapped out, back in as room allows
    assert res.ok and res.data["evicted"] == [(ids[2], "swap")]
    moves.check(engine)
    assert engine.abort(ids[3])  # waiting
    assert engine.abort(ids[1])  # swapped out
    moves.check(engine)
    assert apply(engine, engine.set_offload(False)).ok
    res = apply(engine, engine.evict(1, "normal"))  # recomputed: back in the queue, admitted
    assert res.ok and [mode for _, mode in res.data["evicted"]] == ["recompute"]
    moves.check(engine)
    assert engine.abort(ids[0])  # running
    moves.check(engine)
    for _ in range(200):
        if not engine.has_unfinished():
            break
        moves.step(engine)
    assert not engine.has_unfinished()
    assert engine.scheduler.preemptions == {"swap": 2, "recompute": 1}
    events = engine.snapshot().events
    assert (events["swapped_out"], events["swapped_in"]) == (2, 1)  # the aborted one stayed out
    assert moves.seen == {"waiting", "running", "swapped", "admitted waiting", "queued waiting"}
    empty = dict.fromkeys(PRIORITY_NAMES.values(), 0)
    assert engine.snapshot().queues == {"waiting": empty, "running": empty, "swapped": empty}


def test_the_audit_fails_on_a_move_left_uncounted(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = overloaded()
    rid = engine.add_request(prompt(0), params())
    engine.step()
    engine.audit_blocks()
    sch = engine.scheduler
    sch.counts.queued[Status.WAITING][NORMAL] += 1  # a count off by one
    with pytest.raises(AssertionError, match="queue counts"):
        engine.audit_blocks()
    sch.counts.queued[Status.WAITING][NORMAL] -= 1
    engine.audit_blocks()
    sch.counts.admit(sch.running[0], 1)  # a running request's ticket: counted as it moves
    engine.audit_blocks()
    sch.counts.admitted[NORMAL] += 1  # a request counted as admitted and waiting
    with pytest.raises(AssertionError, match="queue counts"):
        engine.audit_blocks()
    sch.counts.admitted[NORMAL] -= 1
    engine.audit_blocks()
    # the admitted sequences of the overlap peak: as many as the admitted tickets, not theirs
    policy = engine.admission_policy
    policy._admitted["req-stranger"] = policy._admitted.pop(rid)
    with pytest.raises(AssertionError, match="admitted sequences"):
        engine.audit_blocks()
    policy._admitted[rid] = policy._admitted.pop("req-stranger")
    engine.audit_blocks()
    # a swap out that leaves the running queue uncounted
    moved = sch._moved

    def forgetful(seq: Sequence, src: Status | None, dst: Status | None) -> None:
        if src is not Status.RUNNING:
            moved(seq, src, dst)

    monkeypatch.setattr(sch, "_moved", forgetful)
    fut = engine.evict(1, "normal")
    engine.step()
    assert fut.result(0).data["evicted"] == [(rid, "swap")]
    with pytest.raises(AssertionError, match="queue counts"):
        engine.audit_blocks()


class DeviceOutOfMemory(RuntimeError):
    """What a device copy or allocation raises under memory pressure (a CUDA OOM): faked, as
    no device can run out here."""


def raising_once(
    real: Callable[..., None],
    when: Callable[..., bool],
    error: Callable[[str], Exception] = DeviceOutOfMemory,
) -> Callable[..., None]:
    """`real`, except that the first call `when` accepts raises `error` instead."""
    raised = []

    def call(*args: object) -> None:
        if not raised and when(*args):
            raised.append(args)
            raise error("CUDA out of memory (injected)")
        real(*args)

    return call


def test_a_swap_in_out_of_memory_once_leaves_the_sequence_swapped_out_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy back to the device runs out of memory once, inside a step: the sequence stays
    swapped out holding its host copy, the device blocks taken for it go back, the counts
    agree with the queues, and it comes back at a later step and finishes."""
    engine, moves = overloaded(), Moves()
    # the two that run on fill three blocks and take a fourth each for their next token; the
    # one evicted ends in a block of its own, copied back in
    ids = [engine.add_request(prompt(i, n), params()) for i, n in enumerate([48, 48, 40])]
    moves.step(engine)
    sch = engine.scheduler
    oom = raising_once(sch.kv.swap_in, lambda *a: True, torch.OutOfMemoryError)
    monkeypatch.setattr(sch.kv, "swap_in", oom)
    fut = engine.evict(1, "normal")
    used = engine.block_manager.num_used
    engine.step()  # swapped out by the evict, then tried back in within the step
    assert fut.result(0).data["evicted"] == [(ids[2], "swap")]
    assert [s.request_id for s in sch.swapped] == [ids[2]]
    assert engine.block_manager.num_used < used  # its device blocks went to the host
    moves.check(engine)
    done = run_all(engine, moves.check)
    assert {rid: len(o.token_ids) for rid, o in done.items()} == dict.fromkeys(ids, 24)
    assert engine.snapshot().events["swapped_in"] == 1


def out_of_memory(*args: object) -> None:
    """A device copy that cannot get its memory, as torch raises it on CUDA."""
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")


def test_a_swap_in_out_of_device_memory_for_a_while_does_not_stop_the_running_ones(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every copy back to the device runs out of memory for a while (the device held by
    another process): raised out of each step, no running sequence made progress for as long
    as it lasted. Now the step goes on without the swapped-out sequence: the running ones
    finish, one warning says why it stays out, and it comes back once the copy succeeds."""
    engine, moves = overloaded(), Moves()
    ids = [engine.add_request(prompt(i, n), params()) for i, n in enumerate([48, 48, 40])]
    moves.step(engine)
    sch = engine.scheduler
    copy_in = sch.kv.swap_in
    monkeypatch.setattr(sch.kv, "swap_in", out_of_memory)
    fut = engine.evict(1, "normal")
    done: dict[str, int] = {}
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        for _ in range(200):
            if set(done) == set(ids[:2]):
                break
            done |= {o.request_id: len(o.token_ids) for o in engine.step() if o.finished}
            moves.check(engine)
    assert fut.result(0).data["evicted"] == [(ids[2], "swap")]
    assert done == dict.fromkeys(ids[:2], 24)
    assert [s.request_id for s in sch.swapped] == [ids[2]]
    said = [r.getMessage() for r in caplog.records if "stays swapped out" in r.getMessage()]
    assert len(said) == 1 and "ran out of memory" in said[0], said
    monkeypatch.setattr(sch.kv, "swap_in", copy_in)
    done |= {rid: len(o.token_ids) for rid, o in run_all(engine, moves.check).items()}
    assert done == dict.fromkeys(ids, 24)


def said(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    """The warnings logged so far that hold `words`."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and words in r.getMessage()
    ]


def test_a_swap_out_out_of_memory_in_a_step_recomputes_the_sequence_instead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A high arrival takes a low request's slot (`_make_way`) and copying the low one to the
    host runs out of memory: it is recomputed instead, its host blocks given back and its
    device blocks freed, one warning naming it and the error, and it finishes. Taken off the
    running queue before the copy, it was in no queue, its blocks on both tiers leaked, and
    the step raised."""
    engine, moves, ids = low_among_normal()
    sch = engine.scheduler
    monkeypatch.setattr(sch.kv, "swap_out", out_of_memory)
    ids.append(engine.add_request(prompt(3), params(), priority="high"))
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        moves.step(engine)  # the high one starts in the low one's slot
    assert sch.preemptions == {"swap": 0, "recompute": 1}
    assert [s.request_id for s in sch.waiting] == [ids[1]]
    assert sorted(s.request_id for s in sch.running) == sorted([ids[0], ids[2], ids[3]])
    assert engine.host_block_manager.num_used == 0
    assert said(caplog, "preempted by recompute") == [
        f"{ids[1]} is preempted by recompute: copying it to the host pool ran out of memory "
        "(CUDA out of memory. Tried to allocate 2.00 MiB); it waits to run again from its text"
    ]
    done = run_all(engine, moves.check)
    assert {rid: len(o.token_ids) for rid, o in done.items()} == dict.fromkeys(ids, 24)
    assert engine.snapshot().events.get("swapped_out", 0) == 0


def test_a_remedys_swap_out_out_of_memory_recomputes_what_it_preempts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An eviction and a batch cut whose copies to the host run out of memory (on the host
    too: the CPU allocator's error) preempt by recompute: each says so in its result, the
    batch cut goes on to its limit, nothing holds host blocks, one warning covers them all,
    and every request finishes."""
    engine, moves = overloaded(), Moves()
    ids = [engine.add_request(prompt(i), params()) for i in range(3)]
    moves.step(engine)
    sch = engine.scheduler
    monkeypatch.setattr(sch.kv, "swap_out", out_of_memory)
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        res = apply(engine, engine.evict(1, "normal"))
        assert res.data["evicted"] == [(ids[2], "recompute")]
        moves.check(engine)

        def host_out_of_memory(*args: object) -> None:
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                "memory: you tried to allocate 1048576 bytes"
            )

        monkeypatch.setattr(sch.kv, "swap_out", host_out_of_memory)
        res = apply(engine, engine.set_max_num_seqs(1))
        assert [mode for _, mode in res.data["preempted"]] == ["recompute", "recompute"]
        assert len(sch.running) == 1 and engine.host_block_manager.num_used == 0
        moves.check(engine)
    assert len(said(caplog, "preempted by recompute")) == 1  # once a minute
    assert sch.preemptions["swap"] == 0
    assert apply(engine, engine.set_max_num_seqs(3)).ok
    done = run_all(engine, moves.check)
    assert {rid: len(o.token_ids) for rid, o in done.items()} == dict.fromkeys(ids, 24)


def broken_copy(*args: object) -> None:
    """A copy to the host that fails with anything but running out of memory: a bug."""
    raise RuntimeError("swap_out: a kvguard bug")


def test_a_swap_out_that_fails_otherwise_recomputes_the_sequence_and_every_request_finishes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every copy to the host fails with anything but running out of memory (a bug), for an
    eviction and for a high arrival taking a slot in a step: each sequence they preempt is
    recomputed instead (its host blocks given back, its device blocks freed), one error with
    the traceback names the first, and every request finishes. Raised out of the step with
    the victim still running, the next step picked the same victim and raised again: no
    request made progress for as long as the copy failed."""
    engine, moves, ids = low_among_normal()
    sch = engine.scheduler
    monkeypatch.setattr(sch.kv, "swap_out", broken_copy)
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        ids.append(engine.add_request(prompt(3), params(), priority="high"))
        moves.step(engine)  # the high one starts in the low one's slot
        assert [s.request_id for s in sch.waiting] == [ids[1]]
        assert sch.preemptions == {"swap": 0, "recompute": 1}
        assert engine.host_block_manager.num_used == 0
        res = apply(engine, engine.evict(1, "normal"))
        assert res.ok and res.data["evicted"] == [(ids[2], "recompute")]
        assert sch.preemptions == {"swap": 0, "recompute": 2}
        assert engine.host_block_manager.num_used == 0
        moves.check(engine)
        done = run_all(engine, moves.check)
    assert {rid: len(o.token_ids) for rid, o in done.items()} == dict.fromkeys(ids, 24)
    assert sch.preemptions == {"swap": 0, "recompute": 2}
    failed = [r for r in caplog.records if "preempted by recompute" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in failed] == [
        (
            logging.ERROR,
            f"{ids[1]} is preempted by recompute: copying it to the host pool failed "
            "(swap_out: a kvguard bug), a kvguard bug to report; it waits to run again from "
            "its text",
        )
    ]  # once a minute
    assert failed[0].exc_info is not None and "broken_copy" in caplog.text  # the traceback
    assert engine.snapshot().events.get("swapped_out", 0) == 0


def broken_copy_in(*args: object) -> None:
    """A copy back to the device that fails with anything but running out of memory: a bug."""
    raise RuntimeError("swap_in: a kvguard bug")


def evicted_and_run(break_copy_in: bool) -> tuple[LLMEngine, list[str], dict[str, list[int]]]:
    """Three requests run a step, two are evicted (swapped out) and every request is run to its
    end, the counts checked after each step; with `break_copy_in`, every copy back to the
    device fails (`broken_copy_in`). The engine, the request ids and each request's tokens."""
    engine, moves = overloaded(), Moves()
    # both evicted end in a part-filled block: none comes back by sharing cached blocks alone
    ids = [engine.add_request(prompt(i, n), params()) for i, n in enumerate([48, 40, 40])]
    moves.step(engine)
    if break_copy_in:
        engine.scheduler.kv.swap_in = broken_copy_in
    res = apply(engine, engine.evict(2, "normal"))  # out, and tried back in, in one step
    assert res.ok and res.data["evicted"] == [(ids[2], "swap"), (ids[1], "swap")]
    moves.check(engine)
    done = run_all(engine, moves.check)
    return engine, ids, {rid: o.token_ids for rid, o in done.items()}


def test_a_swap_in_that_fails_otherwise_recomputes_the_sequence_and_every_request_finishes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every copy back to the device fails with anything but running out of memory (a bug):
    each evicted sequence leaves the swapped queue and its host blocks and is computed again
    from its text, one error with the traceback names the first back, and every request finishes
    with the tokens it has where the copies work (greedy). Its one preemption stays counted
    as the swap it was. Raised out of the step with the sequence left swapped out, the next
    step tried the same copy and raised again: no request made progress for as long as the
    copy failed."""
    *_, want = evicted_and_run(break_copy_in=False)
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        engine, ids, got = evicted_and_run(break_copy_in=True)
    assert got == want and {rid: len(t) for rid, t in got.items()} == dict.fromkeys(ids, 24)
    sch = engine.scheduler
    assert sch.preemptions == {"swap": 2, "recompute": 0}
    assert not sch.swapped and engine.host_block_manager.num_used == 0
    events = engine.snapshot().events
    assert events["swapped_out"] == 2 and events.get("swapped_in", 0) == 0
    failed = [r for r in caplog.records if "copying it back" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in failed] == [
        (
            logging.ERROR,
            f"{ids[1]} is recomputed: copying it back to the device from the host pool failed "
            "(swap_in: a kvguard bug), a kvguard bug to report; it waits to run again from "
            "its text",
        )
    ]  # once a minute
    assert failed[0].exc_info is not None and "broken_copy_in" in caplog.text  # the traceback


def test_a_swap_in_that_loses_a_rank_raises_and_leaves_the_sequence_swapped_out() -> None:
    """A lost tensor-parallel rank during the copy back is no bug to recompute around: the
    engine cannot go on, so it raises out of the step, the sequence still swapped out with
    its host copy whole and the device blocks taken for it given back."""
    engine, moves = overloaded(), Moves()
    ids = [engine.add_request(prompt(i, n), params()) for i, n in enumerate([48, 48, 40])]
    moves.step(engine)
    sch = engine.scheduler

    def rank_lost(*args: object) -> None:
        raise RankFailure(1, "exited (injected)")

    sch.kv.swap_in = rank_lost
    fut = engine.evict(1, "normal")
    with pytest.raises(RankFailure):
        engine.step()
    assert fut.result(0).data["evicted"] == [(ids[2], "swap")]
    assert [s.request_id for s in sch.swapped] == [ids[2]]
    assert engine.host_block_manager.num_used == len(sch.swapped[0].host_block_table) > 0
    assert sch.preemptions == {"swap": 1, "recompute": 0}
    moves.check(engine)


def raising_after_the_first(real: Callable[[Sequence], str]) -> Callable[[Sequence], str]:
    """`Scheduler.preempt`, except that every call after the first raises (a bug)."""
    done: list[Sequence] = []

    def preempt(seq: Sequence) -> str:
        if done:
            raise RuntimeError("preempt: a kvguard bug")
        done.append(seq)
        return real(seq)

    return preempt


BATCH_CUTS: dict[str, Callable[[LLMEngine], object]] = {
    "set_max_num_seqs": lambda e: e.set_max_num_seqs(1),
    "reduce_max_num_seqs": lambda e: e.reduce_max_num_seqs(0.4),  # 3 -> 1
    "reconfigure": lambda e: e.reconfigure({("max_num_seqs",): 1}),
}


@pytest.mark.parametrize("cut", list(BATCH_CUTS))
def test_a_batch_cut_whose_preemption_raises_leaves_the_limit_as_it_was(
    monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """A batch cut to 1 whose second preemption raises (a bug): the action fails and the
    limit, the cut a remedy holds and the configured limit are as they were, the sequence
    preempted before the error waiting to run again, and every request finishes. Before,
    the cut stayed in force while the rule that asked for it recorded the action `failed`."""
    engine, moves = overloaded(), Moves()
    ids = [engine.add_request(prompt(i), params()) for i in range(3)]
    moves.step(engine)
    sch = engine.scheduler
    monkeypatch.setattr(sch, "preempt", raising_after_the_first(sch.preempt))
    fut = BATCH_CUTS[cut](engine)
    engine.step()
    with pytest.raises(RuntimeError, match="a kvguard bug"):
        fut.result(0)
    assert engine.knobs()["max_num_seqs"] == 3
    assert engine.batch_cut is None and engine.config.max_num_seqs == 3
    assert sch.num_preemptions == 1
    moves.check(engine)
    monkeypatch.delattr(sch, "preempt")
    done = run_all(engine, moves.check)
    assert {rid: len(o.token_ids) for rid, o in done.items()} == dict.fromkeys(ids, 24)


def test_a_start_whose_allocation_raises_leaves_the_request_queued_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Taking a waiting request's blocks raises as it starts: it waits on at its place, its
    cached prefix blocks given back, the counts agree with the queues, and it starts at a
    later step and finishes."""
    engine, moves = overloaded(), Moves()
    first = engine.add_request(prompt(0), params())
    moves.step(engine)
    second = engine.add_request(prompt(0), params())  # it finds the first's prompt cached
    bm = engine.block_manager
    monkeypatch.setattr(
        bm, "allocate", raising_once(bm.allocate, lambda seq, n: seq.request_id == second)
    )
    with pytest.raises(DeviceOutOfMemory):
        engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == [second]
    moves.check(engine)
    done = run_all(engine, moves.check)
    assert {rid: len(o.token_ids) for rid, o in done.items()} == {first: 24, second: 24}
    assert bm.hit_tokens == 32  # the second request started from the first's two blocks


def test_a_high_arrival_whose_slot_cannot_be_made_gives_its_matched_blocks_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A high arrival begins with two blocks of a running prompt (the prefix cache) and the
    preemption making its slot raises (a bug): the step raises and it waits on as it was,
    holding no block, and once preemptions work it starts from those two cached blocks,
    counted as prefix-cache hits. Before, it kept the matched blocks while waiting and
    started from them as if it had computed them: no hit counted."""
    engine, moves, ids = low_among_normal()
    moves.step(engine)
    sch, bm = engine.scheduler, engine.block_manager
    used = bm.num_used

    def broken(seq: Sequence) -> str:
        raise RuntimeError("preempt: a kvguard bug")

    monkeypatch.setattr(sch, "preempt", broken)
    shared = prompt(0)[:33] + [250, 251, 252, 253, 254, 255, 256]
    ids.append(engine.add_request(shared, params(), priority="high"))
    [high] = sch.waiting
    with pytest.raises(RuntimeError, match="a kvguard bug"):
        engine.step()  # the high one would take the low one's slot
    assert high.status is Status.WAITING and engine.admission_policy.is_admitted(high)
    assert high.block_table == [] and high.num_computed_tokens == 0
    assert bm.num_used == used
    moves.check(engine)
    monkeypatch.delattr(sch, "preempt")
    queried, hits = bm.queried_tokens, bm.hit_tokens
    moves.step(engine)
    assert high.status is Status.RUNNING and high.num_cached_tokens == 32
    assert (bm.queried_tokens - queried, bm.hit_tokens - hits) == (40, 32)
    done = run_all(engine, moves.check)
    assert {rid: len(o.token_ids) for rid, o in done.items()} == dict.fromkeys(ids, 24)


@pytest.mark.parametrize("offload", [False, True], ids=["recomputed", "swapped"])
def test_a_request_ended_for_outgrowing_the_pool_answers_though_its_step_then_raises(
    monkeypatch: pytest.MonkeyPatch, offload: bool
) -> None:
    """A step's scheduling ends a request that holds more tokens than the whole pool (its
    `length` answer), then the request queued behind it fails to start (its allocation
    raises) and the step raises. The ended request's answer comes out of the next step: kept
    in the step's batch, which the raise dropped, it was never handed out and its client
    waited for ever."""
    out = outgrowing(monkeypatch, offload)
    engine, rid = out.engine, out.rid
    later = engine.add_request([5, 6, 7, 8], params(4))
    bm = engine.block_manager
    monkeypatch.setattr(
        bm, "allocate", raising_once(bm.allocate, lambda seq, n: seq.request_id == later)
    )
    with pytest.raises(DeviceOutOfMemory):
        engine.step()  # the eviction and the switch applied, then the step's scheduling
    out.check_applied(offload)
    assert not engine.has_request(rid)  # it ended in that step: counted
    assert engine.snapshot().finished == {"length": {"normal": 1}}
    done = run_all(engine, Moves().check)
    assert done[rid].finish_reason == "length" and done[rid].token_ids == out.made
    assert len(done[later].token_ids) == 4
    assert engine.block_manager.num_used == 0 and engine.host_block_manager.num_used == 0


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The errors logged so far."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def count_repairs(engine: LLMEngine) -> float:
    """`kvguard_scheduler_count_repairs_total` as the daemon's /metrics exports it from the
    engine's latest snapshot."""
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: engine.latest_snapshot, lambda: True))
    text = generate_latest(reg).decode()
    [fam] = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == "kvguard_scheduler_count_repairs"
    ]
    assert fam.type == "counter"
    [sample] = fam.samples
    assert sample.name == "kvguard_scheduler_count_repairs_total"
    return sample.value


def test_a_drifted_count_is_repaired_with_an_error_and_the_request_it_hid_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An admitted request queued behind one admission holds back for KV starts only where
    the counts say an admitted request waits past the one held back (a step's walk ends at
    the last): counted one too few, it waits, on an idle engine for good. Once a second the
    scheduler recounts its queues, logs the drift as an error and repairs it, and it starts;
    the repair is counted in the metrics the daemon exports
    (`kvguard_scheduler_count_repairs_total`), where an operator sees it: an error line
    alone was seen by nobody who watches the metrics."""
    adm = AdmissionConfig(estimate="worst_case", max_queue=4, max_queue_wait_s=0.0)
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=256, max_num_seqs=3, admission=adm)
    sch, now = engine.scheduler, [0.0]
    sch.clock = lambda: now[0]
    engine.add_request(prompt(0, 20), params(220))  # holds 15 of the 32 blocks
    low = engine.add_request(prompt(1, 20), params(), priority="low")
    engine.step()  # a recount is due at the first step: nothing to repair
    assert count_repairs(engine) == 0
    held_back = engine.add_request(prompt(2, 20), params(220))  # 15 more do not fit
    assert sch.evict(1, PRIORITIES["low"]) == [(low, "recompute")]  # back in the queue, admitted
    assert [s.request_id for s in sch.waiting] == [held_back, low]
    sch.counts.admitted[PRIORITIES["low"]] -= 1  # a ticket change left uncounted
    engine.step()
    assert [s.request_id for s in sch.waiting] == [held_back, low]  # the count hid it
    assert not errors(caplog)
    now[0] += RECOUNT_S
    engine.step()
    assert [s.request_id for s in sch.waiting] == [held_back]
    assert errors(caplog) == [
        "queue counts drifted from the queues (admitted waiting low: counted 0, recounted 1): "
        "set to the recount; a move between the queues or an admission ticket change went "
        "uncounted, a kvguard bug to report"
    ]
    assert count_repairs(engine) == 1
    engine.audit_blocks()
    now[0] += RECOUNT_S
    engine.step()
    assert len(errors(caplog)) == 1  # repaired: nothing more to say
    assert count_repairs(engine) == 1


class Watched(list):
    """The scheduler's waiting queue, counting the entries that anything reads of it."""

    read = 0

    def __iter__(self):  # noqa: ANN204 - an iterator of Sequence
        for seq in super().__iter__():
            self.read += 1
            yield seq

    def __getitem__(self, i: int | slice) -> Sequence | list[Sequence]:
        got = super().__getitem__(i)
        self.read += len(got) if isinstance(i, slice) else 1
        return got

    def __contains__(self, seq: object) -> bool:
        self.read += len(self)
        return super().__contains__(seq)

    def __radd__(self, other: list[Sequence]) -> list[Sequence]:
        self.read += len(self)
        return list.__add__(other, self)


def queued_2000(kv_gated: bool) -> tuple[LLMEngine, Watched]:
    """An engine with 2000 requests queued behind a full batch of four, or, with slots free,
    for the KV commitment admission will not make while a long request holds the budget; its
    waiting queue `Watched` from here on."""
    adm = AdmissionConfig(estimate="worst_case", max_queue=10_000, max_queue_wait_s=0.0)
    engine = make_engine(
        kv_cache_bytes="256KiB",
        max_model_len=256,
        max_num_seqs=64 if kv_gated else 4,
        admission=adm,
    )
    # the once-a-second recount of the queue counts reads the queue: at the first step only
    engine.scheduler.clock = lambda: 0.0
    hog = 1 if kv_gated else 4  # a long request that holds the KV budget, or every slot
    for i in range(hog):
        engine.add_request(prompt(i, 20), params(220 if kv_gated else 24))
    engine.step()
    ranks = ["normal"] if kv_gated else ["high", "normal", "low"]
    for i in range(2000):
        engine.add_request(prompt(i % 200, 20), params(), priority=ranks[i % len(ranks)])
    sch = engine.scheduler
    assert len(sch.running) == hog and len(sch.waiting) == 2000
    sch.waiting = waiting = Watched(sch.waiting)
    return engine, waiting


@pytest.mark.parametrize("kv_gated", [False, True], ids=["full-batch", "kv-gated"])
def test_an_arrival_and_a_snapshot_read_a_few_queued_requests_not_the_queue(
    kv_gated: bool,
) -> None:
    """With 2000 requests queued, a new arrival and a snapshot read at most a few dozen of
    them: a binary search for the arrival's place, and the head of the queue for who starts
    next (up to the first request held back for KV). Each read every one, and a burst of
    arrivals cost the square of its length."""
    engine, waiting = queued_2000(kv_gated)
    engine.add_request(prompt(7, 20), params(), priority="low")
    engine.add_request(prompt(8, 20), params(), priority="normal")
    assert waiting.read <= 2 * 11  # two binary searches of 2000 entries for their places
    # admitted as they came (high ones take lower-priority slots): the next step starts them
    admitted = sum(map(engine.admission_policy.is_admitted, list.__iter__(waiting)))
    assert admitted == (3 if kv_gated else 4)
    waiting.read = 0
    assert engine.snapshot().num_waiting == 2002
    assert waiting.read <= admitted + 2
    engine.audit_blocks()


def test_a_step_reads_the_queue_up_to_the_last_admitted_request_not_to_its_end() -> None:
    """With slots free and 2000 requests queued that admission holds back for KV, a step
    starts the admitted ones at the head of the queue and stops at the first held back: no
    request behind it could start, as the queue counts say no admitted one waits there. The
    step read the whole queue for admitted requests that were not there."""
    engine, waiting = queued_2000(kv_gated=True)
    engine.step()
    # three started and the one held back, by the step, its prompt budget and its snapshot
    assert waiting.read <= 16
    assert len(engine.scheduler.running) == 4 and len(waiting) == 1997
    engine.audit_blocks()


class WalkToTheEnd:
    """A scheduler's queue counts with as many admitted requests left to find as ever there
    could be: its walks of the queue end at the end of the queue, as they did."""

    def __init__(self, counts: QueueCounts) -> None:
        self.counts = counts

    def __getattr__(self, name: str) -> object:
        return getattr(self.counts, name)

    def admitted_waiting(self) -> int:
        return 1 << 30


def admitted_behind_held_back(engine: LLMEngine) -> bool:
    """Whether an admitted request waits behind one admission holds back for KV."""
    held_back = False
    for seq in engine.scheduler.waiting:
        admitted = engine.admission_policy.is_admitted(seq)
        if admitted and held_back:
            return True
        held_back = held_back or not admitted
    return False


def batches(walk_to_the_end: bool) -> tuple[list[list[str]], int]:
    """The requests each step runs while waves of requests of every priority and of mixed
    lengths queue on a 32-block pool, and the steps that left an admitted request queued
    behind one admission holds back for KV: predicted admission overcommits, so preempted
    requests come back to the queue admitted, behind requests held back that came before
    them, and queued high ones sort ahead of admitted lower ones. Arrival times are fixed."""
    adm = AdmissionConfig(max_queue=1000, max_queue_wait_s=0.0)
    engine = make_engine(kv_cache_bytes="256KiB", max_model_len=256, max_num_seqs=8, admission=adm)
    sch = engine.scheduler
    if walk_to_the_end:
        sch.counts = WalkToTheEnd(sch.counts)
    t0, k, out, behind = time.monotonic() - 100.0, 0, [], 0

    def step() -> None:
        nonlocal behind
        engine.step()
        out.append(sorted(s.request_id for s in sch.running))
        behind += admitted_behind_held_back(engine)
        assert len(out) < 3000

    for _ in range(4):
        for _ in range(10):
            rank = ("high", "normal", "low")[k * 7 % 3 if k % 4 else 2]
            n = params(8 + 16 * (k % 4))
            engine.add_request(prompt(k, 20 + 9 * (k % 5)), n, priority=rank, arrival_time=t0 + k)
            k += 1
        for _ in range(3):
            step()
    while engine.has_unfinished():
        step()
    return out, behind


def test_a_walk_that_stops_at_the_last_admitted_request_starts_what_a_whole_walk_starts() -> None:
    stopping, behind = batches(walk_to_the_end=False)
    assert behind > 10  # the walk had admitted requests to find past the first held back
    assert (stopping, behind) == batches(walk_to_the_end=True)


class Lockstep:
    """Two engines given the same operations: one as it runs, one whose walks of the waiting
    queue go to its end (`WalkToTheEnd`). After each operation both pass the audit, admission
    and the snapshot read what a walk of the queues gives, and both run and queue the same
    requests."""

    def __init__(self) -> None:
        adm = AdmissionConfig(max_queue=40, max_queue_wait_s=0.0)
        self.engines = [
            make_engine(
                kv_cache_bytes="256KiB",
                max_model_len=256,
                max_num_seqs=6,
                admission=adm,
                enable_prefix_caching=True,
                **SWAP,
            )
            for _ in range(2)
        ]
        for engine in self.engines:
            engine.scheduler.clock = lambda: 0.0  # no recount repairs what the audit would see
        whole = self.engines[1].scheduler
        whole.counts = WalkToTheEnd(whole.counts)  # type: ignore[assignment]

    def apply(self, op: Callable[[LLMEngine], object]) -> None:
        """Run `op` on both engines: the same outcome, and the same queues after it."""
        outcomes = []
        for engine in self.engines:
            try:
                outcomes.append(op(engine))
            except AdmissionRejected as e:
                outcomes.append(("refused", e.decision.kind, refused_request(e)))
            self.check(engine)
        assert outcomes[0] == outcomes[1] or not isinstance(outcomes[0], (str, list, tuple, int))
        running, waiting = (
            [[s.request_id for s in getattr(e.scheduler, q)] for e in self.engines]
            for q in ("running", "waiting")
        )
        assert sorted(running[0]) == sorted(running[1])
        assert waiting[0] == waiting[1]

    @staticmethod
    def check(engine: LLMEngine) -> None:
        sch = engine.scheduler
        counts = sch.counts
        sch.counts = getattr(counts, "counts", counts)  # the audit compares the counts' own
        try:
            engine.audit_blocks()
        finally:
            sch.counts = counts
        assert engine.snapshot().queues == walked_queues(engine)
        for rank in (HIGH, NORMAL):
            assert engine.admission_policy.queue_ahead(rank) == walked_ahead(engine, rank)


def random_operation(rng: random.Random, k: int) -> Callable[[LLMEngine], object]:
    """One operation of the mix: arrivals of one request or of several (mixed priorities and
    lengths, some with a shared prefix), steps, aborts, evicts, offload turned on and off, KV
    dtype switches, pool shares and batch limits. No injected out-of-memory fault: its
    backoff restores the budget by the clock, which two engines do not share."""
    kind = rng.choices(
        ["add", "add several", "step", "abort", "evict", "offload", "dtype", "share", "seqs"],
        [6, 2, 10, 2, 1, 1, 1, 1, 1],
    )[0]
    if kind.startswith("add"):
        prefix = [3 + rng.randint(0, 5)] * rng.choice([0, 16, 32])
        reqs = [
            NewRequest(
                prefix + [10 + (13 * k + 7 * j + q) % 240 for q in range(rng.randint(5, 60))],
                SamplingParams(max_tokens=rng.randint(4, 48), ignore_eos=True),
            )
            for j in range(1 if kind == "add" else rng.randint(2, 4))
        ]
        rank = rng.choice(["high", "normal", "normal", "low"])
        return lambda e: e.add_requests(reqs, priority=rank, arrival_time=1000.0 + k)
    if kind == "step":
        return lambda e: len(e.step())
    if kind == "abort":
        pick = rng.random()
        return lambda e: bool(e._seqs) and e.abort(sorted(e._seqs)[int(pick * len(e._seqs))])
    value = {
        "evict": (rng.randint(1, 2), rng.choice(["normal", "low"])),
        "offload": (rng.random() < 0.5,),
        "dtype": (rng.choice(["fp32", "bf16", "fp8_e4m3"]),),
        "share": (rng.choice([0.5, 0.75, 1.0]),),
        "seqs": (rng.choice([2, 4, 6, None]),),
    }[kind]
    action = {
        "evict": "evict",
        "offload": "set_offload",
        "dtype": "set_kv_cache_dtype",
        "share": "set_kv_pool_share",
        "seqs": "set_max_num_seqs",
    }[kind]
    return lambda e: getattr(e, action)(*value)  # applied at the next step


@pytest.mark.parametrize(
    ("seed", "seen"),
    [(2, "admitted behind held back"), (4, "swapped and switched dtype")],
)
def test_random_operations_keep_the_counts_and_start_what_a_whole_walk_starts(
    seed: int, seen: str
) -> None:
    """The reviewer's lockstep fuzz, seeded: 40 operations, then steps to the end. Seed 2
    leaves admitted requests queued behind one held back for KV (the early stop's case),
    seed 4 swaps sequences out and in across a KV dtype switch."""
    rng, both = random.Random(seed), Lockstep()
    engine, behind = both.engines[0], 0

    def run(op: Callable[[LLMEngine], object]) -> None:
        nonlocal behind
        both.apply(op)
        behind += admitted_behind_held_back(engine)

    for k in range(40):
        run(random_operation(rng, k))
    for _ in range(1000):
        if not any(e.has_unfinished() for e in both.engines):
            break
        run(lambda e: len(e.step()))
    assert not any(e.has_unfinished() for e in both.engines)
    events = engine.snapshot().events
    if seen == "admitted behind held back":
        assert behind > 10 and engine.scheduler.preemptions["recompute"] > 0
    else:
        assert events["swapped_in"] > 0 and events["kv_dtype_switched"] > 0
