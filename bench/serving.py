"""Serving overhead: `kvguard serve` over HTTP against the same engine driven in-process.

One fixed-seed trace (drawn by bench/trace.py: token-id prompts, exact output lengths, EOS
ignored, greedy) is served twice at each fixed concurrency (1, 8, 32 requests in flight,
closed loop: a finished request is replaced by the next one):

- kvguard serve: the real daemon as a subprocess on a free loopback port, its config written
  by this script (admission on but generous: no safety margin, no dynamic max_new_tokens
  ladder, a deep queue; rules in dry-run so no remedy changes the run). The load generator is
  a separate process (spawned, not forked) running an asyncio httpx client that streams
  `/v1/completions` (SSE): TTFT is the first event, inter-token latency the gaps between
  events (the daemon sends one event per token that adds text);
- in-process: an `LLMEngine` built from the very same config file, driven directly with
  `add_request` / `step`, keeping the same number of requests in flight (at concurrency >=
  max_num_seqs this is exactly what `engine.generate` does with the whole trace); TTFT and
  inter-token latency from the step at which each token came out.

The two take turns level by level (never at the same time), so outside load on a shared
machine hits both alike; `--rounds N` repeats the whole sweep and keeps each side's best. Reported per level: requests/s, output tokens/s, TTFT
and inter-token p50/p99, and the server's share of in-process throughput. Goal stated by the
issue: >= 90% of in-process throughput at concurrency 32. The client shares the machine with
the server, as it does in any one-box deployment; its CPU time counts against the server.

    python bench/serving.py [--quick] [--json FILE] [--threads N] [--levels 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import greedy, load_line, ms, percentile, ratio, section, verdict  # noqa: E402
from bench.trace import (  # noqa: E402
    SUMMARY_HEADERS,
    LengthDist,
    TraceRequest,
    TraceSpec,
    common_args,
    format_table,
    make_trace,
    ordinary_token_ids,
    resolve_model_dir,
    trace_summary,
    write_json,
)

if TYPE_CHECKING:
    from kvguard.engine import LLMEngine

# Modest on purpose: a full run (three levels, both sides) takes a few minutes on 2 cores.
FULL = TraceSpec(64, LengthDist(64, 0.6, 16, 256), LengthDist(48, 0.25, 32, 64))
QUICK = TraceSpec(8, LengthDist(24, 0.4, 16, 48), LengthDist(8, 0.25, 6, 10))
GOAL_SHARE = 0.90
GOAL_LEVEL = 32


# ----------------------------------------------------------------------------- results


@dataclass(slots=True)
class RequestTiming:
    """One request as its caller saw it: perf_counter times of start and of each token event."""

    start: float = 0.0
    events: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.events[0] - self.start if self.events else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:], strict=False)]


@dataclass(slots=True)
class LevelResult:
    side: str
    concurrency: int
    wall_s: float
    requests: list[RequestTiming] = field(repr=False)

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return len(self.requests) / self.wall_s

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.requests if r.error]

    def latency(self, which: str, q: float) -> float | None:
        if which == "ttft":
            values = [r.ttft for r in self.requests if r.ttft is not None]
        else:
            values = [g for r in self.requests for g in r.gaps()]
        return percentile(values, q)

    def summary(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "wall_s": self.wall_s,
            "output_tokens": self.output_tokens,
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.tokens_per_s,
            "ttft_p50_s": self.latency("ttft", 50),
            "ttft_p99_s": self.latency("ttft", 99),
            "itl_p50_s": self.latency("itl", 50),
            "itl_p99_s": self.latency("itl", 99),
            "errors": self.errors[:5],
        }


# ----------------------------------------------------------------------------- the client process


def run_client(url: str, model: str, jobs: list[tuple[list[int], int]], c: int) -> dict:
    """Entry point of the load-generator process: serve `jobs` at concurrency `c` over HTTP."""
    t0 = time.perf_counter()
    timings = asyncio.run(_client(url, model, jobs, c))
    return {"wall_s": time.perf_counter() - t0, "requests": [asdict(t) for t in timings]}


async def _client(
    url: str, model: str, jobs: list[tuple[list[int], int]], c: int
) -> list[RequestTiming]:
    import httpx

    timings = [RequestTiming() for _ in jobs]
    queue: deque[int] = deque(range(len(jobs)))
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:

        async def worker() -> None:
            while queue:
                i = queue.popleft()
                await _stream_one(http, model, *jobs[i], timings[i])

        await asyncio.gather(*(worker() for _ in range(c)))
    return timings


async def _stream_one(
    http: Any, model: str, prompt: list[int], max_tokens: int, out: RequestTiming
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out.start = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                _on_line(line, out)
    except Exception as e:  # noqa: BLE001 - a failed request is a result to report
        out.error = f"{type(e).__name__}: {e}"


def _on_line(line: str, out: RequestTiming) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    now = time.perf_counter()
    event = json.loads(line[6:])
    if event.get("usage"):
        out.tokens = event["usage"]["completion_tokens"]
        return
    choice = event["choices"][0]
    if choice.get("finish_reason") is None:  # a token event (the final one carries no text)
        out.events.append(now)
        out.text += choice.get("text") or ""


# ----------------------------------------------------------------------------- the daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tmp: Path, args: argparse.Namespace, port: int) -> Path:
    """The daemon's YAML; the in-process engine is built from the same file."""
    cfg = {
        "serving": {
            "model": args.model,
            "kv_cache_bytes": args.kv_cache_bytes,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "num_threads": args.threads,
        },
        "admission_control": {
            "enable": True,
            "safety_factor": 1.0,
            "reserved_headroom_mb": 0,
            "dynamic_max_tokens": False,
            "max_queue": 4096,
        },
        "offloading": {"enable_cpu_offload": False},
        "rules": {"dry_run": True},
        "api": {"host": "127.0.0.1", "port": port, "drain_timeout": "10s"},
        "audit": {"url": f"sqlite:///{tmp / 'audit.db'}"},
    }
    path = tmp / "config.yaml"
    path.write_text(json.dumps(cfg, indent=2))  # JSON is YAML
    return path


