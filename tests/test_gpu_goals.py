"""The verdicts bench/gpu_e2e.py, gpu_gemv.py, gpu_kernels.py and gpu_w4a16.py print from a
device run: they decide which opt-in CUDA path becomes a default (the per-layer Triton ops, the
Triton prefill, FP8 pools under graphs, the skinny GEMMs, FP8 tiles widened as loaded, the
nibble-plane W4A16 GEMM), so their arithmetic is checked here on results shaped like a run's
JSON."""

from __future__ import annotations

from typing import Any

from bench import gpu_gemv
from bench.gpu_e2e import goals


def _run(
    b1: float,
    fused_b1: float,
    trace: dict[str, Any],
    fp8_speedup: float,
    gemv_b1: float = 150.0,
    both_b1: float = 190.0,
    tiny_same: bool = True,
    fused_same: bool = True,
    prefill_same: bool = True,
    fp8_same: bool = True,
    captures: int = 1,
) -> dict[str, Any]:
    return {
        "device": "NVIDIA H200",
        "decode": {
            "llama2-7b": {
                "limit_tok_s_b1": 314.0,
                "rows": [
                    {"batch": 1, "kvguard_tok_s": b1, "ratio": 4.0},
                    {"batch": 64, "kvguard_tok_s": 5724.8, "ratio": 2.26},
                ],
                "fused_on": [
                    {"batch": 1, "kvguard_tok_s": fused_b1, "same_first8": "1/1"},
                    {"batch": 64, "kvguard_tok_s": 5800.0, "same_first8": "60/64"},
                ],
                "gemv_on": [
                    {"batch": 1, "kvguard_tok_s": gemv_b1, "same_first8": "1/1"},
                    {"batch": 64, "kvguard_tok_s": 5700.0, "same_first8": "58/64"},
                ],
                "fused_gemv_on": [{"batch": 1, "kvguard_tok_s": both_b1, "same_first8": "1/1"}],
                "gemv_tiny_fp32": {"same_tokens": tiny_same, "captures": 4},
                "fused_tiny_fp32": {"same_tokens": fused_same, "captures": 4},
                "prefill_tiny_fp32": {"same_tokens": prefill_same, "captures": 4},
                "trace": trace,
            }
        },
        "cuda_graphs": {
            "tiny_fp32": {"same_tokens": True, "captures": captures},
            "rows": [{"batch": 1, "speedup": 6.9, "captures": captures}],
            "fp8": {
                "batch": 16,
                "speedup": fp8_speedup,
                "same_tokens": "16/16",
                "captures": captures,
                "tiny_fp32": {"same_tokens": fp8_same, "captures": captures},
            },
        },
    }


def _line(lines: list[str], what: str) -> str:
    return next(line for line in lines if what in line)


def test_a_faster_opt_in_path_is_met_and_a_slower_one_is_not() -> None:
    trace = {
        "kvguard_tok_s": 800.0,
        "kvguard_triton_prefill_tok_s": 1000.0,
        "triton_prefill_same_outputs": "31/32",
    }
    lines = goals(_run(140.7, 201.0, trace, 4.5))
    assert "met (2.26x)" in _line(lines, "2.0x transformers static")
    assert "NOT met (45% of 314 tok/s)" in _line(lines, "batch-1 decode")
    fused = _line(lines, "per-layer Triton ops faster")
    assert ": met (batch 1 1.43x (64% of the limit)" in fused and "60/64 at 64" in fused
    assert ": met (trace 1.25x, same outputs 31/32, tiny fp32 tokens equal)" in _line(
        lines, "Triton prefill kernel"
    )
    assert ": met (batch 16 4.50x, same tokens 16/16, tiny fp32 tokens equal)" in _line(
        lines, "FP8 pool replayed"
    )
    assert "60/64 at 64, tiny fp32 tokens equal)" in fused
    assert ": met (tiny fp32 tokens equal, batch-1 speed-up 6.90x)" in _line(lines, "CUDA graphs")

    gemv = _line(lines, "skinny GEMMs faster in decode")
    assert ": met (batch 1 1.07x (48% of the limit)" in gemv
    assert "58/64 at 64, tiny fp32 tokens equal" in gemv
    assert ": met (61% of 314 tok/s)" in _line(lines, "with both opt-ins")

    slower = goals(_run(140.7, 120.0, {**trace, "kvguard_triton_prefill_tok_s": 700.0}, 0.9, 130.0))
    assert "NOT met" in _line(slower, "skinny GEMMs faster")
    # faster but with other tokens on the fp32 tiny model: not met
    differ = goals(_run(140.7, 201.0, trace, 4.5, tiny_same=False))
    assert "NOT met" in _line(differ, "skinny GEMMs faster") and "DIFFER" in _line(differ, "skinny")
    low = goals(_run(140.7, 201.0, trace, 4.5, both_b1=170.0))
    assert ": NOT met (54% of 314 tok/s)" in _line(low, "with both opt-ins")
    assert "NOT met" in _line(slower, "per-layer Triton ops faster")
    assert "NOT met" in _line(slower, "Triton prefill kernel")
    assert "NOT met" in _line(slower, "FP8 pool replayed")


