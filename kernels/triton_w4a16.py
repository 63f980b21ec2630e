"""W4A16 matmul as Triton kernels: the CUDA path for 4-bit weight-only quantized linears.

`y = x @ W.T` with x `[M, K]` in fp16 / bf16 / fp32 and W given packed (`w4a16.W4A16Weight`:
int32 words of eight 4-bit codes along K, low nibble first, plus per-group scales and float zero
points, `w = (code - zero) * scale`). y has x's dtype.

Why a kernel: decode is memory-bound, and a 4-bit weight is a quarter of the fp16 bytes. That
only pays if nothing writes a dequantised copy: the GEMM reads the packed words and expands them
in registers, tile by tile.

How the fused GEMM works: one program per (M tile, N tile, K split). Every K tile lies inside one
quantisation group (the tile width divides the group size), so a tile needs one scale and one
zero per output row, and the dequantisation factors out of the dot product:

    sum_k x[m, k] * (q[n, k] - z[n]) * s[n] = s[n] * (dot(x, q)[m, n] - z[n] * sum_k x[m, k])

The tensor cores then multiply x (in its own dtype) by the raw codes (0..15, exact in fp16 and
bf16), and the group's scale and zero are applied once per tile to the fp32 partial sum: no
per-weight float arithmetic and no rounding of the dequantised weight. Accumulation is fp32.

Split-K: at decode sizes (M <= 16) the (M, N) grid of a 4096-wide layer is a few dozen
programs, far fewer than the SMs that must stream the weight; the K range is then split so the
grid reaches a few programs per SM, as far as the partials' traffic (growing with M) stays
small next to the weight's bytes. Splits write fp32 partials to a workspace and a small
second kernel sums them in a fixed order (deterministic, unlike atomics) and casts to x's dtype.

By nibble planes (`_planes_kernel`, opt-in with `KVGUARD_W4A16_PLANES=1` until a device run has
timed it; 16-bit activations): the H200 ran the kernel above at 0.2-0.5x fp16's matmul, and its
sm_90 build shows the reshape of eight codes a word into a row costing a 2-byte shared-memory
store and load per weight plus a quarter-rate int-to-float conversion, at 152-184 registers.
Taking code i of every word as one operand (x copied into the matching plane order) gives eight
K=16 dots a 128-wide tile with neither: 90-138 registers, about a third fewer instructions.

Large M (prefill): once enough rows share each weight, the GEMM is compute-bound and cuBLAS on a
model-dtype weight beats a fused kernel, so above `LARGE_M` rows the weight is dequantised once
per call into a scratch tensor of x's dtype (a Triton kernel, one pass over the packed weight)
and multiplied with `torch.matmul`. The scratch is transient (the caching allocator reuses it).

Under Triton's CPU interpreter (tests) the dot products run in fp32 (the interpreter gets bf16
and fp16 arithmetic wrong); compiled, fp16/bf16 activations use the tensor cores and fp32 ones
an exact (non-TF32) fp32 dot.

`triton` is imported here; import this module only after `kvguard.kernels.dispatch` chose it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kvguard.kernels.triton_gemv import code_plane
from kvguard.kernels.w4a16 import W4A16Weight, pack_for_triton, plane_order

__all__ = ["LARGE_M", "Plan", "W4A16Weight", "dequantize", "matmul", "pack_for_triton", "plan"]

# Rows above which the dequantise + torch.matmul path is taken (prefill); bench/gpu_w4a16.py
# times both paths around it.
LARGE_M = 128
# Widest K tile: a tile must divide the group size, and 128 covers the usual groups (32-128).
_MAX_BLOCK_K = 128
# Split K until the grid has about this many programs per SM ...
_WAVES = 4
# ... but give each split at least this many K tiles, so its partial is worth writing,
_MIN_TILES_PER_SPLIT = 2
# and keep the partials' traffic (fp32, written and read back) under this fraction of the
# packed weight's bytes: it grows with M, so at M = 64 a 4096-wide layer barely splits.
_MAX_PARTIAL_FRACTION = 0.5
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _store_tile(
    acc, y_ptr, part_ptr, rm, rn, m_ok, n_ok, M, N, stride_ym, pid_k, SPLIT: tl.constexpr
):
    """A program's `[BLOCK_M, BLOCK_N]` result: with SPLIT its fp32 partial to
    `part_ptr[pid_k, M, N]`; without, y's tile in y's dtype."""
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=ok)
    else:
        dst = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    part_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_ym,
    tiles_per_split,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """One (M tile, N tile) block of `x @ W.T` over split `program_id(2)` of the K tiles.

    With SPLIT the fp32 partial goes to `part_ptr[split, M, N]`; without, the result goes
    to y in y's dtype.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    kk = tl.arange(0, BLOCK_K)
    kw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, K // BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(first, last):
        k0 = t * BLOCK_K
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + (k0 + kk)[None, :] * stride_xk,
            mask=m_ok[:, None],
            other=0.0,
        )
        words = tl.load(
            qw_ptr + rn[:, None] * stride_qn + (k0 // 8 + kw)[None, :],
            mask=n_ok[:, None],
            other=0,
        )
        codes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
        g = k0 // GROUP
        s = tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn * stride_zn + g, mask=n_ok, other=0.0).to(tl.float32)
        if FP32_DOT:
            a = a.to(tl.float32)
            dot = tl.dot(a, tl.trans(codes.to(tl.float32)), input_precision="ieee")
            a_sum = tl.sum(a, axis=1)
        else:
            dot = tl.dot(a, tl.trans(codes.to(a.dtype)))
            a_sum = tl.sum(a.to(tl.float32), axis=1)
        acc += (dot - a_sum[:, None] * z[None, :]) * s[None, :]
    _store_tile(acc, y_ptr, part_ptr, rm, rn, m_ok, n_ok, M, N, stride_ym, pid_k, SPLIT)


