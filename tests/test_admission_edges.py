"""Admission at its edges: max_tokens past what the model can produce, prompts that fit only
the configured pool while a remedy holds it smaller, answers shortened to what fits, high
priority behind a full queue of normal work, a reload lowering max_overcommit, and the queue
bound counting requests that wait for a batch slot."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvguard.engine.admission import AdmissionConfig, AdmissionController
from kvguard.engine.admission_policy import AdmissionRejected
from kvguard.engine.config import EngineConfig
from kvguard.engine.llm_engine import LLMEngine, NewRequest
from kvguard.engine.sampling_params import SamplingParams
from tests.test_disconnect import idle, state
from tests.test_remedies import run_all
from tests.test_server import Daemon, until

BLOCK = 16


def make_engine(**kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", "32MiB")
    kw.setdefault("num_threads", 2)
    kw.setdefault("max_model_len", 128)
    return LLMEngine.from_config(EngineConfig(model="tiny", **kw), progress=False)


PROMPT = list(range(3, 3 + 8))  # 8 tokens: 120 more reach max_model_len 128


# -- F1: max_tokens past the length limit ---------------------------------------------------------
@pytest.mark.parametrize("estimate", ["worst_case", "predicted"])
def test_max_tokens_past_the_length_limit_is_planned_as_what_the_model_can_produce(
    estimate: str,
) -> None:
    """max_tokens 100000 on max_model_len 128 ends at 120 tokens, as max_tokens 120 does: four
    such requests start together (10 projected blocks each of 48), not one at a time, and
    the estimator learns they ran to their whole limit (ratio 1), not to 120/100000."""
    adm = AdmissionConfig(estimate=estimate)
    engine = make_engine(num_gpu_blocks=48, max_num_seqs=8, admission=adm)
    params = SamplingParams(max_tokens=100000, ignore_eos=True)
    rids = [engine.add_request(PROMPT, params) for _ in range(4)]
    seqs = [engine._seqs[r] for r in rids]
    assert all(engine.admission_policy.is_admitted(s) for s in seqs), "all four fit at once"
    for s in seqs:
        d = engine.admission_policy.decision(s)
        assert d.decision == "admit" and d.max_tokens == 120 and not d.truncated
        assert d.predicted_tokens == 120
    done = run_all(engine)
    assert all(done[r].num_output_tokens == 120 for r in rids)
    assert all(done[r].finish_reason == "length" and not done[r].truncated for r in rids)
    est = engine.admission.estimator
    assert est.ratios() == {"le128": 1.0}
    assert est.error()["mean"] == 0.0


def test_max_tokens_past_the_length_limit_is_served_without_the_dynamic_ladder() -> None:
    """With dynamic_max_tokens off, a max_tokens the length limit cuts anyway is no reason
    to refuse the request as one that can never fit."""
    adm = AdmissionConfig(dynamic_max_tokens=False)
    engine = make_engine(num_gpu_blocks=48, admission=adm)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=100000, ignore_eos=True))
    out = run_all(engine)[rid]
    assert out.num_output_tokens == 120 and out.finish_reason == "length"


# -- F2: never fits, judged on what is known, against the configured pool ---------------------
def test_the_known_prompt_is_judged_to_the_token_not_with_the_safety_factor() -> None:
    """A 150-token prompt (and its first token) fills 10 blocks of a 10-block budget exactly:
    servable, though 151 × 1.15 tokens would not fit."""
    ctl = AdmissionController(
        AdmissionConfig(estimate="worst_case", high_priority_reserve=0.0), BLOCK, 1000
    )
    d = ctl.decide(150, 1, 1, 10, 0.0, 0, 4096)
    assert d.decision != "reject", d.reason
    d = ctl.decide(160, 1, 1, 10, 0.0, 0, 4096)  # 161 tokens: 11 blocks, truly too many
    assert d.decision == "reject" and d.kind == "never_fits"


def test_a_pool_held_smaller_queues_what_only_the_configured_pool_holds() -> None:
    """While a remedy holds the pool at 32 blocks (28 for normal priority), a 450-token
    prompt (29 blocks) waits rather than being refused as one that never fits, and an answer
    the configured pool holds is not cut for the smaller one."""
    ctl = AdmissionController(AdmissionConfig(estimate="worst_case"), BLOCK, 1000)
    d = ctl.decide(450, 16, 1, 32, 0.0, 0, 512, configured_blocks=921)
    assert d.decision == "queue" and d.max_tokens == 16, d
    assert "held at 32 blocks" in d.reason
    d = ctl.decide(300, 200, 1, 32, 0.0, 0, 512, configured_blocks=921)
    assert d.decision == "queue" and d.max_tokens == 200 and not d.truncated
    # against the configured pool itself, the 450-token prompt is past it for good
    d = ctl.decide(450, 16, 1, 32, 0.0, 0, 512, configured_blocks=32)
    assert d.decision == "reject" and d.kind == "never_fits"
    assert "can never fit the KV budget of 28 blocks" in d.reason


@pytest.mark.parametrize(("estimate", "fits"), [("worst_case", 128), ("predicted", 148)])
def test_an_answer_is_shortened_to_the_longest_that_fits_not_halved(
    estimate: str, fits: int
) -> None:
    """300 prompt tokens and max_tokens 200 on a 28-block budget (448 tokens), the margin on the
    answer only: 300 + 128 × 1.15 tokens fit in worst case, and 300 + 148 under predicted
    admission, whose margin never passes the answer's max_tokens (halving gave 50)."""
    ctl = AdmissionController(AdmissionConfig(estimate=estimate), BLOCK, 1000)
    d = ctl.decide(300, 200, 1, 32, 0.0, 0, 512)
    assert d.max_tokens == fits and d.truncated
    assert ctl.projected_blocks(300, fits) == 28 < ctl.projected_blocks(300, fits + 1)


