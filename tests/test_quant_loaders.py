"""The quantized-checkpoint loaders against references no one here wrote.

compressed-tensors: its own quantizer (`calculate_qparams`), packer (`pack_to_int32`) and
compressor (`PackedQuantizationCompressor`) pack random weights and its decompressor is the
reference; a checkpoint it writes is loaded by transformers (dequantised on load) and by us.
AWQ and GPTQ: their packers do not install here (AutoAWQ and GPTQModel want CUDA builds), so
known codes are packed by the literal loops of the published bit orders below (written from
the formats' descriptions, not from our unpackers) and compared with `(q - z) * s`.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.loader.awq import awq_spec, unpack_awq
from kvguard.engine.loader.compressed_tensors import ct_spec
from kvguard.engine.loader.gptq import gptq_spec
from kvguard.engine.loader.packing import perm_from_g_idx, unpack_nibbles
from kvguard.engine.loader.quantized import detect_format, load_quantized
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from tests.test_engine import PROMPTS

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.model_compressors.model_compressor import (  # noqa: E402
    ModelCompressor,
)
from compressed_tensors.compressors.pack_quantized.base import (  # noqa: E402
    PackedQuantizationCompressor,
)
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


# -- reference packers: the published bit orders, one nibble at a time -----------------------
def _word(nibbles: list[int]) -> int:
    """The int32 holding eight 4-bit values, value k at bits 4k .. 4k+3."""
    word = 0
    for k, v in enumerate(nibbles):
        assert 0 <= v < 16
        word |= v << (4 * k)
    return word - (1 << 32) if word >= 1 << 31 else word


def ref_pack_awq(codes: np.ndarray) -> torch.Tensor:
    """AutoAWQ GEMM, along columns: nibble k of word c holds column 8c + (0,2,4,6,1,3,5,7)[k]."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    rows, cols = codes.shape
    words = [
        [_word([int(codes[r, 8 * c + order[k]]) for k in range(8)]) for c in range(cols // 8)]
        for r in range(rows)
    ]
    return torch.tensor(words, dtype=torch.int32)


def ref_pack_rows(codes: np.ndarray) -> torch.Tensor:
    """GPTQ qweight, along rows (the input dim): nibble k of word r holds row 8r + k."""
    rows, cols = codes.shape
    words = [
        [_word([int(codes[8 * r + k, c]) for k in range(8)]) for c in range(cols)]
        for r in range(rows // 8)
    ]
    return torch.tensor(words, dtype=torch.int32)


def ref_pack_cols(codes: np.ndarray) -> torch.Tensor:
    """GPTQ qzeros, along columns (the output dim): nibble k of word c holds column 8c + k."""
    return ref_pack_rows(codes.T).t().contiguous()


def ref_dequant(
    codes: np.ndarray, zeros: np.ndarray, scales: torch.Tensor, g_idx: np.ndarray
) -> torch.Tensor:
    """`W[o, i] = (codes[i, o] - zeros[g_idx[i], o]) * scales[g_idx[i], o]`, in float32."""
    q = torch.from_numpy(codes).float()
    z = torch.from_numpy(zeros).float()[g_idx]
    s = scales.float()[g_idx]
    return ((q - z) * s).t()


def _random_layer(rng: np.random.Generator, cols: int, out: int, group: int) -> tuple:
    codes = rng.integers(0, 16, size=(cols, out))
    zeros = rng.integers(0, 16, size=(cols // group, out))
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, size=(cols // group, out))).half()
    return codes, zeros, scales


# -- bit orders on known words ---------------------------------------------------------------
def test_known_words_unpack_to_their_published_nibbles() -> None:
    """Codes 0..7 in one word, by hand: AWQ interleaves, GPTQ and compressed-tensors do not."""
    awq_word = torch.tensor([[0x75316420]], dtype=torch.int32)  # nibbles 0,2,4,6,1,3,5,7
    assert unpack_awq(awq_word).tolist() == [list(range(8))]
    plain = torch.tensor([[0x76543210, -0x01234568]], dtype=torch.int32)  # 2nd: 0xFEDCBA98
    assert unpack_nibbles(plain).tolist() == [list(range(16))]
    codes = torch.arange(-8, 8, dtype=torch.int8).view(1, 16)  # signed, stored + 8
    assert torch.equal(pack_to_int32(codes, 4), plain)


def test_reference_packers_round_trip_through_ours() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(32, 24))
    assert np.array_equal(unpack_awq(ref_pack_awq(codes)).numpy(), codes)
    assert np.array_equal(unpack_nibbles(ref_pack_rows(codes).t()).t().numpy(), codes)
    assert np.array_equal(unpack_nibbles(ref_pack_cols(codes)).numpy(), codes)


# -- AWQ -------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [32, 128])
def test_awq_gemm_unpacks_and_dequantises(group: int) -> None:
    rng = np.random.default_rng(group)
    cols, out = 128, 48
    codes, zeros, scales = _random_layer(rng, cols, out, group)
    spec = awq_spec(ref_pack_awq(codes), ref_pack_awq(zeros), scales)
    assert spec.group_size == group and spec.perm is None
    assert np.array_equal(spec.q.numpy(), codes.T)
    assert np.array_equal(spec.zeros.numpy(), zeros.T)
    g_idx = np.arange(cols) // group
    assert torch.equal(spec.dequantize(), ref_dequant(codes, zeros, scales, g_idx))


# -- GPTQ ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_unpacks_and_dequantises(fmt: str, sym: bool, desc_act: bool) -> None:
    rng = np.random.default_rng([int(sym), int(desc_act), int(fmt == "gptq")])
    cols, out, group = 128, 40, 32
    codes, zeros, scales = _random_layer(rng, cols, out, group)
    if sym:
        zeros[:] = 8
    elif fmt == "gptq":
        zeros = np.maximum(zeros, 1)  # v1 stores z - 1: a zero of 0 has no v1 encoding
    stored = (zeros - 1) % 16 if fmt == "gptq" else zeros
    if desc_act:  # the j-th column GPTQ quantized (in act order) is in group j // group
        order = rng.permutation(cols)
        g_idx = np.empty(cols, dtype=np.int64)
        g_idx[order] = np.arange(cols) // group
    else:
        g_idx = np.arange(cols) // group
    spec = gptq_spec(
        ref_pack_rows(codes),
        ref_pack_cols(stored),
        scales,
        torch.from_numpy(g_idx).int(),
        zero_offset=1 if fmt == "gptq" else 0,
    )
    assert (spec.perm is not None) == desc_act
    perm = spec.perm.numpy() if desc_act else np.arange(cols)
    assert np.array_equal(spec.q.numpy(), codes.T[:, perm])
    assert torch.equal(spec.dequantize(), ref_dequant(codes, zeros, scales, g_idx))
    x = torch.randn(3, cols)  # the layer's product, as a kernel would take it: x[:, perm]
    w_stored = (
        spec.q.float() - spec.zeros.repeat_interleave(group, 1)
    ) * spec.scales.float().repeat_interleave(group, 1)
    torch.testing.assert_close(x[:, perm] @ w_stored.t(), x @ spec.dequantize().t())


def test_uneven_g_idx_is_refused() -> None:
    g_idx = torch.tensor([0, 0, 0, 1])
    with pytest.raises(ModelLoadError, match="g_idx does not give 2 groups of 2"):
        perm_from_g_idx(g_idx, 2, "m.g_idx")


# -- compressed-tensors ----------------------------------------------------------------------
def ct_compress(w: torch.Tensor, args: QuantizationArgs) -> dict[str, torch.Tensor]:
    """One linear quantized min-max and packed by compressed-tensors itself."""
    if args.strategy == "group":
        grouped = w.unflatten(-1, (-1, args.group_size))
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    return PackedQuantizationCompressor.compress(state, _scheme(args))


def _scheme(args: QuantizationArgs) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=args)


def _args(strategy: str, sym: bool, group: int | None = None) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=4, type="int", symmetric=sym, strategy=strategy, group_size=group
    )


def _ct_spec(c: dict[str, torch.Tensor]) -> QuantSpec:
    return ct_spec(
        c["weight_packed"],
        c["weight_scale"],
        c["weight_shape"].tolist(),
        c.get("weight_zero_point"),
    )


@pytest.mark.parametrize(
    ("strategy", "sym", "group", "shape", "dtype"),
    [
        ("group", True, 32, (48, 128), torch.float16),
        ("group", False, 32, (48, 128), torch.float16),
        ("group", True, 64, (40, 128), torch.bfloat16),
        ("group", False, 128, (40, 256), torch.float32),
        ("channel", True, None, (48, 128), torch.float16),
        ("channel", False, None, (48, 100), torch.bfloat16),  # width not a multiple of 8
    ],
)
def test_compressed_tensors_pack_quantized_matches_its_decompressor(
    strategy: str, sym: bool, group: int | None, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    args = _args(strategy, sym, group)
    compressed = ct_compress(torch.randn(shape, dtype=dtype), args)
    assert ("weight_zero_point" in compressed) == (not sym)
    reference = PackedQuantizationCompressor.decompress(compressed, _scheme(args))["weight"]
    ours = _ct_spec(compressed)
    assert ours.group_size == (group or shape[1])
    assert torch.equal(ours.dequantize(reference.dtype), reference)


def test_compressed_tensors_unpacked_zero_points_of_older_versions() -> None:
    """Before 0.10, asymmetric zero points were stored as signed int8 `[out, groups]`."""
    torch.manual_seed(1)
    compressed = ct_compress(torch.randn(24, 64), _args("group", False, 32))
    out, groups = compressed["weight_scale"].shape
    signed = unpack_nibbles(compressed["weight_zero_point"].t().contiguous())[:, :out].t() - 8
    assert torch.equal(
        pack_to_int32(signed.to(torch.int8), 4, packed_dim=0), compressed["weight_zero_point"]
    )
    legacy = {**compressed, "weight_zero_point": signed.to(torch.int8)}
    assert torch.equal(_ct_spec(legacy).dequantize(), _ct_spec(compressed).dequantize())


# -- format detection and refusals -----------------------------------------------------------
def _ct_config(fmt: str = "pack-quantized", **weights: Any) -> dict[str, Any]:
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**w, **weights}}},
    }


