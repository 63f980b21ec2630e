"""The action catalogue: names a rules file (or an operator) uses, mapped to the engine's
control surface. Each action validates its params, runs through the engine mailbox, and answers
an `ActionResult`; `undo` names the action that reverses it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvguard.engine.config import MAX_NUM_SEQS
from kvguard.engine.control import REQUESTS_MOVED, ActionResult, Mailbox
from kvguard.engine.priority import parse_allow_priority

if TYPE_CHECKING:  # the engine (and torch) only when an action runs, not to validate a file
    from kvguard.engine.llm_engine import LLMEngine


# Static ceilings: what a rules file can be checked against before the daemon's config is
# known. No engine kvguard runs holds a million sequences in one batch or sixteen million tokens
# in one request, so a value above these is a typo (or a probe), never a setting. The limits of
# the running config (serving.max_num_seqs, max_model_len) are checked when the action applies.
MAX_SEQS = MAX_NUM_SEQS
MAX_TOKENS = 1 << 24
# the OOM chain halts admission only while the device KV cache is still above this share once
# its other steps applied (`rules test` simulates the chain by the scenario's KV usage)
OOM_HALT_ABOVE = 0.98
# the OOM chain's undo switches the KV cache back from FP8 only while usage is below this share
# of the FP8 pool, the margin the default ladder's fp8-kv rung undoes at (its recover_below):
# the live K/V then fill at most 0.4 of a 16-bit pool and 0.8 of an fp32 one
OOM_UNDO_FP8_BELOW = 0.20


class _Params(BaseModel):
    # Strict: `true` is not a count, `"4"` or `4.0` is not an integer and 1e30 is not either;
    # no inf/nan. A remedy's parameters are read once by a person and then acted on unattended.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class NoParams(_Params):
    pass


class ReduceBatch(_Params):
    factor: float = Field(0.5, gt=0.0, le=1.0)
    min: int = Field(1, ge=1, le=MAX_SEQS)


class Evict(_Params):
    count: int = Field(4, ge=1, le=MAX_SEQS)
    max_priority: Literal["high", "normal", "low"] = "low"


class Cap(_Params):
    n: int = Field(256, ge=1, le=MAX_TOKENS)


class Halt(_Params):
    # None (null) halts for every priority. "none" says the same: it is how `kvguard status`,
    # the action's detail and the engine's knob show that halt, so an operator types it back.
    allow_priority: Literal["high", "normal", "low", "none"] | None = "high"

    @field_validator("allow_priority")
    @classmethod
    def _none_is_null(cls, value: str | None) -> str | None:
        """Reads `none` as None, as the engine's `halt_admission` does (the one reading,
        `parse_allow_priority`): one value for a halt for all, in the engine and in a
        remedy's identity (a rule writing `none` or `null` asks for the same)."""
        return parse_allow_priority(value)


class SetSeqs(_Params):
    n: int = Field(..., ge=1, le=MAX_SEQS)


class PoolShare(_Params):
    share: float = Field(0.5, gt=0.0, le=1.0)


class SwitchBack(_Params):
    # switch back only while the device KV usage of the FP8 pool is below this share (None:
    # whenever the live K/V fit): the OOM chain's undo passes its margin when it is split up
    only_below: float | None = Field(None, gt=0.0, le=1.0)


@dataclass(frozen=True, slots=True)
class ActionSpec:
    name: str
    params: type[_Params]
    # (engine, params, clamp) -> Future of ActionResult; `clamp` is run_action's, see there
    run: Callable[[LLMEngine, Any, bool], Future]
    undo: str | None
    doc: str
    # the engine settings it sets (a remedy in force holds them: see SETTINGS below)
    settings: frozenset[str] = frozenset()
    # an undo's params for a setting's own action (SETTINGS) when the evaluator restores that
    # setting alone, because other remedies in force hold some of its settings: `restore_alone`
    alone: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)


