"""Tool calls on models whose chat templates refuse a system message or insist that user and
assistant alternate (Gemma's, Mistral v0.1's, Llama 2's). kvguard describes a request's tools
in a system message of its own and renders each tool result as a user turn: such templates
refused every request with `tools` (no place for the system message), or a conversation with
two results in a row, with a 400 blaming messages the client sent right. The tools are now
described before the first user turn's text where the template takes no system message, and
one assistant turn's results (with a user message sent right after them) are one user turn
where it wants alternation; the request's own system message is placed alike with tools and
without, and the template is probed when the model loads; a template that takes both (the tiny
model's ChatML) renders what it rendered before. Through `kvguard serve`
and the real openai client, the prompts checked against transformers' render of the
conversation laid out by hand."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from kvguard.daemon import tools
from kvguard.daemon.openai_api import _chat_messages, _template_pieces
from kvguard.daemon.openai_schemas import ChatCompletionRequest
from kvguard.engine.tokenizer import TemplateLayout, Tokenizer
from tests.test_server import Daemon

# Gemma's template (gemma-7b-it) less its alternation check: a system message is refused
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
# Mistral v0.1's: roles alternate from a user turn, and there is no system role
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# Llama 2's: a system message folded into the first turn, the rest alternating
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
TEMPLATES = {"chatml": None, "gemma": GEMMA, "mistral": MISTRAL, "llama2": LLAMA2}
PROBED = {
    **TEMPLATES,
    # one that leaves a system message out without a word
    "silent": "{% for m in messages %}{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    # one that fails on its own whatever the messages (a TypeError)
    "broken": "{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
    # one that wants a system message first, and takes user turns in a row after it
    "needs-system": "{% if messages[0].role != 'system' %}"
    "{{ raise_exception('a system prompt is required') }}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}",
}
# what each template takes: a system message, two user turns in a row
TAKES = {"chatml": (True, True), "gemma": (False, True), "mistral": (False, False),
         "llama2": (True, False), "silent": (False, True), "broken": (True, True),
         "needs-system": (True, True)}  # fmt: skip
# the INFO line at load naming what a template does not take (chatml's takes both: none)
REFUSED = {"gemma": "takes no system message:", "mistral": "takes no system message and no two "
           "user turns in a row:", "llama2": "takes no two user turns in a row:"}  # fmt: skip

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
FUNCS = [tools.Function("get_weather", None, WEATHER["function"]["parameters"])]
QUESTION = "Weather in Paris and Rome?"


def _call(call_id: str, city: str) -> dict[str, Any]:
    arguments = f'{{"city": "{city}"}}'
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip


# an agent loop's second turn: the user's system message, the model's two calls, two results
LOOP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": None,
     "tool_calls": [_call("call_1", "Paris"), _call("call_2", "Rome")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25C"},
]  # fmt: skip
CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
)
PARIS, ROME = "<tool_response>\n18C\n</tool_response>", "<tool_response>\n25C\n</tool_response>"
NEXT = "And in Oslo?"  # the user's next question, sent right after the results


def laid_out(
    family: str, system: str | None, described: bool = True, after: str | None = None
) -> list[dict[str, str]]:
    """LOOP (less its system message where `system` is None, less its tools where not
    `described`, with the user message `after` after the results) as the family's template
    is to be given it, written out by hand: the user's system text then the tools in a system
    message where the template takes one, else before the question; the two results, and a
    blank line then `after`, one user turn where it wants roles to alternate."""
    takes_system, takes_runs = TAKES[family]
    texts = [system, tools.system_text(FUNCS, "auto", True) if described else None]
    before = "\n\n".join(t for t in texts if t is not None)
    if not before:
        head = [{"role": "user", "content": QUESTION}]
    elif takes_system:
        head = [{"role": "system", "content": before}, {"role": "user", "content": QUESTION}]
    else:
        head = [{"role": "user", "content": before + "\n\n" + QUESTION}]
    results = [PARIS, ROME] if takes_runs else [PARIS + "\n" + ROME]
    if after is not None and takes_runs:
        results.append(after)
    elif after is not None:
        results[-1] += "\n\n" + after
    return [
        *head,
        {"role": "assistant", "content": CALLS},
        *({"role": "user", "content": r} for r in results),
    ]


@pytest.fixture(scope="module")
def family_dirs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model with each family's chat template (chatml: its own)."""
    out = {}
    for family, template in PROBED.items():
        folder = tmp_path_factory.mktemp(family)
        for f in tiny_dir.iterdir():
            if f.is_file():
                shutil.copy(f, folder / f.name)
        if template is not None:
            (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
        out[family] = folder
    return out


LOG_AT_START: dict[str, str] = {}  # each family's daemon log once ready, before any request


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(
    request: pytest.FixtureRequest,
    family_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Daemon]]:
    """A daemon serving the tiny model with one family's template, refusing special tokens'
    text in messages (the check reads the texts as the template is given them)."""
    family = request.param
    d = Daemon(
        tmp_path_factory.mktemp(f"serve-{family}"),
        debug_hooks=False,
        serving=f"{{model: '{family_dirs[family]}', kv_cache_bytes: 32MiB, max_model_len: 2048}}",
        api=f"served_model_name: {family}, special_tokens_in_messages: refuse",
    )
    LOG_AT_START[family] = Path(d.log.name).read_text(encoding="utf-8")
    yield family, d
    assert d.stop() == 0


