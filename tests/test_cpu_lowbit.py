"""The C W4A8 / W8A8 kernels (`kvguard.kernels.cpu_lowbit`): against a torch reference that
quantises the activations the same way (tight), against the fp32 dequantised matmul (loose),
and the fallback to torch's kernels where no compiler is found."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.layers.quantized_linear import QuantizedLinear, pick_kernel
from kvguard.kernels import cpu_lowbit

BATCHES = (1, 3, 17, 33)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)  # every test draws the same activations on every run


def correctly_rounded(num: torch.Tensor | float, den: torch.Tensor | float) -> torch.Tensor:
    """`num / den` rounded once to fp32, as the C division is (torch may multiply by a
    reciprocal, one ulp off, which flips a code sitting on a rounding boundary)."""
    num = num.double() if isinstance(num, torch.Tensor) else num
    den = den.double() if isinstance(den, torch.Tensor) else den
    return (num / den).float()


def gguf_like(fmt: str, out: int, cols: int, seed: int = 0) -> QuantSpec:
    """Q4_0 (zero point 8), Q4_1 (a float min), Q8_0 (zero point 128) in groups of 32, or
    `asym<group>`: 4-bit with float zero points in groups of `group` (AWQ/GPTQ-like)."""
    g = torch.Generator().manual_seed(seed)
    bits = 8 if fmt == "q8_0" else 4
    group = int(fmt.removeprefix("asym")) if fmt.startswith("asym") else 32
    q = torch.randint(0, 2**bits, (out, cols), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out, cols // group, generator=g) * 0.02 + 1e-3).half().float()
    if fmt == "q4_0":
        zeros = torch.full_like(scales, 8.0)
    elif fmt == "q8_0":
        zeros = torch.full_like(scales, 128.0)
    else:
        zeros = torch.rand(out, cols // group, generator=g) * (2**bits - 1)
    return QuantSpec(q, scales, zeros, group, bits)


def quantise_like_the_kernel(x: torch.Tensor, fine: bool = False) -> torch.Tensor:
    """int8 (`fine`: int16) per block of 32, scale amax/127 (amax/32639), round half to even:
    the dequantised activations."""
    levels = float(cpu_lowbit.FINE_LEVELS) if fine else 127.0
    blocks = x.reshape(x.shape[0], -1, cpu_lowbit.BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, correctly_rounded(levels, amax), torch.zeros_like(amax))
    return (torch.round(blocks * inv) * correctly_rounded(amax, levels)).reshape(x.shape)


def weight_as_stored(spec: QuantSpec) -> torch.Tensor:
    """`d q + m` with the fp16 scale and min the kernels hold (8-bit codes signed)."""
    g = spec.group_size
    d = spec.scales.half().float()
    if spec.bits == 4:
        q, m = spec.q.float(), (-spec.zeros * spec.scales).half().float()
    else:
        q, m = spec.q.float() - 128, ((128 - spec.zeros) * spec.scales).half().float()
    return q * d.repeat_interleave(g, 1) + m.repeat_interleave(g, 1)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "asym64", "asym128"])
@pytest.mark.parametrize("out", [40, 75])
@pytest.mark.parametrize("fine", [True, False])
def test_kernel_matches_references(fmt: str, out: int, fine: bool) -> None:
    """int16 activations (projections; fp32 panels from `panel_rows()` rows: 17 and 33) or
    int8 (an `approximate`, refined lm_head)."""
    spec = gguf_like(fmt, out, 256)
    layer = QuantizedLinear(spec, approximate=not fine)
    kernel = "w4a8" if fmt != "q8_0" else "w8a8" if fine else "w8a8v"
    assert layer.kernel == kernel and layer.fine == fine
    stored, full = weight_as_stored(spec), spec.dequantize()
    for rows in BATCHES:
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        got = layer(x)
        assert got.shape == (rows, out) and got.dtype == torch.float32
        panels = fine and rows >= cpu_lowbit.panel_rows(bits=layer.bits)
        assert rel(got, (x if panels else quantise_like_the_kernel(x, fine)) @ stored.T) <= 1e-5
        # int8: ~2 significant digits; int16: the fp32 matmul's up to fp16 scales and mins
        assert rel(got, x @ full.T) <= (2e-3 if fine else 2e-2)


@pytest.mark.parametrize("fine", [False, True])
def test_activation_quantisation_is_the_reference_one(fine: bool) -> None:
    x = torch.randn(7, 192) * torch.linspace(0.01, 100, 192)
    x[2, :32] = 0.0  # an all-zero block: scale 0, codes 0
    levels = cpu_lowbit.FINE_LEVELS if fine else 127
    amax = x.reshape(7, -1, 32).abs().amax(-1)
    q, e, es = cpu_lowbit.quantize_rows(x, fine)
    assert q.dtype == (torch.int16 if fine else torch.int8)
    assert torch.equal(e, correctly_rounded(amax, levels))
    assert q.abs().max().item() == levels and not q[2, :32].any()
    deq = (q.float().reshape(7, -1, 32) * e.unsqueeze(-1)).reshape(7, 192)
    assert torch.equal(deq, quantise_like_the_kernel(x, fine))
    assert torch.allclose(es, e * q.float().reshape(7, -1, 32).sum(-1))


@pytest.mark.parametrize("fine", [False, True])
def test_the_avx512_quantiser_gives_the_avx2_bits(fine: bool) -> None:
    """Where the VNNI dots serve, activations are quantised four blocks at a time in 512-bit
    registers: the same codes, scales and sums as the AVX2 copy for rows of one to eight
    blocks (every remainder of four), zero blocks (scale 0), a block whose largest value sits
    in its last lane, values from 1e-30 to 1e30 and exact halves between levels (ties to even)."""
    if not cpu_lowbit.vnni():
        with pytest.raises(ValueError, match="AVX-512 VNNI"):
            cpu_lowbit.vnni(True)
        return
    levels = cpu_lowbit.FINE_LEVELS if fine else 127
    try:
        for blocks in range(1, 9):
            k = 32 * blocks
            g = torch.Generator().manual_seed(blocks)
            x = torch.randn(6, k, generator=g) * torch.logspace(-30, 30, k).roll(blocks)
            x[1] = 0.0
            x[2, 32 * (blocks - 1) :] = 0.0  # the last block zero
            x[3, 31] = -1e30  # a block's largest in its last lane
            x[4] = (torch.arange(k) % 5 - 2.5) / levels * 2  # halves between levels
            x[4, ::32] = 2.0  # amax 2: scale 2/levels, codes at the halves
            x[5] = torch.randn(k, generator=g) * 3
            cpu_lowbit.vnni(True)
            wide = cpu_lowbit.quantize_rows(x, fine)
            assert cpu_lowbit.vnni(False) is True
            plain = cpu_lowbit.quantize_rows(x, fine)
            for a, b in zip(wide, plain, strict=True):
                assert torch.equal(a, b), (blocks, fine)
            assert not wide[0][1].any() and not wide[1][1].any()
    finally:
        cpu_lowbit.vnni(True)


def test_int16_codes_split_into_two_signed_bytes_at_every_edge() -> None:
    """`fine` codes reach +-FINE_LEVELS and every low byte from -128 to 127 (the 4-bit kernels
    hold a code as 256 h + l, both signed bytes): the codes are the ones asked for, and the
    4-bit GEMM is the exact dot of those codes on every dot path (rows one, two and six: the
    VNNI tile's two forms; the AVX2 copy's tiles where there is no VNNI or it is switched off)."""
    top = cpu_lowbit.FINE_LEVELS
    wanted = [
        256 * h + lo for h in (-127, -64, -1, 0, 1, 64, 127) for lo in (-128, -127, -1, 0, 1, 127)
    ]
    wanted = [c for c in wanted if abs(c) <= top]
    codes = torch.zeros(6, 256, dtype=torch.int64)
    for r in range(6):  # each row from another place in the list, so each block holds others
        codes[r] = torch.tensor((wanted * 8)[7 * r : 7 * r + 256])
        codes[r, ::32] = top if r % 2 else -top  # each block's largest: amax 1, scale 1/top
    x = codes.float() / top
    q, e, _ = cpu_lowbit.quantize_rows(x, fine=True)
    assert torch.equal(q.long(), codes) and torch.equal(e, torch.full_like(e, 1 / top))
    spec = gguf_like("q4_1", 24, 256, seed=9)
    layer = QuantizedLinear(spec)
    assert layer.kernel == "w4a8" and layer.fine
    want = x.double() @ weight_as_stored(spec).double().T
    paths = [True, False] if cpu_lowbit.vnni() else [False]
    try:
        for on in paths:
            cpu_lowbit.vnni(on)
            for rows in (1, 2, 6):
                assert rows < cpu_lowbit.panel_rows(bits=4)  # integer dots, not fp32 panels
                got = layer(x[:rows])
                assert rel(got.double(), want[:rows]) <= 1e-6, (on, rows)
    finally:
        if paths[0]:
            cpu_lowbit.vnni(True)


def test_threads_and_strides_do_not_change_the_result() -> None:
    """Threads split output columns, each column computed alike: equal bit for bit; a row
    stride wider than the row (a slice of a fused activation) is read in place."""
    spec = gguf_like("q4_1", 200, 512)
    layer = QuantizedLinear(spec)
    wide = torch.randn(33, 700)
    x = wide[:, 100:612]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x.contiguous())
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_4bit_layout_holds_each_code_where_the_kernels_read_it() -> None:
    """Tile t, block b: byte 32j + 4c + i holds weight 32b + 8j + i of column 8t + c (low
    nibble) and weight 32b + 8j + 4 + i (high nibble); padding columns are zero."""
    q = torch.randint(0, 16, (11, 128), dtype=torch.uint8)
    packed = cpu_lowbit.pack4(q)
    assert packed.shape == (2, 4, 128) and packed.dtype == torch.uint8
    for n in range(16):
        for k in range(128):
            b, j, i, high = k // 32, k % 32 // 8, k % 4, k % 8 >= 4
            byte = packed[n // 8, b, 32 * j + 4 * (n % 8) + i].item()
            code = byte >> 4 if high else byte & 15
            assert code == (q[n, k].item() if n < 11 else 0), (n, k)
    assert torch.equal(cpu_lowbit.unpack4(packed)[:11], q)
    rows = torch.tensor([10, 3, 0, 3])
    assert torch.equal(cpu_lowbit.unpack4(packed, rows), q[rows])
    # the C packer (a load's) and the tensor one write the same bytes, a tile's worth of
    # columns or not, a strided view too
    assert torch.equal(packed, cpu_lowbit.pack4_reference(q))
    for n, k in ((8, 32), (1, 64), (27, 96), (300, 1536)):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        assert torch.equal(cpu_lowbit.pack4(codes), cpu_lowbit.pack4_reference(codes)), (n, k)
    wide = torch.randint(0, 16, (20, 256), dtype=torch.uint8)
    view = wide[:, 64:192]
    assert torch.equal(cpu_lowbit.pack4(view), cpu_lowbit.pack4_reference(view))


def test_the_vertical_8bit_layout_holds_each_code_where_the_kernels_read_it() -> None:
    """Tile t, block b: byte 32j + 4c + i holds weight 32b + 4j + i of column 8t + c, the
    unsigned code; padding columns are zero."""
    q = torch.randint(0, 256, (11, 128), dtype=torch.uint8)
    packed = cpu_lowbit.pack8v(q)
    assert packed.shape == (2, 4, 256) and packed.dtype == torch.uint8
    for n in range(16):
        for k in range(128):
            b, j, i = k // 32, k % 32 // 4, k % 4
            byte = packed[n // 8, b, 32 * j + 4 * (n % 8) + i].item()
            assert byte == (q[n, k].item() if n < 11 else 0), (n, k)
    assert torch.equal(cpu_lowbit.unpack8v(packed)[:11], q)
    rows = torch.tensor([10, 3, 0, 3])
    assert torch.equal(cpu_lowbit.unpack8v(packed, rows), q[rows])
    one = q[:5, :64]  # a single tile: its words could be viewed in place, not copied
    assert torch.equal(cpu_lowbit.unpack8v(cpu_lowbit.pack8v(one))[:5], one)


def test_the_vertical_8bit_head_gives_the_row_major_kernels_bits() -> None:
    """`w8a8v` sums each column's products in its own lane where `w8a8` sums them across a
    register, then scales block by block alike: the same bits for int8 activations, on each
    copy of the dots this CPU has (VNNI: one row on the eight-column tile, more sixteen
    columns a tile pair, a lone last tile), with and without mins, groups of one and two
    blocks, one and two threads."""
    have = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_lowbit.cpu_flags()
    threads_before = torch.get_num_threads()
    try:
        for vnni in [False, True] if have else [False]:
            cpu_lowbit.vnni(vnni)
            for mins, threads in ((False, 2), (True, 1)):
                spec = gguf_like("q8_0", 75 if threads == 2 else 200, 576, seed=6)
                if mins:  # float zero points in groups of 64
                    half = spec.scales[:, ::2].contiguous(), spec.zeros[:, ::2] - 3.5
                    spec = QuantSpec(spec.q, half[0], half[1], 64, 8)
                torch.set_num_threads(threads)
                row_major = QuantizedLinear(spec, approximate=True, kernel="w8a8")
                vertical = QuantizedLinear(spec, approximate=True)
                assert vertical.kernel == "w8a8v" and not vertical.fine and not row_major.fine
                assert (vertical.lowbit_mins is not None) == mins
                for rows in (1, 2, 3, 4, 5, 9, 40):
                    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3
                    assert torch.equal(vertical(x), row_major(x)), (vnni, mins, rows)
    finally:
        cpu_lowbit.vnni(have)
        torch.set_num_threads(threads_before)


@pytest.mark.parametrize(("fmt", "approximate"), [("q4_1", False), ("q8_0", False), ("q8_0", True)])
def test_a_layers_rows_are_its_stored_weight_rows(fmt: str, approximate: bool) -> None:
    """What a tied embedding reads from the lm_head's codes (row-major or vertical 8-bit,
    4-bit): the rows, dequantised."""
    spec = gguf_like(fmt, 75, 256, seed=2)
    layer = QuantizedLinear(spec, approximate=approximate)
    assert layer.can_read_rows()
    ids = torch.tensor([[74, 0], [9, 40]])
    assert torch.equal(layer.rows(ids), weight_as_stored(spec)[ids])


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "asym64"])
@pytest.mark.parametrize("out", [1001, 40])
def test_a_batch_from_panel_rows_multiplies_unquantised_activations(fmt: str, out: int) -> None:
    """From `panel_rows()` rows an int16 projection multiplies the activations as they are,
    in fp32, by its weight dequantised sixteen columns at a time (40 columns: a panel half
    padding), past the kernel's stretches of k (576 > 256) and chunks of rows (200 > 192);
    one row fewer stays on the integer dots, and the refined head on int8 at any batch."""
    spec = gguf_like(fmt, out, 576, seed=3)
    stored = weight_as_stored(spec)
    layer, head = QuantizedLinear(spec), QuantizedLinear(spec, approximate=True)
    default = cpu_lowbit.panel_rows(bits=layer.bits)
    # 4-bit weights on the VNNI dots take panels only when asked: ask from 24 rows
    first = default if default <= 100 else 24
    cpu_lowbit.panel_rows(first, bits=layer.bits)
    try:
        for rows in (first - 1, first, first + 5, 200):
            x = torch.randn(rows, 576)
            want = x if rows >= first else quantise_like_the_kernel(x, fine=True)
            assert rel(layer(x), want @ stored.T) <= 1e-5, rows
            assert rel(head(x), quantise_like_the_kernel(x) @ stored.T) <= 1e-5, rows
    finally:
        cpu_lowbit.panel_rows(default, bits=layer.bits)


def test_panel_rows_moves_the_switch() -> None:
    """The threshold is the kernels' own (one value for the per-op layers and the decode
    layer's C calls); setting it returns the old value, and 1 puts even one row on panels."""
    spec = gguf_like("q4_1", 75, 256, seed=4)
    layer, stored = QuantizedLinear(spec), weight_as_stored(spec)
    x = torch.randn(2, 256)
    before = cpu_lowbit.panel_rows(1)
    try:
        assert cpu_lowbit.panel_rows() == 1
        assert rel(layer(x), x @ stored.T) <= 1e-5
        cpu_lowbit.panel_rows(1 << 40)  # clamped to the C int
        assert cpu_lowbit.panel_rows() == 2**31 - 1
        assert rel(layer(x), quantise_like_the_kernel(x, fine=True) @ stored.T) <= 1e-5
    finally:
        cpu_lowbit.panel_rows(before)
    assert cpu_lowbit.panel_rows() == before == (2**31 - 1 if cpu_lowbit.vnni() else 16)
    assert cpu_lowbit.panel_rows(bits=8) == 16


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "asym64"])
def test_the_vnni_dots_give_the_avx2_dots_bits(fmt: str) -> None:
    """Where the CPU has AVX-512 VNNI the integer dots run their VNNI copy by default (4-bit
    weights then never switch to panels), and it gives the AVX2 copy's bits: int16 and int8
    activations, one to a few hundred rows (tiles of four rows, six on the VNNI sixteen-column
    tiles, and their remainders, stretches of rows), 4-bit columns sixteen at a time (ten
    tiles: in pairs with one thread, five a thread with two, so each thread's last tile is
    alone), a partial last tile of columns, threads one and two. Without VNNI the AVX2 dots
    serve and asking for VNNI is refused.
    (The C side asks cpuid; this asks Linux.)"""
    have = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_lowbit.cpu_flags()
    assert cpu_lowbit.vnni() == have
    assert cpu_lowbit.panel_rows(bits=4) == (2**31 - 1 if have else 16)
    assert cpu_lowbit.panel_rows(bits=8) == 16
    if not have:
        with pytest.raises(ValueError, match="AVX-512 VNNI"):
            cpu_lowbit.vnni(True)
        assert cpu_lowbit.vnni() is False
        return
    spec = gguf_like(fmt, 75, 576, seed=5)
    layers = [QuantizedLinear(spec), QuantizedLinear(spec, approximate=True)]
    before = {b: cpu_lowbit.panel_rows(1 << 30, bits=b) for b in (4, 8)}  # dots at any batch
    threads_before = torch.get_num_threads()
    # long chunks would leave the integers for bf16 tiles on an AMX CPU (the integer tiles
    # keep the dots' bits: see the next tests)
    bf16 = cpu_lowbit.amx_bf16(False) if cpu_lowbit.amx() else False
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4, 5, 7, 8, 13, 100, 333):
                x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3
                for layer in layers:
                    cpu_lowbit.vnni(True)
                    fast = layer(x)
                    assert cpu_lowbit.vnni(False) is True
                    plain = layer(x)
                    assert torch.equal(fast, plain), (fmt, layer.fine, rows, threads)
    finally:
        cpu_lowbit.vnni(True)
        if bf16:
            cpu_lowbit.amx_bf16(True)
        for b, rows in before.items():
            cpu_lowbit.panel_rows(rows, bits=b)
        torch.set_num_threads(threads_before)
    assert cpu_lowbit.vnni() is True and cpu_lowbit.panel_rows() == 2**31 - 1


