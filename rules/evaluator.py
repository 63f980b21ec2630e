"""The rule evaluator: a state machine per rule, one decision per tick, an audit record per act.

    inactive --(over threshold)--> pending --(held for `for`)--> firing
    firing --(past the recovery threshold)--> recovering --(held `recover_for`)--> undo -> inactive

Principles: a condition must hold for its `for` before acting; recovery needs the lower
threshold held for `recover_for` (hysteresis); at most one escalation per tick, in file order,
so the cheapest remedy acts first and its effect is seen before the next; undo runs in reverse
order of application, one per tick; a signal that cannot be read leaves the rule where it is,
marked unknown, and never acts; dry-run records what would have happened and changes nothing.
The clock is injected so all of this is testable offline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from kvguard.engine.control import ActionResult
from kvguard.rules.schema import Rule, RuleSet, Signal

log = logging.getLogger("kvguard.rules")
STATES = ("inactive", "pending", "firing", "recovering", "unknown")

SignalReader = Callable[[str, Signal], "float | None"]
Executor = Callable[[str, dict[str, Any]], ActionResult]


class AuditSink(Protocol):
    def record_action(self, **fields: Any) -> None: ...
    def record_event(
        self, kind: str, detail: str = "", data: dict | None = None, incident: str | None = None
    ) -> None: ...
    def open_incident(self, level: int, summary: str) -> str: ...
    def update_incident(
        self,
        incident_id: str,
        peak_level: int | None = None,
        actions_count: int | None = None,
        closed_at: Any = None,
    ) -> None: ...


@dataclass(slots=True)
class RuleState:
    state: str = "inactive"
    since: float = 0.0
    last_action: float | None = None
    unknown: bool = False
    value: float | None = None
    undo_refused_at: float | None = None  # a refused undo is retried after the cooldown

    @property
    def shown(self) -> str:
        return "unknown" if self.unknown else self.state


@dataclass(slots=True)
class Decision:
    """What the evaluator did (or would have done): the rows `rules test` prints and asserts."""

    time: float
    rule: str
    action: str
    trigger: str
    outcome: str
    undo: bool = False
    value: float | None = None
    detail: str = ""


@dataclass(slots=True)
class Stats:
    evaluations: int = 0
    failures: int = 0
    last_duration_s: float = 0.0
    actions: dict[tuple[str, str, str], int] = field(default_factory=dict)
    alerts: dict[tuple[str, str], int] = field(default_factory=dict)


class Evaluator:
    def __init__(
        self,
        rules: RuleSet,
        read_signal: SignalReader,
        execute: Executor,
        audit: AuditSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        dry_run: bool = False,
        host: str = "",
    ) -> None:
        self.rules = rules
        self.read_signal = read_signal
        self.execute = execute
        self.audit = audit
        self.clock = clock
        self.wall_clock = wall_clock
        self.dry_run = dry_run
        self.host = host
        self.states: dict[str, RuleState] = {r.name: RuleState() for r in rules.rules}
        self.applied: list[str] = []  # rules whose action is in force, in order of application
        self.incident: str | None = None
        self.incident_actions = 0
        self.incident_peak = 0
        self.stats = Stats()
        self.decisions: list[Decision] = []
        self._lock = threading.RLock()

    # -- configuration ----------------------------------------------------------------------
    def replace_rules(self, rules: RuleSet) -> None:
        """Swap in a reloaded rule set; rules that keep their name keep their state."""
        with self._lock:
            self.rules = rules
            self.states = {r.name: self.states.get(r.name, RuleState()) for r in rules.rules}
            self.applied = [n for n in self.applied if n in self.states]

    def _rule(self, name: str) -> Rule:
        return next(r for r in self.rules.rules if r.name == name)

    # -- the tick ---------------------------------------------------------------------------
    def tick(self) -> list[Decision]:
        """One evaluation. Signals are read before taking the lock: a slow Prometheus must not
        block readers of the rule states (metrics, /admin/state)."""
        t0 = time.perf_counter()
        try:
            values = self._read_values()
        except Exception:  # noqa: BLE001
            values = {}
        with self._lock:
            start = len(self.decisions)
            try:
                self._tick(values)
            except Exception:
                self.stats.failures += 1
                log.exception("rule evaluation failed")
            finally:
                d = time.perf_counter() - t0
                self.stats.evaluations += 1
                self.stats.last_duration_s = d
            return self.decisions[start:]

    def _tick(self, values: dict[str, float | None]) -> None:
        now = self.clock()
        escalated = False
        for rule in self.rules.rules:
            if rule.is_event:
                continue
            st = self.states[rule.name]
            v = values.get(rule.signal)
            st.unknown, st.value = v is None, v
            if v is None:
                continue
            self._advance(rule, st, v, now)
            if not escalated:
                escalated = self._maybe_act(rule, st, v, now)
        self._maybe_undo(values, now)
        self._maybe_close_incident()

    def _read_values(self) -> dict[str, float | None]:
        used = {r.signal for r in self.rules.rules if r.signal is not None}
        out: dict[str, float | None] = {}
        for name in used:
            try:
                out[name] = self.read_signal(name, self.rules.signals[name])
            except Exception as e:  # noqa: BLE001 - unreadable means unknown, never an action
                log.debug("signal %s unreadable: %s", name, e)
                out[name] = None
        return out

    def _advance(self, rule: Rule, st: RuleState, v: float, now: float) -> None:
        if st.state == "inactive" and rule.triggered(v):
            st.state, st.since = "pending", now
        elif st.state == "pending" and not rule.triggered(v):
            st.state = "inactive"
        elif st.state == "firing":
            if rule.undo is not None and rule.recovered(v):
                st.state, st.since = "recovering", now
            elif rule.undo is None and not rule.triggered(v):
                st.state = "inactive"
        elif st.state == "recovering" and not rule.recovered(v):
            st.state = "firing"

    def _cooled(self, rule: Rule, st: RuleState, now: float) -> bool:
        return st.last_action is None or now - st.last_action >= self.rules.cooldown_of(rule)

    def _maybe_act(self, rule: Rule, st: RuleState, v: float, now: float) -> bool:
        ready = st.state == "pending" and now - st.since >= rule.for_
        repeat = st.state == "firing" and rule.undo is None and rule.triggered(v)
        if not (ready or repeat) or not self._cooled(rule, st, now):
            return False
        outcome = self._act(rule, rule.action, rule.params, "signal", v, undo=False)
        st.last_action = now
        if outcome in ("applied", "dry_run"):
            st.state = "firing"
            if rule.undo is not None and rule.name not in self.applied:
                self.applied.append(rule.name)
        return True  # an attempt, even a refused one, is this tick's one escalation

    def _maybe_undo(self, values: dict[str, float | None], now: float) -> None:
        if not self.applied:
            return
        rule = self._rule(self.applied[-1])
        st = self.states[rule.name]
        if rule.is_event:  # e.g. the OOM chain: undone after `recover_for` without a new event
            if st.state != "firing" or now - (st.last_action or now) < rule.recover_for:
                return
        elif st.unknown or st.state != "recovering" or now - st.since < rule.recover_for:
            return
        refused = st.undo_refused_at
        if refused is not None and now - refused < self.rules.cooldown_of(rule):
            return  # e.g. fp32 KV cannot hold the live tokens yet: not a new try every tick
        outcome = self._act(
            rule, rule.undo or "", rule.undo_params, "signal", values.get(rule.signal), undo=True
        )
        if outcome in ("applied", "dry_run"):
            self.applied.pop()
            st.state, st.last_action, st.undo_refused_at = "inactive", now, None
        else:
            st.undo_refused_at = now

    # -- events -----------------------------------------------------------------------------
    def handle_event(
        self, kind: str, data: dict[str, Any] | None = None, resolved: bool = False
    ) -> list[Decision]:
        """Run event rules for `kind` (engine_oom, preemption_storm, alert:<Name>) right away."""
        with self._lock:
            start = len(self.decisions)
            now = self.clock()
            trigger = "alert" if kind.startswith("alert:") else "event"
            for rule in self.rules.rules:
                if rule.on != kind:
                    continue
                st = self.states[rule.name]
                if resolved:
                    if rule.undo is not None and st.state == "firing":
                        self._act(rule, rule.undo, rule.undo_params, trigger, None, undo=True)
                        st.state = "inactive"
                    continue
                if not self._cooled(rule, st, now):
                    continue
                outcome = self._act(rule, rule.action, rule.params, trigger, None, undo=False)
                st.last_action = now
                if outcome in ("applied", "dry_run"):
                    st.state = "firing" if rule.undo is not None else "inactive"
                    timed = rule.undo is not None and trigger == "event"
                    if timed and rule.name not in self.applied:
                        self.applied.append(rule.name)
            self._maybe_close_incident()
            return self.decisions[start:]

    # -- acting and recording ---------------------------------------------------------------
    def _act(
        self,
        rule: Rule,
        action: str,
        params: dict[str, Any],
        trigger: str,
        value: float | None,
        undo: bool,
    ) -> str:
        if self.dry_run:
            res, outcome, error = None, "dry_run", None
        else:
            try:
                res = self.execute(action, params)
                outcome, error = (
                    ("applied" if res.ok else "refused"),
                    (None if res.ok else res.detail),
                )
            except Exception as e:  # noqa: BLE001 - a failed action is recorded, not fatal
                res, outcome, error = None, "failed", f"{type(e).__name__}: {e}"
                log.error("rule %s: action %s failed: %s", rule.name, action, error)
        if outcome in ("applied", "dry_run") and not undo:
            self._open_incident(rule)
        self._record(rule, action, trigger, value, params, res, outcome, error, undo)
        return outcome

    def level(self) -> int:
        """0 when calm, else 1 + the ladder index of the highest rule in force."""
        ladder = [r for r in self.rules.rules if not r.is_event]
        active = [
            i + 1
            for i, r in enumerate(ladder)
            if self.states[r.name].state in ("firing", "recovering")
        ]
        return max(active, default=0)

    def _open_incident(self, rule: Rule) -> None:
        lvl = max(self.level(), 1)
        if self.incident is None:
            self.incident_actions, self.incident_peak = 0, lvl
            summary = f"{rule.name} ({rule.on or rule.signal})"
            self.incident = (
                self.audit.open_incident(lvl, summary)
                if self.audit
                else f"local-{int(self.wall_clock())}"
            )
        self.incident_peak = max(self.incident_peak, lvl)

    def _maybe_close_incident(self) -> None:
        if self.incident is None or self.applied:
            return
        if any(st.state != "inactive" for st in self.states.values()):
            return
        if self.audit:
            self.audit.update_incident(
                self.incident,
                peak_level=self.incident_peak,
                actions_count=self.incident_actions,
                closed_at=self._wall(),
            )
        log.info("incident %s closed after %d actions", self.incident, self.incident_actions)
        self.incident = None

    def _record(
        self,
        rule: Rule,
        action: str,
        trigger: str,
        value: float | None,
        params: dict[str, Any],
        res: ActionResult | None,
        outcome: str,
        error: str | None,
        undo: bool,
    ) -> None:
        key = (rule.name, action, outcome)
        self.stats.actions[key] = self.stats.actions.get(key, 0) + 1
        detail = res.detail if res else (error or "dry run: nothing changed")
        self.decisions.append(
            Decision(self.clock(), rule.name, action, trigger, outcome, undo, value, detail)
        )
        del self.decisions[:-10000]
        if self.incident is not None:
            self.incident_actions += 1
        log.info(
            "rule %s %s %s -> %s (%s)",
            rule.name,
            "undo" if undo else "act",
            action,
            outcome,
            detail,
        )
        if self.audit is None:
            return
        self.audit.record_action(
            time=self._wall(),
            rule=rule.name,
            action=action,
            trigger=trigger,
            signal=rule.signal or rule.on,
            value=value,
            threshold=rule.threshold() if not rule.is_event else None,
            params=params,
            state_before=res.before if res else None,
            state_after=res.after if res else None,
            outcome=outcome,
            error=error,
            incident=self.incident,
            is_undo=undo,
            detail=detail,
        )
        if self.incident is not None:
            self.audit.update_incident(
                self.incident, peak_level=self.incident_peak, actions_count=self.incident_actions
            )

    def _wall(self) -> datetime:
        return datetime.fromtimestamp(self.wall_clock(), UTC)

    # -- views ------------------------------------------------------------------------------
    def rule_states(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "name": r.name,
                    "state": self.states[r.name].shown,
                    "value": self.states[r.name].value,
                    "signal": r.signal,
                    "on": r.on,
                    "action": r.action,
                    "undo": r.undo,
                }
                for r in self.rules.rules
            ]
