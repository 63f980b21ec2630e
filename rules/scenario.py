"""`kvguard rules test`: replay a scenario of signal values and events through the real
evaluator on a fake clock, and check which actions fire and undo when (the rules' own unit
test, in the spirit of `promtool test rules`).

Scenario file:

    duration: 300s            # how long to replay (ticks every rules `interval`, at most
                              # MAX_TICKS of them)
    series:                   # signal name -> steps, each at or before the last tick; a value
                              # holds until the next step
      kv_usage: [{at: 0s, value: 0.50}, {at: 30s, value: 0.93}, {at: 120s, value: 0.70}]
      gpu_mem: []             # no data: the signal is unknown (rules on it never act)
    events:                   # optional: engine events and Alertmanager alerts, at or before
                              # `duration`, each of a kind some rule listens `on`
      - {at: 200s, kind: engine_oom}
      - {at: 210s, kind: "alert:GPUNearOOM"}
      - {at: 260s, kind: "alert:GPUNearOOM", resolved: true}
    expect:                   # every action the rules take, in order (nothing more, nothing less)
      - {at: 40s, rule: reduce-batch, action: reduce_batch}
      - {at: 215s, rule: reduce-batch, action: restore_batch, undo: true}

As the daemon does, an evaluation follows each event at once: events at the same time share
one, and an event at a tick's time is followed by that tick. Actions are simulated (applied,
changing nothing); the OOM chain (`handle_oom`) halts admission, and so holds it, only where
the scenario's KV usage (the series of the signal reading `kv_cache_usage_ratio`) is above
0.98 when it runs, as the engine decides after the chain's other steps. Its undo
(`recover_from_oom`, whole or split up by other remedies' holds) switches the KV cache back
from FP8 only where that usage is below 0.20, and `disable_fp8_kv` given `only_below` only
below that: otherwise it is refused, as the engine refuses it, and retried after the cooldown.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvguard.engine.control import ActionResult
from kvguard.rules.actions import OOM_HALT_ABOVE, OOM_UNDO_FP8_BELOW
from kvguard.rules.evaluator import Decision, Evaluator
from kvguard.rules.schema import (
    RuleSet,
    RulesFileError,
    Signal,
    event_problem,
    format_error,
    line_key,
    parse_duration,
)
from kvguard.rules.yaml_file import YamlFileError, line_for, load_yaml, read_source

# The evaluations one scenario may replay: a replay runs the real evaluator every `interval`
# of the rules (about 15 us a tick with the shipped rules, so 1.5 s at most); the longest
# duration a file may give (a century) would never finish at any interval.
MAX_TICKS = 100_000


def ticks(duration: float, interval: float) -> int:
    """How many evaluations a replay of `duration` runs: at 0, interval, ..., up to duration."""
    return math.floor(duration / interval + 1e-9) + 1


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Step(_M):
    at: float
    value: float | None

    _d = field_validator("at", mode="before")(lambda v: parse_duration(v))


class Event(_M):
    at: float
    kind: str
    resolved: bool = False

    _d = field_validator("at", mode="before")(lambda v: parse_duration(v))

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        problem = event_problem(v)
        if problem:
            raise ValueError(problem)
        return v


class Expect(_M):
    at: float
    rule: str
    action: str
    undo: bool = False
    outcome: str = "applied"

    _d = field_validator("at", mode="before")(lambda v: parse_duration(v))


class Scenario(_M):
    duration: float
    series: dict[str, list[Step]] = Field(default_factory=dict)
    events: list[Event] = Field(default_factory=list)
    expect: list[Expect] = Field(default_factory=list)
    dry_run: bool = False

    _d = field_validator("duration", mode="before")(lambda v: parse_duration(v))


@dataclass(slots=True)
class Outcome:
    decisions: list[Decision]
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


def load_scenario(path: Path, rules: RuleSet | None = None) -> Scenario:
    """The scenario at `path`; RulesFileError lists every problem as `FILE:LINE: field:
    problem`, among them what the replay would skip, so that the test would pass untested: an
    event or a series step past `duration`, and (given the `rules` it runs against) a series
    step after the last evaluation, a series that names none of their signals or an event no
    rule listens on (a misspelt one would feed nothing); and, given the rules, a duration of
    more than MAX_TICKS evaluations (a replay that would not finish)."""
    name = str(path)
    try:
        data, lines = load_yaml(read_source(Path(path)), name)
    except YamlFileError as e:
        raise RulesFileError(e.errors) from None
    except OSError as e:
        raise RulesFileError([f"{path}: cannot read: {e.strerror}"]) from None
    if data is not None and not isinstance(data, dict):
        raise RulesFileError([f"{name}:1: a scenario must be a mapping (duration, series, ...)"])
    problems, sc = [], None
    try:
        sc = Scenario.model_validate(data or {})
    except ValidationError as e:
        problems = [format_error(err, lines, name) for err in e.errors()]
    series = (data or {}).get("series")
    if rules is not None and isinstance(series, dict):
        defined = ", ".join(rules.signals) or "none"
        problems += [
            f"{name}:{line_for(lines, ('series', s))}: series.{s}: names no signal of the rules "
            f"file (defined: {defined})"
            for s in series
            if s not in rules.signals
        ]
    problems += _unreplayed_events(data or {}, lines, name, rules)
    problems += _unreplayed_steps(data or {}, lines, name, rules)
    problems += _too_long(data or {}, lines, name, rules)
    if problems or sc is None:
        raise RulesFileError(sorted(problems, key=line_key))
    return sc


def _duration_or_none(v: Any) -> float | None:
    try:
        return parse_duration(v)
    except (TypeError, ValueError):
        return None  # reported by the model's own validation


def _unreplayed_events(data: dict, lines: dict, name: str, rules: RuleSet | None) -> list[str]:
    """Events the replay would skip, so that an `expect` about them would pass untested: one
    past `duration` (the replay stops there), and one of a kind no rule listens `on` (e.g. a
    misspelt alert name; given the `rules`). Each is refused at its line."""
    events = data.get("events")
    if not isinstance(events, list):
        return []
    duration = _duration_or_none(data.get("duration"))
    listened = sorted({r.on for r in rules.rules if r.on is not None}) if rules else []
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            continue
        at = _duration_or_none(e.get("at"))
        if at is not None and duration is not None and at > duration + 1e-9:
            out.append(
                f"{name}:{line_for(lines, ('events', i, 'at'))}: events.{i}.at: {at:g}s is "
                f"past the scenario's duration ({duration:g}s): it would never be replayed"
            )
        kind = e.get("kind")
        if (
            rules is not None
            and isinstance(kind, str)
            and event_problem(kind) is None
            and kind not in listened
        ):
            out.append(
                f"{name}:{line_for(lines, ('events', i, 'kind'))}: events.{i}.kind: no rule "
                f"listens on {kind!r}, so it would change nothing (rules listen on: "
                f"{', '.join(listened) or 'none'})"
            )
    return out


def _unreplayed_steps(data: dict, lines: dict, name: str, rules: RuleSet | None) -> list[str]:
    """Series steps no evaluation would read, so that the scenario would pass without them: one
    past `duration` (the replay stops there), and (given the `rules`, whose interval sets the
    ticks) one after the last evaluation within it: the last tick's, or the one that follows
    a later event. Each is refused at its line."""
    series, duration = data.get("series"), _duration_or_none(data.get("duration"))
    if not isinstance(series, dict) or duration is None:
        return []
    every = rules.interval if rules is not None else None
    last = None if every is None else round((ticks(duration, every) - 1) * every, 9)
    events = data.get("events") if isinstance(data.get("events"), list) else []
    at_events = [_duration_or_none(e.get("at")) for e in events if isinstance(e, dict)]
    after = max((t for t in at_events if t is not None and t <= duration + 1e-9), default=None)
    why = "" if every is None else f"every {every:g}s up to the duration {duration:g}s"
    if last is not None and after is not None and after > last + 1e-9:
        last, why = after, "the one after the last event"
    out = []
    for sig, steps in series.items():
        for i, step in enumerate(steps if isinstance(steps, list) else []):
            at = _duration_or_none(step.get("at")) if isinstance(step, dict) else None
            if at is None:
                continue
            where = f"{name}:{line_for(lines, ('series', sig, i, 'at'))}: series.{sig}.{i}.at"
            if at > duration + 1e-9:
                out.append(
                    f"{where}: {at:g}s is past the scenario's duration ({duration:g}s): it "
                    "would never be replayed"
                )
            elif last is not None and at > last + 1e-9:
                out.append(
                    f"{where}: {at:g}s is after the last evaluation ({last:g}s, {why}): no "
                    "evaluation would read it"
                )
    return out


def _too_long(data: dict, lines: dict, name: str, rules: RuleSet | None) -> list[str]:
    """A duration of more than MAX_TICKS evaluations of the `rules`: a replay that would run for
    minutes or years, refused at its line."""
    duration = _duration_or_none(data.get("duration"))
    if rules is None or duration is None or ticks(duration, rules.interval) <= MAX_TICKS:
        return []
    longest = (MAX_TICKS - 1) * rules.interval
    given = data["duration"] if isinstance(data["duration"], str) else f"{duration:g}s"
    return [
        f"{name}:{line_for(lines, ('duration',))}: duration: {given} is "
        f"{ticks(duration, rules.interval)} evaluations of the rules (every "
        f"{rules.interval:g}s): at most {MAX_TICKS} ({longest:g}s at that interval)"
    ]


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Series:
    """A signal's steps, sorted once: the value at `t` is the latest step's at or before it
    (of steps at the same time, the last given)."""

    def __init__(self, steps: list[Step]) -> None:
        ordered = sorted(steps, key=lambda s: s.at)
        self.ats = [s.at for s in ordered]
        self.values = [s.value for s in ordered]

    def at(self, t: float) -> float | None:
        i = bisect.bisect_right(self.ats, t)
        return self.values[i - 1] if i else None


# the steps of a simulated OOM chain, as the engine names them in its result (the engine skips
# offload without a host pool, and FP8 where it is on already: a replay cannot tell)
_OOM_STEPS = ["reduce_max_num_seqs", "evict", "set_offload", "set_kv_cache_dtype"]


def run_scenario(rules: RuleSet, sc: Scenario) -> Outcome:
    n = ticks(sc.duration, rules.interval)
    if n > MAX_TICKS:  # load_scenario refuses it given the rules: a replay that never ends
        raise ValueError(f"duration {sc.duration:g}s is {n} evaluations: at most {MAX_TICKS}")
    clock = _Clock()
    series = {name: _Series(steps) for name, steps in sc.series.items()}
    kv_usage = next(
        (
            series[name]
            for name, sig in rules.signals.items()
            if sig.local == "kv_cache_usage_ratio" and name in series
        ),
        None,
    )

    def read(name: str, _sig: Signal) -> float | None:
        s = series.get(name)
        return None if s is None else s.at(clock.t)

    def execute(action: str, params: dict[str, Any]) -> ActionResult:
        usage = None if kv_usage is None else kv_usage.at(clock.t)
        if action == "handle_oom":
            return _simulated_oom_chain(usage)
        margin = _fp8_margin(action, params)
        if margin is not None:
            return _simulated_switch_back(action, usage, margin)
        return ActionResult(action, {}, {}, "simulated", True)

    ev = Evaluator(rules, read, execute, clock=clock, wall_clock=clock, dry_run=sc.dry_run)
    events = sorted(sc.events, key=lambda e: e.at)
    times = [round(k * rules.interval, 9) for k in range(n)]
    # events after the last tick but within `duration`: still replayed, at their times
    times += sorted({e.at for e in events if times[-1] + 1e-9 < e.at <= sc.duration + 1e-9})
    for t in times:
        # events before this tick, each time's followed by an evaluation then (the daemon's),
        # then those at this tick's time, which this tick follows
        while events and events[0].at <= t + 1e-9:
            at = events[0].at
            while events and events[0].at <= at + 1e-9:
                e = events.pop(0)
                clock.t = e.at
                ev.handle_event(e.kind, resolved=e.resolved)
            if at < t - 1e-9:
                clock.t = at
                ev.tick()
        clock.t = t
        ev.tick()
    failures = _compare(ev.decisions, sc.expect)
    return Outcome(ev.decisions, failures + (_unfed(rules, sc) if failures else []))


def _unfed(rules: RuleSet, sc: Scenario) -> list[str]:
    """For a failed replay: each rule whose signal the scenario gives no series, which never
    acts (its value unknown, as an unread signal's is in the daemon). Said because a rules
    file whose rule moved to another signal (the default batch cut reads `kv_demand` since it
    read `kv_usage`) fails an older scenario with expectations that only shifted."""
    return [
        f"note: rule {r.name} reads signal {r.signal}, for which the scenario has no series: "
        "it never acted (add a series for it)"
        for r in rules.rules
        if r.signal is not None and r.signal not in sc.series
    ]


def _simulated_oom_chain(kv_usage: float | None) -> ActionResult:
    """`handle_oom` in a replay: every step applied but the halt, which applies (and holds
    admission) only where the KV usage replayed at that time is above OOM_HALT_ABOVE."""
    if kv_usage is not None and kv_usage > OOM_HALT_ABOVE:
        applied = [*_OOM_STEPS, "halt_admission"]
        detail = f"simulated; admission halted: KV cache at {kv_usage:.1%}"
    else:
        applied = list(_OOM_STEPS)
        at = "unknown" if kv_usage is None else f"at {kv_usage:.1%}"
        detail = (
            f"simulated; admission not halted: KV cache {at} (halts above {OOM_HALT_ABOVE:.0%})"
        )
    return ActionResult("handle_oom", {}, {}, detail, True, {"steps": applied, "applied": applied})


def _fp8_margin(action: str, params: dict[str, Any]) -> float | None:
    """The usage below which `action` switches the KV cache back from FP8 (None: no margin,
    or no switch back): the OOM chain's undo has OOM_UNDO_FP8_BELOW, and `disable_fp8_kv` the
    `only_below` it is given (the chain's undo split up passes that margin)."""
    if action == "recover_from_oom":
        return OOM_UNDO_FP8_BELOW
    if action == "disable_fp8_kv":
        return params.get("only_below")
    return None


def _simulated_switch_back(action: str, kv_usage: float | None, margin: float) -> ActionResult:
    """A switch back from FP8 with a margin in a replay: refused (the rule retries it after its
    cooldown) where the KV usage replayed at that time is not below `margin`, as the engine
    refuses it; applied where it is, or where the scenario gives no KV usage (unknown)."""
    if kv_usage is None:
        return ActionResult(action, {}, {}, "simulated; KV usage unknown", True)
    if kv_usage < margin:
        detail = f"simulated; KV cache at {kv_usage:.1%}, under {margin:.0%}: switched back"
        return ActionResult(action, {}, {}, detail, True)
    detail = (
        f"simulated; refused: KV cache at {kv_usage:.1%}, and the switch back from FP8 waits "
        f"for under {margin:.0%}; retried after the rule's cooldown"
    )
    return ActionResult(action, {}, {}, detail, False)


def _compare(got: list[Decision], want: list[Expect]) -> list[str]:
    failures = []
    for i in range(max(len(got), len(want))):
        g = got[i] if i < len(got) else None
        w = want[i] if i < len(want) else None
        gs = None if g is None else (round(g.time, 6), g.rule, g.action, g.undo, g.outcome)
        ws = None if w is None else (round(w.at, 6), w.rule, w.action, w.undo, w.outcome)
        if gs != ws:
            failures.append(f"action #{i + 1}: expected {_fmt(ws)}, got {_fmt(gs)}")
    return failures


def _fmt(t: tuple | None) -> str:
    if t is None:
        return "nothing"
    at, rule, action, undo, outcome = t
    return f"{action}{' (undo)' if undo else ''} by {rule} at {at:g}s [{outcome}]"