def test_without_a_compiler_the_torch_kernels_serve(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))  # no library built there yet
    monkeypatch.setenv("CC", "/nonexistent/cc")
    cpu_lowbit.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvguard.kernels"):
            assert not cpu_lowbit.available()
        assert "no C compiler ($CC=/nonexistent/cc)" in caplog.text
        assert "use torch's kernels" in caplog.text
        for fmt, kernel in (("q4_1", "int4pack"), ("q8_0", "int4x2")):
            spec = gguf_like(fmt, 64, 256)
            layer = QuantizedLinear(spec)
            assert layer.kernel == kernel == pick_kernel(spec, torch.device("cpu"))
            x = torch.randn(5, 256)
            assert rel(layer(x), x @ spec.dequantize().T) <= 1e-2
        assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())
    finally:
        cpu_lowbit.library.cache_clear()


BUILD = """
import sys
from collections.abc import Callable
from kvguard.kernels import cpu_lowbit
sys.exit(0 if cpu_lowbit.available() else 1)
"""


def test_two_processes_compiling_at_once_both_load_one_library(tmp_path: Path) -> None:
    """Each compiles to a temporary name and renames: both end with a whole library, and the
    cache holds that one file."""
    env = {**os.environ, "KVGUARD_HOME": str(tmp_path)}
    env.pop("CC", None)
    procs = [subprocess.Popen([sys.executable, "-c", BUILD], env=env) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("kvguard-cpu-") and built[0].suffix == ".so"


def switch_follows_cpu(switch: Callable[..., bool], have: bool, refusal: str) -> bool:
    """A CPU-path switch is on by default exactly where the CPU has the path, and asking for
    it elsewhere is refused (`refusal` in the message) without turning it on. Returns `have`."""
    assert switch() == have
    if not have:
        with pytest.raises(ValueError, match=refusal):
            switch(True)
        assert switch() is False
    return have


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "asym64"])
def test_the_amx_tiles_give_the_vnni_dots_bits(fmt: str) -> None:
    """Where the CPU has AMX-INT8 (and Linux grants the tile state) 4-bit GEMMs with int16
    activations take sixteen rows at a time through the tile unit by default, with the VNNI
    dots' bits: rows in whole sixteens and a remainder, past a 128-row stretch, ten column tiles
    (pairs, each thread's lone last one with two threads), a pair holding padding columns,
    threads one and two. Fewer than 16 rows and int8 activations stay on the dots. Without
    AMX asking for it is refused. (The C side asks cpuid and Linux; this reads the flags.)"""
    have = {"amx_tile", "amx_int8", "avx512_vnni"} <= cpu_lowbit.cpu_flags()
    if not switch_follows_cpu(cpu_lowbit.amx, have, "no AMX"):
        return
    threads_before = torch.get_num_threads()
    bf16_before = cpu_lowbit.amx_bf16(False)  # long prompt chunks: bf16 tiles, other bits
    try:
        for out in (75, 128, 200):
            spec = gguf_like(fmt, out, 576, seed=5)
            layers = [QuantizedLinear(spec), QuantizedLinear(spec, approximate=True)]
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for rows in (1, 15, 16, 17, 31, 32, 100, 160, 333):
                    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3
                    for layer in layers:
                        cpu_lowbit.amx(True)
                        tiles = layer(x)
                        assert cpu_lowbit.amx(False) is True
                        dots = layer(x)
                        assert torch.equal(tiles, dots), (fmt, out, layer.fine, rows, threads)
    finally:
        cpu_lowbit.amx(True)
        cpu_lowbit.amx_bf16(bf16_before)
        torch.set_num_threads(threads_before)
    assert cpu_lowbit.amx() is True


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "asym64"])
def test_bf16_tiles_hold_long_chunks_to_the_unquantised_product(fmt: str) -> None:
    """Where the CPU has AMX-BF16 a 4-bit GEMM of 128 rows or more sums two bf16 parts of each
    weight and activation on the tile unit: as close to the unquantised activations times the
    stored weight (in fp64) as the int16 dots, or closer, for whole and partial row groups
    (rows padded to 32), a past-the-stretch row count at K 1536, a pair of column tiles holding
    padding columns and an odd tile count, threads one and two; below 128 rows the integer
    paths serve, the same bits as with it off. Without it asking for it is refused."""
    have = {"amx_tile", "amx_bf16"} <= cpu_lowbit.cpu_flags() and cpu_lowbit.amx()
    if not switch_follows_cpu(cpu_lowbit.amx_bf16, have, "no AMX-BF16"):
        return
    threads_before = torch.get_num_threads()
    try:
        for out, cols in ((75, 576), (128, 576), (200, 1536)):
            spec = gguf_like(fmt, out, cols, seed=7)
            layer = QuantizedLinear(spec)
            stored = weight_as_stored(spec).double()
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for rows in (127, 128, 129, 160, 333):
                    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3
                    want = x.double() @ stored.T
                    cpu_lowbit.amx_bf16(True)
                    tiles = layer(x)
                    assert cpu_lowbit.amx_bf16(False) is True
                    dots = layer(x)
                    if rows < 128:
                        assert torch.equal(tiles, dots), (fmt, out, rows, threads)
                        continue
                    err = (tiles.double() - want).abs().max() / want.abs().max()
                    dots_err = (dots.double() - want).abs().max() / want.abs().max()
                    assert err <= max(3e-5, dots_err), (fmt, out, rows, threads, err, dots_err)
    finally:
        cpu_lowbit.amx_bf16(True)
        torch.set_num_threads(threads_before)
    assert cpu_lowbit.amx_bf16() is True