class _Derived(Future):
    """The result of actions posted to the engine's mailbox, computed from theirs. Cancelling
    it withdraws them, all or none (`Mailbox.withdraw`): refused once the engine has taken
    one, so that a cancelled action never ran and one that could not be cancelled tells its
    real result. Never set twice: a step withdrawn cancels it, and nothing sets it after."""

    def __init__(self, parts: list[Future], mailbox: Mailbox | None) -> None:
        super().__init__()
        self._parts = parts
        # the mailbox they were posted to; None: one part is cancelled on its own, and several
        # cannot be withdrawn all or none (the cancel is refused)
        self._mailbox = mailbox

    def cancel(self) -> bool:
        if self.done():
            return self.cancelled()
        if self._mailbox is not None:
            withdrawn = self._mailbox.withdraw(self._parts)
        else:
            withdrawn = len(self._parts) == 1 and self._parts[0].cancel()
        # the parts' callbacks have cancelled this one already (`_settle`)
        return withdrawn and (super().cancel() or self.cancelled())

    def _settle(self, compute: Callable[[], ActionResult]) -> None:
        """Its result from the parts, once all are done: cancelled where one was withdrawn."""
        if any(f.cancelled() for f in self._parts):
            Future.cancel(self)
            return
        try:
            result = compute()
        except Exception as exc:  # noqa: BLE001 - the caller gets it through the Future
            self._set(exc)
            return
        self._set(result)

    def _set(self, value: ActionResult | Exception) -> None:
        try:
            if isinstance(value, Exception):
                self.set_exception(value)
            else:
                self.set_result(value)
        except InvalidStateError:  # cancelled meanwhile (its parts withdrawn): stays so
            pass


def _noted(fut: Future, note: Callable[[ActionResult], str | None]) -> Future:
    """`fut` with its result's detail rewritten by `note` (None keeps it); cancelling it
    cancels `fut` (or is refused, once the engine has taken it)."""
    out = _Derived([fut], None)

    def compute() -> ActionResult:
        r = fut.result()
        detail = note(r)
        return r if detail is None else replace(r, detail=detail)

    fut.add_done_callback(lambda _f: out._settle(compute))
    return out


def _configured_kv_dtype(e: LLMEngine, p: SwitchBack, clamp: bool) -> Future:
    """disable_fp8_kv: the KV cache back to serving.kv_cache_dtype, the dtype the operator
    sized the pool for. Where that is fp8_e4m3 there is no full-precision cache to return to
    (a switch to `auto` would leave a quarter of the configured pool's blocks): FP8 stays.
    With `only_below`, the engine refuses it while usage is not below that share."""
    configured = e.config.kv_cache_dtype
    fut = e.set_kv_cache_dtype(configured, only_below=p.only_below)
    if configured != "fp8_e4m3":
        return fut
    return _noted(
        fut,
        lambda r: (
            f"{r.detail}: serving.kv_cache_dtype is fp8_e4m3, so FP8 is the configured "
            "dtype and the KV cache stays FP8"
        ),
    )


def _offload_configured(e: LLMEngine) -> bool:
    # the state the engine started in (offloading.enable_cpu_offload, unless the device pool
    # is under offloading.min_gpu_blocks), where a host pool exists to swap into (none:
    # recompute only)
    return bool(e.configured_offload and e.host_block_manager.num_blocks)


def _configured_offload(e: LLMEngine, p: NoParams, clamp: bool) -> Future:
    """disable_cpu_offload: offload back to its configured state; a daemon configured with
    offloading.enable_cpu_offload keeps swapping."""
    on = _offload_configured(e)
    fut = e.set_offload(on)
    if not on:
        note = _offload_note(e)
        if note is None:
            return fut
        return _noted(fut, lambda r: f"{r.detail}: {note}" if r.ok else None)
    return _noted(
        fut,
        lambda r: (
            f"{r.detail}: offloading.enable_cpu_offload is true, so offload stays on "
            "(its configured state)"
            if r.ok
            else None
        ),
    )


def _offload_note(e: LLMEngine) -> str | None:
    """Why offload is configured off though offloading.enable_cpu_offload is true (the
    engine started recomputing: its device pool is under offloading.min_gpu_blocks)."""
    if not e.config.enable_cpu_offload or e.configured_offload:
        return None
    return (
        f"the device pool started under offloading.min_gpu_blocks={e.config.min_gpu_blocks} "
        "blocks, so offload stays off (its configured state: preempted sequences recompute, "
        "but swap while the KV cache is FP8 and the host pool has room)"
    )


