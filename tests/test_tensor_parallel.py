"""The engine at tensor_parallel > 1 (CPU, gloo, fp32): worker processes spawned by the engine,
one step message per step, and every remedy applied on every rank.

Each case runs the same requests at tp=1 and tp>1 and asks for identical greedy tokens: the
sharded model is exact up to fp32 summation order, and the tiny model's and smollm2's top-1
margins are far above that (the last logits are compared too, within 1e-4).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.config import ConfigError
from kvguard.engine.distributed.errors import RankFailure

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Paris is the capital of",
    "1, 2, 3, 4,",
    "A paged KV cache keeps",
    "Hello",
    "The weather today is sunny and the",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def engine(model: str, tp: int, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", "16MiB")
    kw.setdefault("max_model_len", 256)
    kw.setdefault("tensor_parallel_timeout_s", 60.0)
    return LLMEngine.from_config(
        EngineConfig(model=model, tensor_parallel=tp, **kw), progress=False
    )


def run(eng: LLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.final_token_ids for o in eng.generate(list(prompts), params)]


def last_logits(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    return eng.score(ids)[-1]


def reference(model: str, **kw) -> tuple[list[list[int]], list[torch.Tensor]]:
    eng = engine(model, 1, **kw)
    try:
        tokens = run(eng)
        ids = eng.tokenizer.encode(PROMPTS[0])
        return tokens, [last_logits(eng, ids + tokens[0])]
    finally:
        eng.shutdown()


def assert_parity(model: str, tp: int, **kw) -> LLMEngine | None:
    want_tokens, want_logits = reference(model, **kw)
    eng = engine(model, tp, **kw)
    try:
        assert len(eng.runner.worker_pids()) == tp - 1
        got = run(eng)
        assert got == want_tokens
        ids = eng.tokenizer.encode(PROMPTS[0])
        diff = (last_logits(eng, ids + got[0]) - want_logits[0]).abs().max().item()
        assert diff <= 1e-4, f"last-logit max|diff| {diff:.2e} at tp={tp}"
        eng.audit_blocks()
    finally:
        eng.shutdown()


def test_smollm2_at_tp3_matches_tp1(smollm2_dir) -> None:
    # fp32 weights: exact up to summation order
    assert_parity("smollm2-135m", 3, model_quantization="none")


def test_tiny_at_tp2_matches_tp1(tiny_dir) -> None:
    assert_parity("tiny", 2)


def test_workers_import_the_kvguard_rank_0_runs_whatever_the_cwd(
    tiny_dir, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon started from a directory holding a `kvguard.py` (or a `kvguard/` checkout):
    the workers import the same package as rank 0, not that file (the start used to fail)."""
    (tmp_path / "kvguard.py").write_text(
        'raise RuntimeError("the cwd\'s kvguard.py was imported by a worker")\n'
    )
    monkeypatch.chdir(tmp_path)
    assert_parity("tiny", 2)


def test_tiny_at_tp4_replicates_kv_heads_and_matches_tp1(tiny_dir) -> None:
    # tiny has 2 KV heads: at tp=4 ranks 0,1 hold KV head 0 and ranks 2,3 KV head 1
    assert_parity("tiny", 4)


def test_a_size_that_does_not_divide_the_model_is_refused_before_spawning(smollm2_dir) -> None:
    before = set(_children())
    with pytest.raises(ConfigError, match=r"9 query heads.*tensor_parallel may be 1 or 3"):
        engine("smollm2-135m", 2)
    assert set(_children()) == before


def _switch_mid_generation(tp: int) -> tuple[list[list[int]], str]:
    eng = engine("tiny", tp)
    try:
        rids = [eng.add_request(p, GREEDY) for p in PROMPTS]
        final = {}
        for _ in range(6):
            for out in eng.step():
                final.setdefault(out.request_id, [])
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


def test_fp8_switch_mid_generation_gives_the_tokens_tp1_gives(tiny_dir) -> None:
    want, dtype1 = _switch_mid_generation(1)
    got, dtype2 = _switch_mid_generation(2)
    assert dtype1 == dtype2 == "fp8_e4m3"
    assert got == want


