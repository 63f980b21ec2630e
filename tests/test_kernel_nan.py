"""NaN through the KV kernels, and the C wrappers' argument checks.

A NaN in a step's K or V (a diverged model, a poisoned activation) must read as NaN on every
path, as it does in torch: the fp8 write gives the block a NaN scale (torch's amax and maximum
propagate it), and attention over a NaN key gives NaN for the query heads that see it (torch's
softmax does). The C kernels once lost it by the lane it sat in (maxps keeps only its second
operand's NaN): the fp8 write scaled the block to its other values, or to the 1e-12 floor, and
the exponential's clamp turned a NaN score into a finite weight. Triton's min/max drop NaN
unless told otherwise, which did the same to the Triton write.

The C wrappers hand raw pointers to the kernels, which read by shape alone: a strided or
mistyped argument read as garbage (or out of bounds) where a ValueError naming it is due.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from kvguard.kernels import cpu_lowbit, cpu_ops
from kvguard.kernels.fp8 import FP8_DTYPE, grow_scales, write_kv_fp8
from tests.test_cpu_ops import _native_on  # noqa: F401 - every test with the kernels on

pa = importlib.import_module("kvguard.kernels.paged_attention")
NAN = float("nan")


def same_scales(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, a NaN equal to a NaN (payloads aside)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


# ------------------------------------------------------------------ the C fp8 write


def _both_writes(writes: list[tuple[torch.Tensor, torch.Tensor]], nb: int, bs: int, h: int, d: int):
    """The same writes into two empty fp8 pools, by torch and by the C kernel."""
    out = []
    for write in (write_kv_fp8, cpu_ops.write_kv):
        cache, scales = torch.zeros(nb, bs, h, d, dtype=FP8_DTYPE), torch.zeros(nb, h)
        for x, where in writes:
            write(cache, scales, x, where)
        out.append((cache.view(torch.uint8).clone(), scales.clone()))
    return out


def _assert_same(got, want) -> None:  # noqa: ANN001
    (gb, gs), (wb, ws) = got, want
    assert same_scales(gs, ws), (gs, ws)
    assert torch.equal(gb, wb), (gb[gb != wb], wb[gb != wb])


def _with_nan(x: torch.Tensor, index: tuple, negative: bool = False) -> torch.Tensor:
    x = x.clone()
    x[index] = NAN
    if negative:  # the NaN x86 arithmetic makes (0 * inf, inf - inf): sign bit set
        x.view(torch.int32)[index] = -0x400000
    return x


@pytest.mark.parametrize("lane", range(8))
@pytest.mark.parametrize("negative", [False, True])
def test_fp8_write_of_a_nan_gives_torchs_nan_scale_and_bytes(lane: int, negative: bool) -> None:
    """A NaN in any lane of an 8-wide vector (here the second vector of a row of 16): a fresh
    block, a block already holding a token, and a write of three tokens with the NaN in the
    second, all leave torch's bytes (the NaN's sign kept) and a NaN scale."""
    gen = torch.Generator().manual_seed(lane)
    nb, bs, h, d = 3, 4, 1, 16
    x = torch.randn(3, h, d, generator=gen)
    bad = _with_nan(x[:1], (0, 0, 8 + lane), negative)
    fresh = _both_writes([(bad, torch.tensor([4]))], nb, bs, h, d)
    _assert_same(*fresh)
    assert fresh[1][1][1, 0].isnan()
    appended = _both_writes([(x[:1], torch.tensor([4])), (bad, torch.tensor([5]))], nb, bs, h, d)
    _assert_same(*appended)
    assert appended[1][1][1, 0].isnan()
    many = _with_nan(x, (1, 0, lane), negative)
    _assert_same(*_both_writes([(many, torch.tensor([4, 5, 6]))], nb, bs, h, d))
    # a block whose scale is NaN stays NaN when finite tokens follow
    later = [(bad, torch.tensor([4])), (x[1:2] * 100, torch.tensor([5]))]
    _assert_same(*_both_writes(later, nb, bs, h, d))


@pytest.mark.parametrize("lane", range(8))
def test_fp8_write_nan_in_one_head_while_another_grows(lane: int) -> None:
    """Two KV heads of one block: head 0 gets a NaN while head 1's scale grows, so torch
    requantises the whole block (head 0 by old / NaN): the same bytes and scales."""
    gen = torch.Generator().manual_seed(100 + lane)
    x0 = torch.randn(1, 2, 8, generator=gen)
    x1 = torch.randn(1, 2, 8, generator=gen)
    x1[0, 1] *= 50.0  # head 1 grows
    x1[0, 0, lane] = NAN
    got = _both_writes([(x0, torch.tensor([0])), (x1, torch.tensor([1]))], 2, 4, 2, 8)
    _assert_same(*got)
    assert got[1][1][0, 0].isnan() and got[1][1][0, 1].isfinite()


# ------------------------------------------------------------------ attention over a NaN key

H, HKV, D = 6, 2, 16  # three query heads per KV head
G = H // HKV


def _pools(nb: int, bs: int, dtype: torch.dtype, gen: torch.Generator):
    k = torch.randn(nb, bs, HKV, D, generator=gen)
    v = torch.randn(nb, bs, HKV, D, generator=gen)
    if dtype != FP8_DTYPE:
        return k, v, None, None
    kc, vc = torch.zeros(nb, bs, HKV, D, dtype=dtype), torch.zeros(nb, bs, HKV, D, dtype=dtype)
    ks, vs = torch.zeros(nb, HKV), torch.zeros(nb, HKV)
    every = torch.arange(nb * bs)
    write_kv_fp8(kc, ks, k.view(-1, HKV, D), every)
    write_kv_fp8(vc, vs, v.view(-1, HKV, D), every)
    return kc, vc, ks, vs


def _poison(kv: tuple, slot: int) -> tuple:
    """A copy of the pools with K element 5 of KV head 0 at flat `slot` NaN; in an fp8 pool
    as a write of it leaves the block (tests above): a NaN code, and a NaN scale for the
    block's KV head 0."""
    k, v, ks, vs = kv
    k = k.clone()
    if k.dtype != FP8_DTYPE:
        k.view(-1, HKV, D)[slot, 0, 5] = NAN
        return k, v, ks, vs
    k.view(torch.uint8).view(-1, HKV, D)[slot, 0, 5] = 0x7F
    ks = ks.clone()
    ks[slot // k.shape[1], 0] = NAN
    return k, v, ks, vs


def _tables(lengths: list[int], bs: int, nb: int, gen: torch.Generator, shared: int = 0):
    """Block tables (int32) in shuffled blocks; the first `shared` blocks the same for all."""
    perm = torch.randperm(nb, generator=gen).tolist()
    width = max(-(-n // bs) for n in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    common, used = perm[:shared], shared
    for i, n in enumerate(lengths):
        own = -(-n // bs) - shared
        tables[i, : shared + own] = torch.tensor(common + perm[used : used + own])
        used += own
    return tables


def _decode_both(q: torch.Tensor, kv: tuple, tables: torch.Tensor, lengths: list[int]):
    rows = list(range(len(lengths)))
    native, ref = torch.zeros_like(q), torch.zeros_like(q)
    pa._decode_native(q, native, kv, tables, lengths, rows, rows, 0.25)
    pa._decode(q, ref, kv, tables, lengths, rows, rows, 0.25)
    return native, ref


DECODE_CASES = {
    # lengths, block size, shared blocks, (sequence, token) NaN positions
    "blocks": ([37, 21, 9], 8, 0, [(0, 0), (0, 7), (0, 15), (0, 36), (1, 20), (2, 3)]),
    "split-k": ([600], 16, 0, [(0, 0), (0, 15), (0, 300), (0, 599)]),
    "shared": ([30, 27, 35, 40], 8, 3, [(0, 0), (0, 7), (0, 23), (2, 34)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, FP8_DTYPE], ids=["fp32", "fp8"])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_over_a_nan_key_is_nan_as_in_torch(case: str, dtype: torch.dtype) -> None:
    """A NaN key element at the first, a block's last, a middle and the last token; a long
    sequence split over the threads (partials merged), sequences sharing blocks (read once):
    the query heads of that KV head are NaN on the C path as on torch's, every other output
    keeps its bits."""
    lengths, bs, shared, spots = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(7)
    nb = sum(-(-n // bs) for n in lengths) + 2
    tables = _tables(lengths, bs, nb, gen, shared)
    kv = _pools(nb, bs, dtype, gen)
    q = torch.randn(len(lengths), H, D, generator=gen)
    clean, _ = _decode_both(q, kv, tables, lengths)
    calls = cpu_lowbit.shared_prefix_calls()
    for seq, tok in spots:
        block = int(tables[seq, tok // bs])
        native, ref = _decode_both(q, _poison(kv, block * bs + tok % bs), tables, lengths)
        # the sequences that hold the block (a shared one: all), heads of KV head 0
        hit = torch.tensor(
            [block in tables[i, : -(-n // bs)].tolist() for i, n in enumerate(lengths)]
        )
        if dtype == FP8_DTYPE:  # the whole block's scale is NaN: any token of it poisons
            hit &= torch.tensor([n > (tok // bs) * bs for n in lengths])
        else:
            hit &= torch.tensor([n > tok for n in lengths])
        for out in (native, ref):
            assert out[hit, :G].isnan().all(), (seq, tok)
        keep = torch.ones_like(native, dtype=torch.bool)
        keep[hit, :G] = False
        assert torch.equal(native[keep], clean[keep])
        assert ref[keep].isfinite().all()
    if case == "shared":
        assert cpu_lowbit.shared_prefix_calls() > calls  # the shared blocks were read once


PREFILL_CASES = {
    # (cached length, query rows) of each chunk, block size, NaN tokens of chunk 0
    "whole prompts": ([(40, 40), (17, 17)], 8, [0, 7, 20, 39]),
    "later chunks": ([(50, 20), (70, 33)], 8, [3, 31, 35, 49]),
    "one item": ([(300, 16)], 16, [15, 290, 299]),
}


@pytest.mark.parametrize("dtype", [torch.float32, FP8_DTYPE], ids=["fp32", "fp8"])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_over_a_nan_key_is_nan_as_in_torch(case: str, dtype: torch.dtype) -> None:
    """A prompt chunk over a NaN key: every query that sees the token (at or after it) is NaN
    for that KV head's query heads, on the C path as on torch's; the C path's other outputs
    (earlier queries, other heads, other chunks) keep their bits. (Torch's masked attention
    gives the queries before it NaN too: its mask is added, and NaN - inf is NaN.)"""
    chunks, bs, spots = PREFILL_CASES[case]
    lengths, qlens = [n for n, _ in chunks], [m for _, m in chunks]
    gen = torch.Generator().manual_seed(9)
    nb = sum(-(-n // bs) for n in lengths) + 2
    tables = _tables(lengths, bs, nb, gen)
    kv = _pools(nb, bs, dtype, gen)
    q = torch.randn(sum(qlens), H, D, generator=gen)
    starts = pa.row_starts(qlens)
    every = list(range(len(chunks)))
    clean = torch.zeros_like(q)
    pa._prefill_native(q, clean, kv, tables, lengths, qlens, starts, every, 0.25)
    pos = torch.arange(lengths[0] - qlens[0], lengths[0])  # chunk 0's query positions
    for tok in spots:
        block = int(tables[0, tok // bs])
        bad = _poison(kv, block * bs + tok % bs)
        native = torch.zeros_like(q)
        pa._prefill_native(q, native, bad, tables, lengths, qlens, starts, every, 0.25)
        ref = pa._prefill_one(q[: qlens[0]], bad, tables[0], lengths[0], 0.25)
        first = (tok // bs) * bs if dtype == FP8_DTYPE else tok  # fp8: its block is NaN
        sees = pos >= first
        assert sees.any()
        assert native[: qlens[0]][sees, :G].isnan().all(), tok
        assert ref[sees, :G].isnan().all(), tok
        keep = torch.ones_like(native, dtype=torch.bool)
        keep[: qlens[0]][sees, :G] = False
        assert torch.equal(native[keep], clean[keep])


def test_a_nan_query_or_an_infinite_score_is_nan_on_the_c_path() -> None:
    """The exponential no longer clamps a NaN: a NaN query, or a score of +inf (inf - inf in
    the softmax), gives NaN on the C path as on torch's, for decode and prefill."""
    gen = torch.Generator().manual_seed(3)
    bs, lengths = 8, [20]
    tables = _tables(lengths, bs, 4, gen)
    k, v, _, _ = _pools(4, bs, torch.float32, gen)
    q = torch.randn(1, H, D, generator=gen)
    q[0, 1, 2] = NAN
    native, ref = _decode_both(q, (k, v, None, None), tables, lengths)
    assert native[0, 1].isnan().all() and ref[0, 1].isnan().all()
    assert torch.equal(native[0, 0].isnan(), ref[0, 0].isnan())
    k2 = k.clone()
    k2.view(-1, HKV, D)[int(tables[0, 1]) * bs + 2, 1] = 3e38  # 16 of 3e38: an inf score
    q2 = torch.ones(1, H, D)
    native, ref = _decode_both(q2, (k2, v, None, None), tables, lengths)
    assert native[0, G:].isnan().all() and ref[0, G:].isnan().all()
    assert native[0, :G].isfinite().all()
    qp = torch.ones(20, H, D)
    out = torch.zeros_like(qp)
    pa._prefill_native(qp, out, (k2, v, None, None), tables, lengths, [20], [0], [0], 0.25)
    want = pa._prefill_one(qp, (k2, v, None, None), tables[0], 20, 0.25)
    assert torch.equal(out[:, G:].isnan(), want[:, G:].isnan())
    assert out[10:, G:].isnan().all() and out[:, :G].isfinite().all()


# ------------------------------------------------------------------ the wrappers' checks


def _decode_args(**change):  # noqa: ANN003, ANN202
    nb, bs = 8, 4
    args = {
        "q": torch.randn(2, H, D),
        "out": torch.zeros(2, H, D),
        "rows": torch.tensor([0, 1]),
        "lens": torch.tensor([6, 3], dtype=torch.int32),
        "k_cache": torch.randn(nb, bs, HKV, D),
        "v_cache": torch.randn(nb, bs, HKV, D),
        "tables": torch.stack([torch.arange(nb), torch.arange(nb).flip(0)]).int(),
        "scale": 0.25,
    }
    args.update(change)
    return args


def _prefill_args(**change):  # noqa: ANN003, ANN202
    args = _decode_args()
    args["qlens"] = torch.tensor([1, 1], dtype=torch.int32)
    args.update(change)
    return args


def test_the_wrappers_take_well_formed_arguments() -> None:
    cpu_ops.paged_decode(**_decode_args())
    cpu_ops.paged_prefill(**_prefill_args())


BAD_DECODE = {
    "lens": torch.tensor([6, 9, 3], dtype=torch.int32)[::2],  # strided: read [6, 9]
    "rows": torch.tensor([0, 1], dtype=torch.int32),
    "k_cache": torch.randn(8, 4, 4, D)[:, :, :HKV],  # a view of another pool's heads
    "v_cache": torch.randn(8, 4, 4, D)[:, :, :HKV],
    "q": torch.randn(2, H, D).half(),
    "out": torch.zeros(2, H, D, dtype=torch.float64),
    "tables": torch.arange(16, dtype=torch.int32).view(2, 8)[:1],  # one row for two sequences
}


@pytest.mark.parametrize("name", BAD_DECODE)
def test_decode_refuses_an_argument_it_would_misread(name: str) -> None:
    args = _decode_args(**{name: BAD_DECODE[name]})
    with pytest.raises(ValueError, match=f"`{name}`"):
        cpu_ops.paged_decode(**args)


BAD_PREFILL = {
    "qlens": torch.tensor([1, 5, 1], dtype=torch.int32)[::2],
    "lens": torch.tensor([6, 9, 3], dtype=torch.int32)[::2],
    "k_cache": torch.randn(8, 4, 4, D)[:, :, :HKV],
    "tables": torch.stack([torch.arange(8), torch.arange(8)]),  # int64
}


@pytest.mark.parametrize("name", BAD_PREFILL)
def test_prefill_refuses_an_argument_it_would_misread(name: str) -> None:
    args = _prefill_args(**{name: BAD_PREFILL[name]})
    with pytest.raises(ValueError, match=f"`{name}`"):
        cpu_ops.paged_prefill(**args)


def test_an_fp8_pool_without_its_scales_and_a_strided_pool_are_refused() -> None:
    pool = torch.zeros(8, 4, HKV, D, dtype=FP8_DTYPE)
    args = _decode_args(k_cache=pool, v_cache=pool.clone())
    with pytest.raises(ValueError, match="k_scale"):
        cpu_ops.paged_decode(**args)
    with pytest.raises(ValueError, match="v_scale"):
        cpu_ops.paged_decode(**args, k_scale=torch.ones(8, HKV), v_scale=torch.ones(HKV, 8))
    strided = BAD_DECODE["k_cache"]
    assert not cpu_ops.decode_supported(torch.randn(1, H, D), strided)  # torch's path serves it
    assert cpu_ops.decode_supported(torch.randn(1, H, D), strided.contiguous())


def test_rope_rmsnorm_and_write_refuse_misshapen_arguments() -> None:
    x = torch.randn(3, (H + HKV + 1) * D)[:, : (H + HKV) * D]  # rows with room past them
    cos, sin = torch.randn(3, D), torch.randn(3, D)
    cpu_ops.rope_(x, H + HKV, D, cos, sin)
    with pytest.raises(ValueError, match="`cos`"):
        cpu_ops.rope_(x, H + HKV, D, torch.randn(3, D // 2), sin)  # half the table
    with pytest.raises(ValueError, match="`sin`"):
        cpu_ops.rope_(x, H + HKV, D, cos, torch.randn(2, D))  # a row short
    with pytest.raises(ValueError, match="`x`"):
        cpu_ops.rope_(x, H + HKV + 1, D, cos, sin)  # more heads than the row holds
    h = torch.randn(3, 64)
    cpu_ops.rmsnorm(h, torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="`weight`"):
        cpu_ops.rmsnorm(h, torch.ones(64, dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match="`weight`"):
        cpu_ops.rmsnorm(h, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="`residual`"):
        cpu_ops.rmsnorm(h, torch.ones(64), 1e-5, torch.ones(3, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="`x`"):
        cpu_ops.silu_mul(torch.randn(3, 64, dtype=torch.float64), 32)
    with pytest.raises(ValueError, match="write_kv"):
        cpu_ops.write_kv(
            torch.zeros(2, 4, 1, 8), None, torch.randn(1, 1, 8), torch.tensor([0]).int()
        )


# ------------------------------------------------------------------ the Triton fp8 write

DEVICE = os.environ.get("KVGUARD_TEST_DEVICE", "cpu")


def _triton_fp8_equal(ref: torch.Tensor, got: torch.Tensor) -> None:
    """Equal bytes; under the interpreter a NaN code may read as its software cast writes a
    NaN (the exponent saturated, the mantissa's top bits kept: 0x7c with the sign), where the
    compiled cast writes 0x7f as torch does. Never a clamped +-448 (0x7e / 0xfe)."""
    rb, gb = ref.view(torch.uint8), got.view(torch.uint8)
    diff = rb != gb
    if DEVICE == "cpu":
        nan_code = (rb & 0x7F) == 0x7F
        assert (~diff | (nan_code & ((gb & 0x7F) == 0x7C) & ((gb & 0x80) == (rb & 0x80)))).all()
    else:
        assert not diff.any(), (rb[diff], gb[diff])


@pytest.mark.parametrize("own_blocks", [True, False], ids=["own-blocks", "grown-in-torch"])
def test_triton_fp8_write_of_a_nan_gives_torchs_nan_scale(own_blocks: bool) -> None:
    """The Triton fp8 write (the CUDA path; the interpreter on CPU) with a NaN in each lane,
    in a fresh block and in one holding a token: torch's NaN scale, and NaN codes for the
    token, not the -448 a NaN-dropping clamp made of it."""
    pytest.importorskip("triton")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU only in the interpreter")
    tkv = pytest.importorskip("kvguard.kernels.triton_kv")
    gen = torch.Generator().manual_seed(5)
    for lane in range(8):
        for first in (False, True):  # a fresh block; a block holding a token
            x0 = torch.randn(1, 1, 8, generator=gen).to(DEVICE)
            x = torch.arange(1.0, 9.0).view(1, 1, 8)
            x[0, 0, lane] = NAN
            x = x.to(DEVICE)
            pools = []
            for _path in range(2):
                cache = torch.zeros(2, 4, 1, 8, dtype=FP8_DTYPE, device=DEVICE)
                scales = torch.zeros(2, 1, device=DEVICE)
                if first:
                    write_kv_fp8(cache, scales, x0, torch.tensor([4], device=DEVICE))
                pools.append((cache, scales))
            slot = torch.tensor([5 if first else 4], device=DEVICE)
            write_kv_fp8(*pools[0], x, slot)
            cache, scales = pools[1]
            if own_blocks:
                tkv.store_fp8_own_blocks(cache, x, slot, scales)
            else:
                grow_scales(cache, scales, x, slot)
                tkv.store_kv(cache, x, slot, scales)
            assert same_scales(pools[0][1].cpu(), scales.cpu()), (lane, first)
            assert scales[1, 0].isnan()
            _triton_fp8_equal(pools[0][0].cpu(), cache.cpu())