_SPECS = [
    ActionSpec(
        "reduce_batch",
        ReduceBatch,
        lambda e, p, clamp: e.reduce_max_num_seqs(p.factor, p.min),
        "restore_batch",
        "max_num_seqs := min(current, max(`min`, floor(current * `factor`))): never raises it;"
        " excess sequences preempted",
        settings=frozenset({"batch"}),
    ),
    ActionSpec(
        "restore_batch",
        NoParams,
        lambda e, p, clamp: e.set_max_num_seqs(None),
        None,
        "max_num_seqs back to its configured value",
        settings=frozenset({"batch"}),
    ),
    ActionSpec(
        "set_max_num_seqs",
        SetSeqs,
        # a rule's value (`clamp`, see run_action) stays a cut until restore_batch lifts it,
        # even at the configured limit
        lambda e, p, clamp: e.set_max_num_seqs(p.n, clamp=clamp, hold=clamp),
        "restore_batch",
        "set max_num_seqs to `n` (1 <= n <= the configured serving.max_num_seqs)",
        settings=frozenset({"batch"}),
    ),
    ActionSpec(
        "evict_lowest_priority",
        Evict,
        lambda e, p, clamp: e.evict(p.count, p.max_priority),
        None,
        "preempt `count` running sequences of priority <= `max_priority` (swap or recompute)",
    ),
    ActionSpec(
        "enable_fp8_kv",
        NoParams,
        lambda e, p, clamp: e.set_kv_cache_dtype("fp8_e4m3"),
        "disable_fp8_kv",
        "switch the live KV cache to FP8 (about 2-4x the blocks in the same bytes)",
        settings=frozenset({"kv_dtype"}),
    ),
    ActionSpec(
        "disable_fp8_kv",
        SwitchBack,
        _configured_kv_dtype,
        None,
        "switch the KV cache back to its configured serving.kv_cache_dtype: full precision,"
        " or FP8 still where that is fp8_e4m3 (refused while live tokens would not fit, and"
        " with `only_below` while the KV usage of the FP8 pool is not below that share)",
        settings=frozenset({"kv_dtype"}),
    ),
    ActionSpec(
        "shrink_kv_pool",
        PoolShare,
        lambda e, p, clamp: e.set_kv_pool_share(p.share),
        "restore_kv_pool",
        "hold the device KV pool at `share` of its configured bytes and give the rest back "
        "(never below one max_model_len request; sequences that do not fit are preempted)",
        settings=frozenset({"kv_pool"}),
    ),
    ActionSpec(
        "restore_kv_pool",
        NoParams,
        lambda e, p, clamp: e.set_kv_pool_share(1.0),
        None,
        "the device KV pool back to its configured bytes (refused while the memory is not free)",
        settings=frozenset({"kv_pool"}),
    ),
    ActionSpec(
        "enable_cpu_offload",
        NoParams,
        lambda e, p, clamp: e.set_offload(True),
        "disable_cpu_offload",
        "preempt by swapping to the host pool",
        settings=frozenset({"offload"}),
    ),
    ActionSpec(
        "disable_cpu_offload",
        NoParams,
        _configured_offload,
        None,
        "offload back to its configured state: preempt by recompute only, or still by swapping"
        " where offloading.enable_cpu_offload is true",
        settings=frozenset({"offload"}),
    ),
    ActionSpec(
        "cap_max_new_tokens",
        Cap,
        lambda e, p, clamp: e.set_max_new_tokens_cap(p.n, clamp=clamp),
        "uncap_max_new_tokens",
        "cap every request's max_tokens at `n` (1 <= n <= max_model_len; responses say they"
        " were truncated)",
        settings=frozenset({"token_cap"}),
    ),
    ActionSpec(
        "uncap_max_new_tokens",
        NoParams,
        lambda e, p, clamp: e.set_max_new_tokens_cap(None),
        None,
        "remove the max-token cap",
        settings=frozenset({"token_cap"}),
    ),
    ActionSpec(
        "halt_admission",
        Halt,
        lambda e, p, clamp: e.halt_admission(p.allow_priority),
        "resume_admission",
        "refuse new requests (503) except priority `allow_priority` and above (null or"
        " `none`: refuse every priority)",
        settings=frozenset({"admission"}),
    ),
    ActionSpec(
        "resume_admission",
        NoParams,
        lambda e, p, clamp: e.resume_admission(),
        None,
        "accept new requests again",
        settings=frozenset({"admission"}),
    ),
]


