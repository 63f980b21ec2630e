"""Sampling draws from the right distribution, on the batched path and the per-row one alike,
and a seed still fixes the tokens. Statistical checks run on a fixed torch seed: the same
draws on every machine."""

from __future__ import annotations

import pytest
import torch

from kvguard.engine.sampler import NUCLEUS_FIRST, nucleus, sample
from kvguard.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
ROWS = 20000


def frequencies(tokens: list[int], n: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=n).double() / len(tokens)


def test_unseeded_rows_are_drawn_from_their_tempered_softmax() -> None:
    torch.manual_seed(0)
    for temperature in (1.0, 0.5, 2.0):
        p = SamplingParams(temperature=temperature)
        tokens = sample(LOGITS.repeat(ROWS, 1), [p] * ROWS, [None] * ROWS)
        want = torch.softmax(LOGITS.double() / temperature, dim=0)
        # 4 standard errors of a frequency over ROWS draws
        assert torch.allclose(frequencies(tokens, 5), want, atol=4 * (0.25 / ROWS) ** 0.5)
        assert 4 not in tokens  # probability 1e-14 at most


def test_seeded_and_filtered_rows_are_drawn_from_their_distribution() -> None:
    """The per-row path (a seed, top-k or top-p): each draw from the row's own generator,
    with the frequencies of the tempered softmax that the filter leaves, renormalised."""
    torch.manual_seed(0)
    soft = torch.softmax(LOGITS.double(), dim=0)
    cases = [
        (SamplingParams(temperature=1.0, seed=1), soft),
        (SamplingParams(temperature=1.0, top_k=2), torch.cat([soft[:2] / soft[:2].sum(),
                                                               torch.zeros(3)])),
        (SamplingParams(temperature=1.0, top_p=0.8), torch.cat([soft[:2] / soft[:2].sum(),
                                                                torch.zeros(3)])),
    ]  # fmt: skip
    for p, want in cases:
        gens = [
            torch.Generator().manual_seed(i) if p.seed is not None else None for i in range(ROWS)
        ]
        tokens = sample(LOGITS.repeat(ROWS, 1), [p] * ROWS, gens)
        assert torch.allclose(frequencies(tokens, 5), want, atol=4 * (0.25 / ROWS) ** 0.5), p


def full_sort_nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The top-p set by its definition: sort everything, keep while the mass before < top_p."""
    sorted_p, idx = probs.sort(descending=True)
    before = sorted_p.cumsum(0) - sorted_p
    return set(idx[: max(1, int((before < top_p).sum()))].tolist())


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.1])  # peaked to flat
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99, 1e-30])
def test_the_nucleus_is_the_full_sorts_set(scale: float, top_p: float) -> None:
    """The top-p set from the 256 most likely tokens (most likely first), or from a sort of
    all where it does not close inside them, is the set the definition gives."""
    probs = torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(3)) * scale, 0)
    kept, ids = nucleus(probs, top_p)
    assert set(ids.tolist()) == full_sort_nucleus(probs, top_p)
    assert torch.equal(kept, probs[ids]) and len(set(ids.tolist())) == len(ids)
    if len(ids) < 256:
        assert bool((kept[:-1] >= kept[1:]).all())
    # both ways are taken: 1 to 219 tokens close inside the first 256, 1243 to 4935 do not


def test_rows_mix_greedy_tempered_seeded_and_filtered() -> None:
    """Each row gets its own rule in one call: greedy, tempered, seeded, top-k."""
    torch.manual_seed(0)
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS, LOGITS])
    params = [
        SamplingParams(),  # greedy
        SamplingParams(temperature=0.05),  # nearly greedy: the flipped row's max (1 - 2e-9)
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=5.0, top_k=1),  # top-k 1 is greedy
    ]
    gens = [None, None, torch.Generator().manual_seed(7), None]
    out = sample(logits, params, gens)
    assert out[0] == 0 and out[1] == 4 and out[3] == 0
    again = sample(logits[2:3], [params[2]], [torch.Generator().manual_seed(7)])
    assert again == [out[2]]  # a seed fixes its draw whatever else is in the batch


def test_a_seeded_row_does_not_move_the_others() -> None:
    """Unseeded rows draw from the global generator only; a seeded row from its own."""
    p, seeded = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=3)
    torch.manual_seed(1)
    alone = sample(LOGITS.repeat(8, 1), [p] * 8, [None] * 8)
    torch.manual_seed(1)
    mixed = sample(
        LOGITS.repeat(9, 1), [p] * 8 + [seeded], [None] * 8 + [torch.Generator().manual_seed(3)]
    )
    assert mixed[:8] == alone


def test_nan_logits_are_refused_not_drawn() -> None:
    """A model that produced NaN must fail its step (its requests end with an error), not
    answer with an arbitrary token."""
    logits = torch.tensor([[0.0, float("nan"), 1.0]])
    with pytest.raises(RuntimeError):
        sample(logits, [SamplingParams(temperature=1.0)], [None])
    with pytest.raises(RuntimeError, match="NaN"):  # the per-row path too
        sample(logits, [SamplingParams(temperature=1.0, seed=1)], [torch.Generator()])


# -- the C draw (cpu_ops.topp_draw): the sampler's path for rows without a top-k on CPU -----


def reference_draw(x: torch.Tensor, temp: float, top_p: float, u: float) -> int:
    """The draw by its definition in float64: the nucleus from a full sort (most likely first,
    equal values in id order) keeping each token whose mass before it is below top_p of the
    whole, then the first token in id order whose running mass exceeds u times the
    nucleus's."""
    p = torch.exp((x.double() - x.max()) / temp)
    order = sorted(range(len(p)), key=lambda i: (-p[i].item(), i))
    before, keep, target = 0.0, 0, top_p * p.sum().item()
    for i in order:
        if keep and before >= target:
            break
        before += p[i].item()
        keep += 1
    kept = sorted(order[:keep])
    mass = sum(p[i].item() for i in kept)
    acc = 0.0
    for i in kept:
        acc += p[i].item()
        if acc > u * mass:
            return i
    return kept[-1]


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.1])  # peaked to flat
def test_the_c_draw_is_the_definitions(scale: float) -> None:
    from kvguard.kernels import cpu_ops

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3000, generator=gen) * scale
    x[1, ::7] = float("-inf")  # tokens a grammar or a bias forbids: never drawn
    cases = [(t, p) for t in (1.0, 0.6) for p in (0.5, 0.9, 0.99, 1e-30, 1.0)]
    for u in (0.0, 0.13, 0.5, 0.87, 0.999):
        for temp, top_p in cases:
            got = cpu_ops.topp_draw(x, [temp] * 6, [top_p] * 6, [u] * 6)
            want = [reference_draw(row, temp, top_p, u) for row in x]
            assert got == want, (temp, top_p, u)
            assert all(x[1, t] > float("-inf") for t in got[1:2])


