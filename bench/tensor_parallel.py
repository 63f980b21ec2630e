"""Tensor parallelism on this host: tp=1 against tp>1, same model, same requests, one run.

For each pair (tiny tp=1 vs tp=2; smollm2-135m tp=1 vs tp=3, its heads divide by 3, not 2):

1. decode tokens/s at batch 1 and batch 32 (prompts of 32 ordinary tokens, greedy, EOS ignored,
   timed from the step where every sequence has its first token, so prefill is excluded), and
   whether tp>1 produced exactly the tokens tp=1 did;
2. weight and KV bytes per rank (rank 0 measured here; the workers report theirs at start);
3. where rank 0's batch-32 decode step goes: the collectives (all-reduce, gather; measured by
   wrapping torch.distributed's calls in this process, waiting for slower ranks included) and
   the per-step message to the workers (encoding and sending). On CUDA the collectives are
   NCCL launches, so their share there says little; tokens/s and parity are what count.

On CPU the ranks share this machine's cores (each gets cores // tp threads) and talk over gloo
on loopback, so tp>1 is expected to be slower than tp=1 here: tensor parallelism pays off when
each rank has its own device. The benchmark says how much slower and where the time goes.

    python bench/tensor_parallel.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import MiB, greedy, load_line, ratio, section, token_prompts, verdict  # noqa: E402
from bench.trace import format_table, write_json  # noqa: E402

PAIRS = (("tiny", 2), ("smollm2-135m", 3))
GOAL_WEIGHT_SHARE = 0.45  # smollm2 at tp=3: weight bytes per rank vs tp=1
GOAL_MESSAGE_SHARE = 0.05  # the per-step message vs a decode step


class CollectiveTimer:
    """Wall time rank 0 spends inside torch.distributed's all_reduce and gather."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.on = False

    def install(self) -> None:
        import torch.distributed as dist

        for name in ("all_reduce", "gather"):
            setattr(dist, name, self._wrap(getattr(dist, name)))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed


def build(model: str, tp: int, args: argparse.Namespace) -> Any:
    from kvguard.engine import EngineConfig, LLMEngine

    cfg = EngineConfig(
        model=model,
        tensor_parallel=tp,
        model_quantization=args.quantization,
        device=args.device,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=0.3,
        max_model_len=512,
    )
    return LLMEngine.from_config(cfg, progress=False)


def decode(eng: Any, prompts: list[list[int]], tokens: int, timer: CollectiveTimer) -> dict:
    """Decode tokens/s of one batch, from the step where every sequence has its first token."""
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
    stats = getattr(eng.runner, "stats", None)
    msg0 = (stats.message_s, stats.message_bytes, stats.steps) if stats else (0.0, 0, 0)
    timer.seconds, timer.calls, timer.on = 0.0, 0, True
    t0, made, steps = time.perf_counter(), 0, 0
    while eng.has_unfinished():
        made += step()
        steps += 1
    wall = time.perf_counter() - t0
    timer.on = False
    out = {
        "tok_s": made / wall,
        "step_ms": 1e3 * wall / max(steps, 1),
        "tokens": [got[r] for r in rids],
    }
    if stats:
        out["collective_share"] = timer.seconds / wall
        out["message_share"] = (stats.message_s - msg0[0]) / wall
        out["message_bytes"] = (stats.message_bytes - msg0[1]) / max(stats.steps - msg0[2], 1)
    return out


def measure(model: str, tp: int, args: argparse.Namespace, timer: CollectiveTimer) -> dict:
    from kvguard.engine.model import weight_bytes

    eng = build(model, tp, args)
    try:
        runner = eng.runner
        weights = [weight_bytes(eng.model)] + [
            w.info["weight_bytes"] for w in getattr(runner, "workers", [])
        ]
        res: dict[str, Any] = {"model": model, "tp": tp, "weight_bytes": weights}
        res["kv_bytes"] = runner.kv_bytes_per_rank()
        eng.generate([token_prompts(model, 1, 8, 99)[0]], greedy(4))  # warm-up, untimed
        for batch in (1, 32):
            prompts = token_prompts(model, batch, 32, seed=batch)
            res[f"bs{batch}"] = decode(eng, prompts, args.tokens, timer)
        return res
    finally:
        eng.shutdown()


