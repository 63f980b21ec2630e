"""A chat message's `name` reaches the model. The default model's chat template (SmolLM2's)
never reads `name`: passed on, two participants rendered as one and the field was dropped
without a word. Where a template does not write a role's names (found once, by a probe
render), kvguard writes a speaker's (system, developer, user, tool) name at the start of the
message's text, `Alice: ...`; where it does, the name goes to the template as it is. An
assistant's text is left as sent, whatever the template: the model's own turns each starting
with a name taught it to start its answers so. /tokenize shows the prompt chat serves."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer

from kvguard.engine.tokenizer import Tokenizer
from tests.test_server import Daemon

SMOLLM = "smollm2-135m"
NAMED = [
    {"role": "user", "name": "Alice", "content": "My favourite colour is red."},
    {"role": "user", "name": "Bob", "content": "What is my favourite colour?"},
]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
# an AutoGen-style conversation: every message names its agent, the model's own turns too
AGENTS = [
    {"role": "user", "name": "user_proxy", "content": "Plan a trip."},
    {"role": "assistant", "name": "planner", "content": "Sure, here is a plan."},
    {"role": "user", "name": "user_proxy", "content": "Shorter."},
]
# every role, named: a developer turn is a system turn, a tool turn a user turn
EVERY_ROLE = [
    {"role": "developer", "name": "ops", "content": "Be brief."},
    {"role": "user", "name": "Alice", "content": "Weather?"},
    {"role": "assistant", "name": "bot", "tool_calls": [CALL]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": "sunny"},
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
def smollm_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        debug_hooks=False,
        serving=f"{{model: {SMOLLM}, kv_cache_bytes: 64MiB, max_model_len: 512}}",
    )
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def user_names_daemon(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The tiny model with a chat template that writes user names (USER_NAMES)."""
    folder = tmp_path_factory.mktemp("tinynames")
    for f in tiny_dir.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(USER_NAMES, encoding="utf-8")
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        debug_hooks=False,
        serving=f"{{model: '{folder}', kv_cache_bytes: 8MiB, max_model_len: 512}}",
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


def unnamed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "name"} for m in messages]


def test_names_the_default_model_s_template_ignores_are_written_into_the_text(
    smollm_daemon: Daemon,
) -> None:
    """SmolLM2's template never reads `name`: Alice's and Bob's turns rendered as two
    anonymous user turns, the same prompt as without names. Each now starts with its
    speaker's name, and chat is served the prompt /tokenize shows (its usage counts it)."""
    prompt = prompt_of(smollm_daemon, SMOLLM, NAMED)
    assert "<|im_start|>user\nAlice: My favourite colour is red.<|im_end|>\n" in prompt, prompt
    assert "<|im_start|>user\nBob: What is my favourite colour?<|im_end|>\n" in prompt, prompt
    counted = tokenize(smollm_daemon, SMOLLM, NAMED)
    assert counted != tokenize(smollm_daemon, SMOLLM, unnamed(NAMED))
    out = smollm_daemon.client().chat.completions.create(
        model=SMOLLM, messages=NAMED, max_tokens=1, temperature=0
    )
    assert out.usage.prompt_tokens == len(counted)


def test_every_role_s_name_is_written_where_the_template_would_drop_it(
    smollm_daemon: Daemon,
) -> None:
    """A system (developer) turn's name starts its text; a tool's is inside the
    `<tool_response>` its result is given in. An assistant's turns, its tool calls and its
    text, are rendered as sent. A message without a name is rendered as before."""
    prompt = prompt_of(smollm_daemon, SMOLLM, EVERY_ROLE)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for turn in (
        "<|im_start|>system\nops: Be brief.<|im_end|>\n",
        "<|im_start|>user\nAlice: Weather?<|im_end|>\n",
        f"<|im_start|>assistant\n{call}<|im_end|>\n",
        "<|im_start|>user\n<tool_response>\nget_weather: sunny\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n",
    ):
        assert turn in prompt, (turn, prompt)
    plain = prompt_of(smollm_daemon, SMOLLM, unnamed(EVERY_ROLE))
    for turn in (
        "<|im_start|>system\nBe brief.<|im_end|>\n",
        f"<|im_start|>assistant\n{call}<|im_end|>\n",
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n",
    ):
        assert turn in plain, (turn, plain)
    out = smollm_daemon.client().chat.completions.create(
        model=SMOLLM, messages=EVERY_ROLE, max_tokens=1, temperature=0
    )
    assert out.usage.prompt_tokens == len(tokenize(smollm_daemon, SMOLLM, EVERY_ROLE))


