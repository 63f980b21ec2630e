"""A KV pool conversion (the FP8 switch, its undo, a pool resize) runs layer by layer inside one
engine step: seconds per GiB on a CPU, tens of seconds for a large pool. The engine loop's
heartbeat, which the systemd watchdog and /ready follow, moves with every layer converted, so
that a conversion making progress is not taken for a stalled engine (the daemon was killed by
its watchdog in the middle of the remedy) while a layer that hangs still stops it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest

from kvguard.engine.engine_loop import EngineLoop
from kvguard.engine.kv_cache import KVCache
from kvguard.engine.llm_engine import LLMEngine
from tests.test_engine import make_engine


@pytest.fixture
def loop() -> Iterator[EngineLoop]:
    # a host tier too: both pools convert, one after the other, in the same pause
    engine = make_engine(kv_cache_bytes="8MiB", enable_cpu_offload=True, cpu_cache_ratio=0.5)
    loop = EngineLoop(engine).start()
    try:
        yield loop
    finally:
        loop.stop()


def beats_at_each_layer(monkeypatch: pytest.MonkeyPatch, loop: EngineLoop) -> list[float]:
    """The loop's heartbeat as each layer of a conversion starts (engine thread)."""
    seen: list[float] = []
    convert_layer = KVCache._converted

    def watched(self: KVCache, *args: object, **kw: object) -> object:
        seen.append(loop.last_beat)
        return convert_layer(self, *args, **kw)

    monkeypatch.setattr(KVCache, "_converted", watched)
    return seen


CONVERSIONS: dict[str, Callable[[LLMEngine], Future]] = {
    "fp8 switch": lambda e: e.set_kv_cache_dtype("fp8_e4m3"),
    "pool resize": lambda e: e.set_kv_pool_share(0.5),
}


@pytest.mark.parametrize("what", list(CONVERSIONS))
def test_the_heartbeat_moves_between_the_layers_of_a_conversion(
    what: str, loop: EngineLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = loop.engine
    layers = 2 * engine.model_config.num_layers  # the device pool's, then the host pool's
    assert engine.kv_cache.num_host_blocks > 0 and layers >= 4
    seen = beats_at_each_layer(monkeypatch, loop)
    res = CONVERSIONS[what](engine).result(60)
    assert res.ok, res.detail
    assert len(seen) == (layers if what == "fp8 switch" else layers // 2)  # resize: device only
    # each layer started after a beat later than the previous layer's: the pause beats on
    assert all(b > a for a, b in zip(seen, seen[1:], strict=False)), seen


def test_the_undo_of_the_fp8_switch_beats_too(
    loop: EngineLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = loop.engine
    assert engine.set_kv_cache_dtype("fp8_e4m3").result(60).ok
    seen = beats_at_each_layer(monkeypatch, loop)
    res = engine.set_kv_cache_dtype("auto").result(60)
    assert res.ok and res.after["kv_cache_dtype"] == "fp32", res.detail
    assert len(seen) == 2 * engine.model_config.num_layers
    assert all(b > a for a, b in zip(seen, seen[1:], strict=False)), seen
