"""Chaos benchmark: faults thrown at a loaded `kvguard serve`, one after another.

A real Prometheus scrapes the daemon and a PromQL rule reads it back, so losing Prometheus
matters. While an open-loop load runs (this process, over HTTP), the faults are:

  prometheus   Prometheus stopped for a while, then started again on the same port
  audit-ro     the audit DB made read-only: `chattr +i` on the file and its WAL (root ignores
               chmod, not the immutable flag); where chattr is unavailable (not root, not
               ext2/3/4) another connection's BEGIN EXCLUSIVE stands in. One manual action is
               taken meanwhile, so a row has to wait until the file is writable again
  engine-oom   one out-of-memory fault inside an engine step (POST /admin/debug/inject_oom)
  kv-pool      long requests fill the device KV pool past half; it is shrunk (shrink_kv_pool
               0.25, held at one max_model_len request), held, then restored
               (restore_kv_pool): what does not fit is preempted, nothing lost
  sighup-bad   SIGHUP with a broken rules file: the old rules must stay
  sighup-good  SIGHUP with a good rules file: the new rules must be in force
  disconnect   20 streaming clients hang up mid-stream
  sigterm      arrivals stop, SIGTERM: in-flight requests drain, exit status 0

For each: daemon up, requests lost (neither a response nor a 429/503 with Retry-After), and what
the metrics and the log said. At the end: audit rows lost, comparing the rules' part of
kvguard_actions_total at the last scrape before SIGTERM with the rule rows decided up to that
scrape (rules keep acting in the drain; their rows come later), and the manual actions we took
with the manual rows.

    python bench/chaos.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.overload import (  # noqa: E402
    PRIORITIES,
    PRIORITY_WEIGHTS,
    Arrival,
    Daemon,
    Outcome,
    StartError,
    bench_workdir,
    fast_rules,
    free_port,
    kv_bytes_per_token,
    metric_sum,
    one_request,
    start_failure,
)
from bench.trace import (  # noqa: E402
    DEFAULT_MODEL,
    LengthDist,
    format_table,
    ordinary_token_ids,
    resolve_model_dir,
    write_json,
)

PROMQL_RULE = (
    "  # chaos: a PromQL-signal rule, so that losing Prometheus matters\n"
    "  - {name: fleet-kv, signal: fleet_kv, above: 0.90, for: 2s, action: cap_max_new_tokens,\n"
    "     params: {n: 64}, recover_below: 0.50, recover_for: 3s,"
    " undo: uncap_max_new_tokens}\n"
)
PROMQL_SIGNAL = (
    '  fleet_kv: {promql: \'max(kvguard_kv_cache_usage_ratio{tier="device",'
    'instance="$instance"})\'}\n'
)
BROKEN_RULES = "version: 1\nrules:\n  - {name: broken, signal: nope, action: explode}\n"
WATCHED = (  # metrics whose change during a fault says what the daemon noticed
    "kvguard_prometheus_query_failures_total",
    "kvguard_rule_evaluation_failures_total",
    "kvguard_audit_write_failures_total",
    "kvguard_audit_dropped_total",
    "kvguard_engine_oom_events_total",
    "kvguard_actions_total",
    "kvguard_preemptions_total",
)


@dataclass(frozen=True, slots=True)
class Timing:
    prom_down_s: float
    lock_s: float
    settle_s: float  # pause after each fault, so its effects show before the next one
    warmup_s: float
    rps: float
    disconnects: int = 20
    longs: int = 8  # the kv-pool fault's long requests


DRAIN_S = 300  # the daemon's drain_timeout; Daemon.stop waits it out, plus a margin

FULL = Timing(prom_down_s=30, lock_s=10, settle_s=8, warmup_s=10, rps=0.7, longs=8)
QUICK = Timing(prom_down_s=8, lock_s=4, settle_s=3, warmup_s=4, rps=0.5, longs=6)


# ----------------------------------------------------------------------------- Prometheus


class Prometheus:
    """A real Prometheus scraping the daemon every second; stop() and start() keep its port."""

    def __init__(self, workdir: Path, target_port: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = workdir
        self.cfg = workdir / "prometheus.yml"
        self.cfg.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n  - job_name: kvguard\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={self.cfg}",
                f"--storage.tsdb.path={self.dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise StartError(f"prometheus not ready within 60 s on 127.0.0.1:{self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


# ----------------------------------------------------------------------------- load


class Load(threading.Thread):
    """Open-loop Poisson arrivals until stopped; every outcome kept for the fault windows."""

    def __init__(self, url: str, model: str, vocab: Sequence[int], rps: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.rps, self.t0 = url, model, rps, t0
        self.rng = np.random.default_rng(0)
        self.vocab = np.asarray(vocab, dtype=np.int64)
        self.outcomes: list[Outcome] = []
        self.halt = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.client: httpx.AsyncClient | None = None
        self.extra: list[concurrent.futures.Future[Outcome]] = []

    def arrival(self) -> Arrival:
        p = LengthDist(32, 0.8, 8, 256).draw(self.rng, 1)[0]
        o = LengthDist(24, 0.8, 4, 96).draw(self.rng, 1)[0]
        prio = PRIORITIES[int(self.rng.choice(3, p=PRIORITY_WEIGHTS))]
        ids = [int(x) for x in self.rng.choice(self.vocab, size=p)]
        return Arrival(0.0, ids, o, prio, False)

    def run(self) -> None:
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=30)) as c:
            self.client = c
            tasks: list[asyncio.Task[Outcome]] = []
            while not self.halt.is_set():
                tasks.append(asyncio.create_task(self._one(self.arrival())))
                await asyncio.sleep(float(self.rng.exponential(1.0 / self.rps)))
            self.outcomes.extend(await asyncio.gather(*tasks))
            extra = [asyncio.wrap_future(f) for f in self.extra]
            self.outcomes.extend(await asyncio.gather(*extra))

    async def _one(self, a: Arrival, cancel_after: int = 0) -> Outcome:
        assert self.client is not None
        return await one_request(self.client, self.url, self.model, a, self.t0, cancel_after)

    async def _hang_up(self) -> Outcome:
        return await self._one(self.arrival(), cancel_after=2)  # drawn on the loop: one rng user

    def hang_ups(self, n: int) -> None:
        """n streams that the client drops after two chunks, from inside the load's loop."""
        self.extra += [
            asyncio.run_coroutine_threadsafe(self._hang_up(), self.loop) for _ in range(n)
        ]

    async def _long(self) -> Outcome:
        a = self.arrival()
        return await self._one(Arrival(0.0, a.prompt_ids[:64], 160, "low", False))

    def longs(self, n: int) -> None:
        """n low-priority requests of 160 output tokens, from inside the load's loop: enough
        live KV that a smaller pool cannot hold it."""
        self.extra += [asyncio.run_coroutine_threadsafe(self._long(), self.loop) for _ in range(n)]

    def stop(self) -> None:
        self.halt.set()
        self.join(600)


