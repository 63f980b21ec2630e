"""Random-weight models of real shapes, built in memory on the device: no download, no files.

Decode speed depends on the shapes and dtypes of the weights, never on their values, so a
GPU benchmark of Llama-2-7B or SmolLM2-135M needs no checkpoint: the device machine cannot
download one, and writing 13 GB of safetensors there would eat the run's minutes. The weights
are drawn on the device itself (one generator, fixed seed), the tokenizer is the tiny model's
byte-level one (prompts are token-id lists anyway), and the engine is assembled from its parts
exactly as `LLMEngine.from_config` would, minus the loading.

With `quant_group`, the layers' projections are 4-bit instead (random codes, scales and
float zero points in groups of that many inputs, the layout GPTQ / AWQ / GGUF Q4_1 checkpoints
load into), served by the same quantized layers as a real 4-bit checkpoint: on a GPU the W4A16
path, whose speed does not depend on the values either.

`write_random_model` also writes a shape as an ordinary model directory (config.json,
model.safetensors, tokenizer files) for code that wants a path; that is only sensible for the
small shapes.

    python -m kvguard.engine.random_model --shape smollm2-135m --out DIR
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvguard.engine.config import EngineConfig
from kvguard.engine.kv_cache import KVCache, kv_dtype_name
from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.model import LlamaForCausalLM, _materialise, build_quantized_model
from kvguard.engine.model_config import ModelConfig
from kvguard.engine.model_runner import (
    ModelRunner,
    cuda_graphs_wanted,
    pick_device,
    pick_dtype,
    profiled_num_blocks,
)
from kvguard.engine.tiny_model import tiny_config, tiny_tokenizer_spec
from kvguard.engine.tokenizer import Tokenizer
from kvguard.engine.tokenizer_build import write_tokenizer_files

INIT_STD = 0.02  # transformers' Llama initializer_range: activations stay finite in bf16
# uniform 4-bit codes about a zero point of 7.5 have a std of about 4.6 code units
CODE_STD = 4.6

# The architecture fields of each shape; `hf_config` adds the common ones.
SHAPES: dict[str, dict[str, Any]] = {
    "llama2-7b": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    # The tiny test model's shape: what --cpu-smoke runs use.
    "tiny": {k: tiny_config()[k] for k in ("hidden_size", "intermediate_size", "head_dim")}
    | {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
}


def hf_config(shape: str) -> dict[str, Any]:
    """The config.json of a shape, as transformers' LlamaConfig and `ModelConfig` read it."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: expected one of {sorted(SHAPES)}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": INIT_STD,
        "torch_dtype": "bfloat16",
        **SHAPES[shape],
    }


