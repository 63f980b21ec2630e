"""Build every Triton kernel kvguard launches for a Hopper GPU (sm_90), with no GPU.

The kernels are tested in Triton's CPU interpreter, which runs their Python and never their
compiled form: a kernel that cannot be compiled (a construct the interpreter accepts and the
compiler refuses), or one that spills registers, would only show on a device run, and device
time is scarce. So this script, in two processes:

- `record` (under `TRITON_INTERPRET=1`): calls each kernel wrapper with the shapes and dtypes
  the engine serves on a GPU (Llama-2-7B's and SmolLM2-135M's heads, bf16 / fp16 / fp32 /
  FP8 caches, decode-sized and prefill-sized batches), and records every launch (kernel,
  argument types, constexpr values, warps, stages) instead of running it;
- `compile` (interpreter off): compiles each distinct launch with `triton.compile` for
  `GPUTarget("cuda", 90, 32)` (ptxas ships with triton) and reads its registers and stack
  bytes from the cubin (`cuobjdump --dump-resource-usage`).

    python tests/triton_sm90.py record FILE             # writes the launches
    python tests/triton_sm90.py compile FILE [I N]      # one JSON line per build (part I of N)

tests/test_triton_sm90.py runs both.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_PTR = {
    "torch.bfloat16": "*bf16", "torch.float16": "*fp16", "torch.float32": "*fp32",
    "torch.int32": "*i32", "torch.int64": "*i64", "torch.float8_e4m3fn": "*fp8e4nv",
    "torch.uint8": "*u8", "torch.int8": "*i8",
}  # fmt: skip


def _kind(value: Any) -> list[Any]:
    """An argument as the JIT specialises it (type, and "D" where divisible by 16 / aligned)
    and its value where it is a plain Python one (a constexpr, or an int the JIT folds).
    Triton's own specialiser where this triton has it (an internal API), else its rules."""
    plain = value if isinstance(value, bool | int | float | str) or value is None else None
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        return _rules(value) + [plain]
    kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
    return [kind, attr, plain]


def _rules(value: Any) -> list[Any]:
    """Triton's specialisation rules: ints equal to 1 fold to constexprs, ints and pointers
    divisible by 16 carry the hint, None is a constexpr."""
    import torch

    if value is None:
        return ["constexpr", None]
    if isinstance(value, torch.Tensor):
        return [_PTR[str(value.dtype)], "D" if value.data_ptr() % 16 == 0 else ""]
    if isinstance(value, bool):
        return ["u1", None]
    if isinstance(value, int):
        if value == 1:
            return ["constexpr", 1]
        kind = "i32" if -(2**31) <= value < 2**31 else "i64"
        return [kind, "D" if value % 16 == 0 else ""]
    if isinstance(value, float):
        return ["fp32", None]
    return ["constexpr", value]


def record(path: Path) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[dict[str, Any]] = []

    def run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202, ARG001
        named = dict(zip(self.arg_names, args, strict=False)) | kwargs
        launch = {k: _kind(v) for k, v in named.items() if k not in ("num_warps", "num_stages")}
        launches.append(
            {
                "module": self.fn.__module__,
                "name": self.fn.__name__,
                "args": launch,
                "num_warps": kwargs.get("num_warps", 4),
                "num_stages": kwargs.get("num_stages", 3),
            }
        )

    InterpretedFunction.run = run
    _launch_everything()
    path.write_text(json.dumps(launches))


