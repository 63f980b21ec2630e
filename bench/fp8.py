"""FP8 KV cache: what the live switch buys and what it costs, FP8 against full precision.

One engine (smollm2-135m by default), one KV byte budget, measured in one run:

1. capacity: blocks and tokens the same byte budget holds in full precision (fp32 on CPU, bf16
   on CUDA: what `auto` picks) and in fp8_e4m3 (per-block scales included), read from the live
   pools after switching an idle engine both ways;
2. the live switch: the cache is filled with live sequences to several sizes and
   `set_kv_cache_dtype("fp8_e4m3")` is applied mid-generation; the engine's own `pause_s`
   (the step boundary is held that long) per GiB of live KV, its peak extra bytes, and the way
   back. Goal stated by the issue: <= 2 s per GiB of live KV on CPU;
3. quality: teacher-forced top-1 agreement, FP8 against full precision, on greedy
   continuations of fixed prompts (`kvguard.engine.kv_quality`). Goal: >= 98% agreement;
4. speed: decode tokens/s of the same batch (same prompts, same lengths, greedy) in each dtype,
   timed from the step where every sequence has its first token, so prefill is excluded; once
   after short prompts (the projections dominate a step) and once after long ones, where
   reading the cached K/V dominates and a narrower pool is read faster;
5. serving through the switch: an engine loop streaming `--streams` greedy requests (8) is
   switched to FP8 the way a rule does it (`enable_fp8_kv` posted from another thread, applied
   at a step boundary), then back (`disable_fp8_kv`), `--stream-rounds` times on the same loop:
   the switch's own pause on the engine thread, and the inter-token gaps the streams see, the
   largest around each switch against the median before it. The first round is the process's
   first switch each way (cold).

    python bench/fp8.py [--quick] [--json FILE] [--threads N] [--kv-cache-bytes 256MiB]
                        [--sections 1,2,3,4,5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import (  # noqa: E402
    GiB,
    MiB,
    greedy,
    load_line,
    make_engine,
    ratio,
    section,
    step_apply,
    token_prompts,
    verdict,
)
from bench.trace import common_args, format_table, write_json  # noqa: E402

if TYPE_CHECKING:
    from kvguard.engine import LLMEngine

FP8 = "fp8_e4m3"
PAUSE_GOAL_S_PER_GIB = 2.0
AGREEMENT_GOAL = 0.98  # teacher-forced top-1 agreement, FP8 against full precision
SAME_PREFIX = 16  # free-running greedy outputs compared on their first tokens too

# Fixed quality prompts: plain English and code, so the continuations are ones the model means.
QUALITY_PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    "Once upon a time, in a small village by the sea,",
    "A KV cache stores the keys and values of",
    "1, 2, 3, 4, 5, 6,",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "import numpy as np\n\ndef mean(xs):\n",
    "Photosynthesis is the process by which plants",
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
    "SELECT name, age FROM users WHERE",
    "The opposite of hot is cold, and the opposite of up is",
    "Dear hiring manager, I am writing to apply for",
    "A haiku about autumn:\n",
    "The main difference between a list and a tuple in Python is",
    "Monday, Tuesday, Wednesday,",
    "The best way to learn a new language is",
]


# ----------------------------------------------------------------------------- 1. capacity


@dataclass(slots=True)
class Capacity:
    dtype: str
    blocks: int
    tokens: int
    pool_bytes: int  # what the device pool's tensors actually occupy, scales included

    @property
    def bytes_per_token(self) -> float:
        return self.pool_bytes / self.tokens


def capacity_of(engine: LLMEngine) -> Capacity:
    snap = engine.snapshot()
    return Capacity(
        snap.kv_cache_dtype,
        snap.blocks_total,
        snap.blocks_total * snap.block_size,
        engine.kv_cache.device_pool.nbytes,
    )


def switch_idle(engine: LLMEngine, dtype: str) -> dict[str, Any]:
    """Switch an idle engine's KV dtype; a refusal here is a bug worth stopping for."""
    res = step_apply(engine, engine.set_kv_cache_dtype(dtype))
    if not res.ok:
        raise SystemExit(f"switch to {dtype} refused on an idle engine: {res.detail}")
    return res.data


