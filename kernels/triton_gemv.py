"""Skinny GEMMs for decode: `y = x @ W.T` for a few rows of x (at most `MAX_ROWS`), as Triton
kernels that stream the weight once at the memory's pace.

Why: a decode step at small batch reads every weight once and does almost no arithmetic with
it, so its projections should run at the GPU's memory bandwidth. On the H200 of the first
device runs cuBLAS's batch-1 bf16 GEMMs did not: a 4096 x 4096 weight (32 MiB) took 19 us
(1.77 TB/s, 42% of the measured 4.25 TB/s copy bandwidth), Llama-2-7B's MLP shapes 2.4-2.6
TB/s; a Llama-2-7B decode step spends most of its time there, which is why batch-1 decode
stood at 45% of its bandwidth limit. The 4-bit weights' tiled GEMM (`triton_w4a16`, tensor
cores over 16-row tiles) did worse still at decode sizes: 0.1-0.37 TB/s of codes (2-9%).

How: one program per `BLOCK_N` output columns (weight rows) walks the whole K range, tile by
tile, and every row of x is dotted with the tile while it is in registers, so the weight is
read once whatever the row count. No split of K: a grid of N / BLOCK_N programs (hundreds at
decode shapes, `config` picks BLOCK_N so) keeps the GPU's memory busy without the partial
sums and second launch a split needs, and each output is one program's fp32 sum in a fixed
order (deterministic). Triton does not software-pipeline loads that feed no `tl.dot`, so the
kernels do it by hand: a program loads its next weight tile before it multiplies the one it
has (two tiles in flight), and `config` sizes tiles to several KiB. A single x row is read in
the weight tile's own shape (every tile row the same addresses, served by L1): loaded as a
vector it had to be converted to the tile's layout through shared memory, which the sm_90
build showed as barriers in every tile (tests/test_triton_sm90.py builds these kernels without
a GPU). Products and sums are fp32 whatever the activation dtype; the result is cast to x's
dtype, as cuBLAS's is. Past `MAX_ROWS` rows the products outgrow the memory time (a bf16
weight element feeds one FMA per row) and cuBLAS's tensor cores win.

The 4-bit kernel reads `w4a16.W4A16Weight`'s words (eight codes along K, low nibble first) as a
`[BLOCK_N, WORDS]` tile and takes it one nibble plane at a time: plane i holds the codes of x's
columns `8 w + i`, so each plane is an ordinary `[BLOCK_N, WORDS]` tile against a slice of x
(x is first copied into plane order, so that slice is contiguous), never eight times the words
in registers. A code becomes the float 1 + code / 16 by moving its nibble into 1.0's top
mantissa bits (two integer instructions, not the quarter-rate int-to-float conversion, nor a
subtraction); the 1 comes back out with each word's x sum, computed once per call. Each word
lies in one quantisation group (the group size is a multiple of 8), so its scale and zero
apply once to the word's dot: `s * (dot(codes, x) - z * sum(x))`, here
`s * (16 * dot(1 + codes / 16, x) - (16 + z) * sum(x))`. In the sm_90 build that took a
one-row tile from 644 to 570 instructions a warp and 72 to 60 registers.

Opt-in (`KVGUARD_TRITON_GEMV=1`, or `dense` / `4bit` for one kind of weight;
`dispatch.gemv_rows`) until a device run has timed it against cuBLAS and the tiled W4A16 GEMM
(bench/gpu_gemv.py; bench/gpu_e2e.py decodes with it on, dense and 4-bit models).
Under Triton's CPU interpreter (tests) the same kernels run on CPU tensors.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvguard.kernels.dispatch import GEMV_MAX_ROWS
from kvguard.kernels.w4a16 import PACK, W4A16Weight, plane_order

__all__ = ["MAX_ROWS", "GemvConfig", "config", "linear", "w4a16_linear"]

MAX_ROWS = GEMV_MAX_ROWS  # rows of x up to which a skinny GEMM beats the tensor cores (above)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# a grid of at least this many programs per SM keeps enough loads in flight
_PROGRAMS_PER_SM = 2


@triton.jit
def _dense_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Columns `[pid * BLOCK_N, +BLOCK_N)` of y for all ROWS rows of x, over the whole K."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS_PAD)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # one row: sums per lane, reduced once
    # the next tile is loaded before this one is used: two tiles in flight per program
    w_next = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        w = w_next.to(tl.float32)
        w_ok = n_ok[:, None] & k_ok[None, :]
        after = kk + BLOCK_K
        w_next = tl.load(
            w_rows + after[None, :], mask=n_ok[:, None] & (after < K)[None, :], other=0.0
        )
        if ROWS == 1:  # x read in w's own shape (the same addresses per row, from L1): no
            # layout conversion through shared memory
            x_at = tl.broadcast_to(x_ptr + kk[None, :], (BLOCK_N, BLOCK_K))
            x = tl.load(x_at, mask=w_ok, other=0.0)
            lanes += w * x.to(tl.float32)
        else:
            for r in tl.static_range(ROWS):
                x = tl.load(x_ptr + r * stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
                part = tl.sum(w * x[None, :], axis=1)
                acc = tl.where(rows[:, None] == r, acc + part[None, :], acc)
    if ROWS == 1:
        acc = tl.sum(lanes, axis=1)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dst = y_ptr + rows[:, None] * stride_ym + rn[None, :]
    ok = (rows[:, None] < ROWS) & n_ok[None, :]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def code_plane(words, i: tl.constexpr):
    """Code i of each word as the float 1 + code / 16, in two integer instructions: the
    nibble shifted into the top four mantissa bits of 1.0 (no quarter-rate int-to-float
    conversion, no subtraction). A product with it is exact in fp32 for 16-bit x; the 1 is
    taken back per word with the word's x sum (`_w4_kernel`), or by the FMA that
    dequantises it (`triton_w4a16._planes_kernel`)."""
    if 4 * i <= 19:  # noqa: SIM108 - a constexpr branch (a shift count cannot be negative)
        bits = (words << (19 - 4 * i)) & 0x780000
    else:
        bits = (words >> (4 * i - 19)) & 0x780000
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _w4_kernel(
    xp_ptr,
    sx_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    n_words,
    stride_xm,
    stride_sxm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_ym,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
):
    """As `_dense_kernel` for packed 4-bit weights: a tile is `[BLOCK_N, WORDS]` int32 words,
    taken one nibble plane at a time. `xp` is x in plane order (`[rows, 8, n_words]`: plane i
    holds x's columns `8 w + i`), so each plane meets a contiguous slice of every x row; `sx`
    (`[rows, n_words]`, fp32) sums each word's eight x values. A word's planes are the floats
    1 + code / 16 (`code_plane`), so its dot with x is `16 * dot - 16 * sx`, and with the zero
    point and scale, `w = (code - z) * s`, the word adds `(16 * dot - (16 + z) * sx) * s`."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rw = tl.arange(0, WORDS)
    rows = tl.arange(0, ROWS_PAD)
    r_ok = rows < ROWS
    rn64 = rn.to(tl.int64)
    x_rows = xp_ptr + rows[:, None] * stride_xm
    sx_rows = sx_ptr + rows[:, None] * stride_sxm
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    lanes = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)  # one row: sums per word lane
    w_rows = qw_ptr + rn64[:, None] * stride_qn
    # the next tile's words are loaded before this one's are used: two in flight per program
    w_next = tl.load(w_rows + rw[None, :], mask=n_ok[:, None] & (rw < n_words)[None, :], other=0)
    for w0 in range(0, n_words, WORDS):
        ww = w0 + rw
        w_ok = ww < n_words
        tile_ok = n_ok[:, None] & w_ok[None, :]
        x_ok = r_ok[:, None] & w_ok[None, :]
        words = w_next
        after = ww + WORDS
        w_next = tl.load(
            w_rows + after[None, :], mask=n_ok[:, None] & (after < n_words)[None, :], other=0
        )
        g = (ww * 8) // GROUP  # each word lies in one group
        s = tl.load(s_ptr + rn64[:, None] * stride_sn + g[None, :], mask=tile_ok, other=0.0)
        z = tl.load(z_ptr + rn64[:, None] * stride_zn + g[None, :], mask=tile_ok, other=0.0)
        if ROWS == 1:
            # x's plane read in the words' own [BLOCK_N, WORDS] shape (each row of the tile
            # the same addresses, from L1), so no layout conversion goes through shared memory
            x_at = tl.broadcast_to(xp_ptr + ww[None, :], (BLOCK_N, WORDS))
            dot1 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
            for i in tl.static_range(8):
                x = tl.load(x_at + i * n_words, mask=tile_ok, other=0.0).to(tl.float32)
                dot1 += code_plane(words, i) * x
            sx_at = tl.broadcast_to(sx_ptr + ww[None, :], (BLOCK_N, WORDS))
            sum1 = tl.load(sx_at, mask=tile_ok, other=0.0)
            lanes += (16.0 * dot1 - (16.0 + z.to(tl.float32)) * sum1) * s.to(tl.float32)
        else:
            dots = tl.zeros((ROWS_PAD, BLOCK_N, WORDS), dtype=tl.float32)
            for i in tl.static_range(8):
                x = tl.load(x_rows + i * n_words + ww[None, :], mask=x_ok, other=0.0)
                dots += code_plane(words, i)[None, :, :] * x.to(tl.float32)[:, None, :]
            x_sum = tl.load(sx_rows + ww[None, :], mask=x_ok, other=0.0)
            z3 = 16.0 + z.to(tl.float32)[None, :, :]
            part = 16.0 * dots - z3 * x_sum[:, None, :]
            acc += tl.sum(part * s.to(tl.float32)[None], axis=2)
    if ROWS == 1:
        acc = tl.sum(lanes, axis=1)[None, :]
    dst = y_ptr + rows[:, None] * stride_ym + rn[None, :]
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class GemvConfig:
    """One launch's tiles: `block_n` weight rows a program, `block_k` K elements a tile (for 4-bit
    weights a multiple of 8: `block_k // 8` words), and warps a program."""

    block_n: int
    block_k: int
    num_warps: int = 4


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def config(n: int, k: int, sms: int, packed: bool = False, rows: int = 1) -> GemvConfig:
    """Tiles for an `[n, k]` weight on a GPU of `sms` SMs: 8 weight rows a program (4 where
    that leaves the grid short of `_PROGRAMS_PER_SM` programs an SM), and K tiles that keep
    several KiB of weight in flight per program: 512 weights of a 16-bit row (1 KiB); 4-bit
    rows 1024 weights at one x row, fewer as x's rows multiply the per-lane sums (down to 256
    at 8 rows), which keeps the kernel under 130 registers a thread (sm_90 build) without
    spilling. Never wider than k needs (a power of two)."""
    bn = 8 if triton.cdiv(n, 8) >= _PROGRAMS_PER_SM * sms else 4
    bk = PACK * max(32, 128 // triton.next_power_of_2(rows)) if packed else 512
    return GemvConfig(bn, min(bk, max(triton.next_power_of_2(k), 2 * PACK if packed else 16)))


def _config_for(x: torch.Tensor, n: int, k: int, packed: bool) -> GemvConfig:
    """`config` for x's device; in Triton's CPU interpreter (tests), which runs every program
    in Python, 32 weight rows a program instead: eight times fewer programs."""
    rows = x.numel() // k
    if x.device.type != "cuda":
        return dataclasses.replace(config(n, k, 1, packed, rows), block_n=32)
    return config(n, k, _sm_count(x.device), packed, rows)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype not in _DTYPES:
        raise ValueError(f"activations must be fp16, bf16 or fp32, not {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight takes {k}")
    x2 = x.reshape(-1, k)
    if x2.shape[0] > MAX_ROWS:
        raise ValueError(f"{x2.shape[0]} rows: the skinny GEMM takes at most {MAX_ROWS}")
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: GemvConfig | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for at most `MAX_ROWS` rows of x `[..., K]`; `weight` `[N, K]`
    with unit stride along K (any 16- or 32-bit float), y in x's dtype."""
    n, k = weight.shape
    x2 = _rows(x, k)
    if weight.stride(-1) != 1 or weight.dtype not in _DTYPES:
        raise ValueError("the weight must be fp16, bf16 or fp32 with unit stride along K")
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        cfg = cfg or _config_for(x2, n, k, packed=False)
        _dense_kernel[(triton.cdiv(n, cfg.block_n),)](
            x2, weight, weight if bias is None else bias, y, n, k, x2.stride(0),
            weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, ROWS=m,
            ROWS_PAD=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    return y.view(*x.shape[:-1], n)


def w4a16_linear(x: torch.Tensor, w: W4A16Weight, cfg: GemvConfig | None = None) -> torch.Tensor:
    """`x @ W.T` for a packed 4-bit weight (`w4a16.pack_for_triton`) and at most `MAX_ROWS`
    rows of x, y in x's dtype. x is first gathered into plane order (one small copy of the
    rows, with the desc_act permutation folded in)."""
    n, k = w.shape
    x2 = _rows(x, k)
    if w.group_size % PACK:
        raise ValueError(f"group size {w.group_size} is not a multiple of {PACK} (one word)")
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        cfg = cfg or _config_for(x2, n, k, packed=True)
        if cfg.block_k % PACK:
            raise ValueError(f"block_k {cfg.block_k} is not whole words of {PACK}")
        xp = plane_order(x2, w.perm)
        # each word's eight x values summed (fp32): plane i of word w is column i * words + w
        sx = xp.view(m, PACK, k // PACK).sum(1, dtype=torch.float32)
        _w4_kernel[(triton.cdiv(n, cfg.block_n),)](
            xp, sx, w.qweight, w.scales, w.zeros, y, n, k // PACK, k, sx.stride(0),
            w.qweight.stride(0), w.scales.stride(0), w.zeros.stride(0), y.stride(0),
            GROUP=w.group_size, ROWS=m, ROWS_PAD=triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
            WORDS=cfg.block_k // PACK, num_warps=cfg.num_warps,
        )  # fmt: skip
    return y.view(*x.shape[:-1], n)
