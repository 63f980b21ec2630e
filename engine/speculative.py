"""Speculative decoding by prompt lookup: draft tokens from the request's own text, verified in
one step.

Much of what a model writes repeats what it has read or written: a quoted passage, code being
edited, names and figures from a document, a list's recurring frame. When the last few tokens of
a request occurred before in its prompt or output, the tokens that followed them then are a
likely continuation now. Such a draft costs no model: it is a dictionary lookup.

A step computes the request's last token and its `k` draft tokens together (`build_step` runs a
short chunk like that as one decode row a position), with logits at every position. Row `i`
gives the token that follows the draft's first `i` tokens; drafts are accepted while each one is
what its row chose, and the first row that chose otherwise gives the step's last token (after
`k` accepted drafts, the row past them gives one more). A greedy request therefore gets the
tokens it gets without drafts (each row is computed as a decode row of its own: the same
arithmetic but for how a long sequence is split over threads, which only a near tie between its
two best tokens could feel). A sampled one draws each row from its own distribution, as
decoding would, and keeps a draft only where the draw equals it: for a draft that is a fixed
token rather than a draw from another model, that is exactly speculative sampling's rule (the
draft is kept with its probability; when it is not, the token drawn is distributed as the row's
distribution without the draft), so the output follows the model's distribution as without
drafts. A seeded request's generator gives back the draws of rows past a rejected draft, so
it spends one draw a token either way: a seed gives the same tokens with drafts on or off.
K/V computed for rejected drafts lie past the request's computed count: the next step
overwrites them, and blocks only they needed go back to the pool at once. Not on an FP8 pool,
whose block scales only grow as K/V are written (rejected drafts' too): there no step drafts
(`Scheduler.kv_quantized`).

Drafts cost compute: a draft row makes its step longer (on 2 CPU cores about 0.85 ms a row
for the default model against 2.5 ms of a step's fixed part; on a GPU next to nothing), and it
brings a token only if every draft before it is accepted too. So a draft is worth its row only
where it is likely enough: each request keeps an estimate `a` of how often its drafts are
accepted (recent verify steps weigh most, a prior when it has none), draft position `j` is
expected to bring a^j tokens, and a step drafts position `j` when a^j is at least the
threshold `draft_threshold`: what a row costs against what a token of a step without drafts
costs. With `b` sequences decoding and a step of n rows taking base + row * n seconds, a token
costs (base + row * b) / b, so the threshold is r b / (1 + r b) with r = row / base, learnt
from the engine's own decode steps (`speculative_row_cost` fixes r instead). One decoding
sequence on the CPU drafts while a^j >= 0.25; sixteen only where a^j >= 0.84: a large batch
already fills the cores (past `speculative_max_batch` decoding sequences no draft is
looked up at all). A request whose text has no earlier match drafts nothing and pays nothing;
one whose drafts keep failing stops drafting until its estimate drifts back to the prior.
"""

from __future__ import annotations

import math
from typing import Protocol

MAX_DRAFT = 16  # `speculative_tokens` may not exceed this
PRIOR_ACCEPT = 0.7  # a request's acceptance estimate before its first verify step
PRIOR_WEIGHT = 1.0  # ... worth one verify step
MEMORY = 0.8  # each verify step's weight against the one after it
IDLE_MEMORY = 0.97  # a step not drafted for a low estimate: the estimate drifts to the prior
# r (a row's seconds over a decode step's fixed seconds) before the engine has measured its
# own: on CPU cores a row's arithmetic counts (2 cores, the default model: 0.85 ms against
# 2.5); a GPU's decode step is bound by reading the weights, so a few more rows cost ~nothing
ROW_COST_PRIOR = {"cpu": 0.3, "cuda": 0.02}


class TokenSource(Protocol):
    """What a lookup reads of a request (`Sequence`): its length and slices of its tokens."""

    @property
    def num_tokens(self) -> int: ...
    def token_slice(self, start: int, end: int | None = None) -> list[int]: ...


