"""Architecture hyper-parameters of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ModelLoadError(RuntimeError):
    """The model cannot be found, fetched, converted or read; the message says which file and why."""


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
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(
                f"architecture {arch!r} is not supported: expected one of {SUPPORTED_ARCHS}"
            )
        heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(
                d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
            ),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
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
            raise ModelLoadError(f"{cfg}: not valid JSON ({e})") from e
        try:
            return cls.from_hf_dict(data)
        except KeyError as e:
            raise ModelLoadError(f"{cfg}: missing required field {e.args[0]!r}") from e

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer (seed §1.2): 2 × layers × kv_heads × head_dim × bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