def test_the_c_draw_takes_ties_at_the_nucleus_edge_in_id_order() -> None:
    from kvguard.kernels import cpu_ops

    inf = float("-inf")
    x = torch.tensor([[inf, 0.0, 0.0, inf, 0.0, 0.0, -1e3, inf, 0.0, 0.0, inf]])
    # six tokens of probability 1 (the rest ~0): half the mass is their first three in id order
    draws = [cpu_ops.topp_draw(x, [1.0], [0.5], [u])[0] for u in (0.0, 0.34, 0.67, 0.99)]
    assert draws == [1, 2, 4, 4]
    assert cpu_ops.topp_draw(x, [1.0], [1.0], [0.99]) == [9]  # all six
    for tiny in (0.0, 1e-320, 1e-45):  # no mass to reach (denormals read as 0): the first max
        assert cpu_ops.topp_draw(x, [1.0], [tiny], [0.99]) == [1]
    bad = torch.tensor([[0.0, float("nan"), 1.0], [inf, inf, inf]])
    for row in bad:  # NaN, or nothing to draw: refused
        assert cpu_ops.topp_draw(row[None], [1.0], [0.9], [0.5]) is None


def test_the_c_draw_gives_the_torch_paths_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded rows with and without a top-p take one uniform each from their generator on
    either path and draw over their nucleus in id order: the same seed, the same token."""
    from kvguard.kernels import cpu_ops

    x = torch.randn(48, 5000, generator=torch.Generator().manual_seed(9)) * 3.0
    assert cpu_ops.rows_served(x)  # the first draws are the C kernel's
    params = [
        SamplingParams(temperature=0.8, top_p=(0.95, 0.5, 1.0)[i % 3], seed=i) for i in range(48)
    ]

    def draws() -> list[int]:
        return sample(x, params, [torch.Generator().manual_seed(i) for i in range(48)])

    fast = draws()
    monkeypatch.setenv(cpu_ops.ENV, "0")
    cpu_ops.reset()
    try:
        assert draws() == fast
    finally:
        monkeypatch.undo()
        cpu_ops.reset()


def test_ties_at_the_nucleus_edge_keep_the_lowest_ids_on_every_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """200 tied tokens (ids 100-299 of 320) and a top-p that keeps some of them: the nucleus
    holds the tie's lowest ids, as the C draw does, also where it closes inside the 256 most
    likely (`topk` orders ties as it likes), so top_k 0 (the C draw) and top_k 320 (torch's
    path, a filter that removes nothing) give a seed the same token."""
    from kvguard.kernels import cpu_ops

    vocab = 320
    x = torch.full((1, vocab), -5.0)
    x[0, 100:300] = 1.0
    probs = torch.softmax(x[0], 0)
    _, ids = nucleus(probs, 0.3)
    lowest = list(range(100, 100 + len(ids)))
    assert 1 < len(ids) < 200 and sorted(ids.tolist()) == lowest
    first = torch.topk(probs, NUCLEUS_FIRST)  # selected by the caller, several rows at once
    assert sorted(nucleus(probs, 0.3, first)[1].tolist()) == lowest
    assert nucleus(probs, 1e-30)[1].tolist() == [100]  # one of the tie: the greedy token

    def draws(top_k: int) -> list[int]:
        params = [
            SamplingParams(temperature=1.0, top_p=0.3, top_k=top_k, seed=s) for s in range(64)
        ]
        return [sample(x, [p], [torch.Generator().manual_seed(p.seed)])[0] for p in params]

    c_draw = draws(0)
    assert set(c_draw) <= set(lowest) and len(set(c_draw)) > 1
    assert draws(vocab) == c_draw
    monkeypatch.setenv(cpu_ops.ENV, "0")
    cpu_ops.reset()
    try:  # torch's path both ways
        assert draws(0) == c_draw and draws(vocab) == c_draw
    finally:
        monkeypatch.undo()
        cpu_ops.reset()
