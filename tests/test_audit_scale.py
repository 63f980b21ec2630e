"""The audit store at scale, on small data with the sizes patched down: a retention sweep of a
big backlog in chunks with rows written between them, `kvguard audit export` streaming, spill
files on a full disk, indexed filtered lists, and the CLI's default database without the engine.

Real SQLite files throughout (and the throwaway PostgreSQL server of tests/test_audit_postgres
for the migration).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from kvguard.daemon import audit, audit_migrate, audit_spill
from kvguard.daemon.audit import AuditStore
from tests.test_audit import _act, kvguard
from tests.test_audit_postgres import PgServer, pg, pg_db, pg_url  # noqa: F401 - fixtures

NOW = datetime.now(UTC).replace(microsecond=0)
OLD = NOW - timedelta(days=100)


def _rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(db)) as c:
        return c.execute(sql).fetchall()


def _everything(db: Path) -> dict[str, list[tuple[Any, ...]]]:
    return {
        t: _rows(db, f"SELECT * FROM {t} ORDER BY id") for t in ("actions", "events", "incidents")
    }


# -- 1. the retention sweep: chunks, rows between them, the WAL ------------------------------------
def _backlog(store: AuditStore, events: int, detail: str = "") -> dict[str, str]:
    """Old rows of no incident, of an incident closed long ago, of one still open and of one
    closed after the cut; recent rows."""
    gone = store.open_incident(1, "closed long ago", time=OLD)
    kept_open = store.open_incident(2, "still open", time=OLD)
    late = store.open_incident(1, "closed after the cut", time=OLD)
    incs = (None, gone, kept_open, late)
    for i in range(events):
        store.record_event(
            "alert_received", detail, incident=incs[i % 4], time=OLD + timedelta(seconds=i)
        )
        if i % 3 == 0:
            _act(store, incident=incs[i % 4], time=OLD + timedelta(seconds=i))
    store.update_incident(gone, closed_at=OLD + timedelta(days=1))
    store.update_incident(late, closed_at=NOW - timedelta(hours=1))
    store.record_event("daemon_start")
    _act(store, action="restore_batch")
    assert store.flush(60)
    return {"gone": gone, "open": kept_open, "late": late}


def test_a_sweep_deletes_in_chunks_and_writes_rows_queued_meanwhile_between_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A backlog's sweep was one transaction: the writer held for its whole length, every row
    queued behind it waiting (for ever on a disk without room for its WAL). Now it deletes
    PURGE_CHUNK rows a transaction, the rows queued meanwhile land between its chunks, and it
    deletes what one transaction would have: not those rows, even one with an old time."""
    monkeypatch.setattr(audit, "PURGE_CHUNK", 100)
    db = tmp_path / "audit.db"
    store = AuditStore(f"sqlite:///{db}", host="node-1")
    store.start()
    incs = _backlog(store, 1200)
    reference = tmp_path / "reference.db"  # the same rows, swept in one transaction
    with closing(sqlite3.connect(db)) as src, closing(sqlite3.connect(reference)) as dst:
        src.backup(dst)

    statements: list[tuple[str, str, int]] = []
    queued: list[str] = []

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        words = statement.split()
        verb, table = words[0], words[2] if words[0] in ("DELETE", "INSERT") else ""
        statements.append((verb, table, cursor.rowcount))
        if verb == "DELETE" and not queued:  # the sweep has begun: a daemon records on
            queued.append("during the sweep")
            store.record_event("during the sweep")
            store.record_event("old, during the sweep", time=OLD)

    caplog.set_level(logging.INFO, logger="kvguard.daemon.audit")
    event.listen(store._engine, "after_cursor_execute", after)
    store.purge_older_than(90)
    assert store.flush(60)  # returns once the whole sweep is done
    event.remove(store._engine, "after_cursor_execute", after)
    assert store.stop(timeout=10)

    deletes = [(t, n) for verb, t, n in statements if verb == "DELETE"]
    assert max(n for _, n in deletes) <= 100, deletes
    assert sum(1 for t, _ in deletes if t == "events") >= 6
    inserted = next(i for i, (verb, t, _) in enumerate(statements) if verb == "INSERT")
    last_delete = max(i for i, (verb, *_) in enumerate(statements) if verb == "DELETE")
    assert inserted < last_delete, "the rows queued during the sweep waited for all of it"

    said = [r.getMessage() for r in caplog.records if "retention deleted" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        "(audit.retention): 200 actions, 600 events, 1 incidents"
    ), said
    engine = audit_migrate.make_engine(f"sqlite:///{reference}")
    with engine.begin() as conn:
        audit._purge(conn, NOW - timedelta(days=90))
    engine.dispose()
    swept, ref = _everything(db), _everything(reference)
    assert swept["incidents"] == ref["incidents"]
    assert swept["actions"] == ref["actions"] and len(ref["actions"]) > 100
    during = [r for r in swept["events"] if r[3].endswith("during the sweep")]
    assert [r[3] for r in during] == ["during the sweep", "old, during the sweep"]
    assert [r for r in swept["events"] if r not in during] == ref["events"]
    assert {r[0] for r in swept["incidents"]} == {incs["open"], incs["late"]}


