"""What identifies a model directory, cheaply: so that rank 0 can tell that a remote rank, which
resolves the model in its own host's cache, loaded the same model as every other rank.

Ranks that loaded different models cannot be told apart by their collectives: with the same
shapes they compute wrong tokens without an error, with other shapes the first step breaks
the group (or worse). The fingerprint is the architecture (`ModelConfig`), a hash of
config.json, and a hash of every tensor's name, dtype and shape with a small sample of its
bytes (its first and middle SAMPLE_BYTES): weights trained or drawn differently differ there,
and reading a few KiB per tensor costs nothing next to loading them. The directory's path is
carried for the message, not compared (each host has its own cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.engine.weights import safetensors_files

SAMPLE_BYTES = 256  # read at the start and at the middle of each tensor
COSMETIC_KEYS = ("transformers_version", "_name_or_path")  # change no weight or computation
MAX_HEADER = 100 * 2**20  # safetensors' own bound on a header


def model_fingerprint(path: Path, mcfg: ModelConfig) -> dict[str, Any]:
    """The fingerprint of the model in `path` (whose config `mcfg` was read from)."""
    path = Path(path)
    return {
        "path": str(path),
        "config": dataclasses.asdict(mcfg),
        "config_sha256": _config_digest(path / "config.json"),
        "weights_sha256": _weights_digest(path),
    }


def differences(mine: dict[str, Any], theirs: dict[str, Any], limit: int = 4) -> str | None:
    """How `theirs` differs from `mine` (rank 0's), in words, or None if it does not."""
    ours, other = mine["config"], theirs["config"]
    fields = [k for k in ours if ours[k] != other.get(k)]
    if fields:
        shown = [f"{k} {other.get(k)!r} (rank 0: {ours[k]!r})" for k in fields[:limit]]
        more = f" and {len(fields) - limit} more" if len(fields) > limit else ""
        what = ", ".join(shown) + more
    elif mine["config_sha256"] != theirs["config_sha256"]:
        what = "config.json differs (same architecture)"
    elif mine["weights_sha256"] != theirs["weights_sha256"]:
        what = "same config.json, different weights"
    else:
        return None
    return f"{what}; its model directory {theirs['path']}, rank 0's {mine['path']}"


def _config_digest(file: Path) -> str:
    """config.json as parsed, keys sorted, cosmetic keys left out: the same config written by
    another tool (spacing, key order, a transformers version stamp) hashes the same."""
    data = json.loads(file.read_text())  # ModelConfig.from_dir has already parsed it
    for key in COSMETIC_KEYS:
        data.pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _weights_digest(path: Path) -> str:
    """Every tensor's name, dtype, shape and sampled bytes, in name order: independent of how
    the tensors are split into shards or ordered in a file."""
    entries = []
    for file in safetensors_files(path):
        try:
            entries += _tensor_samples(file)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise ModelLoadError(
                f"{file}: cannot read safetensors, truncated or corrupt ({e})"
            ) from e
    entries.sort()
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _tensor_samples(file: Path) -> list[tuple[str, str, list[int], str]]:
    out = []
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER:
            raise ValueError(f"header of {n} bytes")
        header = json.loads(f.read(n))
        base = 8 + n
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(x) for x in meta["data_offsets"])
            digest = hashlib.sha256()
            middle = begin + max(0, (end - begin) // 2 - SAMPLE_BYTES // 2)
            for at in sorted({begin, middle}):
                f.seek(base + at)
                digest.update(f.read(min(SAMPLE_BYTES, end - at)))
            out.append((name, str(meta["dtype"]), list(meta["shape"]), digest.hexdigest()))
    return out
