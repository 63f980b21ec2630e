"""`kvguard serve` as a user runs it: a real process on loopback, the real `openai` client."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

KVGUARD = str(Path(sys.executable).parent / "kvguard")
TOKEN = "s3cret-admin-token"
# A test daemon shares the cores with the test itself, its clients and often another daemon:
# libgomp's default wait policy spins a worker between parallel regions, and a step then waits
# for a spinning worker the kernel has taken off its core (six 100-token answers took 16-46 s
# instead of 0.2-3.5 s with two busy processes beside them). PASSIVE unless the caller chose.
TEST_DAEMON_ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def until(pred, timeout: float, what: str):  # noqa: ANN001, ANN201 - a predicate, its value
    """Wait for a condition, never for a guessed time; the bound is generous, not a goal.
    Returns the predicate's first true value."""
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)
    return value


def serve_refused(config: Path) -> subprocess.CompletedProcess[str]:
    """`kvguard serve --config` of a config it must refuse to start with (it exits)."""
    argv = [KVGUARD, "serve", "--config", str(config)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def free_port() -> int:
    """A loopback port free now, below Linux's ephemeral range (32768 and up): a port the
    kernel picked from that range can become the local end of a connection some process opens
    before the server binds it (a tensor-parallel worker's, say), and the bind then fails."""
    rng = random.Random()  # the OS's entropy: test processes running together pick apart
    while True:
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class Daemon:
    """A `kvguard serve` subprocess with its own config, token and state directory."""

    def __init__(
        self,
        tmp: Path,
        extra: str = "",
        env: dict[str, str] | None = None,
        port: int | None = None,
        debug_hooks: bool = True,  # /admin/debug/*: some tests stall the engine or fake an OOM
        serving: str = "{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}",
        args: tuple[str, ...] = (),  # more `kvguard serve` flags
        api: str = "",  # more keys of the `api` section, e.g. "api_keys_file: /x.yaml"
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (tmp / "admin.token").write_text(TOKEN + "\n")
        self.config = tmp / "config.yaml"
        self.config.write_text(
            f"serving: {serving}\n"
            f"api: {{host: 127.0.0.1, port: {self.port}, admin_token_file: {tmp / 'admin.token'},"
            f" drain_timeout: 20s, debug_hooks: {str(debug_hooks).lower()}"
            f"{', ' + api if api else ''}}}\n"
            f"audit: {{url: 'sqlite:///{tmp / 'audit.db'}'}}\n" + extra
        )
        full_env = {**os.environ, **TEST_DAEMON_ENV, "STATE_DIRECTORY": str(tmp), **(env or {})}
        self.log = open(tmp / "daemon.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [KVGUARD, "serve", "--config", str(self.config), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"daemon exited {self.proc.returncode}: {Path(self.log.name).read_text()}"
                )
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("daemon not ready")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(
            method, self.url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60, **kw
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("daemon"))
    yield d
    assert d.stop() == 0


def test_completion_chat_and_usage(daemon: Daemon) -> None:
    c = daemon.client()
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.models.retrieve("org/other-model")
    r = c.completions.create(
        model="tiny",
        prompt="Hello there",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(b"Hello there")
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens <= 8 and chat.choices[0].finish_reason in ("stop", "length")


def test_streaming_matches_non_streaming(daemon: Daemon) -> None:
    c = daemon.client()
    full = c.completions.create(
        model="tiny",
        prompt="Stream me",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        c.completions.create(
            model="tiny",
            prompt="Stream me",
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
        )
    )
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens <= 6


def test_stop_strings_are_honoured(daemon: Daemon) -> None:
    c = daemon.client()
    free = (
        c.completions.create(
            model="tiny",
            prompt="abc",
            max_tokens=30,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = free[4:6]
    cut = c.completions.create(
        model="tiny",
        prompt="abc",
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert (
        cut.choices[0].finish_reason == "stop" and cut.choices[0].text == free[: free.index(stop)]
    )
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="tiny",
            prompt="abc",
            max_tokens=30,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if ch.choices
    )
    assert streamed == cut.choices[0].text


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ("{not json", 400, ""),
        ({"model": "tiny", "prompt": 5}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
        ({"model": "tiny", "prompt": "x" * 5000}, 400, "max_model_len"),
        ({"model": "tiny", "prompt": "x", "priority": "urgent"}, 400, "priority"),
        ({"model": "tiny", "prompt": ""}, 400, "empty"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "n": 33}, 400, "n"),
    ],
)
def test_bad_requests_get_openai_errors(daemon: Daemon, body, status: int, needle: str) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        daemon.url + "/v1/completions", content=data, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and needle in err["message"] + str(err.get("param"))


def test_bad_priority_header_and_chat_body(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(
        daemon.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x"},
        headers={"X-Priority": "urgent"},
    )
    assert r.status_code == 400


def test_admin_needs_the_token(daemon: Daemon) -> None:
    assert httpx.get(daemon.url + "/admin/state").status_code == 401
    bad = httpx.get(daemon.url + "/admin/state", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.headers["www-authenticate"] == "Bearer"
    ok = daemon.admin("GET", "/admin/state")
    assert ok.status_code == 200 and ok.json()["knobs"]["max_num_seqs"] == 32
    act = daemon.admin("POST", "/admin/actions/reduce_batch", json={"factor": 0.5})
    assert act.status_code == 200 and act.json()["after"]["max_num_seqs"] == 16
    daemon.admin("POST", "/admin/actions/restore_batch")
    assert daemon.admin("POST", "/admin/actions/no_such_action").status_code == 404
    assert (
        daemon.admin("POST", "/admin/actions/reduce_batch", json={"factor": 3}).status_code == 400
    )


def test_cap_truncation_is_reported(daemon: Daemon) -> None:
    daemon.admin("POST", "/admin/actions/cap_max_new_tokens", json={"n": 4})
    try:
        r = httpx.post(
            daemon.url + "/v1/completions",
            json={"model": "tiny", "prompt": "cap", "max_tokens": 20, "ignore_eos": True},
        ).json()
        assert r["usage"]["completion_tokens"] == 4 and r["kvguard"]["truncated"] is True
    finally:
        daemon.admin("POST", "/admin/actions/uncap_max_new_tokens")


def test_halted_admission_answers_503_with_retry_after(daemon: Daemon) -> None:
    daemon.admin("POST", "/admin/actions/halt_admission", json={"allow_priority": "high"})
    try:
        r = httpx.post(
            daemon.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}
        )
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "admission_rejected"
        hi = httpx.post(
            daemon.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
            headers={"X-Priority": "high"},
        )
        assert hi.status_code == 200
    finally:
        daemon.admin("POST", "/admin/actions/resume_admission")


def test_metrics_and_health(daemon: Daemon) -> None:
    assert httpx.get(daemon.url + "/health").json()["status"] == "alive"
    text = httpx.get(daemon.url + "/metrics").text
    for name in (
        'kvguard_kv_cache_usage_ratio{tier="device"}',
        "kvguard_kv_cache_blocks",
        "kvguard_requests{",
        "kvguard_preemptions_total",
        "kvguard_admission_decisions_total",
        "kvguard_engine_oom_events_total",
        "kvguard_scheduler_count_repairs_total 0.0",  # a count that drifted: none here
        "kvguard_time_to_first_token_seconds_bucket",
        "kvguard_nvml_up 0.0",
        "kvguard_gc_pause_seconds_bucket",
    ):
        assert name in text, name


def test_client_disconnect_frees_blocks(daemon: Daemon) -> None:
    with httpx.stream(
        "POST",
        daemon.url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "long",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        for _ in r.iter_lines():
            break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = daemon.admin("GET", "/admin/state").json()
        if s["kv"]["device"]["blocks_used"] == 0 and sum(s["queues"]["running"].values()) == 0:
            return
        time.sleep(0.1)
    pytest.fail("blocks of a disconnected client were not freed")


def test_a_taken_port_fails_the_start_before_the_model_loads(tmp_path: Path) -> None:
    """The API's port is bound first: taken, the daemon exits 1 at once naming the address,
    having loaded nothing (no model, no workers, no audit database)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="exited 1") as failed:
            Daemon(tmp_path, port=port)
    log = str(failed.value)
    assert f"cannot bind the API to 127.0.0.1:{port}" in log and "nothing loaded" in log
    assert (
        "loaded" not in log.replace("nothing loaded", "") and not (tmp_path / "audit.db").exists()
    )


def test_the_daemon_logs_where_it_listens(daemon: Daemon) -> None:
    assert f"API bound to 127.0.0.1:{daemon.port}" in Path(daemon.log.name).read_text()


def test_metrics_and_the_start_line_name_the_installed_version(daemon: Daemon) -> None:
    """Every rank and every daemon sharing an audit database should run one kvguard version:
    an operator reads it off /metrics and the log, not out of each host's venv."""
    from importlib.metadata import version

    installed = version("kvguard")
    text = httpx.get(daemon.url + "/metrics").text
    assert f'kvguard_build_info{{version="{installed}"}} 1.0' in text.splitlines()
    assert (
        f"kvguard {installed} starting (pid {daemon.proc.pid})" in Path(daemon.log.name).read_text()
    )


def test_port_0_logs_the_port_and_an_unusable_token_file_is_named(tmp_path: Path) -> None:
    """`api.port: 0` binds a port the kernel picks: the log names that port, not 0, and so does
    the daemon's own `instance` (the alerts it takes as its own). An
    api.admin_token_file that cannot be read (or is empty) turns /admin/* off: the start and
    each reload log a warning naming the file and why; the 403, which any client reads, says
    the admin API is off and names neither."""
    token = tmp_path / "missing" / "admin.token"
    config = tmp_path / "config.yaml"
    config.write_text(
        "serving: {model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}\n"
        f"api: {{host: 127.0.0.1, port: 0, admin_token_file: {token}}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    log = tmp_path / "daemon.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [KVGUARD, "serve", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STATE_DIRECTORY": str(tmp_path)},
        )
    try:
        bound = lambda: re.search(r"API bound to 127\.0\.0\.1:(\d+)", log.read_text())  # noqa: E731
        until(lambda: bound() is not None or proc.poll() is not None, 60, "the bind")
        assert proc.poll() is None, log.read_text()
        port = int(bound().group(1))
        assert port != 0
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        until(ready, 90, "the daemon ready on the port it logged")
        assert (
            "admin API disabled (/admin/* answers 403): cannot read api.admin_token_file "
            f"{token}: No such file or directory" in log.read_text()
        )
        admin = lambda: httpx.get(  # noqa: E731
            url + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )
        r = admin()
        disabled = (
            "admin API disabled: the admin token file cannot be used; the daemon's log names "
            "the problem (fix the file: it is read again at each request)"
        )
        assert r.status_code == 403 and r.json()["error"]["message"] == disabled
        token.parent.mkdir()
        token.write_text("\n")
        r = admin()
        assert r.status_code == 403 and r.json()["error"]["message"] == disabled, r.text
        # the new problem, met by a request, is logged (the path stays in the log)
        until(lambda: f"{token} is empty" in log.read_text(), 20, "the request's warning")
        proc.send_signal(signal.SIGHUP)
        empty = f"admin API disabled (/admin/* answers 403): api.admin_token_file {token} is empty"
        until(lambda: log.read_text().count(empty) == 2, 20, "the reload's warning")
        token.write_text(TOKEN + "\n")
        assert admin().status_code == 200
        # This daemon's `instance` (no prometheus.instance: host:port) has the bound port, so
        # an alert labelled with it is its own, and one labelled host:0 is another daemon's.
        alert = {"status": "firing", "labels": {"alertname": "KVCacheHigh"}}
        alert["startsAt"] = "2026-11-30T10:00:00Z"
        for n, where in enumerate((port, 0)):
            labels = alert["labels"] | {"instance": f"{socket.gethostname()}:{where}"}
            body = {"version": "4", "alerts": [alert | {"labels": labels, "fingerprint": f"f{n}"}]}
            r = httpx.post(
                url + "/alertmanager", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
            )
            assert r.json() == {"accepted": 1 - n, "duplicates": 0, "other_instance": n}, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_default_bind_is_loopback() -> None:
    from kvguard.daemon.config import load_config

    cfg = load_config(None)
    assert cfg.api.host == "127.0.0.1" and cfg.serving.model == "smollm2-135m"


def test_sigterm_under_load_drains_and_exits_zero(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    results: list[object] = []

    def one() -> None:
        try:
            r = httpx.post(
                d.url + "/v1/completions",
                timeout=60,
                # short enough to finish within the drain on a loaded machine once the engine
                # is released (a drain cuts what it cannot finish)
                json={"model": "tiny", "prompt": "drain me", "max_tokens": 100, "ignore_eos": True},
            )
            results.append((r.status_code, r.json().get("usage", {}).get("completion_tokens")))
        except httpx.HTTPError as e:
            results.append(e)

    # the engine held from before the six come until the late request has had its answer: the
    # six are in flight at the SIGTERM and the drain is still on when the late one comes (else
    # on a loaded machine the first ones finished before the last came, and on a quick one all
    # six before the late one, the daemon gone: connection refused)
    assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    in_flight = lambda: d.admin("GET", "/admin/state").json()["in_flight"]  # noqa: E731
    until(lambda: in_flight() == 6, 60, "all six in flight")  # SIGTERM only then
    d.proc.send_signal(signal.SIGTERM)
    until(lambda: httpx.get(d.url + "/ready", timeout=5).status_code == 503, 30, "draining")
    late = httpx.post(
        d.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
        timeout=10,
    )
    assert late.status_code == 503
    assert d.admin("POST", "/admin/debug/release").json() == {"released": 1}
    for t in threads:
        t.join(60)
    assert d.proc.wait(60) == 0
    d.log.close()
    assert results == [(200, 100)] * 6, results


def test_sd_notify_lifecycle_and_watchdog(tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.5)
    msgs: list[str] = []
    stop = threading.Event()

    def recv() -> None:
        while not stop.is_set():
            try:
                msgs.append(sock.recv(4096).decode())
            except TimeoutError:
                continue

    t = threading.Thread(target=recv, daemon=True)
    t.start()
    d = Daemon(tmp_path, env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "600000"})
    pings = lambda: sum("WATCHDOG=1" in m for m in msgs)  # noqa: E731
    try:
        until(lambda: pings() > 0, 30, "a first watchdog ping")
        # a stalled engine loop stops the pings: the window checked lies well inside the stall
        d.admin("POST", "/admin/debug/stall", json={"seconds": 6})
        time.sleep(1.0)
        n = pings()
        time.sleep(2.0)
        assert pings() == n, "watchdog pinged while the loop was stalled"
        until(lambda: pings() > n, 60, "pings resumed after the stall")
        d.proc.send_signal(signal.SIGHUP)
        until(lambda: sum(m.startswith("READY=1") for m in msgs) >= 2, 60, "READY after reload")
    finally:
        code = d.stop()
        stop.set()
        t.join(2)
    assert code == 0
    seq = [m.split("\n")[0] for m in msgs if m.startswith(("READY=1", "RELOADING=1", "STOPPING=1"))]
    assert seq[:3] == ["READY=1", "RELOADING=1", "READY=1"] and seq[-1] == "STOPPING=1", seq
    reloading = next(m for m in msgs if m.startswith("RELOADING=1"))
    assert "MONOTONIC_USEC=" in reloading
