"""`kvguard keys add` and `keys remove` run at once on one keys file (two operators, config
management adding tenants in parallel): every add that prints a key has its digest in the
file, every remove that says "removed" leaves the key out, and none fails for the other.

Each command is a real `kvguard keys` process. All of them import kvguard first, then wait on
one pipe the test closes once every one is ready, so they edit the file at the same moment
(start-up time would otherwise spread them apart); the checks are on the file once all exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvguard.daemon.api_keys import add_key, digest, read_entries

# waits for the start signal (EOF on fd GO) after telling READY, then runs `kvguard ARGS...`
CHILD = """
import os, sys
from kvguard.daemon.cli import main
import kvguard.daemon.api_keys  # loaded before the start: the edits, not imports, race
go, ready = int(sys.argv[1]), int(sys.argv[2])
os.write(ready, b"."); os.close(ready)
os.read(go, 1); os.close(go)
sys.exit(main(sys.argv[3:]))
"""


def run_together(commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Run each `kvguard` command line in its own process, all let go at once."""
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(go_r), str(ready_w), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=(go_r, ready_w),
        )
        for argv in commands
    ]
    os.close(go_r)
    os.close(ready_w)
    got = b""
    while len(got) < len(procs):  # every child ready (or dead: EOF ends the wait)
        chunk = os.read(ready_r, len(procs))
        if not chunk:
            break
        got += chunk
    os.close(ready_r)
    os.close(go_w)  # the start: every child's read of GO returns
    done = []
    for p, argv in zip(procs, commands, strict=True):
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
    return done


def in_file(path: Path) -> dict[str, str]:
    """The file's entries: name to digest."""
    return {e.name: e.sha256 for e in read_entries(path)[0]}


def failures(done: list[subprocess.CompletedProcess[str]]) -> list[str]:
    return [f"{' '.join(p.args[-2:])}: rc {p.returncode}: {p.stderr}" for p in done if p.returncode]


def test_parallel_adds_each_leave_their_printed_key_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "api_keys.yaml"
    add_key(path, "seed", "normal", None)
    names = [f"tenant{i}" for i in range(12)]
    done = run_together([["keys", "--file", str(path), "add", name] for name in names])
    assert not failures(done), failures(done)
    entries = in_file(path)
    lost = [
        name
        for name, p in zip(names, done, strict=True)
        if entries.get(name) != digest(p.stdout.strip())
    ]
    assert not lost, f"printed a key that is not in the file: {lost}; file has {sorted(entries)}"
    assert sorted(entries) == sorted(["seed", *names])
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".api_keys.yaml.lock", "api_keys.yaml"]


def test_a_revoked_key_stays_out_when_adds_run_beside_the_remove(tmp_path: Path) -> None:
    path = tmp_path / "api_keys.yaml"
    add_key(path, "leaked", "normal", None)
    add_key(path, "kept", "normal", None)
    names = [f"tenant{i}" for i in range(8)]
    remove = [["keys", "--file", str(path), "remove", "leaked"]]
    done = run_together(remove + [["keys", "--file", str(path), "add", name] for name in names])
    entries = in_file(path)
    assert "leaked" not in entries, f"the revoked key is back: {sorted(entries)}"
    assert not failures(done), failures(done)
    assert "removed 'leaked'" in done[0].stderr
    assert sorted(entries) == sorted(["kept", *names])