def test_a_rows_kernel_follows_its_kind_on_every_cpu_path() -> None:
    """The C GEMMs' rule (`pick_kernel`), asked for every CPU path: prompt rows take one kernel
    whatever their count (fp32 panels on the AVX2 dots and for 8-bit weights, the dots for 4-bit
    weights on VNNI, the bf16 tiles where AMX-BF16 is on), decode rows pick by the step's
    decoding sequences (panels from `panel_rows()`, bf16 tiles from 128), int8 activations and
    the vertical 8-bit head take the dots at any count. `PANELS_NEVER` keeps prompt rows off the
    panels too, and 1 puts one decode row on them. (The CPU is an argument: the AMX and VNNI
    rules are checked on any CPU.)"""
    pick = cpu_lowbit.pick_kernel
    counts = (1, 2, 15, 16, 17, 127, 128, 129, 2048)
    paths = {"avx2": (False, False), "vnni": (True, False), "amx-bf16": (True, True)}
    prompt4 = {"avx2": "panels", "vnni": "dots", "amx-bf16": "bf16"}
    for path, (vnni, bf16) in paths.items():
        for n in counts:
            assert pick(4, True, n, True, vnni, bf16) == prompt4[path], (path, n)
            decode4 = {"avx2": "panels" if n >= 16 else "dots", "vnni": "dots"}
            decode4["amx-bf16"] = "bf16" if n >= 128 else "dots"
            assert pick(4, True, n, False, vnni, bf16) == decode4[path], (path, n)
            assert pick(8, True, n, True, vnni, bf16) == "panels", (path, n)
            assert pick(8, True, n, False, vnni, bf16) == ("panels" if n >= 16 else "dots")
            for bits, fine in ((4, False), (8, False), (9, False), (9, True)):
                for prompt in (False, True):
                    assert pick(bits, fine, n, prompt, vnni, bf16) == "dots", (path, bits, n)
    before = cpu_lowbit.panel_rows(cpu_lowbit.PANELS_NEVER, bits=8)
    try:
        assert pick(8, True, 4096, True, False) == pick(4, True, 4096, True, False) == "dots"
        assert pick(4, True, 4096, True, True, True) == "bf16"
        cpu_lowbit.panel_rows(1, bits=8)
        assert pick(8, True, 1, False, False) == pick(4, True, 1, False, False) == "panels"
    finally:
        cpu_lowbit.panel_rows(before, bits=8)


