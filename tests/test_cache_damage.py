"""A damaged file of a cached model copy, and a conversion that cannot write its files.

README ("Models"): an error about a file of a cached copy says to run `kvguard model fetch
--force NAME`, and a full disk while converting names the directory in one line (exit 2, which
the service unit does not restart into). Every test uses its own home (tmp_path).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvguard.daemon.cli import main
from kvguard.engine import gguf_convert, tiny_model
from kvguard.engine.model_config import COMPLETE_MARKER, ModelConfig, ModelLoadError
from kvguard.engine.model_registry import SMOLLM2_GGUF, fetch_model, resolve_model
from kvguard.engine.tiny_model import tiny_tokenizer_spec
from kvguard.engine.tokenizer_build import write_tokenizer_files
from tests.test_model_cache import write_pinned_gguf


def _delete(file: Path) -> None:
    file.unlink()


def _truncate(file: Path) -> None:
    """Half the file: a copy cut short (a full disk, a killed `cp`)."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


DAMAGE: dict[str, tuple[str, Callable[[Path], None]]] = {
    "tokenizer.json deleted": ("tokenizer.json", _delete),
    "tokenizer.json truncated": ("tokenizer.json", _truncate),
    "tokenizer_config.json truncated": ("tokenizer_config.json", _truncate),
    "config.json deleted": ("config.json", _delete),
    "config.json truncated": ("config.json", _truncate),
    "model.safetensors deleted": ("model.safetensors", _delete),
    "model.safetensors truncated": ("model.safetensors", _truncate),
}


def _generate(model: str) -> int:
    return main(["generate", "--model", model, "--max-tokens", "2", "hi"])


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_file_of_a_cached_copy_says_to_fetch_it_again(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A missing file read as if the user had made the directory wrong, with no remedy; the
    cache's copy now gets README's: `model fetch --force tiny`, which does fix it. The same
    damage in a directory of the user's own names no cache remedy."""
    name, damage = DAMAGE[case]
    path = fetch_model("tiny", tmp_path, progress=False)
    damage(path / name)
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    assert _generate("tiny") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and "run `kvguard model fetch --force tiny`" in err, err

    mine = tmp_path / "mine"
    shutil.copytree(path, mine, ignore=shutil.ignore_patterns(COMPLETE_MARKER))
    assert _generate(str(mine)) == 2
    err = capsys.readouterr().err
    assert str(mine) in err and "model fetch" not in err and "delete" not in err, err

    assert main(["model", "fetch", "--force", "tiny"]) == 0
    assert _generate("tiny") == 0


def test_a_cached_copy_without_config_json_read_by_a_worker_says_to_fetch_it_again(
    tmp_path: Path,
) -> None:
    """The CLI reads config.json first for its quantization, whose error gives the remedy;
    `ModelConfig.from_dir` (a tensor-parallel worker's read, a library caller's) said only
    "missing; a model directory needs config.json", as if the user had made the directory."""
    path = fetch_model("tiny", tmp_path, progress=False)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="run `kvguard model fetch --force tiny`"):
        ModelConfig.from_dir(path)


def test_a_truncated_default_gguf_placed_by_hand_says_how_to_replace_it(tmp_path: Path) -> None:
    """The default model's GGUF placed by hand (an offline host) is used without a digest
    check: cut short, its error says that a forced fetch or placing it again fixes it. A user's
    own GGUF gets no such hint: kvguard cannot fetch it."""
    data = write_pinned_gguf(tmp_path / "pinned.gguf").read_bytes()
    placed = tmp_path / "home" / "gguf" / SMOLLM2_GGUF
    placed.parent.mkdir(parents=True)
    placed.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as known:
        fetch_model("smollm2-135m", tmp_path / "home", progress=False)
    assert str(placed) in str(known.value), known.value
    assert "run `kvguard model fetch --force smollm2-135m`" in str(known.value), known.value

    own = tmp_path / "own.gguf"
    own.write_bytes(placed.read_bytes())
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as users:
        resolve_model(str(own), tmp_path / "home", progress=False, quantization="auto")
    assert "model fetch" not in str(users.value), users.value


def test_a_tokenizer_json_that_cannot_be_written_is_an_oserror(tmp_path: Path) -> None:
    """tokenizers' own writer raised a plain Exception on any I/O error (here EISDIR, on a
    full disk ENOSPC), which no caller catches as the write error it is."""
    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(OSError, match="Is a directory"):
        write_tokenizer_files(tiny_tokenizer_spec(), tmp_path)


def _tokenizer_json_unwritable(module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the conversion's real tokenizer.json write fail, as a full disk does at that file
    (it comes after model.safetensors): a directory stands where it goes."""

    def write_into_blocked(spec: Any, out_dir: Path) -> None:
        (out_dir / "tokenizer.json").mkdir()
        write_tokenizer_files(spec, out_dir)

    monkeypatch.setattr(module, "write_tokenizer_files", write_into_blocked)


@pytest.mark.parametrize("source", ["tiny", "gguf"])
def test_a_conversion_that_cannot_write_tokenizer_json_is_one_line_and_exit_2(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """It was a traceback and exit 1, which the service unit restarts into the same failed
    conversion; now the full-disk error: one line naming the directory, exit 2, and no
    half-written directory left."""
    home = tmp_path / "home"
    if source == "tiny":
        model, module, parent = "tiny", tiny_model, home / "models"
    else:
        model = str(write_pinned_gguf(tmp_path / "pinned.gguf"))
        module, parent = gguf_convert, home / "models" / "gguf"
    _tokenizer_json_unwritable(module, monkeypatch)
    with pytest.raises(ModelLoadError, match="cannot write the model into"):
        resolve_model(model, home, progress=False, quantization="auto")
    assert list(parent.iterdir()) == []

    monkeypatch.setenv("KVGUARD_HOME", str(home))
    assert _generate(model) == 2
    err = capsys.readouterr().err  # a GGUF's conversion progress bar, then the error
    assert "Traceback" not in err and err.endswith("and run again\n"), err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"kvguard: error: {parent}") and "Is a directory" in last, err
    assert f"cannot write the model into {parent}" in last, err
