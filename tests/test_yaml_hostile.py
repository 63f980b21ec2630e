"""Hostile and mistaken files, read by the one YAML loader that the daemon config and the rules
file share: each must become one `FILE:LINE: problem` line, at once, never a traceback, a hang
or gigabytes of memory. Fixed examples, each written the way an attacker or a tired operator
would write it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvguard.daemon import config as daemon_config
from kvguard.daemon.config import ConfigFileError, load_config
from kvguard.rules import schema
from kvguard.rules.schema import RulesFileError, load_rules, load_rules_text

SIGNAL = "signals: {kv: {local: kv_cache_usage_ratio}}\n"


def billion_laughs() -> str:
    """Nine levels of nine aliases: about 300 bytes that expand to 9**9 values."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    return "\n".join(lines) + "\n"


DEEP_LISTS = "version: 1\nx: " + "[" * 5000 + "]" * 5000 + "\n"
DEEP_MAPPINGS = "version: 1\nx: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n"
PYTHON_TAG = "!!python/object/apply:os.system ['echo pwned']"
NOT_PLAIN = "is not allowed (expected plain YAML"

# (id, file text, line of the error, what the message must say)
RULES_CASES: list[tuple[str, str | bytes, int, str]] = [
    (
        "duplicate interval",
        "version: 1\ninterval: 5s\ninterval: 0.001\n",
        3,
        "interval: duplicate key (expected once; first given on line 2)",
    ),
    (
        "duplicate threshold",
        SIGNAL + "rules:\n  - name: a\n    signal: kv\n    above: 0.9\n"
        "    above: 0.1\n    action: halt_admission\n",
        6,
        "rules.0.above: duplicate key (expected once; first given on line 5)",
    ),
    ("python tag", f"version: 1\ninterval: {PYTHON_TAG}\n", 2, "tag !!python/object/apply"),
    ("local tag", "version: 1\ninterval: !seconds 5\n", 2, f"tag '!seconds' {NOT_PLAIN}"),
    ("deep lists", DEEP_LISTS, 2, "nested more than 64 levels deep"),
    ("deep mappings", DEEP_MAPPINGS, 2, "nested more than 64 levels deep"),
    (
        "invalid utf-8",
        b"version: 1\n# caf\xe9\ninterval: 5s\n",
        2,
        "byte 0xe9 at column 6 is not UTF-8",
    ),
    ("control character", "version: 1\ninterval: 5s\x07\n", 2, "character #x0007 is not allowed"),
    ("interval .inf", "version: 1\ninterval: .inf\n", 2, "interval: inf is not finite"),
    ("interval .nan", "version: 1\ninterval: .nan\n", 2, "interval: nan is not finite"),
    ("cooldown .inf", "version: 1\ncooldown: .inf\n", 2, "cooldown: inf is not finite"),
    (
        "interval beyond a century",
        "version: 1\ninterval: 36501d\n",
        2,
        "interval: '36501d' is too long (expected at most 100 years",
    ),
    (
        "for .inf",
        SIGNAL
        + "rules:\n  - {name: a, signal: kv, above: 0.9, for: .inf, action: halt_admission}\n",
        3,
        "rules.0.for: inf is not finite",
    ),
    (
        "recover_for .nan",
        SIGNAL + "rules:\n  - {name: a, signal: kv, above: 0.9, action: reduce_batch,\n"
        "     recover_below: 0.5, recover_for: .nan, undo: restore_batch}\n",
        4,
        "rules.0.recover_for: nan is not finite",
    ),
    (
        "rule cooldown .inf",
        SIGNAL
        + "rules:\n  - {name: a, signal: kv, above: 0.9, cooldown: .inf, action: halt_admission}\n",
        3,
        "rules.0.cooldown: inf is not finite",
    ),
    (
        "above .nan",
        SIGNAL + "rules:\n  - {name: a, signal: kv, above: .nan, action: halt_admission}\n",
        3,
        "rules.0.above: Input should be a finite number",
    ),
    (
        "recover_above .inf",
        SIGNAL + "rules:\n  - {name: a, signal: kv, below: 0.1, action: halt_admission,\n"
        "     recover_above: .inf, undo: resume_admission}\n",
        4,
        "rules.0.recover_above: Input should be a finite number",
    ),
    ("billion laughs", billion_laughs(), 5, "more than 50000 values after expanding aliases"),
    (
        "too many aliases",
        "a: &a 1\nversion: 1\nb: [" + ", ".join(["*a"] * 101) + "]\n",
        3,
        "more than 100 aliases",
    ),
    ("alias cycle", "version: 1\nx: &x [1, *x]\n", 2, "alias *x refers to a node that contains it"),
    ("huge integer", "version: 1\ninterval: " + "9" * 5000 + "\n", 2, "is not a valid !!int"),
]