def through(layer: QuantizedLinear, x: torch.Tensor, kernel: str) -> torch.Tensor:
    """`layer(x)` outside a step with every row through `kernel` (a row's bits do not depend
    on the rows beside it: padding rows bring a short call to the bf16 tiles' 128)."""
    bits, rows = layer.bits, x.shape[0]
    before = cpu_lowbit.panel_rows(1 if kernel == "panels" else cpu_lowbit.PANELS_NEVER, bits=bits)
    bf16 = cpu_lowbit.amx_bf16(kernel == "bf16") if cpu_lowbit.amx() else False
    try:
        if kernel == "bf16":
            x = torch.cat([x, x.new_zeros(max(0, 128 - rows), x.shape[1])])
        return layer(x)[:rows]
    finally:
        cpu_lowbit.panel_rows(before, bits=bits)
        if cpu_lowbit.amx():
            cpu_lowbit.amx_bf16(bf16)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_steps_rows_take_the_kernels_of_their_own_kinds(fmt: str) -> None:
    """Inside `step_rows` a projection over a step's rows gives its decode rows the bits a GEMM
    of the step's decoding sequences gives them (1, 4 or 20 sequences; 16 rows of 4 drafting
    sequences as 4 plain decode rows would), and its prompt rows the prompt kernel's bits,
    however many rows each kind has, threads one and two, as rows of one kind or both. The
    refined head (int8 activations) and a GEMM of another row count keep their own rule.
    Before, the whole call picked by its row count: a decode row beside a 16-row chunk took
    panels, and a 5-row prompt tail the dots."""
    spec = gguf_like(fmt, 75, 576, seed=6)
    layer, head = QuantizedLinear(spec), QuantizedLinear(spec, approximate=True)
    vnni = cpu_lowbit.vnni()
    bf16 = cpu_lowbit.amx() and cpu_lowbit.amx_bf16()
    threads_before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for decode, decoding, prompt in (
                (1, 1, 20), (4, 4, 5), (16, 4, 3), (20, 20, 16), (0, 0, 7), (0, 0, 40), (3, 3, 0),
            ):  # fmt: skip
                rows = decode + prompt
                x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3
                with cpu_lowbit.step_rows(cpu_lowbit.StepRows(rows, decode, decoding)):
                    got, got_head = layer(x), head(x)
                    other = layer(x[:-1]) if rows > 1 else None  # not the step's rows
                kd = cpu_lowbit.pick_kernel(layer.bits, True, decoding, False, vnni, bf16)
                kp = cpu_lowbit.pick_kernel(layer.bits, True, prompt, True, vnni, bf16)
                case = (fmt, threads, decode, decoding, prompt)
                assert torch.equal(got[:decode], through(layer, x[:decode], kd)), case
                assert torch.equal(got[decode:], through(layer, x[decode:], kp)), case
                assert torch.equal(got_head, head(x)), case
                if other is not None:
                    assert torch.equal(other, layer(x[:-1])), case
                if not vnni:  # the AVX2 dots, and panels for prompt rows of any count
                    assert kp == "panels" and kd == ("panels" if decoding >= 16 else "dots")
    finally:
        torch.set_num_threads(threads_before)


