"""The audit log names requests by ids their clients hold, and an action's row keeps what the
engine said it did: the requests an eviction preempted.

The engine named the daemon's requests `req-N`, a counter that began again at 0 at every start
and that no response or log line showed: an `engine_oom` row's `requeued: ['req-0']` could not
be matched to a client's report, and meant another request in each run. An eviction's row (a
rule's or an operator's) dropped the engine's answer, the evicted requests, which the admin
API returned: the audit could not tell whose requests an incident slowed. The OOM chain's row
named its steps but not the requests its batch cut and eviction took off the device. And an
operator asked about one request grepped an export: `kvguard audit list --request ID` lists
what names it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from kvguard.daemon import audit_migrate, audit_spill
from kvguard.daemon.audit import TABLES, AuditStore
from kvguard.daemon.audit_models import Base
from kvguard.engine.llm_engine import LLMEngine
from kvguard.rules.actions import run_action
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import load_rules_text
from tests.test_audit import kvguard
from tests.test_audit_postgres import PgServer, pg, pg_db, pg_url  # noqa: F401 - fixtures
from tests.test_engine import make_engine
from tests.test_remedies import greedy
from tests.test_remedy_holds import ENGINE, HEADER, OOM_CHAIN, settle
from tests.test_server import Daemon, until

WAIT_S = 60.0  # generous: a bound, not a goal
NOW = datetime(2026, 12, 8, 9, 0, tzinfo=UTC)
# tokens a choice still has to decode once its first has come: the engine is stalled long
# before it could make them all
LONG = 400


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("request_ids"))
    yield d
    assert d.stop() == 0


def _events(d: Daemon, kind: str) -> list[dict[str, Any]]:
    """The `data` of every `kind` event row the daemon has written, in order."""
    with closing(sqlite3.connect(d.config.parent / "audit.db")) as db:
        sql = "SELECT data FROM events WHERE kind = ? ORDER BY id"
        return [json.loads(r[0]) for r in db.execute(sql, (kind,))]


def _audit(d: Daemon, *argv: str) -> Any:
    """`kvguard audit ARGV --config CONFIG --json`, as an operator runs it, parsed."""
    rc, out = kvguard("audit", *argv, "--config", str(d.config), "--json")
    assert rc == 0, out
    return json.loads(out)


# -- the daemon's requests are the engine's under the ids their clients got ---------------------
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_an_ooms_requeued_requests_are_named_by_the_ids_their_responses_returned(
    daemon: Daemon, kind: str
) -> None:
    """Each choice is an engine request named `<response id>-<choice index>`: what the client
    holds, not a `req-N` of the engine's own (a completion of two prompts numbers its four
    choices on across them, as its response does)."""
    seen = len(_events(daemon, "engine_oom"))
    assert daemon.admin("POST", "/admin/debug/inject_oom", json={"times": 1}).status_code == 200
    c = daemon.client()
    if kind == "completion":
        r = c.completions.create(
            model="tiny", prompt=["Hello there", "Good day"], max_tokens=2, n=2
        )
        assert r.id.startswith("cmpl-")
    else:
        messages = [{"role": "user", "content": "Hello there"}]
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, n=2)
        assert r.id.startswith("chatcmpl-")
    ids = {f"{r.id}-{choice.index}" for choice in r.choices}
    assert len(ids) == (4 if kind == "completion" else 2)
    [oom] = until(lambda: _events(daemon, "engine_oom")[seen:], WAIT_S, "the engine_oom row")
    assert oom["requeued"] and set(oom["requeued"]) <= ids, (oom["requeued"], ids)


def test_a_manual_evictions_audit_row_holds_the_requests_the_admin_answer_named(
    daemon: Daemon,
) -> None:
    """Two low-priority choices decode; the engine is stalled while they do, the eviction is
    posted to it, and the stall released: it applies at that boundary, to both. The admin
    answer names them, and so does `kvguard audit show ID --json`, by the stream's id."""
    c = daemon.client()
    stream = c.completions.create(
        model="tiny",
        prompt="Tell me a story about a small boat",
        max_tokens=LONG,
        n=2,
        stream=True,
        extra_body={"priority": "low", "ignore_eos": True},
    )
    got: dict[str, httpx.Response] = {}

    def evict() -> None:
        body = {"count": 2, "max_priority": "low"}
        got["r"] = daemon.admin("POST", "/admin/actions/evict_lowest_priority", json=body)

    t = threading.Thread(target=evict)
    try:
        first = next(iter(stream))  # a choice has its first token: both are decoding
        assert daemon.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
        try:
            running = daemon.admin("GET", "/admin/state").json()["queues"]["running"]
            assert sum(running.values()) == 2, f"both choices decoding at the stall: {running}"
            t.start()
            asked = "admin action evict_lowest_priority asked"
            until(lambda: asked in Path(daemon.log.name).read_text(), WAIT_S, "the eviction posted")
        finally:
            assert daemon.admin("POST", "/admin/debug/release").status_code == 200
        t.join(WAIT_S)
    finally:
        stream.close()  # the client leaves: its choices end
    answer = got["r"].json()
    assert got["r"].status_code == 200 and answer["ok"], answer
    evicted = answer["data"]["evicted"]

    rows = until(
        lambda: _audit(daemon, "list", "--action", "evict_lowest_priority"),
        WAIT_S,
        "the eviction's audit row",
    )
    shown = _audit(daemon, "show", str(rows[-1]["id"]))
    assert shown["rule"] == "manual" and shown["data"] == {"evicted": evicted}
    assert sorted(rid for rid, _ in evicted) == [f"{first.id}-0", f"{first.id}-1"]


