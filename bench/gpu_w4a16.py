"""Triton W4A16 GEMM on a GPU: time against fp16 `torch.matmul`, and the weight bandwidth it reaches.

For Llama-2-7B's linear shapes (out x in: q/k/v/o 4096x4096, gate/up 11008x4096, down
4096x11008), 4-bit codes in groups of 128 with float zero points, fp16 activations, at batch
1 / 16 / 64 (decode) and 256 (past `LARGE_M`, where prefill takes the dequantise + matmul path):

- `w4a16_matmul`'s time as dispatched (`auto`), and each path forced: the fused kernel with its
  split-K plan, the fused kernel without split-K (what the split buys), the nibble-plane fused
  kernel (`KVGUARD_W4A16_PLANES=1`, opt-in) with the same plan, and dequantise + matmul (where
  the `LARGE_M` threshold should sit);
- fp16 `torch.matmul` on the same weight dequantised to fp16 (the dense baseline) and the
  speedup of `auto` over it;
- effective weight bandwidth: the packed bytes (codes + scales + zeros) over `auto`'s time, set
  against the device's copy bandwidth (read + write, `bench/gpu_kernels.py`'s measure), and the
  fp16 weight's bytes over the dense time;
- max |error| over max |reference| against the fp32 `x @ W.T`, as a check of what is timed.

On CUDA, times are `triton.testing.do_bench` medians: it clears the L2 cache before every rep,
so each call streams its weight from HBM as a decode step over a whole model does (a 4096x4096
4-bit layer would otherwise sit in H100/H200's 50 MB L2 and report cache bandwidth).

`--cpu-smoke` runs tiny shapes in Triton's CPU interpreter (it sets TRITON_INTERPRET=1 itself),
so the script can be checked without a GPU; its times mean nothing.

    python bench/gpu_w4a16.py [--cpu-smoke] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if "--cpu-smoke" in sys.argv:  # must precede any triton import (jit picks its mode at definition)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu_kernels import GB, copy_bandwidth, timer  # noqa: E402

GPU_SHAPES = [("qkvo", 4096, 4096), ("gate_up", 11008, 4096), ("down", 4096, 11008)]
GPU_BATCHES = [1, 16, 64, 256]
SMOKE_SHAPES = [("tiny", 48, 128), ("tiny_down", 32, 256)]
SMOKE_BATCHES = [1, 5, 33]
GROUP = 128
SMOKE_GROUP = 128  # the nibble-plane kernel takes groups of 128 (and multiples)
MAX_REL_ERR = 1e-2  # fp16 output rounding is ~5e-4; this only catches a broken kernel


@dataclass
class Row:
    shape: str
    n: int
    k: int
    batch: int
    path: str  # what w4a16_matmul picked: fused (split_k=..) or dequant+mm
    auto_ms: float
    fused_ms: float
    fused_nosplit_ms: float
    planes_ms: float
    dequant_mm_ms: float
    fp16_ms: float
    speedup_vs_fp16: float
    planes_over_fused: float  # the nibble-plane kernel's time / the fused kernel's
    w4_gbs: float
    of_copy_bw: float
    fp16_gbs: float
    max_rel_err: float
    planes_rel_err: float


def make_weight(n: int, k: int, group: int, device: torch.device) -> tuple[Any, torch.Tensor]:
    """A random 4-bit layer, packed for the kernel, and its fp32 dequantisation."""
    from kvguard.engine.layers.quant_spec import QuantSpec
    from kvguard.kernels.w4a16 import pack_for_triton

    gen = torch.Generator(device=device).manual_seed(0)
    g = k // group
    spec = QuantSpec(
        q=torch.randint(0, 16, (n, k), generator=gen, device=device, dtype=torch.uint8),
        scales=torch.rand(n, g, generator=gen, device=device) * 0.01 + 0.001,
        zeros=torch.rand(n, g, generator=gen, device=device) * 15,
        group_size=group,
        bits=4,
    )
    return pack_for_triton(spec), spec.dequantize()


def make_timer(cuda: bool, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Seconds per call: L2-flushed CUDA medians on a GPU, wall-clock medians on the CPU."""
    if not cuda:
        return lambda fn: timer(fn, reps, cuda=False)
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3


def time_paths(
    x: torch.Tensor, w: Any, w16: torch.Tensor, time_it: Callable[[Callable[[], Any]], float]
) -> dict[str, float]:
    """Seconds per call of the dispatched matmul, each W4A16 path forced, and dense fp16."""
    from kvguard.kernels import triton_w4a16 as tw
    from kvguard.kernels.dispatch import w4a16_matmul

    m = x.shape[0]
    return {
        "auto": time_it(lambda: w4a16_matmul(x, w)),
        "fused": time_it(lambda: tw.matmul(x, w, large_m=m)),
        "nosplit": time_it(lambda: tw.matmul(x, w, split_k=1, large_m=m)),
        "planes": time_it(lambda: tw.matmul(x, w, large_m=m, planes=True)),
        "dequant": time_it(lambda: tw.matmul(x, w, large_m=0)),
        "fp16": time_it(lambda: x @ w16.T),
    }


