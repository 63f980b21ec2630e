"""Writes Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json) for byte-level BPE
(`BpeSpec`) and for SentencePiece BPE with byte fallback (`SentencePieceSpec`).

Both the GGUF converter and the tiny test model need the same two files, in the format that
`kvguard.engine.tokenizer.Tokenizer` and Hugging Face transformers both read, so the builder
lives here once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# GPT-2-style splitting: contractions, letter runs, digit runs, other runs, whitespace.
GPT2_SPLIT = "byte-level"
# StarCoder-family vocabularies (SmolLM2 included) first cut every digit apart.
DIGITS_SPLIT = "digits+byte-level"
# Llama 3: contractions in any case, a letter run with one leading non-letter, digits in runs
# of up to three, punctuation runs with their newlines, newline runs, whitespace.
LLAMA3_SPLIT = "llama3"
# Qwen2: as Llama 3, but every digit on its own.
QWEN2_SPLIT = "qwen2"
# Mistral's Tekken: words cut at a lower-to-upper case change, no contractions, single digits.
TEKKEN_SPLIT = "tekken"

_LETTER_WORD = r"[^\r\n\p{L}\p{N}]?\p{L}+"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
# the regexes these vocabularies were trained with; each match is one pre-token
SPLIT_REGEXES = {
    LLAMA3_SPLIT: rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|{_LETTER_WORD}|\p{{N}}{{1,3}}|{_TAIL}",
    QWEN2_SPLIT: rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|{_LETTER_WORD}|\p{{N}}|{_TAIL}",
    TEKKEN_SPLIT: (
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
# SentencePiece's stand-in for a space, in token text
SPACE_MARK = "\u2581"


@dataclass(slots=True)
class BpeSpec:
    """Everything needed to describe a byte-level BPE tokenizer."""

    vocab: list[str]  # token text (byte-level alphabet) by id
    merges: list[tuple[str, str]]
    special: dict[int, bool] = field(default_factory=dict)  # added token id -> is special
    split: str = GPT2_SPLIT
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    model_max_length: int = 2048
    add_eos_token: bool = False
    # a pre-token that is a whole vocabulary entry is that token, whatever the merges would
    # make of it (Llama 3 was trained so)
    ignore_merges: bool = False


@dataclass(slots=True)
class SentencePieceSpec:
    """A SentencePiece BPE vocabulary as llama.cpp stores it (Llama 2, Mistral): pieces with
    `▁` for a space, a score each (higher merges first), and `<0x00>`..`<0xFF>` pieces that
    spell, byte by byte, any character no piece holds."""

    vocab: list[str]  # piece text by id
    scores: list[float]
    special: dict[int, bool] = field(default_factory=dict)  # added token id -> is special
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool = True
    add_eos_token: bool = False
    add_space_prefix: bool = True  # a `▁` before each piece of text; decoding takes one off
    chat_template: str | None = None
    model_max_length: int = 2048


def byte_alphabet() -> list[str]:
    """The printable stand-in character for each byte value 0..255, as GPT-2 byte-level BPE uses.

    Bytes that are printable Latin-1 stand for themselves; the rest are shifted to code points
    from 256 upwards, in byte order, so that no token text contains whitespace or control chars.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    keep = set(printable)
    out: list[str] = []
    shifted = 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


