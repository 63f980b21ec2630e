"""The paged KV pools: per layer K and V tensors `[num_blocks, block_size, kv_heads, head_dim]`."""

from __future__ import annotations

import torch

from kvguard.engine.config import ConfigError
from kvguard.engine.model_config import ModelConfig

KV_TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def kv_dtype_name(name: str, model_dtype: torch.dtype) -> str:
    """Resolve `auto` to the model's compute dtype."""
    if name != "auto":
        return name
    return {v: k for k, v in KV_TORCH_DTYPES.items()}[model_dtype]


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: str) -> int:
    if dtype not in KV_TORCH_DTYPES:
        raise ConfigError(f"kv_cache_dtype={dtype!r} is not available in this build")
    elem = torch.tensor([], dtype=KV_TORCH_DTYPES[dtype]).element_size()
    return block_size * cfg.kv_bytes_per_token(elem)


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: str, device: torch.device
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.bytes_per_block = bytes_per_block(cfg, block_size, dtype)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        tdt = KV_TORCH_DTYPES[dtype]
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=tdt, device=device),
                torch.zeros(shape, dtype=tdt, device=device),
            )
            for _ in range(cfg.num_layers)
        ]

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block
