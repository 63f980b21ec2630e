"""Paged attention must equal plain dense causal attention, whatever the cache layout.

The reference below is written from the definition (scores, causal mask on absolute positions,
softmax, weighted sum; GQA by repeating KV heads) in float64, on contiguous per-sequence K/V that
never touch the paged pool. The kernel sees the same tokens only through `write_kv` and block
tables, so any slot, block-boundary, masking or head-mapping error shows up as a mismatch.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# The package re-exports the function under the module's own name, so `from kvguard.kernels
# import paged_attention` yields the function; fetch the module itself.
pa = importlib.import_module("kvguard.kernels.paged_attention")

ATOL = 1e-5
RTOL = 1e-5


# ----------------------------------------------------------------------------- reference


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal GQA attention of the last `q.shape[0]` positions of one sequence, in float64.

    q `[Q, H, D]`, k and v `[S, KVH, D]` hold the whole sequence; query j sits at absolute
    position S - Q + j and may see keys 0..that position.
    """
    n_q, n_heads, _ = q.shape
    seq_len, n_kv, _ = k.shape
    group = n_heads // n_kv
    kh = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    vh = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    qh = q.double().transpose(0, 1)  # [H, Q, D]
    scores = qh @ kh.transpose(1, 2) * scale  # [H, Q, S]
    q_pos = torch.arange(seq_len - n_q, seq_len)[:, None]
    visible = torch.arange(seq_len)[None, :] <= q_pos
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(0, 1)  # [Q, H, D]


# ----------------------------------------------------------------------------- paged setup


@dataclass
class PagedBatch:
    """A batch laid out as an allocator would leave it: sequences in scattered blocks."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    tables: list[list[int]]  # the same, unpadded
    block_size: int


def blocks_needed(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def make_pool(
    seq_lens: list[int],
    n_kv: int,
    head_dim: int,
    block_size: int,
    gen: torch.Generator,
    shuffle: bool = True,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Garbage-filled pools plus block tables; spare blocks give stray reads something wrong to find."""
    need = [blocks_needed(n, block_size) for n in seq_lens]
    total = sum(need) + spare_blocks
    ids = torch.randperm(total, generator=gen).tolist() if shuffle else list(range(total))
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    width = max(need)
    padded = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    # Pools start as large finite garbage, like stale KV of finished sequences: attending to any
    # slot the sequence does not own moves the output far beyond tolerance.
    shape = (total, block_size, n_kv, head_dim)
    k_cache = torch.randn(shape, generator=gen) * 30 + 50
    v_cache = torch.randn(shape, generator=gen) * 30 + 50
    return PagedBatch(k_cache, v_cache, padded, tables, block_size)


