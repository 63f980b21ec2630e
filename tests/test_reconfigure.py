"""A reload applies the knobs that can change live to the running engine, and names the rest.

Through the engine: batch limit, step budget, admission knobs and the CPU KV budget change at
a step boundary; a limit a remedy lowered stays lowered (its undo restores the new configured
value); knobs that need a restart are refused by name. Through a live `kvguard serve`: a
reload changes them without a restart, says which changes wait for one, and a file with a bad
value changes nothing."""

from __future__ import annotations

import signal
import sqlite3
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from kvguard.engine.admission import AdmissionConfig
from kvguard.engine.knobs import ConfigError
from tests.test_disconnect import count, idle, send, state
from tests.test_engine import PROMPTS, make_engine
from tests.test_kv_pool import apply, finish
from tests.test_remedies import greedy
from tests.test_server import Daemon, until


def test_a_reload_of_kv_cache_bytes_sizes_the_swap_pool_as_a_start_does() -> None:
    """With enable_cpu_offload the swap pool kept its start size through a reload of the KV
    budget: grown 8x, preemptions fell back to recompute once the small swap pool filled;
    shrunk, it kept its memory. It follows the budget now (cpu_cache_ratio of all KV, as at a
    start), never below the blocks swapped sequences hold, and their tokens are unchanged."""
    offload = {"enable_cpu_offload": True, "cpu_cache_ratio": 0.4, "min_gpu_blocks": 0}
    calm = make_engine(max_model_len=128)
    want = [o.token_ids for o in calm.generate(PROMPTS, greedy(40))]
    engine = make_engine(kv_cache_bytes="1MiB", max_model_len=128, **offload)
    eight = make_engine(kv_cache_bytes="8MiB", max_model_len=128, **offload)
    device, host = eight.block_manager.num_blocks, eight.host_block_manager.num_blocks
    start_host = engine.host_block_manager.num_blocks
    rids = [engine.add_request(p, greedy(40)) for p in PROMPTS]
    for _ in range(6):
        engine.step()
    moved = apply(engine, engine.set_max_num_seqs(1)).data["preempted"]
    assert {how for _, how in moved} == {"swap"}, moved  # some sequences wait on the host
    swapped = engine.host_block_manager.num_used
    assert swapped > 0
    res = apply(engine, engine.reconfigure({("kv_cache_bytes",): 8 * 2**20}))
    assert res.ok, res.detail
    assert engine.block_manager.num_blocks == device
    assert engine.host_block_manager.num_blocks == host > start_host, res.detail
    assert f"swap pool {start_host} -> {host} blocks" in res.detail, res.detail
    assert engine.host_block_manager.num_used == swapped  # moved, not lost
    # shrunk below what the swapped sequences hold: held there, and said so
    res = apply(engine, engine.reconfigure({("kv_cache_bytes",): 300 * 1024}))
    assert res.ok, res.detail
    assert engine.host_block_manager.num_blocks == max(
        swapped, int(engine.block_manager.num_blocks * 0.4 / 0.6)
    )
    apply(engine, engine.reconfigure({("kv_cache_bytes",): 2**20}))
    assert engine.host_block_manager.num_blocks >= start_host
    apply(engine, engine.set_max_num_seqs(32))
    done = finish(engine)
    assert [done[r] for r in rids] == want
    assert engine.host_block_manager.num_used == 0
    res = apply(engine, engine.reconfigure({("kv_cache_bytes",): 2**20 + 1}))
    assert engine.host_block_manager.num_blocks == start_host, res.detail  # as at a start


