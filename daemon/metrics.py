"""Prometheus metrics: read from the engine's latest snapshot at scrape time, plus request
latency histograms observed by the HTTP layer. Names follow Prometheus conventions (base units,
`_total` counters) under the `kvguard_` prefix; docs/metrics lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvguard.daemon.nvml import NvmlReader
from kvguard.daemon.version import kvguard_version
from kvguard.engine.host_memory import host_memory_used_ratio
from kvguard.engine.snapshot import EngineSnapshot
from kvguard.rules.actions import ACTIONS
from kvguard.rules.evaluator import MANUAL, RETIRING, STATES

if TYPE_CHECKING:
    from kvguard.daemon.api_keys import ApiKeys

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3")
# why a request was refused for its API key (daemon/openai_api.py): kvguard_api_auth_failures_total
AUTH_FAILURE_REASONS = ("missing", "unknown", "priority", "max_requests")
# the refusals of a known key, by key as well: kvguard_api_key_refusals_total
KEY_REFUSAL_REASONS = ("priority", "max_requests")
PRIORITIES = ("high", "normal", "low")
# requests the API refused before the engine could decide (daemon/openai_api.py), in
# kvguard_admission_decisions_total{decision="reject"} beside the engine's refusals with a
# `reason`: the reject-ratio rule and the dashboards count them. `queue_full`: past what a hard
# queue bound takes in, counting those posted and not yet taken; `engine_stalled`: a 503 while
# the engine loop is stalled
API_REJECT_REASONS = ("queue_full", "engine_stalled")


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class SnapshotCollector(Collector):
    """Engine state as of the last step: nothing is computed or locked at scrape time."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        ready: Callable[[], bool],
        api_rejects: Mapping[str, int] | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.ready = ready
        # the API's own refusals (API_REJECT_REASONS), counted on the event loop
        self.api_rejects = api_rejects if api_rejects is not None else {}

    def collect(self):  # noqa: ANN201 - generator of metric families
        s = self.snapshot()
        yield from self._kv(s)
        yield from self._queues(s)
        yield from self._counters(s)
        yield from self._knobs(s)
        yield from self._admission(s)
        up = _gauge("kvguard_ready", "1 when the daemon accepts requests")
        up.add_metric([], 1.0 if self.ready() else 0.0)
        yield up

    def _kv(self, s: EngineSnapshot):  # noqa: ANN202
        usage = _gauge("kvguard_kv_cache_usage_ratio", "Share of KV blocks in use", ["tier"])
        blocks = _gauge("kvguard_kv_cache_blocks", "KV blocks by tier and state", ["tier", "state"])
        for tier, t in (("device", s.device), ("host", s.host)):
            usage.add_metric([tier], t.usage_ratio)
            blocks.add_metric([tier, "used"], t.blocks_used)
            blocks.add_metric([tier, "free"], t.blocks_free)
        demand = _gauge(
            "kvguard_kv_cache_demand_ratio",
            "Device KV blocks the engine would hold at its configured max_num_seqs / total "
            "(its swapped and waiting sequences too; over 1 where that batch would not fit)",
        )
        demand.add_metric([], s.kv_cache_demand_ratio)
        live = _gauge(
            "kvguard_kv_cache_live_tokens",
            "Tokens the running sequences hold on the device (a shared prefix counts for each)",
        )
        live.add_metric([], s.live_tokens)
        dtype = _gauge(
            "kvguard_kv_cache_dtype_info",
            "KV cache dtype in force (1 for the active one)",
            ["dtype"],
        )
        for d in KV_DTYPES:
            dtype.add_metric([d], 1.0 if s.kv_cache_dtype == d else 0.0)
        cached = _gauge(
            "kvguard_prefix_cache_blocks",
            "Device KV blocks holding reusable prompt K/V (shared in use, or free until reused)",
        )
        cached.add_metric([], s.prefix_cache.get("blocks", 0))
        yield from (usage, blocks, demand, live, dtype, cached)

    def _queues(self, s: EngineSnapshot):  # noqa: ANN202
        req = _gauge(
            "kvguard_requests",
            "Requests inside the engine by state and priority",
            ["state", "priority"],
        )
        for state, by_prio in s.queues.items():
            for prio, n in by_prio.items():
                req.add_metric([state, prio], n)
        yield req

    def _counters(self, s: EngineSnapshot):  # noqa: ANN202
        pre = CounterMetricFamily(
            "kvguard_preemptions", "Sequences preempted, by mode", labels=["mode"]
        )
        for mode, n in s.preemptions.items():
            pre.add_metric([mode], n)
        adm = CounterMetricFamily(
            "kvguard_admission_decisions", "Admission decisions", labels=["decision"]
        )
        for decision in ("admit", "queue", "reject"):
            adm.add_metric([decision], s.admission_decisions.get(decision, 0))
        for reason, n in self.api_rejects.items():  # the series without `reason`: the engine's
            adm.add_sample(adm.name + "_total", {"decision": "reject", "reason": reason}, n)
        oom = CounterMetricFamily(
            "kvguard_engine_oom_events", "Out-of-memory faults survived by the engine"
        )
        oom.add_metric([], s.counters["oom"])
        gen = CounterMetricFamily("kvguard_generated_tokens", "Output tokens generated")
        gen.add_metric([], s.counters["tokens_generated"])
        prompt = CounterMetricFamily(
            "kvguard_prompt_tokens", "Prompt tokens accepted, each prompt once however many choices"
        )
        prompt.add_metric([], s.counters["prompt_tokens"])
        steps = CounterMetricFamily("kvguard_engine_steps", "Engine steps run")
        steps.add_metric([], s.step)
        cut = CounterMetricFamily(
            "kvguard_engine_steps_interrupted",
            "Steps stopped between layers for a high-priority arrival (and run again)",
        )
        cut.add_metric([], s.counters.get("steps_interrupted", 0))
        ahead = CounterMetricFamily(
            "kvguard_engine_steps_ahead",
            "Decode steps run inside a run after its first, the host not in between "
            "(serving.decode_steps)",
        )
        ahead.add_metric([], s.counters.get("steps_ahead", 0))
        repairs = CounterMetricFamily(
            "kvguard_scheduler_count_repairs",
            "Recounts of the scheduler's queues (once a second while it steps) that found its "
            "queue counts drifted and set them to the recount: a kvguard bug each, its error "
            "logged naming the drift",
        )
        repairs.add_metric([], s.counters.get("count_repairs", 0))
        hit = CounterMetricFamily(
            "kvguard_prefix_cache_hit_tokens",
            "Prompt tokens whose K/V a request found in the prefix cache",
        )
        hit.add_metric([], s.prefix_cache.get("hit_tokens", 0))
        queried = CounterMetricFamily(
            "kvguard_prefix_cache_queried_tokens",
            "Prompt tokens of requests that looked in the prefix cache as they started",
        )
        queried.add_metric([], s.prefix_cache.get("queried_tokens", 0))
        structured = CounterMetricFamily(
            "kvguard_structured_requests",
            "Requests held to a grammar as they are queued, each choice of n one: response_format "
            "json_object or json_schema, and chat requests with tools (tool_choice other than "
            "none: held to the call form)",
        )
        structured.add_metric([], s.structured.get("requests", 0))
        grammar = CounterMetricFamily(
            "kvguard_grammar_seconds",
            "Engine-thread seconds spent on structured requests' token masks and advances",
        )
        grammar.add_metric([], s.structured.get("grammar_seconds", 0.0))
        drafted = CounterMetricFamily(
            "kvguard_spec_draft_tokens",
            "Speculative draft tokens (prompt lookup) verified by the model",
        )
        drafted.add_metric([], s.speculative.get("drafted", 0))
        accepted = CounterMetricFamily(
            "kvguard_spec_accepted_tokens",
            "Speculative draft tokens the model chose as its own that became output tokens "
            "(each one a step saved)",
        )
        accepted.add_metric([], s.speculative.get("accepted", 0))
        row_cost = _gauge(
            "kvguard_spec_row_cost_ratio",
            "What one more row costs a decode step over the step's fixed part, by which a "
            "draft position must pay for itself (learnt from the steps, or the configured one)",
        )
        row_cost.add_metric([], s.speculative.get("row_cost", 0.0))
        yield from (pre, adm, oom, gen, prompt, steps, cut, ahead, repairs, hit, queried, structured,
                    grammar, drafted, accepted, row_cost, self._finished(s))  # fmt: skip

    def _finished(self, s: EngineSnapshot) -> CounterMetricFamily:
        """Counted by the engine, where every finish passes: a request aborted because its
        client hung up or the drain cut it never reaches an HTTP success path, and an
        outcome counter that misses those hides exactly the failures an operator looks for."""
        fam = CounterMetricFamily(
            "kvguard_requests_finished",
            "Finished requests by reason (abort: client gone or cut by a drain)",
            labels=["finish_reason", "priority"],
        )
        for reason in sorted({"stop", "length", "abort", "error", *s.finished}):
            by_priority = s.finished.get(reason, {})
            for prio in PRIORITIES:
                fam.add_metric([reason, prio], by_priority.get(prio, 0))
        return fam

    def _knobs(self, s: EngineSnapshot):  # noqa: ANN202
        k = s.knobs
        seqs = _gauge("kvguard_max_num_seqs", "Batch limit in force")
        seqs.add_metric([], float(k["max_num_seqs"]))
        toks = _gauge("kvguard_max_num_batched_tokens", "Per-step token budget in force")
        toks.add_metric([], float(k["max_num_batched_tokens"]))
        cap = _gauge("kvguard_max_new_tokens_cap", "Max-token cap in force (0 = none)")
        cap.add_metric([], float(k["max_new_tokens_cap"] or 0))
        off = _gauge("kvguard_cpu_offload_enabled", "1 while preemption may swap to the host pool")
        off.add_metric([], 1.0 if k["offload"] else 0.0)
        halted = _gauge("kvguard_admission_halted", "1 while admission is halted")
        halted.add_metric([], 1.0 if s.admission["halted"] else 0.0)
        yield from (seqs, toks, cap, off, halted)

    def _admission(self, s: EngineSnapshot):  # noqa: ANN202
        """Predicted admission's estimate and its error, so a bad guess shows before it hurts."""
        adm = s.admission
        ratio = _gauge(
            "kvguard_admission_output_ratio_estimate",
            "Share of max_tokens admission plans outputs at, by max_tokens bucket (1 = worst case)",
            ["bucket"],
        )
        for bucket, r in (adm.get("output_ratio") or {}).items():
            ratio.add_metric([bucket], r)
        err = adm.get("estimate_error") or {}
        mean = _gauge(
            "kvguard_admission_estimate_error_ratio",
            "Recent mean of (realised - planned output) / max_tokens; > 0: outputs outran plans",
        )
        mean.add_metric([], float(err.get("mean", 0.0)))
        under = _gauge(
            "kvguard_admission_estimate_undershoot_ratio",
            "Share of recent requests whose output outran admission's plan",
        )
        under.add_metric([], float(err.get("undershoot_share", 0.0)))
        over = _gauge(
            "kvguard_admission_overcommit_ratio",
            "How far past the KV budget predicted admission plans now: grows on calm steps, "
            "cut on one that preempts or ends with KV at 0.9 or more (1 = the budget)",
        )
        over.add_metric([], float(adm.get("overcommit", 1.0)))
        drain = _gauge(
            "kvguard_admission_finish_rate",
            "Requests finished per second over the last 10s: how fast the queue drains "
            "(past max_queue a request waits if the queue ahead drains within max_queue_wait)",
        )
        drain.add_metric([], float(adm.get("finish_rate", 0.0)))
        committed = _gauge(
            "kvguard_admission_committed_blocks", "KV blocks admission has planned for"
        )
        committed.add_metric([], float(adm.get("committed_blocks", 0)))
        yield from (ratio, mean, under, over, drain, committed)


