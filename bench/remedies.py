"""Live remedies under a saturating load: how much KV each frees, and how fast it acts.

An `EngineLoop` serves a steady stream of requests from a feeder thread that keeps twice
`max_num_seqs` in flight (half of them `low` priority), on a KV pool far smaller than that load
needs, so usage sits near 100% with preemptions going on. For each remedy, applied in turn from
another thread exactly as the rule evaluator applies it (through the control surface's mailbox):

- reduce_batch      `set_max_num_seqs(max_num_seqs // 2)`
- evict_low         `evict(4, "low")`
- cap_max_tokens    `set_max_new_tokens_cap(output_len // 4)`
- halt_admission    `halt_admission("high")`
- enable_fp8_kv     `set_kv_cache_dtype("fp8_e4m3")` (last: under this load it cannot be undone)

it reports KV usage just before the call, 1 s after it (`--settle`) and the lowest in between
(under a saturating load freed blocks are soon reused: the lowest value is the immediate
relief), the time from the call until its Future resolves, and until the first published
snapshot shows the change. Actions are applied at the start of the next step and snapshots are
published at its end, so the Future waits for the rest of the step in flight and the snapshot
one step more; the step time (p50) is printed alongside. For the halt, a low-priority probe
request posted right after the call must be refused: its refusal time is reported too. Between remedies the previous one is undone
and the load is given time to saturate the pool again. No peer engine can change these knobs
while serving, so the comparison is each remedy's before against its after.

    python bench/remedies.py [--quick] [--json FILE] [--threads N] [--settle 1.0]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import greedy, load_line, make_engine, ms, ratio, section, token_prompts  # noqa: E402
from bench.trace import common_args, format_table, write_json  # noqa: E402

if TYPE_CHECKING:
    from kvguard.engine import EngineSnapshot, LLMEngine
    from kvguard.engine.control import ActionResult
    from kvguard.engine.engine_loop import EngineLoop
    from kvguard.engine.sequence import RequestOutput

PRIORITY_CYCLE = ("normal", "low", "low", "high")  # half low, so eviction has victims
SATURATED = 0.85  # usage the load must reach again before the next remedy is measured


# ----------------------------------------------------------------------------- the load


def _drop_output(out: RequestOutput) -> None:
    """The load's outputs are not read: only the engine's pressure and its snapshots matter."""


class Timeline:
    """Every snapshot the engine publishes (hooked on the engine thread; appends are atomic)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.snaps: deque[EngineSnapshot] = deque(maxlen=100_000)
        loop.on_step.append(self.snaps.append)

    def since(self, t: float) -> list[EngineSnapshot]:
        return [s for s in list(self.snaps) if s.time >= t]

    def wait_for(self, t: float, timeout: float = 120.0) -> EngineSnapshot:
        """The first snapshot published at or after wall time `t` (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            later = self.since(t)
            if later:
                return later[0]
            time.sleep(0.01)
        raise SystemExit(f"no snapshot published within {timeout:.0f} s: is the loop stuck?")

    def step_times(self) -> list[float]:
        snaps = list(self.snaps)
        return [b.time - a.time for a, b in itertools.pairwise(snaps) if b.step == a.step + 1]


@dataclass(slots=True)
class Feeder:
    """Keeps `target` requests in flight; counts refusals (halted admission) with their times."""

    loop: EngineLoop
    prompts: list[list[int]]
    output_len: int
    target: int
    submitted: int = 0
    refusals: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        from kvguard.engine.llm_engine import AdmissionRejected

        while not self.stop.is_set():
            futs = [self._submit() for _ in range(self.target - self.loop.in_flight())]
            refused = 0
            for fut in futs:
                try:
                    fut.result(timeout=60)
                except AdmissionRejected:
                    self.refusals.append(time.time())
                    refused += 1
                except TimeoutError:
                    pass  # a very slow step; the request is still added when the loop gets to it
            if refused or not futs:
                time.sleep(0.05 if refused else 0.02)  # a halted engine is not to be hammered

    def _submit(self) -> Future:
        i = self.submitted
        self.submitted += 1
        prompt = self.prompts[i % len(self.prompts)]
        prio = PRIORITY_CYCLE[i % len(PRIORITY_CYCLE)]
        # Nobody reads these outputs: a listener that drops them keeps the stream from
        # buffering each request's text until it finishes.
        _, fut = self.loop.submit_nowait(
            prompt, greedy(self.output_len), prio, listener=_drop_output
        )
        return fut


# ----------------------------------------------------------------------------- the remedies

Apply = Callable[["LLMEngine", "EngineSnapshot"], Future]
Shows = Callable[["EngineSnapshot", "EngineSnapshot", "ActionResult"], bool]


@dataclass(frozen=True, slots=True)
class Remedy:
    name: str
    call: str  # what is called, for the table
    apply: Apply
    shows: Shows  # (snapshot, snapshot before, result): does it show the action applied?
    undo: Apply | None = None
    probe: bool = False  # check the effect with a request that must now be refused


def catalogue(output_len: int) -> list[Remedy]:
    cap = max(1, output_len // 4)

    def half(before: EngineSnapshot) -> int:
        return max(1, before.max_num_seqs // 2)

    return [
        Remedy(
            "reduce_batch",
            "set_max_num_seqs(n // 2)",
            lambda e, b: e.set_max_num_seqs(half(b)),
            lambda s, b, r: s.max_num_seqs == half(b) and s.num_running <= half(b),
            lambda e, b: e.set_max_num_seqs(b.max_num_seqs),
        ),
        Remedy(
            "evict_low",
            'evict(4, "low")',
            lambda e, b: e.evict(4, "low"),
            lambda s, b, r: s.num_preemptions >= b.num_preemptions + len(r.data.get("evicted", [])),
        ),
        Remedy(
            "cap_max_tokens",
            f"set_max_new_tokens_cap({cap})",
            lambda e, b: e.set_max_new_tokens_cap(cap),
            lambda s, b, r: s.knobs["max_new_tokens_cap"] == cap,
            lambda e, b: e.set_max_new_tokens_cap(None),
        ),
        Remedy(
            "halt_admission",
            'halt_admission("high")',
            lambda e, b: e.halt_admission("high"),
            lambda s, b, r: bool(s.admission["halted"]),
            lambda e, b: e.resume_admission(),
            probe=True,
        ),
        Remedy(
            "enable_fp8_kv",
            'set_kv_cache_dtype("fp8_e4m3")',
            lambda e, b: e.set_kv_cache_dtype("fp8_e4m3"),
            lambda s, b, r: s.kv_cache_dtype == "fp8_e4m3",
        ),
    ]


# ----------------------------------------------------------------------------- measuring


@dataclass(slots=True)
class Sample:
    remedy: str
    call: str
    ok: bool
    detail: str
    usage_before: float
    usage_after: float
    usage_min: float  # lowest usage published within the settle window: the immediate relief
    blocks_before: tuple[int, int]  # (used, total)
    blocks_after: tuple[int, int]
    running_before: int
    running_after: int
    future_s: float
    snapshot_s: float | None
    probe_refused_s: float | None  # halt only: a low-priority request posted after the call
    saturate_s: float  # how long the load took to saturate the pool before the call


def wait_saturated(loop: EngineLoop, timeline: Timeline, timeout: float) -> float:
    """Seconds until a fresh snapshot shows usage >= SATURATED (the load is back to pressure)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        snap = timeline.wait_for(time.time())
        if snap.kv_cache_usage_ratio >= SATURATED:
            return time.monotonic() - t0
    print(f"  warning: usage stayed below {SATURATED:.0%} for {timeout:.0f} s", flush=True)
    return time.monotonic() - t0


