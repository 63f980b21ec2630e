"""The actions rules may take on a live engine (DESIGN "Control surface").

Public methods validate their arguments at once (ValueError in the caller's thread), then post
the work to the mailbox and return a Future of `ActionResult`; the engine thread applies it at
the next step boundary. Calling `step()` (or running an `EngineLoop`) is what applies them.
After `shutdown()` no step comes: the Future has already failed with EngineShutDown.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import typing
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvguard.engine.admission import AdmissionConfig
from kvguard.engine.config import LIVE_KNOBS, EngineConfig, parse_bytes
from kvguard.engine.control import ActionResult
from kvguard.engine.detokenizer import finish_text
from kvguard.engine.distributed.errors import PoolTorn
from kvguard.engine.knobs import ConfigError, KnobField, KnobPath, knob_fields
from kvguard.engine.kv_cache import KV_TORCH_DTYPES, is_oom, kv_dtype_name
from kvguard.engine.model_runner import CUDA_GROW_MARGIN, HOST_GROW_BELOW
from kvguard.engine.plural import counted
from kvguard.engine.priority import (
    ALLOW_NONE,
    PRIORITIES,
    PRIORITY_NAMES,
    parse_allow_priority,
    parse_priority,
)
from kvguard.engine.sequence import Status

if TYPE_CHECKING:
    from kvguard.engine.llm_engine import LLMEngine


class ParamError(ValueError):
    """An action's argument is out of bounds or of the wrong type; `param` names it, so an API
    can answer which field to fix."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_count(param: str, value: Any, lo: int, hi: int | None) -> int:
    """A whole number lo <= value (<= hi). Booleans are refused although Python counts them as
    ints (`True` sequences is a typo, not 1), and so are floats, even whole ones: 1e30 is not
    a count anyone meant."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(param, f"{param}={value!r}: expected an integer")
    if value < lo or (hi is not None and value > hi):
        bounds = f"{lo} <= {param}" + (f" <= {hi}" if hi is not None else "")
        raise ParamError(param, f"{param}={value}: expected {bounds}")
    return value


def bounded_count(n: Any, limit: int, limit_name: str, clamp: bool) -> tuple[int, str]:
    """`n` (parameter `n`) as a count 1 <= n <= limit. Above the limit: ParamError, or with
    `clamp` (rules, whose one file serves daemons of different sizes) the limit itself and a
    note for the action's detail."""
    n = check_count("n", n, 1, None)
    if n <= limit:
        return n, ""
    name = limit_name.rsplit(" ", 1)[-1]
    if not clamp:
        raise ParamError("n", f"n={n} is above {limit_name}={limit}: expected 1 <= n <= {limit}")
    return limit, f" (asked {n}, clamped to {name}={limit})"


