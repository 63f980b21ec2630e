"""The requests the API refuses before the engine can decide: a hard queue bound's 429 for the
requests piled up behind a stalled engine thread, and the 503 `engine_stalled`.

They were counted nowhere but kvguard_http_requests, so the reject-ratio recording rule
(kvguard:admission_reject:ratio_rate5m) and the dashboards showed a stalled or flooded daemon
rejecting nothing; and the 429's Retry-After was computed on the event loop by forgetting
stale finishes in the deque that the engine thread appends to and pops (finishes lost, every
Retry-After skewed). And an error answer's x-request-id, which a client quotes, is one the
daemon's log line about that error names. The daemon runs in process (its stall threshold set
by hand), served by uvicorn on loopback to the real `openai` client."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from kvguard.daemon import openai_api
from kvguard.daemon.config import load_config
from kvguard.daemon.service import Service
from kvguard.engine.admission_policy import AdmissionRejected
from kvguard.engine.config import AdmissionConfig
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.sampling_params import SamplingParams
from tests.test_admission_edges import PROMPT, make_engine
from tests.test_engine_stall import stall
from tests.test_grammar_prepare import serving
from tests.test_server import until

QUEUE = 4  # admission_control.max_queue, a hard limit (max_queue_wait 0s)
SEQS = 2  # serving.max_num_seqs: at most QUEUE + SEQS requests are taken in at once
SENT = 20


def _posting(engine: LLMEngine, posted: int) -> SimpleNamespace:
    """The parts of a Service the API-side 429 reads: the engine, `posted` sequences on their
    way into it, the API's reject counter."""
    return SimpleNamespace(
        engine=engine,
        loop=SimpleNamespace(posted=lambda high=False: posted),
        metrics=SimpleNamespace(api_rejects=collections.Counter()),
    )


def test_the_api_side_429_reads_the_finish_record_without_changing_it() -> None:
    """The event loop's 429 is admission's queue_full, its Retry-After when the queue would
    drain from the finishes of the last 10 s, and leaves the engine thread's record as it
    was: the stale finishes are the engine thread's to forget (the event loop popped them,
    racing the engine thread's own pops)."""
    adm = AdmissionConfig(max_queue=QUEUE, max_queue_wait_s=0.0)
    engine = make_engine(num_gpu_blocks=256, max_num_seqs=SEQS, admission=adm)
    ctl = engine.admission
    now = [0.0]
    ctl.clock = lambda: now[0]
    for at in (0.0, 0.0, 0.0, 8.0, 8.0, 8.0, 8.0):  # 3 finishes, then 4 more 8 s later
        now[0] = at
        ctl.release(0)
    now[0] = 12.0  # the first three are past the 10 s window now
    service = _posting(engine, QUEUE + SEQS)
    record = list(ctl._finished)
    with pytest.raises(openai_api.ApiError) as refused:
        openai_api._refuse_past_queue(service, 1, "normal")  # type: ignore[arg-type]
    assert (refused.value.status, refused.value.code) == (429, "admission_rejected")
    assert list(ctl._finished) == record  # nothing forgotten from the event loop
    # SEQS of those posted take the slots, QUEUE wait: at the 4 finishes of the last 10 s
    # (0.4/s) they start in 10 s, past the hard bound's 0 s
    assert str(refused.value) == "queue full (4 waiting, about 10s to drain)"
    assert refused.value.retry_after == pytest.approx(10.0)
    assert service.metrics.api_rejects == {"queue_full": 1}


def test_a_request_the_engine_s_full_queue_refuses_is_refused_as_it_is_posted() -> None:
    """The engine holds a full queue (one running, two waiting, a hard bound of two) and
    nothing is on its way in: the request posted now is refused at once with the 429 the
    engine gives it on taking it in, its message and Retry-After. The API's check counted
    only the requests posted and not yet taken in, so it was posted, and waited for an engine
    thread that may be stalled to refuse it."""
    adm = AdmissionConfig(max_queue=2, max_queue_wait_s=0.0)
    engine = make_engine(num_gpu_blocks=256, max_num_seqs=1, admission=adm)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for _ in range(3):
        engine.add_request(PROMPT, params)
    engine.step()  # one runs, two wait: published with the step's snapshot
    with pytest.raises(openai_api.ApiError) as refused:
        openai_api._refuse_past_queue(_posting(engine, 0), 1, "normal")  # type: ignore[arg-type]
    with pytest.raises(AdmissionRejected) as taken_in:
        engine.add_request(PROMPT, params)
    assert (refused.value.status, refused.value.code) == (429, "admission_rejected")
    assert str(refused.value) == taken_in.value.decision.reason == "queue full (2 waiting)"
    assert refused.value.retry_after == taken_in.value.decision.estimated_wait_s


