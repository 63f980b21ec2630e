"""Control-loop cost: evaluation time per tick for 10 / 100 / 1000 rules, the time from a
threshold crossing to the action applied in the engine, and serving throughput with the
control plane on versus off under the same load.

    python bench/control_loop.py [--quick] [--json FILE]

Goals (issue): reaction <= interval + 100 ms with `for: 0`; control plane costs <= 3% throughput.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace import common_args, format_table, write_json  # noqa: E402

from common import make_engine, percentile  # noqa: E402

from kvguard.engine import SamplingParams  # noqa: E402
from kvguard.engine.control import ActionResult  # noqa: E402
from kvguard.engine.engine_loop import EngineLoop  # noqa: E402
from kvguard.rules.actions import run_action  # noqa: E402
from kvguard.rules.evaluator import Evaluator  # noqa: E402
from kvguard.rules.schema import load_rules_text  # noqa: E402
from kvguard.rules.signals import SignalReader  # noqa: E402


def rules_text(
    n: int, interval: str = "5s", above: float = 2.0, action: str = "halt_admission"
) -> str:
    """`n` threshold rules on local signals (half KV usage, half queue length)."""
    lines = [
        "version: 1",
        f"interval: {interval}",
        "cooldown: 30s",
        "signals:",
        "  kv: {local: kv_cache_usage_ratio}",
        "  waiting: {local: num_waiting}",
        "rules:",
    ]
    for i in range(n):
        sig = "kv" if i % 2 == 0 else "waiting"
        lines.append(
            f"  - {{name: r{i}, signal: {sig}, above: {above + i * 1e-6}, action: {action},"
            f" recover_below: 0.0, undo: resume_admission}}"
        )
    return "\n".join(lines) + "\n"


def tick_cost(engine, sizes: list[int], ticks: int) -> list[list]:  # noqa: ANN001
    """Median and p99 wall time of one evaluation over `n` rules reading the live snapshot."""
    reader = SignalReader(lambda: engine.latest_snapshot, lambda: None, None)  # type: ignore[arg-type]
    rows = []
    for n in sizes:
        ev = Evaluator(
            load_rules_text(rules_text(n), "bench"),
            reader,
            lambda a, p: ActionResult(a, {}, {}, "", True),
        )
        samples = []
        for _ in range(ticks):
            t0 = time.perf_counter()
            ev.tick()
            samples.append(time.perf_counter() - t0)
        rows.append(
            [
                n,
                statistics.median(samples) * 1e3,
                percentile(samples, 99) * 1e3,
                statistics.median(samples) / n * 1e6,
            ]
        )
    return rows


def reaction(engine, loop: EngineLoop, interval_s: float, trials: int) -> list[float]:  # noqa: ANN001
    """Seconds from the snapshot first showing the crossing to the knob changed in the engine."""
    text = (
        f"version: 1\ninterval: {interval_s}s\ncooldown: 0s\nsignals: {{w: {{local: num_running}}}}\nrules:\n"
        "  - {name: cut, signal: w, above: 3, action: set_max_num_seqs, params: {n: 2},"
        " recover_below: 1, undo: restore_batch}\n"
    )
    reader = SignalReader(lambda: engine.latest_snapshot, lambda: None, None)  # type: ignore[arg-type]
    ev = Evaluator(
        load_rules_text(text, "bench"), reader, lambda a, p: run_action(engine, a, p).result(60)
    )
    stop = threading.Event()

    def ticker() -> None:  # what APScheduler's interval job does, on its own thread
        while not stop.wait(interval_s):
            ev.tick()

    threading.Thread(target=ticker, daemon=True).start()
    out = []
    for _ in range(trials):
        while engine.latest_snapshot.max_num_seqs != engine.config.max_num_seqs or loop.in_flight():
            time.sleep(0.01)
        time.sleep(interval_s * 0.37)  # start at varying phases of the tick
        streams = [
            loop.submit([5 + j for j in range(40)], SamplingParams(max_tokens=24, ignore_eos=True))
            for _ in range(8)
        ]
        crossed = _wait(lambda: engine.latest_snapshot.num_running > 3, 30)
        applied = _wait(lambda: engine.latest_snapshot.max_num_seqs == 2, 30)
        if crossed and applied:
            out.append(applied - crossed)
        for s in streams:  # measured: stop the load instead of waiting for 1000 tokens
            loop.abort(s.request_id)
        for s in streams:
            s.result(120)
    stop.set()
    return out


def _wait(pred, timeout: float) -> float | None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic()
        time.sleep(0.001)
    return None


def throughput(engine, loop: EngineLoop, prompts, tokens: int, control: bool) -> float:  # noqa: ANN001
    """Output tokens/s for the same burst, with 100 never-firing rules ticking every 1 s or not."""
    stop = threading.Event()
    if control:
        reader = SignalReader(lambda: engine.latest_snapshot, lambda: None, None)  # type: ignore[arg-type]
        ev = Evaluator(
            load_rules_text(rules_text(100, "1s"), "bench"),
            reader,
            lambda a, p: run_action(engine, a, p).result(60),
        )

        def ticker() -> None:
            while not stop.wait(1.0):
                ev.tick()

        threading.Thread(target=ticker, daemon=True).start()
    t0 = time.perf_counter()
    streams = [loop.submit(p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for p in prompts]
    total = sum(len(s.result(600).token_ids) for s in streams)
    dt = time.perf_counter() - t0
    stop.set()
    return total / dt


def main() -> None:
    ap = common_args(__doc__ or "")
    ap.add_argument(
        "--interval", type=float, default=1.0, help="rule interval for the reaction test (s)"
    )
    args = ap.parse_args()
    q = args.quick
    engine = make_engine(args.model, args.threads, kv_cache_bytes="64MiB")
    loop = EngineLoop(engine).start()
    try:
        rows = tick_cost(engine, [10, 100] if q else [10, 100, 1000], 20 if q else 200)
        print("\nEvaluation time per tick (local signals)")
        print(format_table(["rules", "median ms", "p99 ms", "us per rule"], rows))
        lat = reaction(engine, loop, args.interval, 2 if q else 6)
        print(f"\nThreshold crossing -> action applied (interval {args.interval:g}s, for: 0)")
        goal = args.interval + 0.1
        lrows = [
            ["median", statistics.median(lat) if lat else None],
            ["max", max(lat) if lat else None],
            ["goal", goal],
        ]
        print(format_table(["", "seconds"], lrows))
        prompts = [[5 + (i * 7 + j) % 3000 for j in range(64)] for i in range(16 if q else 48)]
        tokens = 16 if q else 48
        runs = {"off": [], "on": []}
        for _ in range(1 if q else 2):  # alternate to spread machine noise over both
            runs["off"].append(throughput(engine, loop, prompts, tokens, False))
            runs["on"].append(throughput(engine, loop, prompts, tokens, True))
        off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
        print("\nThroughput under the same load, control plane off vs on (100 rules every 1 s)")
        print(
            format_table(
                ["control plane", "tokens/s"],
                [["off", off], ["on", on], ["cost", f"{(1 - on / off) * 100:+.1f}%"]],
            )
        )
        write_json(args.json, {"tick": rows, "reaction_s": lat, "throughput": runs})
    finally:
        loop.stop()


if __name__ == "__main__":
    main()
