"""Paged attention as Triton kernels: decode (single-token queries), the CUDA fast path, and
prefill chunks (opt-in, `dispatch.use_triton_prefill`).

Same layout as the torch path (`kvguard.kernels.paged_attention`): caches are
`[num_blocks, block_size, kv_heads, head_dim]`, a sequence's tokens live in the blocks its row
of `block_tables` lists, and queries are `[B, heads, head_dim]`, one token per sequence.

Why a kernel: the torch decode path first gathers every sequence's blocks into a contiguous
workspace (and, for FP8, dequantises it there), so each decode step reads the KV cache, writes
a copy and reads the copy again. This kernel reads each K/V element once, straight from the
pool through the block table, and dequantises FP8 in registers.

How it works: one program per (sequence, KV head, context split). It loads the queries of all
heads that share the KV head (GQA needs no K/V repeat; the group is padded to 16 rows), walks
its share of the context in tiles of `tile` tokens (a tile may span blocks: every token looks up
its own block id, so partial blocks and any block order just work), and keeps an online softmax
(running max `m`, running sum `l`, unnormalised output `acc`) in fp32. Both products are
`tl.dot`s: on tensor cores, with loads Triton pipelines ahead of them. The first H200 run had
the earlier form (per-element products summed in registers) at 41-45% of copy bandwidth on
Llama-2-7B's shape and 3-8% on SmolLM2's; the dots give 83-101% there (bench/README.md). Long
contexts with few sequences would leave most of the GPU idle with one program per (sequence,
head), so the context is split and a second small kernel merges the splits by their
log-sum-exp (flash-decoding).

The prefill kernel takes a block of a chunk's queries for all heads of a group per program and
the same tiles, with each query's causal limit; one launch serves every chunk of a step.

`triton` is imported when this module is imported, never by `kvguard.kernels` itself: import
this module only after `kvguard.kernels.dispatch.use_triton` said yes (or in tests).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvguard.kernels import dispatch
from kvguard.kernels.fp8 import FP8_DTYPE

_LOG2E = 1.4426950408889634
# Work below which a split is not worth its merge: a split reads at least this many tokens.
_MIN_SPLIT_TOKENS = 256
# Aim for this many programs so every SM has a few to switch between (H100/H200 have 132 SMs).
_TARGET_PROGRAMS = 528
# The interpreter computes in numpy, where bf16 arithmetic is wrong: there bf16 dots run in
# fp32 (fp16 ones, FP8 caches' included, keep their 16-bit path, so the CPU tests cover it).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _as_dot_input(q, DOT_F32: tl.constexpr, DOT_F16: tl.constexpr):
    """Queries in the dtype the dots run in (see `_decode_kernel`)."""
    if DOT_F32:
        q = q.to(tl.float32)
    elif DOT_F16:
        q = q.to(tl.float16)
    return q


@triton.jit
def _widen_e4m3(x):
    """e4m3 codes (loaded as uint8) to fp16 where they were loaded, four at a time by the
    hardware's `cvt.rn.f16x2.e4m3x2` (sm_89+, the GPUs FP8 caches take Triton on).

    A plain `.to(tl.float16)` gives the same values, but Triton moves such a cast past the
    tile's layout change to the dot operand, to shuffle half the bytes: the sm_90 build then
    reads the 8-bit tile back from shared memory a byte or two per lane (scalar LDS, no
    ldmatrix) and needs about twice the registers of the bf16 kernel (tests/triton_sm90.py).
    Inline asm marked impure is not moved, so the tile is widened as it arrives and goes
    through shared memory as fp16, read with ldmatrix like a bf16 tile."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def _attend_tile(
    q,
    m,
    lsum,
    acc,
    toks,
    t_ok,
    pos,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_row_ptr,
    kvh,
    d,
    d_ok,
    stride_cb,
    stride_cs,
    stride_ch,
    num_kv_heads,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
    CAUSAL: tl.constexpr,
    WIDEN_EARLY: tl.constexpr = False,
):
    """One tile of keys `toks` (valid where `t_ok`) into the online softmax (`m`, `lsum`, `acc`)
    of query rows `q`: the tile's K/V are read through the sequence's block-table row, FP8
    scales go on the scores and probabilities; with CAUSAL, row r sees keys up to `pos[r]`.
    WIDEN_EARLY (FP8 on a GPU): the codes are widened to fp16 as loaded (`_widen_e4m3`)."""
    blk = tl.load(table_row_ptr + toks // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
    row = blk * stride_cb + (toks % BLOCK_SIZE) * stride_cs + kvh * stride_ch
    kv_mask = t_ok[:, None] & d_ok[None, :]
    offs = row[:, None] + d[None, :]
    if WIDEN_EARLY:
        u8 = tl.pointer_type(tl.uint8)
        k = _widen_e4m3(tl.load(k_ptr.to(u8, bitcast=True) + offs, mask=kv_mask, other=0))
        v = _widen_e4m3(tl.load(v_ptr.to(u8, bitcast=True) + offs, mask=kv_mask, other=0))
    else:
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k))  # [rows, TILE], fp32
    if IS_FP8:
        k_sc = tl.load(ks_ptr + blk * num_kv_heads + kvh, mask=t_ok, other=0.0)
        scores = scores * k_sc[None, :]
    if CAUSAL:  # noqa: SIM108 - a constexpr branch
        visible = t_ok[None, :] & (toks[None, :] <= pos[:, None])
    else:
        visible = t_ok[None, :]
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    lsum = lsum * alpha + tl.sum(p, axis=1)
    if IS_FP8:
        p = p * tl.load(vs_ptr + blk * num_kv_heads + kvh, mask=t_ok, other=0.0)[None, :]
    if DOT_F32:  # noqa: SIM108 - kept a constexpr branch, as the one above
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v)
    return m_new, lsum, acc * alpha[:, None] + pv


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    qk_scale,
    tokens_per_split,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_tb,
    stride_ob,
    stride_oh,
    num_kv_heads,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    IS_FP8: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_F16: tl.constexpr,
    WIDEN_EARLY: tl.constexpr,
):
    """Attention of one sequence's query heads (one GQA group) over one split of its context.

    Both products are `tl.dot`s (tensor cores, and loads Triton can pipeline ahead of them):
    the group's queries are padded to `GROUP_PAD` (at least 16) rows. With `DOT_F32` they run
    in fp32 at full precision (fp32 models, and bf16 in the CPU interpreter); with `DOT_F16`
    in fp16 (FP8 caches: e4m3 widens to fp16 exactly and in hardware, to bf16 only by a longer
    emulated path); otherwise in q's dtype (bf16/fp16). Both accumulate in fp32. FP8 per-block
    scales are applied to the scores and the probabilities instead of to the tiles.

    With SPLIT the normalised partial output and its `m`/`l` go to the workspace for
    `_merge_kernel`; without, the final output goes straight to `out_ptr`. `qk_scale` already
    includes log2(e) so the softmax uses exp2. K and V share strides (they are allocated alike).
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = _as_dot_input(q, DOT_F32, DOT_F16)

    seq_len = tl.load(lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    lsum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)

    for t0 in range(start, end, TILE):
        toks = t0 + tl.arange(0, TILE)
        m, lsum, acc = _attend_tile(
            q, m, lsum, acc, toks, toks < end, m, k_ptr, v_ptr, ks_ptr, vs_ptr,  # (pos unused)
            table_ptr + b * stride_tb, kvh, d, d_ok, stride_cb, stride_cs, stride_ch,
            num_kv_heads, qk_scale, BLOCK_SIZE, IS_FP8, DOT_F32, False,  # not causal
            WIDEN_EARLY,
        )  # fmt: skip

    # An empty split (context shorter than the split grid) leaves l == 0: output 0, weight 0.
    o = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    o_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = (b * num_kv_heads * GROUP + heads) * num_splits + split
        tl.store(part_o_ptr + part[:, None] * DIM_PAD + d[None, :], o, mask=o_mask)
        tl.store(part_m_ptr + part, m, mask=g_ok)
        tl.store(part_l_ptr + part, lsum, mask=g_ok)
    else:
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_kernel(
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Combine one (sequence, head)'s split outputs, each weighted by `l * 2^(m - max m)`."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_ok = s < num_splits
    base = (b * num_heads + h) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=float("-inf"))
    lsum = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)
    o = tl.load(
        part_o_ptr + (base + s)[:, None] * DIM_PAD + d[None, :], mask=s_ok[:, None], other=0.0
    )
    m_max = tl.max(m, axis=0)
    w = tl.where(lsum > 0, lsum * tl.exp2(m - m_max), 0.0)
    # a row with no tokens (a CUDA-graph padding row) has no weight anywhere: 0, not 0/0; a
    # live row's weights sum to at least 1 (its largest split's own maximum counts exp2(0))
    res = tl.sum(o * w[:, None], axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    dst = out_ptr + b * stride_ob + h * stride_oh + d
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_config(dim_pad: int, fp8: bool) -> tuple[int, int, int, bool]:
    """(tokens per tile, warps, pipeline stages, FP8 widened as loaded), from the H200 sweep
    (bench/gpu_kernels.py --sweep, batch 64, 4k context): 16-bit caches 64-token tiles, 8
    warps from head size 128 (98% of copy bandwidth on Llama-2-7B's shape); FP8 caches
    128-token tiles, 4 warps. With `KVGUARD_FP8_EARLY_WIDEN=1` (opt-in until a device run has
    timed it) FP8 tiles are widened as loaded (`_widen_e4m3`) in 128-token tiles of 8 warps:
    the sm_90 build needs 96 registers there against 205, and issues about 15% fewer
    instructions per cached token than the bf16 kernel (29 warp-instructions against 34)."""
    if fp8 and dispatch.fp8_early_widen() and not _INTERPRETED:
        return (128 if dim_pad <= 128 else 64), 8, 2, True
    if fp8:
        return (128 if dim_pad <= 128 else 64), 4, 2, False
    return (64 if dim_pad <= 128 else 32), (4 if dim_pad <= 64 else 8), 2, False


def choose_splits(
    batch: int, kv_heads: int, max_seq_len: int, target: int = _TARGET_PROGRAMS
) -> int:
    """How many pieces to cut each context into: about `target` programs, to fill the GPU, but
    no piece shorter than `_MIN_SPLIT_TOKENS` (below that the merge costs more than the
    parallelism buys)."""
    want = math.ceil(target / max(1, batch * kv_heads))
    most = max(1, math.ceil(max_seq_len / _MIN_SPLIT_TOKENS))
    return max(1, min(want, most))


def _dot_flags(q_dtype: torch.dtype, is_fp8: bool) -> dict[str, bool]:
    """The kernels' dot dtype (see `_decode_kernel`): fp32 for fp32 queries (and bf16 ones in
    the interpreter, whose bf16 arithmetic is wrong, unless an FP8 cache takes fp16), fp16 for
    an FP8 cache, else the queries' own 16-bit dtype."""
    f32 = q_dtype == torch.float32 or (_INTERPRETED and q_dtype == torch.bfloat16 and not is_fp8)
    return {"DOT_F32": f32, "DOT_F16": is_fp8}


