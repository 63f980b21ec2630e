"""GGUF tokenizers beyond SmolLM2's: SentencePiece (`tokenizer.ggml.model` `llama`: Llama 2,
Mistral) and byte-level BPE with the splits of Llama 3 (`llama-bpe`), Qwen2 and Mistral's
Tekken. kvguard had refused them all.

A GGUF is llama.cpp's file, and its models were trained with the tokenizer llama.cpp copies, so
a SentencePiece vocabulary encodes as llama.cpp encodes it, proven against the `sentencepiece`
package itself: a BPE model trained here on CORPUS (byte fallback, control and user-defined
symbols), its pieces, scores and types copied into a GGUF as llama.cpp's converter copies them,
and every text encoded as llama.cpp does (`llama_cpp_ids`): cut at the added tokens, each piece
of text between them encoded by sentencepiece, with its dummy prefix. That is where kvguard
parts from transformers 5, which reads the same GGUF with a `▁` only at the start of the whole
text, and none where the text starts with a space: for a Llama 2 chat prompt `<s>[INST] Hi` it
gives `[` after BOS where Meta's tokenizer and llama.cpp give `▁[`, and one `▁` for " Hello"
where they give two. Transformers stays the reference where the two agree: decoding, the merges
read off the scores (ties included, on a vocabulary built here), and text with no added token
that starts with no space.

Byte-level BPE has no such prefix; there the reference is transformers' tokenizer for the same
GGUF (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`). kvguard's incremental
detokenisation must give the text a full decode gives. Two settings llama.cpp reads and
transformers ignores are checked against llama.cpp's rule: `add_space_prefix` false, and the
Llama 3 vocabularies taking a whole-token word as that token (`ignore_merges`).

The files are written here: a tiny random-weight llama with a SentencePiece vocabulary (the
trained one, or one built from CORPUS with tied scores), or with the default model's
byte-level vocabulary under another `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoTokenizer

from kvguard.engine import EngineConfig, LLMEngine
from kvguard.engine.detokenizer import append_token
from kvguard.engine.gguf_convert import convert_gguf
from kvguard.engine.model_config import ModelLoadError
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.sequence import Sequence, Status
from kvguard.engine.tokenizer import Tokenizer
from kvguard.engine.tokenizer_build import byte_alphabet

T = gguf.TokenType
SPACE = "\u2581"
ADDED = (T.CONTROL, T.UNKNOWN, T.USER_DEFINED)  # the types llama.cpp cuts the text at

CORPUS = """The quick brown fox jumps over the lazy dog. Hello world, hello there!
It's a test of the tokenizer: numbers 12345 and 2024, spaces   and tabs\tand new lines.
Llama models use SentencePiece with byte fallback for characters they have never seen.
The model reads the prompt, then writes the answer one token at a time, and the server
streams each piece of text as soon as it is whole. Caf\u00e9 na\u00efve r\u00e9sum\u00e9.
def main(argv):
    for item in argv:
        if item.startswith("--"):
            print("option", item)
    return 42
