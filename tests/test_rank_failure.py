"""A fatal engine failure (a tensor-parallel rank died or hung) as the engine loop and the daemon
handle it: no request waits forever, the daemon says it is not ready and why, and exits
non-zero so that systemd restarts it.

No worker processes are needed here: the one-process engine's runner is made to raise the
`RankFailure` a tensor-parallel runner raises. tests/test_tensor_parallel_serve.py runs real
workers."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.daemon.app import create_app
from kvguard.daemon.config import load_config
from kvguard.daemon.service import Service
from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.distributed.errors import RankFailure
from kvguard.engine.engine_loop import EngineLoop, EngineUnavailable
from kvguard.engine.sequence import RequestOutput
from tests.test_server import Daemon, until

FAILURE = RankFailure(1, "(pid 4242) died: exit code -9")
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def break_runner(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, good_steps: int) -> None:
    """The runner's steps raise FAILURE after `good_steps` good ones, as a tensor-parallel
    runner does once a worker is gone. Counting steps, not time, decides when it fails."""
    real = engine.runner.execute
    calls = itertools.count()

    def execute(seqs: Any, num_tokens: Any) -> list[int]:
        if next(calls) >= good_steps:
            raise FAILURE
        return real(seqs, num_tokens)

    monkeypatch.setattr(engine.runner, "execute", execute)


@pytest.fixture
def engine(tiny_dir: Path) -> LLMEngine:
    cfg = EngineConfig(model=str(tiny_dir), kv_cache_bytes="8MiB", max_model_len=512)
    return LLMEngine.from_config(cfg, progress=False)


# -- the engine loop ------------------------------------------------------------------------------
def test_rank_failure_ends_every_stream_with_an_error_and_refuses_later_work(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both requests are taken at the first step (the loop is held until both are posted):
    # step 1 prefills them, step 2 decodes a second token, step 3 fails.
    break_runner(engine, monkeypatch, good_steps=2)
    loop = EngineLoop(engine)
    told: list[BaseException] = []
    loop.on_fatal.append(told.append)
    loop.paused.set()
    loop.start()
    try:
        iterated, _ = loop.submit_nowait([5, 6, 7], LONG)
        heard: list[RequestOutput] = []
        listened, _ = loop.submit_nowait([8, 9], LONG, listener=heard.append)
        loop.paused.clear()
        until(lambda: loop.fatal is not None, 60, "the loop to take the rank failure")

        assert loop.fatal is FAILURE and told == [FAILURE]
        outs = list(iterated)  # the iteration ends: the stream got a final output
        assert outs[-1].finished and outs[-1].finish_reason == "error"
        assert heard[-1].finished and heard[-1].finish_reason == "error"
        assert [o.num_output_tokens for o in heard] == [1, 2, 2]  # the counts it had reached
        assert sum(len(o.new_token_ids) for o in outs) == 2
        assert listened.result(0).finish_reason == "error"
        assert loop.in_flight() == 0

        # Later work is refused at once, whether posted through the loop or straight to the
        # engine's mailbox (the control surface's actions), instead of waiting for a step.
        with pytest.raises(EngineUnavailable, match="rank 1 .pid 4242. died: exit code -9"):
            loop.submit([1, 2], LONG, timeout=30)
        with pytest.raises(EngineUnavailable):
            engine.set_max_num_seqs(1).result(30)
        assert loop.alive  # refusing until stopped
    finally:
        loop.stop()
    assert not loop.alive


def test_a_rank_that_dies_while_idle_is_noticed_without_traffic(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = threading.Event()

    def check_alive() -> None:  # what a tensor-parallel runner does between steps
        if dead.is_set():
            raise FAILURE

    monkeypatch.setattr(engine.runner, "check_alive", check_alive, raising=False)
    loop = EngineLoop(engine).start()
    try:
        assert loop.submit([5, 6], SamplingParams(max_tokens=2)).result(60).finished
        dead.set()
        until(lambda: loop.fatal is not None, 60, "the idle loop to notice the dead rank")
        assert loop.fatal is FAILURE
    finally:
        loop.stop()


# -- the daemon, in process -----------------------------------------------------------------------
@pytest.fixture
def service(tiny_dir: Path, tmp_path: Path) -> Iterator[Service]:
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"serving: {{model: {tiny_dir}, kv_cache_bytes: 8MiB, max_model_len: 512}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    yield svc
    svc.close()


def test_one_rank_metrics(service: Service) -> None:
    """One rank: the size is 1 and rank 0's KV bytes are the engine's whole device pool."""
    got = gauges(generate_latest(service.metrics.registry).decode())
    assert got["kvguard_tensor_parallel_size"] == {(): 1.0}
    pool = service.engine.kv_cache.device_pool.nbytes
    assert got["kvguard_kv_cache_rank_bytes"] == {(("rank", "0"),): float(pool)} and pool > 0


def gauges(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Each metric's samples by label set, from the exposition text as Prometheus reads it."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_daemon_answers_503_and_turns_not_ready_on_a_rank_failure(
    service: Service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In-flight requests (plain and streamed) get 503 engine_unavailable instead of hanging,
    /ready says why it is not ready, new requests get 503, and the metrics show it. The exit
    itself is a process-level matter: see the subprocess test below."""
    break_runner(service.engine, monkeypatch, good_steps=2)  # as in the loop test above
    body = {"model": service.model_name, "prompt": "hi", "max_tokens": 400, "ignore_eos": True}

    async def run() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvguard") as c:
            service.loop.paused.set()  # held until both requests are posted
            plain = asyncio.create_task(c.post("/v1/completions", json=body, timeout=60))
            streamed = asyncio.create_task(
                c.post("/v1/completions", json={**body, "stream": True}, timeout=60)
            )
            await _until_async(lambda: len(service.requests) == 2, "both requests posted")
            service.loop.paused.clear()
            await _until_async(lambda: service.loop.fatal is not None, "the rank failure")
            return {
                "plain": await plain,
                "sse": (await streamed).text.split("\n\n"),
                "ready": await c.get("/ready"),
                "new": await c.post("/v1/completions", json=body, timeout=60),
                "metrics": (await c.get("/metrics")).text,
            }

    with caplog.at_level("ERROR", logger="kvguard"):
        got = asyncio.run(run())

    plain = got["plain"]
    assert plain.status_code == 503, plain.text
    err = plain.json()["error"]
    assert (err["code"], err["type"]) == ("engine_unavailable", "service_unavailable")
    assert "tensor-parallel rank 1 (pid 4242) died: exit code -9" in err["message"]
    assert int(plain.headers["Retry-After"]) >= 1
    events = [json.loads(x[6:]) for x in got["sse"] if x.startswith("data: ")]
    assert events[-1]["error"]["code"] == "engine_unavailable"
    assert "data: [DONE]" not in got["sse"]

    ready = got["ready"]
    assert ready.status_code == 503
    assert ready.json() == {
        "ready": False,
        "reason": f"engine failed: {FAILURE}",
    }
    new = got["new"]
    assert new.status_code == 503 and new.json()["error"]["code"] == "engine_unavailable"
    assert gauges(got["metrics"])["kvguard_ready"] == {(): 0.0}
    assert service.exit_code == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "kvguard.daemon"]
    assert any(
        m.startswith("engine failed for good: tensor-parallel rank 1 (pid 4242) died: exit code -9")
        for m in logged
    ), logged