def measure_capacity(engine: LLMEngine, full: str) -> list[Capacity]:
    caps = [capacity_of(engine)]
    switch_idle(engine, FP8)
    caps.append(capacity_of(engine))
    switch_idle(engine, full)
    return caps


def capacity_rows(caps: list[Capacity]) -> list[list[Any]]:
    base = caps[0]
    return [
        [
            c.dtype,
            c.blocks,
            c.tokens,
            f"{c.pool_bytes / MiB:.1f}",
            f"{c.bytes_per_token:,.0f}",
            ratio(c.blocks, base.blocks),
        ]
        for c in caps
    ]


CAPACITY_HEADERS = ["KV dtype", "blocks", "tokens", "pool MiB", "bytes/token", "blocks vs full"]


# ----------------------------------------------------------------------------- 2. live switch


@dataclass(slots=True)
class PauseSample:
    live_blocks: int
    usage: float
    live_bytes: int  # full-precision bytes the switch had to convert
    pause_s: float
    peak_extra_bytes: int
    back_pause_s: float | None  # fp8 -> full precision, same sequences one step later
    back_detail: str = ""
    cold: bool = False  # the process's first live conversion (pays one-off kernel set-up)

    @property
    def s_per_gib(self) -> float:
        return self.pause_s / (self.live_bytes / GiB)


def prompt_len_for(blocks_total: int, block_size: int, top_fill: float) -> int:
    """About two dozen sequences make the largest fill: many enough to look like serving,
    few enough that the fill overshoots its target by one sequence at most."""
    per_seq = max(1, math.ceil(blocks_total * top_fill / 24))
    return per_seq * block_size


def run_until_prefilled(engine: LLMEngine, rids: set[str]) -> None:
    """Step until every request in `rids` has its first token (its prompt is all in the cache)."""
    waiting = set(rids)
    while waiting:
        for out in engine.step():
            if out.num_output_tokens:
                waiting.discard(out.request_id)
            if out.finished:
                raise SystemExit(f"{out.request_id} finished while filling: raise max_tokens")


def fill_to(engine: LLMEngine, target: int, prompts: list[list[int]], live: list[str]) -> None:
    """Add live sequences until about `target` device blocks hold their KV."""
    per_seq = engine.block_manager.blocks_for(len(prompts[0]))  # at its first token
    need = max(0, math.ceil((target - engine.snapshot().blocks_used) / per_seq))
    new = {engine.add_request(prompts.pop(), greedy(4000)) for _ in range(need)}
    live.extend(new)
    run_until_prefilled(engine, new)


def switch_live(engine: LLMEngine, full: str, cold: bool = False) -> PauseSample:
    snap = engine.snapshot()
    to_fp8 = step_apply(engine, engine.set_kv_cache_dtype(FP8))
    if not to_fp8.ok:
        raise SystemExit(f"live switch to fp8 refused: {to_fp8.detail}")
    back = step_apply(engine, engine.set_kv_cache_dtype(full))
    d = to_fp8.data
    return PauseSample(
        live_blocks=snap.blocks_used,
        usage=snap.kv_cache_usage_ratio,
        live_bytes=d["live_bytes"],
        pause_s=d["pause_s"],
        peak_extra_bytes=d["peak_extra_bytes"],
        back_pause_s=back.data.get("pause_s") if back.ok else None,
        back_detail="" if back.ok else back.detail,
        cold=cold,
    )


