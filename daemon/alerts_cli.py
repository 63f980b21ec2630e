"""`kvguard alerts export`: the shipped Prometheus rules, promtool tests and Grafana dashboard,
written out of the installed package for an operator to load into Prometheus and Grafana."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_alerts_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    alerts = sub.add_parser(
        "alerts",
        help="export the shipped Prometheus alert rules and Grafana dashboard",
        description="Prometheus recording and alerting rules for kvguard, their promtool unit "
        "tests and a Grafana dashboard, as shipped in the package.",
    )
    cmds = alerts.add_subparsers(dest="alerts_command", metavar="{export}", required=True)
    p = cmds.add_parser(
        "export",
        help="write the rules, their tests and the dashboard to a directory",
        description="Write kvguard.rules.yml, tests/*.yml and grafana/kvguard.json under DIR "
        "and print their paths.",
        epilog="then: promtool test rules DIR/tests/*.yml, add DIR/kvguard.rules.yml to "
        "Prometheus' rule_files and import DIR/grafana/kvguard.json into Grafana",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("kvguard-alerts"),
        help="target directory, created if missing (default: %(default)s)",
    )
    p.add_argument(
        "--runbook-base",
        metavar="URL",
        help="where your copy of docs/runbooks.md lives; rewrites every runbook_url "
        "(default: the kvguard repository on GitHub)",
    )
    p.add_argument(
        "--force", action="store_true", help="overwrite files that exist with other content"
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of the written paths")
    p.set_defaults(func=cmd_alerts_export)


def cmd_alerts_export(args: argparse.Namespace) -> int:
    from kvguard.alerts.export import RULES, export

    if args.runbook_base is not None and not args.runbook_base.startswith(("http://", "https://")):
        raise ValueError(f"--runbook-base must be an http(s) URL, not {args.runbook_base!r}")
    paths = export(args.dir, runbook_base=args.runbook_base, force=args.force)
    if args.json:
        print(json.dumps([str(p) for p in paths], indent=2))
        return 0
    for path in paths:
        print(path)
    rules = args.dir / RULES
    print(
        f"\ncheck:  promtool check rules {rules} && promtool test rules {args.dir}/tests/*.yml"
        f"\nload:   add {rules.resolve()} to rule_files in prometheus.yml, then reload Prometheus"
        f"\nimport: {args.dir / 'grafana' / 'kvguard.json'} in Grafana (Dashboards > Import)"
    )
    return 0
