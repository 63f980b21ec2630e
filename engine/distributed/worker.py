"""A tensor-parallel worker rank: a ModelRunner in a loop, driven by rank 0 over a pipe.

Rank 0 (the daemon's process) spawns ranks 1..tp-1 with this module's `worker_main`. A worker
says it is joining (a remote rank with its model's fingerprint, see fingerprint.py), joins the
process group, loads its shards, reports ready, then runs whatever rank 0 sends, in
order: a step (KV copies replayed first, then the forward; rank 0 alone samples), a KV dtype
switch (checked, then applied), or stop. It never outlives rank 0: the kernel kills it when its
parent dies (PR_SET_PDEATHSIG, set by worker_entry.py before this module is imported), and a
closed pipe ends its loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from kvguard.engine.config import EngineConfig
from kvguard.engine.distributed.fingerprint import model_fingerprint
from kvguard.engine.distributed.parallel_state import PipelineStage, TPGroup
from kvguard.engine.distributed.sharding import stage_layers
from kvguard.engine.distributed.step_message import StepDecoder, StepMessage
from kvguard.engine.distributed.worker_entry import die_with_parent
from kvguard.engine.log_level import log_level
from kvguard.engine.model import weight_bytes
from kvguard.engine.model_config import ModelConfig
from kvguard.engine.model_registry import resolve_model
from kvguard.engine.model_runner import ModelRunner, build_step
from kvguard.kernels.cpu_lowbit import step_rows

log = logging.getLogger("kvguard.engine.worker")
LOOPBACK = "lo"  # gloo's interface: ranks of one host never need another
STARTUP_TIMEOUT_S = 600.0  # joining the group and loading every rank's shards
BEATS_PER_TIMEOUT = 4  # a computing stage's heartbeats within one tensor_parallel_timeout
BEAT_EVERY_S = 1.0  # and at least this often: rank 0 passes them on to the engine loop's
# heartbeat, which the systemd watchdog follows (rank 0 itself computes nothing meanwhile)
# Test hook: "RANK:SECONDS[:PATH]" makes rank RANK's first step take SECONDS longer, inside its
# compute (heartbeats go on), after creating PATH: a stage computing a long step, on demand.
SLOW_FIRST_STEP_ENV = "KVGUARD_TEST_SLOW_FIRST_STEP"


def threads_per_rank(size: int) -> int:
    """Each rank's share of the cores: ranks compute at once, and oversubscribed threads on a
    small machine spin against each other in every collective."""
    return max(1, (os.cpu_count() or 1) // size)


def join_group(
    rank: int,
    config: EngineConfig,
    layers: list[range],
    store: str | Any,
    backend: str,
) -> tuple[TPGroup, PipelineStage]:
    """Join the ranks' process group; return this rank's tensor-parallel group (what the
    model's collectives use) and its pipeline stage (which layers it runs, and the group over
    every rank that carries the transfers between stages and the agreements).

    World rank = stage * tensor_parallel + tp rank: a stage's tp group is consecutive ranks, so
    the ranks of one host form whole tp groups. Every rank creates every group, in the same
    order (torch.distributed requires it). Two timeouts: the default group (start-up: joining,
    and agreeing on the KV block count after every rank has loaded its shards, which for a
    large model takes minutes) waits up to STARTUP_TIMEOUT_S; the step groups give up after
    `tensor_parallel_timeout_s`, so a hung rank is named well before systemd's watchdog gives
    up on the whole daemon. The transfers between stages on gloo are the exception: they wait
    as long as the stages compute (parallel_state.wait_watched), and rank 0 tells a computing
    stage from a dead or silent one by its heartbeats (`Worker.beating`)."""
    import torch.distributed as dist

    tp_size, pp_size = config.tensor_parallel, config.pipeline_parallel
    size = tp_size * pp_size
    startup = timedelta(seconds=STARTUP_TIMEOUT_S)
    if isinstance(store, str):
        store = dist.FileStore(store, size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=startup)
    step = timedelta(seconds=config.tensor_parallel_timeout_s)
    world = dist.new_group(list(range(size)), timeout=step)
    mine = world
    if pp_size > 1:
        for s in range(pp_size):
            group = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=step)
            if s == rank // tp_size:
                mine = group
    index = rank // tp_size
    tp = TPGroup(rank % tp_size, tp_size, mine)
    world_group = TPGroup(rank, size, world)
    return tp, PipelineStage(index, pp_size, layers[index], tp_size, world_group)


@dataclass(slots=True, frozen=True)
class WorkerArgs:
    """What rank 0 tells a worker first, over the socket it inherits."""

    rank: int
    size: int
    store: str  # the rendezvous file, in a directory only this user can read ("": remote)
    backend: str
    config: EngineConfig
    path: Path | None  # None: a remote rank resolves the model in its own cache
    parent_pid: int  # 0: a remote rank, whose parent is its host's systemd


def main(argv: list[str]) -> None:
    conn = Connection(int(argv[0]))
    args: WorkerArgs = conn.recv()
    worker_main(args, conn)


def worker_main(args: WorkerArgs, conn: Connection, store: Any = None) -> bool:
    """Join, load, serve until told to stop (True) or until rank 0 is gone (False). `store`:
    a remote rank's store proxy, in place of the rendezvous file."""
    rank, size, config, path = args.rank, args.size, args.config, args.path
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    logging.basicConfig(
        level=log_level(),
        format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s",
    )
    torch.set_num_threads(config.num_threads or threads_per_rank(size))
    try:
        fingerprint = None
        if path is None:  # a remote rank: its own cache, which rank 0 checks against its own
            path = resolve_model(config.model, config.home, False, config.model_quantization)
            mcfg = ModelConfig.from_dir(path)
            fingerprint = model_fingerprint(path, mcfg)
        else:
            mcfg = ModelConfig.from_dir(path)
        layers = stage_layers(mcfg.num_layers, config.pipeline_parallel, config.pipeline_layers)
        # Rank 0 joins the group only once every rank has said this (or failed): a rank that
        # fails before it joins is reported at once, not after the group's start-up timeout.
        conn.send(("joining", {"model": fingerprint}))
        tp, stage = join_group(rank, config, layers, store or args.store, args.backend)
        runner = ModelRunner.from_config(config, path, mcfg, tp, stage)
        info = {
            "pid": os.getpid(),
            "kv_bytes": runner.kv_cache.device_pool.nbytes,
            "weight_bytes": weight_bytes(runner.model),
        }
        conn.send(("ready", info))
    except Exception as e:  # noqa: BLE001 - tell rank 0 why, then exit non-zero
        # when: a rank whose collective broke because another rank failed first fails too,
        # later; rank 0 names the first (clocks of one host agree)
        when = time.time()
        log.exception("rank %d failed to start", rank)
        _send(conn, ("failed", {"error": f"{type(e).__name__}: {e}", "at": when}))
        os._exit(1)
    beat_s = min(BEAT_EVERY_S, config.tensor_parallel_timeout_s / BEATS_PER_TIMEOUT)
    return Worker(runner, conn, beat_s).run()


