"""Where rules read pressure: the engine snapshot and NVML (local), or a PromQL query.

A value that cannot be read is None — the evaluator treats it as unknown and never acts on it.
PromQL failures are counted and logged once per outage (not once per tick): Prometheus out of
reach (no connection, no answer in time, a 502-504) once for the client, a query Prometheus
refuses (a typo, a 422) once for that query until it answers again, however the others fare; so
are answers that hold no number (an empty vector, NaN, a string), once per query until it
answers one again.

`prometheus.url` may carry a path (a Prometheus behind a proxy, or under --web.route-prefix) and
query parameters (a proxy's `?token=`): the API path goes after the path, the parameters with
every query. Its password and secret-named parameters never reach a log line in clear.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, quote_plus, unquote_plus, urlsplit, urlunsplit

from kvguard.engine.host_memory import host_memory_used_ratio
from kvguard.engine.snapshot import EngineSnapshot
from kvguard.rules.schema import PREEMPTION_WINDOW_S, Signal

log = logging.getLogger("kvguard.rules.signals")


def local_value(
    name: str,
    snap: EngineSnapshot,
    gpu_used_ratio: Callable[[], float | None],
    preemptions_recent: float,
) -> float | None:
    table: dict[str, Callable[[], float | None]] = {
        "kv_cache_usage_ratio": lambda: snap.kv_cache_usage_ratio,
        "kv_cache_demand_ratio": lambda: snap.kv_cache_demand_ratio,
        "host_kv_cache_usage_ratio": lambda: (
            snap.host.usage_ratio if snap.host.blocks_total else None
        ),
        "num_waiting": lambda: float(snap.num_waiting),
        "num_running": lambda: float(snap.num_running),
        "num_swapped": lambda: float(snap.num_swapped),
        "preemptions_1m": lambda: preemptions_recent,
        "preemptions_total": lambda: float(snap.num_preemptions),
        "gpu_memory_used_ratio": gpu_used_ratio,
        "host_memory_used_ratio": host_memory_used_ratio,
    }
    return table[name]()


@dataclass(slots=True)
class RecentRise:
    """How much a running total rose over the last `window_s` seconds, from the totals the
    evaluations read: a rule on the total itself can never see it fall, so it could never be
    undone. Each preemption counts from the first reading that sees it (at most an
    evaluation interval after it happened) until `window_s` after that reading. Only the
    readings where the total changed are kept (between two, it was the earlier one's), with
    the newest at or before the window's start as the baseline."""

    window_s: float
    changes: deque[tuple[float, int]] = field(default_factory=deque)  # (time, total)

    def rise(self, now: float, total: int) -> float:
        """The rise up to `total`, read at `now`, since the window's start (0 at the first
        reading: what came before it is not known to be recent)."""
        if self.changes and total < self.changes[-1][1]:
            # the count started over (a new engine): all of it came since the last reading
            self.changes = deque([(self.changes[-1][0], 0)])
        if not self.changes or total != self.changes[-1][1]:
            self.changes.append((now, total))
        while len(self.changes) > 1 and self.changes[1][0] <= now - self.window_s:
            self.changes.popleft()
        return float(total - self.changes[0][1])


class PromQL:
    """Scalar or max-over-vector PromQL reads through prometheus-api-client, within a deadline.

    `timeout_s` bounds the whole query, not each socket read: a Prometheus (or a proxy) that
    trickles its answer a byte at a time would otherwise hold the rule tick for as long as it
    pleases. The request runs on a daemon thread the caller stops waiting for at the deadline;
    while one is still running past it, further queries fail at once instead of piling up."""

    def __init__(self, url: str | None, timeout_s: float, instance: str) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.instance = instance
        self.failures = 0  # queries that failed (no answer, an error, past the deadline)
        self.empty = 0  # queries answered with no number (empty vector, NaN, a string)
        self._down = False  # Prometheus out of reach now (logged once for every query)
        self._failing: set[str] = set()  # queries Prometheus refuses now (logged once each)
        self._empty_exprs: set[str] = set()  # queries answering no number now (logged once)
        self._lock = threading.Lock()
        self._late: threading.Event | None = None  # set once the query past its deadline ends
        self._client = None
        self._params: dict[str, list[str]] = {}  # the URL's query parameters, sent every time
        self._secrets = _secret_values(url) if url else []
        if url:
            from prometheus_api_client import PrometheusConnect
            from urllib3.util.retry import Retry

            base, self._params = _api_base(url)
            if self._params:
                _mask_request_lines()
            # No retries: a down Prometheus must answer "unknown" within the timeout, not
            # after a backoff loop that outlives the evaluation interval.
            self._client = PrometheusConnect(
                url=base,
                disable_ssl=True,
                timeout=timeout_s,
                retry=Retry(total=0, connect=0, read=0),
            )

    def reconfigured(self, url: str | None, timeout_s: float, instance: str) -> PromQL:
        """A client for changed settings (a reload) that counts on from this one's totals:
        a counter that went back to 0 would read as a reset, not as the failures it had."""
        new = PromQL(url, timeout_s, instance)
        new.failures, new.empty = self.failures, self.empty
        return new

    def query(self, expr: str) -> float | None:
        if self._client is None:
            self._fail(f"no prometheus.url configured for query {expr!r}")
            return None
        q = expr.replace("$instance", self.instance)
        try:
            result = self._within_deadline(q)
        except Exception as e:  # noqa: BLE001 - any failure is an unknown signal
            why = self._masked(f"{type(e).__name__}: {e}")
            if _out_of_reach(e):
                self._fail(why)
            else:  # Prometheus answered: it refuses this query, not every one
                self._reached()
                self._fail_query(q, why)
            return None
        self._reached()
        value = _value(result)
        with self._lock:
            if q in self._failing:
                self._failing.discard(q)
                log.info("PromQL query %r answers again", q)
            if value is None:
                self.empty += 1
                if q not in self._empty_exprs:
                    self._empty_exprs.add(q)
                    log.warning(
                        "PromQL query %r answered no number (%s); rules on it are unknown until "
                        "it does",
                        q,
                        _describe(result),
                    )
            elif q in self._empty_exprs:
                self._empty_exprs.discard(q)
                log.info("PromQL query %r answers a number again", q)
        return value

    def _within_deadline(self, q: str) -> Any:
        """custom_query's result, or TimeoutError once timeout_s has passed in all."""
        with self._lock:
            if self._late is not None and not self._late.is_set():
                raise TimeoutError(
                    f"an earlier query is still running past its {self.timeout_s:g}s deadline"
                )
            self._late = None
        client, params, done, out = self._client, self._params, threading.Event(), {}

        def run() -> None:
            try:
                out["result"] = client.custom_query(q, params=params, timeout=self.timeout_s)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name="kvguard-promql", daemon=True).start()
        if not done.wait(self.timeout_s):
            with self._lock:
                self._late = done
            raise TimeoutError(f"no complete answer within {self.timeout_s:g}s")
        if "error" in out:
            raise out["error"]
        return out["result"]

    def _masked(self, text: str) -> str:
        """A failure's text with the URL's secrets hidden: requests names the URL it could not
        reach (its query string and all), and a proxy may echo the token it refused."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _fail(self, why: str) -> None:
        """Prometheus out of reach (or none configured): every PromQL signal is unknown."""
        with self._lock:
            self.failures += 1
            if self._down:
                return
            self._down = True
        log.warning(
            "Prometheus query failing (%s); rules on PromQL signals are unknown until it recovers",
            why,
        )

    def _fail_query(self, q: str, why: str) -> None:
        """Prometheus answered this query with an error: the rules on it are unknown."""
        with self._lock:
            self.failures += 1
            if q in self._failing:
                return
            self._failing.add(q)
        log.warning(
            "PromQL query %r failing (%s); rules on it are unknown until it answers", q, why
        )

    def _reached(self) -> None:
        """Prometheus answered (a result, or an error of its own for one query)."""
        with self._lock:
            was_down, self._down = self._down, False
        if was_down:
            log.info("Prometheus at %s answers again", url_shown(self.url))


# query parameters whose values are hidden, as the audit database URL's are
SECRET_PARAM = re.compile(r"pass|pwd|secret|token|credential", re.IGNORECASE)


def url_shown(url: str | None) -> str | None:
    """The Prometheus URL as the log, the reload answer and the audit show it: the password of
    its user part (`user:***@host`, up to the last `@`) and the values of query parameters
    that name a secret (`?token=***`) hidden. Text only: a URL that does not parse is masked
    the same way."""
    if not url:
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.partition(':')[0]}:***@{host}"
    tail, hash_, fragment = tail.partition("#")
    path, q, query = tail.partition("?")
    if query:
        query = "&".join(
            f"{p.partition('=')[0]}=***" if SECRET_PARAM.search(p.partition("=")[0]) else p
            for p in query.split("&")
        )
    return f"{scheme}{sep}{netloc}{path}{q}{query}{hash_}{fragment}"


# query parameters that would override what kvguard asks of Prometheus, and what each would do
RESERVED_PARAMS = {
    "query": "would replace the PromQL expression of every query",
    "time": "would evaluate every query at that one instant instead of now",
}


def url_problem(url: str) -> str | None:
    """Why `url` cannot serve as `prometheus.url` (None: it can), for the config's
    `FILE:LINE: prometheus.url:` error. The text never holds the URL's secrets: it goes to the
    terminal, the reload answer and the log."""
    try:
        parts = urlsplit(url)
    except ValueError as e:  # an unclosed [IPv6 address
        return f"{url_shown(url)!r} is not a URL: {e} (expected e.g. http://127.0.0.1:9090)"
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return (
            f"{url_shown(url)!r} is not an http:// or https:// URL with a host "
            "(expected e.g. http://127.0.0.1:9090)"
        )
    if "#" in url:  # not url_shown: a token's tail after a `#` is not masked as a parameter
        return (
            "a '#' ends the URL, and nothing after it would reach Prometheus (expected no "
            "#fragment; write a '#' inside a parameter's value as %23)"
        )
    for name in parse_qs(parts.query, keep_blank_values=True):
        if name in RESERVED_PARAMS:
            return (
                f"the query parameter {name!r} {RESERVED_PARAMS[name]} (expected only the "
                "parameters a proxy in front of Prometheus needs, such as token=...)"
            )
    return None


def _api_base(url: str) -> tuple[str, dict[str, list[str]]]:
    """The URL the client puts `/api/v1/query` after (scheme, user, host and path, no trailing
    `/`), and the query parameters that go with every query. The client only appends: a query
    string left in the URL would come before the API path and break every query."""
    parts = urlsplit(url)
    base = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
    return base, parse_qs(parts.query, keep_blank_values=True)


def _secret_values(url: str) -> list[str]:
    """What a failure's text must not show of `url`: its password and the values of its
    secret-named parameters, as written, decoded and percent-encoded (requests sends them
    encoded), longest first so that no part of one is left once a shorter one is hidden."""
    parts = urlsplit(url)
    written = [parts.password or ""] + [
        p.partition("=")[2]
        for p in parts.query.split("&")
        if SECRET_PARAM.search(p.partition("=")[0])
    ]
    forms = {
        form
        for text in written
        for value in (text, unquote_plus(text))
        for form in (value, quote(value, safe=""), quote_plus(value, safe=""))
    }
    return sorted((f for f in forms if f), key=len, reverse=True)


# a secret-named parameter's value in a request line: `?token=abc` or `&token=abc`
_SECRET_IN_REQUEST = re.compile(
    rf"([?&][^=&\s]*(?:{SECRET_PARAM.pattern})[^=&\s]*=)[^&\s'\"]*", re.IGNORECASE
)


# urllib3's loggers that name a request's path and query string (a request, a retry, a redirect)
URLLIB3_URL_LOGGERS = ("urllib3.connectionpool", "urllib3.util.retry", "urllib3.poolmanager")


class _SecretParamsMasked(logging.Filter):
    """urllib3 names each request's path and query string (at DEBUG, and in its warnings on
    retries): a `?token=` among them would reach the log in clear."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        masked = _SECRET_IN_REQUEST.sub(r"\1***", text)
        if masked != text:
            record.msg, record.args = masked, ()
        return True


