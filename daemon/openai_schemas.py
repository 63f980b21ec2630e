"""Request and response bodies of the OpenAI-compatible API (the subset kvguard serves).

Every field is accounted for, so that no request is answered as if it had asked for something
else. A field kvguard serves is typed strictly (integers are integers, numbers are finite, text
is valid Unicode); an OpenAI field it does not serve is accepted only at the value that asks for
nothing (`best_of: 1`, `suffix: ""`, `functions: []`, ...) and refused otherwise; an unknown
field is refused, as OpenAI itself does, so that a typo (`max_token`) is not quietly dropped.
Every refusal is a 400 with an OpenAI-style error naming the field (see README, "OpenAI fields").
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvguard.daemon import tools
from kvguard.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

# in any case, as the X-Priority header takes it ("High" is high)
Priority = Annotated[
    Literal["high", "normal", "low"],
    BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v),
]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's integer range; torch takes no more
MAX_CHOICES = 32  # `n`: each choice is a sequence of its own, admitted like a request
MAX_TOOLS = 128  # functions one request may offer (OpenAI's limit)
MAX_STOP_TOKEN_IDS = MAX_STOP_STRINGS  # `stop_token_ids`, bounded as stop strings are
# `metadata`, as OpenAI bounds it: at most 16 pairs, keys of at most 64 characters, string
# values of at most 512 (unused by kvguard: it is accepted, not a store for megabytes)
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# a chat answer's token limit where the request sets neither max_tokens nor
# max_completion_tokens (OpenAI's runs to the context; this keeps a runaway answer short),
# and a completion's (OpenAI's), where the model's generation_config.json sets none
DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_COMPLETION_MAX_TOKENS = 16
# OpenAI's temperature and top_p where a request leaves them out and the model sets none
DEFAULT_TEMPERATURE = DEFAULT_TOP_P = 1.0


def unicode_problem(text: str) -> str | None:
    """Why `text` cannot be UTF-8 encoded (an unpaired UTF-16 surrogate, which JSON's `\\ud800`
    escapes can carry and Python's decoder lets through), or None. Such a string would fail
    later, in the tokenizer, the audit database or the JSON answer, far from the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"unpaired UTF-16 surrogate \\u{ord(text[e.start]):04x} at character {e.start}: "
            "not valid Unicode text"
        )
    return None


def _text(value: str) -> str:
    problem = unicode_problem(value)
    if problem is not None:
        raise PydanticCustomError("unicode", problem)
    return value


