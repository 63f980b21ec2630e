"""The rules file: named signals, threshold rules with hysteresis, and event rules.

Validated with pydantic; every problem is reported as `FILE:LINE: field.path: problem` and all
of them at once, so `kvguard rules check` can list everything wrong in one run.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvguard.rules.actions import ACTIONS, ActionError, parse_params
from kvguard.rules.durations import parse_duration
from kvguard.rules.yaml_file import YamlFileError, line_for, load_yaml, read_source

log = logging.getLogger("kvguard.rules")

PREEMPTION_WINDOW_S = 60.0  # what `preemptions_1m` counts back over


@dataclass(frozen=True, slots=True)
class LocalSignal:
    """What a local signal reads, in what unit, and, for a running total that never falls,
    the signal of its recent rise: a rule above a running total can never recover (it fired
    on an idle daemon once the lifetime count passed its threshold and capped every request
    until a restart), so a rule that undoes reads the recent one instead."""

    meaning: str
    unit: str
    recent: str | None = None
    # what it measures, where another signal measures it too: rules on such signals are one
    # ladder (`ladder_of`), undone from the top rung down as the rules on one signal are
    pool: str | None = None

    @property
    def can_fall(self) -> bool:
        return self.recent is None


RATIO = "ratio, 0..1"
LOCAL_SIGNALS = {
    "kv_cache_usage_ratio": LocalSignal("device KV blocks in use / total", RATIO, pool="device KV"),
    "kv_cache_demand_ratio": LocalSignal(
        "device KV blocks the engine would hold at its configured `max_num_seqs` / total: "
        "those in use, and those the swapped and waiting sequences it would start next in "
        "the free slots would add (not one admission holds back; a block it would share "
        "with a running sequence or the prefix cache counted once), over 1 where that batch "
        "would not fit; `kv_cache_usage_ratio` when nothing waits",
        "ratio, 0 up (thresholds 0..1)",
        pool="device KV",
    ),
    "host_kv_cache_usage_ratio": LocalSignal(
        "host (swap) KV blocks in use / total; unknown without a host pool", RATIO
    ),
    "num_waiting": LocalSignal("requests waiting for admission to the batch", "requests"),
    "num_running": LocalSignal("requests in the running batch", "requests"),
    "num_swapped": LocalSignal("requests swapped out to the host pool", "requests"),
    "preemptions_1m": LocalSignal(
        f"sequences preempted (swapped out or put back to be computed again) in the last "
        f"{PREEMPTION_WINDOW_S:g} s, as the evaluations read the engine's total (at an "
        f"`interval` over {PREEMPTION_WINDOW_S:g} s: since the evaluation before)",
        "preemptions",
    ),
    "preemptions_total": LocalSignal(
        "sequences preempted since the engine started: a running total",
        "preemptions",
        recent="preemptions_1m",
    ),
    "gpu_memory_used_ratio": LocalSignal(
        "GPU memory used / total, the fullest of the engine's GPUs on this host (NVML; "
        "unknown without one)",
        RATIO,
    ),
    "host_memory_used_ratio": LocalSignal(
        "host memory in use / total, or a memory cgroup's working set / its limit (the "
        "daemon's group's or any parent's with a limit: `MemoryMax=`, a slice's, a "
        "container's), the highest",
        RATIO,
    ),
}


# local signals that are ratios: a threshold outside [0, 1] on one never fires (or always
# does), as a percent written for a ratio (`above: 92` for 0.92) would. The KV demand may
# pass 1, but a threshold over 1 is refused too: 1 already says "more than the pool holds",
# and `above: 92` is a percent far more often than 92 pools' worth of batch.
RATIO_SIGNALS = frozenset(n for n in LOCAL_SIGNALS if n.endswith("_ratio"))
THRESHOLDS = ("above", "below", "recover_below", "recover_above")


def off_ratio_thresholds(
    rule: dict[str, Any], signal: str | None, local: str | None
) -> list[tuple[str, str]]:
    """Each threshold key of `rule` outside 0..1 on a ratio signal (`local`), with why: such a
    rule never fires, or always does, as a percent written for a ratio (`above: 92`) would.
    A value that is no finite number is skipped: its own field error says so."""
    if local not in RATIO_SIGNALS:
        return []
    out = []
    for key in THRESHOLDS:
        value = rule.get(key)
        if not _is_number(value) or 0 <= value <= 1:
            continue
        out.append(
            (
                key,
                f"{value:g} is outside 0..1: signal {signal!r} is {local}, a "
                f"ratio (not a percent: {value / 100:g} for {value:g}%)",
            )
        )
    return out


def undo_never_due(
    rule: dict[str, Any], signal: str | None, local: str | None
) -> list[tuple[str, str]]:
    """The rule's `undo`, with why, where it waits for a running total (`local`) to fall: it
    never does, so a rule above one fired on an idle daemon once the lifetime count passed
    its threshold and held its remedy until a restart while `rules check` said OK. A rule
    firing `below` one recovers as it rises, and one without an undo is one-way on purpose."""
    spec = LOCAL_SIGNALS.get(local) if isinstance(local, str) else None
    if spec is None or spec.can_fall or rule.get("above") is None or rule.get("undo") is None:
        return []
    why = (
        f"rule {rule.get('name')!r} would never be undone: signal {signal!r} is {local}, a "
        "running total that never falls, so its recovery never comes and what "
        f"{rule.get('action')} sets would stay in force until a restart (for a rule that "
        f"undoes, read `local: {spec.recent}`, the {spec.unit} of the last "
        f"{PREEMPTION_WINDOW_S:g} s, which falls once they stop; a one-way rule leaves out "
        "`undo` and its recovery keys)"
    )
    return [("undo", why)]


def _is_number(value: Any) -> bool:
    """Whether `value` is a threshold the (strict, finite) model would accept."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class RulesFileError(ValueError):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


