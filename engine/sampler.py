"""Next-token choice: greedy rows in one argmax, sampled rows with their own generators."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.sequence import Sequence, TokenLogprob
from kvguard.kernels import cpu_ops

# Why a row gets no token (the step's requests then end with an error): a sampled row's
# probabilities, or a greedy row's logits, that a model poisoned with NaN (or, sampled, inf or
# a grammar that allows nothing) left nothing to choose from.
NOT_DRAWN = "cannot draw a token: its probabilities are NaN, inf or all zero"


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    outputs: list[Seen | None] | None = None,
    allowed: list[torch.Tensor | None] | None = None,
) -> list[int]:
    """One token per row of `logits` `[N, vocab]` (fp32), after each row's penalties (against
    its sequence's `outputs` so far: see `adjust_logits`) and logit bias, and among the tokens
    its grammar allows where it has one (`allowed`: a bool per vocabulary entry).

    Rows sampled with only a temperature and no seed (what an OpenAI client asks by default)
    are drawn together by inverse CDF: one uniform per row against the row's cumulative
    probabilities. A `multinomial` per row cost about 2 ms over a 49k vocabulary (60 ms for
    32 rows, 17% of a 32-sequence decode step in the daemon); the batch costs 4.5-5 ms. (Not an
    exponential race: it needs a random number per vocabulary entry, and CPU generation of
    those took 38 ms.) Seeded rows keep their own generator and draw, so a seed gives the
    same tokens as before."""
    logits = adjust_logits(logits, params, outputs, allowed)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if len(greedy) == len(params):
        out = _greedy_picks(logits)
    elif greedy:  # only the greedy rows: an argmax of a sampled row is thrown away
        picks = _greedy_picks(logits[torch.tensor(greedy, device=logits.device)])
        for i, token in zip(greedy, picks, strict=True):
            out[i] = token
    plain = [i for i, p in enumerate(params) if _plain(p, generators[i])]
    drawn = _inverse_cdf(logits, plain, [params[i].temperature for i in plain]) if plain else []
    if drawn is None:  # NaN probabilities: the per-row draw below refuses them loudly
        plain, drawn = [], []
    for i, token in zip(plain, drawn, strict=True):
        out[i] = token
    batched = set(plain)
    rest = [i for i, p in enumerate(params) if not p.greedy and i not in batched]
    for i, token in zip(rest, _sample_rows(logits, rest, params, generators), strict=True):
        out[i] = token
    return out


def adjust_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[Seen | None] | None,
    allowed: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """`logits` with, on each row that asks, its logit bias added and, for every token of
    its output so far, `frequency_penalty` times the token's count plus `presence_penalty`
    subtracted (OpenAI's definitions; the prompt's tokens do not count), and -inf for every
    token its grammar does not allow (`allowed[i]`). The rows that ask nothing are untouched,
    and so is `logits` itself: a copy is changed where one must be.

    A row's output (`outputs[i]`) is its sequence's running `OutputCounts` (the engine's,
    kept on the sequence: a step counts only the tokens appended since the last), one with
    drafts ahead of it (`OutputCounts.ahead`), or a plain list of token ids, counted here."""
    masks = allowed or [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.adjusts_logits or masks[i] is not None]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, row = params[i], logits[i]
        if masks[i] is not None:
            row.masked_fill_(~masks[i].to(row.device), float("-inf"))
        if p.logit_bias:
            bias_ids, bias = _bias_tensors(p, row)
            if bias_ids is not None and bias is not None:
                row.index_add_(0, bias_ids, bias)
            elif bias is not None:
                row.add_(bias)
        seen = outputs[i] if outputs is not None else None
        if seen is not None and (p.presence_penalty or p.frequency_penalty):
            counted = OutputCounts(seen) if isinstance(seen, list) else seen
            ids, minus = counted.penalties(row, p)
            if ids is not None:
                row.index_add_(0, ids, minus)
    return logits


class OutputCounts:
    """How often each token occurs in one sequence's output, kept as the output grows, for
    the presence and frequency penalties. Each call counts only the tokens appended since the
    last (one a step; several after accepted drafts) and writes the penalty of each token
    whose count changed, so that no tensor is built from the whole output any more: rebuilding
    the counts from it (a tensor of the output and its `unique`) at every step made a 32-row
    step's adjust_logits take 21 ms at 2000 output tokens (3 ms at 10), against 2 ms with
    these (1.3 ms at 10; 2 CPU cores, 49k vocabulary). What is left that grows is the
    `index_add_` of one entry per distinct token, a few ns each.

    The engine keeps one on each penalised sequence (`output_counts`), reading its
    `output_token_ids` in place: that list only grows (a preempted sequence is recomputed or
    swapped back with its output as it is), and each of a request's choices is a sequence of
    its own. Other penalties, another device or dtype start the tensors over from the counts
    (and a list that shrank, the counts too). The penalties are the ones `unique` gave: the
    same arithmetic on the same counts (`_penalty`), one entry a token, so that the logits
    come out bit for bit as they did."""

    __slots__ = ("tokens", "folded", "place", "entries", "counts", "key", "ids", "minus", "table")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens  # the output itself, read (never changed) here
        self.folded = 0  # how many of `tokens` are counted
        self.place: dict[int, int] = {}  # token -> its entry, in the order first output
        self.entries: list[int] = []  # each entry's token
        self.counts: list[int] = []  # and how often it occurs
        # the tensors below, on the device and in the dtype of the rows they serve, and the
        # penalties they hold: (device, dtype, frequency_penalty, presence_penalty)
        self.key: tuple[Any, ...] | None = None
        self.ids = torch.empty(0, dtype=torch.long)  # each entry's token (room for more)
        self.minus = torch.empty(0)  # minus its penalty
        self.table = torch.empty(0)  # minus the penalty of a token output 0, 1, 2, ... times

    def ahead(self, drafts: list[int]) -> Ahead:
        """These counts with `drafts` appended, for the row sampled after them (speculative
        decoding); nothing of the drafts is kept."""
        return Ahead(self, drafts)

    def penalties(
        self, row: torch.Tensor, p: SamplingParams
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the output's distinct tokens, minus each one's penalty), on `row`'s device and in
        its dtype, for `row.index_add_`; (None, None) while the output is empty."""
        changed = self._fold()
        n = len(self.counts)
        if not n:
            return None, None
        key = (row.device, row.dtype, p.frequency_penalty, p.presence_penalty)
        if key != self.key:  # on new terms: every entry worked out afresh
            self.key, changed = key, list(range(n))
            self.ids = torch.empty(0, dtype=torch.long, device=row.device)
            self.minus = self.table = torch.empty(0, dtype=row.dtype, device=row.device)
        if self.ids.shape[0] < n:  # room for twice as many, the entries written kept
            ids = torch.zeros(2 * n, dtype=torch.long, device=row.device)
            minus = torch.zeros(2 * n, dtype=row.dtype, device=row.device)
            had = self.ids.shape[0]
            ids[:had], minus[:had] = self.ids, self.minus
            self.ids, self.minus = ids, minus
        if changed:
            tokens = [self.entries[at] for at in changed]
            self.write(
                self.ids, self.minus, changed, tokens, [self.counts[at] for at in changed], p
            )
        return self.ids[:n], self.minus[:n]

    def write(
        self,
        ids: torch.Tensor,
        minus: torch.Tensor,
        at: list[int],
        tokens: list[int],
        counts: list[int],
        p: SamplingParams,
    ) -> None:
        """Entries `at` of `ids` and `minus`: `tokens`, and minus the penalty of a token
        output `counts` times (looked up: `table`). On the CPU through numpy views of the
        tensors, element by element: a few tensor operations cost more than the rest of a
        row's penalties."""
        if self.table.shape[0] <= max(counts):  # every count up to twice the largest, at once
            size = 2 * max(counts) + 16
            self.table = -_penalty(torch.arange(size, device=minus.device), minus.dtype, p)
        table = self.table
        if minus.device.type == "cpu" and minus.dtype in _NUMPY_DTYPES:
            ids_np, minus_np, table_np = ids.numpy(), minus.numpy(), table.numpy()
            for a, token, count in zip(at, tokens, counts, strict=True):
                ids_np[a], minus_np[a] = token, table_np[count]
            return
        cols = torch.tensor([at, tokens, counts], dtype=torch.long, device=ids.device)
        ids[cols[0]] = cols[1]
        minus[cols[0]] = table[cols[2]]

    def _fold(self) -> list[int]:
        """Count the tokens appended since the last call; the entries whose count changed."""
        tokens = self.tokens
        if len(tokens) < self.folded:  # not a growing output after all: counted afresh
            self.folded, self.place, self.entries, self.counts, self.key = 0, {}, [], [], None
        changed: dict[int, None] = {}  # each entry once, in order
        place, entries, counts = self.place, self.entries, self.counts
        for k in range(self.folded, len(tokens)):
            token = tokens[k]
            at = place.get(token)
            if at is None:
                at = place[token] = len(entries)
                entries.append(token)
                counts.append(0)
            counts[at] += 1
            changed[at] = None
        self.folded = len(tokens)
        return list(changed)


