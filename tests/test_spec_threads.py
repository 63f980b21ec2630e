"""A verify step's rows (one sequence's last token and its drafts) on the CPU kernels, at one
thread and several: decode attention (cpu_ops.c) and the decode GEMMs (lowbit.c) take a
sequence's several rows in one call. Neither may change a bit: each row must get what a
one-token step of its sequence at its length gets, whatever the threads, the pool's element
type or the CPU path, or greedy answers would part with drafts on and off (README,
speculative decoding)."""

from __future__ import annotations

import pytest
import torch

from kvguard.engine.layers.quantized_linear import QuantizedLinear
from kvguard.kernels import cpu_lowbit, cpu_ops
from kvguard.kernels.fp8 import FP8_DTYPE
from tests.test_cpu_lowbit import gguf_like
from tests.test_paged_attention import assert_close, dense_reference

BS, HKV, D, HEADS, BLOCKS = 16, 3, 64, 9, 80  # SmolLM2's attention shape, blocks of 16


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch: pytest.MonkeyPatch):
    assert cpu_lowbit.available(), "the C kernels must build here (.ci/run installs gcc)"
    monkeypatch.delenv(cpu_ops.ENV, raising=False)
    cpu_ops.reset()
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    cpu_ops.reset()


def _pools(dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """K and V pools of `dtype` (random everywhere: garbage beyond any table's tokens), with
    per-block scales for fp8, and their values as fp32 (what the kernel reads)."""
    k = torch.randn(BLOCKS, BS, HKV, D, generator=gen) * 3
    v = torch.randn(BLOCKS, BS, HKV, D, generator=gen)
    if dtype != FP8_DTYPE:
        k, v = k.to(dtype), v.to(dtype)
        return (k, v, None, None), (k.float(), v.float())
    ks = torch.rand(BLOCKS, HKV, generator=gen) + 0.5
    vs = torch.rand(BLOCKS, HKV, generator=gen) + 0.5
    k, v = k.to(dtype), v.to(dtype)
    return (k, v, ks, vs), (k.float() * ks[:, None, :, None], v.float() * vs[:, None, :, None])


def _decode(q: torch.Tensor, pools: tuple, tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    out = torch.empty_like(q)
    k, v, ks, vs = pools
    cpu_ops.paged_decode(
        q, out, torch.arange(q.shape[0]), torch.tensor(lens, dtype=torch.int32), k, v,
        tables.contiguous(), 0.125, ks, vs,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, FP8_DTYPE])
def test_a_sequences_rows_in_one_call_keep_each_rows_own_bits(
    dtype: torch.dtype,
) -> None:
    """One sequence's 2 to 17 rows (lengths one apart) in one call: rows within a block, over
    a block's edge, around the length where a row is split into runs for the threads (128 at
    two threads), and split many ways; each row equals, bit for bit, that row alone (a
    one-token step of the sequence at its length) at 1, 2 and 4 threads, and the dense
    reference over the pool's values."""
    gen = torch.Generator().manual_seed(7)
    pools, values = _pools(dtype, gen)
    ids = torch.randperm(BLOCKS, generator=gen).to(torch.int32)
    for threads in (1, 2, 4):
        torch.set_num_threads(threads)
        for first in (3, 14, 47, 126, 200, 645):
            for rows in (2, 5, 9, 17):
                lens = [first + i for i in range(rows)]
                width = (lens[-1] + BS - 1) // BS
                tables = ids[:width].repeat(rows, 1)
                q = torch.randn(rows, HEADS, D, generator=gen)
                together = _decode(q, pools, tables, lens)
                for i, n in enumerate(lens):
                    alone = _decode(q[i : i + 1], pools, tables[i : i + 1], [n])
                    assert torch.equal(together[i], alone[0]), (threads, first, rows, i)
                k = values[0][ids[:width]].reshape(-1, HKV, D)
                v = values[1][ids[:width]].reshape(-1, HKV, D)
                refs = [
                    dense_reference(q[i : i + 1], k[:n], v[:n], 0.125) for i, n in enumerate(lens)
                ]
                assert_close(together, torch.cat(refs).float())


@pytest.mark.parametrize("shared", [True, False])
def test_several_sequences_rows_each_keep_their_own_bits(shared: bool) -> None:
    """Two sequences with several rows each beside a one-row sequence, all behind one prompt
    of four blocks: with the shared-prefix read on (several-row sequences join no group) or
    off, each row gets what it gets alone, at 1 and 2 threads."""
    gen = torch.Generator().manual_seed(11)
    pools, _ = _pools(torch.float32, gen)
    ids = torch.randperm(BLOCKS, generator=gen).tolist()
    prompt, own = ids[:4], ids[4:]
    seq = [prompt + own[8 * i : 8 * i + 8] for i in range(3)]  # 192 tokens each
    layout = [(0, 90), (0, 91), (0, 92), (1, 130), (2, 150), (2, 151), (2, 152), (2, 153)]
    tables = torch.tensor([seq[s] for s, _ in layout], dtype=torch.int32)
    lens = [n for _, n in layout]
    q = torch.randn(len(layout), HEADS, D, generator=gen)
    before = cpu_lowbit.shared_prefix(shared)
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            together = _decode(q, pools, tables, lens)
            for i in range(len(lens)):
                # alone: the row with the one-row sequence, so the step still holds two
                # sequences (a row is split into runs by the step's sequence count)
                pick = [i, 3] if i != 3 else [3, 0]
                alone = _decode(q[pick], pools, tables[pick], [lens[j] for j in pick])
                assert torch.equal(together[i], alone[0]), (shared, threads, i)
    finally:
        cpu_lowbit.shared_prefix(before)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_verify_steps_decode_gemm_rows_keep_each_rows_bits(fmt: str) -> None:
    """Decode GEMMs of 5 to 9 rows (a verify step of one sequence: its last token and up to
    eight drafts): each row equals that row alone, and two threads give one thread's bits, on
    the AVX2 dots and, where the CPU has them, the VNNI ones; int16 and int8 activations."""
    spec = gguf_like(fmt, 200, 576, seed=3)
    layers = [QuantizedLinear(spec), QuantizedLinear(spec, approximate=True)]
    paths = [False, True] if cpu_lowbit.vnni() else [False]
    try:
        for vnni in paths:
            cpu_lowbit.vnni(vnni)
            for rows in (5, 6, 7, 8, 9):
                x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3
                for layer in layers:
                    torch.set_num_threads(1)
                    one = layer(x)
                    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
                    torch.set_num_threads(2)
                    two = layer(x)
                    assert torch.equal(one, alone), (vnni, rows, layer.fine)
                    assert torch.equal(one, two), (vnni, rows, layer.fine)
    finally:
        if paths[-1]:
            cpu_lowbit.vnni(True)
