"""Skinny GEMMs on a GPU: `triton_gemv`'s kernels against cuBLAS and the tiled W4A16 GEMM at
decode batch sizes.

Shapes: the projections as kvguard fuses them, Llama-2-7B (qkv 12288x4096, o 4096x4096,
gate_up 22016x4096, down 4096x11008, lm_head 32000x4096) and SmolLM2-135M (qkv 960x576, o
576x576, gate_up 3072x576, down 576x1536, lm_head 49152x576), bf16, at 1 / 2 / 4 / 8 rows:

- cuBLAS (`F.linear`, what serves today) and `triton_gemv.linear`: median time, the weight's
  bytes over it (GB/s) and its share of the device's copy bandwidth (read + write bytes of a
  device-to-device copy, `gpu_kernels.py`'s measure), the kernel's error against fp32;
- the same shapes as 4-bit weights with float zero points, Llama-2-7B in groups of 128 (as GPTQ
  and AWQ checkpoints), SmolLM2-135M in groups of 32 (as the default GGUF, Q4_1): the tiled
  W4A16 GEMM as it serves today (`triton_w4a16.matmul`) against `triton_gemv.w4a16_linear`;
- `--sweep`: each launch config of both kernels at one row on Llama-2-7B's o and gate_up.

Times are `triton.testing.do_bench` medians with the L2 cache cleared before every rep, so each
call streams its weight from HBM as a decode step over a whole model does. The verdict lines
decide `KVGUARD_TRITON_GEMV`'s default: faster than cuBLAS at every row count on Llama-2-7B
(the shapes a batch-1 step spends its time in), with the same tokens end to end
(bench/gpu_e2e.py's `gemv_on` rows).

`--cpu-smoke` runs tiny shapes in Triton's CPU interpreter (it sets TRITON_INTERPRET=1 itself),
so the script can be checked without a GPU; its times mean nothing.

    python bench/gpu_gemv.py [--cpu-smoke] [--sweep] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--cpu-smoke" in sys.argv:  # must precede any triton import (jit picks its mode at definition)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import verdict  # noqa: E402
from bench.gpu_kernels import GB, copy_bandwidth  # noqa: E402
from bench.gpu_w4a16 import make_timer, make_weight  # noqa: E402

LLAMA = [
    ("qkv", 12288, 4096),
    ("o", 4096, 4096),
    ("gate_up", 22016, 4096),
    ("down", 4096, 11008),
    ("lm_head", 32000, 4096),
]
SMOL = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
SMOL += [("lm_head", 49152, 576)]
GPU_ROWS = [1, 2, 4, 8]
SMOKE = [("tiny", 48, 128), ("tiny_down", 32, 256)]
SMOKE_ROWS = [1, 3]
GROUP, SMOKE_GROUP = 128, 64
MAX_REL_ERR = 2e-2  # bf16 output rounding is 2^-8; this only catches a broken kernel
# (block_n, block_k, warps) tried by --sweep; block_k counts weights (8 a 4-bit word)
SWEEP = [
    (4, 512, 4), (4, 1024, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 4), (8, 2048, 8),
    (8, 512, 2), (8, 1024, 8), (16, 256, 4), (16, 512, 4), (16, 1024, 8), (32, 512, 8),
]  # fmt: skip


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def bf16_weight(n: int, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A random `[n, k]` bf16 weight whose products with unit activations stay near 1."""
    return (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)


def dense_rows(
    model: str,
    shapes: list[tuple[str, int, int]],
    rows: list[int],
    device: torch.device,
    copy_bw: float,
    time_it: Callable[[Callable[[], Any]], float],
) -> list[dict[str, Any]]:
    """cuBLAS vs the Triton kernel on bf16 weights, per shape and row count."""
    from kvguard.kernels import triton_gemv

    out = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, n, k in shapes:
        w = bf16_weight(n, k, gen, device)
        wbytes = w.numel() * w.element_size()
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
            err = rel_err(triton_gemv.linear(x, w), x.float() @ w.float().T)
            t_cublas = time_it(lambda x=x, w=w: F.linear(x, w))
            t_triton = time_it(lambda x=x, w=w: triton_gemv.linear(x, w))
            cfg = triton_gemv._config_for(x, n, k, packed=False)
            row = {"model": model, "shape": name, "n": n, "k": k, "rows": m}
            row |= {"cublas_ms": t_cublas * 1e3, "triton_ms": t_triton * 1e3}
            row |= {"speedup": t_cublas / t_triton, "config": [cfg.block_n, cfg.block_k]}
            row |= {"cublas_of_copy": wbytes / t_cublas / copy_bw}
            row |= {"triton_of_copy": wbytes / t_triton / copy_bw, "max_rel_err": err}
            out.append(row)
            print(fmt_dense(row), flush=True)
        del w
    return out


