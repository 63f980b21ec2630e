"""An operator's settings hold as a rule's remedy's do. A manual action that applied (the admin
API's) holds what it set, as `manual`: a rule's act that would loosen it is `held`, and a rule's
undo puts it back to the operator's value, not to the configured one. A manual undo (resume,
uncap...) is the operator's explicit word: it applies, and the rules that held those settings
hold them no more (their undo leaves them alone; one left holding nothing leaves the level).
Also: the stop's `daemon_stop` row lies inside the incident it carries.

Before, only rules held settings: a rule loosened an operator's halt for all to "all but high"
(recorded `applied`), its undo reopened admission, a rule's undo lifted an operator's cap, and
after an operator's resume `/admin/state` still listed the rule's hold and the level stayed up.

The daemon tests run `kvguard serve` of the tiny model over real HTTP (alerts through the
Alertmanager webhook, actions through the admin API, the audit in a real SQLite file); the
others run the evaluator on a fake clock against a real tiny engine (`tests/test_remedy_holds`)."""

from __future__ import annotations

import re
import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvguard.rules.actions import run_action
from tests.test_remedy_holds import Live, alert_rule, settle
from tests.test_server import Daemon, until

RULES = """version: 1
interval: 1s
cooldown: 1s
rules:
  - {name: near-oom, on: "alert:GPUNearOOM", action: halt_admission,
     params: {allow_priority: high}, undo: resume_admission}
  - {name: loose, on: "alert:Loose", action: halt_admission,
     params: {allow_priority: normal}, undo: resume_admission}
  - {name: cap, on: "alert:CapAlert", action: cap_max_new_tokens, params: {n: 5},
     undo: uncap_max_new_tokens}
"""


class Served:
    """A daemon on RULES, with what a test reads of it."""

    def __init__(self, tmp: Path) -> None:
        rules = tmp / "rules.yaml"
        rules.write_text(RULES)
        self.db = tmp / "audit.db"
        self.d = Daemon(tmp, extra=f"rules: {{path: {rules}}}\n")

    def act(self, action: str, **params: Any) -> dict[str, Any]:
        r = self.d.admin("POST", f"/admin/actions/{action}", json=params)
        assert r.status_code == 200, r.text
        return r.json()

    def alert(self, name: str, status: str) -> None:
        a = {
            "status": status,
            "labels": {"alertname": name},
            "startsAt": "2026-12-01T10:00:00Z",
            "fingerprint": f"fp-{name}",
        }
        body = {"version": "4", "status": status, "alerts": [a]}
        r = self.d.admin("POST", "/alertmanager", json=body)
        assert r.status_code == 200 and r.json()["accepted"] == 1, r.text

    def state(self) -> dict[str, Any]:
        return self.d.admin("GET", "/admin/state").json()

    def rule(self, name: str) -> dict[str, Any]:
        return next(r for r in self.state()["rules"] if r["name"] == name)

    def knob(self, name: str) -> Any:
        return self.state()["knobs"][name]

    def level_metric(self) -> float:
        text = httpx.get(self.d.url + "/metrics", timeout=10).text
        return float(re.search(r"^kvguard_degradation_level (\S+)$", text, re.M).group(1))

    def rows(self, rule: str) -> list[tuple[str, str, int, str]]:
        """The audit's action rows of `rule`: (action, outcome, is_undo, detail)."""
        if not self.db.exists():
            return []
        con = sqlite3.connect(self.db)
        try:
            return con.execute(
                "SELECT action, outcome, is_undo, detail FROM actions WHERE rule = ? ORDER BY id",
                (rule,),
            ).fetchall()
        except sqlite3.OperationalError:  # the writer has not made its tables yet
            return []
        finally:
            con.close()

    def wait_rows(self, rule: str, n: int) -> list[tuple[str, str, int, str]]:
        until(lambda: len(self.rows(rule)) >= n, 30, f"{n} audit rows of {rule}")
        return self.rows(rule)

    def complete(self, priority: str = "normal", max_tokens: int = 2) -> openai.types.Completion:
        return self.d.client().completions.create(
            model="tiny",
            prompt="x",
            max_tokens=max_tokens,
            extra_body={"priority": priority, "ignore_eos": True},
        )


