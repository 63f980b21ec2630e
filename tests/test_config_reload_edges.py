"""Edges of the config file, its reload and the operator's commands around them.

A reload resolves automatic values for the device in force (serving.device waits for the
restart) and refuses what the next start would refuse, unknown models included; a relative
`serving.model` is read beside the config file; a KV budget too small for one block is
refused by a reload as a start refuses it; `kvguard audit`/`kvguard db` with an unknown
database backend, and `kvguard status` at a server that is not kvguard, answer in one line;
a SIGHUP while `kvguard serve` is still importing is ignored, as one during loading is.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvguard.daemon import config as config_module
from kvguard.daemon.app import create_app
from kvguard.daemon.cli import main
from kvguard.daemon.config import ConfigFileError, apply_overrides, load_config
from kvguard.daemon.service import Service, engine_changes
from kvguard.engine.config import ConfigError
from tests.test_control_plane import admin_post, service  # noqa: F401 - service: a fixture
from tests.test_engine import make_engine
from tests.test_kv_pool import apply
from tests.test_reload import _events
from tests.test_server import KVGUARD, TEST_DAEMON_ENV, serve_refused, until


def _completion(svc: Service) -> httpx.Response:
    """POST /v1/completions to the daemon in process."""

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(svc))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvguard") as c:
            body = {"model": svc.model_name, "prompt": "hi", "max_tokens": 2}
            return await c.post("/v1/completions", json=body, timeout=120)

    return asyncio.run(post())


def _serving(svc: Service, more: str) -> str:
    """The service's config file with `more` added to its serving section."""
    assert svc.config_path is not None
    text = svc.config_path.read_text()
    assert "max_model_len: 512}" in text
    return text.replace("max_model_len: 512}", f"max_model_len: 512, {more}}}")


# -- a reload resolves automatic values for the device in force -------------------------------
def test_a_reload_that_changes_only_the_device_changes_no_live_knob(
    service: Service,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon serves on CPU (`auto` on this host) and the file now says `device: cuda`,
    as on a host with a GPU (the config check is told there is one; the engine stays on CPU).
    serving.device waits for the restart, so the automatic headroom stays the CPU's 0: before,
    the reload resolved it for the file's CUDA (2048 MiB) and applied it to the running CPU
    engine, and every request was refused ("KV budget of 0 blocks"), even after the file was
    put back. A headroom that leaves nothing of the CPU budget in force is refused, though the
    file's own device would take it."""
    monkeypatch.setattr(config_module, "_cuda_devices", lambda: 1, raising=False)
    assert service.config_path is not None
    original = service.config_path.read_text()
    headroom = service.engine.config.admission.reserved_headroom_bytes
    service.config_path.write_text(_serving(service, "device: cuda"))
    r = admin_post(service, "/admin/reload")
    assert r.status_code == 200, r.text
    assert r.json()["changes"] == {} and r.json()["restart_needed"] == ["serving.device"], r.json()
    assert service.engine.config.admission.reserved_headroom_bytes == headroom
    assert service.engine.admission.config.reserved_headroom_bytes == headroom
    assert _completion(service).status_code == 200
    service.config_path.write_text(original)
    back = service.reload()
    assert back["reloaded"] and back["changes"] == {} and back["restart_needed"] == [], back
    # 8 MiB of headroom on the 8 MiB CPU pool in force: refused, though CUDA would take it
    service.config_path.write_text(
        _serving(service, "device: cuda") + "admission_control: {reserved_headroom_mb: 8}\n"
    )
    bad = admin_post(service, "/admin/reload")
    assert bad.status_code == 400, bad.text
    message = bad.json()["error"]["message"]
    assert (
        f"{service.config_path}:4: admission_control.reserved_headroom_mb: 8 MiB leaves "
        "nothing of the 8 MiB CPU KV budget of the engine in force (cpu: serving.device "
        "changes at a restart)"
    ) in message, message
    assert service.engine.config.admission.reserved_headroom_bytes == headroom
    assert _completion(service).status_code == 200


def test_the_changes_between_two_files_resolve_auto_for_the_device_given(tmp_path: Path) -> None:
    cpu, cuda = tmp_path / "cpu.yaml", tmp_path / "cuda.yaml"
    cpu.write_text("serving: {model: tiny, device: cpu}\n")
    cuda.write_text("serving: {model: tiny, device: cuda}\n")
    live, restart = engine_changes(load_config(cpu), load_config(cuda))
    assert (live, restart) == ([], ["serving.device"])
    assert load_config(cuda).reserved_headroom_mb() == 2048  # the next start, on CUDA
    assert load_config(cuda).reserved_headroom_mb("cpu") == 0
    cuda.write_text(
        "serving: {model: tiny, device: cuda, kv_cache_bytes: 16MiB}\n"
        "admission_control: {reserved_headroom_mb: 64}\n"
    )
    with pytest.raises(ConfigFileError) as e:
        load_config(cuda).check_start("cpu")
    assert any("reserved_headroom_mb: 64 MiB leaves nothing" in line for line in e.value.errors)


# -- a reload refuses what the next start refuses: the model ----------------------------------
def test_a_reload_refuses_a_model_the_next_start_cannot_find(
    service: Service,  # noqa: F811
) -> None:
    """Before, the reload said "serving.model changed in the file and takes effect at the next
    restart", and that restart then failed."""
    assert service.config_path is not None
    text = service.config_path.read_text()
    model = re.search(r"model: ([^,]+),", text)
    assert model is not None
    service.config_path.write_text(text.replace(model.group(0), "model: nosuch,"))
    r = admin_post(service, "/admin/reload")
    assert r.status_code == 400, r.text
    line = (
        f"{service.config_path}:1: serving.model: 'nosuch' is not a known model "
        "(smollm2-135m, tiny) and as a path does not exist"
    )
    assert r.json()["error"]["message"].startswith(line), r.text
    [event] = _events(service, "config_error")
    assert event["data"]["errors"][0].startswith(line), event
    assert _completion(service).status_code == 200
    # the start refuses the same file with the same line, before the port is bound
    refused = serve_refused(service.config_path)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith(f"kvguard: error: {line}"), refused.stderr
    assert "API bound" not in refused.stderr + refused.stdout


def test_a_cuda_device_on_a_host_without_one_is_refused_with_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_module, "_cuda_devices", lambda: 0, raising=False)
    f = tmp_path / "config.yaml"
    f.write_text("api: {port: 0}\nserving: {model: tiny, device: cuda}\n")
    with pytest.raises(ConfigFileError) as e:
        load_config(f).check_start()
    assert e.value.errors == [
        f"{f}:2: serving.device: 'cuda': torch finds no CUDA on this host, where this config "
        "needs 1 GPU (expected cpu or auto)"
    ]


