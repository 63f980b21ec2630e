"""Structured output: a request's tokens held to a JSON schema while they are drawn.

A request with `SamplingParams.json_schema` (the OpenAI `response_format` of type
`json_object` or `json_schema`) gets a `Grammar`: before each of its draws, every token that
cannot continue a text matching the schema gets -inf (`allowed`), so greedy and sampled
draws alike pick among those that can; each token drawn then advances it (`advance`). Once
the text is complete and nothing may follow, the request finishes with `stop`; while it may
still end or go on (a number's digits), an end-of-sequence token is among the allowed ones.

The schema is compiled, and the tokens matched, by llguidance (a Rust library, imported on
first use: an engine that never sees a schema never loads it). Its tokenizer view is built
once per engine from the model's own tokenizer (about 0.3 s for a 49k vocabulary, on the
first such request) and shared by every request's grammar; a token's mask and advance cost
about 0.1 ms (a request's first mask a few ms). A grammar's matcher takes as long to build as
its schema is large (half a second for 5000 fields): it is built once per grammar, off the
engine thread where the daemon serves (`Grammars.prepare`), and each request (each choice of
`n`) gets a copy of it (0.15 ms for 5000 fields), so no step waits on a large schema.
The JSON is laid out on one line as Python's `json.dumps` writes it (`{"a": 1, "b": [2, 3]}`):
with free whitespace between tokens a model may write spaces and newlines until its token
limit (a random-weight model did, at every temperature), and a fixed layout bounds the answer
to a schema of bounded values. A schema may say otherwise under llguidance's own key,
`"x-guidance": {"whitespace_flexible": true}`.

A request may instead give a grammar (`SamplingParams.grammar`: Lark text in llguidance's
dialect, whose `%json {...}` embeds a schema); the daemon's tool calls are one (a text answer
or `<tool_call>` blocks holding a function's name and arguments, see daemon/tools.py).

Jump-forward: where the grammar allows a single continuation (`{"name": "` at the start of
a person, `", "age": ` after the name, a tool call's frame), those tokens are appended at
once after the drawn one (`forced`) and computed together in the next step, instead of a
step and a draw each (9 of 21 tokens of a person's JSON). They are that step's decode rows,
not a prompt chunk (`Sequence.decoding`), as a verify step's drafts are: each attends as a
decode row of its own and the CPU GEMMs give them the decode rows' kernel (README, CPU
GEMMs). So a short chunk pays no prompt kernel's fixed cost (on an AMX-BF16 CPU, prompt rows
however few convert every weight for the bf16 tiles), and its logits are one-token steps'
bit for bit, except where decode attention's split of a long sequence over the threads, or
its shared-prefix read, differs between the two: the rows of a chunk of three or more over
two full blocks or more read those blocks once, together, which moved the default model's
logits by up to 0.02 from its one-token steps alone. A request asking for log-probabilities
draws every token (a forced token has none to give). A seeded request spends a draw on each
forced token too, so it makes the same draws either way, and so the same tokens wherever
those logits agree.

A grammar lives on its sequence in the engine process and moves only forward: a preempted
request keeps its tokens (recomputed or swapped back), so its grammar stays where it was.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvguard.engine.sampling_params import SamplingParams

# One line, separators as Python's json.dumps writes them: readable, and no room to loop
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL_HINT = "structured output needs llguidance (pip install llguidance)"
COMPILED_SCHEMAS = 256  # schemas whose grammars are kept, least recently used dropped
# grammars whose fresh matchers an engine keeps to copy, least recently used dropped (a
# 5000-field schema's is about 16 MB, a few fields' next to nothing)
MATCHER_TEMPLATES = 16


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # a library install without it: name the package
        raise ValueError(f"json_schema: {INSTALL_HINT} ({e})") from e
    return llguidance


def compile_schema(schema: dict[str, Any]) -> str:
    """The grammar llguidance runs for `schema`; ValueError naming what is wrong with it (a
    schema is checked here, without a tokenizer, so an API can refuse it before queueing).
    Compiled once per schema text: the API's check and the engine's request share it, and an
    application sends the same schema again and again."""
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema={schema!r}: expected a JSON schema object")
    try:
        text = json.dumps(schema)  # key order kept: it is the order the JSON is written in
    except RecursionError as e:  # nested past what the JSON encoder follows
        raise ValueError(
            "json_schema: not a JSON schema kvguard can serve: nested too deeply"
        ) from e
    return _compile(text)


@functools.lru_cache(maxsize=COMPILED_SCHEMAS)
def compile_grammar(lark: str) -> str:
    """The grammar llguidance runs for Lark text; ValueError naming what is wrong with it."""
    return _checked("grammar: not a grammar", lambda llg: llg.LLMatcher.grammar_from_lark(lark))


@functools.lru_cache(maxsize=COMPILED_SCHEMAS)
def _compile(text: str) -> str:
    """`compile_schema` of a schema's JSON text (a refusal raises, and is not cached)."""
    return _checked(
        "json_schema: not a JSON schema",
        lambda llg: llg.LLMatcher.grammar_from_json_schema(text, defaults=LAYOUT),
    )