def test_a_faster_opt_in_path_with_other_tokens_or_no_graphs_is_not_met() -> None:
    """Faster is not enough to become a default: the tiny fp32 model's tokens must be the
    default path's, checked (a run cut before the check proves nothing), and graphs that
    never captured on the GPU are a failed verdict, not a missing one."""
    trace = {
        "kvguard_tok_s": 800.0,
        "kvguard_triton_prefill_tok_s": 1000.0,
        "triton_prefill_same_outputs": "32/32",
    }
    lines = goals(_run(140.7, 201.0, trace, 4.5, fused_same=False, prefill_same=False))
    assert ": NOT met" in _line(lines, "per-layer Triton ops faster")
    assert "DIFFER" in _line(lines, "per-layer Triton ops faster")
    assert ": NOT met" in _line(lines, "Triton prefill kernel faster")
    lines = goals(_run(140.7, 201.0, trace, 4.5, fp8_same=False))
    assert ": NOT met" in _line(lines, "FP8 pool replayed") and "DIFFER" in _line(lines, "FP8")
    uncaptured = goals(_run(140.7, 201.0, trace, 4.5, captures=0))
    assert "NOT met" in _line(uncaptured, "CUDA graphs equal") and "NOTHING CAPTURED" in _line(
        uncaptured, "CUDA graphs equal"
    )
    assert "NOT met" in _line(uncaptured, "FP8 pool replayed")
    cut = _run(140.7, 201.0, trace, 4.5)
    del cut["decode"]["llama2-7b"]["fused_tiny_fp32"]
    assert "NOT met" in _line(goals(cut), "per-layer Triton ops faster")
    assert "tiny fp32 tokens not checked" in _line(goals(cut), "per-layer Triton ops faster")


def test_a_cpu_smoke_run_claims_no_goal() -> None:
    run = _run(140.7, 201.0, {}, 4.5)
    run["device"] = "cpu"
    del run["cuda_graphs"]
    lines = goals(run)
    assert lines == ["goal llama2-7b decode goals: not measured (no GPU numbers)"]


def _dense(model: str, shape: str, rows: int, speedup: float, of_copy: float) -> dict[str, Any]:
    n, k = {"o": (4096, 4096), "gate_up": (22016, 4096)}[shape]
    row = {"model": model, "shape": shape, "n": n, "k": k, "rows": rows, "speedup": speedup}
    return row | {"triton_of_copy": of_copy}


