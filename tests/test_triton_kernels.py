"""The Triton kernels must agree with the torch path they replace on CUDA.

On a CPU-only machine the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set here
before anything imports triton, because `triton.jit` decides interpreter-or-compiled when a
kernel is defined). On a GPU host with `KVGUARD_TEST_DEVICE=cuda` the same tests run compiled.
Shapes stay tiny: the interpreter executes every program instance in Python.

The reference is `kvguard.kernels.paged_attention` itself (write_kv + paged_attention on the
same cache), so these tests pin the two paths together; that path is checked against a
definition-level reference in `test_paged_attention.py`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator

DEVICE = os.environ.get("KVGUARD_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kvguard.kernels import dispatch  # noqa: E402
from kvguard.kernels.fp8 import FP8_DTYPE, as_bytes  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("KVGUARD_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

# The package re-exports `paged_attention` under the module's name: fetch the module itself.
torch_path = importlib.import_module("kvguard.kernels.paged_attention")

ta = pytest.importorskip("kvguard.kernels.triton_attention")
tkv = pytest.importorskip("kvguard.kernels.triton_kv")


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keep `torch_path` on torch: on CUDA its dispatch would otherwise route the reference
    through the very kernels under test. Run as the engine does, under inference_mode (the
    torch path's reused workspace may already have been created inside it by an earlier
    test module)."""
    monkeypatch.setenv("KVGUARD_TRITON", "0")
    with torch.inference_mode():
        yield


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": FP8_DTYPE}


