"""Writes Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json) for byte-level BPE.

Both the GGUF converter and the tiny test model need the same two files, in the format that
`kvguard.engine.tokenizer.Tokenizer` and Hugging Face transformers both read, so the builder
lives here once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# GPT-2-style splitting: contractions, letter runs, digit runs, other runs, whitespace.
GPT2_SPLIT = "byte-level"
# StarCoder-family vocabularies (SmolLM2 included) first cut every digit apart.
DIGITS_SPLIT = "digits+byte-level"


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
    raise ValueError(f"unknown split {split!r}: expected {GPT2_SPLIT!r} or {DIGITS_SPLIT!r}")


def _post_processor(spec: BpeSpec) -> processors.PostProcessor:
    """With add_bos_token, encode(add_special_tokens=True) prepends BOS, as the model expects."""
    if spec.add_bos_token and spec.bos_token is not None:
        bos_id = spec.vocab.index(spec.bos_token)
        return processors.TemplateProcessing(
            single=f"{spec.bos_token} $A",
            pair=f"{spec.bos_token} $A {spec.bos_token} $B",
            special_tokens=[(spec.bos_token, bos_id)],
        )
    return processors.ByteLevel(trim_offsets=False)


def build_tokenizer(spec: BpeSpec) -> HFTokenizer:
    """A `tokenizers.Tokenizer` for the spec; added (special) tokens are matched in raw text."""
    vocab = {text: i for i, text in enumerate(spec.vocab)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=spec.merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(spec.split)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(spec)
    added = sorted(spec.special.items())
    tok.add_special_tokens([_added(spec.vocab[i], True) for i, special in added if special])
    tok.add_tokens([_added(spec.vocab[i], False) for i, special in added if not special])
    return tok


def _added(text: str, special: bool) -> AddedToken:
    """Matched verbatim in raw text, before any pre-tokenization."""
    return AddedToken(text, special=special, normalized=False)


def tokenizer_config(spec: BpeSpec) -> dict[str, Any]:
    """tokenizer_config.json: the special token names and the chat template."""
    return {
        "add_bos_token": spec.add_bos_token,
        "add_eos_token": False,
        "bos_token": spec.bos_token,
        "chat_template": spec.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": spec.eos_token,
        "model_max_length": spec.model_max_length,
        "pad_token": spec.pad_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": spec.unk_token,
    }


def write_tokenizer_files(spec: BpeSpec, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into out_dir (deterministic bytes)."""
    build_tokenizer(spec).save(str(out_dir / "tokenizer.json"), pretty=False)
    text = json.dumps(tokenizer_config(spec), indent=2, sort_keys=True, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
