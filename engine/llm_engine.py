"""LLMEngine: requests in, tokens out, one `step()` at a time over a paged KV cache.

One thread owns an engine. Other threads post control actions to its mailbox (applied at the
start of the next step) and read `latest_snapshot`, which is replaced after every step.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Sequence as Seq

import torch

from kvguard.engine.admission import AdmissionController, AdmissionDecision
from kvguard.engine.block_manager import BlockManager
from kvguard.engine.config import ConfigError, EngineConfig
from kvguard.engine.control import Mailbox
from kvguard.engine.control_surface import ControlSurface
from kvguard.engine.detokenizer import append_token
from kvguard.engine.events import EventBus
from kvguard.engine.kv_cache import KV_TORCH_DTYPES, KVCache, bytes_per_block, kv_dtype_name
from kvguard.engine.model import AttentionMetadata, LlamaForCausalLM, build_model
from kvguard.engine.model_config import ModelConfig
from kvguard.engine.model_registry import resolve_model
from kvguard.engine.sampler import sample
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.scheduler import ScheduledBatch, Scheduler
from kvguard.engine.sequence import (
    PRIORITY_NAMES,
    RequestOutput,
    Sequence,
    Status,
    parse_priority,
)
from kvguard.engine.snapshot import EngineSnapshot, build_snapshot
from kvguard.engine.tokenizer import Tokenizer
from kvguard.engine.weights import load_weights

log = logging.getLogger("kvguard.engine")
OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)
MIN_BATCHED_TOKENS = 64
UNDO_MARGIN = 0.10  # share of the configured dtype's pool kept free while a remedy narrows it


class InjectedOOMError(RuntimeError):
    """Raised inside a forward pass by `inject_oom` (the documented fault-injection test hook)."""


class AdmissionRejected(ValueError):
    """The admission controller refused a request; `decision` says why and when to retry."""

    def __init__(self, decision: AdmissionDecision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r}: CUDA is not available on this host")
    return dev


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return KV_TORCH_DTYPES[name]


class LLMEngine(ControlSurface):
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        kv_cache: KVCache,
    ) -> None:
        self.config = config
        self.model = model
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.kv_cache = kv_cache
        self.events = EventBus()
        self.mailbox = Mailbox()
        self.block_manager = BlockManager(kv_cache.num_blocks, config.block_size)
        self.host_block_manager = BlockManager(kv_cache.num_host_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            self.host_block_manager,
            kv_cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            offload=config.enable_cpu_offload and kv_cache.num_blocks >= config.min_gpu_blocks,
            emit=self.events.emit,
        )
        self.admission = None
        if config.admission is not None and config.admission.enable:
            self.admission = AdmissionController(
                config.admission, config.block_size, kv_cache.bytes_per_block
            )
            self.scheduler.admit_gate = self._commit
            self.scheduler.release_gate = self._uncommit
            self.admission.live = self._live_loads
        self.max_model_len = min(config.max_model_len, model_config.max_position_embeddings)
        self.eos_ids = set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids)
        self.max_new_tokens_cap: int | None = None
        self.allow_rank: int | None = None  # admission halted: only ranks <= this get in
        self.configured_batched_tokens = config.max_num_batched_tokens
        self._seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # aborted/finished outside a step
        self._step_no = 0
        self._counters = {"tokens_generated": 0, "prompt_tokens": 0, "finished": 0, "oom": 0}
        # finish_reason -> priority -> count. Every finish passes through `_finish`, aborts
        # (client gone, drain cut) included, so this is the one place that can count them all.
        self._finished: dict[str, dict[str, int]] = {}
        self._inject_oom = 0
        self._last_oom = 0.0
        self._ttft: deque[float] = deque(maxlen=256)
        self._tpot: deque[float] = deque(maxlen=256)
        self.latest_snapshot: EngineSnapshot = self.snapshot()

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> LLMEngine:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        path = resolve_model(config.model, config.home, progress=progress)
        mcfg = ModelConfig.from_dir(path)
        tokenizer = Tokenizer.from_dir(path)
        max_len = min(config.max_model_len, mcfg.max_position_embeddings)
        t0 = time.perf_counter()
        model = build_model(mcfg, load_weights(path, dtype, device), max_len, dtype, device)
        log.info("loaded %s in %.2fs", path, time.perf_counter() - t0)
        kv_dtype = kv_dtype_name(config.kv_cache_dtype, dtype)
        num_blocks = config.num_gpu_blocks or _num_blocks(config, mcfg, kv_dtype, device)
        host_blocks = 0
        if config.enable_cpu_offload:
            host_blocks = int(num_blocks * config.cpu_cache_ratio / (1.0 - config.cpu_cache_ratio))
        kv = KVCache(mcfg, num_blocks, config.block_size, kv_dtype, device, host_blocks)
        return cls(config, model, mcfg, tokenizer, kv)

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: str | int = "normal",
        add_special_tokens: bool = True,
    ) -> str:
        """Queue a request. ValueError names what makes it unservable; AdmissionRejected
        (a ValueError) carries the controller's decision and retry hint."""
        params = params or SamplingParams()
        params.validate()
        rank = parse_priority(priority)
        ids = self._prompt_ids(prompt, add_special_tokens)
        limit = self._max_total_len()
        if len(ids) >= limit:
            raise ValueError(self._too_long(len(ids), limit))
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request_id {rid!r} is already in use")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(rid, ids, params, rank, next(self._order), limit, gen)
        if self.max_new_tokens_cap is not None:
            seq.max_tokens = min(seq.max_tokens, self.max_new_tokens_cap)
        self._admit(seq)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        self._counters["prompt_tokens"] += len(ids)
        return rid

    def _admit(self, seq: Sequence) -> None:
        if self.allow_rank is not None and seq.priority > self.allow_rank:
            raise AdmissionRejected(
                AdmissionDecision(
                    "reject",
                    "admission is halted for this priority",
                    status=503,
                    estimated_wait_s=5.0,
                )
            )
        if self.admission is None:
            seq.admitted = True
            return
        # predicted: high priority sorts ahead of queued lower ones and does not wait on their KV
        ahead = 0 if self.admission.predicted and seq.priority == 0 else None
        queued = sum(
            1
            for s in self.scheduler.waiting
            if not s.admitted and (ahead is None or s.priority == ahead)
        )
        capacity = self.scheduler.device_capacity()
        d = self.admission.decide(
            len(seq.prompt_token_ids),
            seq.max_tokens,
            seq.priority,
            capacity,
            self.block_manager.num_used / capacity,
            queued,
            seq.max_total_len,
        )
        self.events.emit("admission", decision=d.decision, reason=d.reason, priority=seq.priority)
        if d.decision == "reject":
            raise AdmissionRejected(d)
        seq.max_tokens = d.max_tokens
        seq.projected_blocks = self.admission.projected_blocks(
            len(seq.prompt_token_ids) + d.predicted_tokens
        )
        seq.admission = d
        if d.decision == "admit":
            self.admission.commit(seq.projected_blocks)
            seq.admitted = True

    def _commit(self, seq: Sequence) -> bool:
        load = (seq.num_tokens, seq.admission.predicted_tokens if seq.admission else 1)
        return self.admission.try_commit(
            seq.projected_blocks, self.scheduler.device_capacity(), seq.priority, load
        )

    def undo_room_cap(self) -> int | None:
        """The device blocks sequences may hold while the KV dtype is narrower than configured.

        A remedy that switches to FP8 is meant to be undone; if the scheduler filled the larger
        FP8 pool, the live tokens would not fit the configured dtype's pool and the way back
        would stay refused long after the burst. So use is capped at what that pool holds, less
        UNDO_MARGIN (a request alone on the device may pass it: see Scheduler._can_allocate).
        None when the live dtype holds no more blocks than the configured one.
        """
        configured = kv_dtype_name(self.config.kv_cache_dtype, next(self.model.parameters()).dtype)
        full = self.kv_cache.blocks_for_budget(configured)
        if self.kv_cache.dtype == configured or full >= self.block_manager.num_blocks:
            return None
        return max(1, math.floor(full * (1.0 - UNDO_MARGIN)))

    def _live_loads(self, max_rank: int | None = None) -> list[tuple[int, int]]:
        """(tokens held, tokens still expected) of every admitted, unfinished request of rank
        <= max_rank (None: all), for predicted admission. A request past its prediction is
        expected to need at least another block (or what its max_tokens leaves), not to end
        this very step."""
        out = []
        for s in self.scheduler.live():
            if not s.admitted or s.admission is None:
                continue
            if max_rank is not None and s.priority > max_rank:
                continue
            made = len(s.output_token_ids)
            rest = max(s.admission.predicted_tokens - made, self.config.block_size)
            out.append((s.num_tokens, max(0, min(s.max_tokens - made, rest))))
        return out

    def _uncommit(self, seq: Sequence) -> None:
        self.admission.uncommit(seq.projected_blocks)

    def _prompt_ids(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: expected at least one token")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [
                t
                for t in ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
            ]
            if bad:
                raise ValueError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
                )
        if not ids:
            raise ValueError("prompt is empty: expected at least one token")
        return ids

    def _max_total_len(self) -> int:
        return min(self.max_model_len, self.block_manager.num_blocks * self.config.block_size)

    def _too_long(self, n: int, limit: int) -> str:
        pool = self.block_manager.num_blocks * self.config.block_size
        if n >= pool and pool <= self.max_model_len:
            need = self.block_manager.blocks_for(n + 1)
            return (
                f"prompt of {n} tokens needs {need} KV blocks but the whole pool has "
                f"{self.block_manager.num_blocks} ({pool} tokens): raise kv_cache_bytes"
            )
        return f"prompt of {n} tokens leaves no room to generate within max_model_len={limit}"

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished.
        Engine thread only (other threads post `lambda: engine.abort(rid)` to the mailbox)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self._pending.append(self._end(seq, "abort"))
        return True

    def _end(self, seq: Sequence, reason: str) -> RequestOutput:
        """Finish `seq` outside the normal decode path (abort, cap, failed step): out of its
        queue, blocks freed, counted, and its last output handed out."""
        self.scheduler.remove(seq)
        seq.finish_reason = reason
        self._finish(seq)
        return RequestOutput.take(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Apply posted actions, run one batch; return outputs of requests that advanced."""
        self.mailbox.drain()
        outputs, self._pending = self._pending, []
        self._maybe_restore_budget()
        batch = self.scheduler.schedule()
        if not batch.empty:
            try:
                sampled = self._run(batch)
            except OOM_ERRORS + (InjectedOOMError,) as e:
                self._on_oom(batch, e)
                sampled = []
            except Exception:  # noqa: BLE001 - a bug or a poisoned input: stop this step's requests
                log.exception(
                    "engine step failed; its %d requests end with an error", len(batch.seqs)
                )
                outputs += self._fail(batch)
                sampled = []
            now = time.monotonic()
            for seq, token in sampled:
                self._emit_token(seq, token, now)
                outputs.append(RequestOutput.take(seq))
            self._step_no += 1
        self.latest_snapshot = self.snapshot()
        return outputs

    def _fail(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """End a failed step's requests with finish_reason `error` and free their blocks.

        Retrying the same batch would fail the same way, step after step, and stall every
        request behind it; ending these few keeps the engine serving everyone else."""
        return [self._end(seq, "error") for seq in batch.seqs if not seq.is_finished]

    def _run(self, batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        ids, pos, slots, rows = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start = seq.num_computed_tokens
            ids.extend(seq.token_slice(start, start + n))
            pos.extend(range(start, start + n))
            slots.extend(self.block_manager.slot(seq, p) for p in range(start, start + n))
            if start + n == seq.num_tokens:
                rows.append(len(ids) - 1)
        meta = self._metadata(batch, slots)
        dev = self.device
        if self._inject_oom:
            self._inject_oom -= 1
            raise InjectedOOMError("injected out-of-memory fault (inject_oom test hook)")
        hidden = self.model(
            torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), self.kv_cache.layers, meta
        )
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
        done = [s for s in batch.seqs if s.num_computed_tokens == s.num_tokens]
        if not done:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])
        tokens = sample(logits, [s.params for s in done], [s.generator for s in done])
        return list(zip(done, tokens, strict=True))

    def _metadata(self, batch: ScheduledBatch, slots: list[int]) -> AttentionMetadata:
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=[
                s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
            ],
            query_lens=list(batch.num_tokens),
        )

    def _emit_token(self, seq: Sequence, token: int, now: float) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._ttft.append(now - seq.arrival_time)
        elif seq.last_token_time is not None:
            self._tpot.append(now - seq.last_token_time)
        seq.last_token_time = now
        self._counters["tokens_generated"] += 1
        append_token(self.tokenizer, seq, token, self.eos_ids)
        if seq.finish_reason is not None:
            self.scheduler.remove(seq)
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self._counters["finished"] += 1
        by_priority = self._finished.setdefault(seq.finish_reason or "unknown", {})
        name = PRIORITY_NAMES[seq.priority]
        by_priority[name] = by_priority.get(name, 0) + 1
        if self.admission is not None and seq.admitted:
            self.admission.release(seq.projected_blocks)
            d = seq.admission
            if d is not None and seq.finish_reason in ("stop", "length"):
                # what the output really ran to teaches the estimator (aborts say nothing)
                self.admission.estimator.observe(
                    d.max_tokens, len(seq.output_token_ids), d.predicted_tokens
                )
        self._seqs.pop(seq.request_id, None)

    # -- out-of-memory safety -------------------------------------------------------------
    def inject_oom(self, times: int = 1) -> None:
        """Test hook: the next `times` forward passes fail as if the device ran out of memory."""
        self._inject_oom += times

    def _on_oom(self, batch: ScheduledBatch, error: BaseException) -> None:
        """Put the step's sequences back to recompute, halve the batch budget, tell listeners."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for seq in batch.seqs:
            if seq.status is Status.RUNNING:
                self.scheduler.running.remove(seq)
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                seq.num_preemptions += 1
                self.scheduler.preemptions["recompute"] += 1
                self.scheduler.add(seq)
        before = self.scheduler.max_num_batched_tokens
        self.scheduler.max_num_batched_tokens = max(MIN_BATCHED_TOKENS, before // 2)
        self.scheduler.chunked = True  # a halved budget must still fit every prompt
        self._counters["oom"] += 1
        self._last_oom = time.monotonic()
        log.warning(
            "out of memory in a step (%s): %d sequences requeued, batch budget %d -> %d",
            error,
            len(batch.seqs),
            before,
            self.scheduler.max_num_batched_tokens,
        )
        self.events.emit(
            "engine_oom",
            error=str(error),
            requeued=[s.request_id for s in batch.seqs],
            max_num_batched_tokens_before=before,
            max_num_batched_tokens_after=self.scheduler.max_num_batched_tokens,
        )

    def _maybe_restore_budget(self) -> None:
        cur = self.scheduler.max_num_batched_tokens
        if cur >= self.configured_batched_tokens or not self._last_oom:
            return
        if time.monotonic() - self._last_oom >= self.config.oom_quiet_period_s:
            new = min(self.configured_batched_tokens, cur * 2)
            self.scheduler.max_num_batched_tokens = new
            self._last_oom = time.monotonic()
            if new == self.configured_batched_tokens:
                self.scheduler.chunked = self.config.enable_chunked_prefill
            self.events.emit(
                "knob_changed",
                knob="max_num_batched_tokens",
                before=cur,
                after=new,
                reason="recovered after out-of-memory",
            )

    # -- convenience ----------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str] | Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: str | int = "normal",
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        rids = [
            self.add_request(p, sp, None, priority, add_special_tokens)
            for p, sp in zip(prompts, plist, strict=True)
        ]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in rids]

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits `[len, vocab]` at every position of `token_ids`, run through the paged cache.

        Teacher forcing for quality checks (e.g. FP8 KV against full precision): the tokens are
        prefilled chunk by chunk, exactly like a request, into blocks freed afterwards.
        """
        seq = Sequence("__score__", list(token_ids), SamplingParams(), 0, -1, len(token_ids) + 1)
        chunk = self.scheduler.max_num_batched_tokens
        if not self.block_manager.can_allocate(self.block_manager.blocks_for(len(token_ids))):
            raise RuntimeError("score: not enough free KV blocks; call it while the engine is idle")
        logits = []
        try:
            while seq.num_computed_tokens < len(token_ids):
                n = min(chunk, len(token_ids) - seq.num_computed_tokens)
                self.block_manager.allocate(seq, n)
                start = seq.num_computed_tokens
                slots = [self.block_manager.slot(seq, p) for p in range(start, start + n)]
                hidden = self.model(
                    torch.tensor(token_ids[start : start + n], device=self.device),
                    torch.arange(start, start + n, device=self.device),
                    self.kv_cache.layers,
                    self._metadata(ScheduledBatch([seq], [n]), slots),
                )
                seq.num_computed_tokens += n
                logits.append(self.model.compute_logits(hidden))
        finally:
            self.block_manager.free(seq)
        return torch.cat(logits)

    def snapshot(self) -> EngineSnapshot:
        return build_snapshot(self)

    def audit_blocks(self) -> None:
        """Assert exact block accounting on both tiers (tests call it between steps)."""
        self.scheduler.audit()


def _num_blocks(config: EngineConfig, cfg: ModelConfig, kv_dtype: str, device: torch.device) -> int:
    per_block = bytes_per_block(cfg, config.block_size, kv_dtype)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = int(config.kv_cache_bytes)
    n = budget // per_block
    if n < 1:
        raise ConfigError(
            f"KV budget of {budget} bytes holds no block of {per_block} bytes: raise kv_cache_bytes"
        )
    return n