def test_skinny_gemm_kernel_verdicts() -> None:
    """gpu_gemv.py: faster than cuBLAS only if every llama2-7b row is (SmolLM2's rows, launch
    bound, do not decide); one-row bandwidth weighted by each weight's bytes."""
    dense = [
        _dense("llama2-7b", "o", 1, 1.6, 0.70),
        _dense("llama2-7b", "gate_up", 1, 1.3, 0.80),
        _dense("llama2-7b", "gate_up", 8, 1.1, 0.75),
        _dense("smollm2", "o", 1, 0.5, 0.05),
    ]
    w4 = [{"speedup": 3.0}, {"speedup": 2.0}]
    lines = gpu_gemv.goals({"dense": dense, "w4a16": w4}, smoke=False)
    assert ": met (geomean 1.32x, worst 1.10x (gate_up at 8 rows))" in _line(lines, "cuBLAS")
    assert ": met (78%)" in _line(lines, "70% of copy bandwidth")
    assert ": met (geomean 2.45x, worst 2.00x)" in _line(lines, "tiled W4A16")
    dense[2]["speedup"] = 0.9
    w4[1]["speedup"] = 0.8
    lines = gpu_gemv.goals({"dense": dense, "w4a16": w4}, smoke=False)
    assert "NOT met" in _line(lines, "cuBLAS") and "NOT met" in _line(lines, "tiled W4A16")
    assert gpu_gemv.goals({"dense": dense, "w4a16": w4}, smoke=True) == [
        "goal skinny GEMM goals: not measured (no GPU numbers)"
    ]


def test_the_verdicts_of_a_saved_run_print_alone(tmp_path) -> None:  # noqa: ANN001
    """`gpu_e2e.py --goals FILE`: a run cut short before its verdicts still gets them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    saved = tmp_path / "gpu_e2e.json"
    saved.write_text(json.dumps(_run(140.7, 201.0, {}, 4.5)))
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_e2e.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--goals", str(saved)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == goals(_run(140.7, 201.0, {}, 4.5))


def _attention_rows(fp8e_ms: float, fp8e_err: float = 0.01) -> list[Any]:
    from bench.gpu_kernels import Row

    rows = []
    for shape in ("smollm2", "llama2-7b"):
        for ctx in (1024, 4096, 16384):
            for kv, ms in (("bf16", 1.0), ("fp8", 1.2), ("fp8e", fp8e_ms)):
                bw = 0.9 if kv == "bf16" else 0.5
                err = fp8e_err if kv == "fp8e" else 0.01
                rows.append(Row(shape, kv, 64, ctx, ms, ms, "graph", 1.0, 1.0, bw, 1.0, ms, err))
    return rows


def test_attention_verdicts_judge_fp8_widened_as_loaded_apart() -> None:
    """gpu_kernels.py: the issue's attention goals over the default kernels only (the opt-in
    fp8e rows, at every context including 1k, neither help nor hurt them), and the opt-in's own
    verdict: faster than the plain FP8 rows at 4k+ with the reference's values."""
    from bench.gpu_kernels import goals as attention_goals

    faster, slower, wrong = (
        attention_goals(_attention_rows(*a), False) for a in ((0.9,), (1.3,), (0.9, 0.5))
    )
    assert faster[:2] == slower[:2] == wrong[:2]
    assert faster[0].startswith("goal >= 70% of copy bandwidth at 4k+: NOT met (worst 50%")
    assert "FP8 widened as loaded faster: met (worst 1.33x" in faster[2]
    assert "FP8 widened as loaded faster: NOT met" in slower[2]
    assert "FP8 widened as loaded faster: NOT met" in wrong[2]
    plain = [r for r in _attention_rows(0.9) if r.kv_dtype != "fp8e"]
    assert "not measured" in attention_goals(plain, False)[2]
    assert "not measured" in attention_goals(plain, True)[0]


