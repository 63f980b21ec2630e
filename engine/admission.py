"""Admission control (seed §5): admit, queue or reject a request from its projected KV peak.

A request's peak is (prompt + max_new_tokens) × safety_factor tokens, in blocks. Requests are
admitted while the committed peaks of everything admitted stay within the budget (the pool
minus the reserved headroom); the rest wait in the engine's bounded queue with a position and
an estimated wait from the measured KV release rate. A share of the budget
(`high_priority_reserve`, 10% by default) is committed to `high` priority only, so a burst of
normal and low traffic cannot fill every commitment and make high-priority requests queue
behind it. Above 95% usage only `high` priority is taken, and a request that can never fit is
rejected at once. (Halting admission is an engine knob, checked before the controller.)
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from kvguard.engine.knobs import MiB, check_knobs, knob

EMERGENCY_USAGE = 0.95
HIGH = 0


@dataclass(slots=True, kw_only=True)
class AdmissionConfig:
    """The admission knobs; the daemon offers each in its `admission_control` section."""

    enable: bool = knob(True, section="admission_control", doc="project KV peaks before admitting")
    safety_factor: float = knob(
        1.15, section="admission_control", ge=1.0, doc="margin on each request's projected KV peak"
    )
    reserved_headroom_bytes: int = knob(
        0,
        section="admission_control",
        key="reserved_headroom_mb",
        scale=MiB,
        ge=0,
        # Unset in the file: 2048 MiB on CUDA (seed §7.1), 0 on CPU, where the KV pool is an
        # explicit byte budget with nothing else inside it to protect.
        file_default=None,
        doc="KV budget kept free of commitments; unset: 2048 MiB on CUDA, 0 on CPU",
    )
    dynamic_max_tokens: bool = knob(
        True, section="admission_control", doc="shorten max_tokens as KV usage climbs (seed §5.2)"
    )
    max_queue: int = knob(256, section="admission_control", ge=0, doc="requests that may wait")
    high_priority_reserve: float = knob(
        0.10,
        section="admission_control",
        ge=0.0,
        lt=1.0,
        doc="share of the budget only `high` priority may commit into (0 = none)",
    )

    def __post_init__(self) -> None:
        check_knobs(self)


@dataclass(slots=True, frozen=True)
class AdmissionDecision:
    decision: str  # admit | queue | reject
    reason: str = ""
    max_tokens: int = 0  # possibly lowered by the dynamic ladder
    truncated: bool = False
    queue_position: int = 0
    estimated_wait_s: float = 0.0
    status: int = 200  # HTTP status a server should answer a rejection with


def dynamic_max_tokens(requested: int, usage: float, remaining: int) -> int:
    """Seed §5.2's ladder: full length when calm, shorter answers as KV usage climbs."""
    if usage < 0.5:
        n = requested
    elif usage < 0.75:
        n = int(requested * 0.75)
    elif usage < 0.9:
        n = max(int(requested * 0.5), min(50, requested))
    else:
        n = min(100, requested)
    return max(1, min(n, remaining))


class AdmissionController:
    def __init__(self, config: AdmissionConfig, block_size: int, bytes_per_block: int) -> None:
        self.config = config
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.committed_blocks = 0
        self._releases: deque[tuple[float, int]] = deque(maxlen=256)
        self.decisions = {"admit": 0, "queue": 0, "reject": 0}

    def budget_blocks(self, total_blocks: int) -> int:
        headroom = -(-self.config.reserved_headroom_bytes // self.bytes_per_block)
        return max(0, total_blocks - headroom)

    def limit_blocks(self, total_blocks: int, rank: int) -> int:
        """What requests of this priority may commit in all: the budget, less the high-priority
        reserve for every other priority."""
        budget = self.budget_blocks(total_blocks)
        if rank == HIGH:
            return budget
        return math.floor(budget * (1.0 - self.config.high_priority_reserve))

    def projected_blocks(self, tokens: int) -> int:
        return math.ceil(tokens * self.config.safety_factor / self.block_size)

    def decide(
        self,
        prompt_len: int,
        max_tokens: int,
        rank: int,
        total_blocks: int,
        usage: float,
        queued: int,
        max_total_len: int,
    ) -> AdmissionDecision:
        d = self._decide(prompt_len, max_tokens, rank, total_blocks, usage, queued, max_total_len)
        self.decisions[d.decision] += 1
        return d

    def _decide(
        self, prompt_len, max_tokens, rank, total_blocks, usage, queued, max_total_len
    ) -> AdmissionDecision:  # noqa: ANN001 - same types as decide
        limit = self.limit_blocks(total_blocks, rank)
        if self.projected_blocks(prompt_len + 1) > limit:
            return _reject(
                400,
                f"prompt of {prompt_len} tokens can never fit the KV budget of {limit} blocks"
                + ("" if rank == HIGH else " (what is left outside the high-priority reserve)"),
            )
        if usage > EMERGENCY_USAGE and rank != HIGH:
            return _reject(
                429, f"KV cache {usage:.0%} full: only high priority is admitted", self.wait_s(1)
            )
        n = max_tokens
        if self.config.dynamic_max_tokens:
            n = dynamic_max_tokens(max_tokens, usage, max_total_len - prompt_len)
        while n > 1 and self.projected_blocks(prompt_len + n) > limit:
            n = max(1, n // 2)  # shrink to what can ever fit rather than refuse
        if not self.config.dynamic_max_tokens and n < max_tokens:
            return _reject(
                400,
                f"prompt + max_tokens={max_tokens} can never fit the KV budget of {limit} blocks",
            )
        need = self.projected_blocks(prompt_len + n)
        if self.committed_blocks + need <= limit and queued == 0:
            return AdmissionDecision("admit", "", n, n < max_tokens)
        if queued >= self.config.max_queue:
            return _reject(429, f"queue full ({queued} waiting)", self.wait_s(need))
        wait = self.wait_s(self.committed_blocks + need - limit)
        return AdmissionDecision(
            "queue", "waiting for KV memory", n, n < max_tokens, queued + 1, wait
        )

    # -- commitments --------------------------------------------------------------------------
    def try_commit(self, blocks: int, total_blocks: int, rank: int = HIGH) -> bool:
        """Reserve a projected peak when a queued request is about to start."""
        if self.committed_blocks + blocks > self.limit_blocks(total_blocks, rank):
            return False
        self.committed_blocks += blocks
        return True

    def commit(self, blocks: int) -> None:
        """Reserve a peak that `decide` admitted at once."""
        self.committed_blocks += blocks

    def uncommit(self, blocks: int) -> None:
        """Give back a reservation whose request could not start after all (no KV released)."""
        self.committed_blocks -= blocks

    def release(self, blocks: int) -> None:
        self.committed_blocks = max(0, self.committed_blocks - blocks)
        self._releases.append((time.monotonic(), blocks))

    def release_rate(self) -> float:
        """Blocks released per second over the recent window (0 when unknown)."""
        if len(self._releases) < 2:
            return 0.0
        span = self._releases[-1][0] - self._releases[0][0]
        return sum(b for _, b in self._releases) / span if span > 0 else 0.0

    def wait_s(self, blocks: int) -> float:
        rate = self.release_rate()
        return min(30.0, blocks / rate) if rate > 0 else 1.0


def _reject(status: int, reason: str, wait: float = 0.0) -> AdmissionDecision:
    return AdmissionDecision("reject", reason, 0, False, 0, wait, status)
