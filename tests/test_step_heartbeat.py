"""A step's forward beats the engine loop's heartbeat after each decoder layer.

The systemd watchdog pings and /ready follow that heartbeat. It used to move only between
steps (and during a KV conversion), so one long prompt step (a valid 8000-token prompt of the
default model, or a default 2048-token step of a 7B model on a CPU: longer than the unit's
WatchdogSec=30s) stopped the pings, and systemd killed the daemon in the middle of the request.
A step computing is progress: the heartbeat now moves after every layer on each path a step
runs (the per-op torch layers, the packed CPU path's one C call a layer, rank 0 of a
tensor-parallel group), while nothing beats inside a layer, so one that never returns still
stops the beats.

Deterministic without timing: a watched layer records the heartbeat when it starts and ends,
and the clock when it ends; the next layer must then see a heartbeat no older than that clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.cpu_decode import CpuDecode
from kvguard.engine.engine_loop import EngineLoop
from kvguard.engine.model import DecoderLayer
from kvguard.kernels import cpu_layer

PROMPT = [3 + (7 * j) % 300 for j in range(64)]  # inside the tiny model's 320 ids
THREE_STEPS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)  # prompt + 2 decode


@dataclass(frozen=True, slots=True)
class LayerCall:
    beat_in: float  # the heartbeat as the layer started
    beat_out: float  # the heartbeat as it returned
    ended: float  # the clock as it returned


def watch_layers(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, loop: EngineLoop
) -> list[LayerCall]:
    """Wrap the layer call `owner.name` (a step's unit of work, on the engine thread): each
    call's heartbeats and end, in order."""
    calls: list[LayerCall] = []
    layer = getattr(owner, name)

    def watched(*args: object, **kw: object) -> object:
        beat_in = loop.last_beat
        out = layer(*args, **kw)
        calls.append(LayerCall(beat_in, loop.last_beat, time.monotonic()))
        return out

    monkeypatch.setattr(owner, name, watched)
    return calls


def serve_one(loop: EngineLoop) -> None:
    out = loop.submit(PROMPT, THREE_STEPS).result(120)
    assert out.finished and len(out.token_ids) == THREE_STEPS.max_tokens


def assert_beats_after_each_layer(calls: list[LayerCall], layers: int) -> None:
    # every step ran all its layers through the watched call (the prompt, two decode steps)
    assert len(calls) == layers * THREE_STEPS.max_tokens, len(calls)
    # nothing beats while a layer runs: a layer that never returns stops the heartbeat
    assert all(c.beat_out == c.beat_in for c in calls), calls
    # each layer, the first of a step's included, started after a beat no older than the
    # previous layer's end: before, a step's later layers saw the beat from before the step
    late = [i for i in range(1, len(calls)) if calls[i].beat_in < calls[i - 1].ended]
    assert not late, f"layer calls {late} started with no beat since the call before them ended"


@pytest.fixture
def running() -> Iterator[Callable[..., EngineLoop]]:
    """Start a loop over an engine; at the end the loops stop, then the engines they were
    given to own shut down (a tensor-parallel engine's workers with them)."""
    loops: list[EngineLoop] = []
    owned: list[LLMEngine] = []

    def start(engine: LLMEngine, own: bool = True) -> EngineLoop:
        loops.append(EngineLoop(engine).start())
        if own:
            owned.append(engine)
        return loops[-1]

    yield start
    for loop in loops:
        loop.stop()
    for engine in owned:
        engine.shutdown()


def test_the_per_op_layers_beat_after_each_layer(
    running: Callable[..., EngineLoop], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = EngineConfig(model="tiny", kv_cache_bytes="8MiB", num_threads=2)
    loop = running(LLMEngine.from_config(cfg, progress=False))
    calls = watch_layers(monkeypatch, DecoderLayer, "forward", loop)
    serve_one(loop)
    assert loop.engine.model._cpu_plan is None  # an fp32 model: the torch layers served
    assert_beats_after_each_layer(calls, loop.engine.model_config.num_layers)


def test_the_packed_cpu_path_beats_after_each_c_layer_call(
    smollm_engine: LLMEngine,
    running: Callable[..., EngineLoop],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = running(smollm_engine, own=False)
    calls = watch_layers(monkeypatch, cpu_layer, "run_layer", loop)
    serve_one(loop)
    assert isinstance(smollm_engine.model._cpu_plan, CpuDecode)  # the C path served the steps
    assert_beats_after_each_layer(calls, smollm_engine.model_config.num_layers)


def test_rank_0_of_a_tensor_parallel_group_beats_after_each_layer(
    running: Callable[..., EngineLoop], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver runs its own shards' layers (the worker's run in its own process): the
    watched layers are rank 0's."""
    cfg = EngineConfig(
        model="tiny",
        tensor_parallel=2,
        kv_cache_bytes="8MiB",
        max_model_len=256,
        tensor_parallel_timeout_s=60.0,
    )
    loop = running(LLMEngine.from_config(cfg, progress=False))
    assert len(loop.engine.runner.worker_pids()) == 1
    calls = watch_layers(monkeypatch, DecoderLayer, "forward", loop)
    serve_one(loop)
    assert_beats_after_each_layer(calls, loop.engine.model_config.num_layers)
