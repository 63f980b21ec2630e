"""A reload the engine refuses changes nothing in it, and a reload's KV budget is unused where
serving.num_gpu_blocks fixes the pool.

A KV budget the host cannot give (no room to grow the pool) used to be refused only after the
other knobs of the same reload had been applied (the batch limit, the admission config) and
with the refused budget left in the engine: the daemon kept its config, so the next reload of
the original file found nothing to change, and `shrink_kv_pool` sized its share from the refused
budget (a "shrink" that tried to grow the pool, refused in turn) until a restart."""

from __future__ import annotations

from pathlib import Path

from kvguard.engine.admission import AdmissionConfig
from tests.test_engine import make_engine
from tests.test_kv_pool import apply
from tests.test_server import Daemon

# more than any host holds (1 PiB): the pool can never grow to it
NO_HOST_HOLDS = 1 << 50


def engine_state(engine) -> dict:  # noqa: ANN001 - LLMEngine
    """Everything a reconfigure may change: knobs in force, configured values, the KV budget,
    the admission controller's settings."""
    ctl = engine.admission
    return {
        "knobs": engine.knobs(),
        "config": {
            k: getattr(engine.config, k)
            for k in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes")
        }
        | {"interrupt_for_high": engine.config.interrupt_for_high},
        "admission": engine.config.admission,
        "controller": (ctl.config, ctl.estimator.quantile, ctl.overcommit),
        "budget_bytes": engine.kv_cache.budget_bytes,
        "configured_batched_tokens": engine.configured_batched_tokens,
    }


def test_a_refused_kv_budget_changes_nothing_in_the_engine() -> None:
    engine = make_engine(
        kv_cache_bytes="8MiB", max_model_len=128, max_num_seqs=5, admission=AdmissionConfig()
    )
    full = engine.block_manager.num_blocks
    before = engine_state(engine)
    no = apply(
        engine,
        engine.reconfigure(
            {
                ("kv_cache_bytes",): NO_HOST_HOLDS,
                ("max_num_seqs",): 2,
                ("max_num_batched_tokens",): 1024,
                ("interrupt_for_high",): False,
                ("admission", "max_queue"): 9,
                ("admission", "estimate_quantile"): 0.75,
                ("admission", "max_overcommit"): 1.0,
            }
        ),
    )
    assert not no.ok
    assert engine_state(engine) == before and no.after == no.before
    assert no.detail.startswith(f"refused: kv_cache_bytes={NO_HOST_HOLDS}: no room for"), no.detail
    assert "nothing of the reload applied" in no.detail
    assert "max_num_seqs" not in no.detail and "admission_control" not in no.detail
    # the remedy sizes its share from the budget in force: it halves the pool
    half = apply(engine, engine.set_kv_pool_share(0.5))
    assert half.ok and half.data["blocks_before"] == full, half.detail
    assert half.data["blocks_after"] == full // 2
    assert apply(engine, engine.set_kv_pool_share(1.0)).data["blocks_after"] == full
    # and a reload the engine can take still applies whole
    ok = apply(engine, engine.reconfigure({("max_num_seqs",): 2, ("admission", "max_queue"): 9}))
    assert ok.ok and ok.after["max_num_seqs"] == 2 and engine.admission.config.max_queue == 9


def test_num_gpu_blocks_fixes_the_pool_through_a_kv_budget_reload() -> None:
    engine = make_engine(kv_cache_bytes="8MiB", max_model_len=128, num_gpu_blocks=50)
    budget = engine.kv_cache.budget_bytes
    assert engine.block_manager.num_blocks == 50
    for value in (4 << 20, 16 << 20, 1):  # lower, higher, less than a block: all unused
        res = apply(engine, engine.reconfigure({("kv_cache_bytes",): value}))
        assert res.ok and "unused while serving.num_gpu_blocks=50 fixes the pool" in res.detail
        assert engine.block_manager.num_blocks == 50 and engine.kv_cache.budget_bytes == budget
        assert engine.config.kv_cache_bytes == value
    assert apply(engine, engine.set_kv_pool_share(0.5)).data["blocks_after"] == 25


def test_a_reload_the_engine_refuses_leaves_the_daemon_and_engine_as_they_were(
    tmp_path: Path,
) -> None:
    serving = "{model: tiny, device: cpu, kv_cache_bytes: 8MiB, max_num_seqs: 5}"
    d = Daemon(tmp_path, serving=serving, extra="admission_control: {max_queue: 256}\n")
    try:
        knobs = d.admin("GET", "/admin/state").json()["knobs"]
        assert knobs["max_num_seqs"] == 5
        good = d.config.read_text()
        d.config.write_text(
            good.replace("kv_cache_bytes: 8MiB", f"kv_cache_bytes: {NO_HOST_HOLDS}")
            .replace("max_num_seqs: 5", "max_num_seqs: 2")
            .replace("max_queue: 256", "max_queue: 9")
        )
        bad = d.admin("POST", "/admin/reload")
        assert bad.status_code == 400, bad.text
        assert d.admin("GET", "/admin/state").json()["knobs"] == knobs
        assert f"kv_cache_bytes={NO_HOST_HOLDS}: no room for" in bad.json()["error"]["message"]
        # the original file again: nothing to change, and the remedy halves the pool
        d.config.write_text(good)
        again = d.admin("POST", "/admin/reload").json()
        assert again["reloaded"] and again["changes"] == {}, again
        r = d.admin("POST", "/admin/actions/shrink_kv_pool", json={"share": 0.5})
        assert r.status_code == 200, r.text
        after = d.admin("GET", "/admin/state").json()["knobs"]
        assert after["kv_pool_blocks"] == knobs["kv_pool_blocks"] // 2
        # the file whose max_queue the refused reload carried: now taken, as a change
        d.config.write_text(good.replace("max_queue: 256", "max_queue: 9"))
        took = d.admin("POST", "/admin/reload").json()
        assert took["changes"] == {"admission_control.max_queue": 9}, took
    finally:
        assert d.stop() == 0
