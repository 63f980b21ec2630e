"""Incremental detokenisation and stop handling for one sequence per call.

An answer's text is its tokens' bytes read as UTF-8 as Python's errors="replace" (and byte-level
decoding) reads them: the bytes of a character that never completes are one U+FFFD (a character
cut after 2 of its 3 bytes is one), each other byte that is part of no character one of its own
(a stray continuation byte), as completions' logprobs place their text. A token whose text is
whole characters gets it by decoding a short window of recent tokens (a decoder may read a token
by the one before it: a leading space). A window with no text (a prompt of special tokens only)
is decoded after a token of plain text (`Tokenizer.text_guard`): a decoder that takes a text's
first space off (SentencePiece's) takes the guard's, so an answer's first space stays, as after
any other prompt. Tokens of raw bytes (`Tokenizer.raw_bytes`) are read as UTF-8 here, from the
answer's first byte on, so a prompt ending inside a character does not take the answer's first
bytes, and one stray byte is one U+FFFD, not a whole run of them (as byte-fallback decoding
gives). Bytes that may still become a character wait for the next token, so streamed text never
shows garbage.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

from kvguard.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvguard.engine.tokenizer import Tokenizer

_UTF8 = codecs.getincrementaldecoder("utf-8")


def append_token(tok: Tokenizer, seq: Sequence, token: int, eos_ids: set[int]) -> None:
    """Record a sampled token and finish the sequence when a stop condition holds."""
    seq.output_token_ids.append(token)
    p = seq.params
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        seq.finish_reason = "stop"
        _extend_text(tok, seq, seq.num_tokens - 1, final=True)  # the text before it, whole
        if p.stop:
            _apply_stop_strings(seq)
        return
    _extend_text(tok, seq, seq.num_tokens)
    if p.stop and _apply_stop_strings(seq):
        seq.finish_reason = "stop"
        return
    if len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= seq.max_total_len:
        seq.finish_reason = "length"
        seq.truncated = seq.max_tokens < p.max_tokens and seq.num_tokens < seq.max_total_len
        if finish_text(tok, seq):
            seq.finish_reason, seq.truncated = "stop", False


def finish_text(tok: Tokenizer, seq: Sequence) -> bool:
    """The sequence ends at a length limit (its max_tokens, or a live cap lowering it): its
    text made whole, the bytes of an unfinished character as U+FFFD, and a stop string the
    last text completes applied. True where a stop string cut it (it ends `stop`)."""
    _extend_text(tok, seq, seq.num_tokens, final=True)
    return bool(seq.params.stop) and _apply_stop_strings(seq)


def _extend_text(tok: Tokenizer, seq: Sequence, end: int, final: bool = False) -> None:
    """Add the text of the tokens up to `end` not shown yet. Bytes that may still become a
    character wait for the next token, unless `final` (the request ends here): then those that
    never completed a character are shown as U+FFFD, so that the text is the tokens' and a
    stream's chunks add up to it.

    Tokens before `read_offset` are in the text; the window from `prefix_offset` to it is the
    last group shown, what a token of whole characters is decoded after (the prompt's last
    tokens before the first). From `read_offset` on are the tokens holding bytes that wait for
    the rest of their character, read again each time (a few: UTF-8 decides within 4 bytes)."""
    if seq.read_offset == 0 and seq.prefix_offset == 0:
        seq.prefix_offset = max(0, len(seq.prompt_token_ids) - 5)
        seq.read_offset = len(seq.prompt_token_ids)
    if end <= seq.read_offset:
        return
    waiting = ""  # text of the bytes read since read_offset
    run: list[tuple[int, int]] = []  # the tokens of those still waiting: index, bytes
    utf8 = _UTF8(errors="replace")  # reads them (flushed, it is fresh again)
    for k, token in enumerate(seq.token_slice(seq.read_offset, end), seq.read_offset):
        raw = tok.raw_bytes(token)
        if raw is None:  # whole characters: the bytes before it end here, whatever they made
            if run:
                waiting += utf8.decode(b"", final=True)
                run = []
            window = seq.token_slice(seq.prefix_offset, k)
            prefix = tok.decode(window)
            if not prefix:  # no text before it: decoded after a guard, its first space stays
                window = tok.text_guard + list(window)
                prefix = tok.decode(window)
            full = tok.decode([*window, token])
            waiting += full[len(prefix) :]
            done = k + 1
        elif not raw and not run:  # a special token: no text, the window stays the next's
            seq.read_offset = k + 1
            continue
        else:
            waiting += utf8.decode(raw)
            run.append((k, len(raw)))
            pending = len(utf8.getstate()[0])
            if not pending:
                done, run = k + 1, []
            else:
                done = _pending_start(run, pending)
                if done is None or done == seq.read_offset:
                    continue
                run = [r for r in run if r[0] >= done]
        seq.text += waiting
        waiting = ""
        seq.prefix_offset, seq.read_offset = seq.read_offset, done
    if final and seq.read_offset < end:
        seq.text += waiting + (utf8.decode(b"", final=True) if run else "")
        seq.prefix_offset, seq.read_offset = seq.read_offset, end


def _pending_start(run: list[tuple[int, int]], pending: int) -> int | None:
    """The token of `run` (index, bytes) where its last `pending` bytes begin, or None where
    they begin inside one: the text before that token is whole, and goes out."""
    for k, size in reversed(run):
        pending -= size
        if pending <= 0:
            return k if pending == 0 else None
    return None


def _apply_stop_strings(seq: Sequence) -> bool:
    """Cut the text at the first stop string. Text up to `stop_checked_len` held none, so a
    stop string can only end in what was added since: each is looked for from len(stop) - 1
    characters before that (one `find` in C over the new text and that overlap, whatever the
    number of tokens so far). The first occurrence wins, and of two at the same place the
    stop string listed first."""
    text, checked = seq.text, seq.stop_checked_len
    best = -1
    hit = ""
    for s in seq.params.stop:
        i = text.find(s, max(0, checked - len(s) + 1))
        if i != -1 and (best == -1 or i < best):
            best, hit = i, s
    seq.stop_checked_len = len(text)
    if best == -1:
        return False
    keep = best + len(hit) if seq.params.include_stop_str_in_output else best
    seq.text = text[:keep]
    return True
