"""Outputs leave the engine as deltas: what a request holds for a consumer that has not read
it yet stays one coalesced output, linear in its length, however slow the consumer is."""

from __future__ import annotations

import asyncio
import codecs
import collections
import gc
import json
import random
import threading
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.detokenizer import _apply_stop_strings, append_token
from kvguard.engine.engine_loop import EngineLoop, RequestStream
from kvguard.engine.sequence import RequestOutput, Sequence, Status
from kvguard.engine.tokenizer import Tokenizer

N = 2000  # output tokens; the tiny model's 2048 positions hold the prompt too
PROMPT = [5, 6, 7]
# Objects of these modules are followed when measuring what a stream holds: the stream, its
# buffers, outputs, the API's per-request state and the queues they may use. The engine, the
# service and the event loop are not: they are not per-request undelivered state.
FOLLOWED = (
    "kvguard.engine.engine_loop",
    "kvguard.engine.sequence",
    "kvguard.daemon.openai_api",
    "queue",
    "asyncio.queues",
)


def held(roots: Iterable[object]) -> tuple[int, int]:
    """(RequestOutput objects, list items + characters) reachable from `roots`.

    Generic on purpose (containers, closures, bound methods, followed modules' objects), so the
    same measure applies to any shape of stream: one output copying everything per token and
    queued per token costs O(n^2) here, a coalesced delta O(n).
    """
    seen: set[int] = set()
    todo = list(roots)
    outputs = size = 0
    while todo:
        o = todo.pop()
        if id(o) in seen or o is None or isinstance(o, int | float | bool | bytes):
            continue
        seen.add(id(o))
        if isinstance(o, str):
            size += len(o)
        elif isinstance(o, list | tuple | collections.deque | set | frozenset):
            size += len(o) if isinstance(o, list) else 0
            todo.extend(x for x in o if not isinstance(x, int))
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, types.MethodType):
            todo.append(o.__self__)
        elif isinstance(o, types.FunctionType):
            todo.extend(c.cell_contents for c in o.__closure__ or ())
        elif type(o).__module__ in FOLLOWED:
            outputs += isinstance(o, RequestOutput)
            todo.extend(gc.get_referents(o))  # its __dict__ or slot values
    return outputs, size


class Peak:
    """The largest `held` of the engine loop's live streams, sampled after every engine step
    (on the engine thread, so no delivery is half done)."""

    def __init__(self, loop: EngineLoop, extra: Callable[[], list[object]] = list) -> None:
        self.loop, self.extra = loop, extra
        self.outputs = self.size = self.samples = 0

    def __call__(self, _snapshot: object) -> None:
        for stream in list(self.loop._streams.values()):
            outputs, size = held([stream, *self.extra()])
            self.outputs, self.size = max(self.outputs, outputs), max(self.size, size)
            self.samples += 1


def _engine(tiny_dir: Path) -> LLMEngine:
    cfg = EngineConfig(
        model=str(tiny_dir), kv_cache_bytes="32MiB", num_threads=2, max_model_len=2048
    )
    return LLMEngine.from_config(cfg, progress=False)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=N, ignore_eos=True)  # greedy


def test_unread_stream_holds_one_coalesced_output(tiny_dir: Path) -> None:
    loop = EngineLoop(_engine(tiny_dir)).start()
    peak = Peak(loop)
    loop.on_step.append(peak)
    try:
        stream = loop.submit(PROMPT, _params())
        while loop.in_flight():  # nobody reads the stream while its 2,000 tokens are produced
            threading.Event().wait(0.05)
        final = stream.result(0)
        assert peak.samples >= N - 1
        # one undelivered output (plus the final one), linear in the output, at every step
        assert peak.outputs <= 2, f"{peak.outputs} outputs held for one request"
        assert peak.size <= 8 * (N + len(PROMPT)), f"{peak.size} ids + chars held"
        assert held([stream])[0] <= 2
        outs = list(stream)  # everything not yet read comes as one output, then the stream ends
        assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
        assert outs[0].new_token_ids == final.token_ids and len(final.token_ids) == N
        assert outs[0].new_text == final.text
        assert final.num_output_tokens == N and final.prompt_token_ids == PROMPT
    finally:
        loop.stop()


