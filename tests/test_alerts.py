"""The shipped Prometheus rules, their promtool tests and the Grafana dashboard, checked with the
real tools: promtool (lint, unit tests), a live `kvguard serve` (every metric name a rule or a
panel reads is one the daemon exports) and a real Prometheus server that scrapes that daemon,
evaluates the rules on its series and answers every dashboard query.

promtool and prometheus come from the Debian package `prometheus`; a missing binary fails.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_server import KVGUARD, Daemon, free_port

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "alerts"
RULES = ALERTS / "kvguard.rules.yml"
UNIT_TESTS = sorted((ALERTS / "tests").glob("*.yml"))
DASHBOARD = ALERTS / "grafana" / "kvguard.json"
DEFAULT_RULES = REPO / "rules" / "default.yaml"
RUNBOOKS = REPO / "docs" / "runbooks.md"
# Grafana's variables, as a query with "All" selected (the default) reads them: each one its
# allValue, what Grafana puts in the query for "All".
GRAFANA_VARS = {
    v["name"]: v["allValue"]
    for v in json.loads(DASHBOARD.read_text())["templating"]["list"]
    if v.get("includeAll")
} | {"__rate_interval": "1m", "__interval": "1m"}
# Series that Prometheus itself makes, not the daemon.
NOT_FROM_KVGUARD = {"up"}


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"`{name}` not on PATH: apt-get install --no-install-recommends prometheus"
    return path


def run(*cmd: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["groups"]


def all_rules() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in all_rules() if "alert" in r]


def records() -> set[str]:
    return {r["record"] for r in all_rules() if "record" in r}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


# -- PromQL: the metric names an expression reads ----------------------------------------------
_SKIP_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_SKIP_WORDS |= {"and", "or", "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Bare identifiers that are neither functions, keywords, label names nor durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", expr):
        if expr[m.end() :].lstrip().startswith("(") or m.group().lower() in _SKIP_WORDS:
            continue
        names.add(m.group())
    return names


def grafana(expr: str, **chosen: str) -> str:
    """A panel query as Grafana would send it to Prometheus: the variables `chosen` as given,
    the others on "All"."""
    values = GRAFANA_VARS | chosen
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


def dashboard_queries() -> dict[str, str]:
    """Every PromQL query of the dashboard, by where it is: panels, annotations, variables."""
    d = dashboard()
    out = {}
    for p in d["panels"]:
        for t in p.get("targets", []):
            out[f"panel {p['title']!r} {t['refId']}"] = grafana(t["expr"])
    for a in d["annotations"]["list"]:
        if "expr" in a:
            out[f"annotation {a['name']!r}"] = grafana(a["expr"])
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", v["definition"])
            assert m, f"variable {v['name']}: expected label_values(SELECTOR, LABEL)"
            out[f"variable {v['name']}"] = grafana(m.group(1))
    return out


def test_metric_names_reads_only_metrics() -> None:
    got = metric_names(
        'sum by (job, le) (rate(a_bucket{job=~"x"}[5m])) / on (job) group_left b'
        ' > 1e3 and c offset 5m or absent(up{job=~".*"}) * 0.5'
    )
    assert got == {"a_bucket", "b", "c", "up"}


# -- promtool ----------------------------------------------------------------------------------
def test_rules_pass_promtool_check_with_fatal_lint() -> None:
    r = run(tool("promtool"), "check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(all_rules())} rules found" in r.stdout


def test_promtool_unit_tests_pass() -> None:
    assert UNIT_TESTS, "no promtool tests in alerts/tests/"
    r = run(tool("promtool"), "test", "rules", *map(str, UNIT_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(UNIT_TESTS), r.stdout


def test_every_alert_and_recording_rule_is_unit_tested() -> None:
    fired, quiet, exprs = set(), set(), []
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (fired if t.get("exp_alerts") else quiet).add(t["alertname"])
            exprs += [t["expr"] for t in case.get("promql_expr_test", [])]
    names = {a["alert"] for a in alerts()}
    assert names - fired == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested staying quiet"
    untested = {r for r in records() if not any(r in metric_names(e) for e in exprs)}
    assert untested == set(), "recording rules without a promql_expr_test"


def test_alerts_carry_severity_text_and_a_runbook_section() -> None:
    sections = set(re.findall(r"^## (\S+)$", RUNBOOKS.read_text(), re.M))
    for a in alerts():
        name, ann = a["alert"], a["annotations"]
        assert a["labels"]["severity"] in ("warning", "critical"), name
        assert ann["summary"] and ann["description"], name
        assert ann["runbook_url"].endswith(f"docs/runbooks.md#{name.lower()}"), name
        assert name in sections, f"docs/runbooks.md has no '## {name}' section"
    assert {a["alert"] for a in alerts()} >= {
        "KVCachePressure", "KVCacheCritical", "GPUNearOOM", "EngineOOM", "AdmissionHalted",
        "DegradationProlonged", "PreemptionStorm", "RuleEvaluationFailing", "AuditWritesFailing",
        "PrometheusQueriesFailing", "NVMLDown", "KvguardDown", "SchedulerCountsRepaired",
    }  # fmt: skip


def runbook_sections() -> dict[str, str]:
    """docs/runbooks.md's `## Name` sections, by name."""
    parts = re.split(r"^## (\S+)$", RUNBOOKS.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_a_daemon_loading_its_model_is_kvguarddown_not_kvguardnotready() -> None:
    """A loading daemon's port is bound but refuses connections (README): Prometheus sees
    up == 0, never kvguard_ready == 0. The model-fetch advice belongs to KvguardDown."""
    sections = runbook_sections()
    down, not_ready = sections["KvguardDown"], sections["KvguardNotReady"]
    assert "loading" in down and "kvguard model fetch" in down
    assert "kvguard model fetch" not in not_ready and "first start" not in not_ready
    by_name = {a["alert"]: a for a in alerts()}
    assert "loading" not in by_name["KvguardNotReady"]["annotations"]["description"]
    assert "loading its model" in by_name["KvguardDown"]["annotations"]["description"]


# -- dashboard ---------------------------------------------------------------------------------
def test_dashboard_reads_its_datasource_from_a_variable() -> None:
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"]), "duplicate panel ids"
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    assert "increase(kvguard_actions_total" in exprs and "by (rule" in exprs
    assert "histogram_quantile(0.99" in exprs and "histogram_quantile(0.5" in exprs
    assert "kvguard_gpu_memory_used_bytes" in exprs and "kvguard_requests{" in exprs
    assert any("kvguard_actions_total" in a.get("expr", "") for a in d["annotations"]["list"])


def test_every_metric_an_alert_reads_is_on_the_dashboard() -> None:
    """What an alert fires on is what its operator looks for on the dashboard: before, the
    "Dependencies failing" panel left out kvguard_prometheus_query_empty_total, on which
    PrometheusQueriesFailing fires. A recording rule an alert reads stands for the metrics
    its expression reads (the dashboard may show either)."""
    recorded = {r["record"]: r["expr"] for r in all_rules() if "record" in r}

    def read(name: str) -> set[str]:
        if name not in recorded:
            return {name}
        return {n for m in metric_names(recorded[name]) for n in read(m)}

    shown = {n for q in dashboard_queries().values() for n in metric_names(q)}
    missing = {
        (a["alert"], m)
        for a in alerts()
        for name in metric_names(a["expr"])
        for m in ({name} if name in shown else read(name))
        if m not in shown
    }
    assert missing == set(), "metrics alerts fire on that no dashboard query shows"


# The gauge the dashboard shows for each local signal (rules/schema.py LOCAL_SIGNALS) that the
# default rules read: GPU memory is the ratio of two byte gauges, the others a gauge of their name.
SIGNAL_METRICS = {
    "kv_cache_usage_ratio": "kvguard_kv_cache_usage_ratio",
    "kv_cache_demand_ratio": "kvguard_kv_cache_demand_ratio",
    "gpu_memory_used_ratio": "kvguard_gpu_memory_used_bytes",
    "host_memory_used_ratio": "kvguard_host_memory_used_ratio",
}


def test_every_signal_the_default_rules_read_is_on_the_dashboard() -> None:
    """What a remedy acts on is what its operator looks for when it acts: before, the dashboard
    had no panel for kvguard_kv_cache_demand_ratio, on which the default reduce-batch rule
    halves the batch, and the usage panel (whose description named 0.92 as the batch cut) could
    sit well below 0.92 while the batch was cut. The demand's panel draws that rule's lines."""
    default = yaml.safe_load(DEFAULT_RULES.read_text())
    local = {name: s["local"] for name, s in default["signals"].items() if "local" in s}
    read = {local[r["signal"]] for r in default["rules"] if r.get("signal") in local}
    unknown = read - SIGNAL_METRICS.keys()
    assert not unknown, f"add the gauge the dashboard shows for {unknown} to SIGNAL_METRICS"
    shown = {n for q in dashboard_queries().values() for n in metric_names(q)}
    assert {s: SIGNAL_METRICS[s] for s in read if SIGNAL_METRICS[s] not in shown} == {}
    (demand,) = [p for p in dashboard()["panels"] if "demand" in p["title"].lower()]
    lines = {s["value"] for s in demand["fieldConfig"]["defaults"]["thresholds"]["steps"]}
    cut = [r for r in default["rules"] if local.get(r.get("signal")) == "kv_cache_demand_ratio"]
    assert cut and all({r["above"], r["recover_below"]} <= lines for r in cut), lines


# -- kvguard alerts export ---------------------------------------------------------------------
def test_export_writes_files_that_pass_promtool(tmp_path: Path) -> None:
    from kvguard.alerts.export import RUNBOOK_BASE, export
    from kvguard.daemon.alerts_cli import add_alerts_parser

    parser = argparse.ArgumentParser(prog="kvguard")
    add_alerts_parser(parser.add_subparsers(dest="command", required=True))
    base = "https://wiki.example.org/kvguard/runbooks"
    args = parser.parse_args(["alerts", "export", "--dir", str(tmp_path), "--runbook-base", base])
    assert args.func(args) == 0
    rules = tmp_path / "kvguard.rules.yml"
    tests = sorted((tmp_path / "tests").glob("*.yml"))
    assert [p.name for p in tests] == [p.name for p in UNIT_TESTS]
    assert json.loads((tmp_path / "grafana" / "kvguard.json").read_text())["uid"] == "kvguard"
    assert RUNBOOK_BASE not in rules.read_text() and f"{base}#kvcachepressure" in rules.read_text()
    r = run(tool("promtool"), "test", "rules", *map(str, tests), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    for bad, shown in (
        ('https://x.org/a"b', "%22"),
        ("https://x.org/a\\b", "%5C"),
        ("https://x.org/a b", "%20"),
        # and into Go-templated annotations: "{{" made rules promtool refused
        ("https://x.org/a{{b", "%7B"),
        ("https://x.org/a}}b", "%7D"),
    ):
        with pytest.raises(ValueError, match=shown):  # pasted into quoted YAML and JSON
            export(tmp_path / "other", runbook_base=bad)
    assert not (tmp_path / "other").exists()
    rules.write_text(rules.read_text() + "# an operator's edit\n")
    with pytest.raises(FileExistsError, match="--force"):
        export(tmp_path)
    assert export(tmp_path, force=True)[0] == rules
    assert rules.read_text() == RULES.read_text()


def test_export_writes_files_prometheus_can_read_whatever_the_umask(tmp_path: Path) -> None:
    """`sudo kvguard alerts export --dir /etc/prometheus/kvguard` under an operator's umask of
    077 (sudo keeps it): Prometheus runs as its own user, so the files are 0644 and the folders
    made for them 0755 all the same. A folder or file that was there keeps its mode."""
    kept = tmp_path / "kept"
    kept.mkdir()
    kept.chmod(0o700)
    out = kept / "prometheus" / "kvguard"
    cmd = [KVGUARD, "alerts", "export", "--dir", str(out), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, umask=0o077)
    assert proc.returncode == 0, proc.stderr
    files = [Path(p) for p in json.loads(proc.stdout)]
    made = [kept / "prometheus", out, out / "tests", out / "grafana"]
    modes = {p: oct(p.stat().st_mode & 0o777) for p in (kept, *made, *files)}
    assert modes == {kept: "0o700"} | dict.fromkeys(made, "0o755") | dict.fromkeys(files, "0o644")
    files[0].chmod(0o640)  # an operator's choice (group prometheus, say): kept
    proc = subprocess.run(
        [*cmd, "--force"], capture_output=True, text=True, timeout=60, umask=0o077
    )
    assert proc.returncode == 0, proc.stderr
    assert oct(files[0].stat().st_mode & 0o777) == "0o640"


# -- a live daemon and a real Prometheus -------------------------------------------------------
@pytest.fixture(scope="module")
def live_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("alerts-daemon"))
    try:
        # one finished request, so the latency histograms and outcome counters have series
        r = httpx.post(
            d.url + "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        yield d
    finally:
        assert d.stop() == 0


def exported_names(exposition: str) -> set[str]:
    """Sample names a scrape can hold, from every family (also those with no samples yet)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for fam in text_string_to_metric_families(exposition):
        names |= {fam.name + s for s in suffixes.get(fam.type, ("",))}
        names |= {s.name for s in fam.samples}
    return names


class _OneGpu:
    """NVML's answer for one GPU: the boundary a host without a GPU cannot cross."""

    def read(self) -> list[Any]:
        from kvguard.daemon.nvml import GpuReading

        return [GpuReading(0, "fake", 70 << 30, 10 << 30, 80 << 30, 0.5, 40.0, 300.0)]


def gpu_names_without_a_gpu() -> set[str]:
    """The GPU families the daemon's NVML collector exports when NVML answers."""
    from kvguard.daemon.metrics import NvmlCollector

    registry = CollectorRegistry()
    registry.register(NvmlCollector(_OneGpu()))  # type: ignore[arg-type]
    return exported_names(generate_latest(registry).decode())


def test_every_metric_in_rules_and_dashboard_is_exported(live_daemon: Daemon) -> None:
    scrape = httpx.get(live_daemon.url + "/metrics", timeout=10).text
    names = exported_names(scrape)
    if "kvguard_nvml_up 0.0" in scrape:  # no GPU here: NVML exports only kvguard_nvml_up
        names |= gpu_names_without_a_gpu()
    used: dict[str, set[str]] = {}
    for r in all_rules():
        for n in metric_names(r["expr"]):
            used.setdefault(n, set()).add(r.get("alert") or r["record"])
    for where, expr in dashboard_queries().items():
        for n in metric_names(expr):
            used.setdefault(n, set()).add(where)
    known = names | records() | NOT_FROM_KVGUARD
    missing = {n: sorted(w) for n, w in sorted(used.items()) if n not in known}
    assert not missing, f"read by rules or the dashboard, not exported by kvguard: {missing}"


@pytest.fixture(scope="module")
def prometheus(live_daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus that scrapes the live daemon every second and evaluates the shipped rules."""
    tmp = tmp_path_factory.mktemp("prometheus")
    jobs = {"kvguard": [live_daemon.url.removeprefix("http://")]}
    with running_prometheus(tmp, jobs, rules=True) as (url, proc):
        wait_for(lambda: query(url, 'up{job="kvguard"} == 1') != [], proc, tmp)
        yield url


@contextmanager
def running_prometheus(
    tmp: Path, jobs: dict[str, list[str]], rules: bool = False, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A Prometheus scraping each job's targets every second (and evaluating the shipped rules
    if `rules`), ready to answer queries."""
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)] if rules else [],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: httpx.get(url + "/-/ready", timeout=1).status_code == 200, proc, tmp)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def wait_for(ok: Any, proc: subprocess.Popen, tmp: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()
        try:
            if ok():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError((tmp / "prometheus.log").read_text()[-3000:])


def query(url: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.post(url + "/api/v1/query", data={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}\n{r.text}"
    return body["data"]["result"]


def test_every_dashboard_query_runs_in_prometheus(prometheus: str) -> None:
    failures = {}
    for where, expr in dashboard_queries().items():
        r = httpx.post(prometheus + "/api/v1/query", data={"query": expr}, timeout=10)
        if r.status_code != 200 or r.json().get("status") != "success":
            failures[where] = f"{expr} -> {r.status_code} {r.text[:300]}"
    assert not failures, failures
    kv = dashboard_queries()["panel 'KV cache usage by tier' A"]
    tiers = {s["metric"]["tier"] for s in query(prometheus, kv)}
    assert tiers == {"device", "host"}  # the variables and labels line up with real series


def test_rules_evaluate_on_the_live_series_and_stay_quiet(
    prometheus: str, live_daemon: Daemon
) -> None:
    def groups() -> list[dict[str, Any]]:
        return httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]

    deadline = time.monotonic() + 30
    while any(r["lastEvaluation"].startswith("0001") for g in groups() for r in g["rules"]):
        assert time.monotonic() < deadline, "rules not evaluated within 30s"
        time.sleep(0.5)
    # the recording rule has a sample once its group ran on scraped data: wait for that itself
    deadline = time.monotonic() + 120
    while not query(prometheus, "kvguard:kv_cache_usage:max"):
        assert time.monotonic() < deadline, "kvguard:kv_cache_usage:max not recorded within 120s"
        time.sleep(0.5)
    loaded = [r for g in groups() for r in g["rules"]]
    assert len(loaded) == len(all_rules())
    bad = {r["name"]: r.get("lastError") for r in loaded if r["health"] != "ok"}
    assert not bad, bad
    usage = query(prometheus, "kvguard:kv_cache_usage:max")
    instance = live_daemon.url.removeprefix("http://")
    assert [s["metric"] for s in usage] == [
        {"__name__": "kvguard:kv_cache_usage:max", "job": "kvguard", "instance": instance}
    ]
    firing = query(prometheus, 'ALERTS{alertstate="firing"}')
    assert firing == [], "an idle, healthy daemon fires alerts"


# -- the overview tiles in a Prometheus that scrapes more than kvguard ------------------------
@pytest.fixture(scope="module")
def shared_prometheus(
    live_daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """A Prometheus as an operator already runs one, scraping more than kvguard: the live
    daemon as job kvguard, and again as job llm-serving (kvguard under a job not named so); a
    kvguard target that is down (its port bound but refusing connections, as while a daemon
    loads its model); and Prometheus itself as job prometheus. Yields its URL and the live
    daemon's instance."""
    tmp = tmp_path_factory.mktemp("shared-prometheus")
    live = live_daemon.url.removeprefix("http://")
    with socket.socket() as down:
        down.bind(("127.0.0.1", 0))  # never listens: every scrape is refused
        port = free_port()
        jobs = {
            "kvguard": [live, f"127.0.0.1:{down.getsockname()[1]}"],
            "llm-serving": [live],
            "prometheus": [f"127.0.0.1:{port}"],
        }
        with running_prometheus(tmp, jobs, port=port) as (url, proc):
            # every target scraped once: the down one's up 0, both jobs' kvguard_ready in
            wait_for(lambda: len(query(url, "up")) == 4, proc, tmp)
            wait_for(lambda: len(query(url, "kvguard_ready")) == 2, proc, tmp)
            yield url, live


def panel(title: str) -> dict[str, Any]:
    (p,) = [p for p in dashboard()["panels"] if p["title"] == title]
    return p


def tile(url: str, target: dict[str, Any], **chosen: str) -> list[tuple[dict[str, str], float]]:
    """The series a stat tile shows for one query, each with its value, as Grafana asks for
    them: an instant query at now, or a range query (here the last 10 minutes) of which each
    series that has a point shows its last one (the tiles' `lastNotNull`)."""
    expr = grafana(target["expr"], **chosen)
    if target.get("instant"):
        return [(s["metric"], float(s["value"][1])) for s in query(url, expr)]
    now = time.time()
    r = httpx.post(
        url + "/api/v1/query_range",
        data={"query": expr, "start": now - 600, "end": now, "step": 1},
        timeout=10,
    )
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}\n{r.text}"
    return [(s["metric"], float(s["values"][-1][1])) for s in body["data"]["result"]]


def one_value(url: str, title: str, ref: str = "A", **chosen: str) -> float:
    (target,) = [t for t in panel(title)["targets"] if t["refId"] == ref]
    got = tile(url, target, **chosen)
    assert len(got) == 1, f"{title} {ref}: {got}"
    return got[0][1]


def test_scrape_targets_tile_counts_kvguard_targets_only(
    shared_prometheus: tuple[str, str],
) -> None:
    """Before, "Scrape targets up" counted every target of the Prometheus with "All" selected
    (`up{job=~".*"}`): here 3 up of 4, Prometheus itself among them. kvguard's are the two
    jobs' live daemon (up) and the down target."""
    url, live = shared_prometheus
    assert len(query(url, 'up{job="prometheus"} == 1')) == 1  # another job is there, and up
    tiles = ("Scrape targets up", "A"), ("Scrape targets up", "B")
    assert [one_value(url, *t) for t in tiles] == [2, 3]  # up / targets
    assert [one_value(url, *t, job="kvguard") for t in tiles] == [1, 2]
    assert [one_value(url, *t, instance=live) for t in tiles] == [2, 2]


def test_ready_tile_reads_not_ready_while_a_kvguard_target_is_down(
    shared_prometheus: tuple[str, str],
) -> None:
    """A down daemon exports no kvguard_ready: before, `min(kvguard_ready)` ran over the daemons
    that answered and the tile stayed READY (or, with only that daemon, showed no data)."""
    url, live = shared_prometheus
    assert one_value(url, "Ready") == 0
    assert one_value(url, "Ready", job="kvguard") == 0
    assert one_value(url, "Ready", instance=live) == 1  # the live daemon alone: ready


def test_kv_dtype_tile_shows_the_dtype_in_force_now(
    shared_prometheus: tuple[str, str], live_daemon: Daemon
) -> None:
    """Before, the tile was a range query: after a switch to FP8 it showed fp32 as well, which
    had been 1 earlier in the time range, each tile reading the value 1."""
    url, live = shared_prometheus
    kv = panel("KV dtype")
    assert kv["options"]["textMode"] == "name" and "{{dtype}}" in kv["targets"][0]["legendFormat"]
    r = live_daemon.admin("POST", "/admin/actions/enable_fp8_kv", json={})
    assert r.status_code == 200, r.text
    try:
        scraped = 'kvguard_kv_cache_dtype_info{job="kvguard", dtype="fp8_e4m3"} == 1'
        deadline = time.monotonic() + 60
        while not query(url, scraped):
            assert time.monotonic() < deadline, "the switch to FP8 not scraped within 60s"
            time.sleep(0.3)
        got = tile(url, kv["targets"][0], job="kvguard", instance=live)
        assert [(m["dtype"], v) for m, v in got] == [("fp8_e4m3", 1)]
    finally:
        r = live_daemon.admin("POST", "/admin/actions/disable_fp8_kv", json={})
        assert r.status_code == 200, r.text
