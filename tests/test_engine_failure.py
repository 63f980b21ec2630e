"""A failing engine step over HTTP: its requests get a clear server error, everyone else is served.

Inputs are validated before they reach the engine, so a step that raises is a kvguard bug or a
fault below it; retrying that step forever used to stall every request behind it.

The error answer, the log's error line and the audit name the failed request alike: the 500 said
"the daemon log has the cause", but the log line gave only a count of requests and nothing was
audited, so an operator handed a client's failed request could not find its traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import re
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
    service: Service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
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

    with caplog.at_level(logging.ERROR, logger="kvguard.engine"):
        plain, sse, after = asyncio.run(run())
    assert plain.status_code == 500, plain.text
    assert plain.json()["error"]["code"] == "engine_error"
    events = [json.loads(x[6:]) for x in sse.split("\n\n") if x.startswith("data: ")]
    assert events and events[-1]["error"]["code"] == "engine_error"
    assert "data: [DONE]" not in sse  # a cut stream never looks complete
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 6
    snap = service.engine.latest_snapshot
    assert snap.blocks_used == 0 and snap.finished["error"]["normal"] == 2
    # each failed choice by the id the daemon gave it: `<response id>-<index>`; the streamed
    # one's response id is in its chunks, the plain 500's only in its message
    plain_id = re.search(r"\((cmpl-[0-9a-f]+-0)\)", plain.json()["error"]["message"])
    assert plain_id, plain.json()["error"]["message"]
    streamed_id = f"{events[0]['id']}-0"
    assert f"({streamed_id})" in events[-1]["error"]["message"]
    failed_lines = [r for r in caplog.records if "with an error: " in r.getMessage()]
    assert [r.exc_info is not None for r in failed_lines] == [True, True]  # with the traceback
    assert service.audit.flush(10)
    for rid, line in zip((plain_id[1], streamed_id), failed_lines, strict=True):
        # in the singular for one request: "its 1 requests end", "1 requests ended"
        want = f"engine step failed; its 1 request ends with an error: {rid}"
        assert line.getMessage() == want, line.getMessage()
        [row] = service.audit.list_events(kind="engine_step_failed", request=rid)
        assert row["data"] == {"error": "RuntimeError: poisoned step", "failed": [rid]}
        assert row["detail"] == "engine step failed (RuntimeError: poisoned step): 1 request ended"


def test_the_error_line_names_the_first_20_failed_requests_and_counts_the_rest() -> None:
    """A step of hundreds of requests must not make a log line of kilobytes."""
    from kvguard.engine.llm_engine import listed

    ids = [f"cmpl-{i}-0" for i in range(25)]
    assert listed(ids[:20]) == ", ".join(ids[:20])
    assert listed(ids) == ", ".join(ids[:20]) + " +5 more"


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
