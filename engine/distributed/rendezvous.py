"""Ranks on other hosts: how a `kvguard worker` joins the daemon's process group.

torch's TCPStore, the usual rendezvous, listens on every interface whatever host name it is
given (checked with torch 2.13: `TCPStore("127.0.0.1", 0, is_master=True)` listens on `*:port`)
and authenticates nothing. So the daemon opens no TCPStore. It listens with
`multiprocessing.connection` on the one address the operator configured
(`serving.distributed.master_addr`, loopback unless `allow_network` says otherwise), and every
connection must prove it holds the shared key (HMAC challenge, `authkey`) before a byte of it is
read. A remote rank opens two such connections: a control channel (its step messages, exactly as
a local worker's pipe) and a store channel, over which its `StoreProxy` forwards every store
operation to the daemon's own file store. The group's data then flows over gloo (or NCCL)
between the ranks' configured interfaces; that traffic is not authenticated, which is why it
belongs on a private network.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)
from typing import Any

import torch.distributed as dist

from kvguard.engine.distributed.errors import RankFailure

log = logging.getLogger("kvguard.engine.rendezvous")
ACCEPT_POLL_S = 0.2
HANDSHAKE_S = 10.0  # a connection has this long to prove the key and say hello
MAX_HANDSHAKES = 32  # connections in their handshake at once; more are closed unread


class Refused(ConnectionError):
    """The master refused this rank for a reason retrying cannot change (its world size, a
    rank the daemon does not expect): the worker ends at once with the master's reason."""


# -- the remote rank's side -------------------------------------------------------------------
class StoreProxy(dist.Store):
    """A torch.distributed store whose every operation is answered by the daemon."""

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.conn = conn
        self.lock = threading.Lock()

    def _call(self, *request: Any) -> Any:
        with self.lock:
            self.conn.send(request)
            ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"store at the master: {value}")
        return value

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: Any = None) -> None:  # noqa: ARG002 - master's
        self._call("wait", list(keys))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")


