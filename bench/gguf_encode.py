"""GGUF blocks written from float weights, and a GGUF rewritten in the layouts llama.cpp's users
download (`Q4_K_M`, `Q5_K_M`, `IQ4_XS`).

The gguf package quantises the legacy types (Q4_0 ... Q8_0) but none of the K-quants or IQ4
types: `encode` writes those blocks here, byte by byte (round to nearest, no search: what the
tests and the benchmarks need is valid blocks of realistic weights, not llama.cpp's error
minimisation). `requantise` dequantises each tensor of a GGUF and encodes it in the type
llama.cpp's `llama-quantize` would pick for the layout (`tensor_type`), one tensor at a time, so
a file of any size needs about one tensor's floats in memory.

    python bench/gguf_encode.py SRC.gguf DST.gguf --layout Q4_K_M [--layers N]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


# -- blocks written from float weights --------------------------------------------------------
def f16_bytes(x: np.ndarray) -> np.ndarray:
    """fp16 values as their two bytes, `[..., 2]`."""
    return np.ascontiguousarray(x.astype(np.float16)).reshape(*x.shape, 1).view(np.uint8)


def _safe(x: np.ndarray) -> np.ndarray:
    return np.where(x == 0, 1, x)


def encode(w: np.ndarray, qtype: Q) -> np.ndarray:
    """`w [rows, cols]` in `qtype`'s raw blocks `[rows, bytes]` (round to nearest, no search)."""
    if qtype in (Q.Q4_K, Q.Q5_K):
        return _encode_k(w, qtype == Q.Q5_K)
    if qtype == Q.Q6_K:
        return _encode_q6_k(w)
    if qtype == Q.Q3_K:
        return _encode_q3_k(w)
    if qtype == Q.Q2_K:
        return _encode_q2_k(w)
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):
        return _encode_iq4(w, qtype == Q.IQ4_XS)
    return gguf.quants.quantize(w, qtype)


