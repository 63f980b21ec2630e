"""The CPU kernels' build directories in the kvguard cache: one left by a process that died
while compiling (kill -9 skips the temporary directory's own clean-up) is removed by the next
load or build, and a build under way, which holds its directory's lock, is left alone. The pid
in a name is for people: in another pid namespace (a container; kvguard as PID 1 again after a
restart) it names no process, or a live one that is not the builder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.kernels import cpu_lowbit

DEAD = 999_999_999  # no such process
LOAD = """
import sys
from kvguard.kernels import cpu_lowbit
sys.exit(0 if cpu_lowbit.available() else 1)
"""


def leftovers(kernels: Path) -> tuple[list[Path], list[Path]]:
    """Build directories as a kill -9 mid-compile leaves them (objects written, the lock
    gone), one named for a pid that runs nowhere and one for a live process (this one: what a
    restarted PID 1 finds), and one of a build under way whose pid runs nowhere here (another
    container's), its lock held by `builds_under_way`."""
    dead = [
        kernels / f".tmp-{pid}-kvguard-cpu-0123456789abcdef-x1y2" for pid in (DEAD, os.getpid())
    ]
    live = [kernels / f".tmp-{DEAD}-kvguard-cpu-0123456789abcdef-z3w4"]
    for path in dead + live:
        path.mkdir(parents=True)
        (path / "lowbit.o").write_bytes(b"\x7fELF")
    return dead, live


@contextlib.contextmanager
def builds_under_way(paths: list[Path]) -> Iterator[None]:
    """Each directory's lock held, as the process compiling in it holds it."""
    with contextlib.ExitStack() as stack:
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            stack.callback(os.close, fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


def test_a_load_removes_abandoned_build_dirs_and_keeps_a_locked_one(tmp_path: Path) -> None:
    """The next start (a new process) finds the library cached (another process finished it)
    and only loads it: the abandoned builds' directories go all the same."""
    assert cpu_lowbit.available(), "the CPU kernels must build here for this test"
    cc = cpu_lowbit.compiler()
    assert cc is not None
    name = f"kvguard-cpu-{cpu_lowbit._key(cc)}.so"
    kernels = tmp_path / "kernels"
    dead, live = leftovers(kernels)
    shutil.copy(cpu_lowbit.cache_dir() / name, kernels / name)
    env = {**os.environ, "KVGUARD_HOME": str(tmp_path)}
    with builds_under_way(live):
        load = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True)
    assert load.returncode == 0, load.stderr
    assert [p for p in dead if p.exists()] == []
    assert all(p.is_dir() for p in live)
    assert sorted(kernels.iterdir()) == sorted([*live, kernels / name])  # loaded, not rebuilt


def test_a_build_removes_abandoned_build_dirs_and_leaves_none_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No library cached: the start compiles. Here the compiler fails at once (`false`), so
    the build ends without a library; the abandoned builds' directories are gone, the locked
    one stays, and the failed build removed its own."""
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    monkeypatch.setenv("CC", false)
    kernels = tmp_path / "kernels"
    dead, live = leftovers(kernels)
    assert cpu_lowbit.cpu_problem() is None, "the CPU kernels must be able to build here"
    with builds_under_way(live):
        assert cpu_lowbit.library.__wrapped__() is None  # the compile failed: torch's kernels
    assert [p for p in dead if p.exists()] == []
    assert sorted(kernels.iterdir()) == sorted(live)  # no library, no build of its own left
