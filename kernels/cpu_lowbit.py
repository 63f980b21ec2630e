"""W4A8 and W8A8 CPU GEMMs (`lowbit.c`), compiled on first use and called through ctypes.

The same library carries the step kernels of `cpu_ops.c` (paged decode attention, RMSNorm,
RoPE; wrapped by `kvguard.kernels.cpu_ops`): one compile, one cache file, one load.

torch's CPU weight-only kernels multiply in bf16 or fp32; on AVX2 the fast way is integers:
activations quantised to int8 per block of 32, each block a `vpmaddubsw` dot with the 4-bit or
8-bit weight codes. With int16 activations and enough rows (`panel_rows()`, 16) FMAs win
instead: the kernel dequantises sixteen weight columns at a time into an fp32 panel and
multiplies the activations as they are. Which of them a row of a model step takes follows the
row's kind (`step_rows`): prompt rows always the prompt kernel, decode rows by how many
sequences decode, so a row's bits never depend on what else shares its step. Where the CPU has
AVX-512 VNNI the integer dots run
a VNNI copy compiled into the same library (`vnni()`; same bits); for 4-bit weights it leads
or ties the panels at any batch, so they take the dots at every batch there. Where it has
AMX (and Linux grants the tile state), 4-bit rows go to the tile unit: integer tiles from 16
rows (`amx()`; the dots' bits), and bf16 tiles summed in fp32 (`amx_bf16()`; two bf16 parts
of each weight and activation, as close to the fp32 product) for the rows of prompts of
`bf16_min_prompt()` tokens or more, at any count, and decode rows from 128 decoding sequences.
A bf16 call dequantises every weight it reads, so a few rows pay about what 32 cost on the dots
(SmolLM2: some 40 ms of one core): a shorter prompt's rows take the integer dots. The C source
ships with the package and is compiled once per source and flags into the kvguard cache
(`$KVGUARD_HOME/kernels`, default `~/.cache/kvguard/kernels`), written under a temporary name
and renamed, so two processes compiling at once both end with a whole library. The build
directory (`.tmp-<pid>-...`, the pid for people to read) is locked while its compile runs
(`locked_temp_dir`): one left by a process that died mid-build (kill -9) is removed by the next
load, in any pid namespace (a container's PID 1 again after a restart), and a compile still
running in another container on the same cache is left alone. The cache folders and the
library are made writable by their owner only, whatever the umask, and a cached library another
user could have written (theirs, writable by group or others, or in a folder others may write
to) is never loaded: it is built again where the folder is this user's, else torch's kernels
serve. ctypes drops the GIL for the call.

Without a C compiler, without AVX2/FMA/F16C, or off x86-64 Linux, `library()` is None (one log
line says why) and the quantized layer keeps torch's kernels.

OpenMP: the library is linked against the OpenMP runtime torch loaded (`torch/lib/libgomp*`), so
its parallel regions reuse torch's thread team instead of starting a second runtime whose
spinning threads would fight torch's for the cores.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvguard.kernels.env import env_flag, warn_unknown

log = logging.getLogger("kvguard.kernels")

# One library: the low-bit GEMMs, the step kernels of `cpu_ops` (attention, norm, RoPE) and
# the whole-layer decode call of `cpu_layer`.
SOURCES = tuple(Path(__file__).with_name(f) for f in ("lowbit.c", "cpu_ops.c", "decode_layer.c"))
# what the sources call of each other, and the integer dots lowbit.c compiles twice (AVX2, VNNI)
HEADERS = tuple(Path(__file__).with_name(f) for f in ("kvg_cpu.h", "lowbit_dots.h"))
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-fopenmp", "-std=c11")
CPU_FLAGS = ("avx2", "fma", "f16c")
# "0": decode attention reads blocks shared by several sequences per sequence (`shared_prefix`)
SHARED_PREFIX_ENV = "KVGUARD_SHARED_PREFIX"
# a whole number: the prompt length from which a prompt's rows take the bf16 tiles
BF16_MIN_PROMPT_ENV = "KVGUARD_BF16_MIN_PROMPT"
# SmolLM2 on a 2-core AMX Xeon: the tiles' prefill of a lone prompt ties the integer tiles'
# at 56-60 tokens and wins from 64 (README, "Where the CPU has AMX")
BF16_MIN_PROMPT = 64
BLOCK = 32  # activation and weight block: one scale per 32 values
# the largest `fine` (int16) activation code: 127 * 256 + 127, so each is 256 h + l with both
# h and l signed bytes (lowbit.c's FINE_LEVELS); int8 activations go to 127
FINE_LEVELS = 32639
PANELS_NEVER = 2**31 - 1  # a panel threshold no batch reaches (the C int's largest)
TILE = 8  # output columns a kernel tile computes side by side
# group and others' write bits: a library or cache folder with either is not trusted (`_unsafe`)
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
BUILD_PREFIX = ".tmp-"  # a build directory in the cache: .tmp-<pid>-<library>-<random>

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_INT = ctypes.c_int
_GEMM_ARGS = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _INT, _INT]
# the kernels a row of a `fine` GEMM can take (`kvg_pick_kernel` in lowbit.c): the integer dots
# (AVX2, VNNI, or the AMX integer tiles: the same bits), fp32 panels, AMX bf16 tiles
KERNELS = ("dots", "panels", "bf16")


def cache_dir() -> Path:
    """The kvguard cache (kernels may not import the engine's config: it sits above them)."""
    home = os.environ.get("KVGUARD_HOME") or Path.home() / ".cache" / "kvguard"
    return Path(home) / "kernels"


def compiler() -> str | None:
    """`$CC` when set (a path or a name on PATH), else `cc` or `gcc` on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (`avx2`, `avx512_vnni`, ...)."""
    text = Path("/proc/cpuinfo").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cpu_problem() -> str | None:
    """Why this CPU cannot run the kernels, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"{platform.system()}/{platform.machine()} is not x86-64 Linux"
    try:
        have = cpu_flags()
    except OSError as e:
        return f"cannot read /proc/cpuinfo ({e})"
    missing = [f for f in CPU_FLAGS if f not in have]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def torch_openmp() -> Path | None:
    """The OpenMP runtime torch ships and has loaded, if it ships one (`torch/lib/` in the CPU
    wheels, `torch.libs/` with a hashed name in the manylinux CUDA ones)."""
    root = Path(torch.__file__).parent
    for folder in (root / "lib", root.parent / "torch.libs"):
        libs = sorted(folder.glob("libgomp*.so*"))
        if libs:
            return libs[0]
    return None


def _build(cc: str, out: Path) -> None:
    """Compile then link against torch's libgomp (or the compiler's, when torch has none)."""
    gomp = torch_openmp()
    prefix = f"{BUILD_PREFIX}{os.getpid()}-{out.stem}-"  # the pid for people: see locked_temp_dir
    with locked_temp_dir(prefix, out.parent) as tmp:
        objs, lib = [tmp / f"{src.stem}.o" for src in SOURCES], tmp / out.name
        run = functools.partial(subprocess.run, check=True, capture_output=True, text=True)
        for src, obj in zip(SOURCES, objs, strict=True):
            run([cc, *CFLAGS, "-c", str(src), "-o", str(obj)])
        link = [str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp else ["-fopenmp"]
        run([cc, "-shared", *map(str, objs), "-o", str(lib), *link])
        fd = os.open(lib, os.O_RDONLY)
        try:  # its bytes on disk before its name: a crash must not leave an empty library
            os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~OTHERS_WRITE)  # see _unsafe
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(lib, out)  # atomic: a concurrent compile of the same key writes the same file


class _Unsafe(Exception):
    """The cache folder is one another user can write to: nothing in it is loaded."""


def _make_dirs(folder: Path) -> None:
    """Create `folder` and its missing parents writable by this user only, whatever the umask
    (`mkdir -p` under umask 000 makes them writable by all: see `_unsafe`)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process's, made the same way
            path.mkdir(mode=0o755)


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)  # root can replace any file anyway


