"""kvguard end to end on one GPU, beside transformers and the physical limit, in one run.

Random-weight models of real shapes (kvguard.engine.random_model: Llama-2-7B and SmolLM2-135M,
bf16) are drawn on the GPU by transformers and handed to kvguard, so both engines hold the very
same numbers and nothing is downloaded. Sections, each timed and kept apart (one failing or
running out of time leaves the others' results in the JSON):

1. decode tok/s at batch 1, 16 and 64 (prompt 128): kvguard (and, at the smallest and largest
   batch, kvguard with its per-layer Triton ops on: `KVGUARD_FUSED_OPS=1`, with its skinny
   GEMMs on: `KVGUARD_TRITON_GEMV=1`, and at batch 1 with both; the skinny GEMMs' tokens on
   the tiny fp32 model too; with runs of 4 decode steps, `serving.decode_steps=4`, alone and
   at batch 1 with the per-layer ops, whole outputs compared), transformers static
   `generate`, and the batch-1 limit (the weight
   bytes a decode step must read once, all but an untied embedding table of which it reads a
   row, over the measured copy bandwidth). Decode time
   is t(N tokens) - t(1 token), so prefill is left out for both;
   the same greedy tokens are required of both (first 8, bf16 noise allowed on a few rows);
2. a mixed trace (lognormal prompt and output lengths): kvguard (also with its opt-in Triton
   prefill kernel: `KVGUARD_TRITON_PREFILL=1`, and with runs of 4 decode steps), transformers
   static batches of 16, and
   transformers continuous batching where this transformers has it;
3. NVML: the daemon's reader, its memory figure against the CUDA runtime's (run first);
4. a real CUDA out-of-memory: every free byte is taken, the engine's next step fails, the
   engine requeues and, once the memory is back, finishes every request;
5. CUDA KV pool sizing from `gpu_memory_utilization`: memory in use after one maximal batch,
   against the share asked for;
6. the live FP8 KV switch on a filled pool: pause per GiB of live KV, there and back; then
   the live pool resize on it (half, and back): device memory given back, pause;
7. a 4-bit model of the first shape (groups of 32, as the default GGUF loads on a GPU: the
   W4A16 path): decode at each batch through the tiled W4A16 GEMM and with the skinny 4-bit
   GEMMs (`KVGUARD_TRITON_GEMV=4bit`), and past 8 rows with the tiled GEMM by nibble planes
   (`KVGUARD_W4A16_PLANES=1`), against the limit of its own bytes;
8. CUDA graphs (`KVGUARD_CUDA_GRAPHS=0` vs `1`): equal greedy tokens on the tiny test model in
   fp32 (random bf16 weights have near-tied logits, where summation order alone can flip a
   token), then the speed-up at batch 1/16/64 on the SmolLM2 shape (the knob is on by
   default since the first device run showed both; the other sections run with it); and an
   FP8 pool eager vs replayed (`KVGUARD_FP8_GRAPHS=1`, opt-in);
9. where a decode step's host time goes: cProfile of kvguard on that shape, eager and replayed,
   at batch 1 and the largest batch (the functions with the most own time per step);
10. where a replayed batch-1 step's GPU time goes, kernel by kernel (torch.profiler), on each
   shape with the defaults and with the per-layer ops and skinny GEMMs on.

Goals (issue 18): kvguard >= 2x transformers static at batch 64; batch-1 decode >= 60% of
the bandwidth limit. `--cpu-smoke` runs every section on the tiny shape on CPU in seconds
(the OOM is injected there, NVML is absent) to prove the script, not to measure.

They run in the order nvml, decode (with the trace), CUDA graphs, pool sizing, FP8 switch,
OOM, 4-bit, host profile, kernel time: what the issue asks for first. `--deadline S` starts
no section after S seconds; those left are listed as not run and the verdicts still printed.

    python bench/gpu_e2e.py [--cpu-smoke] [--json FILE] [--shapes smollm2-135m,llama2-7b]
                            [--deadline S]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.common import GiB, env_set, greedy, step_apply, verdict  # noqa: E402

GB = 1e9
# every section, in the order they run (`--sections` picks some: a rerun on little device time)
SECTIONS = (
    "nvml", "decode", "trace", "cuda_graphs", "pool_sizing", "fp8_switch", "oom", "packed",
    "profile", "kernel_time",
)  # fmt: skip
STATIC_GOAL = 2.0  # kvguard / transformers static at batch 64
LIMIT_GOAL = 0.60  # batch-1 decode / (copy bandwidth / weight bytes)
RUN_STEPS = 4  # serving.decode_steps for the runs-of-decode-steps rows


class Run:
    """Settings of one run: the GPU one, or the CPU smoke one (tiny shapes, few tokens)."""

    def __init__(
        self,
        smoke: bool,
        shapes: list[str],
        batches: list[int] | None = None,
        sections: set[str] | None = None,
    ) -> None:
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.shapes = ["tiny"] if smoke else shapes
        self.batches = batches or ([1, 4] if smoke else [1, 16, 64])
        self.sections = sections or set(SECTIONS)
        self.prompt = 16 if smoke else 128
        self.new_tokens = 6 if smoke else 48
        self.trace_requests = 8 if smoke else 32
        self.reps = 1  # the device run has 8 minutes for everything: one timed pair per row

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- models


def hf_random_model(shape: str, run: Run, seed: int = 0) -> Any:
    """transformers' Llama of `shape`, initialised by transformers itself on the device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvguard.engine.random_model import hf_config

    torch.manual_seed(seed)
    cfg = LlamaConfig(**hf_config(shape))
    with torch.device(run.device):  # drawn on the GPU itself: seconds, not a CPU init of 7B
        model = AutoModelForCausalLM.from_config(cfg, dtype=run.dtype)
    return model.to(run.device).eval()  # a no-op unless this transformers ignored the device


def kvguard_engine(
    shape: str, run: Run, weights: dict | None, quant_group: int | None = None, **knobs: Any
) -> Any:
    """kvguard on a random model of `shape` (the given weights, or 4-bit projections in groups
    of `quant_group`), engine knobs as given."""
    from kvguard.engine import EngineConfig
    from kvguard.engine.random_model import random_engine

    knobs.setdefault("max_num_seqs", max(run.batches))
    knobs.setdefault("max_model_len", 1024 if run.smoke else 2048)
    # runs here repeat their prompts (t(N) - t(1), the trace once per variant on one engine):
    # a prefix cache would hand the later runs their prompts' KV, a head start the first lacks
    knobs.setdefault("enable_prefix_caching", False)
    dtype = "fp32" if run.smoke else "bf16"
    cfg = EngineConfig(model=f"random:{shape}", device=run.device.type, dtype=dtype, **knobs)
    return random_engine(shape, cfg, weights=weights, quant_group=quant_group)


