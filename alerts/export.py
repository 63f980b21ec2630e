"""Copy the shipped Prometheus rules, their promtool tests and the Grafana dashboard out of the
installed package, so that an operator can load them without a checkout of the source tree.

The layout is kept (`kvguard.rules.yml`, `tests/*.yml`, `grafana/kvguard.json`) because the
tests name the rules file by a relative path: `promtool test rules DIR/tests/*.yml` works on
the exported copy as it does in the repository.
"""

from __future__ import annotations

import os
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

RULES = "kvguard.rules.yml"
TESTS = "tests"
DASHBOARD = "grafana/kvguard.json"
# The form every runbook_url takes in the shipped files; anchors are lower-cased alert names.
RUNBOOK_BASE = "https://github.com/kvguard/kvguard/blob/main/docs/runbooks.md"
# What the written files and the folders made for them are read by (Prometheus' user, Grafana's,
# the kvguard service's dynamic user) is never the user who ran the export: readable by all,
# whatever the umask (sudo keeps an operator's 077).
FILE_MODE = 0o644
FOLDER_MODE = 0o755


def packaged_files() -> list[tuple[str, Traversable]]:
    """(relative path, resource) for every file that `export` writes, rules first."""
    root = files("kvguard.alerts")
    tests = sorted(
        (t for t in root.joinpath(TESTS).iterdir() if t.name.endswith(".yml")),
        key=lambda t: t.name,
    )
    out = [(RULES, root.joinpath(RULES))]
    out += [(f"{TESTS}/{t.name}", t) for t in tests]
    out.append((DASHBOARD, root.joinpath(*DASHBOARD.split("/"))))
    return out


def export(dir: Path, runbook_base: str | None = None, force: bool = False) -> list[Path]:
    """Write the packaged files under `dir` and return their paths.

    `runbook_base` replaces the runbook page URL in every file (rules, the tests that expect
    those annotations, the dashboard link), for a site that hosts docs/runbooks.md elsewhere.
    A file that exists with other content is an error unless `force`: an operator's edited
    rules are not overwritten by accident. Nothing is written unless every file may be.
    """
    if runbook_base is not None and (bad := [c for c in runbook_base if c in '"\\{}' or c <= " "]):
        # it is pasted into double-quoted YAML and JSON strings, and into the rules' Go-templated
        # annotations, where "{{" opens an action promtool refuses: a URL holds none of these raw
        raise ValueError(
            f"--runbook-base {runbook_base!r} holds {bad[0]!r}: percent-encode it "
            f"(%{ord(bad[0]):02X}) as a URL must"
        )
    planned: list[tuple[Path, str]] = []
    for rel, resource in packaged_files():
        text = resource.read_text(encoding="utf-8")
        if runbook_base:
            text = text.replace(RUNBOOK_BASE, runbook_base.rstrip("/"))
        planned.append((Path(dir) / rel, text))
    return write_planned(planned, force)


def write_planned(planned: list[tuple[Path, str]], force: bool) -> list[Path]:
    """Write each (path, text), folders made as needed, and return the paths. A file that
    exists with other content is an error unless `force` (an operator's edit is not
    overwritten by accident), and then nothing is written."""
    if not force:
        clashes = [str(p) for p, text in planned if p.exists() and p.read_text() != text]
        if clashes:
            raise FileExistsError(
                f"{', '.join(clashes)} already exist(s) with other content; "
                "pass --force to overwrite"
            )
    for path, text in planned:
        make_folders(path.parent)
        is_new = not path.exists()
        path.write_text(text, encoding="utf-8")
        if is_new:  # one that was there keeps the mode its owner gave it
            os.chmod(path, FILE_MODE)
    return [p for p, _ in planned]


def make_folders(folder: Path) -> None:
    """Make `folder` and its missing parents, each FOLDER_MODE whatever the umask: under a
    umask of 077 `mkdir -p` leaves 0700 folders that hide what they hold from the user who
    reads it (a 0700 /etc/kvguard hides config.yaml and api_keys.yaml from the service, and
    systemd does not change an existing ConfigurationDirectory=). A folder that exists keeps
    its mode: its owner chose it."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for level in reversed(missing):
        try:
            level.mkdir()
        except FileExistsError:  # made meanwhile, by someone else: theirs
            continue
        os.chmod(level, FOLDER_MODE)
