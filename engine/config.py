"""Engine configuration: every knob the engine reads at start-up, validated once."""

from __future__ import annotations

import functools
import ipaddress
import numbers
import os
import re
import socket
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvguard.engine.admission import AdmissionConfig
from kvguard.engine.knobs import ConfigError, MiB, check_knobs, knob, knob_fields

__all__ = ["KV_DTYPES", "ConfigError", "EngineConfig", "kvguard_home", "parse_bytes"]

KV_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8_e4m3")
# How checkpoint weights are served (kvguard.engine.weights reads the checkpoint's own format);
# declared here, torch-free, because the daemon's config loader validates the knob
QUANTIZATION_CHOICES = ("auto", "none", "awq_4bit", "gptq_4bit", "gguf")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}

# No engine holds a million sequences in one batch: above it a typo (the rules' ceiling too)
MAX_NUM_SEQS = 1 << 20


def parse_bytes(value: int | str, name: str = "size") -> int:
    """Accept 268435456, '256MiB', '1.5GiB', '512 MB'."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([kmg]i?b|b)?", str(value).strip().lower().replace(" ", ""))
    if m is None:
        raise ConfigError(
            f"{name}={value!r}: cannot read as a size, expected e.g. 268435456, '256MiB', '2GiB'"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


# A field's annotated type -> (the values it takes, how an error message names them). A bool
# is an int in Python, so True is no count; and "false" would be a truthy string.
_TYPE_CHECKS: dict[type, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "a bool (True or False)"),
    int: (_is_int, "an int"),
    float: (_is_number, "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


@functools.cache
def _typed_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """(name, type, None allowed) for each top-level field of `cls` annotated `T` or
    `T | None` with T one of `_TYPE_CHECKS`; other fields (sizes, nested configs, lists)
    have their own checks."""
    out = []
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1 and kinds[0] in _TYPE_CHECKS:
            out.append((name, kinds[0], len(kinds) < len(args)))
    return tuple(out)


def check_types(config: Any) -> None:
    """Refuse the first field whose value is not of its annotated type, naming the field and
    the type: a config built in Python is not typed by the file loader, and a wrong type
    otherwise fails later with a TypeError naming no field, or passes quietly (4.5 sequences,
    `enable_prefix_caching="false"` keeping the cache on). Integers of other libraries
    (numpy) become ints."""
    for name, kind, optional in _typed_fields(type(config)):
        value = getattr(config, name)
        if value is None and optional:
            continue
        ok, expected = _TYPE_CHECKS[kind]
        if not ok(value):
            allowed = " or None" if optional else ""
            raise ConfigError(
                f"{name}={value!r:.60}: expected {expected}{allowed}, got {type(value).__name__}"
            )
        if kind is int and type(value) is not int:
            setattr(config, name, int(value))


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback one."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_network(host: str, allow_network: bool, who: str) -> None:
    """Refuse a non-loopback address unless the operator allowed network traffic."""
    if not allow_network and not is_loopback(host):
        raise ConfigError(
            f"{who}={host!r} is not a loopback address: torch.distributed traffic is not "
            "authenticated, so kvguard uses a network interface only when told to: "
            "serving.distributed.allow_network: true in the daemon's config, --allow-network "
            "for kvguard worker (that traffic belongs on a private network)"
        )


@dataclass(slots=True, frozen=True, kw_only=True)
class DistributedConfig:
    """Ranks on other hosts (`kvguard worker`) and where they meet the daemon (the config
    file's `serving.distributed`). With no remote ranks every rank is a local worker process
    and nothing listens on any port."""

    remote_ranks: tuple[int, ...] = ()  # world ranks run by `kvguard worker` on other hosts
    master_addr: str = "127.0.0.1"  # the rendezvous listens here, and only here
    master_port: int = 0  # 0: any free port (logged); a multi-node deployment fixes one
    interface: str = "lo"  # gloo's (and NCCL's) socket interface on this host
    allow_network: bool = False  # a non-loopback master_addr is refused without it
    join_timeout_s: float = 600.0  # how long the daemon waits for its remote ranks
    authkey_file: Path | None = None  # the shared secret each remote rank must prove it holds

    def validate(self, world_size: int, tp_size: int = 1) -> None:
        ranks = list(self.remote_ranks)
        bad = [r for r in ranks if not 0 < r < world_size]
        if bad or len(set(ranks)) != len(ranks):
            raise ConfigError(
                f"distributed.remote_ranks={ranks}: expected distinct ranks in 1..{world_size - 1} "
                f"(rank 0 is the daemon; the world is tensor_parallel x pipeline_parallel)"
            )
        for first in range(0, world_size, tp_size):  # a stage's tensor-parallel group
            group = set(range(first, first + tp_size))
            if group & set(ranks) and not group <= set(ranks):
                raise ConfigError(
                    f"distributed.remote_ranks={ranks}: the tensor-parallel group of ranks "
                    f"{first}..{first + tp_size - 1} would span hosts (its all-reduces need one "
                    "host's links): list all of its ranks or none"
                )
        if ranks:
            check_network(self.master_addr, self.allow_network, "distributed.master_addr")
            if self.authkey_file is None:
                raise ConfigError(
                    "distributed.authkey_file is required with remote ranks: each must prove "
                    "it holds that secret before the daemon reads a byte from it"
                )


def kvguard_home() -> Path:
    """Cache root for fetched and converted models ($KVGUARD_HOME, default ~/.cache/kvguard)."""
    return Path(os.environ.get("KVGUARD_HOME") or Path.home() / ".cache" / "kvguard")


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """Every knob the engine reads at start-up.

    Fields declared with `knob()` are the operator's: the daemon's config file offers each one
    in its section, named and bounded as declared here (see kvguard.engine.knobs). The rest are
    for library use: tests, benchmarks and the environment. Field order is the order the
    config file lists them in.
    """

    model: str = knob(
        "smollm2-135m",
        section="serving",
        min_length=1,
        doc="a known name (`kvguard model list`), a Hugging Face directory or a .gguf file",
    )
    device: str = knob("auto", section="serving", kind="device", doc="auto | cpu | cuda | cuda:N")
    dtype: str = knob(
        "auto",
        section="serving",
        choices=("auto", "fp32", "fp16", "bf16"),
        doc="model compute dtype: auto is fp32 on CPU, bf16 on CUDA",
    )
    kv_cache_bytes: int | str = knob(
        256 * MiB,
        section="serving",
        live=True,
        kind="size",
        gt=0,
        doc=(
            "the KV budget on CPU, of each rank (several ranks hold up to world size times it; "
            "CUDA sizes the pool from gpu_memory_utilization)"
        ),
    )
    gpu_memory_utilization: float = knob(
        0.85,
        section="serving",
        gt=0.0,
        le=1.0,
        doc="share of GPU memory kvguard may use; the KV pool is sized after profiling",
    )
    block_size: int = knob(16, section="serving", choices=(8, 16, 32, 64), doc="tokens per block")
    max_num_seqs: int = knob(
        32, section="serving", live=True, ge=1, le=MAX_NUM_SEQS, doc="sequences in one batch"
    )
    max_model_len: int = knob(4096, section="serving", ge=1, doc="prompt + output tokens")
    kv_cache_dtype: str = knob(
        "auto",
        section="serving",
        choices=KV_DTYPES,
        doc="KV element type; auto follows dtype. Rules may switch it live",
    )
    enable_chunked_prefill: bool = knob(
        True, section="serving", doc="split long prompts over steps (else one step holds a prompt)"
    )
    enable_prefix_caching: bool = knob(
        True,
        section="serving",
        doc="keep computed prompt blocks for reuse: a request whose prompt begins with the "
        "same full blocks (a shared system prompt, an earlier turn) skips computing them; "
        "cached blocks count as free and are overwritten least recently used first",
    )
    prefix_cache_exact: bool = knob(
        False,
        section="serving",
        doc="serve from the prefix cache only blocks holding the bits the request computes "
        "cold (blocks prompts of its length class computed), so a seeded request gets the same "
        "log-probabilities however its prefix got into the cache (packed weights; with weights "
        "torch's GEMM multiplies, tiny or model_quantization none, the few tokens computed "
        "after a hit take other GEMM kernels than the cold prompt's: up to ~2e-5 apart, and "
        "a sampled token can turn); false (default) also serves "
        "blocks an earlier request wrote as it decoded (a follow-up chat turn skips the "
        "previous answer too) or, on AMX CPUs, a prompt of the other length class computed: "
        "log-probabilities ~1e-3 from a cold run's, a sampled token rarely",
    )
    max_num_batched_tokens: int = knob(
        2048,
        section="serving",
        live=True,
        ge=1,
        doc="tokens one step may process, prefill and decode",
    )
    prefill_while_decoding: int | None = knob(
        None,
        section="serving",
        live=True,
        ge=1,
        doc="prompt tokens a step may run while other sequences decode, times the prompts "
        "that could start per decode, rounded up (bounds the decodes' inter-token latency and "
        "a new request's wait; one decode does not hold a burst of queued prompts to it); "
        "unset: 128 on CPU, no extra bound on CUDA",
    )
    grammar_jump_forward: bool = knob(
        True,
        section="serving",
        live=True,
        doc="tokens a request's grammar forces (a schema's keys and punctuation, a tool call's "
        "frame) are appended at once and computed in one chunk, not drawn a step each",
    )
    interrupt_for_high: bool = knob(
        True,
        section="serving",
        live=True,
        doc="a high-priority arrival interrupts the step in flight between two layers (its "
        "work is redone next step) so the high prompt starts at once; one process only",
    )
    decode_steps: int = knob(
        1,
        section="serving",
        live=True,
        ge=1,
        le=16,
        doc="decode steps run back to back without the host in between (each step's tokens "
        "feed the next on the device; the host takes them while the later steps run): the "
        "host's per-step work is paid once a run and a GPU is not left idle by it. Only while "
        "every sequence is greedy or sampled with only a temperature, without penalties, "
        "grammar or log-probabilities, and nothing is queued but on a full batch (a run then "
        "ends where the first sequence reaches max_tokens); a new request waits at most the "
        "run. 1 is off",
    )
    speculative_tokens: int = knob(
        0,
        section="serving",
        live=True,
        ge=0,
        le=16,
        doc="speculative decoding by prompt lookup: at most this many draft tokens a decode "
        "step, copied from where the request's last tokens occurred before in its prompt or "
        "output, verified in the same step (greedy output unchanged, sampled output from the "
        "same distribution); 0 turns it off",
    )
    speculative_ngram: int = knob(
        3,
        section="serving",
        live=True,
        ge=1,
        le=8,
        doc="the longest run of last tokens a draft is looked up by (shorter runs down to 2 "
        "are tried next)",
    )
    speculative_max_batch: int = knob(
        16,
        section="serving",
        live=True,
        ge=1,
        doc="no drafts while more sequences than this decode at once; below it a draft "
        "position runs only where it pays for its row (speculative_row_cost)",
    )
    speculative_row_cost: float | None = knob(
        None,
        section="serving",
        live=True,
        ge=0.0,
        le=100.0,
        doc="what one more row of a decode step costs over the step's fixed part: a draft "
        "position runs only where its chance of bringing a token pays for its row; unset: "
        "learnt from the engine's own decode steps; 0 drafts as far as speculative_tokens "
        "allows whenever a match is found",
    )
    tensor_parallel: int = knob(
        1,
        section="serving",
        ge=1,
        doc="ranks the model is split over (one GPU each on CUDA, worker processes on CPU)",
    )
    tensor_parallel_timeout_s: float = knob(
        20.0,
        section="serving",
        key="tensor_parallel_timeout",
        kind="duration",
        gt=0.0,
        doc="a rank that does not answer a step within this is declared failed (keep it below "
        "WatchdogSec); start-up has its own 10-minute limit. Between pipeline stages on the "
        "CPU it bounds how long no stage shows it is computing, not how long a step takes",
    )
    pipeline_parallel: int = knob(
        1,
        section="serving",
        ge=1,
        doc="pipeline stages: the decoder layers split into this many contiguous stages, each "
        "a tensor-parallel group (world = tensor_parallel x pipeline_parallel ranks)",
    )
    pipeline_layers: list[int] | None = knob(
        None,
        section="serving",
        doc="decoder layers per stage, first stage first (one entry per stage, summing to the "
        "model's layer count); unset: an even split, earlier stages taking any remainder",
    )
    pipeline_micro_batches: int | None = knob(
        None,
        section="serving",
        ge=1,
        doc="micro-batches a pipeline step's batch is split into, so stages compute at once; "
        "unset: pipeline_parallel; 1: stages take turns",
    )
    num_threads: int | None = knob(
        None, section="serving", ge=1, doc="torch intra-op threads on CPU; unset: torch's default"
    )
    cuda_graphs: bool = knob(
        True,
        section="serving",
        doc="replay decode steps as CUDA graphs padded to batch-size buckets (CUDA with Triton, "
        "one rank, non-FP8 KV; ignored elsewhere); an H200 run gave equal tokens and 5-7x decode",
    )
    num_gpu_blocks: int | None = knob(
        None,
        section="serving",
        ge=1,
        doc="fix the KV pool at this many blocks instead of sizing it from the budget",
    )
    oom_quiet_period_s: float = knob(
        10.0,
        section="serving",
        live=True,
        key="oom_quiet_period",
        kind="duration",
        gt=0.0,
        doc="an OOM halves the step's token budget; it doubles back once per quiet period",
    )
    enable_cpu_offload: bool = knob(
        False,
        section="offloading",
        doc="swap preempted sequences' KV to a host pool instead of recomputing them",
    )
    cpu_cache_ratio: float = knob(
        0.4,
        section="offloading",
        ge=0.0,
        lt=1.0,
        doc="the host pool holds at most this share of all KV (seed §7.2)",
    )
    min_gpu_blocks: int = knob(
        0,
        section="offloading",
        ge=0,
        # Serving baselines keep 512 hot blocks on the GPU (seed §7.2); library callers that
        # enable offload on a small test pool expect it to swap.
        file_default=512,
        doc="below this device pool size preemption recomputes instead of swapping (an FP8 "
        "pool still swaps while the host pool has room: a recompute there can change a greedy "
        "answer)",
    )
    model_quantization: str = knob(
        "auto",
        section="quantization",
        choices=QUANTIZATION_CHOICES,
        doc="auto serves the checkpoint's own format (a GGUF's Q4/Q8 weights and AWQ, GPTQ, "
        "compressed-tensors 4-bit kept packed); none serves a GGUF dequantised to fp32; "
        "awq_4bit, gptq_4bit and gguf insist on that format and refuse another checkpoint",
    )
    cpu_activations: str = knob(
        "int16",
        section="quantization",
        choices=("int16", "int8"),
        doc="packed weights on CPU (kvguard's C kernels): activations quantised per block of "
        "32 to int16, or not quantised at all (fp32 panels) for prompt rows and for decode rows "
        "from 16 decoding sequences (the default model agrees 100% top-1 with fp32, "
        "teacher-forced), or int8 at any batch (as OpenVINO and "
        "llama.cpp do on AVX2: measured here, 1.2x the batch-32 decode and the mixed trace; "
        "97.6% teacher-forced top-1 agreement on the default model)",
    )
    admission: AdmissionConfig | None = None  # None: accept every valid request (library use)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    home: Path = field(default_factory=kvguard_home)  # $KVGUARD_HOME: the unit file sets it

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):  # a model directory as a Path: its text
            self.model = os.fspath(self.model)
        self.kv_cache_bytes = parse_bytes(self.kv_cache_bytes, "kv_cache_bytes")
        self.home = Path(self.home)
        self.validate()

    def validate(self) -> None:
        """Each field against its type and its knob's declaration, then the rules that tie
        knobs together."""
        check_types(self)
        check_knobs(self)
        self._check_pipeline_layers()
        self.distributed.validate(self.world_size, self.tensor_parallel)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len="
                f"{self.max_model_len}: without chunked prefill a whole prompt must fit one step"
            )

    def _check_pipeline_layers(self) -> None:
        """The override's shape; whether it covers the model is checked once the model is
        known (`kvguard.engine.distributed.sharding.stage_layers`)."""
        layers = self.pipeline_layers
        if layers is None:
            return
        if not isinstance(layers, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in layers
        ):
            raise ConfigError(f"pipeline_layers={layers!r}: expected a list of layer counts")
        if len(layers) != self.pipeline_parallel:
            raise ConfigError(
                f"pipeline_layers={layers}: {len(layers)} stages given but pipeline_parallel="
                f"{self.pipeline_parallel} (expected one layer count per stage)"
            )
        if any(n < 1 for n in layers):
            raise ConfigError(
                f"pipeline_layers={layers}: every stage needs at least one decoder layer"
            )

    @property
    def world_size(self) -> int:
        """Ranks of the whole engine: a tensor-parallel group per pipeline stage."""
        return self.tensor_parallel * self.pipeline_parallel


# The knobs a reload (SIGHUP) applies to a running engine (`LLMEngine.reconfigure`); the rest
# take effect at the next start.
LIVE_KNOBS = frozenset(k.path for k in knob_fields(EngineConfig) if k.knob.live)
