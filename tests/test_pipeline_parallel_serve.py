"""`kvguard serve` with pipeline parallelism, as an operator runs it: the shipped 70B baseline
(tensor_parallel 8 x pipeline_parallel 2) scaled down to what a CPU host runs, real worker
processes, real HTTP on loopback and the real `openai` client."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from tests.test_server import KVGUARD, TOKEN, free_port, until
from tests.test_tensor_parallel_serve import ask, ready, stop_and_check_workers, tensor_parallel

EXAMPLE = Path(__file__).resolve().parents[1] / "daemon" / "examples" / "multi-gpu-70b.yaml"


def large_baseline_on_cpu(tmp_path: Path, port: int) -> Path:
    """daemon/examples/multi-gpu-70b.yaml with its scale changed (the tiny model's two layers,
    two ranks per stage, the CPU) and everything else, pipeline included, kept as shipped."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    assert cfg["serving"]["pipeline_parallel"] == 2  # kept from the file
    cfg["serving"].update(
        model="tiny", device="cpu", tensor_parallel=2, kv_cache_bytes="8MiB", max_model_len=512
    )
    cfg["quantization"]["model_quantization"] = "auto"  # the tiny checkpoint is not AWQ
    cfg["admission_control"]["reserved_headroom_mb"] = 0  # the CPU pool is the byte budget
    (tmp_path / "admin.token").write_text(TOKEN + "\n")
    cfg["api"] = {
        "host": "127.0.0.1",
        "port": port,
        "admin_token_file": str(tmp_path / "admin.token"),
    }
    cfg["audit"] = {"url": f"sqlite:///{tmp_path / 'audit.db'}"}
    path = tmp_path / "multi-gpu-70b.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_large_baseline_scaled_down_serves_a_request(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = large_baseline_on_cpu(tmp_path, port)
    with open(tmp_path / "daemon.log", "w") as log:
        proc = subprocess.Popen(
            [KVGUARD, "serve", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STATE_DIRECTORY": str(tmp_path)},
        )
    try:
        until(lambda: ready(proc, url, tmp_path), 180, "the four-rank daemon to be ready")
        tp = tensor_parallel(url)
        assert tp["size"] == 2 and len(tp["worker_pids"]) == 3 and tp["failure"] is None
        assert tp["pipeline_stages"] == 2
        r = ask(url)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        log_text = (tmp_path / "daemon.log").read_text()
        assert "tensor parallel 2 x pipeline 2 (layers 0-0, 1-1)" in log_text
        status = subprocess.run(
            [KVGUARD, "status", "--url", url, "--token-file", str(tmp_path / "admin.token")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert "2 tensor-parallel x 2 pipeline stages  workers pid" in status.stdout
        stop_and_check_workers(proc, tp["worker_pids"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