def _resize_mid_generation(tp: int) -> tuple[list[list[int]], list[int]]:
    """Shrink the pool to a quarter mid-generation (preempting), then give it back."""
    eng = engine("tiny", tp, kv_cache_bytes="1MiB", max_model_len=64)
    try:
        rids = [eng.add_request(p, GREEDY) for p in PROMPTS]
        for _ in range(6):
            eng.step()
        sizes = []
        outs: dict[str, list[int]] = {}
        for share in (0.25, 1.0):
            fut = eng.set_kv_pool_share(share)
            for _ in range(8):
                for out in eng.step():
                    if out.finished:
                        outs[out.request_id] = out.final_token_ids
            result = fut.result(timeout=0)
            assert result.ok, result.detail
            sizes.append(eng.block_manager.num_blocks)
            eng.audit_blocks()
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out.final_token_ids
        return [outs[r] for r in rids], sizes
    finally:
        eng.shutdown()


def test_a_pool_resize_mid_generation_gives_the_tokens_tp1_gives(tiny_dir) -> None:
    want, sizes1 = _resize_mid_generation(1)
    got, sizes2 = _resize_mid_generation(2)
    assert got == want and sizes1[0] < sizes1[1] and sizes2[0] < sizes2[1]


def test_preemption_and_swap_under_tp2_lose_nothing(tiny_dir) -> None:
    want, _ = reference("tiny")
    # a pool of a few blocks per request: sequences are preempted to the host pool and back
    kw = {"num_gpu_blocks": 24, "enable_cpu_offload": True, "cpu_cache_ratio": 0.5}
    eng = engine("tiny", 2, **kw)
    try:
        got = run(eng)
        swaps = eng.scheduler.preemptions["swap"]
        eng.audit_blocks()
    finally:
        eng.shutdown()
    assert swaps > 0, "the pool was meant to force swapping"
    assert got == want


def test_an_oom_on_a_worker_rank_requeues_the_step_everywhere(tiny_dir) -> None:
    want, _ = reference("tiny")
    eng = engine("tiny", 2)
    try:
        seen = []
        eng.events.subscribe(lambda ev: seen.append(ev.kind))
        rids = [eng.add_request(p, GREEDY) for p in PROMPTS]
        eng.step()
        eng.runner.inject_oom(1, rank=1)
        outs = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out.final_token_ids
        assert seen.count("engine_oom") == 1
        assert [outs[r] for r in rids] == want
    finally:
        eng.shutdown()


def test_decode_steps_send_block_table_deltas(tiny_dir) -> None:
    eng = engine("tiny", 2)
    try:
        for p in PROMPTS:
            eng.add_request(p, GREEDY)
        eng.step()  # prefill: whole tables and prompt ids
        st = eng.runner.stats
        first = st.message_bytes
        steps = 8
        for _ in range(steps):
            eng.step()
        per_decode = (st.message_bytes - first) / steps
        # 8 sequences, one token each, tables as deltas: a few hundred bytes, not the prompts
        assert per_decode < 600, f"{per_decode:.0f} bytes per decode step"
    finally:
        eng.shutdown()


def test_a_killed_worker_fails_the_engine_clearly_and_leaves_no_process(tiny_dir) -> None:
    eng = engine("tiny", 2)
    pid = eng.runner.worker_pids()[0]
    try:
        eng.add_request(PROMPTS[0], GREEDY)
        eng.step()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as err:
            while eng.has_unfinished():
                eng.step()
        assert time.monotonic() - t0 < 10
        assert err.value.rank == 1 and "killed by signal 9" in str(err.value)
        with pytest.raises(RankFailure):
            eng.check_ranks()  # stays failed: the group cannot be trusted again
    finally:
        eng.shutdown()
    assert pid not in _children()


def test_a_hung_worker_fails_the_engine_within_the_timeout(tiny_dir) -> None:
    eng = engine("tiny", 2, tensor_parallel_timeout_s=3.0)
    with _worker_held(eng) as pid:
        eng.add_request(PROMPTS[0], GREEDY)
        eng.step()
        os.kill(pid, signal.SIGSTOP)  # alive but answering nothing: a hang
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as err:
            while eng.has_unfinished():
                eng.step()
        assert time.monotonic() - t0 < 3.0 + 10
        assert err.value.rank == 1 and "stopped" in str(err.value)