@pytest.fixture
def served(tmp_path: Path):  # noqa: ANN201 - a generator fixture
    s = Served(tmp_path)
    try:
        yield s
    finally:
        assert s.d.stop() == 0


def test_a_rule_never_loosens_an_operators_halt_for_all(served: Served) -> None:
    """The operator halts admission for all (maintenance); the GPUNearOOM rule's halt for all
    but `high` is held, `high` requests still get 503, and its undo leaves the halt for all."""
    s = served
    # the hold is taken as the action settles, before its answer: no wait needed
    assert s.act("halt_admission", allow_priority=None)["ok"]
    s.alert("GPUNearOOM", "firing")
    act = s.wait_rows("near-oom", 1)[0]
    assert act[:2] == ("halt_admission", "held"), act  # before: applied, allowed: high
    assert "admission stays at none (held by manual; this rule asks for high)" in act[3]
    assert s.knob("admission_allow_priority") == "none"
    # /admin/state shows the operator's hold beside the rule's (wanted once it goes)
    assert s.state()["manual"] == {"holds": ["admission"], "asked": {"admission": None}}
    assert s.rule("near-oom")["holds"] == ["admission"]
    with pytest.raises(openai.APIStatusError) as refused:
        s.complete(priority="high")
    assert refused.value.status_code == 503
    s.alert("GPUNearOOM", "resolved")
    undo = s.wait_rows("near-oom", 2)[1]
    assert undo[:3] == ("resume_admission", "held", 1), undo  # before: applied, open
    assert "nothing restored: admission (held by manual)" in undo[3]
    assert s.knob("admission_allow_priority") == "none"
    with pytest.raises(openai.APIStatusError):
        s.complete(priority="high")
    # the operator's own word reopens it
    assert s.act("resume_admission")["ok"]
    assert s.complete(priority="low").choices[0].text is not None
    assert s.state()["manual"]["holds"] == []


def test_an_operators_cap_stays_through_a_rules_cap_and_its_undo(served: Served) -> None:
    """Cap 3 by the operator, cap 5 by a rule: the cap stays 3 while the rule fires and once
    it resolves (before, 5, then no cap at all)."""
    s = served
    assert s.act("cap_max_new_tokens", n=3)["ok"]
    s.alert("CapAlert", "firing")
    act = s.wait_rows("cap", 1)[0]
    assert act[:2] == ("cap_max_new_tokens", "held"), act
    assert "token_cap stays at 3 (held by manual; this rule asks for 5)" in act[3]
    assert s.knob("max_new_tokens_cap") == 3
    assert s.rule("cap")["holds"] == ["token_cap"]  # its value is wanted if the operator's goes
    s.alert("CapAlert", "resolved")
    undo = s.wait_rows("cap", 2)[1]
    assert undo[:3] == ("uncap_max_new_tokens", "held", 1), undo
    assert s.knob("max_new_tokens_cap") == 3
    assert s.complete(max_tokens=40).usage.completion_tokens == 3


def test_an_operators_resume_takes_the_setting_from_the_rules_holding_it(served: Served) -> None:
    """A rule halts for all but `high`; the operator resumes admission. It opens, the rule
    holds admission no more (so another rule's looser halt applies, not `held` by it), the
    level drops, and the rule's undo when its alert resolves leaves admission as it is."""
    s = served
    s.alert("GPUNearOOM", "firing")
    assert s.wait_rows("near-oom", 1)[0][:2] == ("halt_admission", "applied")
    assert s.rule("near-oom")["holds"] == ["admission"]
    assert s.state()["degradation_level"] == 1
    resumed = s.act("resume_admission")
    assert resumed["ok"] and s.knob("admission_allow_priority") is None
    shown = s.rule("near-oom")
    assert shown["holds"] == [], shown  # before: ["admission"], though admission was open
    assert shown["state"] == "firing" and shown["overridden"] == ["admission"]
    assert s.state()["degradation_level"] == 0  # it holds nothing: not degraded
    assert s.level_metric() == 0.0
    manual = s.wait_rows("manual", 1)[0]
    assert "overrode what rules held: near-oom (admission)" in manual[3], manual
    assert s.complete(priority="low").choices
    # another rule's halt for all but `normal` is the strictest in force now: it applies
    s.alert("Loose", "firing")
    assert s.wait_rows("loose", 1)[0][:2] == ("halt_admission", "applied")
    assert s.knob("admission_allow_priority") == "normal"
    s.alert("GPUNearOOM", "resolved")
    undo = s.wait_rows("near-oom", 2)[1]
    assert undo[:3] == ("resume_admission", "held", 1), undo
    assert s.knob("admission_allow_priority") == "normal"  # the loose rule's halt stays
    assert s.rule("near-oom")["state"] == "inactive"
    s.alert("Loose", "resolved")
    assert s.wait_rows("loose", 2)[1][:2] == ("resume_admission", "applied")
    assert s.knob("admission_allow_priority") is None


