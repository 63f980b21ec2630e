"""The audit and the operator's commands as an incident responder meets them afterwards: an
incident named after its first remedy that changed something, with action details in the
singular for one.

Real parts throughout: SQLite files, the CLI's own entry point, a real tiny engine under the
evaluator."""

from __future__ import annotations

import json
from pathlib import Path

from kvguard.daemon.audit import AuditStore
from tests.test_audit import kvguard
from tests.test_remedy_holds import Live
from tests.test_rules_reload_lifecycle import EVICT, FP8_RUNG, greedy


# -- an incident's summary, an action's detail -----------------------------------------------------
def test_an_incident_is_named_after_its_first_action_that_changed_something(
    tmp_path: Path,
) -> None:
    """The eviction rung opened the incident with nothing of its priority running ("evicted 0
    sequences"), and the FP8 rung, which did act, followed in the same tick: the summary named
    the eviction. It names the FP8 rung now; the eviction's row stays as it was recorded. An
    eviction that did evict opens, and names, its incident itself."""
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    store = AuditStore(url, host="h")
    store.start()
    h = Live(EVICT + FP8_RUNG)
    h.ev.audit = store
    evict = ("evict-low", "evict_lowest_priority", "applied")
    assert h.at(0, kv=0.995) == [evict, ("fp8-kv", "enable_fp8_kv", "applied")]

    h2 = Live(EVICT + FP8_RUNG)
    h2.ev.audit = store
    h2.engine.add_request(list(range(3, 40)), greedy(200), priority="low")
    h2.engine.step()
    assert h2.at(0, kv=0.995) == [evict]
    assert h2.detail() == "evicted 1 sequence of priority <= low"
    assert store.stop(timeout=10)

    rc, out = kvguard("audit", "incidents", "--db", url, "--json")
    assert [i["summary"] for i in json.loads(out)] == ["fp8-kv (kv)", "evict-low (kv)"]
    rc, out = kvguard("audit", "list", "--db", url, "--json")
    details = [a["detail"] for a in json.loads(out)]
    assert details[0] == "evicted 0 sequences of priority <= low"
    assert details[1].startswith("KV cache fp32 -> fp8_e4m3: ")
    assert details[2] == "evicted 1 sequence of priority <= low"