def test_slow_reader_gets_deltas_that_add_up(tiny_dir: Path) -> None:
    """A reader slower than the engine: coalesced deltas still concatenate to the final
    output, and the stream never queues more than one output for it."""
    loop = EngineLoop(_engine(tiny_dir)).start()
    undelivered: list[int] = []
    streams: list[RequestStream] = []
    behind = threading.Event()

    def on_step(_snapshot: object) -> None:
        undelivered.extend(s.undelivered() for s in streams)
        if len(undelivered) >= 100:
            behind.set()

    loop.on_step.append(on_step)
    try:
        stream = loop.submit(PROMPT, SamplingParams(max_tokens=300, ignore_eos=True))
        streams.append(stream)
        assert behind.wait(120)  # the reader starts 100 steps late, then reads slowly
        ids: list[int] = []
        text: list[str] = []
        sizes = []
        for out in stream:
            sizes.append(len(out.new_token_ids))
            ids.extend(out.new_token_ids)
            text.append(out.new_text)
            assert out.num_output_tokens == len(ids)
            threading.Event().wait(0.005)
        final = stream.result(0)
        assert ids == final.token_ids and "".join(text) == final.text and len(ids) == 300
        assert max(undelivered) <= 1
        assert sizes[0] >= 99 and len(sizes) < 300  # what was not read came as one output
    finally:
        loop.stop()


# -- deltas at the engine: multi-byte characters and stop strings -----------------------------


def _run_tokens(
    tok: Tokenizer,
    ids: list[int],
    params: SamplingParams,
    prompt: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
) -> list[RequestOutput]:
    """Feed `ids` as if sampled, taking an output after each, as the engine does."""
    seq = Sequence("r", tok.encode("x") if prompt is None else prompt, params, 1, 0, 10_000)
    outs = []
    for t in ids:
        append_token(tok, seq, t, set(eos))
        if seq.finish_reason is not None:
            seq.status = Status.FINISHED
        outs.append(RequestOutput.take(seq))
        if outs[-1].finished:
            break
    return outs


def test_text_deltas_split_no_character_and_add_up(tiny_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    text = "héllo 日本語 ✓ 🙂 done"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # the tiny tokenizer is byte level: characters span tokens
    outs = _run_tokens(tok, ids, SamplingParams(max_tokens=len(ids), ignore_eos=True))
    assert outs[-1].finished and outs[-1].text == text
    assert "".join(o.new_text for o in outs) == text
    assert all("\ufffd" not in o.new_text for o in outs)
    assert any(o.new_token_ids and not o.new_text for o in outs)  # a partial character waited
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == ids
    with pytest.raises(AttributeError, match="final output"):
        _ = outs[0].text  # an unfinished output has no whole text: it is a delta


def test_a_request_ending_inside_a_character_shows_its_bytes_as_the_tokens_decode(
    tiny_dir: Path,
) -> None:
    """Ended by max_tokens (or EOS) part way through a character, the text held back for the
    rest of it goes out with the last output: the final text is the output tokens' decoding,
    U+FFFD for the incomplete bytes, and the stream's deltas add up to it."""
    tok = Tokenizer.from_dir(tiny_dir)
    ids = tok.encode("ok 日本")
    cut = ids[:-1]  # the last character's final byte never comes
    (end,) = tok.encode("#")
    assert end not in cut
    for params, feed in (
        (SamplingParams(max_tokens=len(cut), ignore_eos=True), cut),
        (SamplingParams(max_tokens=100, stop_token_ids=[end]), [*cut, end]),
    ):
        outs = _run_tokens(tok, feed, params)
        want = tok.decode(cut)
        assert want.endswith("\ufffd") and outs[-1].finished
        assert outs[-1].text == want and "".join(o.new_text for o in outs) == want


def _byte_fallback_tokenizer() -> Tokenizer:
    """A tokenizer shaped as Llama 2's and Mistral's are: BPE that spells a character outside
    its vocabulary as byte tokens (<0xE4>), decoded by Replace("▁", " "), ByteFallback, Fuse
    and Strip (one leading space); ids 0-2 special, byte b is id 3 + b."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "w"), ("o", "r")]
    for piece in ["▁", *"abcdehlnortwxé", *(a + b for a, b in merges)]:
        vocab.setdefault(piece, len(vocab))
    backend = HFTokenizer(
        models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})


def _utf8_shown(data: bytes, final: bool) -> str:
    """`data` read as UTF-8 as Python's errors="replace" reads it (as completions' logprobs
    place text): one U+FFFD for the bytes of a character that never completes, one for each
    stray byte, an unfinished last character left out unless `final`."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final)


