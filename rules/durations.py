"""The one duration grammar of kvguard's files (daemon config, rules, rule scenarios).

Operators write Prometheus next to kvguard, so durations read the way Prometheus writes them:
`500ms`, `30s`, `5m`, `1h30m`, `90d`, `1w`, largest unit first and each unit once, or a plain
number of seconds. Every value must be finite, >= 0 and at most a century: a duration feeds
timer waits and `datetime` arithmetic (audit retention, `--since`), where `.inf` or `1e300`
raise OverflowError long after the file was accepted.
"""

from __future__ import annotations

import math
import re
from typing import Any

UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
MAX_DURATION_S = 100 * 365 * 86400.0  # a century: far beyond any sane interval or retention
EXPECTED = "expected seconds as a number or a duration like '500ms', '30s', '5m', '2h', '90d'"
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_COMPOUND = re.compile(rf"(?:{_PART.pattern})+")
_ORDER = list(UNITS)


def parse_duration(value: Any) -> float:
    """Seconds from 30, 2.5, '45', '30s', '5m', '1h30m', '90d' or '1w'; ValueError otherwise.

    The message is the problem alone (the caller adds FILE:LINE and the key)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{_shown(value)} is not a duration ({EXPECTED})")
    try:
        seconds = _seconds_of_text(value) if isinstance(value, str) else float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if isinstance(value, float) and not math.isfinite(value):  # YAML .inf / .nan
        raise ValueError(f"{_shown(value)} is not finite ({EXPECTED})")
    if seconds < 0:
        raise ValueError(f"{_shown(value)} is negative ({EXPECTED})")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"{_shown(value)} is too long (expected at most 100 years, 36500d)")
    return seconds


def _seconds_of_text(value: str) -> float:
    text = value.strip().replace(" ", "")
    if _NUMBER.fullmatch(text):
        return float(text)
    if not _COMPOUND.fullmatch(text):
        raise ValueError(f"{_shown(value)} is not a duration ({EXPECTED})")
    parts = _PART.findall(text)
    ranks = [_ORDER.index(unit) for _, unit in parts]
    if ranks != sorted(set(ranks)):
        raise ValueError(
            f"{_shown(value)} is not a duration (expected units largest first, each once, e.g. '1h30m')"
        )
    return sum(float(n) * UNITS[unit] for n, unit in parts)


def _shown(value: Any) -> str:
    """The value as written, cut short: a hostile file may hold a 4,000-digit number."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
