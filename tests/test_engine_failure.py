"""A failing engine step over HTTP: its requests get a clear server error, everyone else is served.

Inputs are validated before they reach the engine, so a step that raises is a kvguard bug or a
fault below it; retrying that step forever used to stall every request behind it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvguard.daemon.app import create_app
from kvguard.daemon.config import load_config
from kvguard.daemon.service import Service


@pytest.fixture
def service(tiny_dir: Path, tmp_path: Path) -> Iterator[Service]:
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"serving: {{model: {tiny_dir}, kv_cache_bytes: 8MiB, max_model_len: 256}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    yield svc
    svc.close()


def test_failed_step_answers_500_then_serves_on(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    body: dict[str, Any] = {
        "model": service.model_name,
        "prompt": "hello there",
        "max_tokens": 6,
        "ignore_eos": True,
    }

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("poisoned step")

    async def run() -> tuple[httpx.Response, str, httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvguard") as c:
            with monkeypatch.context() as m:
                m.setattr(service.engine.model, "compute_logits", poisoned)
                plain = await c.post("/v1/completions", json=body, timeout=60)
                streamed = await c.post(
                    "/v1/completions", json={**body, "stream": True}, timeout=60
                )
            after = await c.post("/v1/completions", json=body, timeout=60)
        return plain, streamed.text, after

    plain, sse, after = asyncio.run(run())
    assert plain.status_code == 500, plain.text
    assert plain.json()["error"]["code"] == "engine_error"
    events = [json.loads(x[6:]) for x in sse.split("\n\n") if x.startswith("data: ")]
    assert events and events[-1]["error"]["code"] == "engine_error"
    assert "data: [DONE]" not in sse  # a cut stream never looks complete
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 6
    snap = service.engine.latest_snapshot
    assert snap.blocks_used == 0 and snap.finished["error"]["normal"] == 2


def test_a_rank_lost_right_after_loading_exits_non_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idle loop checks the ranks as soon as the engine is up: a failure found then, before
    the daemon has finished its own start, still makes it exit non-zero (systemd restarts it on
    failure; an exit 0 left it down)."""
    from kvguard.daemon import service as service_mod
    from kvguard.daemon.config import DaemonConfig, apply_overrides
    from kvguard.engine.distributed.errors import RankFailure
    from kvguard.engine.llm_engine import LLMEngine

    built = LLMEngine.from_config

    def dead_rank(*args: Any, **kw: Any) -> LLMEngine:
        engine = built(*args, **kw)

        def check_alive() -> None:
            raise RankFailure(1, "died right after loading")

        engine.runner.check_alive = check_alive
        return engine

    monkeypatch.setattr(LLMEngine, "from_config", staticmethod(dead_rank))
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    cfg = apply_overrides(DaemonConfig(), model="tiny", port=0)
    svc = service_mod.Service(cfg)
    sock = service_mod.bind_api("127.0.0.1", 0)
    try:
        svc.load(progress=False)
        assert asyncio.run(svc.serve(sock)) == service_mod.FATAL_EXIT_CODE
    finally:
        sock.close()
        svc.shutdown_engine()
