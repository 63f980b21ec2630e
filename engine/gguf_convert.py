"""Converts a llama.cpp GGUF file into a Hugging Face-format directory, once, at fetch time.

Reading a GGUF is slow (the tokenizer arrays alone take seconds to parse), so the model is
converted once into safetensors + tokenizer files, which then load with no parsing or
unpacking of blocks: the default model in about a second, a Llama-2-7B Q4_K_M (a 5.5 GiB copy
of its 3.8 GiB) in some 30 s on two CPU cores, much of it the layers laying codes out for
their kernels (a progress bar on a terminal; an INFO line with the size and time). The file is
written one tensor at a time (`SafetensorsWriter`), so converting holds one tensor's arrays,
not the model's. Two forms:

- packed (`packed=True`, what `model_quantization: auto | gguf` serves): Q2_K, Q3_K, Q4_0,
  Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, IQ4_NL and IQ4_XS tensors stay quantized, unpacked
  to `QuantSpec`'s convention and stored per module as `<name>.qweight` (uint8 codes; two 4-bit codes a byte, even column
  in the low nibble), `<name>.scales` and `<name>.zeros` (float32, one per 32-column group);
  config.json says so in `quantization_config` (`quant_method: gguf`: each module's GGUF type
  and its codes' width). The 4-bit types become 4-bit codes, the 5-bit ones 8-bit codes (the
  code value itself), all exact; Q6_K, which scales every 16 weights, is requantised to 8-bit
  codes per 32 (`_unpack_q6_k`: exact where one scale holds both halves, else off by at most
  an eighth of its step), with a warning giving the error measured. Unquantised tensors (F32,
  F16, BF16: the norms, and any weight a file keeps at full precision) are stored as fp32. A
  fused projection (q/k/v, gate/up: one kernel serves each) needs one code width: one with an
  unquantised part (an F16 `attn_v` beside Q4_1 q/k) is stored as fp32, with a warning; one
  mixing 4-bit and 8-bit codes (Q4_K q/k beside a Q6_K `attn_v`, as in a Q4_K_M file) at 8
  bits, its 4-bit codes one a byte. IQ4_NL and IQ4_XS, whose 16 values are not evenly spaced,
  become 8-bit codes (exact, twice their size). Q3_K and Q2_K (scaled every 16 weights, like
  Q6_K) become 8-bit codes per 32: Q3_K exactly, Q2_K requantised where a pair of 16 has two
  minimums (`_unpack_q2_k`), both with a warning of their size. A tensor of any other
  quantised type (IQ1-3, TQ*, ...) is refused, naming the file, the tensor and its type:
  dequantised it would silently serve the model at many times the file's size (an IQ2 weight
  as 32 bits), which
  `model_quantization: none` does on purpose.
- fp32 (`packed=False`, `model_quantization: none`): every tensor dequantised, the reference
  the packed model is compared with.

The `llama` architecture (`ARCHITECTURES`): SmolLM2 (the default model), Llama 2 and Mistral
(SentencePiece tokenizer, `tokenizer.ggml.model` `llama`), Llama 3 and others with a byte-level
BPE (`gpt2`) tokenizer whose `tokenizer.ggml.pre` split is known (`PRE_SPLITS`); and `qwen2`
(Qwen2, Qwen2.5: q/k/v biases, served as transformers' `Qwen2ForCausalLM`). llama.cpp's
converter reorders the q/k rows of `llama` files only (`unpermute_rows` puts them back); a
`qwen2` file's are in Hugging Face's order already. RoPE scaling is read as llama.cpp reads it
(`_rope_scaling`).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
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
    LLAMA3_SPLIT,
    QWEN2_SPLIT,
    TEKKEN_SPLIT,
    BpeSpec,
    SentencePieceSpec,
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
    "llama-bpe": LLAMA3_SPLIT,  # Llama 3 (and the distills built on it)
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "falcon3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
    "tekken": TEKKEN_SPLIT,  # Mistral Nemo, Mistral Small 3
}
# As llama.cpp reads them: these vocabularies take a pre-token that is a whole token as that
# token (whatever the merges make of it), and add BOS where the file does not say
LLAMA3_PRES = {"llama-bpe", "llama3", "llama-v3", "falcon3"}

# general.architecture -> config.json's `architectures` entry, for the architectures served
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# the layer tensors that have a bias in each architecture (llama.cpp requires Qwen2's)
_LAYER_BIASES = {"llama": (), "qwen2": ("attn_q", "attn_k", "attn_v")}
# the architectures whose q/k rows llama.cpp's converter reorders for its rope of adjacent
# pairs (`unpermute_rows`); qwen2's rope rotates halves there, as Hugging Face's does, so
# its rows (and biases) are stored in Hugging Face's order
_PERMUTED = {"llama"}

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
# the quantised types a packed conversion serves packed -> the bits of the codes they become:
# 4-bit types as 4-bit codes, 5-bit ones as 8-bit codes (the code value itself), the K-quants
# that scale every 16 weights as 8-bit codes per 32: Q3_K exactly (`_unpack_q3_k`), Q6_K and
# Q2_K requantised where one scale cannot hold a pair (`_unpack_q6_k`, `_unpack_q2_k`)
BITS = {
    gguf.GGMLQuantizationType.Q2_K: 8,
    gguf.GGMLQuantizationType.Q3_K: 8,
    gguf.GGMLQuantizationType.Q4_0: 4,
    gguf.GGMLQuantizationType.Q4_1: 4,
    gguf.GGMLQuantizationType.Q4_K: 4,
    gguf.GGMLQuantizationType.Q5_0: 8,
    gguf.GGMLQuantizationType.Q5_1: 8,
    gguf.GGMLQuantizationType.Q5_K: 8,
    gguf.GGMLQuantizationType.Q6_K: 8,
    gguf.GGMLQuantizationType.Q8_0: 8,
    gguf.GGMLQuantizationType.IQ4_NL: 8,
    gguf.GGMLQuantizationType.IQ4_XS: 8,
}
# IQ4_NL's and IQ4_XS's 16 weight values (times a scale): not evenly spaced, so no 4-bit code
# with a scale and minimum holds them, and 8-bit codes `value + 128` do, exactly
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
PACKED_TYPES = tuple(BITS)
# the types served requantised (not exactly in every pair of 16): the worst error is warned
REQUANTISED = (gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q2_K)
GROUP = 32  # weights per scale in every packed type (a K-quant's super-block holds 8 or 16)
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
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
    config = hf_config(src)
    spec = tokenizer_spec(src, config)
    out_dir = Path(out_dir)
    convert_tensors(src, config, progress, packed, out_dir / "model.safetensors")
    if packed:
        config["quantization_config"] = packed_config(src)
    write_tokenizer_files(spec, out_dir)
    text = json.dumps(config, indent=2, sort_keys=True)
    (out_dir / "config.json").write_text(text + "\n", encoding="utf-8")


def _check_architecture(src: GgufFile) -> None:
    if src.arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{src.path}: GGUF architecture {src.arch!r} is not supported "
            f"(only {', '.join(map(repr, ARCHITECTURES))})"
        )


def hf_config(src: GgufFile) -> dict[str, Any]:
    """config.json for LlamaForCausalLM or Qwen2ForCausalLM, from the GGUF hyper-parameters."""
    _check_architecture(src)
    hidden = int(src.arch_get("embedding_length"))
    heads = int(src.arch_get("attention.head_count"))
    layers = int(src.arch_get("block_count"))
    names = src.tensor_names()
    config = {
        "architectures": [ARCHITECTURES[src.arch]],
        "model_type": src.arch,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(src.arch_get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(src.arch_get("attention.head_count_kv", heads)),
        "head_dim": int(src.arch_get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(src.arch_get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(src.arch_get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(src, names),
        "max_position_embeddings": int(src.arch_get("context_length")),
        "vocab_size": _vocab_rows(src),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _optional_int(src.get("tokenizer.ggml.bos_token_id", None)),
        "eos_token_id": _eos_ids(src),
        "pad_token_id": _optional_int(src.get("tokenizer.ggml.padding_token_id", None)),
        "torch_dtype": "float32",
    }
    if src.arch == "qwen2":  # every layer attends to the whole context, as llama.cpp runs it
        return config | {"use_sliding_window": False, "max_window_layers": layers}
    return config | {"attention_bias": False, "mlp_bias": False}


def _rope_scaling(src: GgufFile, names: set[str]) -> dict[str, Any] | None:
    """The file's RoPE scaling as llama.cpp reads it: the type defaults to `linear` and the
    factor comes from `rope.scaling.factor`, or else the old converters' `rope.scale_linear`
    (a factor of 0 or 1 scales nothing, nor does type `none`). Linear scaling is served, and a
    `rope_freqs` tensor (Llama 3.1 and later) as the llama3 scaling it was computed from
    (`_llama3_of`); any other type (`yarn`, ...) is refused rather than run with the wrong
    positions."""
    kind = str(src.arch_get("rope.scaling.type", "linear"))
    key = f"{src.arch}.rope.scaling.factor"
    if src.get(key, None) is None:
        key = f"{src.arch}.rope.scale_linear"
    factor = src.get(key, 0.0)
    if kind not in ("none", "linear"):
        raise ModelLoadError(
            f"{src.path}: RoPE scaling ({kind}) in GGUF files is not supported (none, linear)"
        )
    if ROPE_FREQS in names:
        if src.get(key, None) is not None and float(factor) not in (0.0, 1.0):
            raise ModelLoadError(
                f"{src.path}: RoPE scaling: both a {ROPE_FREQS} tensor and {key}={factor} "
                "(llama.cpp would apply both; kvguard serves one or the other)"
            )
        return _llama3_of(src)
    try:
        factor = float(factor)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{src.path}: GGUF metadata {key} is malformed ({e})") from e
    if not factor >= 0:  # NaN too
        raise ModelLoadError(f"{src.path}: GGUF metadata {key} is {factor}, expected >= 0")
    if kind == "none" or factor in (0.0, 1.0):
        return None
    return {"rope_type": "linear", "factor": factor}


# Llama 3.1 and later: each rotary frequency's divisor, llama.cpp's form of llama3 scaling
ROPE_FREQS = "rope_freqs.weight"
# Meta's llama3 scaling parameters (Llama 3.1, 3.2, 3.3), less the factor
_META_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original": 8192.0}


def _llama3_of(src: GgufFile) -> dict[str, Any] | None:
    """The llama3 RoPE scaling a `rope_freqs` tensor was computed from. llama.cpp's converter
    writes, per rotary frequency, the divisor transformers' llama3 scaling applies: 1 for
    short wavelengths, `factor` for long ones, a smooth band between, whose inverse is linear
    in the frequency. kvguard computes frequencies from the parameters (as for a directory's
    config.json), so the tensor is read back as them: Meta's (low 1, high 4, original 8192,
    the factor the largest divisor) where they give the tensor, else a line fitted through
    the band (the original length held at 8192: only the band's line matters; 6 digits, as
    many as the float32 divisors hold). Parameters
    that do not give every divisor within 1e-4 are refused, naming the worst frequency."""
    t = next(t for t in src.reader.tensors if t.name == ROPE_FREQS)
    try:
        held = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
    except Exception as e:  # a short buffer or an odd type
        raise ModelLoadError(f"{src.path}: cannot read tensor {ROPE_FREQS!r} ({e})") from e
    heads = int(src.arch_get("attention.head_count"))
    dim = int(src.arch_get("rope.dimension_count", 0)) or int(
        src.arch_get("attention.key_length", int(src.arch_get("embedding_length")) // heads)
    )
    base = float(src.arch_get("rope.freq_base", 10000.0))
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if held.shape != inv.shape or not np.isfinite(held).all() or (held <= 0).any():
        raise ModelLoadError(
            f"{src.path}: tensor {ROPE_FREQS!r} holds {held.size} values, expected "
            f"{inv.size} positive ones (one per rotary frequency)"
        )
    if np.allclose(held, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(held.max())
    tries = [(_META_LLAMA3["low_freq_factor"], _META_LLAMA3["high_freq_factor"])]
    band = (held > 1 + 1e-6) & (held < factor * (1 - 1e-6))
    if band.sum() >= 2 and factor > 1:  # smooth = (1/r - 1/f) / (1 - 1/f) = a * inv + b
        smooth = (1 / held[band] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(inv[band], smooth, 1)
        width = _META_LLAMA3["original"] / (2 * np.pi * a) if a > 0 else -1.0
        if width > 0 and -b * width > 0:  # the tensor is float32: 6 digits are all it holds
            tries.append((float(f"{-b * width:.6g}"), float(f"{-b * width + width:.6g}")))
    worst = (np.inf, 0)
    for low, high in tries:
        got = _llama3_divisors(inv, factor, low, high, _META_LLAMA3["original"])
        miss = np.abs(got - held) / held
        if miss.max() <= 1e-4:
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": float(low),
                "high_freq_factor": float(high),
                "original_max_position_embeddings": int(_META_LLAMA3["original"]),
            }
        worst = min(worst, (float(miss.max()), int(miss.argmax())))
    raise ModelLoadError(
        f"{src.path}: tensor {ROPE_FREQS!r} is not llama3 RoPE scaling (the nearest llama3 "
        f"parameters miss frequency {worst[1]}'s divisor by {worst[0]:.2g}); kvguard serves "
        "llama3 and linear scaling only"
    )


def _llama3_divisors(
    inv: np.ndarray, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """Each frequency's divisor under llama3 scaling (as `model._llama3_scale` applies it)."""
    wavelen = 2 * np.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


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
    if (
        m is None
        or m.group(2) not in _LAYER_TENSORS
        or (m.group(3) == "bias" and m.group(2) not in _LAYER_BIASES.get(src.arch, ()))
    ):
        raise ModelLoadError(f"{src.path}: tensor {name!r} is not a known {src.arch} tensor")
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"


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
    src: GgufFile, config: dict[str, Any], progress: bool, packed: bool, file: Path
) -> None:
    """Every tensor under its Hugging Face name, written to the safetensors `file` one at a
    time (`SafetensorsWriter`: the conversion holds one tensor's arrays, not the model's):
    fp32, or (packed) those of `BITS`' types as `.qweight/.scales/.zeros` (`kept_packed`) and
    other quantised types refused (`_refuse_unpackable`). The tensors' types and names are
    checked before anything is converted or written (no directory is made for a refused file)."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    if src.arch not in _PERMUTED:
        heads = {}  # no rows to put back in order (`_PERMUTED`)
    keep: dict[str, int] = {}
    if packed:
        _refuse_unpackable(src)
        keep = kept_packed(src, warn=True)
    # rope_freqs is config.json's rope_scaling (`_llama3_of`), not a weight
    names = {
        t.name: hf_tensor_name(src, t.name) for t in src.reader.tensors if t.name != ROPE_FREQS
    }
    written: list[str] = []
    for gguf_name, name in names.items():
        base = name.removesuffix(".weight")
        parts = ("qweight", "scales", "zeros")
        written += [f"{base}.{p}" for p in parts] if gguf_name in keep else [name]
    _check_complete(src, written, config)
    errors: dict[str, tuple[str, float]] = {}
    bar = tqdm(
        src.reader.tensors, desc=f"converting {src.path.name}", unit="tensor", disable=not progress
    )
    made = not file.parent.exists()
    file.parent.mkdir(parents=True, exist_ok=True)  # once the file is known to convert
    try:
        with SafetensorsWriter(file, written) as out:
            for t in bar:
                if t.name not in names:
                    continue
                name = names[t.name]
                if t.name in keep:
                    base = name.removesuffix(".weight")
                    for part, array in _packed(src, t, heads, base, keep[t.name], errors).items():
                        out.add(part, array)
                else:
                    out.add(name, _dequantise(src, t, heads))
    except BaseException:  # a tensor that cannot be read, a full disk, Ctrl-C: nothing left
        if made:
            shutil.rmtree(file.parent, ignore_errors=True)
        raise
    if errors:
        _warn_requantised(src, errors)


class SafetensorsWriter:
    """A safetensors file written one tensor at a time, in the order given to `add`.

    The tensors go after room left for the header, which is written on closing, once every
    shape is known, padded with spaces (as the format allows); the room is what `names` take
    at their longest (four dimensions, offsets of 20 digits). Until then the file starts with
    zeros, which no reader takes for a safetensors file. Every tensor written is a whole
    number of 4-byte words (blocks of codes, fp32), so each starts aligned for its type."""

    DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}
    _WIDEST = {"dtype": "F32", "shape": [10**19] * 4, "data_offsets": [10**19] * 2}
    _CHUNK = 1 << 26  # bytes a write: one write() of over 2 GiB comes back short

    def __init__(self, file: Path, names: list[str]) -> None:
        room = len(self._header({n: self._WIDEST for n in names}))
        self.room = room + -room % 8  # the data 8-byte aligned (the length field is 8 bytes)
        self.file, self.names = Path(file), set(names)
        self.entries: dict[str, dict[str, Any]] = {}
        self.end = 0
        self._f = open(self.file, "wb")  # noqa: SIM115 - closed by close()
        self._f.seek(8 + self.room)

    @staticmethod
    def _header(entries: dict[str, Any]) -> bytes:
        table = {"__metadata__": {"format": "pt"}, **entries}
        return json.dumps(table, separators=(",", ":")).encode()

    def add(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if array.dtype not in self.DTYPES or array.ndim > 4 or name not in self.names:
            raise ValueError(f"cannot write {name!r} ({array.dtype}, {array.shape})")
        self.names.discard(name)
        data = memoryview(array.reshape(-1).view(np.uint8))
        for at in range(0, len(data), self._CHUNK):
            self._f.write(data[at : at + self._CHUNK])
        shape = [int(n) for n in array.shape]
        self.entries[name] = {
            "dtype": self.DTYPES[array.dtype],
            "shape": shape,
            "data_offsets": [self.end, self.end + array.nbytes],
        }
        self.end += array.nbytes

    def close(self) -> None:
        """Write the header (the file is then complete) and close."""
        header = self._header(self.entries)
        if self.names or len(header) > self.room:
            raise ValueError(
                f"{self.file}: {sorted(self.names)[:5]} not written, or a header "
                f"of {len(header)} bytes for room of {self.room}"
            )
        self._f.seek(0)
        self._f.write(len(header.ljust(self.room)).to_bytes(8, "little"))
        self._f.write(header.ljust(self.room))
        self._f.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        else:  # a half-written file is no use to anyone
            self._f.close()
            self.file.unlink(missing_ok=True)


def _warn_requantised(src: GgufFile, errors: dict[str, tuple[str, float]]) -> None:
    """One warning per type served requantised (Q6_K `_unpack_q6_k`, Q2_K `_unpack_q2_k`):
    how many tensors, and the worst error measured. `errors`: tensor -> (type, error)."""
    for qtype in sorted({kind for kind, _ in errors.values()}):
        mine = {name: err for name, (kind, err) in errors.items() if kind == qtype}
        worst = max(mine, key=mine.__getitem__)
        log.warning(
            "%s: %d %s tensor(s) are served requantised to 8-bit codes per 32 weights (%s "
            "scales every 16, which one scale per 32 holds exactly only sometimes): the worst "
            "error is %.3f of a %s step (of the coarser of a pair of 16; in %s; %s's own "
            "rounding is up to 0.5 of its step); "
            "`model_quantization: none` serves them exactly, dequantised to fp32",
            src.path,
            len(mine),
            qtype,
            qtype,
            mine[worst],
            qtype,
            worst,
            qtype,
        )


# A file's vocabulary-sized tensors, which llama.cpp's quantiser may keep in another type than
# the layers (`--output-tensor-type`, `--token-embedding-type`): one of a type not packed costs
# one matrix dequantised, not the model, and is served in full precision with a warning
VOCAB_TENSORS = ("token_embd.weight", "output.weight")


def _refuse_unpackable(src: GgufFile) -> None:
    """A packed conversion serves `BITS`' types packed and unquantised ones as they are. A
    layer's tensor quantised otherwise (blocks of more than one value: IQ1-3, TQ*,
    ...) is refused before anything is converted, naming the file, the tensor and its type:
    dequantised, the model would take several times the file's size. The embedding and the
    lm_head (`VOCAB_TENSORS`) are dequantised to fp32 instead, with a warning."""
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


def _mixed_groups(src: GgufFile) -> tuple[list[list[Any]], list[list[Any]]]:
    """The fused groups (`FUSED_GROUPS`, per layer) whose parts' codes differ in width, as
    (those with an unquantised part, those of 4-bit and 8-bit codes). `llama-quantize` writes
    both: an F16 `attn_v` beside Q4_1 q/k (`--tensor-type`), and Q4_K q/k beside a Q6_K
    `attn_v` (every other layer of a Q4_K_M file). Q4_0 beside Q4_K fuses (both 4-bit)."""
    by_name = {t.name: t for t in src.reader.tensors}
    layers = sorted({int(m.group(1)) for n in by_name if (m := _LAYER_NAME.fullmatch(n))})
    floats, widths = [], []
    for i in layers:
        for group in FUSED_GROUPS:
            parts = [by_name[n] for k in group if (n := f"blk.{i}.{k}.weight") in by_name]
            bits = {BITS.get(t.tensor_type) for t in parts}
            if len(bits) > 1:
                (floats if None in bits else widths).append(parts)
    return floats, widths


def kept_packed(src: GgufFile, warn: bool = False) -> dict[str, int]:
    """The GGUF tensors a packed conversion keeps packed (`BITS`' types), each with the width
    its codes are stored at. A fused group with an unquantised part is dequantised whole (a
    float weight has no exact codes); one mixing 4-bit and 8-bit codes is served at 8 bits,
    its 4-bit parts' codes one a byte (`warn`: say which groups, once)."""
    floats, widths = _mixed_groups(src)
    if warn and floats:
        _warn_unfusable(src, floats)
    if warn and widths:
        _say_widened(src, widths)
    keep = {t.name: BITS[t.tensor_type] for t in src.reader.tensors if t.tensor_type in BITS}
    if warn:
        uneven = "exactly (their 16 values are not evenly spaced, as 4-bit codes with a scale are)"
        _say_wider(src, ("IQ4_NL", "IQ4_XS"), uneven)
        by_16 = "per 32 (they scale every 16 weights; Q2_K requantised, Q3_K exactly)"
        _say_wider(src, ("Q3_K", "Q2_K"), by_16)
    for t in (t for parts in floats for t in parts):
        keep.pop(t.name, None)
    for t in (t for parts in widths for t in parts):
        keep[t.name] = 8
    return keep


def _say_wider(src: GgufFile, types: tuple[str, ...], how: str) -> None:
    """One warning for the file's tensors of `types` (served as 8-bit codes, `how`): how many,
    and their size served against their size in the file."""
    wide = [t for t in src.reader.tensors if t.tensor_type.name in types]
    if wide:
        log.warning(
            "%s: %d %s tensor(s) are served as 8-bit codes, %s: %.0f MiB against %.0f MiB in "
            "the file",
            src.path,
            len(wide),
            "/".join(sorted({t.tensor_type.name for t in wide})),
            how,
            sum(int(np.prod(t.shape)) * 9 / 8 for t in wide) / 2**20,
            sum(int(t.n_bytes) for t in wide) / 2**20,
        )


def _groups_named(groups: list[list[Any]]) -> str:
    """`layer 0: attn_q Q4_1, attn_k Q4_1, attn_v F16; ...`, the first four groups."""
    said = [
        f"layer {parts[0].name.split('.')[1]}: "
        + ", ".join(f"{t.name.split('.')[2]} {t.tensor_type.name}" for t in parts)
        for parts in groups
    ]
    more = f"; {len(said) - 4} more" if len(said) > 4 else ""
    return "; ".join(said[:4]) + more


def _warn_unfusable(src: GgufFile, groups: list[list[Any]]) -> None:
    """One warning naming every layer whose fused group is served dequantised, and the cost."""
    mib = sum(int(np.prod(t.shape)) for parts in groups for t in parts) * 4 / 2**20
    log.warning(
        "%s: %d fused projection group(s) mix tensor types (%s); kvguard serves a fused "
        "group with one kernel, and an unquantised part has no codes, so these are served "
        "dequantised to fp32 (%.0f MiB)",
        src.path,
        len(groups),
        _groups_named(groups),
        mib,
    )


def _say_widened(src: GgufFile, groups: list[list[Any]]) -> None:
    """One line naming the groups whose 4-bit parts are stored at 8 bits, and the cost."""
    four = [t for parts in groups for t in parts if BITS[t.tensor_type] == 4]
    log.info(
        "%s: %d fused projection group(s) mix 4-bit and 8-bit codes (%s); kvguard serves a "
        "fused group with one kernel, so their 4-bit parts are served as 8-bit codes, the "
        "same values (%.1f MiB more)",
        src.path,
        len(groups),
        _groups_named(groups),
        sum(int(np.prod(t.shape)) for t in four) / 2 / 2**20,
    )


def packed_config(src: GgufFile) -> dict[str, Any]:
    """The `quantization_config` of a packed conversion: which modules are packed, as what."""
    keep = kept_packed(src)
    modules, bits = {}, {}
    for t in src.reader.tensors:
        if t.name in keep:
            module = hf_tensor_name(src, t.name).removesuffix(".weight")
            modules[module], bits[module] = t.tensor_type.name, keep[t.name]
    return {
        "quant_method": "gguf",
        "format": "kvguard-packed",
        "version": PACKED_FORMAT_VERSION,
        "source": src.path.name,
        "modules": modules,  # the GGUF type each module came in
        "bits": bits,  # the width its codes are stored at
    }


def _packed(
    src: GgufFile,
    t: Any,
    heads: dict[str, int],
    base: str,
    bits: int | None = None,
    errors: dict[str, tuple[str, float]] | None = None,
) -> dict[str, np.ndarray]:
    """One quantized tensor as codes + scales + zeros, rows un-permuted like the fp32 path;
    `bits`: the codes' stored width (`kept_packed`: 8 for a 4-bit type fused with an 8-bit
    one, the same code values a byte each); `errors`: a requantised (`REQUANTISED`) tensor's
    type and worst error are put there, the error in its type's steps."""
    try:
        q, scales, zeros, err = _unpack(np.asarray(t.data), t.tensor_type)
    except ValueError as e:
        raise ModelLoadError(f"{src.path}: cannot unpack tensor {t.name!r} ({e})") from e
    if errors is not None and t.tensor_type in REQUANTISED:
        errors[t.name] = (t.tensor_type.name, err)
    kind = t.name.split(".")[-2]
    if kind in heads:  # the rope permutation moves whole output rows: codes and their scales
        q, scales, zeros = (unpermute_rows(a, heads[kind]) for a in (q, scales, zeros))
    if (bits or BITS[t.tensor_type]) == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    elif BITS[t.tensor_type] == 4:  # fused with 8-bit codes
        q, zeros = _centred(q, zeros, 4)
    return {
        f"{base}.qweight": np.ascontiguousarray(q),
        f"{base}.scales": np.ascontiguousarray(scales),
        f"{base}.zeros": np.ascontiguousarray(zeros),
    }


def unpack_blocks(
    data: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A packed type's raw blocks (`[rows, bytes]`, see `BITS`) as (uint8 codes `[rows, cols]`,
    float32 scales and zeros `[rows, cols // 32]`) with `w = (code - zero) * scale`.

    Blocks of 32 weights: Q4_0 is fp16 `d` + 16 bytes (`w = d * (nibble - 8)`), Q4_1 fp16 `d`,
    fp16 `m` + 16 bytes (`w = d * nibble + m`), Q8_0 fp16 `d` + 32 int8 (`w = d * q`). In the
    4-bit types byte j holds weight j in its low nibble and weight j + 16 in its high one; Q5_0
    and Q5_1 put four bytes of fifth bits (bit j for weight j) before those 16 bytes, and their
    codes are 5 bits (`w = d * (q - 16)`, `w = d * q + m`). The K-quants are `_unpack_k` and
    `_unpack_q6_k` (the one not exact: requantised)."""
    return _unpack(data, qtype)[:3]


def _unpack(
    data: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """`unpack_blocks`, and the worst error its codes make, in Q6_K steps (0: exact)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    if qtype not in BITS or data.ndim != 2 or data.shape[1] % size:
        raise ValueError(f"{qtype.name} data of shape {data.shape} is not whole {size}-byte blocks")
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, size)
    if qtype in _PAIRED:
        return _by_rows(_PAIRED[qtype], blocks)
    if qtype.name.startswith("IQ4_"):
        q, scales, zeros = _unpack_iq4(blocks, qtype == gguf.GGMLQuantizationType.IQ4_XS)
        return q.reshape(rows, -1), scales.reshape(rows, -1), zeros.reshape(rows, -1), 0.0
    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        q, scales, zeros = _unpack_k(blocks, qtype == gguf.GGMLQuantizationType.Q5_K)
    else:
        q, scales, zeros = _unpack_32(blocks, qtype)
    if qtype.name.startswith("Q5_"):
        q, zeros = _centred(q, zeros, 5)
    return q.reshape(rows, -1), scales.reshape(rows, -1), zeros.reshape(rows, -1), 0.0


