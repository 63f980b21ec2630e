"""Edges of the GGUF loader, the CPU low-bit kernels' activation quantisation and the greedy
sampler that a reviewer found misbehaving:

- a GGUF quantised in a type kvguard does not serve packed (Q2_K, Q3_K, IQ3_S, ...) is refused
  by the packed conversion (`model_quantization: auto | gguf`) naming the file, the tensor and
  its type, instead of being silently dequantised to fp32; `none` still dequantises it;
- a block of activations holding a NaN or an infinity makes every output of its row NaN on
  the integer-dot paths (as x W^T in fp32 does), where NaN's integer code had made them finite
  garbage, and a block of values too small for a finite scale quantises to zeros, where the
  scale overflowed and every code became the most negative one;
- a greedy row whose logits are NaN fails its step as a sampled one does, where the argmax
  had answered token 0 (an engine on a model poisoned with NaN ends the request with an error).

Tiny llama GGUFs are written here with the `gguf` package's writer. The kernel tests run on
the path this CPU takes (the AVX2 copy, and the AVX-512 VNNI copy where the CPU has it).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvguard.engine.gguf_convert import convert_gguf
from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.layers.quantized_linear import QuantizedLinear
from kvguard.engine.model_config import ModelLoadError
from kvguard.engine.sampler import NOT_DRAWN, sample
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.tokenizer_build import byte_alphabet
from kvguard.kernels import cpu_lowbit, cpu_ops

Q = gguf.GGMLQuantizationType
VOCAB = 300
RANDOM_BLOCKS = (Q.Q2_K, Q.Q3_K, Q.IQ3_S, Q.IQ2_XS)


# -- tiny GGUF files -------------------------------------------------------------------------
def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: Q, seed: int) -> None:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == Q.F32:
        writer.add_tensor(name, w)
    elif qtype == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype in RANDOM_BLOCKS:  # the gguf package cannot quantise these: random blocks
        size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = w.shape
        rng = np.random.default_rng(seed)
        data = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if qtype in (Q.IQ3_S, Q.IQ2_XS):  # d leads the block
            data[..., 0:2] = scale
        else:  # d (and Q2_K's dmin) end the block
            data[..., -4:-2] = data[..., -2:] = scale
        writer.add_tensor(name, data.reshape(rows, -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def llama_writer(
    path: Path, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, context: int = 512
) -> gguf.GGUFWriter:
    """A GGUF writer for a small llama of these shapes, its hyperparameters written (RMSNorm
    eps 1e-5, RoPE base 10000): the tokenizer and tensors are the caller's."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_rope_dimension_count(hidden // heads)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    return w


def write_gguf(
    path: Path,
    qtype: Q = Q.Q4_0,
    hidden: int = 64,
    inter: int = 128,
    layers: int = 2,
    types: dict[str, Q] | None = None,
    nan_at: tuple[str, int] | None = None,
) -> Path:
    """A two-layer llama GGUF with random weights, projections in `qtype` (`types`: by GGUF
    tensor name, e.g. `blk.0.attn_q.weight`, or `output.weight` for an untied lm_head);
    `nan_at` (tensor, index) puts a NaN in one value of an F32 tensor."""
    rng = np.random.default_rng(0)
    types = types or {}
    heads, kv_heads = 4, 2
    w = llama_writer(path, layers, hidden, inter, heads, kv_heads, context=256)
    tokens = [*byte_alphabet(), "Ġt"]  # the bytes and the one merge's result
    tokens += [f"<pad{i}>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def lin(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)).astype(np.float32) * cols**-0.5

    def norm(n: int) -> np.ndarray:
        return (0.5 + rng.random(n)).astype(np.float32)

    tensors: list[tuple[str, np.ndarray, Q]] = [
        ("token_embd.weight", rng.standard_normal((VOCAB, hidden)).astype(np.float32), qtype)
    ]
    hd = hidden // heads
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", norm(hidden), Q.F32),
            (p + "attn_q.weight", lin(heads * hd, hidden), qtype),
            (p + "attn_k.weight", lin(kv_heads * hd, hidden), qtype),
            (p + "attn_v.weight", lin(kv_heads * hd, hidden), qtype),
            (p + "attn_output.weight", lin(hidden, heads * hd), qtype),
            (p + "ffn_norm.weight", norm(hidden), Q.F32),
            (p + "ffn_gate.weight", lin(inter, hidden), qtype),
            (p + "ffn_up.weight", lin(inter, hidden), qtype),
            (p + "ffn_down.weight", lin(hidden, inter), qtype),
        ]
    tensors.append(("output_norm.weight", norm(hidden), Q.F32))
    if "output.weight" in types:
        tensors.append(("output.weight", lin(VOCAB, hidden), types["output.weight"]))
    for seed, (name, arr, qt) in enumerate(tensors):
        if nan_at is not None and name == nan_at[0]:
            arr = arr.copy()
            arr[nan_at[1]] = np.nan
        _add(w, name, arr, types.get(name, qt), seed)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- 1. quantised types kvguard does not serve packed -------------------------------------------