"""

# leading, trailing and runs of spaces, newlines, tabs, digit runs, accents, CJK and emoji
# (byte fallback), special-token text mid-text, the empty string
TRICKY = [
    "Hello world",
    " Hello",
    "  two  spaces ",
    "trailing   ",
    "a\n\tb\n\n  x",
    "\n",
    " ",
    "12345 2024 1234567",
    "Caf\u00e9 na\u00efve \u00e9t\u00e9",
    "\u65e5\u672c\u8a9e \U0001f999 \u00e0 la carte",
    "x<s>y</s> <|user|>hi <|assistant|> ok",
    "<unk> and <s>",
    "I'm here, they'LL go; CamelCaseWord HTTPServer",
    'def f(x):\n    return x**2  # "ok"\r\n',
    "",
]
# where llama.cpp puts a `▁` that transformers does not: after a special or user-defined token
# (the text's first, a chat prompt's), before text that is only spaces, next to other tokens
EDGES = [
    "<s>[INST] Hi [/INST]",
    "<s> a",
    "<s>  ",
    " <s> ",
    "</s>",
    "a</s>",
    "<|user|>\n<|assistant|>",
    "<|assistant|><|assistant|>x",
    "<|assistant|>  two",
    "x<unk>y<|user|>",
]
TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def spm_vocab(merges: int = 400) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece BPE vocabulary as llama.cpp stores one: `<unk>`, `<s>`, `</s>`, the 256
    byte pieces, then pieces learnt from CORPUS (words with their `▁`, runs of `▁`) scored
    from -0 down in the order learnt, the characters last; a control and a user-defined token
    at the end. Every 9th learnt piece shares the score before it (ties are ranked too)."""
    text = SPACE + CORPUS.replace(" ", SPACE)
    words = collections.Counter(re.findall(f"{SPACE}+(?=[^{SPACE}]|$)|{SPACE}?[^{SPACE}]+", text))
    split = {w: list(w) for w in words}
    learnt: list[str] = []
    for _ in range(merges):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w, n in words.items():
            for a, b in zip(split[w], split[w][1:], strict=False):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _n = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        for w, parts in split.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            split[w] = out
        if a + b not in learnt:
            learnt.append(a + b)
    chars = sorted({c for w in words for c in w} - set(learnt))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL, *[T.BYTE] * 256]
    scores = [0.0] * len(tokens)
    score = 0.0
    for i, piece in enumerate([*learnt, *chars]):
        tokens.append(piece)
        types.append(T.NORMAL)
        scores.append(score)
        if i % 9 != 8:
            score -= 1.0
    tokens += ["<|user|>", "<|assistant|>"]
    types += [T.CONTROL, T.USER_DEFINED]
    scores += [0.0, 0.0]
    return tokens, scores, [int(t) for t in types]


