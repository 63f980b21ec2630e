"""Decode attention over shared prefixes (`kernels/cpu_ops.c`, `decode_shared`): sequences
whose block tables share leading blocks (a prefix-cache hit) read those blocks once, their
queries taken together.

Each case builds pools where named segments of blocks are shared by several sequences (one
system prompt before everyone, the choices of one prompt, a group inside a group, more members
than one pass holds, a sequence whose every block is shared), fills every other block with
garbage, and holds the kernel to the float64 dense reference of each sequence's whole K/V.
The grouped path must have served (its outputs are not the per-sequence path's bits, and the
library counts the call), and batches without sharing worth grouping must keep the
per-sequence path's bits. Narrow pools are held to torch's dequantising path; an engine
serving a burst behind one system prompt must give the same tokens with the path on and off.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine
from kvguard.engine.sampling_params import SamplingParams
from kvguard.kernels import cpu_lowbit, cpu_ops
from kvguard.kernels.fp8 import FP8_DTYPE, write_kv_fp8
from tests.test_cpu_lowbit import switch_follows_cpu
from tests.test_paged_attention import assert_close, dense_reference

pa = importlib.import_module("kvguard.kernels.paged_attention")

Spec = tuple[list[str], int]  # the shared segments a sequence starts with, then its own tokens


@pytest.fixture(autouse=True)
def _shared_on():
    assert cpu_lowbit.available(), "the C kernels must build here (.ci/run installs gcc)"
    before = cpu_lowbit.shared_prefix(True)
    yield
    cpu_lowbit.shared_prefix(before)


def shared_batch(
    specs: list[Spec],
    segments: dict[str, int],
    n_heads: int,
    n_kv: int,
    d: int,
    bs: int,
    seed: int = 1,
) -> tuple[torch.Tensor, tuple, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(queries [B, heads, d], fp32 (k_cache, v_cache), tables, lens, dense reference).

    `segments` names runs of blocks (their count) that every sequence listing them shares;
    block ids are shuffled and the pool's other slots hold large garbage."""
    gen = torch.Generator().manual_seed(seed)
    own_blocks = [math.ceil(own / bs) for _, own in specs]
    total = sum(segments.values()) + sum(own_blocks) + 3
    ids = torch.randperm(total, generator=gen).tolist()
    k_cache = torch.randn(total, bs, n_kv, d, generator=gen) * 30 + 50
    v_cache = torch.randn(total, bs, n_kv, d, generator=gen) * 30 + 50
    at, seg = 0, {}
    for name, nb in segments.items():
        blocks, at = ids[at : at + nb], at + nb
        k = torch.randn(nb * bs, n_kv, d, generator=gen)
        v = torch.randn(nb * bs, n_kv, d, generator=gen)
        k_cache[blocks] = k.view(nb, bs, n_kv, d)
        v_cache[blocks] = v.view(nb, bs, n_kv, d)
        seg[name] = (blocks, k, v)
    tables, lens, qs, refs = [], [], [], []
    for (names, own), nb in zip(specs, own_blocks, strict=True):
        blocks, at = ids[at : at + nb], at + nb
        k = torch.randn(own, n_kv, d, generator=gen)
        v = torch.randn(own, n_kv, d, generator=gen)
        for t in range(own):
            k_cache[blocks[t // bs], t % bs] = k[t]
            v_cache[blocks[t // bs], t % bs] = v[t]
        ks = torch.cat([seg[n][1] for n in names] + [k])
        vs = torch.cat([seg[n][2] for n in names] + [v])
        q = torch.randn(1, n_heads, d, generator=gen)
        tables.append([b for n in names for b in seg[n][0]] + blocks)
        lens.append(ks.shape[0])
        qs.append(q)
        refs.append(dense_reference(q, ks, vs, 1 / math.sqrt(d)))
    padded = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return torch.cat(qs), (k_cache, v_cache), padded, lens_t, torch.cat(refs).float()


def decode(
    q: torch.Tensor, kv: tuple, tables: torch.Tensor, lens: torch.Tensor, shared: bool
) -> torch.Tensor:
    before = cpu_lowbit.shared_prefix(shared)
    try:
        out = torch.zeros_like(q)
        rows = torch.arange(q.shape[0])
        cpu_ops.paged_decode(
            q, out, rows, lens, *kv[:2], tables, 1 / math.sqrt(q.shape[2]), *kv[2:]
        )
        return out
    finally:
        cpu_lowbit.shared_prefix(before)


CASES = {
    # the n choices of two prompts, own tails of 0..17 tokens (one with every block shared)
    "choices": ([(["A"], 5)] * 4 + [(["B"], 17)] * 3 + [(["B"], 0)], {"A": 32, "B": 20}, 9, 3, 64, 16),
    # a one-block header (too little to group) before two prompts' choices; and a group of
    # five sharing S, three of them sharing T after it (a group inside a group)
    "nested": (
        [(["H", "P1"], 7)] * 3 + [(["H", "P2"], 9)] * 3 + [(["H"], 40)]
        + [(["S"], 3), (["S"], 30), (["S", "T"], 1), (["S", "T"], 16), (["S", "T"], 33)],
        {"H": 1, "P1": 8, "P2": 8, "S": 3, "T": 4}, 9, 3, 64, 16,
    ),
    # sixty members of one group: more query heads (180 a KV head) than one pass keeps in its
    # 256 KiB of sets (53 members of this shape), so the members go in two passes
    "wide": ([(["A"], i) for i in range(60)], {"A": 10}, 9, 3, 64, 16),
    # no GQA (one query head per KV head), eight KV heads of 128: 32 members a pass, seventy
    # members in three
    "mha": ([(["A"], i) for i in range(70)], {"A": 3}, 8, 8, 128, 8),
    # the widest GQA group and the narrowest head, a sequence on its own beside the group
    "gqa16": ([(["A"], 3), (["A"], 9), (["B"], 1)], {"A": 2, "B": 1}, 16, 1, 8, 4),
    # two sequences behind a long shared prompt: pieces cut for the threads
    "long": ([(["A"], 50)] * 2, {"A": 100}, 8, 2, 128, 32),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_shared_blocks_read_once_match_the_dense_reference(case: str) -> None:
    q, kv, tables, lens, ref = shared_batch(*CASES[case])
    calls = cpu_lowbit.shared_prefix_calls()
    got = decode(q, kv, tables, lens, shared=True)
    assert cpu_lowbit.shared_prefix_calls() == calls + 1
    assert_close(got, ref)
    per_sequence = decode(q, kv, tables, lens, shared=False)
    assert cpu_lowbit.shared_prefix_calls() == calls + 1  # off: never grouped
    assert_close(per_sequence, ref)
    # the grouped reads merge each sequence's softmax from its parts: other bits than one pass
    assert not torch.equal(got, per_sequence)


def drawn_case(seed: int) -> tuple:
    """A batch drawn from a fixed seed (the same every run): a tree of shared segments two
    levels deep (0-5 blocks each, some too short to group), members with tails of 0-40
    tokens, some sequences sharing nothing; one of four head shapes and block sizes."""
    gen = torch.Generator().manual_seed(1000 + seed)

    def draw(n: int) -> int:
        return int(torch.randint(n, (1,), generator=gen))

    shapes = [(9, 3, 64, 16), (8, 8, 32, 8), (16, 2, 64, 4), (4, 1, 128, 32)]
    heads, kv, d, bs = shapes[seed % len(shapes)]
    segments, specs = {}, []
    for top in range(1 + draw(3)):
        segments[f"T{top}"] = draw(6)
        for sub in range(draw(3)):
            segments[f"T{top}S{sub}"] = draw(6)
            specs += [([f"T{top}", f"T{top}S{sub}"], draw(41)) for _ in range(1 + draw(5))]
        specs += [([f"T{top}"], draw(41)) for _ in range(draw(4))]
    specs += [([], 1 + draw(60)) for _ in range(draw(3))]
    specs = [(names, own) for names, own in specs if own or any(segments[n] for n in names)]
    return specs, segments, heads, kv, d, bs


@pytest.mark.parametrize("seed", range(16))
def test_drawn_sharing_matches_the_dense_reference(seed: int) -> None:
    """Sixteen batches of drawn shapes (fixed seeds): grouped or not, every sequence's output
    is its dense reference's."""
    specs, segments, heads, kv, d, bs = drawn_case(seed)
    q, pools, tables, lens, ref = shared_batch(specs, segments, heads, kv, d, bs, seed)
    assert_close(decode(q, pools, tables, lens, shared=True), ref)


@pytest.mark.parametrize(
    "specs",
    [
        [([], 40), ([], 33), ([], 7)],  # nothing shared
        [(["H"], 40), (["H"], 9), (["H"], 70)],  # one shared block: under the minimum
        [(["A"], 30)],  # one sequence
        [(["A"], 30), (["A"], 9), ([], 50)],  # two members: six of a set's sixteen lanes
    ],
)
def test_without_sharing_worth_a_group_the_bits_are_the_per_sequence_paths(
    specs: list[Spec],
) -> None:
    q, kv, tables, lens, ref = shared_batch(specs, {"H": 1, "A": 6}, 9, 3, 64, 16)
    calls = cpu_lowbit.shared_prefix_calls()
    got = decode(q, kv, tables, lens, shared=True)
    assert cpu_lowbit.shared_prefix_calls() == calls
    assert torch.equal(got, decode(q, kv, tables, lens, shared=False))
    assert_close(got, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8_DTYPE])
def test_narrow_pools_read_once_like_torchs_dequantisation(dtype: torch.dtype) -> None:
    q, (k32, v32), tables, lens, _ = shared_batch(*CASES["nested"])
    if dtype == FP8_DTYPE:
        n_blocks, bs, n_kv, d = k32.shape
        kv = [torch.zeros(k32.shape, dtype=dtype), torch.zeros(v32.shape, dtype=dtype)]
        scales = [torch.zeros(n_blocks, n_kv), torch.zeros(n_blocks, n_kv)]
        where = torch.arange(n_blocks * bs)
        for pool, sc, src in ((kv[0], scales[0], k32), (kv[1], scales[1], v32)):
            write_kv_fp8(pool, sc, src.view(-1, n_kv, d) / 40, where)  # garbage within range
        pools = (kv[0], kv[1], scales[0], scales[1])
    else:
        pools = (k32.to(dtype), v32.to(dtype), None, None)
    rows = list(range(q.shape[0]))
    want = torch.zeros_like(q)
    pa._decode(q, want, pools, tables, lens.tolist(), rows, rows, 1 / 8)
    torch.testing.assert_close(
        decode(q, pools, tables, lens, shared=True), want, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("case", ["choices", "nested", "mha"])
def test_the_avx512_group_pass_gives_the_avx2_bits(case: str) -> None:
    """A group's pass takes the prefill lanes' 512-bit copy where the CPU has AVX-512 (the
    AVX2 one elsewhere, where asking for AVX-512 is refused)."""
    q, kv, tables, lens, ref = shared_batch(*CASES[case])
    have = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_lowbit.cpu_flags()
    if not switch_follows_cpu(cpu_lowbit.attention512, have, "lacks AVX-512"):
        assert_close(decode(q, kv, tables, lens, shared=True), ref)
        return
    wide = decode(q, kv, tables, lens, shared=True)
    before = cpu_lowbit.attention512(False)
    try:
        narrow = decode(q, kv, tables, lens, shared=True)
    finally:
        cpu_lowbit.attention512(before)
    assert torch.equal(wide, narrow)
    assert_close(narrow, ref)


@pytest.mark.parametrize(("env", "on"), [(None, True), ("1", True), ("0", False)])
def test_the_environment_sets_the_default_as_the_library_loads(env: str | None, on: bool) -> None:
    environ = {k: v for k, v in os.environ.items() if k != cpu_lowbit.SHARED_PREFIX_ENV}
    if env is not None:
        environ[cpu_lowbit.SHARED_PREFIX_ENV] = env
    code = "from kvguard.kernels import cpu_lowbit; print(cpu_lowbit.shared_prefix())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(on)


def test_the_switch_reads_and_sets() -> None:
    assert cpu_lowbit.shared_prefix() is True
    assert cpu_lowbit.shared_prefix(False) is True
    assert cpu_lowbit.shared_prefix() is False
    assert cpu_lowbit.shared_prefix(True) is False


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_a_burst_behind_one_system_prompt_gets_the_same_tokens_either_way(model: str) -> None:
    """Prefix cache on: eight requests share a 96-token system prompt, then two prompts' four
    choices each share a whole prompt; decoding takes the grouped reads (counted), and every
    answer is the one the per-sequence reads give."""
    system = [10 + (7 * i) % 290 for i in range(96)]
    prompts = [system + [40 + i, 41 + 2 * i, 42 + 3 * i] for i in range(8)]
    prompts += [system + list(range(100, 140))] * 4 + [system + list(range(200, 225))] * 4
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(
        model=model,
        kv_cache_bytes="64MiB",
        num_threads=2,
        max_num_seqs=16,
        enable_prefix_caching=True,
    )
    outs = {}
    for shared in (True, False):
        before = cpu_lowbit.shared_prefix(shared)
        try:
            eng = LLMEngine.from_config(cfg, progress=False)
            calls = cpu_lowbit.shared_prefix_calls()
            outs[shared] = [o.final_token_ids for o in eng.generate(prompts, params)]
            grouped = cpu_lowbit.shared_prefix_calls() - calls
        finally:
            cpu_lowbit.shared_prefix(before)
        assert (grouped > 0) == shared
    assert outs[True] == outs[False]
    assert all(len(t) == 16 for t in outs[True])
