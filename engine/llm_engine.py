"""LLMEngine: requests in, tokens out, one `step()` at a time over a paged KV cache.

One thread owns an engine. Other threads post control actions to its mailbox (applied at the
start of the next step) and read `latest_snapshot`, which is replaced after every step.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvguard.engine.admission import HIGH, AdmissionController
from kvguard.engine.admission_policy import AdmissionPolicy, AdmissionRejected
from kvguard.engine.block_manager import BlockManager
from kvguard.engine.config import ConfigError, EngineConfig
from kvguard.engine.control import Mailbox
from kvguard.engine.control_surface import ControlSurface
from kvguard.engine.detokenizer import append_token, finish_text
from kvguard.engine.distributed.errors import PoolTorn, RankFailure
from kvguard.engine.events import EventBus
from kvguard.engine.kv_cache import KVCache, is_oom
from kvguard.engine.model import StepInterrupted
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.engine.model_registry import resolve_model
from kvguard.engine.model_runner import (
    InjectedOOMError,
    ModelRunner,
    RunTokens,
    finishes_prompt,
    pick_device,
    pick_dtype,
)
from kvguard.engine.plural import counted
from kvguard.engine.sampler import spend_draws
from kvguard.engine.sampling_params import SamplingParams, is_int, is_number, split_ids
from kvguard.engine.scheduler import (
    ScheduledBatch,
    Scheduler,
    Speculation,
    awaits_first_text,
    one_step,
)
from kvguard.engine.sequence import (
    PRIORITY_NAMES,
    RequestOutput,
    Sequence,
    TokenLogprob,
    parse_priority,
)
from kvguard.engine.snapshot import EngineSnapshot, build_snapshot
from kvguard.engine.speculative import ROW_COST_PRIOR
from kvguard.engine.structured import Grammars
from kvguard.engine.tokenizer import PREFIX_CHARS, PREFIX_SLACK, Tokenizer, read_json

__all__ = [
    "AdmissionRejected",
    "InjectedOOMError",
    "LLMEngine",
    "NewRequest",
    "pick_device",
    "pick_dtype",
    "refused_request",
]

log = logging.getLogger("kvguard.engine")


def within_window(config: EngineConfig, mcfg: ModelConfig, source: Path) -> EngineConfig:
    """`config` with max_model_len held to the model's sliding window, if it has one.

    kvguard has no sliding-window attention; over no more tokens than the window, such a model
    attends to every token, as kvguard computes. So a longer max_model_len left at its default
    is held to the window (with a warning naming it) and one set longer is refused."""
    window = mcfg.sliding_window
    if window is None or min(config.max_model_len, mcfg.max_position_embeddings) <= window:
        return config
    if config.max_model_len != EngineConfig.__dataclass_fields__["max_model_len"].default:
        raise ConfigError(
            f"serving.max_model_len {config.max_model_len} is more than {source}'s "
            f"sliding_window {window}: kvguard has no sliding-window attention, and serves "
            f"such a model only within its window; set max_model_len to {window} or less"
        )
    log.warning(
        "%s has sliding_window %d: serving.max_model_len is held to %d tokens "
        "(kvguard has no sliding-window attention; within the window it is the same)",
        source,
        window,
        window,
    )
    return replace(config, max_model_len=window)


# generation_config.json's sampling fields that stand for a request's own where it leaves them
# out (the OpenAI API, `kvguard generate`), as transformers' generate() and vLLM take them:
# the file's name -> SamplingParams'
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_tokens",
}
# its fields that change what transformers samples but that kvguard has no control for, with
# the values that change nothing
GENERATION_UNSERVED: dict[str, tuple[object, ...]] = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "min_p": (None, 0.0),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "no_repeat_ngram_size": (None, 0),
    "num_beams": (None, 1),
    "penalty_alpha": (None, 0.0),
    "min_new_tokens": (None, 0),
    "min_length": (None, 0),
    "bad_words_ids": (None, []),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "sequence_bias": (None, {}),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    # a limit on prompt and answer together, which transformers applies where max_new_tokens
    # is left out; kvguard limits only the answer (max_new_tokens, a request's max_tokens)
    "max_length": (None,),
    "stop_strings": (None, [], ""),
}


def generation_defaults(path: Path, max_model_len: int) -> dict[str, int | float]:
    """The sampling defaults of the model directory's generation_config.json, SamplingParams'
    names -> values ({} without the file): temperature, top_p, top_k and max_tokens (its
    max_new_tokens, held to `max_model_len`, the most an answer can run to). One warning names
    what is not taken: a field kvguard has no control for (repetition_penalty, ...) and a
    value that is no valid setting. `do_sample` is not read, as vLLM does not read it: a
    temperature the file sets is one the model's makers meant to be sampled at."""
    file = path / "generation_config.json"
    config = read_json(file)
    out: dict[str, int | float] = {}
    skipped = [
        f"{name}={config[name]!r} (kvguard has no such control)"
        for name, neutral in GENERATION_UNSERVED.items()
        if name in config and config[name] not in neutral
    ]
    for name, param in GENERATION_DEFAULTS.items():
        value = config.get(name)
        if value is None:
            continue
        if _usable_default(param, value):
            out[param] = min(value, max_model_len) if param == "max_tokens" else value
        else:
            skipped.append(f"{name}={value!r} (not a valid setting)")
    if out:
        log.info(
            "%s: sampling defaults %s, for requests that leave them out",
            file,
            ", ".join(f"{k}={v}" for k, v in out.items()),
        )
    if skipped:
        log.warning("%s: not applied: %s", file, "; ".join(skipped))
    return out


def _usable_default(param: str, value: object) -> bool:
    """Whether `value` is a setting SamplingParams takes for `param`."""
    if param == "temperature":
        return is_number(value) and 0.0 <= value < math.inf  # type: ignore[operator]
    if param == "top_p":
        return is_number(value) and 0.0 <= value <= 1.0  # type: ignore[operator]
    return is_int(value) and value >= (0 if param == "top_k" else 1)  # type: ignore[operator]


CPU_PREFILL_WHILE_DECODING = 128  # prompt tokens beside the decodes: a forward of ~0.3 s on 2 cores
SHOWN_IDS = 20  # the request ids a log line names; the rest are counted
# A step that keeps running out of memory once its budget can halve no further fails as often as
# the engine can run it: its faults are reported (a warning, an `engine_oom_repeated` event) once
# per this many seconds, as the preemption storm is counted, not once per step
OOM_REPORT_EVERY_S = 5.0
# ... and each such step runs again only after a pause, doubled after every failure up to the
# most, so that a device another tenant holds does not keep a core spinning on retries
OOM_BACKOFF_START_S = 0.01
OOM_BACKOFF_MAX_S = 0.5


def listed(ids: Seq[str]) -> str:
    """`ids` for a log line: the first SHOWN_IDS and a count of the rest (a step of hundreds
    of requests must not make a line of kilobytes)."""
    shown = ", ".join(ids[:SHOWN_IDS])
    return shown if len(ids) <= SHOWN_IDS else f"{shown} +{len(ids) - SHOWN_IDS} more"


