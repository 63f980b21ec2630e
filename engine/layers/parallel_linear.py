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
    """The lm_head over this rank's vocabulary rows; rank 0 gathers the fp32 logits of the
    first `vocab_size` ids.

    Its weight may be the embedding's own parameter (tied embeddings): both hold the same
    vocabulary rows on every rank, so tying survives sharding. `vocab_size` may be less than
    the rows (a padded embedding: Qwen2's 151936 rows for 151665 tokens): the rows past it
    name no token, so one rank computes only the rows before it (a prefix of a contiguous
    weight is a contiguous view: no copy, fewer products) and the logits are as wide as the
    tokenizer, whatever reads them. The weight keeps every row for a tied embedding's prompt
    ids; split over ranks each rank computes its whole share (the gather wants equal parts)
    and rank 0 keeps the first `vocab_size` columns."""

    def __init__(self, rows: int, dim: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`[n, vocab_size]` fp32 logits on rank 0, None on the others."""
        if self.tp.size == 1:
            return dense_linear(hidden, self.weight[: self.vocab_size]).float()
        full = self.tp.gather_to_first(dense_linear(hidden, self.weight).float())
        if full is None or full.shape[-1] == self.vocab_size:
            return full
        return full[..., : self.vocab_size].contiguous()
