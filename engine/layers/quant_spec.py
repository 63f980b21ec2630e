"""The one internal form every quantized checkpoint is turned into before it is served.

Each on-disk format (GGUF Q4_0/Q4_1/Q8_0, AWQ GEMM, GPTQ v1/v2, compressed-tensors
pack-quantized) has its own bit order and zero-point convention; its loader unpacks to a
`QuantSpec`, and only the quantized linear layer (and the kernels behind it) packs a spec into
whatever a kernel wants. So a format is tested once, against its reference unpacker, and a
kernel once, against `QuantSpec.dequantize`.

Convention: for output row `o` and input column `i` in group `g = i // group_size` (after the
optional input permutation), the weight is `(q[o, i] - zeros[o, g]) * scales[o, g]`, where `q`
holds unsigned codes in `[0, 2**bits)`. Zero points are floats in code units, so formats with a
float minimum (GGUF Q4_1: `w = d*q + m`) fit too (`zeros = -m / d`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class QuantSpec:
    q: torch.Tensor  # uint8 [out, in]: one unsigned code per weight, in [0, 2**bits)
    scales: torch.Tensor  # float32 [out, in // group_size]
    zeros: torch.Tensor  # float32 [out, in // group_size], in code units
    group_size: int  # input columns per scale; == in for per-channel
    bits: int  # 4 or 8
    # GPTQ desc_act: input column j of the stored matrix is column perm[j] of the activation
    # (x[:, perm] @ W.T); None when the columns are in order
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        out, cols = self.q.shape
        if self.bits not in (4, 8):
            raise ValueError(f"{self.bits}-bit weights are not supported (4 or 8)")
        if cols % self.group_size:
            raise ValueError(
                f"input width {cols} is not a multiple of group size {self.group_size}"
            )
        groups = cols // self.group_size
        for name in ("scales", "zeros"):
            shape = tuple(getattr(self, name).shape)
            if shape != (out, groups):
                raise ValueError(f"{name} has shape {shape}, expected {(out, groups)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[out, in]` as the activation sees it (permutation undone): the
        reference every kernel and loader is checked against."""
        g = self.group_size
        s = self.scales.float().repeat_interleave(g, dim=1)
        z = self.zeros.float().repeat_interleave(g, dim=1)
        w = (self.q.float() - z) * s
        if self.perm is not None:
            full = torch.empty_like(w)
            full[:, self.perm] = w
            w = full
        return w.to(dtype)