@dataclass(slots=True)
class OomRepeats:
    """The out-of-memory faults of a burst that left the step budget as it was (at its floor:
    nothing left to halve), since the burst's last report. Each was a warning and an audit
    row of its own: hundreds a second while the device stays short. Now the first of a burst is
    reported as any fault is and the rest once per OOM_REPORT_EVERY_S (`LLMEngine._on_oom`).
    Times are the engine's `oom_clock`."""

    reported: float | None = None  # the burst's last report (None: no burst yet)
    last: float = 0.0  # the burst's latest fault: it ends OOM_REPORT_EVERY_S after it
    count: int = 0  # faults since the report
    requeues: int = 0  # the sequences they requeued, counted each time
    requeued: dict[str, None] = field(default_factory=dict)  # the first SHOWN_IDS of them
    unlisted: bool = False  # ... and others were requeued too
    error: str = ""  # the latest fault's
    budget: int = 0  # the step budget they failed at
    backoff: float = 0.0  # the pause before the next retry at the floor (0: none yet)

    def in_burst(self, now: float) -> bool:
        return self.reported is not None and now - self.last < OOM_REPORT_EVERY_S

    def opened(self, now: float) -> None:
        """A fault was reported on its own: the burst runs (again) from it."""
        self.reported = self.last = now

    def add(self, now: float, error: str, ids: list[str], budget: int) -> None:
        self.last = now
        self.count += 1
        self.requeues += len(ids)
        for rid in ids:
            if rid in self.requeued:
                continue
            if len(self.requeued) < SHOWN_IDS:
                self.requeued[rid] = None
            else:
                self.unlisted = True
        self.error, self.budget = error, budget

    def due(self, now: float) -> bool:
        return self.count > 0 and now - (self.reported or now) >= OOM_REPORT_EVERY_S

    def taken(self, now: float) -> None:
        """Reported: the next window counts afresh."""
        self.reported = now
        self.count = self.requeues = 0
        self.requeued, self.unlisted = {}, False

    def next_backoff(self) -> float:
        """The pause before this retry; the next one's is twice it, up to OOM_BACKOFF_MAX_S."""
        pause = self.backoff or OOM_BACKOFF_START_S
        self.backoff = min(pause * 2, OOM_BACKOFF_MAX_S)
        return pause


@dataclass(slots=True)
class NewRequest:
    """One engine request of several that `LLMEngine.add_requests` takes in as one (an API
    request's `n` choices, its prompts). `count_prompt` False: the prompt is another one's of
    the same request (each choice is an engine request), counted with that one, so that the
    prompt-tokens counter takes each prompt once, as usage does."""

    prompt: str | list[int]
    params: SamplingParams | None = None
    request_id: str | None = None
    count_prompt: bool = True


def refused_request(error: BaseException) -> int:
    """Which of the requests given to `add_requests` its refusal `error` is about (the prompt
    too long, the prompt past the KV it may use): 0 when it is about all of them."""
    return getattr(error, "request_index", 0)


class EngineShutDown(RankFailure):
    """The engine was shut down (`LLMEngine.shutdown`): it takes no more requests or steps.
    A RankFailure, as PoolTorn is, so that a loop still stepping stops as for a lost rank
    rather than retrying a step that cannot run."""

    def __init__(self) -> None:
        RuntimeError.__init__(self, "engine is shut down: it takes no more requests or steps")
        self.rank = -1
        self.reason = "shut down"


