"""The benchmark scripts measure what they say: every script starts, repeated passes on one
kvguard engine get no prompt from its prefix cache, peers get kvguard's own limits, and each
verdict is computed from the measurement against the goal bench/README.md states. Unit-level:
the scripts' functions on small inputs and the tiny model, never a whole benchmark run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.name for p in (ROOT / "bench").glob("*.py") if 'if __name__ == "__main__"' in p.read_text()
)


def test_the_script_list_is_the_bench_folder() -> None:
    """Every bench/*.py but the shared library module is a script the next test starts."""
    assert {p.name for p in (ROOT / "bench").glob("*.py")} - set(SCRIPTS) == {"common.py"}
    assert "control_loop.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_answers_help(script: str) -> None:
    """`python bench/X.py --help` as a user runs it, from the checkout's root: its imports
    resolve (bench/control_loop.py failed with `No module named 'bench'`)."""
    res = subprocess.run(
        [sys.executable, f"bench/{script}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout, res.stdout[-2000:]


def _hits(eng: Any) -> int:
    return eng.snapshot().prefix_cache["hit_tokens"]


# ----------------------------------------------------------------------------- gpu_e2e.py


@pytest.fixture(scope="module")
def e2e_trace() -> dict[str, Any]:
    """gpu_e2e.py's trace section as the CPU smoke run runs it (tiny shape, fp32), on an
    engine built as section_decode builds it but with a batched-token limit (4096) other than
    the 2048 once hard-coded for transformers; every generate call's prefix-cache hits and the
    continuous-batching config built are recorded."""
    import bench.gpu_e2e as e2e
    import bench.throughput as tp

    run = e2e.Run(True, ["tiny"])
    hf = e2e.hf_random_model("tiny", run)
    tokens = run.prompt + run.new_tokens + 8
    eng = e2e.kvguard_engine(
        "tiny",
        run,
        hf.state_dict(),
        num_gpu_blocks=e2e.pool_blocks(max(run.batches), tokens) + e2e.pool_blocks(1, 1024),
        max_num_batched_tokens=4096,
    )
    calls: list[tuple[int, int]] = []
    generate = eng.generate

    def counted(prompts: Any, params: Any, *a: Any, **k: Any) -> Any:
        before = _hits(eng)
        out = generate(prompts, params, *a, **k)
        calls.append((len(prompts), _hits(eng) - before))
        return out

    configs: list[dict[str, Any]] = []
    cb_config = tp.cb_config

    def spy(cls: Any, page: int, **limits: Any) -> Any:
        configs.append(limits)
        return cb_config(cls, page, **limits)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eng, "generate", counted)
        mp.setattr(tp, "cb_config", spy)
        out = e2e.section_trace(eng, hf, run)
    return {"eng": eng, "calls": calls, "configs": configs, "out": out}


def test_gpu_e2e_trace_runs_take_no_prompt_from_the_prefix_cache(e2e_trace: dict) -> None:
    """The default, Triton-prefill and decode-steps runs serve one trace on one engine: with
    the prefix cache on, the later ones took 400 of its 461 prompt tokens from the cache, the
    default run 96, and the 'Triton prefill kernel faster' verdict compared unequal work."""
    assert not e2e_trace["eng"].config.enable_prefix_caching
    timed = [c for c in e2e_trace["calls"] if c[0] == e2e_trace["out"]["requests"]]
    assert len(timed) == 3, e2e_trace["calls"]  # default, Triton prefill, runs of decode steps
    assert [hit for _, hit in e2e_trace["calls"]] == [0] * len(e2e_trace["calls"])


def test_gpu_e2e_continuous_batching_gets_the_engines_batched_token_limit(
    e2e_trace: dict,
) -> None:
    limit = e2e_trace["eng"].scheduler.max_num_batched_tokens
    assert limit == 4096
    assert [c["max_batch_tokens"] for c in e2e_trace["configs"]] == [limit]


# ----------------------------------------------------------------------------- chaos.py


def _audit_db(tmp_path: Path, rows: list[tuple[str, datetime]]) -> Path:
    """An audit DB written by kvguard's own audit store: one action row per (rule, time)."""
    from kvguard.daemon.audit import AuditStore

    db = tmp_path / "audit.db"
    store = AuditStore(f"sqlite:///{db}")
    store.start()
    try:
        for rule, when in rows:
            manual = rule == "manual"
            store.record_action(
                rule=rule,
                action="set_max_num_seqs" if manual else "cap_max_new_tokens",
                outcome="applied",
                trigger="manual" if manual else "signal",
                time=when,
            )
        assert store.flush()
    finally:
        store.stop()
    return db


def _scrape(rule_actions: int, manual_actions: int) -> dict[str, float]:
    from bench.overload import parse_metrics

    return parse_metrics(
        "# TYPE kvguard_actions_total counter\n"
        f'kvguard_actions_total{{action="cap_max_new_tokens",outcome="applied",rule="kv-high"}}'
        f" {rule_actions:.1f}\n"
        f'kvguard_actions_total{{action="set_max_num_seqs",outcome="applied",rule="manual"}}'
        f" {manual_actions:.1f}\n"
    )


def _chaos_report(db: Path, final: dict[str, float], manual_actions: int, **kw: Any) -> dict:
    """bench/chaos.py's report() on a run with no requests and the given audit DB."""
    from bench.chaos import report

    chaos = SimpleNamespace(reports=[], manual_actions=manual_actions)
    load, d = SimpleNamespace(outcomes=[]), SimpleNamespace(db=db)
    return report(chaos, load, d, final, 0, db.parent, **kw)  # type: ignore[arg-type]


def test_chaos_audit_rows_lost_counts_no_manual_action_twice(tmp_path: Path) -> None:
    """One rule action and one manual action, each with its row: nothing lost. The manual
    action, counted in kvguard_actions_total too, was compared with the rule rows and then
    again with the manual rows: 1 lost."""
    before = datetime.now(UTC) - timedelta(seconds=5)
    db = _audit_db(tmp_path, [("kv-high", before), ("manual", before)])
    res = _chaos_report(db, _scrape(1, 1), 1)
    assert res["audit_rows_lost"] == 0, res["audit"]
    # a row truly missing: the manual action's, then a rule action's
    db = _audit_db(tmp_path / "a", [("kv-high", before)])
    assert _chaos_report(db, _scrape(1, 1), 1)["audit_rows_lost"] == 1
    db = _audit_db(tmp_path / "b", [("kv-high", before), ("manual", before)])
    assert _chaos_report(db, _scrape(2, 1), 1)["audit_rows_lost"] == 1


def test_chaos_audit_rows_of_the_drain_neither_count_nor_offset(tmp_path: Path) -> None:
    """The last scrape comes before SIGTERM; rules still act in the drain and their rows come
    after it. They are not compared (no negative count), nor can they make up for a row of an
    action the scrape counted."""
    scraped = datetime.now(UTC)
    before, drain = scraped - timedelta(seconds=5), scraped + timedelta(seconds=5)
    rows = [("kv-high", before), ("manual", before), ("kv-high", drain), ("kv-high", drain)]
    db = _audit_db(tmp_path, rows)
    res = _chaos_report(db, _scrape(1, 1), 1, scraped_at=scraped)
    assert res["audit_rows_lost"] == 0, res["audit"]
    assert res["audit"]["rule_action_rows_by_final_scrape"] == 1
    assert res["audit"]["rule_action_rows"] == 3  # the drain's rows are reported
    # two rule actions counted at the scrape, one row decided by then: one lost
    assert _chaos_report(db, _scrape(2, 1), 1, scraped_at=scraped)["audit_rows_lost"] == 1


def test_a_bench_daemon_is_given_its_drain_before_a_kill(tmp_path: Path) -> None:
    """bench/chaos.py configured drain_timeout 300 s and killed the daemon after 120: stop()
    waits the configured drain plus a margin before it kills."""
    from bench.overload import Daemon

    d = object.__new__(Daemon)  # the subprocess without `kvguard serve`: stop() is the subject
    d.drain_s = 300
    d.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    d._log = open(tmp_path / "log", "w")  # noqa: SIM115 - stop() closes it
    waited: list[float | None] = []
    wait = d.proc.wait

    def spy(timeout: float | None = None) -> int:
        waited.append(timeout)
        return wait(timeout)

    d.proc.wait = spy  # type: ignore[method-assign]
    assert d.stop() == -15  # SIGTERM ended it
    assert len(waited) == 1 and waited[0] is not None and waited[0] > 300, waited
    from bench import chaos

    assert chaos.DRAIN_S == 300  # what chaos configures, and stop() now derives from


@pytest.mark.parametrize("trace", ["realistic", "adversarial"])
def test_a_relative_overload_workdir_gives_configs_the_daemon_loads(
    trace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvguard bench overload --workdir bench/w` (relative, the caller's, as docs/overload.md
    says) wrote `rules.path: bench/w/rules-fast.yaml` into bench/w/kvguard/config.yaml; the
    daemon reads that from the config's folder and refused to start. Each setup's config, as
    the run writes it, now loads and names files that exist. chaos.py takes the same folder."""
    from bench import chaos, overload
    from kvguard.daemon.config import load_config

    monkeypatch.chdir(tmp_path)
    workdir = overload.bench_workdir(Path("bench/w"), "unused-")
    assert workdir == tmp_path / "bench" / "w" and workdir.is_dir()
    assert chaos.bench_workdir is overload.bench_workdir
    setups = overload.setups(workdir, "tiny", 2**20, 1024, overload.QUICK, 1, trace)
    for s in setups:
        d = workdir / s.name
        d.mkdir()
        (d / "admin.token").write_text("t\n")  # as Daemon writes it
        (d / "config.yaml").write_text(overload.daemon_config(d, s.config, 8000, 60, False))
        cfg = load_config(d / "config.yaml")
        assert cfg.rules.path is not None and cfg.rules.path.is_file(), s.name
        assert cfg.api.admin_token_file == d / "admin.token", s.name
        assert cfg.audit.url == f"sqlite:///{d / 'audit.db'}", s.name


# ----------------------------------------------------------------------------- throughput.py


def _tiny_trace() -> tuple[list[int], list[Any]]:
    from bench.trace import QUICK, make_trace, ordinary_token_ids, resolve_model_dir

    vocab = ordinary_token_ids(resolve_model_dir("tiny"))
    return vocab, make_trace(QUICK, vocab)[:4]


def test_throughput_rounds_on_one_engine_take_no_prompt_from_the_prefix_cache() -> None:
    """Two measure() calls (--rounds 2) on the tiny model: the second round found 608 of its
    662 prompt tokens cached. Also: the warm-up's ids come from the model's vocabulary (ids
    1000.. crashed --model tiny), and the goals' contender serves unquantised weights."""
    from bench import throughput as tp

    vocab, trace = _tiny_trace()
    warmup = tp.warmup_requests(vocab)
    assert all(i in set(vocab) for r in warmup for i in r.prompt_ids)
    c = tp.kvguard_contender("tiny", tp.Limits(32 << 20, 8, 512), 2, warmup)
    assert c.engine.config.model_quantization == "none" and c.in_goals
    for _ in range(2):
        wall, out = c.measure(trace)
        tp.check_lengths(c.name, trace, out)
    assert _hits(c.engine) == 0


def test_throughput_goals_judge_kvguard_on_the_peers_weights(smollm2_dir: Path) -> None:
    """The default model is served packed (4-bit); the transformers peers run fp32. The goals'
    kvguard serves the same fp32 weights; the packed engine is its own row, not judged."""
    from bench import throughput as tp

    limits = tp.Limits(8 << 20, 4, 256)
    warmup = tp.warmup_requests(list(range(3, 1000)))
    same = tp.kvguard_contender("smollm2-135m", limits, 2, warmup)
    assert tp.packed_layers(same.engine) == 0
    served = tp.served_contender("smollm2-135m", limits, 2, warmup)
    assert served is not None and tp.packed_layers(served.engine) > 0
    assert served.name == tp.PACKED_NAME and not served.in_goals
    assert tp.served_contender("tiny", limits, 2, warmup) is None  # tiny: nothing packed


def test_throughput_verdicts_leave_the_packed_row_out() -> None:
    from bench.throughput import PACKED_NAME, Contender, report_rows, verdicts

    def row(name: str, wall: float, in_goals: bool = True) -> Contender:
        return Contender(name, lambda t: (0.0, []), walls=[wall], in_goals=in_goals)

    ours = row("kvguard", 10.0)
    static = row("transformers generate, static 16", 15.0)
    packed = row(PACKED_NAME, 3.0, in_goals=False)
    lines = verdicts([ours, static, packed])
    assert lines == ["goal >= 2x static generate: NOT met (1.50x the fastest static)"]
    rows = report_rows([ours, static, packed], 100, 4)
    assert rows[2][0] == PACKED_NAME and rows[2][4] == "-"  # no speed-up over kvguard itself
    assert rows[1][4] == "1.50x"


# ----------------------------------------------------------------------------- gguf_kquants.py


def test_gguf_kquants_quick_run_serves_each_layout_from_the_same_file(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    """`bench/gguf_kquants.py --quick` as a user runs it, on the default GGUF cut to 2 layers:
    the file and the Q4_K_M, Q5_K_M and IQ4_XS files written from it in llama-quantize's types,
    each served by kvguard packed and fp32 and offered to OpenVINO GenAI, whose row holds its
    figures, or its refusal and which of the file's types it refuses, each tried alone."""
    out = tmp_path / "kquants.json"
    res = subprocess.run(
        [sys.executable, "bench/gguf_kquants.py", "--quick", "--gguf", str(smollm2_gguf)]
        + ["--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    layouts = {lay["layout"]: lay for lay in got["layouts"]}
    assert list(layouts) == ["Q4_1", "Q4_K_M", "Q5_K_M", "IQ4_XS"]
    # 576-wide rows take the 32-weight fallbacks, ffn_down (1536) the K-quants; of 2 layers,
    # layer 1 is the one whose attn_v and ffn_down get 6 bits (Q6_K, Q8_0 where 576 wide), as
    # does the tied embedding (Q8_0); the norms stay F32
    assert layouts["Q4_1"]["types"] == {"Q4_1": 14, "Q8_0": 1, "F32": 5}
    assert layouts["Q4_K_M"]["types"] == {"Q5_0": 11, "Q8_0": 2, "Q4_K": 1, "Q6_K": 1, "F32": 5}
    assert layouts["Q5_K_M"]["types"] == {"Q5_1": 11, "Q8_0": 2, "Q5_K": 1, "Q6_K": 1, "F32": 5}
    assert layouts["IQ4_XS"]["types"] == {"IQ4_NL": 12, "IQ4_XS": 2, "Q8_0": 1, "F32": 5}
    peer_installed = importlib.util.find_spec("openvino_genai") is not None
    for lay in got["layouts"]:
        rows = {r["engine"]: r for r in lay["engines"]}
        assert list(rows) == ["kvguard packed", "OpenVINO GenAI", "kvguard fp32"]
        packed, fp32, peer = rows["kvguard packed"], rows["kvguard fp32"], rows["OpenVINO GenAI"]
        for r in (packed, fp32):
            assert min(r["bs1_tok_s"], r["bs32_tok_s"], r["trace_tok_s"]) > 0, r
        assert packed["weight_bytes"] < 0.3 * fp32["weight_bytes"]  # codes, not floats
        assert fp32["same_outputs"] == got["requests"] and fp32["same_tokens"] == 1.0
        assert ("peer_missing" in lay) is not peer_installed
        if "peer_refused" in lay:  # the refusal explained: a type of this file it cannot read
            refused = lay["peer_refused"]["types_refused"]
            assert refused and set(refused) <= set(lay["types"])
        elif peer_installed:
            assert min(peer["bs1_tok_s"], peer["bs32_tok_s"], peer["trace_tok_s"]) > 0, peer
    assert "peer_refused" not in layouts["Q4_1"]  # OpenVINO GenAI reads the default GGUF


# ----------------------------------------------------------------------------- offload.py


def test_offload_passes_on_one_engine_take_no_prompt_from_the_prefix_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The squeezed engine serves the trace with swap, then with recompute; the reference
    engine prefills the recompute sequence once per rep (rep 2 on was wholly cached)."""
    from bench import offload as ol
    from bench.trace import make_trace, ordinary_token_ids, resolve_model_dir

    engines: list[Any] = []
    make_engine = ol.make_engine

    def kept(*a: Any, **k: Any) -> Any:
        engines.append(make_engine(*a, **k))
        return engines[-1]

    monkeypatch.setattr(ol, "make_engine", kept)
    args = argparse.Namespace(model="tiny", threads=2, rounds=1)
    trace = make_trace(ol.QUICK, ordinary_token_ids(resolve_model_dir("tiny")))
    pool = max(4, ol.demand_blocks(trace) // 2)
    swap, recompute = ol.squeezed_runs(args, trace, pool)
    assert swap.preemptions.get("swap") and recompute.preemptions.get("recompute")
    ol.measure_recompute(engines[0], 64, 2, 1)  # recompute reps: one prompt prefilled twice
    assert len(engines) == 1 and _hits(engines[0]) == 0


# ----------------------------------------------------------------------------- verdicts


def test_kv_memory_judges_only_the_stated_goal() -> None:
    """README states >= 4x concurrency against the max-length reservation; the kindest fixed
    reservation (the trace's longest request) is reported, not judged."""
    from bench.kv_memory import AllocStats, verdicts

    def stats(name: str, peak: int, live: float = 0.5) -> AllocStats:
        return AllocStats(name, 1000, peak, live, live, 10)

    ours = stats("kvguard paged blocks", 12, 0.97)
    peers = [stats("reserve max_model_len=4096", 2), stats("reserve trace max length=127", 12)]
    peers.append(stats("reserve prompt+max_tokens (oracle)", 12))
    lines = verdicts(ours, peers)
    goals = [ln for ln in lines if ln.startswith("goal ")]
    assert goals == [
        "goal >= 4x concurrency vs reserve max_model_len=4096: met (6.0x)",
        "goal >= 96% of allocated slots live: met (97.0% mean)",
    ]
    assert "concurrency vs reserve trace max length=127: 1.0x (reported, no goal stated)" in lines


def test_control_loop_states_its_goals_met_or_not() -> None:
    from bench.control_loop import verdicts

    met = verdicts([0.41, 0.47], 1.0, 100.0, 98.0)
    assert met[0].startswith("goal reaction <= interval + 100 ms (1.1 s): met (slowest 0.470 s")
    assert met[1] == "goal control plane costs <= 3% throughput: met (+2.0%, medians)"
    missed = verdicts([0.5, 1.25], 1.0, 100.0, 90.0)
    assert [ln.split(": ")[1].split(" (")[0] for ln in missed] == ["NOT met", "NOT met"]
    assert verdicts([], 1.0, 0.0, 0.0)[0].endswith("not measured (no reaction measured)")


def test_fp8_states_its_agreement_goal_met_or_not() -> None:
    import torch

    from bench.fp8 import Agreement, Capacity, DecodeRun, PauseSample, summary

    caps = [Capacity("fp32", 100, 1600, 1 << 20), Capacity("fp8_e4m3", 398, 6368, 1 << 20)]
    pauses = [PauseSample(10, 0.5, 1 << 30, 0.2, 0, 0.1)]
    runs = [DecodeRun("fp32", 1.0, 100), DecodeRun("fp8_e4m3", 1.0, 100)]
    cpu = SimpleNamespace(device=torch.device("cpu"))

    def lines(share: float) -> list[str]:
        agree = Agreement(4, 32, 128, share, 1.0)
        return summary(cpu, caps, pauses, agree, runs[0], runs[1], (512, runs[0], runs[1]))  # type: ignore[arg-type]

    goal = "goal teacher-forced top-1 agreement >= 98%: "
    assert goal + "met (99.22% over 128 positions)" in lines(127 / 128)
    assert goal + "NOT met (90.00% over 128 positions)" in lines(0.9)


def test_fp8_reads_the_gap_spanning_a_switch_against_the_gaps_before_it() -> None:
    from bench.fp8 import GAPS_AFTER, GAPS_BEFORE, gaps_around

    # two streams, a token every 10 ms; the switch posted when each had 20 tokens, and the
    # gap it spans (ending at token 20, index 20) 0.5 s in the first, 0.3 s in the second
    times = []
    for stall in (0.5, 0.3):
        t = [0.01 * k for k in range(20)]
        t += [t[-1] + stall + 0.01 * k for k in range(GAPS_AFTER + 2)]
        times.append(t)
    median, worst = gaps_around(times, [20, 20])
    assert round(median, 6) == 0.01 and round(worst, 6) == 0.5
    # a stall before the mark counts in the median's gaps only (GAPS_BEFORE of them)
    times[0][10:] = [x + 2.0 for x in times[0][10:]]
    median, worst = gaps_around(times, [20, 20])
    assert round(median, 6) == 0.01 and round(worst, 6) == 0.5 and GAPS_BEFORE >= 10
