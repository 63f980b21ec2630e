"""GPTQ and AWQ directories as their exporters write them, served end to end and compared with
transformers (fp32) running the same weights dequantised: act-order (desc_act) GPTQ, whose
g_idx really shuffles the groups, in one process and over two pipeline stages; an lm_head
quantized beside a plain embedding (GPTQModel's `lm_head: true`, AWQ with the head packed);
and malformed `quantization_config` fields, refused by name.

The tiny model's projections are packed by the reference packers of `test_quant_loaders`
(the formats' published bit orders), asymmetric min-max in groups of 32 with zero points in
1..15. Each directory is served as kvguard serves it (`packed`: the C W4A8 kernels) and, in
one process, with every layer dequantised once at load (`dense`), which isolates the loading
from the kernels' rounding. Measured max|logit - transformers| over these prompts (logits up
to about 41): dense at most 1.1e-4, packed at most 0.25 (the kernels hold each group's
minimum `-z*s` in fp16 and quantise activations to int16); `TOL` leaves about twice each.
Greedy tokens were transformers' best at all 144 positions of each case but one, a near tie
(0.005 apart) that the packed lm_head turned. For scale: the act-order directory served with
its g_idx ignored is off by 60, its top-1 transformers' at none of the long prompt's 120.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvguard.engine import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from kvguard.engine.layers import quantized_linear
from kvguard.engine.layers.parallel_linear import VocabParallelEmbedding
from kvguard.engine.layers.quantized_linear import QuantizedLinear, QuantizedLMHead
from tests.test_quant_loaders import (
    LINEAR,
    _minmax_codes,
    ref_dequant,
    ref_pack_awq,
    ref_pack_cols,
    ref_pack_rows,
)
from tests.test_tensor_parallel import PROMPTS, _children

GROUP = 32
TOL = {"packed": 0.5, "dense": 2e-4}
TOKENS = 16


def pack_dir(
    src: Path, dst: Path, fmt: str, desc_act: bool = False, lm_head: bool = False
) -> dict[str, torch.Tensor]:
    """`src` with its projections (and, with `lm_head`, the lm_head) packed as `fmt` (`awq`,
    `gptq`, `gptq_v2`); returns {tensor name: the weight the packed one dequantises to}.

    desc_act as GPTQ does it: each input is quantized in its own column order, group g being
    the order's columns g*32 .. g*32+31, and q/k/v (one input) share one order, gate/up
    another; g_idx is the group of each column in the natural order."""
    dst.mkdir(parents=True)
    rng = np.random.default_rng(11)
    orders: dict[str, np.ndarray] = {}
    out: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for name, w in load_file(src / "model.safetensors").items():
        if not (LINEAR.fullmatch(name) or (lm_head and name == "lm_head.weight")):
            out[name] = w
            continue
        module, cols = name.removesuffix(".weight"), w.shape[1]
        order = np.arange(cols)
        if desc_act:
            shared = re.sub(r"(q|k|v)_proj$", "qkv", re.sub(r"(gate|up)_proj$", "gu", module))
            order = orders.setdefault(shared, rng.permutation(cols))
        in_order, zeros, scales = _minmax_codes(w[:, order], GROUP, rng)
        codes = np.empty_like(in_order)
        codes[order] = in_order
        g_idx = np.empty(cols, dtype=np.int64)
        g_idx[order] = np.arange(cols) // GROUP
        if fmt == "awq":
            out[f"{module}.qweight"] = ref_pack_awq(codes)
            out[f"{module}.qzeros"] = ref_pack_awq(zeros)
        else:
            stored = (zeros - 1) % 16 if fmt == "gptq" else zeros
            out[f"{module}.qweight"] = ref_pack_rows(codes)
            out[f"{module}.qzeros"] = ref_pack_cols(stored)
            out[f"{module}.g_idx"] = torch.from_numpy(g_idx).int()
        out[f"{module}.scales"] = scales
        weights[name] = ref_dequant(codes, zeros, scales, g_idx)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"}
        qc["zero_point"] = True
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": desc_act}
        qc |= {"sym": False, "checkpoint_format": fmt} | ({"lm_head": True} if lm_head else {})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return weights


@pytest.fixture(scope="module")
def untied_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an lm_head of its own (`tie_word_embeddings: false`)."""
    dst = tmp_path_factory.mktemp("tiny-untied")
    state = load_file(tiny_dir / "model.safetensors")
    embed = state["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(5)
    state["lm_head.weight"] = torch.randn(embed.shape, generator=gen) * embed.std()
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tiny_dir / "config.json").read_text()) | {"tie_word_embeddings": False}
    (dst / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / f, dst / f)
    return dst


