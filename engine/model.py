"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

One forward runs a flattened batch: every scheduled token of every sequence in one `[T]` row
list, prefill chunks and decode tokens mixed; attention is the only per-sequence part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvguard.engine.kv_cache import LayerKV
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.kernels import paged_attention, write_kv


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] flat cache slot per token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: list[int]  # tokens in cache per sequence after this step's writes
    query_lens: list[int]  # tokens computed this step per sequence


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary frequencies, with Llama 3 / linear scaling when the config asks for it."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        inv = _llama3_scale(inv, rs)
    elif kind not in ("default", None):
        raise ModelLoadError(
            f"rope_scaling type {kind!r} is not supported (default, linear, llama3)"
        )
    return inv.float()


def _llama3_scale(inv: torch.Tensor, rs: dict) -> torch.Tensor:
    """Llama 3.1 long-context scaling: low frequencies divided by `factor`, a smooth band between."""
    factor, lo, hi = (
        float(rs["factor"]),
        float(rs["low_freq_factor"]),
        float(rs["high_freq_factor"]),
    )
    old_len = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on `[T, heads, head_dim]` with `cos/sin` `[T, 1, head_dim]`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.scale = self.hd**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1
        )
        q = apply_rope(q.view(t, self.nh, self.hd), cos, sin)
        k = apply_rope(k.view(t, self.nkv, self.hd), cos, sin)
        write_kv(kv[0], kv[1], k, v.view(t, self.nkv, self.hd), meta.slot_mapping, kv[2], kv[3])
        o = paged_attention(
            q,
            kv[0],
            kv[1],
            meta.block_tables,
            meta.seq_lens,
            meta.query_lens,
            self.scale,
            kv[2],
            kv[3],
        )
        return self.o_proj(o.reshape(t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv, meta):  # noqa: ANN001, ANN201 - hot path, types as above
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer(
            "cos_cache", torch.empty(max_positions, cfg.head_dim), persistent=False
        )
        self.register_buffer(
            "sin_cache", torch.empty(max_positions, cfg.head_dim), persistent=False
        )

    def init_rope(self, max_positions: int) -> None:
        """Fill the cos/sin tables (after `to_empty`, which leaves buffers uninitialised)."""
        dev = self.cos_cache.device
        inv = rope_inv_freq(self.cfg).to(dev)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=dev), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = emb.cos()
        self.sin_cache = emb.sin()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm."""
        x = self.embed_tokens(input_ids)
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up into single matmuls."""
        own = self.state_dict()
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"weights lack tensor {name!r}")
            used.add(name)
            return weights[name]

        for key, dst in own.items():
            src = self._hf_source(key, take)
            if src.shape != dst.shape:
                raise ModelLoadError(
                    f"tensor for {key!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(src)

    def _hf_source(self, key: str, take) -> torch.Tensor:  # noqa: ANN001 - local callback
        hf = key if key.startswith("lm_head") else f"model.{key}"
        if key == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return take("model.embed_tokens.weight")
        if ".qkv_proj." in key:
            return torch.cat(
                [take(hf.replace("qkv_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
            )
        if ".gate_up_proj." in key:
            return torch.cat(
                [take(hf.replace("gate_up_proj", p)) for p in ("gate_proj", "up_proj")]
            )
        return take(hf)


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LlamaForCausalLM:
    """Build on the meta device (no random init), then fill in the real tensors."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.init_rope(max_positions)
    model.load_hf_weights(weights)
    return model.eval()