# -- the margin is on the answer, never on the prompt ----------------------------------------------
def prompt_of(n: int) -> list[int]:
    return [3 + i % 300 for i in range(n)]


def small_pool(estimate: str) -> LLMEngine:
    """11 blocks of 16 tokens: 176 tokens for a high request (9 blocks below high)."""
    adm = AdmissionConfig(estimate=estimate, reserved_headroom_bytes=0)
    engine = make_engine(num_gpu_blocks=11, max_model_len=512, admission=adm)
    assert engine.block_manager.num_blocks == 11 and engine.config.block_size == BLOCK
    return engine


@pytest.mark.parametrize("estimate", ["worst_case", "predicted"])
def test_a_request_that_fits_an_idle_pool_keeps_its_max_tokens(estimate: str) -> None:
    """150 prompt tokens and max_tokens 16 on an idle 11-block pool, high priority: 166 tokens
    fit 176 (150 + 16 × 1.15 too), so the request gets its 16 tokens; the safety factor on
    the prompt as well cut it to 3 (and every prompt of 153-175 tokens to 1)."""
    engine = small_pool(estimate)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    rid = engine.add_request(prompt_of(150), params, priority="high")
    d = engine.admission_policy.decision(engine._seqs[rid])
    assert d.decision == "admit" and d.max_tokens == 16 and not d.truncated, d
    out = run_all(engine)[rid]
    assert out.num_output_tokens == 16 and out.finish_reason == "length" and not out.truncated
    assert engine.admission.committed_blocks == 0


@pytest.mark.parametrize(("estimate", "fits"), [("worst_case", 12), ("predicted", 14)])
def test_an_answer_that_cannot_fit_whole_is_still_shortened(estimate: str, fits: int) -> None:
    """A normal request may use 9 of the 11 blocks (144 tokens): 130 prompt tokens leave 14,
    which predicted admission gives (its margin never passes max_tokens), worst case the 12
    whose 1.15 margin still fits; admitted at once and served to that length, truncated (the
    margin on the prompt too cut it to 1)."""
    engine = small_pool(estimate)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    rid = engine.add_request(prompt_of(130), params, priority="normal")
    d = engine.admission_policy.decision(engine._seqs[rid])
    assert d.decision == "admit" and d.max_tokens == fits and d.truncated, d
    out = run_all(engine)[rid]
    assert out.num_output_tokens == fits and out.finish_reason == "length" and out.truncated
    assert engine.admission.committed_blocks == 0


