"""The tensor-parallel group one rank belongs to, and the two collectives the model needs.

A single-rank group is plain data: its collectives return their input untouched and never import
or initialise torch.distributed, so tp=1 runs exactly the code path it ran before tensor
parallelism existed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

# gloo (the CPU backend) cannot sum half-precision tensors; those are reduced in fp32 instead.
_GLOO_UNSUMMABLE = (torch.float16, torch.bfloat16)

# How long a gloo transfer between stages waits by itself. Not the step timeout: a stage may
# compute a long step for longer than that, and the wait for its output must not give up on
# it. What ends a wait on a dead or silent stage is the caller's watch (the driver), or the
# peer's connection closing when it dies or the group is torn down (a worker).
TRANSFER_WAIT = timedelta(days=1)
WATCH_EVERY_S = 0.05  # how often a watched transfer looks at the other ranks

Watch = Callable[[], None]  # raises once the transfer being waited for can no longer come


def wait_watched(work: Any, watch: Watch | None) -> None:
    """Wait for a gloo transfer however long the other stages compute, calling `watch` every
    WATCH_EVERY_S meanwhile: it raises (and this with it) once a rank is dead or silent. gloo's
    own timeout cannot tell the two apart, and a wait that times out closes the connection to
    that peer for good, so a wait cannot be cut into slices either: the one wait runs in the
    process's waiter thread (`_Waiter`: it releases the GIL) while this thread watches.

    A watch that raises leaves the wait running: it cannot be cut short without closing the
    connection, and the teardown after such a failure (workers stopped, the group destroyed)
    closes it, which ends the wait. That waiter is retired (`_retire`): it ends once its wait
    does, and the next transfer (a group formed again) gets a fresh one rather than queueing
    behind a wait that may not end; at worst one idle daemon thread stays blocked."""
    if watch is None:
        work.wait(TRANSFER_WAIT)
        return
    waiter = _current_waiter()
    job = waiter.submit(work)
    try:
        while not job.done.wait(WATCH_EVERY_S):
            watch()
    except BaseException:
        _retire(waiter)
        raise
    if job.error is not None:
        raise job.error


@dataclass(slots=True)
class _Transfer:
    """One transfer handed to the waiter thread, and how its wait ended."""

    work: Any
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Waiter:
    """The one thread that waits out this process's watched transfers, in the order they are
    handed to it: a pipeline run waits for a transfer at every step, and a thread started per
    transfer cost a thread start per step. Rank 0's engine thread is its one caller (callers
    in several threads would have their transfers waited for in turn)."""

    def __init__(self) -> None:
        self._transfers: queue.SimpleQueue[_Transfer | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="kvguard-stage-transfer", daemon=True)
        self.thread.start()

    def submit(self, work: Any) -> _Transfer:
        transfer = _Transfer(work)
        self._transfers.put(transfer)
        return transfer

    def retire(self) -> None:
        """End the thread once the wait it is in has ended (however long that takes)."""
        self._transfers.put(None)

    def _run(self) -> None:
        while (transfer := self._transfers.get()) is not None:
            try:
                transfer.work.wait(TRANSFER_WAIT)
            except BaseException as e:  # noqa: BLE001 - raised in the watching thread
                transfer.error = e
            finally:
                transfer.done.set()


_waiter: _Waiter | None = None
_waiter_lock = threading.Lock()


def _current_waiter() -> _Waiter:
    """The process's waiter, started on first use; a new one where the last was retired, or
    where this process was forked from one that had it (the thread is not in the child)."""
    global _waiter
    with _waiter_lock:
        if _waiter is None or not _waiter.thread.is_alive():
            _waiter = _Waiter()
        return _waiter


def _retire(waiter: _Waiter) -> None:
    """Stop handing transfers to `waiter`, whose wait a caller gave up on: it may be blocked
    until the group is torn down, and a transfer queued behind it would be too."""
    global _waiter
    with _waiter_lock:
        if _waiter is waiter:
            _waiter = None
    waiter.retire()


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
    the agreements that must hold everywhere (one KV block count, one FP8 switch) use it. On
    gloo a transfer waits as long as the stages compute, not the step timeout: rank 0 watches
    the ranks meanwhile (`wait_watched`); on NCCL the step timeout bounds it. One
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

    def send_next(self, hidden: torch.Tensor, watch: Watch | None = None) -> None:
        self.transfer("send", hidden.contiguous(), self.world.rank + self.tp_size, watch)

    def recv_prev(self, like: torch.Tensor, watch: Watch | None = None) -> torch.Tensor:
        self.transfer("recv", like, self.world.rank - self.tp_size, watch)
        return like

    def send_logits(self, logits: torch.Tensor, watch: Watch | None = None) -> None:
        self.transfer("send", logits.contiguous(), 0, watch)

    def recv_logits(
        self, rows: int, vocab: int, device: torch.device, watch: Watch | None = None
    ) -> torch.Tensor:
        out = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.transfer("recv", out, self.last_driver_rank, watch)
        return out

    def start_send_next(self, hidden: torch.Tensor) -> Any:
        """Post the send of `hidden` to the next stage; finish it with `finish`."""
        import torch.distributed as dist

        return dist.isend(hidden, self.world.rank + self.tp_size, group=self.world.group)

    def finish(self, work: Any, watch: Watch | None = None) -> None:
        """Wait for a posted transfer: on gloo as long as the stages compute, with `watch`
        looking at the ranks; on NCCL within the group's step timeout, as before."""
        if self._on_gloo():
            wait_watched(work, watch)
        else:
            work.wait()

    def transfer(self, op: str, tensor: torch.Tensor, peer: int, watch: Watch | None) -> None:
        """Send `tensor` to, or receive it from, global rank `peer` (see `finish`)."""
        import torch.distributed as dist

        if not self._on_gloo():  # NCCL: the group's step timeout bounds it, as before
            (dist.send if op == "send" else dist.recv)(tensor, peer, group=self.world.group)
            return
        start = dist.isend if op == "send" else dist.irecv
        wait_watched(start(tensor, peer, group=self.world.group), watch)

    def _on_gloo(self) -> bool:
        import torch.distributed as dist

        return dist.get_backend(self.world.group) == "gloo"
