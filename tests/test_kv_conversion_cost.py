"""A live KV dtype switch costs what the live blocks cost.

The switch (a rule's `enable_fp8_kv`, its undo) runs between two steps and holds every stream
meanwhile. On a CPU it converted the live blocks through a dozen torch ops a layer, each
allocating and walking the layer's live K/V again and each a parallel region of its own: on 2
cores other processes also used, an 8-stream switch of the default pool paused serving for
seconds. The live blocks now go through one C pass a layer.
"""

from __future__ import annotations

import pytest

from kvguard.engine import LLMEngine, SamplingParams
from kvguard.engine import kv_cache as kv_cache_module
from kvguard.kernels import cpu_lowbit, cpu_ops
from tests.test_engine import make_engine


def switch(engine: LLMEngine, dtype: str) -> dict:
    fut = engine.set_kv_cache_dtype(dtype)
    engine.step()
    res = fut.result(0)
    assert res.ok and engine.kv_cache.dtype == dtype, res.detail
    return res.data


@pytest.fixture
def serving() -> LLMEngine:
    """Four requests decoding on a pool of 16 MiB per layer's K (and V), fp32."""
    engine = make_engine(kv_cache_bytes="64MiB")
    for i in range(4):
        engine.add_request([3 + (5 * i + j) % 200 for j in range(40)], greedy(24))
    for _ in range(4):
        engine.step()
    return engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_live_blocks_go_through_one_c_call_per_tensor_and_no_torch_pass(
    serving: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C conversion serves every K and V of every layer, handed exactly the live blocks:
    torch's read/write pair (the reference, and the path where the C kernels are off) does
    not run."""
    assert cpu_lowbit.available(), "the C kernels must build here (.ci/run installs gcc)"
    engine = serving
    calls: list[int] = []
    real = cpu_ops.convert_blocks

    def counted(src, src_scales, src_ids, *rest):  # noqa: ANN001, ANN202
        calls.append(src_ids.numel())
        return real(src, src_scales, src_ids, *rest)

    def refuse(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("torch's conversion must not run where the C kernel serves")

    monkeypatch.setattr(cpu_ops, "convert_blocks", counted)
    monkeypatch.setattr(kv_cache_module, "read_blocks", refuse)
    monkeypatch.setattr(kv_cache_module, "write_blocks", refuse)
    used = engine.snapshot().blocks_used
    switch(engine, "fp8_e4m3")
    assert calls == [used] * (2 * engine.model_config.num_layers)
