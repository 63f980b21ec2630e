"""Converts a llama.cpp GGUF file into a Hugging Face-format directory, once, at fetch time.

Reading a GGUF is slow (the tokenizer arrays alone take seconds to parse), so the model is
converted once into safetensors + tokenizer files, which then load in about a second. Two forms:

- packed (`packed=True`, what `model_quantization: auto | gguf` serves): Q4_0, Q4_1 and Q8_0
  tensors stay quantized, unpacked to `QuantSpec`'s convention and stored per module as
  `<name>.qweight` (uint8 codes; two 4-bit codes a byte, even column in the low nibble),
  `<name>.scales` and `<name>.zeros` (float32, one per 32-column group); config.json says so in
  `quantization_config` (`quant_method: gguf`). Unquantised tensors (F32, F16, BF16: the
  norms, and any weight a file keeps at full precision) are stored as fp32, and so are the
  parts of a fused projection (q/k/v, gate/up: one kernel serves each) whose types differ in
  bit width or packing (an F16 or Q8_0 `attn_v` beside Q4_1 q/k), with a warning. A tensor of any
  other quantised type (Q4_K, Q5_0, Q6_K, ...) is refused, naming the file, the tensor and its
  type: dequantised it would silently serve the model at several times the file's size (a 4.5
  bit weight as 32 bits), which `model_quantization: none` does on purpose.
- fp32 (`packed=False`, `model_quantization: none`): every tensor dequantised, the reference
  the packed model is compared with.

Only the `llama` architecture with a byte-level BPE (`gpt2`) tokenizer is handled: that covers
SmolLM2, the default model. RoPE scaling is read as llama.cpp reads it (`_rope_scaling`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from kvguard.engine.gguf_packed import (  # noqa: F401 - load_packed, unpack_nibbles: re-exported
    PACKED_FORMAT_VERSION,
    load_packed,
    unpack_nibbles,
)
from kvguard.engine.model_config import ModelLoadError
from kvguard.engine.tokenizer_build import (
    DIGITS_SPLIT,
    GPT2_SPLIT,
    BpeSpec,
    write_tokenizer_files,
)

log = logging.getLogger("kvguard.engine")

# Bump model_registry.CONVERTER_REVISION when the output changes, so cached conversions are
# redone (it lives there so that serving never imports this module and `gguf`).

# tokenizer.ggml.pre -> how text is cut before BPE (as each vocabulary was trained)
PRE_SPLITS = {
    "default": GPT2_SPLIT,
    "gpt2": GPT2_SPLIT,
    "gpt-2": GPT2_SPLIT,
    "smollm": DIGITS_SPLIT,
    "starcoder": DIGITS_SPLIT,
    "refact": DIGITS_SPLIT,
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
PACKED_TYPES = (
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q8_0,
)
BITS = {
    gguf.GGMLQuantizationType.Q4_0: 4,
    gguf.GGMLQuantizationType.Q4_1: 4,
    gguf.GGMLQuantizationType.Q8_0: 8,
}
BLOCK_BYTES = {
    gguf.GGMLQuantizationType.Q4_0: 18,
    gguf.GGMLQuantizationType.Q4_1: 20,
    gguf.GGMLQuantizationType.Q8_0: 34,
}
GROUP = 32  # weights per block in all three
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_MISSING = object()


class GgufFile:
    """A parsed GGUF file whose every error names the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: GGUF file not found")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the parser raises many types on bad bytes; all mean "corrupt"
            raise ModelLoadError(
                f"{self.path}: not a readable GGUF file, corrupt or truncated ({e})"
            ) from e
        self.arch = str(self.get("general.architecture"))

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value; a missing required key is an error that names it."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return field.contents()

    def arch_get(self, key: str, default: Any = _MISSING) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}