@pytest.mark.parametrize(
    ("qtype", "types", "tensor", "kind"),
    [
        (Q.IQ2_XS, {"token_embd.weight": Q.Q8_0}, "blk.0.attn_q.weight", "IQ2_XS"),
        (Q.IQ3_S, {}, "blk.0.attn_q.weight", "IQ3_S"),
        (Q.Q4_0, {"blk.1.ffn_down.weight": Q.IQ3_S}, "blk.1.ffn_down.weight", "IQ3_S"),
    ],
)
def test_packed_conversion_refuses_types_it_does_not_serve_packed(
    tmp_path: Path, qtype: Q, types: dict[str, Q], tensor: str, kind: str
) -> None:
    """Dequantised, an IQ2_XS file became over ten times its size in fp32 under `auto`; the
    error names the file, the first such tensor and its type, and points to `none`. `none`
    still converts the file (dequantised on purpose), every weight as the gguf package
    dequantises it."""
    k_quant = {qtype, *types.values()} & {Q.Q2_K, Q.Q3_K, Q.IQ3_S, Q.IQ2_XS}  # blocks of 256
    hidden, inter = (256, 512) if k_quant else (64, 128)
    path = write_gguf(tmp_path / "odd.gguf", qtype, hidden, inter, types=types)
    pattern = rf"odd\.gguf: tensor '{tensor}' is {kind} .*model_quantization: none"
    with pytest.raises(ModelLoadError, match=pattern):
        convert_gguf(path, tmp_path / "packed", progress=False, packed=True)
    assert not (tmp_path / "packed" / "model.safetensors").exists()

    from kvguard.engine.model_registry import resolve_model

    for knob in ("auto", "gguf"):
        with pytest.raises(ModelLoadError, match=pattern):
            resolve_model(str(path), tmp_path / "home", progress=False, quantization=knob)
    out = resolve_model(str(path), tmp_path / "home", progress=False, quantization="none")
    from safetensors.numpy import load_file

    held = load_file(str(out / "model.safetensors"))
    src = {t.name: t for t in gguf.GGUFReader(path).tensors}
    hf = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
        "output.weight": "lm_head.weight",
    }[tensor]
    want = gguf.quants.dequantize(src[tensor].data, src[tensor].tensor_type)
    if tensor == "blk.0.attn_q.weight":  # its rows come back un-permuted: compare as sets
        assert sorted(map(tuple, held[hf])) == sorted(map(tuple, want))
    else:
        assert np.array_equal(held[hf], want)


def test_a_vocabulary_tensor_of_another_type_is_served_in_full_precision_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """llama.cpp's quantiser keeps `output.weight` (and `token_embd.weight`) in a finer type
    than the layers (`--output-tensor-type`): of a type not served packed (IQ3_S here), those two
    are one matrix each, not the model, so such a file still converts packed, them dequantised
    to fp32, with a warning."""
    types = {"output.weight": Q.IQ3_S, "token_embd.weight": Q.IQ3_S}
    path = write_gguf(tmp_path / "llama.gguf", Q.Q4_0, 256, 512, types=types)
    with caplog.at_level("WARNING", logger="kvguard.engine"):
        convert_gguf(path, tmp_path / "packed", progress=False, packed=True)
    said = caplog.text
    assert "output.weight is IQ3_S" in said and "token_embd.weight is IQ3_S" in said
    assert "dequantised to fp32" in said
    import json

    config = json.loads((tmp_path / "packed" / "config.json").read_text())
    modules = config["quantization_config"]["modules"]
    assert modules["model.layers.0.self_attn.q_proj"] == "Q4_0" and "lm_head" not in modules
    from kvguard.engine import EngineConfig, LLMEngine

    for knob in ("auto", "none"):  # served packed, and the fp32 reference: the same tokens
        cfg = EngineConfig(
            model=str(path), home=tmp_path / "home", kv_cache_bytes="8MiB", num_threads=1,
            model_quantization=knob,
        )  # fmt: skip
        eng = LLMEngine.from_config(cfg, progress=False)
        out = eng.generate([list(range(10, 20))], SamplingParams(max_tokens=3, ignore_eos=True))
        assert out[0].finish_reason == "length" and len(out[0].token_ids) == 3


