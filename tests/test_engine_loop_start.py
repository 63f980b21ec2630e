"""`EngineLoop.start(factory)`: the engine is built on the thread that steps it; and
`EngineLoop.stop()` leaves nobody waiting.

The daemon builds its engine this way so that the thread stepping it is the only one holding
an OpenMP team (see `EngineLoop.start`); here: where the factory runs, that the loop then
serves, and that a failed build reaches the caller and leaves no thread behind. A stopped loop
ends the streams it fed with an error and refuses what waits for it and what comes after.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.engine_loop import EngineLoop, EngineUnavailable
from tests.test_server import until


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


def test_a_stop_ends_the_streams_and_refuses_what_waits_and_what_comes_after(
    tiny_dir: Path,
) -> None:
    """Before, only the fatal path did this: after a stop, an action posted while the loop was
    held, a call posted after the stop and a request in flight all waited forever."""
    cfg = EngineConfig(model=str(tiny_dir), kv_cache_bytes="8MiB", max_model_len=512)
    engine = LLMEngine.from_config(cfg, progress=False)
    loop = EngineLoop(engine)
    loop.on_step.append(lambda _snap: loop.paused.set())  # held after its first step
    loop.start()
    try:
        stream = loop.submit([5, 6, 7, 8], SamplingParams(max_tokens=400, ignore_eos=True))
        until(loop.paused.is_set, 60, "the loop held after the request's first step")
        posted = engine.set_max_num_seqs(4)  # an action, straight to the engine's mailbox
        called = loop.call(lambda: "ran")
    finally:
        loop.stop()
    assert not loop.alive
    with pytest.raises(EngineUnavailable, match="the engine loop has stopped"):
        posted.result(10)
    with pytest.raises(EngineUnavailable, match="the engine loop has stopped"):
        called.result(10)
    assert engine.knobs()["max_num_seqs"] != 4  # refused, never run
    out = stream.result(10)
    assert out.finished and out.finish_reason == "error"
    assert list(stream)[-1].finish_reason == "error"  # an iteration ends too
    assert loop.in_flight() == 0
    # posted after the stop: refused at once, not left for a step that will never come
    with pytest.raises(EngineUnavailable, match="the engine loop has stopped"):
        loop.call(lambda: "ran").result(0)
    with pytest.raises(EngineUnavailable, match="the engine loop has stopped"):
        loop.submit([1, 2], SamplingParams(max_tokens=2), timeout=0)


def test_queue_time_and_ttft_count_the_wait_for_the_engine_thread(tiny_dir: Path) -> None:
    """A request posted while the engine thread is busy (a long step, a stall) waits in the
    mailbox. Before, its arrival was stamped when the thread took it in, so that wait was in
    neither its queue time nor its TTFT: a 10 s stall read as 0.0 s queue time."""
    cfg = EngineConfig(model=str(tiny_dir), kv_cache_bytes="8MiB", max_model_len=512)
    loop = EngineLoop(LLMEngine.from_config(cfg, progress=False)).start()
    release = threading.Event()
    try:
        held = loop.call(lambda: release.wait(60))  # the engine thread is busy until released
        stream, added = loop.submit_nowait([5, 6, 7, 8], SamplingParams(max_tokens=2))
        posted = time.monotonic()  # the request was posted by now
        until(lambda: time.monotonic() - posted >= 0.5, 10, "half a second in the mailbox")
        release.set()
        assert held.result(60) is True and added.result(60)
        out = stream.result(60)
    finally:
        release.set()
        loop.stop()
    assert out.finished and out.queue_time_s is not None and out.ttft_s is not None
    assert out.queue_time_s >= 0.5, out.queue_time_s
    assert out.ttft_s >= out.queue_time_s
    # the Python API's own add_request: it arrives when it is added
    engine = loop.engine
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=1))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert 0.0 <= outs[-1].queue_time_s < 5.0  # from the add, not some other clock's 0