def as_token_ids(tokens: object, what: str, vocab: int, too_long: int | None = None) -> list[int]:
    """`tokens` as a list of token ids: ints, or what stands for one (numpy or torch
    integers), each in [0, vocab). Booleans, strings and bytes are not token ids: ValueError
    naming `what`. A list of `too_long` or more is returned unchecked: its caller refuses it
    for its length, without this scan."""
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        raise ValueError(f"{what}: expected a list of int token ids, not {type(tokens).__name__}")
    try:
        items = list(tokens)  # type: ignore[call-overload]  # any iterable, checked below
    except TypeError:
        raise ValueError(
            f"{what}={tokens!r:.60}: expected a string or a list of int token ids"
        ) from None
    if too_long is not None and len(items) >= too_long:
        return items
    ids, wrong = split_ids(items)
    if wrong:
        raise ValueError(f"{what} holds {wrong[:5]!r:.80}: expected a list of int token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return ids


def _encoded_whole(text: str, ids: list[int], limit: int) -> bool:
    """Whether `Tokenizer.encode_within(text, ..., limit)` returned `ids` for all of `text`, so
    that their count is the prompt's: it cuts only a text longer than PREFIX_CHARS x (limit +
    PREFIX_SLACK) characters, and a prefix it returns holds more than limit + PREFIX_SLACK
    tokens."""
    return len(text) <= PREFIX_CHARS * (limit + PREFIX_SLACK) or len(ids) <= limit + PREFIX_SLACK


def speculation(config: EngineConfig) -> Speculation | None:
    """The scheduler's draft settings from the `speculative_*` knobs (None: off)."""
    return Speculation.of(
        config.speculative_tokens,
        config.speculative_ngram,
        config.speculative_max_batch,
        config.speculative_row_cost,
    )


def decode_only(batch: ScheduledBatch) -> bool:
    """Whether every sequence of `batch` computes just its last token (and its drafts)."""
    return all(
        s.num_uncomputed == 1 and n == 1 + len(s.draft)
        for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
    )


def prefill_while_decoding(config: EngineConfig, device: torch.device) -> int | None:
    """The knob, or its device default: on CPU a step's time grows with every prompt token,
    so long prompts go in chunks beside the decodes; a GPU runs big chunks at nearly the cost
    of small ones."""
    if config.prefill_while_decoding is not None:
        return config.prefill_while_decoding
    return CPU_PREFILL_WHILE_DECODING if device.type == "cpu" else None


def check_eos_ids(tokenizer: Tokenizer, mcfg: ModelConfig, path: Path) -> None:
    """A ModelLoadError, before the weights load, for an eos id past the lm_head's columns
    (`token_vocab`: the tokenizer's highest id + 1, at most config.json's vocab_size): no
    answer could end with it, silently, and the grammar library refuses a tokenizer whose eos
    id it does not hold. Refused rather than the head widened to it: an id past the
    tokenizer's is no token the model writes, so its file names the wrong id."""
    head = min(tokenizer.vocab_size, mcfg.vocab_size)
    outside = sorted(i for i in {*tokenizer.eos_token_ids, *mcfg.eos_token_ids} if i >= head)
    if outside:
        raise ModelLoadError(
            f"{path}: eos token ids {outside[:5]} are past the ids the model can write, "
            f"[0, {head}) (the tokenizer's ids end at {tokenizer.vocab_size - 1}, config.json's "
            f"vocab_size is {mcfg.vocab_size}), so no answer could end with them; correct "
            "eos_token_id in config.json and generation_config.json (or eos_token in "
            "tokenizer_config.json) to the model's end-of-text token"
        )


class LLMEngine(ControlSurface):
    """Requests in, outputs out. `step()` = drain the mailbox -> `scheduler.schedule()` ->
    `runner.execute()` -> `scheduler.update()` -> outputs. The engine validates requests,
    detokenises and counts; the scheduler moves sequences, the runner runs the model."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
    ) -> None:
        self.config = config
        self.runner = runner
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.events = EventBus()
        self.mailbox = Mailbox()
        kv = runner.kv_cache
        self.block_manager = BlockManager(
            kv.num_blocks,
            config.block_size,
            caching=config.enable_prefix_caching,
            exact=config.prefix_cache_exact,
        )
        self.host_block_manager = BlockManager(kv.num_host_blocks, config.block_size)
        controller = None
        if config.admission is not None and config.admission.enable:
            controller = AdmissionController(
                config.admission, config.block_size, kv.bytes_per_block
            )
        self.admission_policy = AdmissionPolicy(
            controller, config.block_size, config.enable_prefix_caching
        )
        # offload as configured: on where enabled, unless the device pool is too small to keep
        # swapping worth it (min_gpu_blocks); what disable_cpu_offload and the OOM chain's
        # undo return to (enable_cpu_offload and min_gpu_blocks change only at a restart)
        self.configured_offload = bool(
            config.enable_cpu_offload and kv.num_blocks >= config.min_gpu_blocks
        )
        self.scheduler = Scheduler(
            self.block_manager,
            self.host_block_manager,
            runner,
            self.admission_policy,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            offload=self.configured_offload,
            emit=self.events.emit,
            prefill_while_decoding=prefill_while_decoding(config, runner.device),
            speculation=speculation(config),
            row_cost_prior=ROW_COST_PRIOR.get(runner.device.type, ROW_COST_PRIOR["cuda"]),
            kv_quantized=lambda: self.kv_cache.dtype == "fp8_e4m3",  # no drafts on an FP8 pool
        )
        self.max_model_len = min(config.max_model_len, model_config.max_position_embeddings)
        if config.max_model_len > model_config.max_position_embeddings:
            log.warning(
                "serving.max_model_len %d is more than the model's max_position_embeddings %d: "
                "prompt and output are held to %d tokens",
                config.max_model_len,
                model_config.max_position_embeddings,
                self.max_model_len,
            )
        self.eos_ids = set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids)
        if tokenizer.vocab_size > model_config.vocab_size:
            vocab, extra = model_config.vocab_size, tokenizer.vocab_size - model_config.vocab_size
            past = [tokenizer.id_to_token(vocab + i) for i in range(min(extra, 5))]
            log.warning(
                "the tokenizer has %d tokens but the model's vocabulary (config.json vocab_size) "
                "is %d: a prompt holding the tokenizer's %s is refused",
                tokenizer.vocab_size,
                vocab,
                ", ".join(map(repr, past)) + (f" and {extra - 5} more" if extra > 5 else ""),
            )
        # generation_config.json's sampling defaults (`generation_defaults`), which a server or
        # the CLI applies where a request leaves a field out; the engine's own requests do not
        self.sampling_defaults: dict[str, int | float] = {}
        self.grammars = Grammars(tokenizer, model_config.vocab_size, self.eos_ids)
        self.max_new_tokens_cap: int | None = None
        # the device KV pool held at this share of its configured bytes (set_kv_pool_share)
        self.kv_pool_share = 1.0
        self.configured_batched_tokens = config.max_num_batched_tokens
        # what remedies hold lower than configured until their undo (None: nothing): the batch
        # limit a cut asked for, the step budget an out-of-memory halving left; a reload puts
        # the lower of it and the new configured value in force (`reconfigure`)
        self.batch_cut: int | None = None
        self.budget_cut: int | None = None
        self._seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # aborted/finished outside a step
        self.torn: PoolTorn | None = None  # a pool conversion failed half way: no more steps
        self.shut_down = False  # `shutdown()` ran: no more requests or steps
        # the thread in step(), generate() or score(), and which of them it is in (`_driving`)
        self._drive_lock = threading.Lock()
        self._driver: tuple[threading.Thread, str] | None = None
        self._step_no = 0
        self._counters = {
            "tokens_generated": 0,
            "prompt_tokens": 0,
            "finished": 0,
            "oom": 0,
            "steps_interrupted": 0,
            "steps_ahead": 0,  # decode steps run after another without the host in between
        }
        # set by another thread when a high-priority request is on its way (`interrupt_step`)
        self.interrupt = threading.Event()
        # finish_reason -> priority -> count. Every finish passes through `_count_finish`,
        # aborts (client gone, drain cut) included, so this is the one place that counts them.
        self._finished: dict[str, dict[str, int]] = {}
        self._last_oom = 0.0
        # the repeated faults of an out-of-memory burst (`_on_oom`), on a clock and with a
        # pause that a test may replace (the backoff is real seconds otherwise)
        self._oom = OomRepeats()
        self.oom_clock: Callable[[], float] = time.monotonic
        self.oom_sleep: Callable[[float], object] = time.sleep
        self._ttft: deque[float] = deque(maxlen=256)
        self._tpot: deque[float] = deque(maxlen=256)
        self.latest_snapshot: EngineSnapshot = self.snapshot()

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> LLMEngine:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model(config.model, config.home, progress, config.model_quantization)
        mcfg = ModelConfig.from_dir(path)
        config = within_window(config, mcfg, path / "config.json")
        tokenizer = Tokenizer.from_dir(path)
        check_eos_ids(tokenizer, mcfg, path)
        if config.world_size > 1:
            from kvguard.engine.distributed.driver import TensorParallelRunner

            runner = TensorParallelRunner.launch(config, path, mcfg)
        else:
            runner = ModelRunner.from_config(config, path, mcfg)
        engine = cls(config, runner, mcfg, tokenizer)
        engine.sampling_defaults = generation_defaults(path, engine.max_model_len)
        return engine

    # the runner's parts, as callers (tests, benchmarks, the snapshot) know them
    @property
    def model(self):  # noqa: ANN201 - LlamaForCausalLM
        return self.runner.model

    @property
    def kv_cache(self) -> KVCache:
        return self.runner.kv_cache

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def admission(self) -> AdmissionController | None:
        return self.admission_policy.controller

    @property
    def allow_rank(self) -> int | None:
        return self.admission_policy.allow_rank

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: str | int = "normal",
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
        *,
        count_prompt: bool = True,
    ) -> str:
        """Queue a request. ValueError names what makes it unservable; AdmissionRejected
        (a ValueError) carries the policy's decision and retry hint. `arrival_time` (a
        time.monotonic()) is when the request came, where that was before this call (posted
        through the mailbox while a step ran): its queue time and TTFT count from there.
        None: now. `count_prompt`: as `NewRequest`'s. After `shutdown()`: EngineShutDown (a
        RuntimeError)."""
        new = NewRequest(prompt, params, request_id, count_prompt)
        return self.add_requests([new], priority, add_special_tokens, arrival_time)[0]

    def add_requests(
        self,
        requests: Seq[NewRequest],
        priority: str | int = "normal",
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
    ) -> list[str]:
        """Queue the requests of one client's request (its choices, its prompts) as one: all
        of them or, where one is refused, none. Taken in one by one, a refusal of the k-th
        left the k before it admitted or queued, and aborting them counted as work its
        client gave up on (`abort` finishes, queue waits, its prompt's tokens). Raises as
        `add_request` does; `refused_request(error)` says which request the error is about.
        Returns their ids, in order."""
        if self.shut_down:
            raise EngineShutDown()
        rank = parse_priority(priority)
        seqs = self._new_sequences(requests, rank, add_special_tokens, arrival_time)
        self._admit_all(seqs)
        for seq, new in zip(seqs, requests, strict=True):
            self._taken_in(seq, new.count_prompt)
        return [seq.request_id for seq in seqs]

    def _new_sequences(
        self,
        requests: Seq[NewRequest],
        rank: int,
        add_special_tokens: bool,
        arrival_time: float | None,
    ) -> list[Sequence]:
        """Every request checked and made a Sequence before admission decides any: one that
        cannot be served refuses them all with nothing decided (ValueError, its
        `request_index` set)."""
        seqs: list[Sequence] = []
        ids: set[str] = set()
        for i, new in enumerate(requests):
            try:
                seq = self._new_sequence(new, rank, add_special_tokens, arrival_time, ids)
            except ValueError as e:
                e.request_index = i  # type: ignore[attr-defined]
                raise
            ids.add(seq.request_id)
            seqs.append(seq)
        return seqs

    def _new_sequence(
        self,
        new: NewRequest,
        rank: int,
        add_special_tokens: bool,
        arrival_time: float | None,
        taken_ids: set[str],
    ) -> Sequence:
        """`new` as a Sequence, or the ValueError naming what makes it unservable (an id
        already in use, by the engine or by another of `taken_ids`)."""
        params = self._checked_params(new.params)
        params.validate()  # O(1) in the bias's size once validated (CheckedBias): n=32 shares it
        vocab = self.model_config.vocab_size
        for name, bad in (
            ("logit_bias", params.bias_ids_from(vocab)),
            ("stop_token_ids", sorted(t for t in params.stop_token_ids if t >= vocab)),
        ):
            if bad:
                raise ValueError(
                    f"{name} token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
                )
        self._bias_names_tokens(params)
        limit = self.max_total_len()
        ids = self._prompt_ids(new.prompt, add_special_tokens, limit)
        if params.prompt_logprobs is not None:
            self._prompt_has_logprobs(ids)
        request_id = new.request_id
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r:.60}: expected a string")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._seqs or rid in taken_ids:
            raise ValueError(f"request_id {rid!r} is already in use")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(rid, ids, params, rank, next(self._order), limit, gen)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if params.json_schema is not None or params.grammar is not None:
            seq.grammar = self.grammars.for_params(params)
        if params.logprobs is not None:
            seq.output_logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = []
        return seq

    def _admit_all(self, seqs: list[Sequence]) -> None:
        """Admission decides `seqs` one by one, each queued behind those before it (one
        admitted takes a batch slot and KV, one queued a place in the queue), and where it
        refuses one, every one is withdrawn before any step could start it: AdmissionRejected
        with the request's refusal (`AdmissionPolicy.refuse`), its `request_index` the
        refused one. A request too large for a hard queue bound is refused first, as one
        whose prompt can never fit is, halted or not."""
        policy = self.admission_policy
        taken: list[Sequence] = []
        try:
            if (never := policy.never_fits_all(len(seqs))) is not None:
                raise AdmissionRejected(never)
            for seq in seqs:
                self._check_admission(seq)
                # admission decided (and reserved) on the request's own max_tokens, so lifting
                # a cap gives it back what the ladder allowed; the live cap applies on top
                if self.max_new_tokens_cap is not None:
                    seq.max_tokens = min(seq.max_tokens, self.max_new_tokens_cap)
                self.scheduler.add(seq)  # the next one's decision counts it
                taken.append(seq)
        except AdmissionRejected as e:
            for seq in taken:
                self.scheduler.remove(seq)
            d = policy.refuse(seqs, taken, e.decision)
            self._admission_event(seqs[0], d.decision, d.reason, sequences=len(seqs))
            refusal = AdmissionRejected(d)
            refusal.request_index = len(taken)  # type: ignore[attr-defined]
            raise refusal from None
        policy.count(seqs)

    def _check_admission(self, seq: Sequence) -> None:
        """Admit or queue `seq` (its ticket), or raise AdmissionRejected."""
        self.admission_policy.check(
            seq,
            self.block_manager.num_blocks,
            self.block_manager.num_used,
            # the pool at its configured bytes, in the dtype in force (a remedy may hold it
            # at a share of them for a while)
            self.runner.blocks_for_budget(self.kv_cache.dtype),
        )

    def _taken_in(self, seq: Sequence, count_prompt: bool) -> None:
        """`seq`, queued, is the engine's from now on: known by its id, and counted."""
        self._seqs[seq.request_id] = seq
        d = self.admission_policy.decision(seq)
        if d is not None:
            self._admission_event(seq, d.decision, d.reason)
        if seq.grammar is not None:  # queued: a request admission refused is not counted
            self.grammars.requests += 1
        if count_prompt:
            self._counters["prompt_tokens"] += len(seq.prompt_token_ids)

    def _admission_event(
        self, seq: Sequence, decision: str, reason: str, sequences: int = 1
    ) -> None:
        """One event per decision made: each sequence taken in has its own (`admit` or `queue`),
        a refused request one for all its `sequences` (they are refused as one), so that a
        client looping on n=128 requests does not flood the event ring and its readers with
        128 copies of one refusal. The decision counter still counts every sequence."""
        self.events.emit(
            "admission",
            decision=decision,
            reason=reason,
            priority=seq.priority,
            sequences=sequences,
        )

    def pool_blocks(self, dtype: str) -> int:
        """Device blocks a pool of `dtype` has in the bytes the engine holds now: the
        configured budget, or the share of it a remedy left (set_kv_pool_share), never below
        one max_model_len request (the floor `set_kv_pool_share` keeps: a share taken on a
        narrower dtype's larger pool would otherwise leave too few blocks in a wider one)."""
        full = self.runner.blocks_for_budget(dtype)
        if self.kv_pool_share >= 1.0:
            return full
        floor_n = min(full, self.block_manager.blocks_for(self.max_model_len))
        return max(floor_n, math.floor(full * self.kv_pool_share), 1)

    def _prompt_ids(
        self, prompt: str | list[int], add_special_tokens: bool, limit: int
    ) -> list[int]:
        """The prompt's token ids, refused (ValueError) when empty, outside the vocabulary or
        not shorter than `limit`. The work is bounded by `limit`, not by the prompt: this runs
        on the engine thread, and a text of megabytes tokenized whole would stall every
        request for seconds."""
        if isinstance(prompt, str):  # "" is one token where the tokenizer adds a BOS
            ids, whole = self.tokenizer.encode_within(prompt, add_special_tokens, limit)
            if not whole:
                # the count where the whole text was tokenized (as OpenAI's message names it: a
                # client trimming a conversation learns how far over it is), else a lower bound
                exact = _encoded_whole(prompt, ids, limit)
                n, more = (len(ids), False) if exact else (limit, True)
                raise ValueError(self._too_long(n, limit, more=more))
            if self.tokenizer.vocab_size > self.model_config.vocab_size:
                self._within_model_vocab(ids)
        else:  # a list too long is refused below, without scanning it
            ids = as_token_ids(prompt, "prompt", self.model_config.vocab_size, too_long=limit)
        if not ids:
            raise ValueError("prompt is empty: expected at least one token")
        if len(ids) >= limit:
            raise ValueError(self._too_long(len(ids), limit))
        return ids

    def biasable_ids(self) -> int:
        """How many token ids a `logit_bias` may name: [0, this)."""
        return min(self.tokenizer.vocab_size, self.model_config.vocab_size)

    @staticmethod
    def _checked_params(params: SamplingParams | None) -> SamplingParams:
        """`params`, or the defaults for None. Anything else (a dict of its fields is the
        likely one) is a TypeError that says what to pass, not an AttributeError from deep
        inside the checks."""
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"params={params!r:.60}: expected a SamplingParams (or None for the defaults), "
                f"got {type(params).__name__}; build one with SamplingParams(**fields)"
            )
        return params

    def _bias_names_tokens(self, params: SamplingParams) -> None:
        """A ValueError for a `logit_bias` on ids the model has rows for but the tokenizer no
        token: the padding rows of an embedding rounded up (Qwen2: 151936 rows, 151665
        tokens). Raised, such an id would be generated with no text."""
        tokens = self.biasable_ids()
        if tokens >= self.model_config.vocab_size:
            return
        if bad := params.bias_ids_from(tokens):
            raise ValueError(
                f"logit_bias token ids {bad[:5]} name no token: the tokenizer has {tokens} "
                f"(ids [0, {tokens})), the ids from {tokens} to {self.model_config.vocab_size - 1}"
                " are the model's padding rows"
            )

    def _prompt_has_logprobs(self, ids: list[int]) -> None:
        """A ValueError for prompt log-probabilities of a prompt whose token ids (after the
        first, which has none) hold a padded embedding's rows past the tokenizer's tokens: their
        logits are -inf (`runner.vocab`), so their log-probability would be -inf, which a JSON
        answer cannot carry. Such a prompt is served as ever without them."""
        vocab = self.runner.vocab
        bad = list(dict.fromkeys(t for t in ids[1:] if t >= vocab))
        if bad:
            raise ValueError(
                f"prompt_logprobs: prompt token ids {bad[:5]} name no token (the ids from "
                f"{vocab} to {self.model_config.vocab_size - 1} are the model's padding rows, "
                "which have no log-probability); leave them out of the prompt, or ask for no "
                "prompt log-probabilities"
            )

    def _within_model_vocab(self, ids: list[int]) -> None:
        """A ValueError naming the tokens of a text prompt past the model's vocabulary: tokens
        the tokenizer has added beyond the embedding (found at load, and warned about), which
        the model cannot read."""
        vocab = self.model_config.vocab_size
        bad = list(dict.fromkeys(t for t in ids if t >= vocab))
        if bad:
            shown = ", ".join(f"{self.tokenizer.id_to_token(t)!r} (id {t})" for t in bad[:5])
            raise ValueError(
                f"prompt holds the tokenizer's {shown}, outside the model's vocabulary "
                f"[0, {vocab}): the tokenizer has {self.tokenizer.vocab_size} tokens, the model "
                f"{vocab}; leave such tokens out of the text"
            )

    def max_total_len(self) -> int:
        """Prompt plus output tokens may not exceed this (max_model_len, or the pool's tokens
        if fewer): a prompt must be shorter, so one token fits after it."""
        return min(self.max_model_len, self.block_manager.num_blocks * self.config.block_size)

    def _too_long(self, n: int, limit: int, more: bool = False) -> str:
        """Why a prompt of `n` tokens (`more`: more than that) cannot be served."""
        pool = self.block_manager.num_blocks * self.config.block_size
        size = f"more than {n}" if more else f"{n}"
        if n >= pool and pool <= self.max_model_len:
            need = self.block_manager.blocks_for(n + 1)
            return (
                f"prompt of {size} tokens needs {'at least ' if more else ''}{need} KV blocks but the "
                f"whole pool has {self.block_manager.num_blocks} ({pool} tokens): raise "
                "kv_cache_bytes"
            )
        return (
            f"prompt of {size} tokens leaves no room to generate within max_model_len={limit}: "
            f"shorten it to at most {limit - 1} tokens"
        )

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
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self._count_finish(seq)
        return RequestOutput.take(seq)

    def _outgrown(self, seq: Sequence) -> RequestOutput:
        """A request the scheduler ended with `length` (it outgrew the whole pool,
        `Scheduler._outgrown`): its text made whole and its stop strings applied, as at any
        length limit, counted, and its output handed out."""
        if finish_text(self.tokenizer, seq):
            seq.finish_reason = "stop"
        self._count_finish(seq)
        return RequestOutput.take(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Apply posted actions, run one batch; return outputs of requests that advanced.

        Raises RankFailure (tensor parallel) when a rank died or hung: the engine is done;
        after `shutdown()`, EngineShutDown (one, a RuntimeError saying so); RuntimeError
        while another thread is in a step (`_driving`)."""
        with self._driving("step"):
            return self._step()

    @contextmanager
    def _driving(self, what: str) -> Iterator[None]:
        """Hold the engine for the calling thread while it runs `what` (step, generate,
        score). One thread drives an engine: a second one stepping at the same time would
        schedule and run the same sequences twice, and every request of both steps ended with
        an error. So the second call raises RuntimeError at once, touching nothing, and the
        running step carries on. The thread that holds it may enter again (generate's steps)."""
        me = threading.current_thread()
        held = self._driver
        if held is not None and held[0] is me:
            yield
            return
        if not self._drive_lock.acquire(blocking=False):
            raise RuntimeError(self._busy(what, self._driver))
        try:
            self._driver = (me, what)
            yield
        finally:
            self._driver = None
            self._drive_lock.release()

    @staticmethod
    def _busy(what: str, held: tuple[threading.Thread, str] | None) -> str:
        """Why `what` cannot run now: another thread is in a step (`held`: which, in what;
        None where it has taken the engine and not yet said so)."""
        running = "step() is already running in another thread"
        if held is not None:
            running = f"{held[1]}() is already running in thread {held[0].name!r}"
        return (
            f"{what}() called while {running}; "
            "one thread drives an engine: call step(), generate() and score() from that "
            "thread only (other threads post to engine.mailbox, or serve through an EngineLoop)"
        )

    def _step(self) -> list[RequestOutput]:
        """`step()`, in the thread that holds the engine."""
        if self.shut_down:
            raise EngineShutDown()
        self.interrupt.clear()  # what is posted by now is in this step's drain
        self.mailbox.drain()
        if self.torn is not None:
            raise self.torn
        # The step's outputs gather in `_pending` and leave it only in the return statement:
        # whatever interrupts the step (an exception, Ctrl-C while the snapshot is built),
        # the next step hands them out. Each was taken (`RequestOutput.take` moved its
        # request's cursor on), so one dropped would be an answer never given, or a running
        # request's tokens missing from its stream though its final output has them.
        self._report_oom_repeats()
        self._maybe_restore_budget()
        try:
            batch = self.scheduler.schedule()
        finally:
            # the requests scheduling ended (`Scheduler._outgrown`) answer even where it then
            # raised: their outputs wait in `_pending` for this step's return or the next's
            self._pending += [self._outgrown(seq) for seq in self.scheduler.take_ended()]
        if not batch.empty:
            steps = self._steps_ahead(batch)
            self._pending += self._run(batch, steps)
            self._step_no += steps
        self.latest_snapshot = self.snapshot()
        outputs, self._pending = self._pending, []
        return outputs

    def interrupt_step(self) -> None:
        """A high-priority request was just posted (any thread): the step in flight, unless
        it runs high-priority prompt work itself, stops at its next layer and is redone after
        the request is in, so the high prompt need not wait for a whole step of others' work."""
        if self.config.interrupt_for_high:
            self.interrupt.set()

    def _interruptible(self, batch: ScheduledBatch) -> bool:
        if not self.runner.can_interrupt:
            return False
        # a step that runs a high prompt, or the token a high request's first text waits
        # on, is the one the new arrival would interrupt for
        return not any(
            s.priority == HIGH and (not one_step(s) or awaits_first_text(s)) for s in batch.seqs
        )

    def _steps_ahead(self, batch: ScheduledBatch) -> int:
        """Decode steps `batch` runs back to back (`serving.decode_steps`; see
        `Scheduler.run_ahead`): 1 unless the knob asks for more, the runner can, the batch is
        all decodes and nothing is posted for the engine to apply first."""
        most = self.config.decode_steps
        if most < 2 or not self.runner.can_run_ahead or not decode_only(batch):
            return 1
        if self.mailbox.pending() or self.interrupt.is_set():
            return 1
        return self.scheduler.run_ahead(batch, most)

    def _run(self, batch: ScheduledBatch, steps: int = 1) -> list[RequestOutput]:
        self.runner.step_stop = self.interrupt if self._interruptible(batch) else None
        t0 = time.perf_counter()
        try:
            if steps > 1:
                tokens = self.runner.decode_ahead(batch.seqs, steps)
            else:
                tokens = self.runner.execute(batch.seqs, batch.num_tokens)
        except StepInterrupted:
            # nothing advanced: the batch runs again after the new request, holding the blocks
            # of its computed tokens (those taken for this step's tokens go back: a preemption
            # before then would otherwise swap out blocks that hold nothing)
            self._counters["steps_interrupted"] += 1
            for seq in batch.seqs:
                self.scheduler.bm.trim(seq)
            return []
        except RankFailure:
            raise  # the engine is done: the daemon restarts it, no request is retried here
        except Exception as e:  # noqa: BLE001 - a bug or a poisoned input: stop this step's requests
            if isinstance(e, InjectedOOMError) or is_oom(e):
                self._on_oom(batch, e)
                return []
            return self._fail(batch, e)
        self._oom.backoff = 0.0  # a step ran: the next fault at the floor pauses briefly again
        if steps > 1:
            return self._run_tokens(batch, tokens)
        if self.scheduler.speculation is not None and decode_only(batch):  # a draft row's cost
            self.scheduler.step_cost.observe(sum(batch.num_tokens), time.perf_counter() - t0)
        now = time.monotonic()
        for seq, entries in getattr(self.runner, "prompt_logprobs", None) or ():
            seq.prompt_logprobs.extend(entries)  # the prompt positions it lacked, in order
        # the new tokens' log-probabilities where asked: a list for each entry of `tokens`
        lps = getattr(self.runner, "logprobs", None) or []
        of = {id(seq): lps[i] for i, seq in enumerate(self._sampled(batch))} if lps else {}

        def on_token(seq: Sequence, token: int, i: int) -> None:
            got = of.get(id(seq))
            self._on_token(seq, token, now, got[i] if got else None)

        try:
            done = self.scheduler.update(batch, tokens, on_token)
        except Exception as e:  # noqa: BLE001 - a fault taking the tokens: these requests, not the engine
            return self._salvage(batch, "taking a step's tokens failed", e)
        return [RequestOutput.take(seq) for seq in done]

    def _run_tokens(self, batch: ScheduledBatch, run: RunTokens) -> list[RequestOutput]:
        """Hand a run's tokens over step by step as they come back (on a GPU while its later
        steps still run), each timed when its step was ready. A step whose tokens cannot be
        taken ends the requests still going with an error; those that finished keep theirs."""
        self._counters["steps_ahead"] += len(run) - 1
        try:
            done = self.scheduler.update_ahead(batch, run, self._on_token)
        except Exception as e:  # noqa: BLE001 - as in a single step: these requests, not the engine
            return self._salvage(batch, "a run of decode steps failed", e)
        return [RequestOutput.take(seq) for seq in done]

    def _salvage(self, batch: ScheduledBatch, what: str, error: Exception) -> list[RequestOutput]:
        """After a fault while a step's tokens were taken (`what`): the requests that finished
        keep their answers, the others end with an error (their state may be half advanced), so
        that every client of the step hears the end of its request."""
        outs, failed = [], []
        for s in batch.seqs:
            if not s.is_finished and s.finish_reason is not None:  # its answer was complete
                self.scheduler.finish(s)
            if s.is_finished:
                outs.append(RequestOutput.take(s))
            else:
                outs.append(self._end(s, "error"))
                failed.append(s.request_id)
        self._step_failed(
            f"{what}; its {counted(len(failed), 'unfinished request')}", error, failed
        )
        return outs

    @staticmethod
    def _sampled(batch: ScheduledBatch) -> list[Sequence]:
        """The step's sequences that get tokens (their last token runs), in batch order."""
        return [
            s for s, n in zip(batch.seqs, batch.num_tokens, strict=True) if finishes_prompt(s, n)
        ]

    def _fail(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """End a failed step's requests with finish_reason `error` and free their blocks.

        Retrying the same batch would fail the same way, step after step, and stall every
        request behind it; ending these few keeps the engine serving everyone else."""
        outs = [self._end(seq, "error") for seq in batch.seqs if not seq.is_finished]
        failed = [o.request_id for o in outs]
        self._step_failed(
            f"engine step failed; its {counted(len(failed), 'request')}", error, failed
        )
        return outs

    def _step_failed(self, what: str, error: Exception, failed: list[str]) -> None:
        """Log the fault with the ids of the requests it ended (the daemon's are those its
        clients hold: `<response id>-<choice>`), so that a client's 500 can be matched to its
        traceback, and emit `engine_step_failed` (audited) naming them all."""
        ends = "ends" if len(failed) == 1 else "end"
        log.error("%s %s with an error: %s", what, ends, listed(failed) or "none", exc_info=error)
        self.events.emit(
            "engine_step_failed", error=f"{type(error).__name__}: {error}", failed=failed
        )

    def _on_token(
        self, seq: Sequence, token: int, now: float, logprob: TokenLogprob | None = None
    ) -> None:
        if seq.output_logprobs is not None and logprob is not None:
            seq.output_logprobs.append(logprob)
        seq.forced = 0  # a drawn token: the tokens forced before it are computed
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._ttft.append(now - seq.arrival_time)
        elif seq.last_token_time is not None:
            self._tpot.append(now - seq.last_token_time)
        seq.last_token_time = now
        self._counters["tokens_generated"] += 1
        grammar_ok = seq.grammar is None or seq.grammar.advance(token)
        append_token(self.tokenizer, seq, token, self.eos_ids)
        if seq.grammar is not None and seq.finish_reason in (None, "length"):
            if not grammar_ok:  # the library gave up on it (a schema past its parser's limits)
                log.warning("request %s left its grammar: %s", seq.request_id, seq.grammar.error)
                seq.finish_reason, seq.error = "error", seq.grammar.error
            else:
                whole = seq.finish_reason is not None or self._jump_forward(seq)
                if whole and seq.finish_reason in (None, "length") and seq.grammar.complete:
                    # the JSON is closed and nothing may follow: complete, even where its
                    # last token was the last max_tokens allowed
                    seq.finish_reason, seq.truncated = "stop", False
        if seq.finish_reason is not None:
            self._count_finish(seq)

    def _jump_forward(self, seq: Sequence) -> bool:
        """Append the tokens `seq`'s grammar forces after the one just drawn (structured.py);
        the next step computes them with it, as the decode rows of one step (`seq.forced`,
        `Sequence.decoding`). Not for a request that asks for log-probabilities (a forced
        token has none) or once it is finished. False where the request ended before the last
        of them (max_tokens, the length limit, a stop string): the grammar has taken them all,
        so its `complete` no longer speaks for the text.

        A seeded sampled request's generator spends the draw each forced token would have
        taken drawn (one a token, as speculative rows keep it): its seed makes the same draws
        whether they are forced or drawn (log-probabilities asked, jump-forward off), and so the
        same tokens where the chunk's logits are those of one-token steps: its rows are decode
        rows (their GEMM kernel, each attending alone), so they are to the bit but where decode
        attention splits a long sequence over the threads or reads blocks several rows share
        once otherwise than those steps did (structured.py)."""
        if not self.config.grammar_jump_forward or seq.grammar is None:
            return True
        if seq.output_logprobs is not None or seq.prompt_logprobs is not None:
            return True
        forced = seq.grammar.forced()
        draws = seq.generator is not None and not seq.params.greedy
        for i, token in enumerate(forced):
            self._counters["tokens_generated"] += 1
            if draws:
                spend_draws(seq.generator, 1)
            append_token(self.tokenizer, seq, token, self.eos_ids)
            seq.forced += 1
            if seq.finish_reason is not None:  # max_tokens, the length limit, a stop string
                return i == len(forced) - 1
        return True

    def _count_finish(self, seq: Sequence) -> None:
        self._counters["finished"] += 1
        by_priority = self._finished.setdefault(seq.finish_reason or "unknown", {})
        name = PRIORITY_NAMES[seq.priority]
        by_priority[name] = by_priority.get(name, 0) + 1
        self._seqs.pop(seq.request_id, None)

    # -- out-of-memory safety -------------------------------------------------------------
    def inject_oom(self, times: int = 1) -> None:
        """Test hook: the next `times` forward passes fail as if the device ran out of memory."""
        self.runner.inject_oom(times)

    def _on_oom(self, batch: ScheduledBatch, error: BaseException) -> None:
        """Put the step's sequences back to recompute, halve the batch budget, tell listeners.

        A fault that halves the budget is reported on its own (a warning, `engine_oom`), and so
        is the first of a burst. One that finds the budget at its floor, nothing left to halve,
        is retried after a pause (`OomRepeats.next_backoff`); those of a burst that follow are
        counted and reported once per OOM_REPORT_EVERY_S (`_report_oom_repeats`)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        before = self.scheduler.requeue_failed_step(batch)
        self._counters["oom"] += 1
        self._last_oom = time.monotonic()
        after = self._hold_step_budget(self.scheduler.max_num_batched_tokens)
        ids = [s.request_id for s in batch.seqs]
        now = self.oom_clock()
        at_floor = after >= before
        if at_floor and self._oom.in_burst(now):
            self._oom.add(now, str(error), ids, after)
        else:
            self._report_oom_repeats(force=True)  # those before it come first
            self._oom.opened(now)
            log.warning(
                "out of memory in a step (%s): %d sequences requeued, batch budget %d -> %d",
                error,
                len(ids),
                before,
                after,
            )
            self.events.emit(
                "engine_oom",
                error=str(error),
                requeued=ids,
                max_num_batched_tokens_before=before,
                max_num_batched_tokens_after=after,
            )
        if at_floor:
            self.oom_sleep(self._oom.next_backoff())

    def _report_oom_repeats(self, force: bool = False) -> None:
        """Report the faults at the floor budget counted since the burst's last report, once
        OOM_REPORT_EVERY_S has passed (`force`: now, before a fault reported on its own): one
        warning and one `engine_oom_repeated` event (audited, and the OOM rules evaluated on it,
        as on `engine_oom`) with the count and the first SHOWN_IDS requests requeued."""
        now = self.oom_clock()
        rep = self._oom
        if not (rep.count and (force or rep.due(now))):
            return
        window = now - (rep.reported or now)
        requeued = list(rep.requeued)
        log.warning(
            "out of memory in %d more steps in the last %.0fs (%s): %d sequence requeues "
            "(%s), batch budget held at %d; each step retried after a pause of up to %gs",
            rep.count,
            window,
            rep.error,
            rep.requeues,
            ", ".join(requeued) + (" and others" if rep.unlisted else ""),
            rep.budget,
            OOM_BACKOFF_MAX_S,
        )
        self.events.emit(
            "engine_oom_repeated",
            error=rep.error,
            count=rep.count,
            window_s=round(window, 3),
            requeues=rep.requeues,
            requeued=requeued,
            requeued_unlisted=rep.unlisted,
            max_num_batched_tokens=rep.budget,
        )
        rep.taken(now)

    def _maybe_restore_budget(self) -> bool:
        """Double the halved step budget after every quiet period, until it is back at the
        configured value of the time (which a reload may have set at or below it). Emits
        `step_budget_restored` (audited: the incident's timeline shows the budget coming back);
        returns whether the budget in force changed."""
        cut = self.budget_cut
        quiet = self.config.oom_quiet_period_s
        if cut is None or time.monotonic() - self._last_oom < quiet:
            return False
        cur = self.scheduler.max_num_batched_tokens
        cut *= 2
        new = self._hold_step_budget(None if cut >= self.configured_batched_tokens else cut)
        self._last_oom = time.monotonic()
        if new == cur:
            return False
        self.events.emit(
            "step_budget_restored",
            max_num_batched_tokens_before=cur,
            max_num_batched_tokens_after=new,
            quiet_period_s=quiet,
            configured=self.configured_batched_tokens,
        )
        return True

    def budget_restore_in(self) -> float | None:
        """Seconds until the halved step budget is due to double back (0: due now), None
        while no out-of-memory halving holds it. An idle engine runs no step: its loop waits
        no longer than this, so that the budget comes back on time without traffic."""
        if self.budget_cut is None:
            return None
        due = self._last_oom + self.config.oom_quiet_period_s
        return max(0.0, due - time.monotonic())

    def restore_budget_when_due(self) -> bool:
        """The budget's doubling of a step (`_maybe_restore_budget`) for an idle engine, on
        the engine thread; what it changed is published in the snapshot at once (the metrics
        and the rules read that, and an idle engine rebuilds it only now and then). The last
        out-of-memory faults counted are reported here too when due: no step comes to."""
        self._report_oom_repeats()
        if not self._maybe_restore_budget():
            return False
        self.latest_snapshot = self.snapshot()
        return True

    # -- convenience ----------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str] | Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: str | int = "normal",
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order.

        All or nothing: a prompt refused (ValueError), or any exception while they run, aborts
        the requests this call added before it re-raises, so none is left queued for a caller
        that never got its id. Requests added before with `add_request` keep running: their
        outputs of the steps this call ran are returned by the next `step()`, in order.
        RuntimeError, adding nothing, while another thread is in a step (`_driving`)."""
        with self._driving("generate"):
            return self._generate(prompts, params, priority, add_special_tokens)

    def _generate(
        self,
        prompts: Seq[str] | Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None,
        priority: str | int,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        """`generate()`, in the thread that holds the engine."""
        if isinstance(prompts, str):
            prompts = [prompts]
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        rids: list[str] = []
        final: dict[str, RequestOutput] = {}
        # every output of the steps this call ran, in order, kept whole (one statement adds a
        # step's list) so that an interrupt while they are sorted loses none of the outputs
        # that other callers' next step() hands out
        outs: list[RequestOutput] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
                rids.append(self._add_prompt(i, p, sp, priority, add_special_tokens))
            mine = set(rids)
            while len(final) < len(rids):
                if not self.has_unfinished():
                    missing = [r for r in rids if r not in final]
                    raise RuntimeError(f"generate: {missing} ended without a final output")
                seen = len(outs)
                outs += self.step()
                final.update(
                    (o.request_id, o) for o in outs[seen:] if o.request_id in mine and o.finished
                )
        except BaseException:
            self._abandon(rids)
            raise
        finally:
            added = set(rids)
            self._pending[:0] = [o for o in outs if o.request_id not in added]
        return [final[r] for r in rids]

    def _add_prompt(
        self,
        index: int,
        prompt: str | list[int],
        params: SamplingParams | None,
        priority: str | int,
        add_special_tokens: bool,
    ) -> str:
        """`add_request` for `generate`'s prompt `index`: a refusal names the prompt (in a
        batch of hundreds, "prompt is empty" alone does not say which), keeping its type and
        attributes (AdmissionRejected's `decision`); `prompt_index` carries the index."""
        try:
            return self.add_request(prompt, params, None, priority, add_special_tokens)
        except ValueError as e:
            e.args = (f"prompts[{index}]: {e}", *e.args[1:])
            e.prompt_index = index  # type: ignore[attr-defined]
            raise

    def _abandon(self, rids: list[str]) -> None:
        """Abort the requests a failed `generate` added, their outputs dropped: the caller
        never got their ids. Best effort: the error that failed the call is the one raised."""
        for rid in rids:
            try:
                self.abort(rid)
            except Exception:
                log.exception("generate: aborting %s after a failed call failed", rid)
        dropped = set(rids)
        self._pending = [o for o in self._pending if o.request_id not in dropped]

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits `[len, vocab]` at every position of `token_ids`: the tokenizer's ids
        (`runner.vocab`; the step's logits have a padded embedding's rows past them too, at
        -inf, which name no token and would only hand a caller -inf columns), run through the
        paged cache
        (exact over the whole vocabulary where the lm_head's are exact only at each row's best,
        as returned log-probabilities are: `ModelRunner.exact_logits`).

        Teacher forcing for quality checks (e.g. FP8 KV against full precision): the tokens are
        prefilled chunk by chunk, exactly like a request, into blocks freed afterwards.
        ValueError when `token_ids` is empty, holds ids outside the vocabulary or is longer
        than max_model_len (the model has no positions past it); RuntimeError while another
        thread is in a step (`_driving`).
        """
        with self._driving("score"):
            return self._score(token_ids)

    def _score(self, token_ids: list[int]) -> torch.Tensor:
        """`score()`, in the thread that holds the engine."""
        if self.shut_down:
            raise EngineShutDown()
        ids = as_token_ids(token_ids, "score", self.model_config.vocab_size)
        if not ids:
            raise ValueError("score: token_ids is empty: expected at least one token")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"score: {len(ids)} token ids are more than max_model_len={self.max_model_len}"
            )
        seq = Sequence("__score__", ids, SamplingParams(), 0, -1, len(ids) + 1)
        chunk = self.scheduler.max_num_batched_tokens
        if not self.block_manager.can_allocate(self.block_manager.blocks_for(len(ids))):
            raise RuntimeError("score: not enough free KV blocks; call it while the engine is idle")
        logits = []
        try:
            while seq.num_computed_tokens < len(ids):
                n = min(chunk, len(ids) - seq.num_computed_tokens)
                self.block_manager.allocate(seq, n)
                logits.append(self.runner.logits([seq], [n], every_row=True))
                seq.num_computed_tokens += n
        finally:
            self.block_manager.free(seq)
        return torch.cat(logits)[:, : self.runner.vocab].contiguous()

    def snapshot(self) -> EngineSnapshot:
        """What other threads read of the engine, made on the engine thread after what
        changed it; admission's queue, which a request posted now would join, is published
        with it (`AdmissionPolicy.publish_queue`)."""
        self.admission_policy.publish_queue()
        return build_snapshot(self)

    def audit_blocks(self) -> None:
        """Assert exact block accounting on both tiers (tests call it between steps)."""
        self.scheduler.audit()

    def shutdown(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel workers). The
        engine takes no requests or steps after it (EngineShutDown), and no step will run
        what waits in its mailbox: those calls' Futures fail with it now (`_post`)."""
        self.shut_down = True
        self.mailbox.refuse_pending(EngineShutDown)
        self.runner.shutdown()

    def _post(self, fn: Callable[[], Any]) -> Future:
        """Post `fn` for the engine thread's next step. After `shutdown()` no step comes, and
        a Future that never resolved would hang its caller: it fails at once with
        EngineShutDown. Checked after the post, as shutdown() sets its flag before it refuses
        what waits, so that a post racing it is refused by one or the other."""
        fut = self.mailbox.post(fn)
        if self.shut_down:
            self.mailbox.refuse_pending(EngineShutDown)
        return fut

    def check_ranks(self) -> None:
        """RankFailure if a tensor-parallel rank has died (cheap; an idle loop calls it, so a
        dead rank is noticed without traffic), or PoolTorn once a pool conversion failed
        half way, or EngineShutDown after `shutdown()`."""
        if self.shut_down:
            raise EngineShutDown()
        if self.torn is not None:
            raise self.torn
        self.runner.check_alive()
