"""CUDA-graph decode: the bucketing and padding on CPU (the capture itself needs a GPU: see
bench/gpu_e2e.py), with the real tiny-shaped model running the graph's forward on a padded step
through the Triton kernels in the interpreter (conftest sets TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.cuda_graphs import (
    DEFAULT_BUCKETS,
    NO_SLOT,
    DecodeGraphs,
    DecodeInputs,
    StaticBuffers,
    bucket_for,
    decode_inputs,
    graph_buckets,
    model_decode_forward,
    pad_decode,
    table_width,
)
from kvguard.engine.model_runner import CUDA_GRAPHS_ENV, cuda_graphs_wanted
from kvguard.engine.random_model import random_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import step_apply  # noqa: E402

FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens")


def test_buckets_end_at_max_num_seqs() -> None:
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert graph_buckets(5) == (1, 2, 4, 5)
    assert graph_buckets(1) == (1,)
    assert graph_buckets(1000)[-2:] == (256, 1000)
    with pytest.raises(ValueError):
        graph_buckets(0)


@given(st.integers(1, 300), st.integers(0, 320))
def test_bucket_is_the_smallest_that_holds_the_batch(max_seqs: int, n: int) -> None:
    buckets = graph_buckets(max_seqs, DEFAULT_BUCKETS)
    b = bucket_for(n, buckets)
    if n == 0 or n > max_seqs:
        assert b is None
        return
    assert b is not None and b >= n
    assert all(smaller < n for smaller in buckets if smaller < b)


def test_table_width_covers_max_model_len() -> None:
    assert table_width(4096, 16) == 256
    assert table_width(4097, 16) == 257


def _inputs(n: int, width: int) -> DecodeInputs:
    return DecodeInputs(
        torch.arange(10, 10 + n),
        torch.arange(20, 20 + n),
        torch.arange(100, 100 + n),
        torch.arange(n * width, dtype=torch.int32).view(n, width),
        torch.arange(30, 30 + n, dtype=torch.int32),
    )


def test_padding_rows_write_nothing_and_read_nothing() -> None:
    real = _inputs(3, 2)
    p = pad_decode(real, bucket=4, width=5)
    assert p.rows == 4 and p.block_tables.shape == (4, 5)
    assert torch.equal(p.input_ids[:3], real.input_ids)
    assert torch.equal(p.positions[:3], real.positions)
    assert torch.equal(p.slot_mapping[:3], real.slot_mapping)
    assert torch.equal(p.block_tables[:3, :2], real.block_tables)
    assert torch.equal(p.seq_lens[:3], real.seq_lens)
    # dummy row: token 0 at position 0, no KV slot (-1: skipped), length 0 (nothing read)
    dummy = (p.input_ids[3], p.positions[3], p.slot_mapping[3], p.seq_lens[3])
    assert dummy == (0, 0, NO_SLOT, 0)
    assert p.seq_lens.dtype == torch.int32 and p.block_tables.dtype == torch.int32


def test_a_step_too_big_for_the_bucket_is_refused() -> None:
    with pytest.raises(ValueError):
        pad_decode(_inputs(5, 2), bucket=4, width=5)
    with pytest.raises(ValueError):
        pad_decode(_inputs(2, 6), bucket=4, width=5)


def test_static_buffers_are_loaded_in_place() -> None:
    bufs = StaticBuffers(8, 5, device=torch.device("cpu"))
    before = bufs.inp.input_ids.data_ptr()
    padded = pad_decode(_inputs(3, 2), 4, 5)
    bufs.load(padded)
    view = bufs.view(4)
    assert bufs.inp.input_ids.data_ptr() == before  # graphs keep reading the same memory
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens"):
        assert torch.equal(getattr(view, name), getattr(padded, name))


def test_a_recapture_warms_up_on_padding_not_on_the_last_steps_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The eager run before each capture writes K/V: after `invalidate` (the pool converted
    or resized) the buffers held the last replayed step's slots and tables, block ids of the
    old pool (past a shrunk pool's end, or another sequence's now). It must see padding only.
    torch.cuda's stream and graph calls are stood in for, so `capture` itself runs on CPU."""

    class _Stream:
        def wait_stream(self, other: object) -> None:
            pass

    class _Graph:
        def pool(self) -> None:
            return None

        def replay(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    seen: list[tuple[list[int], list[int], list[int]]] = []

    def forward(*args: torch.Tensor) -> torch.Tensor:
        _ids, _pos, slots, tables, lens = args
        seen.append((slots.tolist(), lens.tolist(), tables.flatten().tolist()))
        return torch.zeros(slots.shape[0], 4)

    graphs = DecodeGraphs(forward, graph_buckets(4), 3, torch.device("cpu"))
    graphs.run(_inputs(3, 2))  # the first capture, then the step loaded and replayed
    graphs.invalidate()
    seen.clear()
    graphs.run(_inputs(1, 1))  # the recapture's warm-ups (and captures) see padding only
    assert graphs.captures == 2 and len(seen) == 2 * len(graph_buckets(4))
    for slots, lens, table in seen:
        assert set(slots) == {NO_SLOT} and set(lens) == {0} and set(table) == {0}


def test_a_batch_above_the_largest_bucket_runs_eagerly() -> None:
    graphs = DecodeGraphs(lambda *a: a[0], (1, 2), 4, torch.device("cpu"))
    assert graphs.run(_inputs(3, 2)) is None  # no capture attempted (that needs CUDA)
    assert graphs.captures == 0


def test_graphs_are_on_by_default_on_one_cuda_rank_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default since a device run (bench/gpu_e2e.py on an H200) gave eager's tokens
    and a 5-7x decode speed-up; the knob and the environment can still turn them off."""
    monkeypatch.delenv(CUDA_GRAPHS_ENV, raising=False)
    cfg = EngineConfig(model="tiny")
    assert cfg.cuda_graphs is True
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cuda_graphs_wanted(cfg, cuda, 1)
    assert not cuda_graphs_wanted(cfg, cpu, 1)
    assert not cuda_graphs_wanted(cfg, cuda, 2)  # tensor parallel: not yet
    assert not cuda_graphs_wanted(EngineConfig(model="tiny", cuda_graphs=False), cuda, 1)
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "1")
    assert cuda_graphs_wanted(EngineConfig(model="tiny", cuda_graphs=False), cuda, 1)
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "0")
    assert not cuda_graphs_wanted(cfg, cuda, 1)


def _decode_state(n: int) -> tuple:
    """An engine whose next step decodes `n` sequences of different lengths, and that step's
    prepared tensors (blocks allocated, nothing run yet)."""
    eng = random_engine(
        "tiny",
        EngineConfig(
            model="random:tiny", device="cpu", num_gpu_blocks=64, max_num_seqs=8, max_model_len=256
        ),
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(n):
        eng.add_request([5 + i] * (7 + 9 * i), params)
    for _ in range(3):
        eng.step()
    batch = eng.scheduler.schedule()
    assert batch.num_tokens == [1] * n
    return eng, batch, eng.runner.prepare(batch.seqs, batch.num_tokens)


def _kv(eng) -> list[torch.Tensor]:  # noqa: ANN001
    return [t for layer in eng.kv_cache.layers for t in layer[:2]]


def test_graph_forward_of_a_padded_step_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward a graph captures, run on a padded step with the Triton kernels in the
    interpreter (the KV write the graph path uses skips slot -1; the torch one cannot): the real
    rows' hidden states and KV writes equal the eager step's, and no other slot changes."""
    from kvguard.engine import model as model_module
    from kvguard.kernels import triton_kv

    eng, _batch, step = _decode_state(3)
    inp = decode_inputs(step)
    assert inp is not None
    before = [t.clone() for t in _kv(eng)]
    eager = eng.model(step.input_ids, step.positions, eng.kv_cache.layers, step.meta)
    after_eager = [t.clone() for t in _kv(eng)]
    for t, saved in zip(_kv(eng), before, strict=True):
        t.copy_(saved)  # undo the eager step's writes

    monkeypatch.setattr(model_module, "write_kv", triton_kv.write_kv)
    max_len = eng.max_model_len
    forward = model_decode_forward(eng.model, eng.kv_cache, max_len)
    padded = pad_decode(inp, bucket=8, width=table_width(max_len, eng.config.block_size))
    replayed = forward(*(getattr(padded, f) for f in FIELDS))
    torch.testing.assert_close(replayed[:3], eager, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(replayed).all()
    for got, want, old in zip(_kv(eng), after_eager, before, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        untouched = want == old  # every slot the eager step did not write: bit for bit
        assert torch.equal(got[untouched], old[untouched])


def test_only_all_decode_steps_are_eligible() -> None:
    eng = random_engine("tiny", EngineConfig(model="random:tiny", device="cpu", num_gpu_blocks=16))
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    batch = eng.scheduler.schedule()
    assert batch.num_tokens == [3]  # the prompt's prefill
    assert decode_inputs(eng.runner.prepare(batch.seqs, batch.num_tokens)) is None


def test_a_one_token_prompt_runs_eagerly() -> None:
    """A prompt of one token (or a one-token cached tail or last chunk) is one query row whose
    token is sampled, but a prompt's rows attend by the prefill kernel: no decode graph."""
    eng = random_engine("tiny", EngineConfig(model="random:tiny", device="cpu", num_gpu_blocks=16))
    eng.add_request([5], SamplingParams(max_tokens=4, ignore_eos=True))
    batch = eng.scheduler.schedule()
    assert batch.num_tokens == [1]
    step = eng.runner.prepare(batch.seqs, batch.num_tokens)
    assert step.meta.prompt_rows == [True]
    assert decode_inputs(step) is None


class _ReplayByRerun:
    """Stands in for a captured CUDA graph on CPU: `replay` reruns the captured forward on the
    same static buffers and writes the same output tensor, which is what a graph does."""

    replays = 0

    def __init__(self, forward, args: tuple) -> None:  # noqa: ANN001
        self.forward, self.args = forward, args
        self.out = forward(*args)

    def replay(self) -> None:
        type(self).replays += 1
        with torch.inference_mode():  # the forward's outputs are inference tensors
            self.out.copy_(self.forward(*self.args))


def _capture_on_cpu(self: DecodeGraphs) -> None:
    graphs = {}
    for b in sorted(self.buckets, reverse=True):
        g = _ReplayByRerun(self.forward, tuple(getattr(self.buffers.view(b), f) for f in FIELDS))
        graphs[b] = (g, g.out)
    self._graphs = graphs
    self.captures += 1


def _replaying_engine(monkeypatch: pytest.MonkeyPatch, cfg: EngineConfig) -> LLMEngine:
    """An engine of `cfg` on CPU whose decode steps go through graph replay: capture replaced
    by rerun-on-replay, the Triton KV write (it skips padding rows' slots) in the interpreter."""
    from kvguard.engine import model as model_module
    from kvguard.engine import model_runner
    from kvguard.kernels import triton_kv

    monkeypatch.setattr(model_module, "write_kv", triton_kv.write_kv)
    monkeypatch.setattr(model_runner, "use_triton", lambda *a: True)
    monkeypatch.setattr(DecodeGraphs, "capture", _capture_on_cpu)
    eng = LLMEngine.from_config(cfg, progress=False)
    eng.runner.enable_cuda_graphs(cfg.max_num_seqs, eng.max_model_len)
    return eng


def test_engine_with_graph_replay_gives_the_eager_tokens(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """The runner's whole replay path (eligibility, padding into shrinking buckets as
    sequences finish, static buffers, the FP8 switch dropping graphs, an FP8 pool replaying
    when opted in, and the way back recapturing) on CPU: capture replaced by rerun-on-replay,
    kernels in the interpreter."""
    from kvguard.engine import model_runner

    prompts = [[5 + i] * (3 + 11 * i) for i in range(5)]
    params = [SamplingParams(max_tokens=14 - 2 * i, ignore_eos=True) for i in range(5)]
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", max_num_seqs=8, max_model_len=256)
    eager = LLMEngine.from_config(cfg, progress=False).generate(prompts, params)

    eng = _replaying_engine(monkeypatch, cfg)
    before = _ReplayByRerun.replays
    replayed = eng.generate(prompts, params)
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]
    assert eng.runner.graphs.captures == 1
    assert _ReplayByRerun.replays - before >= 10  # decode steps replayed, not run eagerly

    assert step_apply(eng, eng.set_kv_cache_dtype("fp8_e4m3")).ok
    assert not eng.runner.graphs._graphs  # noqa: SLF001 - dropped with the old pool
    monkeypatch.delenv(model_runner.FP8_GRAPHS_ENV, raising=False)
    fp8_eager = eng.generate(prompts, params)  # FP8: eager, nothing captured
    assert eng.runner.graphs.captures == 1
    # opted in, an FP8 pool replays too: scales grow inside the graph's own KV write kernel
    monkeypatch.setenv(model_runner.FP8_GRAPHS_ENV, "1")
    before = _ReplayByRerun.replays
    fp8_replayed = eng.generate(prompts, params)
    assert [o.token_ids for o in fp8_replayed] == [o.token_ids for o in fp8_eager]
    assert eng.runner.graphs.captures == 2 and _ReplayByRerun.replays - before >= 10
    monkeypatch.delenv(model_runner.FP8_GRAPHS_ENV)
    assert step_apply(eng, eng.set_kv_cache_dtype("auto")).ok
    again = eng.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in eager]
    assert eng.runner.graphs.captures == 3


def test_runs_of_decode_steps_replay_and_give_the_eager_tokens(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """`decode_steps` runs through graph replay: each step of a run is a replay whose token
    ids come from the step before on the device and whose lengths come from the run's one
    copy; the tokens are eager single steps'."""

    prompts = [[5 + i] * (3 + 11 * i) for i in range(4)]
    params = [SamplingParams(max_tokens=15 - 3 * i, ignore_eos=True) for i in range(4)]
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", max_num_seqs=8, max_model_len=256)
    eager = LLMEngine.from_config(cfg, progress=False).generate(prompts, params)

    eng = _replaying_engine(monkeypatch, replace(cfg, decode_steps=4))
    before = _ReplayByRerun.replays
    ran = eng.generate(prompts, params)
    assert [o.token_ids for o in ran] == [o.token_ids for o in eager]
    assert eng.snapshot().counters["steps_ahead"] >= 6
    assert _ReplayByRerun.replays - before >= 10


def test_graph_replay_through_the_skinny_gemms_gives_the_eager_tokens(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """With KVGUARD_TRITON_GEMV=1 a replayed decode step's projections are the skinny GEMMs
    (kernels in the interpreter), one variant per bucket of rows (8, 4, 2, 1 as sequences
    finish): the eager path's tokens."""
    from kvguard.kernels import dispatch, triton_gemv

    prompts = [[5 + i] * (3 + 11 * i) for i in range(5)]
    params = [SamplingParams(max_tokens=10 - 2 * i, ignore_eos=True) for i in range(5)]
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", max_num_seqs=8, max_model_len=256)
    eager = LLMEngine.from_config(cfg, progress=False).generate(prompts, params)

    rows: set[int] = set()
    real = triton_gemv.linear

    def counted(x, w, b=None):  # noqa: ANN001, ANN202
        rows.add(x.numel() // x.shape[-1])
        return real(x, w, b)

    monkeypatch.setattr(triton_gemv, "linear", counted)
    monkeypatch.setenv(dispatch.GEMV_ENV, "1")
    eng = _replaying_engine(monkeypatch, cfg)
    replayed = eng.generate(prompts, params)
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]
    assert {8, 4, 2, 1} <= rows  # every bucket's rows went through the kernel
