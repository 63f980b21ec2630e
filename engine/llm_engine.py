"""LLMEngine: requests in, tokens out, one `step()` at a time over a paged KV cache."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq

import torch

from kvguard.engine.block_manager import BlockManager
from kvguard.engine.config import ConfigError, EngineConfig
from kvguard.engine.detokenizer import append_token
from kvguard.engine.kv_cache import KV_TORCH_DTYPES, KVCache, bytes_per_block, kv_dtype_name
from kvguard.engine.model import AttentionMetadata, LlamaForCausalLM, build_model
from kvguard.engine.model_config import ModelConfig
from kvguard.engine.model_registry import resolve_model
from kvguard.engine.sampler import sample
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.scheduler import ScheduledBatch, Scheduler
from kvguard.engine.sequence import RequestOutput, Sequence, Status, parse_priority
from kvguard.engine.snapshot import EngineSnapshot
from kvguard.engine.tokenizer import Tokenizer
from kvguard.engine.weights import load_weights

log = logging.getLogger("kvguard.engine")


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


class LLMEngine:
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
        self.block_manager = BlockManager(kv_cache.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
        )
        self.max_model_len = min(config.max_model_len, model_config.max_position_embeddings)
        self.eos_ids = set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # aborted/finished outside a step
        self._step_no = 0
        self._tokens_generated = 0

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
        kv = KVCache(mcfg, num_blocks, config.block_size, kv_dtype, device)
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
        """Queue a request; raise ValueError (naming the problem) for one that cannot be served."""
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
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

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
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        self._finish(seq)
        self._pending.append(RequestOutput.of(seq))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return outputs of every request that advanced or finished."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.empty:
            return outputs
        sampled = self._run(batch)
        now = time.monotonic()
        for seq, token in sampled:
            self._emit(seq, token, now)
            outputs.append(RequestOutput.of(seq))
        self._step_no += 1
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        ids, pos, slots, rows = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            slots.extend(self.block_manager.slot(seq, p) for p in range(start, start + n))
            if start + n == seq.num_tokens:
                rows.append(len(ids) - 1)
        meta = self._metadata(batch, slots)
        dev = self.device
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

    def _emit(self, seq: Sequence, token: int, now: float) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        self._tokens_generated += 1
        append_token(self.tokenizer, seq, token, self.eos_ids)
        if seq.finish_reason is not None:
            self.scheduler.remove(seq)
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self._seqs.pop(seq.request_id, None)

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
                batch = ScheduledBatch([seq], [n])
                start = seq.num_computed_tokens
                slots = [self.block_manager.slot(seq, p) for p in range(start, start + n)]
                hidden = self.model(
                    torch.tensor(token_ids[start : start + n], device=self.device),
                    torch.arange(start, start + n, device=self.device),
                    self.kv_cache.layers,
                    self._metadata(batch, slots),
                )
                seq.num_computed_tokens += n
                logits.append(self.model.compute_logits(hidden))
        finally:
            self.block_manager.free(seq)
        return torch.cat(logits)

    def snapshot(self) -> EngineSnapshot:
        bm = self.block_manager
        return EngineSnapshot(
            step=self._step_no,
            block_size=bm.block_size,
            blocks_total=bm.num_blocks,
            blocks_used=bm.num_used,
            blocks_free=bm.num_free,
            live_tokens=sum(s.num_computed_tokens for s in self.scheduler.running),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_dtype=self.kv_cache.dtype,
            max_num_seqs=self.scheduler.max_num_seqs,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            tokens_generated=self._tokens_generated,
        )

    def audit_blocks(self) -> None:
        """Assert exact block accounting (tests call it between steps)."""
        self.block_manager.audit(self.scheduler.live())


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