def test_an_answer_after_a_prompt_ending_inside_a_character_is_its_own_bytes(
    tiny_dir: Path,
) -> None:
    """A token-id prompt may end part way through a character (a client continuing a text cut
    at a token). The answer's text is its own tokens' bytes, not the character its first
    bytes complete with the prompt's: the echoed prompt shows its partial bytes (decoded
    alone, U+FFFD) and the answer its own, so no byte is lost or shown twice."""
    tok = Tokenizer.from_dir(tiny_dir)
    smile = tok.encode("Smile 😀")  # the tiny tokenizer is byte level: the emoji is 4 tokens
    prompt, rest = smile[:-2], smile[-2:]
    answer = [*rest, *tok.encode(" ok done")]
    assert tok.decode(prompt + answer) == "Smile 😀 ok done"
    assert tok.decode(prompt, skip_special_tokens=False) == "Smile \ufffd"  # as echo shows it
    want = tok.decode(answer)
    assert want == "\ufffd\ufffd ok done"
    for params, feed in (
        (SamplingParams(max_tokens=len(answer), ignore_eos=True), answer),
        (SamplingParams(max_tokens=100), [*answer, 2]),  # ended by its EOS
    ):
        outs = _run_tokens(tok, feed, params, prompt, eos=frozenset({2}))
        assert outs[-1].finished and outs[-1].text == want
        assert [o.new_text for o in outs][:3] == ["\ufffd", "\ufffd", " "]  # each at once
        assert "".join(o.new_text for o in outs) == want


def test_a_stray_byte_in_a_byte_fallback_run_is_one_replacement_character() -> None:
    """Llama 2 and Mistral spell CJK and emoji as byte tokens. One byte that begins no
    character is one U+FFFD, and each character after it goes out with the token that
    completes it (decoding the tokens whole turns the rest of the byte run into U+FFFD,
    one per token)."""
    tok = _byte_fallback_tokenizer()
    (the,) = tok.encode("the")
    assert tok.decode([the]) == "the"  # Strip: decoded alone, the leading space goes

    def spelled(data: bytes) -> list[int]:
        return [3 + b for b in data]

    answer = [*spelled("你".encode()), *spelled(b"\xe4"), *spelled("好世界\n再见".encode()), the]
    assert tok.decode(answer).count("\ufffd") > 10  # the whole run, as the decoder reads it
    outs = _run_tokens(tok, answer, SamplingParams(max_tokens=len(answer)), tok.encode("hello"))
    want = "你\ufffd好世界\n再见 the"
    assert outs[-1].finished and outs[-1].text == want
    deltas = [o.new_text for o in outs]
    assert "".join(deltas) == want
    assert deltas[:7] == ["", "", "你", "", "\ufffd", "", "好"]  # E4 is known stray at E5
    assert deltas[-1] == " the"