class NvmlCollector(Collector):
    """Every GPU NVML answers for, `own="true"` on those the engine runs on (NVML sees the
    whole host: another tenant's GPU is `own="false"`). A field NVML does not answer for a GPU
    (utilisation on a MIG-enabled GPU, say) has no sample for it."""

    def __init__(self, reader: NvmlReader) -> None:
        self.reader = reader

    def collect(self):  # noqa: ANN201
        readings = self.reader.read()
        up = _gauge("kvguard_nvml_up", "1 when NVML answered the last query for at least one GPU")
        up.add_metric([], 1.0 if readings else 0.0)
        yield up
        if not readings:
            return
        labels = ["gpu", "own"]
        fams = {
            "used": _gauge("kvguard_gpu_memory_used_bytes", "GPU memory used", labels),
            "free": _gauge("kvguard_gpu_memory_free_bytes", "GPU memory free", labels),
            "total": _gauge("kvguard_gpu_memory_total_bytes", "GPU memory total", labels),
            "util": _gauge("kvguard_gpu_utilization_ratio", "GPU busy share", labels),
            "temp": _gauge("kvguard_gpu_temperature_celsius", "GPU temperature", labels),
            "power": _gauge("kvguard_gpu_power_watts", "GPU power draw", labels),
        }
        for r in readings:
            g = [str(r.index), "true" if r.own else "false"]
            fams["used"].add_metric(g, r.memory_used_bytes)
            fams["free"].add_metric(g, r.memory_free_bytes)
            fams["total"].add_metric(g, r.memory_total_bytes)
            for key, value in (
                ("util", r.utilization_ratio),
                ("temp", r.temperature_celsius),
                ("power", r.power_watts),
            ):
                if value is not None:
                    fams[key].add_metric(g, value)
        yield from fams.values()