# -- a rule's eviction --------------------------------------------------------------------------
def applied_row(
    engine: LLMEngine, rule: str, event: str, tmp_path: Path
) -> tuple[dict[str, Any], AuditStore]:
    """The audit row of `rule` (a rules-file line) applied on `engine` by the evaluator when
    `event` comes, written by a real store into a SQLite file under `tmp_path` (stopped
    after: the store is returned for its url)."""
    store = AuditStore(f"sqlite:///{tmp_path / 'audit.db'}", host="h")
    store.start()
    try:
        ev = Evaluator(
            load_rules_text(HEADER + rule, "test.yaml"),
            lambda name, signal: None,
            lambda action, params: settle(engine, run_action(engine, action, params)),
            audit=store,
        )
        assert [d.outcome for d in ev.handle_event(event)] == ["applied"]
        assert store.flush(10)
        [row] = store.list_actions()
    finally:
        assert store.stop(timeout=10)
    return row, store


def test_a_rules_eviction_row_holds_the_requests_it_evicted(tmp_path: Path) -> None:
    """The evaluator records the engine's answer beside the settings before and after."""
    engine = make_engine(**ENGINE)
    rids = [
        engine.add_request("Hello there", greedy(50), request_id=f"cmpl-{i}-0", priority="low")
        for i in range(2)
    ]
    engine.step()  # both prefilled: running
    rule = (
        "  - {name: evict, on: 'alert:Full', action: evict_lowest_priority,"
        " params: {count: 2, max_priority: low}}\n"
    )
    row, store = applied_row(engine, rule, "alert:Full", tmp_path)
    assert row["rule"] == "evict" and sorted(rid for rid, _ in row["data"]["evicted"]) == rids
    rc, out = kvguard("audit", "export", "--db", store.url, "--csv")
    assert rc == 0 and out.splitlines()[0].split(",")[-1] == "data", out
    assert '"{""evicted"": [[""cmpl-' in out.splitlines()[1]


def test_the_oom_chains_row_names_the_requests_its_steps_took_off_the_device(
    tmp_path: Path,
) -> None:
    """Two low-priority requests decode; a step runs out of memory and requeues them; they
    run again when the chain applies, a few steps later, as in the daemon. Its batch cut
    (to half the failed batch: 1) preempts one, its eviction the other: the chain's row names
    each under the key that step's own row would (`preempted`, `evicted`), and
    `list --request` finds the row by either id."""
    engine = make_engine(**ENGINE)
    rids = [
        engine.add_request("Hello there", greedy(50), request_id=f"cmpl-{i}-0", priority="low")
        for i in range(2)
    ]
    engine.step()  # both prefilled: running
    engine.inject_oom()
    engine.step()  # the decode step fails: both go back to be computed again
    assert not engine.scheduler.running
    for _ in range(20):  # prefilled again, in chunks of the halved step budget
        if len(engine.scheduler.running) == 2:
            break
        engine.step()
    assert sorted(s.request_id for s in engine.scheduler.running) == rids
    row, store = applied_row(engine, OOM_CHAIN, "engine_oom", tmp_path)
    data = row["data"]
    assert row["action"] == "handle_oom" and data["applied"][:2] == ["reduce_max_num_seqs", "evict"]
    [(cut, _)], [(evicted, _)] = data["preempted"], data["evicted"]
    assert sorted([cut, evicted]) == rids, data
    assert "evict: evicted 1 sequence of" in row["detail"], row["detail"]
    for rid in rids:
        rc, out = kvguard("audit", "list", "--db", store.url, "--request", rid, "--json")
        assert rc == 0 and [r["id"] for r in json.loads(out)] == [row["id"]], out


