"""kvguard.kernels: paged attention and KV-cache operations.

Which path runs where: the torch implementation in `paged_attention` runs on every device
(CPU and CUDA) and is the reference the engine falls back to.
"""

from kvguard.kernels.paged_attention import gather_kv, paged_attention, write_kv

__all__ = ["gather_kv", "paged_attention", "write_kv"]
