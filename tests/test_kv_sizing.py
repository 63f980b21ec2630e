"""KV pool sizing: the CUDA budget arithmetic and the profiling step, checked on CPU (the
measured peak needs a GPU: bench/gpu_e2e.py's pool-sizing section)."""

from __future__ import annotations

import pytest
import torch

from kvguard.engine import ConfigError, EngineConfig
from kvguard.engine.kv_cache import bytes_per_block
from kvguard.engine.model_runner import (
    activation_peak,
    cuda_kv_budget,
    num_kv_blocks,
    profile_step,
)
from kvguard.engine.random_model import random_engine

GiB = 2**30


def test_cuda_budget_is_a_share_of_the_whole_gpu() -> None:
    # 80 GiB GPU, 15 GiB in use (weights, context), 2 GiB activation peak, 0.85 of it allowed
    budget = cuda_kv_budget(80 * GiB, 65 * GiB, 2 * GiB, 0.85)
    assert budget == int(80 * GiB * 0.85) - 15 * GiB - 2 * GiB
    # what is in use counts against the share: a bigger model leaves a smaller pool
    assert cuda_kv_budget(80 * GiB, 40 * GiB, 2 * GiB, 0.85) < budget
    assert cuda_kv_budget(80 * GiB, 10 * GiB, 0, 0.85) < 0  # nothing left: refused by the caller


def test_cpu_pool_is_the_byte_budget_and_too_small_is_refused() -> None:
    eng = random_engine("tiny", EngineConfig(model="random:tiny", device="cpu", num_gpu_blocks=8))
    cfg = eng.model_config
    per_block = bytes_per_block(cfg, 16, "fp32")
    config = EngineConfig(model="x", device="cpu", kv_cache_bytes=10 * per_block + 1)
    assert num_kv_blocks(config, cfg, "fp32", torch.device("cpu"), 123) == 10
    with pytest.raises(ConfigError, match="raise kv_cache_bytes"):
        small = EngineConfig(model="x", device="cpu", kv_cache_bytes=per_block - 1)
        num_kv_blocks(small, cfg, "fp32", torch.device("cpu"))


def test_the_profiling_step_runs_on_its_own_pool() -> None:
    config = EngineConfig(
        model="random:tiny", device="cpu", num_gpu_blocks=8, max_num_batched_tokens=300
    )
    eng = random_engine("tiny", config)
    real_pool = [t.clone() for layer in eng.kv_cache.layers for t in layer[:2]]
    cpu = torch.device("cpu")
    pool = profile_step(eng.model, eng.model_config, config, "fp32", cpu, eng.max_model_len)
    assert pool == 19 * bytes_per_block(eng.model_config, 16, "fp32")  # 300 tokens: 19 blocks
    after = [t for layer in eng.kv_cache.layers for t in layer[:2]]
    assert all(torch.equal(a, b) for a, b in zip(real_pool, after, strict=True))
    # a step's tokens beyond max_model_len are more sequences, as the scheduler would batch
    # them: 300 tokens of at most 128 are 128 + 128 + 44 (8 + 8 + 3 blocks), of at most 100
    # three of 100 (7 blocks each)
    assert profile_step(eng.model, eng.model_config, config, "fp32", cpu, 128) == 19 * (
        bytes_per_block(eng.model_config, 16, "fp32")
    )
    assert profile_step(eng.model, eng.model_config, config, "fp32", cpu, 100) == 21 * (
        bytes_per_block(eng.model_config, 16, "fp32")
    )
    # no memory statistics off CUDA: the CPU budget is kv_cache_bytes, nothing to profile
    assert activation_peak(eng.model, eng.model_config, config, "fp32", cpu, 64) == 0
