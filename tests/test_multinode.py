"""A rank on "another host": `kvguard worker` started as its own process, as another node would
start it, joining a `kvguard serve` over the authenticated rendezvous on loopback (pipeline
parallel 2: the daemon runs stage 0, the remote worker stage 1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from kvguard.engine import model_runner
from kvguard.engine.config import ConfigError, DistributedConfig, EngineConfig
from kvguard.engine.distributed.parallel_state import PipelineStage, TPGroup
from kvguard.engine.model_config import ModelConfig
from kvguard.engine.model_runner import ModelRunner
from tests.test_server import KVGUARD, TOKEN, free_port, until
from tests.test_tensor_parallel_serve import ask, ready

LISTENING = re.compile(r"kvguard worker --master (127\.0\.0\.1:\d+) --rank R --world-size 2")


class Cluster:
    """A daemon serving the tiny model at pipeline_parallel 2 with rank 1 remote."""

    def __init__(self, tmp: Path, join_timeout: str = "120s") -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = tmp / "worker.key"
        self.key.write_text("a shared secret for this test\n")
        (tmp / "admin.token").write_text(TOKEN + "\n")
        config = tmp / "config.yaml"
        config.write_text(
            "serving: {model: tiny, device: cpu, kv_cache_bytes: 8MiB, max_model_len: 512,\n"
            f"  pipeline_parallel: 2, tensor_parallel_timeout: 30s,\n"
            f"  distributed: {{remote_ranks: [1], authkey_file: '{self.key}',"
            f" join_timeout: {join_timeout}}}}}\n"
            "admission_control: {reserved_headroom_mb: 0}\n"
            f"api: {{host: 127.0.0.1, port: {self.port}, admin_token_file: {tmp / 'admin.token'}}}\n"
            f"audit: {{url: 'sqlite:///{tmp / 'audit.db'}'}}\n"
        )
        self.log_path = tmp / "daemon.log"
        with open(self.log_path, "w") as log:
            self.daemon = subprocess.Popen(
                [KVGUARD, "serve", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                # TMPDIR: a daemon killed while it waits for a rank cannot remove its
                # rendezvous folder (under systemd, PrivateTmp= does)
                env={**os.environ, "STATE_DIRECTORY": str(tmp), "TMPDIR": str(tmp)},
            )
        self.worker: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text()

    def master(self) -> str:
        """HOST:PORT the daemon listens on for its remote ranks, once it says so."""
        found: list[str] = []

        def listening() -> bool:
            assert self.daemon.poll() is None, self.log()
            found[:] = LISTENING.findall(self.log())
            return bool(found)

        until(listening, 120, "the daemon to listen for remote ranks")
        return found[0]

    def start_worker(self) -> subprocess.Popen:
        with open(self.tmp / "worker.log", "w") as log:
            self.worker = subprocess.Popen(
                [KVGUARD, "worker", "--master", self.master(), "--rank", "1"]
                + ["--world-size", "2", "--authkey-file", str(self.key)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self.worker

    def wait_ready(self) -> None:
        until(lambda: ready(self.daemon, self.url, self.tmp), 180, "the daemon to be ready")

    def close(self) -> None:
        for p in (self.daemon, self.worker):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)


@pytest.fixture
def cluster(tmp_path: Path, tiny_dir: Path):  # noqa: ANN201 - a generator fixture
    c = Cluster(tmp_path)
    yield c
    c.close()


def test_a_remote_worker_joins_serves_and_exits_non_zero_when_it_loses_the_master(
    cluster: Cluster,
) -> None:
    worker = cluster.start_worker()
    cluster.wait_ready()
    r = ask(cluster.url)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert "remote rank 1 joined from 127.0.0.1" in cluster.log()
    cluster.daemon.send_signal(signal.SIGKILL)  # the master host goes away
    cluster.daemon.wait(30)
    assert worker.wait(60) == 1
    assert "lost its master" in (cluster.tmp / "worker.log").read_text()


def test_a_remote_worker_killed_mid_run_makes_the_daemon_exit_non_zero(cluster: Cluster) -> None:
    worker = cluster.start_worker()
    cluster.wait_ready()
    assert ask(cluster.url).usage.completion_tokens == 8
    worker.kill()
    worker.wait(30)
    assert cluster.daemon.wait(60) != 0
    assert "rank 1 (remote, 127.0.0.1) closed its connection" in cluster.log()


def test_the_daemon_fails_naming_a_remote_rank_that_never_joins(tmp_path: Path, tiny_dir) -> None:  # noqa: ANN001
    c = Cluster(tmp_path, join_timeout="2s")
    try:
        # 1, not 2 (a config error: RestartPreventExitStatus=2): the rank's host may be booting
        assert c.daemon.wait(120) == 1
        log = c.log()
        assert "rank 1 did not join within 2s" in log
        assert "kvguard worker --master 127.0.0.1:" in log
    finally:
        c.close()


def test_a_wrong_key_is_refused_before_anything_is_read(cluster: Cluster) -> None:
    master = cluster.master()
    cluster.key.write_text("not the daemon's secret\n")  # the worker reads this one
    wrong = subprocess.run(
        [KVGUARD, "worker", "--master", master, "--rank", "1", "--world-size", "2"]
        + ["--authkey-file", str(cluster.key), "--connect-timeout", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.returncode == 2 and "did not accept this worker's key" in wrong.stderr
    until(lambda: "refused a connection to the rendezvous" in cluster.log(), 30, "the refusal")


def test_a_worker_that_finds_no_master_exits_1_to_be_started_again(tmp_path: Path) -> None:
    """kvguard-worker@.service stops for good on exit 2 (RestartPreventExitStatus=2: a bad
    flag or key). No daemon listening within --connect-timeout is not that: the daemon may be
    restarting or its host booting, so the worker exits 1 and systemd starts it again."""
    key = tmp_path / "worker.key"
    key.write_text("a shared secret for this test\n")
    master = f"127.0.0.1:{free_port()}"  # nothing listens there
    alone = subprocess.run(
        [KVGUARD, "worker", "--master", master, "--rank", "1", "--world-size", "2"]
        + ["--authkey-file", str(key), "--connect-timeout", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 1, alone.stderr
    assert f"kvguard: error: no kvguard master at {master} within 0s" in alone.stderr


def test_a_network_address_is_refused_without_allow_network() -> None:
    with pytest.raises(ConfigError, match=r"'10\.1\.2\.3' is not a loopback address"):
        DistributedConfig(
            remote_ranks=(1,), master_addr="10.1.2.3", authkey_file=Path("k")
        ).validate(2)
    DistributedConfig(
        remote_ranks=(1,), master_addr="10.1.2.3", authkey_file=Path("k"), allow_network=True
    ).validate(2)
    refused = subprocess.run(
        [KVGUARD, "worker", "--master", "10.1.2.3:29500", "--rank", "1", "--world-size", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "not a loopback address" in refused.stderr
    for flags, message in (
        (["--master", "127.0.0.1:99999"], "a port 1..65535"),
        (["--connect-timeout", "nan"], "--connect-timeout nan: expected seconds, finite, >= 0"),
        (["--connect-timeout", "-1"], "--connect-timeout -1.0: expected seconds, finite, >= 0"),
        (["--world-size", "1"], "--world-size 1: expected 2 or more"),
    ):
        argv = ["--master", "127.0.0.1:29500", "--rank", "1", "--world-size", "2", *flags]
        bad = subprocess.run([KVGUARD, "worker", *argv], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, (flags, bad.stderr)
        assert "Traceback" not in bad.stderr


def test_a_tensor_parallel_group_split_across_hosts_is_refused() -> None:
    key = Path("k")
    with pytest.raises(ConfigError, match=r"ranks 2\.\.3 would span hosts"):
        DistributedConfig(remote_ranks=(2,), authkey_file=key).validate(4, 2)
    DistributedConfig(remote_ranks=(2, 3), authkey_file=key).validate(4, 2)  # stage 1, whole


def test_the_daemon_config_names_the_line_of_a_network_master(tmp_path: Path) -> None:
    from kvguard.daemon.config import ConfigFileError, load_config

    path = tmp_path / "kvguard.yaml"
    path.write_text(
        "serving:\n  pipeline_parallel: 2\n  distributed:\n    remote_ranks: [1]\n"
        "    master_addr: 10.1.2.3\n    authkey_file: /etc/kvguard/worker.key\n"
    )
    with pytest.raises(ConfigFileError) as info:
        load_config(path).to_engine_config()
    assert info.value.errors[0].startswith(
        f"{path}:5: serving.distributed.master_addr: '10.1.2.3' is not a loopback address"
    )
    path.write_text(path.read_text() + "    allow_network: true\n")
    assert load_config(path).to_engine_config().distributed.allow_network


# -- the daemon's worker key: checked before the bind, a systemd credential under the unit ------
REMOTE_RANK_1 = "serving:\n  model: tiny\n  device: cpu\n  pipeline_parallel: 2\n  distributed: "


def test_a_worker_key_the_daemon_cannot_use_stops_the_start_before_the_bind(
    tmp_path: Path,
) -> None:
    """A missing key failed the start only after the API port was bound and the model loaded,
    with a bare `[Errno 2]`; an empty one was taken, and anyone passes the rendezvous's HMAC
    challenge with an empty key. Both are refused with the key's line before the bind (exit 2),
    an empty key as `kvguard worker` refuses one."""
    from tests.test_server import serve_refused

    key, config = tmp_path / "worker.key", tmp_path / "config.yaml"
    config.write_text(
        REMOTE_RANK_1 + "{remote_ranks: [1], authkey_file: worker.key, join_timeout: 5s}\n"
        "api: {port: 0}\n"
    )
    for content, said in (
        (None, f"cannot read {key}: No such file or directory"),
        (b" \n", f"{key} is empty: any client would pass the rendezvous's challenge with an"),
    ):
        if content is not None:
            key.write_bytes(content)
        proc = serve_refused(config)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out
        assert proc.stderr.startswith(
            f"kvguard: error: {config}:5: serving.distributed.authkey_file: {said}"
        ), out
        assert "API bound" not in out, out


def test_the_daemon_reads_the_worker_key_credential_as_kvguard_worker_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the shipped unit the daemon's dynamic user cannot read a root-only key under /etc:
    with authkey_file unset it reads systemd's credential worker.key, where `kvguard worker`
    looks. A key that is a folder, or an empty credential, is refused with the line."""
    from kvguard.daemon.config import ConfigFileError, load_config

    creds = tmp_path / "creds"
    creds.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    config = tmp_path / "config.yaml"
    config.write_text(REMOTE_RANK_1 + "{remote_ranks: [1]}\n")

    def refused() -> list[str]:
        with pytest.raises(ConfigFileError) as info:
            load_config(config).check_start()
        return info.value.errors

    credential = creds / "worker.key"
    credential.write_text("a shared secret for this test\n")
    assert load_config(config).check_start().distributed.authkey_file == credential
    prefix = f"{config}:5: serving.distributed.authkey_file: "
    credential.write_bytes(b"")
    [line] = refused()
    assert line.startswith(prefix + f"{credential} is empty: "), line
    credential.unlink()
    assert refused() == [
        prefix + "is required with remote ranks: each must prove it holds that secret before "
        "the daemon reads a byte from it (or, under systemd, the credential worker.key: "
        "LoadCredential=worker.key:/etc/kvguard/worker.key)"
    ]
    config.write_text(REMOTE_RANK_1 + f"{{remote_ranks: [1], authkey_file: {creds}}}\n")
    assert refused() == [prefix + f"cannot read {creds}: a directory, not a file"]


