"""KV memory: how many sequences one byte budget holds, and how much of it holds live tokens.

kvguard is measured: the engine serves the trace and `snapshot()` is read after every step
(peak `num_running`; `live_tokens / (blocks_used * block_size)` while any block is in use).

The peer is the traditional allocator that reserves a fixed-length region per request when
it is admitted and frees it at finish. It is simulated (an allocator needs no model to run):
the same budget in token slots, the same trace, FCFS admission, the whole prompt computed in the
admitting step and one token per step after, as a static-shape engine does. It is run with
three reservation sizes:

- `max_model_len` (the engine's configured maximum, 4096 by default): what such engines do;
- the trace's longest request (longest prompt + longest output): the smallest `max_model_len`
  that can serve this trace, the kindest fixed setting for the peer;
- each request's own prompt + max_tokens: an oracle that knows every output length up front.

Live tokens are those whose K/V is in the cache: prompt plus generated tokens but the newest
(its K/V is written by the next step). Goals stated by the issue: >= 4x the concurrency of the
max-length reservation, >= 96% of allocated slots live.

    python bench/kv_memory.py [--quick] [--json FILE] [--kv-cache-bytes 256MiB]
"""

from __future__ import annotations

import os
import statistics
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The OpenMP wait policy of every benchmark, set before torch loads libgomp: why, in
# bench/throughput.py and bench/README.md ("Fairness rules").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.trace import (  # noqa: E402
    SUMMARY_HEADERS,
    TraceRequest,
    common_args,
    format_table,
    load_trace,
    spec_from_args,
    trace_summary,
    write_json,
)

GOAL_CONCURRENCY = 4.0
GOAL_LIVE_SHARE = 0.96


@dataclass(frozen=True, slots=True)
class StepSample:
    running: int
    live_tokens: int
    allocated_slots: int


@dataclass(frozen=True, slots=True)
class AllocStats:
    name: str
    capacity_slots: int
    peak_running: int
    mean_live_share: float
    min_live_share: float
    busy_steps: int
    note: str = ""


def summarise(
    name: str, capacity: int, samples: Sequence[StepSample], note: str = ""
) -> AllocStats:
    """Peak concurrency, and the live share of allocated slots over the steps that held any."""
    busy = [s for s in samples if s.allocated_slots > 0]
    shares = [s.live_tokens / s.allocated_slots for s in busy] or [0.0]
    peak = max((s.running for s in samples), default=0)
    return AllocStats(name, capacity, peak, statistics.fmean(shares), min(shares), len(busy), note)


# ----------------------------------------------------------------------------- kvguard


def measure_kvguard(
    model: str, trace: Sequence[TraceRequest], kv_bytes: int, max_num_seqs: int, threads: int
) -> AllocStats:
    """Serve the trace step by step and read the engine's own accounting after each step."""
    from kvguard.engine import EngineConfig, LLMEngine, SamplingParams

    cfg = EngineConfig(
        model=model, kv_cache_bytes=kv_bytes, max_num_seqs=max_num_seqs, num_threads=threads
    )
    eng = LLMEngine.from_config(cfg, progress=False)
    for r in trace:
        eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
    samples: list[StepSample] = []
    finished: set[str] = set()
    while eng.has_unfinished():
        finished |= {o.request_id for o in eng.step() if o.finish_reason is not None}
        snap = eng.snapshot()
        samples.append(
            StepSample(snap.num_running, snap.live_tokens, snap.blocks_used * snap.block_size)
        )
    snap = eng.snapshot()
    if len(finished) != len(trace) or snap.blocks_used:
        raise SystemExit(
            f"kvguard finished {len(finished)}/{len(trace)}, {snap.blocks_used} blocks leaked"
        )
    note = f"measured; {snap.num_preemptions} preemptions"
    return summarise("kvguard paged blocks", snap.blocks_total * snap.block_size, samples, note)


# ----------------------------------------------------------------------------- reservation peer


def simulate_reservation(
    trace: Sequence[TraceRequest],
    capacity: int,
    reserve: Callable[[TraceRequest], int],
    max_num_seqs: int,
) -> list[StepSample]:
    """FCFS fixed-size reservation: admit while the head's region fits, free it at finish."""
    waiting = deque(trace)
    running: list[tuple[TraceRequest, int, int]] = []  # (request, reserved, generated)
    free, samples = capacity, []
    while waiting or running:
        while waiting and len(running) < max_num_seqs and reserve(waiting[0]) <= free:
            req = waiting.popleft()
            free -= reserve(req)
            running.append((req, reserve(req), 0))
        if not running:
            raise SystemExit(
                f"a {reserve(waiting[0])}-slot reservation exceeds the {capacity}-slot budget"
            )
        running = [(r, n, g + 1) for r, n, g in running]
        samples.append(
            StepSample(
                len(running),
                sum(len(r.prompt_ids) + g - 1 for r, _, g in running),
                sum(n for _, n, _ in running),
            )
        )
        free += sum(n for r, n, g in running if g == r.output_len)
        running = [(r, n, g) for r, n, g in running if g < r.output_len]
    return samples


