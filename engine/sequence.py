"""One request's state as it moves through waiting -> running (-> swapped) -> finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvguard.engine.sampling_params import SamplingParams

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
PRIORITY_NAMES = {v: k for k, v in PRIORITIES.items()}


def parse_priority(value: str | int) -> int:
    """`high|normal|low` (or 0/1/2) to the scheduler's rank; lower ranks are served first."""
    if isinstance(value, int) and not isinstance(value, bool) and value in PRIORITY_NAMES:
        return value
    if isinstance(value, str) and value.lower() in PRIORITIES:
        return PRIORITIES[value.lower()]
    raise ValueError(f"priority={value!r}: expected one of high, normal, low")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    order: int  # arrival counter: FCFS inside a priority class, "newest" for preemption
    max_total_len: int  # prompt + output tokens may not exceed this (model length, pool size)
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)  # while swapped out
    max_tokens: int = 0  # effective limit: params.max_tokens, lowered by a max-token cap
    truncated: bool = False  # finished at a cap below what the request asked for
    held: bool = False  # evicted: readmitted only once pressure has eased
    admitted: bool = False  # passed admission once; preemption does not undo that
    projected_blocks: int = 0  # admission's projected peak, released on finish
    admission: Any = None  # the AdmissionDecision that let it in (queue position, truncation)
    finish_reason: str | None = None
    text: str = ""
    prefix_offset: int = 0  # incremental detokenisation window
    read_offset: int = 0
    stop_checked_len: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.max_tokens:
            self.max_tokens = self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model: a prompt remainder, or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.order)


@dataclass(slots=True)
class RequestOutput:
    """What a caller sees of a request: cumulative tokens and text so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    finished: bool
    priority: str = "normal"
    num_preemptions: int = 0
    ttft_s: float | None = None
    truncated: bool = False  # stopped by a max-token cap below the requested max_tokens
    queue_time_s: float | None = None  # arrival until first scheduled

    @classmethod
    def of(cls, seq: Sequence) -> RequestOutput:
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=list(seq.output_token_ids),
            text=seq.text,
            finish_reason=seq.finish_reason,
            finished=seq.is_finished,
            priority=PRIORITY_NAMES[seq.priority],
            num_preemptions=seq.num_preemptions,
            ttft_s=ttft,
            truncated=seq.truncated,
            queue_time_s=None
            if seq.first_scheduled_time is None
            else seq.first_scheduled_time - seq.arrival_time,
        )