class TensorParallelCollector(Collector):
    """How the model is split: tensor-parallel ranks per stage, pipeline stages (the ranks are
    their product) and each rank's device KV pool in bytes (every rank of a stage holds the
    same blocks, of its own KV heads). One rank: this process's pool."""

    def __init__(
        self,
        size: Callable[[], int],
        kv_rank_bytes: Callable[[], list[int]],
        stages: Callable[[], int] = lambda: 1,
    ) -> None:
        self.size = size
        self.kv_rank_bytes = kv_rank_bytes
        self.stages = stages

    def collect(self):  # noqa: ANN201
        size = _gauge(
            "kvguard_tensor_parallel_size",
            "Tensor-parallel ranks each pipeline stage's layers are split over "
            "(ranks in all: this x kvguard_pipeline_parallel_size)",
        )
        size.add_metric([], float(self.size()))
        stages = _gauge(
            "kvguard_pipeline_parallel_size", "Pipeline stages the model's layers are divided into"
        )
        stages.add_metric([], float(self.stages()))
        kv = _gauge("kvguard_kv_cache_rank_bytes", "Bytes of each rank's device KV pool", ["rank"])
        for rank, n in enumerate(self.kv_rank_bytes()):
            kv.add_metric([str(rank)], float(n))
        yield from (size, stages, kv)