@pytest.mark.parametrize("kind", ["byte level", "byte fallback"])
def test_deltas_add_up_to_the_answer_bytes_read_as_utf8(tiny_dir: Path, kind: str) -> None:
    """Seeded random answers of byte fragments (characters of 1-4 bytes, some cut, stray or
    out of order), whole-text tokens and special tokens, after prompts that end on a
    character, inside one, or on a stray byte: after every token the text shown is the
    answer's bytes so far read as UTF-8 (an unfinished last character waiting), and at the
    end the deltas add up to the final text, which is all of them read so."""
    if kind == "byte level":
        tok = Tokenizer.from_dir(tiny_dir)
        whole = {i: tok.decode([i]).encode() for i in tok.encode("ab the, x")}
    else:
        tok = _byte_fallback_tokenizer()
        pieces = [tok.id_to_token(i) or "" for i in tok.encode("the w or é x")]
        whole = {tok.token_to_id(p): p.replace("▁", " ").encode() for p in [*pieces, "▁"]}
    chars = ["a", " ", "\n", "é", "ß", "你", "見", "✓", "😀", "🙂"]
    byte_id: dict[int, int] = {}
    for ch in chars:  # each byte of these is one token of both tokenizers
        ids = tok.encode(ch) if kind == "byte level" else [3 + b for b in ch.encode()]
        assert len(ids) == len(ch.encode()) and tok.decode([*tok.encode("x"), *ids]) == "x" + ch
        byte_id |= dict(zip(ch.encode(), ids, strict=True))
    rnd = random.Random(20250613)

    def fragment() -> bytes:
        data = rnd.choice(chars).encode()
        cut = rnd.random()
        if cut < 0.2:
            return data[: rnd.randrange(len(data))] or data[-1:]  # the start of a character
        if cut < 0.3:
            return data[rnd.randrange(1, len(data)) :] if len(data) > 1 else data  # its end
        return data

    prompts = [
        tok.encode("hello there"),
        tok.encode("hello") + [byte_id[b] for b in "😀".encode()[:3]],  # inside a character
        tok.encode("hello") + [byte_id["你".encode()[0]]],
        tok.encode("hello") + [byte_id["é".encode()[1]]],  # a stray byte
    ]
    for _ in range(400):
        answer: list[tuple[int, bytes]] = []  # token, its bytes
        while len(answer) < rnd.randint(1, 16):
            pick = rnd.random()
            if pick < 0.15:
                token = rnd.choice(list(whole))
                answer.append((token, whole[token]))
            elif pick < 0.2:
                answer.append((rnd.choice([0, 1]), b""))  # special, not the EOS (2)
            else:
                answer += [(byte_id[b], bytes([b])) for b in fragment()]
        ids = [t for t, _ in answer]
        prompt = rnd.choice(prompts)
        if rnd.random() < 0.3:  # ended by its EOS rather than its limit
            params = SamplingParams(max_tokens=100)
            outs = _run_tokens(tok, [*ids, 2], params, prompt, eos=frozenset({2}))
        else:
            outs = _run_tokens(tok, ids, SamplingParams(max_tokens=len(ids)), prompt)
        want = _utf8_shown(b"".join(raw for _, raw in answer), final=True)
        if kind == "byte level":
            assert want == tok.decode(ids)  # byte-level decoding reads the bytes so too
        shown = ""
        for k, out in enumerate(outs[: len(ids)]):
            shown += out.new_text
            if not out.finished:
                assert shown == _utf8_shown(b"".join(r for _, r in answer[: k + 1]), False), (
                    prompt,
                    ids[: k + 1],
                )
        shown += "".join(o.new_text for o in outs[len(ids) :])
        assert outs[-1].finished and outs[-1].text == want == shown, (prompt, ids)


@pytest.mark.parametrize("include", [False, True])
def test_text_that_may_become_a_stop_string_is_held_back(tiny_dir: Path, include: bool) -> None:
    tok = Tokenizer.from_dir(tiny_dir)
    text = "ab 日本 a日x 日本語 tail"
    stop = "日本語"
    params = SamplingParams(max_tokens=200, stop=[stop, "zz"], include_stop_str_in_output=include)
    outs = _run_tokens(tok, tok.encode(text), params)
    want = text[: text.index(stop) + (len(stop) if include else 0)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].text == want
    streamed = ""
    for o in outs:
        streamed += o.new_text
        assert want.startswith(streamed)  # nothing shown is ever taken back
        if not o.finished:  # a tail that may still grow into "日本語" is not shown yet
            assert not streamed.endswith(("日", "日本"))
    assert streamed == want
    # each held "日" / "日本" went out once the next character ruled the stop string out
    assert "日本 " in [o.new_text for o in outs] and "日x" in [o.new_text for o in outs]