def fmt_dense(r: dict[str, Any]) -> str:
    return (
        f"{r['model']:9} {r['shape']:8} {r['n']:>6} {r['k']:>6} {r['rows']:>3}"
        f" {r['cublas_ms']:>9.4f} {r['cublas_of_copy']:>7.0%} {r['triton_ms']:>9.4f}"
        f" {r['triton_of_copy']:>7.0%} {r['speedup']:>7.2f}x {r['max_rel_err']:>8.1e}"
    )


DENSE_HEADER = (
    f"{'model':9} {'shape':8} {'N':>6} {'K':>6} {'M':>3} {'cuBLAS ms':>9} {'of copy':>7}"
    f" {'Triton ms':>9} {'of copy':>7} {'speedup':>8} {'err':>8}"
)


def w4_rows(
    models: list[tuple[str, list[tuple[str, int, int]], int]],
    rows: list[int],
    device: torch.device,
    copy_bw: float,
    time_it: Callable[[Callable[[], Any]], float],
) -> list[dict[str, Any]]:
    """The tiled W4A16 GEMM (today's path) vs the skinny 4-bit kernel, bf16 activations, per
    (model, shapes, group size)."""

    out = []
    for model, shapes, group in models:
        out += _w4_model(model, shapes, group, rows, device, copy_bw, time_it)
    return out


def _w4_model(
    model: str,
    shapes: list[tuple[str, int, int]],
    group: int,
    rows: list[int],
    device: torch.device,
    copy_bw: float,
    time_it: Callable[[Callable[[], Any]], float],
) -> list[dict[str, Any]]:
    from kvguard.kernels import triton_gemv, triton_w4a16

    out = []
    for name, n, k in shapes:
        w, w32 = make_weight(n, k, group, device)
        for m in rows:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            ref = x.float() @ w32.T
            err = rel_err(triton_gemv.w4a16_linear(x, w), ref)
            t_tiled = time_it(lambda x=x, w=w: triton_w4a16.matmul(x, w))
            t_gemv = time_it(lambda x=x, w=w: triton_gemv.w4a16_linear(x, w))
            row = {"model": model, "group": group, "shape": name, "n": n, "k": k, "rows": m}
            row["tiled_ms"] = t_tiled * 1e3
            row |= {"gemv_ms": t_gemv * 1e3, "speedup": t_tiled / t_gemv}
            row |= {"gemv_of_copy": w.nbytes / t_gemv / copy_bw, "max_rel_err": err}
            out.append(row)
            print(
                f"w4a16 g{group:<3} {model:9} {name:8} {n:>6} {k:>6} {m:>3} tiled {row['tiled_ms']:.4f} ms,"
                f" skinny {row['gemv_ms']:.4f} ms ({row['gemv_of_copy']:.0%} of copy),"
                f" {row['speedup']:.2f}x, err {err:.1e}",
                flush=True,
            )
        del w, w32
    return out