class ControlPlaneCollector(Collector):
    """Rule states, evaluations, actions, degradation level, and the health of what the
    control plane depends on (Prometheus queries, audit writes, Alertmanager)."""

    def __init__(
        self, control: Callable[[], object | None], audit: Callable[[], object | None]
    ) -> None:
        self.control = control
        self.audit = audit

    def collect(self):  # noqa: ANN201
        cp = self.control()
        audit = self.audit()
        if audit is not None:
            fails = CounterMetricFamily(
                "kvguard_audit_write_failures", "Failed audit write attempts (retried)"
            )
            fails.add_metric([], getattr(audit, "failures", 0))
            depth = _gauge("kvguard_audit_queue_depth", "Audit rows waiting to be written")
            depth.add_metric([], audit.depth())
            dropped = CounterMetricFamily(
                "kvguard_audit_dropped", "Audit rows dropped at the queue bound"
            )
            dropped.add_metric([], getattr(audit, "dropped", 0))
            up = _gauge(
                "kvguard_audit_up",
                "1 while the audit database takes writes; 0 while degraded (rows queue)",
            )
            problem = getattr(audit, "problem", None)
            up.add_metric([], 0.0 if problem is not None and problem() else 1.0)
            yield from (fails, depth, dropped, up)
        if cp is None:
            return
        ev = cp.evaluator
        state = _gauge(
            "kvguard_rule_state",
            "1 for each rule's current state; retiring: 1 while a remedy a reload took from the "
            "rule is still in force (its undo not applied yet), beside the state of a rule of "
            "that name still in the file",
            ["rule", "state"],
        )
        # by name: a rule a reload changed is in the file and retiring at once (one series each)
        shown: dict[str, set[str]] = {}
        for r in ev.rule_states():
            shown.setdefault(r["name"], set()).add(r["state"])
        for name, states in shown.items():
            for st in (*STATES, RETIRING):
                state.add_metric([name, st], 1.0 if st in states else 0.0)
        evals = CounterMetricFamily("kvguard_rule_evaluations", "Rule evaluation ticks")
        evals.add_metric([], ev.stats.evaluations)
        efail = CounterMetricFamily("kvguard_rule_evaluation_failures", "Rule ticks that raised")
        efail.add_metric([], ev.stats.failures)
        acts = CounterMetricFamily(
            "kvguard_actions",
            "Actions by rule, action and outcome",
            labels=["rule", "action", "outcome"],
        )
        # a copy made in one C call: the evaluator may add a key while a scrape iterates
        counts = dict(ev.stats.actions)
        # every rule's action and undo by every outcome from 0, so that the first failure is
        # a rise increase() sees (a series born at 1 is no increase: RemedyFailed missed it)
        outcomes = ("dry_run",) if ev.dry_run else ("applied", "failed", "refused")
        for r in list(ev.rules.rules):
            for action in (r.action, r.undo):
                for outcome in outcomes if action else ():
                    counts.setdefault((r.name, action, outcome), 0)
        # an operator's actions (rule "manual", never a dry run): each one's failures from 0
        for action in ACTIONS:
            counts.setdefault((MANUAL, action, "failed"), 0)
        for (rule, action, outcome), n in counts.items():
            acts.add_metric([rule, action, outcome], n)
        level = _gauge(
            "kvguard_degradation_level",
            "0 calm; else the position in the rules file (the first rule 1) of the last rule "
            "in force, event and alert rules included (in a dry run, of the simulated "
            "remedies: what the rules would hold; a rule an operator's action took every held "
            "setting from does not count)",
        )
        level.add_metric([], ev.level())
        pq = CounterMetricFamily(
            "kvguard_prometheus_query_failures", "PromQL signal reads that failed"
        )
        pq.add_metric([], cp.promql.failures)
        pq_empty = CounterMetricFamily(
            "kvguard_prometheus_query_empty",
            "PromQL signal reads answered with no number (an empty vector, NaN, a string): "
            "the rule reading it is unknown",
        )
        pq_empty.add_metric([], cp.promql.empty)
        al = CounterMetricFamily(
            "kvguard_alerts_received", "Alertmanager alerts taken", labels=["alertname", "status"]
        )
        received = dict(cp.alerts_received)
        ignored_by_name = dict(cp.alerts_ignored)
        # every alert an `alert:NAME` rule acts on, firing and resolved, from 0 (as actions
        # above): the first one it sends is a rise increase() sees
        for r in list(ev.rules.rules):
            if r.on and r.on.startswith("alert:"):
                for status in ("firing", "resolved"):
                    received.setdefault((r.on[6:], status), 0)
                ignored_by_name.setdefault(r.on[6:], 0)
        for (name, status), n in received.items():
            al.add_metric([name, status], n)
        ignored = CounterMetricFamily(
            "kvguard_alerts_ignored",
            "Alertmanager alerts not taken: their instance label names another daemon",
            labels=["alertname"],
        )
        for name, n in ignored_by_name.items():
            ignored.add_metric([name], n)
        yield from (state, evals, efail, acts, level, pq, pq_empty, al, ignored)


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


