"""The quantized linear layer, GGUF Q4_0/Q4_1/Q8_0 kept packed, and the default model served
packed: each kernel against `QuantSpec.dequantize`, each GGUF unpacker against the `gguf`
package's own `quants.dequantize`, and the packed smollm2 against its fp32-dequantised form.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from kvguard.engine.gguf_convert import (
    GgufFile,
    load_packed,
    unpack_blocks,
    unpack_nibbles,
    unpermute_rows,
)
from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.layers.quantized_linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedLMHead,
    cat_rows,
    pick_kernel,
    slice_spec,
)
from kvguard.engine.model import weight_bytes
from kvguard.engine.model_registry import resolve_model
from kvguard.engine.speculative import Lookup
from kvguard.engine.weights import load_weights
from kvguard.kernels import cpu_lowbit
from tests.test_fp8_quality import TOPICS
from tests.test_prefix_cache import _step_tokens

Q = gguf.GGMLQuantizationType


def random_spec(
    out: int, cols: int, group: int, bits: int, perm: bool = False, seed: int = 0
) -> QuantSpec:
    """Codes over the whole range, positive scales, float zero points anywhere in the range."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (out, cols), generator=g, dtype=torch.uint8)
    scales = torch.rand(out, cols // group, generator=g) * 0.02 + 1e-3
    zeros = torch.rand(out, cols // group, generator=g) * (2**bits - 1)
    p = torch.randperm(cols, generator=g) if perm else None
    return QuantSpec(q, scales, zeros, group, bits, p)


# -- the layer against the reference dequantisation -------------------------------------------
CASES = [
    # (out, in, group, bits, perm, kernel)
    (96, 256, 32, 4, False, "int4pack"),
    (64, 256, 64, 4, False, "int4pack"),
    (64, 512, 128, 4, False, "int4pack"),
    (48, 512, 256, 4, False, "int4pack"),
    (64, 384, 384, 4, False, "int4pack"),  # per-channel: scales repeated over 128-col groups
    (40, 256, 32, 4, False, "int4pack"),  # out not a multiple of 16: padded rows
    (64, 256, 64, 4, True, "int4pack"),  # GPTQ desc_act permutation
    (48, 256, 16, 4, False, "dense"),  # no int4pack group size fits: dequantised once
    (64, 256, 256, 8, False, "int8pack"),  # per-channel 8-bit, float zero points
    (64, 256, 32, 8, False, "int4x2"),  # Q8_0-like groups: two 4-bit planes, codes exact
    # the C kernels (int8 activations: ~3 significant digits too)
    (96, 256, 32, 4, False, "w4a8"),
    (40, 512, 128, 4, False, "w4a8"),  # out not a multiple of the 8-column tile
    (64, 256, 64, 4, True, "w4a8"),
    (64, 256, 32, 8, False, "w8a8"),
    (64, 256, 256, 8, False, "w8a8"),
    (64, 256, 32, 8, False, "w8a8v"),  # the lm_head's vertical layout (int8 activations)
    (44, 256, 64, 8, False, "w8a8v"),  # a lone last tile, groups of two blocks
]


@pytest.mark.parametrize(("out", "cols", "group", "bits", "perm", "kernel"), CASES)
def test_layer_matches_dequantised_matmul(
    out: int, cols: int, group: int, bits: int, perm: bool, kernel: str
) -> None:
    spec = random_spec(out, cols, group, bits, perm)
    bias = torch.randn(out)
    layer = QuantizedLinear(spec, bias, kernel=kernel)
    for rows in (1, 5, 33):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        want = x @ spec.dequantize().T + bias
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        # bf16 activations, scales and outputs: ~3 significant digits
        tol = 1e-2
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= tol, f"{kernel}: relative error {err:.2e}"
    assert layer(torch.empty(0, cols)).shape == (0, out)


def test_the_c_kernels_are_picked_where_they_fit() -> None:
    """This machine has a compiler and AVX2 (CI installs gcc): the C kernels serve every
    group that is a multiple of 32; what they cannot hold keeps torch's kernels."""
    cpu = torch.device("cpu")
    assert pick_kernel(random_spec(64, 256, 32, 4), cpu) == "w4a8"
    assert pick_kernel(random_spec(64, 256, 128, 4), cpu) == "w4a8"
    assert pick_kernel(random_spec(64, 256, 32, 8), cpu, approximate=True) == "w8a8v"
    assert pick_kernel(random_spec(64, 256, 32, 8), cpu) == "w8a8"
    assert pick_kernel(random_spec(64, 96, 32, 4), cpu) == "int4pack"  # 3 blocks: no pairs
    assert pick_kernel(random_spec(48, 256, 16, 4), cpu) == "dense"


@pytest.mark.parametrize("perm", [False, True])
def test_cuda_path_calls_the_w4a16_kernel_once_per_layer(
    perm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA a 4-bit layer hands its packed weight to `dispatch.w4a16_matmul` (the Triton
    kernel; here its interpreter or torch reference on CPU), which gathers the desc_act
    permutation itself: forced on CPU so the wiring is tested without a GPU."""
    from kvguard.engine.layers import quantized_linear

    monkeypatch.setattr(quantized_linear, "pick_kernel", lambda *a, **k: "w4a16")
    spec = random_spec(32, 128, 32, 4, perm=perm)
    layer = QuantizedLinear(spec)
    assert layer.kernel == "w4a16" and layer.perm is None
    x = torch.randn(3, 128)
    want = x @ spec.dequantize().T
    assert (layer(x) - want).abs().max().item() <= 1e-3 * want.abs().max().item()


def test_embedding_rows_match_dequantised_rows() -> None:
    ids = torch.tensor([[0, 7, 63], [5, 5, 1]])
    # (bits, group, tolerance): per-channel int8 rows are the lm_head's own (bf16 row scales);
    # the others keep a row table with fp16 scales (int4pack's layout is the kernel's own)
    # the C kernels' layouts hand out their own rows (fp16 scales and mins)
    cases = [
        (8, 32, "int4x2", 1e-3),
        (8, 256, "int8pack", 4e-3),
        (4, 32, "int4pack", 1e-3),
        (8, 32, "w8a8", 1e-3),
        (8, 128, "w8a8", 1e-3),
        (8, 32, "w8a8v", 1e-3),
        (8, 64, "w8a8v", 1e-3),
        (4, 64, "w4a8", 1e-3),
    ]
    for bits, group, kernel, tol in cases:
        spec = random_spec(64, 256, group, bits)
        tied = QuantizedLinear(spec, kernel=kernel)
        emb = QuantizedEmbedding(spec, torch.float32, tied=tied)
        assert (emb.tied is tied) == (kernel in ("int8pack", "w8a8", "w8a8v", "w4a8"))
        want = spec.dequantize()[ids]
        assert (emb(ids) - want).abs().max().item() <= tol * want.abs().max().item()


def test_approximate_head_refines_its_top_candidates_exactly() -> None:
    """A group-wise 8-bit lm_head requantised to per-row int8 ranks the vocabulary; its top
    candidates' logits are recomputed from the exact rows."""
    spec = random_spec(512, 256, 32, 8)
    spec.scales = spec.scales.half().float()  # fp16 scales, as GGUF's Q8_0 has them
    head = QuantizedLinear(spec, approximate=True, kernel="int8pack")
    emb = QuantizedEmbedding(spec, torch.float32)
    x = torch.randn(3, 256)
    want = x @ spec.dequantize().T
    rough = QuantizedLMHead(head, 512)(x)
    refined = QuantizedLMHead(head, 512, exact=emb.table)(x)
    top = want.topk(4).indices
    assert (refined.gather(1, top) - want.gather(1, top)).abs().max().item() <= 1e-3
    assert (rough - want).abs().max().item() > 1e-3  # the requantisation is visible
    assert torch.equal(refined.argmax(-1), want.argmax(-1))
    assert emb.table.read is None  # a requantised copy cannot stand in for the rows


@pytest.mark.parametrize("kernel", ["w8a8", "w8a8v"])
def test_a_c_kernel_head_holds_the_tied_vocabulary_once(kernel: str) -> None:
    """Handed the embedding's table, a W8A8 head (codes exact, row-major or vertical) serves
    the embedding's rows from its own storage: the table's copy is dropped, lookups and refined
    logits stay exact."""
    spec = random_spec(512, 256, 32, 8)
    spec.scales = spec.scales.half().float()
    spec.zeros = torch.full_like(spec.zeros, 128.0)  # Q8_0: symmetric
    emb = QuantizedEmbedding(spec, torch.float32)
    head = QuantizedLMHead(
        QuantizedLinear(spec, approximate=True, kernel=kernel), 512, exact=emb.table
    )
    assert emb.table.read is not None and not list(emb.table.buffers())
    ids = torch.tensor([3, 511, 0])
    assert torch.equal(emb(ids), spec.dequantize()[ids])
    x = torch.randn(5, 256)
    want = x @ spec.dequantize().T
    got = head(x)
    top = want.topk(4).indices
    assert (got.gather(1, top) - want.gather(1, top)).abs().max().item() <= 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_c_refinement_dots_the_exact_rows_where_they_lie(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The vertical 8-bit head refines its candidates in C from its own codes: the same
    logits (to fp32 rounding) as dequantising those rows and taking their dots in torch, at
    every column of a last, partly filled tile, with mins and two blocks a group."""
    spec = random_spec(100, 256, 64, 8, seed=3)
    spec.scales = spec.scales.half().float()
    emb = QuantizedEmbedding(spec, torch.float32)
    head = QuantizedLMHead(
        QuantizedLinear(spec, approximate=True, kernel="w8a8v"), 100, exact=emb.table
    )
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    rough = head.linear(x).float()
    ids = torch.stack([torch.randperm(100, generator=torch.Generator().manual_seed(r))[:16]
                       for r in range(7)])  # fmt: skip
    ids[0, :4] = torch.tensor([96, 97, 98, 99])  # the last tile's real columns
    got = cpu_lowbit.refine8v(rough.clone(), x, ids, *_head_args(head.linear))
    untouched = torch.ones_like(rough, dtype=torch.bool).scatter_(-1, ids, False)
    assert torch.equal(got[untouched], rough[untouched])
    # against the fp64 dot of the exact rows (the embedding's, whose fp16 mins round the
    # spec's zero points), within fp32 summation's bound (K eps of the terms' magnitudes),
    # and as close as torch's einsum over them
    rows = head.linear.rows(ids)
    exact = torch.einsum("nkh,nh->nk", rows.double(), x.double())
    scale = torch.einsum("nkh,nh->nk", rows.double().abs(), x.double().abs())
    torch_err = (torch.einsum("nkh,nh->nk", rows, x).double() - exact).abs() / scale
    err = (got.gather(-1, ids).double() - exact).abs() / scale
    assert err.max().item() < 256 * 2**-24 and err.mean().item() < 4 * torch_err.mean().item()
    # the head's forward takes this path and ranks by it
    calls = []
    real = cpu_lowbit.refine8v
    monkeypatch.setattr(cpu_lowbit, "refine8v", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(head(x).argmax(-1), (x @ spec.dequantize().T).argmax(-1))
    assert calls == [1]


def test_the_whole_exact_head_is_the_refined_bits_at_any_rows_and_threads() -> None:
    """`exact8v` (every column, a tile's codes read once for up to eight rows: what returned
    log-probabilities come from) gives each logit the very bits `refine8v` gives it, at every
    column of a partly filled last tile, for one row or many (past one group of eight), on
    one thread or two: a row's log-probabilities never depend on what else the step holds."""
    spec = random_spec(100, 256, 64, 8, seed=5)
    spec.scales = spec.scales.half().float()
    lin = QuantizedLinear(spec, approximate=True, kernel="w8a8v")
    threads = torch.get_num_threads()
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(2))
    ids = torch.arange(100).expand(11, -1).contiguous()
    ref = cpu_lowbit.refine8v(torch.zeros(11, 100), x, ids, *_head_args(lin))
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (1, 3, 9, 11):
                got = cpu_lowbit.exact8v(x[:rows], *_head_args(lin))
                assert got.shape == (rows, 104)  # 13 tiles of eight columns
                assert torch.equal(got[:, :100], ref[:rows]), (n, rows)
    finally:
        torch.set_num_threads(threads)


def _head_args(lin: QuantizedLinear) -> tuple:
    return lin.lowbit_codes, lin.lowbit_scales, lin.lowbit_mins, lin.group_size


def test_fusing_and_splitting_specs_follow_rows_and_groups() -> None:
    a, b = random_spec(32, 128, 32, 4, seed=1), random_spec(16, 128, 32, 4, seed=2)
    fused = cat_rows([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    rows = slice_spec(fused, range(8, 40), 0, "x")
    assert torch.equal(rows.dequantize(), fused.dequantize()[8:40])
    cols = slice_spec(fused, range(64, 128), 1, "x")
    assert torch.equal(cols.dequantize(), fused.dequantize()[:, 64:128])
    with pytest.raises(ValueError, match="group boundaries"):
        slice_spec(fused, range(16, 80), 1, "layers.0.mlp.down_proj")
    padded = slice_spec(a, range(24, 40), 0, "embed")
    assert torch.equal(padded.dequantize()[8:], torch.zeros(8, 128))


# -- GGUF blocks against the gguf package's reference ------------------------------------------
@pytest.fixture(scope="module")
def tensors(smollm2_gguf: Path) -> dict[str, Any]:
    """The default GGUF's tensors by name (parsed once: the tokenizer arrays take seconds)."""
    return {t.name: t for t in GgufFile(smollm2_gguf).reader.tensors}


def test_gguf_q4_1_and_q8_0_unpack_like_the_reference(tensors: dict[str, Any]) -> None:
    for name in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_gate.weight"):
        t = tensors[name]
        assert t.tensor_type == Q.Q4_1
        _check_unpack(np.asarray(t.data), Q.Q4_1)
    embd = tensors["token_embd.weight"]
    assert embd.tensor_type == Q.Q8_0
    _check_unpack(np.asarray(embd.data)[:2048], Q.Q8_0)


def test_gguf_q4_0_unpacks_like_the_reference(tensors: dict[str, Any]) -> None:
    """The default GGUF has no Q4_0 tensor: quantise a real weight with the gguf package."""
    t = tensors["blk.3.attn_output.weight"]
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    _check_unpack(gguf.quants.quantize(w, Q.Q4_0), Q.Q4_0)


def _check_unpack(data: np.ndarray, qtype: Q) -> None:
    q, scales, zeros = unpack_blocks(data, qtype)
    spec = QuantSpec(torch.from_numpy(q), torch.from_numpy(scales), torch.from_numpy(zeros), 32, 8)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))
    got = spec.dequantize()
    # Q4_1 goes through z = -m/d: exact up to fp32 rounding of (q - z) * d
    assert (got - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())
    assert int(q.max()) < (256 if qtype == Q.Q8_0 else 16)


def test_nibble_order_round_trips() -> None:
    codes = np.arange(16, dtype=np.uint8).reshape(2, 8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    assert np.array_equal(unpack_nibbles(packed), codes)


# -- the default model, packed --------------------------------------------------------------
@pytest.fixture(scope="module")
def packed_dir(model_home: Path) -> Path:
    return resolve_model("smollm2-135m", model_home, progress=False, quantization="auto")


def test_packed_conversion_equals_the_fp32_one(packed_dir: Path, smollm2_dir: Path) -> None:
    """Same weights both ways: q/k rows un-permuted with their scales, Q4_1 minimum folded into
    float zero points, the Q8_0 embedding exact."""
    specs, plain = load_packed(packed_dir, torch.float32)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    names += ["model.layers.11.mlp.down_proj", "model.embed_tokens"]
    fp32 = load_weights(smollm2_dir, torch.float32, "cpu")
    for name in names:
        want = fp32[f"{name}.weight"]
        assert (specs[name].dequantize() - want).abs().max().item() <= 1e-6, name
    assert torch.equal(plain["model.norm.weight"], fp32["model.norm.weight"])
    assert specs["model.layers.0.mlp.up_proj"].bits == 4
    assert specs["model.embed_tokens"].bits == 8


def test_unpermute_applies_to_codes_and_scales_alike(tensors: dict[str, Any]) -> None:
    t = tensors["blk.2.attn_k.weight"]
    q, scales, zeros = unpack_blocks(np.asarray(t.data), t.tensor_type)
    spec = QuantSpec(
        *(torch.from_numpy(unpermute_rows(a, 3)) for a in (q, scales, zeros)), group_size=32, bits=4
    )
    dense = unpermute_rows(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32), 3)
    assert (spec.dequantize() - torch.from_numpy(dense)).abs().max().item() <= 1e-6


def make(quantization: str, activations: str = "int16") -> LLMEngine:
    cfg = EngineConfig(
        model="smollm2-135m",
        kv_cache_bytes="64MiB",
        num_threads=1,  # one thread: steadier than two on a shared two-core host
        model_quantization=quantization,
        cpu_activations=activations,
    )
    return LLMEngine.from_config(cfg, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("activations", "dots", "floor"),
    [("int16", True, 0.99), ("int8", True, 0.97), ("int16", False, 0.995)],
    ids=["int16 dots", "int8 dots", "int16 default"],
)
def test_default_model_serves_packed_and_agrees_with_fp32(
    activations: str, dots: bool, floor: float
) -> None:
    """Scoring a whole sequence is a prefill batch, which an int16 C-kernel projection serves
    with fp32 panels of its dequantised weight (`int16 default`: the activations unquantised,
    so only the weights' own rounding to fp16 scales and the int8 lm_head remain). With
    `dots` the panels are off (`PANELS_NEVER`, prompt rows included) so the integer kernels
    small decode batches run (int16 activations, or int8 with `cpu_activations: int8`) are
    what is measured."""
    from kvguard.kernels import cpu_lowbit

    before = cpu_lowbit.panel_rows(cpu_lowbit.PANELS_NEVER if dots else None)
    try:
        _agreement(activations, "integer dots" if dots else "default kernels", floor)
    finally:
        cpu_lowbit.panel_rows(before)


def _agreement(activations: str, kernels: str, floor: float) -> None:
    packed = make(EngineConfig().model_quantization, activations)  # the default: auto
    layers = [m for m in packed.model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.kernel for m in layers} == {"w4a8", "w8a8v"}  # w8a8v: the lm_head
    assert len(layers) == 30 * 4 + 1  # qkv, o, gate_up, down per layer + the tied lm_head
    assert sum(m.fine for m in layers) == (120 if activations == "int16" else 0)
    reference = make("none")
    _report_bytes(packed, reference)

    tok = reference.tokenizer
    chats = [
        tok.apply_chat_template([{"role": "user", "content": f"Explain {t}."}]) for t in TOPICS
    ]
    ids = [tok.encode(c) for c in chats]
    outs = reference.generate(ids, SamplingParams(max_tokens=64, ignore_eos=True))
    same = total = 0
    for prompt, out in zip(ids, outs, strict=True):
        seq = prompt + out.token_ids
        want = reference.score(seq)[len(prompt) - 1 : -1].argmax(-1)
        got = packed.score(seq)[len(prompt) - 1 : -1].argmax(-1)
        same += int((want == got).sum())
        total += len(want)
    ratio = same / total
    print(
        f"packed ({activations} activations, {kernels}) vs fp32 teacher-forced top-1 agreement: "
        f"{ratio:.4f} over {total} positions"
    )
    assert total == 20 * 64
    assert ratio >= floor


def _report_bytes(packed: LLMEngine, reference: LLMEngine) -> None:
    """Resident weight bytes against fp16 (two bytes for every weight the fp32 model holds)."""
    fp16 = weight_bytes(reference.model) // 2
    total = weight_bytes(packed.model)
    w4 = sum(
        m.nbytes() for m in packed.model.modules() if isinstance(m, QuantizedLinear) and m.bits == 4
    )
    w4_fp16 = 2 * sum(
        m.in_features * m.out_features
        for m in packed.model.modules()
        if isinstance(m, QuantizedLinear) and m.bits == 4
    )
    print(
        f"\nresident weights: packed {total / 2**20:.1f} MiB = {total / fp16:.3f}x fp16 "
        f"({fp16 / 2**20:.1f} MiB; the Q8_0 vocabulary once at 8.5 bits, norms fp32); "
        f"W4 projections alone {w4 / w4_fp16:.3f}x fp16 (Q4_1: 4-bit codes + fp16 scale and "
        f"min per 32 weights)"
    )
    # the checkpoint's own size: Q4_1 is 5 bits a weight (0.3125x fp16), Q8_0 8.5 (0.53x),
    # and the vocabulary matrix is a fifth of the weights, held once (the lm_head's storage)
    assert total <= 0.37 * fp16
    assert w4 <= 0.3125 * w4_fp16


def test_a_knob_the_checkpoint_does_not_hold_is_refused(model_home: Path, tiny_dir: Path) -> None:
    for knob in ("awq_4bit", "gptq_4bit"):
        with pytest.raises(ModelLoadError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf.*gguf"):
            resolve_model("smollm2-135m", model_home, progress=False, quantization=knob)
    with pytest.raises(ModelLoadError, match=r"config\.json: holds unquantized weights.*gguf"):
        resolve_model(str(tiny_dir), model_home, progress=False, quantization="gguf")
    packed = resolve_model("smollm2-135m", model_home, progress=False, quantization="gguf")
    with pytest.raises(ModelLoadError, match=r"smollm2-135m\.packed/config\.json: holds gguf"):
        resolve_model(str(packed), model_home, progress=False, quantization="none")
    fp32 = resolve_model("smollm2-135m", model_home, progress=False, quantization="none")
    assert fp32 != packed and fp32.name == "smollm2-135m"


# -- tensor parallel --------------------------------------------------------------------------
def quantise_groups(w: torch.Tensor, bits: int, group: int = 32) -> QuantSpec:
    """Asymmetric min/max quantisation per group: the test's own 4- or 8-bit checkpoint."""
    out, cols = w.shape
    g = w.reshape(out, cols // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
    zeros = -lo / scales
    q = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, 2**bits - 1)
    return QuantSpec(q.reshape(out, cols).to(torch.uint8), scales, zeros, group, bits)


@pytest.fixture(scope="module")
def tiny_packed(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights quantised into kvguard's packed format: 4-bit projections, an
    8-bit (group 32) tied embedding."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("tiny-4bit")
    weights = load_weights(tiny_dir, torch.float32, "cpu")
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, str] = {}
    for name, w in weights.items():
        base = name.removesuffix(".weight")
        if w.ndim != 2:
            tensors[name] = w
            continue
        bits = 8 if "embed_tokens" in name else 4
        spec = quantise_groups(w, bits)
        q = spec.q if bits == 8 else spec.q[:, 0::2] | (spec.q[:, 1::2] << 4)
        tensors |= {f"{base}.qweight": q, f"{base}.scales": spec.scales}
        tensors[f"{base}.zeros"] = spec.zeros
        modules[base] = "Q8_0" if bits == 8 else "Q4_1"  # the bit width is what is read back
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = json.loads((tiny_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gguf",
        "format": "kvguard-packed",
        "version": 1,
        "modules": modules,
    }
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, out / name)
    return out


def tp_engine(path: Path, tp: int) -> LLMEngine:
    cfg = EngineConfig(
        model=str(path), tensor_parallel=tp, kv_cache_bytes="16MiB", max_model_len=256
    )
    return LLMEngine.from_config(cfg, progress=False)


def test_the_packed_tiny_heads_padding_rows_are_minus_inf(tiny_packed: Path) -> None:
    """The tiny model's 320 embedding rows hold 259 tokens: the engine sets the token ids on
    the model it loaded (`set_token_vocab`), and its quantized head takes them too, so the
    padding rows are -inf in the head's own logits (before its refined candidates are picked)
    and in the exact logits that log-probabilities are taken from."""
    eng = tp_engine(tiny_packed, 1)
    try:
        head, tokens = eng.model.lm_head, eng.runner.vocab
        assert isinstance(head, QuantizedLMHead) and head.approximate
        assert (head.tokens, tokens, eng.model_config.vocab_size) == (259, 259, 320)
        hidden = torch.randn(
            3, eng.model_config.hidden_size, generator=torch.Generator().manual_seed(1)
        )
        for logits in (head(hidden), head.exact_logits(hidden)):
            assert logits.shape == (3, 320)
            assert bool((logits[:, tokens:] == float("-inf")).all())
            assert bool(logits[:, :tokens].isfinite().all())
    finally:
        eng.shutdown()


def test_packed_tiny_at_tp2_matches_tp1(tiny_packed: Path) -> None:
    """Column shards split output rows, row shards whole groups; each rank refines its own
    vocabulary's best logits. The row-parallel partial sums are rounded to bf16 by the kernel
    before the all-reduce, so greedy runs may part at a near tie: the check is teacher-forced,
    on the tp=1 continuations, logits close and top-1 choices the same."""
    prompts = ["The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4,", "Hello"]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    scores = []
    for tp in (1, 2):
        eng = tp_engine(tiny_packed, tp)
        try:
            if tp == 1:
                outs = eng.generate(prompts, greedy)
                seqs = [
                    eng.tokenizer.encode(p) + o.token_ids
                    for p, o in zip(prompts, outs, strict=True)
                ]
            scores.append(torch.cat([eng.score(ids) for ids in seqs]))
            eng.audit_blocks()
        finally:
            eng.shutdown()
    want, got = scores
    diff = ((got - want).abs().max() / want.abs().max()).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"\npacked tiny tp=2 vs tp=1: logits max|diff| {diff:.2e} (relative), top-1 {agree:.3f}")
    assert diff <= 2e-2
    assert agree >= 0.97


def test_a_prompt_joining_a_tp2_step_leaves_a_seeded_requests_answer(tiny_packed: Path) -> None:
    """At tensor_parallel 2 every rank picks each row's kernel by its kind, as one rank does:
    a seeded request decoding alone, and again with a 40-token prompt prefilled in the step
    beside its sixth token, gives the same tokens and log-probabilities on the packed tiny
    model. Before, the workers were not told the rows' kinds and the 41-row step put the
    decode row on the fp32 panels of every rank's shard."""
    assert cpu_lowbit.available(), "the C low-bit kernels did not build (gcc: see .ci/run)"
    eng = tp_engine(tiny_packed, 2)
    try:
        assert {m.kernel for m in eng.model.modules() if isinstance(m, QuantizedLinear)} >= {"w4a8"}
        mine = eng.tokenizer.encode("The quick brown fox")
        other = list(range(10, 50))
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, logprobs=1, ignore_eos=True)
        alone, joined = _alone_and_joined(eng, mine, other, params)
    finally:
        eng.shutdown()
    assert joined.token_ids == alone.token_ids and len(alone.token_ids) == 16
    assert _entries(joined) == _entries(alone)


def test_a_split_off_the_group_grid_is_refused_naming_the_layer(tiny_packed: Path) -> None:
    """tiny at tp=4: o_proj's 16 input columns per rank cut its 32-column groups."""
    with pytest.raises(
        Exception, match=r"o_proj.*group size 32.*tensor_parallel values .*\[1, 2\]"
    ):
        tp_engine(tiny_packed, 4).shutdown()


@pytest.fixture(scope="module")
def drafting_engine() -> LLMEngine:
    """The default model packed as served (two threads), no prefix cache (every run computes
    its prompt), drafting as many as 15 tokens wherever a lookup proposes them."""
    cfg = EngineConfig(
        model="smollm2-135m",
        kv_cache_bytes="64MiB",
        num_threads=2,
        enable_prefix_caching=False,
        speculative_tokens=15,
        speculative_row_cost=0.0,
    )
    return LLMEngine.from_config(cfg, progress=False)


SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=3, logprobs=1, ignore_eos=True)


def _chat(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def _entries(out: Any) -> list[tuple]:
    return [(e.token_id, e.logprob, e.top) for e in out.final_logprobs]


def _alone_and_joined(
    engine: LLMEngine, mine: list[int], other: list[int], params: SamplingParams
) -> tuple[Any, Any]:
    """`mine`'s final output decoding alone, and again with `other` (one token asked) added
    beside its sixth step."""

    def run(join: bool) -> Any:
        rid, done, step = engine.add_request(mine, params), {}, 0
        while engine.has_unfinished():
            if join and step == 5:
                engine.add_request(other, SamplingParams(max_tokens=1))
            done |= {o.request_id: o for o in engine.step() if o.finished}
            step += 1
        return done[rid]

    return run(False), run(True)


def test_a_prompt_joining_mid_decode_leaves_a_seeded_requests_answer(
    drafting_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded request decoding alone, and again with a 40-token prompt prefilled in the
    step beside its sixth token: the same tokens and log-probabilities. Its decode row takes
    the kernel one decoding sequence picks (the integer dots), the chunk's rows theirs (fp32
    panels); before, the whole 41-row step went to the panels and the answer changed."""
    engine = drafting_engine
    monkeypatch.setattr(Lookup, "propose", lambda self, seq, most: [])  # no drafts here
    mine = _chat(engine, "Write a short poem about the sea.")
    other = _chat(engine, "Explain photosynthesis, step by step. " * 2)[:40]
    assert len(other) == 40
    steps = _step_tokens(engine, monkeypatch)
    alone, joined = _alone_and_joined(engine, mine, other, SEEDED)
    assert [1, 40] in steps  # the chunk was computed beside a decode row
    assert joined.token_ids == alone.token_ids and len(alone.token_ids) == 24
    assert _entries(joined) == _entries(alone)


def _with_and_without_drafts(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, prompt: list[int], shared: bool
) -> tuple[Any, Any, list[list[int]], int]:
    """The seeded request without drafts, then with every draft its own answer's next tokens
    (so each verify step runs 16 rows: its last token and 15 drafts), decode attention's
    shared-prefix read `shared`: (plain, drafted, each step's rows, shared reads taken)."""
    monkeypatch.setattr(Lookup, "propose", lambda self, seq, most: [])
    was = cpu_lowbit.shared_prefix(shared)
    try:
        plain = engine.generate([prompt], [SEEDED])[0]
        answer = plain.token_ids

        def propose(self: Lookup, seq: Any, most: int) -> list[int]:
            done = len(seq.output_token_ids)
            return answer[done : done + most]

        monkeypatch.setattr(Lookup, "propose", propose)
        steps = _step_tokens(engine, monkeypatch)
        calls = cpu_lowbit.shared_prefix_calls()
        drafted = engine.generate([prompt], [SEEDED])[0]
        grouped = cpu_lowbit.shared_prefix_calls() - calls
    finally:
        cpu_lowbit.shared_prefix(was)
    assert [16] in steps  # a verify step of 16 rows
    return plain, drafted, steps, grouped


def test_verify_rows_take_the_kernel_plain_decode_takes(
    drafting_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded request whose every draft is its own answer's next tokens: each verify step
    of one sequence runs 16 rows (its last token and 15 drafts), whose projections pick their
    kernel as one decoding sequence does, so the answer, log-probabilities included, is the
    one without drafts. Before, 16 rows took the fp32 panels where plain decode takes the
    integer dots. (Decode attention's shared-prefix read is off here, so that only the
    projections are compared; with it on, see the test below.)"""
    prompt = _chat(drafting_engine, "Count from one to twenty in words.")
    plain, drafted, _, _ = _with_and_without_drafts(drafting_engine, monkeypatch, prompt, False)
    assert drafted.token_ids == plain.token_ids
    assert _entries(drafted) == _entries(plain)


def test_a_seeded_request_answers_alike_with_drafts_and_the_shared_read_on(
    drafting_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same seeded request with drafts (every one accepted) and without, decode
    attention's shared-prefix read on (the default), behind a prompt of over eight blocks: the
    same tokens and log-probabilities. A verify step's rows are one sequence's, each attended
    as that sequence's one-token step at its length. Before, three rows or more over two full
    blocks were read as sequences sharing a prefix (logits up to 0.024 from one-token
    steps'), and a long sequence's rows were split over the threads by how many rows the
    step had."""
    engine = drafting_engine
    text = "Tell me about the history of the lighthouse, its keepers and its lamps. " * 8
    prompt = _chat(engine, text)
    assert len(prompt) > 8 * engine.config.block_size  # split over the threads when alone
    plain, drafted, _, grouped = _with_and_without_drafts(engine, monkeypatch, prompt, True)
    assert drafted.token_ids == plain.token_ids
    assert _entries(drafted) == _entries(plain)
    assert grouped == 0  # a lone sequence's rows: nothing read once for several


def test_a_step_lays_out_decode_rows_then_short_then_long_prompts() -> None:
    """`build_step` with each sequence's `RowKind`: the decode rows first, then the short
    prompts' chunks, then the long prompts', and `StepRows` counting each; attention's
    entries, positions, slots and token ids follow that order, the prompt chunks are marked
    as such (`prompt_rows`), and the sampled rows stay in batch order. Plain bools (decode
    or not) still mean what they meant: every prompt a long one."""
    from kvguard.engine.model_runner import RowKind, build_step

    tables = [[0, 1], [2], [3, 4], [5], [6]]
    starts, num_tokens = [0, 9, 16, 0, 3], [20, 1, 4, 5, 2]
    kinds = [RowKind.PROMPT, RowKind.DECODE, RowKind.PROMPT, RowKind.SHORT_PROMPT, 2]
    ids = list(range(100, 132))  # batch order: 20, 1, 4, 5 and 2 tokens
    step = build_step(tables, starts, num_tokens, [1, 1, 0, 1, 1], ids, 16, torch.device("cpu"),
                      decodes=[RowKind(k) for k in kinds])  # fmt: skip
    assert step.kinds == cpu_lowbit.StepRows(32, 1, 1, 7)
    assert step.meta.query_lens == [1, 5, 2, 20, 4]
    assert step.meta.seq_lens == [10, 5, 5, 20, 20]
    assert step.meta.prompt_rows == [False, True, True, True, True]
    want_pos = [9, *range(5), 3, 4, *range(20), *range(16, 20)]
    assert step.positions.tolist() == want_pos
    assert step.input_ids.tolist() == [120, *range(125, 130), 130, 131, *range(100, 120),
                                       *range(121, 125)]  # fmt: skip
    assert step.meta.slot_mapping.tolist()[:8] == [2 * 16 + 9, *range(80, 85), 99, 100]
    # the sampled rows, batch order: the long prompt's last, the decode, the two short ones
    assert step.sample_rows.tolist() == [27, 0, 5, 7]
    old = build_step(tables, starts, num_tokens, [1, 1, 0, 1, 1], ids, 16, torch.device("cpu"),
                     decodes=[False, True, False, False, False])  # fmt: skip
    assert old.kinds == cpu_lowbit.StepRows(32, 1, 1, 0)
    assert old.meta.query_lens == [1, 20, 4, 5, 2]


def test_a_prompts_kernel_follows_its_whole_length_however_it_is_computed(
    smollm_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model, packed, AMX-BF16 on where the CPU has it: a 40-token prompt (shorter
    than `bf16_min_prompt()`) and a 100-token one, each computed whole, chunked by 16 and by 7
    (`max_num_batched_tokens`), and repeated from the prefix cache (its uncached tail alone):
    the same prompt log-probabilities and first log-probabilities bit for bit. The short
    prompt's rows are a step's short-prompt rows however they are chunked, and on AMX-BF16
    they are the bits the bf16 tiles off give (the integer dots), the long prompt's not (the
    tiles). Before, a prompt's rows took the tiles at any length: a one-token prompt step
    cost 45 ms of one core against 10."""
    params = SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    first = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2)
    short = [300 + (i * 4099) % 30000 for i in range(40)]
    long = [300 + (i * 4111 + 7) % 30000 for i in range(100)]
    assert len(short) < cpu_lowbit.bf16_min_prompt() <= len(long)
    bf16 = cpu_lowbit.amx() and cpu_lowbit.amx_bf16()
    engines = {
        n: LLMEngine.from_config(
            EngineConfig(
                model="smollm2-135m", kv_cache_bytes="64MiB", num_threads=2,
                max_num_batched_tokens=n, enable_prefix_caching=False,
            ),
            progress=False,
        )
        for n in (16, 7)
    }  # fmt: skip
    kinds: list[cpu_lowbit.StepRows] = []
    forward = engines[16].runner.forward
    monkeypatch.setattr(
        engines[16].runner, "forward", lambda inp: kinds.append(inp.kinds) or forward(inp)
    )
    steps = _step_tokens(engines[7], monkeypatch)

    def plp(out: Any) -> list[tuple]:
        return [(e.logprob, e.top) for e in out.final_prompt_logprobs]

    try:
        for prompt in (short, long):
            n = len(prompt)
            # prompt log-probabilities are computed, never taken from the cache: the first
            # log-probabilities compare the cache's tail with the whole prompt
            whole, tail = (smollm_engine.generate([prompt], [first])[0] for _ in range(2))
            assert (whole.num_cached_tokens, tail.num_cached_tokens) == (0, n // 16 * 16)
            assert tail.token_ids == whole.token_ids and _entries(tail) == _entries(whole), n
            cold = smollm_engine.generate([prompt], [params])[0]
            assert _entries(cold) == _entries(whole), n
            kinds.clear()
            steps.clear()
            runs = [e.generate([prompt], [params])[0] for e in engines.values()]
            assert steps[: -(-n // 7)] == [[7]] * (n // 7) + [[n % 7]]
            for run in runs:
                assert run.token_ids == cold.token_ids, n
                assert plp(run) == plp(cold) and len(plp(run)) == n - 1, n
                assert _entries(run)[0] == _entries(cold)[0], n
            if bf16:
                cpu_lowbit.amx_bf16(False)
                try:
                    off = engines[7].generate([prompt], [params])[0]
                finally:
                    cpu_lowbit.amx_bf16(True)
                assert (plp(off) == plp(cold)) == (n < 64), n
            prefill = kinds[: -(-n // 16)]
            assert [k.rows for k in prefill] == [16] * (n // 16) + [n % 16]
            assert all(k.short == (k.rows if n < 64 else 0) for k in prefill), prefill
    finally:
        for engine in engines.values():
            engine.shutdown()