# Texts and stop strings the incremental stop handling is checked against a brute-force reading
# of: multi-byte characters, overlapping occurrences, stop strings that are prefixes of one
# another (the one listed first wins at the same place), a tail that is the start of a stop
# string several ways at once, and stop strings that never come.
STOP_TABLE = [
    ("ab 日本 a日x 日本語 tail", ["日本語", "zz"]),
    ("aaaaaaab", ["aab", "aaaaaaaa", "b"]),
    ("abababac", ["ababac", "bac"]),
    ("xxyxxyxxyxxz", ["xxyxxz", "yxxyxxq"]),
    ("the cat sat", ["cat s", "cat", "ca"]),
    ("the cat sat", ["ca", "cat", "cat s"]),
    ("héllo 🙂🙂 wörld 🙂!", ["🙂 w", "llo 🙂🙂 x", "ö"]),
    ("🙂🙂🙂🙂x", ["🙂🙂🙂🙂🙂", "🙂🙂🙂x"]),
    ("日本日本日本語", ["日本日本語", "本日本語"]),
    ("nothing stops this text at all", ["stop!", "texts", "all!", "t at all!"]),
    ("aaaaaaaaaaaa", ["a" * 5 + "b" + "a" * 4, "aab", "a" * 20]),
]


def _brute_stop(text: str, stops: list[str]) -> tuple[int, str]:
    """The first place any stop string occurs in `text` (the first listed at a tie), or -1."""
    found = [(text.find(s), k, s) for k, s in enumerate(stops) if s in text]
    return min(found)[::2] if found else (-1, "")


