"""Small pieces the remedy, FP8, offload and serving benchmarks share.

The trace, the common options, the table printer and the JSON writer live in `bench/trace.py`;
this module adds what those four need beyond them: building an engine the same way everywhere,
robust timing statistics, and ratio cells that say which way is better.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bench.trace import prefer_installed_kernels

if TYPE_CHECKING:
    from kvguard.engine import LLMEngine

prefer_installed_kernels()  # before a benchmark imports transformers (see there)

GiB = 2**30
MiB = 2**20


@contextlib.contextmanager
def env_set(env: Mapping[str, str]) -> Iterator[None]:
    """Each `name=value` of `env` in the environment for the block (kvguard reads its switches
    per call), the old values, or none, back after."""
    old = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def shared_reads(on: bool) -> Iterator[None]:
    """CPU decode attention reading blocks that several sequences share once (`on`, the
    default) or per sequence, inside the block (`cpu_lowbit.shared_prefix`)."""
    from kvguard.kernels import cpu_lowbit

    before = cpu_lowbit.shared_prefix(on) if cpu_lowbit.available() else on
    try:
        yield
    finally:
        if cpu_lowbit.available():
            cpu_lowbit.shared_prefix(before)


def make_engine(model: str, threads: int, **config: Any) -> LLMEngine:
    """An engine from keyword `EngineConfig` fields; every benchmark pins the thread count."""
    import torch

    from kvguard.engine import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    return LLMEngine.from_config(
        EngineConfig(model=model, num_threads=threads, **config), progress=False
    )


def greedy(max_tokens: int) -> Any:
    """Exactly `max_tokens` greedy tokens: EOS ignored, so every run does the same work."""
    from kvguard.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call; perf_counter because wall-clock jumps must not count."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def repeat_median(fn: Callable[[], Any], reps: int) -> tuple[float, list[float]]:
    """Median of `reps` timed calls: on a shared machine the median shrugs off one slow run."""
    samples = [timed(fn) for _ in range(reps)]
    return statistics.median(samples), samples


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); nearest-rank never invents a value not observed."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def ratio(num: float | None, den: float | None, suffix: str = "x") -> str:
    """A ratio cell; '-' when either side is missing or the denominator is zero."""
    if num is None or den is None or den == 0:
        return "-"
    return f"{num / den:.2f}{suffix}"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def load_line() -> str:
    """The 1-minute load average: wall times from a busy shared machine must be read with it."""
    return f"1-min load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def verdict(name: str, ok: bool | None, detail: str) -> str:
    """One goal line; None means the run could not measure it."""
    state = "not measured" if ok is None else ("met" if ok else "NOT met")
    return f"goal {name}: {state} ({detail})"


def step_apply(engine: LLMEngine, future: Any, steps: int = 1) -> Any:
    """Run the engine until a posted control action is applied; its ActionResult.

    Control actions wait in the mailbox until the next step boundary, so a benchmark that
    drives `step()` itself must step once for the action to take effect.
    """
    for _ in range(steps):
        engine.step()
        if future.done():
            break
    return future.result(0)


@functools.cache
def _ordinary_ids(model: str) -> tuple[int, ...]:
    from bench.trace import ordinary_token_ids, resolve_model_dir

    return tuple(ordinary_token_ids(resolve_model_dir(model)))


def token_prompts(model: str, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of exactly `length` ordinary token ids, drawn the way bench/trace.py draws."""
    from bench.trace import LengthDist, TraceSpec, make_trace

    fixed = LengthDist(length, 0.0, length, length)
    spec = TraceSpec(n, fixed, LengthDist(1, 0.0, 1, 1), seed)
    return [r.prompt_ids for r in make_trace(spec, _ordinary_ids(model))]
