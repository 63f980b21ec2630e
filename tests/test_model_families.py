"""A user's own Hugging Face directory is served as transformers serves it, or refused by name.

Each case is a small random-weight model that transformers itself builds and saves
(`save_pretrained`, so config.json is in the form transformers writes today), with the tiny
model's tokenizer. kvguard serves the directory in fp32 and transformers runs it: the logits at
every prompt position and the greedy tokens must agree (the tolerance of test_models.py). A
config.json field kvguard cannot serve (a RoPE scaling it does not compute, an activation other
than SiLU, a sliding window longer than the context asked for, a bias the config does not
declare) is refused with its name, never dropped.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from kvguard.engine.config import ConfigError, EngineConfig
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.model import load_model
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.tokenizer import Tokenizer

ATOL = 1e-4  # fp32 logits against transformers, as in test_models.py
STEPS = 4
SHAPE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
ORIGINAL = "original_max_position_embeddings"


def hf_dir(root: Path, tiny_dir: Path, family: str, **overrides: Any) -> Path:
    """A random-weight `family` model saved by transformers, biases and norms away from their
    zero/one initial values (a dropped bias must show), with the tiny model's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / family
    config = AutoConfig.for_model(family, **{**SHAPE, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, path / name)
    return path


def edit_config(path: Path, **fields: Any) -> None:
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))


def serve(path: Path, **knobs: Any) -> LLMEngine:
    config = EngineConfig(model=str(path), kv_cache_bytes="8MiB", num_threads=1, **knobs)
    return LLMEngine.from_config(config, progress=False)


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 259, (n,), generator=gen).tolist() for n in lengths]


def reference(path: Path) -> Any:
    """transformers' model of `path` in fp32 (a compressed one decompressed, as it loads)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # compressed-tensors decompresses on the first call
    return model


def padding_ids(engine: LLMEngine) -> list[int]:
    """The ids of the embedding's rows past the tokenizer's tokens (SHAPE's 320 rows, the
    tiny tokenizer's 259 tokens), which kvguard's lm_head does not compute: transformers'
    logits are compared on the tokens' columns, and its greedy tokens drawn among them."""
    return list(range(engine.runner.vocab, engine.model_config.vocab_size))


def assert_served_as_transformers(path: Path, engine: LLMEngine, *lengths: int) -> None:
    """Logits at every position of each prompt, then STEPS greedy tokens, as transformers'
    (among the tokenizer's tokens: `padding_ids`)."""
    hf = reference(path)
    for ids in prompts(*lengths):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, :, : engine.runner.vocab]
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=STEPS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                suppress_tokens=padding_ids(engine),
            )[0, len(ids) :].tolist()
        got = engine.score(ids).float()
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
        params = SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0)
        assert list(engine.generate([ids], params)[0].token_ids) == out


# -- RoPE: transformers 5 writes scaling as rope_parameters -----------------------------------
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": LLAMA3},
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
        # both keys: transformers reads rope_scaling (and its theta, not rope_parameters')
        {
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        },
    ],
    ids=["llama3", "linear", "rope_scaling-beside-rope_parameters"],
)
def test_rope_scaling_of_rope_parameters_is_served(
    tmp_path: Path, tiny_dir: Path, rope: dict[str, Any]
) -> None:
    path = hf_dir(tmp_path, tiny_dir, "llama")
    edit_config(path, **rope)
    saved = json.loads((path / "config.json").read_text())
    assert "rope_theta" not in saved  # transformers 5 keeps it in rope_parameters only
    engine = serve(path)
    try:
        assert_served_as_transformers(path, engine, 12, 40)
    finally:
        engine.shutdown()


def test_transformers_writes_rope_parameters_only(tmp_path: Path, tiny_dir: Path) -> None:
    """The premise of the cases above: a Llama 3.x model saved today has no rope_scaling."""
    from transformers import AutoConfig

    AutoConfig.for_model("llama", rope_parameters=LLAMA3, **SHAPE).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" not in saved
    assert ModelConfig.from_dir(tmp_path).rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_rope_parameters_kvguard_cannot_compute_are_refused(tmp_path: Path, kind: str) -> None:
    from transformers import AutoConfig

    rope = {"rope_type": kind, "factor": 4.0, "rope_theta": 10000.0}
    if kind == "yarn":
        rope["original_max_position_embeddings"] = 64
    AutoConfig.for_model("llama", rope_parameters=rope, **SHAPE).save_pretrained(tmp_path)
    with pytest.raises(
        ModelLoadError, match=rf"rope_parameters type '{kind}' is not supported \(default, linear"
    ):
        ModelConfig.from_dir(tmp_path)


