"""Reads a model directory's safetensors: whole ({Hugging Face name: tensor}) or rank slices.

Every failure (no files, a truncated or corrupt file, a shard the index names but that is
absent, a tensor the caller needs but that no file holds, a tensor of the wrong size) is a
ModelLoadError naming the file or tensor and the problem, because "it crashed in torch" is not
something an operator can act on. Both ways of reading (a dict of whole tensors, and the slices
one tensor-parallel rank reads straight from the files) go through the same checks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from kvguard.engine.config import QUANTIZATION_CHOICES
from kvguard.engine.model_config import ModelConfig, ModelLoadError, cache_remedy

INDEX_FILE = "model.safetensors.index.json"
_READ_ERRORS = (SafetensorError, OSError, RuntimeError, ValueError)

log = logging.getLogger("kvguard.engine")


@dataclass(frozen=True, slots=True)
class Part:
    """The part of tensor `name` one rank holds: `span` along `dim`, or all of it (span None).

    `full` is the size the tensor must have along `dim`; it is checked before slicing, so a
    wrong-sized tensor is refused rather than silently cut. Indices of `span` at or past `full`
    read as zeros: the padding rows of a vocabulary that does not divide by the rank count.
    """

    name: str
    span: range | None = None
    dim: int = 0
    full: int | None = None


class WeightSource(Protocol):
    """Where a model's parameters are read from, one `Part` at a time."""

    def read(self, part: Part) -> torch.Tensor: ...


class DictSource:
    """Parts of tensors already in memory (the output of `load_weights`)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def read(self, part: Part) -> torch.Tensor:
        if part.name not in self.weights:
            raise _missing(part.name)
        tensor = self.weights[part.name]
        if part.span is None:
            return tensor
        return _slice(
            part, tuple(tensor.shape), lambda lo, hi: tensor.narrow(part.dim, lo, hi - lo)
        )


class SafetensorsSource:
    """Parts read straight from the files: only the requested slice is read out of the mmap,
    so a rank's weight memory is its share, not the whole model.

    A tensor read in the file's dtype is a view onto safetensors' mapping of the file, and
    keeps the whole file mapped while it lives (its pages stay resident, counted in the
    process's RSS): what must outlive the load is copied (`load_from` copies into the
    parameters; `gguf_packed.load_packed` clones)."""

    def __init__(
        self, handles: dict[str, tuple[Path, Any]], dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.handles = handles  # tensor name -> (file, open safe_open handle)
        self.dtype, self.device = dtype, torch.device(device)

    @property
    def names(self) -> list[str]:
        return list(self.handles)

    def read(self, part: Part) -> torch.Tensor:
        if part.name not in self.handles:
            raise _missing(part.name)
        file, handle = self.handles[part.name]
        try:
            if part.span is None:
                t = handle.get_tensor(part.name)
            else:
                sl = handle.get_slice(part.name)
                index = (slice(None),) * part.dim
                t = _slice(part, tuple(sl.get_shape()), lambda lo, hi: sl[(*index, slice(lo, hi))])
        except ModelLoadError:
            raise
        except _READ_ERRORS as e:
            raise ModelLoadError(
                f"{file}: cannot read tensor {part.name!r} ({e}){cache_remedy(file)}"
            ) from e
        return _cast(t, self.dtype, self.device)

    def check_has(self, path: Path, expected: Iterable[str]) -> None:
        """Every tensor in `expected` is here, and no bias that it leaves out."""
        expected = set(expected)
        _check_expected(path, self.handles, expected)
        check_unused_biases(path, self.handles, expected, lambda n: self.read(Part(n)))
        warn_untied_head(path, self.handles, expected, lambda n: self.read(Part(n)))


def warn_untied_head(
    path: Path,
    held: Iterable[str],
    expected: Iterable[str],
    read: Callable[[str], torch.Tensor],
) -> None:
    """config.json ties the lm_head to the embedding (`expected` leaves it out) but the
    checkpoint holds an `lm_head.weight` of other values: kvguard ties, as config.json says
    (and vLLM and transformers 4 do); transformers 5 keeps the checkpoint's head instead, so
    their answers differ. Said once, at load: the values are read only in that case."""
    head = "lm_head.weight"
    if head in expected or head not in set(held):
        return
    if not torch.equal(read(head), read("model.embed_tokens.weight")):
        log.warning(
            "%s: config.json sets tie_word_embeddings, so the lm_head is the embedding, but the "
            "checkpoint's %s differs from it and is not served (transformers 5 would serve it: "
            "set tie_word_embeddings: false in config.json for that)",
            path,
            head,
        )


@contextmanager
def open_safetensors(
    path: Path, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Iterator[SafetensorsSource]:
    """Every shard of `path` opened (headers checked, the index honoured) until the block ends."""
    path = Path(path)
    handles: dict[str, tuple[Path, Any]] = {}
    with ExitStack() as stack:
        for file in safetensors_files(path):
            handle = stack.enter_context(_open(file))
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                if name in handles:
                    raise ModelLoadError(f"{file}: tensor {name!r} also appears in another shard")
                handles[name] = (file, handle)
        _check_index(path, handles)
        yield SafetensorsSource(handles, dtype, device)


def load_weights(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    expected: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of all *.safetensors in path, floating ones cast to dtype, on device.

    `expected` (optional) lists names that must be present, e.g. `expected_tensor_names(cfg)`.
    """
    with open_safetensors(path, dtype, device) as source:
        if expected is not None:
            source.check_has(Path(path), expected)
        return {name: source.read(Part(name)) for name in source.names}


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
    if index:
        # only the shards the index names, as transformers reads them: a whole-model file left
        # beside them (or Mistral's consolidated.safetensors) would hold every tensor again
        shards = {path / shard for shard in index.values()}
        if stray := [f.name for f in files if f not in shards]:
            log.warning("%s: not read, as %s does not name them: %s", path, INDEX_FILE, stray)
        files = sorted(shards)
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight file{cache_remedy(path)}")
    return files


