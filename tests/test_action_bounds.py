"""Remedy parameters are bounded: no action, from a rule or an operator, may take the engine past
the limits it was configured with (issue 13: `reduce_batch {"min": 1e9}` raised max_num_seqs
from 1 to 10^9, and `set_max_num_seqs 1e30` or a cap of 1e30 was stored as given)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from kvguard.daemon.control_plane import ACTION_TIMEOUT_S, ControlPlane
from kvguard.engine import LLMEngine
from kvguard.engine.control import ActionResult
from kvguard.engine.engine_loop import EngineLoop
from kvguard.rules.actions import (
    MAX_SEQS,
    MAX_TOKENS,
    ActionError,
    StopSignal,
    parse_params,
    run_action,
)
from tests.test_engine import make_engine

SEQS = 8  # serving.max_num_seqs of the engine under test
LEN = 256  # serving.max_model_len


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine(max_num_seqs=SEQS, max_model_len=LEN)


@pytest.fixture(autouse=True)
def configured(engine: LLMEngine) -> None:
    """Each test starts from the configured knobs, whatever the one before left."""
    settle(engine, engine.set_max_num_seqs(SEQS))
    settle(engine, engine.set_max_new_tokens_cap(None))


def settle(engine: LLMEngine, fut: Future) -> ActionResult:
    """Actions apply at a step boundary; an idle engine's step just drains the mailbox."""
    engine.step()
    return fut.result(0)


def seqs(engine: LLMEngine) -> int:
    return engine.knobs()["max_num_seqs"]  # type: ignore[return-value]


# -- reduce_batch never raises -------------------------------------------------------------------


def test_reduce_batch_with_a_huge_min_never_raises_the_limit(engine: LLMEngine) -> None:
    settle(engine, engine.set_max_num_seqs(1))
    res = settle(engine, run_action(engine, "reduce_batch", {"factor": 0.5, "min": 1000}))
    assert res.after["max_num_seqs"] == 1 and seqs(engine) == 1, res.detail
    assert "never raises" in res.detail


@pytest.mark.parametrize(
    ("current", "params", "want"),
    [
        (8, {"factor": 0.5}, 4),
        (8, {"factor": 0.5, "min": 6}, 6),  # not below min ...
        (4, {"factor": 0.5, "min": 6}, 4),  # ... but never above the current limit
        (8, {"factor": 1}, 8),  # factor 1 is allowed and changes nothing
        (3, {"factor": 0.1}, 1),  # floor(0.3) = 0, held at min 1
    ],
)
def test_reduce_batch_is_min_of_current_and_floored_product(
    engine: LLMEngine, current: int, params: dict[str, Any], want: int
) -> None:
    settle(engine, engine.set_max_num_seqs(current))
    res = settle(engine, run_action(engine, "reduce_batch", params))
    assert (res.before["max_num_seqs"], res.after["max_num_seqs"]) == (current, want), res.detail


def test_reduce_batch_reads_the_limit_when_applied_not_when_posted(engine: LLMEngine) -> None:
    """An action lowered the limit while the reduction waited in the mailbox: the reduction
    works from the live value (2), where one computed when posted (from 8) would raise it."""
    first = engine.set_max_num_seqs(2)
    cut = run_action(engine, "reduce_batch", {"factor": 0.5, "min": 4})
    engine.step()
    assert first.result(0).ok and cut.result(0).after["max_num_seqs"] == 2
    assert seqs(engine) == 2


def test_handle_oom_halves_without_raising_a_lowered_limit(engine: LLMEngine) -> None:
    first = engine.set_max_num_seqs(1)
    chain = run_action(engine, "handle_oom")
    engine.step()
    first.result(0)
    assert chain.result(0).after["max_num_seqs"] == 1 and seqs(engine) == 1