def test_a_short_prompts_rows_never_take_the_bf16_tiles() -> None:
    """`pick_kernel` for the rows of a prompt shorter than `bf16_min_prompt()`: on every CPU
    path the kernel prompt rows take with the bf16 tiles off (the VNNI dots where AMX-BF16 is
    on, whatever the count), never the tiles a bf16 call dequantises the whole weight for; a
    longer prompt's rows keep the tiles. Where no AMX-BF16 runs, short and long prompts pick
    alike, as before. (The CPU is an argument: every path is asked on any CPU.)"""
    pick = cpu_lowbit.pick_kernel
    paths = {"avx2": (False, False), "vnni": (True, False), "amx-bf16": (True, True)}
    prompt4 = {"avx2": "panels", "vnni": "dots", "amx-bf16": "bf16"}
    for path, (vnni, bf16) in paths.items():
        for n in (1, 2, 15, 16, 63, 64, 128, 4096):
            short4 = pick(4, True, n, True, vnni, bf16, short=True)
            assert short4 == ("dots" if vnni else "panels"), (path, n)
            assert pick(4, True, n, True, vnni, bf16) == prompt4[path], (path, n)
            assert pick(8, True, n, True, vnni, bf16, short=True) == "panels", (path, n)
            assert pick(4, False, n, True, vnni, bf16, short=True) == "dots", (path, n)
    assert cpu_lowbit.bf16_min_prompt() == cpu_lowbit.BF16_MIN_PROMPT == 64


