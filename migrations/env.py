"""Alembic environment for the audit database.

kvguard runs Alembic from code (`kvguard.daemon.audit_migrate`) with a `Config` built in memory
and an open connection in `config.attributes["connection"]`, so no alembic.ini is needed and the
connection carries kvguard's SQLite settings (WAL, busy timeout). A developer writing a new
revision can still use the alembic command with `-x url=sqlite:///var/audit.db`.

`render_as_batch` lets later migrations alter columns on SQLite, which has almost no ALTER TABLE.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from kvguard.daemon.audit_migrate import make_engine
from kvguard.daemon.audit_models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise ValueError("no database: pass -x url=SQLALCHEMY_URL to alembic")
    return url


def run_offline() -> None:
    """`alembic upgrade --sql`: print the DDL for a DBA instead of running it."""
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.begin() as conn:
            _configure(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
