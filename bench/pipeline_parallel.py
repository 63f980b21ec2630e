"""Pipeline parallelism on this host: pp=1 against pp=2 and tp>1, same model, same requests.

(smollm2-135m's 9 heads do not split by 2: it is compared with tp=3, as bench/tensor_parallel.py
does.)

For each model (tiny by default; smollm2-135m too unless --quick) and each layout:

1. decode tokens/s of a batch of 8 (prompts of 32 ordinary tokens, greedy, EOS ignored, timed
   from the step where every sequence has its first token, so prefill is excluded), and
   whether the layout produced exactly the tokens pp=1 did;
2. time per stage: each rank's seconds inside its own forward per decode step (rank 0 measures
   its own; the workers report theirs over their pipe), with the tensor-parallel collectives
   inside a stage counted as the stage's time;
3. idle share: the part of the decode wall time a rank spent outside its forward, waiting for
   the other stage (or, at tp>1, for rank 0's scheduling and sampling).

pp=2 runs twice: with one micro-batch (a stage waits while the other computes, so each idles
about half the time by construction) and with two (each step's batch split in two halves: stage
0 computes the second while stage 1 computes the first; the pipeline fills and drains within a
step, so a third of the step is still a bubble).

On CPU the ranks share this machine's cores and talk over gloo on loopback, so this measures
the overhead of splitting the model (transfers, process hand-offs, fewer threads per rank), not
a speed-up: pipeline parallelism pays off when each stage has its own device and the model does
not fit one.

    python bench/pipeline_parallel.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import greedy, load_line, ratio, section, token_prompts  # noqa: E402
from bench.trace import format_table, write_json  # noqa: E402

TP = {"tiny": 2, "smollm2-135m": 3}  # the tensor-parallel size each model splits by


def layouts(model: str) -> list[tuple[str, int, int]]:
    """(name, tensor_parallel, pipeline_parallel, micro-batches) of each engine compared."""
    tp = TP[model]
    return [("pp=1", 1, 1, 1), ("pp=2", 1, 2, 1), ("pp=2", 1, 2, 2), (f"tp={tp}", tp, 1, 1)]


BATCH = 8


def build(model: str, tp: int, pp: int, micro: int, args: argparse.Namespace) -> Any:
    from kvguard.engine import EngineConfig, LLMEngine

    cfg = EngineConfig(
        model=model,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        pipeline_micro_batches=micro,
        model_quantization=args.quantization,
        device="cpu",
        kv_cache_bytes=args.kv_cache_bytes,
        max_model_len=512,
        tensor_parallel_timeout_s=120.0,
    )
    return LLMEngine.from_config(cfg, progress=False)


def busy(eng: Any) -> list[float]:
    """Seconds each rank has spent in its forward so far (one process: none measured)."""
    runner = eng.runner
    if not hasattr(runner, "worker_busy_s"):
        return []
    workers = runner.worker_busy_s()
    return [runner.stats.busy_s] + [workers[r] for r in sorted(workers)]


def decode(eng: Any, prompts: list[list[int]], tokens: int) -> dict:
    rids = [eng.add_request(p, greedy(tokens)) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}

    def step() -> int:
        n = 0
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
            n += len(out.new_token_ids)
        return n

    while any(not v for v in got.values()):
        step()
    before = busy(eng)
    t0, made, steps = time.perf_counter(), 0, 0
    while eng.has_unfinished():
        made += step()
        steps += 1
    wall = time.perf_counter() - t0
    spent = [b - a for a, b in zip(before, busy(eng), strict=True)]
    return {
        "tok_s": made / wall,
        "step_ms": 1e3 * wall / max(steps, 1),
        "rank_ms": [1e3 * s / max(steps, 1) for s in spent],
        "rank_idle": [max(0.0, 1.0 - s / wall) for s in spent],
        "tokens": [got[r] for r in rids],
    }


def measure(model: str, name: str, tp: int, pp: int, micro: int, args: argparse.Namespace) -> dict:
    eng = build(model, tp, pp, micro, args)
    try:
        eng.generate([token_prompts(model, 1, 8, 99)[0]], greedy(4))  # warm-up, untimed
        prompts = token_prompts(model, BATCH, 32, seed=BATCH)
        res = decode(eng, prompts, args.tokens)
        return {"model": model, "layout": name, "micro_batches": micro, **res}
    finally:
        eng.shutdown()


def report(results: list[dict]) -> list[list[Any]]:
    rows = []
    base: dict[str, dict] = {}
    for r in results:
        ref = base.setdefault(r["model"], r)
        per_rank = " / ".join(f"{v:.1f}" for v in r["rank_ms"]) or "-"
        idle = " / ".join(f"{100 * v:.0f}%" for v in r["rank_idle"]) or "-"
        rows.append(
            [
                r["model"],
                r["layout"],
                r["micro_batches"],
                f"{r['tok_s']:.1f}",
                ratio(r["tok_s"], ref["tok_s"]) if r is not ref else "-",
                f"{r['step_ms']:.1f}",
                per_rank,
                idle,
                r["tokens"] == ref["tokens"] if r is not ref else "-",
            ]
        )
    headers = [
        "model", "layout", "micro-batches", "decode tok/s", "vs pp=1", "step ms",
        "ms/step in forward per rank", "idle per rank", "same tokens",
    ]  # fmt: skip
    print(format_table(headers, rows))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny only, 16 tokens per request")
    p.add_argument("--json", type=Path, help="also write the results as JSON")
    p.add_argument("--kv-cache-bytes", default="64MiB", help="KV budget per rank")
    p.add_argument(
        "--quantization",
        default="none",
        help="model_quantization for every engine (default none: fp32 weights, where every "
        "layout must give exactly pp=1's tokens)",
    )
    args = p.parse_args()
    args.tokens = 16 if args.quick else 64
    models = ["tiny"] if args.quick else ["tiny", "smollm2-135m"]
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    section(f"pipeline parallel on {os.cpu_count()} cores, CPU gloo ({load_line()})")
    results = [
        measure(m, name, tp, pp, micro, args) for m in models for name, tp, pp, micro in layouts(m)
    ]
    report(results)
    print(
        "CPU gloo on shared cores: these figures are the overhead of splitting the model, "
        "not a speed-up."
    )
    for r in results:
        r.pop("tokens")
    write_json(args.json, {"results": results})


if __name__ == "__main__":
    main()
