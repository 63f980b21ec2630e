"""The engine against Hugging Face transformers, and its scheduling and accounting invariants."""

from __future__ import annotations

import logging

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.engine import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from kvguard.engine.config import ConfigError, kvguard_home
from kvguard.engine.model_registry import resolve_model

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colours:",
    "Once upon a time, in a small village,",
    "Explain what a KV cache is in one sentence.",
    "1, 2, 3, 4, 5,",
    "Translate 'good morning' into German:",
]


def make_engine(model: str = "tiny", **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", "32MiB")
    kw.setdefault("num_threads", 2)
    return LLMEngine.from_config(EngineConfig(model=model, **kw), progress=False)


@pytest.fixture(scope="module")
def tiny() -> LLMEngine:
    return make_engine()


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def compare_with_hf(engine: LLMEngine, model_name: str, prompts: list[str], n: int) -> None:
    hf = hf_model(resolve_model(model_name, kvguard_home(), progress=False))
    chats = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
    ]
    ids = [engine.tokenizer.encode(c) for c in chats]
    outs = engine.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True))
    for prompt_ids, out in zip(ids, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt_ids, n), f"diverged on {prompt_ids[:8]}..."
        assert out.finish_reason == "length"
        with torch.no_grad():
            # the tokens' columns, as `score` gives them (tests/test_head_rows.py)
            ref = hf(torch.tensor([prompt_ids])).logits[0, -1, : engine.runner.vocab]
        ours = engine.score(prompt_ids)[-1]
        assert (ours - ref).abs().max().item() <= 1e-3
    engine.audit_blocks()


def test_tiny_matches_transformers(tiny: LLMEngine) -> None:
    compare_with_hf(tiny, "tiny", PROMPTS, 32)


@pytest.mark.slow
def test_smollm2_matches_transformers() -> None:
    # transformers dequantises the GGUF: the reference is our fp32 path, not the packed one
    engine = make_engine("smollm2-135m", kv_cache_bytes="64MiB", model_quantization="none")
    compare_with_hf(engine, "smollm2-135m", PROMPTS, 32)


def test_chunked_prefill_equals_whole_prefill(tiny: LLMEngine) -> None:
    """A prompt split over many steps (budget 7 tokens) gives the same tokens as one pass."""
    chunked = make_engine(max_num_batched_tokens=7)
    ids = tiny.tokenizer.encode(PROMPTS[4] * 3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert chunked.generate([ids], params)[0].token_ids == tiny.generate([ids], params)[0].token_ids


def test_preempted_request_recomputes_same_tokens(tiny: LLMEngine) -> None:
    """A pool too small for the batch forces recompute preemption; outputs must not change."""
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    ids = [tiny.tokenizer.encode(p) for p in PROMPTS]
    calm = tiny.generate(ids, params)
    squeezed = make_engine(num_gpu_blocks=12)
    outs = squeezed.generate(ids, params)
    assert squeezed.snapshot().num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in calm]
    squeezed.audit_blocks()
    assert squeezed.snapshot().blocks_free == squeezed.snapshot().blocks_total


def test_seeded_sampling_is_reproducible(tiny: LLMEngine) -> None:
    # tiny's logits are sharply peaked (so greedy has no ties): sample hot to see randomness
    params = SamplingParams(max_tokens=20, temperature=8.0, top_p=0.95, top_k=200, seed=1234)
    a = tiny.generate([PROMPTS[0], PROMPTS[1]], [params, params])
    b = tiny.generate([PROMPTS[1], PROMPTS[0]], [params, params])
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids
    other = tiny.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=20, temperature=8.0, top_p=0.95, top_k=200, seed=99)
    )
    assert other[0].token_ids != a[0].token_ids