class Metrics:
    """One registry per daemon (tests run several in one process)."""

    def __init__(
        self, snapshot: Callable[[], EngineSnapshot], ready: Callable[[], bool], nvml: NvmlReader
    ) -> None:
        self.registry = CollectorRegistry()
        # each choice of a request the API refused before the engine could decide, by reason
        # (from 0: a series born at 1 is no increase()); written on the event loop only
        self.api_rejects = dict.fromkeys(API_REJECT_REASONS, 0)
        self.registry.register(SnapshotCollector(snapshot, ready, self.api_rejects))
        self.registry.register(NvmlCollector(nvml))
        r = self.registry
        self.ttft = Histogram(
            "kvguard_time_to_first_token_seconds",
            "Request arrival to first token",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "kvguard_inter_token_latency_seconds",
            "Gap between a request's tokens, per token (k that come at once after g: k of g/k)",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvguard_request_duration_seconds",
            "Request arrival to last token",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "kvguard_request_queue_time_seconds",
            "Arrival (posted to the engine) until first scheduled, observed as the wait ends: a "
            "request that ended never scheduled (its client gave up, a drain cut it) with the "
            "time it waited until then (_count less kvguard_requests_started_total: those)",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.started = Counter(
            "kvguard_requests_started",
            "Requests the engine started (first scheduled), each choice of n one, queued "
            "first or not, with admission control on or off: what PreemptionStorm counts "
            "preemptions per",
            ["priority"],
            registry=r,
        )
        for priority in PRIORITIES:  # from 0: a series born at 1 is no increase()
            for per_priority in (self.ttft, self.inter_token, self.e2e, self.queue_time):
                per_priority.labels(priority)
            self.started.labels(priority)
        self.http = Counter(
            "kvguard_http_requests",
            "HTTP answers by route and status",
            ["route", "status"],
            registry=r,
        )
        # the API's connections (service._TimedH11): each holds a file descriptor, and past the
        # open files limit accept() fails and clients get no answer at all; the gauge is read
        # from the server once it serves (0 before)
        self.http_connections = Gauge(
            "kvguard_http_connections",
            "HTTP connections open and served now (the operator's served past "
            "api.max_connections among them: up to 16 more than the max)",
            registry=r,
        )
        self.http_connections_max = Gauge(
            "kvguard_http_connections_max",
            "api.max_connections in force: the most HTTP connections served at once (sized "
            "from the open files limit where the key is unset; +Inf: no cap)",
            registry=r,
        )
        self.http_connections_refused = Counter(
            "kvguard_http_connections_refused",
            "HTTP connections answered 503 too_many_connections and closed: as many were "
            "served as api.max_connections allows",
            registry=r,
        )
        self.http_accept_failures = Counter(
            "kvguard_http_accept_failures",
            "accept() calls on the API's socket that failed for want of a file descriptor (or "
            "of memory): each client waiting then got no answer until some connection closed",
            registry=r,
        )
        host = Gauge(
            "kvguard_host_memory_used_ratio",
            "Host memory in use / total, or a memory cgroup's working set / its limit (the "
            "daemon's group's or a parent's), the highest (NaN where none can be read)",
            registry=r,
        )
        host.set_function(lambda: _or_nan(host_memory_used_ratio()))
        # the version as a label of a constant 1 (Prometheus' build-info form): a fleet's
        # daemons are compared with `count by (version) (kvguard_build_info)`
        build = Gauge(
            "kvguard_build_info",
            "Always 1; version: the kvguard serving (`kvguard --version`)",
            ["version"],
            registry=r,
        )
        build.labels(kvguard_version()).set(1)
        # served, not sent: the charge-back panel's requests are those the engine took in; one
        # refused for its key is in api_key_refusals instead (by admission: http_requests)
        self.api_requests = Counter(
            "kvguard_api_key_requests",
            "Completion and chat requests served (taken in by the engine) by API key name "
            "(with api.api_keys_file set)",
            ["key"],
            registry=r,
        )
        self.api_tokens = Counter(
            "kvguard_api_key_tokens",
            "Tokens generated by API key name: each prompt once, and the completions",
            ["key", "kind"],
            registry=r,
        )
        self.auth_failures = Counter(
            "kvguard_api_auth_failures",
            "Requests refused for their API key: missing, unknown, asking for a priority "
            "above the key's max_priority, or past its max_requests",
            ["reason"],
            registry=r,
        )
        # which key a tenant's 403s and 429s were for: the key is known there, and its names
        # are the keys file's (bounded, MAX_KEYS), never a client's guess (a missing or unknown
        # key stays in auth_failures alone)
        self.api_key_refusals = Counter(
            "kvguard_api_key_refusals",
            "Requests of a known API key refused for it: a priority above its max_priority, "
            "or past its max_requests (429, or 400 for a request that could never pass)",
            ["key", "reason"],
            registry=r,
        )
        self.gc_pause = Histogram(
            "kvguard_gc_pause_seconds",
            "Python cyclic garbage collections: how long each stopped the daemon, by generation",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.rule_tick = Histogram(
            "kvguard_rule_evaluation_duration_seconds",
            "Time to evaluate all rules once",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
            registry=r,
        )

    def name_keys(self, keys: ApiKeys | None) -> None:
        """Export every API key's series (and every refusal reason's) at 0 before its first
        request, at the start and when a reload brings new keys: a series born at 1 is no
        increase() in Prometheus, so a key's first request would be missing from its charge-back
        and the first refusal from kvguard_api_auth_failures_total's alert. None: no keys file
        (the endpoints are open, nothing is charged or refused). A revoked key's series stay,
        with what it was charged."""
        if keys is None:
            return
        for reason in AUTH_FAILURE_REASONS:
            self.auth_failures.labels(reason)
        for name in {k.name for k in keys.by_digest.values()}:
            self.api_requests.labels(name)
            for reason in KEY_REFUSAL_REASONS:
                self.api_key_refusals.labels(name, reason)
            for kind in ("prompt", "completion"):
                self.api_tokens.labels(name, kind)
