"""Tool calls on a Qwen2.5-style tokenizer, where `<tool_call>` and `</tool_call>` are added
tokens that are text (not special): the grammar library counts every added token as special,
offered the token for the call's literal and refused it when drawn, so `required` and named
calls failed at their first token with a 400 and `auto` could never call. The grammar names
such a token by id beside the literal's text.

The model is the tiny test model with the two tokens added to its tokenizer (ids 259 and 260,
inside its 320 embedding rows), served by `kvguard serve` and called with the openai client."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from kvguard.daemon import tools
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.structured import Grammars
from kvguard.engine.tokenizer import Tokenizer
from tests.test_server import Daemon

OPEN_ID, CLOSE_ID = 259, 260  # past the tiny tokenizer's 259 tokens
CITY = {"type": "string", "enum": ["Paris", "Oslo"]}  # a call of bounded length
PARAMETERS = {
    "type": "object",
    "properties": {"city": CITY},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
]
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with `<tool_call>` and `</tool_call>` added as text tokens, as Qwen2.5's
    tokenizer has them."""
    folder = tmp_path_factory.mktemp("qwen") / "model"
    shutil.copytree(tiny_dir, folder)
    file = folder / "tokenizer.json"
    tok = RustTokenizer.from_file(str(file))
    tags = [AddedToken(t, special=False, normalized=False) for t in (tools.OPEN, tools.CLOSE)]
    tok.add_tokens(tags)
    tok.save(str(file))
    assert [tok.token_to_id(t) for t in (tools.OPEN, tools.CLOSE)] == [OPEN_ID, CLOSE_ID]
    return folder


@pytest.fixture(scope="module")
def daemon(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The model served (1024 tokens: the tools' description alone is about 450 of the tiny
    tokenizer's)."""
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        debug_hooks=False,
        serving=f"{{model: '{qwen_dir}', kv_cache_bytes: 8MiB, max_model_len: 1024}}",
        api="served_model_name: tiny",
    )
    yield d
    assert d.stop() == 0


def test_the_grammar_takes_the_tags_by_id_and_as_text(qwen_dir: Path) -> None:
    """At library level: a call written with the two tokens, or with its opening spelled in
    other tokens, is taken by `required`'s grammar and by `auto`'s, and closes the answer."""
    tok = Tokenizer.from_dir(qwen_dir)
    assert tok.text_tokens == {tools.OPEN: OPEN_ID, tools.CLOSE: CLOSE_ID}
    grammars = Grammars(tok, 320, tok.eos_token_ids)
    fns = [tools.Function("get_weather", None, PARAMETERS)]
    body = tok.encode('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    spelled = [t for ch in tools.OPEN for t in tok.encode(ch)]
    for mode in ("required", "auto"):
        lark = tools.grammar(fns, mode, False, text_tokens=tok.text_tokens)
        for opening in ([OPEN_ID], spelled):
            g = grammars.for_params(SamplingParams(grammar=lark))
            assert all(g.advance(t) for t in [*opening, *body, CLOSE_ID]), (mode, g.error)
            assert g.complete


def _call(message: Any) -> dict[str, Any]:
    (call,) = message.tool_calls
    return {"name": call.function.name, "arguments": json.loads(call.function.arguments)}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_are_served(daemon: Daemon, choice: str, stream: bool) -> None:
    """`tool_choice` required, or naming the function: a valid call, finish_reason
    tool_calls (it was a 400 "the grammar library gave up" at the first token)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = daemon.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=named if choice == "named" else "required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=1,
        stream=stream,
    )
    if stream:
        chunks = [c.choices[0] for c in r if c.choices]
        head = next(c.delta.tool_calls[0] for c in chunks if c.delta.tool_calls)
        args = "".join(
            c.delta.tool_calls[0].function.arguments or "" for c in chunks if c.delta.tool_calls
        )
        assert head.function.name == "get_weather"
        assert json.loads(args)["city"] in CITY["enum"]
        assert chunks[-1].finish_reason == "tool_calls"
        return
    choice_ = r.choices[0]
    assert choice_.finish_reason == "tool_calls"
    call = _call(choice_.message)
    assert call["name"] == "get_weather" and call["arguments"]["city"] in CITY["enum"]


def test_auto_calls_when_the_model_writes_the_tag_token(daemon: Daemon) -> None:
    """Under `auto`, a model that begins its answer with the `<tool_call>` token (pushed here
    by logit_bias, as a tool-trained Qwen2.5 writes it) calls the function: the token was
    masked and the answer forced into text."""
    r = daemon.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
        logit_bias={str(OPEN_ID): 100},
        logprobs=True,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.logprobs is not None and choice.logprobs.content
    assert choice.logprobs.content[0].token == tools.OPEN  # the token, not its text spelled
    call = _call(choice.message)
    assert call["name"] == "get_weather" and call["arguments"]["city"] in CITY["enum"]
