"""Overload benchmark: `kvguard serve` under an open-loop burst, three ways, in one run.

A separate process (this one) drives a real daemon over HTTP with a fixed-seed open-loop trace:
Poisson base load plus one burst, lognormal prompt and output lengths with a long tail, 10% high
/ 70% normal / 20% low priority (X-Priority). Open loop matters: arrivals do not slow down when
the server does, which is what a real overload looks like. Configurations:

  (a) kvguard     paging + admission (predicted outputs) + the default rule ladder (timed down
                  so it fits the run)
  (a2) kvguard-ladder  the same without admission: the ladder alone
  (b) no-control  paging + preemption only, no admission, no rules (what a vLLM-style server does)
  (c) prealloc    every sequence holds a max_model_len slot: max_num_seqs = budget // max_model_len,
                  no admission, no rules (a traditional engine's per-request preallocation)

Two traces share arrivals, prompts and answer lengths. `realistic` (the default): clients ask
for a generous max_tokens (64, 128 or 256) and the answer ends sooner, at its drawn length — each
prompt ends in a count ("Count: 1, 2, 3, 4, 5, 6,") that the model continues and a stop string
ends at the number that gives that length, so every configuration sees the same answers.
`adversarial`: max_tokens is the answer's length and EOS is ignored, so every request runs to
its max_tokens — the worst case for predicted admission, run against worst-case admission.

    python bench/overload.py [--quick] [--trace realistic|adversarial] [--burst-rps R] [--json FILE]
                              [--png FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.trace import (  # noqa: E402
    DEFAULT_MODEL,
    LengthDist,
    format_table,
    ordinary_token_ids,
    resolve_model_dir,
    write_json,
)

REPO = Path(__file__).resolve().parents[1]
KVGUARD = str(Path(sys.executable).parent / "kvguard")
TOKEN = "overload-bench-token"
PRIORITIES = ("high", "normal", "low")
PRIORITY_WEIGHTS = (0.10, 0.70, 0.20)
SAMPLE_S = 0.5
BUSY_STATES = ("pending", "firing", "recovering", "retiring")
UNDO_DUE_S = 10.0  # an undo is late when applied this long after its recovery condition held


# ----------------------------------------------------------------------------- the load


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """An open-loop arrival process: Poisson base rate, one burst on top, lognormal lengths."""

    duration_s: float
    base_rps: float
    burst_start_s: float
    burst_len_s: float
    burst_rps: float
    prompt: LengthDist
    output: LengthDist
    max_model_len: int
    settle_s: float  # after the last arrival: wait this long for the ladder to undo itself
    patience_s: float  # a request unanswered this long is lost (a stalled server)
    caps: tuple[int, ...] = (64, 128, 256)  # the max_tokens clients ask for (realistic trace)
    seed: int = 0
    overflow: float = 3.0  # the burst asks for this many times the KV budget

    @property
    def burst_end_s(self) -> float:
        return self.burst_start_s + self.burst_len_s


FULL = LoadSpec(  # a burst that overloads both the KV budget and the 2-core engine's compute
    duration_s=60,
    base_rps=0.5,
    burst_start_s=15,
    burst_len_s=15,
    burst_rps=32.0,
    prompt=LengthDist(32, 0.9, 8, 384),
    output=LengthDist(24, 0.8, 4, 128),
    max_model_len=512,
    settle_s=45,
    patience_s=240,
    overflow=24.0,
)
QUICK = LoadSpec(
    duration_s=10,
    base_rps=0.4,
    burst_start_s=2,
    burst_len_s=4,
    burst_rps=4.0,
    prompt=LengthDist(16, 0.6, 8, 64),
    output=LengthDist(8, 0.6, 4, 32),
    max_model_len=96,
    settle_s=15,
    patience_s=60,
    caps=(32, 64),
)


COUNT_HEAD = "\nCount: 1, 2, 3, 4, 5, 6,"  # every prompt ends so; the model counts on
COUNT_FROM = 7


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    prompt_ids: list[int]
    max_tokens: int  # what the client asks for
    priority: str
    in_burst: bool
    output: int = 0  # tokens the answer runs to (the count's stop); 0: max_tokens, EOS ignored

    @property
    def total_len(self) -> int:
        """Prompt + the tokens the answer really takes: the KV it really needs at its peak."""
        return len(self.prompt_ids) + (self.output or self.max_tokens)

    @property
    def stop(self) -> list[str]:
        """The stop string that ends the model's count after about `output` tokens."""
        return [f" {count_stop(self.output)},"] if self.output else []


def count_tokens(k: int) -> int:
    """Output tokens of the count ' 7, 8, ..., k,' (SmolLM2 splits digits: ' ', d.., ',')."""
    return sum(2 + len(str(i)) for i in range(COUNT_FROM, k + 1))


def count_stop(tokens: int) -> int:
    """The smallest number whose count takes at least `tokens` output tokens."""
    k = COUNT_FROM
    while count_tokens(k) < tokens:
        k += 1
    return k