def _centred(q: np.ndarray, zeros: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """`bits`-bit codes as 8-bit ones about 128 (codes and zeros moved up alike: the same
    weights). The 8-bit kernels take a weight as `scale * (code - 128) + (128 - zero) * scale`
    with that second term in fp16: codes 0..31 at zero 16 would make it `112 * scale`, whose
    fp16 rounding is 0.05 of a step in every weight; about 128 it is near 0 (Q5_0's exactly)."""
    up = 128 - 2 ** (bits - 1)
    return q + np.uint8(up), zeros + np.float32(up)


def _unpack_iq4(blocks: np.ndarray, xs: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ4_NL and IQ4_XS as 8-bit codes `IQ4_VALUES[nibble] + 128`, zero 128, exact.

    IQ4_NL is blocks of 32: fp16 `d` and 16 bytes of nibbles laid out as Q4_0's, `w = d *
    IQ4_VALUES[nibble]`. IQ4_XS is super-blocks of 256: fp16 `d`, a little-endian uint16 whose
    bits 2j, 2j + 1 are sub-block j's scale's top two, 4 bytes of the scales' low four (sub-block
    j in byte j // 2, the low nibble for even j), then 16 bytes of nibbles per sub-block of 32;
    `w = d * (scale - 32) * IQ4_VALUES[nibble]`."""
    n = blocks.shape[:2]
    d = _f16(blocks[..., 0:2])[..., None]
    if xs:
        j = np.arange(8)
        top = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # [..., 1]
        low = (blocks[..., 4 + j // 2] >> (4 * (j % 2)).astype(np.uint8)) & 15
        level = low.astype(np.int16) | (((top >> (2 * j).astype(np.uint16)) & 3) << 4)
        scales = d * (level.astype(np.float32) - 32)
        qs = blocks[..., 8:].reshape(*n, 8, 16)
    else:
        scales, qs = d, blocks[..., 2:].reshape(*n, 1, 16)
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    q = (IQ4_VALUES[codes] + 128).astype(np.uint8)
    return q, scales.astype(np.float32), np.full_like(scales, 128.0, dtype=np.float32)


def _unpack_32(
    blocks: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of 32 weights (`unpack_blocks`): codes `[rows, blocks, 32]`, one scale a block."""
    kind = gguf.GGMLQuantizationType
    d = _f16(blocks[..., 0:2])
    if qtype == kind.Q8_0:
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, np.full_like(d, 128.0)
    at = 4 if qtype in (kind.Q4_1, kind.Q5_1) else 2  # an fp16 minimum follows d
    fifth = qtype in (kind.Q5_0, kind.Q5_1)
    qs = blocks[..., at + 4 * fifth :]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if fifth:  # bit j of the little-endian 32-bit word is weight j's
        q |= np.unpackbits(blocks[..., at : at + 4], axis=-1, bitorder="little") << 4
    if qtype in (kind.Q4_0, kind.Q5_0):
        return q, d, np.full_like(d, 8.0 if qtype == kind.Q4_0 else 16.0)
    return _min_to_zero(q, d, _f16(blocks[..., 2:4]))


def _unpack_k(blocks: np.ndarray, fifth: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks of 256 weights as 8 groups of 32, exact in fp32.

    A super-block is fp16 `d`, fp16 `dmin`, 12 bytes of 6-bit scales `sc` and minimums `m` for
    its 8 sub-blocks of 32 (bytes 0-3: the low 6 bits of sc 0-3, their top bits the high bits
    of sc 4-7; bytes 4-7 the same for m; bytes 8-11: the low 4 bits of sc 4-7 in the low
    nibble, of m 4-7 in the high one), Q5_K's 32 bytes of fifth bits (bit j of byte i: weight
    i of sub-block j), then 128 bytes of nibbles: bytes 32k..32k+31 hold sub-block 2k in their
    low nibble and 2k + 1 in the high one. `w = d * sc * q - dmin * m`, as `_min_to_zero`."""
    n = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    low, high, nib = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([low & 63, (nib & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (nib >> 4) | ((high >> 6) << 4)], axis=-1)
    qs = blocks[..., 48 if fifth else 16 :].reshape(*n, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*n, 8, 32)
    if fifth:
        bits = blocks[..., 16:48].reshape(*n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        q |= (bits & 1) << 4
    scale = d[..., None] * sc.astype(np.float32)
    return _min_to_zero(q, scale, -(dmin[..., None] * mins.astype(np.float32)))


def _by_rows(
    fn: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray, float]],
    blocks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """A type of 256-weight super-blocks scaled every 16 weights (`_PAIRED`) as 8-bit codes per
    32, `fn` run on a slice of rows at a time to bound the temporary arrays: codes, scales and
    zeros `[rows, cols // 32]`, and the worst error `fn` measured (in its type's steps)."""
    rows, per_row = blocks.shape[:2]
    q = np.empty((rows, per_row, 8, 32), np.uint8)
    scales = np.empty((rows, per_row, 8), np.float32)
    zeros = np.empty((rows, per_row, 8), np.float32)
    worst = 0.0
    step = max(1, 2**14 // per_row)
    for r in range(0, rows, step):
        part = slice(r, r + step)
        q[part], scales[part], zeros[part], err = fn(blocks[part])
        worst = max(worst, err)
    return q.reshape(rows, -1), scales.reshape(rows, -1), zeros.reshape(rows, -1), worst


def _unpack_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Q6_K super-blocks (a slice of rows: `[rows, blocks, 210]`) as 8-bit codes per 32, and
    the worst error they make.

    A super-block is 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales `s` (one
    per 16 weights) and fp16 `d`: `w = d * s * (q - 32)`, q in 0..63. Weight 128h + 32k + i
    (h < 2, k < 4) has its low bits in byte 64h + 32(k % 2) + i (nibble k // 2) and its high
    bits in byte 128 + 32h + i (bits 2k, 2k + 1). A pair of sub-blocks is exact where a common
    step holds it (`_pair_codes`); other pairs are requantised to 256 levels about zero, a level
    the largest weight over 127 (or the most negative one over 128), off by at most half a
    level: 32/254 (0.126, an eighth) of the coarser sub-block's step `d * max(|s_a|, |s_b|)`
    (a weight is at most 32 such steps from zero; Q6_K's own rounding is off by up to 0.5)."""
    n = blocks.shape[:2]
    ql = blocks[..., :128].reshape(*n, 2, 1, 64)
    low = np.concatenate([ql & 15, ql >> 4], axis=-2).reshape(*n, 8, 32)
    qh = blocks[..., 128:192].reshape(*n, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    k = (low | ((qh & 3).reshape(*n, 8, 32) << 4)).astype(np.int16) - 32
    s = blocks[..., 192:208].view(np.int8).astype(np.int16).reshape(*n, 8, 2)
    return _pair_codes(k, s, _f16(blocks[..., 208:210]))


def _unpack_q3_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Q3_K super-blocks (`[rows, blocks, 110]`) as 8-bit codes per 32, exactly.

    A super-block is 32 bytes of high bits (bit j of byte i: weight 32j + i), 64 bytes of low
    2-bit pairs (weight 128h + 32j + i in byte 32h + i, bits 2j, 2j + 1), 12 bytes of 6-bit
    scales (sub-block i < 8: the low nibble of byte i, 8 + i its high one; their top two bits
    in bytes 8-11: sub-block 4j + i in byte 8 + i, bits 2j, 2j + 1) and fp16 `d`:
    `w = d * (sc - 32) * (q - 4)` with q the 3-bit code (a clear high bit takes 4 off). Both
    sub-blocks' `(sc - 32) * (q - 4)` lie in -124..128, so a pair's codes on the step `d` (or a
    coarser common one) always fit a byte: no error."""
    n = blocks.shape[:2]
    hbit = blocks[..., :32].reshape(*n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    qs = blocks[..., 32:96].reshape(*n, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    k = ((qs & 3).reshape(*n, 8, 32) | ((hbit & 1) << 2)).astype(np.int16) - 4
    low = blocks[..., 96:104].reshape(*n, 1, 8) >> np.array([0, 4], dtype=np.uint8)[:, None]
    high = blocks[..., 104:108].reshape(*n, 1, 4) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    sc = (low.reshape(*n, 16) & 15) | ((high.reshape(*n, 16) & 3) << 4)
    s = (sc.astype(np.int16) - 32).reshape(*n, 8, 2)
    return _pair_codes(k, s, _f16(blocks[..., 108:110]))


def _pair_codes(
    k: np.ndarray, s: np.ndarray, d: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Weights `w = d * s * k` (codes `k` `[rows, blocks, 8, 32]` about zero, an integer scale
    `s` `[rows, blocks, 8, 2]` per 16 of them, fp16 `d` `[rows, blocks]` per 256) as 8-bit codes
    per 32: codes, scales and zeros `[rows, blocks, 8, ...]` and the worst error, in steps of
    each pair's coarser sub-block (`d * max(|s|)`). One scale per 32 holds a pair exactly where
    a common step does: `d * gcd(s_a, s_b)`, when the pair's codes on it span at most 256
    values, moved up by the shift nearest 128 that keeps them in a byte (the 8-bit kernels keep
    `(128 - zero) * scale` in fp16, exact at 0 and at small multiples of the step). Other pairs
    are requantised to 256 levels about zero (`_unpack_q6_k`)."""
    d = d[..., None, None]
    s_w = np.repeat(s, 16, axis=-1)  # each weight's sub-block scale
    w = (d * s_w.astype(np.float32)) * k.astype(np.float32)  # the exact weights, as gguf
    g = np.gcd(s[..., 0], s[..., 1])
    ints = k * (s_w // np.maximum(g, 1)[..., None])
    lo_i, hi_i = ints.min(axis=-1), ints.max(axis=-1)
    exact = hi_i - lo_i <= 255
    shift = np.clip(128, -lo_i, 255 - hi_i)
    lo, hi = w.min(axis=-1), w.max(axis=-1)
    level = np.maximum(-lo / np.float32(128), hi / np.float32(127))
    safe = np.where(level > 0, level, np.float32(1))
    codes = np.clip(np.rint(w / safe[..., None]) + 128, 0, 255)
    q = np.where(exact[..., None], ints + shift[..., None], codes).astype(np.uint8)
    scales = np.where(exact, d[..., 0] * g.astype(np.float32), level).astype(np.float32)
    zeros = np.where(exact, shift.astype(np.float32), np.float32(128)).astype(np.float32)
    err = np.abs((q.astype(np.float32) - zeros[..., None]) * scales[..., None] - w).max(axis=-1)
    coarse = np.abs(d[..., 0]) * np.abs(s).max(axis=-1).astype(np.float32)
    held = coarse > 0  # a pair with no step holds zeros, exactly
    return q, scales, zeros, float((err[held] / coarse[held]).max(initial=0.0))


def _unpack_q2_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Q2_K super-blocks (`[rows, blocks, 84]`) as 8-bit codes per 32, and the worst error.

    A super-block is 16 bytes of 4-bit scale `sc` (low nibble) and minimum `m` (high nibble),
    one per 16 weights, 64 bytes of 2-bit codes (weight 128h + 32j + i in byte 32h + i, bits
    2j, 2j + 1), fp16 `d` and `dmin`: `w = d * sc * q - dmin * m`. A pair of sub-blocks with one
    minimum is held exactly (up to fp32 rounding, as `_min_to_zero`) on the step
    `d * gcd(sc_a, sc_b)`: its codes span at most 46 values. A pair whose minimums differ is
    requantised to 256 levels from its least weight to its greatest, off by at most half a
    level: 1/510 of the pair's range, which is a few of its coarser step `d * max(sc)` (and
    `dmin` times the minimums' difference). The error is measured in that step."""
    n = blocks.shape[:2]
    sc = (blocks[..., :16] & 15).astype(np.int16).reshape(*n, 8, 2)
    mn = (blocks[..., :16] >> 4).reshape(*n, 8, 2)
    qs = blocks[..., 16:80].reshape(*n, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    k = (qs & 3).reshape(*n, 8, 32).astype(np.int16)
    d = _f16(blocks[..., 80:82])[..., None, None]
    dmin = _f16(blocks[..., 82:84])[..., None, None]
    sc_w = np.repeat(sc, 16, axis=-1)
    low_w = dmin * np.repeat(mn, 16, axis=-1).astype(np.float32)
    w = (d * sc_w.astype(np.float32)) * k.astype(np.float32) - low_w  # as gguf
    g = np.gcd(sc[..., 0], sc[..., 1])
    unit = d[..., 0] * g.astype(np.float32)
    one_min = (mn[..., 0] == mn[..., 1]) & (unit != 0)
    ints = k * (sc_w // np.maximum(g, 1)[..., None])  # 0..45
    shift = np.float32(128) - np.rint(ints.max(axis=-1) / 2).astype(np.float32)
    lo, hi = w.min(axis=-1), w.max(axis=-1)
    level = (hi - lo) / np.float32(255)
    # one value: codes 129 at zero 128, that value as the scale (the 8-bit kernels' fp16
    # `(128 - zero) * scale` is then 0; at codes 0, zero -1 it was `129 * lo`, rounded)
    flat = level == 0
    safe = np.where(flat, np.float32(1), level)
    codes = np.where(
        flat[..., None], 129, np.clip(np.rint((w - lo[..., None]) / safe[..., None]), 0, 255)
    )
    q = np.where(one_min[..., None], ints + shift[..., None], codes).astype(np.uint8)
    safe_unit = np.where(one_min, unit, np.float32(1))
    exact_zero = shift + low_w[..., 0] / safe_unit
    scales = np.where(one_min, unit, np.where(flat, lo, level)).astype(np.float32)
    zeros = np.where(one_min, exact_zero, np.where(flat, 128, -lo / safe)).astype(np.float32)
    err = np.abs((q.astype(np.float32) - zeros[..., None]) * scales[..., None] - w).max(axis=-1)
    coarse = np.abs(d[..., 0]) * sc.max(axis=-1).astype(np.float32)
    held = coarse > 0
    return q, scales, zeros, float((err[held] / coarse[held]).max(initial=0.0))


_PAIRED = {
    gguf.GGMLQuantizationType.Q2_K: _unpack_q2_k,
    gguf.GGMLQuantizationType.Q3_K: _unpack_q3_k,
    gguf.GGMLQuantizationType.Q6_K: _unpack_q6_k,
}


def _min_to_zero(
    q: np.ndarray, d: np.ndarray, m: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1's `d * q + m` (Q5_1's, and a K-quant sub-block's with `d * sc` and `-dmin * m`) as
    `(q - z) * s`: `z = -m / d`. A group with `d == 0` holds `m` in every weight; it becomes
    codes 1, scale `m`, zero 0 (codes 0 at zero -1 are the same weights, but the 8-bit
    kernels' fp16 `(128 - zero) * scale` rounds `17 m` once centred, off by 0.4% of `m`; at
    zero 0 it is `16 m`, exact)."""
    flat = d == 0
    safe = np.where(flat, 1.0, d).astype(np.float32)
    zeros = np.where(flat, 0.0, -m / safe).astype(np.float32)
    scales = np.where(flat, m, d).astype(np.float32)
    if flat.any():
        q = q.copy()
        q.reshape(*d.shape, -1)[flat] = 1
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


def _check_complete(src: GgufFile, out: list[str], config: dict[str, Any]) -> None:
    """Every layer must have all nine tensors (and its architecture's biases); a file missing
    one is truncated or foreign."""
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    biases = [_LAYER_TENSORS[k] for k in _LAYER_BIASES[src.arch]]
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{hf}.weight" for hf in _LAYER_TENSORS.values()}
        expected |= {f"model.layers.{i}.{hf}.bias" for hf in biases}
    held = {n.replace(".qweight", ".weight") for n in out}
    missing = sorted(expected - held)
    if missing:
        raise ModelLoadError(f"{src.path}: missing tensors {missing[:5]} ({len(missing)} in all)")


def tokenizer_spec(src: GgufFile, config: dict[str, Any]) -> BpeSpec | SentencePieceSpec:
    """The GGUF's embedded tokenizer, described for tokenizer_build: SentencePiece BPE
    (`llama`: Llama 2, Mistral) or byte-level BPE (`gpt2`) with the split its
    `tokenizer.ggml.pre` names (`PRE_SPLITS`)."""
    kind = src.get("tokenizer.ggml.model")
    if kind not in ("llama", "gpt2"):
        raise ModelLoadError(
            f"{src.path}: tokenizer model {kind!r} is not supported "
            "(only SentencePiece 'llama' and byte-level BPE 'gpt2')"
        )
    tokens = [str(t) for t in src.get("tokenizer.ggml.tokens")]
    types = [int(t) for t in src.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(types) != len(tokens):
        raise ModelLoadError(
            f"{src.path}: {len(types)} token types for {len(tokens)} tokens in the GGUF"
        )
    if kind == "llama":
        return _sentencepiece_spec(src, config, tokens, types)
    pre = str(src.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_SPLITS:
        raise ModelLoadError(
            f"{src.path}: tokenizer.ggml.pre={pre!r} is not supported: "
            f"expected one of {sorted(PRE_SPLITS)}"
        )
    return BpeSpec(
        vocab=tokens,
        merges=_merges(src),
        special=_added_tokens(types),
        split=PRE_SPLITS[pre],
        bos_token=_token_text(src, tokens, "bos"),
        eos_token=_token_text(src, tokens, "eos"),
        pad_token=_token_text(src, tokens, "padding"),
        unk_token=_token_text(src, tokens, "unknown"),
        add_bos_token=bool(src.get("tokenizer.ggml.add_bos_token", pre in LLAMA3_PRES)),
        add_eos_token=bool(src.get("tokenizer.ggml.add_eos_token", False)),
        ignore_merges=pre in LLAMA3_PRES,
        chat_template=src.get("tokenizer.chat_template", None),
        model_max_length=config["max_position_embeddings"],
    )


def _sentencepiece_spec(
    src: GgufFile, config: dict[str, Any], tokens: list[str], types: list[int]
) -> SentencePieceSpec:
    """A SentencePiece vocabulary: its merges follow from the pieces' scores (llama.cpp keeps
    no merge list for it). BOS is added unless the file says not to, and a `▁` before each
    piece of text between added tokens (the first, and each after one) unless
    `add_space_prefix` is false, as llama.cpp does."""
    scores = [float(s) for s in src.get("tokenizer.ggml.scores")]
    if len(scores) != len(tokens):
        raise ModelLoadError(f"{src.path}: {len(scores)} token scores for {len(tokens)} tokens")
    if not all(np.isfinite(scores)):
        raise ModelLoadError(f"{src.path}: the GGUF's token scores hold a NaN or infinity")
    return SentencePieceSpec(
        vocab=tokens,
        scores=scores,
        special=_added_tokens(types),
        bos_token=_token_text(src, tokens, "bos"),
        eos_token=_token_text(src, tokens, "eos"),
        pad_token=_token_text(src, tokens, "padding"),
        unk_token=_token_text(src, tokens, "unknown"),
        add_bos_token=bool(src.get("tokenizer.ggml.add_bos_token", True)),
        add_eos_token=bool(src.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(src.get("tokenizer.ggml.add_space_prefix", True)),
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
