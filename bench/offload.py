"""CPU offload: what a swap costs, and swap-based preemption against recompute on one trace.

Measured in one run:

1. the copy itself: `KVCache.swap_out` / `swap_in` timed directly on the model's KV shapes
   (smollm2-135m: 30 layers x 3 KV heads x 64), for one block, a small group and one whole
   `--seq-tokens` sequence (4096 tokens), in full precision and fp8, median of repetitions.
   The comparison is what preemption does without a host pool: recompute the sequence, i.e.
   prefill its tokens again, timed on the real engine at the same length;
2. a fixed-seed trace (drawn by bench/trace.py, decode-heavy: short prompts, long outputs) on
   a device pool holding about half of what its requests need at once (`--overflow 2`).
   Decode-heavy because preemption only happens when admitted sequences grow past the pool;
   a prompt-heavy overflow just queues requests and never preempts anything. One engine serves it
   with offload on (preempted sequences are swapped to a host pool) and again with offload
   off (`set_offload(False)`: preempted sequences are recomputed); a second engine whose pool
   fits the whole trace serves it undisturbed as the reference. Reported: wall time, output
   tokens/s, preemptions by mode, and whether every greedy output is identical to the
   reference (preemption must never change what a request gets).

Both engines run with the prefix cache off: the recompute time and the trace are served more
than once on one engine, and a cached prompt would not be computed again.

    python bench/offload.py [--quick] [--json FILE] [--threads N] [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import (  # noqa: E402
    MiB,
    greedy,
    load_line,
    make_engine,
    ms,
    ratio,
    repeat_median,
    section,
    step_apply,
    token_prompts,
)
from bench.trace import (  # noqa: E402
    SUMMARY_HEADERS,
    LengthDist,
    TraceRequest,
    TraceSpec,
    common_args,
    format_table,
    make_trace,
    ordinary_token_ids,
    resolve_model_dir,
    trace_summary,
    write_json,
)

if TYPE_CHECKING:
    from kvguard.engine import LLMEngine
    from kvguard.engine.kv_cache import KVCache

BLOCK_SIZE = 16
# Short prompts, long outputs: sequences admitted small outgrow the pool while decoding.
FULL = TraceSpec(32, LengthDist(64, 0.6, 16, 256), LengthDist(128, 0.4, 64, 256))
QUICK = TraceSpec(6, LengthDist(20, 0.3, 16, 32), LengthDist(24, 0.2, 16, 32))


# ----------------------------------------------------------------------------- 1. swap copies


@dataclass(slots=True)
class CopyTiming:
    dtype: str
    blocks: int
    bytes: int
    swap_out_s: float
    swap_in_s: float

    @property
    def tokens(self) -> int:
        return self.blocks * BLOCK_SIZE

    @property
    def round_trip_s(self) -> float:
        return self.swap_out_s + self.swap_in_s


def kv_device() -> torch.device:
    """Where the engine would put its device pool: the accelerator if there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def filled_cache(model: str, dtype: str, blocks: int) -> KVCache:
    """A device pool and an equal host pool with every page written (no lazy first touch)."""
    from kvguard.engine.kv_cache import KVCache
    from kvguard.engine.model_config import ModelConfig

    cfg = ModelConfig.from_dir(resolve_model_dir(model))
    kv = KVCache(cfg, blocks, BLOCK_SIZE, dtype, kv_device(), blocks)
    for pool in (kv.device_pool, kv.host_pool):
        for layer in pool.layers:
            for t in layer:
                if t is not None:
                    t.view(torch.uint8).random_(0, 120)  # any finite bytes, fp8 included
    return kv


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_copies(kv: KVCache, n: int, reps: int, seed: int) -> CopyTiming:
    """Median swap-out and swap-in of `n` blocks at scattered ids, as a block table has them."""
    g = torch.Generator().manual_seed(seed)
    dev = torch.randperm(kv.num_blocks, generator=g)[:n].tolist()
    host = torch.randperm(kv.num_host_blocks, generator=g)[:n].tolist()

    def out() -> None:
        kv.swap_out(dev, host)
        _sync()

    def back() -> None:
        kv.swap_in(host, dev)
        _sync()

    out(), back()  # first touch of the index tensors and kernels
    t_out, _ = repeat_median(out, reps)
    t_in, _ = repeat_median(back, reps)
    return CopyTiming(kv.dtype, n, n * kv.bytes_per_block, t_out, t_in)


def measure_copies(
    model: str, full: str, seq_blocks: int, reps: int, seed: int
) -> list[CopyTiming]:
    rows = []
    for dtype in (full, "fp8_e4m3"):
        kv = filled_cache(model, dtype, seq_blocks)
        for n in sorted({1, min(16, seq_blocks), seq_blocks}):
            rows.append(time_copies(kv, n, reps, seed))
        del kv
    return rows


