"""Offline throughput: kvguard versus Hugging Face transformers on one fixed trace, in one run.

Every engine gets the same requests (token ids, exact output lengths, greedy), the same model
files, the same torch thread count and, where the engine has a KV budget, the same bytes:

- kvguard: `LLMEngine.generate` on the whole trace (continuous batching over a paged cache),
  on the transformers peers' weights: the converted directory in fp32
  (`model_quantization: none`, a GGUF dequantised), so the goals compare batching, not
  kernels. Where the model is served packed by default (`auto`: smollm2-135m's 4-bit weights),
  that engine gets its own row, `kvguard as served (packed)`, reported beside the others and
  left out of the goals.
- transformers `generate`, static batches of 16 and of 32 in arrival order, left-padded with an
  attention mask. A static batch runs until its longest request is done; only each request's
  own requested tokens count as output, the rest is the waste static batching pays.
- transformers continuous batching (its `ContinuousBatchingManager`, what `generate_batch`
  wraps; driven directly because `generate_batch` takes one `max_new_tokens` for all requests
  and this trace gives each its own), with kvguard's KV bytes, page size and batch limits.
  If it cannot run here, its row says why.

Each engine serves a small warm-up batch (ids from the model's vocabulary) outside the timed
region. kvguard's prefix cache is off: a repeated round would find its prompts cached. With
`--rounds N` the engines take turns N times and each keeps its fastest round, so a burst of load
from other processes on a shared machine hurts no engine more than another. Goals stated by the
issue:
kvguard >= 2x static generate and ahead of continuous batching.

    python bench/throughput.py [--quick] [--rounds N] [--json FILE] [--threads N]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# One OpenMP wait policy for every engine in the run, set before torch loads libgomp. Under the
# default, libgomp workers spin-wait, and switch to a short spin only once a second thread owns an
# OpenMP team (as transformers' continuous-batching thread does): engines in one process would run
# under different policies, and on a host shared with other work the spinning is several times
# slower. OMP_WAIT_POLICY in the environment overrides this.
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
    ordinary_token_ids,
    spec_from_args,
    trace_summary,
    write_json,
)

AGREE_PREFIX = 16  # greedy outputs are compared on their first tokens (fp drift can fork later)
PACKED_NAME = "kvguard as served (packed)"  # reported beside the others, not in the goals

Outputs = list[list[int]]
Serve = Callable[[Sequence[TraceRequest]], Outputs]
# Warm up, then time one pass over the trace: (wall seconds, outputs).
Measure = Callable[[Sequence[TraceRequest]], tuple[float, Outputs]]


@dataclass(frozen=True, slots=True)
class Limits:
    """The knobs every engine with a KV budget gets identically."""

    kv_cache_bytes: int
    max_num_seqs: int
    max_batched_tokens: int
    block_size: int = 16


@dataclass(slots=True)
class Contender:
    name: str
    measure: Measure
    note: str = ""
    walls: list[float] = field(default_factory=list)
    outputs: Outputs = field(default_factory=list, repr=False)
    failure: str = ""  # set when the engine cannot run here
    in_goals: bool = True  # False: a row reported for information, never judged
    engine: Any = field(default=None, repr=False)  # kvguard's engine, where this is kvguard

    @property
    def wall_s(self) -> float | None:
        return min(self.walls) if self.walls else None


def warmup_requests(vocab: Sequence[int]) -> list[TraceRequest]:
    """The untimed warm-up batch: two short prompts of ordinary ids of the model's own
    vocabulary (`ordinary_token_ids`), taken from its middle."""
    mid = len(vocab) // 2
    return [
        TraceRequest([vocab[(mid + i) % len(vocab)] for i in range(24)], 4),
        TraceRequest([vocab[(mid + 24 + i) % len(vocab)] for i in range(40)], 6),
    ]


def warm_then_time(serve: Serve, warmup: Sequence[TraceRequest]) -> Measure:
    def measure(trace: Sequence[TraceRequest]) -> tuple[float, Outputs]:
        serve(warmup)
        t0 = time.perf_counter()
        out = serve(trace)
        return time.perf_counter() - t0, out

    return measure


def check_lengths(name: str, trace: Sequence[TraceRequest], outputs: Outputs) -> None:
    """Throughput is only comparable if every engine produced exactly the requested tokens."""
    got = [len(o) for o in outputs]
    want = [r.output_len for r in trace]
    if got != want:
        bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w][:5]
        raise SystemExit(f"{name}: wrong output lengths for requests {bad}")


# ----------------------------------------------------------------------------- kvguard


def kvguard_contender(
    model: str,
    limits: Limits,
    threads: int,
    warmup: Sequence[TraceRequest],
    quantization: str = "none",
    name: str = "kvguard",
) -> Contender:
    """kvguard on the trace. `quantization` "none" (the goals' contender) serves the very
    weights the transformers peers load; "auto" serves the model as `kvguard serve` does
    (smollm2-135m's 4-bit weights packed). The prefix cache is off: the warm-up and every
    round repeat prompts, and a cached prompt is a head start the peers do not get."""
    from kvguard.engine import EngineConfig, LLMEngine, SamplingParams

    cfg = EngineConfig(
        model=model,
        kv_cache_bytes=limits.kv_cache_bytes,
        block_size=limits.block_size,
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_batched_tokens,
        num_threads=threads,
        model_quantization=quantization,
        enable_prefix_caching=False,
    )
    eng = LLMEngine.from_config(cfg, progress=False)

    def serve(reqs: Sequence[TraceRequest]) -> Outputs:
        params = [
            SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in reqs
        ]
        return [list(o.token_ids) for o in eng.generate([r.prompt_ids for r in reqs], params)]

    def measure(trace: Sequence[TraceRequest]) -> tuple[float, Outputs]:
        before = eng.snapshot().num_preemptions
        wall, out = warm_then_time(serve, warmup)(trace)
        snap = eng.snapshot()
        c.note = (
            f"{snap.blocks_total} blocks x {snap.block_size}; "
            f"{snap.num_preemptions - before} preemptions"
        )
        if not c.in_goals:
            c.note += "; packed 4-bit weights, not in the goals"
        return wall, out

    c = Contender(name, measure, engine=eng)
    return c


def packed_layers(eng: Any) -> int:
    """How many of the engine's projections hold packed (quantized) weights."""
    from kvguard.engine.layers.quantized_linear import QuantizedLinear

    return sum(isinstance(m, QuantizedLinear) for m in eng.model.modules())


def served_contender(
    model: str, limits: Limits, threads: int, warmup: Sequence[TraceRequest]
) -> Contender | None:
    """kvguard as it serves `model` by default (`model_quantization: auto`), for a row beside
    the goals' contender; None where that is the same fp32 model (no packed weights)."""
    c = kvguard_contender(model, limits, threads, warmup, "auto", PACKED_NAME)
    if not packed_layers(c.engine):
        return None
    c.in_goals = False
    return c


# ----------------------------------------------------------------------------- transformers


def load_hf_model(model_dir: Path) -> Any:
    """The peer loads the very directory kvguard converted, so the weights are identical."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def greedy_config(new_tokens: int | None, pad_id: int) -> Any:
    """Greedy, exactly `new_tokens` tokens: min = max, and no EOS to stop on."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=pad_id,
    )


def static_batch(model: Any, batch: Sequence[TraceRequest], pad_id: int) -> Outputs:
    """One `generate` call: left-pad to the longest prompt, run to the longest output."""
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    steps = max(r.output_len for r in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=greedy_config(steps, pad_id)
        )
    new = out[:, width:]
    if new.shape[1] != steps:
        raise SystemExit(f"static generate stopped after {new.shape[1]} of {steps} tokens")
    return [new[i, : r.output_len].tolist() for i, r in enumerate(batch)]


def static_contender(
    model: Any,
    batch_size: int,
    pad_id: int,
    num_requests: int,
    warmup: Sequence[TraceRequest],
) -> Contender:
    def serve(reqs: Sequence[TraceRequest]) -> Outputs:
        outs: Outputs = []
        for i in range(0, len(reqs), batch_size):
            outs.extend(static_batch(model, reqs[i : i + batch_size], pad_id))
        return outs

    note = f"{-(-num_requests // batch_size)} batches, each runs to its longest output"
    measure = warm_then_time(serve, warmup)
    return Contender(f"transformers generate, static {batch_size}", measure, note)


def cb_config(config_cls: Any, page: int, **limits: Any) -> Any:
    """transformers' `ContinuousBatchingConfig` with KV pages of `page` tokens: the field is
    `page_size` in recent releases and `block_size` in earlier 5.x ones (5.17, the GPU
    device's), so the one this transformers has is set."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_cls)}
    key = "page_size" if "page_size" in names else "block_size"
    return config_cls(**{key: page}, **limits)


def continuous_contender(
    model: Any, limits: Limits, pad_id: int, warmup: Sequence[TraceRequest]
) -> Contender:
    """transformers' own continuous batching with kvguard's KV bytes, page size and limits."""
    name = "transformers continuous batching"
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as e:
        return Contender(name, _unavailable, failure=f"not in this transformers: {e}")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    cb = cb_config(
        ContinuousBatchingConfig,
        limits.block_size,
        num_blocks=limits.kv_cache_bytes // (bytes_per_token * limits.block_size),
        max_batch_tokens=limits.max_batched_tokens,
        max_requests_per_batch=limits.max_num_seqs,
    )

    def measure(trace: Sequence[TraceRequest]) -> tuple[float, Outputs]:
        # The manager (its cache allocation and thread) is set up outside the timed region.
        with model.continuous_batching_context_manager(
            generation_config=greedy_config(None, pad_id),
            continuous_batching_config=cb,
            warmup=False,
        ) as manager:
            return warm_then_time(lambda reqs: _cb_serve(manager, reqs), warmup)(trace)

    return Contender(name, measure, f"{cb.num_blocks} pages x {limits.block_size}, same KV bytes")


def _unavailable(trace: Sequence[TraceRequest]) -> tuple[float, Outputs]:
    raise RuntimeError("unavailable")


def _cb_serve(manager: Any, reqs: Sequence[TraceRequest]) -> Outputs:
    """Submit everything, then collect until each request reports finished (or an error)."""
    ids = [
        manager.add_request(r.prompt_ids, max_new_tokens=r.output_len, eos_token_id=-1)
        for r in reqs
    ]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        res = manager.get_result(timeout=1.0)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("the generation thread stopped before finishing the trace")
            continue
        if res.error is not None:
            raise RuntimeError(f"request {res.request_id} failed: {res.error}")
        if res.is_finished():
            done[res.request_id] = list(res.generated_tokens)
    return [done[i] for i in ids]


# ----------------------------------------------------------------------------- run + report


def run_rounds(contenders: list[Contender], trace: Sequence[TraceRequest], rounds: int) -> None:
    """Engines take turns; a peer that fails is reported, never allowed to stop the run."""
    for r in range(rounds):
        for c in contenders:
            if c.failure:
                continue
            try:
                wall, out = c.measure(trace)
            except Exception as e:  # the peer failing here is a result to report
                if c is contenders[0]:
                    raise
                c.failure = f"cannot run here: {type(e).__name__}: {e}"[:160]
                continue
            check_lengths(c.name, trace, out)
            c.walls.append(wall)
            c.outputs = c.outputs or out
            print(f"  round {r + 1}: {c.name}: {wall:.1f} s", flush=True)


def agreement(reference: Outputs, other: Outputs) -> float | None:
    """Share of requests whose first greedy tokens are identical: same model, same answer."""
    if not reference or not other:
        return None
    same = sum(a[:AGREE_PREFIX] == b[:AGREE_PREFIX] for a, b in zip(reference, other, strict=True))
    return same / len(reference)


def report_rows(contenders: list[Contender], output_tokens: int, requests: int) -> list[list[Any]]:
    ours = contenders[0]
    rows = []
    for c in contenders:
        if c.wall_s is None:
            rows.append([c.name, "-", "-", "-", "-", "-", c.failure or c.note])
            continue
        agree = agreement(ours.outputs, c.outputs)
        kvguard = c is ours or not c.in_goals  # kvguard's own rows: no speed-up over itself
        rows.append(
            [
                c.name,
                f"{c.wall_s:.1f}",
                f"{output_tokens / c.wall_s:.1f}",
                f"{requests / c.wall_s:.3f}",
                "-" if kvguard else f"{c.wall_s / ours.wall_s:.2f}x",
                "-" if c is ours or agree is None else f"{agree:.0%}",
                c.note,
            ]
        )
    return rows


HEADERS = [
    "engine",
    "wall s",
    "output tok/s",
    "req/s",
    "kvguard speedup",
    f"same first {AGREE_PREFIX}",
    "notes",
]


def verdicts(contenders: list[Contender]) -> list[str]:
    """The goals, judged on the first contender (kvguard on the peers' weights) against the
    transformers rows; a row reported for information (`in_goals` False) is never judged."""
    ours = contenders[0].wall_s or float("inf")
    lines = []
    judged = [c for c in contenders[1:] if c.in_goals]
    statics = [c.wall_s for c in judged if "static" in c.name and c.wall_s]
    if statics:
        best = min(statics) / ours
        ok = "met" if best >= 2 else "NOT met"
        lines.append(f"goal >= 2x static generate: {ok} ({best:.2f}x the fastest static)")
    for c in judged:
        if "continuous" in c.name:
            if c.wall_s is None:
                lines.append("goal ahead of continuous batching: not measurable here (see its row)")
            else:
                ratio = c.wall_s / ours
                ok = "met" if ratio > 1 else "NOT met"
                lines.append(f"goal ahead of continuous batching: {ok} ({ratio:.2f}x)")
    return lines


def parse_args() -> argparse.Namespace:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-bytes", default="256MiB", help="KV budget for every paged engine")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=1, help="turns per engine; the fastest counts")
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["static16", "static32", "continuous", "packed"],
        help="leave out a peer (repeatable)",
    )
    return p.parse_args()


def build_contenders(
    args: argparse.Namespace, limits: Limits, model_dir: Path, n: int
) -> list[Contender]:
    warmup = warmup_requests(ordinary_token_ids(model_dir))
    contenders = [kvguard_contender(args.model, limits, args.threads, warmup)]
    model = load_hf_model(model_dir)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    for size in (16, 32):
        if f"static{size}" not in args.skip:
            contenders.append(static_contender(model, size, pad_id, n, warmup))
    if "continuous" not in args.skip:
        contenders.append(continuous_contender(model, limits, pad_id, warmup))
    if "packed" not in args.skip:
        served = served_contender(args.model, limits, args.threads, warmup)
        contenders += [served] if served is not None else []
    return contenders


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    from kvguard.engine.config import parse_bytes

    limits = Limits(
        parse_bytes(args.kv_cache_bytes), args.max_num_seqs, args.max_num_batched_tokens
    )
    model_dir, trace = load_trace(args)
    out_tokens = sum(r.output_len for r in trace)
    print(
        f"model {model_dir}, {args.threads} torch threads, KV budget {args.kv_cache_bytes}, "
        f"max_num_seqs {limits.max_num_seqs}, max_num_batched_tokens {limits.max_batched_tokens}"
    )
    print(
        "kvguard (the goals' contender) serves the converted weights in fp32 "
        "(model_quantization none), the very weights the transformers peers load"
    )
    print(f"trace: {len(trace)} requests, seed {spec_from_args(args).seed}")
    print(format_table(SUMMARY_HEADERS, trace_summary(trace)))
    contenders = build_contenders(args, limits, model_dir, len(trace))
    load_before = os.getloadavg()[0]
    run_rounds(contenders, trace, args.rounds)
    print()
    print(format_table(HEADERS, report_rows(contenders, out_tokens, len(trace))))
    for line in verdicts(contenders):
        print(line)
    print(
        f"1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on "
        f"{os.cpu_count()} cores: other processes' load skews wall times (see --rounds)"
    )
    write_json(
        args.json,
        {
            "threads": args.threads,
            "limits": asdict(limits),
            "spec": asdict(spec_from_args(args)),
            "output_tokens": out_tokens,
            "results": [
                {
                    "engine": c.name,
                    "walls_s": c.walls,
                    "best_wall_s": c.wall_s,
                    "output_tokens_per_s": out_tokens / c.wall_s if c.wall_s else None,
                    "note": c.note,
                    "failure": c.failure,
                    "in_goals": c.in_goals,
                }
                for c in contenders
            ],
        },
    )


if __name__ == "__main__":
    main()