class Daemon:
    """`kvguard serve --config FILE` in a subprocess, ready when GET /ready answers 200."""

    def __init__(self, config: Path, port: int, tmp: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = tmp / "daemon.log"
        exe = Path(sys.executable).parent / "kvguard"
        env = {**os.environ, "STATE_DIRECTORY": str(tmp)}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [str(exe), "serve", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def wait_ready(self, timeout: float = 300.0) -> float:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"daemon exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise SystemExit(f"daemon not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-n:])

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def warm_server(url: str, model: str, trace: list[TraceRequest]) -> None:
    """Two short requests so the first timed one does not pay first-call set-up."""
    import httpx

    for r in trace[:2]:
        body = {"model": model, "prompt": r.prompt_ids[:16], "max_tokens": 2, "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()


def serve_level(pool: ProcessPoolExecutor, url: str, model: str, c: int, reqs: list) -> LevelResult:
    """One level through the daemon, the client running in the load-generator process."""
    jobs = [(r.prompt_ids, r.output_len) for r in reqs]
    raw = pool.submit(run_client, url, model, jobs, c).result()
    timings = [RequestTiming(**t) for t in raw["requests"]]
    return LevelResult("kvguard serve", c, raw["wall_s"], timings)


# ----------------------------------------------------------------------------- in-process


def drive(engine: LLMEngine, reqs: list[TraceRequest], c: int) -> LevelResult:
    """Closed loop at concurrency `c`: a finished request is replaced before the next step."""
    timings = [RequestTiming() for _ in reqs]
    pending = deque(range(len(reqs)))
    live: dict[str, int] = {}

    def top_up() -> None:
        while pending and len(live) < c:
            i = pending.popleft()
            timings[i].start = time.perf_counter()
            r = reqs[i]
            live[engine.add_request(r.prompt_ids, greedy(r.output_len))] = i

    t0 = time.perf_counter()
    top_up()
    while live:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            t = timings[live[o.request_id]]
            t.events.append(now)
            if o.finished:
                t.tokens, t.text = len(o.token_ids), o.text
                del live[o.request_id]
        top_up()
    return LevelResult("in-process engine", c, time.perf_counter() - t0, timings)


def inprocess_engine(config: Path, trace: list[TraceRequest]) -> LLMEngine:
    """An engine from the daemon's own config file, warmed like the daemon is."""
    from kvguard.daemon.config import load_config
    from kvguard.engine import LLMEngine

    engine = LLMEngine.from_config(load_config(config).to_engine_config(), progress=False)
    engine.generate([r.prompt_ids[:16] for r in trace[:2]], greedy(2))
    return engine


Results = dict[tuple[str, int], LevelResult]


def keep_best(best: Results, res: LevelResult) -> None:
    key = (res.side, res.concurrency)
    print(f"  {res.side} c={res.concurrency}: {res.tokens_per_s:.1f} output tok/s", flush=True)
    if key not in best or res.tokens_per_s > best[key].tokens_per_s:
        best[key] = res


def run_levels(
    args: argparse.Namespace, tmp: Path, trace: list[TraceRequest], work: dict[int, list]
) -> Results:
    """Both sides back to back at each level, so a burst of outside load hits both alike.

    The daemon idles (its loop sleeps on an event) while the in-process engine runs, and the
    in-process engine does nothing while the daemon serves.
    """
    port = free_port()
    config = write_config(tmp, args, port)
    daemon = Daemon(config, port, tmp)
    best: Results = {}
    try:
        print(f"  daemon ready in {daemon.wait_ready():.1f} s at {daemon.url}", flush=True)
        warm_server(daemon.url, args.model, trace)
        engine = inprocess_engine(config, trace)
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            for _ in range(args.rounds):
                for c, reqs in work.items():
                    keep_best(best, serve_level(pool, daemon.url, args.model, c, reqs))
                    keep_best(best, drive(engine, reqs, c))
    finally:
        code = daemon.stop()
    if code not in (0, None):
        print(f"  warning: daemon exited {code}:\n{daemon.log_tail()}")
    return best


# ----------------------------------------------------------------------------- report


def level_rows(server: LevelResult, local: LevelResult) -> list[list[Any]]:
    same = sum(a.text == b.text for a, b in zip(server.requests, local.requests, strict=True))
    rows = []
    for res in (server, local):
        rows.append(
            [
                res.side,
                res.concurrency,
                len(res.requests),
                f"{res.wall_s:.1f}",
                f"{res.requests_per_s:.2f}",
                f"{res.tokens_per_s:.1f}",
                ms(res.latency("ttft", 50)),
                ms(res.latency("ttft", 99)),
                ms(res.latency("itl", 50)),
                ms(res.latency("itl", 99)),
                ratio(res.tokens_per_s, local.tokens_per_s, "") if res is server else "-",
                f"{same}/{len(server.requests)}" if res is server else "-",
                len(res.errors),
            ]
        )
    return rows


HEADERS = [
    "side",
    "conc",
    "reqs",
    "wall s",
    "req/s",
    "out tok/s",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "share of in-proc",
    "same text",
    "errors",
]


def check_tokens(res: LevelResult, reqs: list[TraceRequest]) -> None:
    """Throughput is only comparable if both sides produced exactly the requested tokens."""
    bad = [
        i
        for i, (t, r) in enumerate(zip(res.requests, reqs, strict=True))
        if t.tokens != r.output_len
    ]
    if bad:
        first = res.requests[bad[0]]
        print(
            f"  warning: {res.side} c={res.concurrency}: {len(bad)} requests with the wrong "
            f"token count (first: request {bad[0]}, {first.tokens} tokens, {first.error or 'no error'})"
        )


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,8,32", help="concurrency levels (default 1,8,32)")
    p.add_argument(
        "--c1-requests", type=int, default=0, help="requests at concurrency 1 (16; quick 2)"
    )
    p.add_argument("--kv-cache-bytes", default="256MiB", help="KV budget on both sides")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=1, help="passes over the levels; best counts")
    args = p.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    args.c1_requests = args.c1_requests or (2 if args.quick else 16)
    return args


