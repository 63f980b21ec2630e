"""Random-weight models of real shapes (what the GPU benchmark serves without a download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.model import LlamaForCausalLM
from kvguard.engine.model_config import ModelConfig
from kvguard.engine.random_model import hf_config, random_engine, write_random_model

PROMPTS = [[5, 6, 7, 8, 9], [40, 41]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    ("shape", "params"),
    # the published parameter counts of Llama-2-7B and SmolLM2-135M
    [("llama2-7b", 6_738_415_616), ("smollm2-135m", 134_515_008)],
)
def test_shapes_have_the_real_parameter_counts(shape: str, params: int) -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_hf_dict(hf_config(shape)), 16)
    assert sum(p.numel() for p in model.parameters()) == params


@pytest.mark.parametrize(
    ("shape", "read"),
    # Llama-2-7B's own embedding table (32000 x 4096) is not read whole by a step; SmolLM2's
    # is its lm_head too (tied), so a step reads every weight
    [("llama2-7b", 6_738_415_616 - 32000 * 4096), ("smollm2-135m", 134_515_008)],
)
def test_a_decode_step_reads_every_weight_but_an_untied_embedding_table(
    shape: str, read: int
) -> None:
    from kvguard.engine.model import step_weight_bytes, weight_bytes

    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_hf_dict(hf_config(shape)), 16).to(torch.bfloat16)
    assert step_weight_bytes(model) == 2 * read
    tied = model.lm_head.weight is model.embed_tokens.weight
    assert (step_weight_bytes(model) == weight_bytes(model)) == tied


def test_in_memory_engine_matches_its_written_directory_and_transformers(tmp_path: Path) -> None:
    cfg = EngineConfig(model="random:tiny", device="cpu", num_gpu_blocks=32)
    in_memory = random_engine("tiny", cfg, seed=3).generate(PROMPTS, GREEDY)
    path = write_random_model("tiny", tmp_path / "tiny", seed=3)
    loaded = LLMEngine.from_config(EngineConfig(model=str(path), device="cpu"), progress=False)
    from_dir = loaded.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in in_memory] == [o.token_ids for o in from_dir]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    out = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None)
    assert out[0, len(PROMPTS[0]) :].tolist() == in_memory[0].token_ids


def test_weights_from_a_peer_are_used_as_given() -> None:
    """The benchmark hands transformers' state_dict over, so both engines hold one set of
    numbers; a different seed must not leak in."""
    cfg = EngineConfig(model="random:tiny", device="cpu", num_gpu_blocks=32)
    a = random_engine("tiny", cfg, seed=1)
    from kvguard.engine.random_model import hf_state_dict

    weights = hf_state_dict(a.model, hf_config("tiny"))
    b = random_engine("tiny", cfg, seed=2, weights=weights)
    for (name, pa), (_, pb) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name


def test_a_4bit_model_serves_through_the_quantized_layers() -> None:
    """`quant_group`: every layer projection a 4-bit QuantizedLinear in groups of that size
    (the benchmark's stand-in for a GGUF Q4_1 or GPTQ checkpoint), the same codes for a seed,
    a quarter-ish of the dense bytes, and it generates; a group that does not divide is refused."""
    from kvguard.engine.layers.quantized_linear import QuantizedLinear
    from kvguard.engine.model import weight_bytes
    from kvguard.engine.random_model import random_4bit

    cfg = EngineConfig(model="random:tiny", device="cpu", num_gpu_blocks=32)
    eng = random_engine("tiny", cfg, seed=4, quant_group=32)
    dense = random_engine("tiny", cfg, seed=4)
    for layer in eng.model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
            assert isinstance(proj, QuantizedLinear) and proj.bits == 4
            assert proj.group_size == 32
    projections = sum(p.numel() * 4 for n, p in dense.model.named_parameters() if "proj" in n)
    assert weight_bytes(eng.model) < weight_bytes(dense.model) - projections * 0.6
    outs = eng.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    a, _ = random_4bit("tiny", 32, torch.device("cpu"), seed=4)
    b, _ = random_4bit("tiny", 32, torch.device("cpu"), seed=4)
    assert all(torch.equal(a[k].q, b[k].q) for k in a) and len(a) == 2 * 7
    with pytest.raises(ValueError, match="multiple of group 48"):
        random_4bit("tiny", 48, torch.device("cpu"))