def probe_refusal(loop: EngineLoop, prompt: list[int], t_call: float) -> float | None:
    """Seconds from the call until a low-priority request is turned away; None if admitted."""
    from kvguard.engine.llm_engine import AdmissionRejected

    _, fut = loop.submit_nowait(prompt, greedy(1), "low")
    try:
        fut.result(timeout=120)
    except AdmissionRejected:
        return time.time() - t_call
    return None


def measure(
    loop: EngineLoop, timeline: Timeline, feeder: Feeder, remedy: Remedy, settle: float
) -> Sample:
    saturate_s = wait_saturated(loop, timeline, timeout=120)
    before = loop.snapshot()
    t_call = time.time()
    res = remedy.apply(loop.engine, before).result(timeout=120)
    future_s = time.time() - t_call
    after = timeline.wait_for(t_call + settle)
    window = [s for s in timeline.since(t_call) if s.time <= after.time]
    shown = next((s for s in timeline.since(t_call) if remedy.shows(s, before, res)), None)
    probe = probe_refusal(loop, feeder.prompts[0], t_call) if remedy.probe else None
    if remedy.undo is not None:
        remedy.undo(loop.engine, before).result(timeout=120)
    return Sample(
        remedy.name,
        remedy.call,
        res.ok,
        res.detail,
        before.kv_cache_usage_ratio,
        after.kv_cache_usage_ratio,
        min(s.kv_cache_usage_ratio for s in window),
        (before.blocks_used, before.blocks_total),
        (after.blocks_used, after.blocks_total),
        before.num_running,
        after.num_running,
        future_s,
        None if shown is None else shown.time - t_call,
        probe,
        saturate_s,
    )


