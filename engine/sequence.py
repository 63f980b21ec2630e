"""One request's state as it moves through waiting -> running (-> swapped) -> finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

# kept importable from here, where they were defined before they moved to the torch-free
# `priority` module
from kvguard.engine.priority import PRIORITIES as PRIORITIES
from kvguard.engine.priority import PRIORITY_NAMES as PRIORITY_NAMES
from kvguard.engine.priority import parse_priority as parse_priority
from kvguard.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvguard.engine.sampler import OutputCounts
    from kvguard.engine.speculative import Lookup
    from kvguard.engine.structured import Grammar

_T = TypeVar("_T")


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (the log-softmax of the raw logits: before
    penalties, bias, temperature, top-k and top-p), a sampled token's or a prompt token's, and
    the `top` most likely tokens' at its position as (id, logprob), most likely first. On a
    packed model whose lm_head ranks the vocabulary approximately (int8: exact only at each
    row's best, which is what is drawn from), the row's logits are computed exactly over the
    whole vocabulary for these (`QuantizedLMHead.exact_logits`): the fp32 log-softmax of the
    weights the model holds, within ~3e-5 of fp64."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's state. Compared and hashed by identity (`eq=False`): each request is one
    object, and the scheduler's membership tests (`seq in batch.seqs`, `running.remove`) ran
    the dataclass's field-by-field `__eq__`, a tuple of some thirty fields built per compare:
    O(n^2) a step (a tiny-model step of 256 running sequences took 21.5 ms, 4.5 without)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    order: int  # arrival counter: FCFS inside a priority class, "newest" for preemption
    max_total_len: int  # prompt + output tokens may not exceed this (model length, pool size)
    generator: torch.Generator | None = None
    grammar: Grammar | None = None  # a structured-output request's place in its schema
    output_token_ids: list[int] = field(default_factory=list)
    # the output's token counts for the presence and frequency penalties, kept by the sampler
    # as the output grows (made on the first penalised draw; see `sampler.OutputCounts`)
    output_counts: OutputCounts | None = None
    # one per output token where the request asked for log-probabilities (else None)
    output_logprobs: list[TokenLogprob] | None = None
    # one per prompt token after the first, collected as the prompt is computed, where asked
    prompt_logprobs: list[TokenLogprob] | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)  # while swapped out
    # prefix-cache content id of each full computed block (BlockManager.commit), in order
    block_contents: list[int] = field(default_factory=list)
    # leading tokens whose K/V prompt rows computed (a prompt, a recomputed text, cached blocks
    # so written), each on the K/V of those before it: the K/V a cold prompt computes. Decode
    # rows (a decode, its drafts or forced tokens) compute other bits, and every token after
    # one of them inherits that, so the count stops there until a recompute. The prefix cache
    # flags a block by it (`BlockManager.commit`)
    prompt_written: int = 0
    # the whole text its prompt rows compute: its prompt, or at a recompute its prompt and
    # output so far (0: not set yet, the prompt). A prompt's kernel kind follows it, never a
    # chunk (`model_runner.decode_rows`), and so does an exact cached block's (`BlockManager`)
    prefill_tokens: int = 0
    # K/V converted by a live dtype switch: none of its blocks may enter the prefix cache (a
    # later block's K/V depend on the earlier, converted ones); cleared by a recompute
    kv_converted: bool = False
    max_tokens: int = 0  # effective limit: params.max_tokens, lowered by a max-token cap
    truncated: bool = False  # finished at a cap below what the request asked for
    held: bool = False  # evicted: readmitted only once pressure has eased
    finish_reason: str | None = None
    error: str | None = None  # why it ended with "error" where the request's own input is why
    text: str = ""
    prefix_offset: int = 0  # incremental detokenisation window
    read_offset: int = 0
    stop_checked_len: int = 0
    sent_tokens: int = 0  # output tokens already handed out in a RequestOutput
    sent_text_len: int = 0  # characters of `text` already handed out
    # when the request came (time.monotonic()): posted through the engine loop, when it was
    # posted (add_request's arrival_time), not when the engine thread took it in
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it first started
    # speculative decoding: the draft tokens this step computes after its last token (set by
    # the scheduler, consumed by `Scheduler.update`), and the request's n-gram index
    draft: list[int] = field(default_factory=list)
    lookup: Lookup | None = None
    # jump-forward: tokens its grammar forced after its last drawn one (set by the engine as it
    # appends them, 0 again at the next draw); with that token they are its decode's (`decoding`)
    forced: int = 0
    # per stop string, how many characters at the end of `text[:hold_checked_len]` are the
    # start of it (`releasable_text_len`); None until first asked
    stop_holds: list[int] | None = None
    hold_checked_len: int = 0

    def __post_init__(self) -> None:
        if not self.max_tokens:
            self.max_tokens = self.params.max_tokens
        if not self.prefill_tokens:
            self.prefill_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        """`token_ids[start:end]` without building `token_ids`: the engine asks for a few recent
        tokens every step, and a whole copy each time costs O(length) per token."""
        n_prompt = len(self.prompt_token_ids)
        end = self.num_tokens if end is None else end
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model: a prompt remainder, or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def decoding(self) -> bool:
        """Whether what is left to compute is a decode's: its prompt computed, and nothing before
        its last drawn token (that token, and any its grammar forced after it). Not a prompt
        chunk, nor a preempted sequence's recomputed text past what the prefix cache gave back."""
        left = self.num_uncomputed
        return 1 <= left <= 1 + self.forced and self.num_computed_tokens >= len(
            self.prompt_token_ids
        )

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.order)

    def releasable_text_len(self) -> int:
        """How much of `text` may be shown now. Text handed out cannot be taken back, so while
        the request runs, the longest tail of `text` that is the start of a stop string is held
        back: the next tokens may complete that stop string, and then the text is cut there.
        Once finished, all of `text` (already cut at its stop string) is final."""
        text = self.text
        stops = self.params.stop
        if self.finish_reason is not None or not stops:
            return len(text)
        holds = self.stop_holds
        if holds is None or len(holds) != len(stops) or len(text) < self.hold_checked_len:
            holds = self.stop_holds = [0] * len(stops)  # from scratch
            self.hold_checked_len = 0
        checked, hold = self.hold_checked_len, 0
        for j, stop in enumerate(stops):
            holds[j] = h = stop_prefix_tail(text, stop, checked - holds[j])
            hold = max(hold, h)
        self.hold_checked_len = len(text)
        return max(self.sent_text_len, len(text) - hold)


