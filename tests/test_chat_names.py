"""A chat message's `name` goes to the chat template as sent, and kvguard writes nothing else:
the prompt chat serves is the one the model's own template renders (transformers'
`apply_chat_template` on the same files). Writing a name into the text where the template
writes none (`Alice: Hi`) changed what small models answer: `user_42: What's 2+2?` was answered
42, a tool's JSON result stopped being JSON (`get_weather: {...}`). The default model's template
(SmolLM2's) writes no names, so there a name does not reach the model; a template that writes
them gets them, where it puts them. /tokenize shows the prompt chat serves."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.test_api_openai_edges import SMOLLM, smollm_daemon  # noqa: F401 - a fixture
from tests.test_server import Daemon

NAMED = [
    {"role": "user", "name": "user_42", "content": "What's 2+2?"},
]
# an AutoGen-style conversation: every message names its agent, the model's own turns too
AGENTS = [
    {"role": "system", "name": "ops", "content": "Be brief."},
    {"role": "user", "name": "user_proxy", "content": "Plan a trip."},
    {"role": "assistant", "name": "planner", "content": "Sure, here is a plan."},
    {"role": "user", "name": "user_proxy", "content": "Shorter."},
]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
RESULT = '{"sky": "sunny", "celsius": 21}'
# every role, named: a developer turn is a system turn, a tool turn a user turn holding its result
EVERY_ROLE = [
    {"role": "developer", "name": "ops", "content": "Be brief."},
    {"role": "user", "name": "Alice", "content": "Weather?"},
    {"role": "assistant", "name": "bot", "tool_calls": [CALL]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": RESULT},
    {"role": "assistant", "name": "bot", "content": "It is sunny."},
]
# a template that writes a user's name in its turn's header, and no other role's
USER_NAMES = (
    "{% for m in messages %}<|im_start|>{{ m.role }}"
    "{% if m.role == 'user' and m.name %} ({{ m.name }}){% endif %}"
    "{{ '\\n' + m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def smollm_reference(smollm2_gguf: Path) -> Any:
    """transformers' tokenizer, with its chat template, read from the GGUF kvguard serves."""
    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def user_names_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that writes user names (USER_NAMES)."""
    folder = tmp_path_factory.mktemp("tinynames")
    for f in tiny_dir.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(USER_NAMES, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def user_names_daemon(
    user_names_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        debug_hooks=False,
        serving=f"{{model: '{user_names_dir}', kv_cache_bytes: 8MiB, max_model_len: 512}}",
        api="served_model_name: tinynames",
    )
    yield d
    assert d.stop() == 0


def tokenize(d: Daemon, model: str, messages: list[dict[str, Any]]) -> list[int]:
    r = httpx.post(d.url + "/tokenize", json={"model": model, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def prompt_of(d: Daemon, model: str, messages: list[dict[str, Any]]) -> str:
    """The prompt chat serves `messages` with, as /tokenize counts it, in text."""
    tokens = tokenize(d, model, messages)
    r = httpx.post(d.url + "/detokenize", json={"model": model, "tokens": tokens}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def rendered(reference: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt transformers renders from `messages` with the model's chat template."""
    return reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def unnamed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "name"} for m in messages]


def served_prompt_tokens(d: Daemon, model: str, messages: list[dict[str, Any]]) -> int:
    """The prompt tokens chat counts for `messages` (the real openai client)."""
    out = d.client().chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0
    )
    return out.usage.prompt_tokens


@pytest.mark.parametrize("messages", [NAMED, AGENTS], ids=["user-id", "agents"])
def test_the_default_model_s_prompt_is_its_chat_template_s(
    smollm_daemon: Daemon,  # noqa: F811 - the fixture
    smollm_reference: Any,
    messages: list[dict[str, Any]],
) -> None:
    """SmolLM2's template writes no names: the prompt with names is transformers' render of
    the messages, token for token the prompt without them, with no `user_42: ` or `planner: `
    in any turn's text; chat is served the prompt /tokenize shows."""
    prompt = prompt_of(smollm_daemon, SMOLLM, messages)
    assert prompt == rendered(smollm_reference, messages)
    counted = tokenize(smollm_daemon, SMOLLM, messages)
    assert counted == tokenize(smollm_daemon, SMOLLM, unnamed(messages))
    for m in messages:
        assert f"{m['name']}:" not in prompt, prompt
    assert served_prompt_tokens(smollm_daemon, SMOLLM, messages) == len(counted)


def test_names_leave_every_role_s_text_as_sent(smollm_daemon: Daemon) -> None:  # noqa: F811
    """A developer's, user's, assistant's and tool's name change no text: a tool's JSON result
    is the JSON sent inside its `<tool_response>`, and the assistant's call turn starts with the
    `<tool_call>` the tools grammar lets an answer start with. The prompt is the one without
    names."""
    prompt = prompt_of(smollm_daemon, SMOLLM, EVERY_ROLE)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for turn in (
        "<|im_start|>system\nBe brief.<|im_end|>\n",
        "<|im_start|>user\nWeather?<|im_end|>\n",
        f"<|im_start|>assistant\n{call}<|im_end|>\n",
        f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n",
    ):
        assert turn in prompt, (turn, prompt)
    counted = tokenize(smollm_daemon, SMOLLM, EVERY_ROLE)
    assert counted == tokenize(smollm_daemon, SMOLLM, unnamed(EVERY_ROLE))
    assert served_prompt_tokens(smollm_daemon, SMOLLM, EVERY_ROLE) == len(counted)


def test_a_template_that_writes_names_gets_them_as_sent(
    user_names_daemon: Daemon, user_names_dir: Path
) -> None:
    """A template that writes user names gets each message's name and writes it where it
    puts it; the system's and the assistant's, which it does not write, it drops, and their
    texts are left as sent. The prompt is transformers' render of the same template."""
    reference = AutoTokenizer.from_pretrained(str(user_names_dir))
    messages = [*AGENTS[:2], {"role": "user", "name": "Bob", "content": "Why?"}, AGENTS[2]]
    prompt = prompt_of(user_names_daemon, "tinynames", messages)
    assert prompt == rendered(reference, messages)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user (user_proxy)\nPlan a trip.<|im_end|>\n"
        "<|im_start|>user (Bob)\nWhy?<|im_end|>\n"
        "<|im_start|>assistant\nSure, here is a plan.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    counted = tokenize(user_names_daemon, "tinynames", messages)
    assert served_prompt_tokens(user_names_daemon, "tinynames", messages) == len(counted)


def test_a_tool_s_name_goes_to_the_template_with_its_result(user_names_daemon: Daemon) -> None:
    """A tool turn is given to the template as a user turn holding its result, its name passed
    on: a template that writes user names writes the tool's in the header, the result stays
    the JSON sent."""
    prompt = prompt_of(user_names_daemon, "tinynames", EVERY_ROLE[1:4])
    assert (
        f"<|im_start|>user (get_weather)\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n"
    ) in prompt, prompt