def sweep(
    shapes: list[tuple[str, int, int]],
    configs: list[tuple[int, int, int]],
    group: int,
    device: torch.device,
    copy_bw: float,
    time_it: Callable[[Callable[[], Any]], float],
) -> list[dict[str, Any]]:
    """One row, each launch config, bf16 and 4-bit weights: ms and share of copy bandwidth."""
    from kvguard.kernels import triton_gemv

    out = []
    gen = torch.Generator(device=device).manual_seed(1)
    for name, n, k in shapes:
        w16 = bf16_weight(n, k, gen, device)
        w4, _ = make_weight(n, k, group, device)
        x = torch.randn(1, k, generator=gen, device=device).to(torch.bfloat16)
        for bn, bk, warps in configs:
            cfg = triton_gemv.GemvConfig(bn, bk, warps)
            row = {"shape": name, "n": n, "k": k, "config": [bn, bk, warps]}
            try:
                t16 = time_it(lambda cfg=cfg, x=x, w=w16: triton_gemv.linear(x, w, cfg=cfg))
                t4 = time_it(lambda cfg=cfg, x=x, w=w4: triton_gemv.w4a16_linear(x, w, cfg=cfg))
            except Exception as exc:  # noqa: BLE001 - one config failing must not end the sweep
                out.append(row | {"error": f"{type(exc).__name__}: {exc}"[:500]})
                print(f"sweep {name:8} {bn:>3} {bk:>5} {warps}: FAILED {exc}", flush=True)
                continue
            row |= {"bf16_ms": t16 * 1e3, "bf16_of_copy": w16.numel() * 2 / t16 / copy_bw}
            row |= {"w4_ms": t4 * 1e3, "w4_of_copy": w4.nbytes / t4 / copy_bw}
            out.append(row)
            print(
                f"sweep {name:8} {bn:>3} {bk:>5} {warps}: bf16 {t16 * 1e3:.4f} ms"
                f" ({row['bf16_of_copy']:.0%}), 4-bit {t4 * 1e3:.4f} ms ({row['w4_of_copy']:.0%})",
                flush=True,
            )
        del w16, w4
    return out


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def goals(result: dict[str, Any], smoke: bool) -> list[str]:
    """What decides KVGUARD_TRITON_GEMV's default, from the rows measured."""
    if smoke:
        return [verdict("skinny GEMM goals", None, "no GPU numbers")]
    lines = []
    llama = [r for r in result["dense"] if r["model"] == "llama2-7b"]
    if llama:
        worst = min(llama, key=lambda r: r["speedup"])
        detail = (
            f"geomean {geomean([r['speedup'] for r in llama]):.2f}x, worst {worst['speedup']:.2f}x"
            f" ({worst['shape']} at {worst['rows']} rows)"
        )
        ok = worst["speedup"] > 1.0
        lines.append(
            verdict("Triton skinny GEMM faster than cuBLAS (llama2-7b, 1-8 rows)", ok, detail)
        )
        one = [r for r in llama if r["rows"] == 1]
        share = sum(r["n"] * r["k"] * 2 for r in one) / sum(
            r["n"] * r["k"] * 2 / r["triton_of_copy"] for r in one
        )
        lines.append(
            verdict("skinny GEMM at one row >= 70% of copy bandwidth", share >= 0.7, f"{share:.0%}")
        )
    w4 = result.get("w4a16", [])
    if w4:
        worst = min(w4, key=lambda r: r["speedup"])
        detail = (
            f"geomean {geomean([r['speedup'] for r in w4]):.2f}x, worst {worst['speedup']:.2f}x"
        )
        lines.append(
            verdict(
                "4-bit skinny GEMM faster than the tiled W4A16 GEMM", worst["speedup"] > 1.0, detail
            )
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Triton interpreter")
    ap.add_argument("--sweep", action="store_true", help="each launch config at one row")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    if args.cpu_smoke:
        device = torch.device("cpu")
        models, rows, group = [("tiny", SMOKE)], SMOKE_ROWS, SMOKE_GROUP
        w4_models = [("tiny", SMOKE, SMOKE_GROUP), ("tiny", SMOKE[:1], 32)]
        sweep_shapes, configs = SMOKE[:1], [(4, 64, 4), (8, 128, 4)]
        copy_bw = copy_bandwidth(device, 2**20, 1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-smoke for the interpreter check", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        models, rows, group = [("llama2-7b", LLAMA), ("smollm2", SMOL)], GPU_ROWS, GROUP
        # GPTQ/AWQ-style groups of 128 on Llama-2-7B; the default GGUF's (Q4_1) groups of 32
        w4_models = [("llama2-7b", LLAMA, GROUP), ("smollm2", SMOL, 32)]
        sweep_shapes, configs = [LLAMA[1], LLAMA[2]], SWEEP
        print(torch.cuda.get_device_name(), flush=True)
        copy_bw = copy_bandwidth(device, 2 * 2**30, 20)
    print(f"device copy bandwidth (read+write): {copy_bw / GB:.1f} GB/s", flush=True)
    time_it = make_timer(device.type == "cuda", reps=1)
    result: dict[str, Any] = {
        "device": "cpu-interpreter" if args.cpu_smoke else torch.cuda.get_device_name(),
        "copy_gbs": copy_bw / GB,
        "dense": [],
    }
    print(DENSE_HEADER)
    for model, shapes in models:
        result["dense"] += dense_rows(model, shapes, rows, device, copy_bw, time_it)
    result["w4a16"] = w4_rows(w4_models, rows, device, copy_bw, time_it)
    result["goals"] = goals(result, args.cpu_smoke)
    for line in result["goals"]:
        print(line)
    if args.json:  # before the sweep: a run cut short there keeps the verdicts
        args.json.write_text(json.dumps(result, indent=2))
    if args.sweep:
        result["sweep"] = sweep(sweep_shapes, configs, group, device, copy_bw, time_it)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    bad = [r for r in result["dense"] + result["w4a16"] if not r["max_rel_err"] < MAX_REL_ERR]
    if bad:
        print(f"MISMATCH against the fp32 reference in {len(bad)} rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
