"""compressed-tensors checkpoints (llm-compressor, `quant_method: compressed-tensors`) in the
`pack-quantized` format with int4 weights and unquantized activations (W4A16).

Per linear layer `<name>` with `out` x `in` weights:

- `<name>.weight_packed` int32 `[out, ceil(in / 8)]`: input column i in word i // 8, nibble
  i % 8 (low nibble first); a nibble holds the signed code plus 8, so codes -8..7 are stored
  as 0..15: exactly `QuantSpec`'s unsigned `q`.
- `<name>.weight_scale` `[out, in / group_size]` (strategy `group`) or `[out, 1]` (`channel`).
- `<name>.weight_zero_point` (asymmetric only): signed zero points, packed int4 along the
  *output* dimension by current compressed-tensors (0.20.1: int32 `[ceil(out / 8), groups]`,
  +8 like the codes); older checkpoints may hold them unpacked (`[out, groups]`, signed). Symmetric
  checkpoints have none: the zero is 0 in signed codes, 8 in unsigned ones.
- `<name>.weight_shape` int `[2]`: `(out, in)`.
- `<name>.weight_g_idx` `[in]` (only older `actorder: group` checkpoints): the group of each
  input column, folded into `QuantSpec.perm` as for GPTQ.

Weight `W[o, i] = (code - zp) * s = (q - (zp + 8)) * s` for the group of column i.
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
    REQUIRED,
    check_shape,
    config_int,
    perm_from_g_idx,
    required,
    unpack_nibbles,
)
from kvguard.engine.model_config import ModelLoadError

MARKER = "weight_packed"
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
SIGNED_OFFSET = 8  # a stored nibble is the signed int4 code plus this
STRATEGIES = ("group", "channel")


@dataclass(frozen=True, slots=True)
class CtSettings:
    group_sizes: frozenset[int]  # those the config groups state; -1 stands for per-channel


def check_config(qc: dict[str, Any], file: Path) -> CtSettings:
    """Accept compressed, pack-quantized int4 weight-only groups; refuse the rest by name."""
    status = str(qc.get("quantization_status", "compressed")).lower()
    if status != "compressed":
        raise ModelLoadError(
            f"{file}: compressed-tensors quantization_status {status!r} is not supported; "
            "only 'compressed' checkpoints load"
        )
    if qc.get("transform_config"):
        raise ModelLoadError(
            f"{file}: compressed-tensors transform_config (rotations) is not supported"
        )
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ModelLoadError(
            f"{file}: compressed-tensors sparsity format {sparsity['format']!r} is not supported"
        )
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ModelLoadError(f"{file}: compressed-tensors quantization_config has no config_groups")
    top = str(qc.get("format") or "pack-quantized")
    sizes = {_check_group(name, g, top, file) for name, g in groups.items()}
    return CtSettings(group_sizes=frozenset(sizes))


def _check_group(name: str, group: dict[str, Any], top: str, file: Path) -> int:
    """One config group: its format, bits, type, strategy; returns its group size."""
    fmt = str(group.get("format") or top)
    where = f"{file}: compressed-tensors config group {name!r}"
    if fmt != "pack-quantized":
        raise ModelLoadError(f"{where}: format {fmt!r} is not supported; only 'pack-quantized'")
    w = group.get("weights") or {}
    fields = f"quantization_config.config_groups.{name}.weights"
    bits, kind = config_int(w, ("num_bits",), 8, file, fields), str(w.get("type", "int"))
    if (bits, kind) != (4, "int"):
        raise ModelLoadError(f"{where}: {bits}-bit {kind} weights are not supported; only int4")
    if group.get("input_activations") or group.get("output_activations"):
        raise ModelLoadError(
            f"{where}: activation quantization is not supported; only weight-only (W4A16)"
        )
    strategy = str(w.get("strategy") or "tensor")
    if strategy not in STRATEGIES or w.get("dynamic"):
        raise ModelLoadError(
            f"{where}: weight strategy {strategy!r} is not supported; only {STRATEGIES}"
        )
    if strategy != "group":
        return -1
    return config_int(w, ("group_size",), REQUIRED, file, fields, group_size=True)


def ct_spec(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, int],
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
    name: str = "compressed-tensors",
) -> QuantSpec:
    """One pack-quantized int4 linear as a QuantSpec."""
    out, cols = (int(v) for v in weight_shape)
    words = -(-cols // NIBBLES_PER_WORD)
    check_shape(f"{name}.weight_packed", weight_packed, (out, words))
    groups = weight_scale.shape[-1] if weight_scale.ndim == 2 else 0
    check_shape(f"{name}.weight_scale", weight_scale, (out, groups))
    if groups == 0 or cols % groups:
        raise ModelLoadError(f"tensor {name + '.weight_scale'!r}: {groups} groups vs {cols} cols")
    group_size = cols // groups
    q = unpack_nibbles(weight_packed)[:, :cols]
    zeros = _zeros(weight_zero_point, out, groups, f"{name}.weight_zero_point")
    perm = None
    if weight_g_idx is not None:
        check_shape(f"{name}.weight_g_idx", weight_g_idx, (cols,))
        perm = perm_from_g_idx(weight_g_idx, group_size, f"{name}.weight_g_idx")
    if perm is not None:
        q = q[:, perm]
    return QuantSpec(
        q=q.contiguous(),
        scales=weight_scale.float().contiguous(),
        zeros=zeros,
        group_size=group_size,
        bits=4,
        perm=perm,
    )


def _zeros(zp: torch.Tensor | None, out: int, groups: int, name: str) -> torch.Tensor:
    """Unsigned zero points `[out, groups]` from whichever way the checkpoint stored them."""
    if zp is None:
        return torch.full((out, groups), float(SIGNED_OFFSET))
    packed_rows = -(-out // NIBBLES_PER_WORD)
    if zp.dtype == torch.int32 and tuple(zp.shape) == (packed_rows, groups) and out > 1:
        return unpack_nibbles(zp.t().contiguous())[:, :out].t().float().contiguous()
    check_shape(name, zp, (out, groups))
    return zp.float() + SIGNED_OFFSET


def module_spec(
    name: str, read: Callable[[str], torch.Tensor | None], settings: CtSettings
) -> QuantSpec:
    """The spec of module `name`, its tensors read through `read` (None when absent)."""
    spec = ct_spec(
        required(read, f"{name}.weight_packed"),
        required(read, f"{name}.weight_scale"),
        required(read, f"{name}.weight_shape").tolist(),
        read(f"{name}.weight_zero_point"),
        read(f"{name}.weight_g_idx"),
        name,
    )
    cols = spec.shape[1]
    allowed = {cols if g == -1 else g for g in settings.group_sizes}
    if spec.group_size not in allowed:
        raise ModelLoadError(
            f"module {name!r}: its scales give group size {spec.group_size}, "
            f"quantization_config allows {sorted(allowed)}"
        )
    return spec
