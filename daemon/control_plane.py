"""The control plane inside the daemon: rules evaluated on a schedule and on events, actions
through the engine's control surface, every act and event in the audit log.

The periodic jobs (rule ticks, NVML polling, audit retention) each run on a `Ticker`, a thread
of its own paced by the monotonic clock: a step of the wall clock (chrony's makestep at boot, an
operator's `date -s`) neither stops them nor makes them burst, and a slow tick never piles up
(the ticks it overran are coalesced into one). Engine events (an OOM, a preemption storm) and
Alertmanager alerts trigger an immediate evaluation, a one-off job on APScheduler's worker
threads; where it opens an incident, the event (its audit row) is that incident's cause, the
first row of its timeline. Preemption storms are counted on the monotonic clock too
(`EngineEvent.monotonic`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from apscheduler.schedulers import SchedulerNotRunningError
from apscheduler.schedulers.background import BackgroundScheduler

from kvguard.daemon.openai_schemas import unicode_problem
from kvguard.engine.control import ActionResult
from kvguard.engine.events import EngineEvent
from kvguard.engine.plural import counted
from kvguard.rules.actions import StopSignal, await_action, run_action
from kvguard.rules.evaluator import Evaluator, same_rule
from kvguard.rules.schema import RuleSet, RulesFileError, load_rules, rules_file
from kvguard.rules.signals import PromQL, SignalReader, url_shown

if TYPE_CHECKING:
    from kvguard.daemon.config import Config
    from kvguard.daemon.service import Service

log = logging.getLogger("kvguard.control")
# Records one event in the incident given (None: none is open).
Recorder = Callable[[str | None], None]
AUDITED_EVENTS = (
    "engine_oom",
    "engine_oom_repeated",
    "engine_step_failed",
    "admission_halted",
    "admission_resumed",
    "kv_dtype_switched",
    "kv_pool_resized",
    "step_budget_restored",
)
STORM_WINDOW_S = 10.0
STORM_PREEMPTIONS = 32
MAX_ALERTS_PER_REQUEST = 100  # Alertmanager's webhook_config max_alerts keeps a group under it
# An alert name becomes a metric label (and an audit detail, a log line): a longer one (a
# template gone wrong, or a sender making labels up) is refused, not exported.
MAX_ALERT_NAME_CHARS = 256
LOGGED_CHARS = 120  # the most of a client's string (an instance label) a log line quotes
# How long a rule's action may wait for the engine to take it at a step boundary before it is
# withdrawn unapplied (recorded failed); one the engine has taken gets as long again to finish.
# The stop ends either wait at once (`stop`): it never waits them out.
ACTION_TIMEOUT_S = 120.0
RETENTION_EVERY_S = 6 * 3600.0  # the audit retention's purge (and once at start)
MAX_WAIT_S = 3600.0  # a ticker's longest single wait (it wakes and waits again: any interval)
# The stop's wait for the ticks and the event evaluations under way, all together (its share of
# service.CLOSE_BUDGET_S): one stuck past it (an NVML query on a wedged GPU, a rules evaluation
# stuck elsewhere) is logged and left behind, and the process exits without it.
STOP_WAIT_S = 3.0
# The audit outcome (and kvguard_actions_total's) of an operator's action that applied and
# changed nothing, the engine already being so: the rules' word for an action that changed
# nothing (`held`), so that `applied` counts only what changed the engine.
UNCHANGED = "held"


class ControlPlane:
    def __init__(self, service: Service) -> None:
        self.service = service
        cfg = service.cfg
        self.rules_path = rules_file(cfg.rules.path)
        # what the service read before loading (`Service.read_rules`), else the file now
        self.ruleset: RuleSet = service.rules_at_start or load_rules(self.rules_path)
        self.promql = PromQL(*_prometheus_of(cfg, service.api_port))
        self._gpu_ratio: float | None = None
        self.reader = SignalReader(
            lambda: service.engine.latest_snapshot, lambda: self._gpu_ratio, self.promql
        )
        self.evaluator = Evaluator(
            self.ruleset,
            self.reader,
            self._execute,
            audit=service.audit,
            dry_run=cfg.rules.dry_run,
            host=socket.gethostname(),
        )
        # the events that start an evaluation (an OOM, a storm, a firing alert) a rule acts on,
        # not recorded yet, by number: each by its own evaluation, in the incident it opens (the
        # first row of its timeline), else after it in the incident open then (`_cause`)
        self._causes: dict[int, Recorder] = {}
        self._cause_numbers = itertools.count()
        self._causes_lock = threading.Lock()
        # the causes of the event evaluation each worker thread runs now
        self._job_causes: dict[threading.Thread, Sequence[int]] = {}
        self.evaluator.on_incident = self._on_incident
        # one-off jobs only (the evaluations engine events and alerts start, on its threads);
        # the periodic jobs are tickers on the monotonic clock (APScheduler's interval jobs
        # are due by the wall clock: a step back of an hour stopped them for an hour)
        self.scheduler = BackgroundScheduler(job_defaults={"max_instances": 1, "coalesce": True})
        self.stopping = StopSignal()  # set by stop(): actions awaited on the engine give way
        self.rule_ticker = Ticker("rules", self.evaluate, self.ruleset.interval, self.stopping)
        self.nvml_ticker = Ticker(
            "nvml", self._poll_nvml, cfg.monitoring.nvml_poll_interval, self.stopping
        )
        self.retention_ticker = Ticker(
            "audit-retention", self._retention, RETENTION_EVERY_S, self.stopping
        )
        self._preempt_times: deque[float] = deque()
        self._storm_until = 0.0
        self._seen_alerts: dict[tuple[str, str, str], float] = {}
        # this daemon's alerts firing now, by name: the alerts (fingerprints) of each that
        # fired and have not resolved since. Alertmanager's repeats are taken once, so a rule
        # a reload starts afresh learns from this that its alert still fires (`_refire`)
        self.firing: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self.alerts_received: dict[tuple[str, str], int] = {}
        # alerts whose `instance` label names another daemon, by alert name (each name logged
        # once: a mismatched prometheus.instance shows in the journal, not only as silence)
        self.alerts_ignored: dict[str, int] = {}
        self.on_tick = None  # set by metrics: observes tick duration
        self.action_timeout_s = ACTION_TIMEOUT_S
        # the event evaluations running now, by their worker thread: what each is for, since
        # when (named by the stop if it has to leave one behind)
        self._jobs: dict[threading.Thread, tuple[str, float]] = {}

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def tickers(self) -> tuple[Ticker, ...]:
        return (self.rule_ticker, self.nvml_ticker, self.retention_ticker)

    def start(self) -> None:
        # retention once now, on the audit writer (queued: READY does not wait for it), so that
        # a daemon restarted more often than every 6 h still purges; it first closes the
        # incidents an earlier run of this daemon left open (killed before its orderly stop)
        self._retention(at_start=True)
        self.scheduler.start()
        self._poll_nvml()
        for ticker in self.tickers:
            ticker.start()
        self.service.engine.events.subscribe(self._on_engine_event)
        log.info(
            "rules: %s (%d rules every %gs%s)",
            self.rules_path,
            len(self.ruleset.rules),
            self.ruleset.interval,
            ", dry run" if self.evaluator.dry_run else "",
        )

    def stop(self, timeout: float = STOP_WAIT_S) -> list[str]:
        """Bounded however stuck the engine is: an evaluation waiting on it for an action stops
        waiting at once (`stopping`), recording it failed, withdrawn if the engine had not taken
        it, else in `close_at_stop` as not known to have applied; only then are the tickers
        (woken at once from their waits by `stopping`) and the scheduler waited for, `timeout`
        seconds in all. Bounded whatever else a tick or an evaluation is stuck in (an NVML
        query on a wedged GPU): one still running then is logged (a WARNING naming its thread
        and where it is) and not waited for. The engine events are recorded and the incident
        closed either way. What was left running, one line each ([]: nothing)."""
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for ticker in self.tickers:
            ticker.join(max(deadline - time.monotonic(), 0.0))
        if self.scheduler.running:
            # on a helper: its shutdown waits for every evaluation under way, with no bound;
            # those queued behind them still run (and end at once: `stopping`)
            down = threading.Thread(
                target=self.scheduler.shutdown, name="kvguard-scheduler-stop", daemon=True
            )
            down.start()
            down.join(max(deadline - time.monotonic(), 0.0))
        left = self._still_running()
        for line in left:
            log.warning(
                "stop: %s; not waited for past %gs: the daemon exits without it", line, timeout
            )
        self.record_pending()
        self.evaluator.close_at_stop()
        return left

    def _still_running(self) -> list[str]:
        """The ticks and the event evaluations under way, each with its thread, how long it
        has run and where it is."""
        now = time.monotonic()
        out = []
        for ticker in self.tickers:
            thread, since = ticker.thread, ticker.tick_since
            if thread is not None and thread.is_alive():
                took = "" if since is None else f" for {now - since:.1f}s"
                out.append(f"the {ticker.name} tick is running{took} ({_where(thread)})")
        for thread, (what, since) in list(self._jobs.items()):
            if thread.is_alive():
                out.append(f"{what} is running for {now - since:.1f}s ({_where(thread)})")
        return out

    def record_pending(self) -> None:
        """Record the causes no evaluation recorded yet, in the incident open now: at the stop,
        and at a forced exit, which waits for no evaluation (they would be lost)."""
        self._record_causes(None, self.evaluator.incident)

    def evaluate(self) -> None:
        """One tick; a tick skipped because another evaluation holds the turn (e.g. awaiting a
        stalled engine) is not a measured tick."""
        t0 = time.perf_counter()
        if self.evaluator.try_tick() is not None and self.on_tick:
            self.on_tick(time.perf_counter() - t0)

    def _execute(self, action: str, params: dict[str, Any]) -> ActionResult:
        """Post the action and wait for the engine to apply it at a step boundary. Called by the
        evaluator with no state lock held, so a slow engine delays only the next evaluation,
        never `/metrics` or `/admin/state`. A rule's parameter above the running config's limit
        is held to that limit (`clamp`), and the recorded detail says so.

        Not taken within `action_timeout_s`, the action is withdrawn and raises
        ActionWithdrawn: it never runs, so the `failed` the evaluator records is the truth (it
        used to stay in the mailbox and apply later, a remedy no rule held nor ever undid).
        One the engine has taken is waited for as long again; an engine stuck inside it raises
        ActionStillApplying, and the evaluator records its outcome when it comes. The stop
        (`stopping`) ends either wait at once, the same way: it never waits them out."""
        fut = run_action(self.service.engine, action, params, clamp=True)
        return await_action(fut, action, self.action_timeout_s, self.stopping)

    def _poll_nvml(self) -> None:
        self._gpu_ratio = self.service.nvml.memory_used_ratio()

    def _retention(self, at_start: bool = False) -> None:
        days = self.service.cfg.audit.retention / 86400.0
        purge = getattr(self.service.audit, "purge_older_than", None)
        if purge is not None:
            purge(days, close_stale=at_start)

    # -- events -----------------------------------------------------------------------------
    def _on_engine_event(self, event: EngineEvent) -> None:
        """On the engine thread: only record and schedule, never act here."""
        # its rules' evaluation records it (`_cause`); the count of a burst's repeated faults
        # starts one too, so that a remedy whose cooldown has passed acts again while it lasts
        if event.kind in ("engine_oom", "engine_oom_repeated"):
            causes = self._cause("engine_oom", functools.partial(self._record, event))
            self._soon_off_engine("engine_oom", causes)
        elif event.kind in AUDITED_EVENTS:
            self._record(event, self.evaluator.incident)
        elif event.kind == "preempted":
            self._count_preemption(event)

    def _record(self, event: EngineEvent, incident: str | None) -> None:
        self.service.audit.record_event(
            event.kind,
            detail=_summary(event),
            data=_plain(event.data),
            incident=incident,
            time=datetime.fromtimestamp(event.time, UTC),
        )

    def _cause(self, on: str, record: Recorder) -> list[int]:
        """An event that starts the evaluation of the rules `on` it: its row is held until that
        evaluation opens an incident, to be its cause, the first row of its timeline
        (`_on_incident`), or ends without one, to be in the incident open then. (Written at
        once, an alert's or a storm's row was in no incident: the timeline showed the alert
        resolving, never firing.) One no rule acts on opens nothing: recorded at once. Returns
        the numbers of the rows held, for the evaluation to take (`_soon_all`)."""
        if not any(r.on == on for r in self.evaluator.rules.rules):
            record(self.evaluator.incident)
            return []
        with self._causes_lock:
            number = next(self._cause_numbers)
            self._causes[number] = record
        return [number]

    def _on_incident(self, incident: str) -> None:
        """An evaluation opened `incident`: the events that started it are its cause. Those of
        the event evaluation on this thread only (a tick has none): another's, queued behind it,
        may open an incident of its own."""
        self._record_causes(self._job_causes.get(threading.current_thread(), ()), incident)

    def _record_causes(self, numbers: Iterable[int] | None, incident: str | None) -> None:
        """Record the causes `numbers` (None: all) still held, in `incident`: each once,
        whoever comes first (its evaluation, or the stop)."""
        with self._causes_lock:
            wanted = list(self._causes) if numbers is None else numbers
            taken = [self._causes.pop(n) for n in wanted if n in self._causes]
        for record in taken:
            record(incident)

    def _soon_off_engine(self, kind: str, causes: Sequence[int] = ()) -> None:
        """`_soon` from another thread: the engine thread must never wait on the scheduler's
        lock, which `stop()` holds while it waits for a running evaluation, and that may be
        waiting for the engine to apply its action (a deadlock of up to 120 s at shutdown)."""
        threading.Thread(
            target=self._soon,
            args=(kind,),
            kwargs={"causes": causes},
            name="kvguard-rule-event",
            daemon=True,
        ).start()

    def _count_preemption(self, event: EngineEvent) -> None:
        """Counted on the event's monotonic time: on the wall clock, a step back of an hour kept
        every earlier preemption in the window and held off the next storm for the hour."""
        q, t = self._preempt_times, event.monotonic
        q.append(t)
        while q and q[0] < t - STORM_WINDOW_S:
            q.popleft()
        if len(q) >= STORM_PREEMPTIONS and t > self._storm_until:
            self._storm_until = t + STORM_WINDOW_S
            record = functools.partial(
                self.service.audit.record_event,
                "preemption_storm",
                detail=f"{len(q)} preemptions in {STORM_WINDOW_S:g}s",
                time=datetime.fromtimestamp(event.time, UTC),
            )
            causes = self._cause("preemption_storm", lambda incident: record(incident=incident))
            self._soon_off_engine("preemption_storm", causes)

    def _soon(self, kind: str, resolved: bool = False, causes: Sequence[int] = ()) -> None:
        """Evaluate right away on the scheduler's worker threads (not the caller's)."""
        self._soon_all([(kind, resolved)], causes=causes)

    def _soon_all(
        self,
        events: list[tuple[str, bool]],
        only: set[str] | None = None,
        note: str = "",
        causes: Sequence[int] = (),
    ) -> None:
        """One job that runs the event rules of each (kind, resolved) in order, then one tick
        (`only`, `note`: as Evaluator.handle_event's). `causes`: the events it is for (`_cause`),
        recorded by it."""

        what = "the evaluation of " + ", ".join(kind for kind, _ in events)

        def run() -> None:
            me = threading.current_thread()
            self._jobs[me] = (what, time.monotonic())
            self._job_causes[me] = causes
            try:
                try:
                    for kind, resolved in events:
                        self.evaluator.handle_event(kind, resolved=resolved, only=only, note=note)
                finally:  # those that opened no incident, in the one open now, if one is
                    self._job_causes.pop(me, None)
                    self._record_causes(causes, self.evaluator.incident)
                self.evaluate()
            finally:
                self._jobs.pop(me, None)

        try:
            # however late (misfire_grace_time None): an evaluation stuck on a slow engine may
            # hold the pool's threads, and an event skipped as misfired would be lost (its
            # alert already marked as seen)
            self.scheduler.add_job(run, id=None, misfire_grace_time=None)
        except SchedulerNotRunningError:  # stopping: nothing to evaluate; its causes now
            self._record_causes(causes, self.evaluator.incident)

    # -- Alertmanager -----------------------------------------------------------------------
    def alertmanager(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Webhook payload v4: each alert taken once per (fingerprint, startsAt, status).

        The payload is checked whole before anything is taken (AlertPayloadError names the
        field), and bounded: at most MAX_ALERTS_PER_REQUEST alerts. The cost of a request is
        per alert name, not per alert: one audit row per (name, status) with the count, and one
        evaluation job for the whole request, in which each name is evaluated once: firing if
        a new alert of that name fires, resolved once none of this daemon's alerts of that name
        fires (`firing`, across requests: a resolved alert does not undo what another of its
        name still needs, a sibling in its group or one Alertmanager sends apart)."""
        alerts = parse_alerts(payload)
        mine = self.service.cfg.prometheus_instance(self.service.api_port)
        taken, dupes, other = 0, 0, 0
        new: dict[tuple[str, str], list[Alert]] = {}
        for a in alerts:
            if a.instance is not None and a.instance != mine:
                other += 1  # a fleet-wide receiver: another daemon's alert is not ours to act on
                self._ignore(a, mine)
                continue
            self._note_firing(a)
            if self._first_time(a):
                taken += 1
                new.setdefault((a.name, a.status), []).append(a)
            else:
                dupes += 1
        causes = [n for group in new.values() for n in self._alerts_row(group)]
        with self._lock:  # each name with an alert that fired and has not resolved since
            firing = set(self.firing)
        events: list[tuple[str, bool]] = []
        for name in dict.fromkeys(name for name, _ in new):
            if (name, "firing") in new:
                events.append((f"alert:{name}", False))
            elif name not in firing:
                events.append((f"alert:{name}", True))
        if events:
            self._soon_all(events, causes=causes)
        return {"accepted": taken, "duplicates": dupes, "other_instance": other}

    def _alerts_row(self, group: list[Alert]) -> list[int]:
        """The audit row of the alerts of one name and status a request brought, timed now. A
        resolution is recorded at once, in the incident open now (its evaluation may close
        it); a firing is a cause (`_cause`): the first row of the incident it opens."""
        name, status = group[0].name, group[0].status
        record = functools.partial(
            self.service.audit.record_event,
            "alert_resolved" if status == "resolved" else "alert_received",
            detail=name if len(group) == 1 else f"{name} (x{len(group)})",
            data={
                "count": len(group),
                "labels": group[0].labels,
                "startsAt": group[0].starts_at,
                "fingerprint": group[0].fingerprint,
                "fingerprints": [a.fingerprint for a in group],
            },
            time=datetime.now(UTC),
        )
        if status == "resolved":
            record(incident=self.evaluator.incident)
            return []
        return self._cause(f"alert:{name}", lambda incident: record(incident=incident))

    def _ignore(self, a: Alert, mine: str) -> None:
        """Count an alert for another instance; the first of each name is logged, with the
        instance it names and this daemon's, so that a `prometheus.instance` that does not
        match the scrape target's label is found without guessing."""
        with self._lock:
            first = a.name not in self.alerts_ignored
            self.alerts_ignored[a.name] = self.alerts_ignored.get(a.name, 0) + 1
        if first:  # the sender's strings quoted, escaped and cut: they cannot forge a line
            log.warning(
                "Alertmanager alert %s names instance %s, and this daemon is %r: not taken "
                "(another daemon's alert; if it is this daemon's, set prometheus.instance to the "
                "instance label Prometheus gives it). Further alerts of that name for other "
                "instances are counted in kvguard_alerts_ignored_total, not logged",
                a.name if a.name.isprintable() else quoted(a.name),  # at most 256 characters
                quoted(a.instance),
                mine,
            )

    def _note_firing(self, a: Alert) -> None:
        """Keep `firing` as the alert says: added while it fires, gone once it resolves."""
        key = a.fingerprint or repr(sorted(a.labels.items()))
        with self._lock:
            if a.status == "firing":
                self.firing.setdefault(a.name, set()).add(key)
            elif a.name in self.firing:
                self.firing[a.name].discard(key)
                if not self.firing[a.name]:
                    del self.firing[a.name]

    def _refire(self, rules: RuleSet, fresh: list[str]) -> None:
        """The alert rules a reload started afresh (new, given another remedy, or every rule
        at a dry-run switch) act at once where their alert still fires: Alertmanager will not
        send it again before it resolves (or only as a repeat, taken once), so without this
        the new rule would never act."""
        with self._lock:
            firing = set(self.firing)
        kinds: dict[str, None] = {}
        only: set[str] = set()
        for r in rules.rules:
            if r.name in fresh and r.on and r.on.startswith("alert:") and r.on[6:] in firing:
                kinds[r.on] = None
                only.add(r.name)
        if kinds:
            log.info("alerts still firing after the reload: %s acts again", ", ".join(sorted(only)))
            self._soon_all(
                [(kind, False) for kind in kinds],
                only=only,
                note="its alert still fires after a reload",
            )

    def _first_time(self, a: Alert) -> bool:
        """Count the alert and remember it; False if this very alert was taken before."""
        key = (a.fingerprint or a.name, a.starts_at or "", a.status)
        with self._lock:
            if key in self._seen_alerts:
                return False
            self._seen_alerts[key] = time.time()
            if len(self._seen_alerts) > 10000:
                oldest = sorted(self._seen_alerts, key=self._seen_alerts.get)[:5000]
                for k in oldest:
                    del self._seen_alerts[k]
            k2 = (a.name, a.status)
            self.alerts_received[k2] = self.alerts_received.get(k2, 0) + 1
        return True

    # -- reload -----------------------------------------------------------------------------
    def reload(
        self,
        rules_path: Path | None,
        dry_run: bool,
        before_install: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Load new rules; on any failure the running rules and their schedule stay as they were.

        Everything that can fail runs before anything is swapped: the file is validated first.
        A new interval applies at once (the next tick is one new interval away, not at the end
        of the old one); if swapping fails, the old interval is put back. `before_install`
        (the daemon's other reloadable settings) runs once the rules are known good and before
        they are swapped; what it raises refuses the reload whole."""
        path = rules_file(rules_path)
        try:
            new = load_rules(path)
        except RulesFileError as e:
            return self._reload_refused(path, e.errors)
        except Exception as e:  # noqa: BLE001 - whatever it is, the running rules stay
            return self._reload_refused(path, [f"{path}: {type(e).__name__}: {e}"])
        if before_install is not None:
            before_install()
        old_interval = self.rule_ticker.interval
        try:
            self.rule_ticker.set_interval(new.interval)
            fresh = self.evaluator.replace_rules(new)
        except Exception as e:  # noqa: BLE001
            log.exception("installing the reloaded rules failed; keeping the running ones")
            try:
                self.rule_ticker.set_interval(old_interval)
            except Exception:  # noqa: BLE001 - already logged above; nothing else to try
                log.exception("could not restore the rule job's schedule")
            return self._reload_refused(path, [f"{path}: not installed: {type(e).__name__}: {e}"])
        diff = rules_diff(self.ruleset, new)
        self.rules_path, self.ruleset = path, new
        if dry_run != self.evaluator.dry_run:
            diff.append(f"~dry_run={str(dry_run).lower()}")
        if self.evaluator.set_dry_run(dry_run):
            fresh = [r.name for r in new.rules]
        self._refire(new, fresh)
        out = {"rules_reloaded": True, "rules": len(new.rules), "rules_changed": diff}
        return out | {"prometheus_changed": self._use_prometheus()}

    def _use_prometheus(self) -> dict[str, Any]:
        """PromQL signals read the `prometheus` section in force (a reload may change it):
        a new client where it changed; what changed (`prometheus.KEY` -> its new value)."""
        now = _prometheus_of(self.service.cfg, self.service.api_port)
        p = self.promql
        changed = {
            f"prometheus.{key}": url_shown(new) if key == "url" else new
            for key, old, new in zip(
                ("url", "timeout", "instance"), (p.url, p.timeout_s, p.instance), now, strict=True
            )
            if old != new
        }
        if changed:  # counting on: the failure and empty-answer counters never go back to 0
            self.promql = p.reconfigured(*now)
            self.reader.promql = self.promql
        return changed

    def _reload_refused(self, path: Path, errors: list[str]) -> dict[str, Any]:
        self.service.audit.record_event(
            "config_error",
            detail=f"rules reload refused: {path}",
            data={"errors": errors},
            incident=self.evaluator.incident,
        )
        return {"rules_reloaded": False, "errors": errors}


class Ticker:
    """Calls `fn` every `interval` seconds of the monotonic clock, on a thread of its own, from
    `start()` until `stop` is set (which wakes its wait at once).

    The wall clock never enters: a step of it neither stops the ticks nor bursts them. Ticks
    keep to a grid (start + k * interval), so delays in waking do not add up; ticks missed
    while `fn` ran long are coalesced into the next grid point after it returned (never run
    back to back). `set_interval` applies at once: the next tick is one new interval later.
    A tick that raises is logged, and the ticks go on. (Its waits time out on the monotonic
    clock too: Python 3.11's lock timeouts use it where glibc has sem_clockwait, 2.30 on.)"""

    def __init__(
        self,
        name: str,
        fn: Callable[[], object],
        interval: float,
        stop: StopSignal,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.fn, self.clock = name, fn, clock
        self._interval = interval
        self._stop = stop
        self._lock = threading.Lock()
        self._wake: threading.Event | None = None
        self._reset = False  # the interval changed: the grid starts again from now
        self._thread: threading.Thread | None = None
        self.tick_since: float | None = None  # when the tick under way began (time.monotonic)
        self.ticks = 0  # ticks run
        self.coalesced = 0  # grid points passed over while a tick overran them

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvguard-{self.name}", daemon=True)
        self._thread.start()

    def set_interval(self, seconds: float) -> None:
        """Tick every `seconds` from now on (nothing changes if it is the interval already:
        reloads that keep it must not push the next tick back)."""
        with self._lock:
            if seconds == self._interval:
                return
            self._interval, self._reset = seconds, True
            wake = self._wake
        if wake is not None:
            wake.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        with self._stop.waker() as wake:
            with self._lock:
                self._wake, self._reset = wake, False
                interval = self._interval
            due = self.clock() + interval
            while not self._stop.is_set():
                with self._lock:
                    if self._reset:
                        self._reset, interval = False, self._interval
                        due = self.clock() + interval
                left = due - self.clock()
                if left > 0:
                    wake.wait(min(left, MAX_WAIT_S))
                    wake.clear()  # a stop or a new interval is seen at the top of the loop
                    continue
                self._tick()
                due += interval
                now = self.clock()
                if due <= now:  # overran: the next grid point after now, not a burst
                    missed = math.floor((now - due) / interval) + 1
                    self.coalesced += missed
                    due += missed * interval
            with self._lock:
                self._wake = None

    def _tick(self) -> None:
        self.ticks += 1
        self.tick_since = time.monotonic()  # the real clock: how long a stuck tick has run
        try:
            self.fn()
        except Exception:  # noqa: BLE001 - one failed tick must not end the schedule
            log.exception("periodic job %s failed", self.name)
        finally:
            self.tick_since = None


def _where(thread: threading.Thread) -> str:
    """Where `thread` is now: its name, the function it is in, and kvguard's innermost one
    (a library's call the thread is stuck in, and what of kvguard's made it)."""
    frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None
    if frame is None:
        return f"thread {thread.name}"
    at = f"thread {thread.name}, in {_frame(frame)}"
    ours: FrameType | None = frame
    while ours is not None and not ours.f_globals.get("__name__", "").startswith("kvguard."):
        ours = ours.f_back
    return at if ours is None or ours is frame else f"{at}, called from {_frame(ours)}"


def _frame(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"


def rules_diff(old: RuleSet, new: RuleSet) -> list[str]:
    """What a reload changed, rule by rule: `+name` added, `-name` removed, `~name` edited (a
    default param written out or left out is no edit: the rule keeps its state); then the
    file's top-level settings, each of which changes how every rule acts (a new `cooldown`
    paces the remedies at once, so a reload that only changed it must not read "no changes")."""
    before, after = {r.name: r for r in old.rules}, {r.name: r for r in new.rules}
    out = [f"-{n}" for n in before if n not in after]
    out += [f"+{n}" for n in after if n not in before]
    out += [f"~{n}" for n in after if n in before and not same_rule(after[n], before[n])]
    if old.signals != new.signals:
        out.append("~signals")
    if old.interval != new.interval:
        out.append(f"interval {old.interval:g}s -> {new.interval:g}s")
    if old.cooldown != new.cooldown:
        out.append(f"cooldown {old.cooldown:g}s -> {new.cooldown:g}s")
    return out


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (v if isinstance(v, str | int | float | bool | type(None) | list | dict) else str(v))
        for k, v in data.items()
    }


def _summary(event: EngineEvent) -> str:
    d = event.data
    if event.kind == "engine_oom":
        return (
            f"OOM in a step: {len(d.get('requeued', []))} requeued, batch budget "
            f"{d.get('max_num_batched_tokens_before')} -> {d.get('max_num_batched_tokens_after')}"
        )
    if event.kind == "engine_oom_repeated":
        return (
            f"OOM in {d.get('count')} more steps in {d.get('window_s', 0):.0f}s: "
            f"{d.get('requeues')} requeued, batch budget held at {d.get('max_num_batched_tokens')}"
        )
    if event.kind == "engine_step_failed":
        why = str(d.get("error"))[:LOGGED_CHARS]
        return f"engine step failed ({why}): {counted(len(d.get('failed', [])), 'request')} ended"
    if event.kind == "step_budget_restored":
        return (
            f"batch budget {d.get('max_num_batched_tokens_before')} -> "
            f"{d.get('max_num_batched_tokens_after')} (configured {d.get('configured')}) after "
            f"a quiet {d.get('quiet_period_s', 0):g}s"
        )
    if event.kind == "kv_dtype_switched":
        return f"KV {d.get('from')} -> {d.get('to')} in {d.get('pause_s', 0) * 1e3:.0f} ms"
    if event.kind == "kv_pool_resized":
        return (
            f"KV pool {d.get('blocks_before')} -> {d.get('blocks_after')} blocks, "
            f"{len(d.get('preempted', []))} preempted, in {d.get('pause_s', 0) * 1e3:.0f} ms"
        )
    return event.kind.replace("_", " ")


class AlertPayloadError(ValueError):
    """An Alertmanager payload refused before any of it was taken: `param` names the field
    (`alerts[3].labels`), `status` is 400, or 413 for too many alerts."""

    def __init__(self, message: str, param: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert of a webhook payload, checked: the fields kvguard reads, as text."""

    name: str
    status: str
    labels: dict[str, str]
    starts_at: str | None
    fingerprint: str | None

    @property
    def instance(self) -> str | None:
        return self.labels.get("instance")


def parse_alerts(payload: Any) -> list[Alert]:
    """The alerts of a version 4 webhook payload, or AlertPayloadError naming the first field
    that is not what Alertmanager sends (labels are an object of strings, status is firing or
    resolved, every string valid Unicode). Fields kvguard does not read are not checked."""
    if not isinstance(payload, dict):
        raise AlertPayloadError("expected a JSON object (Alertmanager webhook payload)", "body")
    version = payload.get("version", "4")
    if str(version) != "4":
        raise AlertPayloadError(
            f"unsupported Alertmanager payload version {version!r} (expected 4)", "version"
        )
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise AlertPayloadError("expected a list of alerts", "alerts")
    if len(alerts) > MAX_ALERTS_PER_REQUEST:
        raise AlertPayloadError(
            f"{len(alerts)} alerts in one request; at most {MAX_ALERTS_PER_REQUEST} are taken "
            f"(set max_alerts: {MAX_ALERTS_PER_REQUEST} in Alertmanager's webhook_config)",
            "alerts",
            status=413,
        )
    return [_parse_alert(a, f"alerts[{i}]") for i, a in enumerate(alerts)]


def _parse_alert(a: Any, where: str) -> Alert:
    if not isinstance(a, dict):
        raise AlertPayloadError("expected an object", where)
    labels = a.get("labels")
    if not isinstance(labels, dict):
        raise AlertPayloadError("expected an object of label names to strings", f"{where}.labels")
    for key, value in labels.items():
        _check_text(key, f"{where}.labels")
        if not isinstance(value, str):
            raise AlertPayloadError("expected a string", f"{where}.labels.{key}")
        _check_text(value, f"{where}.labels.{key}")
    name = labels.get("alertname")
    if not name:
        raise AlertPayloadError("missing: every alert has a name", f"{where}.labels.alertname")
    if len(name) > MAX_ALERT_NAME_CHARS:
        raise AlertPayloadError(
            f"{len(name)} characters; an alert name has at most {MAX_ALERT_NAME_CHARS}",
            f"{where}.labels.alertname",
        )
    status = a.get("status", "firing")
    if status not in ("firing", "resolved"):
        raise AlertPayloadError("expected firing or resolved", f"{where}.status")
    fields = {}
    for field in ("startsAt", "fingerprint"):
        value = a.get(field)
        if value is not None and not isinstance(value, str):
            raise AlertPayloadError("expected a string", f"{where}.{field}")
        if value is not None:
            _check_text(value, f"{where}.{field}")
        fields[field] = value
    return Alert(name, status, labels, fields["startsAt"], fields["fingerprint"])


def manual_outcome(res: ActionResult) -> str:
    """The outcome an operator's action that settled with `res` is audited and counted by:
    `refused` (the engine would not), UNCHANGED (it was already so: an operator's script that
    repeats a remedy must not read in the audit log that it changed the engine each time),
    else `applied`. A rule's action that found the engine already so stays `applied`: a
    rule's `held` says another remedy holds the setting, its remedy with an undo is in force
    all the same (its undo comes as its rule recovers), and its one-off gives the tick's
    escalation back (`Evaluator._escalated`), on the same `ActionResult.changed_nothing`."""
    if not res.ok:
        return "refused"
    return UNCHANGED if res.changed_nothing() else "applied"


def manual_detail(res: ActionResult) -> str:
    """An operator's action's detail as its answer and audit row say it: one that changed
    nothing says so first, as a rule's `held` action does."""
    return f"nothing changed: {res.detail}" if res.changed_nothing() else res.detail


def quoted(text: str | None, limit: int = LOGGED_CHARS) -> str:
    """A client's string as a log line quotes it: repr (a newline or an escape sequence shown
    as `\\n`, not written), cut to `limit` characters with the length said."""
    if text is None or len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def _check_text(text: str, where: str) -> None:
    """An unpaired surrogate or a NUL character would be refused by the audit database (NUL by
    PostgreSQL's text columns), not here: refuse it here."""
    problem = unicode_problem(text)
    if problem is None and "\x00" in text:
        problem = f"NUL character at character {text.index(chr(0))}: not allowed in alert text"
    if problem is not None:
        raise AlertPayloadError(problem, where)


def _prometheus_of(cfg: Config, port: int | None) -> tuple[str | None, float, str]:
    """What the PromQL client is built from: URL, timeout, the `$instance` value (`port`: the
    one the API is bound to, where known)."""
    return cfg.prometheus.url, cfg.prometheus.timeout, cfg.prometheus_instance(port)