def test_unquantised_tensors_stay_allowed_beside_packed_ones(tmp_path: Path) -> None:
    """F16 and F32 weights are not quantised: a file mixing them with Q4_0/Q8_0 converts
    packed, the packed types packed and the others as fp32; a fused group (q/k/v, gate/up)
    with an unquantised part is stored dequantised whole, as the loader can serve it."""
    types = {"blk.0.ffn_up.weight": Q.F16, "blk.1.attn_v.weight": Q.F32, "output.weight": Q.F16}
    path = write_gguf(tmp_path / "mixed.gguf", Q.Q4_0, types=types)
    convert_gguf(path, tmp_path / "packed", progress=False, packed=True)
    import json

    modules = json.loads((tmp_path / "packed" / "config.json").read_text())
    modules = modules["quantization_config"]["modules"]
    assert modules["model.layers.0.mlp.down_proj"] == "Q4_0"
    assert "model.layers.0.mlp.gate_proj" not in modules
    assert "model.layers.0.mlp.up_proj" not in modules
    assert "model.layers.1.self_attn.q_proj" not in modules and "lm_head" not in modules
    all_f16 = write_gguf(tmp_path / "f16.gguf", Q.F16)
    convert_gguf(all_f16, tmp_path / "packed16", progress=False, packed=True)


# -- 2 and 3. the activation quantisation's NaN, inf and tiny blocks -------------------------
def _paths() -> list[bool]:
    """The integer-dot copies this CPU runs: AVX2, and AVX-512 VNNI where it has it (the C
    kernels build on every machine the tests run on: gcc, see .ci/run)."""
    return [False, True] if cpu_lowbit.vnni() else [False]


@pytest.fixture(params=_paths())
def vnni(request: pytest.FixtureRequest):
    """Runs a test on one copy of the kernels; the CPU's default is put back after."""
    before = cpu_lowbit.vnni()
    cpu_lowbit.vnni(request.param)
    yield request.param
    cpu_lowbit.vnni(before)