def safetensors_bytes(path: Path) -> int:
    """The bytes of the shards a load reads: those the index names where the directory has
    one (a whole-model file left beside them is not read, so not counted), else every
    *.safetensors. For the load's log line: files that are missing count nothing here, the
    load names them."""
    index = _read_index(path)
    files = {path / shard for shard in index.values()} or set(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files if f.is_file())


def _read_index(path: Path) -> dict[str, str]:
    index = path / INDEX_FILE
    if not index.is_file():
        return {}
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e


@contextmanager
def _open(file: Path) -> Iterator[Any]:
    """Open one shard; a header that promises more bytes than the file has is caught here."""
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except _READ_ERRORS as e:
        raise ModelLoadError(
            f"{file}: cannot read safetensors, truncated or corrupt ({e}){cache_remedy(file)}"
        ) from e
    with handle:
        yield handle


def _slice(
    part: Part, shape: tuple[int, ...], cut: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """`cut(lo, hi)` of the part, after checking the tensor's size; zero rows past its end."""
    if part.full is not None and (len(shape) <= part.dim or shape[part.dim] != part.full):
        raise ModelLoadError(
            f"tensor {part.name!r} has shape {shape}, expected size {part.full} along dim {part.dim}"
        )
    stop = max(part.span.start, min(part.span.stop, shape[part.dim]))
    t = cut(part.span.start, stop)
    pad = part.span.stop - stop
    if pad <= 0:
        return t
    zeros = t.new_zeros((*t.shape[: part.dim], pad, *t.shape[part.dim + 1 :]))
    return torch.cat([t, zeros], dim=part.dim)


def _cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Only floating tensors take the compute dtype; integer buffers keep theirs."""
    if t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    return t.to(device=device)


def _missing(name: str) -> ModelLoadError:
    return ModelLoadError(f"weights lack tensor {name!r}")


def _check_index(path: Path, held: dict[str, Any]) -> None:
    index = _read_index(path)
    missing = sorted(name for name in index if name not in held)
    if missing:
        raise ModelLoadError(
            f"{path / INDEX_FILE}: names tensors that no shard holds: "
            f"{missing[:5]} ({len(missing)} in all)"
        )


def _check_expected(path: Path, held: dict[str, Any], expected: Iterable[str]) -> None:
    missing = sorted(set(expected) - held.keys())
    if missing:
        raise ModelLoadError(f"{path}: weights lack tensors {missing[:5]} ({len(missing)} in all)")


def check_unused_biases(
    path: Path,
    held: Iterable[str],
    expected: Iterable[str],
    read: Callable[[str], torch.Tensor],
) -> None:
    """Refuse a checkpoint with a bias the model would not apply (say an `o_proj.bias` that
    its config.json does not declare): served without it, it would be another model. A bias
    of zeros changes nothing (some quantisers write one for every projection): it passes."""
    extra = sorted(
        n for n in set(held) - set(expected) if n.endswith(".bias") and bool(read(n).any())
    )
    if extra:
        raise ModelLoadError(
            f"{path}: holds tensor {extra[0]!r} ({len(extra)} such in all), a bias that a model "
            "of this config.json does not have; refusing rather than serving it without"
        )


def expected_tensor_names(cfg: ModelConfig) -> list[str]:
    """The Hugging Face tensor names a Llama-family model of this shape needs (its biases as
    transformers builds them for the architecture: see `ModelConfig.from_hf_dict`)."""
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
        if cfg.o_proj_bias:
            names.append(f"model.layers.{i}.self_attn.o_proj.bias")
        if cfg.mlp_bias:
            names += [f"model.layers.{i}.mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    return names


# -- quantized checkpoints -------------------------------------------------------------------
# `quantization.model_quantization` -> the checkpoint formats it accepts (None: unquantized).
# compressed-tensors has no knob of its own: `auto` serves it.
_KNOB_FORMATS: dict[str, tuple[str | None, ...]] = {
    "none": (None,),
    "awq_4bit": ("awq",),
    "gptq_4bit": ("gptq",),
    "gguf": ("gguf",),
}


def checkpoint_quantization(path: Path) -> str | None:
    """The quantization a model directory declares in config.json: None (plain weights),
    `gguf` (kvguard's packed GGUF conversion) or what the quantized-checkpoint loader reads
    (`awq`, `gptq`, `compressed-tensors`; it refuses other formats by name)."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file}: cannot read ({e}){cache_remedy(file)}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(
            f"{file}: not a JSON object but {type(config).__name__}{cache_remedy(file)}"
        )
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if isinstance(qc, dict) and qc.get("quant_method") == "gguf":
        return "gguf"
    try:
        from kvguard.engine.loader.quantized import detect_format
    except ImportError as e:
        raise ModelLoadError(
            f"{file}: declares quantization_config {qc.get('quant_method')!r} but this build "
            "has no quantized-checkpoint loader (kvguard.engine.loader.quantized)"
        ) from e
    return detect_format(path)


def check_quantization(where: Path, found: str | None, knob: str) -> None:
    """Refuse a `model_quantization` that the checkpoint at `where` does not hold."""
    if knob not in QUANTIZATION_CHOICES:
        raise ModelLoadError(
            f"model_quantization={knob!r}: expected one of {', '.join(QUANTIZATION_CHOICES)}"
        )
    if knob == "auto" or found in _KNOB_FORMATS[knob]:
        return
    held = "unquantized weights" if found is None else f"{found} weights"
    raise ModelLoadError(
        f"{where}: holds {held}, but quantization.model_quantization is {knob} "
        "(auto serves a checkpoint as it is)"
    )
