"""The rule evaluator: a state machine per rule, one decision per tick, an audit record per act.

    inactive --(over threshold)--> pending --(held for `for`)--> firing
    firing --(past the recovery threshold)--> recovering --(held `recover_for`)--> undo -> inactive

Principles: a condition must hold for its `for` before acting; recovery needs the lower
threshold held for `recover_for` (hysteresis); at most one escalation per tick, in file order,
so the cheapest remedy acts first and its effect is seen before the next (one that changed
nothing, refused or a one-off with nothing to do, leaves the tick to the next); undo runs
in reverse order of application, one per tick, a signal's higher rung before its lower ones
whatever order a spike applied them in (`_stack_undo`); a signal that cannot be read leaves the rule
where it is, marked unknown, and never acts; dry-run records what would have happened and
changes nothing.
The clock is injected so all of this is testable offline.

Two locks, so that nobody who only reads waits on the engine:

- `_turn` serialises evaluations (ticks and events). It is held for a whole tick, actions
  included, so two ticks (the rule ticker's and one an event started, on a scheduler worker
  thread) can never both fire a rule or escalate twice. A tick that finds it
  taken is skipped: the holder is evaluating already, and the next tick reads fresh values.
  An event waits for it instead: an alert or its resolution must never be dropped.
- `_lock` guards the rule states, the applied stack, the incident and the decisions. It is
  held only to decide (advance the state machines, choose at most one escalation or one
  undo, mark that rule's action in flight) and to record the result (audit row, incident,
  state update), never while an action is awaited: the engine may take up to two minutes
  to apply one, and `/metrics` and `/admin/state` read the rule states meanwhile.

An action the engine took but is still inside when the executor stops waiting
(ActionStillApplying) does not hold the turn: its rule stays `in_flight` (nothing chooses it
again, no incident closes) and the action is recorded, and its rule's state settled, when its
result comes. One still unsettled when the daemon stops is recorded failed, saying so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from kvguard.engine.control import ActionResult
from kvguard.rules.actions import (
    ACTIONS,
    SET_TO,
    ActionStillApplying,
    ActionWithdrawn,
    asked,
    parse_params,
    restore_alone,
    set_to,
    settings_set,
    strictness,
    targets,
)
from kvguard.rules.schema import Rule, RuleSet, Signal

log = logging.getLogger("kvguard.rules")
SKIP_LOG_S = 60.0  # a skipped tick is logged at most this often (each is counted)
STATES = ("inactive", "pending", "firing", "recovering", "unknown")
RETIRING = "retiring"  # a remedy a reload took from its rule, in force until its undo applies

SignalReader = Callable[[str, Signal], "float | None"]
Executor = Callable[[str, dict[str, Any]], ActionResult]

KEPT_DECISIONS = 10_000  # the latest decisions an evaluator keeps
MANUAL = "manual"  # the rule an operator's action is counted and audited under
# the trigger an undo a reload made is audited with (of a rule it removed or gave another
# trigger or remedy, or of every rule at a dry-run switch): no operator asked for it
RELOAD = "reload"


def _incident_summary(rule: Rule) -> str:
    return f"{rule.name} ({rule.on or rule.signal})"


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
        summary: str | None = None,
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
    holds: frozenset[str] = frozenset()  # the settings its remedy in force set (SETTINGS)
    # the value it asks of each setting it holds (the strictest asked is in force), where known
    asked: dict[str, Any] = field(default_factory=dict)
    live: bool = False  # that remedy was applied for real, not in a dry run
    resolved: bool = False  # its alert resolved, and the undo is still to be done (retried)
    # an event rule's last event, acted on or not (one inside the cooldown is skipped): its
    # remedy is undone `recover_for` after this, not after its last action
    last_event: float | None = None
    # where its rule stood in the rules file (from 1) when a reload or a dry-run switch set
    # this state aside: a remedy of it still in force (retiring) counts there in the level
    position: int = 0
    # the settings an operator's action took from its remedy in force (setting -> that
    # action): it holds them no more, and its undo leaves them as the operator set them
    overridden: dict[str, str] = field(default_factory=dict)

    @property
    def holds_nothing_left(self) -> bool:
        """Its remedy is in force, but an operator's action took every setting it held:
        nothing of it is in force, so it does not count in the level."""
        return bool(self.overridden) and not self.holds

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
    # an undo's settings other remedies in force (or the operator, `manual`) still hold, or
    # that an operator's action took from its remedy (no rules: []), or an act's that it would
    # loosen (another remedy in force asks for a stricter value): setting -> those rules
    held: dict[str, list[str]] = field(default_factory=dict)
    # an undo's held settings its remedy holds stricter than every other holder: each goes to
    # the strictest value the others ask for (setting -> (value, the rules asking for it))
    restore: dict[str, tuple[Any, list[str]]] = field(default_factory=dict)
    kept: str = ""  # what `held` leaves as it is, and why: the audit row's detail says so
    note: str = ""  # why it runs, where not the rule's own signal (a reload)
    # when it was decided (wall clock, set just before it runs): the audit row's time, so that
    # the events the action causes while it runs follow it in a timeline, not precede it
    decided_at: datetime | None = None


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
        # remedies in force of rules a reload removed or changed (or of a dry-run switch):
        # undone first, one a tick, with the rule they were applied by
        self.retiring: list[tuple[Rule, RuleState, str]] = []  # (rule, its state, why)
        self.incident: str | None = None
        self.incident_actions = 0
        self.incident_peak = 0
        # the rule the incident's summary names, and whether an action of it changed something
        # (`_name_incident`)
        self.incident_named: tuple[str, bool] = ("", False)
        self.stats = Stats()
        # the last skipped tick logged: when, the skips counted then, why
        self._skip_logged: tuple[float, int, str] | None = None
        self.decisions: list[Decision] = []  # the latest KEPT_DECISIONS
        self.decided = 0  # decisions ever made: what a call returns is counted by this
        self._lock = threading.RLock()  # state: held briefly, never across an action
        # actions the engine took and had not finished when the executor stopped waiting:
        # each is recorded, and its rule settled, when its result comes (`_settle_later`)
        self.late: list[Attempt] = []
        self._turn = threading.Lock()  # one evaluation (tick or event) at a time
        # the operator's settings: what the admin API's actions that applied set, held as a
        # rule's remedy in force holds its own (`manual_applied`), so that no rule loosens
        # them and a rule's undo puts them back to what the operator asked. Real whatever the
        # mode: a dry run's simulated remedies meet them as real ones would
        self.manual = RuleState(live=True)
        # the operator's actions asked for and not yet applied (`manual_requested`): they hold
        # what they will set from the moment they are asked for, as a rule's decision taken
        # meanwhile runs after them on the engine and must not loosen or undo them
        self.manual_pending: dict[int, RuleState] = {}
        self._pending_seq = 0
        # the incident closed last, and when: the daemon's stop event is timed by it
        self.last_closed: tuple[str, datetime] | None = None

    # -- configuration ----------------------------------------------------------------------
    def replace_rules(self, rules: RuleSet) -> list[str]:
        """Swap in a reloaded rule set. A rule that keeps its name, its trigger (the event or
        alert it is `on`, or a signal) and its remedy (action, undo and their params, with
        their defaults filled in: writing a default out or leaving it out changes nothing)
        keeps its state, thresholds and timings taken from the new file. The remedy in force
        of a rule removed, or given another trigger or remedy, is undone at the next
        evaluations with the undo it was applied with (`retiring`; a setting another remedy
        in force holds stays), and the new rule starts afresh: it acts again if its condition
        still holds, after its `for` (a real change, a stricter one included, relaxes the old
        remedy first). Until its undo applies, a retiring remedy is in force: it holds its
        settings, counts in the level and is listed in `rule_states`. Returns the names of
        the rules that start afresh (new, or given another trigger or remedy): an alert rule
        among them acts again only on its alert, which the caller knows still fires (the
        control plane's `firing`)."""
        with self._lock:
            after = {r.name: r for r in rules.rules}
            kept: dict[str, RuleState] = {}
            for i, old in enumerate(self.rules.rules):
                st = self.states.get(old.name)
                new = after.get(old.name)
                if st is None:
                    continue
                if new is not None and _remedy(new) == _remedy(old) and new.on == old.on:
                    kept[old.name] = st
                    continue
                st.position = i + 1  # set aside: a remedy of it in force counts there
                if self._in_force(old, st):
                    if new is None:
                        why = "removed"
                    elif new.on != old.on:  # another event or alert, or a signal for either
                        why = "given another trigger"
                    else:
                        why = "given another remedy"
                    self._retire(old, st, f"rule {why} by a reload")
            self.rules = rules
            self.states = {r.name: kept.get(r.name) or RuleState() for r in rules.rules}
            self.applied = [n for n in self.applied if n in kept]
            return [r.name for r in rules.rules if r.name not in kept]

    def set_dry_run(self, dry_run: bool) -> bool:
        """Switch dry-run mode (a reload). Every rule starts afresh in the new mode: remedies
        applied for real are undone for real (retiring: the rules no longer control the
        engine, or act again live), those only simulated are forgotten (nothing to undo).
        True where it switched (every rule starts afresh)."""
        with self._lock:
            if dry_run == self.dry_run:
                return False
            for i, rule in enumerate(self.rules.rules):
                st = self.states[rule.name]
                st.position = i + 1
                if self._in_force(rule, st) and st.live:
                    self._retire(rule, st, f"dry run switched {'on' if dry_run else 'off'}")
            self.states = {r.name: RuleState() for r in self.rules.rules}
            self.applied = []
            self.dry_run = dry_run
            return True

    @staticmethod
    def _in_force(rule: Rule, st: RuleState) -> bool:
        return rule.undo is not None and st.state in ("firing", "recovering")

    def _retire(self, rule: Rule, st: RuleState, why: str) -> None:
        if any(r[1] is st for r in self.retiring):  # retired by the reload already
            return
        log.info("rule %s: %s: its remedy in force is undone (%s)", rule.name, why, rule.undo)
        st.undo_refused_at = None
        self.retiring.append((rule, st, why))

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
            self._skipped()
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

    def _skipped(self) -> None:
        """Count a skipped tick; log it where its reason is new, else at most every SKIP_LOG_S,
        with the number skipped since the last such line: a burst of alerts or engine events
        meets a running evaluation many times a second, and each line would say the same."""
        now, why = self.clock(), self._busy_why()
        with self._lock:
            self.stats.skipped += 1
            last = self._skip_logged
            if last is not None and last[2] == why and now - last[0] < SKIP_LOG_S:
                return
            more = self.stats.skipped - 1 - (last[1] if last else 0)
            self._skip_logged = (now, self.stats.skipped, why)
        log.info(
            "rule tick skipped: %s%s",
            why,
            f" ({more} more since the last such line)" if more else "",
        )

    def _busy_why(self) -> str:
        with self._lock:
            waiting = [f"{n}: {st.in_flight}" for n, st in self.states.items() if st.in_flight]
        return "awaiting " + ", ".join(waiting) if waiting else "another evaluation is running"

    def _tick(self, values: dict[str, float | None]) -> None:
        with self._lock:
            now = self.clock()
            escalation = self._decide(values, now)
        passed: list[str] = []  # rules whose attempt this tick gave the escalation back
        while escalation is not None:
            given_back: list[bool] = []
            self._carry_out(
                escalation,
                lambda outcome, res, a=escalation, back=given_back: back.append(
                    self._escalated(a, now, outcome, res)
                ),
            )
            if not any(given_back):  # it took the escalation (or is still applying)
                break
            passed.append(escalation.rule.name)
            with self._lock:
                escalation = self._ready(values, now, passed)
        with self._lock:
            undo = self._decide_undo(values, now)
        if undo is not None:
            self._carry_out(undo, lambda outcome, res: self._undone(undo, now, outcome, res))
        with self._lock:
            self._maybe_close_incident()

    def _decide(self, values: dict[str, float | None], now: float) -> Attempt | None:
        """Advance every rule's state machine; choose at most one escalation, in file order."""
        for rule in self.rules.rules:
            if rule.is_event:
                continue
            st = self.states[rule.name]
            v = values.get(rule.signal)
            st.unknown, st.value = v is None, v
            if v is None:  # unseen time does not count towards `for` or `recover_for`
                if st.state == "pending":
                    st.state = "inactive"
                elif st.state == "recovering":
                    st.state = "firing"
                elif st.state == "firing" and rule.undo is None:
                    st.state = "inactive"  # nothing in force: calm, not degraded, while unseen
                continue
            self._advance(rule, st, v, now)
        return self._ready(values, now, ())

    def _ready(
        self, values: dict[str, float | None], now: float, passed: Collection[str]
    ) -> Attempt | None:
        """The first rule in the file ready to act, but those in `passed` (their attempts this
        tick gave the escalation back: see `_escalated`)."""
        for rule in self.rules.rules:
            if rule.is_event or rule.name in passed:
                continue
            st = self.states[rule.name]
            v = values.get(rule.signal)
            if v is not None and self._should_act(rule, st, v, now):
                return self._attempt(rule, st, rule.action, rule.params, "signal", v, undo=False)
        return None

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

    def _lasted(self, elapsed: float, duration: float) -> bool:
        """Whether `elapsed`, between two clock readings taken at evaluations, counts as
        `duration` (a rule's `for`, `recover_for`, a cooldown). Ticks are due every `interval`
        but never run exactly on time: read bare, a `for: 10s` at a 5 s interval held from a
        tick at 0.003 s fell short at the tick at 9.999 s, and acted a whole tick late. So a
        duration counts as met less a slack below one tick: a tenth of the interval, and at
        most half the duration, so that one shorter than the interval still takes two
        readings (and a duration of 0 is met at once)."""
        slack = min(0.1 * self.rules.interval, duration / 2) if duration > 0 else 0.0
        return elapsed >= duration - slack

    def _cooled(self, rule: Rule, st: RuleState, now: float) -> bool:
        return st.last_action is None or self._lasted(
            now - st.last_action, self.rules.cooldown_of(rule)
        )

    def _should_act(self, rule: Rule, st: RuleState, v: float, now: float) -> bool:
        ready = st.state == "pending" and self._lasted(now - st.since, rule.for_)
        repeat = st.state == "firing" and rule.undo is None and rule.triggered(v)
        return (ready or repeat) and st.in_flight is None and self._cooled(rule, st, now)

    def _escalated(self, a: Attempt, now: float, outcome: str, res: ActionResult | None) -> bool:
        """An attempt, even a refused one, starts its rule's cooldown. True where it gives the
        tick's one escalation back, having changed nothing (no effect to wait for): refused,
        or a one-off (no undo: it repeats while its condition holds) whose action found
        nothing to do (an eviction of 0 sequences, a batch already at its `min`) or left a
        setting another remedy holds stricter (`held`). The next ready rule may then act in
        the same tick: an eviction with nothing to evict, repeating every cooldown, must not
        hold back the rungs below it for good. A rule with an undo that changed nothing is in
        force all the same (its value is wanted): it keeps the escalation."""
        a.st.last_action = now
        if self._in_force_now(a, outcome, res) and a.rule.name not in self.applied:
            self.applied.append(a.rule.name)
        if outcome == "refused":
            return True
        one_off = a.rule.undo is None
        changed_nothing = res is not None and res.changed_nothing()
        return one_off and (outcome == "held" or (outcome == "applied" and changed_nothing))

    def _in_force_now(self, a: Attempt, outcome: str, res: ActionResult | None) -> bool:
        """Settle an action that applied (or was simulated, or held back: another remedy in
        force holds the setting stricter, and this one's value is wanted once that one is
        undone): its rule fires, holding the settings it set, each at the value it asked.
        True where the rule is tracked and has an undo (its remedy is on the undo stack's
        side of things); a rule reloaded away meanwhile retires its remedy."""
        if outcome not in ("applied", "dry_run", "held"):
            return False
        st = a.st
        if a.rule.undo is None:  # a one-off (evict): a threshold rule may repeat while firing
            st.state = "inactive" if a.rule.is_event else "firing"
            return False
        # an event rule acting again while in force adds to what it holds (the OOM chain's
        # second run skips FP8, already on: the first run's FP8 is still its remedy)
        again = st.state in ("firing", "recovering")
        before = st.holds if again else frozenset()
        done = res if outcome == "applied" else None
        st.state = "firing"
        st.holds = before | settings_set(a.action, done)
        st.asked = {**(st.asked if again else {}), **asked(a.action, a.params, done)}
        st.live = not a.dry_run
        # what it set again is its own again, whatever an operator did to its earlier act
        st.overridden = {
            s: how for s, how in (st.overridden if again else {}).items() if s not in st.holds
        }
        if outcome != "held":
            self._take_from_retiring(st)
        if self._live(a):
            return True
        self._retire(a.rule, st, "rule reloaded away while its action ran")
        return False

    def _take_from_retiring(self, st: RuleState) -> None:
        """An act that set a setting looser than a retiring remedy holds it (an act does not
        count those: `_holders`) took that setting from it: the retiring remedy holds it no
        more, so its undo leaves it to the act (`held`, `nothing restored`) rather than set
        the value the act already set and count that as applied (a reload giving an alert
        rule's cap of 5 a cap of 10: the new act sets 10, and the old undo changes nothing)."""
        for _, other, _ in self.retiring:
            if other is st or other.live != st.live:
                continue
            taken = {
                s
                for s in other.holds & st.holds
                if _looser(s, st.asked.get(s, _UNKNOWN), other.asked.get(s, _UNKNOWN))
            }
            if taken:
                other.holds -= taken
                other.asked = {s: v for s, v in other.asked.items() if s not in taken}

    def _decide_undo(self, values: dict[str, float | None], now: float) -> Attempt | None:
        """At most one undo a tick: first a remedy a reload retired (trigger `reload`), then an
        alert's whose undo was refused when it resolved, then the last remedy applied, once
        its rule has recovered long enough (`_stack_undo`)."""
        for rule, st, why in self.retiring:
            if st.in_flight is None and self._undo_cooled(rule, st, now):
                a = self._undo_attempt(rule, st, RELOAD, None, dry_run=not st.live)
                a.note = why
                return a
        for rule in self.rules.rules:
            st = self.states[rule.name]
            if st.resolved and st.in_flight is None and self._undo_cooled(rule, st, now):
                return self._undo_attempt(rule, st, "alert", None)
        return self._stack_undo(values, now)

    def _stack_undo(self, values: dict[str, float | None], now: float) -> Attempt | None:
        """One remedy in force is next to be undone, once its rule has recovered long enough;
        the rest wait for it (as a stack: one order, so nothing waits on itself). Mostly the
        last applied, but a rung of a signal's ladder (the rules on one signal, or on signals
        of one pool, `RuleSet.ladder_of`: the batch cut on KV demand is a rung of the KV
        usage ladder; or on one event) counts as applied when any rung below it in the rules
        file was, the higher rung going first on a tie: on a sudden spike the admission halt
        (0.99, no `for`) is applied before the batch cut (0.92, `for: 10s`), and had been
        undone after it, keeping admission closed for the cut's minute of recovery after usage
        fell, refusing requests on an idle server. In a ladder climbed rung by rung that is the order of application
        reversed, and across ladders it still is (the OOM chain that acted after a batch cut is
        undone before it: each restores what the one before it set)."""
        if not self.applied:
            return None
        place = {r.name: i for i, r in enumerate(self.rules.rules)}
        rules = {name: self._rule(name) for name in self.applied}

        def ladder(rule: Rule) -> tuple[str, str | None]:
            if rule.signal is not None:
                return ("signal", self.rules.ladder_of(rule.signal))
            return ("on", rule.on)

        def applied_at(name: str) -> int:  # the latest application of it or a rung below it
            return max(
                at
                for at, other in enumerate(self.applied)
                if ladder(rules[other]) == ladder(rules[name]) and place[other] <= place[name]
            )

        name = max(self.applied, key=lambda n: (applied_at(n), place[n]))
        if self.states[name].in_flight is not None:
            return None
        return self._undo_if_recovered(rules[name], values, now)

    def _undo_if_recovered(
        self, rule: Rule, values: dict[str, float | None], now: float
    ) -> Attempt | None:
        st = self.states[rule.name]
        if rule.is_event:  # e.g. the OOM chain: undone after `recover_for` without a new event
            seen = [t for t in (st.last_action, st.last_event) if t is not None]
            last = max(seen, default=now)
            if st.state != "firing" or not self._lasted(now - last, rule.recover_for):
                return None
        elif (
            st.unknown
            or st.state != "recovering"
            or not self._lasted(now - st.since, rule.recover_for)
        ):
            return None
        if not self._undo_cooled(rule, st, now):
            return None  # e.g. fp32 KV cannot hold the live tokens yet: not a new try every tick
        if rule.is_event:  # audited as its act was (an alert rule's undo is `alert`)
            return self._undo_attempt(rule, st, "event", None)
        return self._undo_attempt(rule, st, "signal", values.get(rule.signal))

    def _undo_cooled(self, rule: Rule, st: RuleState, now: float) -> bool:
        refused = st.undo_refused_at
        return refused is None or self._lasted(now - refused, self.rules.cooldown_of(rule))

    def _undo_attempt(
        self,
        rule: Rule,
        st: RuleState,
        trigger: str,
        value: float | None,
        dry_run: bool | None = None,
    ) -> Attempt:
        """The undo of `rule`'s remedy, knowing which of its settings other remedies in force
        still hold (those it leaves alone: see `_run`)."""
        a = self._attempt(rule, st, rule.undo or "", rule.undo_params, trigger, value, True)
        if dry_run is not None:
            a.dry_run = dry_run
        settings = ACTIONS[a.action].settings
        holders = self._holders(st, settings, live=not a.dry_run, retiring=True)
        a.held = {s: [n for n, _ in hs] for s, hs in holders.items()}
        a.restore = self._restore_to(st, holders)
        # an operator's action took these from the remedy: they stay as the operator set them
        for s in settings & st.overridden.keys():
            a.held.setdefault(s, [])
        a.kept = ", ".join(
            f"{s} (held by {', '.join(r)})"
            if r
            else f"{s} (overridden by {MANUAL} {st.overridden[s]})"
            for s, r in sorted(a.held.items())
            if s not in a.restore
        )
        return a

    def _holders(
        self, st: RuleState, settings: frozenset[str], live: bool, retiring: bool = False
    ) -> dict[str, list[tuple[str, RuleState]]]:
        """Which of `settings` the remedies in force of rules other than `st`'s hold, and by
        whom (the rule's name and state, in file order): those applied for real where `live`,
        else those only simulated (a dry run's remedies hold nothing real). With `retiring`
        (an undo), the retiring remedies too, after them (`retiring NAME`: a reload took
        them from their rule and their undo has not applied yet, e.g. refused while the live
        tokens do not fit the full-precision pool): another rule's undo leaves what they set
        to their own undo. A rule's act does not count them: the reload no longer wants
        them, and a changed rule's looser remedy applies at once. The operator's settings
        (`manual`, see `manual_applied`) count last, live or not: they are real either way."""
        others = self._remedies_in_force(retiring)
        held: dict[str, list[tuple[str, RuleState]]] = {}
        for name, other in others:
            if other is st or other.resolved or other.live != live:
                continue
            for setting in sorted(other.holds & settings):
                held.setdefault(setting, []).append((name, other))
        for m in (self.manual, *self.manual_pending.values()):
            for setting in sorted(m.holds & settings):
                held.setdefault(setting, []).append((MANUAL, m))
        return held

    def _held_by_others(
        self, st: RuleState, settings: frozenset[str], live: bool
    ) -> dict[str, list[str]]:
        """`_holders` of an act, by name only."""
        return {s: [n for n, _ in hs] for s, hs in self._holders(st, settings, live).items()}

    def _restore_to(
        self, st: RuleState, holders: dict[str, list[tuple[str, RuleState]]]
    ) -> dict[str, tuple[Any, list[str]]]:
        """The held settings that `st`'s remedy, leaving, holds stricter than every other
        holder: each goes to the strictest value the others ask for (not to its configured
        value, nor stays at the leaving remedy's), with the rules that ask for it."""
        out: dict[str, tuple[Any, list[str]]] = {}
        for setting, hs in holders.items():
            values = [other.asked.get(setting, _UNKNOWN) for _, other in hs]
            if (
                setting not in SET_TO
                or setting not in st.asked
                or any(v is _UNKNOWN for v in values)
            ):
                continue  # FP8 and offload: one value, in force while any remedy holds it
            best = min(values, key=lambda v: strictness(setting, v))
            if strictness(setting, st.asked[setting]) < strictness(setting, best):
                out[setting] = (
                    best,
                    [n for (n, _), v in zip(hs, values, strict=True) if v == best],
                )
        return out

    def _loosened(
        self, st: RuleState, action: str, params: dict[str, Any], live: bool
    ) -> tuple[dict[str, list[str]], str]:
        """The settings an act (not an undo) would loosen, with the rules whose remedies in
        force hold them stricter, and what stays: it leaves those alone (see `_run`). An
        action that puts settings back to their configured state (a rule may take
        `resume_admission` as its action) loosens every one another remedy holds."""
        spec = ACTIONS[action]
        if spec.undo is None:
            held = self._held_by_others(st, spec.settings, live)
            kept = ", ".join(f"{s} (held by {', '.join(r)})" for s, r in sorted(held.items()))
            return held, kept
        held, said = {}, []
        for setting, value in targets(action, params).items():
            hs = self._holders(st, frozenset({setting}), live).get(setting, [])
            asks = [(n, other.asked.get(setting, _UNKNOWN)) for n, other in hs]
            stricter = [
                (n, v)
                for n, v in asks
                if v is not _UNKNOWN and strictness(setting, v) < strictness(setting, value)
            ]
            if stricter:
                best = min((v for _, v in stricter), key=lambda v: strictness(setting, v))
                held[setting] = [n for n, _ in stricter]
                said.append(
                    f"{setting} stays at {_shown(setting, best)} (held by "
                    f"{', '.join(held[setting])}; this rule asks for {_shown(setting, value)})"
                )
        return held, ", ".join(said)

    def _undone(self, a: Attempt, now: float, outcome: str, res: ActionResult | None) -> None:
        if outcome not in ("applied", "dry_run", "held"):
            a.st.undo_refused_at = now
            return
        if a.rule.name in self.applied and self.states.get(a.rule.name) is a.st:
            self.applied.remove(a.rule.name)
        self.retiring = [r for r in self.retiring if r[1] is not a.st]
        a.st.state, a.st.last_action, a.st.undo_refused_at = "inactive", now, None
        a.st.holds, a.st.live, a.st.resolved = frozenset(), False, False
        a.st.asked, a.st.overridden = {}, {}

    # -- events -----------------------------------------------------------------------------
    def handle_event(
        self,
        kind: str,
        data: dict[str, Any] | None = None,
        resolved: bool = False,
        only: Collection[str] | None = None,
        note: str = "",
    ) -> list[Decision]:
        """Run event rules for `kind` (engine_oom, preemption_storm, alert:<Name>) right away.
        Waits for a tick under way rather than skip: an alert or its resolution is acted on
        once, never dropped. `only`: just the rules of these names (those a reload started
        afresh while their alert fires), with `note` saying why in what they record."""
        with self._turn:
            with self._lock:
                start = self.decided
                now = self.clock()
                names = [
                    r.name
                    for r in self.rules.rules
                    if r.on == kind and (only is None or r.name in only)
                ]
            trigger = "alert" if kind.startswith("alert:") else "event"
            for name in names:
                with self._lock:
                    a = self._decide_event(name, trigger, now, resolved)
                if a is None:
                    continue
                a.note = note
                if resolved:
                    self._carry_out(a, lambda outcome, res, a=a: self._resolved(a, now, outcome))
                else:
                    self._carry_out(
                        a, lambda outcome, res, a=a: self._event_acted(a, now, outcome, res)
                    )
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
        if not resolved:
            st.last_event = now  # the recovery timer restarts, whether it acts or not
        if st.in_flight is not None:
            return None
        if resolved:
            if rule.undo is None or st.state != "firing" or st.resolved:
                return None
            return self._undo_attempt(rule, st, trigger, None)
        if st.resolved:  # the alert is back before its refused undo was retried: still needed
            st.resolved, st.undo_refused_at = False, None
            return None
        if trigger == "alert" and self._in_force(rule, st):
            # another alert of its name (another GPU's, say) while its remedy is in force:
            # acting again would halt twice or halve the batch again; it holds until resolved
            return None
        # an alert that fires again after it resolved acts whatever the cooldown (it is one
        # firing, deduplicated upstream; skipped, nothing would act on it until it resolves)
        again = trigger == "alert" and st.state == "inactive"
        if not again and not self._cooled(rule, st, now):
            return None
        return self._attempt(rule, st, rule.action, rule.params, trigger, None, undo=False)

    def _resolved(self, a: Attempt, now: float, outcome: str) -> None:
        """The alert resolved: its undo ran (the rule is calm), or was refused or failed: the
        remedy stays in force and the undo is retried after the rule's cooldown."""
        if outcome in ("applied", "dry_run", "held"):
            self._undone(a, now, outcome, None)
        else:
            a.st.resolved, a.st.undo_refused_at = True, now

    def _event_acted(self, a: Attempt, now: float, outcome: str, res: ActionResult | None) -> None:
        a.st.last_action = now
        if self._in_force_now(a, outcome, res) and a.trigger == "event":
            # in force until `recover_for` passes without another event (then undone in stack
            # order, `_stack_undo`): an event that acts again puts its rule back on top
            if a.rule.name in self.applied:
                self.applied.remove(a.rule.name)
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
        """Under the state lock: mark the rule busy so nothing chooses it again meanwhile. An
        act knows the settings it would loosen, which other remedies in force hold stricter
        (it leaves those as they are: see `_run`)."""
        st.in_flight = action
        a = Attempt(rule, st, action, params, trigger, value, undo, self.dry_run)
        if not undo:
            a.held, a.kept = self._loosened(st, action, params, live=not self.dry_run)
        return a

    def _carry_out(self, a: Attempt, settle: Callable[[str, ActionResult | None], None]) -> str:
        """Await the action with no lock held, then record it and let `settle` move the state
        machine, under the lock, in the order the old single-lock code did. An action the
        engine is still inside when the executor gives up is settled when it finishes."""
        if not a.undo:  # before it runs, so that the events it causes are the incident's
            with self._lock:
                self._open_incident(a.rule)
        a.decided_at = self._wall()
        try:
            res, outcome, error = self._run(a)
        except ActionStillApplying as late:
            self._settle_later(a, settle, late)
            return "applying"
        except BaseException:
            with self._lock:
                a.st.in_flight = None
            raise
        with self._lock:
            a.st.in_flight = None
            self._settle(a, settle, res, outcome, error)
        return outcome

    def _settle(
        self,
        a: Attempt,
        settle: Callable[[str, ActionResult | None], None],
        res: ActionResult | None,
        outcome: str,
        error: str | None,
    ) -> None:
        """Under the lock: record the attempt, move its rule's state, update the incident."""
        self._record(a, res, outcome, error)
        settle(outcome, res)
        if self.incident is not None and not a.undo:
            self._name_incident(a.rule, outcome, res)
        if self.incident is not None:  # its peak counts the rung that just acted
            self.incident_peak = max(self.incident_peak, self.level())
            if self.audit:
                self.audit.update_incident(
                    self.incident,
                    peak_level=self.incident_peak,
                    actions_count=self.incident_actions,
                )

    def _settle_later(
        self,
        a: Attempt,
        settle: Callable[[str, ActionResult | None], None],
        late: ActionStillApplying,
    ) -> None:
        """The engine took the action and is still inside it: its rule stays in flight, and the
        result, when the engine finishes, is recorded and settles the rule (on the engine
        thread: the state lock is never held across an action, so this waits on no one)."""
        log.warning("rule %s: action %s: %s", a.rule.name, a.action, late)
        with self._lock:
            self.late.append(a)

        def done(fut: Future) -> None:
            res: ActionResult | None = None
            try:
                res = fut.result()
                outcome = "applied" if res.ok else "refused"
                error = None if res.ok else res.detail
            except Exception as e:  # noqa: BLE001 - a failed action is recorded, not fatal
                outcome, error = "failed", f"{type(e).__name__}: {e}"
            with self._lock:
                if a not in self.late:  # recorded at the stop already
                    return
                self.late.remove(a)
                a.st.in_flight = None
                note = "finished after the evaluation had stopped waiting for it"
                a.note = f"{a.note}; {note}" if a.note else note
                self._settle(a, settle, res, outcome, error)

        late.future.add_done_callback(done)

    def _run(self, a: Attempt) -> tuple[ActionResult | None, str, str | None]:
        """Run the attempt's action. Settings other remedies in force hold (`held`) are never
        loosened past what they ask: an undo puts each it holds stricter than they do at the
        strictest value they ask for (`restore`) and leaves the others alone; an act leaves
        alone those it would loosen. Where nothing is left to do it changes nothing (`held`);
        where an undo or a reset sets others too (the OOM chain's) it restores just those to
        their configured state, each by its own action with the params the undo gives it
        (`restore_alone`: the OOM chain's undo keeps its FP8 margin)."""
        spec = ACTIONS[a.action]
        steps: list[tuple[str, dict[str, Any], str]] | None = None
        if a.held:
            resets = a.undo or spec.undo is None  # to the configured state: the free ones too
            free = sorted(spec.settings - set(a.held)) if resets else []
            steps = [(*restore_alone(a.action, s), "") for s in free]
            for s, (value, names) in sorted(a.restore.items()):
                holds = "holds" if len(names) == 1 else "hold"
                steps.append((*set_to(s, value), f", what {', '.join(names)} still {holds}"))
            if not steps:
                what = "nothing restored" if resets else "nothing changed"
                return ActionResult(a.action, {}, {}, f"{what}: {a.kept}", True), "held", None
        if a.dry_run:
            return None, "dry_run", None
        try:
            if steps is None:
                res = self.execute(a.action, a.params)
            else:
                res = self._restore(a.action, steps, a.kept)
        except ActionStillApplying:
            raise  # the engine is inside it: recorded when it finishes (`_settle_later`)
        except Exception as e:  # noqa: BLE001 - a failed action is recorded, not fatal
            error = f"{type(e).__name__}: {e}"
            log.error("rule %s: action %s failed: %s", a.rule.name, a.action, error)
            return None, "failed", error
        return res, ("applied" if res.ok else "refused"), (None if res.ok else res.detail)

    def _restore(
        self, action: str, steps: list[tuple[str, dict[str, Any], str]], kept: str
    ) -> ActionResult:
        """Part of an undo: each setting it restores by its own action (back to its
        configured state, or to the value the other remedies holding it ask for). A step the
        engine is still inside when the executor gives up leaves the later ones unrun: the
        undo's late result says which, and fails (it is retried whole after the cooldown)."""
        results: list[tuple[ActionResult, str]] = []
        for i, (name, params, why) in enumerate(steps):
            try:
                results.append((self.execute(name, params), why))
            except ActionStillApplying as late:
                rest = [n for n, _, _ in steps[i + 1 :]]
                out = _restored_late(late.future, action, results, why, rest, kept)
                raise ActionStillApplying(str(late), out) from None
            except ActionWithdrawn as gone:
                if not results:  # nothing ran: "nothing changed" is the truth
                    raise
                # the steps before it did change the engine: say which, and which did not run
                rest = ", ".join([name] + [n for n, _, _ in steps[i + 1 :]])
                done = _restored(action, results, kept).detail
                raise RuntimeError(
                    f"{done}; not run: {rest} ({name} {gone}; the undo is retried)"
                ) from None
        return _restored(action, results, kept)

    def _live(self, a: Attempt) -> bool:
        """False when a reload removed the rule while its action was awaited: the act is
        recorded, but a rule that no longer exists is not put in force (nor on the undo stack)."""
        if self.states.get(a.rule.name) is a.st:
            return True
        log.info("rule %s was reloaded away while %s ran: not tracked", a.rule.name, a.action)
        return False

    def level(self) -> int:
        """0 when calm, else 1 + the index in the file of the last rule in force: the ladder's
        rungs and the event and alert rules alike (the OOM chain and an Alertmanager halt are
        degradation too, which an alert on the level must see). A retiring remedy (a reload
        took it from its rule, and its undo has not applied yet) counts at the position its
        rule had in the file it was applied under: it is in force until undone, however long
        its undo is refused. A dry run's simulated remedies count as real ones would. A rule
        whose every held setting an operator's action took over (`manual_applied`) does not
        count: nothing of it is in force, though it stays firing until its undo."""
        with self._lock:
            active = [
                i + 1
                for i, r in enumerate(self.rules.rules)
                if self.states[r.name].state in ("firing", "recovering")
                and not self.states[r.name].holds_nothing_left
            ]
            active += [st.position for _, st, _ in self.retiring if not st.holds_nothing_left]
            return max(active, default=0)

    def _open_incident(self, rule: Rule) -> None:
        lvl = max(self.level(), 1)
        if self.incident is None:
            self.incident_actions, self.incident_peak = 0, lvl
            self.incident_named = (rule.name, False)
            self.incident = (
                self.audit.open_incident(lvl, _incident_summary(rule))
                if self.audit
                else f"local-{int(self.wall_clock())}"
            )
            if self.on_incident is not None:
                self.on_incident(self.incident)

    def _name_incident(self, rule: Rule, outcome: str, res: ActionResult | None) -> None:
        """An incident's summary names the rule whose action opened it, decided before that
        action ran; one that changed nothing (an eviction of 0 sequences: nothing of that
        priority ran) or was refused or failed did not start the remedies. The summary then
        names the first rule whose action in the incident did change something, once one
        does (the rows recorded stay as they are: only the summary is updated)."""
        named, changed = self.incident_named
        if changed or outcome != "applied" or res is None or res.changed_nothing():
            return
        self.incident_named = (rule.name, True)
        if rule.name != named and self.audit and self.incident is not None:
            self.audit.update_incident(self.incident, summary=_incident_summary(rule))

    def count_outside_action(self) -> str | None:
        """An action no rule took (an operator's, trigger `manual`), about to be recorded: it
        belongs to the incident open now, if one is, and counts in that incident's
        actions_count as its timeline lists it. Returns that incident's id (None when calm)."""
        with self._lock:
            if self.incident is None:
                return None
            self.incident_actions += 1
            if self.audit:
                self.audit.update_incident(self.incident, actions_count=self.incident_actions)
            return self.incident

    def count_manual(self, action: str, outcome: str) -> None:
        """An operator's action (the admin API's) counted with the rules' in `stats.actions`,
        as rule `manual` (kvguard_actions_total, which RemedyFailed watches)."""
        with self._lock:
            key = (MANUAL, action, outcome)
            self.stats.actions[key] = self.stats.actions.get(key, 0) + 1

    def manual_requested(self, action: str, params: dict[str, Any]) -> int | None:
        """An operator's action with an undo (a halt, a cap, a batch cut, FP8...) is asked for:
        until it settles (`manual_settled`), what it will set counts as the operator's hold,
        at the values its params name. A rule's act or undo decided meanwhile queues behind it
        on the engine: counted so, it is `held` rather than loosening or undoing the
        operator's setting just after it applied. Returns the token `manual_settled` takes
        (None: nothing held, e.g. an undo, which lets go only once it has applied)."""
        spec = ACTIONS.get(action)
        if spec is None or spec.undo is None:
            return None
        try:
            values = asked(action, params, None)
        except Exception:  # noqa: BLE001 - invalid params: the action itself says so
            return None
        with self._lock:
            self._pending_seq += 1
            self.manual_pending[self._pending_seq] = RuleState(
                live=True, holds=settings_set(action, None), asked=values
            )
            return self._pending_seq

    def manual_settled(self, token: int | None) -> None:
        """The operator's action `token` names settled (applied, refused, failed or
        withdrawn): its hold while it waited ends (`manual_applied` takes over where it
        applied)."""
        if token is None:
            return
        with self._lock:
            self.manual_pending.pop(token, None)

    def manual_applied(self, action: str, params: dict[str, Any], res: ActionResult) -> str:
        """An operator's action (the admin API's) applied, with result `res`: the operator's
        word on the settings it set. An action with an undo (a halt, a cap, a batch cut,
        FP8...) holds them, as `manual`, at the values it set, as a rule's remedy in force
        does: a rule's act that would loosen one is `held`, and a rule's undo puts it back
        to the operator's value, not to the configured one. An undo (resume_admission,
        uncap_max_new_tokens, restore_batch...) lets go of the operator's hold on them. Either
        way a rule in force that held one of them stricter than the operator now has it
        (every one an undo resets) holds it no more: its `holds` drop it, and its own undo
        leaves it as the operator set it (it acts again only after that undo, as it would
        have). Returns what the action's audit detail adds: those rules ('' where none)."""
        done = settings_set(action, res)
        if not done:
            return ""
        release = ACTIONS[action].undo is None  # back to the configured state
        values = {} if release else asked(action, params, res)
        overrode: list[str] = []
        with self._lock:
            m = self.manual
            m.asked = {s: v for s, v in m.asked.items() if s not in done}
            if release:
                m.holds -= done
            else:
                m.holds |= done
                m.asked.update(values)
            for name, st in self._remedies_in_force():
                taken = sorted(
                    s
                    for s in st.holds & done
                    if release or _looser(s, values.get(s, _UNKNOWN), st.asked.get(s, _UNKNOWN))
                )
                if not taken:
                    continue
                st.holds -= frozenset(taken)
                st.asked = {s: v for s, v in st.asked.items() if s not in taken}
                st.overridden.update(dict.fromkeys(taken, action))
                overrode.append(f"{name} ({', '.join(taken)})")
                log.info("rule %s: %s by the operator's %s", name, ", ".join(taken), action)
        return f"overrode what rules held: {'; '.join(overrode)}" if overrode else ""

    def _remedies_in_force(self, retiring: bool = True) -> list[tuple[str, RuleState]]:
        """The rules' remedies in force, in file order, then (`retiring`) those a reload took
        from their rule whose undo has not applied yet (`retiring NAME`)."""
        out = [
            (r.name, self.states[r.name])
            for r in self.rules.rules
            if self._in_force(r, self.states[r.name])
        ]
        if retiring:
            out += [(f"retiring {r.name}", st) for r, st, _ in self.retiring]
        return out

    def manual_holds(self) -> dict[str, Any]:
        """The settings the operator's actions hold, and the value asked of each."""
        with self._lock:
            return {"holds": sorted(self.manual.holds), "asked": dict(self.manual.asked)}

    def close_at_stop(self) -> None:
        """The daemon stops: an action the engine was still inside is recorded failed, saying
        that whether it applied is not known; the open incident ends with it (the next start
        begins calm, its remedies gone with the engine), so none stays open forever."""
        with self._lock:
            for a in self.late:
                a.st.in_flight = None
                error = (
                    "the daemon stopped while the engine was still applying it: whether it "
                    "applied is not known (the engine's settings go with the daemon)"
                )
                self._record(a, None, "failed", error)
            self.late.clear()
            if self.incident is not None:
                self._close_incident("as the daemon stops")

    def _maybe_close_incident(self) -> None:
        if self.incident is None or self.applied or self.retiring or self.late:
            return
        if any(st.state != "inactive" for st in self.states.values()):
            return
        self._close_incident(f"after {self.incident_actions} actions")

    def _close_incident(self, why: str) -> None:
        assert self.incident is not None
        closed = self._wall()
        if self.audit:
            self.audit.update_incident(
                self.incident,
                peak_level=self.incident_peak,
                actions_count=self.incident_actions,
                closed_at=closed,
            )
        log.info("incident %s closed %s", self.incident, why)
        self.last_closed = (self.incident, closed)
        self.incident = None

    def _record(
        self, a: Attempt, res: ActionResult | None, outcome: str, error: str | None
    ) -> None:
        rule, action, trigger, value, params, undo = (
            a.rule, a.action, a.trigger, a.value, a.params, a.undo
        )  # fmt: skip
        key = (rule.name, action, outcome)
        self.stats.actions[key] = self.stats.actions.get(key, 0) + 1
        detail = res.detail if res else (error or "dry run: nothing changed")
        if a.note:
            detail = f"{a.note}: {detail}"
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
            time=a.decided_at or self._wall(),
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
            data=res.data if res else None,  # e.g. the requests an eviction preempted
        )

    def _wall(self) -> datetime:
        return datetime.fromtimestamp(self.wall_clock(), UTC)

    # -- views ------------------------------------------------------------------------------
    def rule_states(self) -> list[dict[str, Any]]:
        """Each rule's state, in file order, then each retiring remedy (state `retiring`: a
        reload took it from its rule, and its undo has not applied yet), with `why`."""
        with self._lock:
            rules = [
                {
                    "name": r.name,
                    "state": self.states[r.name].shown,
                    "value": self.states[r.name].value,
                    "signal": r.signal,
                    "on": r.on,
                    "action": r.action,
                    "undo": r.undo,
                    "in_flight": self.states[r.name].in_flight,
                    # the engine settings its remedy in force holds (others' undos leave them)
                    "holds": sorted(self.states[r.name].holds),
                    # false where that remedy is only simulated (a dry run): it holds nothing real
                    "live": self.states[r.name].live,
                    # those an operator's action took from it (its undo leaves them alone)
                    "overridden": sorted(self.states[r.name].overridden),
                }
                for r in self.rules.rules
            ]
            return rules + [
                {
                    "name": r.name,
                    "state": RETIRING,
                    "value": None,
                    "signal": r.signal,
                    "on": r.on,
                    "action": r.action,
                    "undo": r.undo,
                    "in_flight": st.in_flight,
                    "holds": sorted(st.holds),
                    "live": st.live,
                    "overridden": sorted(st.overridden),
                    "why": why,
                }
                for r, st, why in self.retiring
            ]


