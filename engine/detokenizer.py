"""Incremental detokenisation and stop handling for one sequence per call.

Text grows by decoding a short window of recent tokens; a window that ends inside a
multi-byte character (U+FFFD) waits for the next token, so streamed text never shows garbage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvguard.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvguard.engine.tokenizer import Tokenizer


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
    """Add the text of the tokens up to `end` the window has not shown yet. A window ending
    inside a multi-byte character waits for the next token, unless `final` (the request ends
    here): then the bytes that never completed a character are shown as U+FFFD, as decoding
    the whole output does, so that the text is the tokens' and a stream's chunks add up to it."""
    if seq.read_offset == 0 and seq.prefix_offset == 0:
        seq.prefix_offset = max(0, len(seq.prompt_token_ids) - 5)
        seq.read_offset = len(seq.prompt_token_ids)
    if end <= seq.read_offset:
        return
    prefix = tok.decode(seq.token_slice(seq.prefix_offset, seq.read_offset))
    full = tok.decode(seq.token_slice(seq.prefix_offset, end))
    if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
        seq.text += full[len(prefix) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = end


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