@pytest.mark.parametrize("estimate", ["worst_case", "predicted"])
def test_a_prompt_past_its_prioritys_share_is_refused_as_a_prompt(estimate: str) -> None:
    """A normal 150-token prompt (10 blocks) fits the pool but not the 9 blocks outside the
    high-priority reserve: refused as a prompt that never fits, saying high priority would
    hold it; the same prompt at high priority is served."""
    engine = small_pool(estimate)
    with pytest.raises(AdmissionRejected) as e:
        engine.add_request(prompt_of(150), SamplingParams(max_tokens=4), priority="normal")
    d = e.value.decision
    assert d.kind == "never_fits" and d.about == "prompt", d
    assert "9 blocks that normal priority may use" in d.reason
    assert "high priority may use 11 blocks, which hold it" in d.reason
    rid = engine.add_request(prompt_of(150), SamplingParams(max_tokens=4), priority="high")
    assert run_all(engine)[rid].num_output_tokens >= 1


@pytest.mark.parametrize("estimate", ["worst_case", "predicted"])
def test_a_halt_refuses_what_can_never_fit_as_never_fits_not_as_retry_later(estimate: str) -> None:
    """While admission is halted for all but high, a normal request that no pool could ever
    serve is refused as it is with admission open (never_fits: a 400), not as halted (a
    retryable 503 that would send it back only to get the 400 later): its prompt past
    normal's 9 blocks, or, without the ladder, its answer. One that could fit is halted."""
    adm = AdmissionConfig(estimate=estimate, reserved_headroom_bytes=0, dynamic_max_tokens=False)
    engine = make_engine(num_gpu_blocks=11, max_model_len=512, admission=adm)
    fut = engine.halt_admission("high")
    engine.step()
    assert fut.result(0).ok
    for prompt, max_tokens, about in ((150, 4, "prompt"), (100, 70, "max_tokens")):
        with pytest.raises(AdmissionRejected) as e:
            engine.add_request(prompt_of(prompt), SamplingParams(max_tokens=max_tokens))
        d = e.value.decision
        assert (d.kind, d.about, d.estimated_wait_s) == ("never_fits", about, 0.0), d
    with pytest.raises(AdmissionRejected) as e:
        engine.add_request(prompt_of(8), SamplingParams(max_tokens=4))
    assert e.value.decision.kind == "halted", e.value.decision
    assert engine.admission.decisions["reject"] == 3


@pytest.fixture(scope="module")
def halted_small_pool_daemon(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a Daemon
    """8 blocks of 16 tokens (normal priority may use 7: 112 tokens), admission halted for
    all but high."""
    d = Daemon(
        tmp_path_factory.mktemp("halted_small_pool"),
        extra="admission_control: {enable: true}\n",
        serving="{model: tiny, num_gpu_blocks: 8, max_model_len: 160}",
    )
    r = d.admin("POST", "/admin/actions/halt_admission", json={"allow_priority": "high"})
    assert r.status_code == 200, r.text
    yield d
    assert d.stop() == 0


def test_a_halted_daemon_answers_400_for_a_prompt_that_can_never_fit(
    halted_small_pool_daemon: Daemon,
) -> None:
    """Over HTTP with the openai client (no retries): during the halt a 120-token prompt past
    normal's share gets 400 context_length_exceeded saying high would hold it, as it does
    with admission open, not 503 "admission is halted" with a Retry-After; a short prompt
    gets the 503."""
    client = halted_small_pool_daemon.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt_of(120), max_tokens=4)
    body = e.value.body
    assert (body["code"], body["param"]) == ("context_length_exceeded", "prompt"), body
    assert "prompt of 120 tokens can never fit the KV budget of 7 blocks" in body["message"]
    assert "high priority may use 8 blocks, which hold it" in body["message"]
    assert "retry-after" not in e.value.response.headers
    with pytest.raises(openai.BadRequestError) as e:  # in a list, named by its index
        client.completions.create(model="tiny", prompt=[prompt_of(120), [5]], max_tokens=4)
    assert e.value.body["param"] == "prompt[0]", e.value.body
    assert e.value.body["message"].startswith("prompt[0] of 120 tokens can never fit")
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny", prompt=prompt_of(8), max_tokens=4)
    assert e.value.status_code == 503 and "admission is halted" in e.value.message