def _encode_k(w: np.ndarray, fifth: bool) -> np.ndarray:
    """Q4_K / Q5_K: per 32 weights a 6-bit scale and minimum of fp16 `d` and `dmin`."""
    levels = 31 if fifth else 15
    rows, cols = w.shape
    x = w.reshape(rows, cols // 256, 8, 32)
    lo = np.minimum(x.min(-1), 0)
    scale, low = (x.max(-1) - lo) / levels, -lo
    d = scale.max(-1).astype(np.float16).astype(np.float32) / 63
    dmin = low.max(-1).astype(np.float16).astype(np.float32) / 63
    d, dmin = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.rint(scale / _safe(d.astype(np.float32))[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(low / _safe(dmin.astype(np.float32))[..., None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    shift = (dmin.astype(np.float32)[..., None] * mn)[..., None]
    q = np.clip(np.rint((x + shift) / _safe(step)[..., None]), 0, levels).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4),
        ],
        axis=-1,
    )
    pairs = q.reshape(rows, cols // 256, 4, 2, 32) & 15  # sub-blocks 2k and 2k + 1
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, cols // 256, 128)
    parts = [f16_bytes(d), f16_bytes(dmin), scales]
    if fifth:  # bit j of byte i: weight i of sub-block j
        hi = ((q >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]
        parts.append(np.bitwise_or.reduce(hi, axis=-2))
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _encode_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K: an int8 scale per 16 weights of an fp16 `d`, negative in every other super-block
    (llama.cpp's quantiser writes a negative `d`)."""
    rows, cols = w.shape
    x = w.reshape(rows, cols // 256, 16, 16)
    sub = np.abs(x).max(-1) / 31
    sign = np.where(np.arange(cols // 256) % 2, -1, 1).astype(np.float32)
    d = (sub.max(-1) / 127 * sign).astype(np.float16)
    s = np.clip(np.rint(sub / _safe(d.astype(np.float32))[..., None]), -128, 127)
    step = (d.astype(np.float32)[..., None] * s.astype(np.float32))[..., None]
    q = (np.clip(np.rint(x / _safe(step)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, cols // 256, 2, 4, 32)  # weight 128h + 32k + i
    low = q & 15
    ql = low[..., :2, :] | (low[..., 2:, :] << 4)  # byte 64h + 32(k % 2) + i
    hi = ((q >> 4) & 3) << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    qh = np.bitwise_or.reduce(hi, axis=-2)  # byte 32h + i
    parts = [
        ql.reshape(rows, -1, 128),
        qh.reshape(rows, -1, 64),
        s.astype(np.int8).view(np.uint8),
        f16_bytes(d),
    ]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _bits_by_weight(q: np.ndarray, rows: int, blocks: int) -> np.ndarray:
    """2-bit codes `[rows, blocks, 256]` as Q2_K and Q3_K lay them out: weight 128h + 32j + i
    in byte 32h + i, bits 2j and 2j + 1."""
    q = q.reshape(rows, blocks, 2, 4, 32) << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    return np.bitwise_or.reduce(q, axis=-2).reshape(rows, blocks, 64)


def _encode_q3_k(w: np.ndarray) -> np.ndarray:
    """Q3_K: a 6-bit scale (stored + 32) per 16 weights of an fp16 `d`, 3-bit codes about 4."""
    rows, cols = w.shape
    blocks = cols // 256
    x = w.reshape(rows, blocks, 16, 16)
    sub = np.abs(x).max(-1) / 4
    d = (sub.max(-1) / 31).astype(np.float16)
    s = np.clip(np.rint(sub / _safe(d.astype(np.float32))[..., None]), -32, 31)
    step = (d.astype(np.float32)[..., None] * s)[..., None]
    q = (np.clip(np.rint(x / _safe(step)), -4, 3) + 4).astype(np.uint8).reshape(rows, blocks, 256)
    sc = (s + 32).astype(np.uint8)
    high = ((q >> 2) & 1).reshape(rows, blocks, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]
    top = ((sc >> 4) & 3).reshape(rows, blocks, 4, 4) << np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    parts = [
        np.bitwise_or.reduce(high, axis=-2),  # bit j of byte i: weight 32j + i
        _bits_by_weight(q & 3, rows, blocks),
        (sc[..., :8] & 15) | ((sc[..., 8:] & 15) << 4),
        np.bitwise_or.reduce(top, axis=-2),  # byte 8 + i, bits 2j: sub-block 4j + i
        f16_bytes(d),
    ]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _encode_q2_k(w: np.ndarray) -> np.ndarray:
    """Q2_K: a 4-bit scale and minimum per 16 weights of fp16 `d` and `dmin`, 2-bit codes."""
    rows, cols = w.shape
    blocks = cols // 256
    x = w.reshape(rows, blocks, 16, 16)
    low = -np.minimum(x.min(-1), 0)
    scale = (x.max(-1) + low) / 3
    d = (scale.max(-1) / 15).astype(np.float16)
    dmin = (low.max(-1) / 15).astype(np.float16)
    sc = np.clip(np.rint(scale / _safe(d.astype(np.float32))[..., None]), 0, 15).astype(np.uint8)
    mn = np.clip(np.rint(low / _safe(dmin.astype(np.float32))[..., None]), 0, 15).astype(np.uint8)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    shift = (dmin.astype(np.float32)[..., None] * mn)[..., None]
    q = np.clip(np.rint((x + shift) / _safe(step)), 0, 3).astype(np.uint8)
    parts = [sc | (mn << 4), _bits_by_weight(q, rows, blocks), f16_bytes(d), f16_bytes(dmin)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _encode_iq4(w: np.ndarray, xs: bool) -> np.ndarray:
    """IQ4_NL (an fp16 `d` per 32 weights) / IQ4_XS (an fp16 `d` per 256 and a 6-bit level per
    32, scale `d * (level - 32)`): each weight the nearest of the scale times `IQ4_VALUES`."""
    rows, cols = w.shape
    x = w.reshape(rows, cols // 256, 8, 32) if xs else w.reshape(rows, cols // 32, 1, 32)
    want = np.abs(x).max(-1) / 127  # each 32's scale
    if xs:
        d = (want.max(-1) / 31).astype(np.float16)
        level = np.clip(np.rint(want / _safe(d.astype(np.float32))[..., None]), 0, 31) + 32
        scale = d.astype(np.float32)[..., None] * (level - 32)
    else:
        d = want[..., 0].astype(np.float16)
        scale = d.astype(np.float32)[..., None]
    near = np.abs(x[..., None] / _safe(scale)[..., None, None] - IQ4_VALUES).argmin(-1)
    qs = (near[..., :16] | (near[..., 16:] << 4)).astype(np.uint8).reshape(*x.shape[:2], -1)
    if not xs:
        return np.concatenate([f16_bytes(d), qs], axis=-1).reshape(rows, -1)
    level = level.astype(np.uint16)
    top = np.bitwise_or.reduce((level >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=-1)
    low = (level[..., 0::2] & 15) | ((level[..., 1::2] & 15) << 4)
    parts = [f16_bytes(d), top.reshape(*top.shape, 1).view(np.uint8), low.astype(np.uint8), qs]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


# -- llama.cpp's layouts -----------------------------------------------------------------------
LAYOUTS = {"Q4_K_M": Q.Q4_K, "Q5_K_M": Q.Q5_K, "IQ4_XS": Q.IQ4_XS}  # each one's base type
FILE_TYPES = {
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K_M": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "IQ4_XS": gguf.LlamaFileType.MOSTLY_IQ4_XS,
}
# a row that is no whole number of 256-weight super-blocks takes a 32-weight type of about the
# same bits instead (SmolLM2's 576-wide rows: every projection but ffn_down)
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose `attn_v` and `ffn_down` a `_M` layout keeps at 6 bits: the first and
    last eighth, and every third one between."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def tensor_type(
    layout: str, name: str, cols: int, layers: int, tied: bool, gqa: int = 1
) -> Q | None:
    """The type `llama-quantize` (no importance matrix) gives tensor `name`, rows of `cols`
    weights, in a `layers`-layer model whose lm_head is `tied` to the embedding and whose
    query heads share each KV head `gqa` ways; None: a 1-D tensor (norms), kept as it is. The
    rules for a dense llama model's tensors: fused `attn_qkv` and expert tensors are not
    covered."""
    base = LAYOUTS[layout]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return Q.Q8_0 if cols % 256 else Q.Q6_K  # the lm_head at 6 bits where it can be
    m = re.match(r"blk\.(\d+)\.(\w+)\.weight$", name)
    want = base
    if m:
        layer, kind = int(m.group(1)), m.group(2)
        medium = layout in ("Q4_K_M", "Q5_K_M")
        if kind == "attn_v" and medium and more_bits(layer, layers):
            want = Q.Q6_K
        elif kind == "attn_v" and layout == "IQ4_XS" and gqa >= 4:
            want = Q.Q5_K
        elif kind == "ffn_down" and medium and more_bits(layer, layers):
            want = Q.Q6_K
        elif kind == "ffn_down" and layout == "IQ4_XS" and layer < layers // 8:
            want = Q.Q5_K
    elif name != "token_embd.weight":
        return None
    return FALLBACK.get(want, want) if cols % 256 else want


def _fields(reader: gguf.GGUFReader) -> list[tuple[str, object, V, V | None]]:
    """Every metadata field but those the writer writes itself: (key, value, type, item type)."""
    out = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == V.ARRAY else None
        out.append((key, field.contents(), field.types[0], sub))
    return out


def read(path: Path) -> gguf.GGUFReader:
    """`path`'s reader, opened once while the file is unchanged: the gguf package parses every
    metadata field at open, seconds for a vocabulary of 49152 tokens."""
    st = path.resolve().stat()
    return _read(path.resolve(), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(path: Path, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def requantise(
    src_gguf: Path,
    dst_gguf: Path,
    layout: str | None,
    layers: int | None = None,
    override: Mapping[str, Q] | None = None,
) -> Counter[str]:
    """`src_gguf` rewritten as `dst_gguf` in `layout` (None: every tensor in its own type), its
    first `layers` layers only where given (a smaller model for a smoke run), a tensor named in
    `override` in the type given there; each tensor's new type counted by name. A tensor
    already in its new type is copied byte for byte; the file is written beside `dst_gguf` and
    renamed into place when complete."""
    reader = read(src_gguf)
    arch = str(reader.fields["general.architecture"].contents())
    total = int(reader.fields[f"{arch}.block_count"].contents())
    keep = total if layers is None else min(layers, total)
    heads = reader.fields.get(f"{arch}.attention.head_count")
    kv_heads = reader.fields.get(f"{arch}.attention.head_count_kv")
    gqa = int(heads.contents()) // int(kv_heads.contents()) if heads and kv_heads else 1
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    plan = []
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= keep:
            continue
        cols = int(t.shape[0])  # GGUF lists a tensor's dimensions innermost first
        new = None if layout is None or len(t.shape) < 2 else tensor_type(
            layout, t.name, cols, keep, tied, gqa
        )  # fmt: skip
        new = (override or {}).get(t.name, new)
        plan.append((t, t.tensor_type if new is None else new))
    tmp = dst_gguf.with_name(f".{dst_gguf.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, value, vtype, sub in _fields(reader):
        if key == f"{arch}.block_count":
            value = keep
        elif key == "general.file_type" and layout is not None:
            value = int(FILE_TYPES[layout])
        w.add_key_value(key, value, vtype, sub)
    for t, new in plan:
        shape = [int(n) for n in reversed(t.shape)]  # numpy order: rows first
        if new in (Q.F32, Q.F16):
            dtype = np.float32 if new == Q.F32 else np.float16
            w.add_tensor_info(t.name, shape, np.dtype(dtype), int(np.prod(shape)) * dtype().nbytes)
        else:
            per, size = gguf.GGML_QUANT_SIZES[new]
            byte_shape = [*shape[:-1], shape[-1] // per * size]
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), new)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t, new in plan:
            if new == t.tensor_type:
                data = np.asarray(t.data)
            else:
                rows = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
                data = encode(rows.reshape(-1, int(t.shape[0])), new)
            w.write_tensor_data(np.ascontiguousarray(data))
        w.close()
        tmp.replace(dst_gguf)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
    return Counter(new.name for _, new in plan)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="the GGUF to read")
    p.add_argument("dst", type=Path, help="the GGUF to write")
    p.add_argument("--layout", choices=sorted(LAYOUTS), help="llama.cpp layout (default: keep)")
    p.add_argument("--layers", type=int, help="keep only the first N layers")
    args = p.parse_args()
    types = requantise(args.src, args.dst, args.layout, args.layers)
    print(f"{args.dst}: " + ", ".join(f"{k} x{n}" for k, n in types.most_common()))


if __name__ == "__main__":
    main()