# ----------------------------------------------------------------------------- faults


@dataclass(slots=True)
class FaultReport:
    name: str
    start_s: float
    end_s: float = 0.0
    up: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    note: str = ""
    lost: int = 0
    sent: int = 0


class Chaos:
    """Runs the faults in order against one daemon and records what each one did."""

    def __init__(self, d: Daemon, prom: Prometheus, rules: Path, timing: Timing, t0: float) -> None:
        self.d, self.prom, self.rules, self.t = d, prom, rules, timing
        self.t0 = t0
        self.reports: list[FaultReport] = []
        self.manual_actions = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def fault(self, name: str, body: Callable[[], str]) -> None:
        """Run one fault, then let it settle; metrics and log lines are diffed across it."""
        print(f"-- {name}", flush=True)
        before, log_at = self._metrics(), self._log_size()
        rep = FaultReport(name, self.now())
        try:
            rep.note = body()
        except Exception as e:  # noqa: BLE001 - a fault harness reports, it does not stop
            rep.note = f"harness error: {type(e).__name__}: {e}"
        time.sleep(self.t.settle_s)
        rep.end_s, rep.up = self.now(), self.d.alive()
        after = self._metrics()
        rep.metrics = {m: metric_sum(after, m) - metric_sum(before, m) for m in WATCHED}
        rep.log = self._log_lines(log_at)
        self.reports.append(rep)
        print(f"   up={rep.up} {rep.note}", flush=True)

    def _metrics(self) -> dict[str, float]:
        try:
            return self.d.metrics()
        except httpx.HTTPError:
            return {}

    def _log_size(self) -> int:
        return self.d.log_path.stat().st_size

    def _log_lines(self, since: int) -> list[str]:
        """Warnings, errors and kvguard's own lines written during the fault (the 'why')."""
        with open(self.d.log_path, errors="replace") as f:
            f.seek(since)
            lines = f.read().splitlines()
        keep = [ln for ln in lines if " WARNING " in ln or " ERROR " in ln or " kvguard." in ln]
        return [ln[:200] for ln in keep if "apscheduler" not in ln][:8]

    # -- the faults ---------------------------------------------------------------------------
    def prometheus_down(self) -> str:
        self.prom.stop()
        time.sleep(self.t.prom_down_s / 2)
        states = {r["name"]: r["state"] for r in self.d.state()["rules"]}
        time.sleep(self.t.prom_down_s / 2)
        self.prom.start()
        return f"fleet-kv while down: {states.get('fleet-kv')}; Prometheus restarted"

    def audit_readonly(self) -> str:
        with read_only(self.d.db) as how:
            r = self.d.admin("POST", "/admin/actions/set_max_num_seqs", json={"n": 24})
            self.manual_actions += 1
            time.sleep(self.t.lock_s)
            depth = metric_sum(self._metrics(), "kvguard_audit_queue_depth")
        r2 = self.d.admin("POST", "/admin/actions/set_max_num_seqs", json={"n": 32})
        self.manual_actions += 1
        return (
            f"{how} {self.t.lock_s:g}s; manual action meanwhile: HTTP {r.status_code}; "
            f"audit queue depth {depth:.0f} before release; restore HTTP {r2.status_code}"
        )

    def engine_oom(self) -> str:
        r = self.d.admin("POST", "/admin/debug/inject_oom", json={"times": 1})
        return f"inject_oom: HTTP {r.status_code} {r.text[:80]}"

    def kv_pool(self, load: Load) -> str:
        """Long requests fill the pool past half; it is then shrunk to a quarter (held at one
        max_model_len request: half of this one), held, and restored: what does not fit is
        preempted and finishes later, nothing is lost."""
        load.longs(self.t.longs)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            kv = self.d.state()["kv"]["device"]
            if kv["blocks_used"] > kv["blocks_total"] // 2:
                break
            time.sleep(0.2)
        r = self.d.admin("POST", "/admin/actions/shrink_kv_pool", json={"share": 0.25})
        self.manual_actions += 1
        body = r.json() if r.status_code == 200 else {}
        time.sleep(self.t.lock_s)
        r2 = self.d.admin("POST", "/admin/actions/restore_kv_pool")
        self.manual_actions += 1
        back = r2.json() if r2.status_code == 200 else {}
        blocks = (
            f"{body.get('before', {}).get('kv_pool_blocks')} -> "
            f"{body.get('after', {}).get('kv_pool_blocks')} -> "
            f"{back.get('after', {}).get('kv_pool_blocks')} blocks"
        )
        preempted = len((body.get("data") or {}).get("preempted", []))
        return (
            f"shrink HTTP {r.status_code}, restore HTTP {r2.status_code} after "
            f"{self.t.lock_s:g}s: {blocks}, {preempted} preempted"
        )

    def sighup(self, text: str) -> str:
        self.rules.write_text(text)
        self.d.proc.send_signal(signal.SIGHUP)
        time.sleep(2.0)
        names = [r["name"] for r in self.d.state()["rules"]]
        return f"rules in force: {', '.join(names[:3])}, ... ({len(names)})"

    def disconnect(self, load: Load) -> str:
        load.hang_ups(self.t.disconnects)
        time.sleep(self.t.settle_s)
        s = self.d.state()
        running, used = sum(s["queues"]["running"].values()), s["kv"]["device"]["blocks_used"]
        return f"{self.t.disconnects} clients hung up; then {running} running, {used} KV blocks"


