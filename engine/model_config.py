"""Architecture hyper-parameters of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# config.json's model_type -> the class transformers' AutoModelForCausalLM builds for it, read
# where `architectures` is left out
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")  # what `model.rope_inv_freq` computes
# the pretraining context length llama3 scaling works from (top level or in the RoPE dict)
ORIGINAL_POSITIONS = "original_max_position_embeddings"
# transformers' defaults where config.json leaves these out (MistralConfig, Qwen2Config)
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28

log = logging.getLogger("kvguard.engine")

COMPLETE_MARKER = ".kvguard-complete"  # written last into a directory kvguard made


class ModelLoadError(RuntimeError):
    """The model cannot be found, fetched, converted or read; the message says which file and why."""


def cache_remedy(path: Path) -> str:
    """What to do about a bad file in a model directory kvguard made (its cache: a known
    model is fetched again, a converted GGUF deleted to be converted again); "" elsewhere."""
    path = Path(path)
    for folder in (path, *path.parents[:2]):
        marker = folder / COMPLETE_MARKER
        if not marker.is_file():
            continue
        try:
            name = json.loads(marker.read_text(encoding="utf-8")).get("name")
        except (OSError, ValueError, AttributeError):
            name = None
        if folder.parent.name == "models" and isinstance(name, str):
            return f"; run `kvguard model fetch --force {name}` to replace this cached copy"
        return f"; delete {folder} to have it converted again"
    return ""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases: Qwen2's always, Llama's with attention_bias
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_proj_bias: bool = False  # Llama's attention_bias gives o_proj one too
    mlp_bias: bool = False  # Llama's mlp_bias: gate, up and down
    # tokens a sliding-window layer attends to (None: every layer attends to the whole
    # context); kvguard has no windowed attention, so it serves such a model within it
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """The hyper-parameters of a config.json's contents; `source` names it in errors."""
        if not isinstance(d, dict):
            raise ModelLoadError(f"{source}: not a JSON object but {type(d).__name__}")
        arch = _architecture(d, source)
        if arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(
                f"{source}: architecture {arch!r} is not supported: expected one of {SUPPORTED_ARCHS}"
            )

        def count(key: str, default: int | None = None) -> int:
            """A positive integer field; a missing, null or 0 one takes `default` if it has one."""
            value = d.get(key)
            if default is not None and not value:
                value = default
            elif key not in d:
                raise ModelLoadError(f"{source}: missing required field {key!r}")
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelLoadError(
                    f"{source}: field {key!r} is {value!r}, expected a positive integer"
                )
            return value

        hidden, heads = count("hidden_size"), count("num_attention_heads")
        kv_heads = count("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}"
            )
        eos = d.get("eos_token_id")
        try:
            eos_ids = tuple(int(i) for i in eos) if isinstance(eos, list) else ()
            eos_ids = eos_ids or (() if eos is None or isinstance(eos, list) else (int(eos),))
            rms_norm_eps = float(d.get("rms_norm_eps", 1e-6))
        except (ValueError, TypeError, AttributeError) as e:
            raise ModelLoadError(
                f"{source}: eos_token_id or rms_norm_eps is malformed ({e})"
            ) from e
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # one function under two names
            raise ModelLoadError(
                f"{source}: hidden_act {act!r} is not supported: kvguard's MLP is SiLU-gated"
            )
        max_positions = count("max_position_embeddings", 2048)
        rope_theta, rope_scaling = _rope(d, max_positions, source)
        layers = count("num_hidden_layers")
        # the biases transformers builds for each architecture, whatever else config.json says
        llama = arch == "LlamaForCausalLM"
        llama_attention_bias = llama and bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=count("head_dim", max(hidden // heads, 1)),
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=llama_attention_bias or arch == "Qwen2ForCausalLM",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            o_proj_bias=llama_attention_bias,
            mlp_bias=llama and bool(d.get("mlp_bias", False)),
            sliding_window=_sliding_window(d, arch, layers, source),
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        cfg = Path(path) / "config.json"
        try:
            data = json.loads(cfg.read_text())
        except FileNotFoundError as e:
            raise ModelLoadError(
                f"{cfg}: missing; a model directory needs config.json{cache_remedy(cfg)}"
            ) from e
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg}: not valid JSON ({e}){cache_remedy(cfg)}") from e
        try:
            return cls.from_hf_dict(data, str(cfg))
        except ModelLoadError as e:
            raise ModelLoadError(f"{e}{cache_remedy(cfg)}") from e

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer (seed §1.2): 2 × layers × kv_heads × head_dim × bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _architecture(d: dict[str, Any], source: str) -> str:
    """config.json's `architectures`, or without it the class its `model_type` stands for, as
    transformers' AutoModelForCausalLM picks it: a Granite config served as a Llama would
    ignore its multipliers, and a Qwen2 one would lose its q/k/v biases. With both, they must
    name the same model: transformers and vLLM would each build another."""
    archs, model_type = d.get("architectures"), d.get("model_type")
    if archs:
        arch = archs[0] if isinstance(archs, list) else archs
        _check_model_type_agrees(arch, model_type, source)
        return arch
    if model_type is None:
        raise ModelLoadError(
            f"{source}: neither 'architectures' nor 'model_type' is given, so the model's "
            f"architecture is unknown: expected one of {SUPPORTED_ARCHS}"
        )
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ModelLoadError(
            f"{source}: model_type {model_type!r} (without 'architectures') is not supported: "
            f"expected one of {tuple(MODEL_TYPES)}"
        )
    return MODEL_TYPES[model_type]


def _check_model_type_agrees(arch: Any, model_type: Any, source: str) -> None:
    """Refuse `architectures` and `model_type` naming two different supported models:
    transformers' AutoModelForCausalLM builds model_type's class (it ignores `architectures`),
    vLLM builds architectures', and the two differ in biases and sliding windows, so serving
    either one could drop the weights or attention the checkpoint was made for."""
    named = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if named is None or arch not in SUPPORTED_ARCHS or named == arch:
        return
    raise ModelLoadError(
        f"{source}: architectures names {arch} but model_type {model_type!r} names {named}, "
        f"different models (transformers builds model_type's {named}, vLLM architectures' "
        f"{arch}); set architectures and model_type to the same model"
    )


def _rope(d: dict[str, Any], max_positions: int, source: str) -> tuple[float, dict | None]:
    """(rope_theta, the scaling `model.rope_inv_freq` applies or None), as transformers reads
    them: from `rope_scaling` (Hub-style, `rope_theta` beside it) or else `rope_parameters`
    (what transformers 5 writes, theta inside); a scaling type kvguard cannot compute is
    refused here, naming the field, rather than served as plain RoPE."""
    scaling, params = d.get("rope_scaling"), d.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ModelLoadError(f"{source}: {key} is {value!r}, expected an object")
    # transformers takes rope_scaling over rope_parameters when it has anything in it
    key, rope = ("rope_scaling", scaling) if scaling else ("rope_parameters", params or {})
    if scaling and params and _scaling_of(scaling) != _scaling_of(params):
        log.warning(
            "%s: rope_scaling %s and rope_parameters %s differ: serving rope_scaling's, "
            "which transformers reads first",
            source,
            scaling,
            params,
        )
    try:
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{source}: rope_theta is malformed ({e})") from e
    # RoPE divides by theta's powers: 0, a negative or a non-finite base turns every step's
    # attention into NaN, so it is refused here rather than served as garbage
    if not math.isfinite(theta) or theta <= 0:
        raise ModelLoadError(f"{source}: rope_theta is {theta!r}, expected a positive number")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: {key} type {kind!r} is not supported ({', '.join(ROPE_TYPES)})"
        )
    if kind == "default":
        return theta, None
    out = {**rope, "rope_type": kind}
    if kind == "llama3":
        out[ORIGINAL_POSITIONS] = _original_positions(d, rope, max_positions, source)
    needs = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    needs += (ORIGINAL_POSITIONS,) if kind == "llama3" else ()
    for field in needs:
        value = out.get(field)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(
                f"{source}: {key} {field} is {value!r}; {kind} scaling needs a positive number"
            )
    return theta, out