def test_a_template_that_writes_names_gets_them_as_sent(user_names_daemon: Daemon) -> None:
    """A template that writes user names gets a user's as it is, where it puts it (no
    `Alice: ` in the text); the assistant's, which it does not write, is dropped by it, and
    the assistant's text is left as sent."""
    messages = [*NAMED, {"role": "assistant", "name": "bot", "content": "Red."}]
    prompt = prompt_of(user_names_daemon, "tinynames", messages)
    assert "<|im_start|>user (Alice)\nMy favourite colour is red.<|im_end|>\n" in prompt, prompt
    assert "<|im_start|>user (Bob)\nWhat is my favourite colour?<|im_end|>\n" in prompt, prompt
    assert "<|im_start|>assistant\nRed.<|im_end|>\n" in prompt, prompt
    out = user_names_daemon.client().chat.completions.create(
        model="tinynames", messages=messages, max_tokens=1
    )
    assert out.usage.prompt_tokens == len(tokenize(user_names_daemon, "tinynames", messages))


def test_an_assistant_s_name_leaves_its_text_as_sent(smollm_daemon: Daemon) -> None:
    """An AutoGen-style conversation names every agent. The assistant's name was written into
    its text too, so the history showed the model its own answers starting `planner: `, and
    it would start the next one so, which breaks clients that parse answers (JSON, tool-call
    text). The user's name starts its text, the assistant's turn is its content as sent, and
    chat is served the prompt /tokenize shows."""
    prompt = prompt_of(smollm_daemon, SMOLLM, AGENTS)
    assert (
        "<|im_start|>user\nuser_proxy: Plan a trip.<|im_end|>\n"
        "<|im_start|>assistant\nSure, here is a plan.<|im_end|>\n"
        "<|im_start|>user\nuser_proxy: Shorter.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in prompt, prompt
    assert "planner" not in prompt, prompt
    counted = tokenize(smollm_daemon, SMOLLM, AGENTS)
    out = smollm_daemon.client().chat.completions.create(
        model=SMOLLM, messages=AGENTS, max_tokens=1, temperature=0
    )
    assert out.usage.prompt_tokens == len(counted)


@pytest.mark.parametrize(
    ("template", "written"),
    [
        ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", set()),
        ("{% for m in messages %}{{ m.name or m.role }}: {{ m.content }}\n{% endfor %}",
         {"system", "user", "assistant"}),
        (USER_NAMES, {"user"}),
        # Gemma's: no system role. Its name is passed on: such a request fails on the template
        ("{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
         "{% for m in messages %}{{ m.name }}{{ m.content }}{% endfor %}",
         {"system", "user", "assistant"}),
        ('{{ strftime_now("%H:%M:%S.%f") }}{% for m in messages %}{{ m.content }}{% endfor %}',
         set()),
    ],
    ids=["none", "every-role", "user-only", "refuses-system", "writes-the-time"],
)  # fmt: skip
def test_which_roles_names_a_template_writes(
    tiny_dir: Path, template: str, written: set[str]
) -> None:
    """The probe: a role's name is written where the template puts the probe name in the
    prompt; a template that writes the time does not pass for one that writes names."""
    backend = HFTokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    tok = Tokenizer(backend, {}, template)
    assert {r for r in ("system", "user", "assistant") if tok.renders_name(r)} == written
