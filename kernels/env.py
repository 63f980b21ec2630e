"""Switches read from the environment (`KVGUARD_CPU_OPS`, `KVGUARD_TRITON`, ...), one way
everywhere: `1`/`true`/`on`/`yes` and `0`/`false`/`off`/`no`, in any case and around any
spaces; unset or empty, the switch's default. Any other value is the default too, never
silently: a warning names the variable, the value and what it fell back to (once per variable
and value, since some switches are read on every kernel call), so `KVGUARD_CPU_OPS=off` or a
typo never leaves a path on (or off) while the operator believes otherwise.

No torch here, no engine: any part of kvguard may read a switch this way.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvguard.env")

ON = frozenset({"1", "true", "on", "yes"})
OFF = frozenset({"0", "false", "off", "no"})
ACCEPTED = "1/true/on/yes or 0/false/off/no"
_warned: set[tuple[str, str]] = set()


def warn_unknown(name: str, raw: str, expected: str, fallback: str) -> None:
    """Say, once per `name` and `raw` value, that $name is not one of the `expected` values and
    that `fallback` is what it means instead."""
    if (name, raw) in _warned:
        return
    _warned.add((name, raw))
    log.warning("%s=%r is not %s: %s", name, raw, expected, fallback)


def env_flag(name: str, default: bool) -> bool:
    """$name as a switch (see the module's docstring); `default` where unset, empty or not
    one of the accepted values (then warned about)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    if value:
        warn_unknown(name, raw, ACCEPTED, f"{'on' if default else 'off'}, its default")
    return default