MIN_INTERVAL = 0.05  # seconds between evaluations: below it a typo, and a busy loop
# The longest: memory pressure builds in seconds, and the shipped RuleEvaluationStalled alert
# (alerts/kvguard.rules.yml) takes 5 minutes without an evaluation for a stalled evaluator:
# at 2 minutes every 5-minute window of a scrape a minute apart sees the counter rise.
MAX_INTERVAL = 120.0
# The longest rule name, signal name and `on` value: the audit log's rule and signal columns
# (String(128)) hold no more, and PostgreSQL refuses a longer value (SQLite would keep it).
MAX_NAME = 128


def _too_long(what: str, v: str | None) -> str | None:
    """Why `v` cannot be a name (None: it can)."""
    if v is None or len(v) <= MAX_NAME:
        return None
    return f"{what} is {len(v)} characters long: at most {MAX_NAME} (what the audit log keeps)"


class _Model(BaseModel):
    # No .inf/.nan thresholds: a NaN compares false both ways, so a rule on it never fires.
    # strict, as the config file: `above: true` or `above: "0.9"` is a typo to report, not a
    # threshold of 1.0 or 0.9 to guess.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


def event_problem(kind: str) -> str | None:
    """Why `kind` is not an event a rule can listen `on` (None: it is one)."""
    if kind in ("engine_oom", "preemption_storm"):
        return None
    if kind.startswith("alert:") and kind.removeprefix("alert:").strip():
        return None
    return f"{kind!r}: expected engine_oom, preemption_storm or alert:<AlertName>"


_SIGNAL_ONLY = ("for", "recover_below", "recover_above")  # read only by a threshold rule
_UNDO_ONLY = ("recover_below", "recover_above", "recover_for", "undo_params")  # only with undo


