"""The Triton per-layer ops (`kvguard.kernels.triton_fused`) against the torch code they replace.

On a CPU-only machine the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set before
anything imports triton); with `KVGUARD_TEST_DEVICE=cuda` (bench/gpu_check.sh) compiled on the
GPU. The reference is the model's own torch path (`RMSNorm` with the native kernels off,
`apply_rope`, `F.silu(gate) * up`), in each activation dtype the engine serves.
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("KVGUARD_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton")

from kvguard.engine.model import RMSNorm, apply_rope  # noqa: E402
from kvguard.kernels import cpu_ops, dispatch  # noqa: E402

tf = pytest.importorskip("kvguard.kernels.triton_fused")
FUSED_OPS = dispatch.fused_ops  # the real one (the fixture below stands another in)

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("KVGUARD_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def tol(dtype: torch.dtype) -> dict[str, float]:
    """fp32: summation order only. 16-bit: one unit in the last place (a sum in another order
    can round the other way); two for bf16 in the interpreter, which truncates fp32 -> bf16."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    if dtype == torch.float16:
        return {"atol": 1e-2, "rtol": 2**-10}
    return {"atol": 1e-2, "rtol": 2**-6 if DEVICE == "cpu" else 2**-7}


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch: pytest.MonkeyPatch):
    """The references run the model's torch code: the CPU C kernels off, and (on CUDA) the
    model's hooks (`dispatch.layer_ops`) kept off these kernels unless a test turns them on."""
    monkeypatch.setattr(dispatch, "fused_ops", lambda x: None)
    monkeypatch.setenv(cpu_ops.ENV, "0")
    cpu_ops.reset()
    with torch.inference_mode():
        yield
    cpu_ops.reset()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 0])
def test_rmsnorm_and_the_residual_add_match_torch(dtype: str, rows: int) -> None:
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(rows)
    d = 576  # not a power of two: the row is masked
    x = (torch.randn(rows, d, generator=gen) * 3).to(DEVICE, dt)
    y = torch.randn(rows, d, generator=gen).to(DEVICE, dt)
    norm = RMSNorm(d, 1e-5).to(DEVICE, dt)
    norm.weight.data = torch.randn(d, generator=gen).to(DEVICE, dt)
    want_sum, want = norm.add_forward(x, y)  # torch path: a new sum, then the norm
    got_x = x.clone()
    got = tf.rmsnorm(got_x, norm.weight, 1e-5, y)
    # x += y in place, rounded as torch rounds (the interpreter truncates fp32 -> bf16: one ulp)
    exact = dt != torch.bfloat16 or DEVICE != "cpu"
    torch.testing.assert_close(got_x, want_sum, atol=0, rtol=0 if exact else 2**-7)
    torch.testing.assert_close(got, norm(got_x), **tol(dt))
    torch.testing.assert_close(tf.rmsnorm(want_sum, norm.weight, 1e-5), want, **tol(dt))
    assert got.dtype == dt and got.shape == x.shape


def test_rmsnorm_takes_strided_rows_and_refuses_a_strided_last_dim() -> None:
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 40, generator=gen).to(DEVICE)
    x = wide[:, :32]  # rows 40 apart
    w = torch.randn(32, generator=gen).to(DEVICE)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(tf.rmsnorm(x, w, 1e-6), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unit stride"):
        tf.rmsnorm(wide.t(), w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_equals_apply_rope_on_q_and_k_only(dtype: str) -> None:
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(6)
    t, nh, nkv, d = 5, 6, 2, 48  # half a head (24) is not a power of two
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=gen).to(DEVICE, dt)
    pos = torch.tensor([0, 3, 17, 100, 2047])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat((torch.outer(pos.float(), inv),) * 2, -1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    want_q = apply_rope(qkv[:, : nh * d].view(t, nh, d), cos[:, None], sin[:, None])
    want_k = apply_rope(qkv[:, nh * d : (nh + nkv) * d].view(t, nkv, d), cos[:, None], sin[:, None])
    got = qkv.clone()
    tf.rope_(got, nh + nkv, d, cos, sin)
    torch.testing.assert_close(got[:, : nh * d], want_q.reshape(t, -1), **tol(dt))
    torch.testing.assert_close(got[:, nh * d : (nh + nkv) * d], want_k.reshape(t, -1), **tol(dt))
    assert torch.equal(got[:, (nh + nkv) * d :], qkv[:, (nh + nkv) * d :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 20])  # several row pieces, and one short masked piece
def test_silu_mul_matches_torch_on_strided_rows(dtype: str, inter: int) -> None:
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(inter)
    wide = (torch.randn(3, 2 * inter + 5, generator=gen) * 6).to(DEVICE, dt)
    wide[0, :4] = torch.tensor([-60.0, 60.0, 0.0, -0.0])  # saturating exponents, zeros
    gu = wide[:, : 2 * inter]  # a row stride wider than the row
    got = tf.silu_mul(gu, inter)
    gate, up = gu.split(inter, -1)
    assert got.shape == (3, inter) and got.is_contiguous() and got.dtype == dt
    torch.testing.assert_close(got, F.silu(gate) * up, **tol(dt))
    with pytest.raises(ValueError, match="silu_mul"):
        tf.silu_mul(gu, inter + 1)


def test_the_dispatch_is_opt_in_and_serves_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.FUSED_OPS_ENV, "1")
    assert FUSED_OPS(torch.zeros(2)) is None  # CPU activations: the C kernels' job
    if DEVICE == "cuda":
        x = torch.zeros(2, device="cuda")
        assert FUSED_OPS(x) is tf
        monkeypatch.setenv("KVGUARD_TRITON", "0")
        assert FUSED_OPS(x) is None
        monkeypatch.delenv("KVGUARD_TRITON")
        monkeypatch.delenv(dispatch.FUSED_OPS_ENV)
        assert FUSED_OPS(x) is None  # off unless asked


def test_the_tiny_model_gives_the_torch_logits_with_the_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model's hooks: every layer's norms, RoPE and MLP through the kernels (forced on for
    this device) give the torch path's logits, prefill and decode rows together."""
    from kvguard.engine import EngineConfig, LLMEngine, SamplingParams

    # a fixed pool: sized from gpu_memory_utilization on CUDA, the first engine would leave
    # the second none while it is still referenced
    cfg = EngineConfig(model="tiny", device=DEVICE, dtype="fp32", max_num_seqs=2, num_gpu_blocks=64)
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    calls: list[str] = []

    def counted(name: str):  # noqa: ANN202
        fn = getattr(tf, name)

        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls.append(name)
            return fn(*a, **k)

        return run

    class Counted:
        rmsnorm, rope_, silu_mul = counted("rmsnorm"), counted("rope_"), counted("silu_mul")

    outs = {}
    for on in (False, True):
        monkeypatch.setattr(dispatch, "fused_ops", (lambda x: Counted) if on else (lambda x: None))
        eng = LLMEngine.from_config(cfg, progress=False)
        eng.model.fuse_cpu_decode = False
        res = eng.generate(prompts, params)
        outs[on] = [
            (
                r.token_ids,
                [[p for _, p in lp.top] for lp in r.final_prompt_logprobs + r.final_logprobs],
            )
            for r in res
        ]
    assert {"rmsnorm", "rope_", "silu_mul"} <= set(calls)
    for (tok_a, lp_a), (tok_b, lp_b) in zip(outs[False], outs[True], strict=True):
        assert tok_a == tok_b
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=1e-4)