ACCEPTED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM"}, "awq"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "gptq"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}, "gptq"),
    (_ct_config(), "compressed-tensors"),
    (_ct_config(strategy="channel", group_size=None, symmetric=False), "compressed-tensors"),
]
REFUSED = [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv_fast"}, "AWQ version 'gemv_fast'"),
    ({"quant_method": "awq", "bits": 4, "version": "marlin"}, "AWQ version 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "AWQ version 'exllama'"),
    ({"quant_method": "awq", "bits": 8, "version": "gemm"}, "8-bit AWQ is not supported"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point false"),
    ({"quant_method": "gptq", "bits": 8}, "8-bit GPTQ is not supported"),
    ({"quant_method": "gptq", "bits": 3}, "3-bit GPTQ is not supported"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "format": "bitblas"}, "'bitblas'"),
    ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "pack_dtype 'int16'"),
    (_ct_config("float-quantized", type="float", num_bits=8), "'float-quantized'"),
    (_ct_config("int-quantized", num_bits=8), "'int-quantized'"),
    (_ct_config("marlin-24"), "'marlin-24'"),
    (_ct_config("nvfp4-pack-quantized", type="float"), "'nvfp4-pack-quantized'"),
    (_ct_config(num_bits=8), "8-bit int weights are not supported"),
    (_ct_config(strategy="tensor"), "strategy 'tensor'"),
    ({**_ct_config(), "quantization_status": "frozen"}, "quantization_status 'frozen'"),
    ({"quant_method": "exl2"}, "quant_method 'exl2'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8"}, "quant_method 'fp8'"),
]


