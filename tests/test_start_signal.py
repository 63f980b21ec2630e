"""A SIGTERM or SIGINT anywhere in the start, before serve() takes them over, ends the start:
the process dies by the signal (143, 130) with its audit stop row. The start's handler used to
raise wherever the main thread was, and late in the start that went wrong: raised in a gc
callback (the collection of the startup freeze) the exception was printed and dropped, and the
daemon went on to serve; raised under pydantic-core (FastAPI's import, in serve()) it became a
SchemaError, exit 1 with a traceback and no stop row.

Each daemon here sends the signal to itself at that point with `signal.raise_signal`, which
runs the handler before it returns: the signal lands exactly there, every run.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from kvguard.daemon.version import kvguard_version
from tests.test_server import until

SERVE = """\
import signal, sys
SIG = signal.Signals(int(sys.argv[2]))
sent = []
def send(where):
    if not sent:
        sent.append(where)
        print(f"test: {SIG.name} sent {where}", file=sys.stderr, flush=True)
        signal.raise_signal(SIG)
"""
MAIN = """
from kvguard.daemon.cli import main
sys.exit(main(["serve", "--config", sys.argv[1]]))
"""
# in the full collection of gc_policy.freeze_startup_heap, from a gc callback, as the daemon's
# own (gc_policy.watch_pauses) is run
IN_THE_FREEZE = """
import gc
from kvguard.daemon import gc_policy
freeze = gc_policy.freeze_startup_heap
def in_the_collection(phase, info):
    if phase == "start":
        send("in a gc callback")
def freeze_with_the_signal():
    gc.callbacks.append(in_the_collection)
    try:
        return freeze()
    finally:
        gc.callbacks.remove(in_the_collection)
gc_policy.freeze_startup_heap = freeze_with_the_signal
"""
# while serve() imports the app, from inside pydantic-core as it builds a model's validator
# (it calls the repr of a Literal's value), as FastAPI's import builds its models
IN_THE_APP_IMPORT = """
import importlib.abc, importlib.util
from typing import Literal
import pydantic
class Value(str):
    def __repr__(self):
        if sys._getframe(1).f_code.co_name == "create_schema_validator":
            send("under pydantic-core")
        return str.__repr__(self)
class AtTheAppImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "kvguard.daemon.app":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            pydantic.create_model("Late", x=(Literal[Value("a")], ...))
            run(module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, AtTheAppImport())
"""
POINTS = {
    "the-freeze": (IN_THE_FREEZE, "in a gc callback"),
    "the-app-import": (IN_THE_APP_IMPORT, "under pydantic-core"),
}


@pytest.mark.parametrize(
    ("point", "sig"),
    [
        ("the-freeze", signal.SIGTERM),
        ("the-app-import", signal.SIGTERM),
        ("the-app-import", signal.SIGINT),
    ],
    ids=["freeze-SIGTERM", "app-import-SIGTERM", "app-import-SIGINT"],
)
def test_a_stop_signal_late_in_the_start_ends_it_by_the_signal(
    tmp_path: Path, point: str, sig: signal.Signals
) -> None:
    db = tmp_path / "audit.db"
    config = tmp_path / "config.yaml"
    config.write_text(
        "serving: {model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512}\n"
        "api: {host: 127.0.0.1, port: 0}\n"
        f"audit: {{url: 'sqlite:///{db}'}}\n"
    )
    hook, where = POINTS[point]
    log = tmp_path / "daemon.log"
    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path)}
    argv = [sys.executable, "-c", SERVE + hook + MAIN, str(config), str(int(sig))]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:  # it ends, or it serves (the signal was lost): either is known at once
        until(lambda: proc.poll() is not None or "ready:" in log.read_text(), 300, "the end")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
    text = log.read_text()
    assert f"test: {sig.name} sent {where}" in text, text  # the signal came where meant
    assert proc.returncode == -sig, (proc.returncode, text)
    assert f"WARNING kvguard.daemon: {sig.name}: interrupted while loading; exiting" in text, text
    assert "ready:" not in text and "Traceback" not in text, text
    assert "Exception ignored" not in text, text
    with closing(sqlite3.connect(db)) as c:
        rows = c.execute("SELECT kind, detail FROM events ORDER BY id").fetchall()
    assert rows == [
        ("daemon_start", f"kvguard {kvguard_version()}, model tiny"),
        ("daemon_stop", f"exit {128 + sig}: interrupted by {sig.name} while loading"),
    ]
