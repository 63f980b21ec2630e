"""The Triton W4A16 GEMM must agree with `QuantSpec.dequantize`, the reference for every kernel.

As in test_triton_kernels.py: on a CPU-only machine the kernels run in Triton's interpreter
(`TRITON_INTERPRET=1`, set before anything imports triton, because `triton.jit` picks
interpreter-or-compiled when a kernel is defined); with `KVGUARD_TEST_DEVICE=cuda` on a GPU
host (bench/gpu_check.sh) the same tests run compiled. Shapes stay tiny: the interpreter runs
every program instance in Python.

The reference is `x.float() @ spec.dequantize().T`; the kernel accumulates in fp32 and rounds
once to x's dtype, so the tolerance is that dtype's output rounding (plus, on the dequantise +
matmul path, the weight's rounding to x's dtype).
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("KVGUARD_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kvguard.engine.layers.quant_spec import QuantSpec  # noqa: E402
from kvguard.kernels import dispatch, w4a16  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("KVGUARD_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

tw = pytest.importorskip("kvguard.kernels.triton_w4a16")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Max |error| over max |reference|: fp32 summation order; fp16/bf16 output rounding (2^-11,
# 2^-8, and the interpreter truncates bf16 instead of rounding).
FUSED_TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}
# The large-M path also rounds every weight to x's dtype before the matmul.
LARGE_TOL = {"fp32": 1e-5, "fp16": 3e-3, "bf16": 2.4e-2}


def make_spec(n: int, k: int, group: int, seed: int, desc_act: bool = False) -> QuantSpec:
    """Random codes, positive scales and asymmetric non-integer zero points (as GGUF Q4_1
    yields), optionally with a desc_act input permutation."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    spec = QuantSpec(
        q=torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
        scales=torch.rand(n, groups, generator=gen) * 0.05 + 0.005,
        zeros=torch.rand(n, groups, generator=gen) * 15,
        group_size=group,
        bits=4,
        perm=torch.randperm(k, generator=gen) if desc_act else None,
    )
    return spec


def to_device(spec: QuantSpec) -> QuantSpec:
    perm = None if spec.perm is None else spec.perm.to(DEVICE)
    return QuantSpec(
        spec.q.to(DEVICE),
        spec.scales.to(DEVICE),
        spec.zeros.to(DEVICE),
        spec.group_size,
        spec.bits,
        perm,
    )


def activations(m: int, k: int, dtype: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(DEVICE, DTYPES[dtype])


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def reference(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return x.float() @ to_device(spec).dequantize().T


def test_packing_bit_order() -> None:
    """Eight codes per int32 along K, low nibble first; the top nibble sets the sign bit."""
    codes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [15, 0, 0, 0, 0, 0, 0, 15]], dtype=torch.uint8)
    spec = QuantSpec(codes, torch.ones(2, 1), torch.zeros(2, 1), 8, 4)
    w = w4a16.pack_for_triton(spec)
    assert w.qweight.dtype == torch.int32 and w.qweight.shape == (2, 1)
    assert w.qweight[0, 0].item() == 0x76543210
    assert w.qweight[1, 0].item() == 0xF000000F - 2**32
    assert torch.equal(w4a16.unpack_codes(w.qweight), codes)


def test_pack_roundtrip_and_reference() -> None:
    spec = make_spec(48, 128, 32, seed=1, desc_act=True)
    w = w4a16.pack_for_triton(spec)
    assert w.shape == (48, 128) and w.nbytes == 48 * 16 * 4 + 2 * 48 * 4 * 4
    assert torch.equal(w4a16.unpack_codes(w.qweight), spec.q)
    x = activations(3, 128, "fp32", seed=2).cpu()
    torch.testing.assert_close(
        w4a16.reference_matmul(x, w), x @ spec.dequantize().T, atol=1e-5, rtol=1e-5
    )


def test_pack_refuses_what_the_kernel_cannot_read() -> None:
    spec8 = QuantSpec(
        torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1), torch.ones(4, 1), 32, 8
    )
    with pytest.raises(ValueError, match="8-bit"):
        w4a16.pack_for_triton(spec8)
    with pytest.raises(ValueError, match="multiple of 16"):
        tw.block_k_for(8)


# (M, K, N, group): decode rows (1, 5) and a multi-tile M (33); one and several groups per row;
# N a multiple of the N tile or not (48). Every value of each axis appears with every other.
CASES = [
    (1, 64, 32, 32),
    (1, 128, 48, 64),
    (5, 128, 32, 32),
    (5, 64, 48, 64),
    (33, 128, 48, 32),
    (33, 64, 32, 64),
    (1, 128, 32, 64),
    (33, 128, 32, 64),
]