def ignored_keys(rule: dict[str, Any]) -> list[tuple[str, str]]:
    """The keys of a rule (as in the file, `for` not `for_`) that its shape never reads, each
    with why, in the order given: an event rule acts on each event (no `for`, no recovery
    threshold), an alert rule's undo runs when its alert resolves (no `recover_for`), and
    without `undo` nothing is undone (a forgotten `undo:` would leave the batch cut for good
    while `rules check` said OK). A key given as null counts as left out."""
    on, undo, action = rule.get("on"), rule.get("undo"), rule.get("action")
    out = []
    for key, value in rule.items():
        if value is None:
            continue
        if on is not None and key in _SIGNAL_ONLY:
            out.append((key, "has no effect on an event rule (`on`): no signal to hold or recover"))
        elif undo is None and key in _UNDO_ONLY:
            spec = ACTIONS.get(action) if isinstance(action, str) else None
            hint = (
                f" (nothing is undone: add `undo: {spec.undo}`, or leave `{key}` out)"
                if spec is not None and spec.undo
                else f" (leave `{key}` out)"
            )
            out.append((key, "has no effect without undo" + hint))
        elif key == "recover_for" and isinstance(on, str) and on.startswith("alert:"):
            out.append(
                (key, "has no effect on an alert rule: its undo runs when the alert resolves")
            )
    return out


class Signal(_Model):
    local: str | None = None
    promql: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Signal:
        if (self.local is None) == (self.promql is None):
            raise ValueError("a signal needs exactly one of `local` or `promql`")
        if self.promql is not None and not self.promql.strip():
            raise ValueError("promql is empty: expected a PromQL expression")
        if self.local is not None and self.local not in LOCAL_SIGNALS:
            raise ValueError(
                f"unknown local signal {self.local!r} (expected one of {', '.join(LOCAL_SIGNALS)})"
            )
        return self


class Rule(_Model):
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    signal: str | None = None
    above: float | None = None
    below: float | None = None
    for_: float = Field(0.0, alias="for")
    recover_below: float | None = None
    recover_above: float | None = None
    recover_for: float = 0.0
    cooldown: float | None = None
    on: str | None = None
    action: str
    params: dict[str, Any] = Field(default_factory=dict)
    undo: str | None = None
    undo_params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("for_", "recover_for", "cooldown", mode="before")
    @classmethod
    def _durations(cls, v: Any) -> Any:
        return None if v is None else parse_duration(v)

    @field_validator("name", "on", mode="after")
    @classmethod
    def _length(cls, v: str | None, info: ValidationInfo) -> str | None:
        problem = _too_long("a rule name" if info.field_name == "name" else "`on`", v)
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _shape(self) -> Rule:
        if self.on is not None:
            self._event_shape()
        else:
            self._threshold_shape()
        self._check_action(self.action, self.params, "action", "params")
        if self.undo is not None:
            self._check_action(self.undo, self.undo_params, "undo", "undo_params")
            # only the action's own undo: any other runs an unrelated remedy at recovery (an
            # evict rule with `undo: halt_admission` would halt admission once KV recovers)
            inverse = ACTIONS[self.action].undo
            if self.undo != inverse:
                raise _At(
                    ("undo",),
                    f"rule {self.name!r}: undo {self.undo!r} does not undo {self.action!r} "
                    + (
                        f"(its undo is {inverse})"
                        if inverse
                        else "(that action has no undo: leave `undo` out)"
                    ),
                )
        return self

    def _event_shape(self) -> None:
        problem = event_problem(self.on)
        if problem:
            raise _At(("on",), f"on={problem}")
        if self.signal is not None or self.above is not None or self.below is not None:
            raise ValueError("an event rule (`on`) takes no signal, above or below")
        self._no_ignored_keys()

    def _threshold_shape(self) -> None:
        if self.signal is None:
            raise ValueError("a rule needs `signal` with `above`/`below`, or `on` for an event")
        if (self.above is None) == (self.below is None):
            raise ValueError("a threshold rule needs exactly one of `above` or `below`")
        self._no_ignored_keys()
        if self.recover_below is not None and self.recover_above is not None:
            raise ValueError("give at most one of recover_below / recover_above")
        if self.above is not None and self.recover_above is not None:
            raise ValueError("a rule firing `above` recovers `below`: use recover_below")
        if self.below is not None and self.recover_below is not None:
            raise ValueError("a rule firing `below` recovers `above`: use recover_above")
        if (
            self.above is not None
            and self.recover_below is not None
            and self.recover_below > self.above
        ):
            raise ValueError(
                f"recover_below={self.recover_below} must not exceed above={self.above}"
            )
        if (
            self.below is not None
            and self.recover_above is not None
            and self.recover_above < self.below
        ):
            raise ValueError(
                f"recover_above={self.recover_above} must not be under below={self.below}"
            )

    def _no_ignored_keys(self) -> None:
        """The first key given that this rule's shape never reads (`ignored_keys`; the file's
        cross-checks list every one)."""
        given = {
            ("for" if f == "for_" else f): getattr(self, f)
            for f in type(self).model_fields
            if f in self.model_fields_set
        }
        problems = ignored_keys(given)
        if problems:
            raise _At((problems[0][0],), problems[0][1])

    @staticmethod
    def _check_action(name: str, params: dict[str, Any], field: str, params_field: str) -> None:
        if name not in ACTIONS:
            raise _At(
                (field,), f"unknown {field} {name!r} (expected one of {', '.join(sorted(ACTIONS))})"
            )
        try:
            parse_params(name, params)
        except ActionError as e:
            raise _At((params_field,), str(e)) from e

    # -- evaluation helpers -----------------------------------------------------------------
    @property
    def is_event(self) -> bool:
        return self.on is not None

    def triggered(self, v: float) -> bool:
        return v > self.above if self.above is not None else v < self.below  # type: ignore[operator]

    def threshold(self) -> float | None:
        return self.above if self.above is not None else self.below

    def recovery_threshold(self) -> float | None:
        """What the undo waits for: the recovery threshold, or without one the trigger's."""
        if self.recover_below is not None:
            return self.recover_below
        return self.recover_above if self.recover_above is not None else self.threshold()

    def recovered(self, v: float) -> bool:
        """Below the lower recovery threshold (hysteresis); without one, when no longer triggered."""
        if self.recover_below is not None:
            return v < self.recover_below
        if self.recover_above is not None:
            return v > self.recover_above
        return not self.triggered(v)