def _check_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Refuse a cache the kernels cannot read for these queries; True for an FP8 cache."""
    _, nh, hd = q.shape
    _, _, hkv, hd_c = k_cache.shape
    if hd_c != hd or nh % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches must share strides and have a contiguous head_dim")
    is_fp8 = k_cache.dtype == FP8_DTYPE
    if is_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 cache needs k_scale and v_scale")
    return is_fp8


def _scale_args(
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    is_fp8: bool,
    dummy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' K/V scale arguments: an FP8 cache's block scales as contiguous fp32, else
    `dummy` (any tensor: a constexpr branch never reads it)."""
    if not is_fp8:
        return dummy, dummy
    return k_scale.float().contiguous(), v_scale.float().contiguous()


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: tuple[int, int, int] | tuple[int, int, int, bool] | None = None,
) -> torch.Tensor:
    """Decode attention: `q` `[B, heads, head_dim]` over each sequence's first `seq_lens[b]`
    cached tokens (all valid, so no causal mask). Returns `[B, heads, head_dim]` in q's dtype.

    `max_seq_len` is a host int so the split count is chosen without a device sync;
    `num_splits` overrides the heuristic (tests use it to cover both kernels); `config`
    overrides `decode_config`'s (tile, warps, stages[, FP8 widened as loaded]) (the GPU
    benchmark compares them). The interpreter cannot run the early widening's inline asm:
    there FP8 tiles are always widened by a cast.
    """
    bsz, nh, hd = q.shape
    _, block_size, hkv, _ = k_cache.shape
    is_fp8 = _check_cache(q, k_cache, v_cache, k_scale, v_scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.to(torch.int32)
    seq_lens = seq_lens.to(device=q.device, dtype=torch.int32)
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    group = nh // hkv
    # tl.dot wants every dimension at least 16: a group of 1-15 heads is padded with zero rows
    group_pad, dim_pad = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(hd))
    tile, warps, stages, *early = config or decode_config(dim_pad, is_fp8)
    widen_early = bool(early and early[0]) and is_fp8 and not _INTERPRETED
    splits = num_splits or choose_splits(bsz, hkv, max_seq_len)
    per_split = math.ceil(max(1, max_seq_len) / splits / tile) * tile
    splits = max(1, math.ceil(max(1, max_seq_len) / per_split))
    dummy = out  # stands in for pointers a constexpr branch never touches
    ks, vs = _scale_args(k_scale, v_scale, is_fp8, dummy)
    if splits > 1:
        part_o = torch.empty(bsz * nh * splits, dim_pad, dtype=torch.float32, device=q.device)
        part_m = torch.empty(bsz * nh * splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = dummy
    _decode_kernel[(bsz, hkv, splits)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        block_tables,
        seq_lens,
        out,
        part_o,
        part_m,
        part_l,
        scale * _LOG2E,
        per_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        hkv,
        splits,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=hd,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        TILE=tile,
        IS_FP8=is_fp8,
        SPLIT=splits > 1,
        **_dot_flags(q.dtype, is_fp8),
        WIDEN_EARLY=widen_early,
        num_warps=warps,
        num_stages=stages,
    )
    if splits > 1:
        _merge_kernel[(bsz, nh)](
            out,
            part_o,
            part_m,
            part_l,
            out.stride(0),
            out.stride(1),
            nh,
            splits,
            HEAD_DIM=hd,
            DIM_PAD=dim_pad,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out


def decode_rows(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    starts: list[int],
    rows: list[int],
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The decode rows of a mixed batch, in `paged_attention`'s terms: sequences `rows` have
    one query each, at flat position `starts[i]` of `q`/`out` `[T, heads, head_dim]`."""
    dev = q.device
    lens = [seq_lens[i] for i in rows]
    if rows == list(range(len(rows))) and starts[: len(rows)] == rows:
        # All-decode batch (the common case): no gather or scatter of q/out needed.
        n = len(rows)
        lens_t = torch.tensor(lens, dtype=torch.int32).to(dev, non_blocking=True)
        out[:n] = paged_decode(
            q[:n], k_cache, v_cache, block_tables[:n], lens_t, max(lens), scale, k_scale, v_scale
        )
        return
    idx = torch.tensor(rows, device=dev)
    qpos = torch.tensor([starts[i] for i in rows], device=dev)
    o = paged_decode(
        q.index_select(0, qpos),
        k_cache,
        v_cache,
        block_tables.index_select(0, idx),
        torch.tensor(lens, dtype=torch.int32, device=dev),
        max(lens),
        scale,
        k_scale,
        v_scale,
    )
    out.index_copy_(0, qpos, o)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_ptr,
    out_ptr,
    tile_seq_ptr,
    tile_q0_ptr,
    seq_lens_ptr,
    q_lens_ptr,
    q_starts_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_tb,
    stride_ot,
    stride_oh,
    num_kv_heads,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_F16: tl.constexpr,
):
    """Causal attention of `BLOCK_M` queries of one prefill chunk, all heads of one GQA group
    (rows r = token * GROUP_PAD + head), over the sequence's cached tokens up to each query's
    own position. The chunk's queries are the last `q_len` of the sequence's `seq_len` tokens
    (bottom-right causal: query j sits at position seq_len - q_len + j). Dots, dtypes and FP8
    scales as in `_decode_kernel`."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    q_start = tl.load(q_starts_ptr + seq).to(tl.int64)

    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = q0 + r // GROUP_PAD
    g = r % GROUP_PAD
    d = tl.arange(0, DIM_PAD)
    row_ok = (tok < q_len) & (g < GROUP)
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = _as_dot_input(q, DOT_F32, DOT_F16)
    # each row's last visible key; rows past the chunk see what its last query sees (finite,
    # never stored)
    pos = seq_len - q_len + tl.minimum(tok, q_len - 1)
    end = seq_len - q_len + tl.minimum(q0 + BLOCK_M, q_len)

    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
    lsum = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM_PAD], dtype=tl.float32)
    for t0 in range(0, end, TILE):
        toks = t0 + tl.arange(0, TILE)
        m, lsum, acc = _attend_tile(
            q, m, lsum, acc, toks, toks < end, pos, k_ptr, v_ptr, ks_ptr, vs_ptr,
            table_ptr + seq * stride_tb, kvh, d, d_ok, stride_cb, stride_cs, stride_ch,
            num_kv_heads, qk_scale, BLOCK_SIZE, IS_FP8, DOT_F32, True,  # causal
        )  # fmt: skip
    o = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    dst = out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_rows(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    starts: list[int],
    rows: list[int],
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The prefill chunks of a mixed batch, in `paged_attention`'s terms: sequences `rows`
    have `query_lens[i]` queries at flat rows `starts[i]...` of `q`/`out` `[T, heads, dim]`,
    the last of their `seq_lens[i]` tokens (all already in the cache). One launch for all."""
    _, nh, hd = q.shape
    _, block_size, hkv, _ = k_cache.shape
    is_fp8 = _check_cache(q, k_cache, v_cache, k_scale, v_scale)
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q and out need a contiguous head_dim")
    if not rows:
        return
    group = nh // hkv
    group_pad, dim_pad = triton.next_power_of_2(group), max(16, triton.next_power_of_2(hd))
    block_m = max(16, 64 // group_pad)
    tile = 32 if dim_pad > 128 else 64
    tile_seq, tile_q0 = [], []
    for i in rows:
        for q0 in range(0, query_lens[i], block_m):
            tile_seq.append(i)
            tile_q0.append(q0)
    dev = q.device
    meta = torch.tensor([tile_seq, tile_q0], dtype=torch.int32).to(dev, non_blocking=True)
    per_seq = torch.tensor([seq_lens, query_lens, starts], dtype=torch.int32).to(
        dev, non_blocking=True
    )
    tables = block_tables.to(torch.int32)
    ks, vs = _scale_args(k_scale, v_scale, is_fp8, out)
    _prefill_kernel[(len(tile_seq), hkv)](
        q, k_cache, v_cache, ks, vs, tables, out, meta[0], meta[1],
        per_seq[0], per_seq[1], per_seq[2], scale * _LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1), hkv,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=hd, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, TILE=tile, IS_FP8=is_fp8, **_dot_flags(q.dtype, is_fp8),
        num_warps=4, num_stages=2,
    )  # fmt: skip
