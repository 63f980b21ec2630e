"""What serving a streamed token costs besides the engine: the HTTP layer relays each SSE chunk
straight to the server (no task and memory stream per message), and the engine thread wakes the
event loop once per step, not once per streamed output."""

from __future__ import annotations

import asyncio
import json
import threading
import types
from pathlib import Path
from typing import Any

from starlette.middleware.base import BaseHTTPMiddleware

from kvguard.engine.sequence import RequestOutput
from tests.test_stream_memory import _Client

STREAMS = 32
TOKENS = 8


def _service(tiny_dir: Path, tmp_path: Path, load: bool) -> Any:  # noqa: ANN401 - a Service
    from kvguard.daemon.config import load_config
    from kvguard.daemon.service import Service

    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"serving: {{model: {tiny_dir}, kv_cache_bytes: 32MiB, max_model_len: 2048}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    if load:
        svc.load(progress=False)
    return svc


def _layers(app: Any) -> list[Any]:  # noqa: ANN401 - ASGI apps of any shape
    """The built middleware stack, outermost first, down to the router: each layer's inner app
    is its `app` attribute (a class) or its closure's `app` (a function middleware)."""
    layers = []
    while app is not None and type(app).__name__ != "APIRouter":
        layers.append(app)
        inner = getattr(app, "app", None)
        if inner is None and isinstance(app, types.FunctionType):
            cells = dict(zip(app.__code__.co_freevars, app.__closure__ or (), strict=True))
            inner = cells["app"].cell_contents if "app" in cells else None
        app = inner
    return layers


def test_no_middleware_relays_the_answer_through_a_task(tiny_dir: Path, tmp_path: Path) -> None:
    """Starlette's BaseHTTPMiddleware passes every message of an answer through a memory stream
    read by a second task: a quarter of the event loop's time per streamed token."""
    from kvguard.daemon.app import create_app

    app = create_app(_service(tiny_dir, tmp_path, load=False))
    layers = _layers(app.build_middleware_stack())
    assert type(layers[-1]).__name__ == "AsyncExitStackMiddleware"  # walked down to the router
    relays = [layer for layer in layers if isinstance(layer, BaseHTTPMiddleware)]
    assert not relays, f"middleware relaying each message through a task: {relays}"


class _CountingLoop(asyncio.SelectorEventLoop):
    """Counts the wakes the engine thread sends while it delivers a step's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.delivering = False  # set by the first output of a step, cleared after the step
        self.wakes = 0

    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> Any:  # noqa: ANN401
        if self.delivering and threading.current_thread().name == "kvguard-engine":
            self.wakes += 1
        return super().call_soon_threadsafe(callback, *args, context=context)


def test_one_wake_of_the_event_loop_per_engine_step(tiny_dir: Path, tmp_path: Path) -> None:
    """32 streamed requests decoding together: every engine step wakes the event loop at most
    once (it was once per stream and step, some 10 us of the engine thread each), and every
    stream still gets all its tokens, in order."""
    from kvguard.daemon.app import create_app

    svc = _service(tiny_dir, tmp_path, load=True)
    aio = _CountingLoop()
    finals: dict[str, RequestOutput] = {}
    per_step: list[tuple[int, int]] = []  # (outputs delivered, wakes sent) of each step
    step = {"outputs": 0, "wakes": 0}
    deliver = svc.loop._deliver

    def spy(out: RequestOutput) -> None:  # engine thread
        if not aio.delivering:
            aio.delivering, step["outputs"], step["wakes"] = True, 0, aio.wakes
        step["outputs"] += 1
        if out.finished:
            finals[out.request_id] = out
        deliver(out)

    def stepped(_snapshot: object) -> None:  # engine thread, after the step's delivery
        if aio.delivering:
            per_step.append((step["outputs"], aio.wakes - step["wakes"]))
            aio.delivering = False

    svc.loop._deliver = spy  # type: ignore[method-assign]
    svc.loop.on_step.append(stepped)
    try:
        app = create_app(svc)

        async def streams() -> list[bytes]:
            release = asyncio.Event()
            release.set()
            clients = [
                _Client(
                    {
                        "model": svc.model_name,
                        "prompt": [5 + i, 6, 7],
                        "max_tokens": TOKENS,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    },
                    release,
                )
                for i in range(STREAMS)
            ]
            svc.loop.paused.set()  # every request in the mailbox before the first step
            tasks = [asyncio.create_task(c.call(app, "/v1/completions")) for c in clients]
            while svc.loop.in_flight() < STREAMS:
                await asyncio.sleep(0.01)
            svc.loop.paused.clear()
            bodies = await asyncio.gather(*tasks)
            assert all(c.status == 200 for c in clients)
            return bodies

        with asyncio.Runner(loop_factory=lambda: aio) as runner:
            bodies = runner.run(asyncio.wait_for(streams(), 300))
    finally:
        svc.close()

    assert max(n for n, _ in per_step) == STREAMS, per_step  # steps that served every stream
    assert all(wakes <= 1 for _, wakes in per_step), f"(outputs, wakes) per step: {per_step}"
    streamed = []
    for body in bodies:
        events = [
            json.loads(line[6:])
            for line in body.decode().split("\n\n")
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        streamed.append("".join(e["choices"][0]["text"] for e in events if e["choices"]))
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        assert events[-1]["usage"]["completion_tokens"] == TOKENS
    assert len(finals) == STREAMS
    assert sorted(streamed) == sorted(f.text for f in finals.values())