class RuleSet(_Model):
    version: int = 1
    interval: float = 5.0
    cooldown: float = 30.0
    signals: dict[str, Signal] = Field(default_factory=dict)
    rules: list[Rule] = Field(default_factory=list)

    @field_validator("interval", "cooldown", mode="before")
    @classmethod
    def _durations(cls, v: Any) -> Any:
        return parse_duration(v)

    @field_validator("interval", mode="after")
    @classmethod
    def _interval(cls, v: float) -> float:
        if v < MIN_INTERVAL:
            raise ValueError(f"interval {v:g}s is too short: at least {MIN_INTERVAL * 1e3:g}ms")
        if v > MAX_INTERVAL:
            raise ValueError(
                f"interval {v:g}s is too long: at most {MAX_INTERVAL:g}s (the rules must see "
                "memory pressure within seconds, and the shipped RuleEvaluationStalled alert "
                "reads 5 minutes without an evaluation as a stalled daemon)"
            )
        return v

    @field_validator("signals", mode="after")
    @classmethod
    def _signal_names(cls, v: dict[str, Signal]) -> dict[str, Signal]:
        for name in v:
            problem = _too_long("a signal name", name)
            if problem:
                raise _At((name,), problem)
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"version {v} is not supported (expected 1)")
        return v

    def ladder_of(self, signal: str) -> str:
        """The ladder the rules on `signal` are rungs of: what its local measure measures,
        where other signals measure it too (the batch cut reads the KV demand and the halt
        the KV usage, both of the device pool: on a spike the halt still comes off first),
        else the signal itself."""
        sig = self.signals.get(signal)
        spec = LOCAL_SIGNALS.get(sig.local) if sig is not None and sig.local else None
        return f"pool:{spec.pool}" if spec is not None and spec.pool else f"signal:{signal}"

    @model_validator(mode="after")
    def _references(self) -> RuleSet:
        seen: set[str] = set()
        for i, r in enumerate(self.rules):
            if r.name in seen:
                raise _At(("rules", i, "name"), f"duplicate rule name {r.name!r}")
            seen.add(r.name)
            if r.signal is not None and r.signal not in self.signals:
                raise _At(
                    ("rules", i, "signal"),
                    f"unknown signal {r.signal!r} (defined: {', '.join(self.signals) or 'none'})",
                )
            local = self.signals[r.signal].local if r.signal is not None else None
            given = {key: getattr(r, key) for key in THRESHOLDS}
            given |= {"name": r.name, "action": r.action, "undo": r.undo}
            problems = off_ratio_thresholds(given, r.signal, local)
            problems += undo_never_due(given, r.signal, local)
            if problems:
                raise _At(("rules", i, problems[0][0]), problems[0][1])
        return self

    def cooldown_of(self, rule: Rule) -> float:
        return self.cooldown if rule.cooldown is None else rule.cooldown


