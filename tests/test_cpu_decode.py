"""The CPU fast path (`kvguard.engine.cpu_decode`): every step of the packed default model
(whole prompts, decode rows, and prompt chunks beside decode rows) runs each layer in one C
call and gives the per-op path's logits bit for bit, on an fp32 pool and after a live switch
to fp8, fp16 or bf16; steps it does not serve (the CPU kernels off, an fp32 model) run the
per-op path."""

from __future__ import annotations

import threading

import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.cpu_decode import CpuDecode
from kvguard.engine.model import AttentionMetadata, StepInterrupted
from kvguard.kernels import cpu_layer, cpu_ops

# lengths that put the decode tokens on both sides of 16-token block edges
PROMPTS = [[100 + 7 * i + j for j in range(n)] for i, n in enumerate((5, 15, 16, 31, 47))]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
# queued after the first steps: its prompt goes in chunks beside the others' decode rows
LATE = [200 + (13 * j) % 900 for j in range(300)]
MIXED: list[int] = []  # a mark for each C layer call with both decode rows and prompt chunks


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # each test runs one workload twice (C path, per-op path) and compares them step by step:
    # the prefix cache would let the second run skip the first's prompt blocks
    cfg = EngineConfig(
        model="smollm2-135m",
        kv_cache_bytes="64MiB",
        num_threads=2,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    eng = LLMEngine.from_config(cfg, progress=False)
    yield eng
    eng.shutdown()


def run(eng: LLMEngine, fused: bool, late: bool = False) -> tuple[list, list, int]:
    """Every step's logits, the tokens, and how many layer calls took the C path; `late`
    queues LATE after three steps, so later steps mix its prompt chunks with decode rows."""
    logits, calls = [], []
    compute, run_layer = eng.model.compute_logits, cpu_layer.run_layer

    def record(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        logits.append(out.clone())
        return out

    def count(*args: object) -> None:
        step = args[1]
        calls.append(1)
        if step.B and step.S:  # decode rows and prompt chunks in one call
            MIXED.append(1)
        run_layer(*args)

    eng.model.compute_logits, cpu_layer.run_layer = record, count
    eng.model.fuse_cpu_decode = fused
    try:
        if not late:
            tokens = [o.final_token_ids for o in eng.generate(PROMPTS, GREEDY)]
        else:
            ids = [eng.add_request(p, GREEDY) for p in PROMPTS]
            done: dict[str, list[int]] = {}
            for _ in range(3):
                done.update((o.request_id, o.final_token_ids) for o in eng.step() if o.finished)
            ids.append(eng.add_request(LATE, GREEDY))
            while eng.has_unfinished():
                done.update((o.request_id, o.final_token_ids) for o in eng.step() if o.finished)
            tokens = [done[i] for i in ids]
    finally:
        eng.model.fuse_cpu_decode = True
        eng.model.compute_logits, cpu_layer.run_layer = compute, run_layer
    return logits, tokens, len(calls)


@pytest.mark.parametrize("late", [False, True], ids=["prompts then decode", "mixed steps"])
def test_every_step_takes_one_call_a_layer_and_gives_the_per_op_logits(
    engine: LLMEngine, late: bool
) -> None:
    MIXED.clear()
    fused_logits, fused_tokens, calls = run(engine, True, late)
    plain_logits, plain_tokens, none = run(engine, False, late)
    layers = engine.model.cfg.num_layers
    assert isinstance(engine.model._cpu_plan, CpuDecode)
    # every step (one logits call each) is one C call a layer
    assert none == 0 and calls == layers * len(fused_logits)
    assert all(len(t) == GREEDY.max_tokens for t in fused_tokens)
    assert bool(MIXED) == late  # LATE's chunks went beside decode rows, and only then
    assert fused_tokens == plain_tokens
    assert len(fused_logits) == len(plain_logits)
    for a, b in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp16", "bf16"])
def test_a_live_switched_pool_keeps_the_c_path_and_its_logits_equal_the_per_op_ones(
    engine: LLMEngine, dtype: str
) -> None:
    """After a live KV switch decode steps still run one call a layer (the C write stores the
    pool's type, fp8 with its growing scales), with the per-op path's logits bit for bit; the
    switch back gives the fp32 tokens again."""
    _, before, _ = run(engine, True)
    assert engine.set_kv_cache_dtype(dtype) and engine.step() == []
    try:
        assert engine.kv_cache.dtype == dtype
        fused_logits, fused_tokens, calls = run(engine, True)
        plain_logits, plain_tokens, none = run(engine, False)
        assert none == 0 and calls > 0 and calls % engine.model.cfg.num_layers == 0
        assert all(len(t) == GREEDY.max_tokens for t in fused_tokens)
        assert fused_tokens == plain_tokens
        for a, b in zip(fused_logits, plain_logits, strict=True):
            assert torch.equal(a, b)
    finally:
        fut = engine.set_kv_cache_dtype("auto")
        engine.step()
        assert fut.result(timeout=5).ok
    _, after, calls = run(engine, True)
    assert calls > 0 and after == before


def test_with_the_cpu_kernels_off_no_step_takes_the_c_path(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cpu_ops.ENV, "0")
    cpu_ops.reset()
    try:
        _, _, calls = run(engine, True)
    finally:
        monkeypatch.delenv(cpu_ops.ENV)
        cpu_ops.reset()  # the switch is read once: read it again without the variable
    assert calls == 0


def test_a_set_stop_interrupts_a_c_path_step_between_layers(engine: LLMEngine) -> None:
    plan = engine.model._cpu_plan
    assert isinstance(plan, CpuDecode)
    stop = threading.Event()
    stop.set()
    h = engine.model.cfg.hidden_size
    x = torch.zeros(1, h)
    cos = sin = torch.zeros(1, 1, engine.model.cfg.head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0]),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=[1],
        query_lens=[1],
    )
    with pytest.raises(StepInterrupted):
        plan.run(x, cos, sin, engine.kv_cache.layers, meta, stop)


