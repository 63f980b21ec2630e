"""kvguard.kernels: paged attention and KV-cache operations.

Which path runs where:

- CPU: the C kernels of `cpu_ops` (decode and prefill attention over the pool in place, KV
  writes) where they build and serve the shape, with `KVGUARD_CPU_OPS` not "0"; otherwise the
  torch implementation in `paged_attention`, which is also the reference every other path is
  tested against.
- CUDA with triton importable and `KVGUARD_TRITON` not "0" (`dispatch.use_triton`):
  decode attention (single-token queries) runs the Triton kernel in `triton_attention`, and
  `write_kv` stores tokens with the Triton kernel in `triton_kv` (FP8 scale growth and block
  requantisation stay in torch there, but in a replayed decode step, where one kernel does
  them). Prefill chunks still use the torch path
  (`scaled_dot_product_attention` on gathered K/V), as do swap copies (`engine.kv_cache`).
  With `KVGUARD_FUSED_OPS=1` a layer's small ops (residual add + RMSNorm, RoPE in place,
  SiLU-and-multiply) run as one Triton kernel each from `triton_fused` (`dispatch.fused_ops`),
  as the C kernels of `cpu_ops` do on CPU; with `KVGUARD_TRITON_PREFILL=1` prefill chunks run
  `triton_attention.prefill_rows`.
- CUDA otherwise (no triton, or `KVGUARD_TRITON=0`): the torch implementation, as on CPU.
- 4-bit weight-only matmuls (`dispatch.w4a16_matmul`, weights packed by
  `w4a16.pack_for_triton`): the Triton W4A16 GEMM in `triton_w4a16` under the same rule (and
  under `TRITON_INTERPRET=1` on CPU, for tests); elsewhere a torch reference that dequantises
  the whole weight per call. CPU serving uses the quantized layer's int4pack kernels instead.

The Triton modules are imported only when dispatch picks them, so kvguard imports and runs
without triton installed.
"""

from kvguard.kernels.paged_attention import gather_kv, paged_attention, write_kv

__all__ = ["gather_kv", "paged_attention", "write_kv"]