@torch.no_grad()
def fill_random(model: torch.nn.Module, seed: int) -> None:
    """Draw every weight on its own device: matrices N(0, INIT_STD), norms 1 (as transformers
    initialises a Llama). One generator in parameter order keeps the bytes reproducible."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)
    for _name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, INIT_STD, generator=gen)


def build_random_model(
    shape: str,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    seed: int = 0,
    weights: dict[str, torch.Tensor] | None = None,
) -> LlamaForCausalLM:
    """The model on `device`, random (or from Hugging Face-named `weights`, e.g. a transformers
    peer's state_dict, so both engines hold the very same numbers)."""
    mcfg = ModelConfig.from_hf_dict(hf_config(shape))
    model = _materialise(mcfg, max_positions, dtype, device, None)
    if weights is None:
        fill_random(model, seed)
    else:
        model.load_hf_weights(weights)
    return model.eval()


@torch.no_grad()
def random_4bit(
    shape: str, group: int, device: torch.device, seed: int = 0
) -> tuple[dict[str, QuantSpec], dict[str, torch.Tensor]]:
    """({Hugging Face module: 4-bit QuantSpec}, {Hugging Face tensor: plain tensor}) for a
    random model of `shape` whose layer projections are 4-bit in groups of `group` inputs
    (weights of about INIT_STD, as `fill_random` draws them); embedding, norms and an untied
    lm_head stay plain."""
    mcfg = ModelConfig.from_hf_dict(hf_config(shape))
    gen = torch.Generator(device=device).manual_seed(seed)
    hd, h, inter = mcfg.head_dim, mcfg.hidden_size, mcfg.intermediate_size
    out_in = {  # module: (its block, output width, input width)
        "q_proj": ("self_attn", mcfg.num_heads * hd, h),
        "k_proj": ("self_attn", mcfg.num_kv_heads * hd, h),
        "v_proj": ("self_attn", mcfg.num_kv_heads * hd, h),
        "o_proj": ("self_attn", h, mcfg.num_heads * hd),
        "gate_proj": ("mlp", inter, h),
        "up_proj": ("mlp", inter, h),
        "down_proj": ("mlp", h, inter),
    }
    specs, plain = {}, {}
    for i in range(mcfg.num_layers):
        base = f"model.layers.{i}."
        for name, (block, n, k) in out_in.items():
            if k % group:
                raise ValueError(f"{name}: input width {k} is not a multiple of group {group}")
            specs[f"{base}{block}.{name}"] = QuantSpec(
                q=torch.randint(0, 16, (n, k), generator=gen, device=device, dtype=torch.uint8),
                scales=torch.full((n, k // group), INIT_STD / CODE_STD, device=device),
                zeros=torch.rand(n, k // group, generator=gen, device=device) + 7.0,
                group_size=group,
                bits=4,
            )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plain[base + norm + ".weight"] = torch.ones(h, device=device)
    embed = torch.empty(mcfg.vocab_size, h, device=device).normal_(0.0, INIT_STD, generator=gen)
    plain["model.embed_tokens.weight"] = embed
    plain["model.norm.weight"] = torch.ones(h, device=device)
    if not mcfg.tie_word_embeddings:
        head = torch.empty(mcfg.vocab_size, h, device=device).normal_(0.0, INIT_STD, generator=gen)
        plain["lm_head.weight"] = head
    return specs, plain


def byte_tokenizer() -> Tokenizer:
    """The tiny model's byte-level tokenizer (its files written to a throwaway directory)."""
    with tempfile.TemporaryDirectory(prefix="kvguard-tok-") as tmp:
        write_tokenizer_files(tiny_tokenizer_spec(), Path(tmp))
        (Path(tmp) / "config.json").write_text(json.dumps(tiny_config()))
        return Tokenizer.from_dir(Path(tmp))


def random_engine(
    shape: str,
    config: EngineConfig,
    seed: int = 0,
    weights: dict[str, torch.Tensor] | None = None,
    quant_group: int | None = None,
) -> LLMEngine:
    """An engine serving a random model of `shape`, sized by `config` as `from_config` sizes one
    (`num_gpu_blocks`, else `gpu_memory_utilization` on CUDA, `kv_cache_bytes` on CPU).
    `config.model` is only a label here. Tensor parallelism is not offered (one rank). With
    `quant_group`, the layer projections are 4-bit in groups of that size (`random_4bit`)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    mcfg = ModelConfig.from_hf_dict(hf_config(shape))
    max_len = min(config.max_model_len, mcfg.max_position_embeddings)
    if quant_group is None:
        model = build_random_model(shape, device, dtype, max_len, seed, weights)
    else:
        specs, plain = random_4bit(shape, quant_group, device, seed)
        model = build_quantized_model(mcfg, specs, plain, max_len, dtype, device)
    kv = _kv_cache(config, model, mcfg, kv_dtype_name(config.kv_cache_dtype, dtype), max_len)
    runner = ModelRunner(model, mcfg, kv)
    if cuda_graphs_wanted(config, device, 1):
        runner.enable_cuda_graphs(config.max_num_seqs, max_len)
    return LLMEngine(config, runner, mcfg, byte_tokenizer())


def _kv_cache(
    config: EngineConfig, model: LlamaForCausalLM, mcfg: ModelConfig, kv_dtype: str, max_len: int
) -> KVCache:
    """The pools, sized after the weights are on the device and one maximal step was profiled
    (as ModelRunner.from_config does)."""
    device = next(model.parameters()).device
    n = config.num_gpu_blocks
    if not n:
        n = profiled_num_blocks(model, mcfg, config, kv_dtype, device, max_len)
    host = 0
    if config.enable_cpu_offload:
        host = int(n * config.cpu_cache_ratio / (1.0 - config.cpu_cache_ratio))
    return KVCache(mcfg, n, config.block_size, kv_dtype, device, host)


def write_random_model(shape: str, out_dir: Path, seed: int = 0) -> Path:
    """A loadable model directory of `shape` (fp32 on CPU; meant for the small shapes)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    model = build_random_model(shape, torch.device("cpu"), torch.float32, 16, seed)
    tensors = hf_state_dict(model, cfg)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "float32"}, indent=2))
    write_tokenizer_files(tiny_tokenizer_spec(), out_dir)
    return out_dir


def hf_state_dict(model: LlamaForCausalLM, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our fused parameters split back into Hugging Face tensor names (contiguous copies)."""
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    out: dict[str, torch.Tensor] = {}
    for key, p in model.named_parameters():
        name = key if key.startswith("lm_head") else f"model.{key}"
        if ".qkv_proj." in key:
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.split([q, kv, kv]), strict=True):
                out[name.replace("qkv_proj", part)] = t.contiguous()
        elif ".gate_up_proj." in key:
            for part, t in zip(("gate_proj", "up_proj"), p.chunk(2), strict=True):
                out[name.replace("gate_up_proj", part)] = t.contiguous()
        else:
            out[name] = p.detach().contiguous()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_random_model(args.shape, args.out, args.seed))


if __name__ == "__main__":
    main()