async def _until_async(pred: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """`until` for a coroutine: the ASGI app runs on this event loop, so never block it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.02)


# -- the daemon, as systemd runs it -------------------------------------------------------------
def test_daemon_exits_non_zero_after_a_rank_failure(tmp_path: Path) -> None:
    """`kvguard serve` as a process: a request in flight when a rank fails gets its 503, the
    watchdog pings stop, the log names the rank and the reason, and the process exits 1 by
    itself (systemd's Restart=on-failure then starts it again)."""
    notify = NotifySocket(tmp_path / "notify.sock")
    # debug hooks on (/admin/debug/fail_rank); a 0.6 s watchdog interval: pings every 0.2 s
    d = Daemon(tmp_path, env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "600000"})
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 480, "ignore_eos": True}
    try:
        until(lambda: "WATCHDOG=1" in notify.messages, 30, "a first watchdog ping")
        with httpx.stream("POST", d.url + "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            hook = d.admin("POST", "/admin/debug/fail_rank", json={"rank": 1})
            assert hook.status_code == 200, hook.text
            rest = [line for line in lines if line]
        assert json.loads(rest[-1][6:])["error"]["code"] == "engine_unavailable"
        assert d.proc.wait(60) == 1
    finally:
        d.stop()
        notify.close()
    log = Path(d.log.name).read_text()
    failed = "engine failed for good: tensor-parallel rank 1 died: injected by /admin/debug/"
    assert failed in log and "exiting with status 1" in log
    msgs = notify.messages
    status = next(i for i, m in enumerate(msgs) if m.startswith("STATUS=engine failed: "))
    assert "WATCHDOG=1" not in msgs[status:] and "STOPPING=1" in msgs[status:]


class NotifySocket:
    """A stand-in for systemd's notify socket: every datagram the daemon sends, in order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.extend(self._sock.recv(4096).decode().split("\n"))
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def test_the_unit_restarts_a_daemon_that_exits_non_zero() -> None:
    """The fatal path relies on systemd: exit 1 must mean a restart, and whatever the daemon
    leaves in its control group (a worker that did not stop) must be killed with it."""
    unit = Path(__file__).resolve().parents[1] / "daemon" / "systemd" / "kvguard.service"
    settings = dict(
        line.split("=", 1) for line in unit.read_text().splitlines() if line[:1].isalpha()
    )
    assert settings["Restart"] in ("on-failure", "always")
    assert settings.get("KillMode", "control-group") in ("mixed", "control-group")
