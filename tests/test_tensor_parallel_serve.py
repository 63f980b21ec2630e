"""`kvguard serve` with tensor parallelism, as an operator runs it: real worker processes (gloo on
CPU), real HTTP on loopback, the real `openai` client; the daemon stops its workers when it
exits, and a killed worker makes it exit non-zero for systemd to restart it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import openai
import yaml

from tests.test_server import KVGUARD, TOKEN, Daemon, free_port, until

EXAMPLE = Path(__file__).resolve().parents[1] / "daemon" / "examples" / "dual-gpu-13b.yaml"
TINY_CPU = "{model: tiny, device: cpu, kv_cache_bytes: 8MiB, max_model_len: 512}"


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def tensor_parallel(url: str) -> dict:
    r = httpx.get(url + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tensor_parallel"]


def ask(url: str) -> openai.types.Completion:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=8, extra_body={"ignore_eos": True}
    )


def stop_and_check_workers(proc: subprocess.Popen, workers: list[int]) -> None:
    """SIGTERM drains and exits 0, and no worker outlives the daemon."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    until(lambda: not any(alive(p) for p in workers), 30, f"workers {workers} to exit")


def dual_gpu_on_cpu(tmp_path: Path, port: int) -> Path:
    """daemon/examples/dual-gpu-13b.yaml as shipped, but serving the tiny model on the CPU:
    only what a host without GPUs or the 13B weights needs is changed."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    assert cfg["serving"]["tensor_parallel"] == 2  # kept from the file
    cfg["serving"].update(model="tiny", device="cpu", kv_cache_bytes="8MiB", max_model_len=512)
    cfg["admission_control"]["reserved_headroom_mb"] = 0  # the CPU pool is the byte budget
    (tmp_path / "admin.token").write_text(TOKEN + "\n")
    cfg["api"] = {
        "host": "127.0.0.1",
        "port": port,
        "admin_token_file": str(tmp_path / "admin.token"),
    }
    cfg["audit"] = {"url": f"sqlite:///{tmp_path / 'audit.db'}"}
    path = tmp_path / "dual-gpu-13b.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dual_gpu_example_serves_with_two_ranks(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = dual_gpu_on_cpu(tmp_path, port)
    with open(tmp_path / "daemon.log", "w") as log:
        proc = subprocess.Popen(
            [KVGUARD, "serve", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STATE_DIRECTORY": str(tmp_path)},
        )
    try:
        until(lambda: ready(proc, url, tmp_path), 180, "the two-rank daemon to be ready")
        tp = tensor_parallel(url)
        assert tp["size"] == 2 and len(tp["worker_pids"]) == 1 and tp["failure"] is None
        assert all(alive(p) for p in tp["worker_pids"])
        r = ask(url)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert "kvguard_tensor_parallel_size 2.0" in metrics
        for rank in (0, 1):
            assert f'kvguard_kv_cache_rank_bytes{{rank="{rank}"}}' in metrics
        assert 'kvguard_kv_cache_dtype_info{dtype="fp8_e4m3"} 1.0' in metrics  # as the file says
        stop_and_check_workers(proc, tp["worker_pids"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def ready(proc: subprocess.Popen, url: str, tmp_path: Path) -> bool:
    assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_tensor_parallel_flag_serves_the_openai_client(tmp_path: Path) -> None:
    d = Daemon(tmp_path, serving=TINY_CPU, args=("--tensor-parallel", "2", "--model", "tiny"))
    try:
        tp = tensor_parallel(d.url)
        assert tp["size"] == 2 and len(tp["worker_pids"]) == 1
        r = ask(d.url)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        chunks = list(
            d.client().completions.create(
                model="tiny", prompt="Hello there", max_tokens=8, stream=True, temperature=0
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        status = subprocess.run(
            [KVGUARD, "status", "--url", d.url, "--token-file", str(tmp_path / "admin.token")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        pid = tp["worker_pids"][0]
        assert f"2 tensor-parallel  workers pid {pid}" in status.stdout
        stop_and_check_workers(d.proc, tp["worker_pids"])
    finally:
        d.stop()


def test_a_killed_worker_makes_the_daemon_exit_non_zero(tmp_path: Path) -> None:
    """A worker killed mid-request (an OOM killer, a driver fault): the request gets 503
    engine_unavailable, the log names the rank and its pid, and the daemon exits 1 on its own,
    leaving no worker behind."""
    d = Daemon(tmp_path, serving=TINY_CPU, args=("--tensor-parallel", "2"))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 480, "ignore_eos": True, "stream": True}
    try:
        (pid,) = tensor_parallel(d.url)["worker_pids"]
        with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # generating on both ranks
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert json.loads(rest[-1][6:])["error"]["code"] == "engine_unavailable"
        assert d.proc.wait(60) == 1
    finally:
        d.stop()
    log = Path(d.log.name).read_text()
    assert f"engine failed for good: tensor-parallel rank 1 (pid {pid}) died" in log
    assert not alive(pid)


def test_a_worker_killed_while_idle_is_noticed_without_traffic(tmp_path: Path) -> None:
    """No request needs to fail first: the idle engine loop checks its ranks, so a daemon
    with a dead worker does not sit READY until the next client finds out."""
    d = Daemon(tmp_path, serving=TINY_CPU, args=("--tensor-parallel", "2"))
    try:
        (pid,) = tensor_parallel(d.url)["worker_pids"]
        os.kill(pid, signal.SIGKILL)
        assert d.proc.wait(60) == 1
    finally:
        d.stop()
    log = Path(d.log.name).read_text()
    assert f"engine failed for good: tensor-parallel rank 1 (pid {pid}) died" in log


def test_a_worker_stalled_in_a_live_remedy_answers_503_and_the_daemon_exits(
    tmp_path: Path,
) -> None:
    """A worker that stops answering during a remedy's agreement across the ranks: the admin
    action answers 503 engine_unavailable (not a 500), and the daemon fails for good naming
    the rank, as it does for a step."""
    serving = TINY_CPU[:-1] + ", tensor_parallel: 2, tensor_parallel_timeout: 2s}"
    d = Daemon(tmp_path, serving=serving)
    (pid,) = tensor_parallel(d.url)["worker_pids"]
    try:
        os.kill(pid, signal.SIGSTOP)
        r = d.admin("POST", "/admin/actions/enable_fp8_kv", json={})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert d.proc.wait(60) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone with the daemon (its parent)
            os.kill(pid, signal.SIGCONT)
        d.stop()
    log = Path(d.log.name).read_text()
    assert f"engine failed for good: tensor-parallel rank 1 (pid {pid}) is stopped" in log


def test_workers_die_with_a_daemon_killed_by_sigkill(tmp_path: Path) -> None:
    """SIGKILL leaves the daemon no chance to stop its workers: the kernel does it for them
    (PR_SET_PDEATHSIG), so no orphan rank holds a GPU while systemd restarts the service."""
    d = Daemon(tmp_path, serving=TINY_CPU, args=("--tensor-parallel", "2"))
    try:
        workers = tensor_parallel(d.url)["worker_pids"]
        assert workers and all(alive(p) for p in workers)
        d.proc.kill()
        d.proc.wait(30)
        until(lambda: not any(alive(p) for p in workers), 30, f"workers {workers} to die")
    finally:
        d.stop()
