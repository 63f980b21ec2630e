"""Log-probabilities of tokens that hold part of a character (an emoji or a CJK character split
over tokens), served through the OpenAI API to the real `openai` client: each token's own
bytes (chat `bytes` rebuild the content), distinct texts (`bytes:\\xNN` where a token is not
whole characters), completion offsets that index the returned text, and streamed chunks that
carry the log-probabilities of the tokens whose text they carry."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from kvguard.engine.random_model import byte_tokenizer
from tests.test_server import Daemon

SMOLLM = "smollm2-135m"
# greedy smollm2-135m answers, found by experiment: each has an emoji split over three tokens
# (7 tokens, 'I love 🍕 pizza!' without its end-of-turn token: content has no text of that)
PIZZA = [{"role": "user", "content": "Repeat this text exactly:\n\nI love 🍕 pizza!"}]
STARS = [{"role": "user", "content": "Say hello with an emoji."}]  # '🌟🌟🌟...', from its 1st token


@pytest.fixture(scope="module")
def smollm_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        debug_hooks=False,
        serving=f"{{model: {SMOLLM}, kv_cache_bytes: 64MiB, max_model_len: 1024}}",
    )
    yield d
    assert d.stop() == 0


def token_bytes(token: str) -> bytes:
    """A completion token's bytes: its text as UTF-8, or the bytes a `bytes:\\xNN` text names."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token))
    return token.encode()