def test_a_chain_withdrawn_before_the_engine_takes_it_runs_no_step(engine: LLMEngine) -> None:
    """Cancelling an action of several posted steps (the OOM chain) withdraws every step, and
    is refused once the engine has taken them. Before, only the wrapper was cancelled: every
    step still ran, and the wrapper's callback raised setting a result on it."""
    before = engine.knobs()
    chain = run_action(engine, "handle_oom")
    assert chain.cancel() and chain.cancelled()
    engine.step()
    assert engine.knobs() == before  # no step ran: batch, FP8, offload as they were
    undo = run_action(engine, "recover_from_oom")  # a chain too: back to the configuration
    engine.step()
    assert not undo.cancel() and undo.result(0).ok


# -- the configured limits: refused for operators, held for rules --------------------------------


def test_set_max_num_seqs_above_the_configured_maximum_is_refused(engine: LLMEngine) -> None:
    for n in (SEQS + 1, 1000, MAX_SEQS):
        with pytest.raises(ActionError, match=rf"serving\.max_num_seqs={SEQS}") as err:
            run_action(engine, "set_max_num_seqs", {"n": n})
        assert err.value.param == "n"
    engine.step()
    assert seqs(engine) == SEQS
    ok = settle(engine, run_action(engine, "set_max_num_seqs", {"n": SEQS}))
    assert ok.ok and ok.after["max_num_seqs"] == SEQS


def test_set_max_num_seqs_from_a_rule_is_clamped_and_says_so(engine: LLMEngine) -> None:
    settle(engine, engine.set_max_num_seqs(2))
    res = settle(engine, run_action(engine, "set_max_num_seqs", {"n": 1000}, clamp=True))
    assert res.ok and res.after["max_num_seqs"] == SEQS
    assert f"asked 1000, clamped to serving.max_num_seqs={SEQS}" in res.detail


def test_cap_above_max_model_len_is_refused_or_clamped(engine: LLMEngine) -> None:
    with pytest.raises(ActionError, match=rf"max_model_len={engine.max_model_len}") as err:
        run_action(engine, "cap_max_new_tokens", {"n": engine.max_model_len + 1})
    assert err.value.param == "n"
    engine.step()
    assert engine.knobs()["max_new_tokens_cap"] is None
    res = settle(engine, run_action(engine, "cap_max_new_tokens", {"n": MAX_TOKENS}, clamp=True))
    assert res.after["max_new_tokens_cap"] == engine.max_model_len and "clamped" in res.detail
    ok = settle(engine, run_action(engine, "cap_max_new_tokens", {"n": engine.max_model_len}))
    assert ok.after["max_new_tokens_cap"] == engine.max_model_len


def test_rules_act_with_clamping(engine: LLMEngine) -> None:
    """The daemon's rule executor holds a rule's parameter to the running config's limit."""
    settle(engine, engine.set_max_num_seqs(2))
    loop = EngineLoop(engine).start()
    try:
        plane = SimpleNamespace(
            service=SimpleNamespace(engine=engine),
            action_timeout_s=ACTION_TIMEOUT_S,
            stopping=StopSignal(),  # the daemon's stop: never set here
        )
        res = ControlPlane._execute(plane, "set_max_num_seqs", {"n": 64})  # type: ignore[arg-type]
    finally:
        loop.stop()
    assert res.ok and res.after["max_num_seqs"] == SEQS and "clamped" in res.detail


# -- the engine's own checks, for callers that skip the catalogue --------------------------------


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("set_max_num_seqs", (10**30,)),
        ("set_max_num_seqs", (SEQS + 1,)),
        ("set_max_num_seqs", (True,)),
        ("set_max_num_seqs", (4.0,)),
        ("set_max_num_seqs", (0,)),
        ("set_max_new_tokens_cap", (10**30,)),
        ("set_max_new_tokens_cap", (True,)),
        ("set_max_new_tokens_cap", (float("inf"),)),
        ("evict", (True,)),
        ("evict", (0,)),
        ("evict", (2.0,)),
        ("reduce_max_num_seqs", (float("nan"),)),
        ("reduce_max_num_seqs", (0.0,)),
        ("reduce_max_num_seqs", (1.5,)),
        ("reduce_max_num_seqs", (0.5, True)),
        ("reduce_max_num_seqs", (0.5, 0)),
    ],
)
def test_engine_refuses_out_of_bounds_arguments(
    engine: LLMEngine, method: str, args: tuple[Any, ...]
) -> None:
    before = engine.knobs()
    with pytest.raises(ValueError) as err:
        getattr(engine, method)(*args)
    assert getattr(err.value, "param", None) in ("n", "count", "factor", "min")
    engine.step()
    assert engine.knobs() == before


