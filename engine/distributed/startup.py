"""Rank 0's watch over its workers while the group starts: a rank that fails once it has said it
is joining fails the start within seconds, named with its reason, wherever rank 0 is.

After every worker has said it is joining, rank 0 spends the start-up in three places, each of
which could otherwise wait out the start-up timeout (ten minutes) for a rank that is gone:

- forming the group (`join_group`): torch waits in the rendezvous store for every rank's key.
  Rank 0's store is a `WatchedStore`, whose every operation first asks the watch, so the wait
  ends as soon as a worker has reported a failure or died, and rank 0 never goes on to connect
  to a rank already known dead (gloo retries a refused connection for several of its
  timeouts: with a 15 s timeout it gave up after 75 s). One window stays open: a rank that
  dies after rank 0 has read its address, before their connection is made, leaves rank 0 in
  gloo's connect until it gives up; no Python runs there to interrupt;
- loading its own shards, which for a big model takes minutes: not interrupted (an
  exception raised into a thread from outside may land inside an import and leave a module
  half-initialised for the rest of the process), so a worker's failure meanwhile is named once
  the load ends, at the first collective or store operation after it;
- agreeing on the KV block count (a collective over every rank): gloo fails the collective as
  soon as a peer's process is gone (its sockets close; checked with torch 2.13: at once,
  "Connection reset/closed by peer"), and `StartupWatch.explain` names the rank behind that
  error. (Not checked with NCCL, on CUDA, which may leave that collective waiting for a lost
  peer until the start-up timeout.)

A worker that fails sends its exception over its control connection before it exits; one that
dies without a word is named by its exit status (a local process) or its closed connection (a
remote rank). A rank that hangs, alive and silent, still waits out the start-up timeout: a long
load looks just the same.
"""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from kvguard.engine.distributed.errors import RankFailure

if TYPE_CHECKING:
    from kvguard.engine.distributed.driver import WorkerHandle

WATCH_POLL_S = 0.1  # how often waiting for "ready" looks at a worker that says nothing
STORE_POLL_S = 0.02  # how often a store wait looks for its keys (and at the workers)


class StartupWatch:
    """The workers between 'joining' and 'ready': reads their messages (only ever one reader at
    a time), remembers the first failure and its rank."""

    def __init__(self, workers: list[WorkerHandle]) -> None:
        self.pending = list(workers)  # not ready yet
        self.failure: RankFailure | None = None
        self.failed_at = math.inf  # when the failed worker says it failed (-inf: it died)
        self._lock = threading.Lock()  # one reader of the connections at a time

    def poll(self) -> RankFailure | None:
        """Take what the workers have sent without waiting (a ready worker is done with); the
        failure, once one is known (it stays known). Of the failures seen at once, the first:
        a rank that died without a word, else the earliest reported. A rank whose collective
        broke because another failed reports a failure too, always later than that one."""
        with self._lock:
            if self.failure is None:
                seen: list[tuple[float, int, RankFailure]] = []
                for w in list(self.pending):
                    if (got := w.next_message()) is None:
                        continue
                    kind, data = got
                    if kind == "ready":
                        w.info = data
                        self.pending.remove(w)
                    elif kind == "gone":  # died without a word: not in a collective's wake
                        seen.append(
                            (-math.inf, w.rank, RankFailure(w.rank, f"{data} while starting"))
                        )
                    else:
                        at = data.get("at", math.inf) if isinstance(data, dict) else math.inf
                        why = f"failed to start: {failure_text(data)}"
                        seen.append((at, w.rank, RankFailure(w.rank, why)))
                if seen:
                    self.failed_at, _, self.failure = min(seen, key=lambda f: f[:2])
            return self.failure

    def check(self) -> None:
        """RankFailure (a fresh one: it may be raised on several threads) if a worker failed."""
        if (f := self.poll()) is not None:
            raise RankFailure(f.rank, f.reason)

    def wait_ready(self, deadline: float) -> None:
        """Until every worker has reported ready; RankFailure when one fails or dies, or when
        one has not reported by `deadline`."""
        while True:
            self.check()
            if not self.pending:
                return
            if time.monotonic() >= deadline:
                raise RankFailure(self.pending[0].rank, "did not report ready in time")
            wait([w.conn for w in self.pending], WATCH_POLL_S)

    def explain(self, error: BaseException, grace_s: float) -> RankFailure | None:
        """The worker failure behind `error` (rank 0's start failed with it just now), waiting
        up to `grace_s` for one to show; None when the error is rank 0's own: no worker failed,
        or only after rank 0 (e.g. every rank read the same bad file)."""
        now = time.time()
        if isinstance(error, RankFailure) and self.failure is None:
            return None  # named already (a worker that did not report ready in time)
        if not isinstance(error, Exception):
            return self.failure  # an interrupt or exit of rank 0's own: no waiting
        deadline = time.monotonic() + grace_s
        while (f := self.poll()) is None and time.monotonic() < deadline:
            wait([w.conn for w in self.pending], STORE_POLL_S)
        if f is None or self.failed_at > now:
            return None
        return RankFailure(f.rank, f.reason)


def failure_text(data: Any) -> str:
    """What a worker's "failed" message says: its exception (see worker.worker_main)."""
    return str(data["error"]) if isinstance(data, dict) and "error" in data else str(data)


class WatchedStore(dist.Store):
    """Rank 0's rendezvous store: `inner` (the file store every local rank shares, and the
    remote ranks reach through the rendezvous), each operation preceded by a look at the
    workers, and each wait polling, so that a failed worker ends it (RankFailure) instead of
    the wait's timeout."""

    def __init__(self, inner: dist.Store, watch: StartupWatch) -> None:
        super().__init__()
        self.inner = inner
        self.watch = watch

    def _wait(self, keys: list[str], timeout: timedelta | None) -> None:
        limit = (timeout or self.inner.timeout).total_seconds()
        deadline = time.monotonic() + limit if limit > 0 else float("inf")
        while True:
            self.watch.check()
            if self.inner.check(keys):
                return
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"Wait timeout after {limit:g}s for keys {keys}")
            time.sleep(STORE_POLL_S)

    def set(self, key: str, value: Any) -> None:
        self.watch.check()
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key], None)
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self.watch.check()
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.watch.check()
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        self.watch.check()
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()