def _pre_tokenizer(split: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == GPT2_SPLIT:
        return byte_level
    if split == DIGITS_SPLIT:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    if split in SPLIT_REGEXES:  # the regex cuts; ByteLevel only maps the bytes
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLIT_REGEXES[split]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = [GPT2_SPLIT, DIGITS_SPLIT, *SPLIT_REGEXES]
    raise ValueError(f"unknown split {split!r}: expected one of {known}")


def _post_processor(
    spec: BpeSpec | SentencePieceSpec, default: processors.PostProcessor | None
) -> processors.PostProcessor | None:
    """With add_bos_token (add_eos_token), encode(add_special_tokens=True) puts BOS before
    (EOS after) the text, as the model expects; without either, `default`."""
    bos = spec.bos_token if spec.add_bos_token else None
    eos = spec.eos_token if spec.add_eos_token else None
    if bos is None and eos is None:
        return default
    ends = [t for t in (bos, eos) if t is not None]
    first, last = (f"{bos} " if bos else ""), (f" {eos}" if eos else "")
    return processors.TemplateProcessing(
        single=f"{first}$A{last}",
        pair=f"{first}$A{last} {first}$B{last}",
        special_tokens=[(t, spec.vocab.index(t)) for t in dict.fromkeys(ends)],
    )


def build_tokenizer(spec: BpeSpec | SentencePieceSpec) -> HFTokenizer:
    """A `tokenizers.Tokenizer` for the spec; added (special) tokens are matched in raw text."""
    if isinstance(spec, SentencePieceSpec):
        return _build_sentencepiece(spec)
    vocab = {text: i for i, text in enumerate(spec.vocab)}
    model = models.BPE(
        vocab=vocab, merges=spec.merges, fuse_unk=False, ignore_merges=spec.ignore_merges
    )
    tok = HFTokenizer(model)
    tok.pre_tokenizer = _pre_tokenizer(spec.split)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(spec, processors.ByteLevel(trim_offsets=False))
    _add_tokens(tok, spec)
    return tok


def _build_sentencepiece(spec: SentencePieceSpec) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp runs it: the text is cut at the added tokens, and each
    piece of text between them (or before the first) gets its spaces as `▁` and, with
    add_space_prefix, one `▁` before it, whatever it starts with, after a special token too
    (sentencepiece's dummy prefix, per piece). Each is then one piece to merge (no
    pre-splitting); a character no piece holds is spelled by its UTF-8 bytes' `<0xNN>`
    pieces. Decoding undoes each, and takes one space off the start of the text.

    A normalizer, not a pre-tokenizer, adds the `▁`: the `tokenizers` library normalizes
    each piece between added tokens on its own, so every piece gets one (a Metaspace
    pre-tokenizer prepends only at the start of the whole text, and not where a space is
    there already: transformers' reading of a GGUF, not what the model was trained on)."""
    vocab = {text: i for i, text in enumerate(spec.vocab)}
    model = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(spec.vocab, spec.scores),
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(model)
    spaces = normalizers.Replace(" ", SPACE_MARK)
    if spec.add_space_prefix:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), spaces])
    else:
        tok.normalizer = spaces
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if spec.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    tok.post_processor = _post_processor(spec, None)
    _add_tokens(tok, spec)
    return tok


def sentencepiece_merges(vocab: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scores: every way of writing a piece as two
    pieces is a merge, ranked by the piece's score (highest first). Of two splits of one
    piece, the one with the longer left part comes first, then the longer right part, and
    pieces of equal score keep their vocabulary order (as transformers ranks them)."""
    if len(scores) != len(vocab):
        raise ValueError(f"{len(scores)} scores for {len(vocab)} pieces")
    ids = {text: i for i, text in enumerate(vocab)}
    first: dict[str, int] = {}  # a piece listed twice is ranked where it is first listed
    for i, text in enumerate(vocab):
        first.setdefault(text, i)
    ranked = []
    for text, at in first.items():
        score = float(scores[ids[text]])
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                ranked.append((-score, -len(left), -len(right), at, ids[left], ids[right]))
    ranked.sort()
    return [(vocab[left], vocab[right]) for *_, left, right in ranked]


def _add_tokens(tok: HFTokenizer, spec: BpeSpec | SentencePieceSpec) -> None:
    added = sorted(spec.special.items())
    tok.add_special_tokens([_added(spec.vocab[i], True) for i, special in added if special])
    tok.add_tokens([_added(spec.vocab[i], False) for i, special in added if not special])


def _added(text: str, special: bool) -> AddedToken:
    """Matched verbatim in raw text, before any pre-tokenization."""
    return AddedToken(text, special=special, normalized=False)


def tokenizer_config(spec: BpeSpec | SentencePieceSpec) -> dict[str, Any]:
    """tokenizer_config.json: the special token names and the chat template."""
    return {
        "add_bos_token": spec.add_bos_token,
        "add_eos_token": spec.add_eos_token,
        "bos_token": spec.bos_token,
        "chat_template": spec.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": spec.eos_token,
        "model_max_length": spec.model_max_length,
        "pad_token": spec.pad_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": spec.unk_token,
    }


def write_tokenizer_files(spec: BpeSpec | SentencePieceSpec, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into out_dir (deterministic bytes).

    Python writes tokenizer.json (the same bytes as `Tokenizer.save`, which writes `to_str`):
    the Rust writer reports a full disk as a plain Exception, not an OSError, which the
    conversion's callers let through as a traceback and exit 1, and a service manager then
    restarted into the same failing conversion."""
    tokenizer = build_tokenizer(spec).to_str(pretty=False)
    (out_dir / "tokenizer.json").write_bytes(tokenizer.encode("utf-8"))
    config = json.dumps(tokenizer_config(spec), indent=2, sort_keys=True, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
