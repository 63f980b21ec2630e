"""Reads kvguard's packed GGUF conversions (`<name>.packed/`, written by gguf_convert).

Serving an already converted model must not need the `gguf` package (the GPU image has none):
this module is what loading a packed directory imports, and it imports no `gguf`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.model_config import ModelLoadError, cache_remedy
from kvguard.engine.weights import Part, open_safetensors

# Bump with gguf_convert's output format (and model_registry.CONVERTER_REVISION). The K-quant
# and 5-bit type names and the optional `bits` (a module's code width where not its type's)
# came without a bump: a directory without them reads as before.
PACKED_FORMAT_VERSION = 1
# the GGUF types a packed conversion keeps packed, by name -> bits per code (gguf_convert.BITS)
PACKED_BITS = {
    "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 8, "Q8_0": 8,
    "IQ4_NL": 8, "IQ4_XS": 8,
}  # fmt: skip


def _bits(file: Path, module: str, kind: str, stored: Any) -> int:
    """The width `module`'s codes are stored at (`stored`, None: its type's): its type's, or 8
    for a 4-bit type fused with an 8-bit one."""
    if kind not in PACKED_BITS:
        raise ModelLoadError(
            f"{file}: module {module!r} is packed as {kind!r}, expected one of "
            f"{', '.join(PACKED_BITS)}"
        )
    if stored is None:
        return PACKED_BITS[kind]
    if stored not in (PACKED_BITS[kind], 8):
        raise ModelLoadError(
            f"{file}: module {module!r} ({kind}) has its codes stored at {stored!r} bits, "
            f"expected {PACKED_BITS[kind]} or 8"
        )
    return stored


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """`[rows, cols // 2]` bytes to `[rows, cols]` codes, the even column from the low nibble.

    numpy, not torch: one pass each, unaffected by torch's thread pool (which, on a loaded
    two-core host, made the same torch ops 10x slower at load)."""
    out = np.empty((*packed.shape, 2), dtype=np.uint8)
    np.bitwise_and(packed, 15, out=out[..., 0])
    np.right_shift(packed, 4, out=out[..., 1])
    return out.reshape(packed.shape[0], -1)


def load_packed(
    path: Path, dtype: torch.dtype
) -> tuple[dict[str, QuantSpec], dict[str, torch.Tensor]]:
    """A packed conversion's ({module: QuantSpec}, {tensor: plain tensor in `dtype`}).

    Codes stay 8 or 4 bits (one byte a code once unpacked, until the layer packs them for its
    kernel); no fp32 copy of a quantized weight is made."""
    path = Path(path)
    file = path / "config.json"
    qc = json.loads(file.read_text()).get("quantization_config") or {}
    if qc.get("format") != "kvguard-packed" or qc.get("version") != PACKED_FORMAT_VERSION:
        raise ModelLoadError(
            f"{file}: quantization_config is not kvguard's packed GGUF format version "
            f"{PACKED_FORMAT_VERSION} (found {qc.get('format')!r} {qc.get('version')!r})"
            f"{cache_remedy(file) or '; delete the directory to have it converted again'}"
        )
    modules: dict[str, str] = qc["modules"]
    bits: dict[str, Any] = qc.get("bits") or {}
    specs: dict[str, QuantSpec] = {}
    with open_safetensors(path, torch.float32) as source:
        for module, kind in modules.items():
            specs[module] = _read_spec(source, module, _bits(file, module, kind, bits.get(module)))
        owned = {f"{m}.{p}" for m in modules for p in ("qweight", "scales", "zeros")}
        plain = {n: source.read(Part(n)).to(dtype) for n in source.names if n not in owned}
    return specs, plain


def _read_spec(source: Any, module: str, bits: int) -> QuantSpec:
    q = source.read(Part(f"{module}.qweight"))
    if bits == 4:
        q = torch.from_numpy(unpack_nibbles(q.numpy()))
    scales = source.read(Part(f"{module}.scales"))
    zeros = source.read(Part(f"{module}.zeros"))
    try:
        return QuantSpec(q, scales, zeros, q.shape[1] // scales.shape[1], bits)
    except (ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"packed module {module!r}: inconsistent tensors ({e})") from e