@pytest.mark.parametrize("served_before", [True, False])
def test_a_prompt_for_the_configured_pool_is_served_while_a_remedy_holds_it_smaller(
    served_before: bool,
) -> None:
    """The engine end to end: its configured pool of 64 blocks shrunk to one max_model_len
    request (8 blocks, 7 for normal priority), after serving or before its first request: a
    115-token prompt (8 blocks) is admitted and served, alone."""
    engine = make_engine(num_gpu_blocks=64, admission=AdmissionConfig())
    if served_before:
        engine.add_request(PROMPT, SamplingParams(max_tokens=4))
        run_all(engine)
    fut = engine.set_kv_pool_share(0.01)
    engine.step()
    assert fut.result(0).ok and engine.block_manager.num_blocks == 8
    rid = engine.add_request(list(range(3, 3 + 115)), SamplingParams(max_tokens=8, ignore_eos=True))
    out = run_all(engine)[rid]
    assert out.num_output_tokens == 8 and out.finish_reason == "length"


# -- F4: a high request and the queue bound ------------------------------------------------------
@pytest.mark.parametrize("estimate", ["worst_case", "predicted"])
def test_a_high_request_is_not_refused_for_queued_normal_work(estimate: str) -> None:
    """Normal requests fill the normal budget and max_queue 2 more wait: the next normal
    request is refused, a high one (which goes ahead of them) is not."""
    adm = AdmissionConfig(estimate=estimate, max_queue=2, max_queue_wait_s=0.0)
    engine = make_engine(num_gpu_blocks=32, max_num_seqs=8, admission=adm)
    normal = SamplingParams(max_tokens=100, ignore_eos=True)
    with pytest.raises(AdmissionRejected) as e:
        for _ in range(20):
            engine.add_request(PROMPT, normal)
    assert e.value.decision.kind == "queue_full"
    queued = [s for s in engine.scheduler.waiting if not engine.admission_policy.is_admitted(s)]
    assert len(queued) == 2
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=8), priority="high")
    d = engine.admission_policy.decision(engine._seqs[rid])
    assert d.decision in ("admit", "queue") and d.queue_position <= 1


# -- F5: a reload lowering max_overcommit --------------------------------------------------------
def test_a_reload_lowering_max_overcommit_bounds_the_overcommit_at_once() -> None:
    engine = make_engine(num_gpu_blocks=48, admission=AdmissionConfig())
    ctl = engine.admission
    ctl.overcommit = 1.4  # grown over calm steps
    fut = engine.reconfigure({("admission", "max_overcommit"): 1.1})
    engine.step()  # applied at the step boundary; nothing is scheduled, so no on_step
    assert fut.result(0).ok
    assert ctl.config.max_overcommit == 1.1 and ctl.overcommit == 1.1
    fut = engine.reconfigure({("admission", "max_overcommit"): 1.5})  # raising it takes nothing
    engine.step()
    assert fut.result(0).ok and ctl.overcommit == 1.1


# -- F7: a client that hangs up during a long prompt's chunked prefill ---------------------------
def test_a_key_pays_for_the_prompt_tokens_a_request_got_through_before_it_was_aborted() -> None:
    """A 96-token prompt in chunks of 16, aborted (its client hung up) after two steps: its
    final output says 32 prompt tokens were done, and the API key is charged those (it was
    charged nothing without a generated token); a prompt is paid once, as far as any of its
    choices got, and a finished choice pays the whole prompt."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter

    from kvguard.daemon.openai_api import _Ctx

    engine = make_engine(num_gpu_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    rid = engine.add_request(list(range(3, 3 + 96)), params)
    engine.step(), engine.step()
    assert engine.abort(rid)
    aborted = next(o for o in engine.step() if o.request_id == rid)
    assert aborted.finished and aborted.num_output_tokens == 0
    assert aborted.num_prompt_tokens_done == 32
    done = run_all(engine)  # nothing left; a second request of the same prompt finishes
    other = engine.add_request(list(range(3, 3 + 96)), params)
    finished = run_all(engine)[other]
    assert not done and finished.num_output_tokens == 4

    counter = Counter("t", "t", ["key", "kind"], registry=CollectorRegistry())
    service = SimpleNamespace(metrics=SimpleNamespace(api_tokens=counter))
    ctx = _Ctx(service, "text_completion", "tiny", "normal", 0.0, params)
    ctx.key, ctx.n = "k", 2  # two choices of one prompt

    def paid(kind: str) -> float:
        return counter.labels("k", kind)._value.get()

    ctx.charge(0, aborted)
    assert (paid("prompt"), paid("completion")) == (32, 0)
    ctx.charge(1, finished)  # the other choice finished: the rest of the prompt, once
    assert (paid("prompt"), paid("completion")) == (96, 4)
    ctx.charge(1, aborted)
    assert paid("prompt") == 96


# -- C1: the queue bound counts requests waiting for a batch slot --------------------------------
def _arrive(engine: LLMEngine, n: int) -> list[str]:
    """Add `n` requests of 8 tokens each with no step between them (they arrive at once):
    each one's decision, `reject` for a refusal, which must be for a full queue."""
    got = []
    for _ in range(n):
        try:
            rid = engine.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
        except AdmissionRejected as e:
            assert e.decision.kind == "queue_full", e.decision.reason
            assert e.decision.reason.startswith("queue full (2 waiting"), e.decision.reason
            got.append("reject")
        else:
            got.append(engine.admission_policy.decision(engine._seqs[rid]).decision)
    return got


