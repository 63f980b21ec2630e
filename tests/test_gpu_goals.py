"""The verdicts bench/gpu_e2e.py prints from a device run: they decide which opt-in CUDA path
becomes a default (the per-layer Triton ops, the Triton prefill, FP8 pools under graphs), so
their arithmetic is checked here on results shaped like a run's JSON."""

from __future__ import annotations

from typing import Any

from bench.gpu_e2e import goals


def _run(b1: float, fused_b1: float, trace: dict[str, Any], fp8_speedup: float) -> dict[str, Any]:
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

    slower = goals(_run(140.7, 120.0, {**trace, "kvguard_triton_prefill_tok_s": 700.0}, 0.9))
    assert "NOT met" in _line(slower, "per-layer Triton ops faster")
    assert "NOT met" in _line(slower, "Triton prefill kernel")
    assert "NOT met" in _line(slower, "FP8 pool replayed")


def test_a_cpu_smoke_run_claims_no_goal() -> None:
    run = _run(140.7, 201.0, {}, 4.5)
    run["device"] = "cpu"
    del run["cuda_graphs"]
    lines = goals(run)
    assert lines == ["goal llama2-7b decode goals: not measured (no GPU numbers)"]
