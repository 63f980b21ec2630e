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


@dataclass(slots=True, frozen=True)
class PipelineStage:
    """This rank's pipeline stage: which decoder layers it runs and how it reaches its
    neighbours. Global rank = stage * tp_size + tp rank, so rank r of a stage talks to rank r
    of the next stage (every rank of a stage holds the same full hidden states after its
    group's all-reduce) and the last stage's tp rank 0 sends the logits to rank 0, the driver.

    `world` spans every rank of every stage (step timeout): the point-to-point transfers and
    the agreements that must hold everywhere (one KV block count, one FP8 switch) use it. One
    stage (`single`) is plain data and never touches torch.distributed."""

    index: int
    count: int
    layers: range  # global decoder-layer indexes this stage runs
    tp_size: int = 1
    world: TPGroup = TPGroup(0, 1)

    @classmethod
    def single(cls, num_layers: int, world: TPGroup | None = None) -> PipelineStage:
        w = world or TPGroup.single()
        return cls(0, 1, range(num_layers), w.size, w)

    @property
    def is_first(self) -> bool:
        """The first stage embeds the token ids."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """The last stage applies the final norm and the lm_head."""
        return self.index == self.count - 1

    @property
    def last_driver_rank(self) -> int:
        """The global rank that holds the gathered logits: the last stage's tp rank 0."""
        return (self.count - 1) * self.tp_size

    def send_next(self, hidden: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(hidden.contiguous(), self.world.rank + self.tp_size, group=self.world.group)

    def recv_prev(self, like: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.recv(like, self.world.rank - self.tp_size, group=self.world.group)
        return like

    def send_logits(self, logits: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(logits.contiguous(), 0, group=self.world.group)

    def recv_logits(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        dist.recv(out, self.last_driver_rank, group=self.world.group)
        return out
