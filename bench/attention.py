"""Paged decode attention versus dense SDPA on the same data.

Paging is only worth it if reading K/V through block tables costs little more than reading it
from one contiguous tensor. This times kvguard's `paged_attention` on a decode batch (one query
per sequence) whose blocks are scattered through the pool in random order, as an allocator leaves
them after churn, against `torch.nn.functional.scaled_dot_product_attention` on the same K/V laid
out contiguously per sequence. Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64),
fp32 on CPU. Outputs are checked to match before any time is reported. Goal: paged <= 1.5x dense.

    python bench/attention.py [--quick] [--json FILE] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# The same OpenMP wait policy as the other benchmarks (see throughput.py), set before torch loads
# libgomp: spinning workers are several times slower on a host shared with other work.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.trace import format_table, write_json  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
BLOCK_SIZE = 16
BATCH = 32
CONTEXTS = (512, 2048)
SPARE_BLOCKS = 0.25  # the pool holds this much more than the batch needs, like a real one
GOAL_RATIO = 1.5


@dataclass(frozen=True, slots=True)
class DecodeCase:
    """One decode step's data, held twice: paged (scattered blocks) and dense (contiguous)."""

    q: torch.Tensor  # [B, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, blocks_per_seq] int32
    k_dense: torch.Tensor  # [B, KVH, ctx, D]
    v_dense: torch.Tensor
    context: int


@dataclass(frozen=True, slots=True)
class Result:
    context: int
    batch: int
    paged_ms: float
    dense_ms: float
    ratio: float
    max_abs_diff: float


def make_case(batch: int, context: int, seed: int) -> DecodeCase:
    """Random K/V written into a shuffled pool, plus the identical contiguous copy."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = int(batch * per_seq * (1 + SPARE_BLOCKS))
    order = torch.randperm(num_blocks, generator=gen)[: batch * per_seq]
    tables = order.view(batch, per_seq).to(torch.int32)
    k_dense = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, generator=gen)
    v_dense = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, generator=gen)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    for cache, dense in ((k_cache, k_dense), (v_cache, v_dense)):
        padded = torch.zeros(batch, per_seq * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        padded[:, :context] = dense.transpose(1, 2)
        cache[tables.long()] = padded.view(batch, per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)
    return DecodeCase(q, k_cache, v_cache, tables, k_dense, v_dense, context)


def paged_fn(case: DecodeCase) -> Callable[[], torch.Tensor]:
    kernel = importlib.import_module("kvguard.kernels.paged_attention").paged_attention
    batch = case.q.shape[0]
    seq_lens, query_lens = [case.context] * batch, [1] * batch
    scale = 1.0 / math.sqrt(HEAD_DIM)
    return lambda: kernel(
        case.q, case.k_cache, case.v_cache, case.block_tables, seq_lens, query_lens, scale
    )


def dense_fn(case: DecodeCase) -> Callable[[], torch.Tensor]:
    """The contiguous baseline: one SDPA call over [B, H, 1, D] queries, GQA native."""
    q = case.q.unsqueeze(2)
    scale = 1.0 / math.sqrt(HEAD_DIM)

    def run() -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            q, case.k_dense, case.v_dense, scale=scale, enable_gqa=True
        )
        return o.squeeze(2)

    return run


def time_ms(fn: Callable[[], torch.Tensor], repeats: int, warmup: int = 3) -> float:
    """Median wall time per call: the median shrugs off the scheduler hiccups of a shared box."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def measure(batch: int, context: int, repeats: int, seed: int) -> Result:
    case = make_case(batch, context, seed)
    paged, dense = paged_fn(case), dense_fn(case)
    with torch.inference_mode():
        diff = (paged() - dense()).abs().max().item()
    if not diff < 1e-4:
        raise SystemExit(f"paged and dense outputs differ by {diff:.3g} at context {context}")
    # Interleave the two so drift in machine load hits both alike.
    p_ms, d_ms = [], []
    for _ in range(3):
        p_ms.append(time_ms(paged, repeats))
        d_ms.append(time_ms(dense, repeats))
    p, d = statistics.median(p_ms), statistics.median(d_ms)
    return Result(context, batch, p, d, p / d, diff)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the results as JSON")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else 30
    results = [measure(args.batch, ctx, repeats, args.seed) for ctx in CONTEXTS]
    print(
        f"decode attention, batch {args.batch}, {NUM_HEADS} heads / {NUM_KV_HEADS} KV heads, "
        f"head_dim {HEAD_DIM}, fp32, block_size {BLOCK_SIZE}, {args.threads} threads, "
        f"median of {repeats} calls x 3 rounds"
    )
    rows = [
        [
            r.context,
            f"{r.paged_ms:.3f}",
            f"{r.dense_ms:.3f}",
            f"{r.ratio:.2f}x",
            f"{r.max_abs_diff:.1e}",
        ]
        for r in results
    ]
    headers = ["context", "paged ms", "dense SDPA ms", "paged/dense", "max |diff|"]
    print(format_table(headers, rows))
    worst = max(r.ratio for r in results)
    verdict = "met" if worst <= GOAL_RATIO else "NOT met"
    print(f"goal paged/dense <= {GOAL_RATIO}x: {verdict} (worst {worst:.2f}x)")
    write_json(args.json, {"threads": args.threads, "results": [asdict(r) for r in results]})


if __name__ == "__main__":
    main()