# -- static bounds: what `kvguard rules check` can flag without the daemon's config --------------

BAD_PARAMS = [
    ("reduce_batch", {"min": 1e9}, "min"),
    ("reduce_batch", {"min": 10**9}, "min"),
    ("reduce_batch", {"min": True}, "min"),
    ("reduce_batch", {"min": 0}, "min"),
    ("reduce_batch", {"factor": float("nan")}, "factor"),
    ("reduce_batch", {"factor": float("inf")}, "factor"),
    ("reduce_batch", {"factor": 0}, "factor"),
    ("reduce_batch", {"factor": 1.5}, "factor"),
    ("reduce_batch", {"factor": True}, "factor"),
    ("reduce_batch", {"factor": "0.5"}, "factor"),
    ("reduce_batch", {"mni": 2}, "mni"),
    ("set_max_num_seqs", {"n": 1e30}, "n"),
    ("set_max_num_seqs", {"n": 10**30}, "n"),
    ("set_max_num_seqs", {"n": "8"}, "n"),
    ("set_max_num_seqs", {"n": 8.0}, "n"),
    ("set_max_num_seqs", {"n": False}, "n"),
    ("set_max_num_seqs", {}, "n"),
    ("cap_max_new_tokens", {"n": float("inf")}, "n"),
    ("cap_max_new_tokens", {"n": 1e30}, "n"),
    ("cap_max_new_tokens", {"n": 10**30}, "n"),
    ("cap_max_new_tokens", {"n": None}, "n"),
    ("evict_lowest_priority", {"count": 10**12}, "count"),
    ("evict_lowest_priority", {"count": True}, "count"),
    ("evict_lowest_priority", {"count": 0}, "count"),
    ("evict_lowest_priority", {"max_priority": 3}, "max_priority"),
    ("halt_admission", {"allow_priority": True}, "allow_priority"),
]


@pytest.mark.parametrize(("action", "params", "field"), BAD_PARAMS)
def test_invalid_params_are_refused_naming_the_parameter(
    action: str, params: dict[str, Any], field: str
) -> None:
    with pytest.raises(ActionError) as err:
        parse_params(action, params)
    assert err.value.param == field and field in str(err.value)


def test_params_that_are_not_a_mapping_are_refused() -> None:
    with pytest.raises(ActionError, match="mapping") as err:
        parse_params("reduce_batch", [0.5])  # type: ignore[arg-type]
    assert err.value.param == "params"


@pytest.mark.parametrize(
    ("action", "params"),
    [
        ("reduce_batch", {"factor": 1, "min": 1}),
        ("reduce_batch", {"factor": 0.25, "min": MAX_SEQS}),
        ("set_max_num_seqs", {"n": MAX_SEQS}),
        ("cap_max_new_tokens", {"n": MAX_TOKENS}),
        ("evict_lowest_priority", {"count": 4, "max_priority": "normal"}),
        ("halt_admission", {"allow_priority": None}),
    ],
)
def test_valid_params_pass_the_static_check(action: str, params: dict[str, Any]) -> None:
    parse_params(action, params)


def test_a_halt_for_all_is_null_or_none() -> None:
    """`none`, as `kvguard status` shows a halt for all, is that halt: the same value as null
    for the engine and for a remedy's identity (a rule may write either)."""
    assert parse_params("halt_admission", {"allow_priority": "none"}).model_dump() == {
        "allow_priority": None
    }
