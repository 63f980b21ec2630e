"""A shared system prompt: kvguard's prefix cache on vs off, beside OpenVINO GenAI's, one run.

The workload a chat service sees: every request begins with the same system prompt (512
ordinary tokens by default) and then its own question (32 tokens), and is answered with 32
tokens (greedy, EOS ignored). The default model's GGUF serves it packed in kvguard and loaded
by OpenVINO GenAI's `ContinuousBatchingPipeline` (its CPU defaults), each with its prefix cache
on and off (`enable_prefix_caching`), the same KV bytes, `max_num_seqs` and batched-token limit;
kvguard with the cache on also once with decode attention reading the system prompt's blocks
per sequence instead of once for all the requests (`cpu_lowbit.shared_prefix`).

Each engine first serves a cold burst: the same number of other questions, all arriving
together on an engine that has never seen the system prompt (timed: a service's first burst,
where kvguard's first request computes the shared blocks and the others take them from the
cache a step later). Then two more questions, untimed (a service that has answered before).
Measured per engine: the cold burst in output tokens/s; the whole trace (all requests arrive together)
in output tokens/s and seconds; the time to first token of one more request on the idle engine
after the trace (its system prompt cached, its question new: a one-token request's wall time);
for kvguard the trace's prompt tokens served from the cache; and how many outputs are the same
with the cache as without (the engine's own cache-off run). Goal: the cache makes kvguard's
cold burst and trace >= 1.5x faster and its warm first token >= 3x faster than with the cache
off.

    python bench/prefix_cache.py [--quick] [--json FILE] [--threads 2] [--requests 32]
        [--system 512]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import (  # noqa: E402
    load_line,
    ratio,
    section,
    shared_reads,
    token_prompts,
    verdict,
)
from bench.quantized import Kvguard, OpenVINO, built, gguf_path  # noqa: E402
from bench.trace import TraceRequest, common_args, format_table, write_json  # noqa: E402

QUESTION, ANSWER = 32, 32
EACH = "kvguard, reads each"  # cache on, decode attention reading shared blocks per sequence


def shared_trace(model: str, n: int, system: int, seed: int) -> list[TraceRequest]:
    """`n` requests: one `system`-token prefix, each with its own 32-token question."""
    prefix = token_prompts(model, 1, system, seed + 1000)[0]
    return [TraceRequest(prefix + q, ANSWER) for q in token_prompts(model, n, QUESTION, seed)]


def warm_ttft(engine: Any, prompt: list[int]) -> float:
    """Wall seconds of a one-token request on the idle engine."""
    t0 = time.perf_counter()
    engine.serve([TraceRequest(prompt, 1)])
    return time.perf_counter() - t0


def main() -> None:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--system", type=int, default=512, help="system prompt tokens (default 512)")
    args = p.parse_args()
    n = args.requests or (8 if args.quick else 32)
    system = 128 if args.quick else args.system
    # n questions for the cold burst, n for the trace, two to warm up, one for the warm TTFT
    every = shared_trace(args.model, 2 * n + 3, system, args.seed)
    cold, trace, extra = every[:n], every[n : 2 * n], every[2 * n :]
    section(
        f"shared system prompt: {n} requests of {system} + {QUESTION} prompt tokens, "
        f"{ANSWER} out; {args.threads} threads ({load_line()})"
    )

    def cached() -> Kvguard:
        return Kvguard(args.model, "auto", args.threads, "int16", True)

    # (engine, (prefix cache, shared blocks read once in decode attention))
    makers: list[tuple[str, tuple[bool, bool], Any]] = [
        ("kvguard packed", (True, True), cached),
        (EACH, (True, False), cached),
        ("kvguard packed", (False, True), lambda: Kvguard(args.model, "auto", args.threads)),
        (
            OpenVINO.name,
            (True, True),
            lambda: OpenVINO(gguf_path(), args.threads, prefix_caching=True),
        ),
        (OpenVINO.name, (False, True), lambda: OpenVINO(gguf_path(), args.threads)),
    ]
    results, notes = [], []
    for name, (cache, read_once), eng in built(makers, notes):
        with shared_reads(read_once):
            t0 = time.perf_counter()
            eng.serve(cold)  # the system prompt's first burst
            cold_s = time.perf_counter() - t0
            eng.serve([TraceRequest(r.prompt_ids, 2) for r in extra[:2]])  # untimed warm-up
            before = eng.engine.snapshot().prefix_cache if isinstance(eng, Kvguard) else {}
            t0 = time.perf_counter()
            outs = eng.serve(trace)
            wall = time.perf_counter() - t0
            warm_s = warm_ttft(eng, extra[2].prompt_ids)
        if isinstance(eng, Kvguard):  # the trace's own prompt tokens, found / looked up
            pc = eng.engine.snapshot().prefix_cache
            r_cached = {k: pc[k] - before[k] for k in ("hit_tokens", "queried_tokens")}
        if [len(o) for o in outs] != [ANSWER] * n:
            raise SystemExit(f"{name}: output lengths differ from the trace")
        r: dict[str, Any] = {"engine": name, "prefix_cache": cache, "trace_s": wall}
        r["trace_tok_s"] = n * ANSWER / wall
        r["cold_tok_s"] = n * ANSWER / cold_s
        r["warm_ttft_s"] = warm_s
        if isinstance(eng, Kvguard):
            r["cached_tokens"], r["queried_tokens"] = r_cached.values()
        r["outputs"] = outs
        results.append(r)
        del eng

    def cache_off(r: dict[str, Any]) -> dict[str, Any]:
        engine = "kvguard packed" if r["engine"] == EACH else r["engine"]
        return next(o for o in results if o["engine"] == engine and not o["prefix_cache"])

    for r in results:
        off = cache_off(r)
        r["same_as_off"] = sum(a == b for a, b in zip(r["outputs"], off["outputs"], strict=True))
    by = {(r["engine"], r["prefix_cache"]): r for r in results}
    rows = []
    for r in results:
        off = cache_off(r)
        cached = r.get("cached_tokens")
        rows.append(
            [
                r["engine"],
                "on" if r["prefix_cache"] else "off",
                f"{r['cold_tok_s']:.1f}",
                f"{r['trace_tok_s']:.1f}",
                f"{r['trace_s']:.2f}",
                ratio(r["trace_tok_s"], off["trace_tok_s"]),
                f"{r['warm_ttft_s'] * 1e3:.0f}",
                ratio(off["warm_ttft_s"], r["warm_ttft_s"]),
                "-" if cached is None else f"{cached}/{r['queried_tokens']}",
                f"{r['same_as_off']}/{n}",
            ]
        )
    headers = [
        "engine",
        "prefix cache",
        "cold burst tok/s",
        "trace tok/s",
        "trace s",
        "vs cache off",
        "warm TTFT ms",
        "TTFT speed-up",
        "prompt tokens cached",
        "same as off",
    ]
    print(format_table(headers, rows))
    kv_on, kv_off = by[("kvguard packed", True)], by[("kvguard packed", False)]
    peer = by.get((OpenVINO.name, True))
    if peer:
        print(
            f"kvguard (cache on) vs {OpenVINO.name} (cache on): cold burst "
            f"{ratio(kv_on['cold_tok_s'], peer['cold_tok_s'])}, trace "
            f"{ratio(kv_on['trace_tok_s'], peer['trace_tok_s'])}, warm TTFT "
            f"{ratio(peer['warm_ttft_s'], kv_on['warm_ttft_s'])} faster"
        )
    if notes:
        print("\n".join(notes))
    speed = kv_on["trace_tok_s"] / kv_off["trace_tok_s"]
    ttft = kv_off["warm_ttft_s"] / kv_on["warm_ttft_s"]
    cold = kv_on["cold_tok_s"] / kv_off["cold_tok_s"]
    goals = [
        verdict("kvguard cold burst >= 1.5x with the cache", cold >= 1.5, f"{cold:.2f}x"),
        verdict("kvguard trace >= 1.5x with the cache", speed >= 1.5, f"{speed:.2f}x"),
        verdict("kvguard warm TTFT >= 3x faster with the cache", ttft >= 3, f"{ttft:.2f}x"),
    ]
    each = by.get((EACH, True))
    if each:
        once = kv_on["trace_tok_s"] / each["trace_tok_s"]
        goals.append(
            verdict(
                "kvguard reads the system prompt's blocks once faster than per sequence",
                once > 1,
                f"trace {once:.2f}x",
            )
        )
    print("\n".join(goals))
    for r in results:
        del r["outputs"]
    write_json(args.json, {"system_tokens": system, "requests": n, "results": results})


if __name__ == "__main__":
    main()