# -- which GPU each of a host's ranks takes ----------------------------------------------------
class _Loading(Exception):
    """Ends `ModelRunner.from_config` where it loads the weights: the rank's device is known."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(str(device))
        self.device = device


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """A host where torch sees 2 GPUs (no GPU here: torch.cuda is the boundary faked), whose
    ranks load no weights: `from_config` raises `_Loading` with the device it got. Returns
    the devices `set_device` was given."""
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)

    def load(path, mcfg, max_len, dtype, device, *rest):  # noqa: ANN001, ANN202
        raise _Loading(device)

    monkeypatch.setattr(model_runner, "load_model", load)
    return chosen


def placed(tiny_dir: Path, rank: int, world: int, remote: tuple[int, ...]) -> torch.device:
    """The device `ModelRunner.from_config` gives world rank `rank` of `world` (pipeline
    stages of one rank each) with `remote` run by `kvguard worker` elsewhere."""
    key = Path("worker.key")  # not read: the rank does not reach the rendezvous
    config = EngineConfig(
        model=str(tiny_dir),
        device="cuda",
        pipeline_parallel=world,
        distributed=DistributedConfig(remote_ranks=remote, authkey_file=key),
    )
    stage = PipelineStage(rank, world, range(1), 1, TPGroup(rank, world))
    with pytest.raises(_Loading) as loading:
        ModelRunner.from_config(
            config, tiny_dir, ModelConfig.from_dir(tiny_dir), TPGroup(0, 1), stage
        )
    return loading.value.device


def test_a_hosts_ranks_take_its_gpus_in_order_whatever_ranks_run_elsewhere(
    tiny_dir: Path, gpu_host: list[torch.device]
) -> None:
    """A host's ranks take its GPUs by their index among the ranks it runs. Placed by world
    rank (r mod the GPUs), a 2-GPU host running ranks 0 and 2 (1 and 3 on another host) put
    both on cuda:0 while cuda:1 sat idle, and that other host put 1 and 3 both on cuda:1."""
    cuda = [torch.device("cuda", i) for i in range(2)]
    assert placed(tiny_dir, 2, 4, (1, 3)) == cuda[1]  # by world rank: cuda:0, rank 0's
    assert placed(tiny_dir, 0, 4, (1, 3)) == cuda[0]
    assert [placed(tiny_dir, r, 4, (1, 3)) for r in (1, 3)] == cuda  # the workers' host
    assert gpu_host == [cuda[1], cuda[0], *cuda]
    # every rank here: rank r on cuda:r, as before
    assert [placed(tiny_dir, r, 2, ()) for r in (0, 1)] == cuda
    # a third rank here would share a card, each sizing its KV pool as if it were its own
    with pytest.raises(ConfigError, match=r"this host runs 3 ranks .* torch sees 2"):
        placed(tiny_dir, 2, 4, (3,))