@contextlib.contextmanager
def read_only(db: Path) -> Iterator[str]:
    """The SQLite file and its WAL refuse writes inside the block; yields how that was done.

    The shared-memory index (-shm) is left alone: SQLite maps it, and an immutable mapping
    would kill the process with SIGBUS instead of failing a write.
    """
    files = [f for f in (db, db.with_name(db.name + "-wal")) if f.exists()]
    done: list[Path] = []
    try:
        for f in files:
            if subprocess.run(["chattr", "+i", str(f)], capture_output=True).returncode != 0:
                break
            done.append(f)
        if files and len(done) == len(files):
            yield "audit DB and WAL read-only (chattr +i) for"
            return
        for f in done:  # chattr works on some files only: undo it, use the lock instead
            subprocess.run(["chattr", "-i", str(f)], check=True)
        done.clear()
        con = sqlite3.connect(db, timeout=30, isolation_level=None)
        try:
            con.execute("BEGIN EXCLUSIVE")
            yield "chattr unavailable: audit DB write-locked (BEGIN EXCLUSIVE) for"
            con.execute("COMMIT")
        finally:
            con.close()
    finally:
        for f in done:
            subprocess.run(["chattr", "-i", str(f)], check=True)


# ----------------------------------------------------------------------------- the run


def rules_text(workdir: Path) -> str:
    """The fast default ladder plus a PromQL signal and rule."""
    text = fast_rules(workdir / "ladder.yaml").read_text()
    text = text.replace("signals:\n", "signals:\n" + PROMQL_SIGNAL, 1)
    return text.replace("rules:\n", "rules:\n" + PROMQL_RULE, 1)