def _handle_oom(e: LLMEngine, p: NoParams, clamp: bool) -> Future:
    """The brief's emergency chain after an OOM (seed §6.1), cheapest step first:
    1 halve the batch, 2 evict 4 lowest-priority, 3 swap to host if a pool exists,
    4 FP8 KV, 5 halt admission when the cache is still above 98%: decided by the engine
    when it applies that step, after steps 1-4 (not needed: not applied, and the chain does
    not hold admission)."""
    snap = e.latest_snapshot
    steps = [
        e.reduce_max_num_seqs(0.5, 1, from_running=True),
        e.evict(4, "low"),
    ]
    if snap.host.blocks_total:
        steps.append(e.set_offload(True))
    if snap.kv_cache_dtype != "fp8_e4m3":
        steps.append(e.set_kv_cache_dtype("fp8_e4m3"))
    # never loosening a stricter halt (allowed: none)
    steps.append(e.halt_admission("high", tighten_only=True, only_above=OOM_HALT_ABOVE))
    return _chain("handle_oom", steps, in_force=any, mailbox=e.mailbox)


def _chain(
    name: str, futures: list[Future], in_force: Callable = all, *, mailbox: Mailbox | None = None
) -> Future:
    """One Future for several actions posted together (they apply in order at one boundary).
    Its result is ok when `in_force` of the steps' are: `all` for an undo (one refused step,
    e.g. FP8 that cannot switch back yet, is retried whole), `any` for the OOM chain, which is
    in force, and must be undone, once any step changed the engine. `data["applied"]` names
    the steps that applied; the requests its steps took off the device are under the keys
    their own results name them by (`REQUESTS_MOVED`), so the audit row of the OOM chain
    names them as an eviction's or a batch cut's does. Each is left out where its steps moved
    none. Whether the chain changed nothing is told as any action's is
    (`ActionResult.changed_nothing`): a step's change the knobs do not show is the chain's.
    Cancelling it withdraws every step from `mailbox`, the one they were posted to, or none
    once the engine has taken the first."""
    out = _Derived(futures, mailbox)
    left = [len(futures)]

    def compute() -> ActionResult:
        results = [f.result() for f in futures]
        detail = "; ".join(f"{r.action}: {r.detail}" for r in results)
        data: dict[str, Any] = {
            "steps": [r.action for r in results],
            "applied": [r.action for r in results if r.ok],
        }
        for key in REQUESTS_MOVED:
            moved = [pair for r in results for pair in r.data.get(key, ())]
            if moved:
                data[key] = moved
        ok = in_force(r.ok for r in results)
        beyond = any(r.changed_beyond_knobs for r in results)
        return ActionResult(name, results[0].before, results[-1].after, detail, ok, data, beyond)

    def done(_f: Future) -> None:
        left[0] -= 1  # the steps finish on the engine thread, or are withdrawn under one lock
        if not left[0]:
            out._settle(compute)

    for f in futures:
        f.add_done_callback(done)
    return out


def _recover_from_oom(e: LLMEngine, p: NoParams, clamp: bool) -> Future:
    """Undo the emergency chain once the engine has been quiet: configured batch size, KV
    dtype, offload setting and open admission (the batch token budget restores itself). The
    KV dtype goes back only under `OOM_UNDO_FP8_BELOW` of the FP8 pool, as the fp8-kv rung's
    undo does: switched back whenever the live K/V merely fit, it left the configured pool
    full, and that rung switched FP8 straight back on. Refused, the undo is retried whole
    after the rule's cooldown."""
    return _chain(
        "recover_from_oom",
        [
            e.set_max_num_seqs(None),
            e.set_kv_cache_dtype(e.config.kv_cache_dtype, only_below=OOM_UNDO_FP8_BELOW),
            e.set_offload(_offload_configured(e)),
            e.resume_admission(),
        ],
        mailbox=e.mailbox,
    )


