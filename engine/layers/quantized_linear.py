"""The quantized linear layer: a `QuantSpec` packed once, at load, for the kernel that serves it.

Decode on CPU is memory-bound: every token reads every weight, so the bytes a weight occupies
are the time it costs. The layer therefore keeps weights low-bit and multiplies them with a real
low-bit kernel; it never dequantises a whole matrix per call.

Kernels, picked per layer at construction (`QuantizedLinear.kernel`):

- `w4a8` / `w8a8` (CPU with AVX2, FMA, F16C and a C compiler; 4-bit or 8-bit weights in groups
  that are multiples of 32, `in_features % 64 == 0`): `kvguard.kernels.cpu_lowbit`, our C GEMMs.
  Activations are quantised per row to int8 in blocks of 32 and multiplied with integer dots
  (what OpenVINO and llama.cpp do on AVX2); fp32 out. int8 activations cost the default model
  1.8 points of teacher-forced top-1 agreement with fp32 (98.2%; bf16 activations: 99.2%), and
  no one kind of layer carried it (making any one kind exact left it at 97.2-98.4%), so the
  projections quantise activations to int16 (`fine`, up to +-32639: 100.0%; the 4-bit kernels
  split each into two signed bytes and take two integer dots, exact) and only the
  `approximate` lm_head, whose best candidates are recomputed exactly anyway, to int8.
  `cpu_activations: int8` (`use_int8_activations`) trades the other way: 1.6-2x faster
  GEMMs than int16 dots, 1.2-1.4x than the fp32 panels below (1.2x the batch-32 decode and
  the trace) for 97.6% agreement. For prompt rows (prefill chunks, at any length) and for
  decode rows from `cpu_lowbit.panel_rows()` decoding sequences (each row's kind picks its
  kernel inside a model step: `cpu_lowbit.step_rows`; outside one, the call's row count) a
  `fine` layer's kernel multiplies the activations unquantised, with fp32 FMAs over the weight dequantised sixteen columns at a time: there
  the int16 dots lose to FMAs (1.2-1.5x from 32 rows and up) and to a whole-matrix
  dequantise-and-sgemm (whose copy costs more than the panels below about a thousand rows).
  The weights keep their codes exactly and fp16 scales and mins (`w = d*q + m`) per group,
  so GGUF Q4_0/Q4_1/Q8_0 are held at their own size and a Q8_0 lm_head can hand its rows to
  the tied embedding. Picked ahead of all below; without a compiler or those CPU features
  the layer falls back to them (logged once). On a CPU with AVX-512 VNNI the integer dots
  take `vpdpbusd` (`cpu_lowbit.vnni()`, the same bits) and, for 4-bit weights, serve every
  batch (they lead or tie the panels at any number of rows).
- `w8a8v` (where `w8a8` fits, for an `approximate` 8-bit weight: the tied lm_head): the same
  codes, scales and mins in a vertical layout (`cpu_lowbit.pack8v`: a 32-bit lane holds four
  consecutive weights of one column, as the 4-bit codes do), int8 activations only. Each
  column's dot stays in its own lane, so no block ends in horizontal sums: the SmolLM2 lm_head
  (49152 x 576) ran 1.4-1.7x as fast from 8 rows on VNNI (1.4x on AVX2), the same bits as
  `w8a8`. The tied embedding reads its rows back out of the layout.
- `int4pack` (CPU, 4-bit): torch's `_weight_int4pack_mm_for_cpu`. It takes bf16 activations
  (its fp32 path is ~10x slower on AVX2), group sizes 32/64/128/256 and `N % 16 == 0`. A group
  size that is a larger multiple of 32 (per-channel included) is served exactly by repeating its
  scales over 256/128/64/32-column groups; output rows are padded to a multiple of 16.
  Its dequantisation is `(code - 8) * scale + zero` per group, so QuantSpec's
  `(q - z) * s` maps exactly onto `scale = s`, `zero = (8 - z) * s`.
- `int8pack` (CPU, 8-bit per-channel): torch's `_weight_int8pack_mm` (signed int8, one scale
  per output row): `q - 128`, plus a per-row offset times the row sum of `x` where the zero
  point is not 128. Exact.
- `int4x2` (CPU, 8-bit in groups, GGUF Q8_0): no torch kernel takes 8-bit groups. Each code is
  split into two 4-bit planes served by one int4pack matmul over 2N rows (1.25 bytes a weight,
  codes exact). Measured on the default model's tied Q8_0 lm_head: requantising to per-row
  int8 for `_weight_int8pack_mm` instead (1 byte a weight, ~1.3x faster) cost 1.2 points of
  teacher-forced top-1 agreement (97.9% vs 99.0%); bf16 (2 bytes a weight) runs slower than
  fp32 on AVX2 (no native bf16 matmul).
- `w4a16` (CUDA, 4-bit): the Triton W4A16 GEMM through `kvguard.kernels.dispatch`.
- `dense`: the weight dequantised once, at load, into the compute dtype (what no kernel above
  takes: 4-bit groups that are not multiples of 32 on CPU, 8-bit on CUDA, or CUDA without the
  Triton kernel). Bigger, but never a per-call dequantisation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvguard.engine.distributed.parallel_state import TPGroup
from kvguard.engine.layers.parallel_linear import mask_padding
from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.kernels import cpu_lowbit, cpu_ops

log = logging.getLogger("kvguard.engine")

INT4_GROUPS = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts, largest first
INT4_ROWS = 16  # its packing needs output rows in multiples of this
INT4_INNER_K_TILES = 2


def cpu_int4_group(group_size: int) -> int | None:
    """The int4pack group size that serves `group_size` exactly (scales repeated), or None."""
    return next((g for g in INT4_GROUPS if group_size % g == 0), None)


def lowbit_fits(spec: QuantSpec) -> bool:
    """Whether the C kernels' layout holds this weight (whole 32-blocks, pairs of them)."""
    return spec.group_size % cpu_lowbit.BLOCK == 0 and spec.shape[1] % (2 * cpu_lowbit.BLOCK) == 0