class _At(ValueError):
    """A cross-field error that knows its own location."""

    def __init__(self, loc: tuple, msg: str) -> None:
        super().__init__(msg)
        self.loc = loc


def _alias(loc: tuple) -> tuple:
    return tuple("for" if p == "for_" else p for p in loc)


def load_rules_text(text: str | bytes, name: str, warnings: list[str] | None = None) -> RuleSet:
    """The rules in `text` (`name` is the file named in messages), or RulesFileError listing
    every problem. What is legal but likely a mistake (`missing_undos`) is appended to
    `warnings`, or, without that list, logged: the daemon's start and its reloads load through
    here, so its log says it where `kvguard rules check` prints it."""
    try:
        data, lines = load_yaml(text, name)
    except YamlFileError as e:
        raise RulesFileError(e.errors) from None
    if data is None:  # a file emptied by mistake would take every remedy away
        raise RulesFileError(
            [
                f"{name}:1: the rules file holds nothing, or only comments (for no rules, write `version: 1` and `rules: []`)"
            ]
        )
    if not isinstance(data, dict):
        raise RulesFileError(
            [f"{name}:1: the rules file must be a mapping (version, interval, signals, rules)"]
        )
    try:
        rs = RuleSet.model_validate(data)
    except ValidationError as e:
        errors = [format_error(err, lines, name) for err in e.errors()]
        errors += [m for m in _cross_checks(data, lines, name) if m not in errors]
        raise RulesFileError(sorted(errors, key=line_key)) from e
    found = missing_undos(rs, lines, name)
    if warnings is None:
        for line in found:
            log.warning("%s", line)
    else:
        warnings.extend(found)
    return rs


# what each engine setting a remedy sets is called in a warning
SETTING_WORDS = {
    "batch": "batch limit",
    "kv_dtype": "KV cache dtype",
    "kv_pool": "KV pool share",
    "offload": "offload",
    "token_cap": "max-token cap",
    "admission": "admission halt",
}


def missing_undos(rs: RuleSet, lines: dict, name: str) -> list[str]:
    """A warning, as `FILE:LINE: warning: ...`, for each rule whose action has an undo that the
    rule does not give: what it sets then stays in force for good (the README's first rules
    example ran the OOM chain so, and one engine OOM left the batch halved and the KV cache FP8
    until a restart while `rules check` said OK). Legal, for a deliberate one-way rule, so
    never an error."""
    out = []
    for i, rule in enumerate(rs.rules):
        inverse = ACTIONS[rule.action].undo
        if rule.undo is not None or inverse is None:
            continue
        settings = ACTIONS[rule.action].settings
        what = ", ".join(words for key, words in SETTING_WORDS.items() if key in settings)
        out.append(
            f"{name}:{line_for(lines, ('rules', i, 'action'))}: warning: rules.{i}.action: "
            f"rule {rule.name!r} runs {rule.action} without an undo, so what it sets ({what}) "
            "stays in force until an operator puts it back or the daemon restarts: add "
            f"`undo: {inverse}`, or leave it out if the rule is meant to be one-way"
        )
    return out