def pool_blocks(batch: int, tokens: int, block_size: int = 16) -> int:
    """Blocks for `batch` sequences of `tokens` each, plus one spare block per sequence."""
    return batch * (-(-tokens // block_size) + 1)


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts (ids 3.. are ordinary in the byte tokenizer and every shape's vocab)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 259), (n, length), generator=gen).tolist()


# ----------------------------------------------------------------------------- timing


def wall(fn: Callable[[], Any], run: Run) -> tuple[float, Any]:
    run.sync()
    t0 = time.perf_counter()
    out = fn()
    run.sync()
    return time.perf_counter() - t0, out


def decode_rate(gen: Callable[[int], Any], batch: int, run: Run) -> tuple[float, Any]:
    """Decode tokens/s: batch x (N - 1) tokens over t(N) - t(1), so prefill cancels out.
    One whole N-token warm-up first (kernels compiled, graphs captured for every bucket the
    run passes through), then the median over `run.reps` pairs, t(1) the faster of two
    tries; returns the N-token outputs too."""
    gen(run.new_tokens)
    n, rates, out = run.new_tokens, [], None
    for _ in range(run.reps):
        t_one = min(wall(lambda: gen(1), run)[0] for _ in range(2))
        t_all, out = wall(lambda: gen(n), run)
        if t_all > t_one:  # on a noisy CPU smoke run a tiny model can invert them
            rates.append(batch * (n - 1) / (t_all - t_one))
    return (statistics.median(rates) if rates else float("nan")), out


def kvguard_gen(engine: Any, prompts: list[list[int]]) -> Callable[[int], list[list[int]]]:
    return lambda n: [o.token_ids for o in engine.generate(prompts, greedy(n))]


def hf_gen(model: Any, prompts: list[list[int]], run: Run) -> Callable[[int], list[list[int]]]:
    """Static `generate` on equal-length prompts (no padding needed), exactly n tokens."""
    ids = torch.tensor(prompts, device=run.device)

    def gen(n: int) -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].tolist()

    return gen


def copy_bandwidth(run: Run) -> float:
    from bench.gpu_kernels import copy_bandwidth as measure

    nbytes = 2**20 if run.smoke else 2 * 2**30
    return measure(run.device, nbytes, 3 if run.smoke else 20)


# ----------------------------------------------------------------------------- sections


def section_decode(shape: str, run: Run, copy_bw: float) -> dict[str, Any]:
    """Batch 1/16/64 decode, kvguard vs transformers static, and the batch-1 limit."""
    from kvguard.engine.model import step_weight_bytes
    from kvguard.kernels.dispatch import FUSED_OPS_ENV, GEMV_ENV

    hf = hf_random_model(shape, run)
    tokens = run.prompt + run.new_tokens + 8
    eng = kvguard_engine(
        shape,
        run,
        hf.state_dict(),
        # the batches' sequences, plus room for the trace's longest request (640 tokens)
        num_gpu_blocks=pool_blocks(max(run.batches), tokens) + pool_blocks(1, 1024),
        max_num_batched_tokens=max(2048, max(run.batches) * run.prompt),
    )
    wbytes = step_weight_bytes(eng.model)
    res: dict[str, Any] = {
        "step_weight_gb": wbytes / GB,
        "limit_tok_s_b1": copy_bw / wbytes,
        "rows": [],
    }
    outs: dict[int, Any] = {}
    for b in run.batches:
        prompts = prompts_for(b, run.prompt, eng.model_config.vocab_size, seed=b)
        kv_rate, kv_out = decode_rate(kvguard_gen(eng, prompts), b, run)
        outs[b] = kv_out
        hf_rate, hf_out = decode_rate(hf_gen(hf, prompts, run), b, run)
        same = sum(a[:8] == h[:8] for a, h in zip(kv_out, hf_out, strict=True))
        row = {"batch": b, "kvguard_tok_s": kv_rate, "hf_static_tok_s": hf_rate}
        row |= {"ratio": kv_rate / hf_rate, "same_first8": f"{same}/{b}"}
        res["rows"].append(row)
        print(f"  {shape} batch {b}: " + json.dumps(row), flush=True)
        if run.smoke and same != b:  # fp32 on CPU: the weight handover must be exact
            raise RuntimeError(f"kvguard and transformers disagree at batch {b}: {same}/{b}")
    ends = {min(run.batches), max(run.batches)}
    # the opt-in paths, each alone at the smallest and largest batch, then together at batch 1
    res["fused_on"] = _switched_on(eng, run, outs, {FUSED_OPS_ENV: "1"}, ends)
    print(f"  {shape} per-layer Triton ops on: " + json.dumps(res["fused_on"]), flush=True)
    # (on the smoke run the skinny GEMMs run in Triton's interpreter: batch 1 only there)
    gemv_batches = {min(run.batches)} if run.smoke else ends
    res["gemv_on"] = _switched_on(eng, run, outs, {GEMV_ENV: "1"}, gemv_batches)
    print(f"  {shape} skinny GEMMs on: " + json.dumps(res["gemv_on"]), flush=True)
    both = {FUSED_OPS_ENV: "1", GEMV_ENV: "1"}
    res["fused_gemv_on"] = _switched_on(eng, run, outs, both, {min(run.batches)})
    print(f"  {shape} both on: " + json.dumps(res["fused_gemv_on"]), flush=True)
    # runs of decode steps (the host's per-step work paid once a run), alone and with the
    # per-layer ops (which shrink the GPU's part of a step and so raise the host's share)
    res["runs_on"] = _switched_on(eng, run, outs, {}, ends, RUN_STEPS)
    print(f"  {shape} decode_steps={RUN_STEPS}: " + json.dumps(res["runs_on"]), flush=True)
    fused = {FUSED_OPS_ENV: "1"}
    res["fused_runs_on"] = _switched_on(eng, run, outs, fused, {min(run.batches)}, RUN_STEPS)
    print(f"  {shape} per-layer ops + runs: " + json.dumps(res["fused_runs_on"]), flush=True)
    if shape == run.shapes[0]:  # each opt-in's tokens against the default's, exactly
        from kvguard.kernels.dispatch import TRITON_PREFILL_ENV

        for key, env in (
            ("gemv_tiny_fp32", GEMV_ENV),
            ("fused_tiny_fp32", FUSED_OPS_ENV),
            ("prefill_tiny_fp32", TRITON_PREFILL_ENV),
        ):
            res[key] = tiny_exact(run, env)
            print(f"  {key}: " + json.dumps(res[key]), flush=True)
    if shape == run.shapes[0] and "trace" in run.sections:
        # the trace and the torch-path row once, on the cheaper shape
        res["trace"] = section_trace(eng, hf, run)
        res["triton_off"] = _triton_off(eng, run)
    del eng, hf
    run.free()
    return res


def _rate_with_env(eng: Any, run: Run, batch: int, env: dict[str, str]) -> tuple[float, Any]:
    """Decode tok/s (and the outputs) at `batch` with kernel switches flipped (`env`: name ->
    value); captured CUDA graphs are dropped before and after (a graph replays the kernels it
    was captured with)."""
    prompts = prompts_for(batch, run.prompt, eng.model_config.vocab_size, seed=batch)
    graphs = eng.runner.graphs
    try:
        with env_set(env):
            if graphs is not None:
                graphs.invalidate()
            return decode_rate(kvguard_gen(eng, prompts), batch, run)
    finally:
        if graphs is not None:
            graphs.invalidate()


def _triton_off(eng: Any, run: Run) -> dict[str, Any]:
    """The largest batch with KVGUARD_TRITON=0 (torch attention path), for the kernels' gain."""
    b = max(run.batches)
    return {"batch": b, "kvguard_tok_s": _rate_with_env(eng, run, b, {"KVGUARD_TRITON": "0"})[0]}


@contextlib.contextmanager
def decode_steps(eng: Any, steps: int) -> Iterator[None]:
    """`serving.decode_steps` at `steps` for the block, set live as a reload sets it."""
    before, eng.config.decode_steps = eng.config.decode_steps, steps
    try:
        yield
    finally:
        eng.config.decode_steps = before


def _switched_on(
    eng: Any,
    run: Run,
    default_out: dict[int, Any],
    env: dict[str, str],
    batches: set[int],
    steps: int = 1,
) -> list[dict[str, Any]]:
    """Decode tok/s at `batches` with opt-in switches on (`env`) and runs of `steps` decode
    steps (`serving.decode_steps`, set live as a reload does), for their gain, and how many
    sequences' first 8 tokens equal the default path's (bf16 near-ties aside); with runs, how
    many sequences' whole outputs do (a run's steps are the single steps' kernels)."""
    rows = []
    for b in sorted(batches):
        ahead = eng.snapshot().counters["steps_ahead"]
        with decode_steps(eng, steps):
            rate, out = _rate_with_env(eng, run, b, env)
        same = sum(a[:8] == d[:8] for a, d in zip(out, default_out[b], strict=True))
        row = {"batch": b, "kvguard_tok_s": rate, "same_first8": f"{same}/{b}"}
        if steps > 1:  # steps_ahead: how many steps ran inside runs (0: no run happened)
            whole = sum(a == d for a, d in zip(out, default_out[b], strict=True))
            row |= {"decode_steps": steps, "same_tokens": f"{whole}/{b}"}
            row["steps_ahead"] = eng.snapshot().counters["steps_ahead"] - ahead
        rows.append(row)
    return rows


PACKED_GROUP = 32  # the default GGUF's (Q4_1) quantisation group


def section_packed(run: Run, copy_bw: float) -> dict[str, Any]:
    """A 4-bit model (the first shape's projections in groups of 32, as the default GGUF
    loads; on a GPU the W4A16 path): decode tok/s at each batch through the tiled W4A16 GEMM
    (today's default) and with the skinny 4-bit GEMMs (`KVGUARD_TRITON_GEMV=4bit`), how many
    sequences' first 8 tokens agree, and batch 1 against the limit of its own bytes."""
    from kvguard.engine.model import step_weight_bytes
    from kvguard.kernels.dispatch import GEMV_ENV, GEMV_MAX_ROWS, W4A16_PLANES_ENV

    shape = run.shapes[0]
    tokens = run.prompt + run.new_tokens + 8
    blocks = pool_blocks(max(run.batches), tokens)
    eng = kvguard_engine(shape, run, None, quant_group=PACKED_GROUP, num_gpu_blocks=blocks)
    wbytes = step_weight_bytes(eng.model)
    res: dict[str, Any] = {"shape": shape, "group": PACKED_GROUP, "step_weight_gb": wbytes / GB}
    res |= {"limit_tok_s_b1": copy_bw / wbytes, "rows": []}
    for b in run.batches:
        prompts = prompts_for(b, run.prompt, eng.model_config.vocab_size, seed=b)
        tiled, tiled_out = decode_rate(kvguard_gen(eng, prompts), b, run)
        skinny, skinny_out = _rate_with_env(eng, run, b, {GEMV_ENV: "4bit"})
        same = sum(a[:8] == d[:8] for a, d in zip(skinny_out, tiled_out, strict=True))
        row = {"batch": b, "tiled_tok_s": tiled, "skinny_tok_s": skinny}
        row |= {"speedup": skinny / tiled, "same_first8": f"{same}/{b}"}
        if b > GEMV_MAX_ROWS or run.smoke:  # past the skinny GEMMs: the tiled GEMM by planes
            planes, planes_out = _rate_with_env(eng, run, b, {W4A16_PLANES_ENV: "1"})
            same = sum(a[:8] == d[:8] for a, d in zip(planes_out, tiled_out, strict=True))
            row |= {"planes_tok_s": planes, "planes_speedup": planes / tiled}
            row["planes_same_first8"] = f"{same}/{b}"
        res["rows"].append(row)
        print(f"  {shape} 4-bit g{PACKED_GROUP}: " + json.dumps(row), flush=True)
    del eng
    run.free()
    return res


def section_trace(eng: Any, hf: Any, run: Run) -> dict[str, Any]:
    """The mixed trace through kvguard, transformers static 16s, transformers continuous."""
    from bench.trace import FULL, QUICK, LengthDist, TraceSpec, make_trace

    spec = QUICK if run.smoke else FULL
    output = spec.output if run.smoke else LengthDist(64, 0.8, 16, 128)  # the run's time budget
    spec = TraceSpec(run.trace_requests, spec.prompt, output, spec.seed)
    trace = make_trace(spec, range(3, 259))
    want = sum(r.output_len for r in trace)
    out: dict[str, Any] = {"requests": len(trace), "output_tokens": want}
    params = [greedy(r.output_len) for r in trace]
    prompts = [r.prompt_ids for r in trace]
    eng.generate(prompts[:2], params[:2])  # warm-up
    sec, base = wall(lambda: eng.generate(prompts, params), run)
    out["kvguard_tok_s"] = want / sec
    # the opt-in Triton prefill kernel: the same trace, its throughput and how many outputs
    # equal the default's (bf16 near-ties aside)
    from kvguard.kernels.dispatch import TRITON_PREFILL_ENV

    with env_set({TRITON_PREFILL_ENV: "1"}):
        eng.generate(prompts[:2], params[:2])  # compiles the kernel
        sec, tri = wall(lambda: eng.generate(prompts, params), run)
    same = sum(a.token_ids == b.token_ids for a, b in zip(tri, base, strict=True))
    out["kvguard_triton_prefill_tok_s"] = want / sec
    out["triton_prefill_same_outputs"] = f"{same}/{len(trace)}"
    # runs of decode steps on the trace (all requests queued at once: runs go on while the
    # batch is full and decoding), and how many outputs equal the default's
    with decode_steps(eng, RUN_STEPS):
        sec, ran = wall(lambda: eng.generate(prompts, params), run)
    same = sum(a.token_ids == b.token_ids for a, b in zip(ran, base, strict=True))
    out["kvguard_runs_tok_s"] = want / sec
    out["runs_same_outputs"] = f"{same}/{len(trace)}"
    out["hf_static16_tok_s"] = want / _hf_static(hf, trace, run)
    blocks, batched = eng.kv_cache.num_blocks, eng.scheduler.max_num_batched_tokens
    out["hf_continuous_tok_s"] = _hf_continuous(hf, trace, run, blocks, want, batched)
    print("  trace: " + json.dumps(out), flush=True)
    return out


def _hf_static(hf: Any, trace: list, run: Run) -> float:
    """Seconds for the trace in arrival-order batches of 16, left-padded, each batch run to its
    longest output (what static batching costs)."""
    from bench.throughput import greedy_config

    def serve() -> None:
        for i in range(0, len(trace), 16):
            batch = trace[i : i + 16]
            width = max(len(r.prompt_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):
                ids[j, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
                mask[j, width - len(r.prompt_ids) :] = 1
            steps = max(r.output_len for r in batch)
            with torch.inference_mode():
                hf.generate(
                    input_ids=ids.to(run.device),
                    attention_mask=mask.to(run.device),
                    generation_config=greedy_config(steps, 0),
                )

    return wall(serve, run)[0]


def _hf_continuous(
    hf: Any, trace: list, run: Run, blocks: int, want: int, batched_tokens: int
) -> float | str:
    """transformers' continuous batching with kvguard's page count, page size and limits (its
    batched-token limit `batched_tokens`; set up as bench/throughput.py does, warmed up on the
    trace's first requests), where this transformers has it."""
    from bench.throughput import _cb_serve, cb_config, check_lengths, greedy_config

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as e:
        return f"not in this transformers: {e}"
    cb = cb_config(
        ContinuousBatchingConfig,
        16,
        num_blocks=blocks,
        max_batch_tokens=batched_tokens,
        max_requests_per_batch=max(run.batches),
    )
    try:
        with hf.continuous_batching_context_manager(
            generation_config=greedy_config(None, 0), continuous_batching_config=cb, warmup=False
        ) as manager:
            _cb_serve(manager, trace[:2])
            sec, outputs = wall(lambda: _cb_serve(manager, trace), run)
        check_lengths("transformers continuous batching", trace, outputs)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a peer's failure is reported
        return f"failed: {exc!r}"[:300]
    return want / sec


def tiny_exact(run: Run, env: str | dict[str, str], **knobs: Any) -> dict[str, Any]:
    """Switch `env` "0" vs "1" (or every variable of a dict "0" vs its value) on the tiny
    test model in fp32 (its top-1/top-2 logit gaps are far above fp32 noise, unlike random
    bf16 weights, so tokens must be equal): five sequences of different lengths and stops,
    so a decode batch pads into graph buckets 8, 4, 2 and 1 as they finish. `knobs` go to
    the engine (an FP8 pool). `captures`: graph captures of the switched-on engine."""
    from kvguard.engine import EngineConfig, LLMEngine, SamplingParams

    on = {env: "1"} if isinstance(env, str) else env

    outs, captures = {}, 0
    prompts = [[5 + i] * (3 + 11 * i) for i in range(5)]
    most = 12 if run.smoke else 48  # the smoke run's kernels may run in Triton's interpreter
    params = [SamplingParams(max_tokens=most - most // 6 * i, ignore_eos=True) for i in range(5)]
    # a fixed pool: sized from gpu_memory_utilization, one engine would take the share and
    # leave the next none while the first is still referenced
    cfg = EngineConfig(
        model="tiny", device=run.device.type, dtype="fp32", max_num_seqs=8,
        max_model_len=512, num_gpu_blocks=pool_blocks(8, 512), **knobs,
    )  # fmt: skip
    for flag, switches in (("0", dict.fromkeys(on, "0")), ("1", on)):
        with env_set(switches):
            eng = LLMEngine.from_config(cfg, progress=False)
            outs[flag] = [o.token_ids for o in eng.generate(prompts, params)]
        if flag == "1":
            captures = eng.runner.graphs.captures if eng.runner.graphs is not None else 0
        del eng
        run.free()
    return {"same_tokens": outs["0"] == outs["1"], "captures": captures}


def section_cuda_graphs(run: Run) -> dict[str, Any]:
    """Eager vs graph replay: exact tokens on the tiny model, then the speed-up (and, for
    information, token agreement in bf16) on the first, cheapest, random shape."""
    from kvguard.engine import model_runner

    shape = run.shapes[0]
    exact = tiny_exact(run, model_runner.CUDA_GRAPHS_ENV)
    res: dict[str, Any] = {"tiny_fp32": exact, "shape": shape, "rows": []}
    print("  cuda graphs, tiny fp32: " + json.dumps(res["tiny_fp32"]), flush=True)
    for b in run.batches:
        rates, outs, captures = _off_and_on(shape, run, b, model_runner.CUDA_GRAPHS_ENV)
        row = {"batch": b, "eager_tok_s": rates["0"], "graphs_tok_s": rates["1"]}
        row |= {"speedup": rates["1"] / rates["0"], "same_tokens": outs["0"] == outs["1"]}
        row["captures"] = captures  # 0 on CPU: graphs need CUDA, both runs were eager
        res["rows"].append(row)
        print("  cuda graphs: " + json.dumps(row), flush=True)
    res["fp8"] = _fp8_graphs(shape, run)
    print("  cuda graphs, FP8 pool: " + json.dumps(res["fp8"]), flush=True)
    return res


def _off_and_on(
    shape: str, run: Run, b: int, env: str, **knobs: Any
) -> tuple[dict[str, float], dict[str, Any], int]:
    """Decode tok/s and outputs at batch `b` of a fresh random-weight engine with switch `env`
    "0" and then "1" (set while the engine is built and runs), and the graph captures made."""
    rates, outs, captures = {}, {}, 0
    for flag in ("0", "1"):
        with env_set({env: flag}):
            eng = kvguard_engine(shape, run, None, num_gpu_blocks=pool_blocks(b, 512), **knobs)
            prompts = prompts_for(b, run.prompt, eng.model_config.vocab_size, seed=b)
            rates[flag], outs[flag] = decode_rate(kvguard_gen(eng, prompts), b, run)
        graphs = eng.runner.graphs
        captures += graphs.captures if graphs is not None else 0
        del eng
        run.free()
    return rates, outs, captures


def _fp8_graphs(shape: str, run: Run) -> dict[str, Any]:
    """An FP8 pool at the middle batch: eager (the default) vs replayed with
    `KVGUARD_FP8_GRAPHS=1` (the scales grown in the graph's KV write kernel): speed-up, and
    how many sequences' tokens are equal."""
    from kvguard.engine import model_runner

    b = sorted(run.batches)[len(run.batches) // 2]
    env = model_runner.FP8_GRAPHS_ENV
    rates, outs, captures = _off_and_on(shape, run, b, env, kv_cache_dtype="fp8_e4m3")
    same = sum(a == e for a, e in zip(outs["1"], outs["0"], strict=True))
    return {
        "batch": b,
        "eager_tok_s": rates["0"],
        "graphs_tok_s": rates["1"],
        "speedup": rates["1"] / rates["0"],
        "same_tokens": f"{same}/{b}",
        "captures": captures,  # 0: the switched-on run never replayed (it was eager too)
        # the scales grown inside the graph must be eager's to the bit: exact tokens in fp32
        "tiny_fp32": tiny_exact(run, env, kv_cache_dtype="fp8_e4m3"),
    }


def section_profile(run: Run) -> dict[str, Any]:
    """Where a decode step's host time goes: cProfile over kvguard generating on the first
    (cheapest) shape, eager and with graphs, at batch 1 and the largest batch. Each entry:
    the functions with the most own time (a GPU wait shows as the call that synchronises)."""
    import cProfile
    import pstats

    from kvguard.engine import model_runner

    shape, n = run.shapes[0], run.new_tokens
    res: dict[str, Any] = {"shape": shape, "tokens": n}
    for flag in ("0", "1"):
        for b in (1, max(run.batches)):
            with env_set({model_runner.CUDA_GRAPHS_ENV: flag}):
                eng = kvguard_engine(shape, run, None, num_gpu_blocks=pool_blocks(b, 512))
            prompts = prompts_for(b, run.prompt, eng.model_config.vocab_size, seed=b)
            gen = kvguard_gen(eng, prompts)
            gen(2)  # warm-up: compile, capture
            prof = cProfile.Profile()
            sec, _ = wall(lambda g=gen, p=prof: p.runcall(g, n), run)
            table = pstats.Stats(prof).stats  # type: ignore[attr-defined]
            rows = sorted(table.items(), key=lambda kv: -kv[1][2])[:25]
            top = [
                f"{tt * 1e3 / n:8.3f} ms/step own {ct * 1e3 / n:8.3f} cum {nc / n:7.1f} calls"
                f"  {Path(f).name}:{line}({fn})"
                for (f, line, fn), (_, nc, tt, ct, _) in rows
            ]
            key = f"{'graphs' if flag == '1' else 'eager'}_b{b}"
            res[key] = {"ms_per_step": sec * 1e3 / n, "top": top}
            print(f"  {key}: {sec * 1e3 / n:.2f} ms/step (profiled)", flush=True)
            for line in top[:12]:
                print("    " + line, flush=True)
            del eng
            run.free()
    return res


def section_kernel_time(run: Run) -> dict[str, Any]:
    """What a batch-1 decode step spends on the GPU, kernel by kernel: torch.profiler over
    the replayed steps of one request on each shape, with the defaults and with the per-layer
    Triton ops and skinny GEMMs on. Per step: kernels launched, their GPU time, and the
    kernels with the most of it (the batch-1 bandwidth goal is bound by these; on the CPU
    smoke run there are no GPU kernels to list)."""
    from torch.profiler import ProfilerActivity, profile

    from kvguard.kernels.dispatch import FUSED_OPS_ENV, GEMV_ENV

    acts = [ProfilerActivity.CPU]
    if run.device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    n, res = run.new_tokens, {}
    for shape in run.shapes:
        for label, env in (("default", {}), ("fused_gemv", {FUSED_OPS_ENV: "1", GEMV_ENV: "1"})):
            with env_set(env):  # set while capturing and while replaying
                eng = kvguard_engine(shape, run, None, num_gpu_blocks=pool_blocks(1, 512))
                gen = kvguard_gen(eng, prompts_for(1, run.prompt, eng.model_config.vocab_size, 1))
                gen(n)  # warm-up: compile, capture every bucket it passes through
                run.sync()
                with profile(activities=acts) as prof:
                    gen(n)
                    run.sync()
            key = f"{shape}/{label}"
            res[key] = _kernel_table(prof, n)
            print(f"  {key}: " + json.dumps({k: v for k, v in res[key].items() if k != "top"}))
            for line in res[key]["top"][:8]:
                print("    " + line, flush=True)
            del eng
            run.free()
    return res


def _kernel_table(prof: Any, steps: int) -> dict[str, Any]:
    """GPU kernels of a profile, per decode step: count, GPU ms, the 15 costliest."""
    from torch.autograd import DeviceType

    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
    ]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total_us = sum(e.self_device_time_total for e in kernels)
    top = [
        f"{e.self_device_time_total / 1e3 / steps:7.3f} ms/step {e.count / steps:6.1f} calls"
        f"  {e.key[:90]}"
        for e in kernels[:15]
    ]
    return {
        "kernels_per_step": sum(e.count for e in kernels) / steps,
        "gpu_ms_per_step": total_us / 1e3 / steps,
        "top": top,
    }


def section_pool_sizing(run: Run) -> dict[str, Any]:
    """Pool sized from gpu_memory_utilization, then one maximal batch: memory in use after it
    against the share asked for."""
    if run.device.type != "cuda":
        return {"skipped": "CPU: the pool is sized from kv_cache_bytes"}
    util = 0.5
    run.free()
    torch.cuda.reset_peak_memory_stats()
    free_before, total = torch.cuda.mem_get_info()
    eng = kvguard_engine(
        run.shapes[0], run, None, gpu_memory_utilization=util, max_num_batched_tokens=8192
    )
    pool = eng.kv_cache.device_pool.nbytes
    prompts = prompts_for(max(run.batches), 128, eng.model_config.vocab_size, seed=7)
    eng.generate(prompts, greedy(4))
    free_after = torch.cuda.mem_get_info()[0]
    res = {
        "gpu_memory_utilization": util,
        "total_gb": total / GB,
        "free_before_gb": free_before / GB,
        "pool_gb": pool / GB,
        "blocks": eng.kv_cache.num_blocks,
        "used_share_after_max_batch": (total - free_after) / total,
        "torch_peak_gb": torch.cuda.max_memory_allocated() / GB,
    }
    del eng
    run.free()
    print("  pool sizing: " + json.dumps(res), flush=True)
    return res


def fill_device(chunk: int = GiB) -> list[torch.Tensor]:
    """Allocate until the device refuses, halving the chunk down to 1 MiB: a real OOM state."""
    hog: list[torch.Tensor] = []
    while chunk >= 2**20:
        try:
            hog.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            chunk //= 2
    return hog


def section_oom(run: Run) -> dict[str, Any]:
    """The engine meets a real CUDA OOM mid-serving and finishes every request afterwards."""
    shape = run.shapes[0]
    eng = kvguard_engine(
        shape, run, None, num_gpu_blocks=pool_blocks(32, 512), max_num_batched_tokens=8192
    )
    prompts = prompts_for(32, 256, eng.model_config.vocab_size, seed=11)
    eng.generate(prompts[:2], greedy(2))  # warm-up outside the OOM
    rids = [eng.add_request(p, greedy(16)) for p in prompts]
    hog: list[torch.Tensor] = []
    if run.device.type == "cuda":
        run.free()
        hog = fill_device()
    else:
        eng.inject_oom(1)  # no device memory to exhaust: the same path, by the test hook
    free_at_oom = torch.cuda.mem_get_info()[0] if hog else None
    for _ in range(3):
        eng.step()
    ooms = eng._counters["oom"]  # noqa: SLF001 - the engine's own count of OOM steps
    del hog
    run.free()
    finished: dict[str, int] = {}
    t0 = time.perf_counter()
    while eng.has_unfinished() and time.perf_counter() - t0 < 120:
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = len(out.token_ids)
    res = {
        "oom_steps": ooms,
        "free_bytes_at_oom": free_at_oom,
        "finished": sum(finished.get(r) == 16 for r in rids),
        "requests": len(rids),
        "injected": run.device.type != "cuda",
        "max_num_batched_tokens_after": eng.scheduler.max_num_batched_tokens,
    }
    del eng
    run.free()
    print("  oom: " + json.dumps(res), flush=True)
    return res


def section_fp8(run: Run) -> dict[str, Any]:
    """Fill the pool to about half with live sequences, switch to FP8 and back mid-generation."""
    shape = run.shapes[-1]
    blocks = pool_blocks(32, 1024 if run.smoke else 2048)  # 32 prompts of ~1k: about half full
    eng = kvguard_engine(shape, run, None, num_gpu_blocks=blocks, max_num_batched_tokens=8192)
    prompt_len = (256 if run.smoke else 1024) - 16
    prompts = prompts_for(32, prompt_len, eng.model_config.vocab_size, seed=13)
    for p in prompts:
        eng.add_request(p, greedy(8 if run.smoke else 64))
    while not all(s.num_computed_tokens >= prompt_len for s in eng.scheduler.running) or (
        eng.scheduler.waiting
    ):
        eng.step()
    snap = eng.snapshot()
    res: dict[str, Any] = {"shape": shape, "usage": snap.kv_cache_usage_ratio}
    for name, dtype in (("to_fp8", "fp8_e4m3"), ("back", "auto")):
        sec, result = wall(lambda d=dtype, e=eng: step_apply(e, e.set_kv_cache_dtype(d)), run)
        live_gib = result.data.get("live_bytes", 0) / GiB if result.ok else 0
        res[name] = {"ok": result.ok, "detail": result.detail, "step_s": sec, "live_gib": live_gib}
        if result.ok and live_gib:
            res[name]["pause_s_per_gib"] = result.data["pause_s"] / live_gib
    # the live pool resize (shrink_kv_pool / restore_kv_pool) on the same filled pool: what
    # the device (CPU: the process) really gets back, and the pause
    for name, share in (("pool_half", 0.5), ("pool_back", 1.0)):
        before = free_bytes(run)
        sec, result = wall(lambda s=share, e=eng: step_apply(e, e.set_kv_pool_share(s)), run)
        res[name] = {
            "ok": result.ok,
            "detail": result.detail,
            "step_s": sec,
            "freed_gib": (free_bytes(run) - before) / GiB,
            "preempted": len(result.data.get("preempted", [])),
        }
    while eng.has_unfinished():
        eng.step()
    del eng
    run.free()
    print("  fp8 switch: " + json.dumps(res), flush=True)
    return res


def free_bytes(run: Run) -> int:
    """Device memory free (cudaMemGetInfo), or on the CPU smoke run minus the resident size."""
    if not run.smoke:
        return torch.cuda.mem_get_info()[0]
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return -pages * os.sysconf("SC_PAGE_SIZE")


def section_nvml(run: Run) -> dict[str, Any]:
    """The daemon's NVML reader on this GPU; its used bytes against cudaMemGetInfo's."""
    from kvguard.daemon.nvml import NvmlReader, gpu_id

    reader = NvmlReader()
    if not reader.available:
        return {"available": False, "error": reader.error}
    readings = reader.read()
    res: dict[str, Any] = {"available": True, "gpus": [r.__repr__() for r in readings]}
    if readings and run.device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        res["used_ratio_nvml"] = readings[0].memory_used_ratio
        res["used_ratio_cuda"] = (total - free) / total
        # the rule signal reads the engine's own GPUs only, found in NVML by PCI address: the
        # address torch gives must be one NVML looks up (own_gpus not null, signal a number)
        ids = [gpu_id(torch.cuda.get_device_properties(run.device))]
        reader.use_gpus(ids)
        res |= {"engine_gpus": ids, "own_gpus": reader.own_gpus, "error": reader.error}
        res["signal"] = reader.memory_used_ratio()
    print("  nvml: " + json.dumps(res), flush=True)
    return res


# ----------------------------------------------------------------------------- report


def exact_tokens(check: dict[str, Any] | None) -> tuple[bool, str]:
    """A `tiny_exact` result as (proven, text): a path that becomes a default must have given
    the default's tokens on the tiny fp32 model; not checked (a run cut short) proves nothing."""
    if not check:
        return False, "tiny fp32 tokens not checked"
    return bool(
        check["same_tokens"]
    ), f"tiny fp32 tokens {'equal' if check['same_tokens'] else 'DIFFER'}"


def _num(x: Any) -> float | None:
    """A measured figure, or None where it was not measured (absent, or NaN: a rate whose
    timing never ran, as in a run cut short)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return float(x)


def _div(a: Any, b: Any) -> float | None:
    """a / b where both were measured (and b is not 0), else None."""
    a, b = _num(a), _num(b)
    return None if a is None or b is None or b == 0 else a / b


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _met(value: float | None, test: Callable[[float], bool], *conditions: bool) -> bool | None:
    """A verdict: NOT met where a condition already fails, not measured (None) where the
    figure it turns on was not measured, else the test of that figure."""
    if not all(conditions):
        return False
    return None if value is None else test(value)


def goals(result: dict[str, Any]) -> list[str]:
    """The issue's goals from whatever sections completed (None: not measured; a rate that was
    not measured, NaN in the JSON, reads so too). A verdict that decides whether an opt-in path
    becomes a default needs it faster and, on the tiny fp32 model, giving the default path's
    tokens."""
    lines = []
    smoke = result.get("device") == "cpu"  # CPU numbers prove the script, not the goals

    def tiny(key: str) -> dict[str, Any] | None:  # taken with the first shape
        return next((d[key] for d in result.get("decode", {}).values() if d.get(key)), None)

    def faster(x: float) -> bool:
        return x > 1.0

    def within_limit(x: float) -> bool:
        return x >= LIMIT_GOAL

    for shape, dec in result.get("decode", {}).items():
        if smoke or "rows" not in dec:
            lines.append(verdict(f"{shape} decode goals", None, "no GPU numbers"))
            continue
        rows = {r["batch"]: r for r in dec.get("rows", [])}
        limit = dec["limit_tok_s_b1"]
        top = rows.get(64)
        ratio = _num(top["ratio"]) if top else None
        lines.append(
            verdict(
                f"{shape} kvguard >= {STATIC_GOAL}x transformers static at batch 64",
                _met(ratio, lambda x: x >= STATIC_GOAL),
                _fmt(ratio, ".2f", "x"),
            )
        )
        b1 = rows.get(1)
        b1_rate = b1["kvguard_tok_s"] if b1 else None
        share = _div(b1_rate, limit)
        lines.append(
            verdict(
                f"{shape} batch-1 decode >= {LIMIT_GOAL:.0%} of the bandwidth limit",
                _met(share, within_limit),
                f"{_fmt(share, '.0%')} of {limit:.0f} tok/s",
            )
        )
        fused = {r["batch"]: r for r in dec.get("fused_on", [])}
        if b1 and 1 in fused:  # what decides KVGUARD_FUSED_OPS's default
            gain = _div(fused[1]["kvguard_tok_s"], b1_rate)
            share_on = _div(fused[1]["kvguard_tok_s"], limit)
            equal, note = exact_tokens(tiny("fused_tiny_fp32"))
            detail = f"batch 1 {_fmt(gain, '.2f', 'x')} ({_fmt(share_on, '.0%')} of the limit), "
            detail += "same first 8 tokens "
            detail += ", ".join(f"{r['same_first8']} at {b}" for b, r in fused.items())
            detail += f", {note}"
            ok = _met(gain, faster, equal)
            lines.append(verdict(f"{shape} per-layer Triton ops faster", ok, detail))
        gemv = {r["batch"]: r for r in dec.get("gemv_on", [])}
        if b1 and 1 in gemv:  # what decides KVGUARD_TRITON_GEMV's default (with gpu_gemv.py)
            gain = _div(gemv[1]["kvguard_tok_s"], b1_rate)
            share_on = _div(gemv[1]["kvguard_tok_s"], limit)
            detail = f"batch 1 {_fmt(gain, '.2f', 'x')} ({_fmt(share_on, '.0%')} of the limit), "
            detail += "same first 8 tokens "
            detail += ", ".join(f"{r['same_first8']} at {b}" for b, r in gemv.items())
            equal, note = exact_tokens(tiny("gemv_tiny_fp32"))
            detail += f", {note}"
            ok = _met(gain, faster, equal)
            lines.append(verdict(f"{shape} skinny GEMMs faster in decode", ok, detail))
        both = dec.get("fused_gemv_on", [])
        if both and both[0]["batch"] == 1:
            share_on = _div(both[0]["kvguard_tok_s"], limit)
            detail = f"{_fmt(share_on, '.0%')} of {limit:.0f} tok/s"
            lines.append(
                verdict(
                    f"{shape} batch-1 decode >= {LIMIT_GOAL:.0%} of the limit with both opt-ins",
                    _met(share_on, within_limit),
                    detail,
                )
            )
        runs = {r["batch"]: r for r in dec.get("runs_on", [])}
        if b1 and 1 in runs:  # what decides serving.decode_steps' default
            gain = _div(runs[1]["kvguard_tok_s"], b1_rate)
            top_b = max(runs)
            top_gain = _div(runs[top_b]["kvguard_tok_s"], rows[top_b]["kvguard_tok_s"])
            detail = f"batch 1 {_fmt(gain, '.2f', 'x')}, batch {top_b} "
            detail += f"{_fmt(top_gain, '.2f', 'x')}, same tokens "
            detail += ", ".join(f"{r['same_tokens']} at {b}" for b, r in runs.items())
            equal = all(r["same_tokens"] == f"{b}/{b}" for b, r in runs.items())
            ran = all(r.get("steps_ahead", 1) > 0 for r in runs.values())
            gains = [g for g in (gain, top_gain) if g is not None]  # a slower one fails it
            worst = min(gains) if len(gains) == 2 else None
            ok = _met(worst, faster, equal, ran, *(g > 1.0 for g in gains))
            lines.append(verdict(f"{shape} runs of decode steps faster", ok, detail))
        fr = dec.get("fused_runs_on", [])
        if fr and fr[0]["batch"] == 1:
            share_on = _div(fr[0]["kvguard_tok_s"], limit)
            lines.append(
                verdict(
                    f"{shape} batch-1 decode >= {LIMIT_GOAL:.0%} of the limit with per-layer "
                    f"ops and runs of {fr[0]['decode_steps']}",
                    _met(share_on, within_limit),
                    f"{_fmt(share_on, '.0%')} of {limit:.0f} tok/s",
                )
            )
        trace = dec.get("trace", {})
        if "kvguard_triton_prefill_tok_s" in trace:  # what decides KVGUARD_TRITON_PREFILL's
            gain = _div(trace["kvguard_triton_prefill_tok_s"], trace["kvguard_tok_s"])
            equal, note = exact_tokens(tiny("prefill_tiny_fp32"))
            detail = f"trace {_fmt(gain, '.2f', 'x')}, "
            detail += f"same outputs {trace['triton_prefill_same_outputs']}, {note}"
            ok = _met(gain, faster, equal)
            lines.append(verdict(f"{shape} Triton prefill kernel faster", ok, detail))
    packed = result.get("packed", {})
    rows = {r["batch"]: r for r in packed.get("rows", [])}
    if 1 in rows and not smoke:  # what decides KVGUARD_TRITON_GEMV for 4-bit weights
        share = _div(rows[1]["skinny_tok_s"], packed["limit_tok_s_b1"])
        speedup = _num(rows[1]["speedup"])
        detail = f"batch 1 {_fmt(speedup, '.2f', 'x')} ({_fmt(share, '.0%')} of its limit), "
        detail += "same first 8 " + ", ".join(f"{r['same_first8']} at {b}" for b, r in rows.items())
        ok = _met(speedup, faster)
        lines.append(verdict("4-bit model decode faster with the skinny GEMMs", ok, detail))
    planes = [r for r in rows.values() if "planes_speedup" in r]
    if planes and not smoke:  # KVGUARD_W4A16_PLANES on a GGUF-sized group
        speedups = [_num(r["planes_speedup"]) for r in planes]
        if None in speedups:  # the worst row is not known
            worst_x, where = None, "not every batch measured"
        else:
            at = min(range(len(planes)), key=lambda i: speedups[i])
            worst_x, where = speedups[at], f"at batch {planes[at]['batch']}"
        detail = f"worst {_fmt(worst_x, '.2f', 'x')} {where}, same first 8 "
        detail += ", ".join(f"{r['planes_same_first8']} at {r['batch']}" for r in planes)
        ok = _met(worst_x, faster)
        lines.append(verdict("4-bit model decode faster with nibble planes", ok, detail))
    graphs = result.get("cuda_graphs", {})
    rows, exact = graphs.get("rows", []), graphs.get("tiny_fp32", {})
    if rows and not smoke:  # graphs that never captured on a GPU are a failure, not silence
        first = next((r for r in rows if r["batch"] == 1), rows[0])
        captured = bool(exact.get("captures")) and all(r["captures"] for r in rows)
        same, note = exact_tokens(exact)
        speedup = _num(first["speedup"])
        detail = f"{note}, batch-{first['batch']} speed-up {_fmt(speedup, '.2f', 'x')}"
        if not captured:
            detail += ", NOTHING CAPTURED (both runs eager)"
        ok = _met(speedup, faster, captured, same)
        lines.append(verdict("CUDA graphs equal to eager and faster", ok, detail))
    fp8 = graphs.get("fp8", {})
    if "speedup" in fp8 and not smoke:  # what decides KVGUARD_FP8_GRAPHS's default
        same, note = exact_tokens(fp8.get("tiny_fp32"))
        captured = bool(fp8.get("captures")) and bool((fp8.get("tiny_fp32") or {}).get("captures"))
        speedup = _num(fp8["speedup"])
        detail = f"batch {fp8['batch']} {_fmt(speedup, '.2f', 'x')}, "
        detail += f"same tokens {fp8['same_tokens']}"
        detail += f", {note}" + ("" if captured else ", NOTHING CAPTURED (both runs eager)")
        ok = _met(speedup, faster, same, captured)
        lines.append(verdict("FP8 pool replayed faster", ok, detail))
    pool = result.get("pool_sizing", {})
    if "used_share_after_max_batch" in pool:
        used, util = pool["used_share_after_max_batch"], pool["gpu_memory_utilization"]
        detail = f"{used:.1%} of GPU memory in use after a maximal batch"
        lines.append(verdict(f"pool sizing stays within {util:.0%}", used <= util + 0.02, detail))
    oom = result.get("oom", {})
    if "finished" in oom:
        ok = oom["oom_steps"] >= 1 and oom["finished"] == oom["requests"]
        detail = f"{oom['oom_steps']} OOM steps, {oom['finished']}/{oom['requests']} finished"
        what = "an injected OOM (CPU)" if oom["injected"] else "a real CUDA OOM"
        lines.append(verdict(f"engine survives {what}", ok, detail))
    nvml = result.get("nvml", {})
    if "engine_gpus" in nvml:
        ok = bool(nvml["own_gpus"]) and nvml["signal"] is not None
        detail = f"{nvml['engine_gpus']} -> NVML {nvml['own_gpus']}, signal {nvml['signal']}"
        lines.append(verdict("NVML finds the engine's GPU by PCI address", ok, detail))
    if result.get("not_run"):  # the deadline came first: unmeasured, not failed
        lines.append(f"not run (deadline reached): {', '.join(result['not_run'])}")
    return lines


def run_section(result: dict[str, Any], key: str, fn: Callable[[], Any], out: Path | None) -> None:
    """One section; a failure is recorded and the run goes on. The JSON is rewritten after
    every section so a run cut short by its time limit still leaves what it measured."""
    print(f"\n== {key}", flush=True)
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others
        traceback.print_exc()
        value = {"error": repr(exc)[:500]}
        result.setdefault("errors", []).append(key)
    parts = key.split("/")
    slot = result
    for p in parts[:-1]:
        slot = slot.setdefault(p, {})
    slot[parts[-1]] = value
    result.setdefault("seconds", {})[key] = round(time.perf_counter() - t0, 1)
    if out is not None:
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU, seconds")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shapes", default="smollm2-135m,llama2-7b")
    ap.add_argument("--batches", help="decode batch sizes (default 1,16,64; 1,4 with --cpu-smoke)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of: %(default)s")
    ap.add_argument(
        "--deadline",
        type=float,
        metavar="S",
        help="start no section after S seconds (those left are recorded as not run, and the "
        "verdicts still printed); give the outer time limit some margin over it",
    )
    ap.add_argument(
        "--goals", type=Path, metavar="JSON", help="only print the verdicts of a saved run's JSON"
    )
    args = ap.parse_args()
    if args.goals is not None:  # e.g. a run cut short by its time limit before its verdicts
        for line in goals(json.loads(args.goals.read_text())):
            print(line)
        return 0
    wanted = set(args.sections.split(","))
    if wanted - set(SECTIONS):
        ap.error(f"unknown sections {sorted(wanted - set(SECTIONS))}: choose from {SECTIONS}")
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    run = Run(args.cpu_smoke, args.shapes.split(","), batches, wanted)
    if run.smoke:
        torch.set_num_threads(2)
    result: dict[str, Any] = {
        "device": "cpu" if run.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    # Most wanted first: a run that reaches its deadline (or is cut short by its time limit)
    # loses the tail. The explicit asks (kvguard against transformers, graphs, pool
    # sizing, the FP8 switch, a real OOM) come before the extras; the OOM after the sections
    # whose memory figures it could disturb.
    started = time.perf_counter()
    if "nvml" in wanted:  # first: its memory figure is read before anything is allocated
        run_section(result, "nvml", lambda: section_nvml(run), args.json)
    run_section(result, "copy_gbs", lambda: copy_bandwidth(run) / GB, args.json)
    sections: list[tuple[str, Callable[[], Any]]] = []
    copy_bw = result["copy_gbs"] * GB if isinstance(result["copy_gbs"], float) else 1.0
    for shape in run.shapes:
        decode = lambda s=shape: section_decode(s, run, copy_bw)  # noqa: E731
        sections.append((f"decode/{shape}", decode))
    sections += [
        ("cuda_graphs", lambda: section_cuda_graphs(run)),
        ("pool_sizing", lambda: section_pool_sizing(run)),
        ("fp8_switch", lambda: section_fp8(run)),
        ("oom", lambda: section_oom(run)),
        ("packed", lambda: section_packed(run, copy_bw)),
        ("profile", lambda: section_profile(run)),
        # last: a profiler over graph replays is the one section that could upset the others
        ("kernel_time", lambda: section_kernel_time(run)),
    ]
    for key, fn in sections:
        if key.split("/")[0] not in wanted:
            continue
        spent = time.perf_counter() - started
        if args.deadline is not None and spent >= args.deadline:
            print(f"\n== {key}: not run, {spent:.0f} s spent of the {args.deadline:g} s deadline")
            result.setdefault("not_run", []).append(key)
            continue
        run_section(result, key, fn, args.json)
    print()
    for line in goals(result):
        print(line)
    result["goals"] = goals(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