def measure_pauses(
    engine: LLMEngine, full: str, fills: list[float], seed: int
) -> list[PauseSample]:
    """Fill to each level in turn (the sequences stay live), switching there and back each time.

    The first switch, with one live sequence, is reported apart as `cold`: a daemon pays its
    one-off set-up exactly once, and spread over a few MiB it would swamp the per-GiB figure.
    """
    snap = engine.snapshot()
    length = prompt_len_for(snap.blocks_total, snap.block_size, max(fills))
    prompts = token_prompts(engine.config.model, 4 * 24, length, seed)
    live: list[str] = []
    samples = []
    for i, fill in enumerate([0.0, *fills]):
        fill_to(engine, max(1, int(fill * snap.blocks_total)), prompts, live)
        samples.append(switch_live(engine, full, cold=i == 0))
        s = samples[-1]
        print(
            f"  {s.live_blocks} live blocks ({s.usage:.0%}): {s.pause_s * 1e3:.1f} ms to fp8"
            + (" (cold)" if s.cold else ""),
            flush=True,
        )
    for rid in live:
        engine.abort(rid)
    engine.step()
    return samples


def pause_rows(samples: list[PauseSample]) -> list[list[Any]]:
    return [
        [
            "first (cold)" if s.cold else "warm",
            s.live_blocks,
            f"{s.usage:.0%}",
            f"{s.live_bytes / MiB:.1f}",
            f"{s.pause_s * 1e3:.1f}",
            f"{s.s_per_gib:.3f}",
            f"{s.peak_extra_bytes / MiB:.1f}",
            "refused" if s.back_pause_s is None else f"{s.back_pause_s * 1e3:.1f}",
        ]
        for s in samples
    ]


PAUSE_HEADERS = [
    "switch",
    "live blocks",
    "usage",
    "live MiB",
    "pause ms",
    "s per GiB",
    "peak extra MiB",
    "back to full ms",
]


# ----------------------------------------------------------------------------- 3. quality


@dataclass(slots=True)
class Agreement:
    prompts: int
    tokens: int
    positions: int
    top1_agreement: float
    seconds: float


def measure_agreement(engine: LLMEngine, full: str, n: int, tokens: int) -> Agreement:
    """Greedy full-precision continuations, then both dtypes scored on exactly those tokens."""
    from kvguard.engine.kv_quality import teacher_forced_agreement

    t0 = time.perf_counter()
    outs = engine.generate(QUALITY_PROMPTS[:n], greedy(tokens))
    seqs = [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids)) for o in outs]
    share, positions = teacher_forced_agreement(engine, seqs, full, FP8)
    return Agreement(n, tokens, positions, share, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- 4. decode speed


@dataclass(slots=True)
class DecodeRun:
    dtype: str
    decode_s: float
    decode_tokens: int
    step_s: list[float] = field(default_factory=list, repr=False)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s

    def as_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "decode_s": self.decode_s,
            "decode_tokens": self.decode_tokens,
            "tokens_per_s": self.tokens_per_s,
        }


