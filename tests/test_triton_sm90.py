"""Every Triton kernel kvguard launches on a GPU builds for Hopper (sm_90), without a GPU.

The kernel tests run in Triton's CPU interpreter, which never compiles a kernel: a construct the
interpreter accepts and the compiler refuses, or a launch config that spills registers, would
first show on a device run. `tests/triton_sm90.py` records the launches the kernel wrappers make
with the shapes a GPU serves (Llama-2-7B and SmolLM2-135M heads, bf16 / fp32 / fp16 activations,
FP8 caches, decode and prefill batches) and builds each distinct specialisation with
`triton.compile` for `GPUTarget("cuda", 90, 32)`, as the JIT would on an H100/H200 (same
divisibility hints), reading registers and stack from the cubin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("triton_sm90.py")
KERNELS = {
    "triton_attention": {"_decode_kernel", "_merge_kernel", "_prefill_kernel"},
    "triton_kv": {"_write_kernel", "_write_fp8_own_block_kernel"},
    "triton_fused": {"_rmsnorm_kernel", "_rope_kernel", "_silu_mul_kernel"},
    "triton_w4a16": {"_gemm_kernel", "_planes_kernel", "_splitk_reduce_kernel", "_dequant_kernel"},
    "triton_gemv": {"_dense_kernel", "_w4_kernel"},
}
PARTS = 2  # processes building at once (the CI machine's cores)


def _run(*args: str, cache: Path) -> subprocess.Popen:
    """The script in its own process, with a cache of its own (every build is really built,
    and nothing lands in the user's ~/.triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("sm90")
    launches, cache = tmp / "launches.json", tmp / "triton-cache"
    rec = _run("record", str(launches), cache=cache)
    out, err = rec.communicate(timeout=300)
    assert rec.returncode == 0, err[-3000:]
    procs = [_run("compile", str(launches), str(i), str(PARTS), cache=cache) for i in range(PARTS)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return results


def test_every_kernel_builds(builds: list[dict]) -> None:
    failed = [(b["kernel"], b["constexprs"], b["error"]) for b in builds if not b["ok"]]
    assert not failed, failed[:3]
    built = {b["kernel"].rsplit(".", 1)[1] for b in builds}
    assert built == set().union(*KERNELS.values())
    assert len(builds) > 100  # every shape, dtype and batch size gave its own build


def test_the_16_bit_paths_do_not_spill(builds: list[dict]) -> None:
    """Register spills (stack bytes) only where fp32 models take exact fp32 dots (the tiny
    test model's correctness path), never on the bf16 / fp16 / FP8 kernels that serve. A few
    bytes are allowed: ptxas parks a value across a loop in them (one store before the loop,
    one load after it, as the skinny GEMM's sm_90 build does), which costs nothing."""
    fp32_dots = ("DOT_F32", "FP32_DOT")
    spills = [
        (b["kernel"], b["constexprs"], b["stack"])
        for b in builds
        if b["ok"] and b["stack"] > 16 and not any(b["constexprs"].get(f) for f in fp32_dots)
    ]
    assert not spills, spills[:3]


def test_kv_writes_divide_as_torch_does(builds: list[dict]) -> None:
    """The KV write kernels' FP8 scales and bytes are the torch path's to the bit (the kernel
    tests compare them with rtol 0, and a graph's tokens must be eager's): every division in
    them is rounded as IEEE's, never Triton's approximate `/` (a constant's reciprocal
    multiplied in), which the interpreter the CPU tests run in never shows."""
    writes = [b for b in builds if b["ok"] and ".triton_kv." in b["kernel"]]
    assert writes
    assert not [(b["kernel"], b["approx_div"]) for b in writes if b["approx_div"]]


def test_skinny_gemms_stay_light(builds: list[dict]) -> None:
    """`triton_gemv.config` keeps both kernels under 130 registers a thread (so several
    programs share an SM and keep their loads in flight)."""
    gemv = ("_dense_kernel", "_w4_kernel")
    regs = [b["reg"] for b in builds if b["ok"] and b["kernel"].endswith(gemv)]
    assert regs and max(regs) < 130, max(regs)


def test_fp8_tiles_widened_as_loaded_are_read_with_ldmatrix(builds: list[dict]) -> None:
    """FP8 decode tiles cast after staging are read back from shared memory a byte or two a
    lane (no ldmatrix) with twice the registers; widened as loaded (`KVGUARD_FP8_EARLY_WIDEN`)
    they go through shared memory as fp16 and are read with ldmatrix, like bf16 tiles."""
    decode = [b for b in builds if b["ok"] and b["kernel"].endswith("._decode_kernel")]
    # the served heads (Llama-2-7B's 128, SmolLM2's 64; the tiny model's 16-wide tile differs)
    fp8 = [b for b in decode if b["constexprs"]["IS_FP8"] and b["constexprs"]["HEAD_DIM"] >= 64]
    early = [b for b in fp8 if b["constexprs"]["WIDEN_EARLY"]]
    cast = [b for b in fp8 if not b["constexprs"]["WIDEN_EARLY"]]
    assert early and cast
    assert all(b["lds_narrow"] > b["ldsm"] for b in cast), [
        (b["lds_narrow"], b["ldsm"]) for b in cast
    ]
    assert all(b["ldsm"] >= 8 and b["lds_narrow"] < b["ldsm"] for b in early), [
        (b["lds_narrow"], b["ldsm"]) for b in early
    ]
    assert max(b["reg"] for b in early) < 128 < max(b["reg"] for b in cast)


def test_w4a16_nibble_planes_skip_the_per_weight_reshuffle(builds: list[dict]) -> None:
    """The tiled W4A16 GEMM's codes, reshaped eight a word into a row, go through shared
    memory as one 2-byte store per weight; the nibble-plane kernel's do not, and at decode
    tiles it needs fewer registers (16-bit activations; Llama-2-7B's groups of 128, and
    SmolLM2's 576-wide rows in GGUF's groups of 32)."""

    def key(b: dict) -> tuple:
        c = b["constexprs"]
        return c["BLOCK_M"], c["BLOCK_N"], b["signature"].get("x_ptr", b["signature"].get("xp_ptr"))

    tiled = {key(b): b for b in builds if b["ok"] and b["kernel"].endswith("._gemm_kernel")}
    planes = [b for b in builds if b["ok"] and b["kernel"].endswith("._planes_kernel")]
    assert planes
    for b in planes:
        old, decode = tiled[key(b)], key(b)[0] <= 16
        # groups under 128 dequantise each plane first: at the 64-row tile (wgmma, which
        # reads an operand from shared memory) those weights go there 2 bytes at a time too
        if b["constexprs"]["GROUP"] % 128 == 0 or decode:
            assert b["sts_narrow"] == 0 < old["sts_narrow"], (key(b), b["sts_narrow"])
        if decode:
            assert b["reg"] < old["reg"], (key(b), b["reg"], old["reg"])


def test_the_fallback_specialisation_rules_are_tritons() -> None:
    """The recorder's own rules (used where a triton lacks the internal specialiser) give what
    this triton's specialiser gives."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    import triton_sm90

    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        native_specialize_impl = None
    values = [1, 16, 17, 2**33, 1.5, True, None, torch.zeros(4), torch.zeros(8)[1:]]
    values.append(torch.zeros(4, dtype=torch.bfloat16))
    for v in values:
        ours = triton_sm90._rules(v)
        assert ours[0] in ("constexpr", "u1", "i32", "i64", "fp32") or ours[0].startswith("*")
        if native_specialize_impl is not None:
            assert ours == list(native_specialize_impl(BaseBackend, v, False, True, True)), v
