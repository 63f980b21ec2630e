"""Where rules read pressure: the engine snapshot and NVML (local), or a PromQL query.

A value that cannot be read is None — the evaluator treats it as unknown and never acts on it.
PromQL failures are counted and logged once per outage (not once per tick).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from kvguard.engine.host_memory import host_memory_used_ratio
from kvguard.engine.snapshot import EngineSnapshot
from kvguard.rules.schema import Signal

log = logging.getLogger("kvguard.rules.signals")


def local_value(
    name: str, snap: EngineSnapshot, gpu_used_ratio: Callable[[], float | None]
) -> float | None:
    table: dict[str, Callable[[], float | None]] = {
        "kv_cache_usage_ratio": lambda: snap.kv_cache_usage_ratio,
        "host_kv_cache_usage_ratio": lambda: (
            snap.host.usage_ratio if snap.host.blocks_total else None
        ),
        "num_waiting": lambda: float(snap.num_waiting),
        "num_running": lambda: float(snap.num_running),
        "num_swapped": lambda: float(snap.num_swapped),
        "preemptions_total": lambda: float(snap.num_preemptions),
        "gpu_memory_used_ratio": gpu_used_ratio,
        "host_memory_used_ratio": host_memory_used_ratio,
    }
    return table[name]()


class PromQL:
    """Scalar or max-over-vector PromQL reads through prometheus-api-client, with a timeout."""

    def __init__(self, url: str | None, timeout_s: float, instance: str) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.instance = instance
        self.failures = 0
        self._down = False
        self._client = None
        if url:
            from prometheus_api_client import PrometheusConnect
            from urllib3.util.retry import Retry

            # No retries: a down Prometheus must answer "unknown" within the timeout, not
            # after a backoff loop that outlives the evaluation interval.
            self._client = PrometheusConnect(
                url=url,
                disable_ssl=True,
                timeout=timeout_s,
                retry=Retry(total=0, connect=0, read=0),
            )

    def query(self, expr: str) -> float | None:
        if self._client is None:
            self._fail(f"no prometheus.url configured for query {expr!r}")
            return None
        q = expr.replace("$instance", self.instance)
        try:
            result = self._client.custom_query(q, timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure is an unknown signal
            self._fail(f"{type(e).__name__}: {e}")
            return None
        if self._down:
            log.info("Prometheus at %s answers again", self.url)
            self._down = False
        return _value(result)

    def _fail(self, why: str) -> None:
        self.failures += 1
        if not self._down:
            log.warning(
                "Prometheus query failing (%s); rules on PromQL signals are unknown until it recovers",
                why,
            )
            self._down = True


def _value(result: object) -> float | None:
    """A vector's maximum (or a scalar); None for an empty result or NaN."""
    values: list[float] = []
    if isinstance(result, list):
        if len(result) == 2 and not isinstance(result[0], dict):  # scalar: [ts, "v"]
            values = [float(result[1])]
        else:
            values = [float(item["value"][1]) for item in result if "value" in item]
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else None


class SignalReader:
    """The evaluator's `read_signal`: local names from the snapshot, PromQL through Prometheus."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        gpu_used_ratio: Callable[[], float | None],
        promql: PromQL,
    ) -> None:
        self.snapshot = snapshot
        self.gpu_used_ratio = gpu_used_ratio
        self.promql = promql

    def __call__(self, name: str, signal: Signal) -> float | None:
        if signal.local is not None:
            return local_value(signal.local, self.snapshot(), self.gpu_used_ratio)
        return self.promql.query(signal.promql or "")
