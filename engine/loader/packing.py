"""Bit-level helpers shared by the int4 unpackers.

Every format here stores eight 4-bit codes per int32 word with code `k` of a word at bits
`4k .. 4k+3` (low nibble first); they differ only in which weight each nibble holds (along
the input or the output dimension, AWQ's interleaved order) and in what a stored code or zero
means. So one unpacker of words into nibbles serves all of them; the format modules reorder.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

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