_SPECS.append(
    ActionSpec(
        "handle_oom",
        NoParams,
        _handle_oom,
        "recover_from_oom",
        "the emergency chain: halve batch, evict 4, offload, FP8 KV, halt if > 98%",
        settings=frozenset({"batch", "offload", "kv_dtype", "admission"}),
    )
)
_SPECS.append(
    ActionSpec(
        "recover_from_oom",
        NoParams,
        _recover_from_oom,
        None,
        "undo handle_oom: configured batch, KV dtype and offload; admission open",
        settings=frozenset({"batch", "offload", "kv_dtype", "admission"}),
        # split up (a rung in force holds the batch), the KV dtype keeps the chain's margin
        alone={"kv_dtype": {"only_below": OOM_UNDO_FP8_BELOW}},
    )
)
ACTIONS: dict[str, ActionSpec] = {s.name: s for s in _SPECS}
# Each engine setting remedies set, with the action that puts it back to its configured state
# (the undo-less action that sets it alone). A rule whose remedy is in force holds the
# settings its action set; another rule's undo leaves a held setting alone (that remedy is
# still needed) and restores only the others, each by this action.
SETTINGS = {
    name: spec.name
    for spec in _SPECS
    if spec.undo is None and len(spec.settings) == 1
    for name in spec.settings
}
# a chain's steps, by the engine call that ran each (ActionResult.action), and what each sets
_STEP_SETTINGS = {
    "set_max_num_seqs": "batch",
    "reduce_max_num_seqs": "batch",
    "set_kv_cache_dtype": "kv_dtype",
    "set_kv_pool_share": "kv_pool",
    "set_offload": "offload",
    "set_max_new_tokens_cap": "token_cap",
    "halt_admission": "admission",
    "resume_admission": "admission",
}


def restore_alone(action: str, setting: str) -> tuple[str, dict[str, Any]]:
    """The action (and params) by which `action`, an undo that other remedies in force split
    up, puts `setting` back to its configured state: the setting's own action, with the params
    `action` gives it. The OOM chain's undo switches back from FP8 only under its margin
    whether it runs whole or split; `disable_fp8_kv` run alone (an operator's, a rule's) has
    none."""
    return SETTINGS[setting], dict(ACTIONS[action].alone.get(setting, {}))


def settings_set(action: str, result: ActionResult | None) -> frozenset[str]:
    """The settings `action` set: a chain's, those of the steps that applied (the OOM chain
    halts admission only above 98%); without a result (a dry run), all it may set."""
    steps = (result.data or {}).get("applied") if result is not None else None
    if steps is None:
        return ACTIONS[action].settings
    return frozenset(_STEP_SETTINGS[s] for s in steps if s in _STEP_SETTINGS)


# Remedies in force that hold one setting each ask for a value of it, and the strictest wins:
# the smallest batch (max_num_seqs), KV pool share and token cap, the fewest priorities
# admitted (allowed: none, then high, normal, low). FP8 KV and offload have one value every
# remedy asks for (FP8, swapping): nothing to choose between.
_ADMISSION_ORDER = {None: -1, "high": 0, "normal": 1, "low": 2}
# the action that puts a setting at a value a remedy asked for, and its parameter
SET_TO = {
    "batch": ("set_max_num_seqs", "n"),
    "kv_pool": ("shrink_kv_pool", "share"),
    "token_cap": ("cap_max_new_tokens", "n"),
    "admission": ("halt_admission", "allow_priority"),
}


def strictness(setting: str, value: Any) -> float:
    """Order of the values remedies ask for `setting`: the smaller, the stricter."""
    if setting == "admission":
        return _ADMISSION_ORDER[value]
    if setting in SET_TO:
        return float(value)
    return 0.0  # kv_dtype, offload: one value


