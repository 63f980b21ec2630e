"""Parallel sampling: n choices of one prompt, kvguard beside OpenVINO GenAI, one run.

Each of the prompts (8 of 512 ordinary tokens by default) is asked for n = 4 sampled choices
of 32 tokens (temperature 0.8, top_p 0.95, EOS ignored), all arriving together. kvguard serves
them as its API serves `n`: one request per choice, choice i seeded with seed + i; with its
prefix cache on (the default) the first choice computes the prompt's full blocks and the
others wait a step and take them from the cache; with it off every choice computes its
prompt. With the cache on it also runs with decode attention reading the blocks the choices
share per sequence rather than once for all of them (`cpu_lowbit.shared_prefix`). OpenVINO
GenAI's `ContinuousBatchingPipeline` (its CPU defaults) gets one request per prompt with
`num_return_sequences = n` (its sequence group forks one computed prompt). Same KV bytes,
`max_num_seqs` and batched-token limit; the default model's GGUF, packed in kvguard.

Measured per engine: output tok/s and seconds; for kvguard the prompt tokens computed (a
choice's prompt tokens found in the cache are not); and how many choices per prompt differ
(sampled, not one answer n times). Goal: with the cache, kvguard computes each prompt once and
serves the run >= 1.5x faster than with it off; reading shared blocks once is faster than
per sequence.

    python bench/choices.py [--quick] [--json FILE] [--threads 2] [--requests 8] [--n 4]
        [--prompt 512]
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
from bench.trace import common_args, format_table, write_json  # noqa: E402

OUTPUT, TEMPERATURE, TOP_P = 32, 0.8, 0.95


def serve_kvguard(
    eng: Kvguard, prompts: list[list[int]], n: int, seed: int
) -> list[list[list[int]]]:
    """Every prompt's n choices, as the API's `n` serves them (one request per choice)."""
    from kvguard.engine import SamplingParams

    engine = eng.engine
    rids = [
        [
            engine.add_request(
                p,
                SamplingParams(
                    max_tokens=OUTPUT,
                    temperature=TEMPERATURE,
                    top_p=TOP_P,
                    seed=seed + i,
                    ignore_eos=True,
                ),
            )
            for i in range(n)
        ]
        for p in prompts
    ]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [[done[r] for r in group] for group in rids]


def serve_openvino(
    eng: OpenVINO, prompts: list[list[int]], n: int, seed: int
) -> list[list[list[int]]]:
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    ids, cfgs = [], []
    for p in prompts:
        ids.append(ov.Tensor(np.array([p], dtype=np.int64)))
        g = og.GenerationConfig()
        g.max_new_tokens = g.min_new_tokens = OUTPUT
        g.ignore_eos, g.do_sample = True, True
        g.temperature, g.top_p, g.top_k = TEMPERATURE, TOP_P, 0
        g.num_return_sequences, g.rng_seed = n, seed
        cfgs.append(g)
    return [[list(s) for s in res.m_generation_ids] for res in eng.pipe.generate(ids, cfgs)]


def main() -> None:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4, help="choices per prompt (default 4)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    args = p.parse_args()
    count = args.requests or (4 if args.quick else 8)
    length = 128 if args.quick else args.prompt
    n = args.n
    # two prompts to warm each engine up, then the timed ones (new to every engine)
    prompts = token_prompts(args.model, count + 2, length, args.seed)
    warm, timed = prompts[:2], prompts[2:]
    section(
        f"parallel sampling: {count} prompts of {length} tokens, n = {n} choices of {OUTPUT} "
        f"tokens each (temperature {TEMPERATURE}, top_p {TOP_P}); {args.threads} threads "
        f"({load_line()})"
    )

    def cached() -> Kvguard:
        return Kvguard(args.model, "auto", args.threads, "int16", True)

    # (engine, prompt per group, shared blocks read once in decode attention)
    makers: list[tuple[str, tuple[str, bool], Any]] = [
        ("kvguard packed", ("on", True), cached),
        ("kvguard packed", ("on", False), cached),
        ("kvguard packed", ("off", True), lambda: Kvguard(args.model, "auto", args.threads)),
        (OpenVINO.name, ("forked", True), lambda: OpenVINO(gguf_path(), args.threads)),
    ]
    results, notes = [], []
    for name, (sharing, read_once), eng in built(makers, notes):
        serve = serve_kvguard if isinstance(eng, Kvguard) else serve_openvino
        with shared_reads(read_once):
            serve(eng, warm, 2, args.seed)  # untimed
            before = eng.engine.snapshot().prefix_cache if isinstance(eng, Kvguard) else {}
            t0 = time.perf_counter()
            outs = serve(eng, timed, n, args.seed)
            wall = time.perf_counter() - t0
        if any(len(c) != OUTPUT for group in outs for c in group) or any(
            len(group) != n for group in outs
        ):
            raise SystemExit(f"{name}: choices or lengths differ from the request")
        r: dict[str, Any] = {"engine": name, "prompt_sharing": sharing, "seconds": wall}
        r["shared_reads_once"] = read_once
        r["tok_s"] = count * n * OUTPUT / wall
        if isinstance(eng, Kvguard):
            pc = eng.engine.snapshot().prefix_cache
            queried = pc["queried_tokens"] - before["queried_tokens"]
            hits = pc["hit_tokens"] - before["hit_tokens"]
            # with the cache off nothing is looked up: every choice computes its prompt
            r["prompt_tokens_computed"] = queried - hits if sharing == "on" else count * n * length
        r["distinct"] = sum(len({tuple(c) for c in group}) for group in outs) / count
        results.append(r)
        del eng
    off = next(r for r in results if r["prompt_sharing"] == "off")
    rows = [
        [
            r["engine"],
            r["prompt_sharing"],
            "-" if r["engine"] == OpenVINO.name else "once" if r["shared_reads_once"] else "each",
            f"{r['tok_s']:.1f}",
            f"{r['seconds']:.2f}",
            ratio(r["tok_s"], off["tok_s"]),
            f"{r['prompt_tokens_computed']}/{count * n * length}"
            if "prompt_tokens_computed" in r
            else "-",
            f"{r['distinct']:.2f}/{n}",
        ]
        for r in results
    ]
    headers = [
        "engine",
        "prompt per group",
        "shared blocks read",
        "tok/s",
        "s",
        "vs kvguard off",
        "prompt tokens computed",
        "distinct choices",
    ]
    print(format_table(headers, rows))
    on = next(r for r in results if r["prompt_sharing"] == "on" and r["shared_reads_once"])
    each = next(r for r in results if r["prompt_sharing"] == "on" and not r["shared_reads_once"])
    peer = next((r for r in results if r["engine"] == OpenVINO.name), None)
    if peer:
        print(f"kvguard (cache on) vs {OpenVINO.name}: {ratio(on['tok_s'], peer['tok_s'])} tok/s")
    if notes:
        print("\n".join(notes))
    speed = on["tok_s"] / off["tok_s"]
    # each prompt once: its length, plus what each other choice recomputes past the full blocks
    once = on["prompt_tokens_computed"] <= count * (length + (n - 1) * 16)
    goals = [
        verdict(
            "kvguard computes each prompt once with the cache",
            once,
            f"{on['prompt_tokens_computed']} prompt tokens for {count} prompts of {length}",
        ),
        verdict("kvguard >= 1.5x with the cache", speed >= 1.5, f"{speed:.2f}x"),
        verdict(
            "kvguard reads shared blocks once faster than per sequence",
            on["tok_s"] > each["tok_s"],
            f"{on['tok_s'] / each['tok_s']:.2f}x",
        ),
    ]
    print("\n".join(goals))
    write_json(args.json, {"prompts": count, "n": n, "prompt_tokens": length, "results": results})


if __name__ == "__main__":
    main()
