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
it spends one draw a token either way: a seed gives the same tokens with drafts on or off. K/V computed for rejected drafts lie past the request's computed count: the
next step overwrites them, and blocks only they needed go back to the pool at once.

Drafts cost compute: a verify step of `k` drafts takes longer than a one-token step (on 2 CPU
cores about 0.5-1 ms a draft row for the default model), so the draft length adapts to each
request's record (`Lookup.k`: two longer after a step whose drafts were all accepted, one
shorter after a rejection), a request whose text has no earlier match drafts nothing and pays
nothing, and drafts stop once more sequences decode than `speculative_max_batch` (a large
batch already fills the cores).
"""

from __future__ import annotations

from typing import Protocol

MAX_DRAFT = 16  # `speculative_tokens` may not exceed this


class TokenSource(Protocol):
    """What a lookup reads of a request (`Sequence`): its length and slices of its tokens."""

    @property
    def num_tokens(self) -> int: ...
    def token_slice(self, start: int, end: int | None = None) -> list[int]: ...


class Lookup:
    """One request's n-gram index over its tokens and its adaptive draft length.

    For each n-gram size in `sizes` (longest first) it keeps, under the n-gram's hash, the
    position that followed its most recent occurrence with a continuation. The request's last
    n tokens are looked up before they are indexed themselves, so a hit is always an earlier
    occurrence. A hash collision only proposes a worse draft; verification keeps the output
    right."""

    __slots__ = ("sizes", "_index", "_seen", "k", "proposed", "accepted")

    def __init__(self, sizes: tuple[int, ...], k: int) -> None:
        self.sizes = sizes
        self._index: list[dict[int, int]] = [{} for _ in sizes]
        self._seen = 0  # tokens indexed: n-grams ending before position _seen - 1
        self.k = k  # this request's draft length now
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
        """Up to `min(self.k, most)` tokens that followed the latest earlier occurrence of the
        longest n-gram `seq`'s tokens end with; [] when there is none."""
        self._catch_up(seq)
        k = min(self.k, most)
        total = seq.num_tokens
        if k <= 0:
            return []
        tail = seq.token_slice(max(0, total - max(self.sizes)), total)
        for size, index in zip(self.sizes, self._index, strict=True):
            if len(tail) < size:
                continue
            at = index.get(hash(tuple(tail[len(tail) - size :])))
            if at is not None:
                return seq.token_slice(at, min(at + k, total))
        return []

    def record(self, drafted: int, accepted: int, most: int) -> None:
        """A verify step kept `accepted` of `drafted` drafts; adapt the draft length."""
        self.proposed += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.k = min(most, self.k + 2)
        else:
            self.k = max(1, self.k - 1)


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