def test_the_engine_takes_live_knobs_at_a_step_boundary() -> None:
    engine = make_engine(kv_cache_bytes="1MiB", max_model_len=128, admission=AdmissionConfig())
    full = engine.block_manager.num_blocks
    rids = [engine.add_request(p, greedy(16)) for p in PROMPTS]
    engine.step()
    res = apply(
        engine,
        engine.reconfigure(
            {
                ("max_num_seqs",): 4,
                ("max_num_batched_tokens",): 512,
                ("kv_cache_bytes",): 512 * 1024,
                ("admission", "max_queue"): 9,
                ("admission", "estimate_quantile"): 0.75,
                ("interrupt_for_high",): False,
            }
        ),
    )
    assert res.ok, res.detail
    assert res.after["max_num_seqs"] == 4 and len(engine.scheduler.running) <= 4
    assert res.after["max_num_batched_tokens"] == 512
    assert res.after["kv_pool_blocks"] == full // 2
    assert engine.config.max_num_seqs == 4 and engine.config.kv_cache_bytes == 512 * 1024
    assert engine.admission.config.max_queue == 9 and engine.admission.estimator.quantile == 0.75
    assert engine.config.interrupt_for_high is False
    # a remedy's lower limit stays in force; its undo restores the newly configured value
    assert apply(engine, engine.reduce_max_num_seqs(0.5)).after["max_num_seqs"] == 2
    assert apply(engine, engine.reconfigure({("max_num_seqs",): 6})).after["max_num_seqs"] == 2
    assert apply(engine, engine.set_max_num_seqs(6)).after["max_num_seqs"] == 6
    done = finish(engine)
    assert all(len(done[r]) == 16 for r in rids)
    # a budget the requests in flight could outgrow is refused, and nothing else changes
    rid = engine.add_request(list(range(3, 100)), greedy(24))  # may grow to 128 tokens
    engine.step()
    no = apply(engine, engine.reconfigure({("max_num_seqs",): 3, ("kv_cache_bytes",): 8192}))
    assert not no.ok and "requests in flight may grow to 8" in no.detail, no.detail
    assert no.after == no.before and engine.config.max_num_seqs == 6
    assert len(finish(engine)[rid]) == 24
    with pytest.raises(ValueError, match="max_model_len: takes effect at a restart"):
        engine.reconfigure({("max_model_len",): 64})
    with pytest.raises(ConfigError, match="safety_factor"):
        engine.reconfigure({("admission", "safety_factor"): 0.5})


def test_a_value_out_of_a_live_knobs_bounds_raises_at_the_call_and_changes_nothing() -> None:
    """Each value is checked against its knob's declaration in the caller's thread, as a
    config file's is; before, only the knob's name was: a batch limit of 0 or a step budget of
    -5 was taken and no request was ever scheduled again, and "x" made every step raise."""
    engine = make_engine(kv_cache_bytes="1MiB", max_model_len=128, admission=AdmissionConfig())
    before = engine.knobs()
    for path, value, expected in (
        (("max_num_seqs",), 0, r"max_num_seqs=0: expected an integer >= 1 and <= \d+"),
        (("max_num_seqs",), "x", r"max_num_seqs='x': expected an integer >= 1"),
        (("max_num_seqs",), 4.0, r"max_num_seqs=4.0: expected an integer"),
        (("max_num_seqs",), True, r"max_num_seqs=True: expected an integer"),
        (("max_num_batched_tokens",), -5, r"max_num_batched_tokens=-5: expected an integer >= 1"),
        (("max_num_batched_tokens",), None, r"max_num_batched_tokens=None: expected an integer"),
        (("decode_steps",), 100, r"decode_steps=100: expected an integer >= 1 and <= 16"),
        (("speculative_tokens",), -1, r"speculative_tokens=-1: expected an integer >= 0"),
        (("prefill_while_decoding",), 0, r"prefill_while_decoding=0: .*>= 1, or None"),
        (("speculative_row_cost",), float("nan"), r"speculative_row_cost=nan: expected a number"),
        (("interrupt_for_high",), "no", r"interrupt_for_high='no': expected a bool"),
        (("oom_quiet_period_s",), 0, r"oom_quiet_period_s=0: expected a number > 0"),
        (("kv_cache_bytes",), "lots", r"kv_cache_bytes='lots': cannot read as a size"),
        (("kv_cache_bytes",), 0, r"kv_cache_bytes=0: expected an integer > 0"),
        (("admission", "max_queue"), "9", r"admission.max_queue='9': expected an integer >= 0"),
    ):
        with pytest.raises(ConfigError, match=f"^{expected}"):
            # with a good value beside it: a reload is all or nothing
            engine.reconfigure({("admission", "max_queue"): 5, path: value})
        assert not engine.mailbox.pending(), path  # nothing was posted
    engine.step()
    assert engine.knobs() == before and engine.admission.config.max_queue == 256
    assert engine.config.max_num_seqs == before["max_num_seqs"] and engine.config.decode_steps == 1
    assert [o.finish_reason for o in engine.generate(PROMPTS[:2], greedy(4))] == ["length"] * 2
    # what a declaration takes is taken: a size as the config file writes it, in bytes
    res = apply(engine, engine.reconfigure({("kv_cache_bytes",): "512KiB", ("decode_steps",): 16}))
    assert res.ok and engine.config.kv_cache_bytes == 512 * 1024, res.detail
    assert res.after["kv_pool_blocks"] == before["kv_pool_blocks"] // 2