def _unsafe_dir(folder: Path) -> str | None:
    """Why the libraries in `folder` may not be loaded: another user could put one there or
    replace one (it is theirs, or writable by others without the sticky bit), or None. A
    folder of this user's that others may write to is made writable by this user alone."""
    st = folder.stat()
    if st.st_uid == os.geteuid() and st.st_mode & OTHERS_WRITE:
        folder.chmod(stat.S_IMODE(st.st_mode) & ~OTHERS_WRITE)
        log.warning("%s: was writable by other users; made writable by its owner only", folder)
        return None
    if not _trusted(st.st_uid):
        return f"{folder} belongs to uid {st.st_uid}, another user: its libraries are not loaded"
    if st.st_mode & OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        return f"{folder} is writable by other users: its libraries are not loaded"
    return None


def _unsafe(path: Path) -> str | None:
    """Why the cached library `path` may not be loaded (code another user could have written,
    run in the daemon, which holds the admin token and sees every prompt), or None."""
    st = path.stat()
    if not _trusted(st.st_uid):
        return f"belongs to uid {st.st_uid}, another user"
    if st.st_mode & OTHERS_WRITE:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _remove_dead_builds(folder: Path) -> None:
    """Delete the build directories of processes that died while compiling (a kill -9 skips
    the temporary directory's own clean-up); a running build is left alone. Best effort: a
    folder it cannot list keeps its leftovers, and the kernels still load."""
    with contextlib.suppress(OSError):
        for path in folder.glob(f"{BUILD_PREFIX}*"):
            remove_if_abandoned(path)


