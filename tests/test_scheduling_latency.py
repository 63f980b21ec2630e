"""A loaded engine stays responsive (issue 17): prompt tokens beside decodes are bounded, a high
request's prompt runs alone with the decodes, low requests are delayed behind a normal burst by
a bounded amount instead of starved, and predicted admission's margin covers the output still
to come, not the tokens already held."""

from __future__ import annotations

import functools

import pytest

from kvguard.engine.admission import HIGH, AdmissionConfig, AdmissionController
from kvguard.engine.admission_policy import AdmissionPolicy
from kvguard.engine.config import EngineConfig
from kvguard.engine.llm_engine import LLMEngine, prefill_while_decoding
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.scheduler import FIRST_TEXT_TOKENS, awaits_first_text
from kvguard.engine.sequence import Sequence

BLOCK = 16


def make_engine(**kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", "32MiB")
    kw.setdefault("num_threads", 2)
    return LLMEngine.from_config(EngineConfig(model="tiny", **kw), progress=False)


def prompt(n: int, start: int = 3) -> list[int]:
    return [start + i % 200 for i in range(n)]


def computed(engine: LLMEngine, rid: str) -> int:
    return engine._seqs[rid].num_computed_tokens


def long_params() -> SamplingParams:
    return SamplingParams(max_tokens=64, ignore_eos=True)


# -- prompt tokens beside decodes ---------------------------------------------------------------
def test_prompt_tokens_beside_decodes_are_bounded() -> None:
    eng = make_engine(max_num_batched_tokens=512, prefill_while_decoding=32)
    a = eng.add_request(prompt(10), long_params())
    eng.step()  # a's prompt: a decodes from now on
    b = eng.add_request(prompt(200, 7), long_params())
    eng.step()
    assert computed(eng, a) == 11 and computed(eng, b) == 32  # one decode + a 32-token chunk
    eng.step()
    assert computed(eng, b) == 64


def test_a_prompt_alone_takes_the_whole_step_budget() -> None:
    eng = make_engine(max_num_batched_tokens=512, prefill_while_decoding=32)
    b = eng.add_request(prompt(200), long_params())
    eng.step()
    assert computed(eng, b) == 200  # nothing decodes: no reason to chunk


def test_the_default_bounds_cpu_only() -> None:
    import torch

    cfg = EngineConfig(model="tiny")
    assert prefill_while_decoding(cfg, torch.device("cpu")) == 128
    assert prefill_while_decoding(cfg, torch.device("cuda")) is None
    cfg = EngineConfig(model="tiny", prefill_while_decoding=100)
    assert prefill_while_decoding(cfg, torch.device("cuda")) == 100


def test_without_chunked_prefill_a_prompt_is_not_cut_by_the_bound() -> None:
    eng = make_engine(
        max_num_batched_tokens=4096, prefill_while_decoding=32, enable_chunked_prefill=False
    )
    eng.add_request(prompt(10), long_params())
    eng.step()
    b = eng.add_request(prompt(200, 7), long_params())
    eng.step()
    assert computed(eng, b) == 200  # whole, or it could never start while a decodes


def chunk_of_next_step(eng: LLMEngine, rid: str) -> int:
    """The tokens `rid` computes in the next step."""
    before = computed(eng, rid)
    eng.step()
    return computed(eng, rid) - before


def prompt_chunks(eng: LLMEngine, rid: str) -> list[int]:
    """The prompt tokens `rid` computes in each step until its prompt is in."""
    chunks, prompt_len = [], len(eng._seqs[rid].prompt_token_ids)
    while computed(eng, rid) < prompt_len:
        chunks.append(chunk_of_next_step(eng, rid))
    return chunks


def test_the_prompts_that_widen_the_budget_start_and_one_long_prompt_keeps_one_bound() -> None:
    """Eight short prompts widen the budget beside one decode so that they start together;
    the long prompt first in line must not take all of it (it took 1,152 tokens, none of the
    eight started, and the decode waited for that whole chunk)."""
    eng = make_engine(max_num_batched_tokens=2048, prefill_while_decoding=128)
    a = eng.add_request(prompt(10), long_params())
    eng.step()  # a decodes from now on
    long = eng.add_request(prompt(1900, 7), long_params())
    shorts = [eng.add_request(prompt(20, 50 + 13 * k), long_params()) for k in range(8)]
    eng.step()
    assert computed(eng, long) == 128
    assert [computed(eng, r) for r in shorts] == [20] * 8  # all eight started in that step
    chunks = prompt_chunks(eng, long)
    assert max(chunks) <= 128 and sum(chunks) == 1900 - 128
    assert computed(eng, a) == 11 + len(chunks)  # a decoded in every one of those steps


def worst_case_engine() -> LLMEngine:
    """A 256-block pool under worst-case admission: a request queues while its whole
    `max_tokens` does not fit beside the commitments in flight."""
    admission = AdmissionConfig(
        estimate="worst_case", reserved_headroom_bytes=0, dynamic_max_tokens=False
    )
    return make_engine(
        kv_cache_bytes="2MiB",
        max_num_batched_tokens=2048,
        prefill_while_decoding=128,
        admission=admission,
    )


def test_requests_admission_holds_back_do_not_widen_the_prompt_budget() -> None:
    """Eight requests queued for KV (their worst case does not fit) cannot start: they widen
    nothing. Two prompts beside two decodes share one bound a step, as without them."""
    eng = worst_case_engine()
    for k in range(2):
        eng.add_request(prompt(10, 3 + k), long_params())
    eng.step()  # two decodes from now on
    longs = [eng.add_request(prompt(1000, 7 + k), long_params()) for k in range(2)]
    big = SamplingParams(max_tokens=2000, ignore_eos=True)
    queued = [eng.add_request(prompt(20, 50 + 13 * k), big) for k in range(8)]
    policy = eng.scheduler.policy
    assert all(policy.is_admitted(eng._seqs[r]) for r in longs)
    assert not any(policy.is_admitted(eng._seqs[r]) for r in queued)  # held back for KV
    for _ in range(3):
        before = sum(computed(eng, r) for r in longs)
        eng.step()
        assert sum(computed(eng, r) for r in longs) - before == 128  # was 640: 10 per 2 decodes
    assert not any(computed(eng, r) for r in queued)


def test_queued_requests_whose_commitment_fits_now_widen_the_budget() -> None:
    """Requests queued for KV that fit once it is given back can start, and they start
    together beside a decode, as admitted ones do."""
    eng = worst_case_engine()
    a = eng.add_request(prompt(10, 9), long_params())
    hogs = [eng.add_request(prompt(10, 3 + k), SamplingParams(max_tokens=1900)) for k in range(2)]
    eng.step()
    assert eng._seqs[a].output_token_ids  # a decodes from now on
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    queued = [eng.add_request(prompt(20, 50 + 13 * k), params) for k in range(8)]
    policy = eng.scheduler.policy
    assert not any(policy.is_admitted(eng._seqs[r]) for r in queued)  # the hogs hold the KV
    for rid in hogs:
        eng.abort(rid)
    eng.step()
    assert [computed(eng, r) for r in queued] == [20] * 8  # 160 tokens beside one decode
    assert computed(eng, a) == 11


# -- a high request's prompt --------------------------------------------------------------------
def test_high_prompt_runs_in_a_step_of_its_own() -> None:
    eng = make_engine(max_num_batched_tokens=512, prefill_while_decoding=32)
    a = eng.add_request(prompt(10), long_params())
    eng.step()
    low = eng.add_request(prompt(300, 5), long_params(), priority="low")
    eng.step()
    assert computed(eng, low) == 32
    high = eng.add_request(prompt(40, 9), long_params(), priority="high")
    late = eng.add_request(prompt(20, 11), long_params(), priority="normal")
    eng.step()
    # the high prompt alone, whole (past the 32-token bound: its first token is the point);
    # the decode, the low prompt's next chunk and the normal request wait a step
    assert computed(eng, a) == 11
    assert computed(eng, high) == 40
    assert computed(eng, low) == 32 and computed(eng, late) == 0
    assert eng._seqs[high].output_token_ids  # its first token came from that step
    eng.step()
    assert computed(eng, a) == 12 and computed(eng, low) > 32  # then the others go on


def test_a_high_request_keeps_the_step_until_its_first_text_is_out() -> None:
    """A first token whose text is held back (it begins a stop string) shows the client
    nothing: the token after it comes from a step of high work too, not from a full step of
    everyone's. Once text is out, the others go on."""
    high_prompt = prompt(40, 9)
    [ref] = make_engine().generate(
        [high_prompt], SamplingParams(max_tokens=FIRST_TEXT_TOKENS, ignore_eos=True)
    )
    eng = make_engine(max_num_batched_tokens=512, prefill_while_decoding=32)
    first = eng.tokenizer.decode(ref.token_ids[:1])
    assert first, "the test needs a first token with text"
    a = eng.add_request(prompt(10), long_params())
    eng.step()
    params = SamplingParams(max_tokens=64, ignore_eos=True, stop=[first + "\x01"])
    high = eng._seqs[eng.add_request(high_prompt, params, priority="high")]
    eng.step()  # the prompt, alone
    assert len(high.output_token_ids) == 1 and high.sent_text_len == 0  # held back
    assert computed(eng, a) == 10
    steps = 1
    while awaits_first_text(high):  # the next tokens come from steps of high work too
        assert computed(eng, a) == 10
        eng.step()
        steps += 1
    assert steps >= 2 and high.output_token_ids == ref.token_ids[:steps]
    assert high.sent_text_len > 0 or steps == FIRST_TEXT_TOKENS
    eng.step()
    assert computed(eng, a) == 11  # then the others go on


def test_the_token_a_first_text_waits_on_goes_before_the_next_high_prompt() -> None:
    """Two high requests close together: the one whose next token is its first text gets it
    from a step of its own decode (short), not from the second one's prompt step; a high
    request whose text is out decodes with everyone else, not in those steps."""
    eng = make_engine(max_num_batched_tokens=512, prefill_while_decoding=32)
    p1 = prompt(40, 9)
    [ref] = make_engine().generate([p1], SamplingParams(max_tokens=1))
    held = SamplingParams(
        max_tokens=64, ignore_eos=True, stop=[eng.tokenizer.decode(ref.token_ids) + "\x01"]
    )
    a = eng.add_request(prompt(10), long_params())
    texted = eng._seqs[eng.add_request(prompt(12, 7), long_params(), priority="high")]
    while awaits_first_text(texted):
        eng.step()
    h1 = eng._seqs[eng.add_request(p1, held, priority="high")]
    eng.step()  # h1's prompt, alone: its first token's text is held back
    assert len(h1.output_token_ids) == 1 and h1.sent_text_len == 0
    h2 = eng._seqs[eng.add_request(prompt(60, 11), long_params(), priority="high")]
    done_a, done_texted = computed(eng, a), texted.num_computed_tokens
    eng.step()  # h1's next token alone: h2's prompt waits one short step
    assert len(h1.output_token_ids) == 2 and h2.num_computed_tokens == 0
    assert computed(eng, a) == done_a and texted.num_computed_tokens == done_texted
    while awaits_first_text(h1):
        eng.step()
    eng.step()
    assert h2.num_computed_tokens == 60  # then its prompt


def test_the_wait_for_a_first_text_is_bounded() -> None:
    """A high request whose text stays held back holds the others up for a few tokens at most."""
    s = seq("h", HIGH, 0, 0.0)
    assert awaits_first_text(s)  # its prompt has yet to run
    for n in range(1, FIRST_TEXT_TOKENS + 1):
        s.output_token_ids.append(7)
        s.num_computed_tokens = s.num_tokens - 1
        assert awaits_first_text(s) is (n < FIRST_TEXT_TOKENS)
    s.output_token_ids[1:] = []
    s.sent_text_len = 1
    assert not awaits_first_text(s)  # text is out after one token
    s.sent_text_len, s.priority = 0, 1
    assert not awaits_first_text(s)  # only high requests


def test_a_queued_high_request_does_not_hold_the_others_up() -> None:
    """A high request still queued for its commitment is not being served: lower prompts
    carry on rather than wait on it."""
    eng = make_engine(
        max_num_batched_tokens=512, prefill_while_decoding=64, admission=AdmissionConfig()
    )
    a = eng.add_request(prompt(10), long_params())
    eng.step()
    low = eng.add_request(prompt(300, 5), long_params(), priority="low")
    eng.step()
    high = eng._seqs[eng.add_request(prompt(40, 9), long_params(), priority="high")]
    eng.admission_policy.cancel_start(high)  # its commitment does not fit yet
    eng.admission_policy._tickets[high.request_id].admitted = False
    ctl = eng.admission_policy.controller
    fits, ctl.try_commit = ctl.try_commit, lambda *a, **k: False
    assert not eng.scheduler._urgent_prompt()
    ctl.try_commit = fits  # now it does: it commits and the steps are its
    assert eng.scheduler._urgent_prompt() and eng.admission_policy.is_admitted(high)
    del a, low


def test_a_queued_high_request_that_fits_takes_blocks_from_a_full_step() -> None:
    """A high request queued at arrival (high-priority work filled its budget) whose
    commitment fits once it reaches the head starts at once, preempting lower work for its
    blocks, even when every running sequence decodes and the pool is full: it once waited
    for one of them to finish, as no sequence outside the step could be preempted."""
    eng = make_engine(num_gpu_blocks=24, max_num_batched_tokens=512, admission=AdmissionConfig())
    normals = [eng.add_request(prompt(40, 3 + i), long_params()) for i in range(8)]
    while any(computed(eng, r) < 40 for r in normals if eng.has_request(r)):
        eng.step()
    sch = eng.scheduler
    assert sch.bm.num_free < 4, "the test needs a full pool"
    high = eng._seqs[eng.add_request(prompt(40, 9), long_params(), priority="high")]
    ticket = eng.admission_policy._tickets[high.request_id]
    if ticket.admitted:  # as if high-priority work had filled its budget at arrival
        eng.admission_policy.cancel_start(high)
        ticket.admitted = False
    eng.step()
    assert high.num_computed_tokens == 40 and sch.num_preemptions >= 1


def test_a_high_request_takes_the_slot_of_lower_work() -> None:
    """Every slot taken by normal work: the high request takes the slot of the newest normal
    sequence (preempted, recomputed later) instead of waiting for one to finish."""
    eng = make_engine(max_num_seqs=2)
    normals = [eng.add_request(prompt(10, 3 + i), greedy_n(6)) for i in range(2)]
    eng.step()
    high = eng.add_request(prompt(12, 9), greedy_n(3), priority="high")
    eng.step()
    assert computed(eng, high) == 12  # its prompt ran at once
    assert computed(eng, normals[1]) == 0 and computed(eng, normals[0]) == 10  # newest out
    assert eng.scheduler.num_preemptions == 1
    run_to_end(eng)
    assert all(not eng.has_request(r) for r in [*normals, high])


def test_a_high_request_that_cannot_start_leaves_no_idle_step() -> None:
    """Every slot taken by high work: a new high request waits for a slot, and the others keep
    decoding meanwhile (a step of high work only would be an empty one)."""
    eng = make_engine(max_num_seqs=2)
    highs = [eng.add_request(prompt(10, 3 + i), greedy_n(6), priority="high") for i in range(2)]
    eng.step()
    late = eng.add_request(prompt(12, 9), greedy_n(3), priority="high")
    before = [computed(eng, r) for r in highs]
    eng.step()
    assert [computed(eng, r) for r in highs] == [n + 1 for n in before]
    assert computed(eng, late) == 0 and eng.scheduler.num_preemptions == 0
    run_to_end(eng)
    assert all(not eng.has_request(r) for r in [*highs, late])


def run_to_end(eng: LLMEngine) -> None:
    steps = 0
    while eng.has_unfinished():
        assert eng.step() is not None
        steps += 1
        assert steps < 50, "the engine stopped making progress"


def greedy_n(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


# -- low priority behind a normal burst ---------------------------------------------------------
def seq(rid: str, priority: int, order: int, arrival: float) -> Sequence:
    s = Sequence(rid, [1, 2, 3], SamplingParams(), priority, order, 4096)
    s.arrival_time = arrival
    return s


def test_low_goes_ahead_of_normals_that_came_later_than_the_delay() -> None:
    ctl = AdmissionController(AdmissionConfig(low_priority_delay_s=1.0), BLOCK, 1000)
    policy = AdmissionPolicy(ctl, BLOCK)
    low = seq("low", 2, 0, 100.0)
    near = seq("near", 1, 1, 100.5)  # a normal half a second younger: still ahead of it
    far = seq("far", 1, 2, 101.5)  # a normal 1.5 s younger: behind it
    high = seq("high", 0, 3, 105.0)  # high: ahead of everything
    order = sorted([far, low, high, near], key=policy.queue_key)
    assert [s.request_id for s in order] == ["high", "near", "low", "far"]


def test_without_a_controller_the_queue_is_strict_priority() -> None:
    policy = AdmissionPolicy(None, BLOCK)
    low, normal = seq("low", 2, 0, 100.0), seq("normal", 1, 1, 500.0)
    assert sorted([low, normal], key=policy.queue_key) == [normal, low]


def test_the_engine_queue_follows_the_policy() -> None:
    adm = AdmissionConfig(low_priority_delay_s=1.0)
    eng = make_engine(admission=adm, max_num_seqs=1)
    eng.add_request(prompt(10), long_params())
    eng.step()  # the one slot is taken: the rest queue
    low = eng.add_request(prompt(10), long_params(), priority="low")
    normal = eng.add_request(prompt(10), long_params(), priority="normal")
    eng._seqs[normal].arrival_time = eng._seqs[low].arrival_time + 5.0
    eng.scheduler.waiting.sort(key=eng.admission_policy.queue_key)  # as if it came 5 s later
    late = eng.add_request(prompt(10), long_params(), priority="high")
    assert [s.request_id for s in eng.scheduler.waiting] == [late, low, normal]


# -- predicted admission's margin ---------------------------------------------------------------
def test_the_margin_stretches_the_output_to_come_not_the_tokens_held() -> None:
    ctl = AdmissionController(AdmissionConfig(estimate="predicted"), BLOCK, 1000)
    ctl.live = lambda rank: [(1100, 40)]  # a live request, its margin already applied
    # at tau = 19: ceil(1119 / 16) + ceil((16 + 19) / 16) = 70 + 3 blocks, the new request's
    # 16 planned tokens stretched to ceil(16 x 1.15) = 19; the old rule, 1.15 x every token
    # held as well, would ask ceil(1119 x 1.15 / 16) + 3 = 84
    assert ctl.fits(16, 16, 73, rank=1, cap=64)
    assert not ctl.fits(16, 16, 72, rank=1, cap=64)
    # the stretch never passes what max_tokens allows: at tau = 16, 70 + 2 blocks
    assert ctl.fits(16, 16, 72, rank=1, cap=16)


# -- a high arrival interrupts the step in flight ------------------------------------------------
def _arrive_during_layer(eng: LLMEngine, layer: int, submit) -> None:  # noqa: ANN001
    """Make `submit()` run inside the next forward, just before `layer`, as a request posted
    by another thread while the step computes would."""
    target = eng.runner.model.layers[layer]
    original = target.forward

    def forward(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        target.forward = original  # once
        submit()
        return original(*args, **kw)

    target.forward = forward


def test_a_high_arrival_interrupts_the_step_and_loses_nothing() -> None:
    from kvguard.engine.engine_loop import EngineLoop

    reference = make_engine()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.final_token_ids for o in reference.generate([prompt(40), prompt(25, 9)], params)]
    want_high = reference.generate([prompt(30, 5)], params)[0].final_token_ids

    eng = make_engine()
    loop = EngineLoop(eng)  # not started: the test steps the engine itself
    rids = [eng.add_request(p, params) for p in (prompt(40), prompt(25, 9))]
    eng.step()  # both prompts
    eng.step()  # a decode step
    before = [computed(eng, r) for r in rids]
    posted: list = []
    _arrive_during_layer(
        eng, 0, lambda: posted.append(loop.submit_nowait(prompt(30, 5), params, "high"))
    )
    assert eng.step() == []  # stopped before layer 1 (of 2): nothing advanced
    assert [computed(eng, r) for r in rids] == before
    assert eng.snapshot().counters["steps_interrupted"] == 1
    eng.step()  # the high prompt, in a step of its own (the others wait it out)
    stream, _ = posted[0]
    high = stream.request_id
    assert computed(eng, high) == 30 and [computed(eng, r) for r in rids] == before
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.final_token_ids
    assert [done[r] for r in rids] == want, "the redone step must produce what it would have"
    assert done[high] == want_high
    assert eng.snapshot().counters["steps_interrupted"] == 1


def test_a_step_running_a_high_prompt_is_not_interrupted() -> None:
    eng = make_engine()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = eng.add_request(prompt(20), params)
    eng.step()
    h = eng.add_request(prompt(30, 5), params, priority="high")
    _arrive_during_layer(eng, 0, eng.interrupt_step)
    eng.step()  # the high prompt's step runs to its end
    assert computed(eng, h) == 30
    assert eng.snapshot().counters["steps_interrupted"] == 0
    assert computed(eng, a) == 20  # it waited the high prompt's step out


def test_normal_arrivals_and_the_switch_off_do_not_interrupt() -> None:
    from kvguard.engine.engine_loop import EngineLoop

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for cfg, priority in (({}, "normal"), ({"interrupt_for_high": False}, "high")):
        eng = make_engine(**cfg)
        loop = EngineLoop(eng)
        a = eng.add_request(prompt(20), params)
        eng.step()
        post = functools.partial(loop.submit_nowait, prompt(9, 4), params, priority)
        _arrive_during_layer(eng, 0, post)
        eng.step()
        assert computed(eng, a) == 21, (cfg, priority)
        assert eng.snapshot().counters["steps_interrupted"] == 0


def test_a_waiting_high_request_preempts_lower_work_for_its_blocks() -> None:
    """The pool is full of normal work: a high request does not wait for it to finish, the
    newest lowest-priority sequence makes room, and is served later all the same."""
    eng = make_engine(num_gpu_blocks=10, max_num_seqs=8, admission=AdmissionConfig(enable=False))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    normal = [eng.add_request(prompt(40, 3 + i), params) for i in range(3)]
    eng.step()
    eng.step()
    assert all(computed(eng, r) == 41 for r in normal)
    assert eng.block_manager.num_free < 3  # 3 x 3 blocks of 16 held: a 40-token prompt waits
    high = eng.add_request(prompt(40, 50), params, priority="high")
    eng.step()
    assert computed(eng, high) == 40
    assert eng.scheduler.num_preemptions >= 1
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == sorted([*normal, high])
    assert all(o.num_output_tokens == 6 for o in done.values())


# -- scheduling cost --------------------------------------------------------------------------
def test_requests_are_compared_by_identity() -> None:
    """Two requests with equal fields are two members of a queue (and hashable): a membership
    test is a pointer compare, not a build of two tuples of every field."""
    a, b = seq("same", 1, 0, 100.0), seq("same", 1, 0, 100.0)
    assert a == a and a != b and len({a, b}) == 2
    queue = [a, b]
    queue.remove(b)
    assert queue == [a] and queue[0] is a


def test_a_step_of_many_decodes_compares_requests_linearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheduling a decode step of 256 sequences compares requests O(n) times, not O(n^2): each
    membership test against the step's batch had compared with every sequence already in it
    (32640 compares a step; a tiny-model step took 21.5 ms with field-by-field equality)."""
    n = 256
    eng = make_engine(max_num_seqs=n, kv_cache_bytes="64MiB", max_num_batched_tokens=4096)
    for i in range(n):
        eng.add_request(prompt(8, 3 + i), long_params())
    for _ in range(20):  # every prompt computed: the next step is decodes only
        if len(eng.scheduler.running) == n and all(
            s.num_uncomputed == 1 for s in eng.scheduler.running
        ):
            break
        eng.step()
    compares = 0

    def counting_eq(self: Sequence, other: object) -> bool:
        nonlocal compares
        compares += 1
        return self is other

    monkeypatch.setattr(Sequence, "__eq__", counting_eq)
    batch = eng.scheduler.schedule()
    assert len(batch.seqs) == n and set(batch.num_tokens) == {1}
    assert compares <= 2 * n, compares
