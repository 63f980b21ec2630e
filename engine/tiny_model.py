"""A tiny random-weight Llama (about 150k parameters) for fast, exact tests.

Fixed seed, same bytes every time. The weight scales are chosen so that greedy decoding is not
tie-prone (the top-1/top-2 logit gap is usually far above fp32 noise) and so that attention
and every norm weight matter: an engine that drops a norm, misplaces RoPE or reads the wrong
KV block produces different tokens from Hugging Face transformers, not the same ones by luck.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvguard.engine.tokenizer_build import GPT2_SPLIT, BpeSpec, byte_alphabet, write_tokenizer_files

TINY_REVISION = 1  # bump whenever the bytes this module writes change
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 320  # 3 special + 256 byte tokens, padded (rows past the tokenizer are never picked)
# Scales, measured with transformers over 100 random prompts x 64 greedy steps: median
# top-1/top-2 logit gap 2.4, smallest 5e-4, fp32 and fp64 greedy outputs identical, ~30 distinct
# tokens per 48-token output, and changing the first prompt token changes the continuation.
EMBED_STD = 1.0
# o_proj/down_proj: layer outputs must outweigh the embedding, or with tied embeddings the
# model just echoes its last input token forever.
OUT_GAIN = 8.0
QK_GAIN = 2.0  # sharper attention, so which KV entries are read matters
FINAL_NORM_RANGE = (1.0, 1.4)  # sets the logit scale (logit std is about 8 x this)
LAYER_NORM_RANGE = (0.5, 1.5)

# ChatML, as SmolLM2 uses it, with a short default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_config() -> dict[str, Any]:
    """config.json of the tiny model: GQA (4 heads over 2 KV heads), tied embeddings."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def tiny_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights, drawn in a fixed order from one generator so the bytes are reproducible."""
    cfg = tiny_config()
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_rows, kv_rows = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    embed = torch.randn(VOCAB_SIZE, hidden, generator=gen) * EMBED_STD
    embed[len(SPECIAL_TOKENS) + 256 :] = 0.0
    weights = {"model.embed_tokens.weight": embed}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = _uniform(hidden, LAYER_NORM_RANGE, gen)
        weights[p + "self_attn.q_proj.weight"] = _linear(q_rows, hidden, gen, QK_GAIN)
        weights[p + "self_attn.k_proj.weight"] = _linear(kv_rows, hidden, gen, QK_GAIN)
        weights[p + "self_attn.v_proj.weight"] = _linear(kv_rows, hidden, gen)
        weights[p + "self_attn.o_proj.weight"] = _linear(hidden, q_rows, gen, OUT_GAIN)
        weights[p + "post_attention_layernorm.weight"] = _uniform(hidden, LAYER_NORM_RANGE, gen)
        weights[p + "mlp.gate_proj.weight"] = _linear(inter, hidden, gen)
        weights[p + "mlp.up_proj.weight"] = _linear(inter, hidden, gen)
        weights[p + "mlp.down_proj.weight"] = _linear(hidden, inter, gen, OUT_GAIN)
    weights["model.norm.weight"] = _uniform(hidden, FINAL_NORM_RANGE, gen)
    return weights


def _linear(rows: int, cols: int, gen: torch.Generator, gain: float = 1.0) -> torch.Tensor:
    """Outputs of variance gain**2 for unit-variance inputs."""
    return torch.randn(rows, cols, generator=gen) * (gain * cols**-0.5)


def _uniform(n: int, bounds: tuple[float, float], gen: torch.Generator) -> torch.Tensor:
    """Norm weights away from 1.0, so an engine that forgets one is caught."""
    low, high = bounds
    return low + (high - low) * torch.rand(n, generator=gen)


def tiny_tokenizer_spec() -> BpeSpec:
    """Byte-level BPE with no merges: every UTF-8 byte is one token, after the special tokens."""
    return BpeSpec(
        vocab=[*SPECIAL_TOKENS, *byte_alphabet()],
        merges=[],
        special={i: True for i in range(len(SPECIAL_TOKENS))},
        split=GPT2_SPLIT,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=tiny_config()["max_position_embeddings"],
    )


def build_tiny(out_dir: Path, seed: int = 0) -> None:
    """Write config.json, model.safetensors and tokenizer files of the tiny model into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(tiny_config(), indent=2, sort_keys=True)
    (out_dir / "config.json").write_text(text + "\n", encoding="utf-8")
    save_file(tiny_weights(seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(tiny_tokenizer_spec(), out_dir)
