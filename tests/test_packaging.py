"""The wheel carries everything the daemon reads at run time, and builds without warnings.

kvguard's code folders are mapped into the `kvguard` namespace by pyproject.toml, and several of
them hold data rather than code: the systemd unit, the default rules, the alert rules and their
promtool tests, the Grafana dashboard, the config examples and the Alembic migrations. A data
file left out of the wheel only shows up on a server, as a missing file at start-up, so the
wheel is built here from a copy of the tracked tree (the repository is left untouched: no
build/ or *.egg-info appears in it) and its listing is checked.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("kernels", "engine", "rules", "daemon", "alerts", "migrations")
# What the daemon and an operator need from an installed kvguard, as paths inside the wheel.
REQUIRED = {
    "systemd unit": "kvguard/daemon/systemd/*.service",
    "default /etc config": "kvguard/daemon/systemd/etc/kvguard/config.yaml",
    "default rules": "kvguard/rules/default.yaml",
    "alert rules": "kvguard/alerts/*.yml",
    "Grafana dashboard": "kvguard/alerts/grafana/*.json",
    "config examples": "kvguard/daemon/examples/*.yaml",
    "promtool tests": "kvguard/alerts/tests/*.yml",
    "Alembic env": "kvguard/migrations/env.py",
    "Alembic template": "kvguard/migrations/script.py.mako",
    "migrations": "kvguard/migrations/versions/*.py",
    "license": "kvguard-*.dist-info/licenses/LICENSE",
}
# pip runs with PYTHONDONTWRITEBYTECODE=1 in some environments; distutils then says so. That is
# the environment talking, not a problem in our packaging configuration.
BENIGN = re.compile(r"byte-compiling is disabled")


def tracked_files() -> list[str]:
    """The tracked files of the folders that go into the wheel, plus what the build reads."""
    try:
        out = subprocess.run(
            [
                "git",
                "ls-files",
                "-z",
                "--",
                "pyproject.toml",
                "README.md",
                "LICENSE",
                *CODE_FOLDERS,
            ],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"`git ls-files` failed, so the tracked tree is unknown: {e}")
    # A file deleted in the working tree but not yet in the index is not part of the tree.
    return [p for p in out.decode().split("\0") if p and (REPO / p).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], str, list[str]]:
    """Build once: (names in the wheel, the build log, the tracked files copied)."""
    root = tmp_path_factory.mktemp("packaging")
    src, out = root / "src", root / "dist"
    files = tracked_files()
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    before = git_status()
    # No build isolation and no index: setuptools comes from the test environment, so this
    # takes seconds and works offline. -v makes pip show the backend's own warnings.
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--disable-pip-version-check", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_NO_INPUT": "1"},
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert git_status() == before, "building the wheel changed the repository"
    [whl] = out.glob("kvguard-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
    return names, log, files


def git_status() -> str:
    """Build leftovers in the repository (build/, dist/, *.egg-info), ignored ones included.

    Only these paths: other files may be edited while the tests run."""
    return subprocess.run(
        [
            "git",
            "status",
            "--porcelain",
            "--ignored",
            "--",
            "build",
            "dist",
            "*/build",
            "*.egg-info",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.mark.parametrize("what", REQUIRED)
def test_wheel_holds_runtime_data(wheel: tuple[set[str], str, list[str]], what: str) -> None:
    names, _, _ = wheel
    pattern = REQUIRED[what]
    # fnmatch's * also crosses "/": require the match to stay in the pattern's own folder.
    depth = pattern.count("/")
    assert any(fnmatch(n, pattern) and n.count("/") == depth for n in names), (
        f"{what}: nothing in the wheel matches {pattern}"
    )


def test_every_tracked_file_of_the_code_folders_is_in_the_wheel(
    wheel: tuple[set[str], str, list[str]],
) -> None:
    """A new sub-folder (engine/layers/, say) must be listed in pyproject.toml's packages."""
    names, _, files = wheel
    missing = [
        rel for rel in files if rel.split("/")[0] in CODE_FOLDERS and f"kvguard/{rel}" not in names
    ]
    assert not missing, f"tracked but not shipped (add to pyproject.toml): {missing}"


def test_build_prints_no_setuptools_warning(wheel: tuple[set[str], str, list[str]]) -> None:
    _, log, _ = wheel
    warnings = [
        line.strip()
        for line in log.splitlines()
        if re.search(r"warn", line, re.IGNORECASE) and not BENIGN.search(line)
    ]
    assert not warnings, "\n".join(warnings)
