"""The CPU step kernels (`kernels/cpu_ops.c`): paged decode and prefill attention, the KV
write, RMSNorm, RoPE.

Attention is held to the float64 dense reference of test_paged_attention on pools filled with
garbage outside each sequence's blocks, for every pool dtype, GQA ratio and the split-K path;
the narrow pools (fp16, bf16, fp8) also to torch's own decode path, which dequantises the same
way. Norm and RoPE are held to the torch code they replace. `KVGUARD_CPU_OPS=0` must bring the
torch path back, and a whole model must produce the same tokens either way.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvguard.engine import EngineConfig, LLMEngine, model_runner
from kvguard.engine.model import RMSNorm, apply_rope
from kvguard.engine.sampling_params import SamplingParams
from kvguard.kernels import cpu_lowbit, cpu_ops, dispatch, env
from kvguard.kernels.fp8 import FP8_DTYPE, write_kv_fp8
from tests.test_cpu_lowbit import switch_follows_cpu
from tests.test_paged_attention import (
    assert_close,
    dense_reference,
    make_pool,
    random_seq,
    run_batch,
    slots,
)

pa = importlib.import_module("kvguard.kernels.paged_attention")


@pytest.fixture(autouse=True)
def _native_on(monkeypatch: pytest.MonkeyPatch):
    """Every test starts with the kernels on and leaves the switch as it found it."""
    assert cpu_lowbit.available(), "the C kernels must build here (.ci/run installs gcc)"
    monkeypatch.delenv(cpu_ops.ENV, raising=False)
    cpu_ops.reset()
    yield
    cpu_ops.reset()


def _forbid(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    def refuse(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError(f"{name} must not run on this path")

    monkeypatch.setattr(pa, name, refuse)


def test_decode_rows_take_the_kernel_and_the_switch_brings_torch_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seqs = [(45, 1), (30, 12), (16, 1), (3, 1)]
    _forbid(monkeypatch, "_decode")
    out, ref = run_batch(seqs, 9, 3, 64, 16, seed=11)
    assert_close(out, ref)
    monkeypatch.undo()
    monkeypatch.setenv(cpu_ops.ENV, "0")
    cpu_ops.reset()
    _forbid(monkeypatch, "_decode_native")
    out, ref = run_batch(seqs, 9, 3, 64, 16, seed=11)
    assert_close(out, ref)


@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("0", False),
        ("off", False),
        ("FALSE", False),
        (" No ", False),
        ("1", True),
        ("on", True),
        ("True", True),
        ("yes", True),
        ("", True),  # empty: unset, the default
    ],
)
def test_the_switch_reads_every_switchs_words(
    value: str, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVGUARD_CPU_OPS=off` (false, no) left the kernels on: only "0" was read as off."""
    monkeypatch.setenv(cpu_ops.ENV, value)
    cpu_ops.reset()
    assert cpu_ops._on() is on


def test_an_unknown_switch_value_is_its_default_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A value no switch takes fell back to the default silently; now a warning names the
    variable, the value and the default taken, once (some switches are read on every call)."""
    monkeypatch.setattr(env, "_warned", set())
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)  # read as on a GPU host
    monkeypatch.setenv(cpu_ops.ENV, "of")
    monkeypatch.setenv("KVGUARD_TRITON", "nope")
    monkeypatch.setenv(dispatch.W4A16_PLANES_ENV, "yess")
    monkeypatch.setenv(dispatch.GEMV_ENV, "dnse")
    with caplog.at_level(logging.WARNING, logger="kvguard.env"):
        for _ in range(2):
            cpu_ops.reset()
            assert cpu_ops._on() is True
            assert dispatch.use_triton("cuda") is True
            assert dispatch.w4a16_planes() is False
            assert not dispatch.gemv_rows(torch.ones(1, 8), "dense")
    assert [r.getMessage() for r in caplog.records if r.name == "kvguard.env"] == [
        "KVGUARD_CPU_OPS='of' is not 1/true/on/yes or 0/false/off/no: on, its default",
        "KVGUARD_TRITON='nope' is not 1/true/on/yes or 0/false/off/no: on, its default",
        "KVGUARD_W4A16_PLANES='yess' is not 1/true/on/yes or 0/false/off/no: off, its default",
        "KVGUARD_TRITON_GEMV='dnse' is not 1, dense, 4bit or 0: off, its default",
    ]


def test_the_triton_switches_read_the_same_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KVGUARD_TRITON=off` kept Triton on, `KVGUARD_FP8_EARLY_WIDEN=on` left it off: each
    compared its value with "0" or "1" alone. (Read as on a GPU host: no GPU needed.)"""
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    for value, on in (("off", False), ("No", False), ("0", False), ("on", True), ("YES", True)):
        monkeypatch.setenv("KVGUARD_TRITON", value)
        assert dispatch.use_triton("cuda") is on, value
    monkeypatch.setenv("KVGUARD_TRITON", "true")
    for name, read in (
        (dispatch.TRITON_PREFILL_ENV, lambda: dispatch.use_triton_prefill("cuda")),
        (dispatch.FP8_EARLY_WIDEN_ENV, dispatch.fp8_early_widen),
        (dispatch.W4A16_PLANES_ENV, dispatch.w4a16_planes),
    ):
        monkeypatch.delenv(name, raising=False)
        assert read() is False, name  # opt-in
        for value, on in (("on", True), ("true", True), ("off", False), ("1", True)):
            monkeypatch.setenv(name, value)
            assert read() is on, (name, value)


