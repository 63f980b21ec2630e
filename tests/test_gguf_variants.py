"""GGUF files a user brings that differ from the default one the way llama.cpp's tools make them:

- RoPE scaling as llama.cpp reads it: the type defaults to `linear`, the factor comes from
  `rope.scaling.factor` or the old converters' `rope.scale_linear`. Such a file had been
  converted with no scaling and served with the wrong positions; it is served with linear
  scaling (the reference: transformers on the same weights with that scaling). Types other
  than none/linear are refused as before.
- a fused projection group (q/k/v, gate/up) whose parts differ in type (`llama-quantize
  --tensor-type attn_v=f16`): it had converted, then been refused at every load. One with an
  unquantised part is served dequantised, with a warning; one mixing 4-bit and 8-bit codes
  (a Q8_0 `attn_k` beside Q4_1 ones) at 8 bits, its 4-bit codes one a byte, said once; both
  give the tokens `model_quantization: none` gives. A copy converted before is converted
  again.

The variants are the default SmolLM2 Q4_1 file rewritten with the `gguf` package (a few tensors
re-typed or a metadata key added); the rest of its bytes are copied as they are.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine
from kvguard.engine import model_registry as reg
from kvguard.engine.gguf_convert import GgufFile, hf_config
from kvguard.engine.model_config import ModelLoadError
from kvguard.engine.sampling_params import SamplingParams
from tests.test_loader_kernel_edges import write_gguf

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
STEPS = 12


def rewrite(
    src: Path,
    dst: Path,
    types: dict[str, Q] | None = None,
    meta: dict[str, tuple[Any, V]] | None = None,
    extra: tuple[tuple[str, np.ndarray], ...] = (),
) -> Path:
    """`src` copied to `dst` with the tensors in `types` re-typed (dequantised, then stored in
    the new type), the metadata in `meta` added or replaced and the `extra` F32 tensors added."""
    types, meta = types or {}, meta or {}
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
            continue
        sub = field.types[-1] if field.types[0] == V.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, vtype) in meta.items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        want = types.get(t.name, t.tensor_type)
        if want == t.tensor_type:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        f = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        if want == Q.F16:
            w.add_tensor(t.name, f.astype(np.float16))
        else:
            w.add_tensor(t.name, gguf.quants.quantize(f, want), raw_dtype=want)
    for name, arr in extra:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def engine(path: Path, home: Path, knob: str) -> LLMEngine:
    cfg = EngineConfig(
        model=str(path), home=home, kv_cache_bytes="16MiB", num_threads=1,
        model_quantization=knob,
    )  # fmt: skip
    return LLMEngine.from_config(cfg, progress=False)


def greedy(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs = eng.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def prompt_ids(eng: LLMEngine, texts: list[str]) -> list[list[int]]:
    outs = eng.generate(texts, SamplingParams(max_tokens=1))
    return [list(o.prompt_token_ids) for o in outs]


PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "def fibonacci(n):\n    # returns the n-th Fibonacci number, counting from zero\n",
]


# -- RoPE scaling ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def with_keys(tiny: Path, tmp: Path, **keys: Any) -> Path:
    """The tiny GGUF with `llama.<key>` metadata added (strings as strings, numbers as f32)."""
    meta = {
        "llama." + k.replace("__", "."): (v, V.STRING if isinstance(v, str) else V.FLOAT32)
        for k, v in keys.items()
    }
    return rewrite(tiny, tmp / "keys.gguf", meta=meta)


@pytest.mark.parametrize(
    ("keys", "want"),
    [
        ({"rope__scale_linear": 4.0}, 4.0),  # the old converters' key: type linear by default
        ({"rope__scaling__factor": 2.5}, 2.5),  # no type key: linear too
        ({"rope__scaling__type": "linear", "rope__scaling__factor": 8.0}, 8.0),
        ({"rope__scaling__factor": 2.0, "rope__scale_linear": 8.0}, 2.0),  # the new key wins
        ({"rope__scaling__type": "none", "rope__scaling__factor": 4.0}, None),  # never scaled
        ({"rope__scaling__factor": 1.0}, None),
        ({"rope__scale_linear": 0.0}, None),  # llama.cpp's "unset"
        ({}, None),
    ],
)
def test_gguf_rope_scaling_is_read_as_llama_cpp_reads_it(
    tiny_gguf: Path, tmp_path: Path, keys: dict[str, Any], want: float | None
) -> None:
    """A factor with no type key (or type `linear`) is linear scaling in llama.cpp; kvguard
    had converted it with none (and refused an explicit `linear`)."""
    config = hf_config(GgufFile(with_keys(tiny_gguf, tmp_path, **keys)))
    expected = None if want is None else {"rope_type": "linear", "factor": want}
    assert config["rope_scaling"] == expected


def test_an_upper_case_gguf_name_is_served_as_a_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    """`Model.Q4_K_M.GGUF` was refused as "neither a model directory nor a .gguf file" (by
    the engine, and by the daemon config's check of serving.model)."""
    from kvguard.daemon.config import _model_path

    upper = tmp_path / "TINY.GGUF"
    upper.write_bytes(tiny_gguf.read_bytes())
    assert _model_path(upper)
    served = greedy(engine(upper, tmp_path / "home", "none"), [[5, 6, 7]])
    assert served == greedy(engine(tiny_gguf, tmp_path / "home2", "none"), [[5, 6, 7]])


def test_a_reload_judges_model_quantization_on_a_gguf_as_the_start_without_converting(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """A reload's check of quantization.model_quantization on a GGUF source is the start's
    rule (`none` its fp32 form, any other value taking `gguf` weights), refusing with the
    start's message, but without the conversion the start makes (minutes for a real model):
    nothing is converted into the cache."""
    from kvguard.daemon.service import CHECKPOINT_KEY, _checkpoint_problem

    home = tmp_path / "home"
    for knob in ("awq_4bit", "gptq_4bit"):
        with pytest.raises(ModelLoadError) as start:
            reg.resolve_model(str(tiny_gguf), home, progress=False, quantization=knob)
        said = [(CHECKPOINT_KEY, str(start.value))]
        assert _checkpoint_problem(str(tiny_gguf), home, knob) == said
    for knob in ("auto", "none", "gguf"):
        assert _checkpoint_problem(str(tiny_gguf), home, knob) == []
    assert not home.exists()  # the cache untouched: nothing converted, fetched or cleaned


@pytest.mark.parametrize(
    ("keys", "rope_freqs", "message"),
    [
        ({"rope__scaling__type": "yarn", "rope__scaling__factor": 4.0}, False, r"\(yarn\)"),
        ({"rope__scaling__type": "longrope"}, False, r"\(longrope\)"),
        ({"rope__scale_linear": -2.0}, False, "llama.rope.scale_linear is -2.0"),
        # divisors no llama3 scaling gives (not monotonic), or not one per frequency
        ({}, [1, 3, 1, 3, 1, 3, 1, 3], "is not llama3 RoPE scaling .*frequency"),
        ({}, [1, 1, 8], "holds 3 values, expected 8 positive ones"),
        ({}, [1, 1, 1, 1, 1, 1, 0, 0], "expected 8 positive ones"),
        # llama.cpp would divide by both: kvguard serves one
        ({"rope__scaling__factor": 2.0}, [1, 1, 1, 1, 1, 1, 8, 8], "both a rope_freqs"),
    ],
)
def test_gguf_rope_scaling_kvguard_cannot_compute_is_refused(
    tiny_gguf: Path, tmp_path: Path, keys: dict[str, Any], rope_freqs: Any, message: str
) -> None:
    extra = (("rope_freqs.weight", np.array(rope_freqs, np.float32)),) if rope_freqs else ()
    meta = {
        "llama." + k.replace("__", "."): (v, V.STRING if isinstance(v, str) else V.FLOAT32)
        for k, v in keys.items()
    }
    path = rewrite(tiny_gguf, tmp_path / "scaled.gguf", meta=meta, extra=extra)
    with pytest.raises(ModelLoadError, match=rf"scaled\.gguf: .*{message}"):
        hf_config(GgufFile(path))


def llama3_divisors(params: dict[str, float], dim: int, base: float) -> np.ndarray:
    """Each rotary frequency's divisor under llama3 scaling, as llama.cpp's converter writes
    them into `rope_freqs.weight` (computed here from transformers' formula, in float64)."""
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    out = []
    for wavelen in 2 * np.pi / inv:
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


META_31 = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip


@pytest.mark.parametrize(
    ("params", "served"),
    [
        (META_31, META_31),  # Llama 3.1's own: read back as they are
        (META_31 | {"factor": 32.0}, META_31 | {"factor": 32.0}),  # Llama 3.2's
        # another original length: the same divisors come from low 1, high 16 at 8192
        (
            {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 32.0,
             "original_max_position_embeddings": 16384},
            {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0,
             "original_max_position_embeddings": 8192},
        ),
        ({"factor": 1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}, None),  # all ones: no scaling
    ],
)  # fmt: skip
def test_a_rope_freqs_tensor_is_served_as_its_llama3_scaling(
    tiny_gguf: Path, tmp_path: Path, params: dict[str, float], served: Any
) -> None:
    """Llama 3.1 and later GGUFs hold their llama3 RoPE scaling as a `rope_freqs` tensor (the
    divisor of each frequency); kvguard refused every such file. Now it reads the parameters
    back, and the frequencies they give are the tensor's (tiny: head dim 16, base 10000)."""
    from kvguard.engine.model import rope_inv_freq
    from kvguard.engine.model_config import ModelConfig

    divisors = llama3_divisors(params, 16, 10000.0)
    path = rewrite(tiny_gguf, tmp_path / "l31.gguf", extra=(("rope_freqs.weight", divisors),))
    config = hf_config(GgufFile(path))
    if served is None:
        assert config["rope_scaling"] is None
        return
    assert config["rope_scaling"] == {"rope_type": "llama3", **served}
    inv = rope_inv_freq(ModelConfig.from_hf_dict(config)).double().numpy()
    plain = 10000.0 ** (-np.arange(0, 16, 2, dtype=np.float64) / 16)
    np.testing.assert_allclose(inv, plain / divisors, rtol=1e-6)


def _transformers_greedy(model_dir: Path, tmp: Path, rope_scaling: Any, prompts: Any) -> Any:
    """transformers' greedy tokens for the fp32 model in `model_dir` with its config.json's
    `rope_scaling` replaced (the weights linked, not copied)."""
    from transformers import AutoModelForCausalLM

    ref = tmp / f"hf-{rope_scaling and rope_scaling['factor']}"
    ref.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (ref / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps(config | {"rope_scaling": rope_scaling}))
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "knob"), [("llama.rope.scale_linear", "none"), ("llama.rope.scaling.factor", "auto")]
)
def test_a_gguf_with_legacy_linear_rope_scaling_is_served_with_it(
    smollm2_gguf: Path, smollm2_dir: Path, tmp_path: Path, key: str, knob: str
) -> None:
    """The default model with a linear factor of 4 in either key llama.cpp reads gives
    transformers' tokens for those weights with linear scaling 4, not the unscaled ones."""
    path = rewrite(smollm2_gguf, tmp_path / "scaled.gguf", meta={key: (4.0, V.FLOAT32)})
    eng = engine(path, tmp_path / "home", knob)
    ids = prompt_ids(eng, PROMPTS)
    served = greedy(eng, ids)
    scaling = {"rope_type": "linear", "factor": 4.0}
    assert eng.model_config.rope_scaling == scaling
    want = _transformers_greedy(smollm2_dir, tmp_path, scaling, ids)
    unscaled = _transformers_greedy(smollm2_dir, tmp_path, None, ids)
    assert want != unscaled  # the scaling shows in these prompts' tokens
    assert served == want


