"""Which implementation a kernel call uses: Triton on CUDA when it can, torch otherwise.

The torch path in `paged_attention` runs everywhere and stays the reference; Triton only takes
over on CUDA, where the torch decode path pays for gathering every sequence's blocks into a
contiguous workspace before attention. `KVGUARD_TRITON=0` turns the Triton path off (to compare
the two, or to route around a kernel bug) without a code change. Every switch here reads the
environment as `env.env_flag` does (1/true/on/yes, 0/false/off/no; anything else warned about).

The same rule picks the Triton W4A16 GEMM for 4-bit weight-only linears (`w4a16_matmul`), whose
torch path is only a reference: on CPU the quantized layer serves with torch's int4pack kernels.
A layer's small ops (`layer_ops`: residual add + RMSNorm, RoPE, SiLU-and-multiply) run the C
kernels of `cpu_ops` on CPU and, when asked, the Triton ones of `triton_fused` on CUDA
(`fused_ops`); prefill chunks take the Triton kernel only when asked (`use_triton_prefill`), and
so do decode-sized projections the skinny GEMMs of `triton_gemv` (`dense_linear`, and
`w4a16_matmul` for 4-bit weights; `gemv_rows`): opt-in until a device run has timed them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

import torch
import torch.nn.functional as F

from kvguard.kernels import cpu_ops
from kvguard.kernels.env import env_flag, warn_unknown
from kvguard.kernels.w4a16 import W4A16Weight, reference_matmul


@functools.cache
def triton_available() -> bool:
    """Whether `triton` can be imported; cached because the answer cannot change in a process.

    Only the spec is looked up: importing triton itself is deferred to the kernel modules, so a
    CPU-only install never pays for (or trips over) it.
    """
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or deliberately blocked install
        return False


@functools.cache
def _fp8_capable(index: int | None) -> bool:
    """Triton's e4m3 type (`float8e4nv`) needs compute capability 8.9+ (Ada, Hopper, later)."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def use_triton(device: torch.device | str, kv_dtype: torch.dtype | None = None) -> bool:
    """True when calls on `device` (with a KV cache of `kv_dtype`) should go to Triton.

    Needs a CUDA device, an importable triton, and `KVGUARD_TRITON` not off; an FP8
    cache also needs a GPU whose Triton supports e4m3 (older GPUs keep the torch path for
    FP8 only). The environment is read on every call (it is cheap) so a benchmark can flip
    it between runs.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    if not env_flag("KVGUARD_TRITON", True) or not triton_available():
        return False
    return kv_dtype != torch.float8_e4m3fn or _fp8_capable(dev.index)


TRITON_PREFILL_ENV = "KVGUARD_TRITON_PREFILL"  # on: prefill chunks through the Triton kernel


def use_triton_prefill(device: torch.device | str, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether prefill chunks on `device` go to the Triton prefill kernel
    (`triton_attention.prefill_rows`) instead of torch's per-sequence SDPA: where `use_triton`
    holds and `KVGUARD_TRITON_PREFILL` is on. Off by default until a device run has shown it
    equal and faster (bench/gpu_kernels.py times both)."""
    return env_flag(TRITON_PREFILL_ENV, False) and use_triton(device, kv_dtype)


FUSED_OPS_ENV = "KVGUARD_FUSED_OPS"  # on: a layer's small ops as Triton kernels (opt-in)


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """The Triton per-layer ops (`triton_fused`: add + RMSNorm, RoPE, SiLU-and-multiply) where
    they serve activation `x`: on CUDA as `use_triton` says, when `KVGUARD_FUSED_OPS` is on;
    None means the torch ops. Opt-in until a device run has shown them equal and faster
    (bench/gpu_e2e.py times decode with them on and off), as CUDA graphs were."""
    if x.device.type != "cuda" or not env_flag(FUSED_OPS_ENV, False):
        return None
    if not use_triton(x.device):
        return None
    from kvguard.kernels import triton_fused

    return triton_fused


def layer_ops(x: torch.Tensor) -> ModuleType | None:
    """The kernels for a layer's small ops on activation `x` (`rmsnorm` with the residual add,
    `rope_` in place, `silu_mul`, same contracts in both modules): `cpu_ops` where its C kernels
    serve, else `triton_fused` where `fused_ops` says; None means torch's ops."""
    return cpu_ops if cpu_ops.enabled(x) else fused_ops(x)


FP8_EARLY_WIDEN_ENV = "KVGUARD_FP8_EARLY_WIDEN"  # on: FP8 decode tiles widened as loaded


def fp8_early_widen() -> bool:
    """Whether the Triton decode kernel widens FP8 K/V tiles to fp16 as it loads them (in
    128-token tiles of 8 warps) rather than after staging them: `KVGUARD_FP8_EARLY_WIDEN`
    on (read when a step is launched or captured). Opt-in until a device run has shown it
    equal and faster (bench/gpu_kernels.py's `fp8e` rows)."""
    return env_flag(FP8_EARLY_WIDEN_ENV, False)


