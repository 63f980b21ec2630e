"""The Triton skinny GEMMs (`kvguard.kernels.triton_gemv`) against torch's matmul and the 4-bit
reference, and the dispatch that routes a decode step's projections to them.

On a CPU-only machine the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set before
anything imports triton); with `KVGUARD_TEST_DEVICE=cuda` (bench/gpu_check.sh) compiled on the
GPU. The kernels sum in fp32 and round once to x's dtype, so the tolerance is that dtype's
output rounding (max |error| over max |reference|).
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("KVGUARD_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton")

from kvguard.engine.layers.quant_spec import QuantSpec  # noqa: E402
from kvguard.kernels import dispatch, w4a16  # noqa: E402

tg = pytest.importorskip("kvguard.kernels.triton_gemv")

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("KVGUARD_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# fp32: summation order; fp16 / bf16: output rounding (2^-11, 2^-8; the interpreter truncates
# bf16 instead of rounding)
TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}


def randn(*shape: int, seed: int, dtype: str = "fp32") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, DTYPES[dtype])


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def spec4(n: int, k: int, group: int, seed: int, desc_act: bool = False) -> QuantSpec:
    """Random 4-bit codes, positive scales, non-integer zero points (GGUF Q4_1-like)."""
    gen = torch.Generator().manual_seed(seed)
    return QuantSpec(
        q=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        scales=torch.rand(n, k // group, generator=gen) * 0.05 + 0.005,
        zeros=torch.rand(n, k // group, generator=gen) * 15,
        group_size=group,
        bits=4,
        perm=torch.randperm(k, generator=gen) if desc_act else None,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_dense_matches_torch(dtype: str, rows: int) -> None:
    """Widths that are no multiple of the tiles (the last program's columns and the last K
    tile are partial), a bias, and x rows strided inside a wider tensor."""
    n, k = 37, 300
    wide = randn(rows, k + 20, seed=rows, dtype=dtype)
    x = wide[:, 5 : 5 + k]
    w, b = randn(n, k, seed=2, dtype=dtype), randn(n, seed=3, dtype=dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    got = tg.linear(x, w, b)
    assert got.dtype == x.dtype and got.shape == (rows, n)
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(tg.linear(x, w), F.linear(x.float(), w.float())) < TOL[dtype]


@pytest.mark.parametrize(
    "cfg", [tg.GemvConfig(4, 64), tg.GemvConfig(8, 128), tg.GemvConfig(32, 128, num_warps=8)]
)
def test_dense_other_tiles_and_leading_dims(cfg: tg.GemvConfig) -> None:
    x = randn(2, 3, 192, seed=4)
    w = randn(70, 192, seed=5)
    got = tg.linear(x, w, cfg=cfg)
    assert got.shape == (2, 3, 70)
    assert rel_err(got, x @ w.T) < TOL["fp32"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "rows"), [(32, 1), (64, 3), (128, 8)])
def test_w4a16_matches_the_reference(dtype: str, group: int, rows: int) -> None:
    n, k = 40, 640  # 80 words: a whole 64-word tile and a partial one
    spec = spec4(n, k, group, seed=group + rows)
    w = w4a16.pack_for_triton(spec).to(DEVICE)
    x = randn(rows, k, seed=rows, dtype=dtype)
    got = tg.w4a16_linear(x, w)
    assert got.dtype == x.dtype and got.shape == (rows, n)
    assert rel_err(got, x.float() @ spec.dequantize().to(DEVICE).T) < TOL[dtype]


def test_w4a16_desc_act_fp16_scales_and_small_tiles() -> None:
    spec = spec4(24, 256, 64, seed=9, desc_act=True)
    w = w4a16.pack_for_triton(spec, scale_dtype=torch.float16).to(DEVICE)
    x = randn(2, 256, seed=10, dtype="fp16")
    ref = w4a16.reference_matmul(x.float().cpu(), w.to("cpu")).to(DEVICE)
    for cfg in (None, tg.GemvConfig(4, 64), tg.GemvConfig(8, 128)):
        assert rel_err(tg.w4a16_linear(x, w, cfg=cfg), ref) < TOL["fp16"]


def test_refusals_name_the_problem() -> None:
    w = randn(16, 64, seed=11)
    with pytest.raises(ValueError, match="at most 8"):
        tg.linear(randn(9, 64, seed=12), w)
    with pytest.raises(ValueError, match="columns"):
        tg.linear(randn(2, 32, seed=12), w)
    with pytest.raises(ValueError, match="int8"):
        tg.linear(randn(2, 64, seed=12).to(torch.int8), w)
    with pytest.raises(ValueError, match="unit stride"):
        tg.linear(randn(2, 64, seed=12), randn(64, 16, seed=13).T)
    packed = w4a16.pack_for_triton(spec4(16, 64, 32, seed=14)).to(DEVICE)
    with pytest.raises(ValueError, match="whole words"):
        tg.w4a16_linear(randn(1, 64, seed=15), packed, cfg=tg.GemvConfig(4, 68))
    odd = w4a16.W4A16Weight(packed.qweight, packed.scales, packed.zeros, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        tg.w4a16_linear(randn(1, 64, seed=15), odd)
    assert tg.linear(randn(0, 64, seed=12), w).shape == (0, 16)


def test_config_fills_the_gpu() -> None:
    """Eight weight rows a program where that gives two programs an SM (an H100's 132 SMs
    here), else four; 4-bit tiles shrink with x's rows, in whole words; never wider than K."""
    for n in (576, 960, 2048, 4096, 11008, 22016, 32000):
        cfg = tg.config(n, 4096, 132)
        assert cfg.block_n == (8 if triton.cdiv(n, 8) >= 2 * 132 else 4)
        assert cfg.block_k == 512
    ks = [tg.config(4096, 4096, 132, packed=True, rows=r).block_k for r in (1, 2, 3, 4, 8)]
    assert ks == [1024, 512, 256, 256, 256]
    assert tg.config(64, 64, 132).block_k == 64 and tg.config(64, 300, 132).block_k == 512
    assert tg.config(64, 8, 132).block_k == 16
    assert tg.config(64, 8, 132, packed=True).block_k == 16


