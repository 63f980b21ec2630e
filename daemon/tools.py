"""Tool (function) calling on chat requests, the same way for every model.

A request's `tools` are described to the model in a system message (their names,
descriptions and argument schemas, and how to call one), and a call is written as

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one per line for several calls. The answer is held to that form by a grammar (the engine's
`SamplingParams.grammar`, run by llguidance like a JSON schema): with `tool_choice`
`"required"` it is one or more calls (one with `parallel_tool_calls: false`), with a named
function one call of that function, and with `"auto"` either calls or a text answer (anything
not beginning with OPEN; with a `response_format` schema, JSON matching it). Each call's
arguments match its function's `parameters` schema, so a call always parses and always
validates: a model that was never taught this form still calls tools correctly, and one that
was (most tool-trained models write `<tool_call>` blocks) needs no parser of its own.

The conversation comes back the same way: an assistant message's `tool_calls` are rendered as
the blocks the model wrote, and a `tool` message as a user turn holding
`<tool_response>...</tool_response>` (a chat template without a tool role renders it too),
whatever the model's own template would do with a tool role. A result names no call, so the
model tells results apart by their places: they are rendered in the order of the calls they
answer, whatever order they were sent in (`openai_schemas._tool_results`). Where the chat
template takes no system message or no two user turns in a row (`Tokenizer.template_layout`:
Gemma's, Mistral v0.1's, Llama 2's), the request's own system message and the tools (where any
are in play: with or without, a conversation is laid out alike) go before the first user turn's
text, and one assistant turn's results, with a user message sent right after them, are one
user turn; a template that takes both renders the conversation laid out as above.

The texts handed to the chat template are built as `Piece`s, each marked with the request field
it holds: the prompt is encoded with special tokens matched across the whole text, so a check of
special tokens' text (`api.special_tokens_in_messages: refuse`) reads the joined text and names
the field a hit touches, while kvguard's own words around the fields are not the client's.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvguard.engine.structured import LAYOUT
from kvguard.engine.tokenizer import TemplateLayout

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TAKES_ALL = TemplateLayout()  # a chat template that takes a system message and user turns in a row
# a call's start up to its arguments, in the one layout the grammar writes
_HEAD = re.compile(re.escape(OPEN) + r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
_NAME = re.compile(r"[A-Za-z0-9_-]{0,64}")


class Piece(NamedTuple):
    """Part of a text the chat template is given, and the request field it holds."""

    text: str
    field: str | None = None  # None: kvguard's own words around the fields
    as_sent: bool = True  # False: the field written out as JSON (its escapes read)


def joined(pieces: Sequence[Piece]) -> str:
    return "".join(p.text for p in pieces)


def _json(value: Any, field: str) -> Piece:
    """`value` as JSON (as json.dumps writes it inside an object), marked with its field."""
    return Piece(json.dumps(value, ensure_ascii=False), field, as_sent=False)


def _lines(lines: Sequence[Sequence[Piece]]) -> list[Piece]:
    """The lines' pieces one after another, a newline between two lines."""
    out: list[Piece] = []
    for k, line in enumerate(lines):
        out += [Piece("\n"), *line] if k else line
    return out


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None  # None: any arguments object


@dataclass(frozen=True, slots=True)
class Named:
    """`tool_choice` naming one function: kept apart from the modes "auto" and "required",
    which are also valid function names."""

    name: str


Choice = str | Named  # "auto", "required", or the one function to call