Text = Annotated[str, AfterValidator(_text)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


def _refuse(why: str, accepts: Callable[[Any], bool] = lambda v: False) -> AfterValidator:
    """A field kvguard does not serve: null (and what `accepts`, the value that asks for
    nothing) passes; anything else is refused with `why`, instead of being ignored."""

    def check(value: Any) -> Any:
        if value is None or accepts(value):
            return value
        raise PydanticCustomError("not_served", why)

    return AfterValidator(check)


def _logit_bias(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit bias: token ids as decimal strings, each mapped to -100..100."""
    if value is None:
        return None
    out: dict[int, float] = {}
    keys: dict[int, str] = {}
    for key, bias in value.items():
        if not key.isascii() or not key.isdigit():
            raise PydanticCustomError(
                "logit_bias", "key {key} is not a token id (a decimal integer)", {"key": repr(key)}
            )
        if int(key) in keys:  # "506" and "0506": one would silently undo the other's ban
            raise PydanticCustomError(
                "logit_bias", "keys {first} and {key} are the same token {id}: one entry a token",
                {"first": repr(keys[int(key)]), "key": repr(key), "id": int(key)},
            )  # fmt: skip
        keys[int(key)] = key
        if not -100.0 <= bias <= 100.0:
            raise PydanticCustomError(
                "logit_bias", "bias {bias} for token {key} is outside [-100, 100]",
                {"bias": bias, "key": key},
            )  # fmt: skip
        out[int(key)] = float(bias)
    return out


def _is_one(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v == 1


OLD_FUNCTIONS = "not served: deprecated by OpenAI; send tools and tool_choice instead"


def _prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A prompt is a string or a list of token ids (int64); several prompts are a list of
    strings or a list of token-id lists."""
    if isinstance(value, str):
        return _text(value)
    if not isinstance(value, list):
        raise PydanticCustomError(
            "prompt", "expected a string, a list of strings or a list of token ids"
        )
    if all(isinstance(p, str) for p in value):
        for i, p in enumerate(value):
            if (problem := unicode_problem(p)) is not None:
                raise PydanticCustomError(
                    "unicode", "element {i}: {problem}", {"i": i, "problem": problem}
                )
        return value
    if value and all(isinstance(p, list) for p in value):
        for i, ids in enumerate(value):
            _token_ids(ids, f"element {i}: ")
        return value
    _token_ids(value, "")
    return value


def _token_ids(value: list[Any], where: str) -> None:
    for i, p in enumerate(value):
        if not isinstance(p, int) or isinstance(p, bool) or not INT64_MIN <= p <= INT64_MAX:
            raise PydanticCustomError(
                "prompt",
                "{where}element {i}: expected a token id (an integer); a list prompt is all "
                "strings, all token ids or all lists of token ids",
                {"where": where, "i": i},
            )


def _stop(value: Any) -> str | list[str] | None:
    """A stop string or a list of them: at most MAX_STOP_STRINGS, each non-empty and at most
    MAX_STOP_CHARS characters (the engine checks every token of every choice against each of
    them, on the thread every request waits for)."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise PydanticCustomError("stop", "expected a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise PydanticCustomError(
            "stop",
            "{n} stop strings: at most {most} are allowed",
            {"n": len(items), "most": MAX_STOP_STRINGS},
        )
    for i, s in enumerate(items):
        if not s:
            raise PydanticCustomError("stop", "element {i} is empty", {"i": i})
        if len(s) > MAX_STOP_CHARS:
            raise PydanticCustomError(
                "stop",
                "element {i} has {n} characters: a stop string may have at most {most}",
                {"i": i, "n": len(s), "most": MAX_STOP_CHARS},
            )
        if (problem := unicode_problem(s)) is not None:
            raise PydanticCustomError(
                "unicode", "element {i}: {problem}", {"i": i, "problem": problem}
            )
    return value


def _stop_token_ids(value: Any) -> list[int] | None:
    """kvguard's stop token ids: at most MAX_STOP_TOKEN_IDS token ids (integers >= 0), counted
    before any is checked; the engine refuses one outside the vocabulary (a 400 naming the
    field). Read on every output token of every choice, as stop strings are."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise PydanticCustomError("stop_token_ids", "expected a list of token ids")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise PydanticCustomError(
            "stop_token_ids",
            "{n} token ids: at most {most} are allowed",
            {"n": len(value), "most": MAX_STOP_TOKEN_IDS},
        )
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT64_MAX:
            raise PydanticCustomError(
                "stop_token_ids", "element {i}: expected a token id (an integer >= 0)", {"i": i}
            )
    return value


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most MAX_METADATA_PAIRS string pairs, keys of at most
    MAX_METADATA_KEY_CHARS characters and values of at most MAX_METADATA_VALUE_CHARS, counted
    before any pair is checked (a body of 500k pairs was accepted, each pair checked)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PydanticCustomError("metadata", "expected an object of string keys and values")
    if len(value) > MAX_METADATA_PAIRS:
        raise PydanticCustomError(
            "metadata",
            "{n} pairs: at most {most} are allowed",
            {"n": len(value), "most": MAX_METADATA_PAIRS},
        )
    for key, v in value.items():
        if not isinstance(key, str) or not isinstance(v, str):
            raise PydanticCustomError("metadata", "expected string keys and values")
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise PydanticCustomError(
                "metadata",
                "a key has {n} characters: a key may have at most {most}",
                {"n": len(key), "most": MAX_METADATA_KEY_CHARS},
            )
        if len(v) > MAX_METADATA_VALUE_CHARS:
            raise PydanticCustomError(
                "metadata",
                "a value has {n} characters: a value may have at most {most}",
                {"n": len(v), "most": MAX_METADATA_VALUE_CHARS},
            )
        if (problem := unicode_problem(key) or unicode_problem(v)) is not None:
            raise PydanticCustomError("unicode", "{problem}", {"problem": problem})
    return value


_STREAM_OPTIONS = {"include_usage", "include_obfuscation"}


def _stream_options(value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
    """`include_usage` is served; `include_obfuscation` is accepted (kvguard never pads its
    chunks, so there is nothing to turn off); anything else is refused, and so are options
    given without `stream: true`, as OpenAI refuses them (a stream's options would be
    silently dropped from a whole answer)."""
    if value is not None and info.data.get("stream") is False:  # absent: stream was refused
        raise PydanticCustomError("stream_options", "only allowed when stream is true")
    for key, v in (value or {}).items():
        if key not in _STREAM_OPTIONS:
            raise PydanticCustomError(
                "stream_options",
                "unknown option '{key}': expected include_usage or include_obfuscation",
                {"key": printable(key)},
            )
        if v is not None and not isinstance(v, bool):
            raise PydanticCustomError(
                "stream_options", "{key}: expected true or false", {"key": key}
            )
    return value


class _Body(BaseModel):
    """Strict: `"4"`, `4.0` and `true` are not the integer 4; NaN and Infinity (which Python's
    JSON parser accepts) are not numbers; an unknown field is an error."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _keys_are_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if isinstance(key, str) and unicode_problem(key) is not None:
                    raise PydanticCustomError(
                        "unicode", "a field name holds an unpaired UTF-16 surrogate"
                    )
        return data


def _null_is(default: Any) -> AfterValidator:
    """A field OpenAI declares nullable: null is the field left out (its default)."""
    return AfterValidator(lambda value: default if value is None else value)


class _Sampling(_Body):
    model: Text
    # null (the openai client's pass-through of an unset setting) is the field left out: the
    # model's default where its generation_config.json sets one, else OpenAI's (`sampling`)
    temperature: float | None = Field(
        None,
        ge=0.0,
        le=2.0,
        description="left out or null: the model's generation_config.json temperature, else 1",
    )
    top_p: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="0 keeps only the most likely token (greedy); left out or null: the "
        "model's generation_config.json top_p, else 1",
    )
    top_k: int | None = Field(
        None,
        ge=-1,
        le=INT64_MAX,
        description="kvguard extension: 0 (or -1, as vLLM's clients send it) disables; left "
        "out or null: the model's generation_config.json top_k, else 0",
    )
    n: int | None = Field(
        1,
        ge=1,
        le=MAX_CHOICES,
        description=f"choices of one prompt, 1..{MAX_CHOICES}: the prompt is computed once, "
        "a seeded request's choice i draws with seed + i",
    )
    stream: Annotated[bool | None, _null_is(False)] = False
    stream_options: Annotated[dict[str, Any] | None, AfterValidator(_stream_options)] = Field(
        None, description="include_usage (served), include_obfuscation (no padding is added)"
    )
    stop: Annotated[
        Any,
        AfterValidator(_stop),
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "maxLength": MAX_STOP_CHARS},
                    {
                        "type": "array",
                        "items": {"type": "string", "maxLength": MAX_STOP_CHARS},
                        "maxItems": MAX_STOP_STRINGS,
                    },
                ]
            }
        ),
    ] = Field(
        None,
        description=f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters",
    )
    stop_token_ids: Annotated[
        Any,
        AfterValidator(_stop_token_ids),
        WithJsonSchema(
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0},
                "maxItems": MAX_STOP_TOKEN_IDS,
            }
        ),
    ] = Field(
        None,
        description=f"kvguard extension: at most {MAX_STOP_TOKEN_IDS} token ids of the "
        "vocabulary; the answer ends at the first it generates, whose text it leaves out",
    )
    seed: Int64 | None = None
    ignore_eos: bool = Field(False, description="kvguard extension: generate max_tokens tokens")
    priority: Priority | None = Field(
        None, description="kvguard extension (or the X-Priority header)"
    )
    # OpenAI fields that ask nothing of generation: accepted and not used
    user: Text | None = None
    metadata: Annotated[
        Any,
        AfterValidator(_metadata),
        WithJsonSchema(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "maxProperties": MAX_METADATA_PAIRS,
                        "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
                        "additionalProperties": {
                            "type": "string",
                            "maxLength": MAX_METADATA_VALUE_CHARS,
                        },
                    },
                    {"type": "null"},
                ]
            }
        ),
    ] = Field(
        None,
        description=f"at most {MAX_METADATA_PAIRS} pairs, keys of at most "
        f"{MAX_METADATA_KEY_CHARS} characters, string values of at most "
        f"{MAX_METADATA_VALUE_CHARS} (accepted, not used)",
    )
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="OpenAI's tiers (accepted, not used: kvguard has one)"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="subtracted from a token's logit per time it was output"
    )
    presence_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="subtracted from a token's logit once it was output"
    )
    logit_bias: Annotated[
        dict[str, float] | None,
        AfterValidator(_logit_bias),
        WithJsonSchema({"type": "object", "additionalProperties": {"type": "number"}}),
    ] = Field(None, description="token id (as a string) -> added to its logit, -100..100")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, defaults: Mapping[str, float]) -> dict[str, Any]:
        """temperature, top_p and top_k as the request sets them; where it leaves one out
        (or sends null), `defaults`' (the model's generation_config.json, as the engine read
        it: `LLMEngine.sampling_defaults`), else OpenAI's."""
        temperature, top_p = self.temperature, self.top_p
        return {
            "temperature": defaults.get("temperature", DEFAULT_TEMPERATURE)
            if temperature is None
            else temperature,
            "top_p": defaults.get("top_p", DEFAULT_TOP_P) if top_p is None else top_p,
            "top_k": defaults.get("top_k", 0) if self.top_k is None else max(self.top_k, 0),
        }


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`: the schema the answer's JSON must match."""

    name: Text = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # strict or not, the schema is enforced in full (kvguard has no best-effort mode)
    strict: bool | None = None


class ResponseFormat(_Body):
    """`{"type": "text"}` asks for nothing; `json_object` for any JSON object; `json_schema`
    for JSON matching `json_schema.schema` (checked here: a schema that cannot be served is a
    400 before anything is queued)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError(
                "response_format", 'type json_schema needs json_schema: {"name", "schema"}'
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise PydanticCustomError(
                "response_format", "json_schema is given only with type json_schema"
            )
        # whether the grammar library can serve the schema is checked off the event loop
        # (compiling a large one takes a second): openai_api._serve
        return self

    def engine_schema(self) -> dict[str, Any] | None:
        """What the engine holds the answer to (SamplingParams.json_schema); None: text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        return None


class CompletionRequest(_Sampling):
    prompt: Annotated[
        Any,
        AfterValidator(_prompt),
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}},
                    {"type": "array", "items": {"type": "integer"}},
                    {
                        "type": "array",
                        "items": {"type": "array", "items": {"type": "integer"}},
                    },
                ]
            }
        ),
    ] = Field(
        ...,
        description="a string or a list of token ids; several prompts as a list of strings "
        "or of token-id lists (n choices each)",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=INT64_MAX,
        description=f"left out or null: the model's generation_config.json max_new_tokens, "
        f"else {DEFAULT_COMPLETION_MAX_TOKENS}",
    )
    response_format: ResponseFormat | None = Field(
        None, description="kvguard extension, as chat's: text, json_object or json_schema"
    )
    echo: bool | None = Field(False, description="the answer's text starts with the prompt")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=5,
        description="each generated token's log-probability with this many alternatives",
    )
    best_of: Annotated[
        Any,
        _refuse("not served: kvguard returns every choice it samples (n); send 1 or null", _is_one),
    ] = None
    suffix: Annotated[
        Any,
        _refuse("not served: kvguard does not fill in the middle; send null", lambda v: v == ""),
    ] = None


def _content(value: Any) -> str | list[dict[str, str]] | None:
    """A message's content: text, or a list of text parts. Image, audio and file parts are
    refused: dropping them would answer a different question than the one asked."""
    if value is None or isinstance(value, str):
        return None if value is None else _text(value)
    if not isinstance(value, list):
        raise PydanticCustomError("content", "expected a string or a list of text parts")
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise PydanticCustomError(
                "content",
                'part {j}: only text parts (type "text") are served; kvguard\'s models take '
                "no image, audio or file input",
                {"j": j},
            )
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise PydanticCustomError(
                "content", "part {j}: unknown field {key}", {"j": j, "key": printable(extra[0])}
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise PydanticCustomError("content", "part {j}: text: expected a string", {"j": j})
        if (problem := unicode_problem(text)) is not None:
            raise PydanticCustomError(
                "unicode", "part {j}: text: {problem}", {"j": j, "problem": problem}
            )
    return value


Content = Annotated[
    Any,
    AfterValidator(_content),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        "required": ["type", "text"],
                        "additionalProperties": False,
                    },
                },
                {"type": "null"},
            ]
        }
    ),
]


ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema is not None and schema.get("type", "object") != "object":
        raise PydanticCustomError(
            "parameters", "must describe a JSON object (a call's arguments are one)"
        )
    return schema


def _some_tools(value: list[Tool] | None) -> list[Tool] | None:
    """`tools: []` is refused, as OpenAI refuses it (an array too short), rather than served
    as no tools: a client that sends it would be refused by OpenAI, and one that means no
    tools leaves the field out (or sends tool_choice "none")."""
    if value == []:
        raise PydanticCustomError(
            "tools",
            "an empty array offers no tool (OpenAI refuses it too): send at least one tool, "
            "or leave tools out",
        )
    return value


def _unique_names(value: list[Tool] | None) -> list[Tool] | None:
    names = [t.function.name for t in value or ()]
    if len(set(names)) != len(names):
        raise PydanticCustomError("tools", "function names must be unique")
    return value


class FunctionDef(_Body):
    name: ToolName
    description: Text | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(_parameters)] = Field(
        None, description="the JSON schema of its arguments (any object when absent)"
    )
    # strict or not, the arguments are held to the schema in full
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: ToolName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


# what the openai client adds to the assistant message it hands back (`parse()`, the stream
# helper's `get_final_completion()`) and writes out again when that message is sent back as
# the next turn's history: accepted so that its own agent loop works, and ignored (the answer
# was already given; a call's arguments are `arguments`, whatever `parsed_arguments` says)
CLIENT_ADDED = "accepted and ignored: the openai client adds it to the messages it hands back"


class FunctionCall(_Body):
    name: ToolName
    arguments: Text = Field(..., description="the arguments as JSON text")
    parsed_arguments: Any = Field(None, description=CLIENT_ADDED)


class ToolCall(_Body):
    id: Text
    type: Literal["function"]
    function: FunctionCall
    index: int | None = Field(None, ge=0, description=CLIENT_ADDED + " (a streamed call's)")


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Content = None
    name: Text | None = Field(
        None,
        description="passed to the chat template as sent; one that reads no names (SmolLM2's) "
        "leaves it out of the prompt",
    )
    refusal: Annotated[Any, _refuse("not served: send the refusal text as content")] = None
    annotations: Annotated[Any, _refuse("not served: send null", lambda v: v == [])] = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant turn's calls")
    tool_call_id: Text | None = Field(None, description="a tool turn: the call it answers")
    function_call: Annotated[Any, _refuse(OLD_FUNCTIONS)] = None
    audio: Annotated[Any, _refuse("not served: kvguard has no audio; send null")] = None
    parsed: Any = Field(None, description=CLIENT_ADDED + " (an assistant message's)")
    # where the request sent this message, when its tool results were put in call order
    _sent_at: int | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls", "only an assistant message has tool_calls")
        if self.parsed is not None and self.role != "assistant":
            raise PydanticCustomError(
                "parsed", "only an assistant message has parsed (the openai client adds it)"
            )
        if self.tool_call_id is not None and self.role != "tool":
            raise PydanticCustomError("tool_call_id", "only a tool message has a tool_call_id")
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError(
                "tool_call_id", "tool_call_id is missing: a tool message names the call it answers"
            )
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            # only an assistant turn that calls tools may leave its text out
            raise PydanticCustomError(
                "content",
                "content is missing: only an assistant message with tool_calls may omit it",
            )
        return self

    def for_template(self) -> dict[str, str]:
        """What the chat template sees: role, text, and the participant's name if given. An
        assistant turn's tool calls are written as the model writes them, and a tool turn is a
        user turn holding its result (see daemon/tools.py)."""
        pieces = self.template_pieces("message")
        return {k: v if isinstance(v, str) else tools.joined(v) for k, v in pieces.items()}

    def template_pieces(self, field: str) -> dict[str, Any]:
        """`for_template` with its texts (content, name) as pieces, each marked with the field
        of the request it holds (this message's is `field`): a check of the joined text names
        the field a hit touches, a text part's, a call's arguments' or the name's. The name is
        the template's as sent, never written into the text: the prompt stays the one the
        model's template renders (transformers' `apply_chat_template`), which a speaker prefix
        would change (`user_42: What's 2+2?` answered 42). A tool result put in its call's
        place is named where it was sent (`_tool_results`)."""
        if self._sent_at is not None:
            field = f"messages[{self._sent_at}]"
        role, content = self.role, self._content_pieces(field)
        if self.tool_calls:
            calls = [
                (c.function.name, c.function.arguments, f"{field}.tool_calls[{j}].function")
                for j, c in enumerate(self.tool_calls)
            ]
            content = tools.render_calls(content, calls)
        if role == "tool":
            role, content = "user", tools.render_result(content)
        elif role == "developer":  # OpenAI's successor to system, which templates know
            role = "system"
        out: dict[str, Any] = {"role": role, "content": content}
        if self.name is not None:
            out["name"] = [tools.Piece(self.name, f"{field}.name")]
        return out

    def _content_pieces(self, field: str) -> list[tools.Piece]:
        """The message's text: its text parts joined as they come (a template reads one text)."""
        if self.content is None or isinstance(self.content, str):
            return [tools.Piece(self.content or "", f"{field}.content")]
        return [
            tools.Piece(part["text"], f"{field}.content[{j}].text")
            for j, part in enumerate(self.content)
        ]


def _tool_results(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The messages with each assistant turn's tool calls answered as OpenAI requires: by the
    tool messages right after it, one for each of its calls' ids; those results put in its
    calls' order. A result reaches the model by its place (the `<tool_response>` it is
    rendered as names no call), so results sent as they finished (`asyncio.as_completed`)
    were read as the wrong calls' results; an id that answered nothing, a call left without
    a result, were served as if the conversation made sense."""
    out: list[ChatMessage] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.role == "tool":  # after no assistant turn with calls
            raise _tool_result_error(
                i, f"{_quoted(message.tool_call_id)} answers no call: a tool message must "
                "follow the assistant message with tool_calls whose call it answers"
            )  # fmt: skip
        out.append(message)
        i += 1
        if message.tool_calls:
            end = i
            while end < len(messages) and messages[end].role == "tool":
                end += 1
            out += _in_call_order(messages, i - 1, range(i, end))
            i = end
    return out


def _in_call_order(messages: list[ChatMessage], at: int, run: range) -> list[ChatMessage]:
    """The tool messages `run` answering messages[at]'s calls, in its calls' order; each
    remembers where it was sent (`ChatMessage._sent_at`), for a refusal that names it."""
    ids = [call.id for call in messages[at].tool_calls or ()]
    for j, call_id in enumerate(ids):
        if call_id in ids[:j]:
            raise _refusal(
                f"messages[{at}].tool_calls[{j}].id",
                f"{_quoted(call_id)} is also the id of tool_calls[{ids.index(call_id)}]: each "
                "call needs an id of its own (a tool message names the call it answers by it)",
            )
    answered: dict[str, int] = {}
    for k in run:
        call_id = messages[k].tool_call_id or ""
        if call_id in answered:
            raise _tool_result_error(
                k, f"{_quoted(call_id)} is answered already by messages[{answered[call_id]}]: "
                "send one tool message for each call"
            )  # fmt: skip
        if call_id not in ids:
            raise _tool_result_error(
                k, f"{_quoted(call_id)} is not the id of a call in messages[{at}].tool_calls "
                f"({', '.join(_quoted(c) for c in ids)}): a tool message answers a call of the "
                "assistant message before it"
            )  # fmt: skip
        answered[call_id] = k
    missing = [c for c in ids if c not in answered]
    if missing:  # OpenAI's words
        raise _refusal(
            f"messages[{at}].tool_calls",
            "An assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'. The following tool_call_ids did not have "
            f"response messages: {', '.join(printable(c) for c in missing)}",
        )
    results = [messages[answered[c]] for c in ids]
    for call_id, result in zip(ids, results, strict=True):
        if result._sent_at is None:  # (a model validated again keeps its messages)
            result._sent_at = answered[call_id]
    return results


def _quoted(text: str | None) -> str:
    return repr(printable(text or ""))


def _tool_result_error(index: int, why: str) -> PydanticCustomError:
    return _refusal(f"messages[{index}].tool_call_id", why)


def _refusal(param: str, why: str) -> PydanticCustomError:
    """A request-level check's 400, naming the field inside `messages` that it is about (the
    error handler takes `param` from the context: the validator sits on the whole list)."""
    return PydanticCustomError("messages", "{param}: {why}", {"param": param, "why": why})


# a chat request's messages, as the requests that render them take them
Messages = Annotated[list[ChatMessage], AfterValidator(_tool_results)]


# a chat request's tools, declared alike on the requests that take them (chat completions, and
# /tokenize counting messages as chat serves them): `_ToolsInPlay` reads them
ToolList = Annotated[
    Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None,
    AfterValidator(_some_tools),
    AfterValidator(_unique_names),
]
ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice | None,
    Field(description='"auto" when tools are given: calls or a text answer'),
]
ParallelToolCalls = Annotated[
    bool | None, Field(description="several calls in one answer (default true)")
]


class _ToolsInPlay:
    """What a request's `tools`, `tool_choice` and `parallel_tool_calls` ask (a mixin of the
    bodies that declare them, in their own field order: not as fields here)."""

    if TYPE_CHECKING:
        tools: list[Tool] | None
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None
        parallel_tool_calls: bool | None

    def tool_problem(self) -> tuple[str, str] | None:
        """(field, why) when the tools and tool_choice cannot be served together."""
        names = [t.function.name for t in self.tools or ()]
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            return "tool_choice", "tool_choice needs tools"
        if self.parallel_tool_calls is not None and self.tools is None:  # as OpenAI answers
            return (
                "parallel_tool_calls",
                "parallel_tool_calls is only allowed when tools are given: send tools, or "
                "leave it out",
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return (
                "tool_choice",
                f"function {printable(choice.function.name)} is not among the tools",
            )
        return None

    def tool_functions(self) -> list[tools.Function]:
        return [
            tools.Function(t.function.name, t.function.description, t.function.parameters)
            for t in self.tools or ()
        ]

    def tool_mode(self) -> tools.Choice | None:
        """None: no tools in play (none given, or tool_choice "none"); else "auto",
        "required" or the function to call."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return tools.Named(choice.function.name)
        return choice or "auto"

    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False


