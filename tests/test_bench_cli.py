"""`kvguard bench` hands the benchmark script exactly the options the user set."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.daemon.bench_cli import script_argv
from kvguard.daemon.cli import build_parser


def test_only_what_was_set_is_passed_on() -> None:
    args = build_parser().parse_args(
        ["bench", "overload", "--burst-rps", "8", "--only", "kvguard", "--only", "no-control"]
    )
    assert script_argv(args) == ["--burst-rps", "8", "--only", "kvguard", "--only", "no-control"]
    args = build_parser().parse_args(["bench", "overload", "--quick", "--trace", "adversarial"])
    assert script_argv(args) == ["--quick", "--trace", "adversarial"]


def test_the_overload_script_reads_what_is_passed_on() -> None:
    from bench.overload import parse_args

    args = parse_args(["--burst-rps", "8", "--only", "kvguard"])
    assert args.burst_rps == 8.0 and args.only == ["kvguard"]
    assert parse_args([]).burst_rps is None  # the trace's own rate


def test_the_transformers_peer_config_takes_either_page_field() -> None:
    """transformers renamed ContinuousBatchingConfig's `block_size` to `page_size` after 5.17
    (the GPU device's release): the peer sets whichever field this transformers has."""
    from dataclasses import dataclass

    from bench.throughput import cb_config

    @dataclass
    class Older:
        block_size: int = 256
        num_blocks: int | None = None

    @dataclass
    class Newer:
        page_size: int = 256
        num_blocks: int | None = None

    old, new = cb_config(Older, 16, num_blocks=9), cb_config(Newer, 16, num_blocks=9)
    assert (old.block_size, old.num_blocks) == (16, 9)
    assert (new.page_size, new.num_blocks) == (16, 9)


def test_a_checkout_without_the_benchmark_names_its_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvguard bench chaos --repo DIR` without bench/chaos.py there names chaos.py (it named
    overload.py, the other benchmark), also where DIR holds the other one."""
    from kvguard.daemon.cli import main

    for holds in ((), ("overload.py",)):
        repo = tmp_path / f"holds-{len(holds)}"
        (repo / "bench").mkdir(parents=True)
        for name in holds:
            (repo / "bench" / name).write_text("raise SystemExit(0)\n")
        assert main(["bench", "chaos", "--repo", str(repo)]) == 2
        err = capsys.readouterr().err
        assert f"not a kvguard checkout ({repo / 'bench' / 'chaos.py'} not found)" in err, err


@pytest.mark.parametrize(
    ("bench", "args", "says"),
    [
        ("chaos", ["--model", "tiny", "--threads", "0"], "chaos: error: daemon exited 2 ("),
        ("chaos", ["--model", "/nonexist"], "chaos: error: unknown model '/nonexist'"),
        ("overload", ["--model", "tiny", "--threads", "0"], "overload: error: daemon exited 2 ("),
        ("overload", ["--model", "/nonexist"], "overload: error: unknown model '/nonexist'"),
    ],
)
def test_a_benchmark_that_cannot_start_says_why_and_leaves_nothing_running(
    tmp_path: Path, bench: str, args: list[str], says: str
) -> None:
    """A model that does not resolve, or a daemon that exits at once, ended a benchmark in a
    traceback, and the chaos run's Prometheus, started first, was left running orphaned."""
    import subprocess
    import sys

    workdir = tmp_path / "work"
    cli = Path(sys.executable).with_name("kvguard")
    run = subprocess.run(
        [str(cli), "bench", bench, "--quick", "--workdir", str(workdir), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert says in run.stderr and "Traceback" not in run.stderr, run.stderr
    if "threads" in args:
        assert "serving.num_threads: 0 is out of range" in run.stderr, run.stderr
    left = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True)
    assert left.stdout == "", f"still running: {left.stdout}"
