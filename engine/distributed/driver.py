"""Rank 0 of a distributed engine: the driver runner and the worker processes it drives.

The world is tensor_parallel x pipeline_parallel ranks: each pipeline stage (a contiguous run
of decoder layers) is a tensor-parallel group, and rank 0 is stage 0's first rank. Rank 0 runs
its stage, hands the residual stream to the next stage and takes the last stage's logits back.
A step's batch goes through as `pipeline_micro_batches` runs of sequences, so the stages work
on different runs at once; every run's logits are back before the step ends, so the scheduler
never sees a sequence in flight and a pipeline computes exactly what one process computes.

`TensorParallelRunner.launch` starts ranks 1..world-1 as spawned processes, joins them in one
process group (gloo on CPU, NCCL on CUDA) and loads rank 0's shards. The rendezvous is a file
store in a private temporary directory, not a TCP store: torch's TCP store server listens on
every interface whatever host name it is given, and torch.distributed traffic is not
authenticated, so the group opens no listening port of its own; gloo is kept on loopback. Each step it sends every worker one `StepMessage`, runs its
own share of the forward (the collectives inside the model meet the workers' shares) and
samples from the gathered logits. KV copies and the dtype switch are repeated on every rank.

A rank that dies or stops answering leaves the group out of step for good: the runner raises
`RankFailure` naming it, and the only way on is a restart of the whole service.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from kvguard.engine.config import ConfigError, EngineConfig
from kvguard.engine.distributed.errors import RankFailure
from kvguard.engine.distributed.fingerprint import differences, model_fingerprint
from kvguard.engine.distributed.rendezvous import RendezvousServer, peer_closed
from kvguard.engine.distributed.sharding import check_tensor_parallel, stage_layers
from kvguard.engine.distributed.startup import (
    StartupWatch,
    WatchedStore,
    failure_text,
)
from kvguard.engine.distributed.step_message import KVOp, StepEncoder
from kvguard.engine.distributed.worker import (
    LOOPBACK,
    STARTUP_TIMEOUT_S,
    WorkerArgs,
    join_group,
    threads_per_rank,
)
from kvguard.engine.model_config import ModelConfig
from kvguard.engine.model_runner import (
    InjectedOOMError,
    ModelRunner,
    StepInput,
    build_step,
    decode_rows,
    drafted,
    logit_rows,
    pick_device,
    step_token_ids,
)
from kvguard.engine.sequence import Sequence
from kvguard.kernels.cpu_lowbit import step_rows

log = logging.getLogger("kvguard.engine.tp")
DEATH_GRACE_S = 1.0  # after a failed collective: how long to wait for a dead rank to show
STOP_GRACE_S = 5.0


def failed_step(death: str | None, error: str) -> str:
    """A worker's failure that it reported itself (`Worker.run`), and how it ended if it has."""
    return f"{death} after failing a step: {error}" if death else f"failed a step: {error}"


