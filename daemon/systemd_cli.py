"""`kvguard systemd export`: the shipped systemd units and the config file kvguard.service starts
with, written out of the installed package (a `pip install kvguard` has no daemon/systemd/ to copy
from), with ExecStart= naming this installation's `kvguard` script."""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from importlib.resources import files
from pathlib import Path

from kvguard.alerts.export import write_planned

UNITS = ("kvguard.service", "kvguard-worker@.service")
CONFIG = "etc/kvguard/config.yaml"
# Where the shipped units expect the script (a root `pip install` with the system python, or
# `pipx install --global`); the export puts this installation's in its place.
SHIPPED_SCRIPT = "/usr/local/bin/kvguard"
SHIPPED_EXEC = f"ExecStart={SHIPPED_SCRIPT} "
# Both units set ProtectHome=yes and PrivateTmp=yes: the service cannot see a file under these.
HIDDEN_FROM_SERVICE = {
    "/home": "ProtectHome=yes",
    "/root": "ProtectHome=yes",
    "/run/user": "ProtectHome=yes",
    "/tmp": "PrivateTmp=yes",
    "/var/tmp": "PrivateTmp=yes",
}
# What to do about each file the service runs that it cannot see.
MOVE_SCRIPT = "install kvguard elsewhere, e.g. in a venv at /opt/kvguard"
MOVE_PYTHON = (
    "make the venv from a Python the service can see (e.g. `sudo /usr/bin/python3 -m venv "
    "/opt/kvguard`) and install kvguard there"
)
MOVE_PACKAGE = (
    "install kvguard where the service can see it, e.g. in a venv at /opt/kvguard, as a copy "
    "(`pip install .`, not an editable `pip install -e` of a checkout in a home directory)"
)


def add_systemd_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    systemd = sub.add_parser(
        "systemd",
        help="export the shipped systemd units and their config file",
        description="kvguard.service (the daemon), kvguard-worker@.service (a remote rank) and "
        "the config file kvguard.service starts with, as shipped in the package.",
    )
    cmds = systemd.add_subparsers(dest="systemd_command", metavar="{export}", required=True)
    p = cmds.add_parser(
        "export",
        help="write the units and the config file to a directory",
        description="Write kvguard.service, kvguard-worker@.service and etc/kvguard/config.yaml "
        f"under DIR and print their paths. The shipped units run {SHIPPED_SCRIPT}; the written "
        "ones run this installation's kvguard script (or --kvguard's) instead, and are "
        "otherwise the shipped files.",
        epilog="then: sudo install -D -m 0644 DIR/kvguard.service /etc/systemd/system/"
        "kvguard.service, the same for DIR/etc/kvguard/config.yaml to /etc/kvguard/config.yaml",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("kvguard-systemd"),
        help="target directory, created if missing (default: %(default)s)",
    )
    p.add_argument(
        "--kvguard",
        metavar="PATH",
        help="the kvguard script ExecStart= runs (default: this installation's, "
        "e.g. /opt/kvguard/bin/kvguard in a venv at /opt/kvguard)",
    )
    p.add_argument(
        "--force", action="store_true", help="overwrite files that exist with other content"
    )
    p.set_defaults(func=cmd_systemd_export)


def cmd_systemd_export(args: argparse.Namespace) -> int:
    script = Path(os.path.abspath(args.kvguard)) if args.kvguard else installed_script()
    if not (script.is_file() and os.access(script, os.X_OK)):
        raise ValueError(f"--kvguard {script}: not an executable file")
    for warning in hidden_from_service(script, ours=args.kvguard is None):
        print(f"kvguard: warning: {warning}", file=sys.stderr)
    paths = export(args.dir, script, force=args.force)
    for path in paths:
        print(path)
    unit, config = args.dir / UNITS[0], args.dir / CONFIG
    print(
        f"\ninstall: sudo install -D -m 0644 {unit} /etc/systemd/system/{UNITS[0]}"
        f"\n         sudo install -D -m 0644 {config} /etc/kvguard/config.yaml"
        f"\nstart:   sudo systemctl daemon-reload && sudo systemctl enable --now kvguard"
    )
    return 0


def installed_script() -> Path:
    """The `kvguard` console script of the installation this process runs from: the one that
    was run, else the one beside the interpreter (a venv's bin/), else the interpreter's scripts
    directory (/usr/local/bin for Debian's system python). Links are followed, so the unit does
    not depend on a link made for the operator's PATH (/usr/local/bin/kvguard to a venv's)."""
    run = Path(sys.argv[0])
    if run.name == "kvguard" and run.is_file():
        return run.resolve()
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        script = folder / "kvguard"
        if script.is_file() and os.access(script, os.X_OK):
            return script.resolve()
    raise FileNotFoundError(
        f"no kvguard script beside {sys.executable} or in {sysconfig.get_path('scripts')} "
        "(kvguard is not installed there?): name it with --kvguard PATH"
    )


