"""Starting a distributed daemon when something is wrong with a rank, and stopping one by force:
real `kvguard serve` and `kvguard worker` processes on loopback (see tests/test_multinode.py).

A rank that fails before it joins the process group, or that resolved another model than rank
0's, must fail the start at once naming the rank and why, never leave rank 0 waiting out the
group's start-up timeout or serving wrong tokens; so must a rank that fails after it said it is
joining (forming the group, loading its shards, or killed), wherever rank 0 is then, and every
other rank must be stopped; a worker must read $KVGUARD_LOG_LEVEL as the daemon does; a second
SIGTERM must not log the workers it stops as an engine failure."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvguard.engine import EngineConfig, LLMEngine
from kvguard.engine.config import ConfigError, DistributedConfig
from kvguard.engine.distributed import driver
from kvguard.engine.distributed.errors import RankFailure
from kvguard.engine.model_runner import ModelRunner
from kvguard.engine.tiny_model import tiny_weights
from tests.test_multinode import Cluster
from tests.test_server import KVGUARD, TOKEN, free_port, until
from tests.test_tensor_parallel import _children
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


def start_remote(c: Cluster, home: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`kvguard worker` as rank 1, resolving the model in `home` (its host's cache)."""
    with open(c.tmp / "worker.log", "w") as log:
        c.worker = subprocess.Popen(
            [KVGUARD, "worker", "--master", c.master(), "--rank", "1"]
            + ["--world-size", "2", "--authkey-file", str(c.key)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KVGUARD_HOME": str(home), **(env or {})},
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


def refused(
    tmp_path: Path,
    home: Path,
    timeout: float = REFUSED_WITHIN_S,
    env: dict[str, str] | None = None,
) -> tuple[str, float]:
    """Start a cluster whose remote rank uses `home` (and `env` on its host); the daemon must
    exit non-zero before READY within `timeout`. Its log, and seconds from the worker's start
    to the daemon's exit."""
    c = Cluster(tmp_path)
    try:
        worker = start_remote(c, home, env)
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


# -- a rank that fails after it said it is joining -------------------------------------------
def test_a_remote_rank_that_fails_to_form_the_group_fails_the_start_at_once(
    tmp_path: Path, remote_tiny: Path
) -> None:
    """Rank 1 has said it is joining (with rank 0's model), then cannot open the group: its
    host's GLOO_SOCKET_IFNAME names no interface. Rank 0 waited in the group's rendezvous for
    the start-up timeout (ten minutes); it must fail at once with rank 1's own error."""
    env = {"GLOO_SOCKET_IFNAME": "kvguard-none0"}
    log, took = refused(tmp_path, remote_tiny.parents[1], env=env)
    line = next(ln for ln in log.splitlines() if "tensor-parallel rank 1 failed to start" in ln)
    assert "kvguard-none0" in line, log
    assert took < REFUSED_WITHIN_S


def tiny_engine(home: Path, tp: int = 1, pp: int = 2, **kw: object) -> LLMEngine:
    """The tiny model from `home`'s cache, in-process, at tensor x pipeline parallel."""
    config = EngineConfig(
        model="tiny",
        home=home,
        device="cpu",
        kv_cache_bytes="8MiB",
        max_model_len=512,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        **kw,
    )
    return LLMEngine.from_config(config, progress=False)


def test_the_engine_refuses_an_empty_worker_key_before_it_listens(
    tmp_path: Path, model_home: Path
) -> None:
    """The Python API has no config check before it: an empty key (a failed copy, `install -m
    0600 /dev/null`) was taken, and the rendezvous then let in anyone, an empty key answering
    its HMAC challenge. Refused, naming the file, before anything listens."""
    key = tmp_path / "worker.key"
    key.write_bytes(b" \n")
    remote = DistributedConfig(remote_ranks=(1,), authkey_file=key, join_timeout_s=5.0)
    with pytest.raises(ConfigError) as err:
        tiny_engine(model_home, distributed=remote)
    assert str(err.value).startswith(f"distributed.authkey_file: {key} is empty: "), err.value


def test_a_remote_rank_that_fails_to_form_the_group_stops_its_healthy_remote_peer(
    tmp_path: Path, model_home: Path, tiny_dir: Path
) -> None:
    """pp 2 x tp 2 with stage 1 (ranks 2 and 3) on "another host": rank 2 cannot open the group
    (no such interface). The start fails naming it, and rank 3, waiting in the store for rank 2
    (it reads nothing else until the group forms), must end too, not wait out the store."""
    key = tmp_path / "worker.key"
    key.write_text("a shared secret for this test\n")
    port = free_port()
    workers = []
    for rank, env in ((2, {"GLOO_SOCKET_IFNAME": "kvguard-none0"}), (3, {})):
        with open(tmp_path / f"worker-{rank}.log", "w") as log:
            workers.append(
                subprocess.Popen(
                    [KVGUARD, "worker", "--master", f"127.0.0.1:{port}", "--rank", str(rank)]
                    + ["--world-size", "4", "--authkey-file", str(key)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env},
                )
            )
    remote = DistributedConfig(
        remote_ranks=(2, 3), master_port=port, authkey_file=key, join_timeout_s=120.0
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as err:
            tiny_engine(model_home, tp=2, pp=2, distributed=remote)
        assert time.monotonic() - t0 < REFUSED_WITHIN_S
        assert err.value.rank == 2 and "kvguard-none0" in str(err.value), err.value
        assert [w.wait(REFUSED_WITHIN_S) for w in workers] == [1, 1]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(30)


# -- local ranks ------------------------------------------------------------------------------
@pytest.fixture
def bad_stage_1(remote_tiny: Path) -> Path:
    """A cache whose tiny model has a layer-1 tensor of the wrong shape: the ranks of pipeline
    stage 1 fail loading their shards after they have joined; stage 0 (rank 0) loads fine."""
    weights = load_file(str(remote_tiny / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 96)
    save_file(weights, str(remote_tiny / "model.safetensors"), {"format": "pt"})
    return remote_tiny.parents[1]


BAD_SHAPE = (
    "failed to start: ModelLoadError: tensor 'model.layers.1.mlp.down_proj.weight' has shape "
    "(64, 96), expected size 128 along dim 1"
)


def test_ranks_that_cannot_load_their_shards_fail_the_start_naming_one_and_stop_every_rank(
    bad_stage_1: Path,
) -> None:
    """pp 2 x tp 2: ranks 2 and 3 fail loading; rank 0 (in its load or in the KV agreement, a
    collective whose gloo error named no rank) must raise the failed rank's own error, and rank
    1, which loaded fine, must be stopped."""
    before = set(_children())
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as err:
        tiny_engine(bad_stage_1, tp=2, pp=2)
    assert time.monotonic() - t0 < REFUSED_WITHIN_S
    assert err.value.rank in (2, 3) and BAD_SHAPE in str(err.value), err.value
    assert not set(_children()) - before


def test_a_rank_failing_while_rank_0_loads_is_named_once_the_load_ends(
    bad_stage_1: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big model loads for minutes on rank 0 (here: a load held a few seconds). Rank 1
    failing meanwhile is not interrupted into the load (an exception raised into a thread may
    land inside an import and leave a module half-initialised: a later start in the process
    then failed in torch's sympy); it is named, with its reason, as soon as the load ends,
    instead of rank 0 then waiting in a start-up collective."""
    load = ModelRunner.from_config
    held_s = 3.0

    def slow_load(cls: type[ModelRunner], *args: object, **kw: object) -> ModelRunner:
        time.sleep(held_s)
        return load(*args, **kw)

    monkeypatch.setattr(ModelRunner, "from_config", classmethod(slow_load))
    before = set(_children())
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as err:
        tiny_engine(bad_stage_1)
    assert held_s <= time.monotonic() - t0 < held_s + REFUSED_WITHIN_S
    assert err.value.rank == 1 and BAD_SHAPE in str(err.value), err.value
    assert not set(_children()) - before


def exited(pid: int) -> bool:
    """Whether the process `pid` has ended with every thread (its sockets closed): its main
    thread turns zombie first, while the others may still be on their way out."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "State:\tZ" in status and "Threads:\t1\n" in status


def test_a_rank_killed_after_it_said_joining_fails_the_start_at_once(
    tiny_dir: Path, model_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 dies (killed, as by the OOM killer) once it has said it is joining, before the
    group has formed: rank 0 waited in the rendezvous, or retried connecting to the dead rank,
    for the start-up timeout; it must fail at once naming rank 1 and how it died, and leave
    nothing behind that stops the next start in this process from forming its group."""
    join = driver.join_group
    before = set(_children())
    killed: list[int] = []

    def kill_rank_1_then_join(rank: int, *args: object) -> object:
        (pid,) = set(_children()) - before
        os.kill(pid, signal.SIGKILL)
        until(lambda: exited(pid), 30, "rank 1 to die")
        killed.append(pid)
        return join(rank, *args)

    monkeypatch.setattr(driver, "join_group", kill_rank_1_then_join)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as err:
        tiny_engine(model_home)
    assert time.monotonic() - t0 < REFUSED_WITHIN_S
    assert err.value.rank == 1, err.value
    assert f"(pid {killed[0]}) died: killed by signal 9 while starting" in str(err.value)
    assert not set(_children()) - before
    monkeypatch.undo()
    tiny_engine(model_home).shutdown()


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


# -- a daemon stopped while its workers start --------------------------------------------------
SPAWNING_PARENT = """
import sys
from pathlib import Path
from kvguard.engine import EngineConfig
from kvguard.engine.distributed.driver import _spawn
worker = _spawn(1, 2, "", "gloo", EngineConfig(model="tiny"), Path(sys.argv[1]))
print(worker.process.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_starting_worker_dies_with_its_parent_before_it_imports_torch(
    tiny_dir: Path,
) -> None:
    """The kernel's kill on the parent's death (PR_SET_PDEATHSIG) is asked for before the
    worker's imports (seconds), not after: a daemon stopped during the model load leaves no
    worker behind. Caught in its torch import and stopped there, the worker can only end by
    that kill once its parent is killed."""
    parent = subprocess.Popen(
        [sys.executable, "-c", SPAWNING_PARENT, str(tiny_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = 0
    try:
        pid = int(parent.stdout.readline())

        def importing_torch() -> bool:
            try:
                return "/torch/lib/" in Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                return False

        until(importing_torch, 120, "the worker to import torch")
        os.kill(pid, signal.SIGSTOP)  # from here only a SIGKILL ends it
        parent.kill()
        parent.wait(30)
        until(lambda: not alive(pid), 30, f"worker {pid} to die with its parent")
    finally:
        parent.kill()
        parent.wait(30)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