# -- kvguard audit list --request ---------------------------------------------------------------
def _write_story(store: AuditStore) -> None:
    """What an incident leaves about the choices of `cmpl-abc`, and rows that must not match:
    another response's ids, one beginning with `cmpl-abc` (`cmpl-abcd-0`), choice 10 beside
    choice 1, an id inside a longer string, an id in a detail (not data)."""
    at = iter(NOW + timedelta(seconds=i) for i in range(100))
    store.record_event(
        "engine_oom", data={"requeued": ["cmpl-abc-1", "cmpl-other-0"]}, time=next(at)
    )
    store.record_action(
        action="handle_oom",
        outcome="applied",
        rule="oom-chain",
        trigger="event",
        data={"steps": ["evict"], "applied": ["evict"], "evicted": [["cmpl-abc-0", "swap"]]},
        time=next(at),
    )
    store.record_action(
        action="evict_lowest_priority",
        outcome="applied",
        trigger="manual",
        data={"evicted": [["cmpl-abcd-0", "recompute"]]},
        time=next(at),
    )
    store.record_action(
        action="reduce_batch", outcome="applied", detail="after cmpl-abc-0 was slow", time=next(at)
    )
    store.record_event("alert_received", data={"summary": "cmpl-abc-0 is slow"}, time=next(at))
    store.record_event(
        "kv_pool_resized", data={"preempted": [["cmpl-abc-10", "swap"]]}, time=next(at)
    )