def test_w4a16_planes_verdict() -> None:
    """gpu_w4a16.py: the nibble planes must beat the tiled kernel at every fused batch (not
    the dequantise + matmul ones past LARGE_M), with the reference's values."""
    from bench.gpu_w4a16 import Row, goals

    def rows(ratios: list[float], err: float = 1e-3) -> list[Row]:
        out = []
        for b, r in zip((1, 16, 64, 256), ratios, strict=True):
            out.append(Row("qkvo", 4096, 4096, b, "-", 1, 1, 1, r, 1, 1, 1, r, 1, 1, 1, 1e-3, err))
        return out

    assert "met (worst 1.25x: qkvo batch 64)" in goals(rows([0.5, 0.6, 0.8, 3.0]), False)[0]
    assert "NOT met (worst 0.91x: qkvo batch 16)" in goals(rows([0.5, 1.1, 0.8, 0.1]), False)[0]
    assert "NOT met" in goals(rows([0.5, 0.6, 0.8, 0.9], err=0.5), False)[0]
    assert "not measured" in goals(rows([0.5, 0.6, 0.8, 0.9]), True)[0]


def test_packed_planes_verdict() -> None:
    """gpu_e2e.py's packed section: the nibble planes decode faster past the skinny GEMMs'
    rows at every batch they ran, or the verdict says which batch lost."""

    def packed(s16: float, s64: float) -> dict[str, Any]:
        rows = [{"batch": 1, "tiled_tok_s": 100.0, "skinny_tok_s": 150.0, "speedup": 1.5}]
        rows[0]["same_first8"] = "1/1"
        for b, sp in ((16, s16), (64, s64)):
            row = {"batch": b, "tiled_tok_s": 100.0, "skinny_tok_s": 100.0, "speedup": 1.0}
            row |= {"same_first8": f"{b}/{b}", "planes_tok_s": 100 * sp, "planes_speedup": sp}
            rows.append(row | {"planes_same_first8": f"{b}/{b}"})
        return {"device": "NVIDIA H200", "packed": {"limit_tok_s_b1": 1000.0, "rows": rows}}

    def line(result: dict[str, Any]) -> str:
        return next(x for x in goals(result) if "nibble planes" in x)

    assert line(packed(1.4, 1.2)).startswith(
        "goal 4-bit model decode faster with nibble planes: met"
    )
    assert "NOT met (worst 0.90x at batch 64" in line(packed(1.4, 0.9))
    assert not any("nibble planes" in x for x in goals(packed(1.4, 1.2) | {"device": "cpu"}))


def test_runs_of_decode_steps_verdicts() -> None:
    """Runs decide `serving.decode_steps`' default: faster at both ends and every sequence's
    whole output equal; batch 1 with the per-layer ops and runs against the limit."""

    def with_runs(
        b1: float, b64: float, same64: str, fused_runs: float, ahead: int = 90
    ) -> list[str]:
        run = _run(140.7, 201.0, {}, 4.5)
        dec = run["decode"]["llama2-7b"]
        runs = {"decode_steps": 4, "steps_ahead": ahead}
        dec["runs_on"] = [
            {"batch": 1, "kvguard_tok_s": b1, "same_tokens": "1/1"} | runs,
            {"batch": 64, "kvguard_tok_s": b64, "same_tokens": same64} | runs,
        ]
        dec["fused_runs_on"] = [
            {"batch": 1, "kvguard_tok_s": fused_runs, "decode_steps": 4, "same_tokens": "1/1"}
        ]
        return goals(run)

    lines = with_runs(160.0, 6300.0, "64/64", 220.0)
    assert ": met (batch 1 1.14x, batch 64 1.10x, same tokens 1/1 at 1, 64/64 at 64)" in _line(
        lines, "runs of decode steps faster"
    )
    assert ": met (70% of 314 tok/s)" in _line(lines, "per-layer ops and runs of 4")
    assert "NOT met" in _line(with_runs(160.0, 6300.0, "63/64", 220.0), "runs of decode steps")
    assert "NOT met" in _line(with_runs(160.0, 5600.0, "64/64", 220.0), "runs of decode steps")
    # faster but no step ran inside a run: not the runs' doing
    assert "NOT met" in _line(with_runs(160.0, 6300.0, "64/64", 220.0, 0), "runs of decode")
    assert ": NOT met (51% of 314" in _line(
        with_runs(160.0, 6300.0, "64/64", 160.0), "per-layer ops and runs"
    )