# -- a relative serving.model is read beside the config file ----------------------------------
def test_a_relative_model_path_is_read_beside_the_config_file(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As rules.path and the other paths are: the shipped unit runs the daemon in its state
    directory, so `./m` was looked for there. A `--model` flag stays the shell's."""
    etc, elsewhere = tmp_path / "etc", tmp_path / "wd"
    etc.mkdir()
    elsewhere.mkdir()
    (etc / "m").symlink_to(tiny_dir, target_is_directory=True)
    f = etc / "config.yaml"
    f.write_text("serving: {model: ./m}\n")
    monkeypatch.chdir(elsewhere)
    cfg = load_config(f)
    assert cfg.serving.model == str(etc / "m")
    cfg.check_start()
    assert apply_overrides(cfg, model="./m").serving.model == "./m"
    # clients keep the name the file wrote (they got 404 for it once it was made absolute),
    # other flags keep it, a --model flag serves its own, api.served_model_name wins
    assert cfg.served_model_name() == "./m"
    assert apply_overrides(cfg, port=8123).served_model_name() == "./m"
    assert apply_overrides(cfg, model="tiny").served_model_name() == "tiny"
    f.write_text("serving: {model: ./m}\napi: {served_model_name: mine}\n")
    assert load_config(f).served_model_name() == "mine"
    # a known name stays one, and a path found nowhere beside the file is left as written
    f.write_text("serving: {model: tiny}\n")
    assert load_config(f).serving.model == "tiny"
    f.write_text("serving: {model: ./absent}\n")
    assert load_config(f).serving.model == "./absent"


# -- a KV budget too small for one block ------------------------------------------------------
def test_a_reload_of_a_kv_budget_below_one_block_says_what_the_start_says() -> None:
    with pytest.raises(ConfigError) as start:
        make_engine(kv_cache_bytes=4096)
    said = re.search(r"holds no block of \d+ bytes: raise kv_cache_bytes", str(start.value))
    assert said is not None, start.value
    engine = make_engine(kv_cache_bytes="1MiB")
    res = apply(engine, engine.reconfigure({("kv_cache_bytes",): 4096}))
    assert not res.ok and res.after == res.before
    assert res.detail == f"refused: kv_cache_bytes=4096 {said.group(0)}", res.detail


# -- the operator's commands ------------------------------------------------------------------
@pytest.mark.parametrize("command", [["audit", "list"], ["db", "upgrade"], ["db", "current"]])
def test_an_unknown_database_backend_is_one_line_exit_2(command: list[str], capsys: Any) -> None:
    """`postgres://` (SQLAlchemy says `postgresql://`) gave a NoSuchModuleError traceback."""
    assert main([*command, "--db", "postgres://kvguard@127.0.0.1/kvguard"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kvguard: error: postgres://kvguard@127.0.0.1/kvguard: unknown database backend "
        "'postgres'\n"
    )


class _NotKvguard(http.server.BaseHTTPRequestHandler):
    body = b""
    content_type = "text/html"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[http.server.HTTPServer]:
    """A server on loopback that is not kvguard (another service on the port)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _NotKvguard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(30)


@pytest.mark.parametrize(
    ("content_type", "body", "flags"),
    [
        ("text/html", b"<html>not kvguard</html>", []),
        ("text/html", b"<html>not kvguard</html>", ["--json"]),
        ("application/json", b'{"status": "ok"}', []),
        ("application/json", b'{"status": "ok"}', ["--json"]),
        ("application/json", b"[1, 2]", []),
    ],
)
def test_status_at_a_server_that_is_not_kvguard_is_one_line_exit_2(
    other_server: http.server.HTTPServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
    content_type: str,
    body: bytes,
    flags: list[str],
) -> None:
    """Before: HTML gave "Expecting value: line 1 column 1", a JSON object without kvguard's
    fields a KeyError traceback."""
    monkeypatch.setattr(_NotKvguard, "body", body)
    monkeypatch.setattr(_NotKvguard, "content_type", content_type)
    (tmp_path / "tok").write_text("tok\n")
    url = f"http://127.0.0.1:{other_server.server_address[1]}"
    argv = ["status", "--url", url, "--token-file", str(tmp_path / "tok"), *flags]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"kvguard: error: {url}/admin/state did not answer kvguard's state (is this a kvguard "
        "daemon?)\n"
    )


# -- SIGHUP at the very start of `kvguard serve` -----------------------------------------------
HOLD_IMPORT = """\
import os, sys, time

_held = []


def _hold(event, args):
    # `kvguard serve` paused as it imports its subcommands, until the test has sent SIGHUP
    if event != "import" or args[0] != "kvguard.daemon.alerts_cli" or _held:
        return
    _held.append(1)
    fd = os.open(os.environ["KVGUARD_TEST_HELD"], os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["KVGUARD_TEST_GO"]) and time.monotonic() < deadline:
        time.sleep(0.01)


sys.addaudithook(_hold)
"""


def test_a_sighup_while_serve_is_still_importing_is_ignored(tmp_path: Path) -> None:
    """`kvguard serve` held (by an import hook) at its first import after the module that
    runs it begins, gets SIGHUP there: before, it died of it (exit -SIGHUP, nothing logged),
    as any SIGHUP in its first fraction of a second did; now it is ignored and the daemon
    goes on to serve."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_IMPORT)
    held, go = tmp_path / "held", tmp_path / "go"
    env = {
        **os.environ,
        **TEST_DAEMON_ENV,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
        "KVGUARD_TEST_HELD": str(held),
        "KVGUARD_TEST_GO": str(go),
        "STATE_DIRECTORY": str(tmp_path),
    }
    log = tmp_path / "daemon.log"
    argv = [KVGUARD, "serve", "--model", "tiny", "--port", "0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        until(lambda: held.exists() or proc.poll() is not None, 60, "serve held at its imports")
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGHUP)
        go.touch()
        until(lambda: "ready:" in log.read_text() or proc.poll() is not None, 120, "serve ready")
        assert proc.poll() is None, (proc.returncode, log.read_text())
    finally:
        go.touch()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, log.read_text()
