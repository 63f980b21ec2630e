"""kvguard.kernels: paged attention and KV-cache operations.

Which path runs where:

- CPU: always the torch implementation in `paged_attention` (prefill, decode, KV writes). It is
  also the reference every other path is tested against.
- CUDA with triton importable and `KVGUARD_TRITON` not "0" (`dispatch.use_triton`):
  decode attention (single-token queries) runs the Triton kernel in `triton_attention`, and
  `write_kv` stores tokens with the Triton kernel in `triton_kv` (FP8 scale growth and block
  requantisation stay in torch there). Prefill chunks still use the torch path
  (`scaled_dot_product_attention` on gathered K/V), as do swap copies (`engine.kv_cache`).
- CUDA otherwise (no triton, or `KVGUARD_TRITON=0`): the torch implementation, as on CPU.

The Triton modules are imported only when dispatch picks them, so kvguard imports and runs
without triton installed.
"""

from kvguard.kernels.paged_attention import gather_kv, paged_attention, write_kv

__all__ = ["gather_kv", "paged_attention", "write_kv"]
