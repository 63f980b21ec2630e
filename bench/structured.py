"""Structured output: answers held to a JSON schema, kvguard beside OpenVINO GenAI, one run.

The workload an application that parses answers sends: chat requests asking the default model
to describe a person as JSON (each its own name, age and job), answered greedily with at most
64 tokens, first free and then held to one schema (name: string, age: integer, job: string,
nothing else). The same token ids go to kvguard (packed, `SamplingParams.json_schema`, what
the API's `response_format` sets) and to OpenVINO GenAI's `ContinuousBatchingPipeline`
(`StructuredOutputConfig(json_schema=...)`) on the same GGUF, all requests arriving together. kvguard runs the schema twice: with its
jump-forward (the tokens the schema forces, its keys and punctuation, appended at once and
computed in one chunk; the default) and drawing every token, and serves 8 constrained
answers one at a time each way (the latency of an answer alone).

Measured per engine and mode: wall seconds, answers/s and output tokens/s; answers that parse
as JSON; answers that match the schema; answers the engine ended itself (its grammar closed or
an end-of-sequence token) rather than at the token limit; for kvguard, the time its grammars
took (each token's mask and advance, as the engine counts them for
`kvguard_grammar_seconds_total`), per constrained token and as a share of the run. (A
constrained answer is shorter than a free one, so tokens/s, which spreads the same prompts
over fewer tokens, is not the cost of constraining; the grammar time is.) Goals: every
constrained kvguard answer matches the schema; grammar work <= 5% of the constrained run.

    python bench/structured.py [--quick] [--json FILE] [--threads 2] [--requests 16]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import load_line, ratio, section, verdict  # noqa: E402
from bench.quantized import Kvguard, OpenVINO, gguf_path, ov_greedy  # noqa: E402
from bench.trace import common_args, format_table, write_json  # noqa: E402

MAX_TOKENS = 64
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "job": {"type": "string"},
    },
    "required": ["name", "age", "job"],
    "additionalProperties": False,
}
NAMES = ["Ada", "Alan", "Grace", "Linus", "Margaret", "Dennis", "Barbara", "Ken"]
JOBS = ["engineer", "teacher", "pilot", "baker", "nurse", "farmer", "painter", "chemist"]


def asks(n: int) -> list[str]:
    return [
        f"Describe {NAMES[i % 8]}, aged {20 + 3 * i}, who works as a {JOBS[(i * 3) % 8]}, as JSON."
        for i in range(n)
    ]


def matches(text: str) -> tuple[bool, bool]:
    """(parses as JSON, matches SCHEMA)."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return False, False
    ok = (
        isinstance(v, dict)
        and set(v) == {"name", "age", "job"}
        and isinstance(v["name"], str)
        and isinstance(v["job"], str)
        and isinstance(v["age"], int)
        and not isinstance(v["age"], bool)
    )
    return True, ok


class KvguardJson:
    name = "kvguard packed"

    def __init__(self, model: str, threads: int) -> None:
        self.engine = Kvguard(model, "auto", threads).engine

    def grammar_seconds(self) -> float:
        """What the engine counts in its grammars' masks and advances (the metric's source)."""
        return self.engine.grammars.seconds

    def serve(self, prompts: list[list[int]], schema: dict[str, Any] | None) -> list[list[int]]:
        from kvguard.engine import SamplingParams

        params = [SamplingParams(max_tokens=MAX_TOKENS, json_schema=schema) for _ in prompts]
        return [list(o.final_token_ids) for o in self.engine.generate(prompts, params)]


class OpenVINOJson:
    name = OpenVINO.name

    def __init__(self, threads: int, stop_ids: set[int]) -> None:
        self.pipe = OpenVINO(gguf_path(), threads).pipe
        self.stop_ids = stop_ids

    def grammar_seconds(self) -> None:
        """Not measurable from outside the pipeline."""
        return None

    def serve(self, prompts: list[list[int]], schema: dict[str, Any] | None) -> list[list[int]]:
        import openvino_genai as og

        ids, cfgs = [], []
        for p in prompts:
            tensor, g = ov_greedy(p, MAX_TOKENS, self.stop_ids)
            ids.append(tensor)
            if schema is not None:
                g.structured_output_config = og.StructuredOutputConfig(
                    json_schema=json.dumps(schema)
                )
            cfgs.append(g)
        return [list(r.m_generation_ids[0]) for r in self.pipe.generate(ids, cfgs)]