class Lookup:
    """One request's n-gram index over its tokens and its record of accepted drafts.

    For each n-gram size in `sizes` (longest first) it keeps, under the n-gram's hash, the
    position that followed its most recent occurrence with a continuation. The request's last
    n tokens are looked up before they are indexed themselves, so a hit is always an earlier
    occurrence. A hash collision only proposes a worse draft; verification keeps the output
    right."""

    __slots__ = ("sizes", "_index", "_seen", "_kept", "_missed", "proposed", "accepted")

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self._index: list[dict[int, int]] = [{} for _ in sizes]
        self._seen = 0  # tokens indexed: n-grams ending before position _seen - 1
        self._kept = 0.0  # drafts accepted, and verify steps that rejected one, decayed
        self._missed = 0.0
        self.proposed = 0
        self.accepted = 0

    def _catch_up(self, seq: TokenSource) -> None:
        """Index every n-gram that has a continuation: those ending before the last token."""
        total, first = seq.num_tokens, max(self._seen, 1)
        if first < total:
            base = max(0, first - max(self.sizes))
            window = seq.token_slice(base, total)  # only what the new n-grams span
            for end in range(first, total):  # n-gram tokens[end - n:end] -> end
                for size, index in zip(self.sizes, self._index, strict=True):
                    if end >= size:
                        index[hash(tuple(window[end - size - base : end - base]))] = end
        self._seen = max(self._seen, total)

    def propose(self, seq: TokenSource, most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of the longest
        n-gram `seq`'s tokens end with; [] when there is none."""
        self._catch_up(seq)
        total = seq.num_tokens
        if most <= 0:
            return []
        tail = seq.token_slice(max(0, total - max(self.sizes)), total)
        for size, index in zip(self.sizes, self._index, strict=True):
            if len(tail) < size:
                continue
            at = index.get(hash(tuple(tail[len(tail) - size :])))
            if at is not None:
                return seq.token_slice(at, min(at + most, total))
        return []

    @property
    def acceptance(self) -> float:
        """How likely this request's next draft token is accepted, given the ones before it
        were: accepted drafts over accepted drafts and rejections (each verify step ends at
        its first rejection), recent steps weighing most, with the prior's weight."""
        kept = self._kept + PRIOR_ACCEPT * PRIOR_WEIGHT
        return kept / (self._kept + self._missed + PRIOR_WEIGHT)

    def length(self, threshold: float, most: int) -> int:
        """Draft positions worth a row: those `j` <= `most` whose chance of bringing a token,
        acceptance ** j, is at least `threshold`. A request that drafts nothing for a low
        estimate lets it drift back towards the prior, so it tries again later."""
        a = self.acceptance
        if threshold <= 0.0 or most <= 0:
            return max(most, 0)
        n = most if a >= 1.0 else min(most, int(math.log(threshold) / math.log(a) + 1e-9))
        if n <= 0:
            self._kept *= IDLE_MEMORY
            self._missed *= IDLE_MEMORY
        return n

    def record(self, drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` of its `drafted` drafts."""
        self.proposed += drafted
        self.accepted += accepted
        self._kept = self._kept * MEMORY + accepted
        self._missed = self._missed * MEMORY + (accepted < drafted)


class StepCost:
    """What a row costs a decode step against the step's fixed part, learnt from the engine's
    own decode-only steps: a least-squares line through (rows, seconds), older steps decaying.
    Until steps of different sizes have been seen (the slope is unknown while every step has
    as many rows) it answers the device's prior. `speculative_row_cost` overrides it
    (`Scheduler.row_cost`)."""

    DECAY = 0.98  # a step's weight against the one after it: the fit follows the last ~50
    MIN_WEIGHT = 8.0  # steps before the fit is trusted
    MIN_SPREAD = 0.25  # variance of the row count the slope needs

    __slots__ = ("prior", "_s")

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self._s = [0.0] * 5  # weight, sum x, sum y, sum xx, sum xy

    def observe(self, rows: int, seconds: float) -> None:
        s, d = self._s, self.DECAY
        for i, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            s[i] = s[i] * d + v

    @property
    def weight(self) -> float:
        """The steps the fit holds, older ones counted by their decayed weight."""
        return self._s[0]

    def ratio(self) -> float:
        """r: one more row's seconds over the step's fixed seconds."""
        w, x, y, xx, xy = self._s
        if w < self.MIN_WEIGHT:
            return self.prior
        mx, my = x / w, y / w
        var = xx / w - mx * mx
        if var < self.MIN_SPREAD or my <= 0.0:
            return self.prior
        row = max(0.0, (xy / w - mx * my) / var)
        base = max(my - row * mx, 0.1 * my)  # a noisy fit never makes rows all of a step
        return row / base


def draft_threshold(row_cost: float, decoding: int) -> float:
    """The least chance of bringing a token that pays for a draft row while `decoding`
    sequences decode, a row costing `row_cost` (r) of a step's fixed part: a row's cost over a
    token's in a step without drafts, r b / (1 + r b)."""
    r = row_cost * max(decoding, 1)
    return r / (1.0 + r)


def ngram_sizes(longest: int) -> tuple[int, ...]:
    """The n-gram sizes looked up, longest first: down to 2 (a single token matches too much
    to be a useful draft's anchor)."""
    return tuple(range(longest, 1, -1)) if longest > 1 else (1,)


def accepted_prefix(draft: list[int], chosen: list[int]) -> list[int]:
    """What a verify step emits: the tokens its rows chose (`chosen`, one more than `draft`)
    up to and including the first that differs from the draft, or all of them when every
    draft was chosen."""
    for i, token in enumerate(draft):
        if chosen[i] != token:
            return chosen[: i + 1]
    return chosen[: len(draft) + 1]