def _send(conn: Connection, msg: object) -> None:
    with contextlib.suppress(OSError):
        conn.send(msg)


def _slow_first_step(rank: int) -> tuple[float, Path | None]:
    """The test hook's (seconds, path to create) for `rank` from SLOW_FIRST_STEP_ENV; (0, None)
    when it is unset or names another rank."""
    value = os.environ.get(SLOW_FIRST_STEP_ENV, "")
    who, _, rest = value.partition(":")
    if not value or int(who) != rank:
        return 0.0, None
    seconds, _, path = rest.partition(":")
    return float(seconds), Path(path) if path else None


class Worker:
    def __init__(self, runner: ModelRunner, conn: Connection, beat_s: float = BEAT_EVERY_S) -> None:
        self.runner = runner
        self.conn = conn
        self.decoder = StepDecoder()
        self.busy_s = 0.0  # seconds in this rank's forward (the pipeline benchmark reads it)
        self.beat_s = beat_s  # seconds between heartbeats while computing a pipeline step
        self._last_beat = 0.0
        self._slow_s, self._slow_mark = _slow_first_step(runner.stage.world.rank)

    def run(self) -> bool:
        """Serve rank 0's messages: True when told to stop, False when rank 0 is gone. A
        message this rank fails to carry out (a collective or transfer that broke or timed out)
        is reported to rank 0 as this rank's failure, with its error, before the error ends
        the process: rank 0 names the rank and what it met, not only its exit status."""
        while True:
            try:
                kind, payload = self.conn.recv()
            except (EOFError, OSError):
                return False
            if kind == "stop":
                return True
            try:
                getattr(self, f"on_{kind}")(payload)
            except Exception as e:
                when = time.time()
                log.exception("rank %d: %r failed", self.runner.stage.world.rank, kind)
                _send(self.conn, ("failed", {"error": f"{type(e).__name__}: {e}", "at": when}))
                raise

    @contextlib.contextmanager
    def beating(self) -> Iterator[None]:
        """While this rank computes a pipeline step, tell rank 0 every `beat_s` that it is
        alive: rank 0, waiting for the later stages, tells a stage computing a long step from a
        dead, stopped or unreachable one by these, not by how long the step takes. Sent only
        while computing (a stage waiting for another is not progress) and only at pp > 1 (a
        tensor-parallel step meets rank 0 in its collectives)."""
        if self.runner.stage.count == 1:
            yield
            return
        stop = threading.Event()

        def due() -> float:  # counted across steps: many short ones still beat
            return max(0.0, self._last_beat + self.beat_s - time.monotonic())

        def beat() -> None:
            while not stop.wait(due()):
                self._beat()

        if due() == 0.0:
            self._beat()

        beater = threading.Thread(target=beat, name="kvguard-heartbeat", daemon=True)
        beater.start()
        try:
            yield
        finally:
            stop.set()
            beater.join()

    def _beat(self) -> None:
        self._last_beat = time.monotonic()
        _send(self.conn, ("beat", None))

    def _test_slow_step(self) -> None:
        """The SLOW_FIRST_STEP_ENV hook: the first step only."""
        seconds, mark = self._slow_s, self._slow_mark
        self._slow_s, self._slow_mark = 0.0, None
        if mark is not None:
            mark.touch()
        time.sleep(seconds)

    @torch.inference_mode()
    def on_step(self, payload: bytes) -> None:
        msg: StepMessage = pickle.loads(payload)
        self.on_kv_ops(msg.kv_ops)
        tables = self.decoder.tables(msg)
        r = self.runner
        inp = build_step(
            tables,
            msg.starts,
            msg.num_tokens,
            msg.sampled,
            msg.token_ids,
            r.block_size,
            r.device,
            msg.every_row,
            msg.as_decode,
            msg.decodes,
        )
        stage = r.stage
        received = None
        if not stage.is_first:  # the previous stage's residual stream, one row per token
            width = r.model_config.hidden_size
            received = stage.recv_prev(
                torch.empty(len(inp.input_ids), width, dtype=r.dtype, device=r.device)
            )
        logits = None
        with self.beating():
            if self._slow_s or self._slow_mark is not None:
                self._test_slow_step()
            t0 = time.perf_counter()
            with step_rows(inp.kinds):  # the kernels rank 0 picks for the same rows
                hidden = r.model(
                    inp.input_ids, inp.positions, r.kv_cache.layers, inp.meta, received
                )
            self.busy_s += time.perf_counter() - t0
            if stage.is_last and inp.sample_rows.numel():
                logits = r.model.compute_logits(hidden[inp.sample_rows])  # gathered to tp rank 0
        if not stage.is_last:
            stage.send_next(hidden)
        elif logits is not None and stage.count > 1:
            stage.send_logits(logits)  # the driver samples

    def on_kv_ops(self, ops: list) -> None:  # noqa: ANN001 - list of KVOp
        for kind, src, dst in ops:
            getattr(self.runner, kind)(src, dst)

    def on_convert_check(self, payload: tuple) -> None:
        dtype, new_n = payload
        self.runner.can_convert(dtype, new_n)  # the agreement is the collective inside

    def on_grow_check(self, payload: int) -> None:
        self.runner.can_grow(payload)  # the agreement is the collective inside

    def on_convert(self, payload: tuple) -> None:
        dtype, tiers, ops = payload
        self.on_kv_ops(ops)
        self.runner.convert_kv(dtype, tiers)

    def on_ping(self, _payload: object) -> None:
        self.conn.send(("pong", {"kv_bytes": self.runner.kv_cache.device_pool.nbytes}))

    def on_stats(self, _payload: object) -> None:
        """Seconds spent computing since start (busy); the rest of a rank's time is waiting."""
        self.conn.send(("stats", {"busy_s": self.busy_s}))


def remote_main(
    master: tuple[str, int],
    rank: int,
    world_size: int,
    authkey: bytes,
    connect_timeout_s: float,
) -> int:
    """`kvguard worker`: join the daemon at `master` as `rank` from another host; the exit
    status: 0 when the daemon stopped it, 1 when it lost the daemon (systemd restarts it
    either way, and it rejoins when the daemon is back)."""
    from kvguard.engine.config import kvguard_home
    from kvguard.engine.distributed.rendezvous import StoreProxy, connect

    control, store = connect(master, authkey, rank, world_size, connect_timeout_s)
    args: WorkerArgs = control.recv()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", args.config.distributed.interface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", args.config.distributed.interface)
    args = replace(args, config=replace(args.config, home=kvguard_home()))  # this host's cache
    try:
        stopped = worker_main(args, control, StoreProxy(store))
    except Exception:  # noqa: BLE001 - a collective broken by a lost master, most likely
        log.exception("rank %d: a step failed", rank)
        stopped = False
    if not stopped:
        log.error("rank %d lost its master at %s:%d; exiting", rank, *master)
        return 1
    log.info("rank %d stopped by its master", rank)
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
