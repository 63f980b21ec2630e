"""Admission control (seed §5): admit, queue or reject a request from its projected KV peak.

A request's peak is its prompt + max_new_tokens × safety_factor tokens, in blocks: the prompt
is known to the token, the margin is on the answer still to come. Requests are
admitted while the committed peaks of everything admitted stay within the budget (the pool
minus the reserved headroom) and a `max_num_seqs` batch slot is free for them; the rest wait in
the engine's bounded queue with a position and an estimated wait from the measured KV release
rate (or, waiting for a slot only, the finish rate). The queue counts every request not yet
started, whether it waits for KV or for a slot: one admitted on KV room behind a full batch
waited uncounted, however long. The queue is bounded by time more than by
count: past `max_queue` a request still waits while the requests ahead of it would start within
`max_queue_wait` at the rate requests have been finishing (an open-loop burst that the engine
works off in half a minute is served, not refused, and a client that would wait for minutes
hears so at once, with a Retry-After). A share of the budget
(`high_priority_reserve`, 10% by default) is committed to `high` priority only, so a burst of
normal and low traffic cannot fill every commitment and make high-priority requests queue
behind it. Above 95% usage only `high` priority is taken, and a request that can never fit is
rejected at once. (Halting admission is an engine knob, checked before the controller.)
Under predicted admission that emergency band queues instead (as the brief's own controller
does: not allowed now, a place in the queue and a wait): it plans past the budget on purpose,
so a pool above 95% is where it works, and a request turned away there was goodput lost.

`estimate: predicted` (the default) projects a request's output from what recent outputs really
ran to, not from its max_tokens: an online quantile (the median by default) of realised output
/ max_tokens per max_tokens bucket (`OutputLengthEstimator`), worst case until enough requests
have finished.
Commitments are then judged by the peak the admitted requests reach together, given that each
decodes one token per step and frees its KV when it ends (`overlap_peak`), instead of the sum of
their individual peaks, which they never reach at once. The safety factor stretches what is
uncertain, the output still to come (never past max_tokens), not the tokens a request already
holds: those are known to the token, and inflating them kept an eighth of the pool reserved and
empty. A wrong guess loses nothing: the request runs on and preemption (swap first), eviction
and the ladder absorb the overshoot.
`estimate: worst_case` keeps the brief's rule: the sum of (prompt + max_tokens) peaks.

Predicted admission pays for itself only if it holds requests back when that avoids worse:
preemption, and the ladder's remedies. So it may plan past the budget, by a factor
(`overcommit`, from 1 up to `max_overcommit`) that grows a little with every calm step and is
cut by a quarter on every step that had to preempt for KV or ended with device KV at 0.9 or
more, where the max_tokens ladder cuts and the default rules start acting (additive increase,
multiplicative decrease): while the pool absorbs the load, admission lets in nearly what no
admission would; once KV presses against it, admission tightens to its plan within a few
steps. And the brief's max_tokens ladder cuts answers only in its emergency band (usage >=
0.9): its lower bands shrink a worst-case reservation, but a predicted one is planned from how
long answers really run, which a cut does not change, so below 0.9 a cut would only lose
tokens.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvguard.engine.knobs import MiB, check_knobs, knob

EMERGENCY_USAGE = 0.95
# Predicted admission: from this device KV usage the max_tokens ladder cuts and a step counts
# as pressed (overcommit cut); below it neither
PRESSED_USAGE = 0.9
OVERCOMMIT_STEP = 0.01  # added per calm step
OVERCOMMIT_CUT = 0.75  # multiplied in per pressed step, or one that preempted for KV
HIGH = 0
NORMAL = 1
# The finish rate that says how fast the queue drains is measured over this much recent time
FINISH_WINDOW_S = 10.0


@dataclass(slots=True, kw_only=True)
class AdmissionConfig:
    """The admission knobs; the daemon offers each in its `admission_control` section."""

    enable: bool = knob(True, section="admission_control", doc="project KV peaks before admitting")
    safety_factor: float = knob(
        1.15,
        section="admission_control",
        live=True,
        ge=1.0,
        doc="margin on each request's projected KV peak",
    )
    reserved_headroom_bytes: int = knob(
        0,
        section="admission_control",
        live=True,
        key="reserved_headroom_mb",
        scale=MiB,
        ge=0,
        # Unset in the file: 2048 MiB on CUDA (seed §7.1), 0 on CPU, where the KV pool is an
        # explicit byte budget with nothing else inside it to protect.
        file_default=None,
        doc="KV budget kept free of commitments; unset: 2048 MiB on CUDA, 0 on CPU",
    )
    dynamic_max_tokens: bool = knob(
        True,
        section="admission_control",
        live=True,
        doc="shorten max_tokens as KV usage climbs (seed §5.2)",
    )
    max_queue: int = knob(
        256,
        section="admission_control",
        live=True,
        ge=0,
        doc="requests that may wait (for KV or a batch slot) however slowly the queue moves "
        "(see max_queue_wait)",
    )
    max_queue_wait_s: float = knob(
        60.0,
        section="admission_control",
        live=True,
        key="max_queue_wait",
        kind="duration",
        ge=0.0,
        doc="past max_queue a request still waits while the queue ahead of it would drain within "
        "this, at the rate requests finished over the last 10s (0: max_queue is a hard limit)",
    )
    high_priority_reserve: float = knob(
        0.10,
        section="admission_control",
        live=True,
        ge=0.0,
        lt=1.0,
        doc="share of the budget only `high` priority may commit into (0 = none)",
    )

    estimate: str = knob(
        "predicted",
        section="admission_control",
        choices=("predicted", "worst_case"),
        doc="project outputs from realised lengths (predicted) or from max_tokens (worst_case)",
    )
    max_overcommit: float = knob(
        1.5,
        section="admission_control",
        live=True,
        ge=1.0,
        doc="how far past the budget predicted admission may plan while steps are calm (cut on "
        "every step that preempts or ends with device KV at 0.9 or more; 1 = never)",
    )
    low_priority_delay_s: float = knob(
        1.0,
        section="admission_control",
        live=True,
        key="low_priority_delay",
        kind="duration",
        ge=0.0,
        doc="queued low requests go ahead of normal ones that arrived this much later "
        "(a normal burst delays low traffic by this, never starves it)",
    )
    # The median, not a high quantile: admission judges the whole batch's peak, and over a
    # batch the long and short answers even out; the safety factor is the batch's margin, and
    # preemption absorbs what still outruns it. (0.9 left KV at 0.74 in the overload bench.)
    estimate_quantile: float = knob(
        0.5,
        section="admission_control",
        live=True,
        gt=0.0,
        le=1.0,
        doc="quantile of recent output / max_tokens that predicted admission plans for",
    )

    def __post_init__(self) -> None:
        check_knobs(self)


# (tokens held now, tokens still to come) of one admitted, unfinished request
LiveLoad = tuple[int, int]


def stretch(expected: int, cap: int, factor: float) -> int:
    """Output still to come, planned with a margin: `expected` × factor, never past `cap` (what
    max_tokens leaves), which is certain."""
    return max(0, min(cap, math.ceil(expected * factor)))


def overlap_peak(loads: Iterable[LiveLoad], block_size: int = 1, factor: float = 1.0) -> int:
    """The most KV blocks a set of requests will hold at one time (tokens with block_size 1).

    Continuous batching decodes every running request one token per step, so τ steps from now
    request i holds held_i + τ tokens (× `factor`, rounded up to blocks) while τ <= remaining_i,
    and nothing after. (Predicted admission puts its margin in `remaining`, `stretch`, and
    passes factor 1.) Each term only grows until its request ends, so the maximum is at τ = 0
    or at some remaining_i: evaluating those points is exact, O(n²) for the few dozen requests
    a batch holds.
    """
    items = list(loads)
    best = 0
    for tau in {0, *(r for _, r in items)}:
        total = sum(math.ceil((h + tau) * factor / block_size) for h, r in items if r >= tau)
        best = max(best, total)
    return best


@dataclass(slots=True)
class OutputLengthEstimator:
    """How long outputs really run, as a share of their max_tokens, learnt from finished ones.

    Clients ask for generous max_tokens and most answers end far sooner; reserving the cap keeps
    KV reserved and empty. Ratios are kept per max_tokens bucket (powers of two: a client's cap
    says something about the answers it expects) over a sliding window. A bucket with too few
    samples borrows the pooled estimate; with too few samples anywhere the ratio is 1.0, today's
    worst case, so a cold daemon admits exactly as `estimate: worst_case` does. The floor keeps
    one run of very short answers from letting a flood of long ones in.
    """

    quantile: float = 0.5
    floor: float = 0.1
    window: int = 64
    min_samples: int = 4
    _buckets: dict[int, deque[float]] = field(default_factory=dict)
    _pooled: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    _errors: deque[float] = field(default_factory=lambda: deque(maxlen=256))

    @staticmethod
    def bucket(max_tokens: int) -> int:
        """The bucket's upper bound: the next power of two at or above max_tokens."""
        return 1 << max(0, max_tokens - 1).bit_length()

    def ratio(self, max_tokens: int) -> float:
        own = self._buckets.get(self.bucket(max_tokens), ())
        pool = own if len(own) >= self.min_samples else self._pooled
        if len(pool) < self.min_samples:
            return 1.0
        return max(self.floor, _quantile(pool, self.quantile))

    def predict(self, max_tokens: int) -> int:
        """Output tokens to plan for: ratio × max_tokens, at least one, at most max_tokens."""
        return max(1, min(max_tokens, math.ceil(max_tokens * self.ratio(max_tokens))))

    def observe(self, max_tokens: int, realised: int, predicted: int) -> None:
        """Learn from a finished request; `predicted` is what admission planned for it."""
        if max_tokens < 1:
            return
        r = min(1.0, realised / max_tokens)
        key = self.bucket(max_tokens)
        self._buckets.setdefault(key, deque(maxlen=self.window)).append(r)
        self._pooled.append(r)
        self._errors.append((realised - predicted) / max_tokens)

    def ratios(self) -> dict[str, float]:
        """The ratio each seen bucket plans with now, keyed 'le<bound>' (for metrics)."""
        return {f"le{b}": self.ratio(b) for b in sorted(self._buckets)}

    def error(self) -> dict[str, float]:
        """Recent prediction error: mean (realised - predicted) / max_tokens (positive means
        outputs outran their prediction) and the share of requests that did."""
        errs = list(self._errors)
        if not errs:
            return {"mean": 0.0, "undershoot_share": 0.0, "samples": 0}
        return {
            "mean": sum(errs) / len(errs),
            "undershoot_share": sum(e > 0 for e in errs) / len(errs),
            "samples": len(errs),
        }