def slots(table: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Flat slot ids of absolute positions start..stop-1 of a sequence with this block table."""
    return torch.tensor(
        [table[p // block_size] * block_size + p % block_size for p in range(start, stop)],
        dtype=torch.int64,
    )


def random_seq(
    seq_len: int, n_heads: int, n_kv: int, head_dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q for every position plus K/V, all contiguous: the dense side of the comparison."""
    q = torch.randn(seq_len, n_heads, head_dim, generator=gen)
    k = torch.randn(seq_len, n_kv, head_dim, generator=gen)
    v = torch.randn(seq_len, n_kv, head_dim, generator=gen)
    return q, k, v


def run_batch(
    seqs: list[tuple[int, int]],
    n_heads: int,
    n_kv: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
    shuffle: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One mixed step: each (seq_len, query_len) sequence fully written, its last queries attended.

    Returns (paged output, dense reference) as `[T, H, D]` each.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in seqs]
    query_lens = [q for _, q in seqs]
    batch = make_pool(seq_lens, n_kv, head_dim, block_size, gen, shuffle)
    scale = 1.0 / math.sqrt(head_dim)
    qs, refs = [], []
    for i, (seq_len, q_len) in enumerate(seqs):
        q, k, v = random_seq(seq_len, n_heads, n_kv, head_dim, gen)
        pa.write_kv(
            batch.k_cache, batch.v_cache, k, v, slots(batch.tables[i], 0, seq_len, block_size)
        )
        qs.append(q[seq_len - q_len :])
        refs.append(dense_reference(q[seq_len - q_len :], k, v, scale))
    out = pa.paged_attention(
        torch.cat(qs), batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, query_lens, scale
    )
    return out, torch.cat(refs).float()


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- write_kv


def test_write_kv_puts_each_token_in_its_slot() -> None:
    gen = torch.Generator().manual_seed(1)
    block_size, n_kv, head_dim = 4, 2, 8
    batch = make_pool([11], n_kv, head_dim, block_size, gen)
    _, k, v = random_seq(11, n_kv, n_kv, head_dim, gen)
    table = batch.tables[0]
    k_before, v_before = batch.k_cache.clone(), batch.v_cache.clone()
    pa.write_kv(batch.k_cache, batch.v_cache, k, v, slots(table, 0, 11, block_size))
    owned = set()
    for p in range(11):
        blk, off = table[p // block_size], p % block_size
        owned.add((blk, off))
        assert torch.equal(batch.k_cache[blk, off], k[p])
        assert torch.equal(batch.v_cache[blk, off], v[p])
    for cache, before in ((batch.k_cache, k_before), (batch.v_cache, v_before)):
        changed = (cache != before).flatten(2).any(-1).nonzero().tolist()
        assert {tuple(x) for x in changed} <= owned, "write_kv touched a slot outside the mapping"


def test_write_kv_appends_without_disturbing_earlier_tokens() -> None:
    gen = torch.Generator().manual_seed(2)
    block_size = 8
    batch = make_pool([20], 1, 4, block_size, gen)
    _, k, v = random_seq(20, 1, 1, 4, gen)
    table = batch.tables[0]
    for start, stop in [(0, 5), (5, 16), (16, 17), (17, 20)]:
        pa.write_kv(
            batch.k_cache,
            batch.v_cache,
            k[start:stop],
            v[start:stop],
            slots(table, start, stop, block_size),
        )
    flat_k = batch.k_cache.view(-1, 1, 4).index_select(0, slots(table, 0, 20, block_size))
    assert torch.equal(flat_k, k)


def test_write_kv_casts_to_cache_dtype() -> None:
    k_cache = torch.zeros(2, 4, 1, 2, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.tensor([[[1.5, -2.0]]])
    pa.write_kv(k_cache, v_cache, k, k * 2, torch.tensor([6]))
    assert k_cache[1, 2, 0].tolist() == [1.5, -2.0]
    assert v_cache[1, 2, 0].tolist() == [3.0, -4.0]


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize(("n_heads", "n_kv"), [(4, 4), (9, 3), (8, 2)])
def test_gqa_ratios_decode_and_prefill(n_heads: int, n_kv: int) -> None:
    """GQA ratios 1, 3 and 4: query head h must read KV head h // (H / KVH)."""
    out, ref = run_batch([(37, 1), (20, 20), (50, 7)], n_heads, n_kv, 16, block_size=16)
    assert_close(out, ref)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("delta", [-1, 0, 1])
@pytest.mark.parametrize("q_len", [1, 5, "all"])
def test_block_boundaries(block_size: int, delta: int, q_len: int | str) -> None:
    """Lengths one under, exactly at and one over a multiple of the block size."""
    seqs = []
    for mult in (1, 2, 3):
        n = mult * block_size + delta
        seqs.append((n, n if q_len == "all" else min(int(q_len), n)))
    out, ref = run_batch(seqs, 9, 3, 64, block_size, seed=block_size + delta)
    assert_close(out, ref)


def test_partial_blocks_and_single_token_sequences() -> None:
    """Sequences shorter than one block, including a one-token prompt."""
    out, ref = run_batch([(1, 1), (3, 1), (5, 5), (2, 2), (15, 1)], 6, 2, 32, block_size=16)
    assert_close(out, ref)


@pytest.mark.parametrize("chunk", [1, 7, 16, 23])
def test_chunked_prefill_reads_earlier_chunks_from_cache(chunk: int) -> None:
    """A prompt written chunk by chunk, each chunk attending to itself and everything before."""
    gen = torch.Generator().manual_seed(chunk)
    n_heads, n_kv, head_dim, block_size, length = 9, 3, 64, 16, 70
    batch = make_pool([length], n_kv, head_dim, block_size, gen)
    q, k, v = random_seq(length, n_heads, n_kv, head_dim, gen)
    scale = 1.0 / math.sqrt(head_dim)
    outs = []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        pa.write_kv(
            batch.k_cache,
            batch.v_cache,
            k[start:stop],
            v[start:stop],
            slots(batch.tables[0], start, stop, block_size),
        )
        outs.append(
            pa.paged_attention(
                q[start:stop],
                batch.k_cache,
                batch.v_cache,
                batch.block_tables,
                [stop],
                [stop - start],
                scale,
            )
        )
    assert_close(torch.cat(outs), dense_reference(q, k, v, scale).float())


@pytest.mark.parametrize("seqs", [[(40, 40)], [(70, 23)]], ids=["whole prompt", "later chunk"])
def test_prefill_attention_takes_torchs_fused_cpu_kernel(
    seqs: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the C kernels are off (or do not serve the shape), prefill chunks reach torch's
    fused CPU attention, not its unfused math path (which 3-d inputs get: 2-4x slower at
    96-1024 tokens), causal or with the mask of a later chunk."""
    from torch.profiler import profile

    from kvguard.kernels import cpu_ops

    monkeypatch.setenv(cpu_ops.ENV, "0")
    monkeypatch.setattr(cpu_ops, "_state", {})  # the switch read afresh; after the test, as it was
    with profile() as prof:
        out, ref = run_batch(seqs, 9, 3, 64, block_size=16)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    assert_close(out, ref)


def test_mixed_prefill_and_decode_batch() -> None:
    """Decode tokens, a first prefill chunk, a later chunk and a whole prompt in one step."""
    seqs = [(100, 1), (33, 33), (64, 1), (90, 26), (17, 1), (48, 16), (1, 1)]
    out, ref = run_batch(seqs, 9, 3, 64, block_size=16, seed=7)
    assert_close(out, ref)


def test_large_decode_batch_with_uneven_lengths() -> None:
    """Many decode rows whose lengths straddle block edges, each landing back at its own row."""
    lengths = [5, 31, 16, 48, 2, 17, 64, 9, 1, 33, 15, 47, 80, 8, 24, 63]
    out, ref = run_batch([(n, 1) for n in lengths], 9, 3, 64, block_size=16, seed=3)
    assert_close(out, ref)


def test_decode_rows_interleaved_with_prefill_rows() -> None:
    """Decode rows between prefill rows: outputs must come back in the batch's order."""
    seqs = [(30, 4), (12, 1), (40, 40), (7, 1), (26, 9), (3, 1)]
    out, ref = run_batch(seqs, 4, 1, 16, block_size=8, seed=4)
    assert_close(out, ref)


@pytest.mark.parametrize("shuffle", [False, True])
def test_contiguous_and_scattered_block_layouts(shuffle: bool) -> None:
    """Blocks in order (a fresh pool) and scattered (a pool after churn) both read correctly."""
    out, ref = run_batch([(45, 1), (30, 12), (16, 1)], 9, 3, 64, 16, seed=5, shuffle=shuffle)
    assert_close(out, ref)


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    """A random step: GQA shape, block size, and sequences each with a valid query length."""
    n_kv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 3, 4]))
    n_seqs = draw(st.integers(1, 5))
    seqs = []
    for _ in range(n_seqs):
        seq_len = draw(st.integers(1, 64))
        kind = draw(st.sampled_from(["decode", "chunk", "full"]))
        q_len = {"decode": 1, "full": seq_len}.get(kind) or draw(st.integers(1, seq_len))
        seqs.append((seq_len, q_len))
    return {
        "seqs": seqs,
        "n_heads": n_kv * group,
        "n_kv": n_kv,
        "head_dim": draw(st.sampled_from([8, 16, 64])),
        "block_size": draw(st.sampled_from([4, 8, 16])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=40, deadline=None)
@given(batches())
def test_random_batches_match_dense_reference(case: dict[str, Any]) -> None:
    out, ref = run_batch(**case)
    assert_close(out, ref)


def test_decode_works_outside_inference_mode_after_running_inside() -> None:
    """The engine runs under inference_mode; tools and tests call the kernel without it.

    The batch is larger than any other test's, so whatever the kernel sizes per call is
    first created inside inference_mode here, whatever ran before.
    """
    seqs = [(300 + i, 1) for i in range(8)]
    with torch.inference_mode():
        inside, ref = run_batch(seqs, 9, 3, 64, block_size=16, seed=8)
    outside, _ = run_batch(seqs, 9, 3, 64, block_size=16, seed=8)
    assert_close(inside, ref)
    assert_close(outside, ref)


# ----------------------------------------------------------------------------- fp8 cache


def fp8_pool(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8 K/V pools shaped like `batch`'s, with their `[num_blocks, kv_heads]` scales."""
    nb, _, h, _ = batch.k_cache.shape
    k8 = torch.zeros(batch.k_cache.shape, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(nb, h)
    return k8, torch.zeros_like(k8), scales, scales.clone()


def ideal_fp8(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Round-trip through e4m3 with one scale per block per head from the block's final contents:
    the least error any per-block-scale fp8 cache can have."""
    out = x.clone()
    for s in range(0, x.shape[0], block_size):
        blk = x[s : s + block_size]
        sc = blk.abs().amax(dim=(0, 2), keepdim=True) / 448.0
        out[s : s + block_size] = (blk / sc).to(torch.float8_e4m3fn).float() * sc
    return out


FP8_WRITES = {
    "one write": [(0, 53)],
    "chunks": [(0, 5), (5, 21), (21, 40), (40, 52), (52, 53)],
    "token by token": [(i, i + 1) for i in range(53)],
}


@pytest.mark.parametrize("writes", list(FP8_WRITES))
@pytest.mark.parametrize("magnitude", [1.0, 1000.0])
def test_fp8_cache_stays_near_ideal_quantisation(writes: str, magnitude: float) -> None:
    """Growing values force a block's scale up mid-block; values far past ±448 need the scale.

    Requantising a block when its scale grows adds rounding on top of the ideal per-block
    error, so the bound is a small multiple of that ideal error, not of fp32 precision.
    """
    gen = torch.Generator().manual_seed(11)
    n_heads, n_kv, head_dim, block_size, length = 9, 3, 64, 16, 53
    batch = make_pool([length], n_kv, head_dim, block_size, gen)
    k8, v8, ks, vs = fp8_pool(batch)
    q, k, v = random_seq(length, n_heads, n_kv, head_dim, gen)
    ramp = torch.linspace(0.2, 1.0, length)[:, None, None] * magnitude
    k, v, q = k * ramp, v * ramp, q / magnitude
    scale = 1.0 / math.sqrt(head_dim)
    outs = []
    for start, stop in FP8_WRITES[writes]:
        sl = slots(batch.tables[0], start, stop, block_size)
        pa.write_kv(k8, v8, k[start:stop], v[start:stop], sl, ks, vs)
        outs.append(
            pa.paged_attention(
                q[start:stop], k8, v8, batch.block_tables, [stop], [stop - start], scale, ks, vs
            )
        )
    ref = dense_reference(q, k, v, scale).float()
    ideal = dense_reference(q, ideal_fp8(k, block_size), ideal_fp8(v, block_size), scale).float()
    ideal_err = (ideal - ref).abs().max().item()
    err = (torch.cat(outs) - ref).abs().max().item()
    assert err <= 2.5 * ideal_err, f"fp8 attention off by {err:.3g} (ideal fp8: {ideal_err:.3g})"
