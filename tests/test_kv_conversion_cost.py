"""A live KV dtype switch costs what the live blocks cost, not what the pool holds.

The switch (a rule's `enable_fp8_kv`, its undo) runs between two steps and holds every stream
meanwhile. On a CPU it once wrote the whole new pool (torch.zeros: every byte of every free
block, each page faulted in) and converted the live blocks through a dozen torch ops a layer,
each a parallel region of its own; on 2 cores other processes also used, an 8-stream switch of
the default pool paused serving for seconds. Now each new layer is zero pages the kernel maps
untouched, and the live blocks go through one C pass a layer: the pages of blocks nobody holds
are not touched, which is what these tests read (the kernel's own page table, `mincore`, not
a clock).
"""

from __future__ import annotations

import ctypes
import errno
import mmap

import pytest
import torch

from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine import kv_cache as kv_cache_module
from kvguard.kernels import cpu_lowbit, cpu_ops
from tests.test_engine import make_engine
from tests.test_live_corners import finish

PAGE = mmap.PAGESIZE
HUGE = 2 << 20  # a transparent huge page: a touched page may bring its whole 2 MiB region in


def resident_pages(t: torch.Tensor) -> list[int]:
    """Which of the pages under tensor `t` (contiguous) are in memory, by page index from the
    page holding its first byte (the kernel's page table: mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() - t.data_ptr() % PAGE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (length + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec)
    assert rc == 0, f"mincore failed: errno {ctypes.get_errno()}"
    return [i for i in range(pages) if vec[i] & 1]


def touched_within_held_blocks(engine: LLMEngine) -> None:
    """Every resident page of the device pool's K/V lies within the 2 MiB regions of the
    blocks held now (the live blocks the switch converted, and what the step after it wrote):
    the free blocks' bytes were neither written nor faulted in. The pool is big enough that
    this leaves most of it out."""
    held = set(engine.block_manager._holders)
    assert held, "the test needs live blocks"
    for layer in engine.kv_cache.layers:
        for t in layer[:2]:
            per_block = t[0].numel() * t.element_size()
            base = t.data_ptr() - t.data_ptr() % PAGE
            regions = {(t.data_ptr() + b * per_block - base) // HUGE for b in held}
            regions |= {(t.data_ptr() + (b + 1) * per_block - 1 - base) // HUGE for b in held}
            resident = resident_pages(t)
            stray = [p for p in resident if p * PAGE // HUGE not in regions]
            assert not stray, f"{len(stray)} pages of free blocks in memory, first {stray[:4]}"
            total = (t.numel() * t.element_size()) // PAGE
            assert len(resident) < total // 4, (len(resident), total)


def switch(engine: LLMEngine, dtype: str) -> dict:
    fut = engine.set_kv_cache_dtype(dtype)
    engine.step()
    res = fut.result(0)
    assert res.ok and engine.kv_cache.dtype == dtype, res.detail
    return res.data


@pytest.fixture
def serving() -> LLMEngine:
    """Four requests decoding on a CPU pool of 16 MiB per layer's K (and V), fp32 (on a CPU
    where a GPU is there too: these are the CPU pool's pages and kernels)."""
    engine = make_engine(kv_cache_bytes="64MiB", device="cpu")
    for i in range(4):
        engine.add_request([3 + (5 * i + j) % 200 for j in range(40)], greedy(24))
    for _ in range(4):
        engine.step()
    return engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_switch_and_its_undo_touch_only_the_blocks_in_use(serving: LLMEngine) -> None:
    engine = serving
    live = engine.snapshot().blocks_used
    data = switch(engine, "fp8_e4m3")
    assert data["blocks_after"] > 3 * data["blocks_before"] and live < data["blocks_before"] // 8
    touched_within_held_blocks(engine)
    switch(engine, "fp32")
    touched_within_held_blocks(engine)
    done = finish(engine)
    assert len(done) == 4 and all(len(t) == 24 for t in done.values())