CONFIG_CASES: list[tuple[str, str | bytes, int, str]] = [
    (
        "duplicate duration",
        "monitoring:\n  nvml_poll_interval: 5s\n  nvml_poll_interval: 0.001\n",
        3,
        "monitoring.nvml_poll_interval: duplicate key (expected once; first given on line 2)",
    ),
    ("python tag", f"api:\n  drain_timeout: {PYTHON_TAG}\n", 2, "tag !!python/object/apply"),
    ("deep lists", "serving: " + "[" * 5000 + "]" * 5000 + "\n", 1, "nested more than 64 levels"),
    ("deep mappings", "x: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n", 1, "nested more than 64"),
    ("invalid utf-8", b"api:\n  host: caf\xc3\n", 2, "byte 0xc3 at column 12 is not UTF-8"),
    (
        "drain_timeout .inf",
        "api:\n  drain_timeout: .inf\n",
        2,
        "api.drain_timeout: inf is not finite",
    ),
    (
        "nvml_poll_interval .nan",
        "monitoring: {nvml_poll_interval: .nan}\n",
        1,
        "monitoring.nvml_poll_interval: nan is not finite",
    ),
    (
        "retention beyond a century",
        "audit:\n  retention: 99999999999999999999999d\n",
        2,
        "audit.retention: '99999999999999999999999d' is too long",
    ),
    (
        "safety_factor .inf",
        "admission_control:\n  safety_factor: .inf\n",
        2,
        "admission_control.safety_factor: input should be a finite number",
    ),
    ("billion laughs", billion_laughs(), 5, "more than 50000 values after expanding aliases"),
    (
        "yes is not a boolean",
        "rules:\n  dry_run: yes\n",
        2,
        "rules.dry_run: a string 'yes' (expected true or false)",
    ),
]


def _write(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "file.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _one_error(load: Callable[[Path], object], error: type[ValueError], path: Path) -> str:
    with pytest.raises(error) as info:
        load(path)
    errors = info.value.errors  # type: ignore[attr-defined]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    return errors[0]


@pytest.mark.parametrize(
    ("content", "line", "says"), [c[1:] for c in RULES_CASES], ids=[c[0] for c in RULES_CASES]
)
def test_hostile_rules_file_is_one_located_error(
    tmp_path: Path, content: str | bytes, line: int, says: str
) -> None:
    path = _write(tmp_path, content)
    message = _one_error(load_rules, RulesFileError, path)
    assert message.startswith(f"{path}:{line}: "), message
    assert says in message, message


@pytest.mark.parametrize(
    ("content", "line", "says"), [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES]
)
def test_hostile_config_file_is_one_located_error(
    tmp_path: Path, content: str | bytes, line: int, says: str
) -> None:
    path = _write(tmp_path, content)
    message = _one_error(load_config, ConfigFileError, path)
    assert message.startswith(f"{path}:{line}: "), message
    assert says in message, message


def test_the_bomb_fails_fast_in_a_small_process(tmp_path: Path) -> None:
    """Bounded memory, shown the blunt way: both loaders refuse the bomb inside a process that
    may not grow past 1 GiB of address space (the old loaders took 2.5 GB before failing)."""
    path = _write(tmp_path, billion_laughs())
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from kvguard.daemon.config import ConfigFileError, load_config\n"
        "from kvguard.rules.schema import RulesFileError, load_rules\n"
        "for load, error in ((load_rules, RulesFileError), (load_config, ConfigFileError)):\n"
        "    try:\n"
        "        load(sys.argv[1])\n"
        "    except error as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(f"{path}:5: more than 50000 values after expanding aliases") == 2, (
        out.stdout
    )


def test_a_duplicate_key_is_named_in_every_mapping_once() -> None:
    """Both duplicates are listed; an alias to a mapping is not checked (or indexed) twice."""
    text = "version: 1\ninterval: 5s\ncooldown: 1s\ninterval: 6s\ncooldown: 2s\n"
    with pytest.raises(RulesFileError) as info:
        load_rules_text(text, "r.yaml")
    assert info.value.errors == [
        "r.yaml:4: interval: duplicate key (expected once; first given on line 2)",
        "r.yaml:5: cooldown: duplicate key (expected once; first given on line 3)",
    ]


def test_merge_keys_may_override_what_they_merge() -> None:
    """`<<: *defaults` then a key of its own is YAML's override, not a duplicate."""
    rules = load_rules_text(
        SIGNAL + "rules:\n  - &base {name: a, signal: kv, above: 0.9, action: halt_admission}\n"
        "  - {<<: *base, name: b, above: 0.95}\n",
        "r.yaml",
    ).rules
    assert [(r.name, r.above, r.action) for r in rules] == [
        ("a", 0.9, "halt_admission"),
        ("b", 0.95, "halt_admission"),
    ]


def test_yaml_1_2_booleans_in_both_files(tmp_path: Path) -> None:
    """Only true/false are booleans: the rules key `on:` stays a key, `yes` stays a string."""
    rs = load_rules_text("rules:\n  - {name: oom, on: engine_oom, action: handle_oom}\n", "r.yaml")
    assert rs.rules[0].on == "engine_oom"
    cfg = load_config(
        _write(tmp_path, "rules:\n  dry_run: true\noffloading:\n  enable_cpu_offload: False\n")
    )
    assert cfg.rules.dry_run is True and cfg.offloading.enable_cpu_offload is False


def test_one_duration_grammar_for_both_files(tmp_path: Path) -> None:
    assert schema.parse_duration is daemon_config.parse_duration
    rs = load_rules_text(
        SIGNAL + "interval: 1m30s\ncooldown: 1w\nrules:\n"
        "  - {name: a, signal: kv, above: 0.9, for: 1h30m, action: halt_admission}\n",
        "r.yaml",
    )
    assert (rs.interval, rs.cooldown, rs.rules[0].for_) == (90.0, 604800.0, 5400.0)
    cfg = load_config(_write(tmp_path, "api: {drain_timeout: 1m30s}\naudit: {retention: 1w}\n"))
    assert (cfg.api.drain_timeout, cfg.audit.retention) == (90.0, 604800.0)
    for bad in ("30m1h", "5m5m", "-5s", "1e3", "5 minutes"):
        with pytest.raises(ValueError, match="is not a duration"):
            schema.parse_duration(bad)
