"""Engine configuration: every knob the engine reads at start-up, validated once."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvguard.engine.admission import AdmissionConfig

KV_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8_e4m3")
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


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what was expected."""


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


def kvguard_home() -> Path:
    """Cache root for fetched and converted models ($KVGUARD_HOME, default ~/.cache/kvguard)."""
    return Path(os.environ.get("KVGUARD_HOME") or Path.home() / ".cache" / "kvguard")


@dataclass(slots=True)
class EngineConfig:
    model: str = "smollm2-135m"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = (
        "auto"  # model compute dtype: auto (fp32 on CPU, bf16 on CUDA) | fp32 | fp16 | bf16
    )
    kv_cache_dtype: str = "auto"  # auto follows dtype
    kv_cache_bytes: int | str = "256MiB"  # KV budget on CPU
    gpu_memory_utilization: float = 0.85  # KV budget on CUDA, after profiling
    num_gpu_blocks: int | None = None  # override the computed pool size (tests, benchmarks)
    block_size: int = 16
    max_num_seqs: int = 32
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_cpu_offload: bool = False  # swap preempted sequences to a host pool
    cpu_cache_ratio: float = 0.4  # host pool holds at most this share of all KV (seed §7.2)
    min_gpu_blocks: int = 0  # below this device pool size preemption recomputes instead
    admission: AdmissionConfig | None = None  # None: accept every valid request (library use)
    oom_quiet_period_s: float = 10.0  # after an OOM, the batch budget doubles back per quiet period
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    home: Path = field(default_factory=kvguard_home)

    def __post_init__(self) -> None:
        self.kv_cache_bytes = parse_bytes(self.kv_cache_bytes, "kv_cache_bytes")
        self.home = Path(self.home)
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected {expected}")

        need(self.dtype in ("auto", "fp32", "fp16", "bf16"), "dtype", "auto|fp32|fp16|bf16")
        need(self.kv_cache_dtype in KV_DTYPES, "kv_cache_dtype", "|".join(KV_DTYPES))
        need(self.block_size in (8, 16, 32, 64), "block_size", "8, 16, 32 or 64")
        need(self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1")
        need(self.max_model_len >= 1, "max_model_len", "an integer >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "an integer >= 1")
        need(
            0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "a ratio in (0, 1]"
        )
        need(int(self.kv_cache_bytes) > 0, "kv_cache_bytes", "a positive size")
        need(
            self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
            "num_gpu_blocks",
            ">= 1 or None",
        )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len="
                f"{self.max_model_len}: without chunked prefill a whole prompt must fit one step"
            )
