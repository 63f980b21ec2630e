"""Small collectives by which ranks agree on one number before acting on it."""

from __future__ import annotations

import torch

from kvguard.engine.distributed.parallel_state import TPGroup


def agree_min(world: TPGroup, value: int) -> int:
    """The smallest `value` over every rank of `world` (one rank: `value`): the KV block count
    every rank of every stage can afford, so block ids mean the same slots everywhere. It runs
    at start-up, where ranks finish loading their shards at different times, so it uses the
    default group (the whole world) and its start-up timeout, not the step group's."""
    return value if world.size == 1 else _reduce(TPGroup(world.rank, world.size), value, "MIN")


def agree_any(tp: TPGroup, flag: bool) -> bool:
    """Whether any rank of the group raised `flag` (one rank: `flag`): e.g. a rank without
    room for an FP8 switch, so the switch happens on every rank or on none."""
    return flag if tp.size == 1 else bool(_reduce(tp, int(flag), "MAX"))


def _reduce(tp: TPGroup, value: int, op: str) -> int:
    import torch.distributed as dist

    device = "cuda" if dist.get_backend(tp.group) == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=tp.group)
    return int(t.item())