@pytest.mark.slow
def test_a_llama_3_1_style_gguf_is_served_with_its_rope_freqs(
    smollm2_gguf: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    """The default model with a `rope_freqs` tensor added, as llama.cpp writes Llama 3.1's,
    gives transformers' tokens for those weights with that llama3 scaling, not the unscaled
    ones. (Llama 3.1's own band, wavelengths of 2048-8192 positions, barely turns in prompts
    this short: an original length of 64 puts it where these prompts show it.)"""
    config = json.loads((smollm2_dir / "config.json").read_text())
    dim = config["hidden_size"] // config["num_attention_heads"]
    params = META_31 | {"original_max_position_embeddings": 64}
    divisors = llama3_divisors(params, dim, config["rope_theta"])
    extra = (("rope_freqs.weight", divisors),)
    path = rewrite(smollm2_gguf, tmp_path / "l31.gguf", extra=extra)
    eng = engine(path, tmp_path / "home", "auto")
    ids = prompt_ids(eng, PROMPTS)
    served = greedy(eng, ids)
    assert eng.model_config.rope_scaling["rope_type"] == "llama3"
    scaling = {"rope_type": "llama3", **params}
    want = _transformers_greedy(smollm2_dir, tmp_path, scaling, ids)
    unscaled = _transformers_greedy(smollm2_dir, tmp_path, None, ids)
    assert want != unscaled  # the scaling shows in these prompts' tokens
    assert served == want


# -- mixed types in a fused group --------------------------------------------------------------
MIXED = {
    "blk.0.attn_v.weight": Q.F16,  # F16 beside Q4_1 q/k
    "blk.1.attn_k.weight": Q.Q8_0,  # two packed widths in one group
    "blk.2.ffn_up.weight": Q.Q8_0,
    "blk.3.ffn_gate.weight": Q.F16,
    "blk.4.attn_q.weight": Q.Q4_0,  # Q4_0 beside Q4_1: both 4-bit, fused packed
    "blk.5.ffn_down.weight": Q.Q8_0,  # not fused: packed as it is
}


@pytest.fixture(scope="module")
def mixed_gguf(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rewrite(smollm2_gguf, tmp_path_factory.mktemp("mixed") / "mixed.gguf", types=MIXED)


@pytest.mark.slow
def test_a_fused_group_of_mixed_types_is_served_at_one_width(
    mixed_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Converted packed, such a file had been refused at load ("only some are quantized", or
    a bare "cannot fuse 4-bit/group 32/in 576 with 8-bit ...") and left its copy behind. A
    group with an F16 part is stored dequantised (a float weight has no exact codes), one of
    4-bit and 8-bit codes at 8 bits (it had been dequantised too), each kind said once, and the
    model gives the tokens `model_quantization: none` gives."""
    home = tmp_path / "home"
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        packed = engine(mixed_gguf, home, "auto")
    said = [r.getMessage() for r in caplog.records if "fused projection" in r.getMessage()]
    assert len(said) == 2, said
    floats, widths = sorted(said, key=lambda m: "4-bit and 8-bit" in m)
    assert "mixed.gguf: 2 fused projection group(s) mix tensor types" in floats
    assert "layer 0: attn_q Q4_1, attn_k Q4_1, attn_v F16" in floats
    assert "layer 3: ffn_gate F16, ffn_up Q4_1" in floats
    assert "dequantised to fp32" in floats
    assert "mixed.gguf: 2 fused projection group(s) mix 4-bit and 8-bit codes" in widths
    assert "layer 1: attn_q Q4_1, attn_k Q8_0, attn_v Q4_1" in widths
    assert "layer 2: ffn_gate Q4_1, ffn_up Q8_0" in widths
    (copy,) = (home / "models" / "gguf").glob("mixed-*.packed")
    qc = json.loads((copy / "config.json").read_text())["quantization_config"]
    modules, bits = qc["modules"], qc["bits"]
    for i, proj in ((0, "self_attn.q_proj"), (0, "self_attn.v_proj"), (3, "mlp.up_proj")):
        assert f"model.layers.{i}.{proj}" not in modules
    for proj, kind in (("self_attn.q_proj", "Q4_1"), ("self_attn.k_proj", "Q8_0")):
        assert (modules[f"model.layers.1.{proj}"], bits[f"model.layers.1.{proj}"]) == (kind, 8)
    assert bits["model.layers.2.mlp.gate_proj"] == bits["model.layers.2.mlp.up_proj"] == 8
    assert modules["model.layers.0.self_attn.o_proj"] == "Q4_1"
    assert (
        modules["model.layers.4.self_attn.q_proj"],
        bits["model.layers.4.self_attn.q_proj"],
    ) == (
        "Q4_0",
        4,
    )
    assert modules["model.layers.4.self_attn.k_proj"] == "Q4_1"
    assert modules["model.layers.5.mlp.down_proj"] == "Q8_0"
    ids = prompt_ids(packed, PROMPTS)
    assert greedy(packed, ids) == greedy(engine(mixed_gguf, home, "none"), ids)


@pytest.mark.slow
def test_a_copy_converted_before_the_mixed_group_fix_is_converted_again(
    mixed_gguf: Path, tmp_path: Path
) -> None:
    """Converter revision 2 wrote a mixed group packed, a copy no load could take: a copy it
    left is not reused."""
    home = tmp_path / "home"
    first = reg.resolve_model(str(mixed_gguf), home, progress=False, quantization="auto")
    marker = reg._read_marker(first)
    reg._write_marker(first, marker | {"revision": 2})
    (first / "left-by-revision-2").write_text("")
    again = reg.resolve_model(str(mixed_gguf), home, progress=False, quantization="auto")
    assert again == first and not (again / "left-by-revision-2").exists()
    assert reg._read_marker(again)["revision"] == reg.CONVERTER_REVISION
