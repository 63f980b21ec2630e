"""POST /tokenize and /detokenize: the ids a request is served with, on the real daemon."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvguard.engine.tokenizer import Tokenizer
from tests.test_server import Daemon

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi there"}]


def post(d: Daemon, path: str, body: dict) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=30)


def test_counts_match_what_the_completions_serve(tiny_daemon: Daemon) -> None:
    d, c = tiny_daemon, tiny_daemon.client()
    text = "Hello, tokenizer"
    r = post(d, "/tokenize", {"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    got = r.json()
    done = c.completions.create(model="tiny", prompt=text, max_tokens=1)
    assert got["count"] == len(got["tokens"]) == done.usage.prompt_tokens
    assert 0 < got["max_model_len"] <= 512  # the daemon's max_model_len (or its pool's)
    r = post(d, "/tokenize", {"model": "tiny", "messages": MSGS})
    chat = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens
    # served as a completion prompt of token ids, the same count again
    again = c.completions.create(model="tiny", prompt=got["tokens"], max_tokens=1)
    assert again.usage.prompt_tokens == got["count"]
    # a `developer` turn (OpenAI's successor to `system`) is rendered as the system turn
    developer = [{**MSGS[0], "role": "developer"}, MSGS[1]]
    as_system = post(d, "/tokenize", {"model": "tiny", "messages": MSGS}).json()["tokens"]
    assert post(d, "/tokenize", {"model": "tiny", "messages": developer}).json()["tokens"] == (
        as_system
    )


def test_tokenize_counts_up_to_8_times_max_model_len_and_refuses_one_more(
    tiny_daemon: Daemon,
) -> None:
    """README: a text of more than 8 times max_model_len is refused, naming the field. A text
    short enough to be tokenized whole was once counted however long (250,000 tokens: 200);
    the tiny model's tokens are bytes, so "a" * n is n tokens."""
    d = tiny_daemon
    most = 8 * post(d, "/tokenize", {"model": "tiny", "prompt": "a"}).json()["max_model_len"]
    r = post(d, "/tokenize", {"model": "tiny", "prompt": "a" * most})
    assert r.status_code == 200 and r.json()["count"] == most, r.text[:200]
    r = post(d, "/tokenize", {"model": "tiny", "prompt": "a" * (most + 1)})
    assert r.status_code == 400, r.text[:200]
    err = r.json()["error"]
    assert err["param"] == "prompt", err
    assert f"more than {most} tokens (8x max_model_len=" in err["message"], err
    # a chat: the template's own tokens count too
    around = post(d, "/tokenize", {"model": "tiny", "messages": chat("")}).json()["count"]
    r = post(d, "/tokenize", {"model": "tiny", "messages": chat("a" * (most - around))})
    assert r.status_code == 200 and r.json()["count"] == most, r.text[:200]
    r = post(d, "/tokenize", {"model": "tiny", "messages": chat("a" * (most - around + 1))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:200]


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_encode_within_is_false_for_a_whole_text_over_its_limit(tiny_dir: Path) -> None:
    """Both ways encode_within answers: a text short enough to be tokenized whole is compared
    with the limit exactly; a long one is refused once a prefix is over it."""
    tok = Tokenizer.from_dir(tiny_dir)
    ids, whole = tok.encode_within("a" * 100, False, 100)
    assert (len(ids), whole) == (100, True)
    ids, whole = tok.encode_within("a" * 101, False, 100)
    assert (len(ids), whole) == (101, False)
    ids, whole = tok.encode_within("a" * 1_000_000, False, 100)
    assert not whole and 100 < len(ids) < 1_000_000  # a prefix: the cost set by the limit


def test_detokenize_inverts_tokenize(tiny_daemon: Daemon) -> None:
    d = tiny_daemon
    text = "round trip: é, 漢字"
    ids = post(d, "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False})
    r = post(d, "/detokenize", {"model": "tiny", "tokens": ids.json()["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "tiny"}, 400, None),
        ("/tokenize", {"model": "tiny", "prompt": "a", "messages": MSGS}, 400, None),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/tokenize", {"model": "tiny", "prompt": 7}, 400, "prompt"),
        ("/detokenize", {"model": "tiny", "tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"model": "tiny", "tokens": [1.0]}, 400, "tokens[0]"),
    ],
)
def test_bad_input_is_a_named_4xx(
    tiny_daemon: Daemon, path: str, body: dict, status: int, param: str | None
) -> None:
    r = post(tiny_daemon, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if param is None:
        assert "exactly one of prompt and messages" in err["message"]
