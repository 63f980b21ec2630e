"""Reads kvguard's packed GGUF conversions (`<name>.packed/`, written by gguf_convert).

Serving an already converted model must not need the `gguf` package (the GPU image has none):
this module is what loading a packed directory imports, and it imports no `gguf`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

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
    "IQ4_NL": 8, "IQ4_XS": 8, "Q2_K": 8, "Q3_K": 8,
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


def load_packed(path: Path, dtype: torch.dtype) -> tuple[PackedSpecs, dict[str, torch.Tensor]]:
    """A packed conversion's ({module: QuantSpec}, {tensor: plain tensor in `dtype`}).

    The specs are read from the file one module at a time, as the model's layers ask for them
    (`PackedSpecs`), so a load holds the layers built so far plus one module's codes unpacked
    (one byte a code, until the layer packs them for its kernel), never the whole model's; no
    fp32 copy of a quantized weight is made. Every tensor returned is a copy: safetensors'
    tensors are views onto its mapping of the file, and one kept would keep the whole file
    mapped (and resident) for the life of the process."""
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
    widths = {m: _bits(file, m, kind, bits.get(m)) for m, kind in modules.items()}
    with open_safetensors(path, torch.float32) as source:
        owned = {f"{m}.{p}" for m in modules for p in ("qweight", "scales", "zeros")}
        missing = sorted(owned - set(source.names))
        if missing:
            raise ModelLoadError(
                f"{path}: weights lack tensors {missing[:5]} ({len(missing)} in all)"
                f"{cache_remedy(file)}"
            )
        plain = {
            n: source.read(Part(n)).to(dtype, copy=True) for n in source.names if n not in owned
        }
    return PackedSpecs(path, widths), plain


class PackedSpecs(Mapping[str, QuantSpec]):
    """A packed conversion's modules by name, each read from the file when looked up (and not
    kept: a layer packs it for its kernel and drops it). The file is opened for each read and
    closed after, so nothing stays mapped between reads; a long load shows a progress bar
    (on a terminal, after two seconds)."""

    def __init__(self, path: Path, bits: dict[str, int]) -> None:
        self.path, self.bits = Path(path), bits
        self._bar = tqdm(
            total=len(bits),
            desc=f"loading {self.path.name}",
            unit="module",
            delay=2,
            leave=False,
            disable=None,  # a terminal's only: not a service's journal
        )

    def __getitem__(self, module: str) -> QuantSpec:
        if module not in self.bits:
            raise KeyError(module)
        with open_safetensors(self.path, torch.float32) as source:
            spec = _read_spec(source, module, self.bits[module])
        self._bar.update()
        if self._bar.n >= len(self.bits):
            self._bar.close()
        return spec

    def __contains__(self, module: object) -> bool:
        return module in self.bits

    def __iter__(self) -> Iterator[str]:
        return iter(self.bits)

    def __len__(self) -> int:
        return len(self.bits)


def _read_spec(source: Any, module: str, bits: int) -> QuantSpec:
    """One module's spec, its tensors copied out of the file (4-bit codes unpacked into a new
    array; the rest cloned)."""
    q = source.read(Part(f"{module}.qweight"))
    q = torch.from_numpy(unpack_nibbles(q.numpy())) if bits == 4 else q.clone()
    scales = source.read(Part(f"{module}.scales")).clone()
    zeros = source.read(Part(f"{module}.zeros")).clone()
    try:
        return QuantSpec(q, scales, zeros, q.shape[1] // scales.shape[1], bits)
    except (ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"packed module {module!r}: inconsistent tensors ({e})") from e
