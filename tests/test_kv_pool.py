"""The device KV pool resized live (`set_kv_pool_share`, the `shrink_kv_pool` remedy and its
undo `restore_kv_pool`), and the host memory signal the default ladder shrinks it on.

A shrink mid-generation preempts what does not fit and changes no token; the pool never goes
below one longest request; a later FP8 switch keeps the share; the freed bytes go back to the
host (the process's resident memory falls); the signal reads /proc/meminfo and the memory
cgroup (v1 and v2) as the kernel writes them."""

from __future__ import annotations

import gc
import os
import re
import sqlite3
from pathlib import Path

import pytest
import torch

from kvguard.engine import LLMEngine
from kvguard.engine.control_surface import ParamError
from kvguard.engine.host_memory import host_memory_used_ratio
from kvguard.engine.knobs import ConfigError
from kvguard.engine.model_runner import release_freed_memory
from kvguard.rules.actions import ActionError, run_action
from tests.test_engine import PROMPTS, make_engine
from tests.test_remedies import greedy, run_all
from tests.test_server import until


def finish(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        engine.audit_blocks()
    return done


def apply(engine: LLMEngine, fut):  # noqa: ANN001, ANN201 - a Future of ActionResult
    engine.step()  # the mailbox is drained at the next step boundary
    engine.audit_blocks()
    return fut.result(0)


def test_a_shrink_mid_generation_preempts_what_does_not_fit_and_changes_no_token() -> None:
    calm = make_engine(max_model_len=128)
    want = [o.token_ids for o in calm.generate(PROMPTS, greedy(48))]
    engine = make_engine(kv_cache_bytes="512KiB", max_model_len=128)
    full = engine.block_manager.num_blocks
    rids = [engine.add_request(p, greedy(48)) for p in PROMPTS]
    for _ in range(12):
        engine.step()
    used = engine.block_manager.num_used
    assert used > full // 4, "the test needs more live blocks than the shrunk pool holds"
    res = apply(engine, engine.set_kv_pool_share(0.25))
    assert res.ok, res.detail
    assert res.data["blocks_before"] == full and res.data["blocks_after"] == full // 4
    assert res.data["preempted"] and engine.block_manager.num_blocks == full // 4
    assert res.before["kv_pool_blocks"] == full and res.after["kv_pool_blocks"] == full // 4
    assert engine.snapshot().blocks_total == full // 4
    for _ in range(20):  # run a while shrunk, then give the pool back mid-generation
        engine.step()
        engine.audit_blocks()
    back = apply(engine, engine.set_kv_pool_share(1.0))
    assert back.ok and back.data["blocks_after"] == full and not back.data["preempted"]
    done = finish(engine)
    assert [done[r] for r in rids] == want
    assert engine.block_manager.num_used == 0


def test_a_resize_keeps_the_prefix_cache_that_fits_and_its_answers() -> None:
    """Same dtype, same bytes: cached blocks inside the new pool stay findable, including
    those a running sequence shares, and serve the answers a cache-off engine computes."""
    system = list(range(3, 3 + 64))  # four full blocks every request shares
    asks = [system + [200 + i, 201 + i, 202 + i] for i in range(6)]
    calm = make_engine(kv_cache_bytes="2MiB", max_model_len=256, enable_prefix_caching=False)
    want = [o.token_ids for o in calm.generate(asks, greedy(12))]
    engine = make_engine(kv_cache_bytes="2MiB", max_model_len=256)
    bm = engine.block_manager
    first = engine.generate([asks[0]], greedy(12))[0]
    assert first.token_ids == want[0] and bm.num_cached >= 4
    rid = engine.add_request(asks[1], greedy(12))
    engine.step()  # it shares the four cached blocks while the pool shrinks
    hits = bm.hit_tokens
    assert hits >= 64
    res = apply(engine, engine.set_kv_pool_share(0.25))
    assert res.ok and bm.num_cached >= 4
    done = finish(engine)
    got = [done[rid]] + [o.token_ids for o in engine.generate(asks[2:], greedy(12))]
    assert got == want[1:]
    assert bm.hit_tokens - hits >= 4 * 64  # every later request found the system prompt
    assert apply(engine, engine.set_kv_pool_share(1.0)).ok and bm.num_cached >= 4


def test_the_pool_never_shrinks_below_one_longest_request() -> None:
    engine = make_engine(kv_cache_bytes="2MiB", max_model_len=256)
    full, block = engine.block_manager.num_blocks, engine.config.block_size
    res = apply(engine, engine.set_kv_pool_share(0.01))
    assert res.ok and res.data["blocks_after"] == 256 // block
    assert "one request of max_model_len=256 tokens must still fit" in res.detail
    rid = engine.add_request(list(range(3, 200)), greedy(56))  # 253 tokens: all of the pool
    assert len(finish(engine)[rid]) == 56
    again = apply(engine, engine.set_kv_pool_share(0.02))
    assert again.ok and "already" in again.detail
    assert apply(engine, engine.set_kv_pool_share(1)).data["blocks_after"] == full
    with pytest.raises(ParamError, match=r"share=0: expected a number in \(0, 1\]"):
        engine.set_kv_pool_share(0)
    with pytest.raises(ParamError, match="share=1.5"):
        engine.set_kv_pool_share(1.5)
    # a pool that holds no more than one longest request stays as it is
    tight = make_engine(kv_cache_bytes="128KiB", max_model_len=2048)
    n = tight.block_manager.num_blocks
    assert n * block < tight.max_model_len
    assert apply(tight, tight.set_kv_pool_share(0.5)).data == {"blocks": n}


def test_an_fp8_switch_after_a_shrink_keeps_the_share() -> None:
    engine = make_engine(kv_cache_bytes="4MiB", max_model_len=128)
    full32 = engine.runner.blocks_for_budget("fp32")
    full8 = engine.runner.blocks_for_budget("fp8_e4m3")
    rids = [engine.add_request(p, greedy(24)) for p in PROMPTS[:4]]
    engine.step()
    assert apply(engine, engine.set_kv_pool_share(0.5)).data["blocks_after"] == full32 // 2
    assert apply(engine, engine.set_kv_cache_dtype("fp8_e4m3")).ok
    assert engine.block_manager.num_blocks == full8 // 2
    assert apply(engine, engine.set_kv_pool_share(1.0)).data["blocks_after"] == full8
    assert apply(engine, engine.set_kv_cache_dtype("fp32")).ok
    assert engine.block_manager.num_blocks == full32
    done = finish(engine)
    assert all(len(done[r]) == 24 for r in rids)


def test_the_pool_grows_back_only_into_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore (or a larger budget) takes memory only while the host stays under 90%:
    taking it back must not press the host into giving it back again. The host's memory
    is what cannot be pressed here at will, so its reading is replaced. The shrunk pool is
    zero pages and none of its blocks was written: the pool grown back (zeroed) takes all its
    bytes, and that is the room it needs."""
    import kvguard.engine.model_runner as runner_module

    engine = make_engine(kv_cache_bytes="2MiB", max_model_len=128)
    full, per_block = engine.block_manager.num_blocks, engine.kv_cache.bytes_per_block
    assert apply(engine, engine.set_kv_pool_share(0.5)).ok
    asked: list[float] = []

    def room(below: float) -> int:
        asked.append(below)
        return full * per_block - 1  # one byte short of the way back

    monkeypatch.setattr(runner_module, "room_bytes", room)
    no = apply(engine, engine.set_kv_pool_share(1.0))
    assert not no.ok and "no room for 2 MiB more KV" in no.detail and asked == [0.90]
    assert engine.block_manager.num_blocks == full // 2
    monkeypatch.setattr(runner_module, "room_bytes", lambda below: full * per_block)
    assert apply(engine, engine.set_kv_pool_share(1.0)).data["blocks_after"] == full


def test_a_pool_the_host_cannot_hold_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvguard.engine.model_runner as runner_module

    monkeypatch.setattr(runner_module, "room_bytes", lambda below: 1 << 20)
    with pytest.raises(ConfigError, match=r"kv_cache_bytes=2097152 \(2 MiB\) is more than this"):
        make_engine(kv_cache_bytes="2MiB")
    make_engine(kv_cache_bytes="1MiB")  # what fits starts
    # the swap pool is host memory too (here beside the KV pool's): 0.5 MiB + 0.5 MiB fits,
    # 0.5 MiB + 4.5 MiB (cpu_cache_ratio 0.9) does not
    swap = {"enable_cpu_offload": True, "min_gpu_blocks": 0}
    make_engine(kv_cache_bytes="512KiB", cpu_cache_ratio=0.5, **swap)
    with pytest.raises(ConfigError, match=r"swap pool \(cpu_cache_ratio=0.9: 4 MiB beside"):
        make_engine(kv_cache_bytes="512KiB", cpu_cache_ratio=0.9, **swap)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_shrink_gives_the_memory_back_to_the_host() -> None:
    engine = make_engine(kv_cache_bytes="512MiB", max_model_len=128)
    engine.generate(PROMPTS[:2], greedy(4))
    gc.collect()  # earlier tests' garbage freed and trimmed now, not between the measurements
    release_freed_memory(torch.device("cpu"))
    before = rss_bytes()
    res = apply(engine, engine.set_kv_pool_share(0.125))
    assert res.ok and res.data["bytes_after"] <= 64 * 2**20
    freed = before - rss_bytes()
    assert freed > 400 * 2**20, f"resident memory fell by {freed / 2**20:.0f} MiB only"
    apply(engine, engine.set_kv_pool_share(1.0))
    assert rss_bytes() - before > -32 * 2**20  # and takes it again on the way back


def test_the_remedy_and_its_undo_through_the_action_catalogue() -> None:
    engine = make_engine(kv_cache_bytes="2MiB", max_model_len=128)
    full = engine.block_manager.num_blocks
    fut = run_action(engine, "shrink_kv_pool", {"share": 0.5})
    res = apply(engine, fut)
    assert res.ok and res.action == "set_kv_pool_share" and res.data["blocks_after"] == full // 2
    assert apply(engine, run_action(engine, "restore_kv_pool", {})).data["blocks_after"] == full
    for bad in ({"share": 0}, {"share": 2.0}, {"share": "half"}, {"ratio": 0.5}):
        with pytest.raises(ActionError):
            run_action(engine, "shrink_kv_pool", bad)
    run_all(engine)


# -- the host memory signal ---------------------------------------------------------------


def fake_proc(tmp: Path, cgroup: str, total_kb: int = 1000, available_kb: int = 600) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:         10 kB\nMemAvailable:   {available_kb} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def test_host_memory_reads_meminfo_and_the_memory_cgroups_limit(tmp_path: Path) -> None:
    real = host_memory_used_ratio()
    assert real is not None and 0.0 <= real <= 1.0  # this Linux host
    root = tmp_path / "cg"
    # cgroup v2, a service with MemoryMax=: its working set (current - inactive_file) / max
    svc = root / "system.slice" / "kvguard.service"
    svc.mkdir(parents=True)
    (svc / "memory.max").write_text("1000\n")
    (svc / "memory.current").write_text("950\n")
    (svc / "memory.stat").write_text("anon 700\ninactive_file 50\nactive_file 200\n")
    proc = fake_proc(tmp_path / "v2", "0::/system.slice/kvguard.service\n")
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.9)  # above the host's 0.4
    (svc / "memory.max").write_text("max\n")  # no limit of its own: the host's ratio
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.4)
    # cgroup v1: the memory controller's tree; 2^63 rounded to pages means no limit
    v1 = root / "memory" / "box"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("2000\n")
    (v1 / "memory.usage_in_bytes").write_text("1500\n")
    (v1 / "memory.stat").write_text("cache 600\ntotal_inactive_file 300\n")
    proc = fake_proc(tmp_path / "v1", "4:memory:/box\n1:cpu:/\n0::/\n", available_kb=900)
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.6)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.1)
    # nothing readable: unknown, never acted on
    assert host_memory_used_ratio(tmp_path / "none", root) is None


def test_the_daemon_resizes_the_pool_on_an_admin_action_and_exports_host_memory(
    tiny_daemon,  # noqa: ANN001 - tests.test_server.Daemon
) -> None:
    import httpx

    d = tiny_daemon
    full = d.admin("GET", "/admin/state").json()["knobs"]["kv_pool_blocks"]
    r = d.admin("POST", "/admin/actions/shrink_kv_pool", json={"share": 0.5})
    assert r.status_code == 200 and r.json()["after"]["kv_pool_blocks"] == full // 2, r.text

    def device_blocks() -> float:
        text = httpx.get(d.url + "/metrics").text
        got = re.findall(
            r'^kvguard_kv_cache_blocks\{state="(?:used|free)",tier="device"\} (\S+)$', text, re.M
        )
        return sum(float(v) for v in got)

    until(lambda: device_blocks() == full // 2, 30, "the metrics to show the shrunk pool")
    text = httpx.get(d.url + "/metrics").text
    host = next(line for line in text.splitlines() if line.startswith("kvguard_host_memory"))
    assert 0.0 <= float(host.split()[-1]) <= 1.0
    bad = d.admin("POST", "/admin/actions/shrink_kv_pool", json={"share": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "share"
    r = d.admin("POST", "/admin/actions/restore_kv_pool")
    assert r.status_code == 200 and r.json()["after"]["kv_pool_blocks"] == full
    client = d.client()
    assert client.completions.create(model="tiny", prompt="x", max_tokens=3).usage
    db = d.config.parent / "audit.db"

    def resized() -> list[str]:
        with sqlite3.connect(db) as c:
            rows = c.execute("SELECT detail FROM events WHERE kind = 'kv_pool_resized'")
            return [r[0] for r in rows]

    until(lambda: len(resized()) == 2, 30, "both resizes in the audit log")
    first, back = resized()
    assert first.startswith(f"KV pool {full} -> {full // 2} blocks, 0 preempted, in ")
    assert back.startswith(f"KV pool {full // 2} -> {full} blocks") and back.endswith(" ms")
