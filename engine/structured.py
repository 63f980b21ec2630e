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
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote

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
# refused schemas and grammars remembered (each kind apart), least recently used dropped, and
# the bytes their reasons may take together (the texts are kept as 32-byte digests)
REFUSALS_KEPT = 256
REFUSALS_BYTES = 256 << 10

T = TypeVar("T")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # a library install without it: name the package
        raise ValueError(f"json_schema: {INSTALL_HINT} ({e})") from e
    return llguidance


class Refusals:
    """Texts the grammar library refused, with the reason, so that one sent again is refused
    at once: a schema it gives up on only after seconds of CPU (a nested `anyOf` whose
    matcher runs out of fuel) cost that again on every send, and a client could keep sending
    it. Keyed by the text's SHA-256 (a refused 2 MB schema takes 32 bytes to remember);
    bounded by count and by the bytes of the reasons, the least recently used dropped. A
    refusal is the library's verdict on the text: it stands as long as the process does."""

    def __init__(self, kept: int = REFUSALS_KEPT, size: int = REFUSALS_BYTES) -> None:
        self._kept, self._size = kept, size
        self._reasons: OrderedDict[bytes, str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # any thread compiles (the daemon's workers, the engine)

    def call(self, text: str, build: Callable[[str], T]) -> T:
        """`build(text)`, or at once the ValueError it raised for the same text before."""
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            reason = self._reasons.get(digest)
            if reason is not None:
                self._reasons.move_to_end(digest)
        if reason is not None:
            raise ValueError(reason)
        try:
            return build(text)
        except ValueError as e:
            self._remember(digest, str(e))
            raise

    def _remember(self, digest: bytes, reason: str) -> None:
        size = len(digest) + len(reason.encode("utf-8", "surrogatepass"))
        if size > self._size:  # alone past the bound: asked again, refused again in full
            return
        with self._lock:
            if digest in self._reasons:
                return
            self._reasons[digest] = reason
            self._bytes += size
            while len(self._reasons) > self._kept or self._bytes > self._size:
                old, gone = self._reasons.popitem(last=False)
                self._bytes -= len(old) + len(gone.encode("utf-8", "surrogatepass"))


_REFUSED_SCHEMAS = Refusals()  # schema texts (`compile_schema`)
_REFUSED_GRAMMARS = Refusals()  # Lark texts (`compile_grammar`)


def compile_schema(schema: dict[str, Any]) -> str:
    """The grammar llguidance runs for `schema`; ValueError naming what is wrong with it (a
    schema is checked here, without a tokenizer, so an API can refuse it before queueing).
    Compiled once per schema text: the API's check and the engine's request share it, and an
    application sends the same schema again and again; refused once per text too."""
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema={schema!r}: expected a JSON schema object")
    try:
        text = json.dumps(schema)  # key order kept: it is the order the JSON is written in
    except RecursionError as e:  # nested past what the JSON encoder follows
        raise ValueError(
            "json_schema: not a JSON schema kvguard can serve: nested too deeply"
        ) from e
    return _REFUSED_SCHEMAS.call(text, _compile)


def compile_grammar(lark: str) -> str:
    """The grammar llguidance runs for Lark text; ValueError naming what is wrong with it. The
    schemas it embeds (`%json {...}`: a tool's call, its arguments) are checked as
    `compile_schema` checks one. Compiled once per text, and refused once per text."""
    return _REFUSED_GRAMMARS.call(lark, _compile_grammar)


@functools.lru_cache(maxsize=COMPILED_SCHEMAS)
def _compile_grammar(lark: str) -> str:
    """`compile_grammar` of a text not refused before (a refusal raises, and is not cached
    here but in `_REFUSED_GRAMMARS`)."""
    what = "grammar: not a grammar"
    grammar = _checked(what, lambda llg: llg.LLMatcher.grammar_from_lark(lark))
    for schema in _embedded_schemas(lark):
        _refuse_empty_cycles(what, schema)
    return grammar


@functools.lru_cache(maxsize=COMPILED_SCHEMAS)
def _compile(text: str) -> str:
    """`compile_schema` of a schema's JSON text not refused before (a refusal raises, and is
    not cached here but in `_REFUSED_SCHEMAS`)."""
    what = "json_schema: not a JSON schema"
    grammar = _checked(
        what, lambda llg: llg.LLMatcher.grammar_from_json_schema(text, defaults=LAYOUT)
    )
    _refuse_empty_cycles(what, json.loads(text))
    return grammar


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


# -- cycles of references that match no value ---------------------------------------------
# llguidance compiles a schema whose `$ref`s only lead back to one another (`A -> B -> A`, `#`
# alone, an object requiring a property that is the object again) without a word; its matcher
# then allows nothing but the answer's end where such a value would begin: an empty answer, or
# a tool call cut off at its arguments, each with `stop`. Refused here instead, naming the cycle.

_DATA = frozenset({"const", "enum", "default", "examples"})  # JSON data, not schemas
_NAMED = frozenset({"properties", "patternProperties", "dependentSchemas"})  # name -> schema
_DEFS = frozenset({"$defs", "definitions"})  # schemas that apply only where a $ref names them
_EMBEDDED = re.compile(r"%json\s*(?=\{)")  # a schema in Lark text (llguidance's dialect)
_MISSING = object()

Key = tuple[int, str]  # a local reference: its resource (the schema's id()), the pointer in it


def _embedded_schemas(lark: str) -> Iterator[Any]:
    """The JSON schemas Lark text embeds (`%json {...}`); text there that is not JSON is the
    grammar library's to refuse."""
    decoder = json.JSONDecoder()
    for found in _EMBEDDED.finditer(lark):
        try:
            yield decoder.raw_decode(lark, found.end())[0]
        except ValueError:
            continue


def _refuse_empty_cycles(what: str, schema: Any) -> None:
    """ValueError naming a cycle of `$ref`s that `schema` reaches and that no JSON value
    closes: the model could only begin such a value, never end it."""
    try:
        cycle = _References(schema).empty_cycle()
    except RecursionError:  # deeper than this walk follows: the library's own checks stand
        return
    if len(cycle) > 8:  # a long one named by its start
        cycle = [*cycle[:3], f"({len(cycle) - 4} more)", cycle[-1]]
    if cycle:
        raise ValueError(
            f"{what} kvguard can serve: $ref cycle {' -> '.join(cycle)} matches no JSON "
            "value: each of its schemas needs a value of the next, so none can end (make the "
            "property or items holding one optional, or give it an alternative such as null)"
        )


@dataclass(slots=True)
class _Target:
    """A schema a `$ref` names, the resource its own references resolve in, and the
    reference as first written (what a refusal shows)."""

    node: Any
    resource: Any
    shown: str


class _References:
    """The local references (`#`, `#/...`) a schema reaches, and which of them no value
    matches: a least fixpoint, as a grammar's productive symbols are found. A reference it
    does not follow (an anchor, another document, a pointer through another `$id`'s resource)
    counts as matching: only an empty cycle it sees is refused, never a schema that serves."""

    def __init__(self, root: Any) -> None:
        self._targets: dict[Key, _Target] = {}  # in the order they are reached
        self._reach(root)

    def empty_cycle(self) -> list[str]:
        """The first cycle (references as written, the first again at the end) among the
        references no value matches; [] when there is none."""
        blocked = self._blocked()
        ends_empty: set[Key] = set()  # leads to a schema empty on its own (`false`), not a cycle
        for key in self._targets:
            cycle = _cycle_from(key, blocked, ends_empty)
            if cycle:
                return [self._targets[k].shown for k in cycle]
        return []

    def _reach(self, root: Any) -> None:
        stack = [(root, root)]
        seen: set[int] = set()
        while stack:
            node, resource = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            resource = node if _own_id(node) else resource
            target = self._follow(node.get("$ref"), resource)
            if target is not None:
                stack.append((target.node, target.resource))
            stack.extend((part, resource) for part in _subschemas(node))

    def _follow(self, ref: Any, resource: Any) -> _Target | None:
        key = _key(ref, resource)
        if key is None:
            return None
        if key not in self._targets:
            node, within = _resolve(resource, key[1])
            if node is _MISSING:
                return None
            self._targets[key] = _Target(node, within, ref)
        return self._targets[key]

    def _blocked(self) -> dict[Key, list[Key]]:
        """Each reference no value matches, with those it waits on (first the one its first
        failing part names; none when it is empty on its own, as `false` is)."""
        matching: set[Key] = set()
        blocked: dict[Key, list[Key]] = {}
        waiting: dict[Key, list[Key]] = {}  # reference -> those to look at again once it matches
        pending = list(reversed(self._targets))
        while pending:
            key = pending.pop()
            if key in matching:
                continue
            target = self._targets[key]
            needs = self._needs(target.node, target.resource, matching)
            if needs is None:
                matching.add(key)
                blocked.pop(key, None)
                pending.extend(waiting.pop(key, []))
                continue
            blocked[key] = needs
            for other in needs:
                waiting.setdefault(other, []).append(key)
        return blocked

    def _needs(self, node: Any, resource: Any, matching: set[Key]) -> list[Key] | None:
        """None when some value matches `node`, the references in `matching` known to; else
        the references it waits on ([]: it matches nothing whatever they match)."""
        if node is False:
            return []
        if not isinstance(node, dict):
            return None
        resource = node if _own_id(node) else resource
        key = _key(node.get("$ref"), resource)
        if key in self._targets and key not in matching:
            return [key]
        for part in _conjuncts(node):
            needs = self._needs(part, resource, matching)
            if needs is not None:
                return needs
        for keyword in ("anyOf", "oneOf"):
            needs = self._needs_any(node.get(keyword), resource, matching)
            if needs is not None:
                return needs
        return None

    def _needs_any(self, branches: Any, resource: Any, matching: set[Key]) -> list[Key] | None:
        """`_needs` of alternatives: None when one matches, else what they all wait on."""
        if not isinstance(branches, list):
            return None
        waits: list[Key] = []
        for branch in branches:
            needs = self._needs(branch, resource, matching)
            if needs is None:
                return None
            waits += needs
        return waits


def _cycle_from(key: Key, blocked: dict[Key, list[Key]], ends_empty: set[Key]) -> list[Key]:
    """The cycle reached from `key` by following, from each reference no value matches, the
    first one it waits on; [] where that ends at a matching one or one empty on its own
    (whose path is added to `ends_empty`, so no path is followed twice)."""
    path: dict[Key, int] = {}  # reference -> its place on the path
    while key not in path:
        if not blocked.get(key) or key in ends_empty:
            ends_empty.update(path)
            return []
        path[key] = len(path)
        key = blocked[key][0]
    return [*list(path)[path[key] :], key]


def _key(ref: Any, resource: Any) -> Key | None:
    """A local reference's key; None for one not followed (an anchor, another document)."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    return id(resource), unquote(ref[1:])


def _own_id(node: dict[str, Any]) -> bool:
    """Whether `node` is a resource of its own: its references resolve against it."""
    own = node.get("$id")
    return isinstance(own, str) and not own.startswith("#")  # draft 7's `#name` is an anchor


def _resolve(resource: Any, pointer: str) -> tuple[Any, Any]:
    """The schema at a JSON pointer ("/$defs/A") in `resource`, and the resource its own
    references resolve in; _MISSING where there is none or the path passes through another
    resource (an `$id` of its own) on the way."""
    node = resource
    for token in pointer.split("/")[1:]:
        if node is not resource and isinstance(node, dict) and _own_id(node):
            return _MISSING, None
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return _MISSING, None
    return node, node if isinstance(node, dict) and _own_id(node) else resource


def _subschemas(node: dict[str, Any]) -> Iterator[Any]:
    """The schemas in `node` that apply to it or to its values; not its definitions, which
    apply only where a reference names them."""
    for keyword, value in node.items():
        if keyword in _DATA or keyword in _DEFS:
            continue
        if keyword in _NAMED and isinstance(value, dict):
            yield from value.values()
        elif isinstance(value, list):
            yield from value
        elif isinstance(value, dict):
            yield value


def _conjuncts(node: dict[str, Any]) -> Iterator[Any]:
    """The schemas every value matching `node` holds a match of: `allOf`'s, and where its
    `type` admits objects alone the required properties', where it admits arrays alone the
    items `minItems` asks for and `contains`'. A keyword about an object's or an array's
    contents binds no other value: `{"type": ["object", "null"], "required": ["next"]}` (or
    no `type` at all) is matched by null, so a `next` that is the node again ends there."""
    all_of = node.get("allOf")
    if isinstance(all_of, list):
        yield from all_of
    if _admits_only(node, "object"):
        yield from _required_properties(node)
    if _admits_only(node, "array"):
        yield from _required_items(node)
        if "contains" in node and _count(node.get("minContains", 1)) >= 1:
            yield node["contains"]


def _admits_only(node: dict[str, Any], kind: str) -> bool:
    """Whether `node`'s own `type` admits values of `kind` alone (`"object"`, `["object"]`).
    A narrower kind set elsewhere (an `allOf`, a `oneOf` of objects, an `enum`) is not looked
    for: such a node then counts as matching a value it does not, which can only serve a
    schema with an empty cycle, never refuse one that has a value."""
    declared = node.get("type")
    if isinstance(declared, list):
        return bool(declared) and all(each == kind for each in declared)
    return declared == kind


def _required_properties(node: dict[str, Any]) -> Iterator[Any]:
    """The property schemas an object matching `node` must hold a value of (`required`)."""
    properties, required = node.get("properties"), node.get("required")
    if isinstance(properties, dict) and isinstance(required, list):
        yield from (properties[n] for n in required if isinstance(n, str) and n in properties)


def _required_items(node: dict[str, Any]) -> Iterator[Any]:
    """The item schemas an array matching `node` must hold a value of (`minItems`)."""
    least = _count(node.get("minItems", 0))
    if least <= 0:
        return
    prefix, rest = node.get("prefixItems"), node.get("items")
    if not isinstance(prefix, list):  # before 2020-12, a list of `items` is the prefix
        prefix, rest = (rest, node.get("additionalItems")) if isinstance(rest, list) else ([], rest)
    yield from prefix[:least]
    if least > len(prefix) and rest is not None:
        yield rest


def _count(value: Any) -> int:
    """A keyword's count (`minItems`); 0 where it is not a number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1:
        return 0  # (NaN too)
    return int(min(value, 2**31))


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
        self._refused = Refusals()  # grammars no matcher of this tokenizer's serves
        # a request's schema or Lark text -> its compiled grammar, as `prepare` met it: what
        # `prepared` looks a kept matcher up by without compiling anything
        self._sources: OrderedDict[str, str] = OrderedDict()

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
        field, grammar = _compiled(params)
        self._template(field, grammar)
        source = _source(params)
        if source is None:
            return
        with self._templates_lock:
            self._sources[source] = grammar
            self._sources.move_to_end(source)
            while len(self._sources) > MATCHER_TEMPLATES:
                self._sources.popitem(last=False)

    def prepared(self, params: SamplingParams) -> bool:
        """Whether `prepare` has nothing left to do for `params`: the matcher of its schema or
        grammar is kept (a json_object answer's, a schema an application sends again). It
        compiles and builds nothing, so a server can ask it before queueing a request for a
        compile worker, and a request whose matcher is ready never waits behind another
        client's slow schemas."""
        source = _source(params)
        with self._templates_lock:
            grammar = self._sources.get(source) if source is not None else None
            return grammar is not None and grammar in self._templates

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
        try:
            matcher = self._refused.call(grammar, self._new_matcher)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from e
        with self._templates_lock:
            self._templates[grammar] = matcher
            self._templates.move_to_end(grammar)
            while len(self._templates) > MATCHER_TEMPLATES:
                self._templates.popitem(last=False)
        return matcher

    def _new_matcher(self, grammar: str) -> Any:
        """A matcher at `grammar`'s start; ValueError saying why when the library cannot serve
        it (a large schema's can take seconds to fail: its fuel runs out)."""
        matcher = _llguidance().LLMatcher(self.view(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"not one kvguard can serve: {matcher.get_error()}")
        if self._only_ends(matcher):
            raise ValueError(
                "not one kvguard can serve: it matches no text, so every answer would end at "
                "once, empty (look for rules or definitions that only name one another)"
            )
        return matcher

    def _only_ends(self, matcher: Any) -> bool:
        """Whether a fresh matcher allows nothing but an end-of-sequence token: the grammar
        matches no text (llguidance builds one whose rules only name one another, `a: b`,
        `b: a`, without an error, and says so only at its first mask). Asked of a copy: the
        mask puts the matcher in error."""
        words = np.frombuffer(matcher.deep_copy().compute_bitmask(), dtype=np.uint8)
        allowed = np.flatnonzero(np.unpackbits(words, bitorder="little")[: self._vocab])
        return allowed.size > 0 and set(allowed.tolist()) <= set(self._eos)


def _source(params: SamplingParams) -> str | None:
    """What a request's grammar is compiled from, as one text (its Lark grammar, or its schema's
    JSON in the key order `compile_schema` writes it); None where that cannot be written (a
    schema nested past what the JSON encoder follows: `compile_schema` refuses it)."""
    if params.grammar is not None:
        return "lark:" + params.grammar
    try:
        return "json:" + json.dumps(params.json_schema or {})
    except (RecursionError, TypeError, ValueError):
        return None


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