def _original_positions(
    d: dict[str, Any], rope: dict[str, Any], max_positions: int, source: str
) -> Any:
    """The pretraining length llama3 scaling divides by, where transformers takes it: a
    top-level `original_max_position_embeddings` (Phi-3 style) over the RoPE dict's own, which
    transformers' `standardize_rope_params` overwrites with it when the rotary embedding is
    built; else the dict's; else max_position_embeddings."""
    if ORIGINAL_POSITIONS not in d:
        return rope.get(ORIGINAL_POSITIONS, max_positions)
    top = d[ORIGINAL_POSITIONS]
    if isinstance(top, bool) or not isinstance(top, int | float) or top <= 0:
        raise ModelLoadError(
            f"{source}: {ORIGINAL_POSITIONS} is {top!r}; llama3 scaling needs a positive number"
        )
    inner = rope.get(ORIGINAL_POSITIONS)
    if inner is not None and inner != top:
        log.warning(
            "%s: %s is %s at the top level and %s in the RoPE parameters: serving the "
            "top-level one, which transformers reads first",
            source,
            ORIGINAL_POSITIONS,
            top,
            inner,
        )
    return top


def _scaling_of(rope: dict[str, Any]) -> dict[str, Any]:
    """A RoPE dict's scaling alone: its type (under either name) and parameters, not theta."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    rest = {k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}
    return {"rope_type": kind, **rest}


def _sliding_window(d: dict[str, Any], arch: str, layers: int, source: str) -> int | None:
    """The window of a model with sliding-window layers, as transformers reads config.json:
    Qwen2's only with `use_sliding_window` and on the layers `layer_types` (else
    `max_window_layers`) says; any other's `sliding_window` (Mistral's is 4096 where the field
    is left out; a Llama config that sets one gets transformers' sliding-window KV cache when
    it generates). None: every layer attends to the whole context."""
    if arch == "Qwen2ForCausalLM":
        if not d.get("use_sliding_window"):
            return None
        types = d.get("layer_types")
        if types is None:
            first = d.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
            types = ["sliding_attention" if i >= first else "full" for i in range(layers)]
        if "sliding_attention" not in types:
            return None
    default = DEFAULT_SLIDING_WINDOW if arch != "LlamaForCausalLM" else None
    window = d.get("sliding_window", default)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{source}: sliding_window is {window!r}, expected a positive integer")
    return window
