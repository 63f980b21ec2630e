"""Architecture hyper-parameters of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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
    attention_bias: bool  # Qwen2 has q/k/v biases
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """The hyper-parameters of a config.json's contents; `source` names it in errors."""
        if not isinstance(d, dict):
            raise ModelLoadError(f"{source}: not a JSON object but {type(d).__name__}")
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
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
            rope_theta = float(
                d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
            )
        except (ValueError, TypeError, AttributeError) as e:
            raise ModelLoadError(
                f"{source}: eos_token_id, rms_norm_eps or rope_theta is malformed ({e})"
            ) from e
        return cls(
            architecture=arch,
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=count("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=count("head_dim", max(hidden // heads, 1)),
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=count("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        cfg = Path(path) / "config.json"
        try:
            data = json.loads(cfg.read_text())
        except FileNotFoundError as e:
            raise ModelLoadError(f"{cfg}: missing; a model directory needs config.json") from e
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg}: not valid JSON ({e}){cache_remedy(cfg)}") from e
        try:
            return cls.from_hf_dict(data, str(cfg))
        except ModelLoadError as e:
            raise ModelLoadError(f"{e}{cache_remedy(cfg)}") from e

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer (seed §1.2): 2 × layers × kv_heads × head_dim × bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
