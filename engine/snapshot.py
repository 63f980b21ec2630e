"""An immutable picture of the engine after a step, for readers that must not lock the loop."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    step: int
    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    live_tokens: int  # tokens whose K/V are held in the cache
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    tokens_generated: int

    @property
    def kv_cache_usage_ratio(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0
