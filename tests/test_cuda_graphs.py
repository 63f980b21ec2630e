"""CUDA-graph decode: the bucketing and padding on CPU (the capture itself needs a GPU: see
bench/gpu_e2e.py), with the real tiny-shaped model running padded steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvguard.engine import EngineConfig, SamplingParams
from kvguard.engine.cuda_graphs import (
    DEFAULT_BUCKETS,
    DecodeInputs,
    StaticBuffers,
    bucket_for,
    decode_inputs,
    graph_buckets,
    pad_decode,
    table_width,
)
from kvguard.engine.model import AttentionMetadata
from kvguard.engine.random_model import random_engine


def test_buckets_end_at_max_num_seqs() -> None:
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert graph_buckets(5) == (1, 2, 4, 5)
    assert graph_buckets(1) == (1,)
    assert graph_buckets(1000)[-2:] == (256, 1000)
    with pytest.raises(ValueError):
        graph_buckets(0)


@given(st.integers(1, 300), st.integers(0, 320))
def test_bucket_is_the_smallest_that_holds_the_batch(max_seqs: int, n: int) -> None:
    buckets = graph_buckets(max_seqs, DEFAULT_BUCKETS)
    b = bucket_for(n, buckets)
    if n == 0 or n > max_seqs:
        assert b is None
        return
    assert b is not None and b >= n
    assert all(smaller < n for smaller in buckets if smaller < b)


def test_table_width_covers_max_model_len() -> None:
    assert table_width(4096, 16) == 256
    assert table_width(4097, 16) == 257


def _inputs(n: int, width: int) -> DecodeInputs:
    return DecodeInputs(
        torch.arange(10, 10 + n),
        torch.arange(20, 20 + n),
        torch.arange(100, 100 + n),
        torch.arange(n * width, dtype=torch.int32).view(n, width),
        torch.arange(30, 30 + n, dtype=torch.int32),
    )


def test_padding_rows_touch_only_the_scratch_block() -> None:
    real = _inputs(3, 2)
    p = pad_decode(real, bucket=4, width=5, scratch_block=99, block_size=16)
    assert p.rows == 4 and p.block_tables.shape == (4, 5)
    assert torch.equal(p.input_ids[:3], real.input_ids)
    assert torch.equal(p.positions[:3], real.positions)
    assert torch.equal(p.slot_mapping[:3], real.slot_mapping)
    assert torch.equal(p.block_tables[:3, :2], real.block_tables)
    assert torch.equal(p.seq_lens[:3], real.seq_lens)
    # dummy row: token 0 at position 0, writes slot 0 of the scratch block, attends to it only
    assert (p.input_ids[3], p.positions[3], p.slot_mapping[3], p.seq_lens[3]) == (0, 0, 99 * 16, 1)
    # unused columns, real rows too, name the scratch block, never a live one
    assert (p.block_tables[:3, 2:] == 99).all() and (p.block_tables[3] == 99).all()


def test_a_step_too_big_for_the_bucket_is_refused() -> None:
    with pytest.raises(ValueError):
        pad_decode(_inputs(5, 2), bucket=4, width=5, scratch_block=9, block_size=16)
    with pytest.raises(ValueError):
        pad_decode(_inputs(2, 6), bucket=4, width=5, scratch_block=9, block_size=16)


def test_static_buffers_are_loaded_in_place() -> None:
    bufs = StaticBuffers(8, 5, scratch_block=7, block_size=16, device=torch.device("cpu"))
    before = bufs.inp.input_ids.data_ptr()
    padded = pad_decode(_inputs(3, 2), 4, 5, 7, 16)
    bufs.load(padded)
    view = bufs.view(4)
    assert bufs.inp.input_ids.data_ptr() == before  # graphs keep reading the same memory
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens"):
        assert torch.equal(getattr(view, name), getattr(padded, name))


def _decode_state(n: int) -> tuple:
    """An engine whose next step decodes `n` sequences of different lengths, and that step's
    prepared tensors (blocks allocated, nothing run yet)."""
    eng = random_engine(
        "tiny", EngineConfig(model="random:tiny", device="cpu", num_gpu_blocks=64, max_num_seqs=8)
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(n):
        eng.add_request([5 + i] * (7 + 9 * i), params)
    for _ in range(3):
        eng.step()
    batch = eng.scheduler.schedule()
    assert batch.num_tokens == [1] * n
    return eng, batch, eng.runner.prepare(batch.seqs, batch.num_tokens)


def _forward(eng, inp: DecodeInputs) -> torch.Tensor:  # noqa: ANN001
    meta = AttentionMetadata(
        inp.slot_mapping, inp.block_tables, inp.seq_lens.tolist(), [1] * inp.rows
    )
    return eng.model(inp.input_ids, inp.positions, eng.kv_cache.layers, meta)


def _snapshot(eng) -> list[torch.Tensor]:  # noqa: ANN001
    return [t.clone() for layer in eng.kv_cache.layers for t in layer[:2]]


def test_padded_step_computes_the_same_rows_and_spares_live_blocks() -> None:
    eng, batch, step = _decode_state(3)
    inp = decode_inputs(step)
    assert inp is not None
    scratch = eng.kv_cache.num_blocks - 1
    assert all(scratch not in s.block_table for s in batch.seqs)
    before = _snapshot(eng)
    eager = _forward(eng, inp)
    after_eager = _snapshot(eng)
    for t, saved in zip(
        (t for layer in eng.kv_cache.layers for t in layer[:2]), before, strict=True
    ):
        t.copy_(saved)  # undo the eager step's writes
    width = table_width(eng.max_model_len, eng.config.block_size)
    padded = pad_decode(inp, bucket=8, width=width, scratch_block=scratch, block_size=16)
    replayed = _forward(eng, padded)
    torch.testing.assert_close(replayed[:3], eager, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(replayed).all()
    live = torch.ones(eng.kv_cache.num_blocks, dtype=torch.bool)
    live[scratch] = False
    for got, want, old in zip(_snapshot(eng), after_eager, before, strict=True):
        # every live block as eager left it: the real rows' slots hold the same K/V, and
        # everything the eager step did not write is bit for bit untouched
        torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-6)
        untouched = (want == old)[live]
        assert torch.equal(got[live][untouched], old[live][untouched])


def test_only_all_decode_steps_are_eligible() -> None:
    eng = random_engine("tiny", EngineConfig(model="random:tiny", device="cpu", num_gpu_blocks=16))
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    batch = eng.scheduler.schedule()
    assert batch.num_tokens == [3]  # the prompt's prefill
    assert decode_inputs(eng.runner.prepare(batch.seqs, batch.num_tokens)) is None