def _brute_hold(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is the start of a stop string but not all of it."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_and_held_text_match_a_brute_force_reading(chunk: int, include: bool) -> None:
    """As the text grows `chunk` characters a token: where it is cut, and at every token how
    much of it may be shown, are what a scan of the whole text for each stop string says."""
    for whole, stops in STOP_TABLE:
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        seq = Sequence("r", [1], params, 1, 0, 10_000)
        for end in [*range(chunk, len(whole), chunk), len(whole)]:
            seq.text = whole[:end]  # what the detokenizer appended (`_extend_text`)
            at, hit = _brute_stop(whole[:end], stops)
            assert _apply_stop_strings(seq) == (at != -1), (whole, stops, end)
            if at != -1:
                assert seq.text == whole[: at + (len(hit) if include else 0)], (whole, stops)
                seq.finish_reason = "stop"
                assert seq.releasable_text_len() == len(seq.text)
                break
            want = max(seq.sent_text_len, end - _brute_hold(whole[:end], stops))
            assert seq.releasable_text_len() == want, (whole, stops, end)
            seq.sent_text_len = want  # handed out (`RequestOutput.take`)
        else:
            assert all(s not in whole for s in stops)


class _CountedText(str):
    """Text that counts the searches, comparisons and slices made on it."""

    calls = 0

    def _count(self) -> None:
        type(self).calls += 1

    def find(self, *a: Any) -> int:  # type: ignore[override]
        self._count()
        return super().find(*a)

    def rfind(self, *a: Any) -> int:  # type: ignore[override]
        self._count()
        return super().rfind(*a)

    def startswith(self, *a: Any) -> bool:  # type: ignore[override]
        self._count()
        return super().startswith(*a)

    def endswith(self, *a: Any) -> bool:  # type: ignore[override]
        self._count()
        return super().endswith(*a)

    def __getitem__(self, key: Any) -> str:  # type: ignore[override]
        self._count()
        return super().__getitem__(key)


@pytest.mark.parametrize(
    ("step", "stops"),
    [
        # text that never starts a stop string: one search a stop string, not one per prefix
        ("hello world ", [f"Q{i:04d}" + "Z" * 1019 for i in range(8)]),
        # text that starts each stop string hundreds of characters deep but never finishes one
        ("a", ["a" * k + "b" + "a" * (1023 - k) for k in range(500, 508)]),
    ],
)
def test_held_text_costs_no_more_than_the_new_text_per_stop_string(
    step: str, stops: list[str]
) -> None:
    """Deciding how much text to hold back looks at each place in the text once per stop
    string over the whole request: a token costs a few searches per stop string and per new
    character, whatever the stop strings' lengths. (Trying every prefix of every stop string
    at every token took 85 ms a token for 200 stop strings of 2000 characters, on the engine
    thread every request waits for.)"""
    seq = Sequence("r", [1], SamplingParams(stop=stops), 1, 0, 10_000)
    text, tokens = step * (1500 // len(step)), 300
    for _ in range(tokens):
        text += step
        seq.text = _CountedText(text)
        assert seq.releasable_text_len() == len(text) - _brute_hold(text, stops)
    _CountedText.calls = 0
    for _ in range(tokens):
        text += step
        seq.text = _CountedText(text)
        seq.releasable_text_len()
    assert _CountedText.calls <= 3 * len(stops) * (tokens + tokens * len(step))


# -- through the daemon's HTTP path --------------------------------------------------------------


class _Client:
    """One HTTP request driven straight through the ASGI app. Its `send` does not return
    until `release` is set: a client that reads nothing while the answer is generated."""

    def __init__(self, body: dict[str, Any], release: asyncio.Event) -> None:
        self.body, self.release = json.dumps(body).encode(), release
        self.status = 0
        self.chunks: list[bytes] = []
        self._sent_body = False
        self._gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            await self.release.wait()
            self.chunks.append(message.get("body", b""))

    async def call(self, app: Any, path: str) -> bytes:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        await app(scope, self.receive, self.send)
        self._gone.set()
        return b"".join(self.chunks)


def test_http_request_holds_one_output_while_its_client_reads_nothing(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from kvguard.daemon.app import create_app
    from kvguard.daemon.config import load_config
    from kvguard.daemon.service import Service

    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"serving: {{model: {tiny_dir}, kv_cache_bytes: 32MiB, max_model_len: 2048}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    finals: dict[str, RequestOutput] = {}
    deliver = svc.loop._deliver

    def spy(out: RequestOutput) -> None:  # engine thread: keep each request's final output
        if out.finished:
            finals[out.request_id] = out
        deliver(out)

    svc.loop._deliver = spy  # type: ignore[method-assign]
    peak = Peak(svc.loop)
    svc.loop.on_step.append(peak)
    try:
        app = create_app(svc)
        base = {"model": svc.model_name, "prompt": PROMPT, "max_tokens": N, "ignore_eos": True}

        async def both() -> tuple[bytes, bytes, _Client, _Client]:
            release = asyncio.Event()
            sse = _Client(
                {**base, "stream": True, "stream_options": {"include_usage": True}}, release
            )
            plain = _Client(base, release)
            tasks = [asyncio.create_task(c.call(app, "/v1/completions")) for c in (sse, plain)]
            while len(finals) < 2:  # the client reads nothing until both are generated
                await asyncio.sleep(0.05)
            release.set()
            a, b = await asyncio.gather(*tasks)
            return a, b, sse, plain

        sse_body, plain_body, sse, plain = asyncio.run(asyncio.wait_for(both(), 600))
        assert sse.status == plain.status == 200
        assert peak.samples >= N
        assert peak.outputs <= 2, f"{peak.outputs} outputs held for one HTTP request"
        assert peak.size <= 8 * (N + len(PROMPT)) + 2000, f"{peak.size} ids + chars held"

        events = [
            json.loads(line[6:])
            for line in sse_body.decode().split("\n\n")
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        by_id = {f.request_id: f for f in finals.values()}
        assert len(by_id) == 2
        streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        answer = json.loads(plain_body)
        texts = {f.text for f in by_id.values()}
        assert streamed in texts and answer["choices"][0]["text"] in texts
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        want_usage = {"prompt_tokens": len(PROMPT), "completion_tokens": N}
        assert {k: events[-1]["usage"][k] for k in want_usage} == want_usage
        assert {k: answer["usage"][k] for k in want_usage} == want_usage
        assert answer["kvguard"]["truncated"] is False
        assert len(sse.chunks) < N  # the unread deltas went out coalesced, not one per token
    finally:
        svc.close()