def set_to(setting: str, value: Any) -> tuple[str, dict[str, Any]]:
    """The action (and params) that puts `setting` at `value`."""
    action, param = SET_TO[setting]
    return action, {param: value}


def targets(action: str, params: dict[str, Any] | None) -> dict[str, Any]:
    """The values `action` sets whatever the engine's state, by setting: those that may
    loosen what another remedy holds (reduce_batch never raises the batch, and the OOM
    chain's halt never loosens a stricter one; FP8 and offload have one value)."""
    p = parse_params(action, params)
    if action == "set_max_num_seqs":
        return {"batch": p.n}
    if action == "shrink_kv_pool":
        return {"kv_pool": p.share}
    if action == "cap_max_new_tokens":
        return {"token_cap": p.n}
    if action == "halt_admission":
        return {"admission": p.allow_priority}
    return {}


def asked(action: str, params: dict[str, Any] | None, result: ActionResult | None) -> dict:
    """What a remedy in force asks of each setting it holds: the value it set (the engine's
    after its action, a relative reduction's included), or where it set none (a dry run, an
    action held back: `targets`) the value its params name. A setting whose value cannot be
    told (a dry run's reduce_batch) is left out. The batch `set_max_num_seqs` asks for is its
    `n` whatever was in force after it: a configured limit reloaded below `n` holds the batch
    lower only until a reload raises it again, and another rule's undo that restores the batch
    to what this one asks must not leave it at that lower value."""
    after = (result.after or {}) if result is not None else {}
    out: dict[str, Any] = dict(targets(action, params))
    held = settings_set(action, result)
    if "batch" in held and "batch" not in out and isinstance(after.get("max_num_seqs"), int):
        out["batch"] = after["max_num_seqs"]
    if "token_cap" in held and isinstance(after.get("max_new_tokens_cap"), int):
        out["token_cap"] = after["max_new_tokens_cap"]
    if "admission" in held and action == "handle_oom":
        out["admission"] = "high"
    if "kv_dtype" in held:
        out["kv_dtype"] = "fp8_e4m3"
    if "offload" in held:
        out["offload"] = True
    return {s: v for s, v in out.items() if s in held}


class ActionWithdrawn(RuntimeError):
    """The engine did not take an action within the wait (or before the daemon began to
    stop, `stopped`): it was withdrawn from the mailbox before it ran, and changed nothing."""

    def __init__(self, name: str, waited_s: float, stopped: bool = False) -> None:
        why = (
            f"the daemon began to stop while it waited for the engine to take {name}"
            if stopped
            else f"the engine did not take {name} within {waited_s:g}s (a long step or a "
            "stalled engine thread)"
        )
        super().__init__(f"withdrawn before it ran: {why}; nothing changed")
        self.stopped = stopped


class ActionStillApplying(RuntimeError):
    """The engine took an action but had not finished it by the end of the wait (or when the
    daemon began to stop, `stopped`): it may still apply. `future` answers its result when it
    does."""

    def __init__(self, message: str, future: Future, stopped: bool = False) -> None:
        super().__init__(message)
        self.future = future
        self.stopped = stopped