def run(
    engine: Any, prompts: list[list[int]], schema: Any, tok: Any, stop: set[int], label: str = ""
) -> dict:
    engine.serve(prompts[:2], schema)  # untimed warm-up (and the grammar library's setup)
    grammar_s0 = engine.grammar_seconds()
    t0 = time.perf_counter()
    outs = engine.serve(prompts, schema)
    wall = time.perf_counter() - t0
    grammar_s = engine.grammar_seconds()
    texts = [tok.decode([t for t in o if t not in stop]) for o in outs]
    checks = [matches(t) for t in texts]
    return {
        "engine": engine.name,
        "schema": schema is not None,
        "output": label or ("schema" if schema is not None else "free"),
        "wall_s": wall,
        "tokens": sum(len(o) for o in outs),
        "tok_s": sum(len(o) for o in outs) / wall,
        "answers_s": len(outs) / wall,
        "grammar_s": None if grammar_s is None or schema is None else grammar_s - grammar_s0,
        "json": sum(c[0] for c in checks),
        "valid": sum(c[1] for c in checks),
        "ended": sum(len(o) < MAX_TOKENS or o[-1] in stop for o in outs),
        "sample": texts[0],
    }


def one_at_a_time(kv: KvguardJson, prompts: list[list[int]], jump: bool) -> float:
    """Mean seconds of a constrained answer served alone (each after the one before)."""
    kv.engine.config.grammar_jump_forward = jump
    kv.serve(prompts[:1], SCHEMA)  # untimed
    t0 = time.perf_counter()
    for p in prompts:
        kv.serve([p], SCHEMA)
    return (time.perf_counter() - t0) / len(prompts)


def main() -> None:
    p = common_args(__doc__.split("\n\n")[0])
    args = p.parse_args()
    n = args.requests or (4 if args.quick else 16)
    section(
        f"structured output: {n} chat requests for a person as JSON, at most {MAX_TOKENS} "
        f"tokens, greedy; {args.threads} threads ({load_line()})"
    )
    kv = KvguardJson(args.model, args.threads)
    tok, stop = kv.engine.tokenizer, set(kv.engine.eos_ids)
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": a}], True)) for a in asks(n)
    ]
    results = [run(kv, prompts, s, tok, stop) for s in (None, SCHEMA)]
    kv.engine.config.grammar_jump_forward = False  # every token drawn, forced ones too
    results.append(run(kv, prompts, SCHEMA, tok, stop, "schema, no jump"))
    alone = {jump: one_at_a_time(kv, prompts[:8], jump) for jump in (True, False)}
    del kv
    peer_error = ""
    try:
        ov_engine = OpenVINOJson(args.threads, stop)
    except ImportError as e:
        peer_error = f"openvino-genai not installed ({e}): pip install openvino-genai"
    else:
        results += [run(ov_engine, prompts, s, tok, stop) for s in (None, SCHEMA)]
    rows = []
    for r in results:
        g = r["grammar_s"]
        rows.append(
            [
                r["engine"],
                r["output"],
                f"{r['wall_s']:.2f}",
                f"{r['answers_s']:.2f}",
                f"{r['tok_s']:.1f}",
                r["tokens"],
                f"{r['json']}/{n}",
                f"{r['valid']}/{n}",
                f"{r['ended']}/{n}",
                "-" if g is None else f"{g / r['tokens'] * 1e3:.3f}",
                "-" if g is None else ratio(100 * g, r["wall_s"], "%"),
            ]
        )
    headers = ["engine", "output", "wall s", "answers/s", "tok/s", "tokens", "parses as JSON",
               "matches schema", "ended by engine", "grammar ms/token", "grammar share"]  # fmt: skip
    print(format_table(headers, rows))
    for r in results:
        print(f"{r['engine']} ({r['output']}), first answer: "
              f"{r['sample'][:100]!r}")  # fmt: skip
    if peer_error:
        print(peer_error)
    on = next(r for r in results if r["engine"] == KvguardJson.name and r["output"] == "schema")
    drawn = next(r for r in results if r["output"] == "schema, no jump")
    off = next(r for r in results if r["engine"] == KvguardJson.name and not r["schema"])
    share = on["grammar_s"] / on["wall_s"]
    peer = next((r for r in results if r["engine"] == OpenVINOJson.name and r["schema"]), None)
    if peer:
        print(
            f"kvguard vs {OpenVINOJson.name}, both with the schema: "
            f"{ratio(on['answers_s'], peer['answers_s'])} the answers/s, "
            f"{on['valid']}/{n} against {peer['valid']}/{n} matching"
        )
    print(
        f"kvguard with the schema: {ratio(on['answers_s'], off['answers_s'])} the answers/s "
        f"of free answers; jump-forward {ratio(on['answers_s'], drawn['answers_s'])} the "
        "answers/s of drawing every token"
    )
    print(
        f"kvguard, one constrained answer at a time: {alone[True] * 1e3:.0f} ms with "
        f"jump-forward, {alone[False] * 1e3:.0f} ms drawing every token "
        f"({ratio(alone[False], alone[True])} faster)"
    )
    print(verdict("every constrained kvguard answer matches the schema", on["valid"] == n,
                  f"{on['valid']}/{n}"))  # fmt: skip
    print(verdict("grammar work <= 5% of the constrained run", share <= 0.05, f"{share:.1%}"))
    write_json(
        args.json,
        {"requests": n, "max_tokens": MAX_TOKENS, "results": results, "alone_s": alone},
    )


if __name__ == "__main__":
    main()