def check_token(token: str, raw: bytes) -> None:
    """A token's text is its bytes when they are whole characters, else `bytes:` and each byte."""
    try:
        assert token == raw.decode()
    except UnicodeDecodeError:
        assert token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Every offset indexes `text`: a token that begins a character begins at its offset, one
    that continues a character lies within the character at its offset."""
    assert offsets == sorted(offsets) and all(0 <= o < len(text) for o in offsets)
    for token, offset in zip(tokens, offsets, strict=True):
        raw = token_bytes(token)
        if not raw:
            continue
        rest = text[offset:].encode()
        if raw[0] & 0xC0 != 0x80:  # begins a character
            assert rest.startswith(raw), (token, offset, text)
        else:
            assert 0 < rest.find(raw) < len(text[offset].encode()), (token, offset, text)


# -- completions: offsets and alternatives (the tiny model's tokens are single bytes) ----------
def test_echoed_prompt_offsets_index_the_text_and_partial_tokens_stay_apart(
    tiny_daemon: Daemon,
) -> None:
    """An echoed prompt with a four-byte emoji and two three-byte characters, one token a byte:
    a token continuing a character has that character's offset, every alternative of five is
    kept (bytes that each print as a replacement character are distinct tokens)."""
    c = tiny_daemon.client()
    tok = byte_tokenizer()
    prompt = "a😀b日本c"
    d = tok.encode("d", add_special_tokens=False)[0]
    out = c.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=5,
        logit_bias={str(d): 100},  # the new token is a whole character
    )
    text, lp = out.choices[0].text, out.choices[0].logprobs
    assert text == prompt + "d"
    raws = [bytes([b]) for b in prompt.encode()] + [b"d"]
    assert [token_bytes(t) for t in lp.tokens] == raws
    for token, raw in zip(lp.tokens, raws, strict=True):
        check_token(token, raw)
    assert lp.tokens[1] == "bytes:\\xf0"
    assert lp.text_offset == [0, 1, 1, 1, 1, 2, 3, 3, 3, 4, 4, 4, 5, 6]
    check_offsets(text, lp.tokens, lp.text_offset)
    assert lp.top_logprobs[0] is None
    # five alternatives and, where it is not among them, the prompt's own token (OpenAI's way)
    entries = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
    assert all(5 <= len(top) <= 6 and top[t] == v for t, v, top in entries), lp.top_logprobs


def test_the_token_of_byte_0xff_has_its_byte(tiny_daemon: Daemon) -> None:
    """The token that is byte 0xFF (byte-level `ÿ` here; `<0xFF>` in a SentencePiece
    vocabulary) read as no bytes, as the grammar library marks special tokens with that byte:
    its entry was `""` with `bytes: []` and every completion offset after it one short."""
    c = tiny_daemon.client()
    ff = byte_tokenizer().token_to_id("ÿ")  # the byte-level alphabet's name for byte 0xFF
    bias = {str(ff): 100}
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        temperature=0,
        logprobs=True,
        logit_bias=bias,
    )
    entries = chat.choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in entries] == [("bytes:\\xff", [255])] * 2
    out = c.completions.create(
        model="tiny", prompt="ab", max_tokens=3, temperature=0, logprobs=1, logit_bias=bias
    )
    lp = out.choices[0].logprobs
    assert lp.tokens == ["bytes:\\xff"] * 3
    assert lp.text_offset == [0, 1, 2]


def test_completion_offsets_of_split_characters_streamed_and_not(smollm_daemon: Daemon) -> None:
    """smollm2 continues a row of emojis, each three tokens: the offsets index the text, with
    `echo` (the prompt's tokens first, from 0) and streamed (counting on across chunks)."""
    c = smollm_daemon.client()
    ask = {"model": SMOLLM, "prompt": "🌟🌟🌟🌟", "max_tokens": 9, "temperature": 0, "logprobs": 3}
    full = c.completions.create(**ask)
    text, lp = full.choices[0].text, full.choices[0].logprobs
    assert text == "🌟🌟🌟" and len(lp.tokens) == 9
    assert b"".join(token_bytes(t) for t in lp.tokens) == text.encode()
    assert lp.text_offset == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    check_offsets(text, lp.tokens, lp.text_offset)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    chunks = list(c.completions.create(**ask, stream=True))
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    echoed = c.completions.create(**ask, echo=True)
    text, lp = echoed.choices[0].text, echoed.choices[0].logprobs
    assert text == "🌟" * 7 and len(lp.tokens) == 21
    assert lp.text_offset == [i // 3 for i in range(21)]
    check_offsets(text, lp.tokens, lp.text_offset)


# -- chat: bytes ------------------------------------------------------------------------------
def test_chat_bytes_rebuild_the_content(smollm_daemon: Daemon) -> None:
    """An emoji split over three tokens: joined, every entry's bytes are the content's; each
    token's text (and each alternative's) follows its bytes."""
    c = smollm_daemon.client()
    full = c.chat.completions.create(
        model=SMOLLM,
        messages=PIZZA,
        max_tokens=7,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    text, content = full.choices[0].message.content, full.choices[0].logprobs.content
    assert text == "I love 🍕 pizza!"
    assert any(e.token.startswith("bytes:") for e in content)  # a token holds part of it
    assert b"".join(bytes(e.bytes) for e in content) == text.encode()
    for e in content:
        check_token(e.token, bytes(e.bytes))
        assert len(e.top_logprobs) == 3
        assert (e.top_logprobs[0].token, e.top_logprobs[0].bytes) == (e.token, e.bytes)  # greedy
        for alt in e.top_logprobs:
            check_token(alt.token, bytes(alt.bytes))


# -- chat, streamed: a chunk carries the log-probabilities of the text it carries --------------
@pytest.mark.parametrize(
    ("messages", "max_tokens"), [(STARS, 9), (PIZZA, 7)], ids=["starts-split", "split-inside"]
)
def test_streamed_chunks_without_text_carry_no_logprobs(
    smollm_daemon: Daemon, messages: list[dict[str, str]], max_tokens: int
) -> None:
    """The role chunk goes out before the first character is whole: it carries no
    log-probabilities; streamed, the tokens are the ones the whole answer has."""
    c = smollm_daemon.client()
    ask = {
        "model": SMOLLM,
        "messages": messages,
        "max_tokens": max_tokens,  # whole characters
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = c.chat.completions.create(**ask)
    text, content = full.choices[0].message.content, full.choices[0].logprobs.content
    chunks = [ch for ch in c.chat.completions.create(**ask, stream=True) if ch.choices]
    for ch in chunks:
        choice = ch.choices[0]
        if not choice.delta.content and not choice.delta.tool_calls and not choice.finish_reason:
            assert choice.logprobs is None or not choice.logprobs.content, ch
    streamed = [e for ch in chunks if ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert b"".join(bytes(e.bytes) for e in streamed) == text.encode()


def test_streamed_completion_chunks_without_text_carry_no_logprobs(
    smollm_daemon: Daemon,
) -> None:
    """The same for a completion: the first chunk, before the first emoji is whole, has no
    text and no log-probabilities."""
    c = smollm_daemon.client()
    ask = {"model": SMOLLM, "prompt": "🌟🌟🌟🌟", "max_tokens": 9, "temperature": 0, "logprobs": 0}
    chunks = [ch for ch in c.completions.create(**ask, stream=True) if ch.choices]
    for ch in chunks:
        if not ch.choices[0].text and not ch.choices[0].finish_reason:
            assert ch.choices[0].logprobs is None or not ch.choices[0].logprobs.tokens, ch


# -- a stop string: entries for the text it leaves, streamed and not ---------------------------
@pytest.fixture(scope="module")
def drafting_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """smollm2 with drafts: an engine output often holds several tokens, so a chunk's text can
    end inside what its tokens wrote (the tail held back as the start of a stop string)."""
    d = Daemon(
        tmp_path_factory.mktemp("drafting"),
        debug_hooks=False,
        serving=f"{{model: {SMOLLM}, kv_cache_bytes: 64MiB, max_model_len: 1024, "
        "speculative_tokens: 4, speculative_row_cost: 0}",
    )
    yield d
    assert d.stop() == 0


COUNT = "1, 2, 3, 4, 5, 6,"  # greedy smollm2-135m continues it ' 7, 8, 9, 10, ...'
REPEAT = [{"role": "user", "content": "Repeat this text exactly:\n\n1, 2, 3, 4, 5, 6, 7, 8, 9, 10"}]


@pytest.mark.parametrize(
    ("stop", "text", "tokens", "cut"),
    [
        (" 9", " 7, 8,", [" ", "7", ",", " ", "8", ","], 2),  # ' ' and '9' are cut off
        ("ari", " P", [" Paris"], 0),  # the token the cut splits keeps its entry
        (" P", "", [], 1),
    ],
    ids=["between-tokens", "inside-a-token", "at-the-start"],
)
def test_a_stop_string_cuts_a_completion_s_logprobs_with_its_text(
    drafting_daemon: Daemon, stop: str, text: str, tokens: list[str], cut: int
) -> None:
    """The tokens whose text begins at or past the cut have no entry (usage counts them): the
    offsets index the text, streamed and not, and a chunk carries the entries of the tokens
    whose text begins in it."""
    c = drafting_daemon.client()
    prompt = COUNT if stop == " 9" else "The capital of France is"
    ask = {"model": SMOLLM, "prompt": prompt, "max_tokens": 20, "temperature": 0, "logprobs": 0}
    full = c.completions.create(**ask, stop=[stop])
    choice = full.choices[0]
    lp = choice.logprobs
    assert (choice.text, choice.finish_reason, lp.tokens) == (text, "stop", tokens)
    assert full.usage.completion_tokens == len(tokens) + cut  # the cut ones were generated
    assert "".join(lp.tokens).startswith(text) and len(lp.text_offset) == len(tokens)
    assert lp.text_offset == sorted(lp.text_offset) and all(o < len(text) for o in lp.text_offset)
    chunks = [ch.choices[0] for ch in c.completions.create(**ask, stop=[stop], stream=True)
              if ch.choices]  # fmt: skip
    assert "".join(ch.text for ch in chunks) == text
    streamed = [ch.logprobs for ch in chunks if ch.logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    if stop == " 9":  # tokens of whole characters: a chunk's are its text
        assert all("".join(ch.logprobs.tokens if ch.logprobs else ()) == ch.text for ch in chunks)


@pytest.mark.parametrize(
    ("stop", "content"),
    [(" 9", "1, 2, 3, 4, 5, 6, 7, 8,"), ("6, 7", "1, 2, 3, 4, 5, ")],
    ids=["space-then-digit", "several-tokens"],
)
def test_a_stop_string_cuts_a_chat_answer_s_logprobs_with_its_content(
    drafting_daemon: Daemon, stop: str, content: str
) -> None:
    """A chat answer cut by a stop string: its entries' bytes add up to its content, streamed
    and not, and each chunk's to the content it carries."""
    c = drafting_daemon.client()
    ask = {"model": SMOLLM, "messages": REPEAT, "max_tokens": 40, "temperature": 0,
           "logprobs": True, "stop": [stop]}  # fmt: skip
    full = c.chat.completions.create(**ask)
    choice = full.choices[0]
    assert (choice.message.content, choice.finish_reason) == (content, "stop")
    entries = choice.logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries) == content.encode()
    chunks = [ch.choices[0] for ch in c.chat.completions.create(**ask, stream=True) if ch.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == content
    for ch in chunks:
        got = b"".join(bytes(e.bytes) for e in (ch.logprobs.content if ch.logprobs else ()))
        assert got == (ch.delta.content or "").encode(), ch
    streamed = [e for ch in chunks if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in entries]