def test_stop_strings_and_stop_tokens(tiny: LLMEngine) -> None:
    free = tiny.generate([PROMPTS[2]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    cut = tiny.generate([PROMPTS[2]], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[
        0
    ]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    tok = free.token_ids[5]
    by_id = tiny.generate([PROMPTS[2]], SamplingParams(max_tokens=40, stop_token_ids=[tok]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == tok
    assert tok not in by_id.token_ids[:-1]


def test_abort_frees_blocks(tiny: LLMEngine) -> None:
    rid = tiny.add_request(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
    tiny.step()
    assert tiny.snapshot().blocks_used > 0
    assert tiny.abort(rid)
    outs = tiny.step()
    assert [o.finish_reason for o in outs if o.request_id == rid] == ["abort"]
    assert not tiny.has_unfinished()
    assert tiny.snapshot().blocks_used == 0
    assert not tiny.abort(rid)


# -- bad input --------------------------------------------------------------------------------


def test_bad_requests_are_rejected_and_others_unaffected(tiny: LLMEngine) -> None:
    good = tiny.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny.add_request("")
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny.add_request([])
    with pytest.raises(ValueError, match="max_model_len"):
        tiny.add_request([5] * (tiny.max_model_len + 1))
    with pytest.raises(ValueError, match="max_tokens"):
        tiny.add_request("hi", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.add_request([1, 2, 10**9])
    with pytest.raises(ValueError, match="priority"):
        tiny.add_request("hi", priority="urgent")
    with pytest.raises(ValueError, match="already in use"):
        tiny.add_request("hi", request_id=good)
    done = {}
    while tiny.has_unfinished():
        for o in tiny.step():
            done[o.request_id] = o
    assert done[good].finish_reason == "length" and len(done[good].token_ids) == 8


def test_generate_is_all_or_nothing_and_hands_other_requests_outputs_on(
    tiny: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generate() adds its prompts one by one: one refused, or any exception while they run,
    aborts those it added (their ids never reached the caller: they used to stay queued and
    come out of the caller's next step()). A request added before with add_request runs on
    beside them, and its outputs of generate's steps come out of the next step(), in order
    (it used to be run to completion and its outputs dropped)."""
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny.generate([PROMPTS[0], PROMPTS[1], ""], SamplingParams(max_tokens=5))
    assert not tiny.has_unfinished() and tiny.snapshot().blocks_used == 0
    assert tiny.step() == []

    mine = tiny.add_request(PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True))
    outs = tiny.step()
    got = tiny.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(got[0].token_ids) == 3
    assert tiny.has_unfinished()  # mine: not run to its end by generate
    while tiny.has_unfinished():
        outs += tiny.step()
    assert {o.request_id for o in outs} == {mine}
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    whole = [t for o in outs for t in o.new_token_ids]
    assert len(whole) == 12 and whole == outs[-1].token_ids

    # a step that raises inside generate (here an interrupt): its requests are aborted too
    schedule, calls = tiny.scheduler.schedule, []

    def interrupted():  # noqa: ANN202 - a ScheduledBatch
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return schedule()

    monkeypatch.setattr(tiny.scheduler, "schedule", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    monkeypatch.undo()
    assert not tiny.has_unfinished() and tiny.snapshot().blocks_used == 0
    assert tiny.step() == []
    tiny.audit_blocks()


def test_library_inputs_are_read_as_meant_or_refused_by_name(tiny: LLMEngine) -> None:
    """Token ids as numpy or torch integers are token ids (they were refused as "outside the
    vocabulary"); bytes (read as ids before), strings, floats and bools in a list are not.
    Wrong types in SamplingParams, score()'s bad input and any use after shutdown() raise a
    ValueError or RuntimeError naming the cause (before: TypeError, IndexError from torch, or
    at tp > 1 a RankFailure blaming a rank)."""
    greedy4 = SamplingParams(max_tokens=4, ignore_eos=True)
    want = tiny.generate([[5, 6, 7]], greedy4)[0].token_ids
    for ids in (numpy.array([5, 6, 7]), torch.tensor([5, 6, 7]), [numpy.int32(5), 6, 7]):
        assert tiny.generate([ids], greedy4)[0].token_ids == want
    for bad, said in (
        (b"hi", "^prompt: expected a list of int token ids, not bytes"),
        (["a", 5], r"^prompt holds \['a'\]: expected a list of int token ids"),
        ([5, 6.0], r"^prompt holds \[6.0\]: expected a list of int token ids"),
        ([5, True], r"^prompt holds \[True\]: expected a list of int token ids"),
        (torch.tensor([1.5]), "^prompt holds .*: expected a list of int token ids"),
        (None, "^prompt=None: expected a string or a list of int token ids"),
        (5, "^prompt=5: expected a string or a list of int token ids"),
    ):
        with pytest.raises(ValueError, match=said):
            tiny.add_request(bad)
    with pytest.raises(ValueError, match="^request_id=5: expected a string"):
        tiny.add_request("hi", request_id=5)
    assert not tiny.has_unfinished()
    for bad in (
        {"temperature": None},
        {"temperature": "0.5"},
        {"temperature": True},
        {"top_p": "0.9"},
        {"top_p": None},
        {"top_k": True},
        {"top_k": 2.0},
        {"seed": True},
    ):
        with pytest.raises(ValueError, match=f"^{next(iter(bad))}="):
            SamplingParams(**bad)
    vocab, limit = tiny.model_config.vocab_size, tiny.max_model_len
    with pytest.raises(ValueError, match="^score: token_ids is empty"):
        tiny.score([])
    with pytest.raises(ValueError, match=rf"^score token ids \[{vocab}\] are outside the vocab"):
        tiny.score([1, vocab])
    with pytest.raises(ValueError, match=f"^score: {limit + 1} token ids are more than max_model"):
        tiny.score([5] * (limit + 1))
    assert tiny.score(numpy.array([5, 6, 7])).shape == (3, tiny.tokenizer.vocab_size)
    assert tiny.snapshot().blocks_used == 0

    done = make_engine()
    done.shutdown()
    for use in (
        lambda: done.add_request("hi"),
        done.step,
        lambda: done.generate(["hi"]),
        lambda: done.score([5]),
        done.check_ranks,
    ):
        with pytest.raises(RuntimeError, match="^engine is shut down"):
            use()


def test_prompt_larger_than_pool_is_rejected_at_once() -> None:
    small = make_engine(num_gpu_blocks=4)  # 64 tokens in the whole pool
    with pytest.raises(ValueError, match="whole pool has 4"):
        small.add_request([7] * 100)
    assert not small.has_unfinished()


def test_unknown_model_and_bad_config() -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        make_engine("no-such-model")
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        EngineConfig(kv_cache_bytes="lots")
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=7)


# -- block accounting property test -----------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 90),
            st.integers(1, 40),
            st.sampled_from(["high", "normal", "low"]),
        ),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just("")),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just("")),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_block_accounting_under_random_traffic(ops) -> None:
    engine = _property_engine()
    rids: list[str] = []
    for op, a, b, prio in ops:
        if op == "add":
            rids.append(
                engine.add_request(
                    [3 + (i % 200) for i in range(a)],
                    SamplingParams(max_tokens=b, ignore_eos=True),
                    priority=prio,
                )
            )
        elif op == "abort" and rids:
            engine.abort(rids[a % len(rids)])
        else:
            for _ in range(a):
                engine.step()
        engine.audit_blocks()
    while engine.has_unfinished():
        engine.step()
        engine.audit_blocks()
    snap = engine.snapshot()
    assert snap.blocks_free == snap.blocks_total and snap.num_running == snap.num_waiting == 0


_PROP_ENGINE: list[LLMEngine] = []


def _property_engine() -> LLMEngine:
    """One small-pool engine reused across examples (it is idle and empty between them)."""
    if not _PROP_ENGINE:
        _PROP_ENGINE.append(
            make_engine(num_gpu_blocks=24, max_num_seqs=6, max_num_batched_tokens=64)
        )
    engine = _PROP_ENGINE[0]
    assert not engine.has_unfinished()
    return engine


def test_a_failing_step_ends_its_requests_and_the_engine_serves_on(
    tiny: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises (not an OOM) would fail again on every retry and stall everyone:
    its requests end with finish_reason `error`, their blocks are freed, the next request runs."""
    rid = tiny.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    tiny.step()

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("poisoned step")

    with monkeypatch.context() as m:
        m.setattr(tiny.model, "compute_logits", poisoned)
        outs = tiny.step()
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [(rid, "error", True)]
    assert not tiny.has_unfinished() and tiny.snapshot().blocks_used == 0
    assert tiny.snapshot().finished["error"]["normal"] >= 1
    after = tiny.generate([PROMPTS[1]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert after[0].finish_reason == "length" and len(after[0].token_ids) == 5
    tiny.audit_blocks()


def test_max_model_len_over_the_models_own_is_held_to_it_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """serving.max_model_len above the model's max_position_embeddings (the tiny model's 2048)
    is served at the model's length: the start says so, naming both (it was silent)."""
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        engine = make_engine(max_model_len=4096, kv_cache_bytes="8MiB")
    assert engine.max_model_len == 2048
    said = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert said == [
        "serving.max_model_len 4096 is more than the model's max_position_embeddings 2048: "
        "prompt and output are held to 2048 tokens"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        make_engine(max_model_len=2048, kv_cache_bytes="8MiB")
    assert "max_position_embeddings" not in caplog.text