def decode_run(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> DecodeRun:
    """Serve the batch; the clock starts once every sequence is past its prefill."""
    rids = [engine.add_request(p, greedy(tokens)) for p in prompts]
    seen: dict[str, list[int]] = {}  # each request's tokens, accumulated from the deltas
    t0 = base = None
    steps: list[float] = []
    while engine.has_unfinished():
        s0 = time.perf_counter()
        for out in engine.step():
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        if t0 is not None:
            steps.append(time.perf_counter() - s0)
        elif len(seen) == len(rids) and all(seen.values()):
            t0, base = time.perf_counter(), sum(len(v) for v in seen.values())
    wall = time.perf_counter() - t0
    total = sum(len(seen[r]) for r in rids)
    return DecodeRun(engine.kv_cache.dtype, wall, total - base, steps, [seen[r] for r in rids])


def measure_decode(
    engine: LLMEngine, full: str, prompts: list[list[int]], tokens: int, rounds: int
) -> tuple[DecodeRun, DecodeRun]:
    """Alternate dtypes on one engine (same weights, same pool bytes); keep each one's best."""
    best: dict[str, DecodeRun] = {}
    for r in range(rounds):
        for dtype in (full, FP8):
            switch_idle(engine, dtype)
            engine.generate(prompts[:2], greedy(2))  # warm this dtype's kernels
            run = decode_run(engine, prompts, tokens)
            print(f"  round {r + 1}: {dtype}: {run.tokens_per_s:.1f} decode tok/s", flush=True)
            if dtype not in best or run.tokens_per_s > best[dtype].tokens_per_s:
                best[dtype] = run
    switch_idle(engine, full)
    return best[full], best[FP8]


def same_outputs(a: list[list[int]], b: list[list[int]], prefix: int | None) -> float:
    same = sum(x[:prefix] == y[:prefix] for x, y in zip(a, b, strict=True))
    return same / len(a)


def decode_rows(full: DecodeRun, fp8: DecodeRun) -> list[list[Any]]:
    rows = []
    for run in (full, fp8):
        rows.append(
            [
                run.dtype,
                run.decode_tokens,
                f"{run.decode_s:.2f}",
                f"{run.tokens_per_s:.1f}",
                f"{statistics.median(run.step_s) * 1e3:.1f}" if run.step_s else "-",
                ratio(run.tokens_per_s, full.tokens_per_s),
            ]
        )
    return rows


DECODE_HEADERS = ["KV dtype", "decode tokens", "decode s", "tok/s", "step ms p50", "vs full"]


# ----------------------------------------------------------------------------- 5. under streams

GAPS_BEFORE = 16  # each stream's inter-token gaps before a switch that make its median
GAPS_AFTER = 4  # gaps from the one spanning the switch on, where its cost can show


@dataclass(slots=True)
class StreamSwitch:
    round: int
    direction: str  # "to fp8" or "back"
    live_blocks: int  # device blocks the streams held when the switch was posted
    pause_s: float  # the switch itself on the engine thread (ActionResult.data["pause_s"])
    median_gap_s: float  # median of every stream's gaps before the switch
    max_gap_s: float  # the largest gap any stream saw from the switch on (GAPS_AFTER each)
    detail: str = ""


class TokenClock:
    """When each stream's tokens arrive (the listener runs on the engine thread as each step
    delivers them); `wait` blocks until every stream has at least `n` tokens."""

    def __init__(self, streams: int) -> None:
        self.times: list[list[float]] = [[] for _ in range(streams)]
        self.cond = threading.Condition()

    def listener(self, i: int) -> Any:
        def heard(out: Any) -> None:
            if out.new_token_ids:
                now = time.perf_counter()
                with self.cond:
                    self.times[i].extend([now] * len(out.new_token_ids))
                    self.cond.notify_all()

        return heard

    def counts(self) -> list[int]:
        with self.cond:
            return [len(t) for t in self.times]

    def wait(self, n: int, timeout: float = 600.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: min(map(len, self.times)) >= n, timeout):
                raise SystemExit(f"streams did not reach {n} tokens in {timeout:.0f} s")


def gaps_around(times: list[list[float]], marks: list[int]) -> tuple[float, float]:
    """(median gap before, largest gap from the mark on): `marks[i]` is how many tokens stream
    i had when the switch was posted, so its gap ending at token marks[i] spans the switch."""
    before, after = [], []
    for t, m in zip(times, marks, strict=True):
        gaps = [b - a for a, b in zip(t, t[1:], strict=False)]  # gaps[k] ends at token k + 1
        before += gaps[max(0, m - 1 - GAPS_BEFORE) : m - 1]
        after += gaps[m - 1 : m - 1 + GAPS_AFTER]
    return statistics.median(before), max(after)


def switch_under_streams(
    loop: Any, clock: TokenClock, action: str, rnd: int, direction: str
) -> StreamSwitch:
    from kvguard.rules.actions import run_action

    marks = clock.counts()
    live = loop.snapshot().blocks_used
    res = run_action(loop.engine, action, clamp=True).result(600)
    if not res.ok:
        raise SystemExit(f"{action} refused under streams: {res.detail}")
    clock.wait(max(marks) + GAPS_AFTER + 1)
    median, worst = gaps_around(clock.times, marks)
    return StreamSwitch(
        rnd, direction, live, res.data.get("pause_s", 0.0), median, worst, res.detail
    )


def measure_under_streams(
    model: str, threads: int, kv_bytes: str, streams: int, rounds: int, seed: int
) -> list[StreamSwitch]:
    """Each round: `streams` fresh greedy requests, switched to FP8 and back while they stream."""
    from kvguard.engine import EngineConfig, LLMEngine
    from kvguard.engine.engine_loop import EngineLoop

    def build() -> LLMEngine:  # on the loop's thread, as the daemon builds it
        import torch

        torch.set_num_threads(threads)
        cfg = EngineConfig(model=model, num_threads=threads, kv_cache_bytes=kv_bytes)
        return LLMEngine.from_config(cfg, progress=False)

    loop = EngineLoop().start(build)
    warmup = 2 * GAPS_BEFORE
    per_round = warmup + 2 * (GAPS_BEFORE + GAPS_AFTER + 2) + 8
    out = []
    try:
        for rnd in range(rounds):
            prompts = token_prompts(model, streams, 64, seed + rnd)
            clock = TokenClock(streams)
            subs = [
                loop.submit_nowait(p, greedy(per_round), listener=clock.listener(i))[0]
                for i, p in enumerate(prompts)
            ]
            clock.wait(warmup)
            for action, direction in (("enable_fp8_kv", "to fp8"), ("disable_fp8_kv", "back")):
                out.append(switch_under_streams(loop, clock, action, rnd, direction))
                s = out[-1]
                print(
                    f"  round {rnd + 1} {direction}: pause {s.pause_s * 1e3:.1f} ms, gaps "
                    f"median {s.median_gap_s * 1e3:.1f} ms, max {s.max_gap_s * 1e3:.1f} ms "
                    f"({s.live_blocks} live blocks)",
                    flush=True,
                )
                clock.wait(max(clock.counts()) + GAPS_BEFORE)
            for sub in subs:
                sub.result(600)
    finally:
        loop.stop()
    return out


def stream_rows(samples: list[StreamSwitch]) -> list[list[Any]]:
    return [
        [
            f"{s.round + 1}{' (cold)' if s.round == 0 else ''}",
            s.direction,
            s.live_blocks,
            f"{s.pause_s * 1e3:.1f}",
            f"{s.median_gap_s * 1e3:.1f}",
            f"{s.max_gap_s * 1e3:.1f}",
            ratio(s.max_gap_s, s.median_gap_s),
        ]
        for s in samples
    ]


STREAM_HEADERS = [
    "round",
    "switch",
    "live blocks",
    "pause ms",
    "gap p50 before ms",
    "max gap ms",
    "max/p50",
]


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-bytes", default=None, help="KV budget (256MiB; quick 16MiB)")
    p.add_argument("--batch", type=int, default=0, help="decode batch (32; quick 4)")
    p.add_argument("--decode-tokens", type=int, default=0, help="tokens per sequence (64; quick 8)")
    p.add_argument("--agree-prompts", type=int, default=0, help="quality prompts (20; quick 2)")
    p.add_argument("--agree-tokens", type=int, default=0, help="tokens per prompt (64; quick 8)")
    p.add_argument("--rounds", type=int, default=1, help="decode rounds per dtype; best counts")
    p.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        help="long-context decode: prompt tokens (512; quick 64)",
    )
    p.add_argument(
        "--long-batch", type=int, default=0, help="long-context decode: sequences (8; quick 2)"
    )
    p.add_argument(
        "--fills", default="", help="live-switch fill levels (0.2,0.4,0.6,0.8; quick 0.6)"
    )
    p.add_argument("--streams", type=int, default=0, help="streams switched under (8)")
    p.add_argument(
        "--stream-rounds", type=int, default=0, help="switches there and back under streams (3)"
    )
    p.add_argument("--sections", default="1,2,3,4,5", help="which sections to run (1,2,3,4,5)")
    args = p.parse_args()
    quick = args.quick
    args.kv_cache_bytes = args.kv_cache_bytes or ("16MiB" if quick else "256MiB")
    args.batch = args.batch or (4 if quick else 32)
    args.decode_tokens = args.decode_tokens or (8 if quick else 64)
    args.agree_prompts = min(args.agree_prompts or (2 if quick else 20), len(QUALITY_PROMPTS))
    args.agree_tokens = args.agree_tokens or (8 if quick else 64)
    args.long_prompt = args.long_prompt or (64 if quick else 512)
    args.long_batch = args.long_batch or (2 if quick else 8)
    args.streams = args.streams or 8
    args.stream_rounds = args.stream_rounds or (1 if quick else 3)
    args.sections = {int(x) for x in args.sections.split(",")}
    default_fills = "0.6" if quick else "0.2,0.4,0.6,0.8"
    args.fills = [float(x) for x in (args.fills or default_fills).split(",")]
    return args