def _poisson_times(rng: np.random.Generator, rate: float, start: float, end: float) -> list[float]:
    """Exponential gaps: memoryless arrivals, the textbook model of independent users."""
    times, t = [], start
    while rate > 0:
        t += float(rng.exponential(1.0 / rate))
        if t >= end:
            return times
        times.append(t)
    return times


def make_arrivals(
    spec: LoadSpec, vocab: Sequence[int], head: Sequence[int] = (), adversarial: bool = True
) -> list[Arrival]:
    """The same seed gives the same arrivals, lengths, priorities and tokens in every config.

    `head` (the tokenised COUNT_HEAD) replaces the end of each prompt; unless `adversarial`,
    each request asks for one of `spec.caps` and its answer stops at its drawn length."""
    rng = np.random.default_rng(spec.seed)
    base = _poisson_times(rng, spec.base_rps, 0.0, spec.duration_s)
    burst = _poisson_times(rng, spec.burst_rps, spec.burst_start_s, spec.burst_end_s)
    times = sorted([(t, False) for t in base] + [(t, True) for t in burst])
    n = len(times)
    prompts = spec.prompt.draw(rng, n)
    outputs = spec.output.draw(rng, n)
    prios = rng.choice(len(PRIORITIES), size=n, p=PRIORITY_WEIGHTS)
    pool = np.asarray(vocab, dtype=np.int64)
    out = []
    for (t, in_burst), p, o, k in zip(times, prompts, outputs, prios, strict=True):
        ids = [int(x) for x in rng.choice(pool, size=p)]
        ids = ids[: max(0, p - len(head))] + list(head)
        o = min(o, spec.max_model_len - len(ids))
        out.append(Arrival(t, ids, o, PRIORITIES[int(k)], in_burst))
    if adversarial:
        return out
    caps = np.random.default_rng(spec.seed + 1).choice(spec.caps, size=n)
    realistic = []
    for a, cap in zip(out, caps, strict=True):
        cap = min(int(cap), spec.max_model_len - len(a.prompt_ids))
        realistic.append(
            Arrival(a.at_s, a.prompt_ids, cap, a.priority, a.in_burst, min(a.max_tokens, cap))
        )
    return realistic