def test_an_fp32_model_has_no_c_path_plan() -> None:
    cfg = EngineConfig(model="tiny", kv_cache_bytes="16MiB", num_threads=2)
    eng = LLMEngine.from_config(cfg, progress=False)
    try:
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert eng.model._cpu_plan is None
    finally:
        eng.shutdown()


def test_a_qkv_bias_is_added_alike_on_both_paths() -> None:
    """Qwen2-style checkpoints carry a qkv bias: the C path adds it as torch does."""
    cfg = EngineConfig(model="smollm2-135m", kv_cache_bytes="32MiB", num_threads=2, max_num_seqs=8)
    eng = LLMEngine.from_config(cfg, progress=False)
    try:
        gen = torch.Generator().manual_seed(0)
        for layer in eng.model.layers:
            qkv = layer.self_attn.qkv_proj
            qkv.bias = torch.randn(qkv.out_features, generator=gen) * 0.5
        fused_logits, _, calls = run(eng, True)
        plain_logits, _, _ = run(eng, False)
        assert calls > 0
        for a, b in zip(fused_logits, plain_logits, strict=True):
            assert torch.equal(a, b)
    finally:
        eng.shutdown()


def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(
    engine: LLMEngine,
) -> None:
    plan = engine.model._cpu_plan
    assert isinstance(plan, CpuDecode)
    pools = engine.kv_cache.layers
    slots = pools[0][0].shape[0] * pools[0][0].shape[1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slots]),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=[1],
        query_lens=[1],
    )
    x = torch.ones(1, engine.model.cfg.hidden_size)
    before = x.clone()
    cos = sin = torch.zeros(1, 1, engine.model.cfg.head_dim)
    with pytest.raises(IndexError, match="outside the pool"):
        plan.run(x, cos, sin, pools, meta)
    assert torch.equal(x, before)