def _spec(bits: int, out: int, cols: int, seed: int = 0) -> QuantSpec:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (out, cols), generator=g, dtype=torch.uint8)
    s = (torch.rand(out, cols // 32, generator=g) * 0.02 + 1e-3).half().float()
    z = torch.rand(out, cols // 32, generator=g) * (2**bits - 1)
    return QuantSpec(q, s, z, 32, bits)


def _layers(cols: int) -> list[QuantizedLinear]:
    """The integer-dot kernels: 4-bit and 8-bit weights with int16 and int8 activations, and
    the vertical 8-bit lm_head (`w8a8v`)."""
    out = []
    for bits in (4, 8):
        for fine in (True, False):
            layer = QuantizedLinear(_spec(bits, 40, cols, seed=bits))
            layer.fine = fine
            out.append(layer)
    out.append(QuantizedLinear(_spec(8, 40, cols, seed=9), approximate=True))
    assert {m.kernel for m in out} == {"w4a8", "w8a8", "w8a8v"}, [m.kernel for m in out]
    return out


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("cols", [128, 192])  # 4 and 6 blocks (AVX-512: 4 at a time)
def test_a_non_finite_activation_makes_its_rows_outputs_nan(
    vnni: bool, bad: float, cols: int
) -> None:
    """A NaN or an infinity anywhere in a block (its first element, the middle of its first
    eight, its last, in the row's first, a middle or its last block) gives NaN in every output
    of its row, on every integer-dot kernel at 1-6 rows (below the fp32 panels); the other
    rows' outputs keep their bits. The maximum used to drop a NaN (`maxps` keeps its second
    operand), NaN's integer code was INT_MIN, and the outputs came out finite."""
    rows, layers = 6, _layers(cols)
    torch.manual_seed(1)
    clean = torch.randn(rows, cols)
    want = {id(m): m(clean) for m in layers}
    for block in sorted({0, 1, cols // 32 - 1}):
        for j in (0, 5, 31):
            x = clean.clone()
            x[2, 32 * block + j] = bad
            for m in layers:
                for n in (1, 3, rows):  # alone beside clean rows, or not there at all
                    got = m(x[:n])
                    if n > 2:
                        assert got[2].isnan().all(), (m.kernel, m.fine, n, block, j)
                    keep = [r for r in range(n) if r != 2]
                    assert torch.equal(got[keep], want[id(m)][keep]), (m.kernel, m.fine, n)
                    assert torch.isfinite(got[keep]).all()


def test_quantize_rows_gives_nan_scales_and_zero_codes_to_a_non_finite_block(vnni: bool) -> None:
    """The quantisation itself: the poisoned block's scale and scaled sum are NaN, its codes
    0 (no INT_MIN garbage), and the row's other blocks are quantised as without it."""
    torch.manual_seed(2)
    x = torch.randn(3, 160)
    for fine in (False, True):
        q0, e0, es0 = cpu_lowbit.quantize_rows(x, fine)
        for bad in (float("nan"), float("inf")):
            y = x.clone()
            y[1, 32 * 3 + 4] = bad
            q, e, es = cpu_lowbit.quantize_rows(y, fine)
            assert e[1, 3].isnan() and es[1, 3].isnan()
            assert (q[1, 96:128] == 0).all()
            others = torch.ones_like(e, dtype=torch.bool)
            others[1, 3] = False
            assert torch.equal(e[others], e0[others]) and torch.equal(es[others], es0[others])
            codes = torch.ones_like(q, dtype=torch.bool)
            codes[1, 96:128] = False
            assert torch.equal(q[codes], q0[codes])


@pytest.mark.parametrize("amax", [1e-36, 1e-38, 1e-40, 1e-45])
def test_a_block_too_small_for_a_finite_scale_quantises_to_zeros(vnni: bool, amax: float) -> None:
    """L / amax overflowed to inf below about L / FLT_MAX (1e-36 for int16 codes, 4e-37 for
    int8), and every code became -32768 or -128: the block's sign flipped. Such a block is
    zeros with scale 0 now; the row's other blocks, and blocks just above the limit, are
    quantised as before."""
    for fine, levels in ((False, 127), (True, cpu_lowbit.FINE_LEVELS)):
        x = torch.zeros(2, 128)
        x[:, 0], x[:, 1] = amax, -amax / 2  # the first block: tiny
        x[:, 32:64] = torch.linspace(-1, 1, 32)  # the second: ordinary
        x[1, 64], x[1, 65] = 1e-30, -5e-31  # the third: small, its scale finite
        q, e, es = cpu_lowbit.quantize_rows(x, fine)
        if levels / float(np.float32(amax)) > float(np.finfo(np.float32).max):
            assert (q[:, :32] == 0).all() and (e[:, 0] == 0).all() and (es[:, 0] == 0).all()
        else:  # int8's 127 / 1e-36 is finite: quantised as ever
            assert q[0, 0] == levels and q[0, 1] in (-levels // 2, -levels // 2 + 1)
        assert q[0, 32] == -levels and q[0, 63] == levels and e[0, 1] > 0
        assert q[1, 64] == levels and q[1, 65] < 0 and e[1, 2] > 0
        assert (q[:, 96:] == 0).all() and (e[:, 3] == 0).all()


def test_the_vnni_copy_quantises_edges_as_the_avx2_copy() -> None:
    """Where the CPU has AVX-512, both copies give the same codes and scales (bits) for NaN,
    inf, tiny and ordinary blocks, in every place of the four-block groups the AVX-512 copy
    takes at once, and in a last group of fewer than four."""
    assert cpu_lowbit.available()
    if not cpu_lowbit.vnni():  # only the AVX2 copy runs here, and it cannot be asked for
        with pytest.raises(ValueError, match="AVX-512 VNNI"):
            cpu_lowbit.vnni(True)
        return
    torch.manual_seed(3)
    x = torch.randn(8, 32 * 7)
    specials = [float("nan"), float("inf"), 1e-40, 0.0, 1e-36, float("-inf"), 3e38, 1e-30]
    for r, v in enumerate(specials):
        blk = r % 7
        if v in (1e-40, 0.0, 1e-36, 1e-30):
            x[r, 32 * blk : 32 * blk + 32] = v * torch.sign(torch.randn(32))
        else:
            x[r, 32 * blk + r] = v
    try:
        for fine in (False, True):
            got = {}
            for on in (False, True):
                cpu_lowbit.vnni(on)
                got[on] = cpu_lowbit.quantize_rows(x, fine)
            for a, b in zip(got[False], got[True], strict=True):
                assert torch.equal(a.view(torch.int32) if a.is_floating_point() else a,
                                   b.view(torch.int32) if b.is_floating_point() else b)  # fmt: skip
    finally:
        cpu_lowbit.vnni(True)


# -- 2. greedy rows on NaN logits --------------------------------------------------------------
@pytest.mark.parametrize("c_kernel", [True, False])
def test_a_greedy_row_of_nan_logits_is_refused_as_a_sampled_one(c_kernel: bool) -> None:
    """An all-NaN row answered token 0, a row with one NaN the NaN's index (both argmaxes
    answer so); now greedy rows fail as sampled rows do, alone or beside others, on the C
    argmax and on torch's (a strided view is not the C kernel's), and clean rows are as
    before."""
    clean = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)

    def view(x: torch.Tensor) -> torch.Tensor:
        if c_kernel:
            return x.contiguous()
        wide = torch.zeros(x.shape[0], x.shape[1] * 2)
        wide[:, ::2] = x
        return wide[:, ::2]  # stride 2 along the row: torch's argmax

    assert cpu_ops.rows_served(view(clean)) == (c_kernel and cpu_ops.enabled(clean))
    assert sample(view(clean), [greedy] * 2, [None] * 2) == [1, 0]
    for poison in ([float("nan")] * 4, [0.0, 1.0, float("nan"), 2.0]):
        bad = clean.clone()
        bad[1] = torch.tensor(poison)
        with pytest.raises(RuntimeError, match="NaN") as greedy_error:
            sample(view(bad), [greedy] * 2, [None] * 2)
        assert str(greedy_error.value) == NOT_DRAWN
        mixed = [SamplingParams(temperature=0.7, seed=3), greedy]  # the greedy row is the bad one
        with pytest.raises(RuntimeError, match="NaN"):
            sample(view(bad), mixed, [torch.Generator().manual_seed(3), None])
        with pytest.raises(RuntimeError) as sampled_error:  # what a sampled row says
            sample(view(bad)[1:], [SamplingParams(temperature=1.0, seed=1)], [torch.Generator()])
        assert str(sampled_error.value) == str(greedy_error.value)


# -- 2. end to end: a GGUF whose model produces NaN -----------------------------------------
def test_a_model_producing_nan_ends_its_requests_with_an_error_packed_or_not(
    tmp_path: Path,
) -> None:
    """One NaN in a norm weight makes every logit NaN. Dequantised (`none`) the engine ended
    sampled requests with an error but answered greedy ones with token 0; packed (`auto`) the
    integer dots made the NaN finite and both streamed garbage. Now every request of either
    form ends with `error`, and `score` is NaN on both."""
    assert cpu_lowbit.available(), "the C low-bit kernels did not build (gcc: see .ci/run)"
    from kvguard.engine import EngineConfig, LLMEngine

    path = write_gguf(tmp_path / "nan.gguf", Q.Q4_0, nan_at=("blk.1.ffn_norm.weight", 5))
    ids = list(range(10, 15))  # prompt rows take the fp32 panels, decode rows the integer dots
    for knob in ("none", "auto"):
        cfg = EngineConfig(
            model=str(path),
            home=tmp_path / "home",
            kv_cache_bytes="8MiB",
            num_threads=1,
            model_quantization=knob,
        )
        eng = LLMEngine.from_config(cfg, progress=False)
        assert eng.score(ids).isnan().all(), knob
        for params in (
            SamplingParams(max_tokens=4, ignore_eos=True),
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=1),
        ):
            out = eng.generate([ids], params)[0]
            assert out.finish_reason == "error" and out.token_ids == [], (knob, params)
        assert eng.scheduler.bm.num_used == 0
