"""The rule evaluator: a state machine per rule, one decision per tick, an audit record per act.

    inactive --(over threshold)--> pending --(held for `for`)--> firing
    firing --(past the recovery threshold)--> recovering --(held `recover_for`)--> undo -> inactive

Principles: a condition must hold for its `for` before acting; recovery needs the lower
threshold held for `recover_for` (hysteresis); at most one escalation per tick, in file order,
so the cheapest remedy acts first and its effect is seen before the next; undo runs in reverse
order of application, one per tick; a signal that cannot be read leaves the rule where it is,
marked unknown, and never acts; dry-run records what would have happened and changes nothing.
The clock is injected so all of this is testable offline.

Two locks, so that nobody who only reads waits on the engine:

- `_turn` serialises evaluations (ticks and events). It is held for a whole tick, actions
  included, so two ticks (the scheduled one and one started by an event, on different
  APScheduler threads) can never both fire a rule or escalate twice. A tick that finds it
  taken is skipped: the holder is evaluating already, and the next tick reads fresh values.
  An event waits for it instead: an alert or its resolution must never be dropped.
- `_lock` guards the rule states, the applied stack, the incident and the decisions. It is
  held only to decide (advance the state machines, choose at most one escalation or one
  undo, mark that rule's action in flight) and to record the result (audit row, incident,
  state update), never while an action is awaited: the engine may take up to two minutes
  to apply one, and `/metrics` and `/admin/state` read the rule states meanwhile.
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

KEPT_DECISIONS = 10_000  # the latest decisions an evaluator keeps


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
    in_flight: str | None = None  # the action being awaited (decided, not yet recorded)

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
class Attempt:
    """An action chosen under the state lock, to be awaited without it and then recorded."""

    rule: Rule
    st: RuleState
    action: str
    params: dict[str, Any]
    trigger: str
    value: float | None
    undo: bool
    dry_run: bool


@dataclass(slots=True)
class Stats:
    evaluations: int = 0
    skipped: int = 0  # ticks not run because another evaluation held the turn
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
        # called with a new incident's id as it opens (under the state lock: must not block)
        self.on_incident: Callable[[str], None] | None = None
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
        self.decisions: list[Decision] = []  # the latest KEPT_DECISIONS
        self.decided = 0  # decisions ever made: what a call returns is counted by this
        self._lock = threading.RLock()  # state: held briefly, never across an action
        self._turn = threading.Lock()  # one evaluation (tick or event) at a time

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
        """One evaluation; nothing (an empty list) when another evaluation holds the turn."""
        return self.try_tick() or []

    def try_tick(self) -> list[Decision] | None:
        """One evaluation, or None when skipped because another one is under way (the
        scheduler's tick and an event's tick may meet; only one of them acts). Signals are
        read outside the state lock: a slow Prometheus must not block readers either."""
        if not self._turn.acquire(blocking=False):
            self.stats.skipped += 1
            log.info("rule tick skipped: %s", self._busy_why())
            return None
        try:
            t0 = time.perf_counter()
            start = self.decided
            try:
                values = self._read_values()
            except Exception:  # noqa: BLE001 - no values: every rule unknown, nothing acts
                values = {}
            try:
                self._tick(values)
            except Exception:
                self.stats.failures += 1
                log.exception("rule evaluation failed")
            finally:
                self.stats.evaluations += 1
                self.stats.last_duration_s = time.perf_counter() - t0
            with self._lock:
                return self._since(start)
        finally:
            self._turn.release()

    def _busy_why(self) -> str:
        with self._lock:
            waiting = [f"{n}: {st.in_flight}" for n, st in self.states.items() if st.in_flight]
        return "awaiting " + ", ".join(waiting) if waiting else "another evaluation is running"

    def _tick(self, values: dict[str, float | None]) -> None:
        with self._lock:
            now = self.clock()
            escalation = self._decide(values, now)
        if escalation is not None:
            self._carry_out(escalation, lambda outcome: self._escalated(escalation, now, outcome))
        with self._lock:
            undo = self._decide_undo(values, now)
        if undo is not None:
            self._carry_out(undo, lambda outcome: self._undone(undo, now, outcome))
        with self._lock:
            self._maybe_close_incident()

    def _decide(self, values: dict[str, float | None], now: float) -> Attempt | None:
        """Advance every rule's state machine; choose at most one escalation, in file order."""
        chosen = None
        for rule in self.rules.rules:
            if rule.is_event:
                continue
            st = self.states[rule.name]
            v = values.get(rule.signal)
            st.unknown, st.value = v is None, v
            if v is None:
                continue
            self._advance(rule, st, v, now)
            if chosen is None and self._should_act(rule, st, v, now):
                chosen = self._attempt(rule, st, rule.action, rule.params, "signal", v, undo=False)
        return chosen

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

    def _should_act(self, rule: Rule, st: RuleState, v: float, now: float) -> bool:
        ready = st.state == "pending" and now - st.since >= rule.for_
        repeat = st.state == "firing" and rule.undo is None and rule.triggered(v)
        return (ready or repeat) and st.in_flight is None and self._cooled(rule, st, now)

    def _escalated(self, a: Attempt, now: float, outcome: str) -> None:
        """An attempt, even a refused one, was this tick's one escalation: the cooldown runs."""
        a.st.last_action = now
        if outcome in ("applied", "dry_run") and self._live(a):
            a.st.state = "firing"
            if self._rule(a.rule.name).undo is not None and a.rule.name not in self.applied:
                self.applied.append(a.rule.name)

    def _decide_undo(self, values: dict[str, float | None], now: float) -> Attempt | None:
        """The undo of the last remedy applied, once its rule has recovered long enough."""
        if not self.applied:
            return None
        rule = self._rule(self.applied[-1])
        st = self.states[rule.name]
        if st.in_flight is not None:
            return None
        if rule.is_event:  # e.g. the OOM chain: undone after `recover_for` without a new event
            if st.state != "firing" or now - (st.last_action or now) < rule.recover_for:
                return None
        elif st.unknown or st.state != "recovering" or now - st.since < rule.recover_for:
            return None
        refused = st.undo_refused_at
        if refused is not None and now - refused < self.rules.cooldown_of(rule):
            return None  # e.g. fp32 KV cannot hold the live tokens yet: not a new try every tick
        value = values.get(rule.signal)
        return self._attempt(rule, st, rule.undo or "", rule.undo_params, "signal", value, True)

    def _undone(self, a: Attempt, now: float, outcome: str) -> None:
        if outcome not in ("applied", "dry_run"):
            a.st.undo_refused_at = now
            return
        if a.rule.name in self.applied:  # still the last one: nothing else acted meanwhile
            self.applied.remove(a.rule.name)
        a.st.state, a.st.last_action, a.st.undo_refused_at = "inactive", now, None

    # -- events -----------------------------------------------------------------------------
    def handle_event(
        self, kind: str, data: dict[str, Any] | None = None, resolved: bool = False
    ) -> list[Decision]:
        """Run event rules for `kind` (engine_oom, preemption_storm, alert:<Name>) right away.
        Waits for a tick under way rather than skip: an alert or its resolution is acted on
        once, never dropped."""
        with self._turn:
            with self._lock:
                start = self.decided
                now = self.clock()
                names = [r.name for r in self.rules.rules if r.on == kind]
            trigger = "alert" if kind.startswith("alert:") else "event"
            for name in names:
                with self._lock:
                    a = self._decide_event(name, trigger, now, resolved)
                if a is None:
                    continue
                if resolved:
                    self._carry_out(a, lambda _outcome, a=a: self._resolved(a))
                else:
                    self._carry_out(a, lambda outcome, a=a: self._event_acted(a, now, outcome))
            with self._lock:
                self._maybe_close_incident()
                return self._since(start)

    def _since(self, start: int) -> list[Decision]:
        """The decisions made since `decided` was `start` (a list kept to its latest
        KEPT_DECISIONS: its length stops growing, so it cannot say what is new)."""
        n = min(self.decided - start, len(self.decisions))
        return self.decisions[len(self.decisions) - n :] if n > 0 else []

    def _decide_event(self, name: str, trigger: str, now: float, resolved: bool) -> Attempt | None:
        rule = next((r for r in self.rules.rules if r.name == name), None)
        if rule is None:  # reloaded away while an earlier rule's action was awaited
            return None
        st = self.states[name]
        if resolved:
            if rule.undo is None or st.state != "firing" or st.in_flight is not None:
                return None
            return self._attempt(rule, st, rule.undo, rule.undo_params, trigger, None, True)
        if st.in_flight is not None or not self._cooled(rule, st, now):
            return None
        return self._attempt(rule, st, rule.action, rule.params, trigger, None, undo=False)

    def _resolved(self, a: Attempt) -> None:
        a.st.state = "inactive"  # the alert is gone whatever the undo answered

    def _event_acted(self, a: Attempt, now: float, outcome: str) -> None:
        a.st.last_action = now
        if outcome not in ("applied", "dry_run") or not self._live(a):
            return
        has_undo = self._rule(a.rule.name).undo is not None
        a.st.state = "firing" if has_undo else "inactive"
        timed = has_undo and a.trigger == "event"
        if timed and a.rule.name not in self.applied:
            self.applied.append(a.rule.name)

    # -- acting and recording ---------------------------------------------------------------
    def _attempt(
        self,
        rule: Rule,
        st: RuleState,
        action: str,
        params: dict[str, Any],
        trigger: str,
        value: float | None,
        undo: bool,
    ) -> Attempt:
        """Under the state lock: mark the rule busy so nothing chooses it again meanwhile."""
        st.in_flight = action
        return Attempt(rule, st, action, params, trigger, value, undo, self.dry_run)

    def _carry_out(self, a: Attempt, settle: Callable[[str], None]) -> str:
        """Await the action with no lock held, then record it and let `settle` move the state
        machine, under the lock, in the order the old single-lock code did."""
        if not a.undo:  # before it runs, so that the events it causes are the incident's
            with self._lock:
                self._open_incident(a.rule)
        try:
            res, outcome, error = self._run(a)
        finally:
            with self._lock:
                a.st.in_flight = None
        with self._lock:
            self._record(
                a.rule, a.action, a.trigger, a.value, a.params, res, outcome, error, a.undo
            )
            settle(outcome)
            if self.incident is not None:  # its peak counts the rung that just acted
                self.incident_peak = max(self.incident_peak, self.level())
                if self.audit:
                    self.audit.update_incident(
                        self.incident,
                        peak_level=self.incident_peak,
                        actions_count=self.incident_actions,
                    )
        return outcome

    def _run(self, a: Attempt) -> tuple[ActionResult | None, str, str | None]:
        if a.dry_run:
            return None, "dry_run", None
        try:
            res = self.execute(a.action, a.params)
        except Exception as e:  # noqa: BLE001 - a failed action is recorded, not fatal
            error = f"{type(e).__name__}: {e}"
            log.error("rule %s: action %s failed: %s", a.rule.name, a.action, error)
            return None, "failed", error
        return res, ("applied" if res.ok else "refused"), (None if res.ok else res.detail)

    def _live(self, a: Attempt) -> bool:
        """False when a reload removed the rule while its action was awaited: the act is
        recorded, but a rule that no longer exists is not put in force (nor on the undo stack)."""
        if self.states.get(a.rule.name) is a.st:
            return True
        log.info("rule %s was reloaded away while %s ran: not tracked", a.rule.name, a.action)
        return False

    def level(self) -> int:
        """0 when calm, else 1 + the ladder index of the highest rule in force."""
        with self._lock:
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
            if self.on_incident is not None:
                self.on_incident(self.incident)

    def close_at_stop(self) -> None:
        """The daemon stops: the open incident ends with it (the next start begins calm, its
        remedies gone with the engine), so none stays open forever."""
        with self._lock:
            if self.incident is not None:
                self._close_incident("the daemon stops")

    def _maybe_close_incident(self) -> None:
        if self.incident is None or self.applied:
            return
        if any(st.state != "inactive" for st in self.states.values()):
            return
        self._close_incident(f"after {self.incident_actions} actions")

    def _close_incident(self, why: str) -> None:
        assert self.incident is not None
        if self.audit:
            self.audit.update_incident(
                self.incident,
                peak_level=self.incident_peak,
                actions_count=self.incident_actions,
                closed_at=self._wall(),
            )
        log.info("incident %s closed %s", self.incident, why)
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
        self.decided += 1
        del self.decisions[:-KEPT_DECISIONS]
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
            threshold=None
            if rule.is_event
            else (rule.recovery_threshold() if undo else rule.threshold()),
            params=params,
            state_before=res.before if res else None,
            state_after=res.after if res else None,
            outcome=outcome,
            error=error,
            incident=self.incident,
            is_undo=undo,
            detail=detail,
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
                    "in_flight": self.states[r.name].in_flight,
                }
                for r in self.rules.rules
            ]