def _model_dir(root: Path, qc: dict[str, Any] | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"]}
    if qc is not None:
        cfg["quantization_config"] = qc
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_detect_format_names_the_supported_ones(tmp_path: Path) -> None:
    assert detect_format(_model_dir(tmp_path / "plain", None)) is None
    for i, (qc, name) in enumerate(ACCEPTED):
        assert detect_format(_model_dir(tmp_path / str(i), qc)) == name


def test_input_activation_quantization_is_refused(tmp_path: Path) -> None:
    qc = _ct_config()
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(ModelLoadError, match="activation quantization is not supported"):
        detect_format(_model_dir(tmp_path, qc))


@pytest.mark.parametrize(("qc", "named"), REFUSED, ids=[r[1] for r in REFUSED])
def test_unsupported_formats_are_refused_by_name(
    tmp_path: Path, qc: dict[str, Any], named: str
) -> None:
    path = _model_dir(tmp_path, qc)
    with pytest.raises(ModelLoadError) as err:
        detect_format(path)
    assert named in str(err.value) and str(path / "config.json") in str(err.value)


# -- AWQ and GPTQ directories of the tiny model ----------------------------------------------
def _minmax_codes(w: torch.Tensor, group: int, rng: np.random.Generator) -> tuple:
    """Codes `[in, out]`, zeros and fp16 scales `[G, out]` of `w` `[out, in]` (asymmetric
    min-max); the zeros are drawn in 1..15 so they also have a GPTQ v1 encoding."""
    wt = w.t().double().numpy()
    cols, out = wt.shape
    scales = np.empty((cols // group, out))
    for g in range(cols // group):
        block = wt[g * group : (g + 1) * group]
        scales[g] = np.maximum(block.max(0) - block.min(0), 1e-6) / 15
    scales16 = torch.from_numpy(scales).half()
    zeros = rng.integers(1, 16, size=scales.shape)
    rows = np.arange(cols) // group
    codes = np.clip(np.rint(wt / scales16.double().numpy()[rows]) + zeros[rows], 0, 15)
    return codes.astype(np.int64), zeros, scales16


def write_packed_checkpoint(src: Path, dst: Path, fmt: str, group: int = 32) -> dict:
    """`src` with every projection packed as AWQ GEMM or GPTQ by the reference packers above;
    returns {module: (codes, zeros, scales, g_idx)} to check against."""
    dst.mkdir(parents=True)
    rng = np.random.default_rng(7)
    out, truth = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if not LINEAR.fullmatch(name):
            out[name] = tensor
            continue
        module = name.removesuffix(".weight")
        codes, zeros, scales = _minmax_codes(tensor, group, rng)
        g_idx = np.arange(codes.shape[0]) // group
        if fmt == "awq":
            out |= {
                f"{module}.qweight": ref_pack_awq(codes),
                f"{module}.qzeros": ref_pack_awq(zeros),
            }
        else:  # gptq, desc_act: shuffle which input rows form a group
            g_idx = rng.permutation(g_idx)
            stored = (zeros - 1) % 16 if fmt == "gptq" else zeros
            out |= {
                f"{module}.qweight": ref_pack_rows(codes),
                f"{module}.qzeros": ref_pack_cols(stored),
            }
            out[f"{module}.g_idx"] = torch.from_numpy(g_idx).int()
        out[f"{module}.scales"] = scales
        truth[module] = (codes, zeros, scales, g_idx)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": True}
        qc |= {"sym": False, "checkpoint_format": fmt}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return truth


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_v2"])
def test_load_quantized_reads_awq_and_gptq_directories(
    fmt: str, tiny_dir: Path, tmp_path: Path
) -> None:
    truth = write_packed_checkpoint(tiny_dir, tmp_path / fmt, fmt)
    cfg = ModelConfig.from_dir(tmp_path / fmt)
    specs, plain = load_quantized(tmp_path / fmt, cfg)
    assert specs.keys() == truth.keys() and len(specs) == 7 * cfg.num_layers
    for module, (codes, zeros, scales, g_idx) in truth.items():
        assert torch.equal(specs[module].dequantize(), ref_dequant(codes, zeros, scales, g_idx))
        assert (specs[module].perm is not None) == fmt.startswith("gptq")
    original = load_file(tiny_dir / "model.safetensors")
    assert plain.keys() == {k for k in original if not LINEAR.fullmatch(k)}


def test_group_size_that_contradicts_the_config_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    write_packed_checkpoint(tiny_dir, tmp_path / "awq", "awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"]["group_size"] = 128
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="group size 32, quantization_config says 128"):
        load_quantized(tmp_path / "awq", ModelConfig.from_dir(tmp_path / "awq"))


# -- a compressed-tensors checkpoint of a real model directory -------------------------------
def write_ct_checkpoint(src: Path, dst: Path, args: QuantizationArgs) -> Path:
    """`src` (a safetensors Llama dir) with every layer projection W4A16-compressed by
    compressed-tensors, and the quantization_config its ModelCompressor writes."""
    dst.mkdir(parents=True)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if not LINEAR.fullmatch(name):
            out[name] = tensor
            continue
        module = name.removesuffix(".weight")
        out.update({f"{module}.{k}": v for k, v in ct_compress(tensor, args).items()})
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.startswith("."):
            shutil.copy(f, dst / f.name)
    qc = QuantizationConfig(
        config_groups={"group_0": _scheme(args)},
        ignore=["lm_head"],
        format="pack-quantized",
        quantization_status="compressed",
    )
    ModelCompressor(quantization_config=qc).update_config(str(dst))
    return dst


TINY_SCHEMES = {"group32-sym": ("group", True, 32), "channel-asym": ("channel", False, None)}


@pytest.fixture(scope="module")
def ct_tiny(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model W4A16-compressed two ways (a tmp dir each, never in the repo)."""
    root = tmp_path_factory.mktemp("ct-tiny")
    return {
        name: write_ct_checkpoint(tiny_dir, root / name, _args(*scheme))
        for name, scheme in TINY_SCHEMES.items()
    }


def _hf_dequantised(path: Path) -> Any:
    """transformers' model of the checkpoint, after compressed-tensors decompressed it (on
    the first forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    return model


@pytest.mark.parametrize("scheme", list(TINY_SCHEMES))
def test_load_quantized_equals_compressed_tensors_decompression(
    ct_tiny: dict[str, Path], tiny_dir: Path, scheme: str
) -> None:
    path = ct_tiny[scheme]
    assert detect_format(path) == "compressed-tensors"
    cfg = ModelConfig.from_dir(path)
    specs, plain = load_quantized(path, cfg)
    assert len(specs) == 7 * cfg.num_layers
    stored, original = (
        load_file(path / "model.safetensors"),
        load_file(tiny_dir / "model.safetensors"),
    )
    args = _args(*TINY_SCHEMES[scheme])
    for name, spec in specs.items():
        parts = {
            k.removeprefix(name + "."): v for k, v in stored.items() if k.startswith(name + ".")
        }
        reference = PackedQuantizationCompressor.decompress(parts, _scheme(args))["weight"]
        assert torch.equal(spec.dequantize(), reference), name
    assert plain.keys() == {k for k in original if not LINEAR.fullmatch(k)}
    assert all(torch.equal(t, original[k]) for k, t in plain.items())


def test_transformers_and_kvguard_read_the_same_tiny_checkpoint(
    ct_tiny: dict[str, Path],
) -> None:
    """transformers 5.24 with compressed-tensors 0.20.1 cannot load the asymmetric checkpoint
    (it expects unpacked zero points: size mismatch, cf. vllm-project/llm-compressor#1618), so
    only the symmetric one is compared here; the asymmetric one is checked above against
    compressed-tensors' own decompressor."""
    path = ct_tiny["group32-sym"]
    specs, plain = load_quantized(path, ModelConfig.from_dir(path))
    hf = _hf_dequantised(path).state_dict()
    for name, spec in specs.items():
        assert torch.equal(spec.dequantize(), hf[f"{name}.weight"]), name
    for name, tensor in plain.items():
        assert torch.equal(tensor, hf[name]), name


def test_missing_projection_is_named(ct_tiny: dict[str, Path], tmp_path: Path) -> None:
    for f in ct_tiny["group32-sym"].iterdir():
        shutil.copy(f, tmp_path / f.name)
    state = load_file(tmp_path / "model.safetensors")
    for k in [k for k in state if k.startswith("model.layers.1.mlp.down_proj.")]:
        del state[k]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj"):
        load_quantized(tmp_path, ModelConfig.from_dir(tmp_path))


# -- smollm2-135m, end to end ----------------------------------------------------------------
def _integration_landed() -> bool:
    """Whether the engine serves quantized checkpoints yet (another part of issue 15)."""
    if importlib.util.find_spec("kvguard.engine.layers.quantized_linear") is None:
        return False
    engine_dir = Path(importlib.util.find_spec("kvguard.engine").origin).parent
    sources = [p.read_text() for p in engine_dir.glob("*.py")]
    return any("load_quantized" in s for s in sources)


@pytest.fixture(scope="module")
def ct_smollm2(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """smollm2-135m W4A16, group 64 (128 does not divide its 576-wide hidden size)."""
    dst = tmp_path_factory.mktemp("ct-smollm2") / "smollm2-w4a16-g64"
    return write_ct_checkpoint(smollm2_dir, dst, _args("group", True, 64))


@pytest.fixture(scope="module")
def hf_smollm2_w4a16(ct_smollm2: Path) -> Any:
    return _hf_dequantised(ct_smollm2)


def _serve(path: Path) -> Any:
    from kvguard.engine import EngineConfig, LLMEngine

    config = EngineConfig(model=str(path), kv_cache_bytes="64MiB", num_threads=2)
    return LLMEngine.from_config(config, progress=False)


def _greedy_against(engine: Any, hf: Any, n: int = 32) -> tuple[list[int], int, float]:
    """Our greedy continuations teacher-forced through transformers: per prompt, the first
    position where transformers' argmax differs (-1: none, i.e. the greedy sequences are
    equal), the positions that agree, and the last prompt logit's max|diff|."""
    from kvguard.engine import SamplingParams

    tok = engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    outs = engine.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True))
    first, agree, worst = [], 0, 0.0
    for prompt, out in zip(ids, outs, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0]
        theirs = logits[len(prompt) - 1 :].argmax(-1).tolist()
        same = [a == b for a, b in zip(out.token_ids, theirs, strict=True)]
        first.append(same.index(False) if not all(same) else -1)
        agree += sum(same)
        last = engine.score(prompt)[-1]
        worst = max(worst, (last - logits[len(prompt) - 1]).abs().max().item())
    return first, agree, worst


@pytest.mark.slow
@pytest.mark.xfail(
    not _integration_landed(),
    reason="the engine does not load quantized checkpoints yet (issue 15 item 1: the "
    "QuantizedLinear integration, engine/model.py); this test waits for it",
    raises=ModelLoadError,
    strict=True,
)
def test_smollm2_w4a16_dequantised_greedy_equals_transformers(
    ct_smollm2: Path, hf_smollm2_w4a16: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What kvguard loads is what transformers loads: served through the dequantised (dense)
    kernel, 8 prompts x 32 greedy tokens are equal and the logits agree to fp32 noise."""
    if _integration_landed():  # else the engine refuses the checkpoint: the xfail above
        from kvguard.engine.layers import quantized_linear

        # no engine knob serves a W4A16 checkpoint dequantised yet: pick the dense kernel here
        monkeypatch.setattr(quantized_linear, "pick_kernel", lambda *args, **kwargs: "dense")
    first, _, worst = _greedy_against(_serve(ct_smollm2), hf_smollm2_w4a16)
    print(f"smollm2-135m W4A16 g64, dense: last-logit max|diff| vs transformers {worst:.2e}")
    assert first == [-1] * len(PROMPTS)
    assert worst <= 1e-3


@pytest.mark.slow
@pytest.mark.xfail(
    not _integration_landed(),
    reason="the engine does not load quantized checkpoints yet (issue 15 item 1)",
    raises=ModelLoadError,
    strict=True,
)
def test_smollm2_w4a16_packed_against_transformers(ct_smollm2: Path, hf_smollm2_w4a16: Any) -> None:
    """Served packed (CPU int4pack: bf16 activations), greedy is not bit-equal to fp32
    transformers: it parts at near-ties. Stated, and bounded by teacher-forced agreement."""
    first, agree, worst = _greedy_against(_serve(ct_smollm2), hf_smollm2_w4a16)
    total = 32 * len(PROMPTS)
    print(
        f"smollm2-135m W4A16 g64, packed: greedy equal on {first.count(-1)}/{len(PROMPTS)} "
        f"prompts (first divergence per prompt {first}), teacher-forced top-1 {agree}/{total}, "
        f"last-logit max|diff| vs transformers {worst:.2e}"
    )
    assert agree >= 0.97 * total
