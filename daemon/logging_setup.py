"""The daemon's log: one format, one level, and libraries kept to what an operator needs."""

from __future__ import annotations

import logging

from kvguard.engine.log_level import log_level

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log routine work at INFO: APScheduler writes two lines per job run (each
# evaluation an engine event or an alert starts), which buries kvguard's own lines in a journal. Their warnings and
# errors still show; at DEBUG everything does.
CHATTY = ("apscheduler",)
# Lines a library writes at INFO on every start that say nothing an operator acts on, by logger
# and message: alembic names the audit database's dialect each time it opens it. Its lines that
# say the schema changed ("Running upgrade ...") stay; at DEBUG everything does.
ROUTINE = {"alembic.runtime.migration": ("Context impl ", "Will assume ")}


class _DropRoutine(logging.Filter):
    """Drops a logger's records whose message (the unformatted one) starts with a prefix."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


def configure_logging(level: int | str | None = None) -> int:
    """Set up the root logger at `level` (default $KVGUARD_LOG_LEVEL, else INFO), quiet the
    CHATTY libraries to WARNING and drop the ROUTINE lines unless the level is DEBUG. Returns
    the level in force. Other libraries' loggers (uvicorn's among them: the daemon gives it
    no logging config of its own) go through the root logger: one format, one level."""
    numeric = log_level(level)
    debug = numeric <= logging.DEBUG
    logging.basicConfig(level=numeric, format=FORMAT)
    logging.getLogger().setLevel(numeric)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.WARNING)
    for name, prefixes in ROUTINE.items():
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _DropRoutine)]:
            logger.removeFilter(f)  # called again (tests): one filter, or none at DEBUG
        if not debug:
            logger.addFilter(_DropRoutine(prefixes))
    return numeric
