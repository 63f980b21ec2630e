"""$KVGUARD_LOG_LEVEL read one way by every process of kvguard: the daemon's log
(daemon/logging_setup.py) and each tensor-parallel worker's."""

from __future__ import annotations

import logging
import os

ENV = "KVGUARD_LOG_LEVEL"
ACCEPTED = "a level name (DEBUG, INFO, WARNING, ERROR, CRITICAL, in any case) or a number (10)"


def log_level(value: int | str | None = None) -> int:
    """`value` (default $KVGUARD_LOG_LEVEL, else INFO) as a logging level: a name logging
    knows, in any case, or a non-negative number (`10` is DEBUG). Anything else means INFO,
    never a process that dies before it can say why, and never silently: a warning names the
    variable and the value (written to stderr before any handler exists, so the journal has
    it)."""
    if isinstance(value, int):
        return value
    raw = value if value is not None else os.environ.get(ENV)
    text = (raw or "").strip()
    if not text:
        return logging.INFO
    if text.isdecimal():
        return int(text)
    level = logging.getLevelNamesMapping().get(text.upper())
    if level is not None:
        return level
    named = f"{ENV}={raw!r}" if value is None else f"log level {raw!r}"
    logging.getLogger("kvguard").warning("%s is not %s: logging at INFO", named, ACCEPTED)
    return logging.INFO