def test_without_chunking_the_step_budget_stays_at_least_the_running_max_model_len() -> None:
    """max_model_len and enable_chunked_prefill change only at a restart: a step budget below
    the running max_model_len would leave a longer prompt waiting at the queue's head for
    ever, so reconfigure refuses it (and changes nothing); an OOM's halving, which turns
    chunking on until the budget is back, still works and ends where it began."""
    engine = make_engine(
        max_model_len=128, enable_chunked_prefill=False, max_num_batched_tokens=128
    )
    no = apply(engine, engine.reconfigure({("max_num_seqs",): 4, ("max_num_batched_tokens",): 100}))
    assert not no.ok and no.after == no.before, no.detail
    assert "max_num_batched_tokens=100 < max_model_len=128 in force" in no.detail
    assert "enable_chunked_prefill off" in no.detail
    assert engine.configured_batched_tokens == 128 and engine.config.max_num_seqs != 4
    prompt = list(range(3, 123))  # 120 tokens: one step must hold them all
    assert len(engine.generate([prompt], greedy(4))[0].token_ids) == 4
    yes = apply(engine, engine.reconfigure({("max_num_batched_tokens",): 200}))
    assert yes.ok and yes.after["max_num_batched_tokens"] == 200, yes.detail
    engine.config.oom_quiet_period_s = 0.0
    engine.inject_oom(1)
    rid = engine.add_request(prompt, greedy(4))
    done = finish(engine)
    assert len(done[rid]) == 4 and engine._counters["oom"] == 1
    assert engine.scheduler.max_num_batched_tokens == 200 and engine.scheduler.chunked is False


def test_a_reload_neither_lifts_an_oom_halved_step_budget_nor_leaves_chunking_on() -> None:
    """An out-of-memory step halves the budget 1024 -> 512 and turns chunked prefill on
    (configured off) until the budget is back. A reload to 512 puts the configured budget in
    force, so chunking goes back off (before, it stayed on for good: only the doubling back
    turned it off, and there was nothing left to double). A reload back up within the quiet
    period keeps the halved 512 in force, chunked (before: the new value at once, the halving
    forgotten); once quiet, the budget doubles back to the configured value of then."""
    engine = make_engine(
        max_model_len=256,
        enable_chunked_prefill=False,
        max_num_batched_tokens=1024,
        oom_quiet_period_s=3600,
    )
    sch = engine.scheduler
    rid = engine.add_request(PROMPTS[0], greedy(24))
    engine.step()
    engine.inject_oom(1)
    engine.step()
    assert (sch.max_num_batched_tokens, sch.chunked) == (512, True)
    for configured, in_force, chunked in (
        (512, 512, False),
        (1024, 512, True),
        (300, 300, False),
        (2048, 512, True),
    ):
        res = apply(engine, engine.reconfigure({("max_num_batched_tokens",): configured}))
        assert res.ok and res.after["max_num_batched_tokens"] == in_force, res.detail
        assert sch.chunked is chunked, configured
    engine.config.oom_quiet_period_s = 0.0  # every step is past it now: one doubling a step
    engine.step()
    assert (sch.max_num_batched_tokens, sch.chunked) == (1024, True)
    engine.step()
    assert (sch.max_num_batched_tokens, sch.chunked) == (2048, False)
    assert len(finish(engine)[rid]) == 24 and engine._counters["oom"] == 1


