"""The control plane inside the daemon: rules evaluated on a schedule and on events, actions
through the engine's control surface, every act and event in the audit log.

APScheduler runs the periodic jobs (rule ticks, NVML polling, audit retention) with
max_instances=1 and coalescing, so a slow tick never piles up. Engine events (an OOM, a
preemption storm) and Alertmanager alerts trigger an immediate evaluation.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from kvguard.engine.control import ActionResult
from kvguard.engine.events import EngineEvent
from kvguard.rules.actions import run_action
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import RuleSet, RulesFileError, default_rules_path, load_rules
from kvguard.rules.signals import PromQL, SignalReader

if TYPE_CHECKING:
    from kvguard.daemon.service import Service

log = logging.getLogger("kvguard.control")
AUDITED_EVENTS = ("engine_oom", "admission_halted", "admission_resumed", "kv_dtype_switched")
STORM_WINDOW_S = 10.0
STORM_PREEMPTIONS = 32


class ControlPlane:
    def __init__(self, service: Service) -> None:
        self.service = service
        cfg = service.cfg
        self.rules_path = Path(cfg.rules.path) if cfg.rules.path else default_rules_path()
        self.ruleset: RuleSet = load_rules(self.rules_path)
        self.promql = PromQL(cfg.prometheus.url, cfg.prometheus.timeout, cfg.prometheus_instance())
        self._gpu_ratio: float | None = None
        reader = SignalReader(
            lambda: service.engine.latest_snapshot, lambda: self._gpu_ratio, self.promql
        )
        self.evaluator = Evaluator(
            self.ruleset,
            reader,
            self._execute,
            audit=service.audit,
            dry_run=cfg.rules.dry_run,
            host=socket.gethostname(),
        )
        self.scheduler = BackgroundScheduler(job_defaults={"max_instances": 1, "coalesce": True})
        self._preempt_times: deque[float] = deque()
        self._storm_until = 0.0
        self._seen_alerts: dict[tuple[str, str, str], float] = {}
        self._lock = threading.Lock()
        self.alerts_received: dict[tuple[str, str], int] = {}
        self.on_tick = None  # set by metrics: observes tick duration

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        s = self.scheduler
        s.add_job(self.evaluate, "interval", seconds=self.ruleset.interval, id="rules")
        s.add_job(
            self._poll_nvml,
            "interval",
            seconds=self.service.cfg.monitoring.nvml_poll_interval,
            id="nvml",
        )
        s.add_job(self._retention, "interval", hours=6, id="audit-retention")
        s.start()
        self._poll_nvml()
        self.service.engine.events.subscribe(self._on_engine_event)
        log.info(
            "rules: %s (%d rules every %gs%s)",
            self.rules_path,
            len(self.ruleset.rules),
            self.ruleset.interval,
            ", dry run" if self.evaluator.dry_run else "",
        )

    def stop(self) -> None:
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)

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
        is held to that limit (`clamp`), and the recorded detail says so."""
        return run_action(self.service.engine, action, params, clamp=True).result(timeout=120)

    def _poll_nvml(self) -> None:
        self._gpu_ratio = self.service.nvml.memory_used_ratio()

    def _retention(self) -> None:
        days = self.service.cfg.audit.retention / 86400.0
        purge = getattr(self.service.audit, "purge_older_than", None)
        if purge is not None:
            purge(days)

    # -- events -----------------------------------------------------------------------------
    def _on_engine_event(self, event: EngineEvent) -> None:
        """On the engine thread: only record and schedule, never act here."""
        if event.kind in AUDITED_EVENTS:
            self.service.audit.record_event(
                event.kind,
                detail=_summary(event),
                data=_plain(event.data),
                incident=self.evaluator.incident,
            )
        if event.kind == "engine_oom":
            self._soon("engine_oom")
        elif event.kind == "preempted":
            self._count_preemption(event.time)

    def _count_preemption(self, t: float) -> None:
        q = self._preempt_times
        q.append(t)
        while q and q[0] < t - STORM_WINDOW_S:
            q.popleft()
        if len(q) >= STORM_PREEMPTIONS and t > self._storm_until:
            self._storm_until = t + STORM_WINDOW_S
            self.service.audit.record_event(
                "preemption_storm", detail=f"{len(q)} preemptions in {STORM_WINDOW_S:g}s"
            )
            self._soon("preemption_storm")

    def _soon(self, kind: str, resolved: bool = False) -> None:
        """Evaluate right away on the scheduler's worker threads (not the caller's)."""

        def run() -> None:
            self.evaluator.handle_event(kind, resolved=resolved)
            self.evaluate()

        self.scheduler.add_job(run, id=None, misfire_grace_time=60)

    # -- Alertmanager -----------------------------------------------------------------------
    def alertmanager(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Webhook payload v4: each alert once per (fingerprint, startsAt, status)."""
        if str(payload.get("version", "4")) != "4":
            raise ValueError(
                f"unsupported Alertmanager payload version {payload.get('version')!r} (expected 4)"
            )
        alerts = payload.get("alerts")
        if not isinstance(alerts, list):
            raise ValueError("payload.alerts: expected a list")
        taken, dupes, other = 0, 0, 0
        mine = self.service.cfg.prometheus_instance()
        for a in alerts:
            if not isinstance(a, dict):
                raise ValueError("payload.alerts[]: expected objects")
            inst = (a.get("labels") or {}).get("instance")
            if inst is not None and inst != mine:
                other += 1  # a fleet-wide receiver: another daemon's alert is not ours to act on
            elif self._take_alert(a):
                taken += 1
            else:
                dupes += 1
        return {"accepted": taken, "duplicates": dupes, "other_instance": other}

    def _take_alert(self, a: dict[str, Any]) -> bool:
        name = str((a.get("labels") or {}).get("alertname", ""))
        status = str(a.get("status", "firing"))
        key = (str(a.get("fingerprint") or name), str(a.get("startsAt", "")), status)
        with self._lock:
            if key in self._seen_alerts:
                return False
            self._seen_alerts[key] = time.time()
            if len(self._seen_alerts) > 10000:
                oldest = sorted(self._seen_alerts, key=self._seen_alerts.get)[:5000]
                for k in oldest:
                    del self._seen_alerts[k]
            k2 = (name, status)
            self.alerts_received[k2] = self.alerts_received.get(k2, 0) + 1
        kind = "alert_resolved" if status == "resolved" else "alert_received"
        self.service.audit.record_event(
            kind,
            detail=name,
            data={
                "labels": a.get("labels"),
                "startsAt": a.get("startsAt"),
                "fingerprint": a.get("fingerprint"),
            },
            incident=self.evaluator.incident,
        )
        self._soon(f"alert:{name}", resolved=status == "resolved")
        return True

    # -- reload -----------------------------------------------------------------------------
    def reload(self, rules_path: Path | None, dry_run: bool) -> dict[str, Any]:
        """Load new rules; on any failure the running rules and their schedule stay as they were.

        Everything that can fail runs before anything is swapped: the file is validated and the
        new interval made into a trigger whose next fire time is computed, so an interval that
        APScheduler cannot add to a date is refused here instead of killing the rule job after
        the old rules are gone. If swapping still fails, the old schedule is put back."""
        path = Path(rules_path) if rules_path else default_rules_path()
        try:
            new = load_rules(path)
            trigger = self._interval_trigger(new.interval)
        except RulesFileError as e:
            return self._reload_refused(path, e.errors)
        except Exception as e:  # noqa: BLE001 - whatever it is, the running rules stay
            return self._reload_refused(path, [f"{path}: {type(e).__name__}: {e}"])
        job = self.scheduler.get_job("rules")
        old_trigger = job.trigger if job is not None else None
        try:
            if job is not None:  # none before start(), which schedules self.ruleset.interval
                self.scheduler.reschedule_job("rules", trigger=trigger)
            self.evaluator.replace_rules(new)
        except Exception as e:  # noqa: BLE001
            log.exception("installing the reloaded rules failed; keeping the running ones")
            if old_trigger is not None:
                try:
                    self.scheduler.reschedule_job("rules", trigger=old_trigger)
                except Exception:  # noqa: BLE001 - already logged above; nothing else to try
                    log.exception("could not restore the rule job's schedule")
            return self._reload_refused(path, [f"{path}: not installed: {type(e).__name__}: {e}"])
        diff = rules_diff(self.ruleset, new)
        self.rules_path, self.ruleset = path, new
        self.evaluator.dry_run = dry_run
        return {"rules_reloaded": True, "rules": len(new.rules), "rules_changed": diff}

    def _interval_trigger(self, seconds: float) -> IntervalTrigger:
        """The rule job's trigger for `seconds`; raises (OverflowError) where APScheduler would
        raise later, on the scheduler thread, with the job already half-replaced."""
        trigger = IntervalTrigger(seconds=seconds, timezone=self.scheduler.timezone)
        trigger.get_next_fire_time(None, datetime.now(self.scheduler.timezone))
        return trigger

    def _reload_refused(self, path: Path, errors: list[str]) -> dict[str, Any]:
        self.service.audit.record_event(
            "config_error", detail=f"rules reload refused: {path}", data={"errors": errors}
        )
        return {"rules_reloaded": False, "errors": errors}


def rules_diff(old: RuleSet, new: RuleSet) -> list[str]:
    """What a reload changed, rule by rule: `+name` added, `-name` removed, `~name` edited."""
    before, after = {r.name: r for r in old.rules}, {r.name: r for r in new.rules}
    out = [f"-{n}" for n in before if n not in after]
    out += [f"+{n}" for n in after if n not in before]
    out += [f"~{n}" for n in after if n in before and after[n] != before[n]]
    if old.signals != new.signals:
        out.append("~signals")
    if old.interval != new.interval:
        out.append(f"interval {old.interval:g}s -> {new.interval:g}s")
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
    if event.kind == "kv_dtype_switched":
        return f"KV {d.get('from')} -> {d.get('to')} in {d.get('pause_s', 0) * 1e3:.0f} ms"
    return event.kind.replace("_", " ")
