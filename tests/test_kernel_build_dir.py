"""The CPU kernels' build directories in the kvguard cache: one left by a process that died
while compiling (kill -9 skips the temporary directory's own clean-up) is removed by the next
load or build, and a live process's build is left alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
    """A dead process's build directory (as a kill -9 mid-compile leaves it: objects written)
    and a live one's (this process's: a build under way)."""
    dead = [kernels / f".tmp-{DEAD}-kvguard-cpu-0123456789abcdef-x1y2"]
    live = [kernels / f".tmp-{os.getpid()}-kvguard-cpu-0123456789abcdef-z3w4"]
    for path in dead + live:
        path.mkdir(parents=True)
        (path / "lowbit.o").write_bytes(b"\x7fELF")
    return dead, live


def test_a_load_removes_a_dead_process_build_dir_and_keeps_a_live_one(tmp_path: Path) -> None:
    """The next start (a new process) finds the library cached (another process finished it)
    and only loads it: the dead build's directory goes all the same."""
    assert cpu_lowbit.available(), "the CPU kernels must build here for this test"
    cc = cpu_lowbit.compiler()
    assert cc is not None
    name = f"kvguard-cpu-{cpu_lowbit._key(cc)}.so"
    kernels = tmp_path / "kernels"
    dead, live = leftovers(kernels)
    shutil.copy(cpu_lowbit.cache_dir() / name, kernels / name)
    env = {**os.environ, "KVGUARD_HOME": str(tmp_path)}
    load = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True)
    assert load.returncode == 0, load.stderr
    assert [p for p in dead if p.exists()] == []
    assert all(p.is_dir() for p in live)
    assert sorted(kernels.iterdir()) == sorted([*live, kernels / name])  # loaded, not rebuilt


def test_a_build_removes_a_dead_process_build_dir_and_leaves_none_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No library cached: the start compiles. Here the compiler fails at once (`false`), so
    the build ends without a library; the dead build's directory is gone, the live one's
    stays, and the failed build removed its own."""
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    monkeypatch.setenv("CC", false)
    kernels = tmp_path / "kernels"
    dead, live = leftovers(kernels)
    assert cpu_lowbit.cpu_problem() is None, "the CPU kernels must be able to build here"
    assert cpu_lowbit.library.__wrapped__() is None  # the compile failed: torch's kernels
    assert [p for p in dead if p.exists()] == []
    assert sorted(kernels.iterdir()) == sorted(live)  # no library, no build of its own left