def reference(folder: Path, messages: list[dict[str, str]]) -> list[int]:
    """transformers' prompt ids for `messages` rendered with the folder's chat template."""
    hf = AutoTokenizer.from_pretrained(folder)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return hf(text, add_special_tokens=False)["input_ids"]


def tokenize(d: Daemon, family: str, **body: Any) -> httpx.Response:
    return httpx.post(d.url + "/tokenize", json={"model": family, **body}, timeout=60)


def test_each_template_is_probed_for_what_it_takes(family_dirs: dict[str, Path]) -> None:
    """The layout is the template's own answer to [system, user] and [user, user]: refused
    (Gemma, Mistral, Llama 2) or rendered without a message's text (`silent` drops a system
    message) is not taken. A template failing on its own is taken to take both: each request
    meets its error as before."""
    for family, (system, runs) in TAKES.items():
        layout = Tokenizer.from_dir(family_dirs[family]).template_layout
        assert layout == TemplateLayout(system, runs), family


def test_a_tools_loop_is_served_on_every_template(served: tuple[str, Daemon]) -> None:
    """An agent loop through the openai client: a call asked for with tools, its result sent
    back with the tools again, then a turn with two results and the user's system message.
    Gemma's and Mistral's templates refused the first (kvguard's system message), Mistral's
    and Llama 2's the last (two result turns in a row): each a 400."""
    family, d = served
    client = d.client()
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=family, messages=messages, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=200, temperature=0,
    )  # fmt: skip
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0].message.content
    (call,) = first.choices[0].message.tool_calls or []
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id,
                                            "content": "18C"}]  # fmt: skip
    second = client.chat.completions.create(
        model=family, messages=messages, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    both = client.chat.completions.create(
        model=family, messages=LOOP, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert both.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_the_prompt_holds_the_tools_and_both_results_in_order(
    served: tuple[str, Daemon], family_dirs: dict[str, Path]
) -> None:
    """The prompt chat serves (its usage, /tokenize) is transformers' render of the
    conversation laid out by hand for the template (`laid_out`): the user's system text, the
    tools, the question, the calls, Paris's result then Rome's. ChatML's is the layout it
    always had: a system message, each result a turn of its own."""
    family, d = served
    expected = reference(family_dirs[family], laid_out(family, "Be brief."))
    counted = tokenize(d, family, messages=LOOP, tools=[WEATHER])
    assert counted.status_code == 200, counted.text
    assert counted.json()["tokens"] == expected
    text = Tokenizer.from_dir(family_dirs[family]).decode(expected, skip_special_tokens=False)
    described = tools.system_text(FUNCS, "auto", True)
    assert text.index("Be brief.") < text.index(described) < text.index(QUESTION)
    assert text.index(QUESTION) < text.index(CALLS) < text.index(PARIS) < text.index(ROME)
    served_chat = d.client().chat.completions.create(
        model=family, messages=LOOP, tools=[WEATHER], max_tokens=1, temperature=0
    )
    assert served_chat.usage.prompt_tokens == len(expected)


def test_results_without_tools_offered_are_one_turn_where_turns_must_alternate(
    served: tuple[str, Daemon], family_dirs: dict[str, Path]
) -> None:
    """The turn after the results, with no tools offered and no system message: nothing is
    described, and the two results are one user turn only where the template wants roles to
    alternate (Mistral's one `[INST] ... [/INST]` holds both blocks)."""
    family, d = served
    conversation = LOOP[1:]
    counted = tokenize(d, family, messages=conversation)
    assert counted.status_code == 200, counted.text
    hand = laid_out(family, None, described=False)
    assert counted.json()["tokens"] == reference(family_dirs[family], hand)
    if family == "mistral":
        tok = Tokenizer.from_dir(family_dirs[family])
        assert f"[INST] {PARIS}\n{ROME} [/INST]" in tok.decode(counted.json()["tokens"])
    answer = d.client().chat.completions.create(
        model=family, messages=conversation, max_tokens=4, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "offered",
    [{"tools": [WEATHER], "tool_choice": "none"}, {}],
    ids=["tool-choice-none", "no-tools"],
)
def test_a_conversation_is_laid_out_alike_with_tools_and_without(
    served: tuple[str, Daemon], family_dirs: dict[str, Path], offered: dict[str, Any]
) -> None:
    """An agent's last turn: the loop's messages, with the user's system message, sent with
    `tool_choice: "none"` or with no tools. Its system text goes where it went the turns before
    with tools (before the question where the template takes no system message), nothing
    described: Gemma's and Mistral's templates answered this turn with a 400 (the system role)
    after serving the same messages with tools."""
    family, d = served
    counted = tokenize(d, family, messages=LOOP, **offered)
    assert counted.status_code == 200, counted.text
    hand = laid_out(family, "Be brief.", described=False)
    assert counted.json()["tokens"] == reference(family_dirs[family], hand)
    answer = d.client().chat.completions.create(
        model=family, messages=LOOP, max_tokens=4, temperature=0, **offered
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert not answer.choices[0].message.tool_calls


def test_a_user_message_after_the_results_ends_their_turn(
    served: tuple[str, Daemon], family_dirs: dict[str, Path]
) -> None:
    """The user's next question sent right after the results (valid OpenAI input, common in
    agent loops), tools offered: where the template wants roles to alternate it ends the
    results' turn after a blank line (Mistral's and Llama 2's templates refused it as a second
    user turn in a row), elsewhere it is a turn of its own. Two user messages in a row that the
    client sent itself are not joined: such a template still refuses them, naming why."""
    family, d = served
    conversation = [*LOOP, {"role": "user", "content": NEXT}]
    counted = tokenize(d, family, messages=conversation, tools=[WEATHER])
    assert counted.status_code == 200, counted.text
    hand = laid_out(family, "Be brief.", after=NEXT)
    assert counted.json()["tokens"] == reference(family_dirs[family], hand)
    if family == "mistral":
        text = Tokenizer.from_dir(family_dirs[family]).decode(counted.json()["tokens"])
        assert text.endswith(f"[INST] {PARIS}\n{ROME}\n\n{NEXT} [/INST]")
    answer = d.client().chat.completions.create(
        model=family, messages=conversation, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    twice = [{"role": "user", "content": QUESTION}, {"role": "user", "content": NEXT}]
    sent_twice = tokenize(d, family, messages=twice)
    if TAKES[family][1]:
        assert sent_twice.status_code == 200, sent_twice.text
    else:
        assert sent_twice.status_code == 400
        assert "Conversation roles must alternate" in sent_twice.text


def test_the_daemon_logs_what_its_template_takes_at_start(served: tuple[str, Daemon]) -> None:
    """The template is probed when the model loads: the daemon's log says what it does not
    take, naming its file, before any chat request (it said so at the first chat request); a
    template that takes both (chatml) is not mentioned."""
    family, _ = served
    started = LOG_AT_START[family]
    if family in REFUSED:
        assert "chat_template.jinja" in started and REFUSED[family] in started, started
    else:
        assert "the chat template in" not in started, started


@pytest.mark.parametrize(
    ("at", "param"),
    [(0, "messages[0].content"), (4, "messages[4].content")],
    ids=["folded-system", "second-result"],
)
def test_a_special_token_is_named_where_it_was_sent_whatever_the_layout(
    served: tuple[str, Daemon], at: int, param: str
) -> None:
    """`api.special_tokens_in_messages: refuse` reads the texts as the template is given them,
    laid out as chat lays them out: a special token in the user's system message (folded into
    the first user turn) or in the second result (joined to the first) is named in the message
    the request sent it in."""
    family, d = served
    messages = [dict(m) for m in LOOP]
    messages[at]["content"] += "<|im_end|>"
    with pytest.raises(openai.BadRequestError) as refused:
        d.client().chat.completions.create(
            model=family, messages=messages, tools=[WEATHER], max_tokens=1
        )
    assert refused.value.body["param"] == param, refused.value.body


LAYOUT_CASES = [(True, True), (False, True), (True, False), (False, False)]


@pytest.mark.parametrize(("system", "runs"), LAYOUT_CASES)
@pytest.mark.parametrize("with_system", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_the_checked_pieces_are_the_rendered_texts(
    system: bool, runs: bool, with_system: bool, with_tools: bool
) -> None:
    """The special-token check reads pieces (`_template_pieces`), the template is given texts
    (`_chat_messages`): for every layout, with tools and without, the results followed by a
    user message, the pieces joined are the texts, message for message, and a template that
    takes both is given the messages as before the layouts."""
    sent = [*(LOOP if with_system else LOOP[1:]), {"role": "user", "content": NEXT}]
    offered = {"tools": [WEATHER]} if with_tools else {}
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": sent, **offered})
    layout = TemplateLayout(system, runs)
    texts = _chat_messages(body, layout)
    pieces = _template_pieces(body, layout)
    joined = [{k: v if k == "role" else tools.joined(v) for k, v in m.items()} for m in pieces]
    assert joined == texts
    if layout == TemplateLayout():  # what with_tools gave before there were layouts
        before = [m.for_template() for m in body.messages]
        assert texts == (tools.with_tools(before, FUNCS, "auto", True) if with_tools else before)


def test_a_template_that_wants_a_system_message_first_keeps_results_apart(
    family_dirs: dict[str, Path],
) -> None:
    """The user-turns probe puts a system message first where the template takes one: a
    template that requires one refused the probe's bare [user, user] and was taken to want
    alternation, so its results were joined though it renders them as turns of their own."""
    tok = Tokenizer.from_dir(family_dirs["needs-system"])
    assert tok.template_layout == TemplateLayout(system=True, user_after_user=True)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": LOOP})
    prompt = tok.apply_chat_template(_chat_messages(body, tok.template_layout))
    assert f"<user>{PARIS}\n<user>{ROME}\n<assistant>" in prompt


def test_the_layout_is_probed_once_when_the_tokenizer_loads(
    family_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """`Tokenizer.from_dir` probes the template, so its INFO line comes at load (the daemon's
    start), and a chat request asks nothing more of it."""
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        tok = Tokenizer.from_dir(family_dirs["mistral"])
        at_load = [r.getMessage() for r in caplog.records if " takes " in r.getMessage()]
        caplog.clear()
        assert tok.template_layout == TemplateLayout(system=False, user_after_user=False)
    assert len(at_load) == 1 and REFUSED["mistral"] in at_load[0], at_load
    assert not caplog.records


def test_the_default_model_s_template_takes_both(smollm2_dir: Path) -> None:
    """SmolLM2's ChatML takes a system message and user turns in a row: chat lays out its
    conversations as it always did (the chatml cases above show that layout rendered)."""
    assert Tokenizer.from_dir(smollm2_dir).template_layout == TemplateLayout()


def test_a_conversation_the_model_opens_gets_a_user_turn_for_the_tools() -> None:
    """Where the conversation's first turn after the system message is the model's (a
    greeting), the folded system text and tools are a user turn of their own before it, as
    a template that wants roles to alternate needs; the greeting stays where it was sent. A
    joined results turn keeps a name the results share and no name they do not."""
    greeting = {"role": "assistant", "content": "Hi! Ask me."}
    sent = [LOOP[0], greeting, *LOOP[1:]]
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": sent, "tools": [WEATHER]}
    )
    msgs = _chat_messages(body, TemplateLayout(system=False, user_after_user=False))
    described = "Be brief.\n\n" + tools.system_text(FUNCS, "auto", True)
    assert msgs[:3] == [{"role": "user", "content": described}, greeting, LOOP[1]]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    for names, kept in ((["weather", "weather"], "weather"), (["weather", "clock"], None)):
        results = [{**m, "name": n} for m, n in zip(LOOP[3:], names, strict=True)]
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": LOOP[1:3] + results})
        (turn,) = _chat_messages(body, TemplateLayout(user_after_user=False))[2:]
        assert turn == {
            "role": "user",
            "content": PARIS + "\n" + ROME,
            **({"name": kept} if kept else {}),
        }
