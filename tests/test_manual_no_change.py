"""An operator's action that finds the engine already so (FP8 on an FP8 pool, a halt as strict
as the one in force, a cap or batch limit equal to the one in force, an undo with nothing to
undo, an eviction with nothing to evict) answers 200 with `changed` false and a detail saying
nothing changed; the audit log records it `held`, not `applied`, and kvguard_actions_total
counts it under `held`. Before, every such call was audited and counted `applied` (78 of 87
manual `enable_fp8_kv` calls on an FP8 pool in one hunt), and a second halt wrote a second
`admission_halted` event although nothing was halted then.

An action that changes only what the knobs do not show changed the engine all the same: a
`restore_batch` that lifts a cut a reload had lowered the configured limit to (a later reload
raising the limit raises the batch), a `shrink_kv_pool` on a pool already at its floor (the
share sizes the next dtype switch's pool). Both were audited `held`, "nothing changed".

`kvguard serve` of the tiny model on loopback, with no rules (a rule acting on a loaded
machine would change the engine between two actions): the actions through the admin API over
real HTTP, the audit in a real SQLite file, the counters from /metrics."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_server import Daemon, until

# each action twice in a row: the first changes the engine, the second finds it so
TWICE: list[tuple[str, dict[str, Any]]] = [
    ("enable_fp8_kv", {}),
    ("halt_admission", {"allow_priority": "high"}),
    ("resume_admission", {}),
    ("cap_max_new_tokens", {"n": 5}),
    ("uncap_max_new_tokens", {}),
    ("set_max_num_seqs", {"n": 2}),
    ("restore_batch", {}),
    ("shrink_kv_pool", {"share": 0.5}),
    ("restore_kv_pool", {}),
    ("disable_fp8_kv", {}),
]
# changes nothing the first time: no request is running to evict
ONCE: list[tuple[str, dict[str, Any]]] = [("evict_lowest_priority", {"count": 1})]


NO_RULES = "version: 1\nrules: []\n"
SERVING = "{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, max_num_seqs: %d}"


def no_rules_daemon(tmp: Path, max_num_seqs: int = 8) -> Daemon:
    """A daemon with an empty rules file: only the test's actions change its engine."""
    rules = tmp / "rules.yaml"
    rules.write_text(NO_RULES)
    return Daemon(
        tmp, debug_hooks=False, serving=SERVING % max_num_seqs, extra=f"rules: {{path: {rules}}}\n"
    )