class Ahead:
    """A sequence's `OutputCounts` with drafts appended, for the row sampled after them."""

    __slots__ = ("counts", "drafts")

    def __init__(self, counts: OutputCounts, drafts: list[int]) -> None:
        self.counts, self.drafts = counts, drafts

    def penalties(
        self, row: torch.Tensor, p: SamplingParams
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """As `OutputCounts.penalties`, counting the drafts too: the output's entries with
        the drafts' tokens added (those already output with their counts raised, the others
        after them), in new tensors."""
        base = self.counts
        ids, minus = base.penalties(row, p)
        if not self.drafts:
            return ids, minus
        extra: dict[int, int] = {}
        for token in self.drafts:
            extra[token] = extra.get(token, 0) + 1
        old = [t for t in extra if t in base.place]
        new = [t for t in extra if t not in base.place]
        n = len(base.counts)
        grown = torch.zeros(n + len(new), dtype=torch.long, device=row.device)
        minus_ahead = torch.zeros(n + len(new), dtype=row.dtype, device=row.device)
        if ids is not None and minus is not None:
            grown[:n], minus_ahead[:n] = ids, minus
        base.write(
            grown,
            minus_ahead,
            [base.place[t] for t in old] + list(range(n, n + len(new))),
            old + new,
            [base.counts[base.place[t]] + extra[t] for t in old] + [extra[t] for t in new],
            p,
        )
        return grown, minus_ahead


Seen = list[int] | OutputCounts | Ahead
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


def output_counts(seq: Sequence) -> OutputCounts | None:
    """`seq`'s running output counts where its params ask for a presence or frequency penalty
    (made on its first draw and kept on it), else None."""
    p = seq.params
    if not (p.presence_penalty or p.frequency_penalty):
        return None
    if seq.output_counts is None or seq.output_counts.tokens is not seq.output_token_ids:
        seq.output_counts = OutputCounts(seq.output_token_ids)
    return seq.output_counts


def _penalty(counts: torch.Tensor, dtype: torch.dtype, p: SamplingParams) -> torch.Tensor:
    """`frequency_penalty` times each count plus `presence_penalty`, in `dtype`: the tensor
    arithmetic the penalties have always been worked out with, element for element."""
    return counts.to(dtype) * p.frequency_penalty + p.presence_penalty


# A logit bias naming more than this share of the vocabulary is added as a whole row (a
# vocabulary-long vector of the biases, zero elsewhere): 13 us a row over a 49k vocabulary,
# against 170 us for an index_add_ of 49k entries.
DENSE_BIAS_SHARE = 8


def _bias_tensors(
    p: SamplingParams, row: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`p.logit_bias` as tensors on `row`'s device and dtype: the token ids and their biases
    (zero biases left out) for an `index_add_`, or (None, a vocabulary-long row of biases)
    where it names more than 1/DENSE_BIAS_SHARE of the vocabulary; (None, None) where every
    bias is zero. Built once per params, device, dtype and vocabulary size and kept in
    `p.bias_cache`: a request's choices share their params, and building them from the dict
    took 12 ms a row for a whole-vocabulary bias, every step (392 ms a step for 32 choices).
    A validated `logit_bias` cannot change (a read-only CheckedBias); a new `logit_bias` dict
    drops what was built, as does `validate` checking it."""
    key = (row.device, row.dtype, row.shape[0])
    cache = p.bias_cache
    if cache is None or cache.get("source") is not p.logit_bias:  # params changed: start over
        cache = p.bias_cache = {"source": p.logit_bias}
    built = cache.get(key)
    if built is None:
        kept = {t: b for t, b in p.logit_bias.items() if b}
        built = (None, None)
        if kept:
            ids = torch.tensor(list(kept), dtype=torch.long, device=row.device)
            bias = torch.tensor(list(kept.values()), dtype=row.dtype, device=row.device)
            dense = len(kept) * DENSE_BIAS_SHARE > row.shape[0]
            built = (None, torch.zeros_like(row).index_add_(0, ids, bias)) if dense else (ids, bias)
        cache[key] = built
    return built


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's first largest value: on the CPU by the C kernel (0.18 against 1.3 ms for 32
    rows of a 49k vocabulary, 2 cores), the same indices as torch's."""
    if cpu_ops.rows_served(logits):
        return cpu_ops.argmax_rows(logits)
    return logits.argmax(dim=-1).tolist()


def _greedy_picks(logits: torch.Tensor) -> list[int]:
    """`greedy_ids` on the host, refusing as a draw is refused (`NOT_DRAWN`) where a row's
    logits hold a NaN."""
    picks = greedy_ids(logits).tolist()
    if -1 in picks:
        raise RuntimeError(NOT_DRAWN)
    return picks


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """`_argmax` as a tensor on `logits`' device (no host sync where the logits are on a
    GPU), -1 for a row whose logits hold a NaN: both argmaxes (the C kernel's, torch's)
    answer such a row with its first NaN's index (an all-NaN row with token 0), so only the
    chosen logits are looked at, not the rows."""
    if cpu_ops.rows_served(logits):
        ids = torch.tensor(_argmax(logits), dtype=torch.long)
    else:
        ids = logits.argmax(dim=-1)
    nan = logits.gather(-1, ids.to(logits.device).unsqueeze(-1)).squeeze(-1).isnan()
    return torch.where(nan.to(ids.device), -1, ids)


def run_draws(
    logits: torch.Tensor, drawn: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """A run of decode steps' tokens for one step (`ModelRunner.decode_ahead`), left on the
    device: each row's argmax (-1 where its logits hold a NaN), but for the rows in `drawn`
    (their indices and temperatures, on the logits' device) the draw `sample` makes for rows
    with only a temperature and no seed (`_cdf_draws`), or -1 where the row's probabilities
    are not finite (what `sample` refuses; the host finds it when it reads the step, which the
    next step does not wait for)."""
    ids = greedy_ids(logits)
    if drawn is None:
        return ids
    picks, finite = _cdf_draws(logits, *drawn)
    picks = torch.where(finite, picks, -1)
    return ids.to(picks.device).index_copy_(0, drawn[0], picks)


def _cdf_draws(
    logits: torch.Tensor, index: torch.Tensor, temps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw for each row `index` of `logits` at its temperature (`temps`, one a row, on
    the logits' device): a uniform a row from the global generator, in row order, against the
    row's cumulative probabilities; and whether each row's probabilities are finite."""
    cdf = torch.softmax(logits[index] / temps.unsqueeze(1), dim=-1).cumsum_(dim=-1)
    u = torch.rand(index.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    # side right: a token of probability 0 has the cdf of the one before it: never drawn
    picks = torch.searchsorted(cdf, u, right=True).clamp_max_(logits.shape[-1] - 1)[:, 0]
    return picks, torch.isfinite(cdf[:, -1])


def _inverse_cdf(logits: torch.Tensor, rows: list[int], temps: list[float]) -> list[int] | None:
    """One draw per row of `logits[rows]` at its temperature; None if a row's probabilities
    are not finite."""
    t = torch.tensor(temps, dtype=logits.dtype, device=logits.device)
    picks, finite = _cdf_draws(logits, torch.tensor(rows, device=logits.device), t)
    return picks.tolist() if bool(finite.all()) else None


def _plain(p: SamplingParams, gen: torch.Generator | None) -> bool:
    return p.temperature_only and gen is None


def _sample_rows(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """The rows with a seed, top-k or top-p. On the CPU kernels' path, the rows without a
    top-k in one C call (`cpu_ops.topp_draw`: temperature, softmax, the nucleus from per-bin
    masses and the draw, rows over the threads; a flat distribution's nucleus took a sort of
    the whole vocabulary, 0.32 ms a row, over half of bench/choices.py's sampling). The others
    (`_sample_slow`): temperature, top-k, softmax and the top-p selection of the 256 likeliest
    over all of them at once, then each row's nucleus and draw. Each row takes one uniform
    from its own generator where it has one (the global one where not)."""
    if not rows:
        return []
    want, drawn = list(rows), {}
    if cpu_ops.rows_served(logits):
        fast = [i for i in rows if params[i].top_k <= 0]
        if fast:
            x = logits[torch.tensor(fast)]
            u = [float(_uniform(generators[i])) for i in fast]
            temps = [params[i].temperature for i in fast]
            tokens = cpu_ops.topp_draw(x, temps, [params[i].top_p for i in fast], u)
            if tokens is None:
                raise RuntimeError(NOT_DRAWN)
            drawn = dict(zip(fast, tokens, strict=True))
            rows = [i for i in rows if i not in drawn]
    if rows:
        drawn |= dict(zip(rows, _sample_slow(logits, rows, params, generators), strict=True))
    return [drawn[i] for i in want]


def _sample_slow(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """`_sample_rows` by torch ops: rows with a top-k, or off the CPU kernels' path."""
    index = torch.tensor(rows, device=logits.device)
    temps = [params[i].temperature for i in rows]
    x = logits[index] / torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]
    vocab = x.shape[-1]
    ks = [min(params[i].top_k, vocab) for i in rows]
    if any(ks):
        kth = torch.topk(x, max(ks), dim=-1).values
        for j, k in enumerate(ks):
            if k:
                x[j].masked_fill_(x[j] < kth[j, k - 1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    filtered = [j for j, i in enumerate(rows) if params[i].top_p < 1.0]
    first = {}
    if filtered and vocab > NUCLEUS_FIRST:  # the likeliest of every top-p row, most first
        top, ids = torch.topk(probs[torch.tensor(filtered, device=probs.device)], NUCLEUS_FIRST)
        first = {j: (top[n], ids[n]) for n, j in enumerate(filtered)}
    out = []
    for j, i in enumerate(rows):
        p, gen = params[i], generators[i]
        if p.top_p < 1.0:
            kept, ids = nucleus(probs[j], p.top_p, first.get(j))
            ids, order = ids.sort()  # drawn over in id order, as the C draw does
            out.append(int(ids[_draw(kept[order], gen)]))
        else:
            out.append(_draw(probs[j], gen))
    return out


DRAW_DTYPE = torch.float32  # a seeded draw's uniform: one a token (`rewind` replays them)


def _uniform(gen: torch.Generator | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """The one uniform a draw takes, from `gen` (the global generator if None)."""
    return torch.rand(1, generator=gen, dtype=DRAW_DTYPE, device=device)


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One index of `probs` (not necessarily normalised) by inverse CDF: one uniform from
    `gen` (the global generator if None) against the cumulative sum. `torch.multinomial`
    took 1.1 ms a row over a 49k vocabulary (18 of a 16-row step's 45 ms when every request
    had a seed); this takes about a tenth. NaN or no mass at all is refused, not drawn."""
    cdf = probs.cumsum(0)
    total = cdf[-1:]
    if not (bool(torch.isfinite(total)) and float(total) > 0.0):
        raise RuntimeError(NOT_DRAWN)
    u = _uniform(gen, cdf.device).to(cdf.dtype) * total
    # side right: a token of probability 0 has the cdf of the one before it: never drawn
    return int(torch.searchsorted(cdf, u, right=True).clamp_max_(probs.numel() - 1).item())


def rewind(gen: torch.Generator, state: torch.Tensor, draws: int) -> None:
    """Put `gen` where `draws` draws (`_draw`'s, one uniform each) from `state` leave it."""
    gen.set_state(state)
    spend_draws(gen, draws)


def spend_draws(gen: torch.Generator, draws: int) -> None:
    """Move `gen` on by `draws` draws (one uniform each), as if it had drawn that many tokens:
    for tokens a sequence gets without a draw (a grammar's forced tokens), so that a seed
    keeps to one draw a token however its tokens came."""
    for _ in range(draws):
        _uniform(gen, gen.device)


NUCLEUS_FIRST = 256  # most likely tokens looked at first for a top-p nucleus


def nucleus(
    probs: torch.Tensor,
    top_p: float,
    first: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely tokens whose mass reaches `top_p` (always >= 1: a
    top_p too small for fp32, e.g. 1e-320, rounds to 0 and must still keep the first): their
    probabilities and their ids. From the NUCLEUS_FIRST most likely tokens, and from a sort
    of them all only when the set does not close inside those: a sort of the whole 49k
    vocabulary took 3.8 ms a row (a 16-row step's sampling 61 ms, more than
    its forward), the first 256 a tenth of that. (A larger partial selection before the sort
    cost more than the sort.) On CPU the sort is of the values only (`_nucleus_by_threshold`,
    whose set comes in id order); a flat distribution (an uncertain model, a high
    temperature) needs it for most draws: 399 of 512 in bench/choices.py, whose nuclei held
    267 to 13k tokens. `first`: the NUCLEUS_FIRST likeliest (values, ids), most likely
    first, where the caller selected them already (for several rows at once).

    Tokens tied at the set's least probability, more than it keeps, are kept lowest ids
    first, as the C draw keeps them (`cpu_ops.topp_draw`): a seed gives the same token
    with a top-k that filters nothing as without one. `topk` orders ties as it likes, so
    its set is taken only where the token after it is less likely than its last."""
    if probs.numel() > NUCLEUS_FIRST:
        top, ids = first if first is not None else torch.topk(probs, NUCLEUS_FIRST)
        keep = _reaching(top, top_p)
        if keep < NUCLEUS_FIRST and bool(top[keep] < top[keep - 1]):  # closed, no tie across
            return top[:keep], ids[:keep]
    if probs.device.type == "cpu":
        return _nucleus_by_threshold(probs, top_p)
    top, ids = probs.sort(descending=True, stable=True)  # ties in id order
    keep = _reaching(top, top_p)
    return top[:keep], ids[:keep]


def _nucleus_by_threshold(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus from a sort of the values only (numpy's, vectorised): its size and its
    least probability, then every token above that and as many tied at it as the size
    leaves, in id order (the draw needs the set, not an order). 0.4 ms a row over 49k tokens,
    against 0.8 for an index sort and 2.9 for torch's."""
    p = probs.numpy()
    top = torch.from_numpy(np.sort(p)[::-1].copy())  # most likely first
    keep = _reaching(top, top_p)
    least = top[keep - 1].item()
    above = np.flatnonzero(p > least)
    tied = np.flatnonzero(p == least)[: keep - above.size]
    ids = torch.from_numpy(np.concatenate([above, tied]))
    return probs[ids], ids


def _reaching(top: torch.Tensor, top_p: float) -> int:
    """How many of `top` (most likely first) the nucleus keeps: those whose mass before them
    is below top_p (a prefix: that mass never decreases), at least one."""
    return max(1, int((top.cumsum(0) - top < top_p).sum()))


def token_logprobs(
    logits: torch.Tensor,
    params: list[SamplingParams],
    tokens: list[int],
    asked: torch.Tensor | None = None,
) -> list[TokenLogprob | None]:
    """Each row's sampled token's log-probability under the model (the log-softmax of the raw
    logits, before penalties, bias, temperature, top-k and top-p: what the model thinks of the
    token, not how it was drawn) with its `params.logprobs` most likely tokens'; None for rows
    that did not ask. One log-softmax over the rows that asked, not over the batch: their rows
    of `logits`, or `asked` (those rows, in order, computed apart: exactly, where the logits
    drawn from are exact only at each row's best)."""
    out: list[TokenLogprob | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    if asked is None:
        asked = logits[torch.tensor(rows, device=logits.device)]
    k = max(params[i].logprobs for i in rows)
    entries = log_softmax_entries(asked, [tokens[i] for i in rows], k)
    for i, e in zip(rows, entries, strict=True):
        out[i] = TokenLogprob(e.token_id, e.logprob, e.top[: params[i].logprobs])
    return out


def log_softmax_entries(rows: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """For each row of logits, `targets[i]`'s log-softmax and the `k` most likely tokens'."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1))[:, 0].tolist()
    ids: list[list[int]] = [[] for _ in targets]
    values: list[list[float]] = [[] for _ in targets]
    if k:
        top = lp.topk(min(k, lp.shape[-1]), dim=-1)
        ids, values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprob(t, c, tuple(zip(i, v, strict=True)))
        for t, c, i, v in zip(targets, chosen, ids, values, strict=True)
    ]
