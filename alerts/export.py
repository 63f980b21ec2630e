"""Copy the shipped Prometheus rules, their promtool tests and the Grafana dashboard out of the
installed package, so that an operator can load them without a checkout of the source tree.

The layout is kept (`kvguard.rules.yml`, `tests/*.yml`, `grafana/kvguard.json`) because the
tests name the rules file by a relative path: `promtool test rules DIR/tests/*.yml` works on
the exported copy as it does in the repository.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

RULES = "kvguard.rules.yml"
TESTS = "tests"
DASHBOARD = "grafana/kvguard.json"
# The form every runbook_url takes in the shipped files; anchors are lower-cased alert names.
RUNBOOK_BASE = "https://github.com/kvguard/kvguard/blob/main/docs/runbooks.md"


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
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return [p for p, _ in planned]
