"""The engine at pipeline_parallel > 1 (CPU, gloo, fp32, the tiny model's two layers): each
stage a tensor-parallel group of worker processes, the residual stream passed stage to stage,
the logits sent back to rank 0, and every remedy applied on every stage.

A pipeline computes exactly what one process computes, only in other processes, whether a
step's batch goes through whole (one micro-batch: stages take turns) or split into micro-batches
that the stages work on at once: greedy tokens must be identical and the last logits equal
within 1e-4.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.engine import EngineConfig, LLMEngine
from kvguard.engine.config import ConfigError
from kvguard.engine.distributed.errors import RankFailure
from kvguard.engine.distributed.worker import SLOW_FIRST_STEP_ENV
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


@pytest.mark.parametrize("slow_rank", [0, 1], ids=["first-stage", "last-stage"])
def test_a_stage_computing_longer_than_the_timeout_is_not_a_failed_rank(
    want, monkeypatch: pytest.MonkeyPatch, slow_rank: int
) -> None:  # noqa: ANN001
    """One stage takes 4x `tensor_parallel_timeout` over its first step (a long prompt's
    prefill on a slow stage): the transfers wait for it, and the tokens are the one-process
    tokens with every worker still alive. Before, the wait for its output gave up after the
    timeout and the engine failed for good: rank 0's wait for the logits when the last stage
    was slow, the worker's wait for the hidden states (exit 1) when rank 0 was. While rank 0
    waits it passes the stage's heartbeats on as its own: the engine loop is not stalled."""
    monkeypatch.setenv(SLOW_FIRST_STEP_ENV, f"{slow_rank}:4")
    eng = engine(pp=2, tensor_parallel_timeout_s=1.0)
    pids = eng.runner.worker_pids()
    if slow_rank == 0:  # rank 0 is this process: its first forward, four seconds longer
        forward = eng.runner._forward

        def slow_once(inp):  # noqa: ANN001, ANN202 - StepInput -> Tensor
            eng.runner._forward = forward
            time.sleep(4)
            return forward(inp)

        eng.runner._forward = slow_once
    beats: list[float] = []  # rank 0's heartbeat (the engine loop's, for the watchdog)
    eng.runner.on_layer = lambda: beats.append(time.monotonic())
    try:
        assert run(eng) == want[0]
        eng.check_ranks()
        assert set(pids) <= set(_children())
        if slow_rank == 1:  # rank 0 waits 4 s, hearing stage 1 compute: it beats on meanwhile
            assert max(b - a for a, b in zip(beats, beats[1:], strict=False)) < 2.0
    finally:
        eng.shutdown()


@contextlib.contextmanager
def _stage_mid_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int) -> Iterator[tuple]:
    """A pp=2 engine (1 s timeout) whose worker `rank` computes a 60 s first step, started in a
    thread: yields (its pid, the step's outcome list, the stepping thread) once the worker is
    inside that step. The worker is let go and the engine shut down after."""
    mark = tmp_path / "computing"
    monkeypatch.setenv(SLOW_FIRST_STEP_ENV, f"{rank}:60:{mark}")
    eng = engine(pp=2, tensor_parallel_timeout_s=1.0)
    pid = eng.runner.worker_pids()[rank - 1]
    outcome: list[BaseException] = []

    def step() -> None:
        try:
            eng.add_request(PROMPTS[0], GREEDY)
            eng.step()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    stepper = threading.Thread(target=step, daemon=True)
    try:
        stepper.start()
        while not mark.exists():  # the worker is in its step's compute
            assert stepper.is_alive(), f"the step ended first: {outcome!r}"
            time.sleep(0.01)
        yield pid, outcome, stepper
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        eng.shutdown()
    assert pid not in _children()


def _named_within_the_timeout(
    pid: int, sig: int, outcome: list, stepper: threading.Thread
) -> RankFailure:
    """Send the worker `sig`; the step's RankFailure once it comes within the timeout (1 s)
    and the death grace, long before the worker's 60 s step would end."""
    t0 = time.monotonic()
    os.kill(pid, sig)
    stepper.join(30)
    assert not stepper.is_alive(), "rank 0 is still waiting for the stage"
    assert time.monotonic() - t0 < 1.0 + 10
    assert outcome and isinstance(outcome[0], RankFailure), repr(outcome)
    return outcome[0]


@pytest.mark.parametrize(
    ("sig", "named"),
    [(signal.SIGKILL, "killed by signal 9"), (signal.SIGSTOP, "is stopped")],
    ids=["killed", "stopped"],
)
def test_a_stage_killed_or_stopped_mid_step_is_named_within_the_timeout(
    tiny_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: int, named: str
) -> None:  # noqa: ANN001
    """Waiting as long as a stage computes does not wait for a dead or stopped one: a stage
    killed or stopped in the middle of its step fails the step within the timeout, naming it."""
    with _stage_mid_step(tmp_path, monkeypatch, rank=1) as (pid, outcome, stepper):
        err = _named_within_the_timeout(pid, sig, outcome, stepper)
        assert err.rank == 1 and named in str(err), str(err)


def test_the_stopped_rank_is_named_not_the_one_whose_collective_timed_out(tiny_dir) -> None:  # noqa: ANN001
    """tp 2 x pp 2 with rank 3 stopped: its stage peer, rank 2, waits for it in an all-reduce
    that times out there, and exits 1 reporting it. The failure names rank 3, the cause, within
    the timeout: before, rank 0 named rank 2 as "died: exit code 1"."""
    eng = engine(tp=2, pp=2, tensor_parallel_timeout_s=1.0)
    pid = eng.runner.worker_pids()[2]  # rank 3
    try:
        os.kill(pid, signal.SIGSTOP)
        eng.add_request(PROMPTS[0], GREEDY)
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as err:
            eng.step()
        assert time.monotonic() - t0 < 1.0 + 10
        assert err.value.rank == 3 and "is stopped" in str(err.value), str(err.value)
    finally:
        os.kill(pid, signal.SIGCONT)
        eng.shutdown()
    assert pid not in _children()
