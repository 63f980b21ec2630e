"""`kvguard worker`: a rank of a daemon's model on another host."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

DEFAULT_KEY = Path("/etc/kvguard/worker.key")
KEY_CREDENTIAL = "worker.key"  # name under $CREDENTIALS_DIRECTORY (systemd LoadCredential)


def add_worker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "worker",
        help="join a kvguard daemon's model as one rank, from another host",
        description="Run rank R of a daemon's tensor x pipeline parallel world on this host. The "
        "daemon lists R in serving.distributed.remote_ranks and waits for it; the model is "
        "resolved in this host's cache. Exits 0 when the daemon stops it, 1 when it loses the "
        "daemon: run it under systemd (kvguard-worker@R.service) so it comes back and rejoins.",
    )
    p.add_argument("--master", required=True, metavar="HOST:PORT", help="the daemon's rendezvous")
    p.add_argument("--rank", required=True, type=int, metavar="R", help="this worker's world rank")
    p.add_argument(
        "--world-size", required=True, type=int, metavar="W", help="tensor x pipeline ranks"
    )
    p.add_argument(
        "--authkey-file",
        type=Path,
        help="the secret shared with the daemon (serving.distributed.authkey_file); default: "
        f"$CREDENTIALS_DIRECTORY/{KEY_CREDENTIAL}, else {DEFAULT_KEY}",
    )
    p.add_argument(
        "--allow-network",
        action="store_true",
        help="allow a non-loopback master (torch.distributed traffic is not authenticated: "
        "keep it on a private network)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long to wait for the daemon to listen (default: %(default)s)",
    )
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    from kvguard.engine.config import check_network
    from kvguard.engine.distributed.worker import remote_main

    host, sep, port = args.master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--master {args.master!r}: expected HOST:PORT (a port 1..65535)")
    if not 0 <= args.connect_timeout < math.inf:
        raise ValueError(
            f"--connect-timeout {args.connect_timeout}: expected seconds, finite, >= 0 (0: one try)"
        )
    if args.world_size < 2:
        raise ValueError(
            f"--world-size {args.world_size}: expected 2 or more (the daemon is rank 0)"
        )
    check_network(host, args.allow_network, "--master")
    if not 0 < args.rank < args.world_size:
        raise ValueError(
            f"--rank {args.rank}: expected 1..{args.world_size - 1} (rank 0 is the daemon)"
        )
    key = _read_key(args.authkey_file)
    return remote_main((host, int(port)), args.rank, args.world_size, key, args.connect_timeout)


def _read_key(path: Path | None) -> bytes:
    if path is None:
        creds = os.environ.get("CREDENTIALS_DIRECTORY")
        path = Path(creds) / KEY_CREDENTIAL if creds else DEFAULT_KEY
    try:
        key = path.read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read the worker key from {path}: {e.strerror}") from e
    if not key:
        raise ValueError(f"the worker key file {path} is empty")
    return key