@dataclass(frozen=True, slots=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


def call_schema(fn: Function) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON a call of `fn` is: its name, and arguments matching its parameters (an object
    where they name no type); and the definitions it needs at the root of its call's
    schema. Parameters that refer to themselves (`#`, `#/$defs/...`: pydantic's nested
    models) are such a definition, their references rebased onto it: in place, `#` would
    mean the call around them."""
    args = fn.parameters if fn.parameters is not None else {}
    args = args if "type" in args else {**args, "type": "object"}
    defs: dict[str, Any] = {}
    if _refers_locally(args):
        key = f"kvguard_arguments_{fn.name}"
        defs[key] = _rebased(args, f"#/$defs/{key}")
        args = {"$ref": f"#/$defs/{key}"}
    call = {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": args},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return call, defs


# keywords whose values are JSON data, not schemas: a "$ref" inside one is not a reference
_DATA = frozenset({"const", "enum", "default", "examples"})
# keywords whose values map names to schemas: their keys are not keywords
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each local reference by pointer (`#`, `#/...`) taken relative to `base`
    instead. A reference to an anchor (`#foo`) is left as it is (an anchor is named across its
    document, wherever its schema sits), and so is a schema with an `$id` of its own, a
    resource whose references resolve against it wherever it sits."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if isinstance(schema.get("$id"), str) and not schema["$id"].startswith("#"):
        return schema  # (an `$id` of only a fragment is draft 7's anchor: no new resource)
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: _rebased(s, base) for name, s in v.items()}
        elif k in _DATA:
            out[k] = v
        else:
            out[k] = _rebased(v, base)
    return out


def _refers_locally(schema: Any) -> bool:
    """Whether `schema` holds a local reference (one `_rebased` would change)."""
    return _rebased(schema, "#/x") != schema


def grammar(
    functions: Sequence[Function],
    choice: Choice,
    parallel: bool,
    content_schema: dict[str, Any] | None = None,
    text_tokens: Mapping[str, int] | None = None,
) -> str:
    """The Lark grammar (llguidance's dialect) an answer with tools is held to. `choice`:
    "auto", "required", or the one function to call. Each function's call is a JSON
    document of its own (`args: args_0 | args_1 | ...`), so that the `$anchor`s and `$id`s
    of one function's parameters name nothing in another's: in one document holding every
    call, two functions' same-named anchors or ids would collide. `text_tokens`: the
    tokenizer's added tokens that are text (`Tokenizer.text_tokens`), which a literal of
    their whole text takes by id (`_literal`)."""
    tokens = text_tokens or {}
    if isinstance(choice, Named):
        functions = [f for f in functions if f.name == choice.name]
        parallel = False
    documents = []
    for i, f in enumerate(functions):
        schema, needs = call_schema(f)
        if needs:
            schema = {**schema, "$defs": needs}
        documents.append(f"args_{i}: %json {json.dumps({**schema, 'x-guidance': LAYOUT})}")
    lines = [
        f"calls: call{' (nl call)*' if parallel else ''}",
        f"call: {_literal(OPEN, tokens)} args {_literal(CLOSE, tokens)}",
        "args: " + " | ".join(f"args_{i}" for i in range(len(documents))),
        *documents,
        f"nl: {_literal(chr(10), tokens)}",
    ]
    if choice != "auto":
        return "\n".join(["start: calls", *lines])
    if content_schema is None:
        content = f"content: /{_not_a_call()}/"
    else:
        content = f"content: %json {json.dumps({**content_schema, 'x-guidance': LAYOUT})}"
    return "\n".join(["start: content | calls", content, *lines])


def _literal(text: str, tokens: Mapping[str, int]) -> str:
    """`text` as a grammar literal; where it is the whole text of an added token that is text
    (Qwen2.5's `<tool_call>`), that token by id as well. The grammar library counts every
    added token as special: it offers the token for the literal's text, then refuses it when
    drawn, so the answer failed at its first token and the model could never write the token
    it was trained to call with. (A token marked special is left to the text: an answer
    leaves its text out, so a call written with it would not parse.)"""
    quoted = json.dumps(text)
    return f"(<[{tokens[text]}]> | {quoted})" if text in tokens else quoted


def _not_a_call() -> str:
    """A regex for every non-empty text that does not begin with OPEN: one that parts from
    OPEN at some character (an HTML tag, `<3`, `<tool>`), or a proper prefix of OPEN alone.
    (The grammar library has no lookahead; this is its complement, spelled out.)"""
    parts = []
    for i, ch in enumerate(OPEN):
        head = "".join(_regex_char(c) for c in OPEN[:i])
        parts.append(f"{head}[^{_regex_char(ch)}][\\s\\S]*")
        if i:
            parts.append(head)
    return "|".join(parts)


def _regex_char(ch: str) -> str:
    """`ch` as a regex literal. Only metacharacters are escaped: `\\<` and `\\>` are word
    boundaries to the grammar library's regex syntax, not angle brackets."""
    return "\\" + ch if ch in "\\.+*?()|[]{}^$#&-~/" else ch


def system_text(functions: Sequence[Function], choice: Choice, parallel: bool) -> str:
    """What the model is told about its tools (a system message, or after the first one)."""
    return joined(system_pieces(functions, choice, parallel))


def system_pieces(functions: Sequence[Function], choice: Choice, parallel: bool) -> list[Piece]:
    """`system_text` in pieces: each function's name, description and parameters marked as
    `tools[k].function...` (`functions` are the request's tools, in their order)."""
    intro = (
        "You can call functions. Each is given as JSON: its name, what it does, and the JSON "
        "schema of its arguments."
    )
    lines = [[Piece(intro)], *(_listed(f, f"tools[{k}].function") for k, f in enumerate(functions))]
    form = f'{OPEN}{{"name": <function name>, "arguments": <arguments as JSON>}}{CLOSE}'
    several = " (one line per call)" if parallel else ""
    if isinstance(choice, Named):
        named = Piece(choice.name, "tool_choice.function.name")
        lines.append([Piece("Answer by calling "), named, Piece(f": {form}.")])
    elif choice == "auto":
        how = f"To call a function, answer with {form}{several} and nothing else. "
        lines.append([Piece(how + "Otherwise answer as usual.")])
    else:
        lines.append([Piece(f"Answer by calling a function: {form}{several}.")])
    return _lines(lines)


def _listed(f: Function, field: str) -> list[Piece]:
    """A function as the system message lists it: the JSON object of its name, description and
    parameters (as json.dumps writes it, on one line), each value marked with its field."""
    out = [Piece('{"name": '), _json(f.name, f"{field}.name")]
    if f.description:
        out += [Piece(', "description": '), _json(f.description, f"{field}.description")]
    if f.parameters is None:  # any arguments: kvguard's words, not the client's
        out.append(Piece(', "parameters": {"type": "object"}'))
    else:
        out += [Piece(', "parameters": '), _json(f.parameters, f"{field}.parameters")]
    return [*out, Piece("}")]


def with_tools(
    messages: list[dict[str, str]],
    functions: Sequence[Function],
    choice: Choice,
    parallel: bool,
    layout: TemplateLayout = TAKES_ALL,
) -> list[dict[str, str]]:
    """`messages` with the tools described: after the first system message's text, or in a
    system message of their own before the others; for a chat template that takes no system
    message (`layout`), before the first user turn's text (`_folded`)."""
    text = system_text(functions, choice, parallel)
    return _described(messages, text, "\n\n", layout.system)


def with_tools_pieces(
    messages: list[dict[str, Any]],
    functions: Sequence[Function],
    choice: Choice,
    parallel: bool,
    layout: TemplateLayout = TAKES_ALL,
) -> list[dict[str, Any]]:
    """`with_tools` on messages whose texts are pieces (`ChatMessage.template_pieces`)."""
    text = system_pieces(functions, choice, parallel)
    return _described(messages, text, [Piece("\n\n")], layout.system)


def _described(
    messages: list[dict[str, Any]], text: Any, gap: Any, system: bool
) -> list[dict[str, Any]]:
    """`with_tools` for texts of either kind (strings, or lists of pieces: `+` joins both)."""
    if not system:
        return _folded(messages, text, gap)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": messages[0]["content"] + gap + text}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def system_folded(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (texts of either kind) with no tools in play, for a chat template that takes
    no system message (`TemplateLayout.system`): the first system message's text put before
    the first user turn's text, as with tools (`_folded`), so that a conversation is served
    alike whether a request offers tools or not (an agent's last turn sends `tool_choice:
    "none"` or no tools) and its prompt prefixes stay cached. Gemma 3's own template folds a
    system message so; Gemma 1's and 2's and Mistral v0.1's refuse it, which would refuse
    without tools a conversation served the turn before with them."""
    if not messages or messages[0]["role"] not in ("system", "developer"):
        return messages
    return _folded(messages, None, _like(messages[0]["content"], "\n\n"))


def _folded(messages: list[dict[str, Any]], text: Any, gap: Any) -> list[dict[str, Any]]:
    """`messages` with the tools described (`text`; None: no tools) for a template that takes
    no system message, as such templates' own families fold one (Gemma 3's, Llama 2's): the
    first system message's text (the client's), then the tools, put before the first user
    turn's text; in a user turn of their own where the conversation does not begin with one
    (a template that insists on alternation wants a user turn first). No other message
    moves."""
    if messages and messages[0]["role"] in ("system", "developer"):
        own, messages = messages[0]["content"], messages[1:]
        text = own if text is None else own + gap + text
    if text is None:
        return messages
    if messages and messages[0]["role"] == "user":
        first = {**messages[0], "content": text + gap + messages[0]["content"]}
        return [first, *messages[1:]]
    return [{"role": "user", "content": text}, *messages]


def user_turns_joined(messages: list[dict[str, Any]], sent: Sequence[str]) -> list[dict[str, Any]]:
    """`messages` (texts of either kind; `sent[i]`: the role messages[i] was sent with) for a
    chat template that insists that user and assistant alternate
    (`TemplateLayout.user_after_user`), without the user turns in a row that kvguard's own
    rendering makes (a tool result is a user turn): each run of tool results (one assistant
    turn's calls answered) is one user turn, their blocks in order, a newline between two,
    and a user message sent right after the results (an agent loop's next question) ends
    that turn after a blank line, as it would follow them in a template with a tool role.
    Two user messages in a row as the client sent them stay two turns: the template's
    refusal of them is the client's to read. The turn keeps a name its parts all have."""
    out: list[dict[str, Any]] = []
    for k, message in enumerate(messages):
        if k and sent[k - 1] == "tool" and sent[k] in ("tool", "user"):
            gap = _like(message["content"], "\n" if sent[k] == "tool" else "\n\n")
            out[-1] = _joined_turns(out[-1], message, gap)
        else:
            out.append(message)
    return out


def _like(content: str | Sequence[Piece], text: str) -> str | list[Piece]:
    """kvguard's own words `text` in the kind of `content`: a string, or pieces."""
    return text if isinstance(content, str) else [Piece(text)]


def _joined_turns(turn: dict[str, Any], after: dict[str, Any], gap: Any) -> dict[str, Any]:
    """The user turn `turn` with the user turn `after` after its text; a name both do not
    have is left out (the one turn is no one tool's or speaker's)."""
    joined_turn = {**turn, "content": turn["content"] + gap + after["content"]}
    if _text(turn.get("name")) != _text(after.get("name")):
        joined_turn.pop("name", None)
    return joined_turn


def _text(value: str | Sequence[Piece] | None) -> str | None:
    """A text of either kind (a string, or pieces) as a string."""
    return value if value is None or isinstance(value, str) else joined(value)


def render_calls(content: Sequence[Piece], calls: Sequence[tuple[str, str, str]]) -> list[Piece]:
    """An assistant turn's text with its calls (name, arguments JSON, the call's `function`
    field) as the model wrote them; arguments that are not JSON are rendered as the string they
    are. Arguments that are JSON are written anew, their escapes read (`\\u003c` is `<`)."""
    blocks = [_block(name, arguments, field) for name, arguments, field in calls]
    return _lines([content, *blocks] if joined(content) else blocks)


def _block(name: str, arguments: str, field: str) -> list[Piece]:
    """One call as the model writes it: `{"name": ..., "arguments": ...}` (as json.dumps writes
    that object) between OPEN and CLOSE."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return [
        Piece(OPEN + '{"name": '),
        _json(name, f"{field}.name"),
        Piece(', "arguments": '),
        _json(args, f"{field}.arguments"),
        Piece("}" + CLOSE),
    ]


def render_result(content: Sequence[Piece]) -> list[Piece]:
    """A tool message's text as the user turn that carries it (in its call's place among
    the results: the block does not say which call it answers)."""
    return [Piece("<tool_response>\n"), *content, Piece("\n</tool_response>")]


def parse(text: str) -> list[Call] | None:
    """The calls an answer makes; None when it is a text answer (or calls cut short by
    max_tokens or a stop string, which are not calls: the text is returned as it is)."""
    stream = CallStream()
    stream.feed(text)
    return stream.finish()


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallStream:
    """An answer that may be calls, read as it is generated. `feed` returns the content to
    show now (nothing while the text may still be calls; all of it once it cannot) and the
    calls' stream deltas: a call's id and name once its head is complete, then its arguments'
    JSON text as it comes (the end of the arguments is found by scanning the JSON, strings
    and escapes included, so a `</tool_call>` inside a string is an argument's text). One
    feed's deltas hold at most one entry a call, as an OpenAI chunk does: a head read with
    the first of its arguments carries them."""

    def __init__(self) -> None:
        self.text = ""
        self.is_text = False
        self.calls: list[Call] = []
        self._pos = 0  # how far the calls are read
        self._args_at: int | None = None  # where the current call's arguments start
        self._depth = 0  # the arguments' open brackets
        self._in_string = self._escaped = False
        self._closing = False  # the arguments are complete, the call's end is not yet read
        self._broken = False  # the text stopped following the form (cut or not calls)

    def feed(self, new: str) -> tuple[str, list[dict[str, Any]]]:
        if self.is_text:
            return new, []
        self.text += new
        if not self.calls and not could_be_call(self.text):
            self.is_text = True
            return self.text, []
        return "", self._read()

    def flush(self) -> str:
        """At the answer's end: what was held back and went out neither as content nor as
        calls (an answer cut while it could still have been calls), as content."""
        if self.is_text or self.calls:
            return ""
        self.is_text = True
        return self.text

    def finish(self) -> list[Call] | None:
        """The calls, if the whole answer is complete calls; None when it is text."""
        complete = not self.is_text and not self._broken and self._args_at is None and self.calls
        return self.calls if complete and not self.text[self._pos :].strip() else None

    def _read(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while not self._broken:
            if self._args_at is None:  # between calls: the next head
                rest = self.text[self._pos :]
                if self.calls and rest.startswith("\n"):
                    rest, self._pos = rest[1:], self._pos + 1
                head = _HEAD.match(rest)
                if head is None:
                    self._broken = bool(rest) and not _could_be_head(rest)
                    return deltas
                self.calls.append(Call(_new_id(), head.group(1), ""))
                self._pos = self._args_at = self._pos + head.end()
                deltas.append(self._delta("", self.calls[-1]))
                continue
            if not self._closing:
                piece, self._closing = self._scan()
                if piece and deltas and deltas[-1]["index"] == len(self.calls) - 1:
                    deltas[-1]["function"]["arguments"] += piece  # one entry a call a feed
                elif piece:
                    deltas.append(self._delta(piece))
                if not self._closing:
                    return deltas
            tail = self.text[self._pos :]  # the arguments are complete: the call's end
            if not tail.startswith("}" + CLOSE):
                if len(tail) >= len(CLOSE) + 1 or not ("}" + CLOSE).startswith(tail):
                    self._broken = True
                return deltas
            last = self.calls[-1]
            self.calls[-1] = Call(last.id, last.name, self.text[self._args_at : self._pos])
            self._pos += len(CLOSE) + 1
            self._closing, self._args_at = False, None
        return deltas

    def _scan(self) -> tuple[str, bool]:
        """The arguments' characters from the read position up to their end or the text's
        end, and whether they ended (their last bracket closed)."""
        start = i = self._pos
        text = self.text
        while i < len(text):
            ch = text[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i
                    return text[start:i], True
        self._pos = i
        return text[start:i], False

    def _delta(self, arguments: str, head: Call | None = None) -> dict[str, Any]:
        """The current call's stream delta: its id, type and name too at its head."""
        if head is None:
            return {"index": len(self.calls) - 1, "function": {"arguments": arguments}}
        fn = {"name": head.name, "arguments": arguments}
        return {"index": len(self.calls) - 1, "id": head.id, "type": "function", "function": fn}


def _could_be_head(text: str) -> bool:
    """Whether `text` may still grow into a call's head (OPEN, then the name's frame)."""
    frame = OPEN + '{"name": "'
    if len(text) <= len(frame):
        return frame.startswith(text)
    if not text.startswith(frame):
        return False
    rest = text[len(frame) :]
    name = _NAME.match(rest)
    return '", "arguments": '.startswith(rest[name.end() if name else 0 :])


def could_be_call(text: str) -> bool:
    """Whether a streamed answer that begins with `text` may still turn out to be calls."""
    return text.startswith(OPEN) or OPEN.startswith(text)