def test_the_dispatch_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gemv_rows`: 1-8 rows, KVGUARD_TRITON_GEMV=1, a device Triton serves (CPU tensors only
    under the interpreter); `dense_linear` and `w4a16_matmul` route by it."""
    x, w = randn(3, 64, seed=16), randn(16, 64, seed=17)
    monkeypatch.delenv(dispatch.GEMV_ENV, raising=False)
    assert not dispatch.gemv_rows(x)
    monkeypatch.setenv(dispatch.GEMV_ENV, "1")
    assert dispatch.gemv_rows(x) and dispatch.gemv_rows(x[:1])
    assert not dispatch.gemv_rows(randn(9, 64, seed=18))
    assert not dispatch.gemv_rows(x[:0])
    for value, dense, packed in (
        ("dense", True, False),
        ("4bit", False, True),
        ("yes", False, False),
    ):
        monkeypatch.setenv(dispatch.GEMV_ENV, value)
        assert dispatch.gemv_rows(x) == dense and dispatch.gemv_rows(x, "4bit") == packed
    monkeypatch.setenv(dispatch.GEMV_ENV, "1")
    assert dispatch.gemv_rows(x, "4bit")
    monkeypatch.setenv("KVGUARD_TRITON", "0")
    assert not dispatch.gemv_rows(x)
    monkeypatch.delenv("KVGUARD_TRITON")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not dispatch.gemv_rows(x)  # a CPU serving path never takes it
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls: list[str] = []
    real_linear, real_w4 = tg.linear, tg.w4a16_linear
    monkeypatch.setattr(tg, "linear", lambda *a: calls.append("dense") or real_linear(*a))
    monkeypatch.setattr(tg, "w4a16_linear", lambda *a: calls.append("w4") or real_w4(*a))
    assert rel_err(dispatch.dense_linear(x, w), x @ w.T) < TOL["fp32"]
    with pytest.raises(RuntimeError):  # mixed dtypes: F.linear's error, not the kernel's
        dispatch.dense_linear(x.half(), w)
    wt = randn(64, 16, seed=22).T  # a transposed view: F.linear takes it, the kernel would not
    assert rel_err(dispatch.dense_linear(x, wt), x @ wt.T) < TOL["fp32"]
    assert dispatch.dense_linear(x[0], w).shape == (16,)  # one unbatched row
    spec = spec4(16, 64, 32, seed=19)
    packed = w4a16.pack_for_triton(spec).to(DEVICE)
    ref = x @ spec.dequantize().to(DEVICE).T
    assert rel_err(dispatch.w4a16_matmul(x, packed), ref) < TOL["fp32"]
    assert rel_err(dispatch.w4a16_matmul(x, packed, split_k=1), ref) < TOL["fp32"]
    assert calls == ["dense", "dense", "w4"]


def test_the_tiny_model_serves_the_same_tokens_through_the_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every projection of a decode step (qkv, o, gate_up, down, lm_head) through the skinny
    GEMM gives the torch path's tokens and log-probabilities; prompt steps of more rows keep
    torch's matmul."""
    from kvguard.engine import EngineConfig, LLMEngine, SamplingParams

    # a fixed pool: sized from gpu_memory_utilization on CUDA, the first engine would leave
    # the second none while it is still referenced
    cfg = EngineConfig(model="tiny", device=DEVICE, dtype="fp32", max_num_seqs=2, num_gpu_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [11, 12]]
    shapes: list[tuple[int, ...]] = []
    real = tg.linear

    def counted(x, w, b=None):  # noqa: ANN001, ANN202
        shapes.append(tuple(w.shape))
        return real(x, w, b)

    monkeypatch.setattr(tg, "linear", counted)
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv(dispatch.GEMV_ENV, on)
        eng = LLMEngine.from_config(cfg, progress=False)
        eng.model.fuse_cpu_decode = False
        res = eng.generate(prompts, params)
        outs[on] = [(r.token_ids, [[p for _, p in lp.top] for lp in r.final_logprobs]) for r in res]
    mc = eng.model_config
    assert (mc.vocab_size, mc.hidden_size) in shapes  # the lm_head
    assert len(set(shapes)) == 5  # qkv, o, gate_up, down, lm_head
    for (tok_a, lp_a), (tok_b, lp_b) in zip(outs["0"], outs["1"], strict=True):
        assert tok_a == tok_b
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=1e-4)


def test_quantized_layers_take_the_skinny_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-bit layer on the CUDA path (`w4a16`, forced here) with KVGUARD_TRITON_GEMV=4bit, and
    a quantized layer's dense fallback (an 8-bit weight on CUDA) with `dense`, go through the
    skinny GEMMs for decode rows and give the dequantised matmul."""
    from kvguard.engine.layers.quantized_linear import QuantizedLinear

    calls: list[str] = []
    real_linear, real_w4 = tg.linear, tg.w4a16_linear
    monkeypatch.setattr(tg, "linear", lambda *a: calls.append("dense") or real_linear(*a))
    monkeypatch.setattr(tg, "w4a16_linear", lambda *a: calls.append("w4") or real_w4(*a))
    spec = spec4(40, 128, 32, seed=20)
    x = randn(2, 128, seed=21)
    want = x @ spec.dequantize().to(DEVICE).T
    for kernel, value in (("w4a16", "4bit"), ("dense", "dense")):
        layer = QuantizedLinear(spec, device=DEVICE, kernel=kernel)
        monkeypatch.setenv(dispatch.GEMV_ENV, value)
        assert rel_err(layer(x), want) < TOL["fp32"]
        monkeypatch.setenv(dispatch.GEMV_ENV, "0")
        assert rel_err(layer(x), want) < TOL["fp32"]
    assert calls == ["w4", "dense"]