def bench_shape(
    name: str,
    n: int,
    k: int,
    group: int,
    batches: list[int],
    device: torch.device,
    copy_bw: float,
    time_it: Callable[[Callable[[], Any]], float],
) -> list[Row]:
    from kvguard.kernels import triton_w4a16 as tw
    from kvguard.kernels.dispatch import w4a16_matmul

    w, w32 = make_weight(n, k, group, device)
    w16 = w32.half()
    rows = []
    for m in batches:
        x = torch.randn(m, k, device=device, dtype=torch.float16)
        ref = x.float() @ w32.T
        got = w4a16_matmul(x, w)
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        planes = tw.matmul(x, w, large_m=m, planes=True)
        planes_err = ((planes.float() - ref).abs().max() / ref.abs().max()).item()
        p = tw.plan(m, n, k, group, device)
        path = f"fused split_k={p.split_k}" if m <= tw.LARGE_M else "dequant+mm"
        t = time_paths(x, w, w16, time_it)
        rows.append(
            Row(
                name,
                n,
                k,
                m,
                path,
                t["auto"] * 1e3,
                t["fused"] * 1e3,
                t["nosplit"] * 1e3,
                t["planes"] * 1e3,
                t["dequant"] * 1e3,
                t["fp16"] * 1e3,
                t["fp16"] / t["auto"],
                t["planes"] / t["fused"],
                w.nbytes / t["auto"] / GB,
                w.nbytes / t["auto"] / copy_bw,
                w16.numel() * 2 / t["fp16"] / GB,
                err,
                planes_err,
            )
        )
    return rows


HEADER = (
    f"{'shape':9} {'N':>6} {'K':>6} {'B':>4} {'path':20} {'auto ms':>8} {'fused':>8}"
    f" {'nosplit':>8} {'planes':>8} {'deq+mm':>8} {'fp16 ms':>8} {'x fp16':>7} {'w4 GB/s':>8} {'of copy':>8}"
    f" {'fp16 GB/s':>9} {'err':>8}"
)


def fmt(r: Row) -> str:
    return (
        f"{r.shape:9} {r.n:>6} {r.k:>6} {r.batch:>4} {r.path:20} {r.auto_ms:>8.4f}"
        f" {r.fused_ms:>8.4f} {r.fused_nosplit_ms:>8.4f} {r.planes_ms:>8.4f} {r.dequant_mm_ms:>8.4f}"
        f" {r.fp16_ms:>8.4f} {r.speedup_vs_fp16:>7.2f} {r.w4_gbs:>8.1f} {r.of_copy_bw:>8.0%}"
        f" {r.fp16_gbs:>9.1f} {r.max_rel_err:>8.1e}"
    )


def goals(rows: list[Row], smoke: bool) -> list[str]:
    """Whether the nibble-plane kernel (opt-in) beats the tiled one at every fused batch, as
    `KVGUARD_W4A16_PLANES` would need to become the default."""
    from bench.common import verdict
    from kvguard.kernels.triton_w4a16 import LARGE_M

    fused = [r for r in rows if r.batch <= LARGE_M]
    name = "W4A16 nibble planes faster than the tiled GEMM"
    if smoke or not fused:
        return [verdict(name, None, "no GPU rows")]
    worst = max(fused, key=lambda r: r.planes_over_fused)
    ok = worst.planes_over_fused < 1.0 and all(r.planes_rel_err < MAX_REL_ERR for r in fused)
    detail = f"worst {1 / worst.planes_over_fused:.2f}x: {worst.shape} batch {worst.batch}"
    return [verdict(name, ok, detail)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Triton interpreter")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    if args.cpu_smoke:
        device, shapes, batches, group = (
            torch.device("cpu"),
            SMOKE_SHAPES,
            SMOKE_BATCHES,
            SMOKE_GROUP,
        )
        copy_bw = copy_bandwidth(device, 2**20, 1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-smoke for the interpreter check", file=sys.stderr)
            return 2
        device, shapes, batches, group = torch.device("cuda"), GPU_SHAPES, GPU_BATCHES, GROUP
        print(torch.cuda.get_device_name(), flush=True)
        copy_bw = copy_bandwidth(device, 2 * 2**30, 20)
    print(f"device copy bandwidth (read+write): {copy_bw / GB:.1f} GB/s", flush=True)
    time_it = make_timer(device.type == "cuda", reps=1)
    print(HEADER)
    rows: list[Row] = []
    for name, n, k in shapes:
        for r in bench_shape(name, n, k, group, batches, device, copy_bw, time_it):
            rows.append(r)
            print(fmt(r), flush=True)
    result = {
        "device": "cpu-interpreter" if args.cpu_smoke else torch.cuda.get_device_name(),
        "group_size": group,
        "copy_gbs": copy_bw / GB,
        "rows": [asdict(r) for r in rows],
    }
    result["goals"] = goals(rows, args.cpu_smoke)
    for line in result["goals"]:
        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    bad = [r for r in rows if not max(r.max_rel_err, r.planes_rel_err) < MAX_REL_ERR]
    if bad:
        print(f"MISMATCH against the fp32 reference in {len(bad)} rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
