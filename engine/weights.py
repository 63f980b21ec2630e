"""Loads a model directory's safetensors into a flat {Hugging Face name: tensor} dict.

Every failure (no files, a truncated or corrupt file, a shard the index names but that is
absent, a tensor the caller needs but that no file holds) is a ModelLoadError naming the file
and the problem, because "it crashed in torch" is not something an operator can act on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvguard.engine.model_config import ModelConfig, ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def load_weights(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    expected: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of all *.safetensors in path, floating ones cast to dtype, on device.

    `expected` (optional) lists names that must be present, e.g. `expected_tensor_names(cfg)`.
    """
    files = safetensors_files(Path(path))
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in _read_file(file, dtype, torch.device(device)):
            if name in weights:
                raise ModelLoadError(f"{file}: tensor {name!r} also appears in another shard")
            weights[name] = tensor
    _check_index(Path(path), weights)
    if expected is not None:
        _check_expected(Path(path), weights, expected)
    return weights


def safetensors_files(path: Path) -> list[Path]:
    """The shards to read, checked against the index when the directory has one."""
    if not path.is_dir():
        raise ModelLoadError(
            f"{path}: not a directory; expected a model directory with *.safetensors"
        )
    files = sorted(path.glob("*.safetensors"))
    index = _read_index(path)
    for shard in sorted(set(index.values())):
        if not (path / shard).is_file():
            raise ModelLoadError(f"{path / shard}: missing; {INDEX_FILE} names it as a shard")
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight file")
    return files


def _read_index(path: Path) -> dict[str, str]:
    index = path / INDEX_FILE
    if not index.is_file():
        return {}
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e


def _read_file(
    file: Path, dtype: torch.dtype, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Read one shard; a header that promises more bytes than the file has is caught here."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = list(f.keys())
            return [(name, _cast(f.get_tensor(name), dtype, device)) for name in names]
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{file}: cannot read safetensors, truncated or corrupt ({e})") from e


def _cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Only floating tensors take the compute dtype; integer buffers keep theirs."""
    if t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    return t.to(device=device)


def _check_index(path: Path, weights: dict[str, torch.Tensor]) -> None:
    index = _read_index(path)
    missing = sorted(name for name in index if name not in weights)
    if missing:
        raise ModelLoadError(
            f"{path / INDEX_FILE}: names tensors that no shard holds: "
            f"{missing[:5]} ({len(missing)} in all)"
        )


def _check_expected(path: Path, weights: dict[str, torch.Tensor], expected: Iterable[str]) -> None:
    missing = sorted(set(expected) - weights.keys())
    if missing:
        raise ModelLoadError(f"{path}: weights lack tensors {missing[:5]} ({len(missing)} in all)")


def expected_tensor_names(cfg: ModelConfig) -> list[str]:
    """The Hugging Face tensor names a Llama-family model of this shape needs."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    projections += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    norms = ["input_layernorm", "post_attention_layernorm"]
    for i in range(cfg.num_layers):
        names += [f"model.layers.{i}.{p}.weight" for p in projections + norms]
        if cfg.attention_bias:
            names += [f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv"]
    return names
