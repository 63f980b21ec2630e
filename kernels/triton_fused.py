"""The small per-layer ops of a CUDA step, one Triton kernel each: residual add + RMSNorm, RoPE
in place on the fused q/k/v rows, and SiLU-and-multiply.

Why: the first H200 run (bench/gpu_e2e.py) found a batch-1 decode step of SmolLM2-135M at
about 2.4 ms of GPU time even inside a CUDA graph, for 0.27 GB of weights (0.06 ms of reading).
Each layer ran some 40 kernels, most of them elementwise pieces of the norms (float, pow, mean,
rsqrt, mul, cast, mul) and of RoPE (float, slices, neg, cat, mul, mul, add, cast), and a kernel
costs a few microseconds however small. These three kernels replace about 32 of them per
layer with 4. Opt-in (`KVGUARD_FUSED_OPS=1`, `dispatch.fused_ops`) until a device run has
shown their tokens and speed-up: bench/gpu_check.sh tests them on CUDA and gpu_e2e.py times
decode with them on and off.

They mirror the CPU kernels of `kvguard.kernels.cpu_ops` (same arguments, same in-place
contracts), and round where the torch path rounds: the norm's normalised value is cast to the
activation dtype before the weight multiplies it, SiLU's output before the `up` product, so
bf16 results match the torch path but for the order of a sum (a last-bit difference, rarely).

`triton` is imported with this module: import it only where `use_triton` said yes, or in tests
(the kernels then run in the CPU interpreter). Arithmetic is fp32 throughout (the interpreter
gets bf16 arithmetic wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    dim,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: with HAS_RES, x += res (rounded to x's dtype, stored back), then
    out = w * cast(x / rms(x))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        s = (x + r).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, s, mask=ok)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    xn = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * xn).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_x,
    stride_c,
    heads,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """One (row, head): rotate-half RoPE in place, (x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    i = tl.arange(0, HALF_PAD)
    ok = i < half
    base = x_ptr + row * stride_x + head * HEAD_DIM
    x1 = tl.load(base + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=ok, other=0.0).to(tl.float32)
    c = cos_ptr + row * stride_c
    s = sin_ptr + row * stride_c
    c1 = tl.load(c + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c + half + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s + half + i, mask=ok, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    tl.store(base + i, (x1 * c1 - x2 * s1).to(dt), mask=ok)
    tl.store(base + half + i, (x2 * c2 + x1 * s2).to(dt), mask=ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    """One row piece: out = cast(silu(gate)) * up, for a row laid out [gate | up]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(dt), mask=ok)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension, in x's dtype; with
    `residual`, first `x += residual` in place (`cpu_ops.rmsnorm`'s contract). x's rows may be
    strided, its last dimension must not be."""
    d = x.shape[-1]
    x2 = x.view(-1, d)
    if x2.stride(-1) != 1:
        raise ValueError("rmsnorm needs a unit stride along the last dimension")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res = x2 if residual is None else residual.reshape(-1, d).contiguous()
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, res, weight.contiguous(), out, x2.stride(0), res.stride(0), out.stride(0), d,
            float(eps), HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(d),
            num_warps=4 if d <= 4096 else 8,
        )  # fmt: skip
    return out.view(x.shape)


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on the first `heads` heads of each row of `x` `[T, width]`
    (unit stride along the row), with `cos`/`sin` `[T, head_dim]` per row."""
    if x.stride(-1) != 1 or head_dim % 2:
        raise ValueError("rope_ needs unit-stride rows and an even head_dim")
    cos, sin = cos.contiguous(), sin.contiguous()
    if x.shape[0] and heads:
        _rope_kernel[(x.shape[0], heads)](
            x, cos, sin, x.stride(0), cos.stride(0), heads, HEAD_DIM=head_dim,
            HALF_PAD=triton.next_power_of_2(head_dim // 2), num_warps=1,
        )  # fmt: skip


def silu_mul(x: torch.Tensor, inter: int) -> torch.Tensor:
    """`silu(gate) * up` for rows `[gate | up]` of `x` `[T, 2 * inter]` (unit stride along the
    row): `[T, inter]`, contiguous."""
    if x.dim() != 2 or x.shape[1] != 2 * inter or x.stride(1) != 1:
        raise ValueError(f"silu_mul: x {tuple(x.shape)} is not [T, 2 * {inter}] with unit stride")
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if x.shape[0]:
        grid = (x.shape[0], triton.cdiv(inter, block))
        _silu_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=block)
    return out