def test_nvml_verdict_needs_the_engines_gpu_found_by_pci_address() -> None:
    found = {"engine_gpus": ["0000:3b:00.0"], "own_gpus": [0], "signal": 0.02}
    lost = found | {"own_gpus": [], "signal": None}  # NVML never matched torch's address
    line = _line(goals({"device": "H200", "nvml": found}), "NVML finds")
    assert ": met" in line and "NOT" not in line, line
    assert "NOT met" in _line(goals({"device": "H200", "nvml": lost}), "NVML finds")
    assert not [s for s in goals({"device": "cpu", "nvml": {"available": False}}) if "NVML" in s]


def test_a_rate_that_was_not_measured_reads_not_measured() -> None:
    """A run cut short leaves NaN for a rate it never timed (decode_rate's median of no
    samples): the verdicts that turn on it read `not measured`, as an absent figure does, not
    `NOT met (nan%)`; a figure that was measured and fails still reads NOT met."""
    nan = float("nan")
    trace = {
        "kvguard_tok_s": 800.0,
        "kvguard_triton_prefill_tok_s": nan,
        "triton_prefill_same_outputs": "32/32",
    }
    lines = goals(_run(nan, 201.0, trace, nan))
    assert ": not measured (- of 314 tok/s)" in _line(lines, "of the bandwidth limit")
    assert ": not measured (batch 1 - (64% of the limit)" in _line(lines, "per-layer Triton ops")
    assert ": not measured (batch 1 -" in _line(lines, "skinny GEMMs faster in decode")
    assert ": not measured (trace -, same outputs" in _line(lines, "Triton prefill kernel")
    assert ": not measured (batch 16 -, same tokens" in _line(lines, "FP8 pool replayed")
    assert not [x for x in lines if "nan" in x], lines
    # measured and slower at one end: NOT met, though the other end was not measured
    run = _run(nan, 201.0, trace, 4.5)
    dec = run["decode"]["llama2-7b"]
    dec["runs_on"] = [
        {"batch": 1, "kvguard_tok_s": 160.0, "same_tokens": "1/1", "steps_ahead": 9},
        {"batch": 64, "kvguard_tok_s": 5600.0, "same_tokens": "64/64", "steps_ahead": 9},
    ]
    assert ": NOT met (batch 1 -, batch 64 0.98x" in _line(goals(run), "runs of decode steps")


def test_a_run_past_its_deadline_lists_what_it_did_not_run(tmp_path) -> None:  # noqa: ANN001
    """`gpu_e2e.py --deadline S` starts no section after S seconds: the sections left are
    listed as not run (not failed), the verdicts printed, the JSON written, exit 0."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "gpu_e2e.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_e2e.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--cpu-smoke", "--deadline", "0"]
        + ["--sections", "nvml,decode,oom", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads(out.read_text())
    assert saved["not_run"] == ["decode/tiny", "oom"]
    assert "decode" not in saved and "oom" not in saved and "errors" not in saved
    assert "not run (deadline reached): decode/tiny, oom" in proc.stdout.splitlines()


def test_gpu_check_step_limits_fit_its_deadline_in_the_wanted_order() -> None:
    """bench/gpu_check.sh: the time limits of the steps a one-GPU run takes add up to no more
    than its deadline (so no step is starved by those before it using their limits), and the
    kernel benchmark, which judges decode attention, runs right after the end-to-end step."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh").read_text()
    main = text[text.index('local steps="') :]
    deadline = int(re.search(r"DEADLINE_S=\$\{DEADLINE_S:-(\d+)\}", text).group(1))
    blocks = re.split(r'\n  if \[\[ \$steps [!=]= \*" (\w+) "\* \]\]; then', main)
    order = blocks[1::2]
    assert order == ["tests", "e2e", "kernels", "gemv", "tp", "w4a16"]
    limits = {
        step: sum(int(n) for n in re.findall(r"left (\d+)\)", body))
        for step, body in zip(order, blocks[2::2], strict=True)
    }
    one_gpu = sum(n for step, n in limits.items() if step != "tp")
    assert one_gpu <= deadline, limits