def connect(
    master: tuple[str, int], authkey: bytes, rank: int, world_size: int, timeout_s: float
) -> tuple[Connection, Connection]:
    """The (control, store) connections of a remote rank, retried until the master answers or
    `timeout_s` passes (a worker may start before its daemon)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            control = _join(master, authkey, "control", rank, world_size)
            try:
                return control, _join(master, authkey, "store", rank, world_size)
            except BaseException:
                control.close()  # so that the next try is not refused as already joined
                raise
        except AuthenticationError as e:
            raise ConnectionError(
                f"the master at {master[0]}:{master[1]} did not accept this worker's key "
                f"(it must equal the daemon's serving.distributed.authkey_file): {e}"
            ) from e
        except Refused:
            raise
        except (ConnectionRefusedError, ConnectionResetError, EOFError, TimeoutError) as e:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"no kvguard master at {master[0]}:{master[1]} within {timeout_s:g}s: {e}"
                ) from e
            time.sleep(0.5)


def _join(master: tuple[str, int], authkey: bytes, kind: str, rank: int, size: int) -> Connection:
    conn = Client(master, authkey=authkey)
    conn.send(("join", kind, rank, size))
    ok, why, *final = conn.recv()
    if not ok:
        conn.close()
        if final and final[0]:
            raise Refused(f"the master at {master[0]}:{master[1]} refused rank {rank}: {why}")
        raise ConnectionRefusedError(f"the master refused rank {rank}: {why}")
    return conn


# -- the daemon's side ------------------------------------------------------------------------
@dataclass(slots=True)
class RemoteRank:
    rank: int
    host: str
    control: Connection


class RendezvousServer:
    """Accepts the remote ranks' connections (authenticated) on the configured address."""

    def __init__(
        self,
        host: str,
        port: int,
        authkey: bytes,
        world_size: int,
        remote: list[int],
        store_path: str,
    ) -> None:
        self.listener = Listener((host, port), authkey=authkey)
        self.address: tuple[str, int] = self.listener.address
        self.world_size, self.remote, self.store_path = world_size, set(remote), store_path
        self.joined: dict[int, RemoteRank] = {}
        self._stores: dict[int, Connection] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._said: set[tuple[int, str]] = set()  # refusals logged (a retrying worker's once)
        self._authkey = authkey
        self._thread = threading.Thread(target=self._accept, name="kvguard-rendezvous", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        """Take connections; each proves the key and says hello on a thread of its own, within
        HANDSHAKE_S, so one that connects and stays silent holds up nobody else."""
        raw = self.listener._listener  # the socket; the challenge runs in _handshake
        while not self._closing:
            try:
                conn = raw.accept()
            except OSError as e:
                if not self._closing:
                    log.warning("refused a connection to the rendezvous: %s", e)
                continue
            if self._closing:
                conn.close()
                return
            if not self._handshakes.acquire(blocking=False):
                log.warning("refused a connection to the rendezvous: %d handshakes already "
                            "under way", MAX_HANDSHAKES)  # fmt: skip
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn,), daemon=True).start()

    def _handshake(self, conn: Connection) -> None:
        timer = threading.Timer(HANDSHAKE_S, _hang_up, args=(conn,))
        timer.start()
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            hello = _hello(conn)
            timer.cancel()
            self._admit(conn, *hello)
        except Exception as e:  # noqa: BLE001 - a wrong key, a dropped peer, a garbled hello
            if not self._closing:
                log.warning("refused a connection to the rendezvous: %s", e)
            with contextlib.suppress(OSError):
                conn.close()
        finally:
            timer.cancel()
            self._handshakes.release()

    def _admit(self, conn: Connection, kind: str, rank: int, size: int) -> None:
        with self._cond:
            if self._closing:  # the group has formed (or the daemon stops): nobody joins now
                conn.close()
                return
            problem, final = self._problem(kind, rank, size)
            if problem:
                if (rank, problem) not in self._said:  # a retrying worker's: logged once
                    self._said.add((rank, problem))
                    log.warning("refused rank %s: %s", rank, problem)
                conn.send((False, problem, final))
                conn.close()
                return
            conn.send((True, None, False))
            if kind == "store":
                self._stores[rank] = conn
                store = dist.FileStore(self.store_path, self.world_size)
                threading.Thread(
                    target=self._serve_store, args=(rank, conn, store), daemon=True
                ).start()
            else:
                host = _peer_host(conn)
                self.joined[rank] = RemoteRank(rank, host, conn)
                log.info("remote rank %d joined from %s", rank, host)
            self._cond.notify_all()

    def _serve_store(self, rank: int, conn: Connection, store: dist.Store) -> None:
        _serve_store(conn, store)
        with self._cond:  # hung up: a restarted worker may join in its place
            if self._stores.get(rank) is conn:
                del self._stores[rank]

    def _problem(self, kind: str, rank: int, size: int) -> tuple[str | None, bool]:
        """Why `rank` may not join now, and whether that is final (retrying cannot help)."""
        if size != self.world_size:
            return f"world size {size} given, the daemon's is {self.world_size}", True
        if rank not in self.remote:
            return f"rank {rank} is not one of the remote ranks {sorted(self.remote)}", True
        if kind not in ("control", "store"):
            return f"unknown channel {kind!r}", True
        self._drop_gone()
        taken = rank in (self._stores if kind == "store" else self.joined)
        return (f"rank {rank} has already joined" if taken else None), False

    def _drop_gone(self) -> None:
        """Forget ranks whose worker hung up before the group formed (it died, or was
        restarted): they count as missing, and a restarted worker may join in their place."""
        for rank, remote in list(self.joined.items()):
            if peer_closed(remote.control):
                log.warning("remote rank %d left before the group formed", rank)
                del self.joined[rank]
                remote.control.close()
        for rank, conn in list(self._stores.items()):
            if peer_closed(conn):
                del self._stores[rank]  # its store thread ends on the closed connection

    def wait(self, timeout_s: float) -> dict[int, RemoteRank]:
        """Every remote rank with both channels, or RankFailure naming the missing ones."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._drop_gone()
                if self._complete():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, ACCEPT_POLL_S))
            missing = sorted(
                r for r in self.remote if r not in self.joined or r not in self._stores
            )
        if missing:
            host, port = self.address
            ranks = ", ".join(str(r) for r in missing)
            raise RankFailure(
                missing[0] if len(missing) == 1 else -1,
                f"{'' if len(missing) == 1 else f'(ranks {ranks}) '}did not join within "
                f"{timeout_s:g}s: start `kvguard worker --master {host}:{port} --rank {missing[0]} "
                f"--world-size {self.world_size}` on its host (missing rank{'s' if len(missing) > 1 else ''} {ranks})",
            )
        return dict(self.joined)

    def _complete(self) -> bool:
        return all(r in self.joined and r in self._stores for r in self.remote)

    def hang_up(self) -> None:
        """The start failed: end every remote rank's store channel, so that a rank waiting in
        the store for the group to form gives up at once (it reads nothing else until then)."""
        with self._cond:
            stores = list(self._stores.values())
        for conn in stores:
            _hang_up(conn)

    def close(self) -> None:
        """Stop listening: once the group has formed nobody else may join."""
        self._closing = True
        with contextlib.suppress(OSError):  # wake the accept with a connection it will drop
            socket.create_connection(self.address, timeout=1).close()
        self.listener.close()
        self._thread.join(5)


def _hello(conn: Connection) -> tuple[str, int, int]:
    if not conn.poll(10):
        raise EOFError("no hello")
    msg = conn.recv()
    if not (isinstance(msg, tuple) and len(msg) == 4 and msg[0] == "join"):
        raise EOFError(f"unexpected hello {msg!r}")
    return str(msg[1]), int(msg[2]), int(msg[3])


def _hang_up(conn: Connection) -> None:
    """End a handshake that ran out of time: a read blocked in it returns at once."""
    with contextlib.suppress(OSError), socket.socket(fileno=_dup(conn)) as s:
        s.shutdown(socket.SHUT_RDWR)


def _peer_host(conn: Connection) -> str:
    try:
        with socket.socket(fileno=_dup(conn)) as s:
            return str(s.getpeername()[0])
    except OSError:
        return "?"


def _dup(conn: Connection) -> int:
    return os.dup(conn.fileno())


def peer_closed(conn: Connection) -> bool:
    """Whether the other end has closed (or reset) `conn`, without reading a message from it."""
    try:
        with socket.socket(fileno=_dup(conn)) as s:
            return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _serve_store(conn: Connection, store: dist.Store) -> None:
    """Answer one remote rank's store operations until it hangs up."""
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "wait":
                store.wait(args[0])
                value = None
            elif op in ("set", "get", "add", "compare_set", "check", "delete_key", "num_keys"):
                value = getattr(store, op)(*args)
            else:
                raise ValueError(f"unknown store operation {op!r}")
            reply = (True, value)
        except Exception as e:  # noqa: BLE001 - the remote rank reports it
            reply = (False, f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except OSError:
            return