def convert_gguf(
    gguf_path: Path, out_dir: Path, progress: bool = True, packed: bool = False
) -> None:
    """Write config.json, model.safetensors (packed, or all fp32) and tokenizer files for a
    GGUF into out_dir."""
    src = GgufFile(gguf_path)
    if src.arch != "llama":
        raise ModelLoadError(
            f"{src.path}: GGUF architecture {src.arch!r} is not supported (only 'llama')"
        )
    config = hf_config(src)
    tensors = convert_tensors(src, config, progress, packed)
    if packed:
        config["quantization_config"] = packed_config(src)
    spec = tokenizer_spec(src, config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(spec, out_dir)
    text = json.dumps(config, indent=2, sort_keys=True)
    (out_dir / "config.json").write_text(text + "\n", encoding="utf-8")


def hf_config(src: GgufFile) -> dict[str, Any]:
    """config.json for LlamaForCausalLM, from the GGUF hyper-parameters."""
    hidden = int(src.arch_get("embedding_length"))
    heads = int(src.arch_get("attention.head_count"))
    names = src.tensor_names()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(src.arch_get("feed_forward_length")),
        "num_hidden_layers": int(src.arch_get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(src.arch_get("attention.head_count_kv", heads)),
        "head_dim": int(src.arch_get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(src.arch_get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(src.arch_get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(src, names),
        "max_position_embeddings": int(src.arch_get("context_length")),
        "vocab_size": _vocab_rows(src),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _optional_int(src.get("tokenizer.ggml.bos_token_id", None)),
        "eos_token_id": _eos_ids(src),
        "pad_token_id": _optional_int(src.get("tokenizer.ggml.padding_token_id", None)),
        "torch_dtype": "float32",
    }


def _rope_scaling(src: GgufFile, names: set[str]) -> dict[str, Any] | None:
    """The file's RoPE scaling as llama.cpp reads it: the type defaults to `linear` and the
    factor comes from `rope.scaling.factor`, or else the old converters' `rope.scale_linear`
    (a factor of 0 or 1 scales nothing, nor does type `none`). Linear scaling is served; any
    other type (`yarn`, ...) and Llama 3.1's `rope_freqs` tensor are refused rather than run
    with the wrong positions."""
    kind = str(src.arch_get("rope.scaling.type", "linear"))
    key = f"{src.arch}.rope.scaling.factor"
    if src.get(key, None) is None:
        key = f"{src.arch}.rope.scale_linear"
    factor = src.get(key, 0.0)
    if kind not in ("none", "linear") or "rope_freqs.weight" in names:
        what = kind if "rope_freqs.weight" not in names else "a rope_freqs.weight tensor"
        raise ModelLoadError(
            f"{src.path}: RoPE scaling ({what}) in GGUF files is not supported (none, linear)"
        )
    try:
        factor = float(factor)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{src.path}: GGUF metadata {key} is malformed ({e})") from e
    if not factor >= 0:  # NaN too
        raise ModelLoadError(f"{src.path}: GGUF metadata {key} is {factor}, expected >= 0")
    if kind == "none" or factor in (0.0, 1.0):
        return None
    return {"rope_type": "linear", "factor": factor}


def _vocab_rows(src: GgufFile) -> int:
    """The embedding's row count is the model's vocab (the tokenizer's may be shorter)."""
    for t in src.reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[1])
    raise ModelLoadError(f"{src.path}: tensor 'token_embd.weight' is missing")


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _eos_ids(src: GgufFile) -> int | list[int] | None:
    """EOS plus end-of-turn ids (some chat models end turns with a token other than EOS)."""
    keys = (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    )
    ids: list[int] = []
    for key in keys:
        value = src.get(key, None)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def hf_tensor_name(src: GgufFile, name: str) -> str:
    """The Hugging Face name of a GGUF tensor; an unknown tensor is an error, not a silent skip."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_NAME.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        raise ModelLoadError(f"{src.path}: tensor {name!r} is not a known llama tensor")
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.weight"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rope layout for a q/k projection.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)...; Hugging Face rotates halves
    (x_i, x_{i+d/2}). llama.cpp's converter therefore reorders each head's output rows from
    [first half | second half] to interleaved pairs; this puts them back.
    """
    rows, cols = w.shape
    head_dim = rows // n_heads
    pairs = w.reshape(n_heads, head_dim // 2, 2, cols)
    return np.ascontiguousarray(pairs.swapaxes(1, 2).reshape(rows, cols))


def convert_tensors(
    src: GgufFile, config: dict[str, Any], progress: bool, packed: bool = False
) -> dict[str, np.ndarray]:
    """Every tensor under its Hugging Face name: fp32, or (packed) Q4_0/Q4_1/Q8_0 ones as
    `.qweight/.scales/.zeros` (`kept_packed`) and other quantised types refused
    (`_refuse_unpackable`)."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    keep: set[str] = set()
    if packed:
        _refuse_unpackable(src)
        keep = kept_packed(src, warn=True)
    out: dict[str, np.ndarray] = {}
    bar = tqdm(
        src.reader.tensors, desc=f"converting {src.path.name}", unit="tensor", disable=not progress
    )
    for t in bar:
        name = hf_tensor_name(src, t.name)
        if t.name in keep:
            out.update(_packed(src, t, heads, name.removesuffix(".weight")))
        else:
            out[name] = _dequantise(src, t, heads)
    _check_complete(src, out, config)
    return out


# A file's vocabulary-sized tensors, which llama.cpp's quantiser keeps in a finer type than
# the layers by default (a Q4_0 file's `output.weight` is Q6_K): dequantised, they cost one
# matrix, not the model, and are served in full precision with a warning
VOCAB_TENSORS = ("token_embd.weight", "output.weight")


def _refuse_unpackable(src: GgufFile) -> None:
    """A packed conversion serves Q4_0/Q4_1/Q8_0 tensors packed and unquantised ones as they
    are. A layer's tensor quantised otherwise (blocks of more than one value: Q4_K, Q5_0,
    Q6_K, IQ*, ...) is refused before anything is converted, naming the file, the tensor and
    its type: dequantised, the model would take several times the file's size. The embedding
    and the lm_head (`VOCAB_TENSORS`) are dequantised to fp32 instead, with a warning."""
    odd = [
        t
        for t in src.reader.tensors
        if t.tensor_type not in PACKED_TYPES and gguf.GGML_QUANT_SIZES[t.tensor_type][0] > 1
    ]
    for t in odd:
        if t.name in VOCAB_TENSORS:
            log.warning(
                "%s: %s is %s, which kvguard does not serve packed: it is served dequantised "
                "to fp32 (%.0f MiB)",
                src.path,
                t.name,
                t.tensor_type.name,
                int(np.prod(t.shape)) * 4 / 2**20,
            )
    bad = [t for t in odd if t.name not in VOCAB_TENSORS]
    if bad:
        kinds = sorted({t.tensor_type.name for t in bad})
        raise ModelLoadError(
            f"{src.path}: tensor {bad[0].name!r} is {bad[0].tensor_type.name} "
            f"({len(bad)} tensors of type {', '.join(kinds)} in all), which kvguard does not "
            f"serve packed (only {', '.join(q.name for q in PACKED_TYPES)}, with F32/F16/BF16 "
            "tensors as they are); `model_quantization: none` serves the file dequantised to "
            "fp32 (several times its size in memory)"
        )


# the projections kvguard serves fused, one kernel over their rows: a layer's parts must share
# one packed bit width, or all be dequantised
FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def _unfusable(src: GgufFile) -> list[list[Any]]:
    """The fused groups (`FUSED_GROUPS`, per layer) whose parts are not all packed at one bit
    width: F16 `attn_v` beside Q4_1 q/k, or a Q8_0 `attn_k` beside Q4_1 ones, as
    `llama-quantize --tensor-type` writes. Q4_0 beside Q4_1 fuses (both 4-bit)."""
    by_name = {t.name: t for t in src.reader.tensors}
    layers = sorted({int(m.group(1)) for n in by_name if (m := _LAYER_NAME.fullmatch(n))})
    out = []
    for i in layers:
        for group in FUSED_GROUPS:
            parts = [by_name[n] for k in group if (n := f"blk.{i}.{k}.weight") in by_name]
            bits = {BITS.get(t.tensor_type) for t in parts}
            if len(bits) > 1 and bits != {None}:
                out.append(parts)
    return out


def kept_packed(src: GgufFile, warn: bool = False) -> set[str]:
    """The GGUF tensors a packed conversion keeps packed: the Q4_0/Q4_1/Q8_0 ones, less those
    of a fused group it has to dequantise (`_unfusable`; `warn`: say which, once)."""
    groups = _unfusable(src)
    if warn and groups:
        _warn_unfusable(src, groups)
    mixed = {t.name for parts in groups for t in parts}
    return {t.name for t in src.reader.tensors if t.tensor_type in PACKED_TYPES} - mixed


def _warn_unfusable(src: GgufFile, groups: list[list[Any]]) -> None:
    """One warning naming every layer whose fused group is served dequantised, and the cost."""
    said = [
        f"layer {parts[0].name.split('.')[1]}: "
        + ", ".join(f"{t.name.split('.')[2]} {t.tensor_type.name}" for t in parts)
        for parts in groups
    ]
    more = f"; {len(said) - 4} more" if len(said) > 4 else ""
    mib = sum(int(np.prod(t.shape)) for parts in groups for t in parts) * 4 / 2**20
    log.warning(
        "%s: %d fused projection group(s) mix tensor types (%s%s); kvguard serves a fused "
        "group with one kernel, so these are served dequantised to fp32 (%.0f MiB)",
        src.path,
        len(groups),
        "; ".join(said[:4]),
        more,
        mib,
    )


def packed_config(src: GgufFile) -> dict[str, Any]:
    """The `quantization_config` of a packed conversion: which modules are packed, as what."""
    keep = kept_packed(src)
    modules = {
        hf_tensor_name(src, t.name).removesuffix(".weight"): t.tensor_type.name
        for t in src.reader.tensors
        if t.name in keep
    }
    return {
        "quant_method": "gguf",
        "format": "kvguard-packed",
        "version": PACKED_FORMAT_VERSION,
        "source": src.path.name,
        "modules": modules,
    }


def _packed(src: GgufFile, t: Any, heads: dict[str, int], base: str) -> dict[str, np.ndarray]:
    """One quantized tensor as codes + scales + zeros, rows un-permuted like the fp32 path."""
    try:
        q, scales, zeros = unpack_blocks(np.asarray(t.data), t.tensor_type)
    except ValueError as e:
        raise ModelLoadError(f"{src.path}: cannot unpack tensor {t.name!r} ({e})") from e
    kind = t.name.split(".")[-2]
    if kind in heads:  # the rope permutation moves whole output rows: codes and their scales
        q, scales, zeros = (unpermute_rows(a, heads[kind]) for a in (q, scales, zeros))
    if BITS[t.tensor_type] == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return {
        f"{base}.qweight": np.ascontiguousarray(q),
        f"{base}.scales": np.ascontiguousarray(scales),
        f"{base}.zeros": np.ascontiguousarray(zeros),
    }


def unpack_blocks(
    data: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 / Q8_0 tensor's raw blocks (`[rows, bytes]`) as (uint8 codes `[rows, cols]`,
    float32 scales and zeros `[rows, cols // 32]`) with `w = (code - zero) * scale`.

    Blocks of 32 weights: Q4_0 is fp16 `d` + 16 bytes (`w = d * (nibble - 8)`), Q4_1 fp16 `d`,
    fp16 `m` + 16 bytes (`w = d * nibble + m`), Q8_0 fp16 `d` + 32 int8 (`w = d * q`). In the
    4-bit types byte j holds weight j in its low nibble and weight j + 16 in its high one."""
    size = BLOCK_BYTES[qtype]
    if data.ndim != 2 or data.shape[1] % size:
        raise ValueError(f"{qtype.name} data of shape {data.shape} is not whole {size}-byte blocks")
    blocks = data.reshape(data.shape[0], -1, size)
    d = _f16(blocks[..., 0:2])
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q.reshape(data.shape[0], -1), d, np.full_like(d, 128.0)
    qs = blocks[..., 4:] if qtype == gguf.GGMLQuantizationType.Q4_1 else blocks[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(data.shape[0], -1)
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        return q, d, np.full_like(d, 8.0)
    return _min_to_zero(q, d, _f16(blocks[..., 2:4]))


def _min_to_zero(
    q: np.ndarray, d: np.ndarray, m: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1's `d * q + m` as `(q - z) * s`: `z = -m / d`. A group with `d == 0` holds `m` in
    every weight; it becomes codes 0, scale `m`, zero -1."""
    flat = d == 0
    safe = np.where(flat, 1.0, d).astype(np.float32)
    zeros = np.where(flat, -1.0, -m / safe).astype(np.float32)
    scales = np.where(flat, m, d).astype(np.float32)
    if flat.any():
        q = q.copy()
        q.reshape(*d.shape, -1)[flat] = 0
    return q, scales, zeros


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def _dequantise(src: GgufFile, t: Any, heads: dict[str, int]) -> np.ndarray:
    try:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    except Exception as e:  # unknown quant type or a short buffer
        raise ModelLoadError(f"{src.path}: cannot dequantise tensor {t.name!r} ({e})") from e
    kind = t.name.split(".")[-2]
    if kind in heads:
        w = unpermute_rows(w, heads[kind])
    return np.ascontiguousarray(w)


def _check_complete(src: GgufFile, out: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    """Every layer must have all nine tensors; a file missing one is truncated or foreign."""
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{hf}.weight" for hf in _LAYER_TENSORS.values()}
    held = {n.replace(".qweight", ".weight") for n in out}
    missing = sorted(expected - held)
    if missing:
        raise ModelLoadError(f"{src.path}: missing tensors {missing[:5]} ({len(missing)} in all)")


def tokenizer_spec(src: GgufFile, config: dict[str, Any]) -> BpeSpec:
    """The GGUF's embedded byte-level BPE tokenizer, described for tokenizer_build."""
    kind = src.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{src.path}: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')"
        )
    pre = str(src.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_SPLITS:
        raise ModelLoadError(
            f"{src.path}: tokenizer.ggml.pre={pre!r} is not supported: "
            f"expected one of {sorted(PRE_SPLITS)}"
        )
    tokens = [str(t) for t in src.get("tokenizer.ggml.tokens")]
    types = [int(t) for t in src.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    return BpeSpec(
        vocab=tokens,
        merges=_merges(src),
        special=_added_tokens(types),
        split=PRE_SPLITS[pre],
        bos_token=_token_text(src, tokens, "bos"),
        eos_token=_token_text(src, tokens, "eos"),
        pad_token=_token_text(src, tokens, "padding"),
        unk_token=_token_text(src, tokens, "unknown"),
        add_bos_token=bool(src.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=src.get("tokenizer.chat_template", None),
        model_max_length=config["max_position_embeddings"],
    )


def _merges(src: GgufFile) -> list[tuple[str, str]]:
    """Merges are stored as 'left right'; byte-level token text never contains a space."""
    merges: list[tuple[str, str]] = []
    for text in src.get("tokenizer.ggml.merges"):
        left, sep, right = str(text).partition(" ")
        if not sep or not left or not right or " " in right:
            raise ModelLoadError(f"{src.path}: malformed BPE merge {text!r}")
        merges.append((left, right))
    return merges


def _added_tokens(types: list[int]) -> dict[int, bool]:
    """Control and unknown tokens are special; user-defined ones are matched but not special."""
    control = {gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN}
    return {
        i: t in control
        for i, t in enumerate(types)
        if t in control or t == gguf.TokenType.USER_DEFINED
    }


def _token_text(src: GgufFile, tokens: list[str], role: str) -> str | None:
    token_id = src.get(f"tokenizer.ggml.{role}_token_id", None)
    if token_id is None:
        return None
    if not 0 <= int(token_id) < len(tokens):
        raise ModelLoadError(f"{src.path}: {role} token id {token_id} is outside the vocabulary")
    return tokens[int(token_id)]
