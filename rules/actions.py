"""The action catalogue: names a rules file (or an operator) uses, mapped to the engine's
control surface. Each action validates its params, runs through the engine mailbox, and answers
an `ActionResult`; `undo` names the action that reverses it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvguard.engine.control import ActionResult

if TYPE_CHECKING:  # the engine (and torch) only when an action runs, not to validate a file
    from kvguard.engine.llm_engine import LLMEngine


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoParams(_Params):
    pass


class ReduceBatch(_Params):
    factor: float = Field(0.5, gt=0.0, lt=1.0)
    min: int = Field(1, ge=1)


class Evict(_Params):
    count: int = Field(4, ge=1)
    max_priority: Literal["high", "normal", "low"] = "low"


class Cap(_Params):
    n: int = Field(256, ge=1)


class Halt(_Params):
    allow_priority: Literal["high", "normal", "low"] | None = "high"


class SetSeqs(_Params):
    n: int = Field(..., ge=1)


@dataclass(frozen=True, slots=True)
class ActionSpec:
    name: str
    params: type[_Params]
    run: Callable[[LLMEngine, Any], Future]
    undo: str | None
    doc: str


def _reduce(e: LLMEngine, p: ReduceBatch) -> Future:
    return e.set_max_num_seqs(max(p.min, int(e.knobs()["max_num_seqs"] * p.factor)))


def _full_kv_dtype(e: LLMEngine) -> str:
    configured = e.config.kv_cache_dtype
    return "auto" if configured in ("auto", "fp8_e4m3") else configured


_SPECS = [
    ActionSpec(
        "reduce_batch",
        ReduceBatch,
        _reduce,
        "restore_batch",
        "multiply max_num_seqs by `factor` (not below `min`); excess sequences preempted",
    ),
    ActionSpec(
        "restore_batch",
        NoParams,
        lambda e, p: e.set_max_num_seqs(e.config.max_num_seqs),
        None,
        "max_num_seqs back to its configured value",
    ),
    ActionSpec(
        "set_max_num_seqs",
        SetSeqs,
        lambda e, p: e.set_max_num_seqs(p.n),
        "restore_batch",
        "set max_num_seqs to `n`",
    ),
    ActionSpec(
        "evict_lowest_priority",
        Evict,
        lambda e, p: e.evict(p.count, p.max_priority),
        None,
        "preempt `count` running sequences of priority <= `max_priority` (swap or recompute)",
    ),
    ActionSpec(
        "enable_fp8_kv",
        NoParams,
        lambda e, p: e.set_kv_cache_dtype("fp8_e4m3"),
        "disable_fp8_kv",
        "switch the live KV cache to FP8 (about 2-4x the blocks in the same bytes)",
    ),
    ActionSpec(
        "disable_fp8_kv",
        NoParams,
        lambda e, p: e.set_kv_cache_dtype(_full_kv_dtype(e)),
        None,
        "switch the KV cache back to full precision (refused while live tokens would not fit)",
    ),
    ActionSpec(
        "enable_cpu_offload",
        NoParams,
        lambda e, p: e.set_offload(True),
        "disable_cpu_offload",
        "preempt by swapping to the host pool",
    ),
    ActionSpec(
        "disable_cpu_offload",
        NoParams,
        lambda e, p: e.set_offload(False),
        None,
        "preempt by recompute only",
    ),
    ActionSpec(
        "cap_max_new_tokens",
        Cap,
        lambda e, p: e.set_max_new_tokens_cap(p.n),
        "uncap_max_new_tokens",
        "cap every request's max_tokens at `n` (responses say they were truncated)",
    ),
    ActionSpec(
        "uncap_max_new_tokens",
        NoParams,
        lambda e, p: e.set_max_new_tokens_cap(None),
        None,
        "remove the max-token cap",
    ),
    ActionSpec(
        "halt_admission",
        Halt,
        lambda e, p: e.halt_admission(p.allow_priority),
        "resume_admission",
        "refuse new requests (503) except priority `allow_priority` and above",
    ),
    ActionSpec(
        "resume_admission",
        NoParams,
        lambda e, p: e.resume_admission(),
        None,
        "accept new requests again",
    ),
]


def _handle_oom(e: LLMEngine, p: NoParams) -> Future:
    """The brief's emergency chain after an OOM (seed §6.1), cheapest step first:
    1 halve the batch, 2 evict 4 lowest-priority, 3 swap to host if a pool exists,
    4 FP8 KV, 5 halt admission when the cache is still above 98%."""
    snap = e.latest_snapshot
    steps = [
        e.set_max_num_seqs(max(1, min(snap.max_num_seqs, max(snap.num_running, 1)) // 2)),
        e.evict(4, "low"),
    ]
    if snap.host.blocks_total:
        steps.append(e.set_offload(True))
    if snap.kv_cache_dtype != "fp8_e4m3":
        steps.append(e.set_kv_cache_dtype("fp8_e4m3"))
    if snap.kv_cache_usage_ratio > 0.98:
        steps.append(e.halt_admission("high"))
    return _chain("handle_oom", steps)


def _chain(name: str, futures: list[Future]) -> Future:
    """One Future for several actions posted together (they apply in order at one boundary)."""
    out: Future = Future()
    left = [len(futures)]

    def done(_f: Future) -> None:
        left[0] -= 1
        if left[0]:
            return
        try:
            results = [f.result() for f in futures]
        except Exception as exc:  # noqa: BLE001
            out.set_exception(exc)
            return
        detail = "; ".join(f"{r.action}: {r.detail}" for r in results)
        out.set_result(
            ActionResult(
                name,
                results[0].before,
                results[-1].after,
                detail,
                all(r.ok for r in results),
                {"steps": [r.action for r in results]},
            )
        )

    for f in futures:
        f.add_done_callback(done)
    return out


def _recover_from_oom(e: LLMEngine, p: NoParams) -> Future:
    """Undo the emergency chain once the engine has been quiet: configured batch size, KV
    dtype, offload setting and open admission (the batch token budget restores itself)."""
    return _chain(
        "recover_from_oom",
        [
            e.set_max_num_seqs(e.config.max_num_seqs),
            e.set_kv_cache_dtype(
                _full_kv_dtype(e) if e.config.kv_cache_dtype != "fp8_e4m3" else "fp8_e4m3"
            ),
            e.set_offload(e.config.enable_cpu_offload)
            if e.host_block_manager.num_blocks
            else e.set_offload(False),
            e.resume_admission(),
        ],
    )


_SPECS.append(
    ActionSpec(
        "handle_oom",
        NoParams,
        _handle_oom,
        None,
        "the emergency chain: halve batch, evict 4, offload, FP8 KV, halt if > 98%",
    )
)
_SPECS.append(
    ActionSpec(
        "recover_from_oom",
        NoParams,
        _recover_from_oom,
        None,
        "undo handle_oom: configured batch, KV dtype and offload; admission open",
    )
)
ACTIONS: dict[str, ActionSpec] = {s.name: s for s in _SPECS}


class ActionError(ValueError):
    """Unknown action or bad params; the message names which and what was expected."""


def parse_params(name: str, params: dict[str, Any] | None) -> _Params:
    spec = ACTIONS.get(name)
    if spec is None:
        raise ActionError(f"unknown action {name!r}: expected one of {', '.join(sorted(ACTIONS))}")
    try:
        return spec.params(**(params or {}))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'params'}: {err['msg']}" for err in e.errors()
        )
        raise ActionError(f"action {name!r} params: {problems}") from e


def run_action(engine: LLMEngine, name: str, params: dict[str, Any] | None = None) -> Future:
    """Validate and post `name` to the engine; the Future answers its ActionResult."""
    parsed = parse_params(name, params)
    return ACTIONS[name].run(engine, parsed)
