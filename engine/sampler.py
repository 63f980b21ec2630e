"""Next-token choice: greedy rows in one argmax, sampled rows with their own generators."""

from __future__ import annotations

import torch

from kvguard.engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of `logits` `[N, vocab]` (fp32)."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        probs = _top_p(probs, p.top_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p` (always >= 1:
    a top_p too small for fp32, e.g. 1e-320, rounds to 0 and must still keep the first)."""
    sorted_p, idx = probs.sort(descending=True)
    mass_before = sorted_p.cumsum(0) - sorted_p
    drop = mass_before >= top_p
    drop[0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(0, idx, sorted_p)