def main() -> None:
    args = parse_args()
    result: dict[str, Any] = {"model": args.model, "threads": args.threads}
    result["kv_cache_bytes"] = args.kv_cache_bytes
    if args.sections & {1, 2, 3, 4}:
        result |= engine_sections(args)
    if 5 in args.sections:
        section(
            f"5. {args.streams} streams switched to {FP8} and back by the rules' actions "
            f"({args.stream_rounds} rounds)"
        )
        print(load_line())
        streams = measure_under_streams(
            args.model,
            args.threads,
            args.kv_cache_bytes,
            args.streams,
            args.stream_rounds,
            args.seed,
        )
        print(format_table(STREAM_HEADERS, stream_rows(streams)))
        print(load_line())
        result["under_streams"] = [asdict(s) for s in streams]
    write_json(args.json, result)


def engine_sections(args: argparse.Namespace) -> dict[str, Any]:
    """Sections 1-4 on one engine stepped from this thread; the summary where all four ran."""
    engine = make_engine(
        args.model, args.threads, kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=64
    )
    full = engine.kv_cache.dtype
    print(
        f"model {args.model}, {args.threads} torch threads, device {engine.device}, KV budget "
        f"{args.kv_cache_bytes}, full precision = {full}; {load_line()}"
    )
    out: dict[str, Any] = {"device": str(engine.device), "full_dtype": full}
    want = args.sections
    if 1 in want:
        section(f"1. capacity of one {args.kv_cache_bytes} KV budget")
        caps = measure_capacity(engine, full)
        print(format_table(CAPACITY_HEADERS, capacity_rows(caps)))
        out["capacity"] = [asdict(c) for c in caps]
    if 2 in want:
        section(f"2. live switch {full} -> {FP8} with the cache holding live sequences")
        pauses = measure_pauses(engine, full, args.fills, args.seed)
        print(format_table(PAUSE_HEADERS, pause_rows(pauses)))
        out["live_switch"] = [asdict(s) | {"s_per_gib": s.s_per_gib} for s in pauses]
    if 3 in want:
        section(f"3. teacher-forced top-1 agreement, {FP8} vs {full}")
        agree = measure_agreement(engine, full, args.agree_prompts, args.agree_tokens)
        print(
            f"{agree.top1_agreement:.2%} of {agree.positions} positions "
            f"({agree.prompts} prompts x {agree.tokens} greedy {full} tokens, "
            f"{agree.seconds:.1f} s)"
        )
        out["agreement"] = asdict(agree)
    if 4 in want:
        section(f"4. decode speed, {args.batch} sequences x {args.decode_tokens} tokens")
        prompts = token_prompts(args.model, args.batch, 16, args.seed)
        d_full, d_fp8 = measure_decode(engine, full, prompts, args.decode_tokens, args.rounds)
        print(format_table(DECODE_HEADERS, decode_rows(d_full, d_fp8)))
        same_all = same_outputs(d_full.outputs, d_fp8.outputs, None)
        same_pre = same_outputs(d_full.outputs, d_fp8.outputs, SAME_PREFIX)
        print(
            f"free-running greedy outputs identical: {same_all:.0%} whole, "
            f"{same_pre:.0%} on the first {SAME_PREFIX} tokens"
        )
        print(
            f"\nafter {args.long_prompt}-token prompts, {args.long_batch} sequences x "
            f"{args.decode_tokens} tokens:"
        )
        long_prompts = token_prompts(args.model, args.long_batch, args.long_prompt, args.seed + 1)
        l_full, l_fp8 = measure_decode(engine, full, long_prompts, args.decode_tokens, args.rounds)
        print(format_table(DECODE_HEADERS, decode_rows(l_full, l_fp8)))
        out["decode"] = [r.as_json() for r in (d_full, d_fp8)]
        out["decode_long_context"] = {
            "prompt_tokens": args.long_prompt,
            "sequences": args.long_batch,
            "runs": [r.as_json() for r in (l_full, l_fp8)],
        }
        out["greedy_identical"] = {"whole": same_all, f"first_{SAME_PREFIX}": same_pre}
    if {1, 2, 3, 4} <= want:
        section("summary")
        long = (args.long_prompt, l_full, l_fp8)
        for line in summary(engine, caps, pauses, agree, d_full, d_fp8, long):
            print(line)
    print(load_line())
    return out


