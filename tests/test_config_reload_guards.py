"""What a reload must refuse, or say, that it used to take quietly (the daemon in process).

A config file that holds nothing (a truncated write) read as every default: API-key auth off on
an open address, the operator's rules swapped for the packaged ones. Restart-only values the
next start's load refuses (a tensor-parallel size that does not divide the model, a
model_quantization the checkpoint does not hold) answered `reloaded: true`, and the restart then
failed. A reload asked during the drain answered 400 blaming the config. A reload that drops the
keys file on an open address said nothing above INFO.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.daemon.api_keys import add_key
from kvguard.daemon.config import load_config
from kvguard.daemon.service import Service
from tests.test_config_reload_edges import _serving
from tests.test_control_plane import admin_post, service  # noqa: F401 - service: a fixture
from tests.test_reload import RULES, _events
from tests.test_server import TOKEN

OPEN_API_WARNING = "the API listens on 0.0.0.0 with no api.api_keys_file"


@pytest.fixture
def keyed(tiny_dir: Path, tmp_path: Path) -> Iterator[Service]:
    """The daemon in process on an open address (it binds nothing here), with an API keys
    file, its own rules file and a batch limit of its own."""
    (tmp_path / "admin.token").write_text(TOKEN + "\n")
    add_key(tmp_path / "keys.yaml", "alice", "normal", None)
    (tmp_path / "rules.yaml").write_text(RULES.format(interval="5s", name="operators"))
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"serving: {{model: {tiny_dir}, kv_cache_bytes: 8MiB, max_model_len: 512, "
        "max_num_seqs: 4}\n"
        "api: {host: 0.0.0.0, admin_token_file: admin.token, api_keys_file: keys.yaml}\n"
        "rules: {path: rules.yaml}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    yield svc
    svc.close()


def _rule_names(svc: Service) -> list[str]:
    assert svc.control is not None
    return [r.name for r in svc.control.ruleset.rules]


@pytest.mark.parametrize("text", ["", "# kvguard config\n"])
def test_a_reload_of_a_file_that_holds_nothing_keeps_keys_rules_and_knobs(
    keyed: Service, text: str
) -> None:
    path = keyed.config_path
    assert path is not None and keyed.api_keys is not None and len(keyed.api_keys) == 1
    rules, seqs = keyed.cfg.rules.path, keyed.engine.config.max_num_seqs
    assert _rule_names(keyed) == ["operators"] and seqs == 4
    path.write_text(text)  # a truncated write, caught in the middle
    r = admin_post(keyed, "/admin/reload")
    assert r.status_code == 400, r.text
    said = f"{path}:1: the config file holds nothing, or only comments (for the built-in defaults"
    assert r.json()["error"]["message"].startswith(said), r.text
    assert keyed.api_keys is not None and len(keyed.api_keys) == 1  # auth stays on
    assert keyed.cfg.rules.path == rules and _rule_names(keyed) == ["operators"]
    assert keyed.engine.config.max_num_seqs == 4 == keyed.cfg.serving.max_num_seqs
    [event] = _events(keyed, "config_error")
    assert event["data"]["errors"][0].startswith(said), event


def test_a_reload_that_drops_the_keys_file_on_an_open_address_warns(
    keyed: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """It turns auth off (which an operator may mean), and says so as loudly as a start on
    that address would; a reload that keeps the keys says nothing of it."""
    path = keyed.config_path
    assert path is not None
    caplog.set_level(logging.INFO, logger="kvguard.daemon")
    assert keyed.reload()["reloaded"]
    assert not [m for m in caplog.messages if OPEN_API_WARNING in m]
    path.write_text(path.read_text().replace(", api_keys_file: keys.yaml", ""))
    r = keyed.reload()
    assert r["reloaded"] and r["changes"]["api.api_keys_file"] is None, r
    assert keyed.api_keys is None
    [warning] = [rec for rec in caplog.records if OPEN_API_WARNING in rec.getMessage()]
    assert warning.levelno == logging.WARNING


def test_a_reload_refuses_parallel_sizes_the_model_cannot_split(
    service: Service,  # noqa: F811
) -> None:
    """tiny has 4 query heads, 2 KV heads, an MLP width of 128 and 2 layers: tensor_parallel
    7 and pipeline_parallel 3 fail the next start's load, so the reload refuses them with the
    key and its line; tensor_parallel 2 waits for the restart as before."""
    path = service.config_path
    assert path is not None
    good = path.read_text()
    for more, said in (
        ("tensor_parallel: 7", "serving.tensor_parallel: tensor_parallel=7 does not divide the "),
        ("pipeline_parallel: 3", "serving.pipeline_parallel: pipeline_parallel=3 exceeds the "),
    ):
        path.write_text(_serving(service, more))
        r = admin_post(service, "/admin/reload")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"{path}:1: {said}"), r.text
        path.write_text(good)
    path.write_text(_serving(service, "tensor_parallel: 2"))
    r = service.reload()
    assert r["reloaded"] and r["restart_needed"] == ["serving.tensor_parallel"], r
    assert service.cfg.serving.tensor_parallel == 1  # in force until the restart


def test_a_reload_refuses_a_model_quantization_the_checkpoint_does_not_hold(
    service: Service,  # noqa: F811
) -> None:
    path = service.config_path
    assert path is not None
    good = path.read_text()
    path.write_text(good + "quantization: {model_quantization: gptq_4bit}\n")
    r = admin_post(service, "/admin/reload")
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{path}:4: quantization.model_quantization: "), message
    assert "holds unquantized weights, but quantization.model_quantization is gptq_4bit" in message
    assert service.cfg.quantization.model_quantization == "auto"
    path.write_text(good + "quantization: {model_quantization: none}\n")  # what tiny holds
    r = service.reload()
    assert r["reloaded"] and r["restart_needed"] == ["quantization.model_quantization"], r


def test_a_reload_asked_during_the_drain_answers_503_shutting_down(
    service: Service,  # noqa: F811
) -> None:
    """Nothing is wrong with the config: a deploy script must not read "your config is bad"
    (it was 400 `reload_refused`, `param: config`), but retry against the daemon that takes
    over, as for every admin action asked once the stop began."""
    service.draining = True  # as the stop's first step sets it
    r = admin_post(service, "/admin/reload")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "shutting_down" and err["type"] == "service_unavailable", err
    assert err["param"] is None and "nothing changed" in err["message"], err
    assert r.headers["Retry-After"] == "5"
    assert _events(service, "config_error") == []
