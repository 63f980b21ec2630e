"""A user's own Hugging Face model directory: the tokenizer and generation files read as
transformers reads them, checked against transformers itself and through `kvguard serve` with
the real openai client. special_tokens_map.json's roles, chat_template.jinja before
tokenizer_config.json's template, the `{% generation %}` block, a template that does not
compile (a warning at load, a server error at chat time), tokens the tokenizer added past the
model's vocabulary (a 400 naming them), and generation_config.json's sampling defaults
(`api.generation_config`, `kvguard generate --generation-config`).

The model is a random-weight LlamaForCausalLM (vocabulary 472) with a Llama-2-style tokenizer
written by transformers' LlamaTokenizer: BPE with byte fallback and a BOS post-processor."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import AddedToken, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaTokenizer

from kvguard.daemon.cli import main
from kvguard.engine.model_config import ModelLoadError
from kvguard.engine.tokenizer import ChatTemplateError, Tokenizer
from tests.test_server import Daemon

VOCAB = 472  # the model's: <unk>, <s>, </s>, 256 byte tokens, the trained pieces
ROLES = ("bos_token", "eos_token", "unk_token")
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    " [/INST]{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)
# TRL's assistant-only-loss style: the assistant's turns marked with {% generation %}
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{% set x = 'inner' %} {{ m.content }} {{ eos_token }}{% endgeneration %}{% else %}"
    "[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}{{ x | default('outer') }}"
)
MESSAGES = [
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "The quick fox."},
    {"role": "user", "content": "Héllo wörld 😀"},
]
# the served model's sampling defaults; repetition_penalty is one kvguard cannot apply
GENERATION = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "do_sample": True,
    "temperature": 0.5,
    "top_p": 0.7,
    "top_k": 3,
    "max_new_tokens": 5,
    "repetition_penalty": 1.3,
}
ADDED = ("<tool>", "<think>", "<|im_end|>")  # ids 472, 473, 474: past the model's vocabulary


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama-2-style model directory, saved by transformers."""
    out = tmp_path_factory.mktemp("llama2")
    corpus = [
        "Hello world, this is a test of the tokenizer.",
        "The quick brown fox jumps over the lazy dog.",
        "def main():\n    print('hi')\n    return 0\n",
        "Once upon a time there was a little model.",
    ] * 50
    bpe = RustTokenizer(models.BPE(byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:()'▁")
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    spec = json.loads(bpe.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, legacy=False)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    assert len(vocab) == VOCAB
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def variant(
    base: Path,
    folder: Path,
    config: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    files: dict[str, str] | None = None,
) -> Path:
    """A copy of `base` with tokenizer_config.json updated by `config` less the keys `drop`
    (a transformers class of no defaults of its own: what the files say is what it reads),
    and `files` written (relative path -> text)."""
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(base, folder)
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}
    cfg |= config or {}
    for key in drop:
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg))
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def reference(folder: Path, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """transformers' chat prompt and its token ids for `messages`."""
    hf = AutoTokenizer.from_pretrained(folder)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return text, ids


def ours(folder: Path, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """kvguard's chat prompt and ids (a rendered prompt is encoded without special tokens
    added: the template writes them)."""
    tok = Tokenizer.from_dir(folder)
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return text, tok.encode(text, add_special_tokens=False)


# -- special_tokens_map.json ----------------------------------------------------------------------
MAP_CASES = {
    # an older checkpoint: the roles only in the map, as strings
    "strings": ({}, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    # as AddedToken objects, and a pad token
    "objects": (
        {},
        {
            "bos_token": {"content": "<s>", "lstrip": False, "normalized": False},
            "eos_token": {"content": "</s>", "rstrip": False, "single_word": False},
            "pad_token": "</s>",
        },
    ),
    # a config saved with added_tokens_decoder: transformers does not read the map at all
    "decoder": (
        {"added_tokens_decoder": {"1": {"content": "<s>", "special": True}}},
        {"bos_token": "<s>", "eos_token": "</s>"},
    ),
}


@pytest.mark.parametrize("case", list(MAP_CASES))
def test_special_tokens_map_roles_render_and_encode_as_transformers(
    base_dir: Path, tmp_path: Path, case: str
) -> None:
    """Roles only special_tokens_map.json names fill `{{ bos_token }}`/`{{ eos_token }}` (and
    the eos id) as transformers fills them: the chat prompt and its ids are transformers'."""
    config, roles = MAP_CASES[case]
    files = {"special_tokens_map.json": json.dumps(roles)}
    folder = variant(base_dir, tmp_path / case, config, drop=ROLES, files=files)
    assert ours(folder, MESSAGES) == reference(folder, MESSAGES)
    hf = AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_dir(folder)
    assert tok.special_tokens == {role: getattr(hf, role) for role in ALL_ROLES}
    if case != "decoder":
        assert tok.special_tokens["bos_token"] == "<s>" and tok.eos_token_id == 2


ALL_ROLES = (
    "bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token",
)  # fmt: skip


def test_every_special_token_role_is_a_template_variable_as_in_transformers(
    base_dir: Path, tmp_path: Path
) -> None:
    """sep/cls/mask fill a template as transformers fills them (they had rendered empty), from
    tokenizer_config.json or special_tokens_map.json."""
    template = (
        "{{ cls_token }}{% for m in messages %}{{ m['content'] }}{{ sep_token }}{% endfor %}"
        "{{ mask_token }}"
    )
    roles = {"sep_token": "</s>", "cls_token": "<s>", "mask_token": "<unk>"}
    jinja = {"chat_template.jinja": template}
    folder = variant(base_dir, tmp_path / "config", roles, files=jinja)
    text, ids = ours(folder, MESSAGES)
    assert (text, ids) == reference(folder, MESSAGES)
    assert text.startswith("<s>") and text.endswith("</s><unk>")
    files = jinja | {"special_tokens_map.json": json.dumps(roles)}
    folder = variant(base_dir, tmp_path / "map", files=files)
    assert ours(folder, MESSAGES) == (text, ids) == reference(folder, MESSAGES)


def test_special_tokens_map_wins_over_the_config_as_in_transformers(
    base_dir: Path, tmp_path: Path
) -> None:
    """A config without added_tokens_decoder (saved before it existed): the map's role wins."""
    files = {"special_tokens_map.json": json.dumps({"eos_token": "<unk>"})}
    folder = variant(base_dir, tmp_path / "both", files=files)
    assert AutoTokenizer.from_pretrained(folder).eos_token == "<unk>"
    assert ours(folder, MESSAGES) == reference(folder, MESSAGES)
    assert Tokenizer.from_dir(folder).eos_token_id == 0


# -- a Llama class's default roles ---------------------------------------------------------------
# Meta's Llama-2 template adds bos_token to a string: with no role it is undefined and fails
LLAMA2_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def class_variant(
    base: Path,
    folder: Path,
    config: dict[str, Any],
    drop: tuple[str, ...] = ROLES,
    model: dict[str, Any] | None = None,
    byte_level: bool = False,
    template: str = TEMPLATE,
) -> Path:
    """`variant` with config.json updated by `model`, tokenizer.json's decoder made byte-level
    (Llama 3's, which transformers reads off the file's text) where `byte_level`, and
    `template` as chat_template.jinja."""
    files = {"chat_template.jinja": template}
    if model:
        files["config.json"] = json.dumps(json.loads((base / "config.json").read_text()) | model)
    if byte_level:
        tokenizer = json.loads((base / "tokenizer.json").read_text())
        tokenizer["decoder"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
        }
        files["tokenizer.json"] = json.dumps(tokenizer)
    return variant(base, folder, config, drop=drop, files=files)


def filled_roles(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The load's log lines saying which class defaults it filled in."""
    return [r.getMessage() for r in caplog.records if "defaults filled in" in r.getMessage()]


# how transformers 5 comes to load a directory naming no roles as a Llama class, and which
FILLED_CASES = {
    "llama": ({"tokenizer_class": "LlamaTokenizer"}, (), None, "LlamaTokenizer"),
    "llama_fast": ({"tokenizer_class": "LlamaTokenizerFast"}, (), None, "LlamaTokenizer"),
    "code_llama": ({"tokenizer_class": "CodeLlamaTokenizerFast"}, (), None, "CodeLlamaTokenizer"),
    # tokenizer_config.json names no class: config.json's tokenizer_class is read
    "config_json": (
        {},
        ("tokenizer_class",),
        {"tokenizer_class": "LlamaTokenizer"},
        "LlamaTokenizer",
    ),
}


@pytest.mark.parametrize("case", list(FILLED_CASES))
def test_a_llama_class_fills_the_roles_no_file_names_as_transformers(
    base_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """An older or hand-made Llama-2 directory naming no bos/eos/unk (nor a
    special_tokens_map.json): transformers takes the class's defaults <s>, </s>, <unk>, so
    Llama-2's template renders (it had failed: 'bos_token' is undefined) and the prompt
    starts with BOS, as transformers' does; one INFO line names what was filled and why."""
    config, drop, model, cls = FILLED_CASES[case]
    folder = class_variant(
        base_dir, tmp_path / case, config, ROLES + drop, model, template=LLAMA2_TEMPLATE
    )
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        text, ids = ours(folder, MESSAGES)
    assert (text, ids) == reference(folder, MESSAGES)
    assert text.startswith("<s>[INST] Hello world [/INST] The quick fox. </s><s>[INST]")
    assert ids[0] == 1
    hf = AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_dir(folder)
    assert tok.special_tokens == {role: getattr(hf, role) for role in ALL_ROLES}
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert filled_roles(caplog) == [
        f"{folder}: the tokenizer files name no bos_token, eos_token, unk_token; {cls}'s "
        "defaults filled in, as transformers fills them: bos_token='<s>', eos_token='</s>', "
        "unk_token='<unk>'"
    ]


# no roles named, and transformers 5 loads the directory as it is written: no class defaults
UNFILLED_CASES = {
    "plain": ({}, None, False),  # PreTrainedTokenizerFast
    # a mistral model: transformers loads TokenizersBackend whatever tokenizer_class says
    "mistral_model": ({"tokenizer_class": "LlamaTokenizer"}, {"model_type": "mistral"}, False),
    # a byte-level tokenizer.json labelled LlamaTokenizer (as Llama 3 repos often are)
    "byte_level": ({"tokenizer_class": "LlamaTokenizer"}, None, True),
}


@pytest.mark.parametrize("case", list(UNFILLED_CASES))
def test_no_class_defaults_where_transformers_loads_the_files_as_written(
    base_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Where transformers does not load a Llama class, no roles are made up: `{{ bos_token }}`
    renders empty in both, and nothing is logged as filled."""
    config, model, byte_level = UNFILLED_CASES[case]
    folder = class_variant(base_dir, tmp_path / case, config, model=model, byte_level=byte_level)
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        assert ours(folder, MESSAGES) == reference(folder, MESSAGES)
        tok = Tokenizer.from_dir(folder)
    assert tok.special_tokens == dict.fromkeys(ALL_ROLES)
    assert filled_roles(caplog) == []


def test_roles_a_file_names_are_kept_under_a_llama_class(
    base_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A LlamaTokenizer directory naming its roles is read as before; one naming some (even
    as null) gets the class default for the others only, as in transformers."""
    llama = {"tokenizer_class": "LlamaTokenizer"}
    named = class_variant(base_dir, tmp_path / "named", llama, drop=())
    plain = class_variant(base_dir, tmp_path / "plain", {}, drop=())
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        assert ours(named, MESSAGES) == ours(plain, MESSAGES) == reference(named, MESSAGES)
        assert Tokenizer.from_dir(named).special_tokens == Tokenizer.from_dir(plain).special_tokens
        assert filled_roles(caplog) == []
        some = llama | {"bos_token": None, "eos_token": "<unk>"}
        folder = class_variant(base_dir, tmp_path / "some", some, drop=("unk_token",))
        assert ours(folder, MESSAGES) == reference(folder, MESSAGES)
        tok = Tokenizer.from_dir(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    assert tok.special_tokens == {role: getattr(hf, role) for role in ALL_ROLES}
    assert tok.special_tokens["bos_token"] is None and tok.special_tokens["unk_token"] == "<unk>"
    assert tok.eos_token_id == 0
    assert filled_roles(caplog) == 2 * [
        f"{folder}: the tokenizer files name no unk_token; LlamaTokenizer's defaults filled in, "
        "as transformers fills them: unk_token='<unk>'"
    ]


def test_a_class_default_missing_from_the_vocabulary_is_left_unset(
    base_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A vocabulary without <s>: transformers would add it as a new token, an id past the
    model's embeddings; kvguard leaves bos_token unset and fills the others."""
    folder = class_variant(base_dir, tmp_path / "no_s", {"tokenizer_class": "LlamaTokenizer"})
    file = folder / "tokenizer.json"
    file.write_text(file.read_text().replace('"<s>"', '"<S>"'))
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        tok = Tokenizer.from_dir(folder)
    assert tok.special_tokens["bos_token"] is None
    assert (tok.special_tokens["eos_token"], tok.special_tokens["unk_token"]) == ("</s>", "<unk>")
    assert filled_roles(caplog) == [
        f"{folder}: the tokenizer files name no eos_token, unk_token; LlamaTokenizer's "
        "defaults filled in, as transformers fills them: eos_token='</s>', unk_token='<unk>'"
    ]


# -- which chat template --------------------------------------------------------------------------
def test_chat_template_file_comes_before_tokenizer_config(
    base_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """chat_template.jinja beside a stale `chat_template` in tokenizer_config.json is the one
    rendered, as transformers renders it (a `tool_use` template beside it changes nothing:
    kvguard renders the default); the log says which file served."""
    files = {
        "chat_template.jinja": "NEW {{ messages[0].content }}",
        "additional_chat_templates/tool_use.jinja": "TOOL {{ messages[0].content }}",
    }
    config = {"chat_template": "OLD {{ messages[0].content }}"}
    folder = variant(base_dir, tmp_path / "both", config, files=files)
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        got = ours(folder, MESSAGES)
    assert got == reference(folder, MESSAGES)
    assert got[0] == "NEW Hello world"
    served = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat template")]
    assert served == [
        f"chat template: {folder / 'chat_template.jinja'} (tokenizer_config.json's "
        "chat_template is not used: the file comes first)"
    ]


def test_named_templates_without_a_default_leave_no_template(
    base_dir: Path, tmp_path: Path
) -> None:
    """additional_chat_templates/ with no default: transformers has no template to pick (the
    config's is not used either), and neither has kvguard."""
    files = {"additional_chat_templates/tool_use.jinja": "TOOL"}
    config = {"chat_template": "OLD {{ messages[0].content }}"}
    folder = variant(base_dir, tmp_path / "named", config, files=files)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no default"):
        reference(folder, MESSAGES)
    with pytest.raises(ValueError, match="no chat template"):
        ours(folder, MESSAGES)


# -- {% generation %} and a template that does not compile ---------------------------------------
def test_generation_block_renders_its_body_as_transformers(base_dir: Path, tmp_path: Path) -> None:
    """transformers' `{% generation %}` (TRL's assistant masks): its body as it is, its own
    scope (a `set` inside does not leak out), equal to transformers' prompt and ids."""
    files = {"chat_template.jinja": GENERATION_TEMPLATE}
    folder = variant(base_dir, tmp_path / "gen", files=files)
    text, ids = ours(folder, MESSAGES)
    assert (text, ids) == reference(folder, MESSAGES)
    assert " The quick fox. </s>[INST]" in text and text.endswith("outer")


def test_a_template_that_cannot_compile_warns_at_load(
    base_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Compiled at load: a WARNING naming the file; each chat render then raises the same
    ModelLoadError (the server's fault), and plain text still encodes."""
    files = {"chat_template.jinja": "{% for m in messages %}{% unknowntag %}{% endfor %}"}
    folder = variant(base_dir, tmp_path / "broken", files=files)
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        tok = Tokenizer.from_dir(folder)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert f"the chat template in {folder / 'chat_template.jinja'} does not compile" in warned[0]
    assert "unknowntag" in warned[0]
    with pytest.raises(ModelLoadError, match="chat_template.jinja does not compile"):
        tok.apply_chat_template(MESSAGES)
    assert tok.encode("Hello world")


# without an `is defined` guard, as some published templates are written
NONE_TEMPLATES = {
    "guard": "{% if tools is not none %}T{% endif %}{% if documents is not none %}D{% endif %}"
    "{{ messages[0]['content'] }}",
    "tojson": "{% if tools is not none %}{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}",
}
# refuses one message by raise_exception, and fails on its own bug (str + int) for another
BUGGY_TEMPLATE = (
    "{% if messages[0]['content'] == 'refuse' %}{{ raise_exception('no refusals here') }}"
    "{% elif messages[0]['content'] == 'bug' %}{{ messages | length + 'x' }}{% endif %}"
    "[INST] {{ messages[0]['content'] }} [/INST]"
)


@pytest.mark.parametrize("case", list(NONE_TEMPLATES))
def test_tools_and_documents_are_none_as_in_transformers(
    base_dir: Path, tmp_path: Path, case: str
) -> None:
    """`tools` and `documents` are None without tools, as transformers and vLLM pass them: a
    template testing `tools is not none` renders transformers' prompt (they were undefined:
    the tools branch rendered into every chat prompt, or `tojson` failed on every one)."""
    folder = variant(base_dir, tmp_path / case, files={"chat_template.jinja": NONE_TEMPLATES[case]})
    assert ours(folder, MESSAGES) == reference(folder, MESSAGES)
    assert ours(folder, MESSAGES)[0] == "Hello world"


def test_a_template_s_own_bug_is_the_servers_error_a_refusal_the_messages(
    base_dir: Path, tmp_path: Path
) -> None:
    """A template failing on its own (a TypeError) raises ChatTemplateError naming its file
    and the error (a ModelLoadError: the server's fault); `raise_exception` stays a
    ValueError quoting the template's message."""
    folder = variant(base_dir, tmp_path / "buggy", files={"chat_template.jinja": BUGGY_TEMPLATE})
    tok = Tokenizer.from_dir(folder)
    with pytest.raises(ChatTemplateError) as e:
        tok.apply_chat_template([{"role": "user", "content": "bug"}])
    assert isinstance(e.value, ModelLoadError)
    assert f"the chat template in {folder / 'chat_template.jinja'} fails: TypeError" in str(e.value)
    with pytest.raises(ValueError, match="rejected the messages: no refusals here"):
        tok.apply_chat_template([{"role": "user", "content": "refuse"}])
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "[INST] Hi [/INST]"


# -- served: one daemon with the model's defaults, one without --------------------------------------
@pytest.fixture(scope="module")
def served_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model with three tokens added past its vocabulary, its special roles only in
    special_tokens_map.json, a `{% generation %}` template and sampling defaults."""
    folder = tmp_path_factory.mktemp("served")
    shutil.rmtree(folder)
    shutil.copytree(base_dir, folder)
    hf = AutoTokenizer.from_pretrained(folder)
    hf.add_tokens([AddedToken(ADDED[0], lstrip=True, rstrip=True), AddedToken(ADDED[1])])
    hf.add_special_tokens({"additional_special_tokens": [AddedToken(ADDED[2], special=True)]})
    hf.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    roles = {role: config.pop(role) for role in ROLES}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(roles))
    (folder / "chat_template.jinja").write_text(GENERATION_TEMPLATE)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    assert [hf.convert_tokens_to_ids(t) for t in ADDED] == [VOCAB, VOCAB + 1, VOCAB + 2]
    return folder


@pytest.fixture(scope="module")
def auto_daemon(served_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("auto"),
        debug_hooks=False,
        serving=f"{{model: '{served_dir}', kv_cache_bytes: 8MiB, max_model_len: 512}}",
        api="served_model_name: auto",
    )
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def none_daemon(served_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The same model with generation_config.json not applied and a template that does not
    compile."""
    folder = tmp_path_factory.mktemp("broken")
    shutil.rmtree(folder)
    shutil.copytree(served_dir, folder)
    (folder / "chat_template.jinja").write_text("{% generation %}{{ messages }}")  # no end
    d = Daemon(
        tmp_path_factory.mktemp("none"),
        debug_hooks=False,
        serving=f"{{model: '{folder}', kv_cache_bytes: 8MiB, max_model_len: 512}}",
        api="served_model_name: none, generation_config: none",
    )
    d.folder = folder  # type: ignore[attr-defined]
    yield d
    assert d.stop() == 0


def test_served_chat_prompt_is_transformers(auto_daemon: Daemon, served_dir: Path) -> None:
    """/tokenize of chat messages (the ids a chat request is served with): transformers' ids,
    BOS from special_tokens_map.json, the `{% generation %}` body rendered."""
    r = httpx.post(
        auto_daemon.url + "/tokenize", json={"model": "auto", "messages": MESSAGES}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == reference(served_dir, MESSAGES)[1]


def test_text_past_the_model_vocabulary_is_a_400_naming_the_tokens(
    auto_daemon: Daemon,
) -> None:
    """A text prompt holding a token the tokenizer added past the model's vocabulary: a 400
    naming it (completions: `prompt`; chat: `messages`), as a token-id prompt past it gets;
    the engine never sees it. The load warned once, naming both sizes."""
    c = auto_daemon.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="auto", prompt="a <tool> b", max_tokens=2)
    assert e.value.body["param"] == "prompt"  # type: ignore[index]
    assert "'<tool>' (id 472)" in e.value.message and "[0, 472)" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="auto", messages=[{"role": "user", "content": "x <think> y"}], max_tokens=2
        )
    assert e.value.body["param"] == "messages"  # type: ignore[index]
    assert "'<think>' (id 473)" in e.value.message
    with pytest.raises(openai.BadRequestError, match=r"outside the vocabulary \[0, 472\)"):
        c.completions.create(model="auto", prompt=[1, 474], max_tokens=2)
    ok = c.completions.create(model="auto", prompt="Hello world", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
    log = Path(auto_daemon.log.name).read_text()
    assert "engine step failed" not in log
    warned = [line for line in log.splitlines() if "the tokenizer has 475 tokens" in line]
    assert len(warned) == 1 and "WARNING" in warned[0], log
    assert "vocab_size) is 472" in warned[0] and "'<tool>', '<think>', '<|im_end|>'" in warned[0]


# what a completion request left at OpenAI's defaults asks for, written out
OPENAI_VALUES = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16, "extra": {"top_k": 0}}


def _completion(d: Daemon, model: str, **kw: Any) -> tuple[str, int]:
    r = d.client().completions.create(
        model=model,
        prompt="Hello world",
        seed=7,
        extra_body={"ignore_eos": True, **kw.pop("extra", {})},
        **kw,
    )
    return r.choices[0].text, r.usage.completion_tokens  # type: ignore[union-attr]


def test_generation_config_defaults_what_a_request_leaves_out(auto_daemon: Daemon) -> None:
    """api.generation_config auto (the default): a request leaving temperature, top_p, top_k
    and max_tokens out (or null) samples as one sending the model's generation_config.json
    values; one that sends its own gets them. A chat request's default limit is the model's
    max_new_tokens. The load said what it took, and warned about repetition_penalty, which
    kvguard cannot apply."""
    model_values = {"temperature": 0.5, "top_p": 0.7, "max_tokens": 5, "extra": {"top_k": 3}}
    explicit = _completion(auto_daemon, "auto", **model_values)
    assert explicit[1] == 5
    assert _completion(auto_daemon, "auto") == explicit
    left_null = {"temperature": None, "top_p": None, "max_tokens": None, "extra": {"top_k": None}}
    assert _completion(auto_daemon, "auto", **left_null) == explicit
    own = _completion(auto_daemon, "auto", **OPENAI_VALUES)
    assert own[1] == 16 and own != explicit

    chat = httpx.post(
        auto_daemon.url + "/v1/chat/completions",
        json={"model": "auto", "messages": MESSAGES[:1], "seed": 1},
        timeout=60,
    ).json()
    assert chat["kvguard"]["max_tokens_default"] == 5, chat
    assert chat["usage"]["completion_tokens"] <= 5
    log = Path(auto_daemon.log.name).read_text()
    assert "not applied: repetition_penalty=1.3 (kvguard has no such control)" in log
    assert "sampling defaults temperature=0.5, top_p=0.7, top_k=3, max_tokens=5" in log


def test_generation_config_none_keeps_openais_defaults(
    auto_daemon: Daemon, none_daemon: Daemon
) -> None:
    """api.generation_config none: a request leaving the fields out samples as one sending
    OpenAI's defaults (temperature 1, top_p 1, top_k off, 16 tokens) to the same model."""
    assert _completion(none_daemon, "none") == _completion(auto_daemon, "auto", **OPENAI_VALUES)


def test_a_broken_template_is_the_servers_error_not_the_messages(none_daemon: Daemon) -> None:
    """A template that does not compile: a WARNING at load naming the file, then every chat
    request a 500 saying the server's template is broken (not a 400 blaming `messages`),
    naming the file but not where the host keeps it, not to be retried; completions are
    served."""
    c = none_daemon.client()
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model="none", messages=MESSAGES[:1], max_tokens=2)
    assert e.value.status_code == 500
    assert e.value.body["type"] == "server_error"  # type: ignore[index]
    assert e.value.response.headers["x-should-retry"] == "false"
    assert "this server's chat template is broken" in e.value.message
    assert "chat_template.jinja does not compile" in e.value.message
    assert str(none_daemon.folder) not in e.value.message  # type: ignore[attr-defined]
    assert c.completions.create(model="none", prompt="Hello", max_tokens=2).choices
    log = Path(none_daemon.log.name).read_text()
    warned = [line for line in log.splitlines() if "does not compile" in line]
    assert warned and "WARNING" in warned[0], log


@pytest.fixture(scope="module")
def buggy_daemon(served_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The model with BUGGY_TEMPLATE."""
    folder = tmp_path_factory.mktemp("buggy")
    shutil.rmtree(folder)
    shutil.copytree(served_dir, folder)
    (folder / "chat_template.jinja").write_text(BUGGY_TEMPLATE)
    d = Daemon(
        tmp_path_factory.mktemp("buggyd"),
        debug_hooks=False,
        serving=f"{{model: '{folder}', kv_cache_bytes: 8MiB, max_model_len: 512}}",
        api="served_model_name: buggy",
    )
    d.folder = folder  # type: ignore[attr-defined]
    yield d
    assert d.stop() == 0


def _served_500s(d: Daemon) -> float:
    """The 500s the daemon answered on /v1/chat/completions (kvguard_http_requests_total)."""
    text = httpx.get(d.url + "/metrics", timeout=60).text
    pattern = r'^kvguard_http_requests_total\{route="/v1/chat/completions",status="500"\} (\S+)$'
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_template_failing_on_its_own_is_a_500_a_refusal_a_400(buggy_daemon: Daemon) -> None:
    """A template that fails on its own bug for some messages: a 500 `chat_template_error`
    naming the file (not where the host keeps it) and the error (it was a 400 blaming
    `messages`, which the client cannot fix), with `x-should-retry: false`: the openai client,
    at its default of two retries, sends it once (it sent it three times, with backoff). The
    log has one ERROR line however often it comes, with the file's path, the error and the
    first answer's x-request-id. Its `raise_exception` is a 400 naming `messages` and quoting
    it; other messages are served."""
    c = openai.OpenAI(base_url=buggy_daemon.url + "/v1", api_key="unused", timeout=60)
    assert c.max_retries == 2  # the client's default
    bug: Any = [{"role": "user", "content": "bug"}]
    before = _served_500s(buggy_daemon)
    errors = []
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="buggy", messages=bug, max_tokens=2)
        errors.append(e.value)
    assert _served_500s(buggy_daemon) == before + 2  # one each, none retried
    first = errors[0]
    assert first.response.headers["x-should-retry"] == "false"
    assert first.body["type"] == "server_error"  # type: ignore[index]
    assert first.body["code"] == "chat_template_error"  # type: ignore[index]
    assert "this server's chat template is broken" in first.message
    assert "chat_template.jinja fails: TypeError" in first.message
    template = buggy_daemon.folder / "chat_template.jinja"  # type: ignore[attr-defined]
    assert str(buggy_daemon.folder) not in first.message  # type: ignore[attr-defined]
    log = Path(buggy_daemon.log.name).read_text().splitlines()
    logged = [line for line in log if "chat_template_error" in line]
    assert len(logged) == 1 and " ERROR " in logged[0], logged
    assert f"the chat template in {template} fails: TypeError" in logged[0]
    assert first.request_id and f"request {first.request_id} " in logged[0]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="buggy", messages=[{"role": "user", "content": "refuse"}], max_tokens=2
        )
    assert e.value.body["param"] == "messages"  # type: ignore[index]
    assert "no refusals here" in e.value.message
    messages: Any = [{"role": "user", "content": "Hi"}]
    assert c.chat.completions.create(model="buggy", messages=messages, max_tokens=2).choices


# -- kvguard generate ------------------------------------------------------------------------------
def test_generate_chat_says_a_template_s_bug_in_one_line(
    base_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvguard generate --chat` on a template failing on its own: the one-line error naming
    the template and exit 2, not a Python traceback."""
    folder = variant(base_dir, tmp_path / "buggy", files={"chat_template.jinja": BUGGY_TEMPLATE})
    model = ["--model", str(folder), "--kv-cache-bytes", "8MiB"]
    assert main(["generate", "--chat", *model, "bug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvguard: error: the chat template in ") and "TypeError" in err
    assert len(err.strip().splitlines()) == 1


def _generate(capsys: pytest.CaptureFixture[str], *args: str) -> list[int]:
    assert main(["generate", "--json", "--seed", "3", *args, "Hello world"]) == 0
    return json.loads(capsys.readouterr().out)[0]["token_ids"]


def test_generate_takes_generation_config_defaults(
    served_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvguard generate` fills what its flags leave out from generation_config.json, as
    transformers' generate() does; --generation-config none keeps its own (greedy, 64)."""
    model = ["--model", str(served_dir), "--kv-cache-bytes", "8MiB"]
    flags = ["--temperature", "0.5", "--top-p", "0.7", "--top-k", "3", "--max-tokens", "5"]
    assert _generate(capsys, *model) == _generate(capsys, *model, *flags)
    greedy = ["--temperature", "0", "--max-tokens", "64"]
    assert _generate(capsys, *model, "--generation-config", "none") == _generate(
        capsys, *model, *greedy
    )


def test_max_length_and_stop_strings_are_named_not_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """generation_config.json's max_length (prompt and answer together, transformers' limit
    where max_new_tokens is left out) and stop_strings were ignored without the one warning
    the README promises for what kvguard cannot apply; neutral values still say nothing."""
    from kvguard.engine.llm_engine import generation_defaults

    file = tmp_path / "generation_config.json"
    file.write_text(json.dumps({"max_length": 5, "stop_strings": ["\n\n"], "top_k": 3}))
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        assert generation_defaults(tmp_path, 512) == {"top_k": 3}
    warned = [r for r in caplog.records if "not applied" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "max_length=5 (kvguard has no such control)" in warned[0].getMessage()
    assert "stop_strings=['\\n\\n'] (kvguard has no such control)" in warned[0].getMessage()
    caplog.clear()
    file.write_text(json.dumps({"max_length": None, "stop_strings": [], "top_k": 3}))
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        generation_defaults(tmp_path, 512)
    assert "not applied" not in caplog.text
