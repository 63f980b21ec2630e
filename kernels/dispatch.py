"""Which implementation a kernel call uses: Triton on CUDA when it can, torch otherwise.

The torch path in `paged_attention` runs everywhere and stays the reference; Triton only takes
over on CUDA, where the torch decode path pays for gathering every sequence's blocks into a
contiguous workspace before attention. `KVGUARD_TRITON=0` turns the Triton path off (to compare
the two, or to route around a kernel bug) without a code change.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


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

    Needs a CUDA device, an importable triton, and `KVGUARD_TRITON` not set to "0"; an FP8
    cache also needs a GPU whose Triton supports e4m3 (older GPUs keep the torch path for
    FP8 only). The environment is read on every call (it is cheap) so a benchmark can flip
    it between runs.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    if os.environ.get("KVGUARD_TRITON", "1") == "0" or not triton_available():
        return False
    return kv_dtype != torch.float8_e4m3fn or _fp8_capable(dev.index)