def write_tiny(path: Path, vocab: int, tokenizer: Callable[[gguf.GGUFWriter], None]) -> Path:
    """A one-layer llama GGUF with random F32 weights, `vocab` rows in the embedding and in an
    untied lm_head (a tied one makes the random model repeat its input), its tokenizer
    metadata written by `tokenizer`."""
    rng = np.random.default_rng(0)
    hidden, inter, heads, kv_heads = 32, 64, 4, 2
    hd = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(inter)
    w.add_rope_dimension_count(hd)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tokenizer(w)

    def lin(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)

    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    for name, arr in [
        ("attn_norm", np.ones(hidden, np.float32)),
        ("attn_q", lin(heads * hd, hidden)),
        ("attn_k", lin(kv_heads * hd, hidden)),
        ("attn_v", lin(kv_heads * hd, hidden)),
        ("attn_output", lin(hidden, heads * hd)),
        ("ffn_norm", np.ones(hidden, np.float32)),
        ("ffn_gate", lin(inter, hidden)),
        ("ffn_up", lin(inter, hidden)),
        ("ffn_down", lin(hidden, inter)),
    ]:
        w.add_tensor(f"blk.0.{name}.weight", arr)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def spm_gguf(
    path: Path, vocab: tuple[list[str], list[float], list[int]] | None = None, **flags: bool
) -> Path:
    """The SentencePiece model (`vocab`, else `spm_vocab()`'s); `flags`: add_bos_token,
    add_eos_token, add_space_prefix (absent: not written, as old files do)."""
    tokens, scores, types = vocab or spm_vocab()

    def tokenizer(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        for key, value in flags.items():
            w.add_bool(f"tokenizer.ggml.{key}", value)
        w.add_chat_template(TEMPLATE)

    return write_tiny(path, len(tokens), tokenizer)


# -- the sentencepiece reference -------------------------------------------------------------
USER_DEFINED = ["<|assistant|>"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> spm.SentencePieceProcessor:
    """A BPE model trained by sentencepiece on CORPUS as Llama 2's was: byte fallback, text
    taken as it is (no normalization, spaces kept), a dummy prefix, digits apart; `<s>`,
    `</s>`, the control `<|user|>` and the user-defined `<|assistant|>`. One thread and a
    fixed seed: the same pieces every run."""
    d = tmp_path_factory.mktemp("sp")
    (d / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), model_type="bpe",
        vocab_size=500, byte_fallback=True, control_symbols=["<|user|>"],
        user_defined_symbols=USER_DEFINED, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        allow_whitespace_only_pieces=True, character_coverage=1.0, num_threads=1,
        minloglevel=2,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_file=str(d / "sp.model"))


def sp_vocab(sp: spm.SentencePieceProcessor) -> tuple[list[str], list[float], list[int]]:
    """The model's pieces, scores and types as llama.cpp's converter writes them into a GGUF:
    unknown, control and byte pieces so typed, a user-defined one USER_DEFINED (the converter
    reads that from the added tokens transformers lists beside the model), the rest NORMAL."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        kind = T.NORMAL
        if sp.is_unknown(i):
            kind = T.UNKNOWN
        elif sp.is_control(i):
            kind = T.CONTROL
        elif sp.is_byte(i):
            kind = T.BYTE
        elif piece in USER_DEFINED:
            kind = T.USER_DEFINED
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(int(kind))
    return tokens, scores, types


def llama_cpp_ids(
    sp: spm.SentencePieceProcessor, added: dict[str, int], text: str, *ends: int | None
) -> list[int]:
    """llama.cpp's encoding of a SentencePiece vocabulary, sentencepiece encoding the text: cut
    at the added tokens (control, unknown and user-defined; the longest first where they
    overlap), and each piece of text between them encoded on its own, which puts
    sentencepiece's dummy prefix, a `▁`, before each. `ends`: BOS before and EOS after, where
    not None."""
    bos, eos = ends or (None, None)
    ids = [] if bos is None else [bos]
    cut = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
    for part in re.split(f"({cut})", text):
        if part in added:
            ids.append(added[part])
        elif part:
            ids += sp.encode(part)
    return ids + ([] if eos is None else [eos])


def converted(gguf_path: Path) -> tuple[Tokenizer, object]:
    """kvguard's tokenizer over the converted directory, and transformers' over the GGUF."""
    out = gguf_path.parent / "out"
    convert_gguf(gguf_path, out, progress=False)
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return Tokenizer.from_dir(out), ref


def assert_parity(ours: Tokenizer, ref: object, texts: list[str]) -> None:
    for text in texts:
        for special in (False, True):
            want = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, special) == want, (text, special)
        ids = ref.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text


def run_tokens(tok: Tokenizer, prompt: list[int], ids: list[int]) -> tuple[str, list[str]]:
    """`ids` fed to the detokenizer as if sampled after `prompt`: the answer's text and the
    pieces a stream would have sent."""
    params = SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True)
    seq = Sequence("r", list(prompt), params, 1, 0, 10_000)
    deltas, shown = [], 0
    for t in ids:
        append_token(tok, seq, t, set())
        deltas.append(seq.text[shown:])
        shown = len(seq.text)
    seq.status = Status.FINISHED
    return seq.text, deltas


# -- SentencePiece ---------------------------------------------------------------------------
SPM_FLAGS = pytest.mark.parametrize(
    "flags",
    [
        {"add_bos_token": True, "add_eos_token": False, "add_space_prefix": True},
        {"add_bos_token": False, "add_eos_token": True},
        {},  # an old file: BOS added all the same
    ],
    ids=["llama2", "eos-no-bos", "no-flags"],
)


@SPM_FLAGS
def test_sentencepiece_gguf_encodes_as_llama_cpp(
    tmp_path: Path, sp_model: spm.SentencePieceProcessor, flags: dict[str, bool]
) -> None:
    """A vocabulary sentencepiece trained, in a GGUF: every text (special and user-defined
    token text in it, at its start too) encodes as llama.cpp encodes it with sentencepiece
    doing each piece of text, BOS/EOS as the file asks; the ids decode, whole and token by
    token after a prompt, as sentencepiece decodes them; text without added tokens comes back
    exactly, leading spaces included."""
    tokens, scores, types = sp_vocab(sp_model)
    path = spm_gguf(tmp_path / "sp.gguf", (tokens, scores, types), **flags)
    convert_gguf(path, tmp_path / "out", progress=False)
    ours = Tokenizer.from_dir(tmp_path / "out")
    added = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k in ADDED}
    assert set(added) == {"<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"}
    bos = 1 if flags.get("add_bos_token", True) else None
    eos = 2 if flags.get("add_eos_token", False) else None
    prompt = [1, *ours.encode("The answer is")]
    for text in [*EDGES, *TRICKY, CORPUS, CORPUS.upper()]:
        ids, full = ours.encode(text), ours.encode(text, True)
        assert ids == llama_cpp_ids(sp_model, added, text), text
        assert full == llama_cpp_ids(sp_model, added, text, bos, eos), text
        if 0 in full:  # sentencepiece spells <unk> " ⁇ "; kvguard, a special token, leaves it out
            continue
        assert ours.decode(full) == sp_model.decode(full), text
        got, _ = run_tokens(ours, prompt, ids)
        assert got == sp_model.decode(prompt + ids)[len(sp_model.decode(prompt)) :], text
        if not added.keys() & set(re.findall("<[^>]*>", text)):
            assert ours.decode(ids) == text
    # Meta's chat prompt: a `▁` after BOS, two for a text starting with a space
    assert ours.id_to_token(ours.encode("<s>[INST] Hi [/INST]")[1]) == SPACE
    assert ours.id_to_token(ours.encode(" Hello")[0]) == SPACE * 2


@SPM_FLAGS
def test_sentencepiece_gguf_decodes_as_transformers(tmp_path: Path, flags: dict[str, bool]) -> None:
    """Decoding is transformers' for the same GGUF; so is encoding, for text with no added
    token that starts with no space (elsewhere transformers puts no `▁`: the test above)."""
    ours, ref = converted(spm_gguf(tmp_path / "spm.gguf", **flags))
    plain = [t for t in TRICKY if "<" not in t and not t[:1].isspace()]
    assert len(plain) > 8
    assert_parity(ours, ref, plain)
    for text in TRICKY:
        ids = ours.encode(text, True)
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text
    bos, eos = flags.get("add_bos_token", True), flags.get("add_eos_token", False)
    assert ours.encode("", True) == [1] * bos + [2] * eos
    # a character no piece holds is spelled in bytes, and decodes back whole
    emoji = ours.encode("\U0001f999", False)
    assert [ours.id_to_token(i) for i in emoji] == [SPACE, "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    # byte pieces that are no whole character decode as transformers decodes them
    for ids in (emoji[:3], emoji[2:], [emoji[1], 300, emoji[2]], emoji[1:] + emoji[1:]):
        assert ours.decode(ids) == ref.decode(ids), ids
    user = spm_vocab()[0].index("<|user|>")
    assert ours.special_token_ids() == {"<unk>": 0, "<s>": 1, "</s>": 2, "<|user|>": user}
    assert ours.eos_token_id == 2 and ours.bos_token_id == 1
    chat = [{"role": "user", "content": "hi there"}]
    want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat) == want


def test_sentencepiece_merges_rank_as_transformers(tmp_path: Path) -> None:
    """The merges come from the pieces' scores (the file has none); ties among them included,
    they rank as transformers ranks them, so longer texts merge the same way."""
    ours, ref = converted(spm_gguf(tmp_path / "spm.gguf"))
    mine = json.loads(ours.backend_json())["model"]["merges"]
    theirs = json.loads(ref.backend_tokenizer.to_str())["model"]["merges"]
    assert len(mine) > 200 and mine == theirs
    assert_parity(ours, ref, [CORPUS, CORPUS.upper(), CORPUS.replace(" ", "  ")])


def test_sentencepiece_incremental_text_is_the_full_decode(tmp_path: Path) -> None:
    """The answer's text, token by token (byte pieces of one character waiting for the rest),
    is what decoding the whole prompt and answer adds to the prompt's own text: a leading
    space is kept. After a prompt of special tokens only (BOS alone, `<|user|>`) it is the
    same text: decoding takes the first space off a text, which had taken the answer's (`The
    The` after BOS, ` The The` after text, while the completion's `text_offset` and the
    tokens' own text counted the space)."""
    ours, ref = converted(spm_gguf(tmp_path / "spm.gguf"))
    prompt = ours.encode("The answer is", True)
    user = ours.token_to_id("<|user|>")
    for text in TRICKY:
        ids = ours.encode(text, False)
        got, deltas = run_tokens(ours, prompt, ids)
        head = ref.decode(prompt, skip_special_tokens=True)
        full = ref.decode(prompt + ids, skip_special_tokens=True)
        assert full.startswith(head)
        assert got == full[len(head) :], text
        assert "".join(deltas) == got
        assert all("\ufffd" not in d for d in deltas), (text, deltas)
        for before in ([1], [1, user], [user]):
            assert run_tokens(ours, before, ids) == (got, deltas), (text, before)
    word = ours.encode("world", False)
    assert run_tokens(ours, prompt, word)[0] == " world"
    assert run_tokens(ours, [1], word)[0] == " world"


def test_sentencepiece_without_space_prefix_as_llama_cpp(tmp_path: Path) -> None:
    """`add_space_prefix` false (transformers ignores the key; llama.cpp reads it): no `▁` goes
    before the text and decoding takes none off, so text round-trips exactly."""
    ours, _ = converted(spm_gguf(tmp_path / "spm.gguf", add_space_prefix=False))
    (tmp_path / "p").mkdir()
    with_prefix, _ = converted(spm_gguf(tmp_path / "p" / "spm.gguf"))
    assert ours.encode("the", False) != with_prefix.encode("the", False)
    assert ours.encode(" the", False) == with_prefix.encode("the", False)
    # none after a special token either; with the prefix, one there too
    user = ours.token_to_id("<|user|>")
    assert ours.encode("<|user|>the") == [user, *ours.encode("the")]
    assert with_prefix.encode("<|user|>the") == [user, *with_prefix.encode("the")]
    assert with_prefix.encode("<|user|>the") != ours.encode("<|user|>the")
    assert ours.decode(ours.encode(" the", True)) == " the"
    for text in TRICKY:
        if "<" in text:
            continue
        assert ours.decode(ours.encode(text, True)) == text
        got, _ = run_tokens(ours, [1], ours.encode(text, False))
        assert got == text


# -- byte-level BPE splits ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm_vocab(smollm2_gguf: Path) -> tuple[list[str], list[int], list[str]]:
    r = gguf.GGUFReader(smollm2_gguf)
    tokens, types, merges = (
        r.fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "token_type", "merges")
    )
    return tokens, types, merges


def bpe_gguf(path: Path, tokens: list[str], types: list[int], merges: list[str], pre: str) -> Path:
    def tokenizer(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)

    return write_tiny(path, len(tokens), tokenizer)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "tekken", "smaug-bpe"])
def test_byte_level_splits_encode_as_transformers(
    tmp_path: Path, smollm_vocab: tuple[list[str], list[int], list[str]], pre: str
) -> None:
    """The default model's vocabulary cut by each split (Llama 3's digit triples and
    contractions, Qwen2's single digits, Tekken's case changes): the same ids as transformers,
    BOS first where the file asks."""
    ours, ref = converted(bpe_gguf(tmp_path / "m.gguf", *smollm_vocab, pre=pre))
    texts = [t.replace("<s>", "<|im_start|>").replace("</s>", "<|im_end|>") for t in TRICKY]
    assert_parity(ours, ref, [*texts, CORPUS])
    pieces = HFTokenizer.from_str(ours.backend_json()).pre_tokenizer.pre_tokenize_str("12345")
    digits = ["123", "45"] if pre in ("llama-bpe", "smaug-bpe") else list("12345")
    assert [p for p, _ in pieces] == digits
    prompt = ours.encode("Answer:", True)
    for text in texts:
        got, _ = run_tokens(ours, prompt, ours.encode(text, False))
        assert got == ref.decode(ours.encode(text, False), skip_special_tokens=True)


def test_llama3_whole_word_is_one_token(tmp_path: Path) -> None:
    """llama.cpp (and Meta's own tokenizer.json) take a Llama 3 word that is a whole token as
    that token even where no merge makes it; Qwen2's split has no such rule."""
    tokens = [*byte_alphabet(), "ab", "abc", "<|bos|>", "<|eos|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]

    def ids_for(pre: str) -> list[int]:
        path = tmp_path / pre / "m.gguf"
        path.parent.mkdir()
        ours, _ = converted(bpe_gguf(path, tokens, types, ["a b"], pre=pre))
        return ours.encode("abc", False)

    assert ids_for("llama-bpe") == [tokens.index("abc")]
    assert ids_for("qwen2") == [tokens.index("ab"), tokens.index("c")]


# -- refused -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "pre", "named"),
    [("bert", None, "'bert'"), ("gpt2", "deepseek-llm", "'deepseek-llm'")],
)
def test_unsupported_tokenizer_is_refused_by_name(
    tmp_path: Path, model: str, pre: str | None, named: str
) -> None:
    tokens = [*byte_alphabet(), "<s>", "</s>"]

    def tokenizer(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(model)
        if pre:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges([])

    path = write_tiny(tmp_path / "m.gguf", len(tokens), tokenizer)
    with pytest.raises(ModelLoadError, match=f"{re.escape(str(path))}.*{named}.*not supported"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_sentencepiece_without_scores_is_refused(tmp_path: Path) -> None:
    tokens, _, types = spm_vocab()

    def tokenizer(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)

    path = write_tiny(tmp_path / "m.gguf", len(tokens), tokenizer)
    with pytest.raises(ModelLoadError, match="'tokenizer.ggml.scores' is missing"):
        convert_gguf(path, tmp_path / "out", progress=False)


# -- served ------------------------------------------------------------------------------------
def token_bytes(tokens: list[str], types: list[int], ids: list[int]) -> bytes:
    """A SentencePiece answer's bytes, read off the vocabulary: a byte piece its byte, a
    control or unknown token (special) nothing, a piece its text with `▁` as a space."""
    out = b""
    for i in ids:
        if types[i] == T.BYTE:
            out += bytes([int(tokens[i][3:5], 16)])
        elif types[i] not in (T.CONTROL, T.UNKNOWN):
            out += tokens[i].replace(SPACE, " ").encode()
    return out


@pytest.mark.parametrize("knob", ["auto", "none"])
def test_sentencepiece_model_served_end_to_end(
    tmp_path: Path, sp_model: spm.SentencePieceProcessor, knob: str
) -> None:
    """LLMEngine over the GGUF itself (sentencepiece's vocabulary): converted on first use,
    the prompt tokenized as llama.cpp tokenizes it (BOS first, a `▁` before each piece of
    text), and the answer's text the answer's bytes read as UTF-8 (the random model emits
    byte pieces freely; a stray one reads as U+FFFD)."""
    tokens, scores, types = sp_vocab(sp_model)
    path = spm_gguf(tmp_path / "spm.gguf", (tokens, scores, types), add_bos_token=True)
    added = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k in ADDED}
    cfg = EngineConfig(
        model=str(path), home=tmp_path / "home", kv_cache_bytes="16MiB", num_threads=1,
        model_quantization=knob,
    )  # fmt: skip
    eng = LLMEngine.from_config(cfg, progress=False)
    prompts = [
        "The quick brown fox",
        " hello   world\n\t12345 \U0001f999",
        "<|user|> hi</s><|assistant|>",
    ]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=0)
    outs = eng.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.prompt_token_ids) == llama_cpp_ids(sp_model, added, prompt, 1, None)
        ids = list(out.token_ids)
        assert len(ids) == 40
        assert out.text == token_bytes(tokens, types, ids).decode("utf-8", "replace")
    chat = eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|user|>hi</s><|assistant|>"
    # a completion's echoed prompt: each token's offset is where its text starts in the prompt
    # as sent (the `▁` llama.cpp puts before each piece of text is not in it; the offsets had
    # counted it, one more after each special token, running past the text's end)
    from kvguard.daemon.openai_api import _echo_offsets

    for prompt in ("Hello world", "a<|user|>b c", "<|user|> hi</s><|assistant|>x"):
        ids = eng.tokenizer.encode(prompt, add_special_tokens=True)
        raw = [eng.grammars.token_bytes(i) for i in ids]
        offsets = _echo_offsets(prompt, raw, {0})
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(prompt)
        for at, piece in zip(offsets[1:], raw[1:], strict=True):
            text = piece.decode()
            assert prompt.startswith(text, at) or prompt.startswith(text[1:], at), (prompt, at)
    assert _echo_offsets("a<|user|>b c", [b" a", b"<|user|>", b" b", b" c"], ()) == [0, 1, 9, 10]