def check_ratio(param: str, value: Any) -> float:
    """A finite number in (0, 1]: the share of something to keep."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(param, f"{param}={value!r}: expected a number in (0, 1]")
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ParamError(param, f"{param}={value}: expected a number in (0, 1]")
    return float(value)


# every knob by its engine path and by its config-file name (section, key): what
# `reconfigure` may be handed, by a Python caller who read either the engine or the file; the
# live knobs' declarations, by path, check a reload's values
ENGINE_FIELDS: dict[KnobPath, KnobField] = {k.path: k for k in knob_fields(EngineConfig)}
FILE_FIELDS: dict[KnobPath, KnobField] = {
    (k.knob.section, k.file_key): k for k in ENGINE_FIELDS.values()
}
LIVE_FIELDS: dict[KnobPath, KnobField] = {p: k for p, k in ENGINE_FIELDS.items() if p in LIVE_KNOBS}


def live_knob(key: KnobPath | str, value: Any) -> tuple[KnobPath, Any]:
    """A `reconfigure` key as the engine path of a live knob, and its value in the engine's
    unit. The key is the engine's path (("admission", "safety_factor")) or the config file's
    (("admission_control", "safety_factor")), as a tuple or written with dots; a file key in
    another unit than the engine's (reserved_headroom_mb) takes the file's unit. ValueError
    names a knob that changes only at a restart, and one that does not exist."""
    path = tuple(key.split(".")) if isinstance(key, str) else tuple(key)
    field = ENGINE_FIELDS.get(path)
    name = ".".join(map(str, path))
    if field is None and (field := FILE_FIELDS.get(path)) is not None:
        if field.knob.kind == "duration" and isinstance(value, str):  # the daemon parses those
            raise ConfigError(f"{name}={value!r}: expected a number of seconds")
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = field.to_engine(value)  # a bool stays one, for the declaration to refuse
    if field is None:
        live = ", ".join(sorted(".".join(p) for p in LIVE_KNOBS))
        raise ValueError(f"{name}: no such knob (the live ones: {live})")
    if field.path not in LIVE_KNOBS:
        raise ValueError(f"{name}: takes effect at a restart, not a reload")
    return field.path, value


def check_live_knob(field: KnobField, value: Any) -> Any:
    """A reload's value for one live knob, checked against its declaration (type, bounds)
    in the caller's thread, as a config file's values are: ConfigError (a ValueError) names
    the knob and what it takes. A size may be written '256MiB'; it is returned in bytes."""
    name = ".".join(field.path)
    if field.knob.kind == "size" and value is not None:
        value = parse_bytes(value, name)
    types_ = set(typing.get_args(field.type)) or {field.type}
    if value is None and type(None) in types_:
        return value
    if bool in types_:
        ok, kind = isinstance(value, bool), "a bool"
    elif int in types_ and float not in types_:
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:
        ok, kind = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    if ok and field.knob.accepts(value):
        return value
    expected = field.knob.expected()
    if expected.startswith("a value "):
        expected = f"{kind} {expected.removeprefix('a value ')}"
    elif expected == "any value":
        expected = kind
    if type(None) in types_:
        expected += ", or None"
    raise ConfigError(f"{name}={value!r}: expected {expected}")


def allowed_name(rank: int | None) -> str | None:
    """Admission knob as text: None (open), 'none' (halted for all), or the best priority allowed."""
    if rank is None:
        return None
    return PRIORITY_NAMES.get(rank, ALLOW_NONE)


class ControlSurface:
    """Mixed into LLMEngine; `self` is the engine."""

    def knobs(self: LLMEngine) -> dict[str, object]:
        return {
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "kv_cache_dtype": self.kv_cache.dtype,
            "kv_pool_blocks": self.block_manager.num_blocks,
            "offload": self.scheduler.offload,
            "max_new_tokens_cap": self.max_new_tokens_cap,
            "admission_allow_priority": allowed_name(self.allow_rank),
        }

    def _remedy_records(self: LLMEngine) -> tuple[object, ...]:
        """What remedies hold that the knobs do not show, for an action's result to say it
        changed (`ActionResult.changed_beyond_knobs`): the batch limit and step budget a cut
        holds, which a reload's configured value does not lift, and the pool share the next
        dtype switch sizes its pool by. A `restore_batch` at a limit a reload had lowered to
        the cut lifts the cut with every knob as it was, and is no action that changed
        nothing."""
        return (self.batch_cut, self.budget_cut, self.kv_pool_share)

    def _act(self: LLMEngine, name: str, fn) -> Future:  # noqa: ANN001 - () -> (detail, ok, data)
        def run() -> ActionResult:
            before, records = self.knobs(), self._remedy_records()
            try:
                detail, ok, data = fn()
            except PoolTorn as e:  # the engine cannot go on: its next step says so (fatal)
                self.torn = e
                raise
            after = self.knobs()
            # what it changed is published before its Future resolves (the step's own snapshot
            # comes only after the step): a rule evaluation that follows the action at once,
            # as the daemon's does after an event's, reads the engine with it applied
            self.latest_snapshot = self.snapshot()
            if before != after:
                changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
                self.events.emit("knob_changed", action=name, changes=changed)
            beyond = self._remedy_records() != records
            return ActionResult(name, before, after, detail, ok, data, beyond)

        return self._post(run)

    # -- batch size -------------------------------------------------------------------------
    def set_max_num_seqs(
        self: LLMEngine, n: int | None, *, clamp: bool = False, hold: bool = False
    ) -> Future:
        """Set the batch limit, never above the configured one (serving.max_num_seqs): a remedy
        may cut the batch and restore it, but raising it past what the operator sized the
        server for would make things worse. Above that limit it raises ValueError, or with
        `clamp` (rules) sets the limit itself and says so in the result's detail. None: back
        to the configured limit as it is when the engine applies it (`restore_batch`), which
        lifts the cut (a value read on the caller's thread could be a reload behind). `hold`
        (what a rule in force asks for): `n` stays the cut until it is lifted, even equal to
        the configured limit, so a reload raising that limit leaves the batch at `n`; without
        it, the configured value itself lifts the cut (an operator's "back to configured")."""
        asked = n
        note = ""
        if n is not None:
            n, note = bounded_count(
                n, self.config.max_num_seqs, "the configured maximum serving.max_num_seqs", clamp
            )

        def apply() -> tuple[str, bool, dict]:
            # None, or the configured value itself unless held, lifts the cut; a value clamped
            # to the configured limit holds what was asked, should a reload raise the limit
            lifted = asked is None or (not hold and not note and asked >= self.config.max_num_seqs)
            was = self.scheduler.max_num_seqs
            limit, moved = self._cut_batch(None if lifted else asked)
            same = " (unchanged)" if limit == was else ""
            preempted = counted(len(moved), "running sequence")
            return (
                f"max_num_seqs={limit}{same}{note}; {preempted} preempted",
                True,
                {"preempted": moved},
            )

        return self._act("set_max_num_seqs", apply)

    def reduce_max_num_seqs(
        self: LLMEngine, factor: float, minimum: int = 1, *, from_running: bool = False
    ) -> Future:
        """Cut the batch limit to min(current, max(minimum, floor(base * factor))), where base
        is the current limit, or (`from_running`, the OOM chain) the batch an out-of-memory
        step ran since the last such cut (else the sequences running now) when fewer: the
        chain applies a few steps after the failure, and however many of them the scheduler
        has taken back by then, or admitted since, the cut is of the batch that failed.
        Computed on the engine thread when applied, from the live value, so a reduction never
        raises the limit: not with a large `minimum`, nor after another action lowered it
        while this one waited in the mailbox."""
        factor = check_ratio("factor", factor)
        minimum = check_count("min", minimum, 1, None)

        def apply() -> tuple[str, bool, dict]:
            current = self.scheduler.max_num_seqs
            base = current
            if from_running:
                base = min(current, max(self.scheduler.oom_cut_base(), 1))
                self.scheduler.oom_batch = 0  # a later out-of-memory step's cut: its own batch
            n = min(current, max(minimum, math.floor(base * factor)))
            _, moved = self._cut_batch(n)
            why = ""
            if minimum > current:
                why = f" (unchanged: min={minimum} is above it, and a reduction never raises it)"
            elif n == current:
                why = " (unchanged)"
            preempted = counted(len(moved), "running sequence")
            return (
                f"max_num_seqs {current} -> {n}{why}; {preempted} preempted",
                True,
                {"preempted": moved},
            )

        return self._act("reduce_max_num_seqs", apply)

    def _cut_batch(self: LLMEngine, cut: int | None) -> tuple[int, list[tuple[str, str]]]:
        """Hold the batch at `cut` (`_hold_batch`) and preempt the running sequences over the
        limit: the limit in force and the sequences preempted. A preemption that raises (a
        bug) puts the limit and the cut as they were before the error goes on, so the action
        recorded `failed` leaves no cut in force (what it preempted before stays preempted,
        queued: nothing is lost)."""
        was = self.batch_cut, self.scheduler.max_num_seqs
        limit = self._hold_batch(cut)
        try:
            return limit, self.scheduler.shrink_running(limit)
        except BaseException:
            self.batch_cut, self.scheduler.max_num_seqs = was
            raise

    def _hold_batch(self: LLMEngine, cut: int | None) -> int:
        """Record the batch limit a remedy holds (None: none) and put the limit in force at
        the configured one, or the remedy's where lower; returns it. The record, not the
        value in force, says a cut holds: a reload that set the configured value at or below
        the cut would otherwise make them equal and the next reload lift it."""
        self.batch_cut = cut
        limit = self.config.max_num_seqs if cut is None else min(self.config.max_num_seqs, cut)
        self.scheduler.max_num_seqs = limit
        return limit

    def _hold_step_budget(self: LLMEngine, cut: int | None) -> int:
        """Record the step budget an out-of-memory halving holds (None: none) and put the
        budget in force at the configured one, or the halved one where lower; returns it.
        Prefill goes in chunks while the budget in force is below the configured one (which
        without chunking holds the longest prompt), and as configured once it is back."""
        self.budget_cut = cut
        configured = self.configured_batched_tokens
        budget = configured if cut is None else min(configured, cut)
        self.scheduler.max_num_batched_tokens = budget
        self.scheduler.chunked = self.config.enable_chunked_prefill or budget < configured
        return budget

    # -- eviction ---------------------------------------------------------------------------
    def evict(self: LLMEngine, count: int, max_priority: str = "low") -> Future:
        """Preempt up to `count` running sequences no more important than `max_priority`,
        lowest priority and newest first; they come back once usage has eased."""
        count = check_count("count", count, 1, None)  # more than are running: all that qualify
        rank = parse_priority(max_priority)

        def apply():
            moved = self.scheduler.evict(count, rank)
            return (
                f"evicted {counted(len(moved), 'sequence')} of priority <= {max_priority}",
                True,
                {"evicted": moved},
            )

        return self._act("evict", apply)

    # -- KV dtype ---------------------------------------------------------------------------
    def set_kv_cache_dtype(
        self: LLMEngine, dtype: str, *, only_below: float | None = None
    ) -> Future:
        """Switch the live KV cache to `dtype`; refused while the live K/V would not fit its
        pool. With `only_below` (the OOM chain's undo) only while the device KV cache's usage
        is below it when the engine applies the switch, else refused too: a switch back from
        FP8 that merely fits can leave the full-precision pool full (measured: all of it), so
        the next steps preempt and a rule on KV usage switches FP8 straight back on, the live
        K/V converted twice more."""
        if dtype not in (*KV_TORCH_DTYPES, "auto"):
            raise ValueError(
                f"kv_cache_dtype={dtype!r}: expected one of auto, {', '.join(KV_TORCH_DTYPES)}"
            )
        if only_below is not None:
            only_below = check_ratio("only_below", only_below)
        return self._act("set_kv_cache_dtype", lambda: self._switch_kv_dtype(dtype, only_below))

    def _switch_kv_dtype(
        self: LLMEngine, dtype: str, only_below: float | None = None
    ) -> tuple[str, bool, dict]:
        dtype = kv_dtype_name(dtype, self.runner.dtype)
        old = self.kv_cache.dtype
        if dtype == old:
            return f"KV cache already {dtype}", True, {}
        if only_below is not None and (crowded := self._too_full_to_switch(dtype, only_below)):
            return crowded, False, {}
        new_n = self.pool_blocks(dtype)
        new_host = self.runner.blocks_for_budget(dtype, host=True)
        bm, hbm = self.block_manager, self.host_block_manager
        if bm.num_used > new_n or hbm.num_used > new_host:
            return (
                f"refused: live KV needs {bm.num_used} device / {hbm.num_used} host blocks but a {dtype} "
                f"pool of the same bytes holds {new_n} / {new_host}; retry when usage is lower",
                False,
                {},
            )
        need, rid = self._longest_need()
        if need > new_n:
            return (
                f"refused: request {rid} may grow to {need} blocks (it was admitted against the "
                f"{old} pool of {bm.num_blocks}) but a {dtype} pool of the same bytes holds "
                f"{new_n}; retry when it has finished",
                False,
                {},
            )
        if not self.runner.can_convert(dtype, new_n):
            return (
                f"refused: a rank has no device memory for the {dtype} pool beside the {old} one",
                False,
                {},
            )
        t0 = time.perf_counter()
        live_bytes = bm.num_used * self.kv_cache.bytes_per_block
        old_n = bm.num_blocks
        kept = self._bookkeeping()
        moves, host_moves = bm.resize(new_n), hbm.resize(new_host)
        for seq in self.scheduler.live():
            seq.kv_converted = seq.kv_converted or seq.num_computed_tokens > 0
        self.admission_policy.seal_converted_groups()  # their blocks are shared no more
        self.scheduler.remap(moves)
        self.scheduler.remap(host_moves, host=True)
        try:
            extra = self.runner.convert_kv(
                dtype, {"device": (new_n, moves), "host": (new_host, host_moves)}
            )
        except Exception as e:  # noqa: BLE001 - the pool is put back whatever failed
            return self._conversion_failed(kept, f"a {dtype} pool", e, cached=set())
        self.kv_cache.last_switch_peak_extra_bytes = extra
        if self.admission is not None:  # before the lengths: the budget's headroom in blocks
            self.admission.bytes_per_block = self.kv_cache.bytes_per_block
        self._bound_lengths()
        pause = time.perf_counter() - t0
        data = {
            "from": old,
            "to": dtype,
            "blocks_before": old_n,
            "blocks_after": new_n,
            "pause_s": pause,
            "live_bytes": live_bytes,
            "peak_extra_bytes": extra,
        }
        self.events.emit("kv_dtype_switched", **data)
        return (
            f"KV cache {old} -> {dtype}: {old_n} -> {new_n} blocks in {pause * 1e3:.1f} ms",
            True,
            data,
        )

    def _too_full_to_switch(self: LLMEngine, dtype: str, only_below: float) -> str | None:
        """Why a switch to `dtype` allowed only below a usage of `only_below` must wait (None:
        it need not): the live device blocks fill that much of the pool in force or more."""
        bm = self.block_manager
        usage = bm.num_used / bm.num_blocks if bm.num_blocks else 0.0
        if usage < only_below:
            return None
        after = bm.num_used / max(self.pool_blocks(dtype), 1)
        return (
            f"refused: the live KV fills {usage:.0%} of the {self.kv_cache.dtype} pool "
            f"({bm.num_used} of {bm.num_blocks} blocks), and this switch waits for under "
            f"{only_below:.0%} (it would fill {after:.0%} of a {dtype} pool); retry when usage "
            "is lower"
        )

    def _bookkeeping(self: LLMEngine) -> Callable[[], None]:
        """What a pool conversion changes before it converts (both tiers' block managers,
        every live sequence's block tables), kept: the returned call puts it back."""
        managers = [(bm, {k: copy.copy(v) for k, v in vars(bm).items()})
                    for bm in (self.block_manager, self.host_block_manager)]  # fmt: skip
        tables = [(s, list(s.block_table), list(s.host_block_table)) for s in self.scheduler.live()]

        def restore() -> None:
            for bm, state in managers:
                vars(bm).update(state)
            for s, device, host in tables:
                s.block_table, s.host_block_table = device, host

        return restore

    def _conversion_failed(
        self: LLMEngine,
        restore: Callable[[], None],
        what: str,
        error: BaseException,
        cached: set[int],
    ) -> tuple[str, bool, dict]:
        """A pool conversion failed (out of memory, most likely: it runs under pressure) and
        put the pool back (KVCache.convert): its bookkeeping goes back too, and the action is
        refused. Only the blocks it moved were put back, and a dtype switch's only through
        the new dtype, so the prefix cache keeps only `cached` (a resize's moved blocks:
        their bytes as they were). A pool it could not put back (PoolTorn), or one of several
        ranks' (the others may have converted): the engine cannot go on (systemd restarts the
        daemon)."""
        if isinstance(error, PoolTorn):
            raise error
        if self.config.world_size > 1:
            raise PoolTorn(f"rank 0 could not build {what} ({error}); the other ranks may have")
        restore()
        self.block_manager.retire_cache(cached)
        self.host_block_manager.retire_cache(set())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        kind = "out of memory" if is_oom(error) else type(error).__name__
        return (
            f"refused: {what} could not be built ({kind}: {error}); the pool is as it was",
            False,
            {},
        )

    # -- KV pool size -----------------------------------------------------------------------
    def set_kv_pool_share(self: LLMEngine, share: float) -> Future:
        """Hold the device KV pool at `share` of its configured bytes (1: all of them), in
        the live KV dtype, without a restart: memory goes back to the host or the GPU's other
        tenants under pressure, and returns when the pressure is gone. The pool never shrinks
        below one longest request (max_model_len), so every admitted request can still finish;
        running sequences whose blocks do not fit are preempted first (lowest priority, newest
        first; swapped or recomputed, never dropped) and readmitted once usage eases."""
        share = check_ratio("share", share)
        return self._act("set_kv_pool_share", lambda: self._resize_pool(share))

    def _resize_pool(self: LLMEngine, share: float) -> tuple[str, bool, dict]:
        dtype = self.kv_cache.dtype
        full = self.runner.blocks_for_budget(dtype)
        bm = self.block_manager
        floor_n = min(full, bm.blocks_for(self.max_model_len))
        want = max(1, math.floor(full * share))
        new_n, old_n = max(floor_n, want), bm.num_blocks
        note = ""
        if want < floor_n:
            note = (
                f" (held at {new_n} blocks: one request of max_model_len={self.max_model_len} "
                "tokens must still fit)"
            )
        if new_n == old_n:
            self.kv_pool_share = share
            return f"KV pool already {old_n} blocks{note}", True, {"blocks": old_n}
        # what the grown pool takes: all its bytes less what the old one holds in memory
        grow = self.kv_cache.grow_bytes(self.kv_cache.device_pool, new_n) if new_n > old_n else 0
        if grow > 0 and not (self.runner.can_grow(grow) and self.runner.can_convert(dtype, new_n)):
            return (
                f"refused: no room for {grow / 2**20:.0f} MiB more KV without pressing memory "
                f"(host memory kept under {HOST_GROW_BELOW:.0%}, on CUDA "
                f"{CUDA_GROW_MARGIN:.0%} of the device free); retry when memory is free",
                False,
                {},
            )
        moved = []
        while bm.num_used > new_n:
            victim = self.scheduler.pick_victim()
            if victim is None:
                break
            moved.append((victim.request_id, self.scheduler.preempt(victim)))
            victim.held = True  # back once usage has eased, as an eviction's
        if bm.num_used > new_n:
            return (
                f"refused: {bm.num_used} blocks in use do not fit {new_n}",
                False,
                {"preempted": moved},
            )
        t0 = time.perf_counter()
        kept = self._bookkeeping()
        moves = bm.resize(new_n, keep_cache=True)  # same dtype: cached K/V stay valid
        self.scheduler.remap(moves)
        try:
            self.runner.convert_kv(dtype, {"device": (new_n, moves)})
        except Exception as e:  # noqa: BLE001 - the pool is put back whatever failed
            return self._conversion_failed(kept, f"a pool of {new_n} blocks", e, set(moves))
        # the share asked for, not the one the floor made of it: a later dtype switch sizes
        # its pool from it (`pool_blocks`), and a share floored once and again loses blocks
        self.kv_pool_share = share
        self._bound_lengths()
        pause = time.perf_counter() - t0
        data = {
            "blocks_before": old_n,
            "blocks_after": new_n,
            "share": round(new_n / full, 4),
            "bytes_after": new_n * self.kv_cache.bytes_per_block,
            "preempted": moved,
            "pause_s": pause,
        }
        self.events.emit("kv_pool_resized", **data)
        return (
            f"KV pool {old_n} -> {new_n} blocks ({new_n / full:.0%} of configured){note}; "
            f"{counted(len(moved), 'running sequence')} preempted; {pause * 1e3:.1f} ms",
            True,
            data,
        )

    # -- configuration ----------------------------------------------------------------------
    def reconfigure(self: LLMEngine, values: dict[KnobPath | str, Any]) -> Future:
        """Apply knobs a reload changed, those declared `live`, at the next step boundary.
        A knob is named by its engine path or its config file's name (`live_knob`). The
        configured batch limit and step budget are what a remedy's undo restores; while a
        remedy holds one lower (a batch cut, an out-of-memory halving) the lower of the two is
        in force, whatever reloads come and go before the undo. A knob that is not live or
        does not exist (a ValueError) or a value its declaration refuses (ConfigError, naming
        the knob and what it takes) raises here, in the caller's thread, and nothing is
        posted. Refused at the
        step boundary (a KV budget a request in flight could outgrow, or one the pool cannot
        grow to), a reconfigure changes nothing: no knob, no admission setting, no budget."""
        given = [live_knob(k, v) for k, v in values.items()]
        if len({p for p, _ in given}) < len(given):  # e.g. "max_num_seqs" and its file name
            raise ValueError(f"a knob given twice: {', '.join(map(str, values))}")
        # each value against its knob's declaration, before anything is posted: a batch limit
        # of 0 or a step budget below 1 would leave every request waiting for ever
        values = {p: check_live_knob(LIVE_FIELDS[p], v) for p, v in given}
        inner = {p[1]: v for p, v in values.items() if p[0] == "admission"}
        # built (and so bounds-checked) now, in the caller's thread: AdmissionConfig's own check
        admission = (
            dataclasses.replace(self.config.admission or AdmissionConfig(), **inner)
            if inner
            else None
        )

        def apply() -> tuple[str, bool, dict]:
            if (budget := values.get(("kv_cache_bytes",))) is not None:
                problem = self._budget_problem(int(budget))
                if problem:  # nothing applied: a reload is all or nothing
                    return f"refused: {problem}", False, {}
            if (tokens := values.get(("max_num_batched_tokens",))) is not None:
                problem = self._step_budget_problem(int(tokens))
                if problem:
                    return f"refused: {problem}", False, {}
            said, undo_admission = [], None
            if admission is not None:
                undo_admission = self._take_admission(admission)
                said += [f"admission_control.{k}={v}" for k, v in inner.items()]
            if budget is not None:
                # the one knob that may still be refused as it applies (no room to grow the
                # pool, a pool that cannot be built): taken before every other, and on a
                # refusal the admission config is put back, so a refused reload changes nothing
                detail, done = self._set_kv_budget(budget)
                if not done:
                    if undo_admission is not None:
                        undo_admission()
                    return f"refused: {detail}; nothing of the reload applied", False, {}
                said.append(detail)
            for path, value in values.items():
                if path[0] != "admission" and path != ("kv_cache_bytes",):
                    said.append(self._set_knob(path[0], value))
            changed = {".".join(p): v for p, v in values.items()}
            return "; ".join(said), True, {"changed": changed}

        return self._act("reconfigure", apply)

    def _budget_problem(self: LLMEngine, budget: int) -> str | None:
        """Why a CPU KV budget of `budget` bytes cannot be taken now: it must hold a block,
        and every request in flight must still be able to grow to its length limit (it was
        admitted against the pool it found). Unused (CUDA, serving.num_gpu_blocks): none."""
        if self.runner.device.type != "cpu" or self.config.num_gpu_blocks:
            return None
        per_block = self.kv_cache.bytes_per_block
        blocks = budget // per_block
        if blocks < 1:  # as a start says it: no request could ever run, whatever is in flight
            return (
                f"kv_cache_bytes={budget} holds no block of {per_block} bytes: raise kv_cache_bytes"
            )
        need = max(self._longest_need()[0], 1)
        if blocks < need:
            return (
                f"kv_cache_bytes={budget} holds {blocks} blocks and requests in flight may "
                f"grow to {need}; lower it when they have finished"
            )
        return None

    def _step_budget_problem(self: LLMEngine, tokens: int) -> str | None:
        """Why a configured step budget of `tokens` cannot be taken: without chunked prefill
        (a restart-only knob) one step holds a whole prompt, so the budget must hold the
        longest the running max_model_len lets in, or such a prompt would wait at the head of
        the queue for ever. (An OOM's halved budget turns chunking on until it is restored to
        the configured one, so it never meets this.)"""
        if self.config.enable_chunked_prefill or tokens >= self.max_model_len:
            return None
        return (
            f"max_num_batched_tokens={tokens} < max_model_len={self.max_model_len} in force "
            "with enable_chunked_prefill off: a longer prompt could never be scheduled "
            "(max_model_len and enable_chunked_prefill change only at a restart)"
        )

    def _bound_lengths(self: LLMEngine) -> None:
        """The pool just changed size (a dtype switch, a share, a reload's kv_cache_bytes).
        A smaller one was taken because every request in flight fits it within its length
        limit and max_tokens as they are now: from here on the pool also bounds each one's
        length limit, as it bounds a request admitted against it (`max_total_len`). A cap
        lifted later gives a request its own max_tokens back, not a length the pool can never
        hold: that one would fill the pool, preempt itself and never fit again, and every
        request queued behind it would wait for ever.

        A larger pool gives back what a smaller one took: the length limit, as a request
        admitted now gets it, and the max_tokens admission shortened to fit the smaller
        configured pool, up to what admission would give now within the budget beside the
        other commitments (`AdmissionPolicy.regrow`, which re-reserves the longer answer's
        peak), a live cap still applying on top."""
        limit = self.max_total_len()
        configured = self.runner.blocks_for_budget(self.kv_cache.dtype)
        capacity = self.block_manager.num_blocks
        for s in sorted(self.scheduler.live(), key=lambda s: (s.priority, s.order)):
            s.max_total_len = limit
            d = self.admission_policy.regrow(s, capacity, configured)
            if d is None:
                continue
            cap = self.max_new_tokens_cap
            own = s.params.max_tokens if cap is None else min(s.params.max_tokens, cap)
            s.max_tokens = max(s.max_tokens, min(own, d.max_tokens))

    def _longest_need(self: LLMEngine) -> tuple[int, str | None]:
        """The most device blocks a request in flight may still need (its prompt and every
        output token it may make, within the length limit it was admitted with), and its id:
        a pool smaller than that could strand it (preempted, never to fit again)."""
        bm, need, rid = self.block_manager, 0, None
        for s in self.scheduler.live():
            n = bm.blocks_for(min(s.max_total_len, len(s.prompt_token_ids) + s.max_tokens))
            if n > need:
                need, rid = n, s.request_id
        return need, rid

    def _take_admission(self: LLMEngine, admission: AdmissionConfig) -> Callable[[], None]:
        """Put a reload's admission config in force, on the engine thread; the returned call
        puts back what it replaced (a reload refused after it changes nothing)."""
        ctl = self.admission
        kept_config = self.config.admission
        kept = None if ctl is None else (ctl.config, ctl.estimator.quantile, ctl.overcommit)
        self.config.admission = admission
        if ctl is not None:
            ctl.config = admission
            ctl.estimator.quantile = admission.estimate_quantile
            # a lower max_overcommit bounds the overcommit from this step on
            ctl.overcommit = min(ctl.overcommit, admission.max_overcommit)

        def undo() -> None:
            self.config.admission = kept_config
            if ctl is not None and kept is not None:
                ctl.config, ctl.estimator.quantile, ctl.overcommit = kept

        return undo

    def _set_kv_budget(self: LLMEngine, value: Any) -> tuple[str, bool]:
        """A reload's kv_cache_bytes, on the engine thread: (what was done, ok). The pool is
        resized to it in place on CPU; on CUDA (gpu_memory_utilization sizes the pool) and
        with serving.num_gpu_blocks (which fixes it) the value is unused, as at a start.
        Refused (no room to grow, a pool that cannot be built), the budget and the configured
        value stay as they were, and the pool too (`_resize_pool`)."""
        if self.runner.device.type != "cpu":
            self.config.kv_cache_bytes = value
            return "kv_cache_bytes: unused on this device (gpu_memory_utilization)", True
        if self.config.num_gpu_blocks:
            self.config.kv_cache_bytes = value
            return (
                f"kv_cache_bytes={value}: unused while serving.num_gpu_blocks="
                f"{self.config.num_gpu_blocks} fixes the pool (as at a start)",
                True,
            )
        kept = (self.config.kv_cache_bytes, self.kv_cache.budget_bytes)
        self.config.kv_cache_bytes = value
        self.kv_cache.budget_bytes = int(value)
        detail, done, _ = self._resize_pool(self.kv_pool_share)
        if not done:
            self.config.kv_cache_bytes, self.kv_cache.budget_bytes = kept
            return f"kv_cache_bytes={value}: {detail.removeprefix('refused: ')}", False
        self._bound_lengths()  # a remedy's share may hold the pool as it was, the budget grew
        return f"kv_cache_bytes={value}: {detail}{self._resize_host_pool()}", True

    def _resize_host_pool(self: LLMEngine) -> str:
        """After a reload's kv_cache_bytes resized the device pool: the swap pool sized as a
        start sizes it, cpu_cache_ratio of all KV (ratio / (1 - ratio) times the device blocks
        of the whole budget, whatever share a remedy holds the device pool at); it kept its
        start size, so a grown budget fell back to recompute once the small swap pool filled,
        and a shrunk one kept its memory. Never below the blocks swapped sequences hold now;
        a growth the host has no room for, or a pool that cannot be built, keeps the size it
        had (said in the detail: the device pool's resize stands). What it adds to the
        detail."""
        cfg, hbm = self.config, self.host_block_manager
        if not cfg.enable_cpu_offload:
            return ""
        dtype, ratio = self.kv_cache.dtype, cfg.cpu_cache_ratio
        want = int(self.runner.blocks_for_budget(dtype) * ratio / (1.0 - ratio))
        new_n, old_n = max(want, hbm.num_used), hbm.num_blocks
        per_block = self.kv_cache.bytes_per_block
        if new_n == old_n:
            self.kv_cache.host_budget_bytes = want * per_block
            return ""
        grow = self.kv_cache.grow_bytes(self.kv_cache.host_pool, new_n) if new_n > old_n else 0
        if grow > 0 and not self.runner.can_grow(grow):
            return (
                f"; swap pool kept at {old_n} blocks (no room for {grow / 2**20:.0f} MiB more "
                f"host memory below {HOST_GROW_BELOW:.0%})"
            )
        kept = self._bookkeeping()
        moves = hbm.resize(new_n)
        self.scheduler.remap(moves, host=True)
        try:
            self.runner.convert_kv(dtype, {"host": (new_n, moves)})
        except Exception as e:  # noqa: BLE001 - the pool is put back whatever failed
            if isinstance(e, PoolTorn) or cfg.world_size > 1:  # as a device pool's (it raises)
                self._conversion_failed(kept, f"a swap pool of {new_n} blocks", e, set())
            kept()  # the device pool was not touched: its prefix cache stays
            hbm.retire_cache(set())
            return f"; swap pool kept at {old_n} blocks (it could not be rebuilt: {e})"
        self.kv_cache.host_budget_bytes = want * per_block
        held = f" (held at {new_n}: swapped sequences hold them)" if new_n > want else ""
        return f"; swap pool {old_n} -> {new_n} blocks{held}"

    def _set_knob(self: LLMEngine, name: str, value: Any) -> str:
        """One serving knob of `reconfigure` that cannot be refused (kv_cache_bytes and the
        admission config have their own), on the engine thread: what was done."""
        old = getattr(self.config, name)
        setattr(self.config, name, value)
        sch = self.scheduler
        if name == "max_num_seqs":
            try:
                limit, moved = self._cut_batch(self.batch_cut)
            except BaseException:
                self.config.max_num_seqs = old  # the configured limit too, as it was
                raise
            return f"max_num_seqs={value} (in force {limit}; {len(moved)} preempted)"
        if name == "max_num_batched_tokens":
            self.configured_batched_tokens = value
            budget = self._hold_step_budget(self.budget_cut)
            return f"max_num_batched_tokens={value} (in force {budget})"
        if name == "prefill_while_decoding":
            from kvguard.engine.llm_engine import prefill_while_decoding  # it imports this module

            sch.prefill_while_decoding = prefill_while_decoding(self.config, self.runner.device)
        if name.startswith("speculative_"):
            from kvguard.engine.llm_engine import speculation

            sch.speculation = speculation(self.config)
        return f"{name}={value}"

    # -- offload ----------------------------------------------------------------------------
    def set_offload(self: LLMEngine, enabled: bool) -> Future:
        def apply():
            if enabled and self.host_block_manager.num_blocks == 0:
                return (
                    "refused: no host pool (start with enable_cpu_offload to size one)",
                    False,
                    {},
                )
            already = " already" if self.scheduler.offload == bool(enabled) else ""
            self.scheduler.offload = bool(enabled)
            swapped = counted(len(self.scheduler.swapped), "sequence")
            return (
                f"offload{already} {'on' if enabled else 'off'}; {swapped} still swapped",
                True,
                {},
            )

        return self._act("set_offload", apply)

    # -- output length ----------------------------------------------------------------------
    def set_max_new_tokens_cap(self: LLMEngine, n: int | None, *, clamp: bool = False) -> Future:
        """Cap every request's output at `n` tokens (None: no cap). A cap is at most
        max_model_len, the longest output any request can have anyway: above it raises
        ValueError, or with `clamp` (rules) caps at max_model_len and says so."""
        note = ""
        if n is not None:
            n, note = bounded_count(n, self.max_model_len, "max_model_len", clamp)

        def apply():
            same = " (unchanged)" if self.max_new_tokens_cap == n else ""
            self.max_new_tokens_cap = n
            touched = 0
            for seq in self.scheduler.live():
                limit = seq.params.max_tokens if n is None else min(seq.params.max_tokens, n)
                d = self.admission_policy.decision(seq)
                if d is not None and d.max_tokens:
                    limit = min(limit, d.max_tokens)
                if limit != seq.max_tokens:
                    seq.max_tokens = limit
                    touched += 1
                    self._finish_if_capped(seq)
            return (
                f"max_new_tokens cap {n}{same}{note}; {counted(touched, 'live request')} adjusted",
                True,
                {"adjusted": touched},
            )

        return self._act("set_max_new_tokens_cap", apply)

    def _finish_if_capped(self: LLMEngine, seq) -> None:  # noqa: ANN001
        """A live cap at or below what `seq` has made ends it there, as max_tokens would: its
        text made whole (a character cut short as U+FFFD) and its stop strings applied."""
        if len(seq.output_token_ids) >= seq.max_tokens and seq.status is not Status.FINISHED:
            stopped = finish_text(self.tokenizer, seq)
            seq.truncated = not stopped
            self._pending.append(self._end(seq, "stop" if stopped else "length"))

    # -- admission --------------------------------------------------------------------------
    def halt_admission(
        self: LLMEngine,
        allow_priority: str | None = "high",
        *,
        tighten_only: bool = False,
        only_above: float | None = None,
    ) -> Future:
        """Refuse new requests except those of `allow_priority` or better (None or "none":
        refuse all; ValueError for anything else but a priority, `parse_allow_priority`).
        With `tighten_only` (the OOM chain) a stricter halt in force is kept as it is. With
        `only_above` (the OOM chain's last step) only while the device KV cache's usage is
        above it when the engine applies it, after the actions posted before it; otherwise
        nothing changes and the result is not ok (not needed: nothing applied)."""
        allowed = parse_allow_priority(allow_priority)  # "none" is None, as for a rule
        rank = -1 if allowed is None else PRIORITIES[allowed]

        def apply():
            was = self.allow_rank
            if only_above is not None:
                blocks = self.block_manager.num_blocks
                usage = self.block_manager.num_used / blocks if blocks else 0.0
                if usage <= only_above:
                    why = f"not needed: KV cache at {usage:.1%} (halts above {only_above:.0%})"
                    return why, False, {}
            if tighten_only and was is not None and was <= rank:
                return f"admission already halted (allowed: {allowed_name(was)}): kept", True, {}
            if was == rank:  # no admission_halted event either: nothing was halted now
                return f"admission already halted (allowed: {allowed_name(was)})", True, {}
            self.admission_policy.allow_rank = rank
            self.events.emit("admission_halted", allow_priority=allowed)
            return f"admission halted (allowed: {allowed or ALLOW_NONE})", True, {}

        return self._act("halt_admission", apply)

    def resume_admission(self: LLMEngine) -> Future:
        def apply():
            was = self.allow_rank
            self.admission_policy.allow_rank = None
            if was is None:
                return "admission already open", True, {}
            self.events.emit("admission_resumed")
            return "admission open", True, {}

        return self._act("resume_admission", apply)