def _interpreting() -> bool:
    """Triton's CPU interpreter is on (tests): kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton_w4a16(device: torch.device | str) -> bool:
    """True when a W4A16 matmul on `device` should go to the Triton kernel: CUDA as for
    `use_triton`, and CPU tensors under `TRITON_INTERPRET=1`, where the kernel runs in the
    interpreter so tests can check it without a GPU (slow: not a CPU serving path).
    `KVGUARD_TRITON=0` turns both off."""
    dev = torch.device(device)
    if dev.type == "cpu" and _interpreting():
        return env_flag("KVGUARD_TRITON", True) and triton_available()
    return use_triton(dev)


W4A16_PLANES_ENV = "KVGUARD_W4A16_PLANES"  # on: the tiled W4A16 GEMM by nibble planes


def w4a16_planes() -> bool:
    """Whether the tiled W4A16 GEMM (9 to `LARGE_M` rows, and any rows the skinny GEMMs do
    not take) runs by nibble planes (`triton_w4a16._planes_kernel`, 16-bit activations, any
    group): `KVGUARD_W4A16_PLANES` on. Opt-in until a device run has shown it faster
    (bench/gpu_w4a16.py, gpu_e2e.py's packed section)."""
    return env_flag(W4A16_PLANES_ENV, False)


GEMV_ENV = "KVGUARD_TRITON_GEMV"  # projections of a few rows as Triton skinny GEMMs (opt-in)
# its values: which weights take them (a device run may show one kind faster, not the other);
# "0" or unset: none, and anything else none too, warned about
GEMV_WEIGHTS = {"1": ("dense", "4bit"), "dense": ("dense",), "4bit": ("4bit",)}
GEMV_MAX_ROWS = 8  # rows up to which `triton_gemv` takes a projection (its MAX_ROWS)


def gemv_rows(x: torch.Tensor, weights: str = "dense") -> bool:
    """Whether a projection of activation `x` onto `weights` ("dense": 16/32-bit, "4bit":
    packed) goes to `triton_gemv`'s skinny GEMMs: 1 to `GEMV_MAX_ROWS` rows,
    `KVGUARD_TRITON_GEMV` "1" (both kinds), "dense" or "4bit", and CUDA as `use_triton` says
    (CPU tensors under `TRITON_INTERPRET=1` too, for tests). Opt-in until a device run has
    shown them equal and faster (bench/gpu_gemv.py against cuBLAS and the tiled W4A16 GEMM,
    gpu_e2e.py's decode)."""
    if x.dim() == 0 or not 0 < x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
        return False
    if weights not in _gemv_weights():
        return False
    return use_triton_w4a16(x.device)


def _gemv_weights() -> tuple[str, ...]:
    """The weights `KVGUARD_TRITON_GEMV` gives the skinny GEMMs (GEMV_WEIGHTS); "0", empty or
    unset: none, and a value it does not know none too, warned about (not a switch's word:
    its own values say which weights)."""
    raw = os.environ.get(GEMV_ENV, "0")
    weights = GEMV_WEIGHTS.get(raw.strip())
    if weights is None and raw.strip() not in ("0", ""):
        warn_unknown(GEMV_ENV, raw, "1, dense, 4bit or 0", "off, its default")
    return weights or ()


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `triton_gemv.linear` where `gemv_rows(x)` says so
    (weight and activation of one dtype, the weight's rows unit-stride)."""
    if weight.dtype == x.dtype and weight.stride(-1) == 1 and gemv_rows(x):
        from kvguard.kernels import triton_gemv

        return triton_gemv.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def w4a16_matmul(x: torch.Tensor, packed: W4A16Weight, **kernel_args: int | None) -> torch.Tensor:
    """`x @ W.T` for a 4-bit weight packed by `w4a16.pack_for_triton`, y in x's dtype.

    The Triton kernel where `use_triton_w4a16` says so (`kernel_args`: `split_k`, `large_m`,
    see `triton_w4a16.matmul`); elsewhere the torch reference (the whole weight dequantised to
    fp32 on every call: correct, but slow and large; on CPU serve with the int4pack layer
    instead of calling this). A few rows take `triton_gemv.w4a16_linear` where `gemv_rows`
    says so and no `kernel_args` ask for the tiled kernel.
    """
    if not kernel_args and gemv_rows(x, "4bit"):
        from kvguard.kernels import triton_gemv

        return triton_gemv.w4a16_linear(x, packed)
    if use_triton_w4a16(x.device):
        from kvguard.kernels import triton_w4a16

        return triton_w4a16.matmul(x, packed, **kernel_args)
    return reference_matmul(x, packed)