def test_a_sweep_step_that_fails_to_commit_is_retried_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient failure at a chunk's commit (a locked database, a dropped connection) is
    retried from the last commit: an incidents chunk whose commit failed is deleted by the
    retry, not skipped until the next sweep."""
    monkeypatch.setattr(audit, "PURGE_CHUNK", 3)
    now = datetime.now(UTC).replace(microsecond=0)
    old = now - timedelta(days=100)
    store = AuditStore(f"sqlite:///{tmp_path / 'a.db'}", host="n")
    store.start()
    try:
        for i in range(7):
            inc = store.open_incident(1, f"i{i}", time=old)
            store.update_incident(inc, closed_at=old + timedelta(hours=1))
        assert store.flush(30)
        engine = store._engine
        sweep = audit._Sweep({"before": now - timedelta(days=30)})
        while sweep.left != ["incidents"]:
            sweep.step(engine)
        fail = [True]

        @event.listens_for(engine, "commit")
        def locked(_conn: Any) -> None:
            if fail and fail.pop():
                raise OperationalError("COMMIT", {}, Exception("database is locked"))

        with pytest.raises(OperationalError) as err:
            sweep.step(engine)
        assert audit._is_transient(err.value)
        while not sweep.step(engine):
            pass
        with closing(sqlite3.connect(tmp_path / "a.db")) as c:
            assert c.execute("select count(*) from incidents").fetchone()[0] == 0
        assert sweep.deleted["incidents"] == 7
    finally:
        store.stop(timeout=5)


def test_a_sweep_gives_the_wal_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep in one transaction left a WAL as large as what it deleted, for good: it is
    checkpointed (TRUNCATE) after the sweep, and every connection caps it (journal_size_limit)."""
    monkeypatch.setattr(audit, "PURGE_CHUNK", 500)
    db = tmp_path / "audit.db"
    store = AuditStore(f"sqlite:///{db}", host="node-1")
    store.start()
    for i in range(5000):
        store.record_event("alert_received", "x" * 1000, time=OLD + timedelta(seconds=i))
    assert store.flush(60)
    with closing(sqlite3.connect(db)) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.purge_older_than(90)
    assert store.flush(60)
    assert _rows(db, "SELECT count(*) FROM events") == [(0,)]
    wal = db.with_name("audit.db-wal")
    assert wal.stat().st_size < 1 << 20, wal.stat().st_size  # it held 5 MB of rows
    with store._engine.connect() as conn:
        limit = conn.exec_driver_sql("PRAGMA journal_size_limit").scalar()
    assert limit == audit_migrate.WAL_LIMIT_BYTES
    assert store.stop(timeout=10)


def test_a_sweep_cut_short_by_stop_is_spilled_and_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() giving up during a sweep saves the sweep itself with the rows queued behind it;
    the next start's import applies it again, and deletes the rest."""
    monkeypatch.setattr(audit, "PURGE_CHUNK", 50)
    db = tmp_path / "audit.db"
    store = AuditStore(f"sqlite:///{db}", host="node-1")
    store.start()
    _backlog(store, 400)

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("DELETE"):
            store._abandon.set()  # what stop() does when its time is up
            store.record_event("queued behind the sweep")

    event.listen(store._engine, "after_cursor_execute", after)
    store.purge_older_than(90)
    assert not store.stop(timeout=0.5)  # the writer has left: nothing settles
    assert store.spill_file is not None
    kinds = [k for k, _ in audit_spill.read(store.spill_file).ops]
    assert kinds[0] == "purge" and "events" in kinds
    again = AuditStore(f"sqlite:///{db}", host="node-1")
    again.start()
    assert again.flush(30) and again.stop(timeout=10)
    old_left = "SELECT count(*) FROM events WHERE kind = 'alert_received' AND incident IS NULL"
    assert _rows(db, old_left) == [(0,)]
    assert _rows(db, "SELECT count(*) FROM events WHERE kind = 'queued behind the sweep'") == [(1,)]