@triton.jit
def _codes16(words, i: tl.constexpr, BF16: tl.constexpr):
    """Code i of each word as the 16-bit float 1 + code / 16 (`triton_gemv.code_plane`'s
    trick in fp16's or bf16's bits: every value exact in both), a tensor-core operand."""
    c = (words >> (4 * i)) & 0xF
    if BF16:  # one return (the compiler wants one type from a function)
        out = ((c << 3) | 0x3F80).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = ((c << 6) | 0x3C00).to(tl.int16).to(tl.float16, bitcast=True)
    return out


@triton.jit
def _planes_kernel(
    xp_ptr,
    sx_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    part_ptr,
    M,
    N,
    n_words,
    stride_xm,
    stride_sxm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_ym,
    tiles_per_split,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    BF16: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """`_gemm_kernel` by nibble planes: a K tile is `[BLOCK_N, 16]` words (128 codes a row),
    and plane i (code i of every word, `_codes16`: 1 + code / 16) is an ordinary
    `[BLOCK_N, 16]` operand against x's columns `8 w + i`, contiguous in `xp` (x in plane
    order, `[M, 8, n_words]`). Eight K=16 dots a tile, no reshape of eight codes a word into
    a row (which the sm_90 build turns into 2-byte shared-memory stores and loads, one per
    weight, behind barriers) and no int-to-float conversion. The last tile may be partial.

    Groups of 128 or a multiple (one group a tile): the planes go to the tensor cores as they
    are and a tile adds `s * (16 * dot - (16 + z) * sum(x))`, with `sx` holding each row's x
    sum per tile (`[M, tiles]`, fp32). Smaller groups (e.g. GGUF's 32) change scale within a
    plane, so each plane is dequantised first, `(code - z) * s` as one FMA from per-word
    factors, and rounded to x's dtype for the dot (as the dequantise + matmul path rounds)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rw = tl.arange(0, 16)
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(n_words, 16))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = xp_ptr + rm[:, None] * stride_xm
    for t in range(first, last):
        ww = t * 16 + rw
        w_ok = ww < n_words
        tile_ok = n_ok[:, None] & w_ok[None, :]
        x_ok = m_ok[:, None] & w_ok[None, :]
        words = tl.load(qw_ptr + rn[:, None] * stride_qn + ww[None, :], mask=tile_ok, other=0)
        if GROUP % 128 == 0:
            g = (t * 128) // GROUP
            s = tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rn * stride_zn + g, mask=n_ok, other=0.0).to(tl.float32)
            dot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(8):
                a = tl.load(x_rows + (i * n_words + ww)[None, :], mask=x_ok, other=0.0)
                b = _codes16(words, i, BF16)
                if FP32_DOT:
                    dot += tl.dot(
                        a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee"
                    )
                else:
                    dot = tl.dot(a, tl.trans(b), dot)
            x_sum = tl.load(sx_ptr + rm * stride_sxm + t, mask=m_ok, other=0.0)
            acc += (16.0 * dot - (16.0 + z[None, :]) * x_sum[:, None]) * s[None, :]
        else:
            g = (ww * 8) // GROUP  # each word lies in one group
            at = rn[:, None] * stride_sn + g[None, :]
            s = tl.load(s_ptr + at, mask=tile_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rn[:, None] * stride_zn + g[None, :], mask=tile_ok, other=0.0)
            mul = 16.0 * s  # (code - z) * s == 16 s (1 + code / 16) - (16 + z) s
            add = -(16.0 + z.to(tl.float32)) * s
            for i in tl.static_range(8):
                a = tl.load(x_rows + (i * n_words + ww)[None, :], mask=x_ok, other=0.0)
                b = code_plane(words, i) * mul + add
                if FP32_DOT:
                    acc += tl.dot(
                        a.to(tl.float32),
                        tl.trans(b.to(a.dtype).to(tl.float32)),
                        input_precision="ieee",
                    )
                else:
                    acc = tl.dot(a, tl.trans(b.to(a.dtype)), acc)
    _store_tile(acc, y_ptr, part_ptr, rm, rn, m_ok, n_ok, M, N, stride_ym, pid_k, SPLIT)


@triton.jit
def _splitk_reduce_kernel(part_ptr, y_ptr, MN, splits, BLOCK: tl.constexpr):
    """y = sum of the split partials `[splits, M*N]`, in split order, cast to y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_kernel(
    qw_ptr,
    s_ptr,
    z_ptr,
    w_ptr,
    N,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_wn,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One `[BLOCK_N, BLOCK_K]` tile of the weight, dequantised in fp32, stored in w's dtype."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = rn < N
    kw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    words = tl.load(qw_ptr + rn[:, None] * stride_qn + (k0 // 8 + kw)[None, :], mask=n_ok[:, None])
    codes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
    g = k0 // GROUP
    s = tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rn * stride_zn + g, mask=n_ok, other=0.0).to(tl.float32)
    w = (codes.to(tl.float32) - z[:, None]) * s[:, None]
    kk = tl.arange(0, BLOCK_K)
    dst = w_ptr + rn[:, None] * stride_wn + (k0 + kk)[None, :]
    tl.store(dst, w.to(w_ptr.dtype.element_ty), mask=n_ok[:, None])


@dataclass(frozen=True)
class Plan:
    """Tile sizes and K split of one fused GEMM launch (exposed so tests can see the split)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    tiles_per_split: int
    num_warps: int
    num_stages: int


def block_k_for(group_size: int) -> int:
    """The widest power-of-two K tile (<= 128) inside one group; tl.dot needs at least 16."""
    bk = group_size & -group_size  # largest power of two dividing the group
    bk = min(bk, _MAX_BLOCK_K)
    if bk < 16:
        raise ValueError(f"group size {group_size} is not a multiple of 16 (the kernel's K tile)")
    return bk


@functools.cache
def _sm_count(device: torch.device) -> int:
    """SMs to fill; on the CPU interpreter a nominal H100's 132, so tests exercise the same
    heuristic the GPU runs."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(
    m: int,
    n: int,
    k: int,
    group_size: int,
    device: torch.device,
    split_k: int | None = None,
    dtype: torch.dtype = torch.float16,
) -> Plan:
    """Pick tiles for an `[m, k] @ [k, n]` fused launch; `split_k` forces the split (1 = off),
    None picks one that fills the GPU."""
    bk = block_k_for(group_size)
    if m <= 16:
        bm, bn, warps, stages = 16, 64, 4, 4
    elif m <= 32:
        bm, bn, warps, stages = 32, 64, 4, 4
    else:
        bm, bn, warps, stages = 64, 128, 8, 3
    if dtype == torch.float32 and bm > 16:
        stages = 2  # fp32 tiles are twice the bytes: 3 stages of 64x128 need 144 KB of smem
    k_tiles = k // bk
    if split_k is None:
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        want = _WAVES * _sm_count(device) // tiles
        traffic_cap = int(_MAX_PARTIAL_FRACTION * (n * k / 2) / (8 * m * n))
        split_k = max(1, min(want, k_tiles // _MIN_TILES_PER_SPLIT, traffic_cap))
    split_k = max(1, min(split_k, k_tiles))
    per = triton.cdiv(k_tiles, split_k)
    return Plan(bm, bn, bk, triton.cdiv(k_tiles, per), per, warps, stages)


def _check(x: torch.Tensor, w: W4A16Weight) -> None:
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"activations must be fp16, bf16 or fp32, not {x.dtype}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight takes {w.shape[1]}")
    if w.qweight.dtype != torch.int32 or w.qweight.stride(-1) != 1:
        raise ValueError("qweight must be int32 [N, K // 8] with unit stride along K")
    if w.scales.stride(-1) != 1 or w.zeros.stride(-1) != 1:
        raise ValueError("scales and zeros need unit stride along the groups")


def dequantize(w: W4A16Weight, dtype: torch.dtype) -> torch.Tensor:
    """The stored-order weight `[N, K]` in `dtype`, written by one pass of `_dequant_kernel`."""
    n, k = w.shape
    bk = block_k_for(w.group_size)
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    bn = 64
    _dequant_kernel[(triton.cdiv(n, bn), k // bk)](
        w.qweight,
        w.scales,
        w.zeros,
        out,
        n,
        w.qweight.stride(0),
        w.scales.stride(0),
        w.zeros.stride(0),
        out.stride(0),
        GROUP=w.group_size,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return out


def _fused(x: torch.Tensor, w: W4A16Weight, p: Plan) -> torch.Tensor:
    """The fused GEMM (plus the split-K reduction when `p` splits) on 2-D x."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = p.split_k > 1
    part = torch.empty(p.split_k, m, n, dtype=torch.float32, device=x.device) if split else y
    grid = (triton.cdiv(m, p.block_m), triton.cdiv(n, p.block_n), p.split_k)
    _gemm_kernel[grid](
        x,
        w.qweight,
        w.scales,
        w.zeros,
        y,
        part,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.qweight.stride(0),
        w.scales.stride(0),
        w.zeros.stride(0),
        y.stride(0),
        p.tiles_per_split,
        GROUP=w.group_size,
        BLOCK_M=p.block_m,
        BLOCK_N=p.block_n,
        BLOCK_K=p.block_k,
        SPLIT=split,
        FP32_DOT=x.dtype == torch.float32 or isinstance(_gemm_kernel, InterpretedFunction),
        num_warps=p.num_warps,
        num_stages=p.num_stages,
    )
    _reduce(part, y, p)
    return y


def _reduce(part: torch.Tensor, y: torch.Tensor, p: Plan) -> None:
    """Sum the split-K partials into y (nothing to do without a split)."""
    if p.split_k > 1:
        block, mn = 1024, y.numel()
        _splitk_reduce_kernel[(triton.cdiv(mn, block),)](part, y, mn, p.split_k, BLOCK=block)


def planes_fit(x: torch.Tensor) -> bool:
    """Whether `_planes_kernel` can take activations `x`: 16-bit ones (fp32 ones keep the
    exact fp32 dots of `_gemm_kernel`); any group size and K."""
    return x.dtype != torch.float32


def _fused_planes(x: torch.Tensor, w: W4A16Weight, split_k: int | None) -> torch.Tensor:
    """`_planes_kernel` (plus the split-K reduction) on 2-D x (permutation not yet applied:
    the copy into plane order applies it), in K tiles of 128 (the last one partial)."""
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(k, 128)
    p = plan(m, n, tiles * 128, 128, x.device, split_k, x.dtype)
    xp = plane_order(x, w.perm)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # each row's x sum over each 128-column tile (plane i of tile t holds its words 16 t ..
    # 16 t + 15; K is whole tiles where groups are); smaller groups read none
    sx = xp.view(m, 8, tiles, 16).sum((1, 3), dtype=torch.float32) if w.group_size % 128 == 0 else y
    split = p.split_k > 1
    part = torch.empty(p.split_k, m, n, dtype=torch.float32, device=x.device) if split else y
    grid = (triton.cdiv(m, p.block_m), triton.cdiv(n, p.block_n), p.split_k)
    _planes_kernel[grid](
        xp, sx, w.qweight, w.scales, w.zeros, y, part, m, n, k // 8, k,
        sx.stride(0), w.qweight.stride(0), w.scales.stride(0),
        w.zeros.stride(0), y.stride(0), p.tiles_per_split, GROUP=w.group_size,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, SPLIT=split, BF16=x.dtype == torch.bfloat16,
        FP32_DOT=isinstance(_planes_kernel, InterpretedFunction), num_warps=p.num_warps,
        num_stages=p.num_stages,
    )  # fmt: skip
    _reduce(part, y, p)
    return y


def matmul(
    x: torch.Tensor,
    w: W4A16Weight,
    *,
    split_k: int | None = None,
    large_m: int = LARGE_M,
    planes: bool | None = None,
) -> torch.Tensor:
    """`x @ W.T` for x `[..., K]`: the fused kernel up to `large_m` rows, dequantise +
    `torch.matmul` above. `split_k` forces the fused kernel's K split (1 = none); `planes`
    takes the nibble-plane kernel where `planes_fit` (None: as `dispatch.w4a16_planes` says,
    opt-in until a device run has timed it)."""
    _check(x, w)
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    if planes is None:
        from kvguard.kernels.dispatch import w4a16_planes

        planes = w4a16_planes()
    if m <= large_m and planes and planes_fit(x2):
        return _fused_planes(x2, w, split_k).reshape(*lead, n)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    if m > large_m:
        y = x2 @ dequantize(w, x.dtype).T
    else:
        y = _fused(x2, w, plan(m, n, k, w.group_size, x.device, split_k, x.dtype))
    return y.reshape(*lead, n)