def report(results: list[dict]) -> list[str]:
    rows, goals = [], []
    for base, par in zip(results[::2], results[1::2], strict=True):
        for r in (base, par):
            same = (
                "-"
                if r is base
                else all(r[f"bs{b}"]["tokens"] == base[f"bs{b}"]["tokens"] for b in (1, 32))
            )
            b32 = r["bs32"]
            rows.append(
                [
                    r["model"],
                    r["tp"],
                    f"{r['bs1']['tok_s']:.1f}",
                    f"{b32['tok_s']:.1f}",
                    ratio(b32["tok_s"], base["bs32"]["tok_s"]) if r is par else "-",
                    f"{max(r['weight_bytes']) / MiB:.1f}",
                    f"{max(r['kv_bytes']) / MiB:.1f}",
                    f"{100 * b32.get('collective_share', 0):.0f}%" if r is par else "-",
                    f"{100 * b32.get('message_share', 0):.2f}%" if r is par else "-",
                    f"{b32.get('message_bytes', 0):.0f}" if r is par else "-",
                    same,
                ]
            )
        share = max(par["weight_bytes"]) / base["weight_bytes"][0]
        if par["model"] == "smollm2-135m":
            goals.append(
                verdict(
                    "weights per rank <= 0.45x tp=1 (smollm2, tp=3)",
                    share <= GOAL_WEIGHT_SHARE,
                    f"{share:.3f}x; the RMSNorm weights stay replicated, the tied embedding "
                    "and lm_head are one vocab-parallel tensor",
                )
            )
        msg = par["bs32"]["message_share"]
        goals.append(
            verdict(
                f"per-step message <= 5% of a decode step ({par['model']}, tp={par['tp']})",
                msg <= GOAL_MESSAGE_SHARE,
                f"{100 * msg:.2f}% at batch 32",
            )
        )
        goals.append(
            verdict(
                f"greedy parity ({par['model']}, tp={par['tp']})",
                rows[-1][-1] is True,
                "same tokens as tp=1 at batch 1 and 32",
            )
        )
    headers = [
        "model", "tp", "bs1 tok/s", "bs32 tok/s", "bs32 vs tp=1", "weights MiB/rank",
        "KV MiB/rank", "collectives", "message", "msg bytes/step", "same tokens",
    ]  # fmt: skip
    print(format_table(headers, rows))
    for g in goals:
        print(g)
    return goals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short smoke run (16 tokens per request)")
    p.add_argument("--json", type=Path, help="also write the results as JSON")
    p.add_argument("--kv-cache-bytes", default="64MiB", help="KV budget per rank")
    p.add_argument(
        "--quantization",
        default="none",
        help="model_quantization for every engine (default none: fp32 weights, where tp>1 must "
        "give exactly tp=1's tokens; packed 4-bit kernels round row-parallel partial sums to "
        "bf16, so greedy runs may part at near-ties)",
    )
    p.add_argument("--device", default="cpu", help="cpu (gloo), or cuda: one GPU per rank (NCCL)")
    p.add_argument(
        "--pairs",
        default=",".join(f"{m}:{n}" for m, n in PAIRS),
        help="MODEL:TP pairs, each run at tp=1 and at TP (default: %(default)s)",
    )
    args = p.parse_args()
    args.tokens = 16 if args.quick else 64
    pairs = [(m, int(n)) for m, n in (pair.rsplit(":", 1) for pair in args.pairs.split(","))]
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    section(f"tensor parallel on {os.cpu_count()} cores ({load_line()})")
    timer = CollectiveTimer()
    timer.install()
    results = [measure(model, tp, args, timer) for model, n in pairs for tp in (1, n)]
    goals = report(results)
    for r in results:
        for b in ("bs1", "bs32"):
            r[b].pop("tokens")
    write_json(args.json, {"results": results, "goals": goals})


if __name__ == "__main__":
    main()