def workloads(args: argparse.Namespace, trace: list[TraceRequest]) -> dict[int, list]:
    """Each level serves the trace; concurrency 1 only its head (it measures latency, slowly)."""
    return {c: trace[: args.c1_requests] if c == 1 else trace for c in args.levels}


def main() -> None:
    args = parse_args()
    base = QUICK if args.quick else FULL
    spec = TraceSpec(args.requests or base.num_requests, base.prompt, base.output, args.seed)
    trace = make_trace(spec, ordinary_token_ids(resolve_model_dir(args.model)))
    work = workloads(args, trace)
    print(
        f"model {args.model}, {args.threads} torch threads, KV {args.kv_cache_bytes}, max_num_seqs "
        f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}; {load_line()}"
    )
    print(format_table(SUMMARY_HEADERS, trace_summary(trace)))
    section("kvguard serve over HTTP (client in a separate process) and in-process, in turns")
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-") as d:
        best = run_levels(args, Path(d), trace, work)
    server = {c: best["kvguard serve", c] for c in work}
    local = {c: best["in-process engine", c] for c in work}
    rows = []
    for c, reqs in work.items():
        check_tokens(server[c], reqs)
        check_tokens(local[c], reqs)
        rows.extend(level_rows(server[c], local[c]))
    section("serving overhead")
    print(format_table(HEADERS, rows))
    print(goal_line(server, local))
    print(load_line())
    write_json(
        args.json,
        {
            "model": args.model,
            "threads": args.threads,
            "trace": asdict(spec),
            "levels": args.levels,
            "results": [r.summary() for c in work for r in (server[c], local[c])],
        },
    )


def goal_line(server: dict[int, LevelResult], local: dict[int, LevelResult]) -> str:
    name = f">= {GOAL_SHARE:.0%} of in-process throughput at concurrency {GOAL_LEVEL}"
    if GOAL_LEVEL not in server:
        return verdict(name, None, f"level {GOAL_LEVEL} not run")
    share = server[GOAL_LEVEL].tokens_per_s / local[GOAL_LEVEL].tokens_per_s
    return verdict(name, share >= GOAL_SHARE, f"{share:.0%}")


if __name__ == "__main__":
    main()