def stop_prefix_tail(text: str, stop: str, start: int = 0) -> int:
    """The length of the longest tail of `text` that is the start of `stop` without being all
    of it (0 if none), where that tail begins at `start` or later.

    Only the last len(stop) - 1 characters can begin one, and only where `stop[0]` is: each
    such place is tried once, with one comparison in C. A running sequence asks again as its
    text grows (`releasable_text_len`), from where the previous answer's tail began (a tail
    beginning before it would have been a longer answer then), so over the whole request each
    place in the text is found wanting at most once per stop string, and a token costs a few
    searches per stop string and per new character. Trying every length of prefix at every
    token (a slice and an `endswith` each) cost O(len(stop)^2) per stop string per token: 85 ms
    a token for 200 stop strings of 2000 characters, on the engine thread every request
    waits for."""
    n = len(text)
    i = text.find(stop[0], max(start, n - len(stop) + 1, 0))
    while i != -1:
        if stop.startswith(text[i:]):
            return n - i
        i = text.find(stop[0], i + 1)
    return 0


@dataclass(slots=True)
class RequestOutput:
    """What a request gained since its previous output: new token ids and new text, plus
    cumulative counts. Outputs are deltas so that a request holds O(1) undelivered data per
    output, not a copy of everything so far per token (which grows with the square of the
    output length). Concatenating every output's `new_token_ids` / `new_text` in order gives
    exactly the final output's `token_ids` / `text`.

    The final output (`finished`) also carries the whole result, built once at finish, for
    callers that only want the end: `text`, `token_ids` and `prompt_token_ids`. Reading those on
    an unfinished output is an error, not an empty value, so that a caller still written for
    cumulative outputs fails loudly instead of silently losing text.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative, including `new_token_ids`
    finish_reason: str | None
    finished: bool
    priority: str = "normal"
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    ttft_s: float | None = None
    truncated: bool = False  # stopped by a max-token cap below the requested max_tokens
    queue_time_s: float | None = None  # arrival until first scheduled
    final_text: str | None = None  # the whole text; only on the final output
    final_token_ids: list[int] | None = None  # every output token; only on the final output
    final_prompt_token_ids: list[int] | None = None  # only on the final output
    # the new tokens' log-probabilities, one per `new_token_ids` entry, where asked (else None)
    new_logprobs: list[TokenLogprob] | None = None
    # every output token's, on the final output of a request that asked (else None)
    final_logprobs: list[TokenLogprob] | None = None
    # every prompt token's after the first, on the final output of a request that asked
    final_prompt_logprobs: list[TokenLogprob] | None = None
    # on a final output with finish_reason "error": the cause where it is the request's own
    # (a schema or grammar the grammar library gave up on), else None (a fault of the engine)
    error: str | None = None
    # prompt tokens whose K/V it had (computed, or taken from the prefix cache) when this
    # output was taken: what a request that ends before its first token got for its prompt
    num_prompt_tokens_done: int = 0

    @property
    def text(self) -> str:
        """The whole generated text (final output only)."""
        return self._final("text", self.final_text)

    @property
    def token_ids(self) -> list[int]:
        """Every generated token id (final output only)."""
        return self._final("token_ids", self.final_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (final output only)."""
        return self._final("prompt_token_ids", self.final_prompt_token_ids)

    def _final(self, name: str, value: _T | None) -> _T:
        if value is None:
            raise AttributeError(
                f"RequestOutput.{name} is only set on the final output; an unfinished output "
                f"carries new_token_ids / new_text (what changed since the previous output)"
            )
        return value

    @classmethod
    def take(cls, seq: Sequence) -> RequestOutput:
        """Hand out what `seq` gained since the previous call and mark it handed out.

        Call it exactly once per output: each call advances the sequence's delivery offsets.
        """
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        new_ids = seq.output_token_ids[seq.sent_tokens :]
        lps = seq.output_logprobs
        new_lps = None if lps is None else lps[seq.sent_tokens :]
        upto = seq.releasable_text_len()
        new_text = seq.text[seq.sent_text_len : upto]
        seq.sent_tokens = len(seq.output_token_ids)
        seq.sent_text_len = upto
        done = seq.is_finished
        return cls(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            finished=done,
            priority=PRIORITY_NAMES[seq.priority],
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens,
            ttft_s=ttft,
            truncated=seq.truncated,
            queue_time_s=None
            if seq.first_scheduled_time is None
            else seq.first_scheduled_time - seq.arrival_time,
            final_text=seq.text if done else None,
            final_token_ids=list(seq.output_token_ids) if done else None,
            final_prompt_token_ids=list(seq.prompt_token_ids) if done else None,
            new_logprobs=new_lps,
            final_logprobs=list(lps) if done and lps is not None else None,
            final_prompt_logprobs=list(seq.prompt_logprobs)
            if done and seq.prompt_logprobs is not None
            else None,
            error=seq.error if done else None,
            num_prompt_tokens_done=min(seq.num_computed_tokens, len(seq.prompt_token_ids)),
        )