@dataclass(slots=True)
class WorkerHandle:
    rank: int
    process: subprocess.Popen | None  # None: a remote rank (`kvguard worker` on another host)
    conn: Connection
    info: dict = field(default_factory=dict)
    host: str = ""  # a remote rank's address
    reported: str | None = None  # the error of the step it said it failed (`Worker.run`)

    def death(self) -> str | None:
        """Why this worker is gone, or None while it runs."""
        if self.process is None:
            if peer_closed(self.conn):
                return f"(remote, {self.host}) closed its connection"
            return None
        code = self.process.poll()
        if code is None:
            return None
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"(pid {self.process.pid}) died: {how}"

    def poll_for(self, want: str, timeout: float = 0.0) -> tuple[Any] | None:
        """(data,) if this worker's next message, `want`, has come within `timeout`; None if
        nothing has; RankFailure if it reported a failure or died."""
        if (got := self.next_message(timeout)) is None:
            return None
        kind, data = got
        if kind == want:
            return (data,)
        if kind == "gone":
            raise RankFailure(self.rank, f"{data} while starting")
        raise RankFailure(self.rank, f"failed to start: {failure_text(data)}")

    def next_message(self, timeout: float = 0.0) -> tuple[str, Any] | None:
        """This worker's next message (kind, data) if one comes within `timeout`, else None;
        ("gone", why) once it has died or hung up, after whatever it sent before."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                if (why := self.death()) is None:
                    return None
                if not self.conn.poll(0):  # else its last words came just before it died
                    return ("gone", why)
            try:
                got = self.conn.recv()
            except (EOFError, OSError):
                return ("gone", self.gone())
            if got[0] != "beat":  # a pipeline step's heartbeat: read by `heartbeats` only
                return got

    def heartbeats(self) -> int:
        """Read what this worker has sent during a pipeline step, without blocking: how many
        heartbeats; a "failed" message's error goes to `reported`."""
        beats = 0
        try:
            while self.conn.poll(0):
                kind, data = self.conn.recv()
                if kind == "failed":
                    self.reported = failure_text(data)
                beats += kind == "beat"
        except (EOFError, OSError):
            pass  # its death says why
        return beats

    def failure(self) -> str | None:
        """Why this worker failed, or None while it runs: how it died, and the error it
        reported first if it did (a collective or transfer that broke or timed out there).
        Reads what it sent first: a remote rank's closed connection shows (`peer_closed`) only
        once no heartbeat is left unread before the end."""
        self.heartbeats()
        why = self.death()
        if why is not None:
            self.heartbeats()  # its last words, if they came just before it died
        if self.reported is not None:
            return failed_step(why, self.reported)
        return why

    def gone(self) -> str:
        """Why this worker, whose connection has closed, is gone: its exit status once it shows
        (a process closes its sockets a moment before it can be reaped)."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while (why := self.death()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return why or "closed its connection"


@dataclass(slots=True)
class StepStats:
    """Where rank 0's step time goes (the tensor-parallel benchmark reads these)."""

    steps: int = 0
    message_s: float = 0.0  # encoding and sending the step message
    message_bytes: int = 0
    step_s: float = 0.0  # the whole `logits` call
    busy_s: float = 0.0  # rank 0's own forward (its stage's layers, or the whole model at pp=1)
    wait_s: float = 0.0  # pipeline: waiting for the last stage's logits


# The rendezvous folders of starts under way. A stop signal during a start ends the daemon by
# the signal itself (no `finally` runs: see the daemon's `leave_while_loading`), which removes
# them with `remove_starting_rendezvous`; they stayed in /tmp.
_STARTING: set[Path] = set()


def remove_starting_rendezvous() -> None:
    """Remove the rendezvous folders of starts still under way (the process is about to die)."""
    for folder in list(_STARTING):
        shutil.rmtree(folder, ignore_errors=True)


