"""The daemon's GC policy: startup objects leave the cyclic collector, pauses are measured."""

from __future__ import annotations

import gc

from kvguard.daemon import gc_policy


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_a_frozen_heap_is_skipped_by_collections_and_given_back_by_unfreeze() -> None:
    heap = [[] for _ in range(1000)]  # long-lived containers, as a loaded daemon holds
    try:
        assert gc_policy.freeze_startup_heap() >= len(heap)
        assert not _tracked(heap)  # a full collection no longer walks it
        gc.collect()
        assert not _tracked(heap)
    finally:
        gc_policy.unfreeze()
    assert gc.get_freeze_count() == 0 and _tracked(heap)


def test_each_collection_pause_is_observed_until_unwatched() -> None:
    seen: list[tuple[str, float]] = []
    stop = gc_policy.watch_pauses(lambda gen, s: seen.append((gen, s)))
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        stop()
    gens = [g for g, _ in seen]
    assert "0" in gens and "2" in gens and all(s >= 0 for _, s in seen)
    n = len(seen)
    gc.collect()
    assert len(seen) == n  # stopped
    stop()  # twice is harmless