@pytest.fixture
def service(tiny_dir: Path, tmp_path: Path) -> Iterator[Service]:
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"serving: {{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, max_num_seqs: {SEQS}}}\n"
        f"admission_control: {{max_queue: {QUEUE}, max_queue_wait: 0s}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    svc = Service(load_config(cfg_file), cfg_file)
    svc.load(progress=False)
    svc.stall_after_s = 3600.0  # stalled only when the test says so
    yield svc
    svc.close()


def rejects(url: str) -> dict[str, float]:
    """kvguard_admission_decisions_total's rejects on /metrics, by reason ("": the engine's)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    pattern = r'^kvguard_admission_decisions_total\{decision="reject"(?:,reason="(\w+)")?\} (\S+)$'
    return {reason: float(n) for reason, n in re.findall(pattern, text, re.M)}


def complete(url: str, n: int = 1) -> tuple[int, str | None]:
    """One completion by the `openai` client, not retried: (status, error code)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        client.completions.create(model="tiny", prompt="hi", max_tokens=3, n=n)
    except openai.APIStatusError as e:
        return e.status_code, e.body.get("code") if isinstance(e.body, dict) else None
    return 200, None


def test_refusals_before_the_engine_decides_count_as_admission_rejects(service: Service) -> None:
    """20 requests into a stalled engine with room for 6: the 14 refused at once (429) are
    admission's rejects with reason `queue_full`; past the stall threshold a request of n=2
    gets 503 `engine_stalled`, 2 rejects with that reason (each choice counts, as the engine
    counts its own). The engine's own series, without a reason, stays as it was."""
    release = stall(service)
    pool = concurrent.futures.ThreadPoolExecutor(SENT)
    try:
        with serving(service) as url:
            assert rejects(url) == {"": 0, "queue_full": 0, "engine_stalled": 0}
            futures = [pool.submit(complete, url) for _ in range(SENT)]
            done = lambda: [f.result() for f in futures if f.done()]  # noqa: E731
            until(lambda: len(done()) + service.loop.in_flight() == SENT, 120, "all answered")
            assert done() == [(429, "admission_rejected")] * (SENT - QUEUE - SEQS)
            assert rejects(url) == {"": 0, "queue_full": SENT - QUEUE - SEQS, "engine_stalled": 0}
            service.stall_after_s = 0.0  # the loop has not beaten since the stall began
            assert complete(url, n=2) == (503, "engine_stalled")
            service.stall_after_s = 3600.0
            after = {"": 0, "queue_full": SENT - QUEUE - SEQS, "engine_stalled": 2}
            assert rejects(url) == after
            release.set()
            answers = [f.result(timeout=120) for f in futures]
            assert answers.count((200, None)) == QUEUE + SEQS, answers
            assert rejects(url) == after  # the 6 taken in were the engine's to decide: admitted
    finally:
        release.set()
        pool.shutdown()


def test_an_engine_error_s_request_id_is_the_one_its_log_line_names(
    service: Service, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed step's 500 (`engine_error`): its x-request-id is the completion id under which
    the engine's error line (with the traceback) names the request's choices; it was a fresh
    `req-...` that no log line named."""

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("poisoned step")

    monkeypatch.setattr(service.engine.model, "compute_logits", poisoned)
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
    with caplog.at_level(logging.ERROR, logger="kvguard.engine"), serving(service) as url:
        failed = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
    request_id = failed.headers["x-request-id"]
    [line] = [r.getMessage() for r in caplog.records if "with an error: " in r.getMessage()]
    assert line.endswith(f"ends with an error: {request_id}-0"), (request_id, line)