def test_the_live_blocks_go_through_one_c_call_per_tensor_and_no_torch_pass(
    serving: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C conversion serves every K and V of every layer, handed exactly the live blocks:
    torch's read/write pair (the reference, and the path where the C kernels are off) does
    not run."""
    assert cpu_lowbit.available(), "the C kernels must build here (.ci/run installs gcc)"
    engine = serving
    calls: list[int] = []
    real = cpu_ops.convert_blocks

    def counted(src, src_scales, src_ids, *rest):  # noqa: ANN001, ANN202
        calls.append(src_ids.numel())
        return real(src, src_scales, src_ids, *rest)

    def refuse(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("torch's conversion must not run where the C kernel serves")

    monkeypatch.setattr(cpu_ops, "convert_blocks", counted)
    monkeypatch.setattr(kv_cache_module, "read_blocks", refuse)
    monkeypatch.setattr(kv_cache_module, "write_blocks", refuse)
    used = engine.snapshot().blocks_used
    switch(engine, "fp8_e4m3")
    assert calls == [used] * (2 * engine.model_config.num_layers)


def test_a_mapping_the_system_refuses_is_a_refused_switch(
    serving: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer whose pages the system will not map (a `LimitAS=`, strict overcommit) is the
    out-of-memory it is: the switch is refused saying so, the pool stays whole and in use."""
    engine = serving
    want_blocks = engine.block_manager.num_blocks

    def refuse(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    fut = engine.set_kv_cache_dtype("fp8_e4m3")
    engine.step()
    res = fut.result(0)
    monkeypatch.undo()
    assert not res.ok and "could not be built (out of memory" in res.detail, res.detail
    assert engine.kv_cache.dtype == "fp32" and engine.block_manager.num_blocks == want_blocks
    engine.audit_blocks()
    done = finish(engine)
    assert len(done) == 4 and all(len(t) == 24 for t in done.values())


def resident_bytes(engine: LLMEngine, host: bool = False) -> int:
    """The bytes of the device (or swap) pool in memory: its K/V and fp8 scales' pages."""
    pool = engine.kv_cache.host_pool if host else engine.kv_cache.device_pool
    tensors = [t for layer in pool.layers for t in layer if t is not None and t.numel()]
    return sum(len(resident_pages(t)) * PAGE for t in tensors)


def resize(engine: LLMEngine, share: float) -> dict:
    fut = engine.set_kv_pool_share(share)
    engine.step()
    res = fut.result(0)
    assert res.ok, res.detail
    return res.data


def record_can_grow(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, host: bool) -> list:
    """`can_grow` answers yes (whatever the host's memory now) and records each charge asked
    with the pool's resident bytes at that moment."""
    asked = []

    def record(extra: int) -> bool:
        asked.append((extra, resident_bytes(engine, host)))
        return True

    monkeypatch.setattr(engine.runner, "can_grow", record)
    return asked


def test_a_shrink_after_a_switch_takes_no_memory(serving: LLMEngine) -> None:
    """After a live switch the pool is zero pages, only the live blocks in memory. A shrink in
    the same dtype (`set_kv_pool_share`, the host-mem rule's remedy against the OOM killer)
    zeroed its new layers: it faulted in the whole shrunk pool, memory taken by a remedy that
    gives memory back. It is zero pages too: only the live blocks' pages are written."""
    engine = serving
    switch(engine, "fp8_e4m3")
    before = resident_bytes(engine)
    data = resize(engine, 0.5)
    assert data["blocks_after"] < data["blocks_before"]
    assert resident_bytes(engine) <= before, (resident_bytes(engine), before)
    touched_within_held_blocks(engine)
    done = finish(engine)
    assert len(done) == 4 and all(len(t) == 24 for t in done.values())


def test_a_grow_asks_for_the_memory_it_takes(
    serving: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool grown back is zeroed: all of it in memory. Grown from zero pages (after a switch
    and a shrink) it asked `can_grow` for the blocks it added, not for the whole new pool less
    the few pages the old one held, so the check that taking memory back leaves the host under
    its line passed a grow twice the size it asked for."""
    engine = serving
    switch(engine, "fp8_e4m3")
    resize(engine, 0.5)
    asked = record_can_grow(engine, monkeypatch, host=False)
    resize(engine, 1.0)
    [(charge, before)] = asked
    took = resident_bytes(engine) - before
    tensors = 4 * engine.model_config.num_layers  # a page at either end of each, at most
    slack = engine.kv_cache.bytes_per_block + tensors * PAGE
    assert abs(charge - took) <= slack, (charge, took)
    done = finish(engine)
    assert len(done) == 4 and all(len(t) == 24 for t in done.values())


def test_a_swap_pool_grown_after_a_switch_asks_for_the_memory_it_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same for the swap pool a reload of kv_cache_bytes grows: after a switch it is zero
    pages, and its zeroed rebuild takes all its new bytes."""
    engine = make_engine(
        kv_cache_bytes="16MiB", device="cpu", enable_cpu_offload=True, cpu_cache_ratio=0.5
    )
    for i in range(2):
        engine.add_request([3 + (5 * i + j) % 200 for j in range(40)], greedy(8))
    engine.step()
    switch(engine, "fp8_e4m3")
    asked = record_can_grow(engine, monkeypatch, host=True)
    old_n = engine.host_block_manager.num_blocks
    fut = engine.reconfigure({("kv_cache_bytes",): 32 * 2**20})
    engine.step()
    res = fut.result(0)
    assert res.ok and engine.host_block_manager.num_blocks > old_n, res.detail
    assert len(asked) == 2  # the device pool's grow asks first
    (charge, before) = asked[1]
    took = resident_bytes(engine, host=True) - before
    tensors = 4 * engine.model_config.num_layers
    slack = engine.kv_cache.bytes_per_block + tensors * PAGE
    assert abs(charge - took) <= slack, (charge, took)
    done = finish(engine)
    assert len(done) == 2 and all(len(t) == 8 for t in done.values())
