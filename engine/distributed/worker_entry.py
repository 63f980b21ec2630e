"""Where a local worker process starts: `python -m kvguard.engine.distributed.worker_entry FD PPID`.

Its first act, before torch or anything heavy is imported (seconds), is to tie its life to
rank 0's: the kernel kills it when its parent goes (PR_SET_PDEATHSIG), and it exits at once if
the parent went before that was set. A daemon stopped while its workers still start (SIGTERM
during the model load) leaves none behind. Only the standard library is imported here, and the
packages above this module import nothing at load.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent goes, however it goes (even by
    SIGKILL, which leaves no chance to clean up); exit now if the parent is already gone (it
    went before the request: this process was handed to another parent)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str]) -> None:
    die_with_parent(int(argv[1]))
    from kvguard.engine.distributed.worker import main as serve  # torch: seconds

    serve(argv[:1])


if __name__ == "__main__":
    main(sys.argv[1:])
