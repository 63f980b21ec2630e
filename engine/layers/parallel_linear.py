"""Linear layers (plain and row-parallel) and the vocabulary-parallel embedding and lm_head.

Their matmuls go through `dispatch.dense_linear`: `F.linear`, or on CUDA a Triton skinny GEMM
for decode-sized batches where it is switched on (`KVGUARD_TRITON_GEMV=1`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvguard.engine.distributed.parallel_state import TPGroup
from kvguard.kernels.dispatch import dense_linear


class Linear(nn.Linear):
    """`nn.Linear` whose matmul is `dispatch.dense_linear`'s (a column-parallel projection on
    a rank is one of these over the rows it holds)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """Each rank holds a slice of the input features; the partial outputs are summed by one
    all-reduce, and a bias (if any) is added once, after the sum."""

    def __init__(
        self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return dense_linear(x, self.weight, self.bias)
        out = self.tp.all_reduce_(dense_linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows `[start, start + rows)` of the embedding table; token ids outside that range give zero
    rows here and their real row on the rank that holds it, so one all-reduce completes them."""

    def __init__(self, rows: int, dim: int, start: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce_(rows.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(nn.Module):
    """The lm_head over this rank's vocabulary rows; rank 0 gathers the full fp32 logits.

    Its weight may be the embedding's own parameter (tied embeddings): both hold the same
    vocabulary rows on every rank, so tying survives sharding."""

    def __init__(self, rows: int, dim: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`[n, vocab_size]` fp32 logits on rank 0, None on the others."""
        logits = dense_linear(hidden, self.weight).float()
        if self.tp.size == 1:
            return logits
        full = self.tp.gather_to_first(logits)
        if full is None or full.shape[-1] == self.vocab_size:
            return full
        return full[..., : self.vocab_size].contiguous()


def mask_padding(logits: torch.Tensor, tokens: int) -> torch.Tensor:
    """`logits` with its columns from `tokens` on at -inf, in place: a padded vocabulary's
    rows (Qwen2's 151936 for 151665 tokens) name no token, so nothing may draw them, and at
    -inf they are what a grammar's mask makes a banned token: never sampled, exp(-inf) = 0
    in a log-softmax's normaliser. The head still computes every row, as the output width of
    the whole matrix is the GEMM's fast one (151665 columns cost MKL's fp32 GEMM 5-10% at 32
    rows); the fill is one strided write of the padding columns."""
    if tokens < logits.shape[-1]:
        logits[..., tokens:] = float("-inf")
    return logits
