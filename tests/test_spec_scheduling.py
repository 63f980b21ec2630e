"""Speculative drafts come last in a step: a decode's draft rows get the tokens and free blocks
left once running prompt chunks, swapped sequences and waiting requests have theirs.

A draft is a guess (a rejected one's blocks go straight back), so it must never
outrank work that is sure to be needed: drafts that took their blocks before waiting requests
were admitted held a prompt that fit back for as long as the decoding request kept drafting
(59 steps here), and a running prompt's next chunk, short of the blocks drafts had just taken,
preempted its own sequence. Each test runs the tiny model twice, drafts off and on, with a
lookup that always finds a match (every request "repeats" itself), and compares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.sequence import Sequence
from kvguard.engine.speculative import Lookup
from tests.test_engine import make_engine


@pytest.fixture(autouse=True)
def always_a_draft(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every lookup proposes as many tokens as it may: drafts in every decode step."""

    def propose(self: Lookup, seq: Sequence, most: int) -> list[int]:
        return [7] * most

    monkeypatch.setattr(Lookup, "propose", propose)
    yield


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt) % 300 + 10 for i in range(n)]


class Run:
    """A decoding request `a`, then `b` arriving after `warm` steps; what every step did."""

    def __init__(
        self,
        engine: LLMEngine,
        a: list[int],
        a_tokens: int,
        b: list[int],
        b_tokens: int,
        warm: int = 1,
    ) -> None:
        self.engine = engine
        self.batches: list[list[tuple[str, int]]] = []
        schedule = engine.scheduler.schedule

        def watched():  # noqa: ANN202 - a ScheduledBatch
            batch = schedule()
            self.batches.append(
                [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_tokens, strict=True)]
            )
            return batch

        engine.scheduler.schedule = watched
        self.a = engine.add_request(a, greedy(a_tokens))
        self.tokens: dict[str, list[int]] = {self.a: []}
        for _ in range(warm):
            self._step()
        self.b = engine.add_request(b, greedy(b_tokens))
        self.tokens[self.b] = []
        self.first_b = None  # the step after b's arrival that gave b its first token
        for i in range(300):
            self._step()
            if self.tokens[self.b] and self.first_b is None:
                self.first_b = i
            if not engine.has_unfinished():
                break
        assert not engine.has_unfinished()
        self.preemptions = engine.scheduler.num_preemptions
        self.drafted = engine.scheduler.drafted

    def _step(self) -> None:
        for out in self.engine.step():
            self.tokens[out.request_id] += out.new_token_ids
        self.engine.audit_blocks()  # every block owned once, the counts right


def test_drafts_never_hold_a_waiting_prompt_back() -> None:
    """A 40-token prompt arrives beside a request that drafts: six blocks, the decoding one
    holding two. It fits, and starts at once with drafts off; with the drafts' blocks taken
    first it waited 59 steps, nearly the decoding request's whole output."""
    runs = {}
    for spec in (0, 4):
        engine = make_engine(
            num_gpu_blocks=6,
            max_model_len=96,
            speculative_tokens=spec,
            speculative_row_cost=0.0,  # a draft at every match
            enable_prefix_caching=False,
        )
        runs[spec] = Run(engine, prompt(30, 1), 60, prompt(40, 2), 4)
    off, on = runs[0], runs[4]
    assert off.first_b == 0
    assert on.first_b == off.first_b, f"b's first token at step {on.first_b}, not {off.first_b}"
    assert on.drafted > 0  # the decoding request drafted all along
    assert on.tokens[on.a] == off.tokens[off.a] and on.tokens[on.b] == off.tokens[off.b]
    assert on.preemptions == off.preemptions == 0


def test_drafts_never_make_a_prompt_chunk_preempt() -> None:
    """Eight blocks: a decoding request (17 prompt tokens, 2 blocks while b runs) and a
    96-token prompt in chunks of 48 (6 blocks) fit exactly, with no preemption. The decoding
    request's drafts reach into a third block; taken before the prompt's second chunk reserved
    its three blocks, they left it two, and it preempted itself (recomputed from scratch, 8
    times over)."""
    runs = {}
    for spec in (0, 16):
        engine = make_engine(
            num_gpu_blocks=8,
            max_model_len=128,
            speculative_tokens=spec,
            speculative_row_cost=0.0,
            enable_prefix_caching=False,
            prefill_while_decoding=48,
        )
        runs[spec] = Run(engine, prompt(17, 3), 17, prompt(96, 4), 1)
    off, on = runs[0], runs[16]
    assert off.preemptions == 0
    assert on.preemptions == off.preemptions, f"{on.preemptions} preemption(s) with drafts"
    assert on.first_b == off.first_b
    assert on.drafted > 0
    assert on.tokens[on.a] == off.tokens[off.a] and on.tokens[on.b] == off.tokens[off.b]


def test_drafts_still_run_with_nothing_waiting_and_take_only_the_tokens_left() -> None:
    """Drafting is not switched off: alone, a decoding request verifies a full draft every
    step its limits allow. Beside a prompt chunk the drafts get what the step's token budget
    has left after the chunk, which keeps its `prefill_while_decoding` share, and no step
    runs more than `max_num_batched_tokens`."""
    cfg = {
        "speculative_tokens": 16,
        "speculative_row_cost": 0.0,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": 64,
        "prefill_while_decoding": 56,
    }
    engine = make_engine(**cfg)
    run = Run(engine, prompt(30, 5), 40, prompt(120, 6), 2, warm=12)
    a, b = run.a, run.b
    alone = [dict(step)[a] for step in run.batches[1:12]]  # a's decode steps before b came
    assert alone == [17] * 11  # its token and 16 drafts, every step
    # b's prompt: chunks of 56, 56 and 8 beside a's decode; a drafts with the rest
    beside = [dict(step) for step in run.batches[12:15]]
    assert [step[b] for step in beside] == [56, 56, 8]
    assert [step[a] for step in beside] == [8, 8, 17]
    assert all(sum(n for _, n in step) <= 64 for step in run.batches)
    ref = make_engine(**{**cfg, "speculative_tokens": 0})
    plain = Run(ref, prompt(30, 5), 40, prompt(120, 6), 2, warm=12)
    assert run.tokens == {a: plain.tokens[plain.a], b: plain.tokens[plain.b]}