class TensorParallelRunner(ModelRunner):
    can_interrupt = False  # the ranks run each step to its end together
    can_run_ahead = False  # every step is one the other ranks are sent

    def __init__(
        self,
        runner: ModelRunner,
        workers: list[WorkerHandle],
        timeout_s: float,
    ) -> None:
        super().__init__(
            runner.model, runner.model_config, runner.kv_cache, runner.tp, runner.stage
        )
        self.workers = workers
        self.timeout_s = timeout_s
        self.encoder = StepEncoder()
        self.stats = StepStats()
        self._kv_ops: list[KVOp] = []
        self._faults: list[int] = []  # ranks of injected faults still to fire, in order
        self._failed: RankFailure | None = None
        self._split: list[int] | None = None  # pipeline_layers as configured (None: even)
        # the rendezvous folder, removed at launch and again at shutdown: a worker's store
        # could write its file back while launch removed it, leaving the folder behind
        self._rendezvous: Path | None = None
        self.micro_batches = 1  # pipeline: micro-batches a step's batch is split into

    # -- start and stop -------------------------------------------------------------------
    @classmethod
    def launch(cls, config: EngineConfig, path: Path, mcfg: ModelConfig) -> TensorParallelRunner:
        """Spawn the workers, form the group, load rank 0's shards; every rank is ready when
        this returns, or all are stopped and the reason raised. Rank 0 joins the group only
        once every worker has said it is joining, with the same model (`_check_joining`); a
        worker that fails after that ends the start within seconds too (see startup.py)."""

        size = config.world_size
        check_tensor_parallel(mcfg, config.tensor_parallel)
        layers = stage_layers(mcfg.num_layers, config.pipeline_parallel, config.pipeline_layers)
        backend = "nccl" if pick_device(config.device).type == "cuda" else "gloo"
        rendezvous = Path(tempfile.mkdtemp(prefix="kvguard-tp-")) / "store"
        _STARTING.add(rendezvous.parent)
        remote = set(config.distributed.remote_ranks)
        _set_interface(config.distributed.interface if remote else LOOPBACK)
        workers: list[WorkerHandle] = []
        server: RendezvousServer | None = None
        watch: StartupWatch | None = None
        try:
            server = _open_rendezvous(config, str(rendezvous)) if remote else None
            for rank in range(1, size):
                if rank not in remote:
                    workers.append(_spawn(rank, size, str(rendezvous), backend, config, path))
            if server is not None:
                workers += _admit_remote(server, config, backend)
                workers.sort(key=lambda w: w.rank)
            torch.set_num_threads(config.num_threads or threads_per_rank(size))
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            _check_joining(workers, path, mcfg, deadline)
            # From here a worker that fails or dies ends rank 0's start within seconds while it
            # forms the group or waits in a start-up collective, and is named once rank 0 has
            # loaded its own shards (startup.py: why the load itself is not interrupted).
            watch = StartupWatch(workers)
            store = WatchedStore(dist.FileStore(str(rendezvous), size), watch)
            tp, stage = join_group(0, config, layers, store, backend)
            runner = ModelRunner.from_config(config, path, mcfg, tp, stage)
            watch.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        except BaseException as e:
            failure = None if watch is None else watch.explain(e, DEATH_GRACE_S)
            if server is not None:
                server.hang_up()  # a remote rank waiting in the store: it reads no stop
            _stop(workers)
            _leave_group()
            if failure is not None:  # the error rank 0 met, unless it was only the interruption
                raise failure from e
            raise
        finally:
            if server is not None:
                server.close()
            shutil.rmtree(rendezvous.parent, ignore_errors=True)  # every rank has joined
            _STARTING.discard(rendezvous.parent)
        log.info(
            "tensor parallel %d x pipeline %d (layers %s): workers %s on %s",
            config.tensor_parallel,
            config.pipeline_parallel,
            ", ".join(f"{r.start}-{r.stop - 1}" for r in layers),
            ", ".join(_where(w) for w in workers),
            backend,
        )
        out = cls(runner, workers, config.tensor_parallel_timeout_s)
        out._split = config.pipeline_layers
        out.micro_batches = config.pipeline_micro_batches or config.pipeline_parallel
        out._rendezvous = rendezvous.parent
        return out

    def shutdown(self) -> None:
        _stop(self.workers, failed=self._failed is not None)
        _leave_group()
        if self._rendezvous is not None:  # every worker has stopped: nothing writes it now
            shutil.rmtree(self._rendezvous, ignore_errors=True)

    def worker_pids(self) -> list[int]:
        """The local worker processes (remote ranks run on other hosts)."""
        return [w.process.pid for w in self.workers if w.process is not None]

    def kv_bytes_per_rank(self) -> list[int]:
        """Every rank holds the same block count of the same number of KV heads (split or
        replicated) for each of its stage's layers, so a rank's pool is rank 0's scaled by its
        stage's layer count (at pp=1: rank 0's size everywhere)."""
        own, mine = self.kv_cache.device_pool.nbytes, len(self.stage.layers)
        split = self.stage_layer_counts()
        return [own * split[r // self.tp.size] // mine for r in range(self.stage.world.size)]

    def stage_layer_counts(self) -> list[int]:
        cfg = self.model_config
        return [len(r) for r in stage_layers(cfg.num_layers, self.stage.count, self._split)]

    # -- health ---------------------------------------------------------------------------
    def check_alive(self) -> None:
        """RankFailure if a worker has died (a cheap non-blocking wait per worker)."""
        if self._failed is not None:
            raise self._failed
        for w in self.workers:
            if (why := w.failure()) is not None:
                self._fail(RankFailure(w.rank, why))

    def _fail(self, failure: RankFailure) -> NoReturn:
        self._failed = failure
        raise failure

    def _after_error(self, error: BaseException, rank: int = -1) -> NoReturn:
        """A collective or a send failed: name the stopped or dead rank if one shows up, else
        `rank` (the worker a send to failed), else the group. A rank stopped, or dead without a
        word, is named before one that reported a failed step: a collective or transfer with
        a stopped or dead peer breaks or times out there too, as a consequence."""
        deadline = time.monotonic() + DEATH_GRACE_S
        reported: list[tuple[int, str]] = []
        while True:
            self._fail_stopped()
            reported = []
            for w in self.workers:
                if (why := w.failure()) is None:
                    continue
                if w.reported is None:
                    self._fail(RankFailure(w.rank, why))
                reported.append((w.rank, why))
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if reported:
            self._fail(RankFailure(*reported[0]))
        if rank >= 0 and isinstance(error, BlockingIOError | TimeoutError):  # SO_SNDTIMEO
            self._fail(
                RankFailure(rank, f"did not read rank 0's message within {self.timeout_s:g}s")
            )
        if rank >= 0:
            self._fail(RankFailure(rank, f"could not be sent rank 0's message: {error}"))
        self._fail(RankFailure(-1, f"did not complete a step within {self.timeout_s:g}s: {error}"))

    def _fail_stopped(self) -> None:
        """RankFailure naming a local worker that is stopped (SIGSTOP, a debugger)."""
        for w in self.workers:
            if w.process is not None and _state(w.process.pid) == "T":
                self._fail(
                    RankFailure(
                        w.rank,
                        f"(pid {w.process.pid}) is stopped and did not answer within {self.timeout_s:g}s",
                    )
                )

    def _send_all(self, kind: str, payload: object) -> None:
        """Send every worker a message. A worker that reads nothing for `timeout_s` while its
        socket buffer is full fails the send (SO_SNDTIMEO, `_send_timeout`) rather than block
        rank 0 for good; a send cut off part way leaves that stream torn, and the group with it,
        so it is a RankFailure like any other."""
        for w in self.workers:
            try:
                w.conn.send((kind, payload))
            except OSError as e:
                self._after_error(e, w.rank)

    # -- one step -------------------------------------------------------------------------
    def logits(
        self, seqs: list[Sequence], num_tokens: list[int], every_row: bool = False
    ) -> torch.Tensor | None:
        self.check_alive()
        if self._faults:  # decided here, before any rank starts the step: none runs it
            rank = self._faults.pop(0)
            raise InjectedOOMError(f"injected out-of-memory fault on rank {rank} (inject_oom)")
        t0 = time.perf_counter()
        st = self.stats
        if self.stage.count == 1:
            inp = self._start(seqs, num_tokens, every_row, False)
            try:
                hidden = self._forward(inp)
                out = None
                if inp.sample_rows.numel():
                    out = self.model.compute_logits(hidden[inp.sample_rows])
            except Exception as e:  # noqa: BLE001 - the group is out of step: no retry can fix it
                self._after_error(e)
        else:
            out = self._pipeline(seqs, num_tokens, every_row)
        st.steps += 1
        st.step_s += time.perf_counter() - t0
        return out

    def _start(
        self, seqs: list[Sequence], num_tokens: list[int], every_row: bool, continues: bool
    ) -> StepInput:
        """Send every worker this (micro-)batch's step message; rank 0's own step tensors."""
        t0 = time.perf_counter()
        tables = [s.block_table for s in seqs]
        starts = [s.num_computed_tokens for s in seqs]
        sampled = [logit_rows(s, n) for s, n in zip(seqs, num_tokens, strict=True)]
        ids = step_token_ids(seqs, num_tokens)
        handles = [s.order for s in seqs]
        as_decode = drafted(seqs)
        decodes = [decode_rows(s) for s in seqs]
        payload = self.encoder.encode(
            handles, tables, starts, num_tokens, sampled, ids, every_row, self._kv_ops, continues,
            as_decode, decodes,
        )  # fmt: skip
        self._kv_ops = []
        self._send_all("step", payload)
        self.stats.message_s += time.perf_counter() - t0
        self.stats.message_bytes += len(payload)
        return build_step(
            tables, starts, num_tokens, sampled, ids, self.block_size, self.device, every_row,
            as_decode, decodes,
        )  # fmt: skip

    def _forward(self, inp: StepInput) -> torch.Tensor:
        t0 = time.perf_counter()
        with step_rows(inp.kinds):  # every rank's CPU GEMMs pick by the same rows' kinds
            hidden = self.model(
                inp.input_ids, inp.positions, self.kv_cache.layers, inp.meta,
                on_layer=self.on_layer,
            )  # fmt: skip
        self.stats.busy_s += time.perf_counter() - t0
        return hidden

    def _pipeline(
        self, seqs: list[Sequence], num_tokens: list[int], every_row: bool
    ) -> torch.Tensor | None:
        """The batch as micro-batches (contiguous runs of its sequences, in batch order): rank
        0 runs stage 0 of each and hands it on without waiting, so stage 0 computes micro-batch
        k+1 while the next stage computes k; then it takes the logits back in the same order.
        Every micro-batch's tokens return within this call: no sequence is scheduled again
        before its token is in, and the result is the one-batch result, row for row."""
        sends, rows, outs = [], [], []
        stage = self.stage
        try:
            for i, part in enumerate(micro_batches(num_tokens, self.micro_batches)):
                span = slice(part.start, part.stop)
                inp = self._start(seqs[span], num_tokens[span], every_row, i > 0)
                hidden = self._forward(inp).contiguous()
                sends.append((hidden, stage.start_send_next(hidden)))
                rows.append(len(inp.sample_rows))
            t0 = time.perf_counter()
            vocab = self.model_config.vocab_size
            watch = self._watch_stages()
            outs = [stage.recv_logits(n, vocab, self.device, watch) for n in rows if n]
            for _, work in sends:
                stage.finish(work, watch)
            self.stats.wait_s += time.perf_counter() - t0
        except RankFailure:
            raise  # a send to a worker failed (`_send_all`): named already
        except Exception as e:  # noqa: BLE001 - the group is out of step: no retry can fix it
            self._after_error(e)
        return torch.cat(outs) if outs else None

    def _watch_stages(self) -> Callable[[], None]:
        """What rank 0 checks while it waits for the later stages (parallel_state.wait_watched):
        a worker that died or reported a failed step fails the engine at once, naming it; and
        once no worker has sent a heartbeat (sent only while computing) for `timeout_s`, no
        stage is computing, so one is dead, stopped or unreachable: named as after a
        collective that timed out. A stage computing a long step is never a timeout, and its
        heartbeats are rank 0's (`on_layer`: the engine loop's, which the watchdog follows)."""
        heard = time.monotonic()

        def watch() -> None:
            nonlocal heard
            for w in self.workers:
                if w.heartbeats():
                    heard = time.monotonic()
                    if self.on_layer is not None:
                        self.on_layer()
                if w.reported is not None or w.death() is not None:
                    self._after_error(RuntimeError(f"rank {w.rank} failed"))
            if time.monotonic() - heard >= self.timeout_s:
                silence = f"no stage reported computing for {self.timeout_s:g}s"
                self._after_error(TimeoutError(silence))

        return watch

    def worker_busy_s(self) -> dict[int, float]:
        """Each worker's seconds of forward since start (rank -> seconds), asked over its pipe
        between steps: the pipeline benchmark's time per stage and idle share. A worker that
        does not answer within `timeout_s`, or dies, fails the engine as a step would."""
        self._send_all("stats", None)
        out = {}
        for w in self.workers:
            got = w.next_message(self.timeout_s)
            if got is None:
                self._after_error(TimeoutError("no answer to 'stats'"), w.rank)
            kind, data = got
            if kind == "gone":
                self._fail(RankFailure(w.rank, data))
            out[w.rank] = data["busy_s"] if kind == "stats" else float("nan")
        return out

    def inject_oom(self, times: int = 1, rank: int = 0) -> None:
        """Test hook: the next `times` steps fail with an out-of-memory fault on `rank`. Rank 0
        schedules every step, so it holds the faults of all ranks and sends such a step to no
        one: every rank skips it together, with no per-step collective to agree on it."""
        if not 0 <= rank < self.stage.world.size:
            raise ValueError(f"rank={rank}: expected 0 <= rank < {self.stage.world.size}")
        self._faults += [rank] * times

    # -- KV memory, on every rank ---------------------------------------------------------
    def swap_out(self, device_ids: list[int], host_ids: list[int]) -> None:
        super().swap_out(device_ids, host_ids)
        self._kv_ops.append(("swap_out", list(device_ids), list(host_ids)))

    def swap_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        super().swap_in(host_ids, device_ids)
        self._kv_ops.append(("swap_in", list(host_ids), list(device_ids)))

    def can_convert(self, dtype: str, new_n: int) -> bool:
        self.check_alive()
        self._send_all("convert_check", (dtype, new_n))
        try:
            return super().can_convert(dtype, new_n)
        except Exception as e:  # noqa: BLE001 - the agreement broke: the ranks are out of step
            self._after_error(e)

    def can_grow(self, extra_bytes: int) -> bool:
        self.check_alive()
        self._send_all("grow_check", extra_bytes)
        try:
            return super().can_grow(extra_bytes)
        except Exception as e:  # noqa: BLE001 - the agreement broke: the ranks are out of step
            self._after_error(e)

    def convert_kv(self, dtype: str, tiers: dict[str, tuple[int, dict[int, int]]]) -> int:
        self._send_all("convert", (dtype, tiers, self._kv_ops))
        self._kv_ops = []
        return super().convert_kv(dtype, tiers)


def micro_batches(num_tokens: list[int], most: int) -> list[range]:
    """A batch's sequences as at most `most` contiguous runs of about equal token counts,
    none empty."""
    n = min(most, len(num_tokens))
    total, out, start, done = sum(num_tokens), [], 0, 0
    for i, t in enumerate(num_tokens):
        done += t
        cut = len(out) + 1  # the run that closing here would end
        last_chance = len(num_tokens) - (i + 1) == n - cut  # one sequence per run left to open
        if cut < n and (done * n >= total * cut or last_chance):
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, len(num_tokens)))
    return out