_REQUEST_LINES_MASKED = _SecretParamsMasked()


def _mask_request_lines() -> None:
    """Hide secret parameters in urllib3's request lines (once for the process). A logger's
    filter sees only its own records, not its children's: each logger gets it."""
    for name in URLLIB3_URL_LOGGERS:
        logger = logging.getLogger(name)
        if _REQUEST_LINES_MASKED not in logger.filters:
            logger.addFilter(_REQUEST_LINES_MASKED)


def _out_of_reach(e: BaseException) -> bool:
    """Whether a failed query says nothing of the query itself: no connection, no (whole)
    answer in time, an earlier query still running past its deadline, a proxy's or an
    unready Prometheus' 502, 503 or 504. What Prometheus answered with another error status
    (a query it cannot parse, 400, or run, 422) is the query's own."""
    import requests  # prometheus-api-client's transport, imported with it

    if isinstance(e, TimeoutError | requests.ConnectionError | requests.Timeout):
        return True
    status = re.match(r"HTTP Status Code (\d+)", str(e))  # PrometheusApiClientException's
    return status is not None and status.group(1) in ("502", "503", "504")


def _value(result: object) -> float | None:
    """A vector's maximum (or a scalar); None for an empty result, NaN, or no number at all
    (a string, a range vector)."""
    values: list[float] = []
    if isinstance(result, list):
        if len(result) == 2 and not isinstance(result[0], dict):  # scalar or string: [ts, "v"]
            values = [_number(result[1])]
        else:
            values = [
                _number(item["value"][1])
                for item in result
                if isinstance(item, dict)
                and isinstance(item.get("value"), list | tuple)
                and len(item["value"]) == 2
            ]
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else None


def _number(text: object) -> float:
    """Prometheus' sample value as a float; NaN for what is no number (a string result)."""
    try:
        return float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def _describe(result: object) -> str:
    """What an answer held, for the log line of a query that answered no number."""
    if result == []:
        return "an empty vector"
    return f"{str(result)[:120]}"


class SignalReader:
    """The evaluator's `read_signal`: local names from the snapshot, PromQL through Prometheus.

    Every local reading also notes the engine's preemption total (`clock`: monotonic time),
    so that `preemptions_1m` counts the whole window as soon as a reload adds a rule on it,
    wherever the running rules read another local signal."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        gpu_used_ratio: Callable[[], float | None],
        promql: PromQL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.snapshot = snapshot
        self.gpu_used_ratio = gpu_used_ratio
        self.promql = promql
        self.clock = clock
        self.preemptions = RecentRise(PREEMPTION_WINDOW_S)

    def __call__(self, name: str, signal: Signal) -> float | None:
        if signal.local is not None:
            snap = self.snapshot()
            recent = self.preemptions.rise(self.clock(), snap.num_preemptions)
            return local_value(signal.local, snap, self.gpu_used_ratio, recent)
        return self.promql.query(signal.promql or "")
