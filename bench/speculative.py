"""Speculative decoding by prompt lookup: kvguard with drafts off and on, beside OpenVINO GenAI's
prompt lookup off and on, one run.

Two workloads of chat requests to the default model, greedy, ending where the model ends them
(an end-of-sequence token) or at `--max-tokens`:

- `grounded`: asks whose answer reuses the request's own text (repeat a passage, fix its typos,
  turn it into a list, say what it is about), each of four passages written for this benchmark;
  the workload prompt lookup is for;
- `open`: asks with no text to draw on (a poem, tips, a story, an explanation); drafts rarely
  match, so this measures what trying them costs.

Each workload is served one request at a time (batch 1: the latency a single user sees) and all
its requests together. kvguard (the default GGUF packed, `serving.speculative_tokens` switched
live on one engine, the reload's path) and OpenVINO GenAI's `ContinuousBatchingPipeline` on the
same GGUF (its CPU defaults; prompt lookup is a property it is built with, so two pipelines)
get the same token-id prompts, the same draft length (`--draft`, OpenVINO's
`num_assistant_tokens`) and n-gram size (3, its `max_ngram_size`). kvguard runs drafts two
ways: `on`, its default, where a draft position runs only if its chance of bringing a token
pays for its row (the row's cost learnt from the engine's steps), and `every match`
(`speculative_row_cost: 0`), drafting whenever a match is found, as OpenVINO does. Each cell
is the median of `--repeats` rounds, the modes alternating within a round.

Measured: output tokens/s, the speed-up of drafts over none per engine and mode, kvguard's
drafts proposed and kept, and whether drafts changed any engine's output (greedy: they must
not).
Goals: kvguard's outputs the same with drafts on; grounded requests one at a time >= 1.5x
with drafts; open requests with drafts >= 0.95x without (trying costs next to nothing).

    python bench/speculative.py [--quick] [--json FILE] [--threads 2] [--draft 4]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import load_line, make_engine, ratio, section, step_apply, verdict  # noqa: E402
from bench.quantized import (  # noqa: E402
    KV_BYTES,
    MAX_BATCHED,
    MAX_NUM_SEQS,
    OpenVINO,
    gguf_path,
    ov_greedy,
)
from bench.trace import common_args, format_table, write_json  # noqa: E402

NGRAM = 3
PASSAGES = [
    "The night shift at the bakery starts at ten. First the ovens are lit and the flour is "
    "weighed, then the dough for the morning loaves is mixed, folded and left to rise in cool "
    "rooms. By three the first trays go in, and by six the shelves are full of bread that will "
    "be sold before noon.",
    "A lighthouse keeper once kept a log of every ship that passed. Each entry gave the time, "
    "the weather, the ship's flag and where it was bound. Over forty years the log filled "
    "twelve books, and historians now read them to learn how trade on the coast changed.",
    "To plant a tree, dig a hole twice as wide as its roots and no deeper than they are. Set "
    "the tree in straight, fill the hole with the soil you took out, and water it slowly. For "
    "the first summer, water it once a week unless it rains, and keep grass away from its trunk.",
    "Our team meets on Monday to plan the week. Everyone says what they finished, what they "
    "will work on next, and what is blocking them. The meeting lasts fifteen minutes, and "
    "anything that needs a longer talk is taken up afterwards by the people it concerns.",
]
GROUNDED_ASKS = [
    "Repeat this text exactly:",
    "Fix any typos in this text:",
    "Rewrite this text as a bulleted list:",
    "What is this text about? Quote it.",
]
OPEN_ASKS = [
    "Write a short poem about the sea.",
    "Give three tips for learning a new language.",
    "Tell a short story about a cat that got lost.",
    "Explain why the sky is blue.",
    "Describe a good breakfast.",
    "What should I pack for a weekend in the mountains?",
    "Write a friendly note inviting a neighbour to dinner.",
    "List some ways to save energy at home.",
]


def workloads(tok: Any, n: int) -> dict[str, list[list[int]]]:
    """Token-id prompts (the chat template applied) of each workload, `n` requests each."""

    def chat(content: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}], True))

    grounded = [chat(f"{GROUNDED_ASKS[i % 4]}\n\n{PASSAGES[(i + i // 4) % 4]}") for i in range(n)]
    return {"grounded": grounded, "open": [chat(OPEN_ASKS[i % 8]) for i in range(n)]}


class Kvguard:
    name = "kvguard packed"

    def __init__(self, model: str, threads: int, draft: int) -> None:
        self.engine = make_engine(
            model,
            threads,
            kv_cache_bytes=KV_BYTES,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_BATCHED,
            enable_prefix_caching=False,  # runs repeat their prompts; OpenVINO runs without
            speculative_ngram=NGRAM,
            speculative_max_batch=MAX_NUM_SEQS,  # drafts for every batch this bench runs
        )
        self.draft = draft
        self.stop = set(self.engine.eos_ids)

    modes = ("off", "on", "every match")

    def set_mode(self, mode: str) -> None:
        """off; on (a draft position where it pays for its row, the row's cost learnt from the
        steps: the default); every match (row cost 0: drafts whenever a match is found)."""
        eng = self.engine
        knobs = {
            ("speculative_tokens",): 0 if mode == "off" else self.draft,
            ("speculative_row_cost",): 0.0 if mode == "every match" else None,
        }
        res = step_apply(eng, eng.reconfigure(knobs))
        if not res.ok:
            raise SystemExit(f"kvguard refused the draft settings: {res.detail}")

    def counts(self) -> tuple[int, int]:
        s = self.engine.snapshot().speculative
        return s["drafted"], s["accepted"]

    def serve(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from kvguard.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return [list(o.token_ids) for o in self.engine.generate(prompts, params)]


class OpenVINOLookup:
    """Two pipelines on the same GGUF, prompt lookup off and on (a construction property)."""

    name = OpenVINO.name

    def __init__(self, threads: int, draft: int, stop: set[int]) -> None:
        import openvino_genai as og

        path = str(gguf_path())
        plain = OpenVINO(gguf_path(), threads)
        sc = og.SchedulerConfig()
        sc.cache_size = KV_BYTES >> 30
        sc.max_num_seqs = MAX_NUM_SEQS
        sc.max_num_batched_tokens = MAX_BATCHED
        sc.dynamic_split_fuse = True
        props = {"INFERENCE_NUM_THREADS": threads, "prompt_lookup": True}
        self.pipes = {
            False: plain.pipe,
            True: og.ContinuousBatchingPipeline(path, sc, "CPU", props),
        }
        self.draft, self.stop, self.on = draft, stop, False

    modes = ("off", "on")

    def set_mode(self, mode: str) -> None:
        self.on = mode == "on"

    def counts(self) -> None:
        return None  # the pipeline does not say how many drafts it kept

    def serve(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        ids, cfgs = [], []
        for p in prompts:
            tensor, g = ov_greedy(p, max_tokens, self.stop)
            ids.append(tensor)
            if self.on:
                g.num_assistant_tokens, g.max_ngram_size = self.draft, NGRAM
            cfgs.append(g)
        outs = [list(r.m_generation_ids[0]) for r in self.pipes[self.on].generate(ids, cfgs)]
        return [o[:-1] if o and o[-1] in self.stop else o for o in outs]  # as kvguard counts


def served(engine: Any, prompts: list[list[int]], together: bool, max_tokens: int) -> tuple:
    """(seconds, outputs): all prompts in one call, or one call each."""
    t0 = time.perf_counter()
    if together:
        outs = engine.serve(prompts, max_tokens)
    else:
        outs = [engine.serve([p], max_tokens)[0] for p in prompts]
    return time.perf_counter() - t0, outs


def measure(engine: Any, prompts: list[list[int]], together: bool, args: Any) -> dict:
    """Each of the engine's modes in turn, `args.repeats` rounds: median tok/s, the outputs
    compared with drafts off, and (kvguard) drafts proposed and kept in the last round."""
    walls: dict[str, list[float]] = {m: [] for m in engine.modes}
    outs: dict[str, list[list[int]]] = {}
    kept: dict[str, tuple[int, int] | None] = {}
    for _ in range(args.repeats):
        for mode in engine.modes:
            engine.set_mode(mode)
            before = engine.counts()
            wall, outs[mode] = served(engine, prompts, together, args.max_tokens)
            walls[mode].append(wall)
            after = engine.counts()
            kept[mode] = None if before is None else (after[0] - before[0], after[1] - before[1])
    tokens = {m: sum(len(o) for o in outs[m]) for m in engine.modes}
    return {
        "tok_s": {m: tokens[m] / statistics.median(walls[m]) for m in engine.modes},
        "tokens": tokens,
        "walls": walls,
        "same": {m: outs[m] == outs["off"] for m in engine.modes if m != "off"},
        "drafted_kept": kept,
    }


def main() -> None:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--draft", type=int, default=4, help="draft tokens per step (default 4)")
    p.add_argument("--max-tokens", type=int, default=0, help="answer limit (default 160)")
    p.add_argument("--repeats", type=int, default=0, help="runs per cell (default 3)")
    args = p.parse_args()
    n = args.requests or (4 if args.quick else 8)
    args.max_tokens = args.max_tokens or (48 if args.quick else 160)
    args.repeats = args.repeats or (1 if args.quick else 3)
    section(
        f"prompt lookup: {n} grounded and {n} open chat requests, greedy, at most "
        f"{args.max_tokens} tokens, draft {args.draft}, n-gram {NGRAM}; {args.threads} threads "
        f"({load_line()})"
    )
    kv = Kvguard(args.model, args.threads, args.draft)
    loads = workloads(kv.engine.tokenizer, n)
    engines: list[Any] = [kv]
    notes = []
    try:
        engines.append(OpenVINOLookup(args.threads, args.draft, kv.stop))
    except ImportError as e:
        notes.append(f"openvino-genai not installed ({e}): pip install openvino-genai")
    results = []
    for engine in engines:
        for mode in engine.modes:  # untimed warm-up of every path
            engine.set_mode(mode)
            engine.serve(loads["grounded"][:2], 16)
        for load, prompts in loads.items():
            for together in (False, True):
                r = measure(engine, prompts, together, args)
                r |= {"engine": engine.name, "workload": load, "together": together}
                results.append(r)
    rows = []
    for r in results:
        t, kept, same = r["tok_s"], r["drafted_kept"], r["same"]

        def drafts(mode: str, kept: dict = kept) -> str:
            k = kept.get(mode)
            return "-" if k is None else f"{k[1]}/{k[0]}"

        rows.append(
            [
                r["engine"],
                r["workload"],
                f"all {n} together" if r["together"] else "one at a time",
                f"{t['off']:.1f}",
                f"{t['on']:.1f}",
                ratio(t["on"], t["off"]),
                drafts("on"),
                f"{t['every match']:.1f}" if "every match" in t else "-",
                ratio(t.get("every match"), t["off"]),
                drafts("every match"),
                "/".join(str(r["tokens"][m]) for m in t),
                "yes" if all(same.values()) else "NO",
            ]
        )
    headers = ["engine", "workload", "requests", "off tok/s", "on tok/s", "on/off", "kept",
               "every match tok/s", "/off", "kept", "tokens", "same output"]  # fmt: skip
    print(format_table(headers, rows))
    for note in notes:
        print(note)

    def cell(engine: str, load: str, together: bool) -> dict | None:
        return next(
            (
                r
                for r in results
                if (r["engine"], r["workload"], r["together"]) == (engine, load, together)
            ),
            None,
        )

    for load in loads:
        for together in (False, True):
            ours, peer = cell(Kvguard.name, load, together), cell(OpenVINO.name, load, together)
            if peer:
                print(
                    f"{load}, {'together' if together else 'one at a time'}: kvguard with drafts "
                    f"{ratio(ours['tok_s']['on'], peer['tok_s']['on'])} OpenVINO GenAI's with "
                    f"prompt lookup, {ratio(ours['tok_s']['off'], peer['tok_s']['off'])} without"
                )
    mine = [r for r in results if r["engine"] == Kvguard.name]
    same = all(all(r["same"].values()) for r in mine)
    alone = cell(Kvguard.name, "grounded", False)["tok_s"]
    open_ = [cell(Kvguard.name, "open", t)["tok_s"] for t in (False, True)]
    worst = min(t["on"] / t["off"] for t in open_)
    print(verdict("kvguard outputs the same with drafts on", same,
                  f"{sum(all(r['same'].values()) for r in mine)}/{len(mine)} cells"))  # fmt: skip
    print(verdict("grounded one at a time >= 1.5x with drafts", alone["on"] >= 1.5 * alone["off"],
                  ratio(alone["on"], alone["off"])))  # fmt: skip
    print(verdict("open requests >= 0.95x with drafts", worst >= 0.95, f"worst {worst:.2f}x"))
    write_json(
        args.json,
        {
            "requests": n,
            "max_tokens": args.max_tokens,
            "draft": args.draft,
            "ngram": NGRAM,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