@pytest.mark.parametrize("estimate", ["worst_case", "predicted"])
def test_max_queue_counts_the_requests_waiting_for_a_batch_slot(estimate: str) -> None:
    """The pool holds all ten requests, but max_num_seqs 1 runs one at a time: the first is
    admitted, two wait (max_queue 2, a hard limit with max_queue_wait 0) and seven are
    refused. The queue used to count only requests waiting for KV: all ten were admitted and
    nine waited for the slot, however many max_queue allowed."""
    adm = AdmissionConfig(estimate=estimate, max_queue=2, max_queue_wait_s=0.0)
    engine = make_engine(num_gpu_blocks=256, max_num_seqs=1, admission=adm)
    assert _arrive(engine, 10) == ["admit", "queue", "queue"] + ["reject"] * 7
    assert engine.admission.decisions == {"admit": 1, "queue": 2, "reject": 7}
    waiting = [engine.admission_policy.decision(s) for s in engine.scheduler.waiting[1:]]
    assert [(d.reason, d.queue_position) for d in waiting] == [
        ("waiting for a batch slot", 1),
        ("waiting for a batch slot", 2),
    ]
    engine.step()  # the first runs, two wait for its slot: a third is refused
    assert (len(engine.scheduler.running), len(engine.scheduler.waiting)) == (1, 2)
    assert _arrive(engine, 1) == ["reject"]
    done = run_all(engine)  # the queued ones start as the slot frees, and finish whole
    assert len(done) == 3 and all(o.num_output_tokens == 8 for o in done.values())


def test_a_burst_within_the_free_slots_is_admitted_and_the_next_one_queues() -> None:
    """Requests that arrive together start together while slots are free (admitted, not
    queued): only the one past max_num_seqs waits for a slot, which max_queue 0 refuses."""
    adm = AdmissionConfig(max_queue=0, max_queue_wait_s=0.0)
    engine = make_engine(num_gpu_blocks=256, max_num_seqs=4, admission=adm)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    rids = [engine.add_request(PROMPT, params) for _ in range(4)]
    assert {engine.admission_policy.decision(engine._seqs[r]).decision for r in rids} == {"admit"}
    with pytest.raises(AdmissionRejected) as e:
        engine.add_request(PROMPT, params)
    assert e.value.decision.kind == "queue_full"
    engine.step()
    assert len(engine.scheduler.running) == 4