def _cpu_paths() -> list[tuple[bool, bool]]:
    """(vnni, amx_bf16) for every path this CPU runs: AVX2 always, VNNI and AMX-BF16 where
    it has them."""
    paths = [(False, False)]
    if cpu_lowbit.vnni():
        paths.append((True, False))
        if cpu_lowbit.amx() and cpu_lowbit.amx_bf16():
            paths.append((True, True))
    return paths


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_decode_short_and_long_prompt_rows_in_one_step_each_take_their_kernel(fmt: str) -> None:
    """A step's decode rows, a short prompt's rows and a long prompt's rows (`StepRows` with
    `short`), in one projection on every CPU path this machine runs, threads one and two:
    each row has the bits its kind's kernel gives it alone (adjacent kinds that pick one
    kernel share a call: a row's bits do not depend on its call's other rows). On AMX-BF16
    the short prompt's rows take the dots as the decode rows do, the long prompt's the bf16
    tiles; before, every prompt row took the tiles."""
    spec = gguf_like(fmt, 75, 576, seed=8)
    layer = QuantizedLinear(spec)
    vnni_before = cpu_lowbit.vnni()
    bf16_before = cpu_lowbit.amx_bf16() if cpu_lowbit.amx() else None
    threads_before = torch.get_num_threads()
    seen = set()
    try:
        for vnni, bf16 in _cpu_paths():
            cpu_lowbit.vnni(vnni)
            if bf16_before is not None:
                cpu_lowbit.amx_bf16(bf16)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for decode, decoding, short, long in (
                    (4, 4, 20, 40), (16, 4, 5, 3), (1, 1, 7, 0), (0, 0, 7, 30), (3, 3, 0, 10),
                    (20, 20, 16, 0), (0, 0, 0, 25), (0, 0, 12, 0),
                ):  # fmt: skip
                    rows = decode + short + long
                    g = torch.Generator().manual_seed(rows)
                    x = torch.randn(rows, 576, generator=g) * 3
                    step = cpu_lowbit.StepRows(rows, decode, decoding, short)
                    with cpu_lowbit.step_rows(step):
                        got = layer(x)
                    kd = cpu_lowbit.pick_kernel(layer.bits, True, decoding, False, vnni, bf16)
                    ks = cpu_lowbit.pick_kernel(layer.bits, True, short, True, vnni, bf16, True)
                    kl = cpu_lowbit.pick_kernel(layer.bits, True, long, True, vnni, bf16)
                    case = (fmt, vnni, bf16, threads, decode, decoding, short, long)
                    parts = (
                        (0, decode, kd),
                        (decode, decode + short, ks),
                        (decode + short, rows, kl),
                    )
                    for r0, r1, kernel in parts:
                        if r1 > r0:
                            want = through(layer, x[r0:r1], kernel)
                            assert torch.equal(got[r0:r1], want), (case, r0, kernel)
                            seen.add((vnni, bf16, kernel))
                    if bf16 and layer.bits == 4:
                        assert (ks, kl) == ("dots", "bf16"), case
                    else:
                        assert ks == kl, case  # short and long prompts alike: one call
    finally:
        torch.set_num_threads(threads_before)
        cpu_lowbit.vnni(vnni_before)
        if bf16_before is not None:
            cpu_lowbit.amx_bf16(bf16_before)
    if fmt == "q4_1" and (True, True) in _cpu_paths():
        assert {(True, True, "dots"), (True, True, "bf16")} <= seen