def _checked(what: str, build: Callable[[Any], str]) -> str:
    """The grammar `build` makes with the library, validated; ValueError "`what` kvguard
    can serve: why" when it cannot be made or is not valid."""
    llg = _llguidance()
    try:
        grammar = build(llg)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what} kvguard can serve: {e}") from e
    problem = llg.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(f"{what} kvguard can serve: {problem}")
    return grammar


class Grammars:
    """One engine's grammar factory: the tokenizer view built on the first schema."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._eos = sorted(eos_ids)
        self._view: Any = None
        self._lock = threading.Lock()
        self.requests = 0  # structured requests queued (counted by the engine)
        self.seconds = 0.0  # spent in every grammar's masks and advances (the engine thread)
        self._token_bytes: dict[int, bytes] = {}  # token id -> its raw bytes (token_bytes)
        # compiled grammar -> a matcher at its start, never advanced: what requests copy
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._templates_lock = threading.Lock()  # held only to look up and store, never to build

    def view(self) -> Any:
        """The library's view of the tokenizer, built on the first call (any thread: the
        daemon builds it off the engine thread, so no step waits the 0.3 s)."""
        with self._lock:
            if self._view is None:
                self._view = _llguidance().LLTokenizer(
                    self._tokenizer.backend_json(), n_vocab=self._vocab, eos_token=self._eos
                )
            return self._view

    def token_bytes(self, token_id: int) -> bytes:
        """A token's raw bytes, as the view has them (a token holding part of a character
        has its bytes, not a replacement character); the view is built on the first call. An
        id past the tokenizer's vocabulary (the model's padding rows) is no text: no bytes.
        Where the tokenizer spells a token's bytes itself (a byte token), they come first: the
        view marks special tokens with byte 0xFF, so the token that is that byte (`<0xFF>`,
        byte-level `ÿ`) read as none, and every logprob offset after it was one short."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            known = token_id < self._tokenizer.vocab_size
            own = self._tokenizer.raw_bytes(token_id) if known else None
            raw = own or (bytes(self.view().decode_bytes([token_id])) if known else b"")
            self._token_bytes[token_id] = raw
        return raw

    def prepare(self, params: SamplingParams) -> None:
        """Build the matcher that `for_params` copies for a request's `json_schema` or
        `grammar` (any thread: the daemon builds it off the engine thread, as it does the
        view, so no step waits the half second a large schema's takes); ValueError naming
        the field when the grammar library cannot serve it."""
        self._template(*_compiled(params))

    def for_params(self, params: SamplingParams) -> Grammar:
        """A fresh grammar for one request's `json_schema` or `grammar`: a copy of its
        prepared matcher (0.15 ms for 5000 fields; built here first, a few ms for a schema of
        a hundred fields, where nothing prepared it or it was dropped since)."""
        matcher = self._template(*_compiled(params)).deep_copy()
        return Grammar(matcher, self._vocab, self)

    def _template(self, field: str, grammar: str) -> Any:
        """The matcher at `grammar`'s start, kept to be copied (never advanced itself)."""
        with self._templates_lock:
            matcher = self._templates.get(grammar)
            if matcher is not None:
                self._templates.move_to_end(grammar)
                return matcher
        # built without the lock: the engine thread copying another grammar's never waits
        matcher = _llguidance().LLMatcher(self.view(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{field}: not one kvguard can serve: {matcher.get_error()}")
        with self._templates_lock:
            self._templates[grammar] = matcher
            self._templates.move_to_end(grammar)
            while len(self._templates) > MATCHER_TEMPLATES:
                self._templates.popitem(last=False)
        return matcher


def _compiled(params: SamplingParams) -> tuple[str, str]:
    """The field a request's grammar comes from, and the grammar compiled (cached)."""
    if params.grammar is not None:
        return "grammar", compile_grammar(params.grammar)
    return "json_schema", compile_schema(params.json_schema or {})


class Grammar:
    """One request's place in its schema's grammar."""

    def __init__(self, matcher: Any, vocab_size: int, owner: Grammars) -> None:
        self._m = matcher
        self._vocab = vocab_size
        self._owner = owner  # where the time it takes is counted

    def allowed(self) -> torch.Tensor | None:
        """A bool per vocabulary entry: whether the token may come next. None when nothing
        may (the grammar is in error): the draw is then left alone, and `advance` refuses
        what it gives, so the fault ends this request only, not its batch's step."""
        t0 = time.perf_counter()
        words = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self._vocab].astype(np.bool_)
        self._spent(t0)
        return torch.from_numpy(bits) if bits.any() else None

    def advance(self, token: int) -> bool:
        """Take the drawn token; False when the grammar cannot (it is then in error)."""
        t0 = time.perf_counter()
        ok = bool(self._m.consume_token(token))
        self._spent(t0)
        return ok

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here, taken: a schema's fixed keys and
        punctuation, which no draw could choose otherwise."""
        t0 = time.perf_counter()
        tokens = list(self._m.compute_ff_tokens())
        if tokens and not self._m.consume_tokens(tokens):
            tokens = []  # cannot happen (the library forced them); the grammar says so next
        self._spent(t0)
        return tokens

    def _spent(self, t0: float) -> None:
        self._owner.seconds += time.perf_counter() - t0

    @property
    def complete(self) -> bool:
        """Nothing may follow: the text matches the schema and is closed."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error())