def _where(w: WorkerHandle) -> str:
    return f"rank {w.rank} " + (f"pid {w.process.pid}" if w.process else f"remote {w.host}")


def _set_interface(name: str) -> None:
    """The socket interface gloo and NCCL use on this host; an operator's setting wins."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def _open_rendezvous(config: EngineConfig, store: str) -> RendezvousServer:
    d = config.distributed
    if d.authkey_file is None:  # validated with the config; kept for type checkers
        raise RankFailure(-1, "has remote ranks but no distributed.authkey_file")
    key = _read_authkey(Path(d.authkey_file))
    size = config.world_size
    server = RendezvousServer(d.master_addr, d.master_port, key, size, list(d.remote_ranks), store)
    host, port = server.address
    log.info(
        "waiting up to %gs for remote ranks %s: kvguard worker --master %s:%d --rank R "
        "--world-size %d",
        d.join_timeout_s,
        ", ".join(str(r) for r in sorted(d.remote_ranks)),
        host,
        port,
        size,
    )
    return server


def _read_authkey(path: Path) -> bytes:
    """The secret each remote rank must prove it holds. An empty one is no secret (anyone
    answers an HMAC challenge of an empty key), so it is refused, as `kvguard worker` and the
    daemon's config check refuse it; this covers the Python API, which has no such check."""
    try:
        key = path.read_bytes().strip()
    except OSError as e:
        raise ConfigError(
            f"distributed.authkey_file: cannot read {path}: {e.strerror or e}"
        ) from None
    if not key:
        raise ConfigError(
            f"distributed.authkey_file: {path} is empty: any client would pass the rendezvous's "
            "challenge with an empty key (expected the secret shared with every kvguard worker)"
        )
    return key


