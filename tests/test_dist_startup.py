"""Starting a distributed daemon when something is wrong with a rank, and stopping one by force:
real `kvguard serve` and `kvguard worker` processes on loopback (see tests/test_multinode.py).

A rank that fails before it joins the process group, or that resolved another model than rank
0's, must fail the start at once naming the rank and why, never leave rank 0 waiting out the
group's start-up timeout or serving wrong tokens; a worker must read $KVGUARD_LOG_LEVEL as the
daemon does; a second SIGTERM must not log the workers it stops as an engine failure."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvguard.engine.tiny_model import tiny_weights
from tests.test_multinode import Cluster
from tests.test_server import KVGUARD, TOKEN, free_port, until
from tests.test_tensor_parallel_serve import alive, ask, tensor_parallel

TINY_CPU = "{model: tiny, device: cpu, kv_cache_bytes: 8MiB, max_model_len: %d%s}"
REFUSED_WITHIN_S = 60  # generous: the fix answers in seconds, the bug waited 600s


# -- a remote rank whose own cache holds something else ---------------------------------------
def odd_home(tmp: Path, tiny_dir: Path, model_home: Path) -> Path:
    """A KVGUARD_HOME whose `tiny` is a complete copy of the real one (marker included), for a
    test to spoil; the compiled CPU kernels come along so that no worker rebuilds them."""
    home = tmp / "remote-home"
    shutil.copytree(tiny_dir, home / "models" / "tiny")
    if (model_home / "kernels").is_dir():
        shutil.copytree(model_home / "kernels", home / "kernels")
    return home / "models" / "tiny"


def start_remote(c: Cluster, home: Path) -> subprocess.Popen:
    """`kvguard worker` as rank 1, resolving the model in `home` (its host's cache)."""
    with open(c.tmp / "worker.log", "w") as log:
        c.worker = subprocess.Popen(
            [KVGUARD, "worker", "--master", c.master(), "--rank", "1"]
            + ["--world-size", "2", "--authkey-file", str(c.key)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KVGUARD_HOME": str(home)},
        )
    return c.worker


def exit_before_ready(c: Cluster, timeout: float) -> int:
    """The daemon's exit status; fails if it turns ready first or is still running."""
    deadline = time.monotonic() + timeout
    while (rc := c.daemon.poll()) is None:
        try:
            went_ready = httpx.get(c.url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            went_ready = False
        assert not went_ready, f"the daemon turned ready:\n{c.log()}"
        if time.monotonic() > deadline:
            pytest.fail(f"the daemon still runs after {timeout:g}s:\n{c.log()}")
        time.sleep(0.1)
    return rc


def refused(tmp_path: Path, home: Path, timeout: float = REFUSED_WITHIN_S) -> tuple[str, float]:
    """Start a cluster whose remote rank uses `home`; the daemon must exit non-zero before READY
    within `timeout`. Its log, and seconds from the worker's start to the daemon's exit."""
    c = Cluster(tmp_path)
    try:
        worker = start_remote(c, home)
        t0 = time.monotonic()
        assert exit_before_ready(c, timeout) != 0
        took = time.monotonic() - t0
        assert worker.wait(60) != 0  # it lost its master while joining
        return c.log(), took
    finally:
        c.close()


@pytest.fixture
def remote_tiny(tmp_path: Path, tiny_dir: Path, model_home: Path) -> Path:
    return odd_home(tmp_path, tiny_dir, model_home)


def test_a_remote_rank_that_cannot_read_its_config_fails_the_start_at_once(
    tmp_path: Path, remote_tiny: Path
) -> None:
    (remote_tiny / "config.json").write_text("{not json\n")
    log, took = refused(tmp_path, remote_tiny.parents[1])
    line = next(ln for ln in log.splitlines() if "tensor-parallel rank 1 failed to start" in ln)
    assert f"ModelLoadError: {remote_tiny / 'config.json'}: " in line, log
    assert took < REFUSED_WITHIN_S


def test_a_remote_rank_with_other_weights_of_the_same_shapes_is_refused_before_ready(
    tmp_path: Path, remote_tiny: Path
) -> None:
    """The same config.json, weights drawn with another seed: it would serve wrong tokens."""
    save_file(tiny_weights(seed=1), str(remote_tiny / "model.safetensors"), {"format": "pt"})
    log, _ = refused(tmp_path, remote_tiny.parents[1])
    assert (
        "tensor-parallel rank 1 resolved a different model: same config.json, different weights"
        f"; its model directory {remote_tiny}" in log
    ), log


def test_a_remote_rank_with_other_shapes_is_refused_before_ready(
    tmp_path: Path, remote_tiny: Path
) -> None:
    """A wider MLP on rank 1: its stage would load and run, and the tokens would be wrong."""
    cfg = json.loads((remote_tiny / "config.json").read_text())
    narrow, wide = cfg["intermediate_size"], 2 * cfg["intermediate_size"]
    cfg["intermediate_size"] = wide
    (remote_tiny / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = load_file(str(remote_tiny / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, t in list(weights.items()):
        if ".mlp." in name:
            shape = [wide if n == narrow else n for n in t.shape]
            weights[name] = torch.randn(shape, generator=gen) * 0.05
    save_file(weights, str(remote_tiny / "model.safetensors"), {"format": "pt"})
    log, _ = refused(tmp_path, remote_tiny.parents[1])
    assert (
        f"tensor-parallel rank 1 resolved a different model: intermediate_size {wide} "
        f"(rank 0: {narrow}); its model directory {remote_tiny}" in log
    ), log


# -- local ranks ------------------------------------------------------------------------------
class Serve:
    """`kvguard serve` of the tiny model on the CPU, killed at the end whatever happened."""

    def __init__(self, tmp: Path, serving_extra: str, env: dict[str, str] | None = None) -> None:
        self.tmp, self.port = tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (tmp / "admin.token").write_text(TOKEN + "\n")
        config = tmp / "config.yaml"
        config.write_text(
            f"serving: {TINY_CPU % (2048, serving_extra)}\n"
            "admission_control: {reserved_headroom_mb: 0}\n"
            f"api: {{host: 127.0.0.1, port: {self.port}, admin_token_file: {tmp / 'admin.token'},"
            " drain_timeout: 60s}\n"
            f"audit: {{url: 'sqlite:///{tmp / 'audit.db'}'}}\n"
        )
        self.log_path = tmp / "daemon.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [KVGUARD, "serve", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "STATE_DIRECTORY": str(tmp), **(env or {})},
            )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.log()
            try:
                return httpx.get(self.url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        until(ready, timeout, "the daemon to be ready")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def serve(tmp_path: Path):  # noqa: ANN201 - a generator fixture
    started: list[Serve] = []

    def start(serving_extra: str, env: dict[str, str] | None = None) -> Serve:
        started.append(Serve(tmp_path, serving_extra, env))
        return started[-1]

    yield start
    for s in started:
        s.kill()


def test_a_log_level_logging_does_not_know_starts_tensor_parallel_as_the_daemon_does(
    serve: Callable[..., Serve], tiny_dir: Path
) -> None:
    """The daemon reads an unknown $KVGUARD_LOG_LEVEL as INFO; so must its workers, which
    inherit it (they died of a ValueError, and rank 0 waited for them for ten minutes)."""
    d = serve(", tensor_parallel: 2", {"KVGUARD_LOG_LEVEL": "debug2"})
    d.wait_ready(90)
    assert ask(d.url).usage.completion_tokens == 8
    workers = tensor_parallel(d.url)["worker_pids"]
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(60) == 0
    until(lambda: not any(alive(p) for p in workers), 30, "the workers to exit")


def test_pipeline_metrics_count_stages_and_ranks_per_stage(
    serve: Callable[..., Serve], tiny_dir: Path
) -> None:
    d = serve(", pipeline_parallel: 2")
    d.wait_ready()
    text = httpx.get(d.url + "/metrics", timeout=30).text
    assert "kvguard_pipeline_parallel_size 2.0" in text
    assert "kvguard_tensor_parallel_size 1.0" in text
    assert "# HELP kvguard_tensor_parallel_size Tensor-parallel ranks each pipeline stage" in text
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(60) == 0


def test_a_second_sigterm_does_not_log_the_stopped_workers_as_an_engine_failure(
    serve: Callable[..., Serve], tiny_dir: Path
) -> None:
    """The forced exit stops the engine loop before its workers: no step runs against a
    worker being stopped, so nothing reads as a rank that died, and nothing at ERROR."""
    d = serve(", tensor_parallel: 2")
    d.wait_ready()
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    chunks = [0, 0]
    done = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        try:
            with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    chunks[i] += line.startswith("data: ")
        except httpx.HTTPError:
            pass  # cut by the forced exit
        finally:
            done[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    until(lambda: all(n > 0 for n in chunks), 60, "both streams to be generating")
    d.proc.send_signal(signal.SIGTERM)
    until(lambda: "draining 2 in-flight requests" in d.log(), 30, "the drain to begin")
    assert not any(e.is_set() for e in done), "a request ended before the second signal"
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(60) == 128 + signal.SIGTERM, d.log()
    log = d.log()
    assert "second SIGTERM during the drain: exiting now with status 143" in log
    errors = [ln for ln in log.splitlines() if re.search(r" (ERROR|CRITICAL) ", ln)]
    assert errors == [], log
    assert "engine failed" not in log, log
