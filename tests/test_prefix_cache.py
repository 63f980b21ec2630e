"""The prefix cache: a request whose prompt begins with full blocks another request computed
starts past them, with exactly the tokens it gets without the cache; cached blocks count as
free and yield to any request that needs them; keys are exact; a KV dtype switch drops them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.block_manager import BlockManager
from kvguard.engine.sequence import Sequence
from kvguard.engine.speculative import Lookup
from kvguard.kernels import cpu_lowbit
from tests.test_remedies import run_all


def _seq(rid: str, tokens) -> Sequence:  # noqa: ANN001 - any int iterable
    return Sequence(rid, list(tokens), SamplingParams(), 0, 0, 10_000)


def _compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What a step does to `seq`'s blocks: room for `n` tokens, computed, full blocks kept."""
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)


# -- the block manager --------------------------------------------------------------------


def test_keys_are_whole_prefixes_and_the_last_token_is_always_computed() -> None:
    bm = BlockManager(16, 4, caching=True)
    a = _seq("a", range(10))
    _compute(bm, a, 6)
    _compute(bm, a, 4)  # 10 tokens in two steps: blocks 0-3 and 4-7 are full
    assert bm.num_cached == 2 and a.block_contents[0] != a.block_contents[1]
    b = _seq("b", [*range(8), 99, 98])
    assert bm.match(b) == 8 and b.block_table == a.block_table[:2]
    # the same second block after a different first block is other content
    c = _seq("c", [9, 1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.match(c) == 0 and c.block_table == []
    # a prompt of exactly two cached blocks leaves its last block to compute (its logits)
    d = _seq("d", range(8))
    assert bm.match(d) == 4 and d.num_computed_tokens == 4
    bm.audit([("a", a.block_table), ("b", b.block_table), ("c", []), ("d", d.block_table)])
    assert bm.num_used == 3  # a's three blocks, shared
    # b runs on: its third block is its own, written past its computed count
    _compute(bm, b, 2)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    bm.audit([("a", a.block_table), ("b", b.block_table), ("d", d.block_table)])
    for s in (a, b, d):
        bm.free(s)
    assert bm.num_free == 16 and bm.num_cached == 2


def test_freed_blocks_stay_cached_and_are_reused_last_block_first() -> None:
    bm = BlockManager(8, 4, caching=True)
    a = _seq("a", range(13))
    _compute(bm, a, 13)
    assert bm.num_cached == 3
    bm.free(a)
    assert bm.num_free == 8 and bm.num_cached == 3  # free, content kept
    other = _seq("o", [500] * 24)
    bm.allocate(other, 24)  # the 5 never-used blocks, then a's last full block
    assert bm.num_cached == 2
    again = _seq("again", range(13))
    assert bm.match(again) == 8  # a's first two blocks survive
    bm.audit([("o", other.block_table), ("again", again.block_table)])


def test_audit_refuses_a_shared_block_without_cached_content() -> None:
    bm = BlockManager(8, 4, caching=True)
    a = _seq("a", range(6))
    _compute(bm, a, 6)  # block 1 is partial: not cached, a's alone
    partial = a.block_table[1]
    bm._holders[partial].add("b")
    with pytest.raises(AssertionError, match="holds no cached content"):
        bm.audit([("a", a.block_table), ("b", [partial])])


def test_pool_rebuild_drops_the_cache_and_caching_off_keeps_nothing() -> None:
    bm = BlockManager(8, 4, caching=True)
    a = _seq("a", range(9))
    _compute(bm, a, 9)
    moves = bm.resize(6)
    a.block_table = [moves[b] for b in a.block_table]
    assert bm.num_cached == 0 and bm.match(_seq("b", range(9))) == 0
    bm.audit([("a", a.block_table)])
    off = BlockManager(8, 4)
    c = _seq("c", range(9))
    _compute(off, c, 9)
    assert off.num_cached == 0 and off.match(_seq("d", range(9))) == 0


def test_blocks_shared_through_a_pool_rebuild_stay_shared_and_are_never_found() -> None:
    bm = BlockManager(8, 4, caching=True)
    a, b = _seq("a", range(10)), _seq("b", [*range(8), 50, 51])
    _compute(bm, a, 10)
    assert bm.match(b) == 8 and b.block_table == a.block_table[:2]
    moves = bm.resize(6)  # the live dtype switch: a's and b's first two blocks are shared
    for s in (a, b):
        s.block_table = [moves[x] for x in s.block_table]
    bm.audit([("a", a.block_table), ("b", b.block_table)])
    assert bm.num_cached == 0 and bm.match(_seq("c", range(10))) == 0
    _compute(bm, b, 2)  # b runs on in the new pool beside a
    bm.audit([("a", a.block_table), ("b", b.block_table)])
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 6 and bm.match(_seq("d", range(10))) == 0
    bm.audit([])


# -- the engine ---------------------------------------------------------------------------


def _engine(**kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", "32MiB")
    kw.setdefault("num_threads", 2)
    return LLMEngine.from_config(EngineConfig(model="tiny", **kw), progress=False)


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    rids = [engine.add_request(p, params) for p in prompts]
    done = run_all(engine)  # block accounting audited after every step
    return [done[r].token_ids for r in rids]


def _step_tokens(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Record the tokens each step computes per sequence."""
    seen: list[list[int]] = []
    schedule = engine.scheduler.schedule

    def recording():  # noqa: ANN202
        batch = schedule()
        seen.append(list(batch.num_tokens))
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    return seen


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SYSTEM = [3 + (i * 7) % 250 for i in range(64)]  # four full blocks of 16


@pytest.fixture(scope="module")
def uncached() -> LLMEngine:
    return _engine(enable_prefix_caching=False)


def test_a_repeated_prompt_computes_only_its_last_block(
    uncached: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine()
    prompt = [*SYSTEM, 9, 10, 11]  # 67 tokens: 4 full blocks
    first = _run(engine, [prompt], GREEDY)
    steps = _step_tokens(engine, monkeypatch)
    rid = engine.add_request(prompt, GREEDY)
    outs = [o for _ in range(50) if engine.has_unfinished() for o in engine.step()]
    final = outs[-1]
    assert final.request_id == rid and final.token_ids == first[0]
    assert steps[0] == [3] and final.num_cached_tokens == 64  # 67 - 64 prompt tokens computed
    assert first == _run(uncached, [prompt], GREEDY)
    snap = engine.snapshot()
    assert snap.prefix_cache["hit_tokens"] == 64
    assert snap.prefix_cache["queried_tokens"] == 2 * len(prompt)
    assert snap.blocks_free == snap.blocks_total and snap.prefix_cache["blocks"] >= 4


def test_running_requests_share_a_system_prompt(uncached: LLMEngine) -> None:
    engine = _engine()
    prompts = [[*SYSTEM, *range(20 + 10 * k, 30 + 10 * k)] for k in range(4)]
    engine.add_request(prompts[0], GREEDY)
    engine.step()  # the first prompt's blocks are computed and cached
    rids = [engine.add_request(p, GREEDY) for p in prompts[1:]]
    engine.step()
    engine.audit_blocks()
    seqs = [engine._seqs[r] for r in rids]
    assert all(s.num_cached_tokens == 64 for s in seqs)
    held = sum(len(s.block_table) for s in engine.scheduler.running)
    # four requests of five blocks each hold 5 + 3 * 1 distinct blocks (plus one for the
    # first request's decode)
    assert engine.snapshot().blocks_used <= held - 3 * 4
    while engine.has_unfinished():
        engine.step()
        engine.audit_blocks()
    # and each answer is the one computed without the cache
    assert _run(engine, prompts, GREEDY) == _run(uncached, prompts, GREEDY)


def test_cached_blocks_yield_to_pressure(uncached: LLMEngine) -> None:
    """The cache holds nothing a request needs: a workload that fills the pool preempts no
    more with a full cache than with caching off."""
    engine = _engine(num_gpu_blocks=24, max_num_seqs=8, max_num_batched_tokens=64)
    ref = _engine(
        num_gpu_blocks=24, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False
    )
    _run(engine, [[7 + k] * 40 for k in range(6)], SamplingParams(max_tokens=1))
    assert engine.snapshot().prefix_cache["blocks"] >= 12
    work = [[100 + k * 3 + i % 3 for i in range(30)] for k in range(8)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert _run(engine, work, params) == _run(ref, work, params)
    assert engine.snapshot().num_preemptions == ref.snapshot().num_preemptions > 0
    snap = engine.snapshot()
    assert snap.blocks_free == snap.blocks_total


def test_a_preempted_request_recomputes_from_its_cached_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request recomputed after preemption starts from the cached blocks of its prompt and
    output. The prefix cache's counters are of prompt tokens looked up as requests start: a
    readmission's lookup, its output tokens included, counted too had the hits exceed every
    prompt token there was (64 of 60) and skewed kvguard:prefix_cache_hit:ratio_rate5m."""
    engine = _engine(num_gpu_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    bm = engine.block_manager
    again: list[int] = []  # what each readmission found (a try that did not fit given back)
    match, unmatch = bm.match, bm.unmatch

    def matched(seq: Sequence) -> int:
        hit = match(seq)
        if hit and seq.first_scheduled_time is not None:
            again.append(hit)
        return hit

    def unmatched(seq: Sequence) -> None:
        if seq.first_scheduled_time is not None:
            again.pop()
        unmatch(seq)

    monkeypatch.setattr(bm, "match", matched)
    monkeypatch.setattr(bm, "unmatch", unmatched)
    prompts = [[11 + k + i % 5 for i in range(40)] for k in range(3)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    done = run_all(engine)
    snap = engine.snapshot()
    assert snap.preemptions["recompute"] > 0
    # the recomputes found, together, at least a prompt's full blocks each (what the hit
    # counter measured before it counted prompts only)
    assert sum(again) >= 32 * snap.preemptions["recompute"]
    assert [done[r].token_ids for r in rids] == _run(
        _engine(enable_prefix_caching=False), prompts, params
    )
    cached = sum(done[r].num_cached_tokens for r in rids)
    assert snap.prefix_cache["hit_tokens"] == cached <= snap.counters["prompt_tokens"]
    assert snap.prefix_cache["queried_tokens"] == snap.counters["prompt_tokens"] == 120


def test_blocks_filled_by_accepted_drafts_serve_a_follow_up_turn(
    uncached: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify step computes the K/V of the drafts it accepts before they are appended to
    the request: the blocks they completed were registered then, keyed by the tokens that
    were there (a block cut short), and neither they nor any later block of the request was
    ever found again: the follow-up turn below found 16 cached tokens, not 48."""
    prompt = [5 + (i * 11) % 200 for i in range(24)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    answer = _run(uncached, [prompt], params)[0]

    def propose(self: Lookup, seq: Sequence, most: int) -> list[int]:
        done = len(seq.output_token_ids)  # the answer's next tokens: every draft is accepted
        return answer[done : done + most]

    monkeypatch.setattr(Lookup, "propose", propose)
    engine = _engine(speculative_tokens=4, speculative_row_cost=0.0)
    assert _run(engine, [prompt], params) == [answer]
    sch = engine.scheduler
    assert sch.accepted == sch.drafted > 16  # most of the answer came as accepted drafts
    turn = [*prompt, *answer, 200, 201]
    monkeypatch.undo()  # the follow-up drafts as usual
    out = engine.generate([turn], [GREEDY])[0]
    # every full block of the first turn's K/V: its prompt and answer but the last token
    assert out.num_cached_tokens == (len(prompt) + len(answer) - 1) // 16 * 16 == 48
    assert out.token_ids == uncached.generate([turn], [GREEDY])[0].token_ids


def test_prompt_logprobs_compute_the_whole_prompt(uncached: LLMEngine) -> None:
    engine = _engine()
    prompt = [*SYSTEM, 5]
    _run(engine, [prompt], GREEDY)
    hits = engine.snapshot().prefix_cache["hit_tokens"]
    asked = SamplingParams(max_tokens=2, prompt_logprobs=1)
    out = engine.generate([prompt], [asked])[0]
    ref = uncached.generate([prompt], [asked])[0]
    assert engine.snapshot().prefix_cache["hit_tokens"] == hits
    assert len(out.final_prompt_logprobs) == len(prompt) - 1
    assert [e.token_id for e in out.final_prompt_logprobs] == prompt[1:]
    for e, r in zip(out.final_prompt_logprobs, ref.final_prompt_logprobs, strict=True):
        assert abs(e.logprob - r.logprob) < 1e-4


def test_a_kv_dtype_switch_drops_the_cache() -> None:
    engine = _engine(kv_cache_bytes="4MiB")
    prompt = [*SYSTEM, 1, 2]
    _run(engine, [prompt], GREEDY)
    assert engine.snapshot().prefix_cache["blocks"] >= 4
    fut = engine.set_kv_cache_dtype("fp8_e4m3")
    engine.step()
    assert fut.result(0).ok
    assert engine.snapshot().prefix_cache["blocks"] == 0
    before = engine.snapshot().prefix_cache["hit_tokens"]
    _run(engine, [prompt], GREEDY)  # computed again, in fp8, and cached again
    assert engine.snapshot().prefix_cache["hit_tokens"] == before
    _run(engine, [prompt], GREEDY)
    assert engine.snapshot().prefix_cache["hit_tokens"] == before + 64


def test_the_default_model_answers_alike_with_a_shared_system_prompt(
    smollm_engine: LLMEngine,
) -> None:
    """Chat turns with one system prompt through the real model: the later ones start from
    the first one's blocks and answer exactly as an engine without the cache does."""
    system = (
        "You are a careful assistant for a railway company. Answer in one short sentence, "
        "name the station when you know it, and never invent timetables or platform numbers."
    )
    questions = ["Where does the night train stop?", "What is a platform?", "Who drives it?"]
    tok = smollm_engine.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
        )
        for q in questions
    ]
    params = SamplingParams(max_tokens=12)
    cached = [smollm_engine.generate([p], [params])[0] for p in prompts]
    assert all(o.num_cached_tokens >= 32 for o in cached[1:])
    ref = LLMEngine.from_config(
        EngineConfig(
            model="smollm2-135m",
            kv_cache_bytes="64MiB",
            num_threads=2,
            enable_prefix_caching=False,
        ),
        progress=False,
    )
    assert [o.token_ids for o in cached] == [o.token_ids for o in ref.generate(prompts, params)]


def test_usage_and_metrics_report_cached_tokens(tiny_daemon) -> None:  # noqa: ANN001
    client = openai.OpenAI(base_url=tiny_daemon.url + "/v1", api_key="x")
    prompt = " ".join(["alpha beta gamma delta"] * 12)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    n = second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    text = httpx.get(tiny_daemon.url + "/metrics").text
    hit = [ln for ln in text.splitlines() if ln.startswith("kvguard_prefix_cache_hit_tokens_total")]
    assert hit and float(hit[0].split()[-1]) >= (n - 1) // 16 * 16
    assert "kvguard_prefix_cache_blocks " in text


# -- a burst with one prefix computes it once ---------------------------------------------


def test_a_burst_with_one_system_prompt_computes_it_once(
    uncached: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests arriving together with one system prompt: the first computes it, the others
    wait a step and take its blocks from the cache, with the answers computed without it."""
    engine = _engine()
    steps = _step_tokens(engine, monkeypatch)
    prompts = [[*SYSTEM, *range(20 + 10 * k, 30 + 10 * k)] for k in range(4)]
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    done = run_all(engine)
    assert steps[0] == [74] and steps[1] == [1, 10, 10, 10]
    assert [done[r].num_cached_tokens for r in rids] == [0, 64, 64, 64]
    assert [done[r].token_ids for r in rids] == _run(uncached, prompts, GREEDY)


def test_a_short_shared_header_does_not_hold_a_prompt_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One shared block of a five-block prompt is not worth a step's wait: all start at once."""
    engine = _engine()
    steps = _step_tokens(engine, monkeypatch)
    prompts = [[*SYSTEM[:16], *range(100 + 70 * k, 164 + 70 * k)] for k in range(3)]
    for p in prompts:
        engine.add_request(p, GREEDY)
    run_all(engine)
    assert steps[0] == [80, 80, 80]


def test_only_a_prompt_of_the_same_priority_or_higher_is_waited_for() -> None:
    """A high request never waits on a normal prompt's blocks (high steps may hold that
    prompt back); a normal one with the same prompt does."""
    engine = _engine(max_num_batched_tokens=48)
    prompt = [*SYSTEM, *range(20, 30)]  # 74 tokens: 48 in the first step, 26 in the second
    lead = engine.add_request(prompt, GREEDY)
    engine.step()
    high = engine.add_request([*SYSTEM, 7, 8], GREEDY, priority="high")
    follower = engine.add_request(prompt, GREEDY)
    engine.step()  # the lead's last 26 tokens, the high request's 18, 4 tokens to spare
    seqs = engine._seqs
    assert seqs[lead].num_computed_tokens == 74 and seqs[high].num_computed_tokens == 66
    assert seqs[follower].num_computed_tokens == 0
    done = run_all(engine)
    assert done[follower].num_cached_tokens == 64 and done[high].num_cached_tokens == 48
    assert done[follower].token_ids == done[lead].token_ids


def test_a_same_dtype_resize_keeps_what_fits_and_moves_into_uncached_ids_first() -> None:
    bm = BlockManager(16, 4, caching=True)
    filler = _seq("filler", range(100, 140))  # blocks 0-9, freed: uncached ids
    bm.allocate(filler, 40)
    a = _seq("a", range(16))  # blocks 10-13, all four cached, a keeps holding them
    _compute(bm, a, 16)
    b = _seq("b", range(50, 58))  # blocks 14-15 cached, then freed: cached but free
    _compute(bm, b, 8)
    bm.free(b)
    bm.free(filler)
    assert a.block_table == [10, 11, 12, 13] and bm.num_cached == 6
    moves = bm.resize(8, keep_cache=True)
    # a's blocks move into uncached free ids, in the order the free list hands them out (the
    # filler freed its last block first); b's cached blocks lie outside the new pool
    assert moves == {10: 7, 11: 6, 12: 5, 13: 4}
    a.block_table = [moves[x] for x in a.block_table]
    bm.audit([("a", a.block_table)])
    assert bm.num_cached == 4 and bm.num_blocks == 8
    c = _seq("c", [*range(16), 7])
    assert bm.match(c) == 16 and c.block_table == [7, 6, 5, 4]
    bm.free(c)
    bm.free(a)
    bm.audit([])
    # growing keeps them too, new blocks handed out first; a free cached block inside the
    # pool is moved (copied) to itself so that the new pool holds its K/V
    moves = bm.resize(12, keep_cache=True)
    assert moves == {7: 7, 6: 6, 5: 5, 4: 4} and next(iter(bm._free)) == 8
    d = _seq("d", [*range(16), 9])
    assert bm.match(d) == 16


def test_a_seeded_request_repeated_from_the_cache_answers_alike(smollm_engine: LLMEngine) -> None:
    """The default model, packed: a seeded sampled request sent twice, the second computing
    only the 6 prompt tokens past its cached blocks (after 64 and after 144), gives the same
    tokens and the same log-probabilities. Prompt rows take the prompt kernel however many of
    them a step computes; before, the first run's prompt took the fp32 panels and the repeat's
    few uncached rows the integer dots, and the answers parted."""
    tok = smollm_engine.tokenizer
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=1234, logprobs=2)
    for n in (70, 150):
        text = f"Logbook {n}: the lighthouse keeper and a cat named Tern watch the sea. " * 20
        prompt = tok.encode(text)[:n]
        assert len(prompt) == n
        first, again = (smollm_engine.generate([prompt], [params])[0] for _ in range(2))
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, n // 16 * 16)
        assert again.token_ids == first.token_ids, n
        lps = [[(e.logprob, e.top) for e in o.final_logprobs] for o in (first, again)]
        assert lps[1] == lps[0], n


def _lps(out) -> list[tuple[float, object]]:  # noqa: ANN001 - a RequestOutput
    return [(e.logprob, e.top) for e in out.final_logprobs]


def test_a_one_token_cached_tail_answers_as_the_cold_run(smollm_engine: LLMEngine) -> None:
    """The default model, packed: a prompt repeated from the cache with one uncached token
    (after 1, 2 and 8 blocks of 16) gets the cold run's log-probabilities bit for bit. That
    token attends by the prefill kernel, as the cold prompt's last row did; before, it
    attended as a decode row, whose kernel sums in another order (up to 4e-3 apart)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    for n in (17, 33, 129):
        prompt = [100 + (i * 7919 + n * 131) % 30000 for i in range(n)]  # no prefix shared
        cold, again = (smollm_engine.generate([prompt], [params])[0] for _ in range(2))
        assert (cold.num_cached_tokens, again.num_cached_tokens) == (0, n - 1), n
        assert again.token_ids == cold.token_ids, n
        assert _lps(again) == _lps(cold), n


def test_on_fp32_weights_a_cached_repeat_is_within_2e_5_of_the_cold_run(
    uncached: LLMEngine,
) -> None:
    """`tiny`: fp32 weights through torch's GEMM, as `model_quantization: none` or an
    unquantised checkpoint. A prompt repeated from the cache with exact hits, its last 1 or 2
    tokens computed, answers the cold run's greedy tokens with log-probabilities within ~2e-5
    (README, `seed`; measured up to 1.4e-5 here, 9e-6 on SmolLM2 fp32), not bit for bit: torch's
    GEMM picks its kernel by a step's row count, so the tail's rows are computed otherwise than
    as rows of the cold prompt. The packed default model is exact (the tests above)."""
    engine = _engine(prefix_cache_exact=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    for n in (17, 18, 33, 130):
        prompt = [5 + (i * 7919 + n * 131) % 250 for i in range(n)]
        engine.generate([prompt], [params])
        again = engine.generate([prompt], [params])[0]
        cold = uncached.generate([prompt], [params])[0]
        assert again.num_cached_tokens == n // 16 * 16 and again.token_ids == cold.token_ids, n
        gap = max(abs(a - c) for (a, _), (c, _) in zip(_lps(again), _lps(cold), strict=True))
        assert gap < 1e-4, (n, gap)


def test_a_one_token_last_chunk_answers_as_the_unchunked_prompt(
    smollm_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """129 prompt tokens in chunks of 64, 64 and 1 (`max_num_batched_tokens` 64) give the
    unchunked run's prompt log-probabilities and first log-probabilities bit for bit: the
    last chunk's one row attends by the prefill kernel, as in the 129-row chunk."""
    params = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    prompt = [200 + (i * 4099) % 30000 for i in range(129)]
    chunked = LLMEngine.from_config(
        EngineConfig(
            model="smollm2-135m", kv_cache_bytes="64MiB", num_threads=2, max_num_batched_tokens=64
        ),
        progress=False,
    )
    steps = _step_tokens(chunked, monkeypatch)
    try:
        got = chunked.generate([prompt], [params])[0]
    finally:
        chunked.shutdown()
    assert steps[:3] == [[64], [64], [1]]
    want = smollm_engine.generate([prompt], [params])[0]
    assert want.num_cached_tokens == 0 and got.token_ids == want.token_ids
    plp = [[(e.logprob, e.top) for e in o.final_prompt_logprobs] for o in (got, want)]
    assert len(plp[0]) == 128 and plp[0] == plp[1]
    assert _lps(got) == _lps(want)


# -- blocks an answer filled: reused by default, exact hits only with prefix_cache_exact -------


@pytest.fixture
def one_class() -> Iterator[None]:
    """Every prompt in one length class (`cpu_lowbit.bf16_min_prompt(0)`): these tests switch
    `exact` on a live manager, which keeps a chain per class only while it is on."""
    was = cpu_lowbit.bf16_min_prompt(0)
    yield
    cpu_lowbit.bf16_min_prompt(was)


def test_exact_hits_keep_short_and_longer_prompts_chains_apart() -> None:
    """On AMX CPUs a prompt shorter than `bf16_min_prompt()` takes other kernels than a longer
    one, so its blocks hold other bits: with `exact` on each class has its own chain (neither
    finds nor takes the other's key); by default one chain serves both."""
    was = cpu_lowbit.bf16_min_prompt(12)
    try:
        for exact in (True, False):
            bm = BlockManager(32, 4, caching=True, exact=exact)
            short = _seq("s", range(9))  # 9 tokens: a short prompt
            short.prompt_written = 9
            _compute(bm, short, 9)
            long = _seq("l", [*range(9), *range(100, 110)])  # 19: the same prefix, longer
            assert bm.match(long) == (0 if exact else 8)
            long.prompt_written = long.num_computed_tokens if exact else 0
            _compute(bm, long, 19 - long.num_computed_tokens)
            again = _seq("s2", [*range(9), 42])
            assert bm.match(again) == 8  # its own class's blocks, still there
            bm.audit([(s.request_id, s.block_table) for s in (short, long, again)])
    finally:
        cpu_lowbit.bf16_min_prompt(was)


@pytest.mark.usefixtures("one_class")
def test_blocks_decode_rows_wrote_are_flagged_and_an_exact_copy_replaces_them() -> None:
    """A block is exact while prompt rows wrote it and every block before it. With exact hits a lookup stops at the first other one; an exact copy computed later takes over
    its key (the decode-written block, still in use, stays shared but is never found again),
    and a same-dtype resize keeps the flags."""
    bm = BlockManager(16, 4, caching=True, exact=True)
    a = _seq("a", range(6))
    a.prompt_written = 6  # what the scheduler counts as its prompt rows run
    _compute(bm, a, 6)
    a.output_token_ids += [6, 7, 8, 9, 10]  # then decoded: positions 6-9 are decode rows
    _compute(bm, a, 4)
    assert bm.num_cached == 2  # the prompt's block, exact; 4-7, half written by decode rows
    b = _seq("b", [*range(10), 50])
    assert bm.match(b) == 4 and b.prompt_written == 4
    bm.unmatch(b)
    bm.exact = False  # the default: the decoded block is found too, and b knows it
    assert bm.match(b) == 8 and b.prompt_written == 4
    bm.unmatch(b)
    bm.exact = True
    assert bm.match(b) == 4
    b.prompt_written = 11  # its prompt rows from 4 on: blocks 4-7 and 8-11 exact
    _compute(bm, b, 7)
    bm.audit([("a", a.block_table), ("b", b.block_table)])
    c = _seq("c", [*range(10), 60, 61, 62])
    assert bm.match(c) == 8 and c.block_table == b.block_table[:2] and c.prompt_written == 8
    a.output_token_ids += [11, 12]  # a decodes on past its retired block: still shared by none
    _compute(bm, a, 2)
    bm.audit([("a", a.block_table), ("b", b.block_table), ("c", c.block_table)])
    moves = bm.resize(16, keep_cache=True)
    for s in (a, b, c):
        s.block_table = [moves[x] for x in s.block_table]
    for s in (a, b, c):
        bm.free(s)
    bm.audit([])
    d = _seq("d", [*range(10), 70, 71, 72])
    assert bm.match(d) == 8 and d.prompt_written == 8


@pytest.mark.usefixtures("one_class")
def test_a_recomputed_text_is_prompt_written() -> None:
    """A sequence preempted to recompute computes its prompt and output so far as prompt
    rows: with exact hits its readmission finds only its prompt's exact block, and
    the blocks it recomputes are exact from then on (a lookup with exact hits finds
    them), where its first run's decode rows had written them."""
    engine = _engine()
    bm = engine.block_manager
    prompt = [5 + (i * 11) % 200 for i in range(24)]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    seq = engine._seqs[rid]
    while len(seq.output_token_ids) < 30:
        engine.step()
    assert seq.prompt_written == 24 and seq.num_computed_tokens == 53
    text = prompt + seq.output_token_ids  # 54 tokens, the last one not computed yet
    bm.exact = True
    probe = _seq("probe", [*text[:48], 1])
    assert bm.match(probe) == 16  # blocks 16-47 hold K/V decode rows wrote
    bm.unmatch(probe)
    assert engine.scheduler.preempt(seq) == "recompute"
    engine.step()  # readmitted: block 0 from the cache, then the rest of its text as a prompt
    assert seq.num_cached_tokens == 0 and seq.num_computed_tokens == 54
    assert seq.prompt_written == 54
    done = run_all(engine)
    assert done[rid].num_preemptions == 1 and done[rid].token_ids[:30] == text[24:]
    out = engine.generate([[*text[:48], 1]], [GREEDY])[0]
    assert out.num_cached_tokens == 48


@pytest.mark.usefixtures("one_class")
def test_a_follow_up_turn_reuses_the_blocks_its_answer_filled_by_default() -> None:
    """By default a follow-up turn (the first turn's prompt and answer, then a new message)
    starts past every full block of the first turn's K/V, answer included; with decoded
    blocks off it starts past the blocks its prompt filled alone."""
    engine = _engine()
    bm = engine.block_manager
    assert bm.exact is False
    prompt = [9 + (i * 17) % 200 for i in range(40)]
    answer = engine.generate([prompt], [SamplingParams(max_tokens=40, ignore_eos=True)])[0]
    turn = [*prompt, *answer.token_ids, 201, 202, 203]
    reused = engine.generate([turn], [GREEDY])[0].num_cached_tokens
    assert reused == (len(prompt) + len(answer.token_ids) - 1) // 16 * 16 == 64
    bm.exact = True
    exact = engine.generate([turn], [GREEDY])[0].num_cached_tokens
    assert exact == len(prompt) // 16 * 16 == 32 < reused


@pytest.fixture(scope="module")
def smollm_uncached() -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(
            model="smollm2-135m", kv_cache_bytes="64MiB", num_threads=2, enable_prefix_caching=False
        ),
        progress=False,
    )


def test_with_exact_hits_a_follow_up_turn_answers_as_the_cold_run(
    smollm_engine: LLMEngine, smollm_uncached: LLMEngine
) -> None:
    """The default model, packed: a seeded follow-up chat turn (turn 1's prompt and answer,
    then a new message) with exact hits gets the tokens and log-probabilities of an
    engine without the cache, bit for bit, starting past turn 1's prompt blocks; the blocks
    it then computed replace the ones turn 1's answer wrote, so the same turn again starts
    past them too, still exact. Reusing the decode-written blocks (the default), the same
    turn's log-probabilities were up to 4e-3 apart from the cold run's, and a sampled token
    could turn."""
    tok = smollm_engine.tokenizer
    system = (
        "You are a patient science teacher. Explain things to a curious twelve year old in "
        "plain words, with one everyday example from the kitchen or the garden, and never "
        "use more than three short sentences or any word a child would not know."
    )
    question = "Explain why the sky is blue in a few sentences."
    chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    first = tok.encode(tok.apply_chat_template(chat))
    # 64 tokens or more, as turn 2: with AMX-BF16 a prompt's rows take the bf16 tiles from
    # `cpu_lowbit.bf16_min_prompt()` (64) tokens, so turn 1 wrote the bits turn 2 computes cold
    assert len(first) >= 64
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True, logprobs=2)
    answer = smollm_engine.generate([first], [params])[0].token_ids
    more = "<|im_end|>\n<|im_start|>user\nShorter please.<|im_end|>\n<|im_start|>assistant\n"
    turn = [*first, *answer, *tok.encode(more)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, logprobs=2)
    cold = smollm_uncached.generate([turn], [params])[0]
    bm = smollm_engine.block_manager
    bm.exact = True
    try:
        warm, again = (smollm_engine.generate([turn], [params])[0] for _ in range(2))
    finally:
        bm.exact = False
    assert warm.token_ids == cold.token_ids and _lps(warm) == _lps(cold)
    assert again.token_ids == cold.token_ids and _lps(again) == _lps(cold)
    assert warm.num_cached_tokens == len(first) // 16 * 16 > 0
    assert again.num_cached_tokens == (len(turn) - 1) // 16 * 16 > warm.num_cached_tokens


def test_sequences_swapped_out_share_their_cached_prefix_again_when_they_come_back() -> None:
    """Four requests share a 64-token prompt (four full blocks, one copy on the device). Swapped
    out and back (an eviction with offload on), each had come back with a private copy of the
    shared blocks (the swap-in took fresh device blocks for all its host ones): the eviction
    meant to relieve memory left them holding the prefix four times (39 -> 99 blocks in a
    daemon). Now the blocks whose content the cache still holds are shared again: the
    device holds what it held before, and the answers are the uninterrupted run's."""
    prompts = [SYSTEM + [200 + k, 201 + k, 202 + k] for k in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = _run(_engine(enable_prefix_caching=False), prompts, params)
    engine = _engine(num_gpu_blocks=64, enable_cpu_offload=True, cpu_cache_ratio=0.5)
    bm, sched = engine.block_manager, engine.scheduler
    rids = [engine.add_request(p, params) for p in prompts]
    while len(sched.running) < 4 or any(s.num_computed_tokens < 70 for s in sched.running):
        engine.step()
    before = bm.num_used
    assert before < 4 * 5  # the prompt's four blocks once, a block or two of each's own
    for seq in list(sched.running):
        assert sched.preempt(seq) == "swap"
    assert len(sched.swapped) == 4
    outs: dict[str, list[int]] = {}
    while len(sched.running) < 4:
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    assert bm.num_used <= before + 4  # not 4 x the shared prompt again
    shared = set.intersection(*(set(s.block_table[:4]) for s in sched.running))
    assert len(shared) == 4
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    assert [outs[r] for r in rids] == want
    bm.audit([])