def rows(db: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    except sqlite3.OperationalError:  # the writer has not made its tables yet
        return []
    finally:
        con.close()


def action_rows(db: Path, n: int) -> list[tuple[str, str, str]]:
    """The manual actions' audit rows, once `n` are written: (action, outcome, detail)."""
    sql = "SELECT action, outcome, detail FROM actions WHERE rule = 'manual' ORDER BY id"
    until(lambda: len(rows(db, sql)) >= n, 30, "every manual action's row")
    return rows(db, sql)


def act(d: Daemon, action: str, **params: Any) -> dict[str, Any]:
    r = d.admin("POST", f"/admin/actions/{action}", json=params)
    assert r.status_code == 200, (action, r.text)
    return r.json()


class Acted:
    """The daemon and the answers to every action of TWICE (twice each) and ONCE, in order."""

    def __init__(self, tmp: Path) -> None:
        self.db = tmp / "audit.db"
        self.d = no_rules_daemon(tmp)
        self.answers: list[tuple[str, dict[str, Any]]] = []
        for action, params in [p for pair in TWICE for p in (pair, pair)] + ONCE:
            self.answers.append((action, act(self.d, action, **params)))

    def rows(self, sql: str) -> list[tuple]:
        return rows(self.db, sql)

    def action_rows(self) -> list[tuple[str, str, str]]:
        return action_rows(self.db, len(self.answers))

    def counted(self, action: str, outcome: str) -> float:
        text = httpx.get(self.d.url + "/metrics", timeout=10).text
        m = re.search(
            rf'^kvguard_actions_total{{action="{action}",outcome="{outcome}",rule="manual"}}'
            r" (\S+)$",
            text,
            re.M,
        )
        return 0.0 if m is None else float(m.group(1))


@pytest.fixture(scope="module")
def acted(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a generator fixture
    a = Acted(tmp_path_factory.mktemp("no-change"))
    try:
        yield a
    finally:
        assert a.d.stop() == 0


def expected() -> list[tuple[str, bool]]:
    """(action, changed) for each answer, in order."""
    return [(a, first) for a, _ in TWICE for first in (True, False)] + [(a, False) for a, _ in ONCE]


def test_the_answer_says_whether_anything_changed(acted: Acted) -> None:
    got = [(action, body["changed"]) for action, body in acted.answers]
    assert got == expected()
    for action, body in acted.answers:
        assert body["ok"] is True, (action, body)
        said_so = body["detail"].startswith("nothing changed: ")
        assert said_so is not body["changed"], (action, body["detail"])
    fp8_again = acted.answers[1][1]
    assert fp8_again["detail"] == "nothing changed: KV cache already fp8_e4m3", fp8_again
    assert fp8_again["before"] == fp8_again["after"]
    halt_again = acted.answers[3][1]["detail"]
    assert halt_again == "nothing changed: admission already halted (allowed: high)"


def test_an_action_that_changed_nothing_is_audited_held(acted: Acted) -> None:
    rows = acted.action_rows()
    want = [(a, "applied" if changed else "held") for a, changed in expected()]
    assert [(action, outcome) for action, outcome, _ in rows] == want
    for (_action, outcome, detail), (_, body) in zip(rows, acted.answers, strict=True):
        assert detail.startswith("nothing changed: ") is (outcome == "held"), detail
        assert detail == body["detail"]  # the answer and the audit row say the same


def test_the_applied_counter_counts_only_what_changed(acted: Acted) -> None:
    acted.action_rows()  # every action has settled (its count comes before its row)
    for action, _ in TWICE:
        assert (acted.counted(action, "applied"), acted.counted(action, "held")) == (1, 1), action
    for action, _ in ONCE:
        assert (acted.counted(action, "applied"), acted.counted(action, "held")) == (0, 1), action


def test_a_second_halt_writes_no_second_halted_event(acted: Acted) -> None:
    """The engine's admission events say when admission changed: the halt that found it
    halted, and the resume that found it open, add none."""
    acted.action_rows()
    sql = "SELECT kind FROM events WHERE kind LIKE 'admission_%' ORDER BY id"
    kinds = until(lambda: acted.rows(sql) if len(acted.rows(sql)) >= 2 else None, 30, "events")
    assert [k for (k,) in kinds] == ["admission_halted", "admission_resumed"]


def test_an_action_that_changed_only_what_the_knobs_do_not_show_is_applied(
    tmp_path: Path,
) -> None:
    """A cut of 2, then a reload lowering serving.max_num_seqs to 2: `restore_batch` leaves
    the limit at 2 but lifts the cut, so the next reload raising the limit raises the batch.
    A pool held at its floor (one max_model_len request) by a share of 0.03: a share of 0.01
    leaves the pool as it is, but the next FP8 switch sizes its pool by it."""
    d = no_rules_daemon(tmp_path, max_num_seqs=4)
    try:
        assert act(d, "set_max_num_seqs", n=2)["changed"] is True
        d.config.write_text(d.config.read_text().replace("max_num_seqs: 4", "max_num_seqs: 2"))
        assert d.admin("POST", "/admin/reload").status_code == 200
        restored = act(d, "restore_batch")
        assert restored["before"] == restored["after"] and restored["after"]["max_num_seqs"] == 2
        assert restored["changed"] is True, restored
        assert not restored["detail"].startswith("nothing changed"), restored["detail"]
        d.config.write_text(d.config.read_text().replace("max_num_seqs: 2", "max_num_seqs: 4"))
        assert d.admin("POST", "/admin/reload").status_code == 200
        assert d.admin("GET", "/admin/state").json()["knobs"]["max_num_seqs"] == 4  # no cut

        floor = act(d, "shrink_kv_pool", share=0.03)["after"]["kv_pool_blocks"]
        shrunk = act(d, "shrink_kv_pool", share=0.01)
        assert shrunk["detail"].startswith(f"KV pool already {floor} blocks (held at "), shrunk
        assert shrunk["changed"] is True, shrunk
        again = act(d, "shrink_kv_pool", share=0.01)  # this one changes nothing at all
        assert again["changed"] is False, again
    finally:
        assert d.stop() == 0
    got = [(a, outcome) for a, outcome, _ in action_rows(tmp_path / "audit.db", 5)]
    assert got == [
        ("set_max_num_seqs", "applied"),
        ("restore_batch", "applied"),
        ("shrink_kv_pool", "applied"),
        ("shrink_kv_pool", "applied"),
        ("shrink_kv_pool", "held"),
    ]