# -- build directories owned by a lock -------------------------------------------------------
# Here because the kernels may not import the engine, and the model cache (engine/
# model_registry.py) builds, downloads and trashes its directories the same way.
@contextlib.contextmanager
def locked_temp_dir(prefix: str, parent: Path) -> Iterator[Path]:
    """A new directory in `parent` (`tempfile.mkdtemp`'s, named `prefix` + random), removed on
    exit, that `remove_if_abandoned` leaves alone for as long as this runs.

    Its owner holds an exclusive flock on it until then, which the kernel drops when the
    process dies, however it dies (kill -9, the OOM killer). A lock, unlike the pid in the name
    (kept for people to read), means the same in every pid namespace: a container whose kvguard
    is PID 1 again after a kill finds its leftovers free to remove, and another container on
    the same cache volume never removes a build that is still running."""
    path, fd = _new_locked_dir(prefix, parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if fd is not None:
            os.close(fd)


def _new_locked_dir(prefix: str, parent: Path) -> tuple[Path, int | None]:
    """mkdtemp, then its lock: made again where a cleaner took the new directory in the
    instant before it was locked. The fd is None on a filesystem without flock (some NFS
    mounts): there, cleaners judge by the pid in the name."""
    while True:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:  # a cleaner removed it already
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a cleaner holds it, to remove it
            os.close(fd)
            continue
        except OSError:
            os.close(fd)
            return path, None
        if _still_at(path, fd):
            return path, fd
        os.close(fd)  # removed (or replaced) before the lock was taken


def remove_if_abandoned(path: Path) -> None:
    """Remove a build, trash or download directory whose owner is gone: one whose lock can be
    taken (see `locked_temp_dir`; a trash directory is never locked: it is garbage from the
    moment it is named). Kept while its owner holds the lock, and where it cannot be opened
    (gone meanwhile, or another user's to read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        if _abandoned(path, fd) and _still_at(path, fd):
            shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)  # the lock, if taken, goes with it


def _abandoned(path: Path, fd: int) -> bool:
    """Whether no process holds `path`'s lock (taking it, so its owner cannot start using it
    now); where the filesystem has no flock, whether the pid in its name is not running."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return not pid_alive((path.name.split("-") + [""])[1])
    return True


def _still_at(path: Path, fd: int) -> bool:
    """Whether `path` still names the directory open at `fd` (it was not removed, or renamed
    away and another put in its place, between the open and the lock)."""
    try:
        st = path.stat()
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino) and held.st_nlink > 0