@pytest.fixture(scope="module")
def act_order(untied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The untied tiny model as GPTQModel writes it with desc_act and `lm_head: true` (v1),
    and transformers over its weights."""
    dst = tmp_path_factory.mktemp("gptq-act") / "gptq"
    weights = pack_dir(untied_dir, dst, "gptq", desc_act=True, lm_head=True)
    return {"path": dst, "hf": transformers_model(untied_dir, weights)}


def transformers_model(src: Path, weights: dict[str, torch.Tensor]) -> Any:
    """transformers' model of `src` in fp32, with `weights` (dequantised) copied in."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            state[name].copy_(w)
    return hf


def serve(path: Path, **kw: Any) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", "16MiB")
    kw.setdefault("max_model_len", 256)
    kw.setdefault("tensor_parallel_timeout_s", 60.0)
    return LLMEngine.from_config(EngineConfig(model=str(path), **kw), progress=False)


def serve_as(kernels: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> LLMEngine:
    """`packed`: as served; `dense`: every quantized layer dequantised at load (one process:
    a worker would not see the patch)."""
    if kernels == "dense":
        monkeypatch.setattr(quantized_linear, "pick_kernel", lambda *args, **kwargs: "dense")
    return serve(path)


def assert_matches_transformers(eng: LLMEngine, hf: Any, tol: float) -> None:
    """Every logit of PROMPTS (and of one 120-token prompt: prefill over several panels) and
    of their greedy continuations is within `tol` of transformers', teacher-forced, and each
    greedy token is transformers' best there, or (a near tie the kernels' rounding may turn)
    within `tol` of it."""
    tok = eng.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS] + [list(range(5, 125))]
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    worst, same = 0.0, 0
    for prompt, out in zip(prompts, eng.generate(prompts, greedy), strict=True):
        ids = prompt + list(out.token_ids)
        assert len(out.token_ids) == TOKENS
        with torch.no_grad():
            # the tokens' columns: the lm_head computes no padding row (tests/test_head_rows.py)
            ref = hf(torch.tensor([ids])).logits[0, :, : eng.runner.vocab].float()
        worst = max(worst, (eng.score(ids).float() - ref).abs().max().item())
        at = ref[len(prompt) - 1 : -1]
        ours = at.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
        assert bool((ours >= at.max(-1).values - tol).all()), "greedy off transformers' best"
        same += int((at.argmax(-1) == torch.tensor(out.token_ids)).sum())
    total = TOKENS * len(prompts)
    print(f"max|logit - transformers| {worst:.2e}; greedy tokens its best {same}/{total}")
    assert worst <= tol


# -- desc_act (act-order) GPTQ ------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["packed", "dense"])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_act_order_gptq_is_served_and_matches_transformers(
    fmt: str, kernels: str, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every desc_act checkpoint was refused at tensor_parallel 1 ("cannot be split by input
    columns; tensor_parallel values that keep whole groups: [1, 2]"): o_proj and down_proj
    took a column span even on one rank. The whole span is no split; the kernels gather the
    permutation."""
    weights = pack_dir(tiny_dir, tmp_path / fmt, fmt, desc_act=True)
    hf = transformers_model(tiny_dir, weights)
    eng = serve_as(kernels, tmp_path / fmt, monkeypatch)
    try:
        layers = [m for m in eng.model.modules() if isinstance(m, QuantizedLinear)]
        assert len(layers) == 4 * 2 and {m.kernel for m in layers} <= {"w4a8", "int4pack", kernels}
        if kernels == "packed":  # the kernel gathers each input in its act order
            assert all(m.perm is not None and len(m.perm) == m.in_features for m in layers)
        assert_matches_transformers(eng, hf, TOL[kernels])
    finally:
        eng.shutdown()


def test_act_order_gptq_over_two_pipeline_stages(act_order: dict[str, Any]) -> None:
    """A pipeline stage holds whole layers, so it takes every desc_act weight whole too; the
    last stage (a worker) holds the quantized lm_head and no embedding."""
    eng = serve(act_order["path"], pipeline_parallel=2)
    try:
        assert list(eng.model.stage.layers) == [0]
        assert_matches_transformers(eng, act_order["hf"], TOL["packed"])
    finally:
        eng.shutdown()


def test_act_order_gptq_at_tensor_parallel_2_names_what_serves_it(
    act_order: dict[str, Any],
) -> None:
    """Splitting o_proj by input columns would need each rank's columns in whole groups, and
    act-order scatters every group over all of them: refused, and the advice names only what
    serves it (it used to list tensor_parallel 2, the value refused)."""
    before = set(_children())
    with pytest.raises(ModelLoadError) as err:
        serve(act_order["path"], tensor_parallel=2).shutdown()
    message = str(err.value)
    assert "o_proj.weight: a desc_act (g_idx) weight cannot be split by input columns" in message
    assert "tensor_parallel 1 only" in message and "pipeline_parallel" in message
    assert "[1, 2]" not in message
    assert not set(_children()) - before


# -- a quantized lm_head beside a plain embedding ------------------------------------------------
@pytest.mark.parametrize("kernels", ["packed", "dense"])
@pytest.mark.parametrize(("fmt", "desc_act"), [("gptq", True), ("awq", False)])
def test_quantized_lm_head_beside_a_plain_embedding(
    fmt: str,
    desc_act: bool,
    kernels: str,
    untied_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPTQModel's `lm_head: true` (and AWQ with the head packed) quantize the head alone:
    the embedding stays plain, which crashed the load with KeyError 'model.embed_tokens'."""
    weights = pack_dir(untied_dir, tmp_path / fmt, fmt, desc_act=desc_act, lm_head=True)
    assert "lm_head.weight" in weights
    hf = transformers_model(untied_dir, weights)
    eng = serve_as(kernels, tmp_path / fmt, monkeypatch)
    try:
        assert isinstance(eng.model.embed_tokens, VocabParallelEmbedding)
        head = eng.model.lm_head
        assert isinstance(head, QuantizedLMHead) and not head.approximate
        assert head.linear.out_features == 320
        assert_matches_transformers(eng, hf, TOL[kernels])
    finally:
        eng.shutdown()


# -- malformed quantization_config fields ---------------------------------------------------------
MALFORMED = [
    ("gptq", "group_size", None, "null; it takes a positive integer or -1"),
    ("gptq", "bits", None, "null; it takes an integer"),
    ("gptq", "sym", "x", '"x"; it takes true or false'),
    ("gptq", "desc_act", 1, "1; it takes true or false"),
    ("gptq", "group_size", 0, "0; it takes a positive integer or -1"),
    ("awq", "group_size", None, "null; it takes a positive integer or -1"),
    ("awq", "bits", "four", '"four"; it takes an integer'),
    ("awq", "zero_point", "false", '"false"; it takes true or false'),
]


@pytest.fixture(scope="module")
def packed(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packed")
    for fmt in ("gptq", "awq"):
        pack_dir(tiny_dir, root / fmt, fmt)
    return {fmt: root / fmt for fmt in ("gptq", "awq")}


@pytest.mark.parametrize(
    ("fmt", "field", "value", "said"), MALFORMED, ids=[f"{m[0]}-{m[1]}-{m[2]}" for m in MALFORMED]
)
def test_a_malformed_quantization_field_is_named(
    fmt: str, field: str, value: Any, said: str, packed: dict[str, Path], tmp_path: Path
) -> None:
    """`group_size: null` raised a bare TypeError from int(); `sym: "x"` and an AWQ
    `zero_point: "false"` (a true string) were taken as they came."""
    shutil.copytree(packed[fmt], tmp_path / fmt)
    config_file = tmp_path / fmt / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"][field] = value
    config_file.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        serve(tmp_path / fmt).shutdown()
    assert f"{config_file}: quantization_config.{field} is {said}" in str(err.value)
