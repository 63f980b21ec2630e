"""One C call per decoder layer of a CPU step (`decode_layer.c`).

The structures mirror the C ones field for field; a `Layer` holds raw pointers into the
tensors it was built from, and `LayerPlan` keeps those tensors alive with it. The engine
decides when a step may take this path (`kvguard.engine.cpu_decode`); this module only packs
arguments and calls.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from kvguard.kernels import cpu_lowbit

_I64, _PTR, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class Linear(ctypes.Structure):
    _fields_ = [
        ("bits", _I64), ("fine", _I64), ("n", _I64), ("k", _I64), ("bpg", _I64),
        ("codes", _PTR), ("d", _PTR), ("m", _PTR), ("bias", _PTR),
    ]  # fmt: skip


class Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
        ("norm1", _PTR), ("norm2", _PTR), ("eps", _F), ("scale", _F),
        ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
        ("inter", _I64),
    ]  # fmt: skip


class Step(ctypes.Structure):
    _fields_ = [
        ("T", _I64), ("block_size", _I64), ("ldt", _I64), ("num_slots", _I64),
        ("cos", _PTR), ("sin", _PTR), ("slots", _PTR),
        ("B", _I64), ("rows", _PTR), ("lens", _PTR), ("tables", _PTR),
        ("S", _I64), ("chunk_rows", _PTR), ("chunk_qlens", _PTR), ("chunk_lens", _PTR),
        ("chunk_tables", _PTR), ("chunk_ldt", _I64),
        ("work", _PTR), ("threads", _I64), ("kv_type", _I64),
        # the rows' kinds (`cpu_lowbit.StepRows`), filled in by `run_layer`: 0 in `kinds`
        # leaves every projection picking its kernel by T
        ("kinds", _I64), ("decode_rows", _I64), ("decode_count", _I64), ("short_rows", _I64),
    ]  # fmt: skip


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class LinearWeights:
    """A projection's low-bit buffers (`QuantizedLinear`'s `w4a8`/`w8a8` layout)."""

    bits: int
    fine: bool
    n: int
    k: int
    group: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None

    def struct(self) -> Linear:
        return Linear(
            self.bits, int(self.fine), self.n, self.k, self.group // cpu_lowbit.BLOCK,
            _ptr(self.codes), _ptr(self.scales), _ptr(self.mins), _ptr(self.bias),
        )  # fmt: skip


@dataclass
class LayerPlan:
    """One decoder layer, packed once: `struct` points into `keep`."""

    struct: Layer
    work_per_row: int  # floats of workspace per row of a step
    keep: list[torch.Tensor] = field(repr=False)


def plan_layer(
    qkv: LinearWeights,
    o: LinearWeights,
    gate_up: LinearWeights,
    down: LinearWeights,
    norm1: torch.Tensor,
    norm2: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
) -> LayerPlan:
    hidden, inter = norm1.numel(), down.k
    assert norm1.is_contiguous() and norm2.is_contiguous() and norm1.dtype == torch.float32
    assert qkv.n == (heads + 2 * kv_heads) * head_dim and gate_up.n == 2 * inter
    assert o.bias is None and down.bias is None and gate_up.bias is None
    struct = Layer(
        qkv.struct(), o.struct(), gate_up.struct(), down.struct(),
        norm1.data_ptr(), norm2.data_ptr(), eps, scale,
        hidden, heads, kv_heads, head_dim, inter,
    )  # fmt: skip
    keep = [t for w in (qkv, o, gate_up, down) for t in (w.codes, w.scales, w.mins, w.bias)]
    keep = [t for t in keep if t is not None] + [norm1, norm2]
    work = 3 * hidden + qkv.n + heads * head_dim + 3 * inter
    return LayerPlan(struct, work, keep)


def run_layer(
    plan: LayerPlan,
    step: Step,
    x: torch.Tensor,
    pending: torch.Tensor | None,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    mlp_out: torch.Tensor,
) -> None:
    """The layer on the stream `x` `[T, hidden]` (updated in place); its MLP output goes to
    `mlp_out`. The pools are of `step.kv_type` (`cpu_ops.KV_TYPES`); an fp8 pool comes with its
    per-block scales, updated in place as the new tokens are written. The projections pick
    their kernels by the kinds of the step's rows where the runner gave them
    (`cpu_lowbit.step_rows`), as the per-op layers do."""
    kinds = cpu_lowbit.row_kinds(step.T)
    step.kinds = int(kinds is not None)
    step.decode_rows, step.decode_count, step.short_rows = kinds or (step.T, step.T, 0)
    rc = cpu_lowbit.library().kvg_decode_layer(
        ctypes.addressof(plan.struct), ctypes.addressof(step), x.data_ptr(), _ptr(pending),
        k_pool.data_ptr(), v_pool.data_ptr(), _ptr(k_scales), _ptr(v_scales),
        mlp_out.data_ptr(),
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("CPU layer: no memory for a kernel's workspace")
    if rc == -3:
        raise IndexError(f"CPU layer: a KV slot outside the pool of {step.num_slots} slots")
    if rc:
        raise ValueError(f"CPU layer: a kernel refused the shapes ({rc})")
