"""The `kvguard worker` template unit, checked by systemd's own analyzer as an instance (rank 8),
with ExecStart= pointed at this venv's `kvguard` (verify insists that the binary exists)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from kvguard.daemon.cli_worker import KEY_CREDENTIAL
from tests.test_systemd import MAX_EXPOSURE, analyze, analyzer  # noqa: F401 - a fixture

UNIT = Path(__file__).resolve().parents[1] / "daemon" / "systemd" / "kvguard-worker@.service"
SHIPPED_EXEC = "ExecStart=/usr/local/bin/kvguard worker "


@pytest.fixture
def instance(tmp_path: Path) -> Path:
    script = Path(sys.executable).parent / "kvguard"
    exe = script if script.exists() else Path("/bin/true")
    text = UNIT.read_text()
    assert text.count(SHIPPED_EXEC) == 1, "the unit's ExecStart changed: update this test"
    path = tmp_path / "kvguard-worker@8.service"
    path.write_text(text.replace(SHIPPED_EXEC, f"ExecStart={exe} worker "))
    return path


def test_worker_unit_verifies_cleanly(analyzer: str, instance: Path) -> None:  # noqa: F811
    proc = analyze("verify", str(instance))
    assert (proc.returncode, proc.stderr, proc.stdout) == (0, "", "")


def test_worker_unit_exposure_is_low(analyzer: str, instance: Path) -> None:  # noqa: F811
    proc = analyze("security", "--offline=yes", "--no-pager", str(instance))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert m and float(m.group(1)) <= MAX_EXPOSURE, proc.stdout


def test_worker_unit_runs_its_instance_as_the_rank_and_comes_back() -> None:
    settings = [line.strip() for line in UNIT.read_text().splitlines()]
    exec_line = next(s for s in settings if s.startswith("ExecStart="))
    assert "--rank %i" in exec_line and "--master ${KVGUARD_MASTER}" in exec_line
    assert "--allow-network" not in exec_line  # the operator says so in worker.env
    assert "Restart=always" in settings  # it rejoins when the daemon is back
    assert f"LoadCredential={KEY_CREDENTIAL}:/etc/kvguard/worker.key" in settings