def test_a_reload_may_not_lower_the_step_budget_below_the_running_max_model_len(
    tmp_path: Path,
) -> None:
    """The file's own check passes (300 >= its new max_model_len 256) but 512 stays in force
    until a restart: the reload is refused whole, naming both keys and the line, and a
    450-token prompt is still served. A budget that holds it is taken; a change of
    rules.dry_run is reported with the others."""
    serving = (
        "{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, enable_chunked_prefill: false, "
        "max_num_batched_tokens: 512}"
    )
    d = Daemon(tmp_path, serving=serving)
    try:
        text = d.config.read_text()
        lowered = text.replace("max_model_len: 512", "max_model_len: 256")
        d.config.write_text(
            lowered.replace("max_num_batched_tokens: 512", "max_num_batched_tokens: 300")
            + "rules: {dry_run: true}\n"
        )
        bad = d.admin("POST", "/admin/reload")
        assert bad.status_code == 400, bad.text
        message = bad.json()["error"]["message"]
        assert message.startswith(
            f"{d.config}:1: serving.max_num_batched_tokens: 300 < serving.max_model_len 512 in "
            "force, with serving.enable_chunked_prefill off in force"
        ), message
        now = d.admin("GET", "/admin/state").json()
        assert now["knobs"]["max_num_batched_tokens"] == 512 and now["dry_run"] is False
        ids = httpx.post(
            d.url + "/tokenize", json={"model": "tiny", "prompt": "hello world " * 200}
        )
        prompt = ids.json()["tokens"][:450]
        assert len(prompt) == 450
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
        r = httpx.post(d.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        d.config.write_text(lowered + "rules: {dry_run: true}\n")  # 512 holds every prompt
        ok = d.admin("POST", "/admin/reload").json()
        assert ok["reloaded"] and ok["changes"] == {"rules.dry_run": True}, ok
        assert ok["restart_needed"] == ["serving.max_model_len"]
        assert d.admin("GET", "/admin/state").json()["dry_run"] is True
        log = Path(d.log.name)
        until(lambda: "rules.dry_run is now true" in log.read_text(), 10, "the dry-run warning")
    finally:
        assert d.stop() == 0


def test_a_reload_changes_live_knobs_without_a_restart_and_names_the_rest(tmp_path: Path) -> None:
    serving = "{model: tiny, kv_cache_bytes: 2MiB, max_model_len: 512}"
    d = Daemon(tmp_path, serving=serving, extra="admission_control: {max_queue: 256}\n")
    try:
        knobs = d.admin("GET", "/admin/state").json()["knobs"]
        full, pid = knobs["kv_pool_blocks"], d.proc.pid
        text = d.config.read_text()
        d.config.write_text(
            text.replace(
                serving,
                "{model: tiny, kv_cache_bytes: 1MiB, max_model_len: 256, max_num_seqs: 8}",
            ).replace("{max_queue: 256}", "{max_queue: 9, max_queue_wait: 5s}")
            + "monitoring: {nvml_poll_interval: 2s}\n"
        )
        r = d.admin("POST", "/admin/reload").json()
        assert r["reloaded"], r
        assert r["changes"] == {
            "serving.kv_cache_bytes": 1 << 20,
            "serving.max_num_seqs": 8,
            "admission_control.max_queue": 9,
            "admission_control.max_queue_wait": 5.0,
        }
        assert r["restart_needed"] == ["serving.max_model_len", "monitoring.nvml_poll_interval"]
        knobs = d.admin("GET", "/admin/state").json()["knobs"]
        assert knobs["max_num_seqs"] == 8 and knobs["kv_pool_blocks"] == full // 2
        assert d.proc.pid == pid and d.proc.poll() is None  # no restart
        log = Path(d.log.name)
        until(lambda: "take effect at the next restart" in log.read_text(), 10, "the warning")
        assert "serving.max_model_len, monitoring.nvml_poll_interval changed in the file" in (
            log.read_text()
        )
        # the same file again: nothing changes, the restart is still pending
        again = d.admin("POST", "/admin/reload").json()
        assert again["changes"] == {} and again["restart_needed"] == r["restart_needed"]
        # a value out of bounds refuses the whole reload
        d.config.write_text(d.config.read_text().replace("max_num_seqs: 8", "max_num_seqs: 0"))
        bad = d.admin("POST", "/admin/reload")
        assert bad.status_code == 400 and "max_num_seqs" in bad.json()["error"]["message"]
        assert d.admin("GET", "/admin/state").json()["knobs"]["max_num_seqs"] == 8
        # a KV budget the request in flight could outgrow refuses the reload, knobs and all
        good = d.config.read_text().replace("max_num_seqs: 0", "max_num_seqs: 8")
        d.config.write_text(
            good.replace("kv_cache_bytes: 1MiB", "kv_cache_bytes: 8KiB").replace(
                "max_num_seqs: 8", "max_num_seqs: 4"
            )
        )
        holder = send(d, {"prompt": "hold", "max_tokens": 400})
        try:
            until(lambda: count(state(d), "running") == 1, 60, "a request generating")
            bad = d.admin("POST", "/admin/reload")
            assert bad.status_code == 400, bad.text
            assert "requests in flight may grow to" in bad.json()["error"]["message"]
            knobs = d.admin("GET", "/admin/state").json()["knobs"]
            assert knobs["max_num_seqs"] == 8 and knobs["kv_pool_blocks"] == full // 2
        finally:
            holder.close()
        until(lambda: idle(state(d)), 30, "the holder aborted")
        d.config.write_text(good)
        assert d.admin("POST", "/admin/reload").json()["reloaded"]
        assert d.client().completions.create(model="tiny", prompt="x", max_tokens=2).usage
    finally:
        assert d.stop() == 0


def test_a_reload_refuses_what_a_start_would_refuse(tmp_path: Path) -> None:
    """A file the next start would refuse is refused by a reload, with the lines the start
    prints, and changes nothing: a CPU headroom that leaves nothing of the KV budget (taken,
    it had every request answer 400) and pipeline_layers that do not split the model (taken
    "at the next restart", which then failed). HTTP answers 400, SIGHUP logs the refusal, as
    for a syntax error; requests are served throughout."""
    d = Daemon(tmp_path, serving="{model: tiny, device: cpu, kv_cache_bytes: 8MiB}")
    log = Path(d.log.name)
    try:
        good = d.config.read_text()
        d.config.write_text(good + "admission_control:\n  reserved_headroom_mb: 1000\n")
        bad = d.admin("POST", "/admin/reload")
        assert bad.status_code == 400, bad.text
        headroom = (
            f"{d.config}:5: admission_control.reserved_headroom_mb: 1000 MiB leaves nothing of "
            "the 8 MiB CPU KV budget (serving.kv_cache_bytes), so every request would be refused"
        )
        assert bad.json()["error"]["message"].startswith(headroom), bad.text
        knobs = d.admin("GET", "/admin/state").json()["knobs"]
        r = d.client().completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        d.proc.send_signal(signal.SIGHUP)
        until(lambda: log.read_text().count(headroom) >= 2, 30, "the SIGHUP refusal logged")
        assert f"reload refused, keeping the running config: {headroom}" in log.read_text()
        serving = "{model: tiny, device: cpu, kv_cache_bytes: 8MiB, pipeline_layers: [1, 1]}"
        d.config.write_text(
            good.replace("{model: tiny, device: cpu, kv_cache_bytes: 8MiB}", serving)
        )
        bad = d.admin("POST", "/admin/reload")
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["message"].startswith(
            f"{d.config}:1: serving.pipeline_layers: [1, 1] does not split the layers into "
            "pipeline_parallel=1 stages"
        ), bad.text
        assert "take effect at the next restart" not in log.read_text()
        assert d.admin("GET", "/admin/state").json()["knobs"] == knobs
        r = d.client().completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        d.config.write_text(good)
        assert d.admin("POST", "/admin/reload").json()["reloaded"]
    finally:
        assert d.stop() == 0
    with closing(sqlite3.connect(tmp_path / "audit.db")) as db:
        refused = db.execute("SELECT detail FROM events WHERE kind = 'config_error'").fetchall()
    assert refused == [(f"reload refused: {d.config}",)] * 3


def test_a_knob_is_named_by_its_engine_path_or_its_config_file_name() -> None:
    """README's Python API names a knob as the config file does ("serving.max_num_seqs") or
    as the engine does (("max_num_seqs",)); before, a string key was split into its letters
    ("m.a.x._.n.u.m...") and any key not an engine path, a live file name or a typo alike, was
    called restart-only."""
    engine = make_engine(kv_cache_bytes="1MiB", max_model_len=128, admission=AdmissionConfig())
    for knobs, n in (
        ({"max_num_seqs": 5}, 5),
        ({"serving.max_num_seqs": 6}, 6),
        ({("serving", "max_num_seqs"): 7}, 7),
    ):
        res = apply(engine, engine.reconfigure(knobs))
        assert res.ok and engine.config.max_num_seqs == n, res.detail
    res = apply(
        engine,
        engine.reconfigure(
            {"admission_control.safety_factor": 1.5, "admission_control.reserved_headroom_mb": 2}
        ),
    )
    assert res.ok, res.detail
    assert engine.admission.config.safety_factor == 1.5
    assert engine.admission.config.reserved_headroom_bytes == 2 * 2**20  # the file's unit
    with pytest.raises(ValueError, match=r"^serving\.max_model_len: takes effect at a restart"):
        engine.reconfigure({"serving.max_model_len": 64})
    with pytest.raises(ValueError, match=r"^serving\.max_num_seq: no such knob \(the live ones: "):
        engine.reconfigure({"serving.max_num_seq": 4})
    with pytest.raises(ValueError, match="a knob given twice"):
        engine.reconfigure({"max_num_seqs": 4, "serving.max_num_seqs": 5})
    with pytest.raises(ConfigError, match=r"^max_num_seqs=0: expected an integer >= 1"):
        engine.reconfigure({"serving.max_num_seqs": 0})
    with pytest.raises(ConfigError, match=r"reserved_headroom_bytes=True: expected an integer"):
        engine.reconfigure({"admission_control.reserved_headroom_mb": True})  # not 1 MiB
    with pytest.raises(ConfigError, match=r"^serving\.oom_quiet_period='5s': expected a number"):
        engine.reconfigure({"serving.oom_quiet_period": "5s"})
    assert not engine.mailbox.pending() and engine.config.max_num_seqs == 7