def sample_rows(samples: list[Sample]) -> list[list[Any]]:
    return [
        [
            s.remedy,
            f"{s.usage_before:.0%}",
            f"{s.usage_after:.0%}",
            ratio(s.usage_after, s.usage_before),
            f"{s.usage_min:.0%}",
            f"{s.blocks_before[0]}/{s.blocks_before[1]}",
            f"{s.blocks_after[0]}/{s.blocks_after[1]}",
            f"{s.running_before}->{s.running_after}",
            ms(s.future_s),
            ms(s.snapshot_s),
            ms(s.probe_refused_s),
            ("" if s.ok else "REFUSED: ") + s.detail[:60],
        ]
        for s in samples
    ]


HEADERS = [
    "remedy",
    "usage before",
    "usage +1s",
    "after/before",
    "min in 1s",
    "blocks before",
    "blocks +1s",
    "running",
    "future ms",
    "snapshot ms",
    "low refused ms",
    "detail",
]


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-bytes", default=None, help="KV budget (64MiB; quick 16MiB)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="batch limit (16; quick 8)")
    p.add_argument("--prompt-len", type=int, default=0, help="prompt tokens (64; quick 24)")
    p.add_argument("--output-len", type=int, default=0, help="output tokens (96; quick 48)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="prefill chunk per step; small keeps steps (and so action latency) short on CPU",
    )
    p.add_argument("--settle", type=float, default=1.0, help="seconds before 'after' is read")
    p.add_argument("--only", action="append", default=[], help="run only this remedy (repeatable)")
    args = p.parse_args()
    q = args.quick
    args.kv_cache_bytes = args.kv_cache_bytes or ("16MiB" if q else "64MiB")
    args.max_num_seqs = args.max_num_seqs or (8 if q else 16)
    args.prompt_len = args.prompt_len or (24 if q else 64)
    args.output_len = args.output_len or (48 if q else 96)
    return args


def main() -> None:
    from kvguard.engine.engine_loop import EngineLoop

    args = parse_args()
    engine = make_engine(
        args.model,
        args.threads,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_cpu_offload=True,
        cpu_cache_ratio=0.4,
    )
    remedies = [r for r in catalogue(args.output_len) if not args.only or r.name in args.only]
    loop = EngineLoop(engine)
    timeline = Timeline(loop)
    loop.start()
    prompts = token_prompts(args.model, 64, args.prompt_len, args.seed)
    feeder = Feeder(loop, prompts, args.output_len, 2 * args.max_num_seqs)
    snap = engine.snapshot()
    print(
        f"model {args.model}, {args.threads} torch threads, KV {args.kv_cache_bytes} = "
        f"{snap.blocks_total} blocks + {snap.host.blocks_total} host, max_num_seqs "
        f"{args.max_num_seqs}, load: {feeder.target} in flight x ({args.prompt_len} prompt + "
        f"{args.output_len} output tokens); {load_line()}"
    )
    threading.Thread(target=feeder.run, name="feeder", daemon=True).start()
    samples = []
    try:
        for remedy in remedies:
            samples.append(measure(loop, timeline, feeder, remedy, args.settle))
            s = samples[-1]
            print(
                f"  {s.remedy}: usage {s.usage_before:.0%} -> {s.usage_after:.0%}, "
                f"future {ms(s.future_s)} ms",
                flush=True,
            )
    finally:
        feeder.stop.set()
        loop.stop()
    steps = timeline.step_times()
    step_p50 = statistics.median(steps) if steps else None
    section(f"remedies under load (usage read {args.settle:g} s after each call)")
    print("; ".join(f"{r.name} = {r.call}" for r in remedies))
    print(format_table(HEADERS, sample_rows(samples)))
    print(
        f"engine step p50 {ms(step_p50)} ms over {len(steps)} steps (an action waits for the "
        f"step in flight); {feeder.submitted} requests submitted, {len(feeder.refusals)} refused; "
        f"{load_line()}"
    )
    if loop.error is not None:
        print(f"engine loop error during the run: {loop.error!r}")
    write_json(
        args.json,
        {
            "model": args.model,
            "threads": args.threads,
            "kv_cache_bytes": args.kv_cache_bytes,
            "max_num_seqs": args.max_num_seqs,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "settle_s": args.settle,
            "step_p50_s": step_p50,
            "samples": [asdict(s) for s in samples],
        },
    )


if __name__ == "__main__":
    main()