# -- 3. spill files on a full disk ------------------------------------------------------------
def test_a_spill_on_a_full_disk_leaves_no_empty_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A spill that failed (ENOSPC) truncated the file back, to nothing when it had created it:
    every later start logged an ERROR over it and `kvguard audit import` exited 2."""
    spill = tmp_path / "audit.db.spill.jsonl"
    older = tmp_path / "older.spill.jsonl"
    lines = [
        audit_spill.encode_header("db", "h", 1, None),
        audit_spill.encode("purge", {"before": NOW}),
    ]
    assert audit_spill.append([older], lines) == (older, [])
    kept = older.read_bytes()

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(audit_spill.os, "write", full)
    path, errors = audit_spill.append([spill, older], lines)
    monkeypatch.undo()
    assert path is None and len(errors) == 2 and "No space left" in errors[0]
    assert not spill.exists()  # created by the failed spill: removed
    assert older.read_bytes() == kept  # an earlier spill's lines stay

    # one left by an older kvguard: nothing to import, no error
    spill.write_bytes(b"")
    db = tmp_path / "audit.db"
    caplog.set_level(logging.INFO, logger="kvguard.daemon.audit")
    store = AuditStore(f"sqlite:///{db}", host="node-1")
    store.start()
    assert store.flush(10) and store.stop(timeout=10)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not spill.exists()
    spill.write_bytes(b"")
    rc, out = kvguard("audit", "import", "--db", f"sqlite:///{db}", str(spill))
    assert rc == 0 and out == f"{spill} is empty: nothing to import; the file left as it is\n"
    assert spill.read_bytes() == b""  # not renamed as imported: it held nothing


# -- 2. kvguard audit export streams ---------------------------------------------------------------
def test_export_streams_each_table_byte_for_byte_as_the_whole_list_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export loaded the whole table (1.2 GB for 600k rows) and wrote nothing until the
    end. It reads it in chunks now, and writes the same bytes: JSON and CSV, each table,
    windowed, by instance, and empty."""
    from kvguard.daemon import audit_cli

    db = tmp_path / "audit.db"
    url = f"sqlite:///{db}"
    for name in ("node-a", "node-b"):
        s = AuditStore(url, host="h", instance=name)
        s.start()
        incs = [s.open_incident(i % 4, f"p{i}", time=OLD + timedelta(hours=i)) for i in range(30)]
        for inc in incs[::2]:
            s.update_incident(inc, actions_count=3, closed_at=OLD + timedelta(days=1))
        for i in range(800):
            t = OLD + timedelta(minutes=i // 2)  # two rows a time: the order by id shows
            value = (float("inf"), float("nan"), 0.95, None)[i % 4]
            _act(
                s,
                value=value,
                params={"n": i, "deep": [1, {"ü": "x\ny"}]},
                time=t,
                incident=incs[i % 30] if i % 3 else None,
                detail=f'say "{i}", ok',
            )
            s.record_event("engine_oom", "step\tpreempted", data={"i": i}, time=t)
        assert s.stop(timeout=30)

    reader = AuditStore(url, host="-")
    lists = {
        "actions": reader.list_actions,
        "events": reader.list_events,
        "incidents": reader.list_incidents,
    }
    windows: list[tuple[list[str], dict[str, Any]]] = [
        ([], {}),
        (["--instance", "node-b"], {"instance": "node-b"}),
        (
            [
                "--since",
                (OLD + timedelta(hours=3)).isoformat(),
                "--until",
                (OLD + timedelta(hours=9)).isoformat(),
            ],
            {"since": OLD + timedelta(hours=3), "until": OLD + timedelta(hours=9)},
        ),
        (["--until", (OLD - timedelta(days=1)).isoformat()], {"until": OLD - timedelta(days=1)}),
    ]
    cases = []
    for table, listed in lists.items():
        for argv, window in windows:
            rows = listed(limit=None, **window)
            csv_ref = tmp_path / "ref.csv"
            with csv_ref.open("w", newline="") as f:
                audit_cli._write_csv(f, audit_cli._columns(table), rows)
            cases.append(
                (table, argv, audit_cli._dumps(rows) + "\n", csv_ref.read_text(), len(rows))
            )
    assert {n for *_, n in cases} >= {0, 800, 1600}

    def whole_list(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the export read the whole table into a list")

    monkeypatch.setattr(AuditStore, "_newest", whole_list)
    for table, argv, json_ref, csv_ref, _ in cases:
        for fmt, ref in (("--json", json_ref), ("--csv", csv_ref)):
            out = tmp_path / "out"
            args = ["audit", "export", "--db", url, "--table", table, fmt, "-o", str(out), *argv]
            assert kvguard(*args) == (0, "")
            assert out.read_text() == ref, (table, fmt, argv)
    rc, printed = kvguard("audit", "export", "--db", url, "--table", "events", "--json")
    assert rc == 0 and printed == cases[4][2]


# -- 4. filtered lists: (column, time) indexes ------------------------------------------------------
def test_filtered_lists_read_the_newest_rows_off_an_index_without_sorting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--rule`, `--instance` and events by kind sorted every matching row (an index on the
    column alone): seconds on months of rows. Revision 0005's (column, time) indexes give them
    in order; SQLite's plan has no temporary sort."""
    from sqlalchemy.dialects import sqlite as sqlite_dialect

    db = tmp_path / "audit.db"
    store = AuditStore(f"sqlite:///{db}", host="node-1")
    store.start()
    inc = store.open_incident(1, "p", time=OLD)
    for i in range(300):
        _act(store, rule=("fp8-kv", "shed")[i % 2], time=OLD + timedelta(minutes=i))
        store.record_event(("engine_oom", "reload")[i % 2], time=OLD + timedelta(minutes=i))
    assert store.flush(30)
    queries: list[Any] = []
    rows = AuditStore._rows
    monkeypatch.setattr(AuditStore, "_rows", lambda s, q: queries.append(q) or rows(s, q))
    listed = {
        "list --rule": store.list_actions(rule="fp8-kv", limit=101),
        "list --instance": store.list_actions(instance="node-1", limit=101),
        "events by kind": store.list_events(kind="reload", limit=101),
        "events --instance": store.list_events(instance="node-1", limit=101),
        "incidents --instance": store.list_incidents(instance="node-1", limit=101),
    }
    assert [len(r) for r in listed.values()] == [101, 101, 101, 101, 1]
    assert listed["incidents --instance"][0]["id"] == inc
    with closing(sqlite3.connect(db)) as c:
        for name, q in zip(listed, queries, strict=True):
            sql = q.compile(
                dialect=sqlite_dialect.dialect(), compile_kwargs={"literal_binds": True}
            )
            plan = " | ".join(r[3] for r in c.execute(f"EXPLAIN QUERY PLAN {sql}"))
            assert "TEMP B-TREE" not in plan and "_time" in plan, (name, plan)
    assert store.stop(timeout=10)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0005_swaps_the_filter_indexes_up_and_down_keeping_the_rows(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    import sqlalchemy as sa

    if backend == "postgresql":
        url = request.getfixturevalue("pg_url")
    else:
        url = f"sqlite:///{tmp_path / 'audit.db'}"
    store = AuditStore(url, host="node-1")
    store.start()  # today's writer writes at head (0006 adds a column): taken down to 0004 after
    _act(store, rule="fp8-kv")
    store.record_event("reload")
    store.open_incident(1, "p")
    assert store.stop(timeout=10)
    audit_migrate.downgrade(url, "0004")

    def indexes() -> dict[str, list[str]]:
        engine = audit_migrate.make_engine(url)
        try:
            with engine.connect() as conn:
                insp = sa.inspect(conn)
                return {
                    i["name"]: list(i["column_names"])
                    for t in ("actions", "events", "incidents")
                    for i in insp.get_indexes(t)
                    if "rule" in i["name"] or "kind" in i["name"] or "instance" in i["name"]
                }
        finally:
            engine.dispose()

    single = {
        "ix_actions_rule": ["rule"],
        "ix_actions_instance": ["instance"],
        "ix_events_kind": ["kind"],
        "ix_events_instance": ["instance"],
        "ix_incidents_instance": ["instance"],
    }
    assert indexes() == single
    audit_migrate.upgrade(url, "0005")
    assert audit_migrate.current(url) == "0005"
    assert indexes() == {
        "ix_actions_rule_time": ["rule", "time"],
        "ix_actions_instance_time": ["instance", "time"],
        "ix_events_kind_time": ["kind", "time"],
        "ix_events_instance_time": ["instance", "time"],
        "ix_incidents_instance_time": ["instance", "opened_at", "id"],
    }
    audit_migrate.upgrade(url)  # today's reader reads at head
    reader = AuditStore(url, host="-")
    assert [a["rule"] for a in reader.list_actions(rule="fp8-kv")] == ["fp8-kv"]
    assert len(reader.list_events(kind="reload")) == len(reader.list_incidents()) == 1
    reader._engine.dispose()
    audit_migrate.downgrade(url, "0004")
    assert audit_migrate.current(url) == "0004" and indexes() == single
    audit_migrate.upgrade(url, "0005")
    assert audit_migrate.current(url) == "0005"
