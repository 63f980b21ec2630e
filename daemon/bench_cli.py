"""`kvguard bench overload|chaos`: the serving benchmarks, run from a repository checkout.

The benchmarks live in `bench/` next to the package sources, not inside the wheel (they start
daemons, Prometheus and load generators, and they are for developers), so this command finds
the checkout and runs the script in a subprocess with the same Python: the benchmark then owns
its process, signals and exit status exactly as when it is run by hand. It runs in the caller's
working directory, so relative paths (--json, --png, --workdir, a model directory, and the
script's own default overload.png) mean what they mean at the caller's prompt.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = {
    "overload": "open-loop burst against kvguard, kvguard without its control plane, and "
    "max-length preallocation; table, JSON and PNG timeline",
    "chaos": "faults during a loaded run: Prometheus down, audit DB unwritable, engine OOM, the KV "
    "pool shrunk and restored, SIGHUP with a broken and a good rules file, client disconnects, "
    "SIGTERM",
}


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="run a serving benchmark from the repository checkout",
        description="Run bench/overload.py or bench/chaos.py from the kvguard checkout.",
    )
    cmds = bench.add_subparsers(dest="bench_command", metavar="{overload,chaos}", required=True)
    for name, help_text in BENCHMARKS.items():
        p = cmds.add_parser(name, help=help_text, description=help_text)
        _script_options(p, overload=name == "overload")
        p.add_argument(
            "--repo", type=Path, metavar="DIR", help="the kvguard checkout (default: found)"
        )
        p.set_defaults(func=cmd_bench)


def _script_options(p: argparse.ArgumentParser, overload: bool) -> None:
    """The scripts' own options, declared here too so --help shows them; they are passed on."""
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--model", help="model name or directory (default smollm2-135m)")
    p.add_argument("--threads", metavar="N", help="engine threads (default 2)")
    p.add_argument("--workdir", metavar="DIR", help="keep configs, logs and audit DBs here")
    if overload:
        p.add_argument("--png", metavar="FILE", help="timeline plot (default overload.png)")
        p.add_argument("--seed", metavar="N", help="trace seed (default 0)")
        p.add_argument("--only", action="append", metavar="CONFIG", help="run only CONFIG")
        p.add_argument(
            "--trace",
            choices=("realistic", "adversarial"),
            help="realistic (default): answers end before max_tokens; adversarial: all run to it",
        )
        p.add_argument("--burst-rps", metavar="R", help="the burst's arrival rate (default 32/s)")


def script_argv(args: argparse.Namespace) -> list[str]:
    """Back to command-line form: only what the user set, so the script's defaults hold."""
    argv = ["--quick"] if args.quick else []
    for opt in ("json", "model", "threads", "workdir", "png", "seed", "trace", "burst_rps"):
        value = getattr(args, opt, None)
        if value is not None:
            argv += [f"--{opt.replace('_', '-')}", str(value)]
    for only in getattr(args, "only", None) or []:
        argv += ["--only", only]
    return argv


def find_checkout(explicit: Path | None, bench: str = "overload") -> Path:
    """The checkout holding bench/<bench>.py (absolute): --repo, else $KVGUARD_REPO, else this
    file's tree or the cwd. A checkout named by --repo or $KVGUARD_REPO is the one used or an
    error naming the script it lacks: never another one found instead of it."""
    script = Path("bench") / f"{bench}.py"
    env = os.environ.get("KVGUARD_REPO")
    named = ("--repo", explicit) if explicit is not None else ("$KVGUARD_REPO", env)
    if named[1]:
        repo = Path(named[1]).resolve()  # against the caller's cwd
        if not (repo / script).is_file():
            raise ValueError(
                f"{named[0]} {named[1]}: not a kvguard checkout ({repo / script} not found)"
            )
        return repo
    for cand in (Path(__file__).resolve().parents[1], Path.cwd().resolve()):
        if (cand / script).is_file():
            return cand
    raise ValueError(
        "no kvguard checkout with bench/ found: run from the repository, or pass --repo DIR "
        "(or set KVGUARD_REPO); the benchmarks are not part of the installed package"
    )


def cmd_bench(args: argparse.Namespace) -> int:
    repo = find_checkout(args.repo, args.bench_command)
    script = repo / "bench" / f"{args.bench_command}.py"
    # the caller's cwd: the script finds the checkout from its own path, and relative paths
    # given here (or its own defaults) must not land inside the checkout
    return subprocess.call([sys.executable, str(script), *script_argv(args)])
