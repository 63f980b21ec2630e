"""The admin API against a hostile caller, on a real `kvguard serve` over loopback (issue 13):
remedy parameters are bounded by the configured limits and an invalid one answers 400 naming
it (never 500, never applied), and the fault-injection hooks exist only when configured."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_server import TOKEN, Daemon

SEQS = 32  # the test daemon's serving.max_num_seqs (the default)
LEN = 512  # its serving.max_model_len


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(tmp_path_factory.mktemp("admin-bounds"))
    yield d
    assert d.stop() == 0


def knobs(d: Daemon) -> dict[str, Any]:
    return d.admin("GET", "/admin/state").json()["knobs"]


def post(d: Daemon, path: str, body: Any) -> httpx.Response:
    """POST `body` as JSON, NaN and Infinity included (Python's json reads and writes them, so
    a hostile client can send them; httpx's own encoder refuses to)."""
    return httpx.post(
        d.url + path,
        content=json.dumps(body),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        timeout=60,
    )


def refused(r: httpx.Response, field: str) -> str:
    """A 400 with the OpenAI-style error naming `field`; returns the message."""
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    return err["message"]


@pytest.mark.parametrize(
    ("action", "body", "field"),
    [
        ("reduce_batch", {"min": 1e9}, "min"),
        ("reduce_batch", {"min": 10**9}, "min"),
        ("reduce_batch", {"min": True}, "min"),
        ("reduce_batch", {"factor": 1.5}, "factor"),
        ("reduce_batch", {"factor": float("nan")}, "factor"),
        ("reduce_batch", {"factor": float("inf")}, "factor"),
        ("reduce_batch", {"factor": "half"}, "factor"),
        ("reduce_batch", {"bogus": 1}, "bogus"),
        ("set_max_num_seqs", {"n": 1e30}, "n"),
        ("set_max_num_seqs", {"n": 10**30}, "n"),
        ("set_max_num_seqs", {"n": SEQS + 1}, "n"),
        ("set_max_num_seqs", {"n": "8"}, "n"),
        ("set_max_num_seqs", {"n": 0}, "n"),
        ("cap_max_new_tokens", {"n": 1e30}, "n"),
        ("cap_max_new_tokens", {"n": float("inf")}, "n"),
        ("cap_max_new_tokens", {"n": LEN + 1}, "n"),
        ("evict_lowest_priority", {"count": 10**12}, "count"),
        ("evict_lowest_priority", {"count": True}, "count"),
        ("halt_admission", {"allow_priority": 7}, "allow_priority"),
    ],
)
def test_invalid_action_params_answer_400_naming_the_field_and_change_nothing(
    daemon: Daemon, action: str, body: dict[str, Any], field: str
) -> None:
    before = knobs(daemon)
    refused(post(daemon, f"/admin/actions/{action}", body), field)
    assert knobs(daemon) == before


def test_a_halt_for_every_priority_takes_none_as_status_shows_it(daemon: Daemon) -> None:
    """`kvguard status` and the action's detail show a halt for all as `allowed: none`, but
    `"allow_priority": "none"` was refused with a 400 listing only high, normal and low (null
    was the one value that worked, named nowhere). Now "none" is that halt, and a value that
    is neither names it among those accepted."""
    try:
        r = daemon.admin("POST", "/admin/actions/halt_admission", json={"allow_priority": "none"})
        assert r.status_code == 200, r.text
        assert r.json()["detail"] == "admission halted (allowed: none)"
        assert knobs(daemon)["admission_allow_priority"] == "none"
        ready = httpx.get(daemon.url + "/ready", timeout=60)
        assert ready.status_code == 503 and "halted for every priority" in ready.text
    finally:
        assert daemon.admin("POST", "/admin/actions/resume_admission").status_code == 200
    body = {"allow_priority": "nobody"}
    msg = refused(post(daemon, "/admin/actions/halt_admission", body), "allow_priority")
    assert "'high', 'normal', 'low' or 'none'" in msg


def test_limits_above_the_config_are_named_in_the_refusal(daemon: Daemon) -> None:
    msg = refused(daemon.admin("POST", "/admin/actions/set_max_num_seqs", json={"n": 64}), "n")
    assert f"serving.max_num_seqs={SEQS}" in msg
    msg = refused(daemon.admin("POST", "/admin/actions/cap_max_new_tokens", json={"n": 4096}), "n")
    assert "max_model_len=" in msg
    assert knobs(daemon)["max_num_seqs"] == SEQS and knobs(daemon)["max_new_tokens_cap"] is None


def test_reduce_batch_never_raises_the_limit(daemon: Daemon) -> None:
    one = daemon.admin("POST", "/admin/actions/set_max_num_seqs", json={"n": 1})
    assert one.status_code == 200 and one.json()["after"]["max_num_seqs"] == 1
    try:
        r = daemon.admin("POST", "/admin/actions/reduce_batch", json={"factor": 0.5, "min": 1000})
        assert r.status_code == 200, r.text
        assert r.json()["ok"] and r.json()["after"]["max_num_seqs"] == 1
        assert knobs(daemon)["max_num_seqs"] == 1
    finally:
        back = daemon.admin("POST", "/admin/actions/restore_batch")
    assert back.json()["action"] == "restore_batch"  # as asked, not what it runs underneath
    assert r.json()["action"] == "reduce_batch"
    assert knobs(daemon)["max_num_seqs"] == SEQS


def test_params_must_be_a_json_object(daemon: Daemon) -> None:
    r = daemon.admin("POST", "/admin/actions/reduce_batch", json=[0.5])
    assert r.status_code == 400 and "error" in r.json()


@pytest.mark.parametrize(
    ("hook", "body", "field"),
    [
        ("stall", {"seconds": "abc"}, "seconds"),
        ("stall", {"seconds": float("inf")}, "seconds"),
        ("stall", {"seconds": float("nan")}, "seconds"),
        ("stall", {"seconds": -1}, "seconds"),
        ("stall", {"seconds": 61}, "seconds"),
        ("stall", {"seconds": True}, "seconds"),
        ("stall", {"secs": 1}, "secs"),
        ("inject_oom", {"times": "inf"}, "times"),
        ("inject_oom", {"times": 1e9}, "times"),
        ("inject_oom", {"times": 11}, "times"),
        ("inject_oom", {"times": 0}, "times"),
        ("inject_oom", {"times": True}, "times"),
        ("fail_rank", {"rank": -1}, "rank"),
        ("fail_rank", {"rank": "1"}, "rank"),
        ("fail_rank", {"rank": True}, "rank"),
        ("fail_rank", {"which": 1}, "which"),
    ],
)
def test_debug_hook_params_answer_400_naming_the_field(
    daemon: Daemon, hook: str, body: dict[str, Any], field: str
) -> None:
    refused(post(daemon, f"/admin/debug/{hook}", body), field)


def test_debug_hooks_work_when_configured(daemon: Daemon) -> None:
    r = daemon.admin("POST", "/admin/debug/stall", json={"seconds": 0})
    assert r.status_code == 200 and r.json() == {"stalled_s": 0.0}
    assert daemon.admin("POST", "/admin/debug/release").json() == {"released": 0}
    # a stall of a minute released at once: the engine answers again within seconds
    assert daemon.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
    t0 = time.monotonic()
    assert daemon.admin("POST", "/admin/debug/release").json() == {"released": 1}
    c = daemon.client()
    assert c.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens
    assert time.monotonic() - t0 < 30


def test_debug_hooks_are_absent_by_default(tmp_path: Path) -> None:
    d = Daemon(tmp_path, debug_hooks=False)
    try:
        hooks = (
            ("stall", {"seconds": 1}),
            ("release", {}),
            ("inject_oom", {"times": 1}),
            ("fail_rank", {}),
        )
        for hook, body in hooks:
            assert d.admin("POST", f"/admin/debug/{hook}", json=body).status_code == 404
            assert httpx.post(f"{d.url}/admin/debug/{hook}", json=body).status_code == 404
        assert d.admin("POST", "/admin/actions/restore_batch").status_code == 200
    finally:
        assert d.stop() == 0
