"""The rendezvous a remote rank joins through, on loopback: a silent connection holds up
nobody, a worker that left before the group formed can be replaced by its restart, and a
refusal retrying cannot change ends the worker at once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.engine.distributed.rendezvous import Refused, RendezvousServer, connect

KEY = b"k" * 32


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RendezvousServer]:
    s = RendezvousServer("127.0.0.1", 0, KEY, 3, [1, 2], str(tmp_path / "store"))
    yield s
    s.close()


def test_a_silent_connection_holds_up_no_worker(server: RendezvousServer) -> None:
    silent = socket.create_connection(server.address)  # says nothing, proves no key
    joined: list = []
    try:
        # on a thread: a worker held up by the silent peer waits in its handshake, unbounded
        worker = threading.Thread(
            target=lambda: joined.extend(connect(server.address, KEY, r, 3, 20) for r in (1, 2)),
            daemon=True,
        )
        worker.start()
        worker.join(5)
        assert not worker.is_alive(), "the workers were held up by a silent connection"
        assert sorted(server.wait(5)) == [1, 2]
    finally:
        silent.close()
    for control, store in joined:
        control.close()
        store.close()


def test_a_worker_that_left_before_the_group_formed_can_be_replaced(
    server: RendezvousServer,
) -> None:
    control, store = connect(server.address, KEY, 1, 3, timeout_s=10)
    control.close()  # it died (systemd restarts it)
    store.close()
    again = connect(server.address, KEY, 1, 3, timeout_s=10)  # was "already joined" forever
    other = connect(server.address, KEY, 2, 3, timeout_s=10)
    remote = server.wait(5)
    assert sorted(remote) == [1, 2] and remote[1].control is not None
    for c in (*again, *other):
        c.close()


@pytest.mark.parametrize(
    ("rank", "size", "says"),
    [(1, 4, "world size 4 given, the daemon's is 3"), (0, 3, "not one of the remote ranks")],
)
def test_a_refusal_retrying_cannot_change_ends_the_worker_at_once(
    server: RendezvousServer, rank: int, size: int, says: str
) -> None:
    t0 = time.monotonic()
    with pytest.raises(Refused, match=says):
        connect(server.address, KEY, rank, size, timeout_s=30)
    assert time.monotonic() - t0 < 5