def _story(url: str, request: str, *argv: str) -> list[tuple[str, str]]:
    """`kvguard audit list --request REQUEST ARGV --json`: each row's type and what it was."""
    rc, out = kvguard("audit", "list", "--db", url, "--request", request, "--json", *argv)
    assert rc == 0, out
    return [
        (r["type"], r["action"] if r["type"] == "action" else r["kind"]) for r in json.loads(out)
    ]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_list_request_shows_the_actions_and_events_naming_a_request_or_its_response(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A request id finds the rows naming it; a response id, those naming any of its choices;
    a longer id beginning with it, an id inside other text or in a detail, nothing. The action
    filters leave the events out (they have no rule, action or outcome); --limit keeps the
    newest, saying so."""
    if backend == "postgresql":
        url = request.getfixturevalue("pg_url")
    else:
        url = f"sqlite:///{tmp_path / 'audit.db'}"
    store = AuditStore(url, host="h")
    store.start()
    try:
        _write_story(store)
        assert store.flush(10)
    finally:
        assert store.stop(timeout=10)
    oom, chain, resized = (
        ("event", "engine_oom"),
        ("action", "handle_oom"),
        ("event", "kv_pool_resized"),
    )
    assert _story(url, "cmpl-abc") == [oom, chain, resized]
    assert _story(url, "cmpl-abc-0") == [chain]
    assert _story(url, "cmpl-abc-1") == [oom]
    assert _story(url, "cmpl-abcd") == [("action", "evict_lowest_priority")]
    for nothing in ("cmpl-ab", "cmpl-a_c", "cmpl-abc%", "abc-0"):
        assert _story(url, nothing) == [], nothing
    assert _story(url, "cmpl-abc", "--action", "handle_oom") == [chain]
    assert _story(url, "cmpl-abc", "--outcome", "applied") == [chain]
    capsys.readouterr()
    assert _story(url, "cmpl-abc", "--limit", "2") == [chain, resized]
    assert "the newest 2 matching actions and events shown" in capsys.readouterr().err
    rc, out = kvguard("audit", "list", "--db", url, "--request", "cmpl-abc-1")
    assert rc == 0 and out.split()[:3] == ["ID", "TIME", "TYPE"], out
    [line] = out.splitlines()[1:]
    assert " event " in line and "engine_oom" in line, out


def test_list_request_refuses_an_empty_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unset shell variable (`--request "$RID"`) is an error, not every request."""
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    audit_migrate.upgrade(url)
    with pytest.raises(SystemExit) as exc:
        kvguard("audit", "list", "--db", url, "--request", " ")
    assert exc.value.code == 2
    assert "expected a request id" in capsys.readouterr().err


# -- revision 0006 ------------------------------------------------------------------------------
def _actions_0005() -> sa.Table:
    """`actions` as a kvguard of revision 0005 knows it: no `data`."""
    cols = [
        sa.Column(c.name, c.type, primary_key=c.primary_key)
        for c in TABLES["actions"].c
        if c.name != "data"
    ]
    return sa.Table("actions", sa.MetaData(), *cols)


def _action(**kw: Any) -> dict[str, Any]:
    row = {"time": NOW, "host": "old-node", "rule": "manual", "action": "evict_lowest_priority"}
    row |= {"trigger": "manual", "params": {}, "outcome": "applied", "is_undo": False}
    return row | {"detail": "evicted 1 sequences", "uid": uuid.uuid4().hex} | kw


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0006_adds_the_actions_data_keeping_the_rows_and_the_old_daemons_trigger(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Up from 0005 the rows stay (with no data), the tables are the models', a row a daemon
    from before 0003 writes (no `instance`) still gets its host, and one written without
    `instance` keeps its `data` (SQLite's trigger names the new column); down again, the
    column goes and the trigger of 0004 is back."""
    if backend == "postgresql":
        url = request.getfixturevalue("pg_url")
    else:
        url = f"sqlite:///{tmp_path / 'audit.db'}"
    audit_migrate.upgrade(url, "0005")
    evicted = {"evicted": [["cmpl-3fa25a640b7d4bc2b84a048a-0", "swap"]]}
    engine = audit_migrate.make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(_actions_0005()), [_action(instance="node-5")])
            conn.execute(sa.insert(_actions_0005()), [_action()])  # a kvguard from before 0003
        audit_migrate.upgrade(url)
        assert audit_migrate.current(url) == "0006"
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(ctx, Base.metadata) == []
        with engine.begin() as conn:
            conn.execute(sa.insert(TABLES["actions"]), [_action(data=evicted)])
            conn.execute(sa.insert(_actions_0005()), [_action()])
        store = AuditStore(url, host="-")
        rows = store.list_actions(limit=None)
        store._engine.dispose()  # noqa: SLF001
        assert [(r["instance"], r["data"]) for r in rows] == [
            ("node-5", None),
            ("old-node", None),
            ("old-node", evicted),
            ("old-node", None),
        ]
        audit_migrate.downgrade(url, "0005")
        assert "data" not in {c["name"] for c in sa.inspect(engine).get_columns("actions")}
        with engine.begin() as conn:
            conn.execute(sa.insert(_actions_0005()), [_action()])
            got = conn.execute(sa.text("SELECT instance FROM actions ORDER BY id")).all()
        assert [r[0] for r in got] == ["node-5"] + ["old-node"] * 4
    finally:
        engine.dispose()
    audit_migrate.upgrade(url)
    assert audit_migrate.current(url) == audit_migrate.head() == "0006"


def test_an_action_spilled_before_0006_imports_beside_one_with_data(tmp_path: Path) -> None:
    """A spill file may hold actions an older kvguard left (no `data`) after this one's: they
    go in as one insert, which needs every row to name the same columns."""
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    store = AuditStore(url, host="h")
    store.start()
    try:
        evicted = {"evicted": [["cmpl-a-0", "recompute"]]}
        new, old = _action(instance="h", data=evicted), _action(instance="h")
        lines = [audit_spill.encode_header(url, "h", 2, "stopped unwritten")]
        lines += [audit_spill.encode("actions", row) for row in (new, old)]
        spill = tmp_path / "from-another-run.jsonl"  # not the store's own: it imports that itself
        assert audit_spill.append([spill], lines)[0] == spill
        result = store.import_file(spill)
        assert result.added == {"actions": 2}
        assert [r["data"] for r in store.list_actions()] == [evicted, None]
    finally:
        assert store.stop(timeout=10)