def test_the_daemon_stop_row_lies_inside_the_incident_it_carries(tmp_path: Path) -> None:
    """The stop closes the incident open (a rule's halt in force) and records `daemon_stop`
    with its id: that row was timed after the incident's `closed_at`, so a query of the
    incident's rows by its window missed the row that ends it."""
    s = Served(tmp_path)
    try:
        s.alert("GPUNearOOM", "firing")
        s.wait_rows("near-oom", 1)
        incident = s.state()["incident"]
        assert incident is not None
    finally:
        assert s.d.stop() == 0
    con = sqlite3.connect(s.db)
    try:
        opened, closed = con.execute(
            "SELECT opened_at, closed_at FROM incidents WHERE id = ?", (incident,)
        ).fetchone()
        (stop,) = con.execute(
            "SELECT time FROM events WHERE kind = 'daemon_stop' AND incident = ?", (incident,)
        ).fetchone()
    finally:
        con.close()
    opened_at, closed_at, at = (datetime.fromisoformat(t) for t in (opened, closed, stop))
    assert opened_at <= at <= closed_at, (opened, stop, closed)


# -- the evaluator, on a real engine ------------------------------------------------------------


def manual(h: Live, action: str, **params: Any) -> str:
    """An operator's action as the admin API runs it (no clamp), then handed to the
    evaluator once applied, as `Service.manual_action` does: what the audit detail adds."""
    res = settle(h.engine, run_action(h.engine, action, params))
    assert res.ok, res.detail
    return h.ev.manual_applied(action, params, res)


CAP5 = alert_rule("cap", "cap_max_new_tokens", "n: 5", "uncap_max_new_tokens")
HALT = alert_rule("halt", "halt_admission", "allow_priority: high", "resume_admission")


def test_a_looser_manual_act_applies_and_becomes_the_operators_hold() -> None:
    """The operator's looser cap applies as asked (the operator's word), takes the setting
    from the rule, and the rule's undo leaves it: it is the operator's now."""
    h = Live(CAP5)
    assert h.fire(0, "cap") == [("cap", "cap_max_new_tokens", "applied")]
    assert manual(h, "cap_max_new_tokens", n=10) == "overrode what rules held: cap (token_cap)"
    assert h.knob("max_new_tokens_cap") == 10
    assert h.ev.rule_states()[0]["holds"] == [] and h.ev.level() == 0
    assert h.fire(10, "cap", resolved=True) == [("cap", "uncap_max_new_tokens", "held")]
    assert h.knob("max_new_tokens_cap") == 10
    assert manual(h, "uncap_max_new_tokens") == ""
    assert h.knob("max_new_tokens_cap") is None and h.ev.manual_holds()["holds"] == []


def test_a_rules_stricter_value_goes_back_to_the_operators_when_it_leaves() -> None:
    """The operator caps at 10 first; a rule's 5 is stricter: it applies, and its undo puts
    the cap back at the operator's 10, not off."""
    h = Live(CAP5)
    assert manual(h, "cap_max_new_tokens", n=10) == ""
    assert h.fire(0, "cap") == [("cap", "cap_max_new_tokens", "applied")]
    assert h.knob("max_new_tokens_cap") == 5
    assert h.fire(10, "cap", resolved=True) == [("cap", "uncap_max_new_tokens", "applied")]
    assert h.knob("max_new_tokens_cap") == 10
    assert "what manual still holds" in h.detail()


def test_a_stricter_manual_act_leaves_the_rules_hold_and_its_undo_keeps_it() -> None:
    h = Live(HALT)
    h.fire(0, "halt")
    assert manual(h, "halt_admission", allow_priority=None) == ""  # stricter: nothing taken
    assert h.ev.rule_states()[0]["holds"] == ["admission"] and h.ev.level() == 1
    assert h.fire(10, "halt", resolved=True) == [("halt", "resume_admission", "held")]
    assert h.knob("admission_allow_priority") == "none"


