"""Shared fixtures: the real default model and the tiny test model, from the real cache.

The models resolve through the default kvguard home ($KVGUARD_HOME or ~/.cache/kvguard), so
the first run fetches and converts smollm2-135m once and every later run reuses it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# transformers is the reference implementation in tests; it must never reach for the network.
# Triton reads TRITON_INTERPRET when it is first imported, and other imports (schemathesis,
# transformers) may pull it in before the kernel tests run: decide here, before anything else.
if os.environ.get("KVGUARD_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# CI runs on fresh machines with no example database: random examples there would make a red
# run a matter of luck. With `CI` set, every property test draws the same examples each run
# (derandomized, no database); local runs keep exploring and remember what failed.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# before transformers is imported: PyPI's `kernels`, not the repository's kernels/ folder
from bench.trace import prefer_installed_kernels  # noqa: E402

prefer_installed_kernels()

from kvguard.engine.config import kvguard_home  # noqa: E402
from kvguard.engine.model_registry import resolve_model  # noqa: E402
from kvguard.engine.model_registry import smollm2_gguf as ensure_smollm2_gguf  # noqa: E402


@pytest.fixture(scope="session")
def model_home() -> Path:
    """The default cache, shared across test runs (and with `kvguard` itself)."""
    return kvguard_home()


@pytest.fixture(scope="session")
def smollm2_dir(model_home: Path) -> Path:
    """smollm2-135m as a Hugging Face directory (fetched and converted on first use)."""
    return resolve_model("smollm2-135m", model_home, progress=False)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir: Path, model_home: Path) -> Path:
    """The GGUF that smollm2_dir was converted from: transformers' reference input."""
    return ensure_smollm2_gguf(model_home, progress=False)


@pytest.fixture(scope="session")
def tiny_dir(model_home: Path) -> Path:
    """The tiny random-weight Llama (seed 0) as a Hugging Face directory."""
    return resolve_model("tiny", model_home, progress=False)


@pytest.fixture(scope="module")
def smollm_engine():  # noqa: ANN201 - an LLMEngine
    """The default model, packed as served, on a small pool: one engine per test module."""
    from kvguard.engine import EngineConfig, LLMEngine

    config = EngineConfig(model="smollm2-135m", kv_cache_bytes="64MiB", num_threads=2)
    return LLMEngine.from_config(config, progress=False)


@pytest.fixture(scope="module")
def tiny_daemon(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a Daemon
    """A `kvguard serve` of the tiny model on loopback, stopped cleanly at the module's end."""
    from tests.test_server import Daemon

    d = Daemon(tmp_path_factory.mktemp("daemon"), debug_hooks=False)
    yield d
    assert d.stop() == 0
