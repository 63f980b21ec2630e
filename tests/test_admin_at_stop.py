"""An admin action waiting on the engine when the daemon stops gets kvguard's JSON 503, as the
requests the drain cuts do: withdrawn at the end of the drain period if the engine has not
taken it (it never runs), and one asked once the stop has begun is refused at once. It used to
wait past the drain until uvicorn cancelled it: a plain-text 500, and two tracebacks in the log
("Exception in ASGI application", "Future exception was never retrieved")."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvguard.daemon.app import create_app
from kvguard.daemon.config import load_config
from kvguard.daemon.service import Service
from kvguard.engine.events import EngineEvent
from tests.test_drain import LONG, draining, set_drain_timeout
from tests.test_server import TOKEN, Daemon, until

TRACEBACKS = ("Traceback", "Exception in ASGI application", "Future exception was never retrieved")


def log_text(d: Daemon) -> str:
    return Path(d.log.name).read_text()


def manual_rows(tmp: Path) -> list[tuple[str, str, str]]:
    with contextlib.closing(sqlite3.connect(tmp / "audit.db")) as db:
        sql = "SELECT action, outcome, detail FROM actions WHERE rule = 'manual'"
        return db.execute(sql).fetchall()


def test_an_action_the_stalled_engine_never_took_is_withdrawn_at_the_drain_end_with_a_503(
    tmp_path: Path,
) -> None:
    d = Daemon(tmp_path)
    set_drain_timeout(d, "1s")
    got: dict[str, httpx.Response] = {}

    def act() -> None:
        got["act"] = d.admin("POST", "/admin/actions/enable_fp8_kv", json={})

    t = threading.Thread(target=act)
    try:
        assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
        t.start()
        asked = "admin action enable_fp8_kv asked"
        until(lambda: asked in log_text(d), 30, "the action posted to the stalled engine")
        d.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert d.proc.wait(60) == 0
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
        d.log.close()
    r = got["act"]
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert err["code"] == "action_withdrawn" and err["type"] == "service_unavailable", err
    assert (
        err["message"].startswith("kvguard is shutting down: ")
        and "nothing changed" in (err["message"])
    )
    [(action, outcome, detail)] = manual_rows(tmp_path)
    assert (action, outcome) == ("enable_fp8_kv", "failed") and "withdrawn before it ran" in detail
    log = log_text(d)
    assert "the stop withdrew admin action enable_fp8_kv" in log
    assert not [line for line in TRACEBACKS if line in log], log


def test_an_action_asked_during_the_drain_is_refused_with_a_503(tmp_path: Path) -> None:
    """A request stuck in the stalled engine holds the drain (20 s) open meanwhile."""
    d = Daemon(tmp_path)

    def ask() -> None:  # the forced exit drops it: its answer is test_drain's business
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(d.url + "/v1/completions", json=LONG, timeout=60)

    t = threading.Thread(target=ask)
    try:
        assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
        t.start()
        until(lambda: d.admin("GET", "/admin/state").json()["in_flight"] == 1, 30, "posted")
        d.proc.send_signal(signal.SIGTERM)
        until(lambda: draining(d), 30, "draining")
        r = d.admin("POST", "/admin/actions/halt_admission", json={})
        assert r.status_code == 503, r.text  # at once: not after the drain, nor a bare 500
        err = r.json()["error"]
        assert err["code"] == "shutting_down" and "nothing changed" in err["message"], err
        d.proc.send_signal(signal.SIGTERM)  # no need to wait out the drain
        assert d.proc.wait(30) == 128 + signal.SIGTERM
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
        d.log.close()
        t.join(60)
    assert manual_rows(tmp_path) == []  # never asked of the engine: nothing to audit


def admin_post(service: Service, path: str, body: dict[str, Any]) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvguard") as c:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            return await c.post(path, json=body, headers=headers, timeout=120)

    return asyncio.run(post())


@pytest.fixture
def service(tiny_dir: Path, tmp_path: Path) -> Iterator[Service]:
    """The daemon in process (its admin API through ASGI), with a short drain."""
    (tmp_path / "admin.token").write_text(TOKEN + "\n")
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"serving: {{model: {tiny_dir}, kv_cache_bytes: 8MiB, max_model_len: 512}}\n"
        f"api: {{admin_token_file: {tmp_path / 'admin.token'}, drain_timeout: 0.5s}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    yield svc
    svc.close()


def test_an_action_the_engine_is_still_inside_at_the_drain_end_is_a_503_then_audited(
    service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine took the action and is stuck in it when the drain ends: it cannot be
    withdrawn, so the answer says it may still apply, and its outcome is audited when it
    lands. (In process: the stop begins once the engine is inside the action, which a
    daemon's debug hooks cannot arrange.)"""
    inside, release = threading.Event(), threading.Event()

    def slow(event: EngineEvent) -> None:  # inside the action, on the engine thread
        if event.kind == "knob_changed" and event.data["action"] == "set_max_num_seqs":
            inside.set()
            release.wait(300)  # set once the answer is in

    service.engine.events.subscribe(slow)
    posted = service.manual_action

    def taken(name: str, params: dict[str, Any]) -> Future:
        """The stop begins once the engine is inside the action (as the drain marks it)."""
        fut = posted(name, params)
        until(inside.is_set, 60, "the engine inside the action")
        service.draining = True
        return fut

    monkeypatch.setattr(service, "manual_action", taken)
    try:
        r = admin_post(service, "/admin/actions/set_max_num_seqs", {"n": 4})
    finally:
        release.set()
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "action_still_applying" and "may still apply" in err["message"], err
    assert err["message"].startswith("kvguard is shutting down: ")
    until(lambda: manual_rows(tmp_path), 60, "the action audited once it landed")
    [(action, outcome, _detail)] = manual_rows(tmp_path)
    assert (action, outcome) == ("set_max_num_seqs", "applied")