@pytest.mark.parametrize(
    ("env", "value", "warned"),
    [(None, 64, False), ("128", 128, False), (" 0 ", 0, False), ("many", 64, True)],
)
def test_the_environment_sets_the_bf16_prompt_threshold(
    env: str | None, value: int, warned: bool
) -> None:
    """`KVGUARD_BF16_MIN_PROMPT` sets `bf16_min_prompt()` when first asked; a value that is no
    whole number leaves the default, saying so; `n` sets it, and a negative one is refused."""
    environ = {k: v for k, v in os.environ.items() if k != cpu_lowbit.BF16_MIN_PROMPT_ENV}
    if env is not None:
        environ[cpu_lowbit.BF16_MIN_PROMPT_ENV] = env
    code = (
        "import logging; logging.basicConfig()\n"
        "from kvguard.kernels import cpu_lowbit\n"
        "print(cpu_lowbit.bf16_min_prompt(), cpu_lowbit.bf16_min_prompt(5),"
        " cpu_lowbit.bf16_min_prompt())\n"
        "try:\n    cpu_lowbit.bf16_min_prompt(-1)\n"
        "except ValueError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    lines = out.stdout.splitlines()
    assert lines[0] == f"{value} {value} 5"
    assert lines[1] == "bf16_min_prompt(-1): a prompt length is 0 or more"
    assert ("KVGUARD_BF16_MIN_PROMPT='many' is not a whole number" in out.stderr) == warned
