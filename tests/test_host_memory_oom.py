"""Running out of host memory on CPU is handled as the out-of-memory it is.

A step whose workspace the CPU allocator cannot give (RLIMIT_AS / `LimitAS=`, strict
overcommit) is requeued with a halved budget, as a GPU out-of-memory step is; a KV pool the
process cannot allocate at start is a one-line refusal (exit 2), not a traceback systemd restarts.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine.kv_cache import KVMapRefused, is_oom
from tests.test_engine import PROMPTS, make_engine
from tests.test_remedies import run_all
from tests.test_server import TEST_DAEMON_ENV, free_port

# what torch's CPU allocator raises on ENOMEM, word for word
CPU_ENOMEM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 56993280 bytes. Error code 12 (Cannot allocate memory)"
)


def fail_next_forward(engine: LLMEngine, error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's next forward pass raises `error`, the ones after it run."""
    forward: Callable[..., Any] = engine.runner.forward
    raised = []

    def once(*args: Any, **kw: Any) -> Any:
        if not raised:
            raised.append(error)
            raise error
        return forward(*args, **kw)

    monkeypatch.setattr(engine.runner, "forward", once)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_a_cpu_allocation_failure_in_a_step_is_requeued_not_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = make_engine(max_num_batched_tokens=512)
    rids = [engine.add_request(p, greedy(6)) for p in PROMPTS]
    engine.step()
    fail_next_forward(engine, RuntimeError(CPU_ENOMEM), monkeypatch)
    assert engine.step() == []  # nothing ended with an error
    snap = engine.snapshot()
    assert snap.max_num_batched_tokens == 256
    assert snap.counters["oom"] == 1 and snap.preemptions["recompute"] >= 1
    oom = engine.events.recent("engine_oom")
    assert len(oom) == 1 and "DefaultCPUAllocator" in oom[0].data["error"]
    assert not engine.events.recent("engine_step_failed")
    done = run_all(engine)
    assert set(done) == set(rids)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in done.values())


def test_any_other_runtime_error_in_a_step_still_fails_its_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the allocator's message is out of memory: a bug retried would fail for ever."""
    engine = make_engine(max_num_batched_tokens=512)
    rids = [engine.add_request(p, greedy(6)) for p in PROMPTS[:2]]
    engine.step()
    fail_next_forward(engine, RuntimeError("shape mismatch: can't allocate a view"), monkeypatch)
    outs = engine.step()
    assert {o.request_id for o in outs} == set(rids)
    assert all(o.finish_reason == "error" for o in outs)
    assert engine.snapshot().counters["oom"] == 0


def test_a_memory_error_in_a_step_fails_its_requests_only_a_refused_kv_mapping_is_oom(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel's MemoryError (its workspace, a poisoned size) is no allocator refusal: its
    requests fail as any other step error's, where a retry could fail for ever. The one
    MemoryError that is out of memory is a KV layer's pages the system would not map."""
    assert is_oom(KVMapRefused("cannot map 4096 bytes for a KV layer"))
    assert not is_oom(MemoryError("paged_decode: no memory for the split-K partial sums"))
    engine = make_engine(max_num_batched_tokens=512)
    rids = [engine.add_request(p, greedy(6)) for p in PROMPTS[:2]]
    engine.step()
    fail_next_forward(engine, MemoryError("CPU layer: no memory for a workspace"), monkeypatch)
    outs = engine.step()
    assert {o.request_id for o in outs} == set(rids)
    assert all(o.finish_reason == "error" for o in outs)
    snap = engine.snapshot()
    assert snap.counters["oom"] == 0 and snap.max_num_batched_tokens == 512
    assert engine.snapshot().max_num_batched_tokens == 512


# `kvguard serve`, with the address space limited (RLIMIT_AS, as `prlimit --as` or systemd's
# `LimitAS=` set it) to what the process holds when its KV pool is about to be allocated plus
# a margin far below the pool (256 MiB of its 1 GiB: room for a thread's new glibc arena, a
# 64 MiB reservation, whose refusal would be a MemoryError elsewhere, not the pool's). Set at
# that moment, not at exec: what the interpreter, torch and its threads reserve before then
# differs between machines, the pool's bytes do not.
SERVE_UNDER_RLIMIT_AS = """
import resource, sys
import kvguard.engine.model_runner as runner
from kvguard.daemon.cli import main

real = runner.KVCache


def limited(*args, **kw):
    status = open("/proc/self/status").read().split("VmSize:")[1]
    held = int(status.split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (held + (256 << 20), resource.RLIM_INFINITY))
    return real(*args, **kw)


runner.KVCache = limited
sys.exit(main(["serve", "--config", sys.argv[1]]))
"""


def test_a_kv_pool_the_allocator_refuses_is_a_one_line_refusal_exit_2(tmp_path: Path) -> None:
    """Not a traceback and exit 1, which systemd restarts for ever: the next start would be
    refused the same pool (README "Run under systemd": exit 2 is not restarted)."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "serving: {model: tiny, kv_cache_bytes: 1GiB, max_model_len: 512}\n"
        f"api: {{host: 127.0.0.1, port: {free_port()}}}\n"
        f"audit: {{url: 'sqlite:///{tmp_path / 'audit.db'}'}}\n"
    )
    env = {**os.environ, **TEST_DAEMON_ENV, "STATE_DIRECTORY": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_UNDER_RLIMIT_AS, str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvguard: error:")]
    assert errors == [
        "kvguard: error: kv_cache_bytes=1073741824 (1024 MiB) could not be allocated: the "
        "allocator refused the KV pool's 131072 blocks (1073741824 bytes in all; an "
        "address-space limit such as LimitAS= or prlimit --as, or strict overcommit); lower "
        "kv_cache_bytes, or raise that limit"
    ], proc.stderr


def test_the_load_logs_the_kv_and_swap_pools_sizes(caplog: pytest.LogCaptureFixture) -> None:
    """What an operator sizes MemoryMax= with on a CPU host: the pools are most of the daemon's
    memory, and the swap pool's bytes were otherwise found only by arithmetic."""
    caplog.set_level(logging.INFO, logger="kvguard.engine")
    engine = make_engine(kv_cache_bytes="4MiB", enable_cpu_offload=True, cpu_cache_ratio=0.5)
    kv = engine.kv_cache
    assert (kv.num_blocks, kv.bytes_per_block, kv.host_pool.num_blocks) == (512, 8192, 512)
    lines = [r.getMessage() for r in caplog.records if "KV pool:" in r.getMessage()]
    assert lines == [
        "rank 0 KV pool: 512 blocks of 8192 bytes (4.0 MiB, 8192 tokens), fp32; "
        "swap pool: 512 blocks (4.0 MiB of host memory)"
    ]