def test_the_graph_switch_reads_the_same_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KVGUARD_CUDA_GRAPHS=true` turned graphs off (only "1" was on); unset, the knob rules.
    (Asked for a CUDA device by type only: no GPU needed.)"""
    cuda = torch.device("cuda")
    for knob in (True, False):
        config = EngineConfig(model="tiny", cuda_graphs=knob)
        monkeypatch.delenv(model_runner.CUDA_GRAPHS_ENV, raising=False)
        assert model_runner.cuda_graphs_wanted(config, cuda, 1) is knob
        for value, on in (("true", True), ("ON", True), ("1", True), ("off", False), ("no", False)):
            monkeypatch.setenv(model_runner.CUDA_GRAPHS_ENV, value)
            assert model_runner.cuda_graphs_wanted(config, cuda, 1) is on, (knob, value)
            assert model_runner.cuda_graphs_wanted(config, torch.device("cpu"), 1) is False


@pytest.mark.parametrize(
    ("lengths", "n_heads", "n_kv", "head_dim", "block_size"),
    [
        ([1000], 9, 3, 64, 16),  # one long sequence: split into runs over the threads
        ([700, 1], 4, 1, 128, 32),  # split, with one run of a sequence empty
        ([257, 64, 65], 8, 2, 64, 8),
        ([33] * 40, 9, 3, 64, 16),  # more items than threads: no split
        ([5, 17], 16, 1, 8, 4),  # the widest group, the narrowest head
    ],
)
def test_decode_matches_the_dense_reference(
    lengths: list[int], n_heads: int, n_kv: int, head_dim: int, block_size: int
) -> None:
    out, ref = run_batch([(n, 1) for n in lengths], n_heads, n_kv, head_dim, block_size, seed=2)
    assert_close(out, ref)


def test_a_shape_the_kernel_does_not_serve_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """head_dim 12 is not a multiple of 8: torch's path answers, correctly."""
    _forbid(monkeypatch, "_decode_native")
    out, ref = run_batch([(20, 1), (9, 1)], 4, 2, 12, 8, seed=3)
    assert_close(out, ref)


def _narrow_pool(dtype: torch.dtype, lengths: list[int], gen: torch.Generator):  # noqa: ANN202
    n_heads, n_kv, head_dim, block_size = 9, 3, 64, 16
    batch = make_pool(lengths, n_kv, head_dim, block_size, gen)
    shape = batch.k_cache.shape
    if dtype == FP8_DTYPE:
        k_cache = torch.zeros(shape, dtype=dtype)
        v_cache = torch.zeros(shape, dtype=dtype)
        scales = (torch.zeros(shape[0], n_kv), torch.zeros(shape[0], n_kv))
    else:
        k_cache, v_cache = batch.k_cache.to(dtype), batch.v_cache.to(dtype)
        scales = (None, None)
    for i, n in enumerate(lengths):
        _q, k, v = random_seq(n, n_heads, n_kv, head_dim, gen)
        where = slots(batch.tables[i], 0, n, block_size)
        if dtype == FP8_DTYPE:
            write_kv_fp8(k_cache, scales[0], k, where)
            write_kv_fp8(v_cache, scales[1], v, where)
        else:
            pa.write_kv(k_cache, v_cache, k, v, where)
    q = torch.randn(len(lengths), n_heads, head_dim, generator=gen)
    return q, (k_cache, v_cache, *scales), batch.block_tables


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8_DTYPE])
def test_narrow_pools_read_like_torchs_dequantisation(dtype: torch.dtype) -> None:
    lengths = [1, 40, 300, 17]
    q, kv, tables = _narrow_pool(dtype, lengths, torch.Generator().manual_seed(4))
    rows = list(range(len(lengths)))
    want, got = torch.zeros_like(q), torch.zeros_like(q)
    pa._decode(q, want, kv, tables, lengths, rows, rows, 0.125)
    pa._decode_native(q, got, kv, tables, lengths, rows, rows, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_strided_query_rows_and_rows_between_prefill_rows() -> None:
    """Queries as a view into a wider row (the fused qkv output), decode rows interleaved."""
    gen = torch.Generator().manual_seed(5)
    n_heads, n_kv, d, bs = 9, 3, 64, 16
    seqs = [(30, 4), (50, 1), (12, 12), (70, 1)]
    batch = make_pool([s for s, _ in seqs], n_kv, d, bs, gen)
    rows, refs = [], []
    for i, (n, qlen) in enumerate(seqs):
        q, k, v = random_seq(n, n_heads, n_kv, d, gen)
        pa.write_kv(batch.k_cache, batch.v_cache, k, v, slots(batch.tables[i], 0, n, bs))
        rows.append(q[n - qlen :])
        refs.append(dense_reference(q[n - qlen :], k, v, 1 / 8))
    flat = torch.cat(rows)
    wide = torch.zeros(flat.shape[0], (n_heads + 2 * n_kv) * d)
    wide[:, : n_heads * d] = flat.reshape(flat.shape[0], -1)
    q = wide[:, : n_heads * d].view(-1, n_heads, d)
    assert not q.is_contiguous()
    out = pa.paged_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables,
        [s for s, _ in seqs], [n for _, n in seqs], 1 / 8,
    )  # fmt: skip
    assert_close(out, torch.cat(refs).float())


def _decode_rows(q: torch.Tensor, kv: tuple, tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """`cpu_ops.paged_decode` with query row i of `q` over `tables[i]` at `lens[i]` tokens."""
    out = torch.zeros_like(q)
    rows = torch.arange(q.shape[0])
    lens_t = torch.tensor(lens, dtype=torch.int32)
    cpu_ops.paged_decode(q, out, rows, lens_t, *kv, tables.contiguous(), 0.125)
    return out


def _one_pool(gen: torch.Generator, blocks: int = 64):  # noqa: ANN202
    """fp32 pools of `blocks` blocks of 16 tokens, 3 KV heads of 64, all random (garbage
    beyond any table's tokens), and block tables of shuffled ids."""
    k_cache = torch.randn(blocks, 16, 3, 64, generator=gen) * 3
    v_cache = torch.randn(blocks, 16, 3, 64, generator=gen)
    return (k_cache, v_cache), torch.randperm(blocks, generator=gen).to(torch.int32)


@pytest.mark.parametrize("length", [16 * 3 + 7, 16 * 40 + 5])  # 3 blocks and part, 40 and part
@pytest.mark.parametrize("shared", [True, False])
def test_one_sequences_decode_rows_get_its_one_token_steps_bits(length: int, shared: bool) -> None:
    """A verify step's rows (a last token and its drafts) or a grammar's forced rows are
    several decode rows of one sequence: its block table each, lengths one apart. Each row
    gets, bit for bit, what a step of that sequence alone at its length gets, with the
    shared-prefix read on or off and either lane width, so a lone seeded request answers
    alike with drafts or jump-forward and without. Before, three rows or more over two full
    blocks were taken as sequences sharing a prefix (their blocks read once, the softmax
    merged from parts: logits up to 0.024 apart in the default model), and a long sequence
    was split over the threads by the step's row count, not its own length."""
    gen = torch.Generator().manual_seed(41)
    kv, ids = _one_pool(gen)
    lens = [length - 3, length - 2, length - 1, length]
    width = (length + 15) // 16
    tables = ids[:width].repeat(4, 1)
    q = torch.randn(4, 9, 64, generator=gen)
    have = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_lowbit.cpu_flags()
    threads, wide, before = torch.get_num_threads(), cpu_lowbit.attention512(), None
    try:
        torch.set_num_threads(4)  # a lone long row splits 16 ways, four rows 4 ways before
        before = cpu_lowbit.shared_prefix(shared)
        for lanes in [True, False] if have else [False]:
            cpu_lowbit.attention512(lanes)
            calls = cpu_lowbit.shared_prefix_calls()
            together = _decode_rows(q, kv, tables, lens)
            for i, n in enumerate(lens):
                alone = _decode_rows(q[i : i + 1], kv, tables[i : i + 1], [n])
                assert torch.equal(together[i], alone[0]), (lanes, n)
            assert cpu_lowbit.shared_prefix_calls() == calls  # no group of one sequence
            k = kv[0][ids[:width]].reshape(-1, 3, 64)
            v = kv[1][ids[:width]].reshape(-1, 3, 64)
            refs = [dense_reference(q[i : i + 1], k[:n], v[:n], 0.125) for i, n in enumerate(lens)]
            assert_close(together, torch.cat(refs).float())
    finally:
        torch.set_num_threads(threads)
        cpu_lowbit.attention512(wide)
        if before is not None:
            cpu_lowbit.shared_prefix(before)


def test_sequences_sharing_a_prefix_still_read_it_once_beside_a_verify_step() -> None:
    """Different sequences behind one prompt keep reading its blocks once, one sequence's
    verify rows beside them included (those attend alone), and a group counts sequences,
    not rows: two sequences and another's two rows are too few for this shape's group of
    three (nine query heads, a set of sixteen half filled)."""
    gen = torch.Generator().manual_seed(43)
    kv, ids = _one_pool(gen, blocks=40)
    prompt = ids[:4].tolist()  # 4 full blocks every sequence begins with
    own = ids[4:].tolist()
    seq_tables = [prompt + own[2 * i : 2 * i + 2] for i in range(5)]
    q = torch.randn(7, 9, 64, generator=gen)
    before = cpu_lowbit.shared_prefix(True)
    try:
        # three sequences one row each, then a fourth's three verify rows
        tables = torch.tensor([seq_tables[i] for i in (0, 1, 2, 3, 3, 3)], dtype=torch.int32)
        lens = [70, 75, 80, 90, 91, 92]
        calls = cpu_lowbit.shared_prefix_calls()
        got = _decode_rows(q[:6], kv, tables, lens)
        assert cpu_lowbit.shared_prefix_calls() == calls + 1
        refs = []
        for i, n in enumerate(lens):
            blocks = tables[i, : (n + 15) // 16]
            k = kv[0][blocks].reshape(-1, 3, 64)[:n]
            v = kv[1][blocks].reshape(-1, 3, 64)[:n]
            refs.append(dense_reference(q[i : i + 1], k, v, 0.125))
        assert_close(got, torch.cat(refs).float())
        # two sequences and another's two rows: no group
        tables = torch.tensor([seq_tables[i] for i in (0, 1, 3, 3)], dtype=torch.int32)
        calls = cpu_lowbit.shared_prefix_calls()
        _decode_rows(q[:4], kv, tables, [70, 75, 90, 91])
        assert cpu_lowbit.shared_prefix_calls() == calls
        # ... where three sequences make one
        tables = torch.tensor([seq_tables[i] for i in (0, 1, 3, 4)], dtype=torch.int32)
        _decode_rows(q[:4], kv, tables, [70, 75, 90, 91])
        assert cpu_lowbit.shared_prefix_calls() == calls + 1
    finally:
        cpu_lowbit.shared_prefix(before)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rmsnorm_matches_torch_and_adds_the_residual_in_place(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen) * 3
    y = torch.randn(rows, 576, generator=gen)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    cpu_ops.reset()
    with torch.no_grad():
        want_sum = x + y
        xf = want_sum.float()
        want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))
        got_x, got = norm.add_forward(x.clone(), y)
        alone = norm(want_sum)
    torch.testing.assert_close(got_x, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(alone, want, atol=1e-6, rtol=1e-5)


def test_rope_in_place_equals_apply_rope_on_q_and_k_only() -> None:
    gen = torch.Generator().manual_seed(6)
    t, nh, nkv, d = 7, 9, 3, 64
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=gen)
    pos = torch.tensor([0, 3, 17, 100, 5, 6, 2047])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(pos.float(), inv)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    want_q = apply_rope(qkv[:, : nh * d].view(t, nh, d), cos[:, None], sin[:, None])
    want_k = apply_rope(qkv[:, nh * d : (nh + nkv) * d].view(t, nkv, d), cos[:, None], sin[:, None])
    got = qkv.clone()
    cpu_ops.rope_(got, nh + nkv, d, cos, sin)
    assert torch.equal(got[:, : nh * d], want_q.reshape(t, -1))
    assert torch.equal(got[:, nh * d : (nh + nkv) * d], want_k.reshape(t, -1))
    assert torch.equal(got[:, (nh + nkv) * d :], qkv[:, (nh + nkv) * d :])  # v untouched


@pytest.mark.parametrize("inter", [1536, 20])  # a multiple of 8, and one with a tail
def test_silu_mul_matches_torch_on_strided_rows(inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    wide = torch.randn(9, 2 * inter + 5, generator=gen) * 6
    wide[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -0.0])  # saturating exponents, zeros
    wide[1, 3] = float("nan")
    gu = wide[:, : 2 * inter]  # a row stride wider than the row
    got = cpu_ops.silu_mul(gu, inter)
    gate, up = gu.split(inter, -1)
    want = F.silu(gate) * up
    assert got.shape == (9, inter) and got.is_contiguous()
    assert torch.isnan(got[1, 3]) and torch.isfinite(got[0, :3]).all()
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok], want[ok], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_a_model_makes_the_same_tokens_with_the_kernels_and_without(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[100 + 7 * i + j for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(model=model, kv_cache_bytes="64MiB", num_threads=2, max_num_seqs=4)
    outs = {}
    for on in ("1", "0"):
        monkeypatch.setenv(cpu_ops.ENV, on)
        cpu_ops.reset()
        eng = LLMEngine.from_config(cfg, progress=False)
        outs[on] = [o.final_token_ids for o in eng.generate(prompts, params)]
    assert outs["1"] == outs["0"]
    assert all(len(t) == 24 for t in outs["1"])


# lengths and magnitudes of successive writes into one sequence's blocks: a prefill chunk over
# three blocks, single tokens, a chunk that grows every scale (the block is requantised), one
# far below the scale (fp8 subnormals and zeros), one past 448 x the scale
WRITES = [
    (0, 40, 1.0),
    (40, 41, 0.5),
    (41, 42, 3.0),
    (42, 50, 10.0),
    (50, 51, 1e-6),
    (51, 60, 700.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, FP8_DTYPE])
def test_the_c_kv_write_stores_torchs_bits(dtype: torch.dtype) -> None:
    """`cpu_ops.write_kv` (every KV write on the CPU, whatever the pool) against
    torch's cast or `write_kv_fp8`, byte for byte and scale for scale: strided rows, a block
    table out of order, stale scales of a block's earlier owner, scales that grow."""
    gen = torch.Generator().manual_seed(11)
    nb, bs, h, d = 12, 16, 3, 64
    fp8 = dtype == FP8_DTYPE
    want = torch.zeros(nb, bs, h, d, dtype=dtype) if fp8 else torch.randn(nb, bs, h, d).to(dtype)
    got = want.clone()
    stale = torch.rand(nb, h, generator=gen) if fp8 else None
    want_s, got_s = (stale.clone(), stale.clone()) if fp8 else (None, None)
    table = [3, 7, 1, 9]
    for p0, p1, mag in WRITES:
        wide = torch.randn(p1 - p0, 2 * h * d, generator=gen) * mag
        wide[:, h * d + 5] = 0.0
        wide[0, h * d + 6 : h * d + 14] *= torch.logspace(-7, 0, 8)  # a wide dynamic range
        x = wide[:, h * d :].view(p1 - p0, h, d)  # rows of a wider tensor, like the qkv output
        where = torch.tensor([table[p // bs] * bs + p % bs for p in range(p0, p1)])
        if fp8:
            write_kv_fp8(want, want_s, x, where)
        else:
            want.view(nb * bs, h, d).index_copy_(0, where, x.to(dtype))
        cpu_ops.write_kv(got, got_s, x, where)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (p0, p1)
        if fp8:
            assert torch.equal(got_s, want_s), (p0, p1)
    # exact halfway values (448 in every head makes the fresh block's scale 1): ties round
    # to the even neighbour, in the normal and the subnormal range
    ties = torch.tensor(
        [448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 232.0, 5 * 2.0**-11]
    )
    x = ties.repeat(h, d // 8).view(1, h, d)
    where = torch.tensor([5 * bs])
    if fp8:
        write_kv_fp8(want, want_s, x, where)
    else:
        want.view(nb * bs, h, d).index_copy_(0, where, x.to(dtype))
    cpu_ops.write_kv(got, got_s, x, where)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(IndexError, match="outside the pool"):
        cpu_ops.write_kv(got, got_s, x[:1], torch.tensor([nb * bs]))


KV_NAMES = ["fp32", "fp16", "bf16", "fp8_e4m3"]


@pytest.mark.parametrize(("old", "new"), [(a, b) for a in KV_NAMES for b in KV_NAMES if a != b])
def test_the_c_block_conversion_stores_torchs_bits(old: str, new: str) -> None:
    """`cpu_ops.convert_blocks` (the live KV switch on a CPU) against kv_cache's torch
    read_blocks then write_blocks, byte for byte and scale for scale: blocks moved to other
    ids, values over twelve decades, an all-zero block (the 1e-12 scale floor), ties, values
    past fp16's range; a NaN ends NaN where torch's does (payloads aside). An id outside
    either pool writes nothing."""
    from kvguard.engine import kv_cache

    class Shape:
        num_kv_heads, head_dim, num_layers = 3, 64, 1

    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(5)
    vals = (
        torch.randn(12, 16, 3, 64, generator=gen) * torch.logspace(-6, 6, 12)[:, None, None, None]
    )
    vals[4] = 0.0
    vals[5, 0, :, :8] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 232.0, 7e4, -9e4])
    vals[6, 3, 1, 9] = float("nan")
    src = kv_cache.new_layer(Shape, 12, 16, old, cpu)
    every = torch.arange(12)
    for which in (0, 1):
        kv_cache.write_blocks(src, every, which, vals)
    src_ids, dst_ids = torch.tensor([6, 0, 4, 11, 5, 7]), torch.tensor([1, 30, 2, 0, 17, 9])
    want = kv_cache.new_layer(Shape, 40, 16, new, cpu)
    got = kv_cache.new_layer(Shape, 40, 16, new, cpu)
    for which in (0, 1):
        read = kv_cache.read_blocks(src, src_ids, which, torch.float32)
        kv_cache.write_blocks(want, dst_ids, which, read)
        assert cpu_ops.convert_blocks(
            src[which], src[2 + which], src_ids, got[which], got[2 + which], dst_ids
        )
    for w, g in zip(want, got, strict=True):
        if w is None:
            assert g is None
            continue
        nan = w.float().isnan()
        assert nan.any() and torch.equal(g.float().isnan(), nan)
        wb, gb = w.view(torch.uint8), g.view(torch.uint8)
        if w.dim() == 4:  # K/V: every byte of rows holding no NaN
            keep = ~nan.flatten(1).any(1)
            assert torch.equal(gb[keep], wb[keep])
        else:  # scales
            assert torch.equal(g.nan_to_num(0.0), w.nan_to_num(0.0))
    before = [t.view(torch.uint8).clone() for t in got if t is not None]
    with pytest.raises(IndexError, match="outside its pool"):
        cpu_ops.convert_blocks(
            src[0], src[2], torch.tensor([1, 2]), got[0], got[2], torch.tensor([3, 40])
        )
    after = [t.view(torch.uint8) for t in got if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # the same dtype is a byte copy (kv_cache.copy_blocks): not this kernel's
    assert not cpu_ops.convert_blocks(src[0], src[2], src_ids, src[1], src[3], src_ids)


# A fresh process with an empty kvguard cache: `convert_blocks` on pools that are not on the
# CPU (meta here, as a CUDA pool is not) answers False and leaves the cache empty.
CONVERT_OFF_CPU = """
import os, torch
from kvguard.kernels import cpu_lowbit, cpu_ops
src = torch.empty(4, 16, 2, 64, device="meta")
dst = torch.empty(8, 16, 2, 64, dtype=torch.float16, device="meta")
ids = torch.arange(2)
print(cpu_ops.convert_blocks(src, None, ids, dst, None, ids))
print(cpu_lowbit.library.cache_info().currsize, sorted(os.listdir(os.environ["KVGUARD_HOME"])))
"""


def test_a_conversion_of_pools_off_the_cpu_builds_no_kernels(tmp_path: Path) -> None:
    """A CUDA engine's live KV switch asks `convert_blocks` first, inside the engine's pause:
    pools the kernels do not serve are told so before the kernels are built (a compile of
    seconds on a cold cache, for nothing)."""
    env = {**os.environ, "KVGUARD_HOME": str(tmp_path)}
    env.pop(cpu_ops.ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", CONVERT_OFF_CPU],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["False", "0 []"], proc.stdout


def test_every_fp8_byte_reads_as_torch_dequantises_it() -> None:
    """One cached token and one query head: the output is the token's V row dequantised, so a
    row of all 256 e4m3 bytes (subnormals, both zeros, the largest values, both NaNs) checks
    the kernel's table-free conversion against torch's, exactly."""
    d = 256
    raw = torch.arange(256, dtype=torch.uint8)
    k_cache = torch.zeros(2, 16, 1, d, dtype=FP8_DTYPE)
    v_cache = torch.zeros(2, 16, 1, d, dtype=FP8_DTYPE)
    v_cache.view(torch.uint8)[1, 0, 0] = raw
    k_scale, v_scale = torch.ones(2, 1), torch.full((2, 1), 0.75)
    q = torch.randn(1, 1, d)
    out = torch.zeros_like(q)
    tables = torch.tensor([[1]], dtype=torch.int32)
    cpu_ops.paged_decode(
        q, out, torch.tensor([0]), torch.tensor([1], dtype=torch.int32),
        k_cache, v_cache, tables, 0.1, k_scale, v_scale,
    )  # fmt: skip
    want = raw.view(FP8_DTYPE).float() * 0.75
    nan = torch.isnan(want)
    assert nan.sum() == 2 and torch.isnan(out[0, 0][nan]).all()
    assert torch.equal(out[0, 0][~nan], want[~nan])


# ---------------------------------------------------------------- paged prefill attention


def test_prefill_chunks_take_the_kernel_and_the_switch_brings_torch_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompt chunks (whole prompts and later chunks) beside decode rows: the C kernel serves
    them, and `KVGUARD_CPU_OPS=0` gives them back to torch's attention, equally right."""
    seqs = [(45, 45), (30, 12), (16, 1), (100, 37), (3, 2)]
    _forbid(monkeypatch, "_prefill_one")
    out, ref = run_batch(seqs, 9, 3, 64, 16, seed=12)
    assert_close(out, ref)
    monkeypatch.undo()
    monkeypatch.setenv(cpu_ops.ENV, "0")
    cpu_ops.reset()
    _forbid(monkeypatch, "_prefill_native")
    out, ref = run_batch(seqs, 9, 3, 64, 16, seed=12)
    assert_close(out, ref)


PREFILL_SHAPES = [
    ([(128, 128), (393, 128), (300, 16)], 9, 3, 64, 16),  # the default model's shapes
    ([(300, 16)], 9, 3, 64, 16),  # one item's positions: split by KV head over threads
    ([(70, 9), (9, 9), (2, 2), (17, 8)], 4, 1, 128, 32),  # items cut short (9, 2, 8 rows)
    ([(90, 33), (40, 17)], 9, 3, 64, 16),  # one or two rows past a whole item
    ([(257, 64), (65, 65)], 8, 2, 64, 8),  # chunks that start and end mid-block
    ([(40, 33), (130, 100)], 16, 1, 8, 4),  # the widest group, the narrowest head
    ([(200, 150)], 2, 2, 256, 64),  # no grouping, the widest head, the largest block
    ([(61, 61), (45, 13)], 9, 3, 64, 13),  # blocks of an odd size: 8 tokens and a remainder
]


@pytest.mark.parametrize(("seqs", "n_heads", "n_kv", "head_dim", "block_size"), PREFILL_SHAPES)
def test_prefill_matches_the_dense_reference(
    seqs: list[tuple[int, int]], n_heads: int, n_kv: int, head_dim: int, block_size: int
) -> None:
    out, ref = run_batch(seqs, n_heads, n_kv, head_dim, block_size, seed=13)
    assert_close(out, ref)


@pytest.mark.parametrize(("seqs", "n_heads", "n_kv", "head_dim", "block_size"), PREFILL_SHAPES)
def test_the_avx512_prefill_gives_the_avx2_bits(
    seqs: list[tuple[int, int]], n_heads: int, n_kv: int, head_dim: int, block_size: int
) -> None:
    """Where the CPU has AVX-512, prefill attention runs sixteen queries a vector by default,
    each lane doing what it does in the AVX2 copy in the same order: the same bits, on every
    shape above (and an fp8 pool's). Without AVX-512 asking for it is refused."""
    have = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_lowbit.cpu_flags()
    if not switch_follows_cpu(cpu_lowbit.attention512, have, "lacks AVX-512"):
        return
    try:
        wide, _ = run_batch(seqs, n_heads, n_kv, head_dim, block_size, seed=15)
        assert cpu_lowbit.attention512(False) is True
        narrow, _ = run_batch(seqs, n_heads, n_kv, head_dim, block_size, seed=15)
    finally:
        cpu_lowbit.attention512(True)
    assert torch.equal(wide, narrow)
    gen = torch.Generator().manual_seed(16)
    lengths, qlens, starts = [40, 300], [40, 77], [0, 40]
    _q, kv, tables = _narrow_pool(FP8_DTYPE, lengths, gen)
    q = torch.randn(sum(qlens), 9, 64, generator=gen)
    outs = []
    for on in (True, False):
        cpu_lowbit.attention512(on)
        outs.append(torch.zeros_like(q))
        pa._prefill_native(q, outs[-1], kv, tables, lengths, qlens, starts, [0, 1], 0.125)
    cpu_lowbit.attention512(True)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8_DTYPE])
def test_narrow_pools_in_prefill_read_like_torchs_dequantisation(dtype: torch.dtype) -> None:
    """Each chunk by the kernel against torch's attention over the same pool, dequantised by
    gather (the per-block, per-head scales of an fp8 pool included)."""
    lengths = [40, 300, 17]
    gen = torch.Generator().manual_seed(14)
    _q, kv, tables = _narrow_pool(dtype, lengths, gen)
    qlens = [40, 77, 9]
    q = torch.randn(sum(qlens), 9, 64, generator=gen)
    starts = [0, 40, 117]
    got = torch.zeros_like(q)
    pa._prefill_native(q, got, kv, tables, lengths, qlens, starts, [0, 1, 2], 0.125)
    for i, (n, s) in enumerate(zip(qlens, starts, strict=True)):
        want = pa._prefill_one(q[s : s + n], kv, tables[i], lengths[i], 0.125)
        torch.testing.assert_close(got[s : s + n], want, atol=1e-5, rtol=1e-5)


def test_a_one_query_prompt_chunk_takes_the_prefill_kernel_with_its_prompts_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt's one-token last chunk (or cached tail), marked in `prompt_rows`, attends by
    the prefill kernel: each sequence's last query alone gives the bits it gets as the last
    row of the whole prompt's chunk (a one-token prompt, a block and one, eight blocks and
    one, and past them), and the dense reference's values. Unmarked, one query is a decode
    row."""
    seqs, heads, kv_heads, dim, block = [1, 17, 129, 300], 9, 3, 64, 16
    gen = torch.Generator().manual_seed(17)
    batch = make_pool(seqs, kv_heads, dim, block, gen)
    last, refs = [], []
    for i, n in enumerate(seqs):
        q, k, v = random_seq(n, heads, kv_heads, dim, gen)
        pa.write_kv(batch.k_cache, batch.v_cache, k, v, slots(batch.tables[i], 0, n, block))
        last.append(q)
        refs.append(dense_reference(q[-1:], k, v, 0.125).float())
    kv = (batch.k_cache, batch.v_cache, None, None)
    whole = torch.cat(last)
    full = torch.zeros_like(whole)
    starts = pa.row_starts(seqs)
    pa._prefill_native(whole, full, kv, batch.block_tables, seqs, seqs, starts, [0, 1, 2, 3], 0.125)
    ones = torch.cat([q[-1:] for q in last])
    _forbid(monkeypatch, "_decode_native")
    _forbid(monkeypatch, "_decode")
    # a fresh lengths list: the kernels' step inputs are kept per (tables, lengths) objects
    got = pa.paged_attention(
        ones, batch.k_cache, batch.v_cache, batch.block_tables, list(seqs), [1] * 4, 0.125,
        prompt_rows=[True] * 4,
    )  # fmt: skip
    for i, n in enumerate(seqs):
        assert torch.equal(got[i], full[starts[i] + n - 1]), n
    assert_close(got, torch.cat(refs))
    monkeypatch.undo()
    _forbid(monkeypatch, "_prefill_native")
    pa.paged_attention(
        ones, batch.k_cache, batch.v_cache, batch.block_tables, list(seqs), [1] * 4, 0.125,
        prompt_rows=[False] * 4,
    )  # fmt: skip


def test_a_chunk_longer_than_its_sequence_is_refused() -> None:
    k = torch.zeros(4, 16, 3, 64)
    q, out = torch.zeros(10, 9, 64), torch.zeros(10, 9, 64)
    tables = torch.zeros(1, 4, dtype=torch.int32)
    one = torch.tensor([10], dtype=torch.int32)
    with pytest.raises(ValueError, match="longer than its sequence"):
        cpu_ops.paged_prefill(
            q, out, torch.tensor([0]), one, torch.tensor([9], dtype=torch.int32), k, k, tables, 1.0
        )
    cpu_ops.paged_prefill(q, out, torch.tensor([0]), one, one, k, k, tables, 1.0)  # fits


# ---------------------------------------------------------------- row maxima (sampler, lm_head)


def _rows_with_edge_cases() -> torch.Tensor:
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(9, 1003, generator=gen)
    x[1] = (x[1] * 2).round()  # many ties, the largest among them
    x[2] = float("-inf")  # nothing but -inf: index 0
    x[3, 500:] = float("-inf")
    x[4, 1000] = 99.0  # the largest in the tail past the last eight
    x[5, 7] = x[5, 15] = 50.0  # equal largest values in two lanes: the first wins
    x[6, 15] = x[6, 7] = 50.0
    x[7, :] = 1.0  # all equal
    x[8, 3] = 1e30
    return x


def test_the_c_argmax_gives_torchs_indices() -> None:
    """Ties (the first largest), rows of -inf, a tail past the last eight values, NaN (the
    first NaN), strided rows, a row shorter than eight."""
    x = _rows_with_edge_cases()
    wide = torch.zeros(9, 1200)
    wide[:, 7 : 7 + 1003] = x
    view = wide[:, 7 : 7 + 1003]
    assert cpu_ops.argmax_rows(view) == x.argmax(-1).tolist()
    nan = x.clone()
    nan[0, 600] = nan[0, 900] = float("nan")
    nan[1, 1001] = float("nan")  # in the tail
    assert cpu_ops.argmax_rows(nan) == nan.argmax(-1).tolist()
    short = x[:, :5].contiguous()
    assert cpu_ops.argmax_rows(short) == short.argmax(-1).tolist()


def test_the_c_topk_gives_the_largest_values_lower_indices_first() -> None:
    x = _rows_with_edge_cases()
    for k in (1, 16, 200):
        got = cpu_ops.topk_indices(x, k)
        values = torch.gather(x, 1, got)
        assert torch.equal(values, x.topk(k, dim=-1).values)  # the k largest, largest first
        for row, idx in zip(x, got, strict=True):  # of equal values, the lower index
            order = sorted(range(x.shape[1]), key=lambda i, r=row: (-r[i].item(), i))[:k]
            assert idx.tolist() == order
    gen = torch.Generator().manual_seed(22)
    vocab = torch.randn(32, 49152, generator=gen)  # no ties: torch's very indices
    assert torch.equal(cpu_ops.topk_indices(vocab, 16), vocab.topk(16, dim=-1).indices)
    every = cpu_ops.topk_indices(x[:, :16], 16)  # k = N: every index, in that order
    for row, idx in zip(x[:, :16], every, strict=True):
        assert idx.tolist() == sorted(range(16), key=lambda i, r=row: (-r[i].item(), i))
    nan = x.clone()
    nan[4, 321] = float("nan")
    assert cpu_ops.topk_indices(nan, 16) is None  # torch answers rows with a NaN


def test_greedy_sampling_and_the_lm_heads_candidates_take_the_c_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    argmax, topk = cpu_ops.argmax_rows, cpu_ops.topk_indices

    def count_argmax(x: torch.Tensor) -> list[int]:
        calls.append("argmax")
        return argmax(x)

    def count_topk(x: torch.Tensor, k: int) -> torch.Tensor | None:
        calls.append("topk")
        return topk(x, k)

    monkeypatch.setattr(cpu_ops, "argmax_rows", count_argmax)
    monkeypatch.setattr(cpu_ops, "topk_indices", count_topk)
    cfg = EngineConfig(model="smollm2-135m", kv_cache_bytes="32MiB", num_threads=2)
    eng = LLMEngine.from_config(cfg, progress=False)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        fast = [o.final_token_ids for o in eng.generate([[1, 2, 3, 4], [9, 8, 7]], params)]
        assert calls.count("argmax") >= 6 and calls.count("topk") >= 6
        monkeypatch.setenv(cpu_ops.ENV, "0")
        cpu_ops.reset()
        calls.clear()
        plain = [o.final_token_ids for o in eng.generate([[1, 2, 3, 4], [9, 8, 7]], params)]
        assert calls == [] and plain == fast
    finally:
        eng.shutdown()
