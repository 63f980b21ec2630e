"""`EngineLoop.start(factory)`: the engine is built on the thread that steps it.

The daemon builds its engine this way so that the thread stepping it is the only one holding
an OpenMP team (see `EngineLoop.start`); here: where the factory runs, that the loop then
serves, and that a failed build reaches the caller and leaves no thread behind.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.engine_loop import EngineLoop


def test_the_factory_runs_on_the_loop_thread_which_then_serves(tiny_dir: Path) -> None:
    built_on: list[threading.Thread] = []

    def factory() -> LLMEngine:
        built_on.append(threading.current_thread())
        cfg = EngineConfig(model=str(tiny_dir), kv_cache_bytes="16MiB", num_threads=2)
        return LLMEngine.from_config(cfg, progress=False)

    loop = EngineLoop().start(factory)
    try:
        assert built_on[0] is loop._thread and built_on[0] is not threading.main_thread()
        out = loop.submit([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)).result(60)
        assert len(out.token_ids) == 6 and out.finished
    finally:
        loop.stop()
    assert not loop.alive


def test_a_failed_build_is_raised_to_the_caller_and_the_thread_ends() -> None:
    def factory() -> LLMEngine:
        raise FileNotFoundError("no model at /nowhere")

    loop = EngineLoop()
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        loop.start(factory)
    loop._thread.join(10)
    assert not loop.alive