def pid_alive(text: str) -> bool:
    """Whether the process numbered `text` runs (False for text that is no number): who owns
    a build directory where the filesystem cannot lock it (`_abandoned`)."""
    try:
        os.kill(int(text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _key(cc: str) -> str:
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join((cc, *CFLAGS, str(torch_openmp()))).encode())
    return h.hexdigest()[:16]


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name in ("kvg_w4a8", "kvg_w8a8", "kvg_w8a8v"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _GEMM_ARGS, ctypes.c_int
    for name in ("kvg_w4a8_rows", "kvg_w8a8_rows"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [*_GEMM_ARGS, _I64, _I64, _I64], ctypes.c_int
    lib.kvg_pick_kernel.argtypes = [_INT, _INT, _I64, _INT, _INT, _INT]
    lib.kvg_pick_kernel.restype = _INT
    lib.kvg_vnni.argtypes, lib.kvg_vnni.restype = [_INT], _INT
    lib.kvg_amx.argtypes, lib.kvg_amx.restype = [_INT], _INT
    lib.kvg_amx_bf16.argtypes, lib.kvg_amx_bf16.restype = [_INT], _INT
    lib.kvg_attn512.argtypes, lib.kvg_attn512.restype = [_INT], _INT
    lib.kvg_shared_prefix.argtypes, lib.kvg_shared_prefix.restype = [_INT], _INT
    lib.kvg_shared_prefix_calls.argtypes, lib.kvg_shared_prefix_calls.restype = [], _I64
    if not env_flag(SHARED_PREFIX_ENV, True):
        lib.kvg_shared_prefix(0)
    lib.kvg_pack4.argtypes, lib.kvg_pack4.restype = [_PTR, _I64, _I64, _PTR, _INT], None
    lib.kvg_quantize_rows.argtypes = [_PTR, _I64, _I64, _I64, _INT, _PTR, _PTR, _PTR]
    lib.kvg_quantize_rows.restype = ctypes.c_int
    _F = ctypes.c_float
    lib.kvg_paged_decode.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
    lib.kvg_paged_decode.argtypes += [_INT, _I64, _I64, _I64, _I64, _PTR, _I64, _F, _INT]
    lib.kvg_paged_decode.restype = ctypes.c_int
    lib.kvg_paged_prefill.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR]
    lib.kvg_paged_prefill.argtypes += [_PTR, _INT, _I64, _I64, _I64, _I64, _PTR, _I64, _F, _INT]
    lib.kvg_paged_prefill.restype = ctypes.c_int
    lib.kvg_argmax_rows.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _INT]
    lib.kvg_argmax_rows.restype = None
    lib.kvg_topk_rows.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _INT]
    lib.kvg_topk_rows.restype = ctypes.c_int
    lib.kvg_topp_rows.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT]
    lib.kvg_topp_rows.restype = ctypes.c_int
    lib.kvg_rmsnorm.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _PTR, _F, _PTR, _INT]
    lib.kvg_rmsnorm.restype = None
    lib.kvg_rope.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _INT]
    lib.kvg_rope.restype = None
    lib.kvg_silu_mul.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _INT]
    lib.kvg_silu_mul.restype = None
    lib.kvg_write_kv.argtypes = [_PTR, _PTR, _INT, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64]
    lib.kvg_write_kv.restype = ctypes.c_int
    lib.kvg_convert_blocks.argtypes = [_PTR, _PTR, _INT, _I64, _PTR, _PTR, _INT, _I64, _PTR]
    lib.kvg_convert_blocks.argtypes += [_PTR, _I64, _I64, _I64, _I64, _INT]
    lib.kvg_convert_blocks.restype = ctypes.c_int
    lib.kvg_decode_layer.argtypes = [_PTR] * 9
    lib.kvg_decode_layer.restype = ctypes.c_int
    lib.kvg_refine8v.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64]
    lib.kvg_refine8v.argtypes += [_PTR, _PTR, _PTR, _I64, _INT]
    lib.kvg_refine8v.restype = None
    lib.kvg_exact8v.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64]
    lib.kvg_exact8v.argtypes += [_PTR, _PTR, _PTR, _I64, _INT]
    lib.kvg_exact8v.restype = None
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) where they cannot run here."""
    problem = cpu_problem()
    cc = compiler()
    if problem is None and cc is None:
        problem = f"no C compiler ({'$CC=' + os.environ['CC'] if os.environ.get('CC') else 'cc'})"
    if problem is None:
        path = cache_dir() / f"kvguard-cpu-{_key(cc)}.so"
        try:
            if not path.parent.is_dir():
                _make_dirs(path.parent)
            folder_problem = _unsafe_dir(path.parent)
            if folder_problem is not None:
                raise _Unsafe(folder_problem)
            # at every load, not only a build: a crash's leftovers go
            _remove_dead_builds(path.parent)
            cached = path.exists()
            why = _unsafe(path) if cached else None
            if why is not None and path.parent.stat().st_uid != os.geteuid():
                raise _Unsafe(f"{path} {why}, and its folder is not this user's to build it in")
            if why is not None:
                log.warning("%s %s: not loaded; building it again", path, why)
                path.unlink()
                cached = False
            if not cached:
                _build(cc, path)
            try:
                return _load(path)
            except OSError as e:  # a cached library that is corrupt (empty, truncated)
                if not cached:
                    raise
                log.warning("%s: cannot be loaded (%s); building it again", path, e)
                path.unlink(missing_ok=True)
                _build(cc, path)
                return _load(path)
        except _Unsafe as e:
            problem = str(e)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            problem = f"building {path.name} failed: {detail.strip()[:500]}"
    log.warning(
        "CPU low-bit kernels unavailable (%s): quantized layers use torch's kernels", problem
    )
    return None


def available() -> bool:
    return library() is not None


@dataclass(frozen=True, slots=True)
class StepRows:
    """A model step's rows as its projections see them: of `rows`, the first `decode` are
    decode rows (each decoding sequence's last token, and the speculative drafts verified after
    it) of `decoding` sequences, the next `short` the rows of prompts shorter than
    `bf16_min_prompt()`, the rest prompt rows (prefill chunks of longer prompts). A `fine` GEMM
    over the step's rows gives each kind its own kernel (`kvg_pick_kernel` in lowbit.c):
    prompt rows the one a GEMM of unbounded rows takes (fp32 panels unless `panel_rows()` is
    `PANELS_NEVER`; AMX bf16 tiles where those serve 4-bit weights), short prompts' rows the
    same with the bf16 tiles off, decode rows the one a GEMM of `decoding` rows takes, so that
    verify rows take what plain decode takes."""

    rows: int
    decode: int
    decoding: int
    short: int = 0


# The step whose forward runs on this thread (`step_rows`). A context variable: each thread
# (and asyncio task) sees its own, so a step on one thread cannot change another's kernels.
_STEP_ROWS: contextvars.ContextVar[StepRows | None] = contextvars.ContextVar(
    "kvguard_step_rows", default=None
)


@contextlib.contextmanager
def step_rows(rows: StepRows | None) -> Iterator[None]:
    """While the block runs, GEMMs on this thread over `rows.rows` activation rows (the
    step's projections, per-op or in `cpu_layer`'s C call) pick each row's kernel by its kind;
    None (and any GEMM of another row count: the lm_head over the sampled rows, a test's)
    picks by the call's row count, as a GEMM that knows nothing of a step does."""
    token = _STEP_ROWS.set(rows)
    try:
        yield
    finally:
        _STEP_ROWS.reset(token)


def row_kinds(rows: int) -> tuple[int, int, int] | None:
    """(decode rows first, the count they pick their kernel by, the short prompts' rows after
    them) for a GEMM of `rows` activation rows inside `step_rows`, or None where no step's
    layout applies."""
    step = _STEP_ROWS.get()
    if step is None or step.rows != rows:
        return None
    return step.decode, step.decoding, step.short


def pick_kernel(
    bits: int,
    fine: bool,
    count: int,
    prompt: bool,
    vnni: bool,
    bf16: bool = False,
    short: bool = False,
) -> str:
    """The kernel (`KERNELS`) the C GEMMs give rows of one kind: `prompt` rows (a prompt
    shorter than `bf16_min_prompt()`: `short`), or decode rows of a step with `count` decoding
    sequences (a GEMM outside a step: its rows), on a CPU whose integer dots run their VNNI
    copy (`vnni`) and, for 4-bit weights, with the AMX bf16 tiles on (`bf16`) or not, at the
    current `panel_rows()`. The CPU is an argument so that every path's rule can be asked
    anywhere; bits 9 is the vertical 8-bit layout."""
    lib = library()
    assert lib is not None, "cpu_lowbit.library() is None: check available() first"
    kind = (2 if short else 1) if prompt else 0  # lowbit.c's KVG_DECODE_ROWS .. SHORT_PROMPT
    return KERNELS[lib.kvg_pick_kernel(bits, int(fine), count, kind, int(vnni), int(bf16))]


_bf16_min_prompt: int | None = None  # `bf16_min_prompt`'s value once read or set


def bf16_min_prompt(n: int | None = None) -> int:
    """From how many tokens a prompt's rows take the AMX bf16 tiles (where `amx_bf16()` is on;
    a shorter prompt's rows take what they take with it off: the integer dots, or the integer
    tiles from 16 rows, the same bits). The length is the whole text a sequence prefills (a
    request's prompt; a preempted sequence's prompt and output so far, recomputed), never a
    chunk's, so a prompt gets the same bits however it is chunked, whether the prefix cache
    gave part of it, whatever is prefilled beside it. `BF16_MIN_PROMPT` (64) unless
    `KVGUARD_BF16_MIN_PROMPT` says otherwise when first asked (a whole number, 0 or more; 0:
    every prompt on the tiles, as before). `n` sets it (tests, benchmarks); the model runner
    reads it as it lays out each step (rank 0's, sent to every rank with the step). Needs no
    library. Returns the value before."""
    global _bf16_min_prompt
    if _bf16_min_prompt is None:
        _bf16_min_prompt = BF16_MIN_PROMPT
        raw = os.environ.get(BF16_MIN_PROMPT_ENV, "").strip()
        if raw:
            if raw.isdigit():
                _bf16_min_prompt = int(raw)
            else:
                warn_unknown(
                    BF16_MIN_PROMPT_ENV, raw, "a whole number", f"{BF16_MIN_PROMPT}, its default"
                )
    before = _bf16_min_prompt
    if n is not None:
        if n < 0:
            raise ValueError(f"bf16_min_prompt({n}): a prompt length is 0 or more")
        _bf16_min_prompt = n
    return before


def _gemm(
    fn: str,
    x: torch.Tensor,
    n: int,
    codes: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    group: int,
    fine: bool,
) -> torch.Tensor:
    lib = library()
    assert lib is not None, "cpu_lowbit.library() is None: check available() first"
    x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    out = torch.empty(rows, n)
    if rows:
        mp = None if m is None else m.data_ptr()
        threads = torch.get_num_threads()
        args = (
            x.data_ptr(), rows, k, x.stride(0), codes.data_ptr(), d.data_ptr(), mp, n,
            group // BLOCK, out.data_ptr(), n, threads, int(fine),
        )  # fmt: skip
        kinds = row_kinds(rows) if fine else None  # int8 rows take the dots at any batch
        rc = getattr(lib, fn)(*args) if kinds is None else getattr(lib, f"{fn}_rows")(*args, *kinds)
        if rc == -1:
            raise MemoryError(f"{fn}: no memory for the {rows}x{k} activation workspace")
        if rc:
            raise ValueError(f"{fn}: in_features {k} / group {group} do not fit the layout")
    return out


def panel_rows(rows: int | None = None, bits: int = 4) -> int:
    """From how many activation rows a `fine` GEMM of `bits`-bit weights multiplies fp32 panels
    of the dequantised weight instead of int16 dots (`gemm_panels` in lowbit.c), on the dots
    this process runs: 16 (8-bit weights, and 4-bit ones on the AVX2 dots), never
    (`PANELS_NEVER`: 4-bit weights on the VNNI dots, which lead or tie the panels at every
    batch). In a model step (`step_rows`) its decode rows count the step's decoding sequences
    against it, and its prompt rows take panels at any length unless it is `PANELS_NEVER`.
    `rows` sets that threshold (tests, benchmarks: `PANELS_NEVER` keeps the integer dots at any
    batch, prompts included; 1 puts every batch on panels). Returns the value before."""
    lib = library()
    assert lib is not None, "cpu_lowbit.library() is None: check available() first"
    name = "kvg_panel_rows_vnni4" if bits == 4 and vnni() else "kvg_panel_rows"
    var = ctypes.c_int.in_dll(lib, name)
    before = var.value
    if rows is not None:
        var.value = max(1, min(rows, PANELS_NEVER))
    return before


def vnni(on: bool | None = None) -> bool:
    """Whether the integer dots (int16 rows below `panel_rows()`, any int8 rows) run their
    AVX-512 VNNI copy: on by default where the CPU has AVX-512 F/BW/VL/VNNI, same bits as the
    AVX2 copy. `on` switches it (tests, benchmarks); True on a CPU without VNNI raises
    ValueError. Returns the state before."""
    return _switch("kvg_vnni", on, "this CPU lacks AVX-512 VNNI: the integer dots stay on AVX2")


def _switch(fn: str, on: bool | None, refusal: str) -> bool:
    """Read (`on` None) or set one of the library's CPU-path switches; the state before."""
    lib = library()
    assert lib is not None, "cpu_lowbit.library() is None: check available() first"
    before = getattr(lib, fn)(-1 if on is None else int(on))
    if before == -2:
        raise ValueError(refusal)
    return bool(before)


def amx(on: bool | None = None) -> bool:
    """Whether `fine` 4-bit GEMMs of 16 rows or more (prompt chunks) run on the AMX tile unit:
    on by default where the CPU has AMX-INT8 (and AVX-512 VNNI) and Linux grants the tile
    state, same bits as the VNNI dots. `on` switches it (tests, benchmarks); True where AMX is
    not available raises ValueError. Returns the state before: the switch's own, which runs
    only with `vnni()` on."""
    return _switch(
        "kvg_amx", on, "no AMX here (the CPU lacks AMX-INT8 or Linux refused the tile state)"
    )


def amx_bf16(on: bool | None = None) -> bool:
    """Whether `fine` 4-bit GEMMs run prompt rows of prompts of `bf16_min_prompt()` tokens or
    more (at any count: a prompt's rows take one kernel however it is chunked) and decode rows
    from 128 decoding sequences as bf16 tiles in fp32
    accumulators: weights dequantised sixteen columns at a time and, like the activations,
    split into two bf16 parts (about 2^-16 of each value kept), no per-block scaling. On by
    default where the CPU has AMX-BF16 and Linux grants the tile state; not the integer dots'
    bits but as close to the unquantised product (about 1.5e-5 of the largest output against
    2e-5 for the int16 dots). `on` switches it; True where it is not available raises
    ValueError. Returns the state before: the switch's own, which runs only with `amx()` and
    `vnni()` on."""
    return _switch(
        "kvg_amx_bf16", on, "no AMX-BF16 here (the CPU lacks it or Linux refused the tile state)"
    )


def attention512(on: bool | None = None) -> bool:
    """Whether prefill attention runs its AVX-512 copy (sixteen queries a vector, not eight):
    on by default where the CPU has AVX-512 F/BW/VL/DQ, same bits as the AVX2 copy. `on`
    switches it (tests, benchmarks); True on a CPU without AVX-512 raises ValueError. Returns
    the state before."""
    return _switch("kvg_attn512", on, "this CPU lacks AVX-512: prefill attention stays on AVX2")


def shared_prefix(on: bool | None = None) -> bool:
    """Whether decode attention reads blocks that several sequences share (a prefix-cache
    hit) once for all of them, their queries taken together: on by default (every CPU), off
    where the environment says `KVGUARD_SHARED_PREFIX=0` when the library loads. Not the same
    bits as reading them per sequence (a sequence's softmax is merged from its shared and own
    parts, as split-K merges); one sequence's several rows (a verify step's drafts, a
    grammar's forced tokens) are never grouped, each keeping its one-token step's bits. `on`
    switches it (tests, benchmarks). Returns the state before."""
    return _switch("kvg_shared_prefix", on, "")


def shared_prefix_calls() -> int:
    """Decode attention calls that read blocks once for several sequences (one call a layer a
    step), since the library loaded."""
    lib = library()
    assert lib is not None, "cpu_lowbit.library() is None: check available() first"
    return int(lib.kvg_shared_prefix_calls())


def w4a8(
    x: torch.Tensor,
    n: int,
    codes: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,
    group: int,
    fine: bool = False,
) -> torch.Tensor:
    """`x [M, K] @ W.T` (fp32) for `n` output columns of 4-bit codes (`pack4`)
    with `w = d * q + m` per group (`tile_columns`). Activations in int8 per block of 32, or
    `fine`: int16 (two integer dots, high and low signed bytes), and from `panel_rows()` rows
    unquantised: fp32 FMAs over the weight dequantised sixteen columns at a time (inside
    `step_rows`, over the step's rows: each row by its kind)."""
    return _gemm("kvg_w4a8", x, n, codes, d, m, group, fine)


def w8a8(
    x: torch.Tensor,
    n: int,
    codes: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    group: int,
    fine: bool = False,
) -> torch.Tensor:
    """`x [M, K] @ W.T` (fp32) for `n` output columns of signed 8-bit codes (`pad_columns`)
    with `w = d * q (+ m)` per group (`tile_columns`); `fine` (int16 dots, codes widened once
    per block for four rows; fp32 panels from `panel_rows()` rows) as in `w4a8`."""
    return _gemm("kvg_w8a8", x, n, codes, d, m, group, fine)


def w8a8v(
    x: torch.Tensor,
    n: int,
    codes: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """`w8a8` with int8 activations over 8-bit codes in the vertical layout (`pack8v`): each
    column's dot in its own lane, no horizontal sums; the same bits as `w8a8` (not `fine`) on
    the same weights."""
    return _gemm("kvg_w8a8v", x, n, codes, d, m, group, False)


def refine8v(
    logits: torch.Tensor,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    codes: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """`logits[r, ids[r]] = hidden[r] @ W[ids[r]].T` in fp32, in place, W the exact weight of
    vertical 8-bit codes (`pack8v`, `w = d (q - 128) + m` per group): the refined lm_head's
    recomputation of its best candidates, without dequantising them to a tensor first.
    `logits` fp32 `[M, N]` with unit stride along its rows, `hidden` `[M, K]`, `ids` int64
    `[M, k]` (column ids below N, rows of `codes`' tiles)."""
    lib = library()
    assert lib is not None, "cpu_lowbit.library() is None: check available() first"
    rows, k = ids.shape
    hidden, ids = hidden.float(), ids.contiguous()
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and ids.dtype == torch.int64
    assert hidden.shape[0] == logits.shape[0] == rows and hidden.shape[1] == codes.shape[1] * BLOCK
    if rows and k:
        lib.kvg_refine8v(
            logits.data_ptr(), rows, logits.stride(0), hidden.data_ptr(), hidden.shape[1],
            hidden.stride(0), ids.data_ptr(), k, codes.data_ptr(), d.data_ptr(),
            None if m is None else m.data_ptr(), group // BLOCK, torch.get_num_threads(),
        )  # fmt: skip
    return logits


def exact8v(
    hidden: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, group: int
) -> torch.Tensor:
    """`hidden @ W.T` in fp32 `[M, N]` over every column of vertical 8-bit codes (`pack8v`, N
    their padded column count): each logit the very bits `refine8v` gives it, whatever M or
    the thread count (the exact head a request's log-probabilities come from)."""
    lib = library()
    assert lib is not None, "cpu_lowbit.library() is None: check available() first"
    hidden = hidden.float()
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    rows, n = hidden.shape[0], codes.shape[0] * TILE
    assert hidden.shape[1] == codes.shape[1] * BLOCK
    out = torch.empty(rows, n)
    if rows:
        lib.kvg_exact8v(
            out.data_ptr(), rows, n, hidden.data_ptr(), hidden.shape[1], hidden.stride(0), n,
            codes.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(), group // BLOCK,
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def pack8v(q: torch.Tensor) -> torch.Tensor:
    """8-bit codes `[N, K]` (unsigned 0..255, the weight being `d (q - 128) + m`; N padded with
    zero rows to a multiple of the 8-column tile) as `w8a8v` reads them, `[ceil(N/8), K/32,
    256]` bytes: for tile t and block b, byte `32j + 4c + i` holds weight `32b + 4j + i` of
    column `8t + c`. K % 32 == 0."""
    n, k = q.shape
    q = pad_columns(q.to(torch.uint8))
    v = q.reshape(-1, TILE, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # t b j c i
    return v.reshape(-1, k // BLOCK, TILE * BLOCK).contiguous()


def unpack8v(codes: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`pack8v` undone: the unsigned codes `[N_padded, K]`, or only the columns `rows` (a
    column's four consecutive codes are one 32-bit word: gathered as words, a tenth of the
    time of gathering bytes for a 512-token prompt's embedding rows)."""
    tiles, nb, _ = codes.shape
    words = codes.view(torch.int32).view(tiles, nb, 8, TILE)  # t b j c
    v = words.permute(0, 3, 1, 2) if rows is None else words[rows // TILE, :, :, rows % TILE]
    return v.reshape(-1, nb * 8).contiguous().view(torch.uint8)  # K/4 words a column: K codes


def pack4(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes `[N, K]` (0..15; N padded with zero rows to a multiple of the 8-column
    tile) as the kernels read them, `[ceil(N/8), K/32, 128]` bytes: for tile t and block b,
    byte `32j + 4c + i` holds weight `32b + 8j + i` of column `8t + c` in its low nibble and
    weight `32b + 8j + 4 + i` in its high one. K % 32 == 0."""
    n, k = q.shape
    lib = library()
    if lib is not None and q.device.type == "cpu" and k % BLOCK == 0:  # one pass in C
        q = q.to(torch.uint8).contiguous()
        out = torch.empty(-(-n // TILE), k // BLOCK, TILE * BLOCK // 2, dtype=torch.uint8)
        lib.kvg_pack4(q.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
        return out
    return pack4_reference(q)


def pack4_reference(q: torch.Tensor) -> torch.Tensor:
    """`pack4` in tensor operations (no C library; the tests' reference)."""
    n, k = q.shape
    q = pad_columns(q.to(torch.uint8))
    v = q.reshape(-1, TILE, k // BLOCK, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # t b j c i lo/hi
    return (v[..., 0] | (v[..., 1] << 4)).reshape(-1, k // BLOCK, TILE * BLOCK // 2).contiguous()


def unpack4(codes: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`pack4` undone: the codes `[N_padded, K]` (0..15), or only the columns `rows`."""
    tiles, nb, _ = codes.shape
    v = codes.reshape(tiles, nb, 4, TILE, 4)  # t b j c i
    # every column (t c b j i), or only the rows asked for ((row) b j i)
    v = v.permute(0, 3, 1, 2, 4) if rows is None else v[rows // TILE, :, :, rows % TILE]
    v = torch.stack([v & 15, v >> 4], dim=-2)  # ... b j lo/hi i
    return v.reshape(-1, nb * BLOCK)


def tile_columns(t: torch.Tensor) -> torch.Tensor:
    """Per-group values `[N, G]` as the kernels read them: `[ceil(N/8), G, 8]` fp16 (eight
    output columns side by side), padding columns zero."""
    n, groups = t.shape
    t = F.pad(t.to(torch.float16), (0, 0, 0, -n % TILE))
    return t.reshape(-1, TILE, groups).transpose(1, 2).contiguous()


def untile_columns(t: torch.Tensor, n: int) -> torch.Tensor:
    """`tile_columns` undone: `[N, G]`."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def pad_columns(codes: torch.Tensor) -> torch.Tensor:
    """Codes `[N, ...]` padded with zero rows to a multiple of the eight-column tile (as they
    are where N is one already: no copy of a matrix, which loading a large model paid for
    every projection)."""
    if codes.shape[0] % TILE == 0:
        return codes.contiguous()
    return F.pad(codes, (0, 0, 0, -codes.shape[0] % TILE)).contiguous()


def quantize_rows(
    x: torch.Tensor, fine: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' activation quantisation: (codes [M, K], block scale [M, K/32], block
    sum [M, K/32]) with `x ~ scale * code`; int8 codes (up to 127), or `fine` int16 (up to
    `FINE_LEVELS`; the 4-bit kernels hold each as two signed bytes, `256 h + l`: recombined
    here). A block holding a NaN or an infinity has codes 0 and a NaN scale and sum (so the
    GEMMs give every output of its row NaN); a block whose scale `L / amax` is not a finite
    float (all zeros, or |x| under about 1e-36) has codes 0 and scale 0."""
    lib = library()
    assert lib is not None
    x = x.float().contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int16 if fine else torch.int8)
    e, es = torch.empty(rows, k // BLOCK), torch.empty(rows, k // BLOCK)
    rc = lib.kvg_quantize_rows(
        x.data_ptr(), rows, k, k, int(fine), q.data_ptr(), e.data_ptr(), es.data_ptr()
    )
    if rc:
        raise MemoryError("quantize_rows: no memory for one row's scratch")
    return q, e, es
