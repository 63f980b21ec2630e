"""The tensor-parallel group one rank belongs to, and the two collectives the model needs.

A single-rank group is plain data: its collectives return their input untouched and never import
or initialise torch.distributed, so tp=1 runs exactly the code path it ran before tensor
parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# gloo (the CPU backend) cannot sum half-precision tensors; those are reduced in fp32 instead.
_GLOO_UNSUMMABLE = (torch.float16, torch.bfloat16)


@dataclass(slots=True, frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group; `group` None means the default group."""

    rank: int
    size: int
    group: Any = None

    @classmethod
    def single(cls) -> TPGroup:
        return cls(rank=0, size=1)

    @property
    def is_first(self) -> bool:
        """Rank 0 of the group holds the full logits and samples."""
        return self.rank == 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        if x.device.type == "cpu" and x.dtype in _GLOO_UNSUMMABLE:
            wide = x.float()
            dist.all_reduce(wide, group=self.group)
            return x.copy_(wide)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's equal-shaped `x` along the last dim on rank 0; None elsewhere.

        Only rank 0 samples, so the other ranks need not receive the full vocabulary."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        # `dst` is a global rank (group_dst only exists from torch 2.6; pyproject allows 2.3).
        dst = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None