_UNKNOWN = object()  # a value a remedy asked that cannot be told (a dry run's reduce_batch)


def _restored(action: str, results: list[tuple[ActionResult, str]], kept: str) -> ActionResult:
    detail = "; ".join(f"{r.action}: {r.detail}{why}" for r, why in results)
    if kept:
        detail += f"; kept: {kept}"
    ok = all(r.ok for r, _ in results)
    return ActionResult(action, results[0][0].before, results[-1][0].after, detail, ok)


def _restored_late(
    step: Future,
    action: str,
    results: list[tuple[ActionResult, str]],
    why: str,
    rest: list[str],
    kept: str,
) -> Future:
    """The result of an undo (`Evaluator._restore`) whose step `step` the engine finished
    late: the steps before it and that one; where later steps were left unrun, a failure
    naming them (the undo is retried)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            res = _restored(action, [*results, (f.result(), why)], kept)
        except Exception as e:  # noqa: BLE001 - the step's failure is the undo's
            out.set_exception(e)
            return
        if rest:
            out.set_exception(
                RuntimeError(f"{res.detail}; not run: {', '.join(rest)} (the undo is retried)")
            )
        else:
            out.set_result(res)

    step.add_done_callback(done)
    return out


def _shown(setting: str, value: Any) -> str:
    """A value a remedy asks, as the audit detail names it."""
    if setting == "admission":
        return value or "none"  # the best priority admitted
    return f"{value:g}" if isinstance(value, float) else str(value)


def _looser(setting: str, value: Any, than: Any) -> bool:
    """Whether `value` of `setting` is looser than `than` (both known, of a setting with an
    order: FP8 and offload have one value)."""
    if setting not in SET_TO or value is _UNKNOWN or than is _UNKNOWN:
        return False
    return strictness(setting, value) > strictness(setting, than)


def same_rule(a: Rule, b: Rule) -> bool:
    """Whether two rules (of two loads of a file) are the same rule: equal, or equal but for
    params written out at their defaults in one and left out in the other."""
    if a == b:
        return True
    bare = {"params": {}, "undo_params": {}}
    return a.model_copy(update=bare) == b.model_copy(update=bare) and _remedy(a) == _remedy(b)


def _remedy(rule: Rule) -> tuple[Any, ...]:
    """What a rule does to the engine, its params with their defaults filled in (the file
    may write a default out or leave it out): a reload that changes it retires the remedy in
    force."""
    undo = parse_params(rule.undo, rule.undo_params).model_dump() if rule.undo else None
    return (rule.action, parse_params(rule.action, rule.params).model_dump(), rule.undo, undo)
