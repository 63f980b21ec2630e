"""GGUF files of llama.cpp's `qwen2` architecture (Qwen2, Qwen2.5), which kvguard had refused
("architecture 'qwen2' is not supported"): converted and served as transformers'
`Qwen2ForCausalLM`, with its q/k/v biases, packed (`auto`) and in fp32 (`none`).

llama.cpp's converter reorders the q/k rows of `llama` files for its rope of adjacent pairs,
and not those of `qwen2` ones (their rope rotates halves, as Hugging Face's does): the
reference that the rows and biases are read in the right order is transformers' GGUF loader
on the same file, whose logits kvguard's fp32 model must give.

The files are small random-weight Qwen2 models (hidden 128, two layers, 4 query heads on 2 KV
heads, nonzero biases, rope base 1e6) with the default model's byte-level vocabulary under
`tokenizer.ggml.pre` `qwen2`, quantised by the `gguf` package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from kvguard.engine import LLMEngine
from kvguard.engine import model_registry as reg
from kvguard.engine.gguf_convert import convert_gguf
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from tests.test_gguf_kquants import assert_packed_agrees, assert_transformers_agrees
from tests.test_gguf_variants import engine

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 128, 256, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
VOCAB = 49152  # the default model's
ROPE_BASE = 1e6

# q/k at 4 bits beside an 8-bit v (one fused group at 8 bits), gate/up at 8, o/down at 4
MIXED = {
    "token_embd": Q.Q8_0, "output": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_0,
    "attn_v": Q.Q8_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_0,
}  # fmt: skip
# everything Q8_0, the lm_head tied to the embedding (as in Qwen2.5's small models)
TIED = dict.fromkeys(MIXED, Q.Q8_0)


@pytest.fixture(scope="module")
def tokenizer_fields(model_home: Path) -> list[tuple[str, Any, V, V | None]]:
    """The default GGUF's `tokenizer.*` metadata under `pre` `qwen2`, as Qwen2's files say."""
    r = gguf.GGUFReader(reg.smollm2_gguf(model_home, progress=False))
    out = []
    for key, field in r.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.pre":
            sub = field.types[-1] if field.types[0] == V.ARRAY else None
            out.append((key, field.contents(), field.types[0], sub))
    out.append(("tokenizer.ggml.pre", "qwen2", V.STRING, None))
    return out


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """A Qwen2 model's float weights by GGUF name, q/k rows in Hugging Face's order (llama.cpp
    writes a qwen2 file's so); biases large enough to move every logit."""
    rng = np.random.default_rng(seed)

    def lin(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)

    def bias(rows: int) -> np.ndarray:
        return rng.standard_normal(rows).astype(np.float32)

    out = {"token_embd.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": (0.5 + rng.random(HIDDEN)).astype(np.float32),
            p + "attn_q.weight": lin(HEADS * HEAD_DIM, HIDDEN),
            p + "attn_q.bias": bias(HEADS * HEAD_DIM),
            p + "attn_k.weight": lin(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_k.bias": bias(KV_HEADS * HEAD_DIM),
            p + "attn_v.weight": lin(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_v.bias": bias(KV_HEADS * HEAD_DIM),
            p + "attn_output.weight": lin(HIDDEN, HEADS * HEAD_DIM),
            p + "ffn_norm.weight": (0.5 + rng.random(HIDDEN)).astype(np.float32),
            p + "ffn_gate.weight": lin(INTER, HIDDEN),
            p + "ffn_up.weight": lin(INTER, HIDDEN),
            p + "ffn_down.weight": lin(HIDDEN, INTER),
        }
    out["output_norm.weight"] = (0.5 + rng.random(HIDDEN)).astype(np.float32)
    out["output.weight"] = lin(VOCAB, HIDDEN)
    return out


def write_model(
    path: Path,
    fields: list[Any],
    types: dict[str, Q],
    tied: bool = False,
    arch: str = "qwen2",
    drop: tuple[str, ...] = (),
) -> Path:
    """The `weights()` model as a GGUF of architecture `arch`: each weight in
    `types[its kind]` (F32 if none), biases and norms F32, the lm_head left out when `tied`,
    the tensors in `drop` left out."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(ROPE_BASE)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub)
    for name, arr in weights().items():
        if (tied and name == "output.weight") or name in drop:
            continue
        qtype = types.get(name.split(".")[-2], Q.F32) if name.endswith(".weight") else Q.F32
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tokenizer_fields: list[Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("qwen2")
    return {
        "mixed": write_model(d / "mixed.gguf", tokenizer_fields, MIXED),
        "tied": write_model(d / "tied.gguf", tokenizer_fields, TIED, tied=True),
    }


@pytest.fixture(scope="module")
def served(
    files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[LLMEngine, LLMEngine]]:
    """Each file served packed (`auto`) and in fp32 (`none`)."""
    home = tmp_path_factory.mktemp("home")
    return {k: (engine(p, home, "auto"), engine(p, home, "none")) for k, p in files.items()}


@pytest.mark.parametrize("name", ["mixed", "tied"])
def test_transformers_reads_a_qwen2_file_as_kvguards_fp32_model_does(
    served: dict[str, tuple[LLMEngine, LLMEngine]], files: dict[str, Path], name: str
) -> None:
    """transformers' GGUF loader on the same file (no q/k reordering for qwen2, the biases
    added): the same greedy tokens and logits to fp32 rounding. q/k rows or biases put in
    llama's order, a bias dropped or the wrong rope base move logits by their whole spread."""
    model = assert_transformers_agrees(files[name], served[name][1])
    assert type(model).__name__ == "Qwen2ForCausalLM"


@pytest.mark.parametrize("name", ["mixed", "tied"])
def test_a_packed_qwen2_model_gives_the_fp32_models_tokens(
    served: dict[str, tuple[LLMEngine, LLMEngine]], name: str
) -> None:
    """Greedy tokens as `model_quantization: none` gives them, and every logit along them
    within 5% of the logits' spread (1% on average): the packed model differs only by its
    kernels' fp16 scales and quantised activations."""
    packed, fp32 = served[name]
    assert packed.model_config.architecture == "Qwen2ForCausalLM"
    assert_packed_agrees(packed, fp32)


@pytest.mark.parametrize(("name", "tied"), [("mixed", False), ("tied", True)])
def test_a_qwen2_file_converts_to_a_qwen2_config_with_its_biases(
    files: dict[str, Path], tmp_path: Path, name: str, tied: bool
) -> None:
    """config.json as transformers has Qwen2's (no sliding window, the lm_head tied where the
    file has no `output.weight`); the q/k/v biases stored as the file holds them; packed, the
    layers' weights stay codes (the fused q/k/v of 4-bit q/k and an 8-bit v at 8 bits)."""
    out = tmp_path / "packed"
    convert_gguf(files[name], out, progress=False, packed=True)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["model_type"] == "qwen2"
    assert config["use_sliding_window"] is False
    assert config["tie_word_embeddings"] is tied
    assert config["rope_theta"] == ROPE_BASE
    cfg = ModelConfig.from_dir(out)
    assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.mlp_bias
    assert cfg.sliding_window is None
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    held = load_file(str(out / "model.safetensors"))
    src = weights()
    for i in range(LAYERS):
        for p in "qkv":
            got = held[f"model.layers.{i}.self_attn.{p}_proj.bias"]
            np.testing.assert_array_equal(got, src[f"blk.{i}.attn_{p}.bias"])
    qc = config["quantization_config"]
    assert len(qc["modules"]) == LAYERS * 7 + (1 if tied else 2)
    if not tied:
        assert qc["bits"]["model.layers.0.self_attn.q_proj"] == 8  # fused with the Q8_0 v
        assert qc["bits"]["model.layers.0.self_attn.o_proj"] == 4


def test_a_qwen2_file_without_its_biases_is_refused(
    tokenizer_fields: list[Any], tmp_path: Path
) -> None:
    """llama.cpp requires a qwen2 layer's q/k/v biases: a file without one is truncated or
    foreign, refused at conversion naming the file and the tensor."""
    path = write_model(
        tmp_path / "nobias.gguf", tokenizer_fields, TIED, tied=True, drop=("blk.1.attn_k.bias",)
    )
    pattern = r"nobias\.gguf: missing tensors \['model\.layers\.1\.self_attn\.k_proj\.bias'\]"
    with pytest.raises(ModelLoadError, match=pattern):
        convert_gguf(path, tmp_path / "out", progress=False)


@pytest.mark.parametrize("arch", ["phi3", "gemma"])
def test_other_architectures_are_still_refused_by_name(
    tokenizer_fields: list[Any], tmp_path: Path, arch: str
) -> None:
    """Architectures kvguard does not build are refused before anything is written, naming
    the file and the architecture, in either form."""
    path = write_model(tmp_path / f"{arch}.gguf", tokenizer_fields, TIED, tied=True, arch=arch)
    pattern = (
        rf"{arch}\.gguf: GGUF architecture '{arch}' is not supported \(only 'llama', 'qwen2'\)"
    )
    for packed in (False, True):
        with pytest.raises(ModelLoadError, match=pattern):
            convert_gguf(path, tmp_path / "out", progress=False, packed=packed)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ModelLoadError, match=pattern):
        reg.resolve_model(str(path), tmp_path / "home", progress=False, quantization="none")