@pytest.mark.parametrize("case", CASES, ids=[f"m{c[0]}-k{c[1]}-n{c[2]}-g{c[3]}" for c in CASES])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_fused_matches_reference(case: tuple[int, int, int, int], dtype: str) -> None:
    """Split-K off and on (forced to every K tile, which splits whenever there are two)."""
    m, k, n, group = case
    spec = make_spec(n, k, group, seed=m + k + n + group)
    w = w4a16.pack_for_triton(to_device(spec))
    x = activations(m, k, dtype, seed=m)
    ref = reference(x, spec)
    k_tiles = k // tw.block_k_for(group)
    for split in (1, k_tiles):
        assert tw.plan(m, n, k, group, x.device, split).split_k == split
        got = tw.matmul(x, w, split_k=split)
        assert got.dtype == x.dtype and got.shape == (m, n)
        assert rel_err(got, ref) < FUSED_TOL[dtype], split


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_large_m_path(dtype: str) -> None:
    """Above `large_m` rows: dequantise (Triton) into x's dtype, then torch.matmul."""
    m, k, n, group = 33, 128, 48, 32
    spec = make_spec(n, k, group, seed=5)
    w = w4a16.pack_for_triton(to_device(spec))
    deq = tw.dequantize(w, DTYPES[dtype])
    assert rel_err(deq, to_device(spec).dequantize()) < LARGE_TOL[dtype] / 4
    x = activations(m, k, dtype, seed=6)
    got = tw.matmul(x, w, large_m=m - 1)
    assert got.dtype == x.dtype
    assert rel_err(got, reference(x, spec)) < LARGE_TOL[dtype]


# (M, K, N, group): decode rows, a multi-tile M, one and two 128-wide K tiles and a partial one
# (K 192), N off the tile; groups of 128 and 256 (one group a tile: the planes go to the dots
# as codes) and 32 / 64 (GGUF-sized: each plane dequantised first)
PLANE_CASES = [
    (1, 128, 48, 128),
    (5, 256, 32, 128),
    (33, 256, 48, 256),
    (33, 128, 32, 128),
    (1, 192, 48, 32),
    (5, 256, 32, 64),
    (33, 192, 48, 64),
]