def copy_rows(rows: list[CopyTiming]) -> list[list[Any]]:
    return [
        [
            r.dtype,
            r.blocks,
            r.tokens,
            f"{r.bytes / MiB:.2f}",
            ms(r.swap_out_s),
            ms(r.swap_in_s),
            f"{r.round_trip_s / r.blocks * 1e3:.3f}",
            f"{2 * r.bytes / r.round_trip_s / 2**30:.2f}",
        ]
        for r in rows
    ]


COPY_HEADERS = [
    "KV dtype",
    "blocks",
    "tokens",
    "MiB",
    "swap-out ms",
    "swap-in ms",
    "round trip ms/block",
    "GiB/s",
]


def measure_recompute(engine: LLMEngine, tokens: int, reps: int, seed: int) -> float:
    """Median prefill of a `tokens`-long prompt: what a recompute preemption pays again."""
    ids = token_prompts(engine.config.model, 1, tokens, seed)[0]
    engine.generate([ids[:32]], greedy(1))  # warm-up
    t, _ = repeat_median(lambda: engine.generate([ids], greedy(1)), reps)
    return t


# ----------------------------------------------------------------------------- 2. trace


@dataclass(slots=True)
class TraceRun:
    name: str
    wall_s: float
    output_tokens: int
    preemptions: dict[str, int]
    outputs: list[list[int]] = field(repr=False)
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def serve_trace(engine: LLMEngine, name: str, trace: list[TraceRequest]) -> TraceRun:
    """One pass over the trace after a warm-up; preemptions counted for this pass only."""
    engine.generate([trace[0].prompt_ids[:16]], greedy(2))
    before = dict(engine.snapshot().preemptions)
    params = [greedy(r.output_len) for r in trace]
    t0 = time.perf_counter()
    outs = engine.generate([r.prompt_ids for r in trace], params)
    wall = time.perf_counter() - t0
    after = engine.snapshot().preemptions
    engine.audit_blocks()  # accounting must be exact after all that swapping
    return TraceRun(
        name,
        wall,
        sum(len(o.token_ids) for o in outs),
        {k: after[k] - before.get(k, 0) for k in after},
        [list(o.token_ids) for o in outs],
    )


