"""The device run needs nothing the device image lacks (issue 18).

The device machine cannot download anything and its image has none of the daemon's own stack
(fastapi, pydantic, sqlalchemy, alembic, apscheduler, gguf, ...). These tests prove here, on
CPU, that bench/gpu_check.sh gets by with the image's packages plus what bench/gpu_prepare.sh
carries: first that the engine path never imports a daemon-only package, then the whole
`gpu_check.sh --cpu-smoke` in a venv that holds only the image's packages (bench/image_venv.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.image_venv import NOT_IN_IMAGE, build, image_packages  # noqa: E402

# A stand-in requirement for the prepare -> carry -> install path: the real list
# (bench/gpu_requirements.txt) is empty, and a tiny pure-Python wheel absent from the image
# shows the path works without touching what the check imports.
STAND_IN = "tomli-w==1.2.0"

BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not on the device image")
sys.meta_path.insert(0, Blocker())
from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
import kvguard.kernels.dispatch, kvguard.daemon.nvml, kvguard.engine.random_model
engine = LLMEngine.from_config(EngineConfig(model="tiny", device="cpu"), progress=False)
out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
print("served", out[0].token_ids)
"""


def _modules(names: frozenset[str]) -> set[str]:
    """Distribution names as modules (`prometheus-api-client` is `prometheus_api_client`)."""
    return {n.replace("-", "_") for n in names}


def test_engine_serves_the_tiny_model_without_daemon_packages(tmp_path: Path) -> None:
    """Fast and exact: those packages are made unimportable inside this very environment."""
    code = BLOCKER.format(blocked=sorted(_modules(NOT_IN_IMAGE)))
    env = os.environ | {"KVGUARD_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "served" in proc.stdout


def test_the_package_list_names_what_the_check_imports() -> None:
    listed = image_packages()
    for needed in ("torch", "triton", "transformers", "safetensors", "tokenizers", "pytest"):
        assert needed in listed
    assert not listed & NOT_IN_IMAGE


def test_prepare_downloads_device_wheels(tmp_path: Path) -> None:
    reqs = tmp_path / "req.txt"
    reqs.write_text(f"# a comment\n{STAND_IN}  # pinned\n\n")
    wheels = tmp_path / "wheels"
    _prepare(reqs, wheels)
    (whl,) = wheels.glob("*.whl")
    assert whl.name.startswith("tomli_w-1.2.0-")
    assert zipfile.is_zipfile(whl)


def test_default_requirements_need_no_wheels(tmp_path: Path) -> None:
    _prepare(ROOT / "bench" / "gpu_requirements.txt", tmp_path / "wheels")
    assert not list((tmp_path / "wheels").glob("*.whl"))


def _prepare(reqs: Path, dest: Path) -> None:
    env = os.environ | {"GPU_REQUIREMENTS": str(reqs), "WHEEL_DIR": str(dest), "PY": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_prepare.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def image_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv that sees only the image's packages (links into this environment: seconds)."""
    t0 = time.perf_counter()
    python = build(tmp_path_factory.mktemp("image") / "venv", image_packages())
    print(f"image venv built in {time.perf_counter() - t0:.1f}s")
    return python


def test_image_venv_lacks_the_daemon_stack(image_python: Path) -> None:
    for module in sorted(_modules(NOT_IN_IMAGE)) + ["kvguard"]:
        proc = subprocess.run(
            [str(image_python), "-c", f"import {module}"], capture_output=True, timeout=60
        )
        assert proc.returncode != 0, f"{module} is importable in the image venv"


def test_gpu_check_cpu_smoke_runs_on_the_image_packages(image_python: Path, tmp_path: Path) -> None:
    """The whole smoke run, with a prepared wheel carried and installed offline."""
    reqs = tmp_path / "req.txt"
    reqs.write_text(STAND_IN + "\n")
    wheels = tmp_path / "wheels"
    _prepare(reqs, wheels)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))} | {
        "PY": str(image_python),
        "OUT": str(out),
        "GPU_WHEELS": str(wheels),
        "KVGUARD_HOME": str(tmp_path / "home"),
        "PIP_NO_INDEX": "1",  # as on the device: nothing can be downloaded
    }
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu-smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    print(f"gpu_check.sh --cpu-smoke in the image venv: {time.perf_counter() - t0:.0f}s")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "installed prepared wheels: tomli_w-1.2.0-py3-none-any.whl" in proc.stdout
    smoke = ("gpu_kernels", "gpu_w4a16", "gpu_gemv", "gpu_e2e")
    for name in (f"{script}_smoke.json" for script in smoke):
        assert (out / name).is_file(), name
    assert "engine survives an injected OOM (CPU): met" in (out / "gpu_check.log").read_text()