def summary(
    engine: LLMEngine,
    caps: list[Capacity],
    pauses: list[PauseSample],
    agree: Agreement,
    d_full: DecodeRun,
    d_fp8: DecodeRun,
    long: tuple[int, DecodeRun, DecodeRun],
) -> list[str]:
    warm = [s for s in pauses if not s.cold] or pauses
    worst = max(s.s_per_gib for s in warm)
    cold = [s.pause_s for s in pauses if s.cold]
    on_cpu = engine.device.type == "cpu"
    lines = [
        f"capacity: fp8 holds {ratio(caps[1].blocks, caps[0].blocks)} the blocks of {caps[0].dtype}",
        verdict(
            f"live switch <= {PAUSE_GOAL_S_PER_GIB} s/GiB on CPU",
            worst <= PAUSE_GOAL_S_PER_GIB if on_cpu else None,
            f"worst {worst:.3f} s/GiB over {len(warm)} fill levels"
            + (f"; the first switch in the process took {cold[0] * 1e3:.0f} ms" if cold else "")
            + ("" if on_cpu else "; the goal is stated for CPU"),
        ),
        verdict(
            f"teacher-forced top-1 agreement >= {AGREEMENT_GOAL:.0%}",
            agree.top1_agreement >= AGREEMENT_GOAL if agree.positions else None,
            f"{agree.top1_agreement:.2%} over {agree.positions} positions",
        ),
        f"decode: fp8 at {ratio(d_fp8.tokens_per_s, d_full.tokens_per_s)} the tokens/s of"
        f" {d_full.dtype} after short prompts, {ratio(long[2].tokens_per_s, long[1].tokens_per_s)}"
        f" after {long[0]}-token ones",
    ]
    if len(warm) >= 2:
        fixed, per_gib = pause_fit(warm)
        lines.insert(
            2, f"live switch fit: pause = {fixed * 1e3:.0f} ms + {per_gib:.3f} s/GiB x live KV"
        )
    return lines


def pause_fit(samples: list[PauseSample]) -> tuple[float, float]:
    """Least-squares pause = fixed + slope x live GiB: the pool rebuild costs something even
    with nothing live, and the slope is the price of each further GiB converted."""
    fit = statistics.linear_regression(
        [s.live_bytes / GiB for s in samples], [s.pause_s for s in samples]
    )
    return fit.intercept, fit.slope


if __name__ == "__main__":
    main()
