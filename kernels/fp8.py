"""FP8 (e4m3) KV quantisation with one scale per block per KV head.

A block fills token by token, so its scale can only grow: when new tokens exceed what the
current scale can represent, the block's existing contents are requantised to the larger
scale before the new tokens are written. Values are clamped to ±448 (e4m3's finite range)
before every cast, so nothing saturates to NaN. Arithmetic happens in fp32: CPUs have no fp8
add/mul.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-12  # the least scale a block holds (an all-zero block still divides)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale`, clamped to the e4m3 range, as fp8; `scale` broadcasts against `x`."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def grow_scales(
    cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Grow `scales` `[num_blocks, kv_heads]` so every block `slots` touches can hold `x`
    `[T, kv_heads, head_dim]`, requantising blocks whose scale grew; returns each token's scale
    `[T, kv_heads, 1]`. A write at offset 0 starts a block afresh (blocks are reused after being
    freed, and always fill from offset 0). Shared by the torch and Triton write paths."""
    bs, h = cache.shape[1], cache.shape[2]
    blocks = torch.div(slots, bs, rounding_mode="floor")
    fresh = blocks[slots % bs == 0]
    if fresh.numel():
        scales.index_fill_(0, fresh, 0.0)
    touched, inverse = torch.unique(blocks, return_inverse=True)
    amax = torch.zeros(touched.numel(), h, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, inverse[:, None].expand(-1, h), x.float().abs().amax(-1), "amax")
    old = scales.index_select(0, touched)
    new = torch.maximum(old, amax / FP8_MAX).clamp_min_(SCALE_FLOOR)
    grow = ((new > old) & (old > 0)).any(-1)
    if grow.any():
        ids = touched[grow]
        ratio = (old[grow] / new[grow])[:, None, :, None]
        old_vals = as_bytes(cache).index_select(0, ids).view(FP8_DTYPE).float()
        as_rows(cache).index_copy_(0, ids, as_rows(quantize(old_vals * ratio, 1.0)))
    scales.index_copy_(0, touched, new)
    return new.index_select(0, inverse)[:, :, None]


def write_kv_fp8(
    cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write `x` `[T, kv_heads, head_dim]` into fp8 `cache` at flat `slots`, updating `scales`."""
    nb, bs, h, d = cache.shape
    token_scale = grow_scales(cache, scales, x, slots)
    as_rows(cache.view(nb * bs, h, d)).index_copy_(0, slots, as_rows(quantize(x, token_scale)))


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8: CPU kernels for index_copy/index_select lack fp8."""
    return x.view(torch.uint8)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of the first dimension as raw words: byte-wise index_copy is several times slower
    than moving the same bytes as int64 (block and token rows are multiples of 8 bytes)."""
    rows = x.view(torch.uint8).reshape(x.shape[0], -1)
    return rows.view(torch.int64) if rows.shape[1] % 8 == 0 else rows
