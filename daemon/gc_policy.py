"""The daemon's garbage-collector policy: the heap built at startup is frozen out of the cyclic
collector, and every collection's pause is measured.

A full (generation 2) collection walks every tracked object. After startup that is the model's
modules, torch, transformers' tokenizer, FastAPI, SQLAlchemy and the rest: measured in the
overload benchmark, two full collections under load paused the daemon for 0.24 s and 0.49 s,
and the first landed in a high-priority request's prompt step (0.57 s against 0.36 s for the
same step without it), setting that run's p99 time to first token. The engine thread needs the
GIL between every op of a step, so a collection on any thread stops the engine too.

`gc.freeze()` once everything long-lived exists moves those objects to a permanent generation
that collections skip: what is left to walk is what serving creates. They stay alive for the
life of the process anyway. `kvguard serve` leaves them frozen to its end: given back at the
stop, they made the interpreter's final collections walk the whole heap once more (0.8 s of CPU
with smollm2, 2-3 s on a busy host, after the stop's bounded work). `unfreeze` at close is
for tests, which run several daemons in one process: a later collection can then free what
those daemons left."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvguard.daemon")


def freeze_startup_heap() -> int:
    """Collect what startup left as garbage, then freeze every live object; the count frozen."""
    t0 = time.perf_counter()
    gc.collect()
    pause = time.perf_counter() - t0
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "%d startup objects frozen out of the cyclic GC (a full collection took %.0f ms)",
        frozen,
        pause * 1e3,
    )
    return frozen


def unfreeze() -> None:
    """Give the frozen heap back to the collector: for a process that goes on after a daemon."""
    gc.unfreeze()


def watch_pauses(observe: Callable[[str, float], None]) -> Callable[[], None]:
    """Call `observe(generation, seconds)` after every collection, on whatever thread ran it;
    returns the function that stops watching."""
    started: dict[str, float] = {}

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            observe(str(info["generation"]), time.perf_counter() - started.pop("t"))

    gc.callbacks.append(callback)

    def stop() -> None:
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)

    return stop
