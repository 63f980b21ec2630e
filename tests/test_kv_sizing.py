"""KV pool sizing: the CUDA budget arithmetic and the profiling step, checked on CPU (the
measured peak needs a GPU: bench/gpu_e2e.py's pool-sizing section)."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvguard.engine import ConfigError, EngineConfig, model_runner
from kvguard.engine.kv_cache import bytes_per_block
from kvguard.engine.model_runner import (
    activation_peak,
    cuda_kv_budget,
    num_kv_blocks,
    profile_step,
    profiled_num_blocks,
    torch_decode_reserve,
)
from kvguard.engine.random_model import random_engine
from kvguard.kernels.fp8 import FP8_DTYPE

GiB = 2**30
# the module, not the function of the same name that kvguard.kernels exports
pa = importlib.import_module("kvguard.kernels.paged_attention")


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


@pytest.mark.parametrize(
    ("cache", "dtype"),
    [(torch.float32, torch.float32), (FP8_DTYPE, torch.float32), (torch.bfloat16, torch.float32)],
)
def test_torch_decode_workspace_is_bounded_by_its_arithmetic(
    monkeypatch: pytest.MonkeyPatch, cache: torch.dtype, dtype: torch.dtype
) -> None:
    """The torch decode path keeps gathered K/V between calls; a maximal prefill never grows
    them, so pool sizing adds `decode_workspace_bytes`: what the path really holds after
    `rows` sequences of `max_len` tokens, plus one call's transients."""
    monkeypatch.setattr(pa, "_WORKSPACE", {})
    rows, max_len, bs, heads, kv_heads, d = 3, 40, 16, 4, 2, 8
    nblocks = -(-max_len // bs)
    shape = (rows * nblocks, bs, kv_heads, d)
    kv = (torch.randn(shape).to(cache), torch.randn(shape).to(cache))
    scales = (torch.ones(shape[0], kv_heads), torch.ones(shape[0], kv_heads))
    kv = (*kv, *scales) if cache == FP8_DTYPE else (*kv, None, None)
    tables = torch.arange(rows * nblocks, dtype=torch.int32).view(rows, nblocks)
    q = torch.randn(rows, heads, d, dtype=dtype)
    out = torch.zeros_like(q)
    lens = [max_len, max_len - 7, max_len]
    pa._decode(q, out, kv, tables, lens, list(range(rows)), list(range(rows)), 0.3)
    held = sum(b.nbytes for b in pa._WORKSPACE.values())
    bound = pa.decode_workspace_bytes(rows, max_len, bs, heads, kv_heads, d, cache, dtype)
    transient = rows * nblocks * bs * (1 + 4 * heads)  # the mask and the fp32 scores
    if cache in (dtype, FP8_DTYPE):
        assert held == bound - transient  # everything else is the gathered K/V it keeps
    else:
        # a bf16 cache under fp32 compute keeps bf16 copies and casts them each call
        assert held == bound - transient - 2 * rows * nblocks * bs * kv_heads * d * 4


def test_torch_decode_workspace_is_reserved_only_where_that_path_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eng = random_engine("tiny", EngineConfig(model="random:tiny", device="cpu", num_gpu_blocks=8))
    cfg = eng.model_config
    config = EngineConfig(model="x", max_num_seqs=16, block_size=16)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert torch_decode_reserve(cfg, config, "bf16", cpu, 512, torch.bfloat16) == 0

    def workspace(cache: torch.dtype) -> int:
        args = (16, 512, 16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cache)
        return pa.decode_workspace_bytes(*args, torch.bfloat16)

    # the GPU's abilities are faked (no GPU here): Triton serving everything, Triton without
    # e4m3 (before compute capability 8.9: an fp8 switch lands on the torch path), no Triton
    for serves, want in [
        (lambda _dev, _kv: True, 0),
        (lambda _dev, kv: kv != FP8_DTYPE, workspace(FP8_DTYPE)),
        (lambda _dev, _kv: False, max(workspace(FP8_DTYPE), workspace(torch.bfloat16))),
    ]:
        monkeypatch.setattr(model_runner, "use_triton", serves)
        assert torch_decode_reserve(cfg, config, "bf16", gpu, 512, torch.bfloat16) == want
    # on CPU the profiled count is the byte budget's
    cpu_config = EngineConfig(model="x", device="cpu", kv_cache_bytes=2**20)
    want = num_kv_blocks(cpu_config, cfg, "fp32", cpu)
    assert profiled_num_blocks(eng.model, cfg, cpu_config, "fp32", cpu, 64) == want
