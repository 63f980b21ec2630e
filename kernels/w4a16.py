"""The packed form the Triton W4A16 GEMM reads, built from a `QuantSpec`, and its torch reference.

Torch only (no triton import), so a layer can pack its weights and the reference path can run
on a machine without triton; the kernels themselves live in `triton_w4a16`.

Packing format (`W4A16Weight`):

- `qweight` int32 `[N, K // 8]`: row `n` holds the codes of output `n`, eight 4-bit codes per
  word along K, low nibble first (code of column `8 * j + i` is `(qweight[n, j] >> 4 * i) & 15`).
  Rows stay in QuantSpec's `[out, in]` order so a tensor-parallel shard is a slice of rows (column
  parallel) or of words (row parallel, on a group boundary), and a K-tile of one row is a
  contiguous run of words.
- `scales`, `zeros` `[N, K // group_size]` (float32 by default; float16 halves their bytes at
  ~1e-3 relative error on non-integer zero points): `w = (code - zero) * scale`, zeros in code
  units, exactly `QuantSpec`'s convention.
- `perm`: QuantSpec's desc_act input permutation (or None): the kernel multiplies
  `x[:, perm]` by the stored columns, so the permutation is one gather of the activations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from kvguard.engine.layers.quant_spec import QuantSpec

PACK = 8  # 4-bit codes per int32 word
_SHIFTS = tuple(4 * i for i in range(PACK))


class W4A16Weight(NamedTuple):
    qweight: torch.Tensor  # int32 [N, K // 8]
    scales: torch.Tensor  # [N, K // group_size]
    zeros: torch.Tensor  # [N, K // group_size], code units
    group_size: int
    perm: torch.Tensor | None = None  # int64 [K] or None

    @property
    def shape(self) -> tuple[int, int]:
        """`(N, K)`: output and input width of the layer."""
        return self.qweight.shape[0], self.qweight.shape[1] * PACK

    @property
    def nbytes(self) -> int:
        """Bytes a matmul must read for the weight: codes plus scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def to(self, device: torch.device | str) -> W4A16Weight:
        """The same weight with its tensors on `device` (pack once on the CPU, then move)."""
        return W4A16Weight(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in self))

    def columns(self, start: int, stop: int) -> W4A16Weight:
        """Input columns `[start, stop)` as views (a row-parallel shard); both ends must sit on
        group boundaries, so whole words and whole groups are sliced."""
        g = self.group_size
        if start % g or stop % g or self.perm is not None:
            raise ValueError(f"columns {start}:{stop} do not sit on groups of {g} (or permuted)")
        return W4A16Weight(
            self.qweight[:, start // PACK : stop // PACK],
            self.scales[:, start // g : stop // g],
            self.zeros[:, start // g : stop // g],
            g,
        )


def pack_for_triton(spec: QuantSpec, scale_dtype: torch.dtype = torch.float32) -> W4A16Weight:
    """Pack a 4-bit `QuantSpec` into the kernel's layout (on the spec's device).

    Refuses what the kernel cannot read rather than mis-reading it: 8-bit specs, and input
    widths that are not whole words.
    """
    if spec.bits != 4:
        raise ValueError(f"the W4A16 kernel takes 4-bit weights, not {spec.bits}-bit")
    n, k = spec.shape
    if k % PACK:
        raise ValueError(f"input width {k} is not a multiple of {PACK} (one int32 word)")
    codes = spec.q.to(torch.int64).view(n, k // PACK, PACK)
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=codes.device)
    words = (codes << shifts).sum(dim=-1)  # < 2**32, exact in int64
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same bits as int32
    perm = None if spec.perm is None else spec.perm.to(torch.int64).contiguous()
    return W4A16Weight(
        words.to(torch.int32).contiguous(),
        spec.scales.to(scale_dtype).contiguous(),
        spec.zeros.to(scale_dtype).contiguous(),
        spec.group_size,
        perm,
    )


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 codes `[N, K]` from packed words: the inverse of `pack_for_triton`'s packing."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device)
    codes = (qweight[..., None] >> shifts) & 15
    return codes.reshape(qweight.shape[0], -1).to(torch.uint8)


def dequantize(w: W4A16Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stored-order weight `[N, K]` (permutation not undone), computed in fp32."""
    g = w.group_size
    s = w.scales.float().repeat_interleave(g, dim=1)
    z = w.zeros.float().repeat_interleave(g, dim=1)
    return ((unpack_codes(w.qweight).float() - z) * s).to(dtype)


def reference_matmul(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """`x @ W.T` in fp32 from the packed form, cast to x's dtype: the same math as
    `x.float() @ spec.dequantize().T`. A reference for tests and a last resort off CUDA, not
    a production path (it materialises the whole fp32 weight every call)."""
    xf = x.float()
    if w.perm is not None:
        xf = xf.index_select(-1, w.perm.to(x.device))
    return (xf @ dequantize(w).T).to(x.dtype)


def plane_order(x2: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """x's rows `[m, K]` as `[m, 8 * (K // 8)]` in plane order (the 4-bit skinny GEMM's and the
    nibble-plane W4A16 GEMM's activations): column `i * K // 8 + w` holds
    (permuted) x's column `8 w + i`, so nibble plane i of a tile of words meets a contiguous
    run of x."""
    m, k = x2.shape
    if perm is None:
        return x2.reshape(m, k // PACK, PACK).transpose(1, 2).contiguous()
    return x2.index_select(1, perm.view(k // PACK, PACK).T.reshape(-1))