def line_key(msg: str) -> int:
    """The line a `FILE:LINE: ...` problem names (0 without one), to list them in order."""
    parts = msg.split(":")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _cross_checks(data: dict, lines: dict, name: str) -> list[str]:
    """Duplicate names, unknown signals, thresholds off a ratio signal's 0..1, undos waiting
    for a running total to fall, keys a rule's shape never reads and bad action params, found
    even when other fields are broken (and every one of each, where the model reports a
    rule's or the file's first)."""
    out = []
    signals = data.get("signals") if isinstance(data.get("signals"), dict) else {}
    rules = data.get("rules") if isinstance(data.get("rules"), list) else []
    seen: set[str] = set()
    for i, r in enumerate(rules):
        if not isinstance(r, dict):
            continue
        # a name or signal of another type (`signal: [kv]`) is no key to look up, and its own
        # type error says what is wrong with it: looked up, it stopped `rules check` with a
        # traceback instead
        if isinstance(r.get("name"), str):
            if r["name"] in seen:
                out.append(
                    f"{name}:{line_for(lines, ('rules', i, 'name'))}: rules.{i}.name: duplicate rule name {r['name']!r}"
                )
            seen.add(r["name"])
        sig = r.get("signal")
        if isinstance(sig, str) and sig not in signals:
            out.append(
                f"{name}:{line_for(lines, ('rules', i, 'signal'))}: rules.{i}.signal: unknown signal {sig!r} "
                f"(defined: {', '.join(map(str, signals)) or 'none'})"
            )
        out += [
            f"{name}:{line_for(lines, ('rules', i, key))}: rules.{i}.{key}: {why}"
            for key, why in off_ratio_thresholds(r, sig, _local_of(signals, sig))
            + undo_never_due(r, sig, _local_of(signals, sig))
        ]
        if r.get("on") is not None or sig is not None:
            out += [
                f"{name}:{line_for(lines, ('rules', i, key))}: rules.{i}.{key}: {why}"
                for key, why in ignored_keys(r)
            ]
        out += _params_problems(r, i, lines, name)
    return out


def _local_of(signals: dict, sig: Any) -> str | None:
    """The local signal that signal `sig` of the file's raw `signals` reads (None: none, or it
    is PromQL, or not a signal of the file)."""
    spec = signals.get(sig) if isinstance(sig, str) else None
    if not isinstance(spec, dict) or spec.get("promql") is not None:
        return None
    local = spec.get("local")
    return local if isinstance(local, str) else None


def _params_problems(rule: dict, i: int, lines: dict, name: str) -> list[str]:
    """Rule `i`'s params and undo_params against their actions, as `Rule._check_action`
    words them: the model checks them only once every field of the rule is valid, and stops at
    the rule's first problem, so a bad `for` beside bad params showed only the `for`."""
    out = []
    for field, params_field in (("action", "params"), ("undo", "undo_params")):
        action, params = rule.get(field), rule.get(params_field)
        if not isinstance(action, str) or action not in ACTIONS:
            continue
        if params is not None and not isinstance(params, dict):
            continue  # the field's own type error says it
        try:
            parse_params(action, params)
        except ActionError as e:
            loc = ("rules", i, params_field)
            out.append(f"{name}:{line_for(lines, loc)}: rules.{i}.{params_field}: {e}")
    return out


def format_error(err: dict, lines: dict, name: str) -> str:
    """One pydantic error as `FILE:LINE: field.path: problem`."""
    ctx = err.get("ctx") or {}
    inner = ctx.get("error")
    loc = _alias(tuple(err["loc"]))
    if isinstance(inner, _At):
        loc = loc + inner.loc
    field = ".".join(str(p) for p in loc) or "(top level)"
    msg = str(inner) if inner is not None else err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif inner is None and err["type"] not in ("missing", "value_error") and "input" in err:
        msg += f" (got {err['input']!r})"
    msg = msg.removeprefix("Value error, ")
    return f"{name}:{line_for(lines, loc)}: {field}: {msg}"


def load_rules(path: Path, warnings: list[str] | None = None) -> RuleSet:
    """The rules file at `path` (`warnings`: as `load_rules_text`)."""
    try:
        source = read_source(Path(path))
    except OSError as e:
        raise RulesFileError([f"{path}: cannot read: {e.strerror}"]) from e
    return load_rules_text(source, str(path), warnings)


def default_rules_path() -> Path:
    return Path(__file__).with_name("default.yaml")


def rules_file(path: str | Path | None) -> Path:
    """The rules file `rules.path` names, or the packaged default rules when it names none."""
    return Path(path) if path else default_rules_path()
