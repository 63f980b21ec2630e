"""kvguard_requests_started_total, the requests the shipped PreemptionStorm alert counts the
preemptions per, counted on a live daemon: every request the engine starts, each choice of `n`
one, whether it waited first or not, and with admission control off.

The alert divided by admission's `admit` decisions before: a request admission queued first
and started later stays `queue` (on a busy server most of them), and with
`admission_control.enable: false` no decision is counted at all, so a healthy daemon read
+Inf preemptions per request (alerts/tests/serving.yml has the rule's cases).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from openai.types import Completion
from prometheus_client.parser import text_string_to_metric_families

from tests.test_disconnect import LONG, count, send, state
from tests.test_server import Daemon, until


def samples(d: Daemon, family: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of one metric family on the daemon's /metrics: (name, labels) -> value."""
    text = httpx.get(d.url + "/metrics", timeout=10).text
    fams = [f for f in text_string_to_metric_families(text) if f.name == family]
    assert len(fams) == 1, f"{family} is not exported"
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fams[0].samples}


def total(d: Daemon, family: str, sample: str) -> float:
    return sum(v for (name, _), v in samples(d, family).items() if name == sample)


def test_every_started_request_is_counted_with_admission_control_off(tmp_path: Path) -> None:
    """A holder takes the batch's one slot; six requests, one of them with n=2, queue behind
    it, and start once its client hangs up. All eight start and are counted, each with its
    queue time, while admission counts no decision at all."""
    d = Daemon(
        tmp_path,
        serving="{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, max_num_seqs: 1}",
        extra="admission_control: {enable: false}\n",
    )
    try:
        before = samples(d, "kvguard_requests_started")
        assert {labels for (name, labels) in before if name.endswith("_total")} == {
            (("priority", p),) for p in ("high", "normal", "low")
        }, "each priority's series exported from 0 (a series born at 1 is no increase())"
        started = "kvguard_requests_started", "kvguard_requests_started_total"
        assert total(d, *started) == 0
        holder = send(d, {"prompt": "hold", "max_tokens": LONG})
        client = d.client()

        def ask(i: int) -> Completion:
            return client.completions.create(
                model="tiny", prompt=f"count me {i}", max_tokens=8, n=2 if i == 0 else 1
            )

        with ThreadPoolExecutor(6) as pool:
            try:
                until(lambda: total(d, *started) == 1, 60, "the holder started (its first token)")
                asked = [pool.submit(ask, i) for i in range(6)]
                until(lambda: count(state(d), "waiting") == 7, 60, "7 choices queued")
                assert total(d, *started) == 1  # none of them started yet
            finally:
                holder.close()  # it is aborted, and they start one by one
            answers = [f.result() for f in asked]
        assert sum(len(a.choices) for a in answers) == 7
        assert total(d, *started) == 8  # the holder and the 7 choices that waited for it
        assert total(d, "kvguard_admission_decisions", "kvguard_admission_decisions_total") == 0
        queue_time = "kvguard_request_queue_time_seconds"
        assert total(d, queue_time, queue_time + "_count") == 8
    finally:
        assert d.stop() == 0
