"""$KVGUARD_LOG_LEVEL read one way by every process of kvguard: the daemon's log
(daemon/logging_setup.py) and each tensor-parallel worker's."""

from __future__ import annotations

import logging
import os


def log_level(value: int | str | None = None) -> int:
    """`value` (default $KVGUARD_LOG_LEVEL, else INFO) as a logging level: a name logging does
    not know means INFO, never a process that dies before it can say why."""
    chosen = value if value is not None else os.environ.get("KVGUARD_LOG_LEVEL", "INFO")
    level = logging.getLevelName(chosen.upper()) if isinstance(chosen, str) else chosen
    return level if isinstance(level, int) else logging.INFO