def pick_kernel(spec: QuantSpec, device: torch.device, approximate: bool = False) -> str:
    if device.type == "cuda":
        return "w4a16" if spec.bits == 4 and _triton_w4a16() else "dense"
    if lowbit_fits(spec) and cpu_lowbit.available():
        if spec.bits == 8 and approximate:
            return "w8a8v"  # int8 activations for good: the vertical layout's faster dots
        return "w4a8" if spec.bits == 4 else "w8a8"
    if spec.bits == 8 and (approximate or spec.group_size == spec.shape[1]):
        return "int8pack"
    if cpu_int4_group(spec.group_size):
        return "int4pack" if spec.bits == 4 else "int4x2"
    return "dense"


def _triton_w4a16() -> bool:
    """Whether the Triton W4A16 kernel module is installed in this tree (a sibling's work)."""
    try:
        from kvguard.kernels import dispatch
    except ImportError:
        return False
    return hasattr(dispatch, "w4a16_matmul")


class QuantizedLinear(nn.Module):
    """`y = x @ W.T (+ bias)` for a quantized `W`; activations and output in `dtype`."""

    def __init__(
        self,
        spec: QuantSpec,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        approximate: bool = False,
        kernel: str | None = None,
    ) -> None:
        """`approximate`: a group-wise 8-bit weight may be requantised to per-row int8 (the
        lm_head, whose top candidates `QuantizedLMHead` recomputes exactly). `kernel` forces
        one (tests), else `pick_kernel` chooses."""
        super().__init__()
        device = torch.device(device)
        self.out_features, self.in_features = spec.shape
        self.bits, self.group_size, self.dtype = spec.bits, spec.group_size, dtype
        self.kernel = kernel or pick_kernel(spec, device, approximate)
        self.requantised = False  # int8pack over a requantised copy: its rows are not exact
        # C kernels: int16 activations unless the outputs are refined (then int8)
        self.fine = not approximate and self.kernel != "w8a8v"
        perm = None if spec.perm is None else spec.perm.to(device=device, dtype=torch.long)
        self.register_buffer("perm", perm)
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        getattr(self, f"_pack_{self.kernel}")(_spec_on(spec, device))

    # -- packing, once ----------------------------------------------------------------------
    def _pack_w4a8(self, spec: QuantSpec) -> None:
        """`(q - z) s = s q + m` with `m = -z s`: codes two a byte in the kernels' vertical
        layout (`cpu_lowbit.pack4`), scale and min fp16."""
        self._lowbit_buffers(cpu_lowbit.pack4(spec.q), spec.scales, -spec.zeros * spec.scales)

    def _pack_w8a8(self, spec: QuantSpec) -> None:
        """Signed codes `q - 128`: `(q - z) s = s (q - 128) + (128 - z) s`; GGUF Q8_0 (zero
        point 128) has no min. `q ^ 128` read as int8 is `q - 128`, without the two wider
        copies of the matrix that computing it in int16 took (the lm_head's peak at load)."""
        codes = (spec.q ^ 128).view(torch.int8)
        mins = (128.0 - spec.zeros) * spec.scales
        self._lowbit_buffers(
            cpu_lowbit.pad_columns(codes), spec.scales, mins if mins.any() else None
        )

    def _pack_w8a8v(self, spec: QuantSpec) -> None:
        """The unsigned codes `q` in the vertical layout (`cpu_lowbit.pack8v`), scales and mins
        as `w8a8`'s: the kernel sees `d (q - 128) + m`, the same weight."""
        mins = (128.0 - spec.zeros) * spec.scales
        self._lowbit_buffers(cpu_lowbit.pack8v(spec.q), spec.scales, mins if mins.any() else None)

    def _lowbit_buffers(
        self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
    ) -> None:
        self.register_buffer("lowbit_codes", codes)
        self.register_buffer("lowbit_scales", cpu_lowbit.tile_columns(scales))
        self.register_buffer("lowbit_mins", None if mins is None else cpu_lowbit.tile_columns(mins))

    def _pack_int4x2(self, spec: QuantSpec) -> None:
        """8-bit groups as two 4-bit planes in one int4pack matrix of 2N rows: with
        `q = 16 h + l`, `(q - z) s = (h - z/16) 16s + (l - 0) s`, exact in codes."""
        hi = QuantSpec(spec.q >> 4, spec.scales * 16, spec.zeros / 16, spec.group_size, 4)
        lo = QuantSpec(spec.q & 15, spec.scales, torch.zeros_like(spec.zeros), spec.group_size, 4)
        self._pack_int4pack(cat_rows([hi, lo]))

    def _pack_int4pack(self, spec: QuantSpec) -> None:
        g = cpu_int4_group(spec.group_size)
        assert g is not None
        reps = spec.group_size // g
        scales = spec.scales.float().repeat_interleave(reps, dim=1)
        zeros = spec.zeros.float().repeat_interleave(reps, dim=1)
        pad = -spec.shape[0] % INT4_ROWS
        q = F.pad(spec.q.to(torch.int32), (0, 0, 0, pad))
        scale_zero = torch.stack([scales, (8.0 - zeros) * scales], dim=-1)  # [N, G, 2]
        scale_zero = F.pad(scale_zero, (0, 0, 0, 0, 0, pad))
        self.int4_group = g
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
        )
        self.register_buffer(
            "scale_zero", scale_zero.transpose(0, 1).contiguous().to(torch.bfloat16)
        )

    def _pack_int8pack(self, spec: QuantSpec) -> None:
        if spec.group_size == spec.shape[1]:
            w8 = (spec.q.to(torch.int16) - 128).to(torch.int8)
            scale = spec.scales[:, 0].float()
            offset = (128.0 - spec.zeros[:, 0].float()) * scale
            if not offset.any():
                offset = None
        else:
            w8, scale, offset = requantise_per_row(spec)
            self.requantised = True
        self.register_buffer("w8", w8.contiguous())
        self.register_buffer("scale8", scale.to(torch.bfloat16))
        self.register_buffer("offset8", None if offset is None else offset.to(self.dtype))

    def _pack_w4a16(self, spec: QuantSpec) -> None:
        from kvguard.kernels.w4a16 import pack_for_triton

        self.w4a16 = pack_for_triton(spec)
        self.perm = None  # the kernel gathers the desc_act permutation itself
        for name in ("qweight", "scales", "zeros"):  # counted and moved like any buffer
            self.register_buffer(f"w4a16_{name}", getattr(self.w4a16, name))

    def _pack_dense(self, spec: QuantSpec) -> None:
        log.info(
            "%d-bit weight %s with group size %d: no low-bit kernel here, dequantised once",
            spec.bits,
            tuple(spec.shape),
            spec.group_size,
        )
        w = spec.dequantize(torch.float32)
        if spec.perm is not None:  # dequantize() already undid the permutation
            self.perm = None
        self.register_buffer("weight", w.to(self.dtype))

    # -- the hot path ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(-1, self.perm)
        y = getattr(self, f"_mm_{self.kernel}")(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _mm_lowbit(self, x: torch.Tensor) -> torch.Tensor:
        """`w4a8` and `w8a8`: the C kernels (which pick integer dots or fp32 panels by rows)."""
        gemm = cpu_lowbit.w4a8 if self.bits == 4 else cpu_lowbit.w8a8
        return gemm(
            x,
            self.out_features,
            self.lowbit_codes,
            self.lowbit_scales,
            self.lowbit_mins,
            self.group_size,
            self.fine,
        ).to(x.dtype)

    _mm_w4a8 = _mm_w8a8 = _mm_lowbit

    def _mm_w8a8v(self, x: torch.Tensor) -> torch.Tensor:
        """`w8a8` over the vertical 8-bit layout, int8 activations (the refined lm_head)."""
        args = (self.lowbit_codes, self.lowbit_scales, self.lowbit_mins, self.group_size)
        return cpu_lowbit.w8a8v(x, self.out_features, *args).to(x.dtype)

    def _mm_int4pack(self, x: torch.Tensor) -> torch.Tensor:
        if not x.shape[0]:
            return x.new_empty(0, self.out_features)
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, self.packed, self.int4_group, self.scale_zero
        )
        return y[:, : self.out_features].to(x.dtype)

    def _mm_int4x2(self, x: torch.Tensor) -> torch.Tensor:
        if not x.shape[0]:
            return x.new_empty(0, self.out_features)
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, self.packed, self.int4_group, self.scale_zero
        ).float()
        n = self.out_features
        return (y[:, :n] + y[:, n : 2 * n]).to(x.dtype)

    def _mm_int8pack(self, x: torch.Tensor) -> torch.Tensor:
        if not x.shape[0]:
            return x.new_empty(0, self.out_features)
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(xb, self.w8, self.scale8).to(x.dtype)
        if self.offset8 is not None:
            y = y + x.sum(-1, keepdim=True) * self.offset8
        return y

    def _mm_w4a16(self, x: torch.Tensor) -> torch.Tensor:
        from kvguard.kernels.dispatch import w4a16_matmul

        return w4a16_matmul(x.contiguous(), self.w4a16)

    def _mm_dense(self, x: torch.Tensor) -> torch.Tensor:
        from kvguard.kernels.dispatch import dense_linear

        return dense_linear(x.to(self.weight.dtype), self.weight).to(x.dtype)

    # -- rows, for a (tied) embedding -------------------------------------------------------
    def can_read_rows(self) -> bool:
        """Whether `rows` gives the weight's own rows (not a requantised copy's)."""
        if self.perm is not None or self.requantised:
            return False
        return self.kernel in ("w4a8", "w8a8", "w8a8v", "int8pack", "dense")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids`, dequantised (only those rows): the tied embedding's lookup."""
        if self.kernel == "dense":
            return F.embedding(ids, self.weight)
        if self.kernel in ("w4a8", "w8a8", "w8a8v"):
            return self._lowbit_rows(ids)
        w = self.w8.index_select(0, ids.reshape(-1)).to(self.dtype)
        out = w * self.scale8.index_select(0, ids.reshape(-1)).to(self.dtype).unsqueeze(-1)
        if self.offset8 is not None:
            out = out + self.offset8.index_select(0, ids.reshape(-1)).unsqueeze(-1)
        return out.reshape(*ids.shape, self.in_features)

    def _lowbit_rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.kernel == "w4a8":
            q = cpu_lowbit.unpack4(self.lowbit_codes, flat)
        elif self.kernel == "w8a8v":
            q = (cpu_lowbit.unpack8v(self.lowbit_codes, flat) ^ 128).view(torch.int8)
        else:
            q = self.lowbit_codes.index_select(0, flat)
        tile, col = flat // cpu_lowbit.TILE, flat % cpu_lowbit.TILE
        groups = self.in_features // self.group_size
        w = q.view(-1, groups, self.group_size).float()
        w = w * self.lowbit_scales[tile, :, col].float().unsqueeze(-1)
        if self.lowbit_mins is not None:
            w = w + self.lowbit_mins[tile, :, col].float().unsqueeze(-1)
        return w.reshape(*ids.shape, self.in_features).to(self.dtype)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bits={self.bits}, "
            f"group={self.group_size}, kernel={self.kernel}"
        )


def use_int8_activations(model: nn.Module) -> int:
    """Every C-kernel projection of `model` quantises its activations to int8 instead of int16
    (the `cpu_activations: int8` knob): twice the integer dots per instruction on AVX2, and no
    fp32 panels for big batches (the int8 dots beat them at any batch). Returns how many
    layers changed; the lm_head is int8 already."""
    changed = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m.kernel in ("w4a8", "w8a8") and m.fine:
            m.fine = False
            changed += 1
    return changed


def _spec_on(spec: QuantSpec, device: torch.device) -> QuantSpec:
    perm = None if spec.perm is None else spec.perm.to(device)
    return QuantSpec(
        spec.q.to(device),
        spec.scales.to(device),
        spec.zeros.to(device),
        spec.group_size,
        spec.bits,
        perm,
    )


def requantise_per_row(
    spec: QuantSpec, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Symmetric int8 with one scale per output row (what `_weight_int8pack_mm` takes), a
    chunk of rows at a time so no full fp32 copy of the matrix is made."""
    w8 = torch.empty(spec.shape, dtype=torch.int8)
    scales = torch.empty(spec.shape[0])
    for lo in range(0, spec.shape[0], chunk):
        part = _slice_rows(spec, range(lo, min(lo + chunk, spec.shape[0]))).dequantize()
        scale = part.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        scale = scale.to(torch.bfloat16).float()  # the kernel's scale dtype: codes match it
        w8[lo : lo + len(part)] = torch.round(part / scale[:, None]).clamp_(-127, 127)
        scales[lo : lo + len(part)] = scale
    return w8, scales, None


class QuantizedEmbedding(nn.Module):
    """A vocabulary embedding over quantized rows: only the looked-up rows are dequantised.

    Tied to a quantized lm_head that can hand out its own rows (the C kernels' layouts,
    per-channel int8, dense) it shares that layer's storage, one copy in memory; otherwise (an
    int4pack lm_head, whose layout is torch's, or a requantised int8 copy) it keeps its own
    codes."""

    def __init__(
        self,
        spec: QuantSpec,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tied: QuantizedLinear | None = None,
        start: int = 0,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.dtype, self.start, self.tp = dtype, start, tp or TPGroup.single()
        self.rows = spec.shape[0]
        self.tied = tied if tied is not None and tied.can_read_rows() else None
        if self.tied is None:
            self.table = RowTable(spec, dtype, torch.device(device))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows `ids` (local numbering), exact: what the lm_head refines from."""
        return self.tied.rows(ids) if self.tied is not None else self.table(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `[start, start + rows)` live here; others are zero here and filled in by the
        rank that holds them (one all-reduce), as in `VocabParallelEmbedding`."""
        if self.tp.size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        rows = self.lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce_(rows.masked_fill_(outside.unsqueeze(-1), 0.0))


class RowTable(nn.Module):
    """Codes (4-bit: two a byte) and group scales/zeros, dequantised a row at a time."""

    def __init__(self, spec: QuantSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if spec.perm is not None:
            raise ValueError("an embedding cannot have a desc_act input permutation")
        self.bits, self.group_size, self.dtype = spec.bits, spec.group_size, dtype
        q = spec.q.to(device)
        if spec.bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        self.register_buffer("codes", q.contiguous())
        self.register_buffer("scales", spec.scales.to(device, torch.float16))
        self.register_buffer("zeros", spec.zeros.to(device, torch.float32))
        self.read: Callable[[torch.Tensor], torch.Tensor] | None = None

    def read_from(self, linear: QuantizedLinear) -> None:
        """Serve the rows from `linear`, which holds these very rows exactly (a tied lm_head
        built from the same spec), and drop this copy: the vocabulary is held once."""
        width = self.codes.shape[1] * (2 if self.bits == 4 else 1)
        if (linear.out_features, linear.in_features) != (self.codes.shape[0], width):
            raise ValueError(f"{linear} does not hold this table's {tuple(self.codes.shape)} rows")
        self.read = linear.rows
        for name in ("codes", "scales", "zeros"):
            delattr(self, name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.read is not None:
            return self.read(ids).to(self.dtype)
        flat = ids.reshape(-1)
        q = self.codes.index_select(0, flat)
        if self.bits == 4:
            q = torch.stack([q & 15, q >> 4], dim=-1).flatten(1)
        groups = q.shape[1] // self.group_size
        s = self.scales.index_select(0, flat).float().unsqueeze(-1)
        z = self.zeros.index_select(0, flat).unsqueeze(-1)
        w = (q.view(-1, groups, self.group_size).float() - z) * s
        return w.reshape(*ids.shape, -1).to(self.dtype)


class QuantizedLMHead(nn.Module):
    """The lm_head over a quantized weight (this rank's vocabulary rows); rank 0 gathers the
    full fp32 logits, as `ParallelLMHead` does.

    A tied head is handed the embedding's row table as `exact`; where this head's own storage
    holds the same rows exactly (the C kernels' layouts keep the codes) the table reads them
    from here and drops its copy, so the vocabulary matrix is held once.

    With `exact` rows (the tied embedding's table) the kernel's logits only rank the
    vocabulary: the `REFINED` best candidates of each row are recomputed in fp32 from the exact
    weights and the fp32 hidden state. Top-1 choices then match the full-precision head even
    where the fast kernel's int8 activations, bf16 output (a step of 1/16 at a logit of 16) or
    a per-row int8 requantisation would blur a near tie, at the cost of a top-k and a few
    hundred dot products a token. The other logits keep the kernel's error, which a
    log-softmax's normaliser sums over the whole vocabulary: log-probabilities are taken from
    `exact_logits` instead.

    `tokens` (`token_vocab`: the tokenizer's ids of a padded vocabulary; `vocab_size` where
    None): the rows past them are at -inf from the kernel's output on (`mask_padding`), on
    each rank's share, so that none takes one of a row's refined slots, and in the exact
    logits too."""

    REFINED = 16

    def __init__(
        self,
        linear: QuantizedLinear,
        vocab_size: int,
        tp: TPGroup | None = None,
        exact: Callable[[torch.Tensor], torch.Tensor] | None = None,
        tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.linear, self.vocab_size, self.tp = linear, vocab_size, tp or TPGroup.single()
        self.tokens = vocab_size if tokens is None else min(tokens, vocab_size)
        if isinstance(exact, RowTable) and exact.read is None and linear.can_read_rows():
            exact.read_from(linear)
        self.exact = exact
        self._dense: torch.Tensor | None = None  # `_exact_chunks`' dequantised rows (CPU)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each rank refines its own best candidates, so the global best are among them."""
        logits = mask_padding(self.linear(hidden).float(), self._token_rows())
        if self.exact is not None:
            logits = self._refine(hidden, logits)
        if self.tp.size == 1:
            return logits[..., : self.vocab_size]
        full = self.tp.gather_to_first(logits)
        if full is None or full.shape[-1] == self.vocab_size:
            return full
        return full[..., : self.vocab_size].contiguous()

    def _token_rows(self) -> int:
        """How many of this rank's rows are among the first `tokens` (the ranks' shares are
        equal and in rank order; past the tokens: a padded vocabulary's rows)."""
        rows = self.linear.out_features
        return max(0, min(rows, self.tokens - self.tp.rank * rows))

    @property
    def approximate(self) -> bool:
        """Whether the forward's logits are exact only at each row's best (`_refine`)."""
        return self.exact is not None

    def exact_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every logit of each row `[n, vocab_size]`, fp32 dots of the fp32 hidden state with
        the exact weights (what `_refine` computes for each row's best): what a request's
        log-probabilities are taken from. The forward's logits are the int8 kernel's but for
        the best, and a log-softmax's normaliser sums their errors over the whole vocabulary
        without their cancelling: on the default model up to 0.036 in a log-probability
        against fp32, 3e-5 from these. Each row's bits are its own, however many rows come
        with it (a token's log-probabilities do not depend on the step's other rows). One
        rank's head only: a vocabulary split over ranks has no exact path (ValueError)."""
        if self.exact is None or self.tp.size > 1:
            raise ValueError(
                f"exact_logits needs a refined head on one rank (refined: {self.approximate}, "
                f"tensor_parallel {self.tp.size})"
            )
        if self._reads_own_codes():
            out = self._exact8v(hidden.float())
        else:
            out = self._exact_chunks(hidden.float())
        return mask_padding(out[:, : self.vocab_size], self.tokens)

    def _reads_own_codes(self) -> bool:
        """Whether the exact rows are this head's own vertical 8-bit codes (`w8a8v`), which
        the C kernels dot where they lie (`refine8v`, `exact8v`)."""
        lin = self.linear
        return lin.kernel == "w8a8v" and getattr(self.exact, "read", None) == lin.rows

    def _exact8v(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every column in C (`cpu_lowbit.exact8v`: each dot in `refine8v`'s order, so the
        same bits as the refined best, whatever the rows or threads). A tile's codes are read
        once and dequantised once for up to eight rows: on the default model's head (49152 x
        576) about 6.6 ms for one row at one thread, 1.7 ms a row from nine rows (a prompt's
        log-probabilities), against 1.3 ms for the int8 kernel's whole head. (A dequantised
        chunk's GEMM would take 0.7 ms a row from a dozen rows, but its sums' order, and so a
        row's bits, follow the row count.)"""
        lin = self.linear
        args = (lin.lowbit_codes, lin.lowbit_scales, lin.lowbit_mins, lin.group_size)
        return cpu_lowbit.exact8v(hidden, *args)[:, : lin.out_features]

    def _exact_chunks(self, hidden: torch.Tensor) -> torch.Tensor:
        """The exact rows dequantised 16 MiB at a time, each hidden row's products with them
        one matrix-vector product (a GEMM's sums would follow the row count). On the CPU
        (every head whose exact rows the C kernels do not dot where they lie: torch's int4 and
        int8 fallbacks, a 4-bit or a dense head) the dequantised matrix is kept from the first
        call that asks for log-probabilities: dequantising the vocabulary took 0.42 s a call
        on the default model's size, far more than the products; its fp32 bytes (113 MB
        there, eight times a 4-bit head's) are held from then on, outside the memory
        accounting."""
        vocab = self.linear.out_features
        out = torch.empty(hidden.shape[0], vocab, device=hidden.device)
        if hidden.device.type == "cpu":
            if self._dense is None:
                self._dense = self.exact(torch.arange(vocab)).float()
            chunks = [(0, self._dense)]
        else:  # a GPU dequantises a chunk in microseconds: nothing kept
            step = max(1, 2**22 // self.linear.in_features)
            ids = [torch.arange(lo, min(lo + step, vocab), device=hidden.device)
                   for lo in range(0, vocab, step)]  # fmt: skip
            chunks = ((int(i[0]), self.exact(i).float()) for i in ids)
        for lo, w in chunks:
            for r in range(hidden.shape[0]):
                out[r, lo : lo + len(w)] = torch.mv(w, hidden[r])
        return out

    def _refine(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not logits.numel():
            return logits
        return self.refine_at(hidden, logits, self.best(logits))

    def best(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's `REFINED` largest logits' ids `[n, k]`: the candidates `_refine` makes
        exact."""
        k = min(self.REFINED, logits.shape[-1])
        top = None
        if cpu_ops.rows_served(logits):
            top = cpu_ops.topk_indices(logits, k)  # 0.17 against 1.5 ms for 32 rows here
        if top is None:
            top = logits.topk(k, dim=-1).indices  # [n, k]
        return top

    def refine_at(
        self, hidden: torch.Tensor, logits: torch.Tensor, top: torch.Tensor
    ) -> torch.Tensor:
        """`logits` (fp32 `[n, vocab]` of this head, changed in place and returned) with the
        columns `top` `[n, k]` of each row recomputed exactly from `hidden` `[n, hidden]`."""
        lin = self.linear
        if self._reads_own_codes():
            args = (lin.lowbit_codes, lin.lowbit_scales, lin.lowbit_mins, lin.group_size)
            refined = cpu_lowbit.refine8v(logits, hidden.float(), top, *args)
        else:
            rows = self.exact(top).float()  # [n, k, hidden]
            refined = logits.scatter_(-1, top, torch.einsum("nkh,nh->nk", rows, hidden.float()))
        # a row with fewer finite candidates than `k` (a grammar allowing a few tokens) has
        # padding among them: recomputed, it would be finite again
        return mask_padding(refined, self._token_rows())


class RowParallelQuantized(nn.Module):
    """A quantized row-parallel projection: partial outputs summed by one all-reduce, the bias
    added once after the sum."""

    def __init__(self, layer: QuantizedLinear, tp: TPGroup, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.layer, self.tp = layer, tp
        self.register_buffer("bias", None if bias is None else bias.to(layer.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce_(self.layer(x))
        return out if self.bias is None else out + self.bias


def cat_rows(specs: list[QuantSpec]) -> QuantSpec:
    """Specs stacked along the output dimension (fused qkv, gate_up): same bits, group size
    and input permutation, or an error naming what differs."""
    first = specs[0]
    for s in specs[1:]:
        if (s.bits, s.group_size, s.shape[1]) != (first.bits, first.group_size, first.shape[1]):
            raise ValueError(
                f"cannot fuse {first.bits}-bit/group {first.group_size}/in {first.shape[1]} "
                f"with {s.bits}-bit/group {s.group_size}/in {s.shape[1]}"
            )
        if (s.perm is None) != (first.perm is None) or (
            s.perm is not None and not torch.equal(s.perm, first.perm)
        ):
            raise ValueError("cannot fuse projections with different desc_act permutations")
    if len(specs) == 1:
        return first
    return QuantSpec(
        torch.cat([s.q for s in specs]),
        torch.cat([s.scales for s in specs]),
        torch.cat([s.zeros for s in specs]),
        first.group_size,
        first.bits,
        first.perm,
    )


def slice_spec(spec: QuantSpec, span: range, dim: int, name: str) -> QuantSpec:
    """One rank's part of a spec: output rows (`dim` 0; rows past the end read as zeros, the
    padded vocabulary) or input columns (`dim` 1, whole groups only). A span over the whole
    dimension (one rank) is the spec itself, a desc_act one included."""
    if span.start == 0 and len(span) == spec.shape[dim]:
        return spec
    if dim == 0:
        return _slice_rows(spec, span)
    if spec.perm is not None:
        raise ValueError(  # act-order groups span every input column
            f"{name}: a desc_act (g_idx) weight cannot be split by input columns; it is served "
            "at tensor_parallel 1 only (with any pipeline_parallel: a stage holds whole layers)"
        )
    g = spec.group_size
    if span.start % g or len(span) % g:
        raise ValueError(
            f"{name}: input columns [{span.start}, {span.stop}) do not fall on its "
            f"group boundaries (group size {g})"
        )
    cols, groups = slice(span.start, span.stop), slice(span.start // g, span.stop // g)
    return QuantSpec(
        spec.q[:, cols], spec.scales[:, groups], spec.zeros[:, groups], g, spec.bits, None
    )


def _slice_rows(spec: QuantSpec, span: range) -> QuantSpec:
    stop = max(span.start, min(span.stop, spec.shape[0]))
    pad = span.stop - stop

    def cut(t: torch.Tensor) -> torch.Tensor:
        t = t[span.start : stop]
        return F.pad(t, (0, 0, 0, pad)) if pad > 0 else t

    return QuantSpec(
        cut(spec.q), cut(spec.scales), cut(spec.zeros), spec.group_size, spec.bits, spec.perm
    )
