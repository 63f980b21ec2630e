"""`kvguard rules check FILE` and `kvguard rules test FILE SCENARIO...`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_rules_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "rules",
        help="validate degradation rules and unit-test them offline",
        description="Check a rules file, or replay scenarios through the real evaluator "
        "on a fake clock (like `promtool test rules`).",
    )
    acts = p.add_subparsers(dest="rules_command", metavar="{check,test}", required=True)
    chk = acts.add_parser("check", help="validate a rules file; exit 1 listing every error")
    chk.add_argument(
        "file", type=Path, nargs="?", help="rules YAML (default: the packaged default rules)"
    )
    chk.add_argument("--json", action="store_true", help="print the result as JSON")
    chk.set_defaults(func=cmd_check)
    tst = acts.add_parser(
        "test", help="replay scenarios and assert which actions fire and undo when"
    )
    tst.add_argument("file", type=Path, help="rules YAML")
    tst.add_argument(
        "scenarios", type=Path, nargs="+", metavar="SCENARIO", help="scenario YAML file(s)"
    )
    tst.add_argument("--json", action="store_true", help="print decisions and failures as JSON")
    tst.set_defaults(func=cmd_test)


def _load(path: Path | None, warnings: list[str] | None = None):  # noqa: ANN202
    from kvguard.rules.schema import default_rules_path, load_rules

    return load_rules(path or default_rules_path(), warnings)


def cmd_check(args: argparse.Namespace) -> int:
    from kvguard.rules.schema import RulesFileError, default_rules_path

    path = args.file or default_rules_path()
    warnings: list[str] = []
    try:
        rs = _load(args.file, warnings)
    except RulesFileError as e:
        if args.json:
            print(json.dumps({"file": str(path), "ok": False, "errors": e.errors}, indent=2))
        else:
            for line in e.errors:
                print(line, file=sys.stderr)
            print(f"{path}: {len(e.errors)} error(s)", file=sys.stderr)
        return 1
    if args.json:
        result = {"file": str(path), "ok": True, "rules": [r.name for r in rs.rules]}
        print(json.dumps({**result, "warnings": warnings}, indent=2))
    else:
        for line in warnings:  # legal (exit 0), but likely a mistake: said beside the OK
            print(line, file=sys.stderr)
        print(
            f"{path}: OK ({len(rs.rules)} rules, {len(rs.signals)} signals, every {rs.interval:g}s)"
            + (f", {len(warnings)} warning(s)" if warnings else "")
        )
    return 0


def cmd_test(args: argparse.Namespace) -> int:
    from kvguard.rules.scenario import load_scenario, run_scenario
    from kvguard.rules.schema import RulesFileError

    warnings: list[str] = []
    try:
        rs = _load(args.file, warnings)
    except RulesFileError as e:
        print("\n".join(e.errors), file=sys.stderr)
        return 1
    for line in warnings:
        print(line, file=sys.stderr)
    failed = 0
    report = []
    try:
        scenarios = [(p, load_scenario(p, rs)) for p in args.scenarios]
    except RulesFileError as e:
        print("\n".join(e.errors), file=sys.stderr)
        return 1
    for sc_path, sc in scenarios:
        out = run_scenario(rs, sc)
        failed += not out.ok
        report.append(
            {
                "scenario": str(sc_path),
                "ok": out.ok,
                "failures": out.failures,
                "decisions": [
                    {
                        "at": d.time,
                        "rule": d.rule,
                        "action": d.action,
                        "undo": d.undo,
                        "outcome": d.outcome,
                    }
                    for d in out.decisions
                ],
            }
        )
        if not args.json:
            _print(sc_path, out)
    if args.json:
        print(json.dumps(report, indent=2))
    return 1 if failed else 0


def _print(path: Path, out) -> None:  # noqa: ANN001
    print(f"{path}: {'PASS' if out.ok else 'FAIL'}")
    for d in out.decisions:
        kind = "undo" if d.undo else "act "
        print(f"  {d.time:>8.1f}s  {kind}  {d.rule:<20} {d.action:<24} {d.outcome}")
    for f in out.failures:
        print(f"  FAIL: {f}")