class StopSignal:
    """Set once when the daemon stops: every wait on the engine given it (`await_action`,
    `wait_or_stop`) returns at once from then on, so that a stop never waits out an action
    or a reload the engine is stuck on (up to twice their timeouts)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._wakes: set[threading.Event] = set()

    def set(self) -> None:
        with self._lock:
            self._set = True
            wakes = list(self._wakes)
        for wake in wakes:
            wake.set()

    def is_set(self) -> bool:
        return self._set

    @contextlib.contextmanager
    def waker(self) -> Iterator[threading.Event]:
        """An event set at the stop (already set if the stop came first): a wait on it that
        something else sets too gives way to the stop."""
        wake = threading.Event()
        with self._lock:
            if self._set:
                wake.set()
            self._wakes.add(wake)
        try:
            yield wake
        finally:
            with self._lock:
                self._wakes.discard(wake)


def wait_or_stop(fut: Future, timeout_s: float, stop: StopSignal | None = None) -> bool:
    """Wait up to `timeout_s` for `fut`, or until `stop` is set; True if `fut` is done."""
    if stop is None:
        return bool(wait([fut], timeout=timeout_s).done)
    with stop.waker() as wake:
        fut.add_done_callback(lambda _f: wake.set())
        wake.wait(timeout_s)
    return fut.done()


def await_action(
    fut: Future, name: str, timeout_s: float, stop: StopSignal | None = None
) -> ActionResult:
    """The result of posted action `name`, waiting `timeout_s` for the engine to take it.

    Not taken by then, it is withdrawn (ActionWithdrawn): it never runs, so a caller that
    records a failure tells the truth. Taken (the engine is applying it: it cannot be
    withdrawn), its real result is waited for up to `timeout_s` more; an engine still inside
    it then is stuck in the action itself (the engine loop's watchdog ends such a daemon), and
    the caller gets ActionStillApplying with the Future, not a blocked thread. `stop` set (the
    daemon stops) ends either wait at once, the same way, the exception's `stopped` True."""
    if wait_or_stop(fut, timeout_s, stop):
        return fut.result()
    stopped = stop is not None and stop.is_set()
    if fut.cancel():
        raise ActionWithdrawn(name, timeout_s, stopped=stopped)
    if wait_or_stop(fut, timeout_s, stop):  # at once where the stop came
        return fut.result()
    if stop is not None and stop.is_set():
        raise ActionStillApplying(
            f"the daemon began to stop while the engine was still applying {name}: it may "
            "still apply; not waited for",
            fut,
            stopped=True,
        )
    raise ActionStillApplying(
        f"the engine took {name} but had not finished it {timeout_s:g}s later: it may still "
        "apply; its outcome is recorded when it does",
        fut,
    )


class ActionError(ValueError):
    """Unknown action or bad params; the message names which and what was expected, and
    `param` the parameter at fault (None for the action itself), for an API's error field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_params(name: str, params: dict[str, Any] | None) -> _Params:
    """Check params against the action's static bounds (types, ranges, names): what a rules
    file can be checked for without the daemon's config."""
    spec = ACTIONS.get(name)
    if spec is None:
        raise ActionError(f"unknown action {name!r}: expected one of {', '.join(sorted(ACTIONS))}")
    if params is not None and not isinstance(params, dict):
        raise ActionError(
            f"action {name!r} params: expected a mapping of parameter names to values, "
            f"got {_shown(params)}",
            "params",
        )
    try:
        return spec.params(**(params or {}))
    except ValidationError as e:
        errors = e.errors()
        known = ", ".join(spec.params.model_fields) or "none"
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'params'}: "
            + (
                f"unknown parameter (expected: {known})"
                if err["type"] == "extra_forbidden"
                else f"{err['msg']} (got {_shown(err['input'])})"
            )
            for err in errors
        )
        first = ".".join(map(str, errors[0]["loc"])) if errors else ""
        raise ActionError(f"action {name!r} params: {problems}", first or "params") from e


def run_action(
    engine: LLMEngine, name: str, params: dict[str, Any] | None = None, *, clamp: bool = False
) -> Future:
    """Validate and post `name` to the engine; the Future answers its ActionResult.

    Static bounds are checked here; the running config's limits (serving.max_num_seqs,
    max_model_len) by the engine. Above those, an operator's request (`clamp` False, the admin
    API) is refused with ActionError naming the parameter and the limit, so a 400 tells them at
    once; a rule's (`clamp` True) is held to the limit and the result's detail says so, because
    one rules file serves daemons of different sizes and a remedy held to the limit still
    helps, where a refused one would leave the pressure in place. A rule's batch limit stays
    a cut until restore_batch, even at the configured value (a reload raising that must not
    lift it); an operator's at the configured value puts the batch back to it.
    """
    parsed = parse_params(name, params)
    try:
        return ACTIONS[name].run(engine, parsed, clamp)
    except ValueError as e:  # the control surface validates its arguments before posting
        raise ActionError(f"action {name!r} params: {e}", getattr(e, "param", None)) from e