def start(workdir: Path, model: str, threads: int) -> tuple[Daemon, Prometheus, Path, str]:
    """The daemon and its Prometheus, both up; neither left running if the other fails to
    start (a Prometheus started before a daemon that exits at once was left orphaned)."""
    kv = 1024 * kv_bytes_per_token(resolve_model_dir(model))  # an unknown model: nothing started
    port = free_port()
    prom = Prometheus(workdir, port)
    prom.start()
    d = None
    try:
        rules = workdir / "rules.yaml"
        good = rules_text(workdir)
        rules.write_text(good)
        config = (
            f"serving: {{model: {model}, kv_cache_bytes: {kv}, max_model_len: 512, "
            f"num_threads: {threads}}}\n"
            f"rules: {{path: {rules}}}\n"
            f"prometheus: {{url: '{prom.url}', timeout: 1s, instance: '127.0.0.1:{port}'}}\n"
        )
        d = Daemon(workdir / "daemon", config, port=port, drain_s=DRAIN_S, debug_hooks=True)
        d.wait_ready()
    except BaseException:
        if d is not None:
            d.stop(timeout=10)
        prom.stop()
        raise
    return d, prom, rules, good


def lost_in(outcomes: Sequence[Outcome], rep: FaultReport) -> tuple[int, int]:
    mine = [o for o in outcomes if rep.start_s <= o.sent_s < rep.end_s]
    return len(mine), sum(o.lost for o in mine)


def audit_rows(db: Path, upto: datetime | None = None) -> tuple[int, int]:
    """(rule action rows, manual action rows) in the audit DB; with `upto`, only rows whose
    action was decided (`time`, UTC) at or before it."""
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT time, rule FROM actions").fetchall()
    finally:
        con.close()
    if upto is not None:
        bound = upto.astimezone(UTC).replace(tzinfo=None)  # the DB holds naive UTC times
        rows = [r for r in rows if datetime.fromisoformat(r[0]).replace(tzinfo=None) <= bound]
    manual = sum(rule == "manual" for _, rule in rows)
    return len(rows) - manual, manual


