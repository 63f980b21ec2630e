"""The benchmark workload: one fixed-seed request trace that every engine in a run consumes.

Prompts are token-id lists of ordinary (non-special) tokens, so each prompt has exactly its drawn
length in every engine (text would re-tokenise differently) and no control token changes what
the model does. Output lengths are forced by the runners (EOS ignored), so every engine does the
same work. Lengths come from clipped lognormals: serving traffic is mostly short with a long tail,
which is exactly where per-request max-length reservation and static batching waste the most.

Also the small pieces the benchmark scripts share: where the model lives, common options, the
table printer and the JSON writer.

    python bench/trace.py [--quick] [--json FILE]      # print the trace's shape
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np


def prefer_installed_kernels() -> None:
    """transformers (5.25 and later) imports PyPI's `kernels` package. Run from the repository's
    root (tests, benchmarks), the root's own `kernels/` folder (kvguard.kernels) is found first
    under that name and transformers' import fails. Import the installed package first, from
    sys.path without the root, so that `kernels` names it from then on; nothing happens where
    it is not installed (transformers then does not ask for it)."""
    if "kernels" in sys.modules:
        return
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved


prefer_installed_kernels()

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_SEED = 0


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A lognormal given by its median, clipped to [low, high] and rounded to whole tokens."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        raw = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        return [int(x) for x in np.clip(np.rint(raw), self.low, self.high)]


@dataclass(frozen=True, slots=True)
class TraceSpec:
    num_requests: int
    prompt: LengthDist
    output: LengthDist
    seed: int = DEFAULT_SEED


# The full trace: >= 64 requests, prompts 16-512 tokens, outputs 16-256 tokens.
FULL = TraceSpec(64, LengthDist(128, 0.9, 16, 512), LengthDist(64, 0.8, 16, 256))
# A smoke run that exercises every code path in well under a minute per engine.
QUICK = TraceSpec(12, LengthDist(40, 0.6, 16, 96), LengthDist(20, 0.4, 16, 32))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    prompt_ids: list[int]
    output_len: int

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + self.output_len


def make_trace(spec: TraceSpec, ordinary_ids: Sequence[int]) -> list[TraceRequest]:
    """Draw the trace; separate streams for lengths and tokens keep lengths stable if the vocab changes."""
    len_rng, tok_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(2)
    )
    prompt_lens = spec.prompt.draw(len_rng, spec.num_requests)
    output_lens = spec.output.draw(len_rng, spec.num_requests)
    pool = np.asarray(ordinary_ids, dtype=np.int64)
    return [
        TraceRequest([int(t) for t in tok_rng.choice(pool, size=p)], o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def spec_from_args(args: argparse.Namespace) -> TraceSpec:
    base = QUICK if args.quick else FULL
    n = args.requests or base.num_requests
    return TraceSpec(n, base.prompt, base.output, args.seed)


# ----------------------------------------------------------------------------- model


def resolve_model_dir(name: str) -> Path:
    """The converted HF-style directory kvguard loads; the peers load the very same files."""
    from kvguard.engine.config import kvguard_home
    from kvguard.engine.model_registry import resolve_model

    return Path(resolve_model(name, kvguard_home(), progress=True))


def ordinary_token_ids(model_dir: Path) -> list[int]:
    """Every vocabulary id that is not an added/special token (chat markers, EOS, BOS, ...)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    added = set(tok.get_added_tokens_decoder())
    return [i for i in range(min(vocab, tok.get_vocab_size())) if i not in added]


def load_trace(args: argparse.Namespace) -> tuple[Path, list[TraceRequest]]:
    model_dir = resolve_model_dir(args.model)
    return model_dir, make_trace(spec_from_args(args), ordinary_token_ids(model_dir))


# ----------------------------------------------------------------------------- reporting


def common_args(description: str) -> argparse.ArgumentParser:
    """Options every benchmark accepts, so `--quick` and `--json` mean the same everywhere."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="short smoke run (small trace)")
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the results as JSON")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="trace seed (default 0)")
    p.add_argument("--requests", type=int, default=0, help="override the number of requests")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model name or local HF directory (default smollm2-135m)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads for every engine")
    return p


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain fixed-width table: the first column (names) left-aligned, the rest right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"wrote {path}")


def trace_summary(trace: Sequence[TraceRequest]) -> list[list[Any]]:
    """Rows of min / median / mean / max for prompt and output lengths."""

    def row(name: str, xs: list[int]) -> list[Any]:
        return [name, min(xs), statistics.median(xs), statistics.fmean(xs), max(xs), sum(xs)]

    return [
        row("prompt tokens", [len(r.prompt_ids) for r in trace]),
        row("output tokens", [r.output_len for r in trace]),
        row("total tokens", [r.total_len for r in trace]),
    ]


SUMMARY_HEADERS = ["", "min", "median", "mean", "max", "sum"]


def main() -> None:
    args = common_args("Print the benchmark trace's shape.").parse_args()
    _, trace = load_trace(args)
    spec = spec_from_args(args)
    print(f"trace: {len(trace)} requests, seed {spec.seed}")
    print(format_table(SUMMARY_HEADERS, trace_summary(trace)))
    write_json(
        args.json,
        {
            "spec": asdict(spec),
            "requests": [{"prompt_ids": r.prompt_ids, "output_len": r.output_len} for r in trace],
        },
    )


if __name__ == "__main__":
    main()