def hidden_from_service(script: Path, ours: bool) -> list[str]:
    """One line for each file the service needs to run `script` that the units hide from it,
    naming the file and the setting that hides it. The script is not the only one: a venv's
    bin/python is a link to the Python it was made from (pyenv's, under /root or /home), and
    an editable install imports kvguard from its checkout; under the unit either fails every
    start (203/EXEC, or an ImportError) after an export that said nothing. A file inside one
    already named, or holding it, is not named again."""
    named: list[Path] = []
    lines = []
    for what, path, fix in service_needs(script, ours):
        setting = hiding_setting(path)
        if setting is None or any(path.is_relative_to(p) or p.is_relative_to(path) for p in named):
            continue
        named.append(path)
        lines.append(f"{path} ({what}) is hidden from the service (the units set {setting}): {fix}")
    return lines


def service_needs(script: Path, ours: bool) -> list[tuple[str, Path, str]]:
    """(what, path, how to fix it if hidden) for the files `script` runs on: the script, the
    Python its first line names (links followed: the file that is run) and, where the script
    belongs to this process's installation, that Python's installation and the kvguard
    package this process imported. `ours`: it does (no --kvguard), whatever its first line
    says; else it does where that line names a Python of this installation (sys.prefix: the
    venv). Another installation's package is not known here."""
    needs = [("the kvguard script", script, MOVE_SCRIPT)]
    python = script_interpreter(script)
    ours = ours or (python is not None and python.is_relative_to(sys.prefix))
    if python is None and ours:
        python = Path(sys.executable)
    if python is None:
        return needs
    needs.append(("the Python the script runs", python.resolve(), MOVE_PYTHON))
    if ours:
        needs.append(("that Python's installation", Path(sys.base_prefix).resolve(), MOVE_PYTHON))
        package = Path(__file__).resolve().parents[1]  # kvguard/, or an editable install's checkout
        needs.append(("the kvguard package it imports", package, MOVE_PACKAGE))
    return needs


def script_interpreter(script: Path) -> Path | None:
    """The Python a console script runs: its `#!` line, or the path pip writes on the second
    line when the first is `#!/bin/sh` (an interpreter path too long for `#!`, or with a
    blank in it); None for `#!/usr/bin/env python3` or anything else that names no file."""
    try:
        with script.open("rb") as f:
            head = f.read(4096).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    trampoline = "'''exec' \""
    if head[:1] == ["#!/bin/sh"] and len(head) > 1 and head[1].startswith(trampoline):
        word = head[1].removeprefix(trampoline).partition('"')[0]
    elif head and head[0].startswith("#!"):
        word = head[0].removeprefix("#!").strip().partition(" ")[0]
    else:
        return None
    return Path(word) if word.startswith("/") and Path(word).name != "env" else None


def hiding_setting(path: Path) -> str | None:
    """The unit setting that hides `path` from the service, or None where the service sees it."""
    return next(
        (setting for top, setting in HIDDEN_FROM_SERVICE.items() if path.is_relative_to(top)),
        None,
    )


def exec_path(script: Path) -> str:
    """`script` as the first word of an ExecStart= line: systemd expands % specifiers in it and
    splits the line at blanks, so % is doubled and a path with a blank quoted; it refuses an
    executable whose name holds a quote, a backslash or a control character."""
    text = str(script)
    if bad := [c for c in text if c in "\"'\\" or not c.isprintable()]:
        raise ValueError(
            f"{text!r}: systemd refuses an executable path holding {bad[0]!r}; link the "
            "script from a plainer path and name that with --kvguard"
        )
    word = text.replace("%", "%%")
    return f'"{word}"' if any(c.isspace() for c in word) else word


def export(dir: Path, script: Path, force: bool = False) -> list[Path]:
    """Write the units and the config file under `dir` (the layout of daemon/systemd/) with
    ExecStart= running `script`, and return their paths. A file that exists with other content
    is an error unless `force`: an operator's edited unit is not overwritten by accident.
    Nothing is written unless every file may be."""
    root = files("kvguard.daemon").joinpath("systemd")
    planned: list[tuple[Path, str]] = []
    for name in UNITS:
        text = root.joinpath(name).read_text(encoding="utf-8")
        if text.count(SHIPPED_EXEC) != 1:  # the packaged unit is not the one this was written for
            raise ValueError(f"packaged {name}: expected one line starting {SHIPPED_EXEC!r}")
        planned.append((dir / name, text.replace(SHIPPED_EXEC, f"ExecStart={exec_path(script)} ")))
    config = root.joinpath(*CONFIG.split("/")).read_text(encoding="utf-8")
    planned.append((dir / CONFIG, config))
    return write_planned(planned, force)