def _quantile(values: Iterable[float], q: float) -> float:
    """The nearest-rank quantile: a value that was really seen, never an interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


@dataclass(slots=True, frozen=True)
class AdmissionDecision:
    decision: str  # admit | queue | reject
    reason: str = ""
    max_tokens: int = 0  # possibly lowered by the dynamic ladder
    truncated: bool = False
    queue_position: int = 0
    estimated_wait_s: float = 0.0
    # why a rejection happened, for a server to map onto its own answer: never_fits (the
    # request itself is the problem), overloaded, queue_full, halted (retry later)
    kind: str = ""
    predicted_tokens: int = 0  # output tokens admission planned for (max_tokens: worst case)
    # what it was decided from, for a pool grown for good to decide again (`regrown_max_tokens`):
    # the request's max_tokens, and the KV usage the ladder cut it at (None: no ladder)
    asked: int = 0
    ladder_usage: float | None = None
    # what about the request a never_fits rejection is for: "prompt" (the prompt alone is past
    # the KV this priority may use) or "max_tokens" (its answer is, with the ladder off)
    about: str = ""


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
        # finish times, in order, within FINISH_WINDOW_S of the latest (`_record_finish`)
        self._finished: deque[float] = deque()
        self.clock: Callable[[], float] = time.monotonic
        # by kind, counted by the policy once a request's decision is final: a request's
        # sequences are taken in or refused as one (`AdmissionPolicy.count`)
        self.decisions = {"admit": 0, "queue": 0, "reject": 0}
        self.estimator = OutputLengthEstimator(quantile=config.estimate_quantile)
        self.overcommit = 1.0  # predicted admission plans up to budget x this (see the module)
        # (held, remaining) of every admitted, unfinished request of rank <= the argument
        # (None: every rank); the engine sets it. Called as live(rank, (group, load)) it also
        # holds `load`, a new request whose prompt prefix `group` (the prefix cache's shared
        # blocks) live requests may hold already: each such prefix is counted once.
        self.live: Callable[..., list[LiveLoad]] = lambda rank, join=None: (
            [] if join is None else [join[1]]
        )

    @property
    def predicted(self) -> bool:
        return self.config.estimate == "predicted"

    def plan_tokens(self, max_tokens: int) -> int:
        """Output tokens a request with this max_tokens is planned for."""
        return self.estimator.predict(max_tokens) if self.predicted else max_tokens

    def fits(
        self,
        prompt_len: int,
        planned: int,
        limit: int,
        rank: int = HIGH,
        cap: int | None = None,
        group: object = None,
    ) -> bool:
        """Whether a new request keeps the admitted requests' overlap peak within `limit`.

        `planned` output tokens are stretched by the safety factor up to `cap` (its max_tokens;
        None: planned itself); the live loads come stretched already (the policy's).

        A `high` request is judged against high-priority work only: whatever lower-priority
        work would have to make room for it is preempted (lowest priority, newest first, swap
        first), so commitments of the burst's normal and low requests, which grow past their
        plans, never make high priority queue.

        `group` (None: none) is the request's prompt prefix that the prefix cache shares with
        live requests of the same prefix (the policy's key): `live` counts it once."""
        rest = stretch(planned, planned if cap is None else cap, self.config.safety_factor)
        rank_of = HIGH if rank == HIGH else None
        if group is None:
            loads = [*self.live(rank_of), (prompt_len, rest)]
        else:
            loads = self.live(rank_of, (group, (prompt_len, rest)))
        return overlap_peak(loads, self.block_size) <= math.floor(limit * self.overcommit)

    def on_step(self, preempted: int, usage: float) -> None:
        """After each scheduled step: `preempted` sequences had to leave the device for KV,
        and `usage` of the device KV is in use. Predicted admission loosens its plan on calm
        steps and tightens it on pressed ones (worst_case stays at the brief's budget)."""
        if not self.predicted:
            return
        if preempted or usage >= PRESSED_USAGE:
            self.overcommit = max(1.0, self.overcommit * OVERCOMMIT_CUT)
        else:
            self.overcommit = min(self.config.max_overcommit, self.overcommit + OVERCOMMIT_STEP)

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

    def projected_blocks(self, prompt: int, output: int, cap: int | None = None) -> int:
        """The blocks a request's peak is projected at: its `prompt` tokens, known to the token,
        and `output` tokens to come with the safety factor's margin. Under predicted admission
        the margin never goes past `cap` (what max_tokens leaves; None: `output`), which is
        certain, as `fits` plans it; worst_case keeps the brief's margin on max_tokens."""
        factor = self.config.safety_factor
        if self.predicted:
            rest = stretch(output, output if cap is None else cap, factor)
        else:
            rest = math.ceil(output * factor)
        return math.ceil((prompt + rest) / self.block_size)

    def decide(
        self,
        prompt_len: int,
        max_tokens: int,
        rank: int,
        total_blocks: int,
        usage: float,
        queued: int,
        max_total_len: int,
        configured_blocks: int | None = None,
        shared: int = 0,
        group: object = None,
        slot: bool = True,
    ) -> AdmissionDecision:
        """Admit, queue or reject a request against a pool of `total_blocks` now.
        `queued` requests have not started ahead of it (waiting for KV or for a batch slot),
        and `slot` says whether one of the batch's `max_num_seqs` slots is free for it: a
        request is admitted only where it could start at once, and otherwise joins the queue
        that `max_queue` and `max_queue_wait` bound.
        `configured_blocks` is the pool the engine is configured with (None: `total_blocks`),
        which a remedy may hold smaller for a while: what is too large only for the smaller
        pool waits (alone on an idle engine it starts, `try_commit`), not refused.
        `shared` prompt tokens are held already by an admitted request with the same prompt
        prefix (`group`, see `fits`), which the prefix cache gives this one: they are not
        committed again (whether the request could ever fit is judged on its whole prompt)."""
        configured = total_blocks if configured_blocks is None else configured_blocks
        limit = self.limit_blocks(total_blocks, rank)
        ever = self.limit_blocks(max(configured, total_blocks), rank)
        never = self.never_fits(
            prompt_len, max_tokens, rank, total_blocks, max_total_len, configured
        )
        if never is not None:
            return never
        emergency = usage > EMERGENCY_USAGE and rank != HIGH
        if emergency and not self.predicted:
            return _reject(
                "overloaded",
                f"KV cache {usage:.0%} full: only high priority is admitted",
                self.wait_s(1),
            )
        asked = max_tokens
        ladder = None
        if self.config.dynamic_max_tokens and (not self.predicted or usage >= PRESSED_USAGE):
            ladder = usage
        max_tokens, n = self._shortened(prompt_len, asked, ladder, ever, max_total_len)
        planned = self.plan_tokens(n)
        need = self.projected_blocks(prompt_len - shared, planned, n)
        if self.predicted:
            room = self.fits(prompt_len, planned, limit, rank, n, group)
        else:
            room = self.committed_blocks + need <= limit
        if room and slot and queued == 0 and not emergency:
            return AdmissionDecision(
                "admit", "", n, n < max_tokens, 0, 0.0, "", planned, asked, ladder
            )
        if (full := self.queue_full(queued, need)) is not None:
            return full
        if room and not slot and not emergency:  # KV would hold it: the batch is full
            wait, reason = self.slot_wait_s(queued + 1), "waiting for a batch slot"
        else:
            wait = self.wait_s(max(need, self.committed_blocks + need - limit))
            reason = "waiting for KV memory"
        if need > limit and limit < ever:
            reason += f" (the KV pool is held at {total_blocks} blocks for now)"
        return AdmissionDecision(
            "queue", reason, n, n < max_tokens, queued + 1, wait, "", planned, asked, ladder
        )

    def queue_full(self, queued: int, need: int = 1) -> AdmissionDecision | None:
        """The queue_full refusal of a request that cannot start at once behind `queued`
        requests (None: it may wait): past `max_queue` it waits only while they would drain
        within `max_queue_wait` at the recent finish rate. Read-only (`finish_rate`): the
        engine thread decides with it as it takes a request in, the event loop as a request
        is posted (`AdmissionPolicy.refuse_posted`). Its wait is when the queue would drain
        within the bound again, else the KV wait of `need` blocks."""
        if queued < self.config.max_queue:
            return None
        drain, bound = self.drain_s(queued), self.config.max_queue_wait_s
        if bound and drain <= bound:
            return None
        known = math.isfinite(drain)
        return _reject(
            "queue_full",
            f"queue full ({queued} waiting" + (f", about {drain:.0f}s to drain)" if known else ")"),
            drain - bound if known else self.wait_s(need),
        )

    def queue_full_for(
        self, ahead: int, size: int, refused: AdmissionDecision
    ) -> AdmissionDecision:
        """`refused`, the queue_full refusal of one of a request's `size` sequences, said of
        the whole request: the queue it counted held the request's own sequences decided
        before it, so only the `ahead` requests of others are named as waiting, and the
        request's own size as what does not fit (a client told "queue full (4 waiting)" of an
        empty queue waits for a queue that is not there). Its wait, when the queue would hold
        the sequence again, is kept."""
        bound = self.config.max_queue_wait_s
        reason = (
            f"queue full ({ahead} waiting ahead of this request): its {size} sequences (choices "
            f"or prompts) do not all fit in the queue beside them (max_queue {self.config.max_queue}"
            + (f", max_queue_wait {bound:g}s" if bound else "")
            + "); retry later, or ask for fewer"
        )
        return replace(refused, reason=reason)

    def never_fits(
        self,
        prompt_len: int,
        max_tokens: int,
        rank: int,
        total_blocks: int,
        max_total_len: int,
        configured_blocks: int | None = None,
    ) -> AdmissionDecision | None:
        """The never_fits rejection of a request no pool this engine may hold serves at
        priority `rank` (None: one could), judged as `decide` judges it: its prompt past the
        KV that priority may ever use, or, without the ladder (`dynamic_max_tokens: false`),
        its whole max_tokens. Apart from `decide` so that an admission halt asks it first: a
        503 that tells the client to retry a request that can only ever get this 400 hides
        the cause and invites a retry loop."""
        configured = total_blocks if configured_blocks is None else configured_blocks
        pool = max(configured, total_blocks)
        ever = self.limit_blocks(pool, rank)
        # what is known (the prompt, and the token it must at least produce) is known to the
        # token: no safety factor on it
        if math.ceil((prompt_len + 1) / self.block_size) > ever:
            return _reject(
                "never_fits", self._too_long(prompt_len, rank, ever, pool), about="prompt"
            )
        if self.config.dynamic_max_tokens:
            return None  # an answer too long for the budget is shortened to fit, not refused
        whole, n = self._shortened(prompt_len, max_tokens, None, ever, max_total_len)
        if n >= whole:
            return None
        return _reject(
            "never_fits",
            f"prompt of {prompt_len} tokens + max_tokens={max_tokens} can never fit the KV "
            f"budget of {ever} blocks (the most that fits: max_tokens="
            f"{self.longest_answer(prompt_len, ever)})",
            about="max_tokens",
        )

    def _shortened(
        self, prompt_len: int, asked: int, ladder: float | None, ever: int, max_total_len: int
    ) -> tuple[int, int]:
        """(max_tokens within the length limit, the output tokens given): the ladder's cut at
        KV usage `ladder` (None: none), then the longest answer that can ever fit `ever`."""
        # the model never produces past its length limit: plan (and learn) from what it can
        max_tokens = max(1, min(asked, max_total_len - prompt_len))
        n = max_tokens
        if ladder is not None:
            n = dynamic_max_tokens(max_tokens, ladder, max_total_len - prompt_len)
        if self.projected_blocks(prompt_len, n, n) > ever:
            # shorten to the longest answer that can ever fit rather than refuse: the margin
            # is on the answer only, the prompt is counted to the token
            n = max(1, min(n, self.longest_answer(prompt_len, ever)))
        return max_tokens, n

    def regrown_max_tokens(
        self,
        prompt_len: int,
        decision: AdmissionDecision,
        rank: int,
        total_blocks: int,
        configured_blocks: int,
        max_total_len: int,
    ) -> tuple[int, int]:
        """(max_tokens within the length limit, the output tokens given) as `decide` gives
        them to the request `decision` was made for against the pool as it is now (the
        larger of the pool now and the configured one, as `decide` judges), at the KV usage
        it was decided at. Used when the pool has grown for good, to give back what a
        smaller pool's admission shortened."""
        ever = self.limit_blocks(max(configured_blocks, total_blocks), rank)
        return self._shortened(
            prompt_len, decision.asked, decision.ladder_usage, ever, max_total_len
        )

    def longest_answer(self, prompt: int, blocks: int) -> int:
        """The longest answer (0: none) whose projected peak after a `prompt`-token prompt,
        planned at its whole length (`projected_blocks`), stays within `blocks`."""
        room = blocks * self.block_size - prompt
        if room <= 0:
            return 0
        n = room if self.predicted else math.floor(room / self.config.safety_factor)
        while n > 0 and self.projected_blocks(prompt, n, n) > blocks:  # float rounding
            n -= 1
        while self.projected_blocks(prompt, n + 1, n + 1) <= blocks:
            n += 1
        return n

    def _too_long(self, prompt_len: int, rank: int, ever: int, pool: int) -> str:
        """Why a prompt of `prompt_len` tokens can never be served at priority `rank`: past
        the `ever` blocks it may use of a `pool` of blocks (a share of it below high)."""
        # imported here: kvguard.engine.sequence imports torch, and the daemon's config (and
        # with it `kvguard audit`) imports this module without needing torch
        from kvguard.engine.sequence import PRIORITY_NAMES

        reason = f"prompt of {prompt_len} tokens can never fit the KV budget of {ever} blocks"
        if rank == HIGH or self.config.high_priority_reserve == 0:
            return reason
        reason += (
            f" that {PRIORITY_NAMES.get(rank, 'this')} priority may use (the budget less the "
            f"{self.config.high_priority_reserve:.0%} high-priority reserve)"
        )
        high = self.limit_blocks(pool, HIGH)
        if math.ceil((prompt_len + 1) / self.block_size) <= high:
            reason += f"; high priority may use {high} blocks, which hold it"
        return reason

    # -- commitments --------------------------------------------------------------------------
    def try_commit(
        self,
        blocks: int,
        total_blocks: int,
        rank: int = HIGH,
        load: LiveLoad | None = None,
        cap: int | None = None,
        group: object = None,
    ) -> bool:
        """Reserve a projected peak when a queued request is about to start; predicted
        admission judges the request's `load` (tokens held, planned output still to come, at
        most `cap`; its shared prompt prefix `group`, see `fits`) against the overlap peak
        instead of the sum of committed peaks."""
        # With nothing admitted in flight the request runs alone, and the pool always holds one
        # request of its length limit: it starts whatever its projection (made against a
        # larger pool before a live shrink or dtype switch, or over a limit below one whole
        # request), which would otherwise keep it waiting forever on an idle engine.
        if self.committed_blocks > 0 and not self._fits_beside(
            blocks, total_blocks, rank, load, cap, group
        ):
            return False
        self.committed_blocks += blocks
        return True

    def _fits_beside(
        self,
        blocks: int,
        total_blocks: int,
        rank: int,
        load: LiveLoad | None,
        cap: int | None,
        group: object = None,
    ) -> bool:
        """Whether a request fits beside the commitments in flight (`try_commit`'s test)."""
        limit = self.limit_blocks(total_blocks, rank)
        if self.predicted and load is not None:
            return self.fits(load[0], load[1], limit, rank, cap, group)
        return self.committed_blocks + blocks <= limit

    def commit(self, blocks: int) -> None:
        """Reserve a peak that `decide` admitted at once."""
        self.committed_blocks += blocks

    def uncommit(self, blocks: int) -> None:
        """Give back a reservation whose request could not start after all (no KV released)."""
        self.committed_blocks -= blocks

    def release(self, blocks: int) -> None:
        """An admitted request finished (or was aborted) and gives its peak back."""
        self.committed_blocks = max(0, self.committed_blocks - blocks)
        now = self.clock()
        self._releases.append((now, blocks))
        self._record_finish(now)

    def _record_finish(self, now: float) -> None:
        """Keeps the finish times of the last FINISH_WINDOW_S, forgetting the older ones as
        each is added: only here, on the engine thread, is the record changed, so that no
        reader pops a record another thread has just appended (finishes lost, every
        Retry-After skewed). Bounded by the window, not by a maxlen, which would drop
        finishes still inside the window on a busy engine and understate the rate."""
        self._finished.append(now)
        while self._finished[0] < now - FINISH_WINDOW_S:
            self._finished.popleft()

    def finish_rate(self) -> float:
        """Requests finished per second over the last FINISH_WINDOW_S (0 when none did).
        Read-only, from any thread (the engine's admission, the event loop's 429): counted on
        a copy of the record, `deque.copy()`: it allocates before it starts iterating and then
        only copies pointers (no Python code, no collection, so no thread switch), so it sees
        the deque between two of the engine thread's appends or pops, never during one.
        `tuple(deque)` allocated its tuple after starting, where a collection's finaliser
        could let the engine thread append: "deque mutated during iteration", a 500.
        Finishes older than the window stay until the next release forgets them (an idle
        engine has none): they are skipped by time, the record being in finish order."""
        finished = self._finished.copy()
        cutoff = self.clock() - FINISH_WINDOW_S
        return (len(finished) - bisect.bisect_left(finished, cutoff)) / FINISH_WINDOW_S

    def drain_s(self, queued: int) -> float:
        """Seconds until `queued` requests ahead have started, at the recent finish rate (each
        start waits for a finish once the queue is long); inf when nothing finished lately.
        Measured over a fixed window, so an engine that only just got busy looks slower than
        it is: the estimate errs towards refusing."""
        rate = self.finish_rate()
        return queued / rate if rate > 0 else math.inf

    def slot_wait_s(self, ahead: int) -> float:
        """A request's estimated wait for a batch slot, `ahead` starts from now (itself
        included): one finish each, at the recent finish rate; as `wait_s`, at most 30 s and
        1 s when nothing finished lately (no rate to estimate from)."""
        rate = self.finish_rate()
        return min(30.0, ahead / rate) if rate > 0 else 1.0

    def release_rate(self) -> float:
        """Blocks released per second over the recent window (0 when unknown)."""
        if len(self._releases) < 2:
            return 0.0
        span = self._releases[-1][0] - self._releases[0][0]
        return sum(b for _, b in self._releases) / span if span > 0 else 0.0

    def wait_s(self, blocks: int) -> float:
        rate = self.release_rate()
        return min(30.0, blocks / rate) if rate > 0 else 1.0


def _reject(kind: str, reason: str, wait: float = 0.0, about: str = "") -> AdmissionDecision:
    return AdmissionDecision("reject", reason, 0, False, 0, wait, kind, about=about)
