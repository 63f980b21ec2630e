"""The verdicts bench/gpu_e2e.py and bench/gpu_gemv.py print from a device run: they decide which
opt-in CUDA path becomes a default (the per-layer Triton ops, the Triton prefill, FP8 pools under
graphs, the skinny GEMMs), so their arithmetic is checked here on results shaped like a run's
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
                "trace": trace,
            }
        },
        "cuda_graphs": {
            "tiny_fp32": {"same_tokens": True, "captures": 1},
            "rows": [{"batch": 1, "speedup": 6.9, "captures": 1}],
            "fp8": {"batch": 16, "speedup": fp8_speedup, "same_tokens": "16/16"},
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
    assert ": met (trace 1.25x, same outputs 31/32)" in _line(lines, "Triton prefill kernel")
    assert ": met (batch 16 4.50x, same tokens 16/16)" in _line(lines, "FP8 pool replayed")

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