def reservation_peers(
    trace: Sequence[TraceRequest], capacity: int, max_model_len: int, max_num_seqs: int
) -> list[AllocStats]:
    longest = max(len(r.prompt_ids) for r in trace) + max(r.output_len for r in trace)
    kinds: list[tuple[str, Callable[[TraceRequest], int]]] = [
        (f"reserve max_model_len={max_model_len}", lambda r: max_model_len),
        (f"reserve trace max length={longest}", lambda r: longest),
        ("reserve prompt+max_tokens (oracle)", lambda r: r.total_len),
    ]
    return [
        summarise(
            name, capacity, simulate_reservation(trace, capacity, fn, max_num_seqs), "simulated"
        )
        for name, fn in kinds
    ]


# ----------------------------------------------------------------------------- report


def report_rows(ours: AllocStats, peers: Sequence[AllocStats]) -> list[list[Any]]:
    rows = []
    for s in (ours, *peers):
        ratio = "-" if s is ours else f"{ours.peak_running / s.peak_running:.1f}x"
        rows.append(
            [
                s.name,
                s.capacity_slots,
                s.peak_running,
                ratio,
                f"{s.mean_live_share:.1%}",
                f"{s.min_live_share:.1%}",
                s.busy_steps,
                s.note,
            ]
        )
    return rows


HEADERS = [
    "allocator",
    "slots",
    "peak seqs",
    "kvguard concurrency",
    "live share mean",
    "live share min",
    "busy steps",
    "notes",
]


def verdicts(ours: AllocStats, peers: Sequence[AllocStats]) -> list[str]:
    """The stated goals: concurrency against the max-length reservation (`peers[0]`) and the
    live share. The other peers' ratios are reported, not judged: no goal is stated for them."""
    lines = []
    for i, peer in enumerate(peers[:2]):
        ratio = ours.peak_running / peer.peak_running
        if i == 0:
            ok = "met" if ratio >= GOAL_CONCURRENCY else "NOT met"
            lines.append(
                f"goal >= {GOAL_CONCURRENCY:.0f}x concurrency vs {peer.name}: {ok} ({ratio:.1f}x)"
            )
        else:
            lines.append(f"concurrency vs {peer.name}: {ratio:.1f}x (reported, no goal stated)")
    ok = "met" if ours.mean_live_share >= GOAL_LIVE_SHARE else "NOT met"
    lines.append(
        f"goal >= {GOAL_LIVE_SHARE:.0%} of allocated slots live: {ok} ({ours.mean_live_share:.1%} mean)"
    )
    return lines


def bytes_per_token(model_dir: Path) -> int:
    """K and V for every layer, fp32: the unit that turns the byte budget into token slots."""
    from kvguard.engine.model_config import ModelConfig

    return ModelConfig.from_dir(model_dir).kv_bytes_per_token(4)


def main() -> None:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-bytes", default="256MiB", help="the one KV budget (default 256MiB)")
    p.add_argument(
        "--max-model-len", type=int, default=4096, help="the peer's max-length reservation"
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequence cap, both sides")
    args = p.parse_args()
    from kvguard.engine.config import parse_bytes

    torch.set_num_threads(args.threads)
    kv_bytes = parse_bytes(args.kv_cache_bytes)
    model_dir, trace = load_trace(args)
    capacity = kv_bytes // bytes_per_token(model_dir)
    print(
        f"model {model_dir}, KV budget {args.kv_cache_bytes} = {capacity} token slots (fp32), "
        f"sequence cap {args.max_num_seqs}"
    )
    print(f"trace: {len(trace)} requests, seed {spec_from_args(args).seed}")
    print(format_table(SUMMARY_HEADERS, trace_summary(trace)))
    ours = measure_kvguard(args.model, trace, kv_bytes, args.max_num_seqs, args.threads)
    peers = reservation_peers(trace, capacity, args.max_model_len, args.max_num_seqs)
    print()
    print(format_table(HEADERS, report_rows(ours, peers)))
    for line in verdicts(ours, peers):
        print(line)
    write_json(
        args.json,
        {
            "kv_cache_bytes": kv_bytes,
            "spec": asdict(spec_from_args(args)),
            "results": [asdict(s) for s in (ours, *peers)],
        },
    )


if __name__ == "__main__":
    main()
