"""Bit-level helpers shared by the int4 unpackers.

Every format here stores eight 4-bit codes per int32 word with code `k` of a word at bits
`4k .. 4k+3` (low nibble first); they differ only in which weight each nibble holds (along
the input or the output dimension, AWQ's interleaved order) and in what a stored code or zero
means. So one unpacker of words into nibbles serves all of them; the format modules reorder.
Their `quantization_config` fields are read here too, each refused by name when malformed.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvguard.engine.model_config import ModelLoadError

NIBBLES_PER_WORD = 8


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 8 * words]` from int32 `[..., words]`: nibble k of word w lands at 8w + k.

    Reads the words' bytes (little-endian: byte b holds nibbles 2b and 2b + 1), so the sign
    of an int32 word does not matter and no shift of a negative number is involved.
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"packed codes must be int32, got {packed.dtype}")
    as_bytes = packed.contiguous().view(torch.uint8).reshape(*packed.shape, 4)
    if sys.byteorder == "big":
        as_bytes = as_bytes.flip(-1)
    nibbles = torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1)
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * NIBBLES_PER_WORD)


def perm_from_g_idx(g_idx: torch.Tensor, group_size: int, name: str) -> torch.Tensor | None:
    """The input permutation that makes GPTQ act-order groups contiguous, or None if in order.

    `g_idx[i]` is the group of activation column i. Sorting the columns by group (stably) puts
    group g at stored columns `g*group_size .. (g+1)*group_size`, which is what `QuantSpec`
    expects; that holds only when every group has exactly `group_size` columns, so anything
    else is refused rather than dequantised with the wrong scales.
    """
    g_idx = g_idx.to(torch.int64).flatten()
    cols = g_idx.numel()
    groups = cols // group_size
    if cols == 0 or g_idx.min() < 0:
        raise ModelLoadError(f"tensor {name!r}: g_idx is empty or negative")
    counts = torch.bincount(g_idx, minlength=groups)
    if counts.numel() != groups or bool((counts != group_size).any()):
        raise ModelLoadError(
            f"tensor {name!r}: g_idx does not give {groups} groups of {group_size} columns"
        )
    perm = torch.sort(g_idx, stable=True).indices
    if torch.equal(perm, torch.arange(cols)):
        return None
    return perm


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    """A tensor of the wrong shape is refused naming it, not broadcast into nonsense."""
    if tuple(tensor.shape) != expected:
        raise ModelLoadError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
        )


def required(read: Callable[[str], torch.Tensor | None], name: str) -> torch.Tensor:
    """`read(name)`, or a ModelLoadError naming the tensor a quantized module lacks."""
    tensor = read(name)
    if tensor is None:
        raise ModelLoadError(f"weights lack tensor {name!r}")
    return tensor


def check_group_size(name: str, group_size: int, cols: int, configured: int) -> None:
    """The group size the tensors imply must be the one the config states (-1: whole input)."""
    expected = cols if configured == -1 else configured
    if group_size != expected:
        raise ModelLoadError(
            f"module {name!r}: its scales give group size {group_size}, "
            f"quantization_config says {configured}"
        )


REQUIRED = object()  # `config_int`'s default for a field that has none


def config_int(
    qc: dict[str, Any],
    keys: tuple[str, ...],
    default: Any,
    file: Path,
    where: str = "quantization_config",
    group_size: bool = False,
) -> int:
    """The first of `keys` that the config sets (its aliases follow it), as an int: a whole
    number, or one written as a string, as some exporters do. Anything else (null, true, 4.5,
    "x") is refused naming the file and the field, not turned into a TypeError or a wrong
    number. `group_size`: the field takes a positive integer or -1 (one group)."""
    key = next((k for k in keys if k in qc), keys[0])
    value = qc.get(key, default)
    if value is REQUIRED:
        raise ModelLoadError(f"{file}: {where}.{key} is missing")
    whole = (
        (isinstance(value, int) and not isinstance(value, bool))
        or (isinstance(value, float) and value.is_integer())
        or (isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value) is not None)
    )
    number = int(value) if whole else None
    if number is None or (group_size and number != -1 and number < 1):
        takes = "a positive integer or -1 (one group)" if group_size else "an integer"
        raise ModelLoadError(f"{file}: {where}.{key} is {_json(value)}; it takes {takes}")
    return number


def config_bool(qc: dict[str, Any], key: str, default: bool, file: Path) -> bool:
    """`quantization_config[key]` as JSON true or false; anything else is refused by name."""
    value = qc.get(key, default)
    if not isinstance(value, bool):
        raise ModelLoadError(
            f"{file}: quantization_config.{key} is {_json(value)}; it takes true or false"
        )
    return value


def _json(value: Any) -> str:
    """A config value as config.json spells it (null, "x", 4.5)."""
    return json.dumps(value, default=repr)
