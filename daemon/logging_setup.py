"""The daemon's log: one format, one level, and libraries kept to what an operator needs."""

from __future__ import annotations

import logging

from kvguard.engine.log_level import log_level

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log routine work at INFO: APScheduler writes two lines per job run (the rule
# tick every few seconds), which buries kvguard's own lines in a journal. Their warnings and
# errors still show; at DEBUG everything does.
CHATTY = ("apscheduler",)


def configure_logging(level: int | str | None = None) -> int:
    """Set up the root logger at `level` (default $KVGUARD_LOG_LEVEL, else INFO) and quiet the
    CHATTY libraries to WARNING unless the level is DEBUG. Returns the level in force."""
    numeric = log_level(level)
    logging.basicConfig(level=numeric, format=FORMAT)
    logging.getLogger().setLevel(numeric)
    for name in CHATTY:
        logging.getLogger(name).setLevel(
            logging.NOTSET if numeric <= logging.DEBUG else logging.WARNING
        )
    return numeric