def _admit_remote(
    server: RendezvousServer, config: EngineConfig, backend: str
) -> list[WorkerHandle]:
    """Wait for every remote rank (RankFailure naming the missing ones), then tell each what
    rank 0 tells a local worker; a remote rank resolves the model in its own cache."""
    out = []
    for r in server.wait(config.distributed.join_timeout_s).values():
        r.control.send(WorkerArgs(r.rank, config.world_size, "", backend, config, None, 0))
        _send_timeout(r.control, config.tensor_parallel_timeout_s)
        out.append(WorkerHandle(r.rank, None, r.control, host=r.host))
    return out


def _check_joining(
    workers: list[WorkerHandle], path: Path, mcfg: ModelConfig, deadline: float
) -> None:
    """Wait until every worker is about to join the group, before rank 0 joins it: a worker
    that fails first (a model it cannot resolve or read, a bad setting) is named at once with
    its reason, where rank 0 in the group would wait out the start-up timeout for it. A remote
    rank's model (resolved in its host's cache) must be rank 0's: RankFailure naming what
    differs, before any rank loads weights that would compute wrong tokens or break a step."""
    mine: dict | None = None
    waiting = list(workers)
    while waiting:
        for w in list(waiting):
            got = w.poll_for("joining")
            if got is None:
                continue
            waiting.remove(w)
            theirs = (got[0] or {}).get("model")
            if theirs is None:
                continue
            if mine is None:
                mine = model_fingerprint(path, mcfg)
            if (what := differences(mine, theirs)) is not None:
                raise RankFailure(w.rank, f"resolved a different model: {what}")
        if waiting:
            if time.monotonic() >= deadline:
                raise RankFailure(waiting[0].rank, "did not report joining in time")
            wait([w.conn for w in waiting], 0.1)


