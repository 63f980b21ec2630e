"""The actions rules may take on a live engine (DESIGN "Control surface").

Public methods validate their arguments at once (ValueError in the caller's thread), then post
the work to the mailbox and return a Future of `ActionResult`; the engine thread applies it at
the next step boundary. Calling `step()` (or running an `EngineLoop`) is what applies them.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvguard.engine.control import ActionResult
from kvguard.engine.kv_cache import KV_TORCH_DTYPES, kv_dtype_name
from kvguard.engine.sequence import PRIORITY_NAMES, RequestOutput, Status, parse_priority

if TYPE_CHECKING:
    from kvguard.engine.llm_engine import LLMEngine


def allowed_name(rank: int | None) -> str | None:
    """Admission knob as text: None (open), 'none' (halted for all), or the best priority allowed."""
    if rank is None:
        return None
    return PRIORITY_NAMES.get(rank, "none")


class ControlSurface:
    """Mixed into LLMEngine; `self` is the engine."""

    def knobs(self: LLMEngine) -> dict[str, object]:
        return {
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "kv_cache_dtype": self.kv_cache.dtype,
            "offload": self.scheduler.offload,
            "max_new_tokens_cap": self.max_new_tokens_cap,
            "admission_allow_priority": allowed_name(self.allow_rank),
        }

    def _act(self: LLMEngine, name: str, fn) -> Future:  # noqa: ANN001 - () -> (detail, ok, data)
        def run() -> ActionResult:
            before = self.knobs()
            detail, ok, data = fn()
            after = self.knobs()
            if before != after:
                changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
                self.events.emit("knob_changed", action=name, changes=changed)
            return ActionResult(name, before, after, detail, ok, data)

        return self.mailbox.post(run)

    # -- batch size -------------------------------------------------------------------------
    def set_max_num_seqs(self: LLMEngine, n: int) -> Future:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"max_num_seqs={n!r}: expected an integer >= 1")

        def apply():
            self.scheduler.max_num_seqs = n
            moved = self.scheduler.shrink_running(n)
            return (
                f"max_num_seqs={n}; {len(moved)} running sequences preempted",
                True,
                {"preempted": moved},
            )

        return self._act("set_max_num_seqs", apply)

    # -- eviction ---------------------------------------------------------------------------
    def evict(self: LLMEngine, count: int, max_priority: str = "low") -> Future:
        """Preempt up to `count` running sequences no more important than `max_priority`,
        lowest priority and newest first; they come back once usage has eased."""
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count={count!r}: expected an integer >= 1")
        rank = parse_priority(max_priority)

        def apply():
            moved = self.scheduler.evict(count, rank)
            return (
                f"evicted {len(moved)} sequences of priority <= {max_priority}",
                True,
                {"evicted": moved},
            )

        return self._act("evict", apply)

    # -- KV dtype ---------------------------------------------------------------------------
    def set_kv_cache_dtype(self: LLMEngine, dtype: str) -> Future:
        if dtype not in (*KV_TORCH_DTYPES, "auto"):
            raise ValueError(
                f"kv_cache_dtype={dtype!r}: expected one of auto, {', '.join(KV_TORCH_DTYPES)}"
            )
        return self._act("set_kv_cache_dtype", lambda: self._switch_kv_dtype(dtype))

    def _switch_kv_dtype(self: LLMEngine, dtype: str) -> tuple[str, bool, dict]:
        dtype = kv_dtype_name(dtype, next(self.model.parameters()).dtype)
        old = self.kv_cache.dtype
        if dtype == old:
            return f"KV cache already {dtype}", True, {}
        new_n = self.kv_cache.blocks_for_budget(dtype)
        new_host = self.kv_cache.blocks_for_budget(dtype, host=True)
        bm, hbm = self.block_manager, self.host_block_manager
        if bm.num_used > new_n or hbm.num_used > new_host:
            return (
                f"refused: live KV needs {bm.num_used} device / {hbm.num_used} host blocks but a {dtype} "
                f"pool of the same bytes holds {new_n} / {new_host}; retry when usage is lower",
                False,
                {},
            )
        t0 = time.perf_counter()
        live_bytes = bm.num_used * self.kv_cache.bytes_per_block
        old_n = bm.num_blocks
        extra = self._rebuild_tier(self.kv_cache.device_pool, bm, dtype, new_n, "block_table")
        extra_h = self._rebuild_tier(
            self.kv_cache.host_pool, hbm, dtype, new_host, "host_block_table"
        )
        self.kv_cache.last_switch_peak_extra_bytes = max(extra, extra_h)
        if self.admission is not None:
            self.admission.bytes_per_block = self.kv_cache.bytes_per_block
        pause = time.perf_counter() - t0
        data = {
            "from": old,
            "to": dtype,
            "blocks_before": old_n,
            "blocks_after": new_n,
            "pause_s": pause,
            "live_bytes": live_bytes,
            "peak_extra_bytes": max(extra, extra_h),
        }
        self.events.emit("kv_dtype_switched", **data)
        return (
            f"KV cache {old} -> {dtype}: {old_n} -> {new_n} blocks in {pause * 1e3:.1f} ms",
            True,
            data,
        )

    def _rebuild_tier(self: LLMEngine, pool, bm, dtype: str, new_n: int, table: str) -> int:  # noqa: ANN001
        moves = bm.resize(new_n)
        for seq in self.scheduler.live():
            setattr(seq, table, [moves[b] for b in getattr(seq, table)])
        return self.kv_cache.convert(pool, dtype, new_n, moves)

    # -- offload ----------------------------------------------------------------------------
    def set_offload(self: LLMEngine, enabled: bool) -> Future:
        def apply():
            if enabled and self.host_block_manager.num_blocks == 0:
                return (
                    "refused: no host pool (start with enable_cpu_offload to size one)",
                    False,
                    {},
                )
            self.scheduler.offload = bool(enabled)
            swapped = len(self.scheduler.swapped)
            return (
                f"offload {'on' if enabled else 'off'}; {swapped} sequences still swapped",
                True,
                {},
            )

        return self._act("set_offload", apply)

    # -- output length ----------------------------------------------------------------------
    def set_max_new_tokens_cap(self: LLMEngine, n: int | None) -> Future:
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"max_new_tokens cap {n!r}: expected an integer >= 1 or None")

        def apply():
            self.max_new_tokens_cap = n
            touched = 0
            for seq in self.scheduler.live():
                limit = seq.params.max_tokens if n is None else min(seq.params.max_tokens, n)
                if seq.admission is not None and seq.admission.max_tokens:
                    limit = min(limit, seq.admission.max_tokens)
                if limit != seq.max_tokens:
                    seq.max_tokens = limit
                    touched += 1
                    self._finish_if_capped(seq)
            return (
                f"max_new_tokens cap {n}; {touched} live requests adjusted",
                True,
                {"adjusted": touched},
            )

        return self._act("set_max_new_tokens_cap", apply)

    def _finish_if_capped(self: LLMEngine, seq) -> None:  # noqa: ANN001
        if len(seq.output_token_ids) >= seq.max_tokens and seq.status is not Status.FINISHED:
            self.scheduler.remove(seq)
            seq.finish_reason, seq.truncated = "length", True
            self._finish(seq)
            self._pending.append(RequestOutput.of(seq))

    # -- admission --------------------------------------------------------------------------
    def halt_admission(self: LLMEngine, allow_priority: str | None = "high") -> Future:
        """Refuse new requests except those of `allow_priority` or better (None: refuse all)."""
        rank = -1 if allow_priority is None else parse_priority(allow_priority)

        def apply():
            self.allow_rank = rank
            self.events.emit("admission_halted", allow_priority=allow_priority)
            return f"admission halted (allowed: {allow_priority or 'none'})", True, {}

        return self._act("halt_admission", apply)

    def resume_admission(self: LLMEngine) -> Future:
        def apply():
            was = self.allow_rank
            self.allow_rank = None
            if was is not None:
                self.events.emit("admission_resumed")
            return "admission open", True, {}

        return self._act("resume_admission", apply)
