"""Reads a quantized Hugging Face checkpoint: its format from `config.json`, then each
quantized linear as a `QuantSpec` and everything else as plain float tensors.

The format is `quantization_config.quant_method`: `awq`, `gptq` or `compressed-tensors`, each
checked by its module (`awq`, `gptq`, `compressed_tensors`) before any tensor is read, so an
unsupported variant (AWQ GEMV, Marlin-repacked GPTQ, 8-bit, FP8, NVFP4, ...) is refused by
name instead of being mis-read. A module is quantized when its format's marker tensor is
present (`<name>.qweight`, `<name>.weight_packed`); modules a checkpoint leaves unquantized
(`modules_to_not_convert`, compressed-tensors `ignore`, usually `lm_head`) stay plain.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.loader import awq, compressed_tensors, gptq
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.engine.weights import Part, SafetensorsSource, open_safetensors

FORMATS: dict[str, ModuleType] = {
    "awq": awq,
    "gptq": gptq,
    "compressed-tensors": compressed_tensors,
}
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: str  # a key of FORMATS
    settings: Any  # what the format's check_config returned


def detect_format(path: Path | str) -> str | None:
    """`awq`, `gptq` or `compressed-tensors` from config.json; None for an unquantized model.

    Raises ModelLoadError naming config.json and the value found for any quantization this
    loader does not read.
    """
    fmt = _read_format(Path(path))
    return None if fmt is None else fmt.name


def load_quantized(
    path: Path | str, cfg: ModelConfig, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, QuantSpec], dict[str, torch.Tensor]]:
    """({module name: QuantSpec}, {tensor name: plain tensor in `dtype`}) of a checkpoint.

    Module names are Hugging Face's (`model.layers.0.self_attn.q_proj`); plain tensors keep
    their full names (`model.norm.weight`, a projection's `.bias`). Every projection of every
    layer must be present, quantized or plain.
    """
    path = Path(path)
    fmt = _read_format(path)
    if fmt is None:
        raise ModelLoadError(f"{path / 'config.json'}: no quantization_config; not quantized")
    unpacker = FORMATS[fmt.name]
    # scales must reach the unpackers unrounded: read in fp32, cast only the plain tensors
    with open_safetensors(path, torch.float32) as source:
        names = set(source.names)
        modules = _quantized_modules(names, unpacker.MARKER)
        read = _reader(source, names)
        specs = {m: unpacker.module_spec(m, read, fmt.settings) for m in modules}
        owned = {f"{m}.{part}" for m in modules for part in unpacker.PARTS}
        plain = {n: _cast(source.read(Part(n)), dtype) for n in sorted(names - owned)}
    _check_complete(path, cfg, specs, plain)
    return specs, plain


def _read_format(path: Path) -> QuantFormat | None:
    file = path / "config.json"
    qc = _config(file).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{file}: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in FORMATS:
        raise ModelLoadError(
            f"{file}: quant_method {method!r} is not supported; "
            f"kvguard reads {sorted(FORMATS)} (and GGUF files)"
        )
    return QuantFormat(method, FORMATS[method].check_config(qc, file))


def _config(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise ModelLoadError(f"{file}: missing; a model directory needs config.json") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: not a JSON object")
    return data


def _quantized_modules(names: set[str], marker: str) -> list[str]:
    suffix = "." + marker
    return sorted(n.removesuffix(suffix) for n in names if n.endswith(suffix))


def _reader(source: SafetensorsSource, names: set[str]) -> Callable[[str], torch.Tensor | None]:
    def read(name: str) -> torch.Tensor | None:
        return source.read(Part(name)) if name in names else None

    return read


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _check_complete(
    path: Path, cfg: ModelConfig, specs: dict[str, QuantSpec], plain: dict[str, torch.Tensor]
) -> None:
    """Every projection of every layer must be there, one way or the other."""
    missing = [
        f"model.layers.{i}.{p}"
        for i in range(cfg.num_layers)
        for p in PROJECTIONS
        if f"model.layers.{i}.{p}" not in specs and f"model.layers.{i}.{p}.weight" not in plain
    ]
    if missing:
        raise ModelLoadError(
            f"{path}: weights lack projections {missing[:5]} ({len(missing)} in all)"
        )
