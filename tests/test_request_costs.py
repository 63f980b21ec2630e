"""What taking a request in costs the engine thread, which every running request waits for.

A request of n choices is n engine requests sharing its parameters (the API's `_choice_params`:
the same params, or for a seeded request copies with seed + i). Each choice's parameters were
validated again when the engine took it in, every logit_bias entry each time: 22 ms a choice
for a bias on every token of smollm2's 49k vocabulary, 0.7 s of the engine thread for n=32,
with every other request's decode stalled. The bias is now checked once, when the params are
made, and kept read-only (`CheckedBias`), so that the engine's check of each choice does not
grow with it. These tests count the Python lines the engine runs, not time: deterministic.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvguard.daemon.openai_api import _choice_params
from kvguard.daemon.openai_schemas import MAX_CHOICES
from kvguard.engine import EngineConfig, LLMEngine
from kvguard.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    eng = LLMEngine.from_config(
        EngineConfig(model="tiny", kv_cache_bytes="16MiB", num_threads=2), progress=False
    )
    yield eng
    eng.shutdown()


def lines_run(fn: Callable[[], Any]) -> int:
    """How many Python lines `fn()` runs (line events of every frame it enters)."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return tracer

    before = sys.gettrace()  # a coverage tracer, where one runs: put back after
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(before)
    return count


def take_in_choices(engine: LLMEngine, params: SamplingParams, tag: str) -> int:
    """The lines the engine runs to take in a request of MAX_CHOICES choices of `params`, as
    the API hands them to it; the choices are then aborted."""
    ids = [f"{tag}-{i}" for i in range(MAX_CHOICES)]

    def add() -> None:
        for i, rid in enumerate(ids):
            engine.add_request([1, 2, 3], _choice_params(params, i), request_id=rid)

    try:
        return lines_run(add)
    finally:
        for rid in ids:
            engine.abort(rid)


@pytest.mark.parametrize("seed", [None, 7], ids=["shared params", "seeded copies"])
def test_the_choices_of_a_request_do_not_check_its_logit_bias_again(
    engine: LLMEngine, seed: int | None
) -> None:
    """32 choices biasing every token of the vocabulary cost the engine thread as many lines
    as 32 choices biasing one token: the bias is checked where the params are made (off the
    engine thread), not once more per choice. Before, the difference was two passes over the
    vocabulary per choice (the check, then the vocabulary range), 64 in all."""
    vocab = engine.biasable_ids()  # the tokenizer's tokens (the model has padding rows too)

    def params(bias: dict[int, float]) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=1.0, seed=seed, logit_bias=bias)

    take_in_choices(engine, params({5: 0.5}), "warm")  # first-call work out of the count
    one = take_in_choices(engine, params({5: 0.5}), "one")
    whole = take_in_choices(engine, params({t: 0.5 for t in range(vocab)}), "whole")
    assert whole - one < vocab, (whole, one)  # less than one pass over it for all 32


def test_a_checked_logit_bias_stays_as_checked() -> None:
    """The checked bias is a read-only copy; what is built from it (copies, pickles,
    dataclasses.replace, asdict) is checked as it is built, and a new dict put in its place
    is checked by the next validate."""
    from kvguard.engine.sampling_params import CheckedBias

    given = {3: 1.5, 9: -100}
    p = SamplingParams(logit_bias=given)
    assert type(p.logit_bias) is CheckedBias and p.logit_bias == given
    assert p.logit_bias.max_id == 9 and SamplingParams().logit_bias.max_id == -1
    given[4] = 1000.0  # the caller's dict is not the params' bias
    assert 4 not in p.logit_bias
    with pytest.raises(TypeError, match="read-only"):
        p.logit_bias[4] = 1.0
    with pytest.raises(TypeError, match="read-only"):
        p.logit_bias.update({4: 1.0})
    for made in (
        copy.copy(p),
        copy.deepcopy(p),
        pickle.loads(pickle.dumps(p)),
        dataclasses.replace(p, seed=1),
    ):
        assert type(made.logit_bias) is CheckedBias and made.logit_bias == {3: 1.5, 9: -100}
    assert dataclasses.asdict(p)["logit_bias"] == {3: 1.5, 9: -100}
    with pytest.raises(ValueError, match="logit_bias"):
        CheckedBias({3: 101.0})  # none is made unchecked
    p.logit_bias = {3: float("nan")}
    with pytest.raises(ValueError, match=r"logit_bias=\{3: nan\}"):
        p.validate()
    for bad in ({True: 1.0}, {1: True}, {-1: 1.0}, {"1": 1.0}, {1: "x"}, {1: 10**400}, [(1, 1)]):
        with pytest.raises(ValueError, match="expected token ids >= 0 mapped to numbers"):
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]


def test_a_bias_past_the_vocabulary_is_refused_for_every_choice(engine: LLMEngine) -> None:
    """The engine's vocabulary check reads the checked bias's largest id: a bias naming an id
    past the vocabulary is refused for each choice as it was, in order, the first five."""
    vocab = engine.model_config.vocab_size
    p = SamplingParams(max_tokens=1, seed=3, logit_bias={vocab + 9: 1.0, 0: 1.0, vocab: -1.0})
    for i in range(3):
        with pytest.raises(ValueError, match=rf"logit_bias token ids \[{vocab}, {vocab + 9}\]"):
            engine.add_request([1, 2], _choice_params(p, i), request_id=f"past-{i}")
