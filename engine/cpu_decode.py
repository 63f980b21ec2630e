"""The CPU fast path: a step runs each decoder layer in one C call.

With packed (`w4a8`/`w8a8`) projections on the CPU, a batch-1 decode step of the default model
spent more of its time between kernels than in them: a layer was about thirty torch ops and
kernel calls, each paying Python and dispatch (about 7 ms a step of 30 layers, on 2 cores;
a step with prompt chunks paid the same). `kvguard.kernels.cpu_layer` strings the same
kernels together in C, in the same order, so the tokens are the same bit for bit. (The name
is from when it served decode-only steps; it serves prompt chunks too, through the C prefill
attention.)

A step takes this path when the KV pools are of a type the C
kernels store and read (fp32, fp16, bf16, or fp8 with its scales: a live switch keeps the
path), the CPU kernels are on
(`KVGUARD_CPU_OPS`), and every layer this rank holds qualifies: the four projections served
by the C kernels with no input permutation and no bias on the output, down or gate/up
projections, fp32 norms, and no tensor parallelism. The plan is built once, on the first step
that could use it, and kept with the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvguard.engine.layers.quantized_linear import QuantizedLinear
from kvguard.kernels import cpu_layer, cpu_ops
from kvguard.kernels.paged_attention import decode_rows, prefill_chunks, row_starts, split_rows

log = logging.getLogger("kvguard.engine")


def _weights(layer: Any) -> cpu_layer.LinearWeights | None:
    if not isinstance(layer, QuantizedLinear) or layer.kernel not in ("w4a8", "w8a8"):
        return None
    if layer.perm is not None:
        return None
    return cpu_layer.LinearWeights(
        layer.bits, layer.fine, layer.out_features, layer.in_features, layer.group_size,
        layer.lowbit_codes, layer.lowbit_scales, layer.lowbit_mins, layer.bias,
    )  # fmt: skip


def _plan(layer: Any) -> cpu_layer.LayerPlan | None:
    """The layer packed for the C call, or None where it does not qualify (the attention
    shapes are checked per step, with the pool's block size: `CpuDecode.takes`)."""
    attn, mlp = layer.self_attn, layer.mlp
    parts = [_weights(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(p is None for p in parts) or any(p.bias is not None for p in parts[1:]):
        return None
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
        return None
    if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
        return None
    return cpu_layer.plan_layer(
        *parts, *norms, layer.input_layernorm.eps, attn.nh, attn.nkv, attn.hd, attn.scale
    )


class CpuDecode:
    """Plans for a model's own layers; `run` replaces the layer loop of a qualifying step."""

    def __init__(self, plans: list[cpu_layer.LayerPlan], heads: int, kv_heads: int, d: int) -> None:
        self.plans = plans
        self.work_per_row = max(p.work_per_row for p in plans)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d

    @classmethod
    def build(cls, layers: Sequence[Any], tp_size: int) -> CpuDecode | None:
        if tp_size != 1 or not layers:
            return None
        plans = []
        for layer in layers:
            plan = _plan(layer)
            if plan is None:
                return None
            plans.append(plan)
        log.info("CPU steps run each of %d layers in one C call", len(plans))
        attn = layers[0].self_attn
        return cls(plans, attn.nh, attn.nkv, attn.hd)

    def takes(self, x: torch.Tensor, kv_caches: Sequence[Any], meta: Any) -> bool:
        """Whether this step qualifies: pools whose type and blocks the attention kernels
        serve (an fp8 pool with its scales), the CPU kernels on."""
        if meta.seq_lens_t is not None or not cpu_ops.enabled(x) or not x.is_contiguous():
            return False
        block = kv_caches[0][0].shape[1]
        if not cpu_ops.decode_shape_supported(self.heads, self.kv_heads, self.head_dim, block):
            return False
        dtype = kv_caches[0][0].dtype  # one element type a step (`Step.kv_type`)
        return all(
            kv[0].dtype == dtype and cpu_ops.pool_supported(kv[0], kv[2]) for kv in kv_caches
        )

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[Any],
        meta: Any,
        stop: Any = None,
        on_layer: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(stream, last layer's MLP output still to add), as the layer loop returns them;
        `on_layer` called after each layer, as the layer loop calls it."""
        from kvguard.engine.model import StepInterrupted

        t = x.shape[0]
        qlens = meta.query_lens
        starts = row_starts(qlens)
        decode, chunks = split_rows(qlens, meta.prompt_rows)
        rows, lens, tables = decode_rows(meta.block_tables, meta.seq_lens, starts, decode)
        c_rows, c_qlens, c_lens, c_tables = prefill_chunks(
            meta.block_tables, meta.seq_lens, qlens, starts, chunks
        )
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        cos, sin = cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous()
        work = torch.empty(t * self.work_per_row)
        pool = kv_caches[0][0]
        step = cpu_layer.Step(
            t, pool.shape[1], tables.stride(0), pool.shape[0] * pool.shape[1],
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            len(decode), rows.data_ptr(), lens.data_ptr(), tables.data_ptr(),
            len(chunks), c_rows.data_ptr(), c_qlens.data_ptr(), c_lens.data_ptr(),
            c_tables.data_ptr(), c_tables.stride(0),
            work.data_ptr(), torch.get_num_threads(), cpu_ops.KV_TYPES[pool.dtype],
        )  # fmt: skip
        outs = (torch.empty_like(x), torch.empty_like(x))
        pending = None
        for i, (plan, kv) in enumerate(zip(self.plans, kv_caches, strict=True)):
            if stop is not None and stop.is_set():
                raise StepInterrupted("interrupted between layers")
            out = outs[i % 2]
            cpu_layer.run_layer(plan, step, x, pending, kv[0], kv[1], kv[2], kv[3], out)
            pending = out
            if on_layer is not None:
                on_layer()
        return x, pending