def make_cache(
    nb: int, bs: int, hkv: int, d: int, kv: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """An empty cache pair (plus fp8 scales), like `kv_cache.new_layer`."""
    dt = DTYPES[kv]
    k = torch.zeros(nb, bs, hkv, d, dtype=dt, device=DEVICE)
    v = torch.zeros_like(k)
    if dt != FP8_DTYPE:
        return k, v, None, None
    return k, v, torch.zeros(nb, hkv, device=DEVICE), torch.zeros(nb, hkv, device=DEVICE)


def fill(
    lens: list[int], nb: int, bs: int, hkv: int, d: int, kv: str, seed: int
) -> tuple[tuple, torch.Tensor]:
    """A cache holding `lens` tokens per sequence in shuffled blocks, written with the torch
    path in decode-sized and prefill-sized chunks (so fp8 scales grow and requantise)."""
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(nb, bs, hkv, d, kv)
    perm = torch.randperm(nb, generator=gen)
    maxb = max((n + bs - 1) // bs for n in lens)
    tables = torch.zeros(len(lens), maxb, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nblk = (n + bs - 1) // bs
        tables[i, :nblk] = perm[used : used + nblk].to(torch.int32)
        used += nblk
    tables = tables.to(DEVICE)
    for i, n in enumerate(lens):
        pos = 0
        while pos < n:
            step = min(n - pos, 1 + int(torch.randint(0, bs + 3, (1,), generator=gen)))
            p = torch.arange(pos, pos + step)
            slots = (tables[i].cpu()[p // bs].long() * bs + p % bs).to(DEVICE)
            # Growing magnitudes force fp8 scale growth (requantisation) within blocks.
            k = torch.randn(step, hkv, d, generator=gen) * (1 + p[:, None, None] % 5)
            v = torch.randn(step, hkv, d, generator=gen)
            torch_path.write_kv(cache[0], cache[1], k.to(DEVICE), v.to(DEVICE), slots, *cache[2:])
            pos += step
    return cache, tables


CASES = [
    # (lens, block_size, heads, kv_heads, head_dim)
    ([5, 16, 33], 16, 4, 2, 16),  # GQA 2, partial / exact / spanning blocks
    ([1, 40], 8, 6, 2, 32),  # GQA 3 (padded group), a length-1 context
    ([23, 9, 17], 4, 2, 2, 8),  # MHA, tiny blocks: a tile spans many blocks
]


@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "fp8", "fp8-bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_matches_torch_path(kv: str, case: int) -> None:
    """fp8 caches with fp32 queries take the fp32 dots; with bf16 queries (a bf16 model's
    FP8 pool) the fp16 dots."""
    lens, bs, nh, hkv, d = CASES[case]
    nb = sum((n + bs - 1) // bs for n in lens) + 3
    kv, _, q_dtype = kv.partition("-")
    cache, tables = fill(lens, nb, bs, hkv, d, kv, seed=case)
    compute = DTYPES[q_dtype] if q_dtype else torch.float32 if kv == "fp8" else DTYPES[kv]
    q = torch.randn(len(lens), nh, d, generator=torch.Generator().manual_seed(7)).to(
        DEVICE, compute
    )
    scale = d**-0.5
    ref = torch_path.paged_attention(
        q, *cache[:2], tables, lens, [1] * len(lens), scale, *cache[2:]
    )
    for splits in (1, 3):
        got = ta.paged_decode(
            q,
            *cache[:2],
            tables,
            torch.tensor(lens),
            max(lens),
            scale,
            *cache[2:],
            num_splits=splits,
        )
        tol = 1e-5 if compute == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("q_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp8_widened_as_loaded_matches_torch_path(q_dtype: str, case: int) -> None:
    """FP8 tiles widened to fp16 as they are loaded (`KVGUARD_FP8_EARLY_WIDEN`, the inline-asm
    conversion on a GPU; the interpreter, which cannot run asm, widens by a cast): the
    torch path's attention, with and without splits, under the config the knob picks."""
    lens, bs, nh, hkv, d = CASES[case]
    nb = sum((n + bs - 1) // bs for n in lens) + 3
    cache, tables = fill(lens, nb, bs, hkv, d, "fp8", seed=case)
    q = torch.randn(len(lens), nh, d, generator=torch.Generator().manual_seed(3))
    q = q.to(DEVICE, DTYPES[q_dtype])
    scale = d**-0.5
    ref = torch_path.paged_attention(
        q, *cache[:2], tables, lens, [1] * len(lens), scale, *cache[2:]
    )
    for splits in (1, 3):
        got = ta.paged_decode(
            q, *cache[:2], tables, torch.tensor(lens), max(lens), scale, *cache[2:],
            num_splits=splits, config=(128, 8, 2, True),
        )  # fmt: skip
        tol = 1e-5 if q_dtype == "fp32" else 2e-2
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_fp8_early_widening_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """`decode_config` widens FP8 tiles as loaded (128-token tiles, 8 warps) only with
    `KVGUARD_FP8_EARLY_WIDEN=1` and never in the interpreter; 16-bit caches never."""
    monkeypatch.delenv(dispatch.FP8_EARLY_WIDEN_ENV, raising=False)
    monkeypatch.setattr(ta, "_INTERPRETED", False)
    assert ta.decode_config(128, True) == (128, 4, 2, False)
    monkeypatch.setenv(dispatch.FP8_EARLY_WIDEN_ENV, "1")
    assert ta.decode_config(128, True) == (128, 8, 2, True)
    assert ta.decode_config(256, True) == (64, 8, 2, True)
    assert ta.decode_config(128, False) == (64, 8, 2, False)
    monkeypatch.setattr(ta, "_INTERPRETED", True)
    assert ta.decode_config(128, True) == (128, 4, 2, False)


# (lens, query lens, block_size, heads, kv_heads, head_dim): whole prompts, chunks after a cached
# prefix, a chunk longer than a query tile, decode rows between them, MHA and GQA 3
PREFILL_CASES = [
    ([20, 37, 9], [20, 5, 1], 8, 4, 2, 16),
    ([70, 33], [70, 33], 16, 6, 2, 32),
    ([45, 12, 30], [17, 1, 30], 4, 2, 2, 8),
]


@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "fp8", "fp8-bf16"])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_matches_torch_path(kv: str, case: int) -> None:
    """The Triton prefill kernel fills exactly the chunks' rows, as the torch path does."""
    lens, qlens, bs, nh, hkv, d = PREFILL_CASES[case]
    nb = sum((n + bs - 1) // bs for n in lens) + 2
    kv, _, q_dtype = kv.partition("-")
    cache, tables = fill(lens, nb, bs, hkv, d, kv, seed=case)
    compute = DTYPES[q_dtype] if q_dtype else torch.float32 if kv == "fp8" else DTYPES[kv]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(qlens), nh, d, generator=gen).to(DEVICE, compute)
    ref = torch_path.paged_attention(q, *cache[:2], tables, lens, qlens, d**-0.5, *cache[2:])
    starts = torch_path.row_starts(qlens)
    chunks = [i for i, n in enumerate(qlens) if n > 1]
    out = torch.full_like(q, float("nan"))
    ta.prefill_rows(q, out, *cache[:2], tables, lens, qlens, starts, chunks, d**-0.5, *cache[2:])
    rows = torch.cat([torch.arange(starts[i], starts[i] + qlens[i]) for i in chunks])
    # 16-bit: both sides round scores, probabilities and outputs (fp16 dots for fp8 here)
    tol = 1e-5 if compute == torch.float32 else 3e-2
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=tol, rtol=tol)
    others = [r for r in range(len(q)) if r not in set(rows.tolist())]
    assert out[others].isnan().all()  # decode rows are not the kernel's


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_prefill_kernel_takes_a_one_query_prompt_chunk(kv: str) -> None:
    """A prompt's one-token cached tail or last chunk is a prefill chunk of one query
    (`AttentionMetadata.prompt_rows`): the kernel fills it as the torch path does."""
    lens, qlens, bs, nh, hkv, d = [20, 37, 9], [20, 1, 1], 8, 4, 2, 16
    nb = sum((n + bs - 1) // bs for n in lens) + 2
    cache, tables = fill(lens, nb, bs, hkv, d, kv, seed=3)
    q = torch.randn(sum(qlens), nh, d, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    prompt = [True, True, False]  # the last entry a decode row
    ref = torch_path.paged_attention(
        q, *cache[:2], tables, lens, qlens, d**-0.5, *cache[2:], prompt
    )
    starts = torch_path.row_starts(qlens)
    decode, chunks = torch_path.split_rows(qlens, prompt)
    assert (decode, chunks) == ([2], [0, 1])
    out = torch.full_like(q, float("nan"))
    ta.prefill_rows(q, out, *cache[:2], tables, lens, qlens, starts, chunks, d**-0.5, *cache[2:])
    torch.testing.assert_close(out[:21], ref[:21], atol=1e-5, rtol=1e-5)
    assert out[21:].isnan().all()


def test_prefill_dispatch_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("KVGUARD_TRITON", "1")  # the fixture's reference setting, undone here
    monkeypatch.delenv(dispatch.TRITON_PREFILL_ENV, raising=False)
    assert not dispatch.use_triton_prefill("cuda")
    monkeypatch.setenv(dispatch.TRITON_PREFILL_ENV, "1")
    assert dispatch.use_triton_prefill("cuda") and not dispatch.use_triton_prefill("cpu")


def test_padding_rows_of_no_tokens_come_out_zero() -> None:
    """A CUDA-graph replay pads the batch with rows of no tokens: with the context cut into
    several pieces (a graph's pieces follow its longest possible context) their outputs are
    0, never the 0/0 of an empty softmax, and the live rows are what they are alone."""
    lens, bs, nh, hkv, d = [21, 7], 8, 4, 2, 16
    nb = 8
    cache, tables = fill(lens, nb, bs, hkv, d, "fp32", seed=11)
    pad = torch.zeros(2, tables.shape[1], dtype=tables.dtype, device=DEVICE)
    q = torch.randn(4, nh, d, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    # 512: a context bound long enough for four pieces of the tile (the graph's bound)
    alone = ta.paged_decode(
        q[:2], *cache[:2], tables, torch.tensor(lens), 512, d**-0.5, num_splits=4
    )
    got = ta.paged_decode(
        q, *cache[:2], torch.cat([tables, pad]), torch.tensor(lens + [0, 0]), 512, d**-0.5,
        num_splits=4,
    )  # fmt: skip
    assert torch.equal(got[2:], torch.zeros_like(got[2:]))
    torch.testing.assert_close(got[:2], alone, atol=0, rtol=0)


def test_decode_rows_in_mixed_batch() -> None:
    """Decode rows among prefill rows: `decode_rows` fills exactly the decode positions."""
    lens, bs, nh, hkv, d = [9, 20, 6], 4, 4, 2, 16
    nb = 12
    cache, tables = fill(lens, nb, bs, hkv, d, "fp32", seed=3)
    qlens = [1, 4, 1]  # row 1 is a prefill chunk
    q = torch.randn(sum(qlens), nh, d, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = torch_path.paged_attention(q, *cache[:2], tables, lens, qlens, d**-0.5)
    out = torch.full_like(q, float("nan"))
    ta.decode_rows(q, out, *cache[:2], tables, lens, [0, 1, 5], [0, 2], d**-0.5)
    torch.testing.assert_close(out[[0, 5]], ref[[0, 5]], atol=1e-5, rtol=1e-5)
    assert out[1:5].isnan().all()


@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "fp8"])
def test_write_matches_torch_path(kv: str) -> None:
    """Chunked writes (fresh blocks, partial blocks, fp8 scale growth with requantisation):
    from the same cache state, both paths leave the same bytes and the same fp8 scales.

    Each chunk starts both paths from the torch path's state, so one rounding difference
    cannot cascade through later requantisations and hide or fake a later mismatch.
    """
    nb, bs, hkv, d = 6, 4, 3, 8
    gen = torch.Generator().manual_seed(0)
    a = make_cache(nb, bs, hkv, d, kv)
    order = torch.randperm(nb, generator=gen)
    slots_all = (order[:, None] * bs + torch.arange(bs)).reshape(-1)[:19]
    for lo, hi in ((0, 3), (3, 4), (4, 11), (11, 12), (12, 19)):
        b = tuple(None if t is None else t.clone() for t in a)
        slots = slots_all[lo:hi].to(DEVICE)
        mag = torch.arange(lo, hi).float()[:, None, None] + 1
        k = (torch.randn(hi - lo, hkv, d, generator=gen) * mag).to(DEVICE)
        v = torch.randn(hi - lo, hkv, d, generator=gen).to(DEVICE)
        torch_path.write_kv(a[0], a[1], k, v, slots, *a[2:])
        tkv.write_kv(b[0], b[1], k, v, slots, *b[2:])
        for x, y in zip(a, b, strict=True):
            if x is None:
                continue
            if x.dtype == FP8_DTYPE:
                assert_fp8_equal(x, y)
            elif x.dtype == torch.bfloat16 and DEVICE == "cpu":
                # The interpreter rounds fp32 -> bf16 by truncation (CUDA rounds to nearest
                # even): allow one bf16 ulp here; compiled on CUDA the bytes must match.
                torch.testing.assert_close(x, y, atol=0, rtol=2**-7)
            else:
                torch.testing.assert_close(x, y, atol=0, rtol=0)


def assert_fp8_equal(ref: torch.Tensor, got: torch.Tensor) -> None:
    """Byte-equal fp8 caches; under the interpreter, except for its fp32 -> e4m3 rounding bug.

    The interpreter's software cast drops the carry when rounding up crosses a power of two
    (e.g. -31.14 becomes -16 instead of -32); compiled CUDA rounds correctly. So on CPU a
    mismatch is tolerated only in exactly that shape: ref is a power of two, got is half of it.
    """
    diff = as_bytes(ref) != as_bytes(got)
    if DEVICE == "cpu":
        r, g = ref.float()[diff], got.float()[diff]
        assert torch.equal(g * 2, r), (r, g)
        assert torch.equal(torch.frexp(r.abs()).mantissa, torch.full_like(r, 0.5))
    else:
        assert not diff.any()


def test_fp8_writes_alone_in_their_blocks_match_the_torch_path() -> None:
    """Decode-like steps (one token per block; fresh blocks, growing magnitudes that requantise
    a block's earlier rows, a padding row): the one-kernel FP8 write leaves the torch path's
    bytes and scales after every step."""
    nb, bs, hkv, d = 5, 4, 3, 8
    gen = torch.Generator().manual_seed(4)
    a = make_cache(nb, bs, hkv, d, "fp8")
    blocks = torch.tensor([3, 0, 4])  # three sequences' last blocks
    for step in range(2 * bs + 1):  # across a block boundary: the next blocks start afresh
        off = step % bs
        if off == 0 and step:
            blocks = blocks.flip(0)  # new blocks (reused ids: fresh scales must reset)
        slots = (blocks * bs + off).to(DEVICE)
        mag = torch.tensor([1.0, 3.0**step, 0.5])[:, None, None]  # one grows every step
        k = (torch.randn(3, hkv, d, generator=gen) * mag).to(DEVICE)
        v = torch.randn(3, hkv, d, generator=gen).to(DEVICE)
        b = tuple(t.clone() for t in a)
        torch_path.write_kv(a[0], a[1], k, v, slots, *a[2:])
        pad = torch.cat([slots, torch.tensor([-1], device=DEVICE)])  # a graph's padding row
        kp, vp = torch.cat([k, k[:1] * 100]), torch.cat([v, v[:1] * 100])
        tkv.write_kv(b[0], b[1], kp, vp, pad, *b[2:], own_blocks=True)
        assert_fp8_equal(a[0], b[0])
        assert_fp8_equal(a[1], b[1])
        torch.testing.assert_close(a[2], b[2], atol=0, rtol=0)
        torch.testing.assert_close(a[3], b[3], atol=0, rtol=0)
        a = b


def test_an_infinite_value_gives_its_block_the_torch_paths_infinite_scale() -> None:
    """A poisoned K (an infinity) grows its block's scale to infinity on both paths (the
    kernel's divisor once came from the block's maximum: inf * 0 made it NaN, a scale that
    differs from torch's and hides the poison on CUDA)."""
    a = make_cache(2, 4, 1, 8, "fp8")
    b = tuple(t.clone() for t in a)
    k = torch.ones(1, 1, 8, device=DEVICE)
    k[0, 0, 3] = float("inf")
    v = torch.ones(1, 1, 8, device=DEVICE)
    slots = torch.tensor([4], device=DEVICE)
    torch_path.write_kv(a[0], a[1], k, v, slots, *a[2:])
    tkv.write_kv(b[0], b[1], k, v, slots, *b[2:], own_blocks=True)
    assert a[2][1, 0].isinf() and b[2][1, 0].isinf()
    torch.testing.assert_close(a[3], b[3], atol=0, rtol=0)


def test_write_skips_negative_slots() -> None:
    cache = torch.zeros(2, 4, 1, 8, device=DEVICE)
    x = torch.ones(2, 1, 8, device=DEVICE)
    tkv.store_kv(cache, x, torch.tensor([5, -1], device=DEVICE))
    assert cache.view(8, 8)[5].eq(1).all() and cache.sum() == 8


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton only ever on CUDA, and KVGUARD_TRITON=0 switches it off there too."""
    assert not dispatch.use_triton(torch.device("cpu"))
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("KVGUARD_TRITON", "0")
    assert not dispatch.use_triton("cuda")
    monkeypatch.setenv("KVGUARD_TRITON", "1")
    assert dispatch.use_triton("cuda:0")
    assert not dispatch.use_triton("cpu")
    # FP8 needs Triton's e4m3 (compute capability 8.9+); bf16 caches do not care.
    monkeypatch.setattr(dispatch, "_fp8_capable", lambda index: False)
    assert not dispatch.use_triton("cuda", FP8_DTYPE)
    assert dispatch.use_triton("cuda", torch.bfloat16)
