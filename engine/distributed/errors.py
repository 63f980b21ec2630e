"""The one failure a tensor-parallel engine cannot recover from in-process."""

from __future__ import annotations


class RankFailure(RuntimeError):
    """A rank died, hung, or left the group out of step; the engine cannot go on.

    Raised from `LLMEngine.step()`. The ranks' KV caches and collectives are no longer in step,
    so the only safe way on is to stop every rank and start again (systemd restarts the
    daemon); `rank` names the rank at fault (-1 when no single rank can be named)."""

    def __init__(self, rank: int, reason: str) -> None:
        who = f"tensor-parallel rank {rank}" if rank >= 0 else "the tensor-parallel group"
        super().__init__(f"{who} {reason}")
        self.rank = rank
        self.reason = reason


class PoolTorn(RankFailure):
    """The KV pool is half converted (a live dtype switch or resize failed and could not be
    undone): its blocks no longer match the block tables, so, as with a lost rank, the engine
    stops and systemd restarts the daemon."""

    def __init__(self, reason: str) -> None:
        RuntimeError.__init__(self, reason)
        self.rank = -1
        self.reason = reason