def budget_tokens(spec: LoadSpec, arrivals: Sequence[Arrival], block_size: int = 16) -> int:
    """KV budget: the burst's arrivals, all in flight at once, ask for `overflow` x this.

    Never below max_model_len, so that every single request can always be served.
    """
    burst = sum(a.total_len for a in arrivals if a.in_burst)
    tokens = max(int(burst / spec.overflow), spec.max_model_len)
    return -(-tokens // block_size) * block_size


# ----------------------------------------------------------------------------- the daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_bytes_per_token(model_dir: Path) -> int:
    """fp32 K and V for every layer and KV head: the CPU engine's KV dtype ('auto' = fp32)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * 4


STOP_MARGIN_S = 60  # Daemon.stop waits the drain plus this for the exit (audit flush, engine)


class StartError(RuntimeError):
    """A daemon (or the model it would serve) that could not be started: the run measures
    nothing, and says why in one line (`main`), not in a traceback."""


def start_failure(prog: str, e: Exception) -> int:
    """The one line a run that could not start prints, and its exit status (2, as a usage
    error: what it was given cannot be run)."""
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2


def bench_workdir(given: Path | None, prefix: str) -> Path:
    """The run's folder, absolute and made: the configs written into its subfolders name
    files in it, and the daemon reads a relative path in a config from the config file's
    folder, so a relative `--workdir` (the caller's, as the docs say) would name files that
    do not exist and the daemon would refuse to start."""
    workdir = (given or Path(tempfile.mkdtemp(prefix=prefix))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def daemon_config(
    workdir: Path, config_body: str, port: int, drain_s: int, debug_hooks: bool
) -> str:
    """A bench daemon's config: the setup's body plus its port, token, drain and audit DB,
    all in `workdir` (which `bench_workdir` made absolute)."""
    return config_body + (
        f"api: {{host: 127.0.0.1, port: {port}, admin_token_file: "
        f"{workdir / 'admin.token'}, drain_timeout: {drain_s}s, "
        f"debug_hooks: {str(debug_hooks).lower()}}}\n"
        f"audit: {{url: 'sqlite:///{workdir / 'audit.db'}'}}\n"
    )


class Daemon:
    """A `kvguard serve` subprocess with its own config, token, audit DB and log."""

    def __init__(
        self,
        workdir: Path,
        config_body: str,
        port: int | None = None,
        drain_s: int = 60,
        debug_hooks: bool = False,  # mount /admin/debug/* (the chaos bench injects OOMs)
        preexec_fn: Callable[[], None] | None = None,  # run in the child before exec
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.dir = workdir
        self.drain_s = drain_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = workdir / "audit.db"
        (workdir / "admin.token").write_text(TOKEN + "\n")
        self.config = workdir / "config.yaml"
        self.config.write_text(daemon_config(workdir, config_body, self.port, drain_s, debug_hooks))
        self.log_path = workdir / "daemon.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "STATE_DIRECTORY": str(workdir)}
        self.proc = subprocess.Popen(
            [KVGUARD, "serve", "--config", str(self.config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=preexec_fn,
        )

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                lines = self.log_path.read_text(errors="replace").strip().splitlines()
                last = f" ({lines[-1]})" if lines else ""
                raise StartError(f"daemon exited {self.proc.returncode}{last}: see {self.log_path}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise StartError(f"daemon not ready after {timeout}s: see {self.log_path}")

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kw)

    def state(self) -> dict[str, Any]:
        return self.admin("GET", "/admin/state").json()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float | None = None) -> int:
        """SIGTERM, as systemd stops it; the exit status is part of what we measure. Waits
        `timeout` seconds (default: the drain it was configured with plus STOP_MARGIN_S) before
        it kills: a kill inside the drain would be the harness's failure, not the daemon's."""
        if timeout is None:
            timeout = self.drain_s + STOP_MARGIN_S
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format to {'name{labels}': value}; enough for counters and gauges."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum a metric over every label set that matches `labels`."""
    total = 0.0
    for key, v in metrics.items():
        named = key == name or key.startswith(name + "{")
        if named and all(f'{k}="{val}"' in key for k, val in labels.items()):
            total += v
    return total


def audit_actions(db: Path) -> list[dict[str, Any]]:
    """Every action row; read after the daemon stopped so the writer queue has drained."""
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        sql = "SELECT time, rule, action, outcome, is_undo, incident FROM actions ORDER BY id"
        return [dict(r) for r in con.execute(sql).fetchall()]
    finally:
        con.close()


# ----------------------------------------------------------------------------- configurations

RULES_TIMING = (  # (from, to) rewrites of rules/default.yaml so one run shows the whole ladder
    ("interval: 5s", "interval: 1s"),
    ("cooldown: 30s", "cooldown: 3s"),
    ("for: 10s", "for: 2s"),
    ("recover_for: 60s", "recover_for: 5s"),
    ("recover_for: 30s", "recover_for: 5s"),
    ("recover_for: 10s", "recover_for: 3s"),
    ("cooldown: 10s", "cooldown: 3s"),
)
NO_RULES = "version: 1\ninterval: 1s\nrules: []\n"


def fast_rules(dest: Path) -> Path:
    """The packaged ladder, thresholds untouched, only its clocks shortened (RULES_TIMING)."""
    text = (REPO / "rules" / "default.yaml").read_text()
    for old, new in RULES_TIMING:
        text = text.replace(old, new)
    dest.write_text(text)
    return dest


@dataclass(frozen=True, slots=True)
class Setup:
    name: str
    what: str
    config: str


def setups(
    workdir: Path,
    model: str,
    kv_bytes: int,
    budget: int,
    spec: LoadSpec,
    threads: int,
    trace: str = "realistic",
) -> list[Setup]:
    """The realistic trace runs (a), (a2), (b), (c); the adversarial one (a), worst-case
    admission and (b): what predicted admission costs where every prediction is too short."""
    serving = (
        f"serving: {{model: {model}, kv_cache_bytes: {kv_bytes}, max_model_len: "
        f"{spec.max_model_len}, num_threads: {threads}, max_num_seqs: {{seqs}}}}\n"
    )
    no_rules = workdir / "no-rules.yaml"
    no_rules.write_text(NO_RULES)
    off = f"rules: {{path: {no_rules}}}\nadmission_control: {{enable: false}}\n"
    ladder = f"rules: {{path: {fast_rules(workdir / 'rules-fast.yaml')}}}\n"
    prealloc_seqs = max(1, budget // spec.max_model_len)
    shipped = Setup(
        "kvguard",
        "paging + admission (predicted) + default ladder (clocks shortened)",
        serving.replace("{seqs}", "32") + ladder + "admission_control: {enable: true}\n",
    )
    no_control = Setup(
        "no-control", "paging + preemption only", serving.replace("{seqs}", "32") + off
    )
    if trace == "adversarial":
        worst = "admission_control: {enable: true, estimate: worst_case}\n"
        return [
            shipped,
            Setup(
                "kvguard-worst-case",
                "as kvguard with worst-case admission (prompt + max_tokens, the brief's rule)",
                serving.replace("{seqs}", "32") + ladder + worst,
            ),
            no_control,
        ]
    return [
        shipped,
        Setup(
            "kvguard-ladder",
            "paging + default ladder, admission off (the ladder alone)",
            serving.replace("{seqs}", "32") + ladder + "admission_control: {enable: false}\n",
        ),
        no_control,
        Setup(
            "prealloc",
            f"max_model_len slot per sequence: max_num_seqs={prealloc_seqs}",
            serving.replace("{seqs}", str(prealloc_seqs)) + off,
        ),
    ]


# ----------------------------------------------------------------------------- the client


@dataclass(slots=True)
class Outcome:
    """What one request saw from the client side; `lost` is neither a response nor a 429/503."""

    priority: str
    sent_s: float
    status: int = 0
    retry_after: str | None = None
    first_s: float | None = None
    done_s: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str = ""
    finish_reason: str | None = None

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done_s is not None

    @property
    def rejected(self) -> bool:
        return self.status in (429, 503) and self.retry_after is not None

    @property
    def lost(self) -> bool:
        return not self.completed and not self.rejected and not self.error.startswith("client")


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, a: Arrival, t0: float, cancel_after: int = 0
) -> Outcome:
    """Stream one completion; cancel_after > 0 hangs up after that many chunks (chaos)."""
    out = Outcome(a.priority, time.monotonic() - t0)
    body = {
        "model": model,
        "prompt": a.prompt_ids,
        "max_tokens": a.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stop": a.stop or None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream(
            "POST", url + "/v1/completions", json=body, headers={"X-Priority": a.priority}
        ) as r:
            out.status = r.status_code
            out.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                await r.aread()
                return out
            await _read_stream(r, out, t0, cancel_after)
    except (httpx.HTTPError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _read_stream(r: httpx.Response, out: Outcome, t0: float, cancel_after: int) -> None:
    last, chunks = None, 0
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        now = time.monotonic() - t0
        if line == "data: [DONE]":
            out.done_s = now
            return
        msg = json.loads(line[6:])
        if msg.get("usage"):
            out.tokens = msg["usage"]["completion_tokens"]
        if msg.get("choices") and msg["choices"][0].get("finish_reason"):
            out.finish_reason = msg["choices"][0]["finish_reason"]
        if msg.get("choices") and msg["choices"][0].get("text"):
            out.first_s = out.first_s if out.first_s is not None else now
            if last is not None:
                out.gaps.append(now - last)
            last, chunks = now, chunks + 1
            if cancel_after and chunks >= cancel_after:
                out.error = "client hung up on purpose"
                return


async def drive(
    url: str, model: str, arrivals: Sequence[Arrival], t0: float, patience_s: float
) -> list[Outcome]:
    """Open loop: each request leaves at its arrival time whatever the server is doing.

    A request with no answer after `patience_s` counts as lost: a stalled server must end the
    run with a verdict, not hang it.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def at(a: Arrival) -> Outcome:
            await asyncio.sleep(max(0.0, a.at_s - (time.monotonic() - t0)))
            sent = time.monotonic() - t0
            try:
                return await asyncio.wait_for(one_request(client, url, model, a, t0), patience_s)
            except TimeoutError:
                return Outcome(a.priority, sent, error=f"no answer within {patience_s:.0f}s")

        return list(await asyncio.gather(*(at(a) for a in arrivals)))


# ----------------------------------------------------------------------------- sampling


class Sampler(threading.Thread):
    """Polls /admin/state every SAMPLE_S: the timeline, peak concurrency and rule states."""

    def __init__(self, daemon: Daemon, t0: float) -> None:
        super().__init__(daemon=True)
        self.d, self.t0 = daemon, t0
        self.samples: list[dict[str, Any]] = []
        self.failures = 0
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5) as c:
            while not self._halt.wait(SAMPLE_S):
                try:
                    s = c.get(self.d.url + "/admin/state").json()
                except (httpx.HTTPError, ValueError):
                    self.failures += 1
                    continue
                self.samples.append(_sample(s, time.monotonic() - self.t0))

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def _sample(s: dict[str, Any], t: float) -> dict[str, Any]:
    q = s["queues"]
    host = s["kv"]["host"]
    return {
        "t": t,
        "device": s["kv"]["device"]["usage_ratio"],
        "host": host["blocks_used"] / host["blocks_total"] if host["blocks_total"] else 0.0,
        "waiting": sum(q["waiting"].values()),
        "running": sum(q["running"].values()),
        "swapped": sum(q["swapped"].values()),
        "busy_rules": [r["name"] for r in s.get("rules", []) if r["state"] in BUSY_STATES],
        "rule_states": {r["name"]: r["state"] for r in s.get("rules", [])},
    }


def recovery_s(samples: Sequence[dict[str, Any]], burst_end: float) -> float | None:
    """From the burst's end until every rule is calm (inactive, or unknown: no data) for good."""
    if not samples:
        return None
    last_busy = max((s["t"] for s in samples if s["busy_rules"]), default=None)
    if last_busy is None:
        return 0.0
    if samples[-1]["busy_rules"]:
        return None  # still busy when we stopped looking
    calm = next(s["t"] for s in samples if s["t"] > last_busy)
    return max(0.0, calm - burst_end)


# ----------------------------------------------------------------------------- one configuration


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def unloaded_ttft(d: Daemon, model: str, arrivals: Sequence[Arrival], n: int) -> float | None:
    """High-priority TTFT on an idle daemon, one at a time: the 1.5x goal's yardstick (p99).
    Every high request of the trace (the first `n` when there are none: quick traces), so the
    loaded and the unloaded p99 are taken over the same prompts."""
    picks = [a for a in arrivals if a.priority == "high"] or list(arrivals[:n])
    outs = [asyncio.run(_alone(d.url, model, a)) for a in picks]
    return pct([o.first_s - o.sent_s for o in outs if o.first_s is not None], 99)


async def _alone(url: str, model: str, a: Arrival) -> Outcome:
    async with httpx.AsyncClient(timeout=120) as c:
        return await one_request(c, url, model, a, time.monotonic())


def run_setup(
    setup: Setup, workdir: Path, model: str, arrivals: Sequence[Arrival], spec: LoadSpec
) -> dict[str, Any]:
    d = Daemon(workdir / setup.name, setup.config)
    try:
        d.wait_ready()
        base = unloaded_ttft(d, model, arrivals, 5) if setup.name == "kvguard" else None
        before = d.metrics()
        t0, t0_wall = time.monotonic(), time.time()
        sampler = Sampler(d, t0)
        sampler.start()
        outcomes = asyncio.run(drive(d.url, model, arrivals, t0, spec.patience_s))
        makespan = max((o.done_s or 0.0) for o in outcomes) or 1.0
        print(f"   trace done in {makespan:.1f}s (unloaded TTFT {base}); settling", flush=True)
        _settle(d, sampler, spec)
        sampler.stop()
        after = d.metrics() if d.alive() else {}
        undo_of = {r["name"]: r["undo"] for r in d.state()["rules"]} if d.alive() else {}
        survived = d.alive()
    finally:
        rc = d.stop()
    burst = [o for o, a in zip(outcomes, arrivals, strict=True) if a.in_burst]
    r = summarize(setup, outcomes, sampler.samples, d, before, after, makespan, spec, burst)
    out = r | {
        "survived": survived,
        "exit_code": rc,
        "unloaded_high_ttft_p99_s": base,
        "t0_wall": t0_wall,
        "not_undone": unmatched_actions(undo_of, r["action_log"]),
        "refused_undos": sum(
            bool(a["is_undo"]) and a["outcome"] == "refused" for a in r["action_log"]
        ),
    }
    out["undo_delays_s"] = undo_delays(out)
    return out


def _settle(d: Daemon, sampler: Sampler, spec: LoadSpec) -> None:
    """After the load: wait (up to settle_s) for the rules to undo themselves."""
    deadline = time.monotonic() + spec.settle_s
    while time.monotonic() < deadline and d.alive():
        if sampler.samples and not sampler.samples[-1]["busy_rules"]:
            time.sleep(2 * SAMPLE_S)
            if not sampler.samples[-1]["busy_rules"]:
                return
        time.sleep(SAMPLE_S)


def summarize(
    setup: Setup,
    outcomes: Sequence[Outcome],
    samples: Sequence[dict[str, Any]],
    d: Daemon,
    before: dict[str, float],
    after: dict[str, float],
    makespan: float,
    spec: LoadSpec,
    burst: Sequence[Outcome] = (),
) -> dict[str, Any]:
    done = [o for o in outcomes if o.completed]
    # the burst's backlog: from its start until its last request is answered. Every paging
    # configuration serves the whole trace, so goodput over it is the offered load; how soon
    # the burst is worked off is where wasted work (recomputed preemptions) shows.
    burst_done = [o for o in burst if o.completed]
    drain = max((o.done_s or 0.0 for o in burst_done), default=0.0) - spec.burst_start_s
    acts = audit_actions(d.db) if d.db.exists() else []
    applied = [a for a in acts if a["outcome"] == "applied"]
    by_prio = {
        p: [o for o in done if o.priority == p and o.first_s is not None] for p in PRIORITIES
    }
    return {
        "name": setup.name,
        "what": setup.what,
        "requests": len(outcomes),
        "completed": len(done),
        "rejected": sum(o.rejected for o in outcomes),
        "lost": sum(o.lost for o in outcomes),
        "aborted": sum(o.finish_reason == "abort" for o in done),
        "lost_detail": [o.error or f"HTTP {o.status}" for o in outcomes if o.lost][:5],
        "goodput_tokens_per_s": sum(o.tokens for o in done) / makespan,
        "burst_done_s": drain if burst_done else None,
        "burst_tokens_per_s": sum(o.tokens for o in burst_done) / drain if drain > 0 else None,
        "ttft_p50_s": {p: pct([o.first_s - o.sent_s for o in v], 50) for p, v in by_prio.items()},
        "ttft_p99_s": {p: pct([o.first_s - o.sent_s for o in v], 99) for p, v in by_prio.items()},
        "itl_p50_s": {p: pct([g for o in v for g in o.gaps], 50) for p, v in by_prio.items()},
        "itl_p99_s": {p: pct([g for o in v for g in o.gaps], 99) for p, v in by_prio.items()},
        "preemptions": metric_sum(after, "kvguard_preemptions_total")
        - metric_sum(before, "kvguard_preemptions_total"),
        "peak_running": max((s["running"] for s in samples), default=0),
        "peak_kv": max((s["device"] for s in samples), default=0.0),
        "actions": sum(not a["is_undo"] for a in applied),
        "undos": sum(bool(a["is_undo"]) for a in applied),
        "action_log": [{**a, "time": str(a["time"]), "is_undo": bool(a["is_undo"])} for a in acts],
        "recovery_s": recovery_s(samples, spec.burst_end_s)
        if "rules-fast" in setup.config
        else None,
        "timeline": list(samples),
        "per_request": [
            {
                "priority": o.priority,
                "sent_s": round(o.sent_s, 3),
                "first_s": None if o.first_s is None else round(o.first_s, 3),
                "done_s": None if o.done_s is None else round(o.done_s, 3),
                "tokens": o.tokens,
                "status": o.status,
            }
            for o in outcomes
        ],
    }


# ----------------------------------------------------------------------------- report


def unmatched_actions(undo_of: dict[str, str | None], acts: Sequence[dict[str, Any]]) -> list[str]:
    """Applied actions that no undo of the same rule inside the same incident follows.

    Rules without an undo (evict_lowest_priority, handle_oom) reverse themselves: the evicted
    or preempted sequences are recomputed or swapped back in, so there is nothing to undo.
    """
    pending: dict[tuple[str, str], int] = {}
    for a in acts:
        if a["outcome"] != "applied" or not undo_of.get(a["rule"] or ""):
            continue
        key = (a["rule"], a["incident"])
        pending[key] = pending.get(key, 0) + (-1 if a["is_undo"] else 1)
    return [f"{r} in {i}" for (r, i), n in pending.items() if n > 0]


def print_table(results: Sequence[dict[str, Any]]) -> None:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    rows = [
        [
            r["name"],
            "yes" if r["survived"] else "NO",
            r["completed"],
            r["rejected"],
            r["lost"],
            f"{r['goodput_tokens_per_s']:.1f}",
            s(r.get("burst_done_s")),
            *(s(r["ttft_p50_s"][p]) + "/" + s(r["ttft_p99_s"][p]) for p in PRIORITIES),
            s(r["itl_p99_s"]["normal"]),
            int(r["preemptions"]),
            r["peak_running"],
            f"{r['peak_kv']:.2f}",
            r["actions"],
            r["undos"],
            s(r["recovery_s"]),
        ]
        for r in results
    ]
    heads = ["config", "alive", "done", "rej", "lost", "goodput t/s", "burst done s"]
    heads += [f"TTFT {p} p50/p99 s" for p in PRIORITIES]
    heads += ["ITL p99 s", "preempt", "peak run", "peak KV", "acts", "undos", "recov s"]
    print(format_table(heads, rows))


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def goals(results: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's goals, measured; the benchmark reports them, it does not assert them."""
    by = {r["name"]: r for r in results}
    a, b, c = by["kvguard"], by.get("no-control"), by.get("prealloc")
    worst = by.get("kvguard-worst-case")
    base, high = a["unloaded_high_ttft_p99_s"], a["ttft_p99_s"]["high"]
    lines = [
        f"(a) lost 0 requests: {_verdict(a['lost'] == 0)} ({a['lost']} lost)",
        f"(a) never crashed: {_verdict(a['survived'])} (exit {a['exit_code']})",
    ]
    if b is not None and b["goodput_tokens_per_s"]:
        x = a["goodput_tokens_per_s"] / b["goodput_tokens_per_s"]
        lines.append(
            f"(a) goodput >= 1.0x no-control: {_verdict(x >= 1.0)} "
            f"({a['goodput_tokens_per_s']:.1f} vs {b['goodput_tokens_per_s']:.1f} t/s = {x:.2f}x)"
        )
    if b is not None and a.get("burst_tokens_per_s") and b.get("burst_tokens_per_s"):
        x = a["burst_tokens_per_s"] / b["burst_tokens_per_s"]
        lines.append(
            f"(a) the burst worked off in {a['burst_done_s']:.1f}s against no-control's "
            f"{b['burst_done_s']:.1f}s: {a['burst_tokens_per_s']:.1f} vs "
            f"{b['burst_tokens_per_s']:.1f} t/s = {x:.2f}x (reported, not a goal)"
        )
    if base and high is not None:
        lines.append(
            f"(a) high-priority TTFT p99 within 1.5x unloaded: {_verdict(high <= 1.5 * base)} "
            f"({high:.2f}s vs unloaded {base:.2f}s = {high / base:.2f}x)"
        )
    low_a, low_b = a["ttft_p50_s"]["low"], (b or {}).get("ttft_p50_s", {}).get("low")
    if low_a is not None and low_b:
        lines.append(
            f"(a) low-priority TTFT p50 within 2x no-control's: {_verdict(low_a <= 2 * low_b)} "
            f"({low_a:.2f}s vs {low_b:.2f}s = {low_a / low_b:.2f}x)"
        )
    if worst is not None and worst["goodput_tokens_per_s"]:
        x = a["goodput_tokens_per_s"] / worst["goodput_tokens_per_s"]
        lines.append(
            f"(a) goodput against worst-case admission on this trace: {x:.2f}x "
            f"({a['goodput_tokens_per_s']:.1f} vs {worst['goodput_tokens_per_s']:.1f} t/s)"
        )
    if c is not None:
        ok = c["peak_running"] * 4 <= a["peak_running"]
        lines.append(
            f"(c) at most a quarter of (a)'s concurrent sequences: {_verdict(ok)} "
            f"(peak {c['peak_running']} vs {a['peak_running']})"
        )
    for r in results:
        if "ladder" in r["what"]:
            left = r["not_undone"]
            lines.append(
                f"({r['name']}) every action undone inside its incident: {_verdict(not left)}"
                + (f" (no undo: {', '.join(left)})" if left else f" ({r['actions']} actions)")
            )
            delays = r["undo_delays_s"]
            slow = max((d for _, d in delays), default=0.0)
            lines.append(
                f"({r['name']}) every undo within {UNDO_DUE_S:.0f}s of its recovery condition: "
                f"{_verdict(slow <= UNDO_DUE_S and not r['not_undone'])} "
                f"({len(delays)} undos, slowest {slow:.1f}s; {r['refused_undos']} refused)"
            )
    return lines


def undo_delays(r: dict[str, Any]) -> list[tuple[str, float]]:
    """Per applied undo: seconds from its rule entering `recovering` (usage below the recovery
    threshold) to the undo's audit row. The rule's recover_for is part of it."""
    tl, out = r["timeline"], []
    for a in r["action_log"]:
        at = _action_t(a, r.get("t0_wall"))
        if not a["is_undo"] or a["outcome"] != "applied" or at is None:
            continue
        states = [(x["t"], x.get("rule_states", {}).get(a["rule"])) for x in tl if x["t"] <= at]
        while states and states[-1][1] != "recovering" and states[-1][0] > at - 2.0:
            states.pop()  # sampled after the undo had applied
        start = None
        for t, state in reversed(states):
            if state != "recovering":
                break
            start = t
        if start is not None:
            out.append((a["rule"], round(at - start, 2)))
    return out


def plot(results: Sequence[dict[str, Any]], path: Path, spec: LoadSpec) -> None:
    """One row per config: KV usage per tier, queue lengths, and each audited action as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), sharex=True)
    xmax = max((s["t"] for r in results for s in r["timeline"]), default=1.0)
    for ax, r in zip(np.atleast_1d(axes), results, strict=True):
        _plot_one(ax, r, spec, xmax)
    np.atleast_1d(axes)[-1].set_xlabel("seconds since the first arrival")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _plot_one(ax: Any, r: dict[str, Any], spec: LoadSpec, xmax: float) -> None:
    tl = r["timeline"]
    t = [s["t"] for s in tl]
    ax.plot(t, [s["device"] for s in tl], label="KV device", color="tab:red")
    ax.plot(t, [s["host"] for s in tl], label="KV host", color="tab:orange")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("KV usage")
    ax.axvspan(spec.burst_start_s, spec.burst_end_s, color="grey", alpha=0.15, label="burst")
    q = ax.twinx()
    for key, color in (("running", "tab:blue"), ("waiting", "tab:green"), ("swapped", "tab:pink")):
        q.plot(t, [s[key] for s in tl], label=key, color=color, lw=0.9)
    q.set_ylabel("sequences")
    _plot_actions(ax, r, xmax)
    ax.set_title(f"({r['name']}) {r['what']}", fontsize=9)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = q.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=7, ncol=3)


def _plot_actions(ax: Any, r: dict[str, Any], xmax: float) -> None:
    """Applied actions as vertical lines (solid: action, dotted: undo) with short labels packed
    into rows so none overlaps another; a run of refused undos of one rule as one shaded span
    with a count, not a line per refusal."""
    t0, applied, refused = _t_origin(r), [], {}
    for a in r["action_log"]:
        at = _action_t(a, t0)
        if at is None:
            continue
        if a["outcome"] == "applied":
            applied.append((at, a))
        elif a["is_undo"]:
            runs = refused.setdefault(a["rule"], [])
            if runs and at - runs[-1][1] <= 15.0:
                runs[-1] = (runs[-1][0], at, runs[-1][2] + 1)
            else:
                runs.append((at, at, 1))
    for rule, runs in refused.items():
        for lo, hi, n in runs:
            ax.axvspan(lo, max(hi, lo + 0.5), color="tab:purple", alpha=0.18, lw=0)
            ax.text(lo, 0.06, f"{rule} undo refused x{n}", fontsize=7, color="tab:purple")
    ends: list[float] = []  # per label row: where its last label ends (data units)
    for at, a in sorted(applied, key=lambda x: x[0]):
        ax.axvline(at, color="black", ls=":" if a["is_undo"] else "-", lw=0.7)
        label = SHORT.get(a["action"], a["action"])
        width = (len(label) + 2) * xmax / 110  # a character at fontsize 6.5, with room
        row = next((i for i, end in enumerate(ends) if at > end), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = at + width
        ax.text(
            at,
            0.98 - 0.09 * (row % 8),
            label,
            fontsize=6.5,
            va="top",
            bbox={"facecolor": "white", "alpha": 0.8, "lw": 0, "pad": 0.3},
        )


SHORT = {  # action labels in the picture: short enough not to run into each other
    "evict_lowest_priority": "evict",
    "enable_fp8_kv": "fp8 on",
    "disable_fp8_kv": "fp8 off",
    "reduce_batch": "batch cut",
    "restore_batch": "batch back",
    "halt_admission": "halt",
    "resume_admission": "resume",
    "handle_oom": "oom chain",
    "recover_from_oom": "oom undo",
}


def _t_origin(r: dict[str, Any]) -> float | None:
    return r.get("t0_wall")


def _action_t(a: dict[str, Any], t0_wall: float | None) -> float | None:
    """Audit times are wall-clock (UTC, naive); place them on the run's monotonic axis."""
    from datetime import UTC, datetime

    if t0_wall is None:
        return None
    try:
        when = datetime.fromisoformat(a["time"]).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None
    return when - t0_wall


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short smoke run (about 2 minutes)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--png", type=Path, metavar="FILE", default=Path("overload.png"))
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    p.add_argument(
        "--trace",
        choices=["realistic", "adversarial"],
        default="realistic",
        help="realistic: answers end before max_tokens; adversarial: every one runs to it",
    )
    p.add_argument(
        "--only",
        choices=["kvguard", "kvguard-ladder", "kvguard-worst-case", "no-control", "prealloc"],
        action="append",
    )
    p.add_argument(
        "--burst-rps",
        type=float,
        metavar="R",
        help=f"the burst's arrival rate on top of the base load (default {FULL.burst_rps:g}/s); "
        "the KV budget stays the same",
    )
    p.add_argument("--workdir", type=Path, help="keep configs, logs and audit DBs here")
    args = p.parse_args(argv)
    if args.burst_rps is not None and args.burst_rps <= 0:
        p.error(f"--burst-rps {args.burst_rps:g}: expected a rate above 0")
    return args


def prepare(args: argparse.Namespace) -> tuple[LoadSpec, list[Arrival], Path]:
    base = QUICK if args.quick else FULL
    fields = {f: getattr(base, f) for f in base.__slots__}
    if args.burst_rps is not None:
        # the same memory for a lighter or heavier burst: the overflow scales with the rate
        fields["overflow"] = base.overflow * args.burst_rps / base.burst_rps
        fields["burst_rps"] = args.burst_rps
    spec = LoadSpec(**{**fields, "seed": args.seed})
    model_dir = resolve_model_dir(args.model)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    head = tok.encode(COUNT_HEAD, add_special_tokens=False).ids
    adversarial = args.trace == "adversarial"
    return spec, make_arrivals(spec, ordinary_token_ids(model_dir), head, adversarial), model_dir


def main(argv: Sequence[str] | None = None) -> int:
    from kvguard.engine.model_config import ModelLoadError

    args = parse_args(argv)
    try:
        return measure(args)
    except (StartError, ModelLoadError) as e:
        return start_failure("overload", e)


def measure(args: argparse.Namespace) -> int:
    spec, arrivals, model_dir = prepare(args)
    budget = budget_tokens(spec, arrivals)
    kv_bytes = budget * kv_bytes_per_token(model_dir)
    burst = sum(a.total_len for a in arrivals if a.in_burst)
    print(
        f"trace ({args.trace}): {len(arrivals)} requests over {spec.duration_s:.0f}s, burst "
        f"{spec.burst_start_s:.0f}-{spec.burst_end_s:.0f}s asks {burst} KV tokens; budget "
        f"{budget} tokens ({kv_bytes / 2**20:.1f} MiB); load average {os.getloadavg()[0]:.2f}"
    )
    workdir = bench_workdir(args.workdir, "kvguard-overload-")
    results = []
    for s in setups(workdir, args.model, kv_bytes, budget, spec, args.threads, args.trace):
        if args.only and s.name not in args.only:
            continue
        print(f"-- {s.name}: {s.what}", flush=True)
        r = run_setup(s, workdir, args.model, arrivals, spec)
        results.append(r)
        print(
            f"   survived={r['survived']} completed={r['completed']} rejected={r['rejected']} "
            f"lost={r['lost']} actions={r['actions']} undos={r['undos']}",
            flush=True,
        )
    print_table(results)
    if any(r["name"] == "kvguard" for r in results):
        print("\n".join(goals(results)))
    plot(results, args.png, spec)
    # everything measured, the timelines too, so the picture can be drawn again (replot)
    (workdir / "results.json").write_text(json.dumps(results, default=str))
    write_json(
        args.json,
        {"budget_tokens": budget, "trace": args.trace, "results": _json_results(results)},
    )
    print(f"logs, configs and audit databases under {workdir}")
    return 0 if all(r["survived"] and r["lost"] == 0 for r in results) else 1


def _json_results(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = [
        "name",
        "survived",
        "exit_code",
        "completed",
        "rejected",
        "lost",
        "aborted",
        "goodput_tokens_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_s",
        "itl_p99_s",
        "preemptions",
        "peak_running",
        "actions",
        "undos",
        "recovery_s",
        "unloaded_high_ttft_p99_s",
        "peak_kv",
        "not_undone",
        "action_log",
        "lost_detail",
        "undo_delays_s",
        "refused_undos",
    ]
    return [{k: r[k] for k in keep} for r in results]


if __name__ == "__main__":
    sys.exit(main())