class ChatCompletionRequest(_Sampling, _ToolsInPlay):
    messages: Messages = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=INT64_MAX,
        description="where neither it nor max_completion_tokens is set: the model's "
        f"generation_config.json max_new_tokens, else {DEFAULT_CHAT_MAX_TOKENS} (an answer cut "
        "there ends with finish_reason length and kvguard.max_tokens_default)",
    )
    max_completion_tokens: int | None = Field(
        None,
        ge=1,
        le=INT64_MAX,
        description="OpenAI's newer name for max_tokens, which it overrides where both are set",
    )
    logprobs: bool | None = Field(None, description="each generated token's log-probability")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="with this many alternatives (needs logprobs: true)"
    )
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object (any JSON object) or json_schema"
    )
    tools: ToolList = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: ParallelToolCalls = None
    functions: Annotated[Any, _refuse(OLD_FUNCTIONS, lambda v: v == [])] = None
    function_call: Annotated[Any, _refuse(OLD_FUNCTIONS, lambda v: v in ("none", "auto"))] = None
    modalities: Annotated[
        Any,
        _refuse('not served: kvguard answers text only; send ["text"]', lambda v: v == ["text"]),
    ] = None
    audio: Annotated[Any, _refuse("not served: kvguard has no audio output; send null")] = None
    prediction: Annotated[
        Any, _refuse("not served: kvguard has no predicted-output decoding; send null")
    ] = None
    reasoning_effort: Annotated[
        Any,
        _refuse(
            'not served: the model has no reasoning mode; send "none" or null',
            lambda v: v == "none",
        ),
    ] = None
    verbosity: Annotated[
        Any,
        _refuse(
            'not served: kvguard does not steer answer length; send "medium" (the default) or null',
            lambda v: v == "medium",
        ),
    ] = None
    web_search_options: Annotated[Any, _refuse("not served: kvguard has no web search")] = None
    store: Annotated[
        Any, _refuse("not served: kvguard stores no completions; send false", lambda v: v is False)
    ] = None
    prompt_cache_key: Text | None = Field(None, description="accepted: a cache hint only")
    safety_identifier: Text | None = None


class TokenizeRequest(_Body, _ToolsInPlay):
    """POST /tokenize: a prompt as completions tokenize it, or messages as chat renders them
    (with the tools described, as chat serves a request with them)."""

    model: Text
    prompt: Text | None = Field(None, description="text, tokenized as /v1/completions does")
    messages: Messages | None = Field(
        None, min_length=1, description="rendered by the chat template, as /v1/chat/completions"
    )
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt, false for messages (as served)"
    )
    tools: ToolList = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: ParallelToolCalls = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("tokenize", "send exactly one of prompt and messages")
        asked = (self.tools, self.tool_choice, self.parallel_tool_calls)
        if self.prompt is not None and any(v is not None for v in asked):
            raise PydanticCustomError("tools", "tools go with messages, not a prompt")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize: token ids back to text."""

    model: Text
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached`: prompt tokens the prefix cache served."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def printable(text: str) -> str:
    """`text` made safe to put in a JSON answer: an unpaired surrogate (from the request that
    is being refused for it) is written as the escape `\\ud800`, not sent as invalid UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": printable(message),
            "type": type_,
            "param": None if param is None else printable(param),
            "code": code,
        }
    }


def now() -> int:
    return int(time.time())