@pytest.mark.parametrize(
    "case", PLANE_CASES, ids=[f"m{c[0]}-k{c[1]}-n{c[2]}-g{c[3]}" for c in PLANE_CASES]
)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_nibble_planes_match_reference(case: tuple[int, int, int, int], dtype: str) -> None:
    """The nibble-plane kernel (`KVGUARD_W4A16_PLANES`), split-K off and on, desc_act or not.
    Groups under 128 round each dequantised weight to x's dtype, as the large-M path does."""
    m, k, n, group = case
    tol = FUSED_TOL[dtype] if group % 128 == 0 else LARGE_TOL[dtype]
    for desc_act in (False, True):
        spec = make_spec(n, k, group, seed=m + k + n, desc_act=desc_act)
        w = w4a16.pack_for_triton(to_device(spec))
        x = activations(m, k, dtype, seed=m + 1)
        assert tw.planes_fit(x)
        ref = reference(x, spec)
        for split in (1, -(-k // 128)):
            got = tw.matmul(x, w, split_k=split, planes=True)
            assert got.dtype == x.dtype and got.shape == (m, n)
            assert rel_err(got, ref) < tol, (split, desc_act)


def test_nibble_planes_are_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch is read per call; fp32 activations keep the tiled kernel's exact fp32 dots,
    with or without it."""
    monkeypatch.delenv(dispatch.W4A16_PLANES_ENV, raising=False)
    assert not dispatch.w4a16_planes()
    monkeypatch.setenv(dispatch.W4A16_PLANES_ENV, "1")
    assert dispatch.w4a16_planes()
    calls = []
    monkeypatch.setattr(tw, "_fused_planes", lambda *a: calls.append(a) or 1 / 0)
    spec = make_spec(32, 128, 32, seed=3)
    w = w4a16.pack_for_triton(to_device(spec))
    with pytest.raises(ZeroDivisionError):
        tw.matmul(activations(2, 128, "bf16", seed=4), w)  # the switch took it to the planes
    assert len(calls) == 1
    x32 = activations(2, 128, "fp32", seed=4)
    assert not tw.planes_fit(x32)
    assert rel_err(tw.matmul(x32, w), reference(x32, spec)) < 1e-5
    assert len(calls) == 1
    monkeypatch.setenv(dispatch.W4A16_PLANES_ENV, "0")
    got = tw.matmul(activations(2, 128, "bf16", seed=4), w)
    assert len(calls) == 1 and got.shape == (2, 32)


def test_desc_act_leading_dims_and_strides() -> None:
    """A permuted spec, x with two leading dims, and x as a non-contiguous view, both paths."""
    k, n, group = 128, 48, 64
    spec = make_spec(n, k, group, seed=7, desc_act=True)
    w = w4a16.pack_for_triton(to_device(spec))
    x = activations(6, 2 * k, "fp32", seed=8)[:, ::2].reshape(2, 3, k)
    ref = reference(x.reshape(-1, k), spec).reshape(2, 3, n)
    for large_m in (tw.LARGE_M, 0):
        got = tw.matmul(x, w, large_m=large_m)
        assert got.shape == (2, 3, n) and rel_err(got, ref) < 1e-5
    xt = activations(k, 5, "fp32", seed=9).T  # stride along K is not 1
    assert rel_err(tw.matmul(xt, w), reference(xt, spec)) < 1e-5
    assert tw.matmul(xt[:0], w).shape == (0, n)


def test_column_shard_views() -> None:
    """A row-parallel shard: input columns 64..127 sliced as views of words and groups (row
    strides of the full weight) multiply like the same columns of the spec."""
    k, n, group = 128, 48, 32
    spec = make_spec(n, k, group, seed=16)
    w = w4a16.pack_for_triton(spec).to(DEVICE)
    shard = w.columns(64, 128)
    assert shard.shape == (n, 64) and not shard.qweight.is_contiguous()
    x = activations(3, 64, "fp32", seed=17)
    ref = x.float() @ to_device(spec).dequantize()[:, 64:].T
    assert rel_err(tw.matmul(x, shard, split_k=2), ref) < 1e-5
    assert rel_err(tw.matmul(x, shard, large_m=0), ref) < 1e-5
    with pytest.raises(ValueError, match="groups of 32"):
        w.columns(16, 128)


def test_fp16_scales() -> None:
    """fp16 scales and zeros (half the metadata bytes) cost ~1e-3 of accuracy, no more."""
    m, k, n, group = 5, 128, 32, 32
    spec = make_spec(n, k, group, seed=10)
    w = w4a16.pack_for_triton(to_device(spec), scale_dtype=torch.float16)
    x = activations(m, k, "fp16", seed=11)
    assert rel_err(tw.matmul(x, w, split_k=2), reference(x, spec)) < 5e-3


def test_plan_fills_the_gpu_at_decode() -> None:
    """Llama-2-7B shapes at batch 1 on 132 SMs: split-K lifts the grid to a few programs per SM,
    no split is empty, and larger batches split less."""
    cpu = torch.device("cpu")  # the interpreter's nominal 132 SMs
    for n, k in ((4096, 4096), (11008, 4096), (4096, 11008)):
        p = tw.plan(1, n, k, 128, cpu)
        k_tiles = k // p.block_k
        programs = triton.cdiv(n, p.block_n) * p.split_k
        assert p.split_k > 1 and programs >= 132, (n, k, p)
        assert (p.split_k - 1) * p.tiles_per_split < k_tiles <= p.split_k * p.tiles_per_split
    for m in (1, 16, 64):  # the fp32 partials (written, read) stay under half the weight bytes
        p = tw.plan(m, 11008, 4096, 128, cpu)
        assert p.split_k == 1 or p.split_k * m * 11008 * 8 <= 11008 * 4096 / 4, (m, p)
    assert tw.plan(128, 11008, 4096, 128, cpu).split_k == 1
    assert tw.plan(1, 32, 64, 32, cpu, split_k=1).split_k == 1


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """w4a16_matmul takes the kernel on CUDA and under the interpreter, the reference otherwise,
    and KVGUARD_TRITON=0 switches the kernel off."""
    spec = make_spec(32, 64, 32, seed=12)
    w = w4a16.pack_for_triton(spec)
    x = activations(2, 64, "fp32", seed=13).cpu()
    calls: list[int] = []
    monkeypatch.setattr(tw, "matmul", lambda x, w, **kw: calls.append(1) or x.new_zeros(2, 32))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.w4a16_matmul(x, w).eq(0).all() and calls == [1]
    monkeypatch.setenv("KVGUARD_TRITON", "0")
    ref = x @ spec.dequantize().T
    torch.testing.assert_close(dispatch.w4a16_matmul(x, w), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("KVGUARD_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.testing.assert_close(dispatch.w4a16_matmul(x, w), ref, atol=1e-5, rtol=1e-5)
    assert calls == [1]
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert dispatch.use_triton_w4a16("cuda:0") and not dispatch.use_triton_w4a16("cpu")
    monkeypatch.setenv("KVGUARD_TRITON", "0")
    assert not dispatch.use_triton_w4a16("cuda")


def test_dispatch_runs_the_kernel_end_to_end() -> None:
    """Through `dispatch.w4a16_matmul` as QuantizedLinear calls it: compiled on CUDA
    (KVGUARD_TEST_DEVICE=cuda), in the Triton interpreter on CPU."""
    spec = make_spec(48, 128, 64, seed=14)
    w = w4a16.pack_for_triton(to_device(spec))
    x = activations(3, 128, "fp16", seed=15)
    assert rel_err(dispatch.w4a16_matmul(x, w), reference(x, spec)) < FUSED_TOL["fp16"]
