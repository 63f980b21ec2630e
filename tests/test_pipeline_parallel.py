"""The engine at pipeline_parallel > 1 (CPU, gloo, fp32, the tiny model's two layers): each
stage a tensor-parallel group of worker processes, the residual stream passed stage to stage,
the logits sent back to rank 0, and every remedy applied on every stage.

A pipeline computes exactly what one process computes, only in other processes, whether a
step's batch goes through whole (one micro-batch: stages take turns) or split into micro-batches
that the stages work on at once: greedy tokens must be identical and the last logits equal
within 1e-4.
"""

from __future__ import annotations

import pytest

from kvguard.engine import EngineConfig, LLMEngine
from kvguard.engine.config import ConfigError
from tests.test_tensor_parallel import GREEDY, PROMPTS, _children, last_logits, run


def engine(tp: int = 1, pp: int = 1, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", "16MiB")
    kw.setdefault("max_model_len", 256)
    kw.setdefault("tensor_parallel_timeout_s", 60.0)
    cfg = EngineConfig(model="tiny", tensor_parallel=tp, pipeline_parallel=pp, **kw)
    return LLMEngine.from_config(cfg, progress=False)


@pytest.fixture(scope="module")
def want(tiny_dir) -> tuple[list[list[int]], object]:  # noqa: ANN001 - a Path fixture
    """One process: the tokens and the first prompt's last logits every layout must give."""
    eng = engine()
    try:
        tokens = run(eng)
        ids = eng.tokenizer.encode(PROMPTS[0])
        return tokens, last_logits(eng, ids + tokens[0])
    finally:
        eng.shutdown()


def assert_same(eng: LLMEngine, want: tuple) -> None:
    tokens, logits = want
    got = run(eng)
    assert got == tokens
    ids = eng.tokenizer.encode(PROMPTS[0])
    diff = (last_logits(eng, ids + got[0]) - logits).abs().max().item()
    assert diff <= 1e-4, f"last-logit max|diff| {diff:.2e}"
    eng.audit_blocks()


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_pp2_gives_the_tokens_of_one_process(want, micro_batches: int) -> None:  # noqa: ANN001
    eng = engine(pp=2, pipeline_micro_batches=micro_batches)
    try:
        assert eng.runner.micro_batches == micro_batches
        assert len(eng.runner.worker_pids()) == 1
        assert list(eng.model.stage.layers) == [0]  # rank 0 holds the first layer only
        assert len(eng.kv_cache.layers) == 1
        assert_same(eng, want)
    finally:
        eng.shutdown()


def test_pp2_by_tp2_four_processes_give_the_tokens_of_one_process(want) -> None:  # noqa: ANN001
    eng = engine(tp=2, pp=2)
    pids = eng.runner.worker_pids()
    try:
        assert len(pids) == 3
        assert eng.runner.kv_bytes_per_rank() == [eng.kv_cache.device_pool.nbytes] * 4
        assert_same(eng, want)
    finally:
        eng.shutdown()
    assert not set(pids) & set(_children())


def _switch_mid_generation(**kw) -> tuple[list[list[int]], str]:
    eng = engine(**kw)
    try:
        rids = [eng.add_request(p, GREEDY) for p in PROMPTS]
        for _ in range(6):
            eng.step()
        fut = eng.set_kv_cache_dtype("fp8_e4m3")
        outs: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out.final_token_ids
        result = fut.result(timeout=0)
        assert result.ok, result.detail
        eng.audit_blocks()
        return [outs[r] for r in rids], eng.kv_cache.dtype
    finally:
        eng.shutdown()


def test_fp8_switch_mid_generation_under_pp2_gives_the_tokens_of_one_process(tiny_dir) -> None:
    want_tokens, dtype1 = _switch_mid_generation()
    got, dtype2 = _switch_mid_generation(pp=2)
    assert dtype1 == dtype2 == "fp8_e4m3"
    assert got == want_tokens


def test_swap_and_an_oom_on_the_last_stage_lose_nothing_under_pp2(want) -> None:  # noqa: ANN001
    # a pool of a few blocks per request: sequences are preempted to the host pool and back
    eng = engine(pp=2, num_gpu_blocks=24, enable_cpu_offload=True, cpu_cache_ratio=0.5)
    try:
        seen: list[str] = []
        eng.events.subscribe(lambda ev: seen.append(ev.kind))
        rids = [eng.add_request(p, GREEDY) for p in PROMPTS]
        eng.step()
        eng.runner.inject_oom(1, rank=1)  # rank 1 is the last stage
        outs: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out.final_token_ids
        assert seen.count("engine_oom") == 1
        assert eng.scheduler.preemptions["swap"] > 0, "the pool was meant to force swapping"
        eng.audit_blocks()
    finally:
        eng.shutdown()
    assert [outs[r] for r in rids] == want[0]


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"pipeline_parallel": 3}, r"pipeline_parallel=3 exceeds the model's 2 decoder layers"),
        (
            {"pipeline_parallel": 2, "pipeline_layers": [2, 1]},
            r"pipeline_layers=\[2, 1\] sums to 3, but the model has 2 decoder layers",
        ),
    ],
    ids=["more-stages-than-layers", "layers-miss-the-model"],
)
def test_a_split_the_model_cannot_take_is_refused_before_spawning(
    tiny_dir, kw: dict, problem: str
) -> None:  # noqa: ANN001
    before = set(_children())
    with pytest.raises(ConfigError, match=problem):
        LLMEngine.from_config(EngineConfig(model="tiny", **kw), progress=False)
    assert set(_children()) == before


@pytest.mark.parametrize(
    ("layers", "problem"),
    [
        ([2], r"pipeline_layers=\[2\]: 1 stages given but pipeline_parallel=2"),
        ([0, 2], r"pipeline_layers=\[0, 2\]: every stage needs at least one decoder layer"),
    ],
)
def test_pipeline_layers_of_the_wrong_shape_are_refused(layers: list[int], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        EngineConfig(model="tiny", pipeline_parallel=2, pipeline_layers=layers)


def test_micro_batches_of_a_decode_step_send_block_table_deltas(tiny_dir) -> None:  # noqa: ANN001
    eng = engine(pp=2, pipeline_micro_batches=2)
    try:
        for p in PROMPTS:
            eng.add_request(p, GREEDY)
        eng.step()  # prefill: whole tables and prompt ids
        st = eng.runner.stats
        first = st.message_bytes
        for _ in range(8):
            eng.step()
        per_decode = (st.message_bytes - first) / 8
        # two messages a step, four sequences each, one token each, tables as deltas
        assert per_decode < 900, f"{per_decode:.0f} bytes per decode step"
    finally:
        eng.shutdown()