# a Phi-3-style top-level original_max_position_embeddings: transformers' rotary embedding
# takes it over the RoPE dict's own (standardize_rope_params' "Phi3 exception")
TOP_LEVEL_ORIGINAL = {
    "over-rope_parameters": ("llama", {"original_max_position_embeddings": 128}),
    "rope_parameters-without-one": (
        "llama",
        {
            "rope_parameters": {k: v for k, v in LLAMA3.items() if k != ORIGINAL},
            "original_max_position_embeddings": 64,
        },
    ),
    "over-rope_scaling": (  # the Hub's transformers 4 form
        "llama",
        {
            "rope_parameters": None,
            "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"},
            "rope_theta": LLAMA3["rope_theta"],
            "original_max_position_embeddings": 128,
        },
    ),
    "qwen2": ("qwen2", {"original_max_position_embeddings": 128}),
}


@pytest.mark.parametrize("case", list(TOP_LEVEL_ORIGINAL))
def test_top_level_original_max_position_embeddings_is_served_as_transformers(
    tmp_path: Path, tiny_dir: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    family, fields = TOP_LEVEL_ORIGINAL[case]
    path = hf_dir(tmp_path, tiny_dir, family, rope_parameters=LLAMA3)
    edit_config(path, **fields)
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        engine = serve(path)
    try:
        assert engine.model_config.rope_scaling[ORIGINAL] == fields[ORIGINAL]
        if case != "rope_parameters-without-one":  # 32 inside: the two named
            assert f"{ORIGINAL} is {fields[ORIGINAL]} at the top level and 32" in caplog.text
        assert_served_as_transformers(path, engine, 12, 40)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("value", [None, 0, "128"])
def test_a_malformed_top_level_original_max_position_embeddings_is_refused(
    tmp_path: Path, value: Any
) -> None:
    """transformers puts it into llama3's arithmetic as it is (and fails there)."""
    from transformers import AutoConfig

    AutoConfig.for_model("llama", rope_parameters=LLAMA3, **SHAPE).save_pretrained(tmp_path)
    edit_config(tmp_path, original_max_position_embeddings=value)
    with pytest.raises(
        ModelLoadError, match=rf"{ORIGINAL} is {value!r}; llama3 scaling needs a positive number"
    ):
        ModelConfig.from_dir(tmp_path)


# -- sliding window -----------------------------------------------------------------------------
WINDOWED = {
    "mistral": {"sliding_window": 16},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    # transformers' Llama attends past it in one forward but keeps a window's KV when it
    # generates: within the window the two agree
    "llama": {"sliding_window": 16},
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_window_model_is_served_within_its_window(
    tmp_path: Path, tiny_dir: Path, family: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No windowed attention in kvguard: max_model_len (at its default) is held to the window,
    where attention is the same, and said so; a prompt past it is refused."""
    path = hf_dir(tmp_path, tiny_dir, family, **WINDOWED[family])
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        engine = serve(path)
    try:
        assert engine.max_model_len == 16
        assert "sliding_window 16: serving.max_model_len is held to 16" in caplog.text
        assert_served_as_transformers(path, engine, 12)
        with pytest.raises(ValueError, match="max_model_len=16"):
            engine.generate(prompts(17), SamplingParams(max_tokens=1))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", list(WINDOWED))
def test_max_model_len_set_past_the_window_is_refused(
    tmp_path: Path, tiny_dir: Path, family: str
) -> None:
    path = hf_dir(tmp_path, tiny_dir, family, **WINDOWED[family])
    with pytest.raises(ConfigError, match=r"max_model_len 64 is more than .*sliding_window 16"):
        serve(path, max_model_len=64)


@pytest.mark.parametrize(
    ("family", "fields"),
    [
        ("mistral", {"sliding_window": None}),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 16}),  # transformers: no window
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}),
    ],
    ids=["mistral-null", "qwen2-off", "qwen2-no-window-layer"],
)
def test_a_window_transformers_does_not_apply_changes_nothing(
    tmp_path: Path, tiny_dir: Path, family: str, fields: dict[str, Any]
) -> None:
    path = hf_dir(tmp_path, tiny_dir, family, **fields)
    engine = serve(path)
    try:
        assert engine.max_model_len == SHAPE["max_position_embeddings"]
        assert_served_as_transformers(path, engine, 40)
    finally:
        engine.shutdown()


# -- the MLP's activation ---------------------------------------------------------------------
def test_hidden_act_other_than_silu_is_refused(tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("llama", hidden_act="gelu", **SHAPE).save_pretrained(tmp_path)
    with pytest.raises(
        ModelLoadError, match="hidden_act 'gelu' is not supported: kvguard's MLP is SiLU-gated"
    ):
        ModelConfig.from_dir(tmp_path)


def test_swish_is_silu(tmp_path: Path, tiny_dir: Path) -> None:
    path = hf_dir(tmp_path, tiny_dir, "llama", hidden_act="swish")
    engine = serve(path)
    try:
        assert_served_as_transformers(path, engine, 12)
    finally:
        engine.shutdown()


# -- projection biases --------------------------------------------------------------------------
BIASED = {
    "llama-attention_bias": ("llama", {"attention_bias": True}),  # q, k, v and o
    "llama-mlp_bias": ("llama", {"mlp_bias": True}),  # gate, up and down
    # transformers builds Qwen2's q/k/v biases and no Mistral bias, whatever the field says
    "qwen2-attention_bias-false": ("qwen2", {"attention_bias": False}),
    "mistral-attention_bias-true": ("mistral", {"attention_bias": True, "sliding_window": None}),
}


@pytest.mark.parametrize("case", list(BIASED))
def test_biases_are_applied_as_transformers_builds_them(
    tmp_path: Path, tiny_dir: Path, case: str
) -> None:
    family, fields = BIASED[case]
    path = hf_dir(tmp_path, tiny_dir, family, **fields)
    engine = serve(path)
    try:
        assert_served_as_transformers(path, engine, 12, 40)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("fields", "dropped"),
    [
        ({"attention_bias": True}, ("o_proj.bias",)),
        ({"mlp_bias": True}, ("gate_proj.bias", "up_proj.bias", "down_proj.bias")),
    ],
    ids=["o_proj", "mlp"],
)
def test_declared_biases_a_checkpoint_leaves_out_are_zero_as_in_transformers(
    tmp_path: Path, tiny_dir: Path, fields: dict, dropped: tuple[str, ...]
) -> None:
    """A Llama `attention_bias` checkpoint holding only q/k/v's biases (what converters from
    Qwen-style models write), or an `mlp_bias` one holding none: transformers serves the
    missing ones as zeros, and so does kvguard (it refused the first: a tensor missing)."""
    path = hf_dir(tmp_path, tiny_dir, "llama", **fields)
    weights = load_file(path / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.endswith(dropped)}
    assert len(kept) < len(weights)
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    engine = serve(path)
    try:
        assert_served_as_transformers(path, engine, 12, 40)
    finally:
        engine.shutdown()


def test_a_bias_the_config_does_not_declare_is_refused_by_name(
    tmp_path: Path, tiny_dir: Path
) -> None:
    path = hf_dir(tmp_path, tiny_dir, "llama", attention_bias=True)
    edit_config(path, attention_bias=False)
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.k_proj\.bias'"):
        serve(path)
    weights = load_file(path / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.endswith(("q_proj.bias", "k_proj.bias"))}
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.o_proj\.bias'"):
        serve(path)
    # a bias of zeros changes nothing (some quantisers write one for every projection)
    zeros = {k: (v.zero_() if k.endswith(".bias") else v) for k, v in kept.items()}
    save_file(zeros, path / "model.safetensors", metadata={"format": "pt"})
    serve(path)


@pytest.mark.parametrize(
    ("family", "fields", "built"),
    [
        ("qwen2", {"architectures": ["LlamaForCausalLM"]}, "Qwen2ForCausalLM"),
        (
            "llama",
            {"architectures": ["Qwen2ForCausalLM"], "attention_bias": True},
            "LlamaForCausalLM",
        ),
    ],
    ids=["qwen2-labelled-llama", "llama-labelled-qwen2"],
)
def test_architectures_and_model_type_naming_different_models_are_refused(
    tmp_path: Path, tiny_dir: Path, family: str, fields: dict[str, Any], built: str
) -> None:
    """transformers builds model_type's class, vLLM architectures': refused naming both,
    rather than blaming a bias that model_type's model has."""
    path = hf_dir(tmp_path, tiny_dir, family, **fields)
    edit_config(path, architectures=fields["architectures"])  # save_pretrained writes its own
    assert type(reference(path)).__name__ == built
    label = fields["architectures"][0]
    with pytest.raises(
        ModelLoadError,
        match=rf"architectures names {label} but model_type '{family}' names {built}, "
        rf"different models \(transformers builds model_type's {built}",
    ):
        serve(path)


# -- projection biases on the packed (quantized) path and under tensor parallelism -------------
# packed W4A16 against transformers' decompressed weights: measured 2e-3 at tp=1 and 1.2e-2
# at tp=2 (the w4a8 kernels' int8 activations, quantised over each rank's slice); a bias
# dropped, or a row-parallel bias added on every rank, moves the logits by about 1
PACKED_ATOL = 5e-2


def compressed(path: Path) -> Path:
    """`path`'s projections W4A16-compressed by compressed-tensors (biases stay plain)."""
    from tests.test_quant_loaders import _args, write_ct_checkpoint

    return write_ct_checkpoint(path, path.parent / f"{path.name}-w4a16", _args("group", True, 32))


def test_packed_biases_are_applied(tmp_path: Path, tiny_dir: Path) -> None:
    path = compressed(hf_dir(tmp_path, tiny_dir, "llama", attention_bias=True, mlp_bias=True))
    hf, engine = reference(path), serve(path)
    try:
        for ids in prompts(12, 40):
            with torch.no_grad():
                ref = hf(torch.tensor([ids])).logits[0, :, : engine.runner.vocab]
            torch.testing.assert_close(engine.score(ids).float(), ref, atol=PACKED_ATOL, rtol=0)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_tensor_parallel_biases_are_applied_once(
    tmp_path: Path, tiny_dir: Path, packed: bool
) -> None:
    """tp=2: gate/up and q/k/v biases split with their rows, o_proj's and down_proj's added
    once after the all-reduce; every step's logits as transformers' on the same tokens."""
    from tests.test_tp_model import prompt_vocab, run_ranks
    from tests.test_tp_model import prompts as tp_prompts

    path = hf_dir(tmp_path, tiny_dir, "llama", attention_bias=True, mlp_bias=True)
    if packed:
        path = compressed(path)
    out = tmp_path / "out"
    out.mkdir()
    got = run_ranks(path, 2, out)  # logits [steps + 1, prompts, vocab], tokens [steps + 1][prompts]
    hf = reference(path)
    ref = []
    for i, ids in enumerate(tp_prompts(prompt_vocab(ModelConfig.from_dir(path)))):
        fed = ids + [step[i] for step in got["tokens"][:-1]]
        with torch.no_grad():
            ref.append(hf(torch.tensor([fed])).logits[0, len(ids) - 1 :])
    atol = PACKED_ATOL if packed else ATOL
    torch.testing.assert_close(got["logits"], torch.stack(ref, 1), atol=atol, rtol=0)


def test_a_packed_checkpoints_undeclared_bias_is_refused_by_name(
    tmp_path: Path, tiny_dir: Path
) -> None:
    path = compressed(hf_dir(tmp_path, tiny_dir, "llama", mlp_bias=True))
    edit_config(path, mlp_bias=False)
    cfg = ModelConfig.from_dir(path)
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.down_proj\.bias'"):
        load_model(path, cfg, 64, torch.float32, torch.device("cpu"))


# -- which tokenizer class a directory labelled LlamaTokenizer is loaded with ---------------
LLAMA_ROLES = ("bos_token", "eos_token", "unk_token")


def llama_labelled_dir(folder: Path, byte_level: bool, marked: bool) -> Path:
    """A tokenizer.json with <unk>, <s> and </s> in its vocabulary, labelled LlamaTokenizer and
    naming no roles: SentencePiece-style (byte fallback, a Metaspace-like normalizer and
    decoder) or Llama-3-style byte-level (ByteLevel inside a Sequence pre-tokenizer, and the
    decoder); `marked` puts the text "ByteLevel" in it as a vocabulary entry and, quoted, as
    an added token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz", *(["ByteLevel"] if marked else [])]:
        vocab.setdefault(piece, len(vocab))
    tok = RustTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    if byte_level:
        split = pre_tokenizers.Split(Regex(r"\s+|\w+"), "isolated")
        byte = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte])
        tok.decoder = decoders.ByteLevel()
    else:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    if marked:
        tok.add_tokens(['"ByteLevel"'])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return folder


@pytest.mark.parametrize("byte_level", [False, True], ids=["sentencepiece", "byte_level"])
def test_a_llama_labelled_tokenizer_is_byte_level_by_its_parts_not_its_text(
    tmp_path: Path, byte_level: bool
) -> None:
    """A LlamaTokenizer-labelled directory naming no roles gets the class defaults <s>, </s>,
    <unk> unless its pre-tokenizer or decoder is ByteLevel. The text "ByteLevel" in its
    vocabulary or added tokens changes nothing: the roles are those transformers gives the
    same files without that text. (transformers 5.25 itself searches the file's text for
    '"ByteLevel"' and is fooled by such a vocabulary; kvguard follows what that check means,
    a ByteLevel pre-tokenizer or decoder, not its text search.)"""
    from transformers import AutoTokenizer

    plain = llama_labelled_dir(tmp_path / "plain", byte_level, marked=False)
    marked = llama_labelled_dir(tmp_path / "marked", byte_level, marked=True)
    assert '"ByteLevel"' in (marked / "tokenizer.json").read_text()
    hf = AutoTokenizer.from_pretrained(plain)
    expected = {role: getattr(hf, role) for role in LLAMA_ROLES}
    filled = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert expected == (dict.fromkeys(LLAMA_ROLES) if byte_level else filled)
    for folder in (plain, marked):
        tok = Tokenizer.from_dir(folder)
        assert {role: tok.special_tokens[role] for role in LLAMA_ROLES} == expected, folder.name