def audit_accounting(
    db: Path, final: dict[str, float], manual_actions: int, scraped_at: datetime | None
) -> dict[str, Any]:
    """Audit rows lost: the rules' actions counted by `final` (kvguard_actions_total without
    its rule="manual" series, scraped at `scraped_at`) against the rule rows decided by then
    (None: every row). An action is decided before it is counted; rules still act in the
    drain after that scrape, and their rows are not in the count. Plus the manual actions
    taken against the manual rows. Each side counts only what is missing, never a surplus:
    rows of actions decided before the scrape and counted after it offset nothing."""
    rule_rows, _ = audit_rows(db, upto=scraped_at)
    all_rule_rows, manual_rows = audit_rows(db)
    counted = metric_sum(final, "kvguard_actions_total")
    counted_manual = metric_sum(final, "kvguard_actions_total", rule="manual")
    counted_rules = counted - counted_manual
    lost = max(0, int(counted_rules) - rule_rows) + max(0, manual_actions - manual_rows)
    return {
        "lost": lost,
        "kvguard_actions_total": counted,
        "rule_actions_counted": counted_rules,
        "rule_action_rows_by_final_scrape": rule_rows,
        "rule_action_rows": all_rule_rows,
        "manual_actions_taken": manual_actions,
        "manual_action_rows": manual_rows,
        "dropped_total": metric_sum(final, "kvguard_audit_dropped_total"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    timing = QUICK if args.quick else FULL
    workdir = bench_workdir(args.workdir, "kvguard-chaos-")
    d, prom, rules, good = start(workdir, args.model, args.threads)
    t0 = time.monotonic()
    vocab = ordinary_token_ids(resolve_model_dir(args.model))
    load = Load(d.url, args.model, vocab, timing.rps, t0)
    chaos = Chaos(d, prom, rules, timing, t0)
    try:
        load.start()
        time.sleep(timing.warmup_s)
        chaos.fault("prometheus", chaos.prometheus_down)
        chaos.fault("audit-ro", chaos.audit_readonly)
        chaos.fault("engine-oom", chaos.engine_oom)
        chaos.fault("kv-pool", lambda: chaos.kv_pool(load))
        chaos.fault("sighup-bad", lambda: chaos.sighup(BROKEN_RULES))
        # a visibly different good file: the rule's new name proves the reload took effect
        chaos.fault("sighup-good", lambda: chaos.sighup(good.replace("fleet-kv,", "fleet-kv-v2,")))
        chaos.fault("disconnect", lambda: chaos.disconnect(load))
        final = d.metrics()
        scraped_at = datetime.now(UTC)  # every action counted in `final` was decided by now
        rep = FaultReport("sigterm", chaos.now())
        load.halt.set()  # arrivals stop; what is in flight must drain across the SIGTERM
        rc = d.stop()  # waits out the drain (DRAIN_S) and a margin before a kill
        load.stop()
        rep.end_s, rep.up, rep.note = chaos.now(), False, f"exit status {rc}"
        chaos.reports.append(rep)
    finally:
        prom.stop()
        if d.alive():
            d.stop()
    return report(chaos, load, d, final, rc, workdir, scraped_at)


def report(
    chaos: Chaos,
    load: Load,
    d: Daemon,
    final: dict[str, float],
    rc: int,
    workdir: Path,
    scraped_at: datetime | None = None,
) -> dict[str, Any]:
    """The run's results; `scraped_at`: when `final` was scraped (see audit_accounting)."""
    for rep in chaos.reports:
        rep.sent, rep.lost = lost_in(load.outcomes, rep)
    audit = audit_accounting(d.db, final, chaos.manual_actions, scraped_at)
    total_lost = sum(o.lost for o in load.outcomes)
    return {
        "survived": all(r.up for r in chaos.reports[:-1]),
        "exit_code": rc,
        "requests": len(load.outcomes),
        "lost": total_lost,
        "lost_detail": [o.error or f"HTTP {o.status}" for o in load.outcomes if o.lost][:5],
        "hung_up": sum(o.error.startswith("client") for o in load.outcomes),
        "aborted": sum(o.finish_reason == "abort" for o in load.outcomes if o.completed),
        "audit_rows_lost": audit.pop("lost"),
        "audit": audit,
        "faults": [
            {
                "name": r.name,
                "up": r.up,
                "sent": r.sent,
                "lost": r.lost,
                "note": r.note,
                "metrics": {k: v for k, v in r.metrics.items() if v},
                "log": r.log,
            }
            for r in chaos.reports
        ],
        "workdir": str(workdir),
    }


def print_report(res: dict[str, Any]) -> None:
    rows = [
        [f["name"], "yes" if f["up"] else "no", f["sent"], f["lost"], f["note"][:70]]
        for f in res["faults"]
    ]
    print(format_table(["fault", "up", "sent", "lost", "what happened"], rows))
    for f in res["faults"]:
        said = ", ".join(f"{k.removeprefix('kvguard_')} +{v:g}" for k, v in f["metrics"].items())
        print(f"\n[{f['name']}] metrics: {said or 'no change'}")
        for line in f["log"]:
            print(f"   log: {line}")
    a = res["audit"]
    print(
        f"\nrequests {res['requests']}, lost {res['lost']}, hung up on purpose {res['hung_up']}, "
        f"answered but aborted {res['aborted']}; "
        f"audit: {a['rule_actions_counted']:g} rule actions counted at the last scrape vs "
        f"{a['rule_action_rows_by_final_scrape']} rule rows decided by then "
        f"({a['rule_action_rows']} in all, the drain's included), "
        f"{a['manual_actions_taken']} manual actions vs {a['manual_action_rows']} rows"
        f" -> {res['audit_rows_lost']} rows lost; exit status {res['exit_code']}"
    )
    ok = res["survived"] and res["lost"] == 0 and res["audit_rows_lost"] == 0
    ok = ok and res["exit_code"] == 0
    print(
        f"goal chaos (0 lost requests, 0 lost audit rows, daemon up, exit 0): "
        f"{'met' if ok else 'NOT met'}"
    )
    print(f"logs, configs and the audit DB under {res['workdir']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short smoke run (shorter faults)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    p.add_argument("--workdir", type=Path, help="keep configs, logs and the audit DB here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from kvguard.engine.model_config import ModelLoadError

    args = parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    try:
        res = run(args)
    except (StartError, ModelLoadError) as e:
        return start_failure("chaos", e)
    print_report(res)
    write_json(args.json, res)
    ok = res["survived"] and res["lost"] == 0 and res["audit_rows_lost"] == 0
    return 0 if ok and res["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