def _launch_everything() -> None:
    """Each wrapper as the CUDA engine calls it (execution is skipped: shapes only)."""
    import torch

    from kvguard.kernels import triton_attention as ta
    from kvguard.kernels import triton_fused as tf
    from kvguard.kernels import triton_gemv as tg
    from kvguard.kernels import triton_kv as tk
    from kvguard.kernels import triton_w4a16 as tw
    from kvguard.kernels.dispatch import FP8_EARLY_WIDEN_ENV
    from kvguard.kernels.w4a16 import W4A16Weight

    # the launches a GPU makes: no interpreter-only choices (fp32 dots for bf16), GPU tiles
    ta._INTERPRETED = False
    tw.InterpretedFunction = type("NotInterpreted", (), {})
    fp8 = torch.float8_e4m3fn
    blocks, bs = 64, 16
    # (heads, kv heads, head dim, hidden, intermediate): Llama-2-7B, SmolLM2-135M, the tiny model
    shapes = [(32, 32, 128, 4096, 11008), (9, 3, 64, 576, 1536), (4, 2, 16, 64, 128)]
    for heads, kvh, hd, hidden, inter in shapes:
        # bf16 models, fp32 ones (the tiny test model on CUDA), fp16 on one shape
        dtypes = (torch.bfloat16, torch.float32) + ((torch.float16,) if hd == 128 else ())
        for dt in dtypes:
            for cache_dt in (dt, fp8):
                if cache_dt == fp8 and dt == torch.float32:
                    continue
                kc = torch.zeros(blocks, bs, kvh, hd, dtype=cache_dt)
                vc = torch.zeros_like(kc)
                sc = torch.ones(blocks, kvh) if cache_dt == fp8 else None
                for batch, ctx in ((1, 100), (64, 1000)):
                    q = torch.zeros(batch, heads, hd, dtype=dt)
                    tables = torch.zeros(batch, blocks, dtype=torch.int32)
                    lens = torch.full((batch,), ctx, dtype=torch.int32)
                    ta.paged_decode(q, kc, vc, tables, lens, ctx, hd**-0.5, sc, sc)
                    if cache_dt == fp8:  # and widened as loaded (opt-in)
                        os.environ[FP8_EARLY_WIDEN_ENV] = "1"
                        ta.paged_decode(q, kc, vc, tables, lens, ctx, hd**-0.5, sc, sc)
                        del os.environ[FP8_EARLY_WIDEN_ENV]
                q = torch.zeros(40, heads, hd, dtype=dt)
                out = torch.zeros_like(q)
                tables = torch.zeros(3, blocks, dtype=torch.int32)
                ta.prefill_rows(
                    q, out, kc, vc, tables, [20, 60, 9], [20, 19, 1], [0, 20, 39], [0, 1],
                    hd**-0.5, sc, sc,
                )  # fmt: skip
                x = torch.zeros(5, kvh, hd, dtype=dt)
                slots = torch.arange(5, dtype=torch.int64)
                tk.store_kv(kc, x, slots, sc)
                if cache_dt == fp8:
                    tk.store_fp8_own_blocks(kc, x, slots * bs, sc)
            rows = torch.zeros(3, hidden, dtype=dt)
            tf.rmsnorm(rows, torch.ones(hidden, dtype=dt), 1e-5)
            tf.rmsnorm(rows, torch.ones(hidden, dtype=dt), 1e-5, torch.zeros_like(rows))
            qkv = torch.zeros(3, (heads + 2 * kvh) * hd, dtype=dt)
            cos = torch.zeros(3, hd, dtype=torch.float32)
            tf.rope_(qkv, heads + kvh, hd, cos, cos)
            tf.silu_mul(torch.zeros(3, 2 * inter, dtype=dt), inter)
            for n, k in ((hidden, hidden), (2 * inter, hidden), (hidden, inter)):
                w = torch.zeros(n, k, dtype=dt)
                for m in (1, 2, 3, 4, 8):
                    tg.linear(torch.zeros(m, k, dtype=dt), w, cfg=tg.config(n, k, 132, rows=m))
                if dt == torch.float32:
                    continue
                if k % 128:  # SmolLM2's 576: a GGUF-sized group, by nibble planes
                    g32 = W4A16Weight(
                        torch.zeros(n, k // 8, dtype=torch.int32),
                        torch.ones(n, k // 32),
                        torch.zeros(n, k // 32),
                        32,
                    )
                    for m in (16, 64):
                        tw.matmul(torch.zeros(m, k, dtype=dt), g32, planes=True)
                    continue
                packed = W4A16Weight(
                    torch.zeros(n, k // 8, dtype=torch.int32),
                    torch.ones(n, k // 128),
                    torch.zeros(n, k // 128),
                    128,
                )
                for m in (1, 2, 4, 8):
                    cfg = tg.config(n, k, 132, packed=True, rows=m)
                    tg.w4a16_linear(torch.zeros(m, k, dtype=dt), packed, cfg=cfg)
                for m in (1, 16, 64, 256):
                    tw.matmul(torch.zeros(m, k, dtype=dt), packed)
                    tw.matmul(torch.zeros(m, k, dtype=dt), packed, planes=True)


def _resources(cubin: bytes, sass: bool = False) -> dict[str, int]:
    """Registers, stack, shared and local bytes of a build; with `sass`, also how its code
    uses shared memory: `ldsm` ldmatrix instructions, `lds_narrow` / `sts_narrow` 8/16-bit
    LDS / STS ones."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
        code = ""
        if sass:
            code = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True)
            code = code.stdout
    line = next(x for x in out.splitlines() if "REG:" in x)
    fields = dict(p.split(":", 1) for p in line.split() if ":" in p)
    res = {k.lower(): int(fields[k]) for k in ("REG", "STACK", "SHARED", "LOCAL")}
    if sass:
        res["ldsm"] = len(re.findall(r"\bLDSM\b", code))
        res["lds_narrow"] = len(re.findall(r"\bLDS\.(?:U8|S8|U16|S16)\b", code))
        res["sts_narrow"] = len(re.findall(r"\bSTS\.(?:U8|S8|U16|S16)\b", code))
    return res


def compile_all(path: Path, part: int = 0, parts: int = 1) -> None:
    """Build launch specialisations `part`, `part + parts`, ... (several processes share the
    work) and print one JSON line each."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    seen: set[str] = set()
    for launch in json.loads(path.read_text()):
        fn = getattr(importlib.import_module(launch["module"]), launch["name"])
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(fn.params):
            kind, attr, value = launch["args"][p.name]
            if p.is_constexpr or kind == "constexpr":
                constexprs[p.name] = value
                signature[p.name] = "constexpr"
            else:
                signature[p.name] = kind
                if attr == "D":
                    attrs[(i,)] = [["tt.divisibility", 16]]
        result = {"kernel": f"{launch['module']}.{launch['name']}", "constexprs": constexprs}
        result |= {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}
        result["signature"] = {k: v for k, v in signature.items() if v != "constexpr"}
        result["aligned"] = sorted(fn.params[i].name for (i,) in attrs)
        key = json.dumps(result, sort_keys=True)  # one build per distinct specialisation
        if key in seen:
            continue
        seen.add(key)
        if (len(seen) - 1) % parts != part:
            continue
        try:
            compiled = triton.compile(
                ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                target=target,
                options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]},
            )
            # how tiles go through shared memory (decode attention, the tiled W4A16 GEMMs)
            sass = launch["name"] in ("_decode_kernel", "_gemm_kernel", "_planes_kernel")
            result |= {"ok": True} | _resources(compiled.asm["cubin"], sass)
            # divisions not rounded as IEEE's (and torch's) are: `/` on floats may become these
            result["approx_div"] = len(re.findall(r"\bdiv\.(?:approx|full)\.", compiled.asm["ptx"]))
        except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
            result |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-2000:]}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    mode, file = sys.argv[1], Path(sys.argv[2])
    if mode == "record":
        record(file)
    else:
        compile_all(file, *(int(a) for a in sys.argv[3:5]))
