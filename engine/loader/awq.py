"""AWQ GEMM checkpoints (AutoAWQ / llm-compressor `quant_method: awq`, `version: gemm`).

Per linear layer `<name>`, with `in` inputs, `out` outputs and `G = in / group_size` groups:

- `<name>.qweight` int32 `[in, out / 8]`: row i holds weight column i; word c holds output
  columns 8c .. 8c+7, but interleaved: nibble k (bits 4k .. 4k+3) holds output column
  `8c + AWQ_PACK_ORDER[k]` with `AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)`.
- `<name>.qzeros` int32 `[G, out / 8]`: the zero points, packed the same way.
- `<name>.scales` fp16 `[G, out]`.

Weight `W[o, i] = (q[i, o] - z[i // group_size, o]) * s[i // group_size, o]` with codes and
zeros unsigned in [0, 16) and stored as is (no offset, unlike GPTQ v1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.loader.packing import (
    NIBBLES_PER_WORD,
    check_group_size,
    check_shape,
    config_bool,
    config_int,
    required,
    unpack_nibbles,
)
from kvguard.engine.model_config import ModelLoadError

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column AWQ_PACK_ORDER[k]
# column j of a word's eight sits in nibble AWQ_NIBBLE_OF[j]: the inverse of AWQ_PACK_ORDER
AWQ_NIBBLE_OF = tuple(AWQ_PACK_ORDER.index(j) for j in range(NIBBLES_PER_WORD))
MARKER = "qweight"  # the tensor that makes a module an AWQ-quantized linear
PARTS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True, slots=True)
class AwqSettings:
    group_size: int  # -1: one group over the whole input


def check_config(qc: dict[str, Any], file: Path) -> AwqSettings:
    """Accept AWQ GEMM int4 with zero points; refuse every other AWQ variant by name."""
    version = str(qc.get("version", qc.get("format", "gemm"))).lower()
    if version != "gemm" or str(qc.get("backend", "")).lower() == "llm-awq":
        found = "llm-awq" if version == "gemm" else version
        raise ModelLoadError(
            f"{file}: AWQ version {found!r} is not supported; only AWQ 'gemm' checkpoints load"
        )
    bits = config_int(qc, ("bits", "w_bit"), 4, file)
    if bits != 4:
        raise ModelLoadError(f"{file}: {bits}-bit AWQ is not supported; only 4-bit AWQ loads")
    if not config_bool(qc, "zero_point", True, file):
        raise ModelLoadError(
            f"{file}: AWQ with zero_point false is not supported; only zero-point AWQ loads"
        )
    group_size = config_int(qc, ("group_size", "q_group_size"), 128, file, group_size=True)
    return AwqSettings(group_size=group_size)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[rows, 8 * words]` in natural column order from AWQ-interleaved int32 words."""
    rows, words = packed.shape
    nibbles = unpack_nibbles(packed).view(rows, words, NIBBLES_PER_WORD)
    return nibbles[:, :, list(AWQ_NIBBLE_OF)].reshape(rows, words * NIBBLES_PER_WORD)


def awq_spec(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, name: str = "awq"
) -> QuantSpec:
    """One AWQ GEMM linear as a QuantSpec (transposed to `[out, in]`)."""
    cols, words = qweight.shape
    out = words * NIBBLES_PER_WORD
    groups = scales.shape[0]
    check_shape(f"{name}.scales", scales, (groups, out))
    check_shape(f"{name}.qzeros", qzeros, (groups, words))
    if groups == 0 or cols % groups:
        raise ModelLoadError(f"tensor {name + '.scales'!r}: {groups} groups do not divide {cols}")
    return QuantSpec(
        q=unpack_awq(qweight).t().contiguous(),
        scales=scales.float().t().contiguous(),
        zeros=unpack_awq(qzeros).float().t().contiguous(),
        group_size=cols // groups,
        bits=4,
    )


def module_spec(
    name: str, read: Callable[[str], torch.Tensor | None], settings: AwqSettings
) -> QuantSpec:
    """The spec of module `name`, its tensors read through `read` (None when absent)."""
    qweight, qzeros, scales = (required(read, f"{name}.{part}") for part in PARTS)
    spec = awq_spec(qweight, qzeros, scales, name)
    check_group_size(name, spec.group_size, spec.shape[1], settings.group_size)
    return spec
