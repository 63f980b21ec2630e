"""KV-cache writes as a Triton kernel: the CUDA path for `write_kv`.

`write_kv` stores this step's K/V `[T, kv_heads, head_dim]` at flat slots
`block * block_size + offset` of a `[num_blocks, block_size, kv_heads, head_dim]` cache. On CUDA
the torch `index_copy_` path launches a dtype cast plus a scatter per tensor; this kernel does the
cast (or the FP8 quantisation) and the scatter in one pass, one program per token.

FP8 split of work: the per-block scale bookkeeping stays in torch (`fp8.grow_scales`, the same
algorithm as `kvguard.kernels.fp8.write_kv_fp8`): zero the scale of blocks that start afresh, take
the per-block-per-head amax of the new tokens, grow scales and requantise the few blocks whose
scale grew. That part touches whole blocks only on growth, is data-dependent (`unique`, a
conditional requantise) and is rare after a block's first tokens, so a kernel buys little. The
kernel then quantises the new tokens with the final scales: `x / scale`, clamped to ±448, cast
to e4m3. A decode step's tokens are each alone in their block (`own_blocks`): there one kernel
(`store_fp8_own_blocks`) does the bookkeeping too, with no `unique` and no host sync, which is
what lets a CUDA graph replay an FP8 pool's decode steps.

Swap copies (`kv_cache.copy_blocks`) have no Triton kernel on purpose: they move blocks between
the device pool and the pinned host pool, which is a PCIe DMA that `index_select` + `.to()` +
`index_copy_` already drive at copy-engine speed; a Triton kernel can only run on one side of that
copy and would add nothing but a device-side gather torch already does with one kernel.

Slots < 0 are skipped (padding tokens), which the torch path does not need but costs nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvguard.kernels.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, grow_scales


@triton.jit
def _clamp_fp8(x, FP8_LIMIT: tl.constexpr):
    """x clamped to ±FP8_LIMIT, a NaN kept (as torch's clamp keeps it): Triton's min/max drop a
    NaN unless told to propagate it, which stored a NaN quotient (a NaN scale's tokens) as -448
    where the torch path stores NaN."""
    lo = tl.maximum(x, -FP8_LIMIT, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(lo, FP8_LIMIT, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _to_e4m3(x, scale, FP8_LIMIT: tl.constexpr, cache_ptr):
    """x / scale as the cache's e4m3 codes, saturated (a NaN stays NaN). The quotient is
    correctly rounded, as torch divides: a compiled `/` may be off by an ulp or two, which
    moves a quotient at an e4m3 rounding boundary to the next code."""
    return _clamp_fp8(tl.math.div_rn(x, scale), FP8_LIMIT).to(cache_ptr.dtype.element_ty)


@triton.jit
def _write_kernel(
    x_ptr,
    cache_ptr,
    slots_ptr,
    scales_ptr,
    stride_xt,
    stride_xh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    """Store all KV heads of token `program_id(0)` at its slot (quantised for an FP8 cache)."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    # Broadcast the slot check to a tensor: the interpreter rejects a scalar bool in a mask.
    h_ok = (h < HEADS) & ((h * 0 + slot) >= 0)
    ok = h_ok[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=ok, other=0.0)
    blk = slot // BLOCK_SIZE
    dst = cache_ptr + blk * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst = dst + h[:, None] * stride_ch + d[None, :]
    if IS_FP8:
        s = tl.load(scales_ptr + blk * HEADS + h, mask=h_ok, other=1.0)
        tl.store(dst, _to_e4m3(x.to(tl.float32), s[:, None], FP8_LIMIT, cache_ptr), mask=ok)
    else:
        tl.store(dst, x.to(tl.float32).to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _write_fp8_own_block_kernel(
    x_ptr,
    cache_ptr,
    slots_ptr,
    scales_ptr,
    stride_xt,
    stride_xh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    TINY: tl.constexpr,
):
    """Token `program_id(0)`, KV head `program_id(1)`, alone in its block: `grow_scales` and the
    store in one pass, with no host sync (a CUDA graph can hold it). A token at offset 0 starts
    its block afresh; otherwise the block's scale grows to hold it, the block's other rows
    requantised by old / new where it grew."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, DIM_PAD)
    r = tl.arange(0, BLOCK_SIZE)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    live = (d * 0 + slot) >= 0  # a padding token (slot < 0) writes nothing
    d_ok = (d < HEAD_DIM) & live
    blk = tl.maximum(slot, 0) // BLOCK_SIZE
    off = tl.maximum(slot, 0) % BLOCK_SIZE
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=d_ok, other=0.0).to(tl.float32)
    old = tl.load(scales_ptr + blk * HEADS + h)
    old = tl.where(off == 0, 0.0, old)
    # divisions rounded as torch's are (`grow_scales`): Triton's own `/` is approximate on
    # CUDA (a constant's reciprocal multiplied in), an ulp off the scale the torch path keeps
    # (each |x| / limit, then the largest: the same value, rounding being monotonic, and an
    # infinite x gives an infinite scale as torch's does; a divisor built from amax would not)
    limit = d * 0.0 + FP8_LIMIT
    # NaN as torch's amax, maximum and clamp_min give it: a NaN in x (or an old NaN scale)
    # makes the scale NaN. `tl.max` cannot be told to propagate a NaN (its reduction drops
    # it), so a count of NaNs says where it must be.
    amax = tl.max(tl.math.div_rn(tl.abs(x), limit), axis=0)
    amax = tl.where(tl.sum((x != x).to(tl.int32), axis=0) > 0, float("nan"), amax)
    new = tl.maximum(old, amax, propagate_nan=tl.PropagateNan.ALL)
    new = tl.maximum(new, TINY, propagate_nan=tl.PropagateNan.ALL)
    # as a vector (the interpreter rejects a scalar bool in a mask)
    grow = (new + d * 0.0 > old) & (old + d * 0.0 > 0) & d_ok
    base = cache_ptr + blk * stride_cb + h * stride_ch
    rows = base + r[:, None] * stride_cs + d[None, :]
    # the block's other rows, as `grow_scales` requantises whole blocks (rows past the token
    # hold a freed block's stale bytes, never read; the token's own row is stored below)
    others = (r[:, None] != off) & grow[None, :]
    vals = tl.load(rows, mask=others, other=0.0).to(tl.float32)
    vals = _clamp_fp8(vals * tl.math.div_rn(old, new), FP8_LIMIT)
    tl.store(rows, vals.to(cache_ptr.dtype.element_ty), mask=others)
    tl.store(
        base + off * stride_cs + d, _to_e4m3(x, new + d * 0.0, FP8_LIMIT, cache_ptr), mask=d_ok
    )
    tl.store(scales_ptr + blk * HEADS + h + d * 0, new + d * 0.0, mask=(d == 0) & live)


def store_kv(
    cache: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    """Write `x` `[T, kv_heads, head_dim]` into `cache` at flat `slots`; an FP8 cache is
    quantised with `scales` `[num_blocks, kv_heads]`, which must already cover `x`."""
    t = x.shape[0]
    if t == 0:
        return
    _, bs, h, d = cache.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    is_fp8 = cache.dtype == FP8_DTYPE
    if is_fp8 and (scales is None or not scales.is_contiguous()):
        raise ValueError("an fp8 cache needs contiguous [num_blocks, kv_heads] scales")
    _write_kernel[(t,)](
        x,
        cache,
        slots,
        scales if is_fp8 else x,
        x.stride(0),
        x.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        HEADS=h,
        HEADS_PAD=triton.next_power_of_2(h),
        HEAD_DIM=d,
        DIM_PAD=triton.next_power_of_2(d),
        BLOCK_SIZE=bs,
        IS_FP8=is_fp8,
        FP8_LIMIT=FP8_MAX,
    )


def store_fp8_own_blocks(
    cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor
) -> None:
    """`fp8.write_kv_fp8` for tokens each alone in its block (a decode step: one token per
    sequence), scales grown and blocks requantised in the kernel: no `unique`, no host sync."""
    t = x.shape[0]
    if t == 0:
        return
    _, bs, h, d = cache.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not scales.is_contiguous() or bs & (bs - 1):
        raise ValueError("needs contiguous [num_blocks, kv_heads] scales, a power-of-two block")
    _write_fp8_own_block_kernel[(t, h)](
        x, cache, slots, scales, x.stride(0), x.stride(1), cache.stride(0), cache.stride(1),
        cache.stride(2), HEADS=h, HEAD_DIM=d, DIM_PAD=triton.next_power_of_2(d), BLOCK_SIZE=bs,
        FP8_LIMIT=FP8_MAX, TINY=SCALE_FLOOR,
    )  # fmt: skip


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    own_blocks: bool = False,
) -> None:
    """Drop-in for `paged_attention.write_kv`: scales updated in torch, tokens stored by Triton;
    with `own_blocks` (every token alone in its block) an FP8 write is one kernel per pool."""
    if k_cache.dtype == FP8_DTYPE and own_blocks:
        store_fp8_own_blocks(k_cache, k, slot_mapping, k_scale)
        store_fp8_own_blocks(v_cache, v, slot_mapping, v_scale)
        return
    if k_cache.dtype == FP8_DTYPE:
        grow_scales(k_cache, k_scale, k, slot_mapping)
        grow_scales(v_cache, v_scale, v, slot_mapping)
    store_kv(k_cache, k, slot_mapping, k_scale)
    store_kv(v_cache, v, slot_mapping, v_scale)