def demand_blocks(trace: list[TraceRequest]) -> int:
    """Blocks the whole trace holds at its peak if every request is resident at once."""
    return sum(-(-r.total_len // BLOCK_SIZE) for r in trace)


def reference_engine(
    args: argparse.Namespace, trace: list[TraceRequest], seq_blocks: int
) -> LLMEngine:
    """A pool that fits the whole trace (and the recompute sequence): the undisturbed run.
    No prefix cache: the recompute reps prefill one prompt again and again."""
    return make_engine(
        args.model,
        args.threads,
        num_gpu_blocks=max(demand_blocks(trace), seq_blocks) + 8,
        max_num_seqs=len(trace),
        enable_prefix_caching=False,
    )


def squeezed_engine(args: argparse.Namespace, trace: list[TraceRequest], pool: int) -> LLMEngine:
    """The `pool`-block engine with a host pool that serves the trace with swap and with
    recompute in turn. No prefix cache: each pass serves the same prompts."""
    return make_engine(
        args.model,
        args.threads,
        num_gpu_blocks=pool,
        enable_cpu_offload=True,
        cpu_cache_ratio=0.5,
        max_num_seqs=len(trace),
        enable_prefix_caching=False,
    )


def squeezed_runs(
    args: argparse.Namespace, trace: list[TraceRequest], pool: int
) -> tuple[TraceRun, TraceRun]:
    """The same engine and pool, offload on then off (alternating for `--rounds`); best of each."""
    engine = squeezed_engine(args, trace, pool)
    best: dict[bool, TraceRun] = {}
    for r in range(args.rounds):
        for offload in (True, False):
            step_apply(engine, engine.set_offload(offload))
            run = serve_trace(engine, "swap" if offload else "recompute", trace)
            print(f"  round {r + 1}: {run.name}: {run.wall_s:.1f} s {run.preemptions}", flush=True)
            if offload not in best or run.wall_s < best[offload].wall_s:
                best[offload] = run
    host = engine.snapshot().host.blocks_total
    for run in best.values():
        run.note = f"{pool} device blocks, {host} host blocks"
    return best[True], best[False]


def identical(run: TraceRun, ref: TraceRun | None) -> str:
    if ref is None:
        return "-"
    same = sum(a == b for a, b in zip(run.outputs, ref.outputs, strict=True))
    return f"{same}/{len(ref.outputs)}"


def trace_rows(runs: list[TraceRun], ref: TraceRun | None, recompute: TraceRun) -> list[list[Any]]:
    return [
        [
            r.name,
            f"{r.wall_s:.1f}",
            f"{r.tokens_per_s:.1f}",
            r.preemptions.get("swap", 0),
            r.preemptions.get("recompute", 0),
            identical(r, ref),
            ratio(r.tokens_per_s, recompute.tokens_per_s),
            r.note,
        ]
        for r in runs
    ]


TRACE_HEADERS = [
    "preemption",
    "wall s",
    "output tok/s",
    "swaps",
    "recomputes",
    "same as ref",
    "tok/s vs recompute",
    "notes",
]


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--seq-tokens", type=int, default=0, help="sequence to swap (4096; quick 128)")
    p.add_argument("--reps", type=int, default=0, help="copy repetitions (7; quick 3)")
    p.add_argument("--overflow", type=float, default=2.0, help="trace demand / device pool")
    p.add_argument("--rounds", type=int, default=1, help="trace passes per mode; best counts")
    p.add_argument("--recompute-reps", type=int, default=1, help="timed prefills of the sequence")
    p.add_argument("--no-reference", action="store_true", help="skip the undisturbed reference run")
    args = p.parse_args()
    args.seq_tokens = args.seq_tokens or (128 if args.quick else 4096)
    args.reps = args.reps or (3 if args.quick else 7)
    return args


def trace_spec(args: argparse.Namespace) -> TraceSpec:
    base = QUICK if args.quick else FULL
    return TraceSpec(args.requests or base.num_requests, base.prompt, base.output, args.seed)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    spec = trace_spec(args)
    trace = make_trace(spec, ordinary_token_ids(resolve_model_dir(args.model)))
    demand = demand_blocks(trace)
    pool = max(4, int(demand / args.overflow))
    seq_blocks = -(-args.seq_tokens // BLOCK_SIZE)
    print(
        f"model {args.model}, {args.threads} torch threads, KV device {kv_device()}; {load_line()}"
    )

    ref_engine = reference_engine(args, trace, seq_blocks)
    full = ref_engine.kv_cache.dtype
    section(f"1. swap-out + swap-in, median of {args.reps}")
    copies = measure_copies(args.model, full, seq_blocks, args.reps, args.seed)
    print(format_table(COPY_HEADERS, copy_rows(copies)))
    recompute_s = measure_recompute(ref_engine, args.seq_tokens - 1, args.recompute_reps, 1)
    seq = next(c for c in copies if c.dtype == full and c.blocks == seq_blocks)
    print(
        f"one {args.seq_tokens}-token sequence: swap round trip {ms(seq.round_trip_s)} ms, "
        f"recompute (prefill again) {ms(recompute_s)} ms: swap is "
        f"{ratio(recompute_s, seq.round_trip_s)} faster"
    )

    section(
        f"2. trace: {len(trace)} requests needing {demand} blocks at once on a {pool}-block pool "
        f"({demand / pool:.1f}x)"
    )
    print(format_table(SUMMARY_HEADERS, trace_summary(trace)))
    ref = None if args.no_reference else serve_trace(ref_engine, "reference (no pressure)", trace)
    if ref is not None:
        ref.note = f"{ref_engine.snapshot().blocks_total} device blocks: the trace fits"
    del ref_engine
    swap, recompute = squeezed_runs(args, trace, pool)
    runs = [r for r in (ref, swap, recompute) if r is not None]
    print(format_table(TRACE_HEADERS, trace_rows(runs, ref or recompute, recompute)))
    print(
        f"swap vs recompute: {ratio(swap.tokens_per_s, recompute.tokens_per_s)} the tokens/s, "
        f"outputs identical {identical(swap, recompute)}"
    )
    print(load_line())
    write_json(args.json, payload(args, copies, recompute_s, spec, pool, demand, runs))


def payload(
    args: argparse.Namespace,
    copies: list[CopyTiming],
    recompute_s: float,
    spec: TraceSpec,
    pool: int,
    demand: int,
    runs: list[TraceRun],
) -> dict[str, Any]:
    return {
        "model": args.model,
        "threads": args.threads,
        "copies": [asdict(c) | {"round_trip_s": c.round_trip_s} for c in copies],
        "seq_tokens": args.seq_tokens,
        "recompute_s": recompute_s,
        "trace": asdict(spec),
        "pool_blocks": pool,
        "demand_blocks": demand,
        "runs": [
            {
                "name": r.name,
                "wall_s": r.wall_s,
                "output_tokens": r.output_tokens,
                "tokens_per_s": r.tokens_per_s,
                "preemptions": r.preemptions,
                "note": r.note,
            }
            for r in runs
        ],
    }


if __name__ == "__main__":
    main()