def test_a_hung_worker_fails_the_stage_time_query_within_the_timeout(tiny_dir) -> None:
    """`worker_busy_s` (the pipeline benchmark's per-stage time) asks every worker between
    steps: a worker that answers nothing fails it within the timeout, naming the rank, rather
    than blocking the caller for good."""
    eng = engine("tiny", 2, tensor_parallel_timeout_s=2.0)
    with _worker_held(eng) as pid:
        assert set(eng.runner.worker_busy_s()) == {1}
        os.kill(pid, signal.SIGSTOP)
        out: list[BaseException] = []

        def ask() -> None:
            try:
                eng.runner.worker_busy_s()
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                out.append(e)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(2.0 + 30)  # generous: the answer comes in about 3s
        assert not asker.is_alive(), "worker_busy_s is blocked on the stopped worker"
        assert isinstance(out[0], RankFailure) and out[0].rank == 1, repr(out)
        assert "stopped" in str(out[0])


def test_a_stalled_worker_fails_a_message_larger_than_its_socket_buffer(tiny_dir) -> None:
    """A step message larger than the socket buffer, to a worker that reads nothing: rank 0
    gives up within the timeout naming the rank, never blocks in the send for good. A healthy
    worker takes as large a message whole."""
    eng = engine("tiny", 2, tensor_parallel_timeout_s=2.0)
    runner = eng.runner
    big = bytes(4 << 20)  # the socket pair buffers a few hundred KiB
    failed: list[RankFailure] = []

    def send() -> None:
        with pytest.raises(RankFailure) as err:
            runner._send_all("step", big)
        failed.append(err.value)

    with _worker_held(eng) as pid:
        runner._send_all("ping", big)
        assert runner.workers[0].conn.poll(60) and runner.workers[0].conn.recv()[0] == "pong"
        os.kill(pid, signal.SIGSTOP)
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(2.0 + 30)  # generous: the fix answers in about 3s
        assert not sender.is_alive(), "rank 0 is blocked sending to the stopped worker"
        assert failed and failed[0].rank == 1 and "stopped" in str(failed[0])
        with pytest.raises(RankFailure):
            eng.check_ranks()


def test_a_worker_stalled_in_a_remedy_agreement_fails_the_engine(tiny_dir) -> None:
    """A live FP8 switch's agreement (a collective over every rank) with a worker that does not
    answer: the action fails with RankFailure naming the rank and the engine stays failed, as
    after a step's collective, not a plain error that leaves the ranks out of step."""
    eng = engine("tiny", 2, tensor_parallel_timeout_s=2.0)
    with _worker_held(eng) as pid:
        os.kill(pid, signal.SIGSTOP)
        fut = eng.set_kv_cache_dtype("fp8_e4m3")
        eng.step()  # takes the action at the step boundary
        err = fut.exception(timeout=60)
        assert isinstance(err, RankFailure) and err.rank == 1, repr(err)
        with pytest.raises(RankFailure):
            eng.check_ranks()


def test_shutdown_stops_every_worker(tiny_dir) -> None:
    eng = engine("tiny", 4)
    pids = eng.runner.worker_pids()
    assert len(pids) == 3 and set(pids) <= set(_children())
    eng.shutdown()
    assert not set(pids) & set(_children())
    # and says so, instead of blaming a rank for the workers it stopped itself
    for use in (lambda: eng.add_request("hi"), eng.step, eng.check_ranks):
        with pytest.raises(RuntimeError, match="^engine is shut down"):
            use()


@contextlib.contextmanager
def _worker_held(eng: LLMEngine) -> Iterator[int]:
    """A tp=2 engine's worker pid, for the block to stop (SIGSTOP); after it the worker is let
    go and the engine shut down, and the worker must be gone."""
    pid = eng.runner.worker_pids()[0]
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)
        eng.shutdown()
    assert pid not in _children()


def _children() -> list[int]:
    """Live (not zombie) child processes of this test process."""
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(entry))
    return out
