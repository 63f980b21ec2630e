"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum, `quant_method: gptq`), 4-bit.

Per linear layer `<name>` with `in` inputs, `out` outputs and `G` groups:

- `<name>.qweight` int32 `[in / 8, out]`: word r of column o holds input rows 8r .. 8r+7,
  row 8r + k in nibble k (bits 4k .. 4k+3, low nibble first).
- `<name>.qzeros` int32 `[G, out / 8]`: word c of group g holds the zeros of output columns
  8c .. 8c+7, column 8c + k in nibble k.
- `<name>.scales` fp16 `[G, out]`.
- `<name>.g_idx` int32 `[in]` (optional): the group of each input row. Without act-order it is
  `i // group_size`; with `desc_act` it is a shuffle, and the loader turns it into the
  `QuantSpec.perm` that sorts input columns by group (groups must then hold `group_size` rows
  each, which GPTQ's act-order guarantees).

Weight `W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]`. Zero points: format `gptq`
(v1, `checkpoint_format` or `format`) stores `z - 1`, so the loader adds 1 back, modulo 16 (a
v1 zero of 0 has no faithful encoding: packers either wrap it to 15 or clamp it to 1; wrapping
back reads the former right); `gptq_v2` stores `z` as is. Symmetric checkpoints
carry their zeros too (8, stored as 7 in v1), so sym and asym read the same way.
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
    perm_from_g_idx,
    required,
    unpack_nibbles,
)
from kvguard.engine.model_config import ModelLoadError

MARKER = "qweight"
PARTS = ("qweight", "qzeros", "scales", "g_idx")
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # what to add to a stored zero, per checkpoint format


@dataclass(frozen=True, slots=True)
class GptqSettings:
    group_size: int  # -1: one group over the whole input
    zero_offset: int  # 1 for v1 ("gptq"), 0 for "gptq_v2"


def check_config(qc: dict[str, Any], file: Path) -> GptqSettings:
    """Accept 4-bit GPTQ v1/v2 packed in int32; refuse Marlin, other bit widths and packings."""
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in ZERO_OFFSET:
        raise ModelLoadError(
            f"{file}: GPTQ checkpoint_format {fmt!r} is not supported; "
            f"only {sorted(ZERO_OFFSET)} load"
        )
    bits = config_int(qc, ("bits",), 4, file)
    if bits != 4:
        raise ModelLoadError(f"{file}: {bits}-bit GPTQ is not supported; only 4-bit GPTQ loads")
    pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise ModelLoadError(
            f"{file}: GPTQ pack_dtype {pack_dtype!r} is not supported; only int32 packing loads"
        )
    # sym and desc_act change nothing here (the zeros and g_idx say it), but are checked:
    # a malformed value is a broken config, not one to guess at
    config_bool(qc, "sym", True, file)
    config_bool(qc, "desc_act", False, file)
    group_size = config_int(qc, ("group_size",), 128, file, group_size=True)
    return GptqSettings(group_size=group_size, zero_offset=ZERO_OFFSET[fmt])


def gptq_spec(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    zero_offset: int = 1,
    name: str = "gptq",
) -> QuantSpec:
    """One GPTQ linear as a QuantSpec (`[out, in]`, act-order folded into `perm`)."""
    words, out = qweight.shape
    cols = words * NIBBLES_PER_WORD
    groups = scales.shape[0]
    check_shape(f"{name}.scales", scales, (groups, out))
    check_shape(f"{name}.qzeros", qzeros, (groups, out // NIBBLES_PER_WORD))
    if groups == 0 or cols % groups:
        raise ModelLoadError(f"tensor {name + '.scales'!r}: {groups} groups do not divide {cols}")
    group_size = cols // groups
    q = unpack_nibbles(qweight.t())  # [out, in], activation order
    zeros = (unpack_nibbles(qzeros).to(torch.int16) + zero_offset) % 16
    perm = None
    if g_idx is not None:
        check_shape(f"{name}.g_idx", g_idx, (cols,))
        perm = perm_from_g_idx(g_idx, group_size, f"{name}.g_idx")
    if perm is not None:
        q = q[:, perm]
    return QuantSpec(
        q=q.contiguous(),
        scales=scales.float().t().contiguous(),
        zeros=zeros.float().t().contiguous(),
        group_size=group_size,
        bits=4,
        perm=perm,
    )


def module_spec(
    name: str, read: Callable[[str], torch.Tensor | None], settings: GptqSettings
) -> QuantSpec:
    """The spec of module `name`, its tensors read through `read` (None when absent)."""
    qweight, qzeros, scales = (required(read, f"{name}.{part}") for part in PARTS[:3])
    spec = gptq_spec(qweight, qzeros, scales, read(f"{name}.g_idx"), settings.zero_offset, name)
    check_group_size(name, spec.group_size, spec.shape[1], settings.group_size)
    return spec