def _state(pid: int) -> str:
    """The process state letter from /proc (T: stopped), '' when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _spawn(
    rank: int, size: int, store: str, backend: str, config: EngineConfig, path: Path
) -> WorkerHandle:
    """Start one worker as `python -m kvguard.engine.distributed.worker_entry`, talking over a
    socket pair it inherits. A fresh interpreter, not a multiprocessing child: it does not re-run
    the caller's main module, whatever script started the engine. It is told this process's pid
    on its command line, so that it dies with it from its first instant (worker_entry.py).
    `-P`: `-m` would put the cwd first on sys.path, and a `kvguard/` checkout or a `kvguard.py`
    there would be imported in place of the installed package rank 0 runs."""
    ours, theirs = socket.socketpair()
    entry = "kvguard.engine.distributed.worker_entry"
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", entry, str(theirs.fileno()), str(os.getpid())],
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
    )
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(WorkerArgs(rank, size, store, backend, config, Path(path), os.getpid()))
    _send_timeout(conn, config.tensor_parallel_timeout_s)
    return WorkerHandle(rank, proc, conn)


def _send_timeout(conn: Connection, seconds: float) -> None:
    """Make a send on rank 0's end of a worker's connection fail (OSError) once it has gone
    `seconds` without the worker taking a byte (SO_SNDTIMEO): a step message larger than the
    socket buffer to a rank that stopped reading would otherwise block rank 0 for good, past
    every collective's timeout. A busy rank that reads on is not cut off: the timeout counts
    from the last byte that went through, and a send goes on where a partial write ended."""
    micros = max(1, round(seconds * 1e6))  # 0 would mean no timeout at all
    timeval = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _stop(workers: list[WorkerHandle], failed: bool = False) -> None:
    """Ask each worker to stop, then make sure: no worker outlives the engine. A `failed`
    group's workers are not asked (a stream may be torn part way through a message, or a
    stopped worker's buffer full): rank 0 hangs up, which ends a worker's wait for a message."""
    for w in workers:
        if failed:
            w.conn.close()
            continue
        with contextlib.suppress(OSError):
            w.conn.send(("stop", None))
    deadline = time.monotonic() + STOP_GRACE_S
    for w in workers:
        if w.process is None:  # a remote rank stops itself; its host's systemd restarts it
            w.conn.close()
            continue
        try:
            w.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait(STOP_GRACE_S)
        w.conn.close()


def _leave_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly
            log.warning("process group did not tear down cleanly", exc_info=True)
    else:
        _forget_group_names()


def _forget_group_names() -> None:
    """After a start that failed while the group formed: torch numbers this process's groups,
    and the failed default group kept its number (destroy_process_group, which resets the
    count, needs a group that formed). The next start here would look for its peers' keys
    under another number than fresh workers write them, and wait out the start-up timeout."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):  # torch 2.x; absent: nothing to do
        world.group_count = 0
