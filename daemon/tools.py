"""Tool (function) calling on chat requests, the same way for every model.

A request's `tools` are described to the model in a system message (their names,
descriptions and argument schemas, and how to call one), and a call is written as

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one per line for several calls. The answer is held to that form by a grammar (the engine's
`SamplingParams.grammar`, run by llguidance like a JSON schema): with `tool_choice`
`"required"` it is one or more calls (one with `parallel_tool_calls: false`), with a named
function one call of that function, and with `"auto"` either calls or a text answer (which
then may not begin with `<`; with a `response_format` schema, JSON matching it). Each call's
arguments match its function's `parameters` schema, so a call always parses and always
validates: a model that was never taught this form still calls tools correctly, and one that
was (most tool-trained models write `<tool_call>` blocks) needs no parser of its own.

The conversation comes back the same way: an assistant message's `tool_calls` are rendered as
the blocks the model wrote, and a `tool` message as a user turn holding
`<tool_response>...</tool_response>` (a chat template without a tool role renders it too).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvguard.engine.structured import LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None  # None: any arguments object


@dataclass(frozen=True, slots=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


def call_schema(fn: Function) -> dict[str, Any]:
    """The JSON a call of `fn` is: its name, and arguments matching its parameters."""
    args = fn.parameters if fn.parameters is not None else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": args},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def grammar(
    functions: Sequence[Function],
    choice: str,
    parallel: bool,
    content_schema: dict[str, Any] | None = None,
) -> str:
    """The Lark grammar (llguidance's dialect) an answer with tools is held to. `choice`:
    "auto", "required", or the name of the one function to call."""
    if choice not in ("auto", "required"):
        functions = [f for f in functions if f.name == choice]
        parallel = False
    schemas = [call_schema(f) for f in functions]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    lines = [
        f"calls: call{' (NL call)*' if parallel else ''}",
        f'call: "{OPEN}" args "{CLOSE}"',
        f"args: %json {json.dumps({**call, 'x-guidance': LAYOUT})}",
        'NL: "\\n"',
    ]
    if choice != "auto":
        return "\n".join(["start: calls", *lines])
    if content_schema is None:
        content = r"content: /[^<][\s\S]*/"
    else:
        content = f"content: %json {json.dumps({**content_schema, 'x-guidance': LAYOUT})}"
    return "\n".join(["start: content | calls", content, *lines])


def system_text(functions: Sequence[Function], choice: str, parallel: bool) -> str:
    """What the model is told about its tools (a system message, or after the first one)."""
    lines = [
        "You can call functions. Each is given as JSON: its name, what it does, and the JSON "
        "schema of its arguments.",
    ]
    for f in functions:
        entry: dict[str, Any] = {"name": f.name}
        if f.description:
            entry["description"] = f.description
        entry["parameters"] = f.parameters if f.parameters is not None else {"type": "object"}
        lines.append(json.dumps(entry, ensure_ascii=False))
    form = f'{OPEN}{{"name": <function name>, "arguments": <arguments as JSON>}}{CLOSE}'
    several = " (one line per call)" if parallel else ""
    if choice == "auto":
        lines.append(
            f"To call a function, answer with {form}{several} and nothing else. "
            "Otherwise answer as usual."
        )
    elif choice == "required":
        lines.append(f"Answer by calling a function: {form}{several}.")
    else:
        lines.append(f"Answer by calling {choice}: {form}.")
    return "\n".join(lines)


def with_tools(
    messages: list[dict[str, str]], functions: Sequence[Function], choice: str, parallel: bool
) -> list[dict[str, str]]:
    """`messages` with the tools described: after the first system message's text, or in a
    system message of their own before the others."""
    text = system_text(functions, choice, parallel)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render_calls(content: str, calls: Sequence[tuple[str, str]]) -> str:
    """An assistant turn's text with its calls (name, arguments JSON) as the model wrote them;
    arguments that are not JSON are rendered as the string they are."""
    blocks = []
    for name, arguments in calls:
        try:
            args: Any = json.loads(arguments)
        except ValueError:
            args = arguments
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        blocks.append(f"{OPEN}{body}{CLOSE}")
    return "\n".join([content, *blocks] if content else blocks)


def render_result(content: str) -> str:
    """A tool message's text as the user turn that carries it."""
    return f"<tool_response>\n{content}\n</tool_response>"


def parse(text: str) -> list[Call] | None:
    """The calls an answer makes; None when it is a text answer (or calls cut short by
    max_tokens or a stop string, which are not calls: the text is returned as it is)."""
    if not text.startswith(OPEN):
        return None
    found = _CALL.findall(text)
    rest = _CALL.sub("", text).strip()
    if not found or rest:
        return None
    calls = []
    for body in found:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = json.dumps(obj.get("arguments", {}), ensure_ascii=False)
        calls.append(Call(f"call_{uuid.uuid4().hex[:24]}", obj["name"], arguments))
    return calls


def could_be_call(text: str) -> bool:
    """Whether a streamed answer that begins with `text` may still turn out to be calls."""
    return text.startswith(OPEN) or OPEN.startswith(text)