def test_in_dry_run_the_operators_settings_meet_the_simulated_remedies() -> None:
    """A dry run shows what the rules would do: against the operator's halt for all, a halt
    for all but `high` would be held. Its simulated remedy is listed `live: false`, and it
    counts in the level (what the rules would hold)."""
    h = Live(HALT)
    h.ev.dry_run = True
    manual(h, "halt_admission", allow_priority=None)
    assert h.fire(0, "halt") == [("halt", "halt_admission", "held")]
    assert "admission stays at none (held by manual; this rule asks for high)" in h.detail()
    shown = h.ev.rule_states()[0]
    assert shown["holds"] == ["admission"] and shown["live"] is False
    assert h.ev.level() == 1
    assert h.knob("admission_allow_priority") == "none"


def test_an_undo_leaves_what_an_operators_reset_took_and_restores_the_rest() -> None:
    """The OOM chain holds the batch and FP8; the operator switches FP8 off. The chain's
    undo restores the batch and leaves the KV dtype to the operator (an FP8 switch it no
    longer holds: the operator's word stands)."""
    oom = (
        "  - {name: oom, on: engine_oom, action: handle_oom, undo: recover_from_oom,"
        " recover_for: 30s}\n"
    )
    h = Live(oom)
    h.t = 0.0
    assert [d.outcome for d in h.ev.handle_event("engine_oom")] == ["applied"]
    assert h.ev.rule_states()[0]["holds"] == ["batch", "kv_dtype"]
    assert manual(h, "disable_fp8_kv") == "overrode what rules held: oom (kv_dtype)"
    assert h.ev.rule_states()[0]["holds"] == ["batch"] and h.ev.level() == 1
    assert h.knob("max_num_seqs") == 1
    assert h.at(40) == [("oom", "recover_from_oom", "applied")]
    assert "kv_dtype (overridden by manual disable_fp8_kv)" in h.detail()
    assert "disable_fp8_kv" not in h.detail().split("; kept")[0]
    assert h.knob("max_num_seqs") == 8


def test_an_operators_action_waiting_on_the_engine_already_holds_its_settings() -> None:
    """The operator's halt for all is asked for while the engine is inside a long step; a
    rule deciding meanwhile queues behind it. Counted only once applied, the operator's halt
    was then loosened by the rule's halt for all but `high` (recorded `applied`), or reopened
    by the undo of a rule whose alert resolved meanwhile. Held from the request on, both are
    `held`, and the halt for all stays once everything has run."""
    h = Live(HALT)
    params = {"allow_priority": None}
    pending = h.ev.manual_requested("halt_admission", params)
    assert h.fire(0, "halt") == [("halt", "halt_admission", "held")]
    assert "held by manual" in h.detail()
    res = settle(h.engine, run_action(h.engine, "halt_admission", params))  # its turn comes
    assert res.ok and h.ev.manual_applied("halt_admission", params, res) == ""
    h.ev.manual_settled(pending)
    assert h.ev.manual_pending == {} and h.knob("admission_allow_priority") == "none"

    h = Live(HALT)  # the rule's halt in force first; its alert resolves while the operator's waits
    assert h.fire(0, "halt") == [("halt", "halt_admission", "applied")]
    pending = h.ev.manual_requested("halt_admission", params)
    assert h.fire(10, "halt", resolved=True) == [("halt", "resume_admission", "held")]
    res = settle(h.engine, run_action(h.engine, "halt_admission", params))
    assert res.ok
    h.ev.manual_applied("halt_admission", params, res)
    h.ev.manual_settled(pending)
    assert h.knob("admission_allow_priority") == "none"
    # an action that settles without applying (refused, withdrawn) holds nothing afterwards
    pending = h.ev.manual_requested("cap_max_new_tokens", {"n": 3})
    assert h.ev.manual_pending
    h.ev.manual_settled(pending)
    # the operator's holds are what applied (the halt), the settled cap's not moved into them
    assert h.ev.manual_pending == {} and h.ev.manual_holds()["holds"] == ["admission"]