@pytest.fixture(scope="module")
def one_slot_daemon(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a Daemon
    """One batch slot and a queue of at most two (a hard limit); KV holds far more."""
    d = Daemon(
        tmp_path_factory.mktemp("one_slot"),
        extra="admission_control: {enable: true, max_queue: 2, max_queue_wait: 0s}\n",
        serving="{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, max_num_seqs: 1}",
    )
    yield d
    assert d.stop() == 0


def _decisions(d: Daemon) -> dict[str, float]:
    """Admission's decisions by kind, the engine's and the API's refusals (`reason`) summed."""
    text = d.admin("GET", "/metrics").text
    pattern = r'^kvguard_admission_decisions_total\{decision="(\w+)"(?:,reason="\w+")?\} (\S+)$'
    out: dict[str, float] = {}
    for k, v in re.findall(pattern, text, re.M):
        out[k] = out.get(k, 0.0) + float(v)
    return out


def test_ten_requests_at_once_on_one_slot_queue_two_and_get_seven_429s(
    one_slot_daemon: Daemon,
) -> None:
    """Ten requests sent while the engine is stalled: the three the hard queue bound takes in
    (one slot, two waiting) are posted, the seven past it answer 429 with a Retry-After at
    once, before the engine takes any (they used to be admitted, nine waiting for the slot
    however long; then, all ten posted, refused only once the engine took them in). The
    metrics count them as `admit`, `queue` and `reject`."""
    d = one_slot_daemon
    before = _decisions(d)
    client = d.client()
    with ThreadPoolExecutor(10) as pool:
        assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
        try:
            futures = [
                pool.submit(
                    client.completions.create,
                    model="tiny",
                    prompt=f"request {i}",
                    max_tokens=4,
                    extra_body={"ignore_eos": True},
                )
                for i in range(10)
            ]
            refused_at_once = lambda: sum(f.done() for f in futures)  # noqa: E731
            until(lambda: refused_at_once() == 7, 30, "seven requests refused at once")
            assert state(d)["in_flight"] == 3
        finally:
            d.admin("POST", "/admin/debug/release")
        served, refused = [], []
        for f in futures:
            try:
                served.append(f.result(120))
            except openai.APIStatusError as e:
                refused.append(e)
    assert [r.usage.completion_tokens for r in served] == [4, 4, 4]
    assert [e.status_code for e in refused] == [429] * 7
    # admission's own refusal, as the engine gives it: one runs, two wait ahead of each
    assert all(e.message.endswith("queue full (2 waiting)") for e in refused), refused[0]
    assert all(float(e.response.headers["retry-after"]) > 0 for e in refused)

    def counted() -> dict[str, float]:  # the metrics are rebuilt from a snapshot each second
        return {k: v - before.get(k, 0.0) for k, v in _decisions(d).items()}

    until(lambda: counted() == {"admit": 1, "queue": 2, "reject": 7}, 10, "the decisions counted")


# -- a request's choices are taken in or refused as one ------------------------------------------
def _sample(d: Daemon, name: str) -> float:
    """A sample of /metrics by its name and labels as written there (0: not there yet)."""
    text = d.admin("GET", "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_refused_request_of_eight_choices_is_one_admission_event_naming_eight() -> None:
    """Four slots and a queue of four (a hard limit) hold eight sequences; one request holds a
    slot, so an n=8 request behind it finds the queue full at its eighth choice and is
    refused whole. Its refusal is one `admission` event with `sequences: 8`: it used to be
    eight events, one per choice, so a client looping on n=128 refusals filled the event ring
    (and pushed out what else it holds) with 128 copies of each. The decision counter still
    counts each choice a `reject`."""
    adm = AdmissionConfig(max_queue=4, max_queue_wait_s=0.0)
    engine = make_engine(num_gpu_blocks=256, max_num_seqs=4, admission=adm)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request(PROMPT, params)
    choices = [NewRequest(PROMPT, params, count_prompt=i == 0) for i in range(8)]
    with pytest.raises(AdmissionRejected) as e:
        engine.add_requests(choices)
    assert e.value.decision.kind == "queue_full", e.value.decision.reason
    events = [ev.data for ev in engine.events.recent("admission")]
    assert [(d["decision"], d.get("sequences")) for d in events] == [("admit", 1), ("reject", 8)]
    assert events[-1]["reason"] == e.value.decision.reason
    assert events[-1]["priority"] == events[0]["priority"]  # both normal
    assert engine.admission.decisions == {"admit": 1, "queue": 0, "reject": 8}


LENGTH = 'kvguard_requests_finished_total{finish_reason="length",priority="normal"}'
ABORT = 'kvguard_requests_finished_total{finish_reason="abort",priority="normal"}'
WAITS = 'kvguard_request_queue_time_seconds_count{priority="normal"}'
PROMPT_TOKENS = "kvguard_prompt_tokens_total"


def test_a_request_whose_last_choice_finds_the_queue_full_is_refused_whole(
    one_slot_daemon: Daemon,
) -> None:
    """One request takes the slot; an n=3 request behind it finds room in the queue (max_queue
    2) for two of its choices, not the third. It used to be taken in choice by choice: two
    queued, the third refused, the two aborted, so a request answered 429 counted two `queue`
    decisions, two `abort` finishes (clients that gave up), two queue waits and its prompt's
    tokens as work done, and its 429 said "queue full (2 waiting)" of an empty queue: its
    own choices. Now none of it is taken in: refused at once behind the request posted ahead
    of it (the engine is stalled), its three choices count `reject`, nothing else moves, and
    the 429 counts only what is ahead of it and names its size."""
    d = one_slot_daemon
    until(lambda: idle(state(d)), 30, "the engine idle")
    client = d.client()
    names = (LENGTH, ABORT, WAITS, PROMPT_TOKENS)
    before, decided = {n: _sample(d, n) for n in names}, _decisions(d)
    ask = {"model": "tiny", "max_tokens": 4, "extra_body": {"ignore_eos": True}}
    with ThreadPoolExecutor(2) as pool:
        assert d.admin("POST", "/admin/debug/stall", json={"seconds": 60}).status_code == 200
        try:  # both reach the engine in one drain, the first ahead
            first = pool.submit(client.completions.create, prompt="the first", **ask)
            until(lambda: state(d)["in_flight"] == 1, 30, "the first request posted")
            second = pool.submit(client.completions.create, prompt="the second", n=3, **ask)
            until(second.done, 30, "the n=3 request refused at once")
            assert state(d)["in_flight"] == 1
        finally:
            d.admin("POST", "/admin/debug/release")
        served = first.result(120)
        with pytest.raises(openai.RateLimitError) as e:
            second.result(120)
    until(lambda: _sample(d, LENGTH) == before[LENGTH] + 1, 30, "the first request counted")
    moved = {n: _sample(d, n) - before[n] for n in names}
    assert moved == {
        LENGTH: 1,
        ABORT: 0,
        WAITS: 1,  # the first request's wait only
        PROMPT_TOKENS: served.usage.prompt_tokens,
    }
    counted = {k: v - decided.get(k, 0.0) for k, v in _decisions(d).items()}
    assert counted == {"admit": 1, "queue": 0, "reject": 3}
    message = e.value.message
    # the first request takes the slot: none of the queue is ahead of this one's three
    assert message.endswith(
        "queue full (0 waiting ahead of this request): its 3 sequences (choices or prompts) "
        "do not all fit in the queue beside them (max_queue 2); retry later, or ask for fewer"
    ), message
    assert float(e.value.response.headers["retry-after"]) > 0


def test_more_choices_than_a_hard_queue_bound_ever_takes_in_are_a_400_naming_n(
    one_slot_daemon: Daemon,
) -> None:
    """max_num_seqs 1 and max_queue 2 under max_queue_wait 0s take in at most three sequences
    at once, on an idle engine too: n=4 (or four prompts) can never be served. It used to
    answer 429 with a Retry-After, for a client to retry for ever; now a 400 naming `n` (or
    `prompt`) and the most it may ask for. n=3 is served whole."""
    d = one_slot_daemon
    until(lambda: idle(state(d)), 30, "the engine idle")
    client = d.client()
    decided = _decisions(d)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, n=4)
    body = e.value.body
    assert (body["code"], body["param"]) == ("admission_rejected", "n"), body
    assert body["message"].startswith("4 sequences (choices or prompts) can never all be taken")
    assert body["message"].endswith("ask for at most 3"), body["message"]
    assert "retry-after" not in e.value.response.headers
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=["a", "b", "c", "d"], max_tokens=2)
    assert e.value.body["param"] == "prompt", e.value.body
    served = client.completions.create(model="tiny", prompt="x", max_tokens=2, n=3)
    assert len(served.choices) == 3

    def counted() -> dict[str, float]:
        return {k: v - decided.get(k, 0.0) for k, v in _decisions(d).items()}

    want = {"admit": 1, "queue": 2, "reject": 8}
    until(lambda: counted() == want, 10, "the decisions counted")
