"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

One forward runs a flattened batch: every scheduled token of every sequence in one `[T]` row
list, prefill chunks and decode tokens mixed; attention is the only per-sequence part.

Under tensor parallelism (a `TPGroup` of size > 1) every rank builds the same module tree over
its own slices (see `kvguard.engine.distributed.sharding`): fused qkv and gate_up are
column-parallel, o_proj and down_proj row-parallel, the embedding and lm_head split by
vocabulary. With one rank the model runs the very calls it always ran.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvguard.engine.cpu_decode import CpuDecode
from kvguard.engine.distributed.parallel_state import PipelineStage, TPGroup
from kvguard.engine.distributed.sharding import Shard, shard_config, shard_of
from kvguard.engine.kv_cache import LayerKV
from kvguard.engine.layers.parallel_linear import (
    Linear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    mask_padding,
)
from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.layers.quantized_linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedLMHead,
    RowParallelQuantized,
    cat_rows,
    slice_spec,
)
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.engine.weights import (
    DictSource,
    Part,
    SafetensorsSource,
    WeightSource,
    check_quantization,
    check_unused_biases,
    checkpoint_quantization,
    expected_tensor_names,
    open_safetensors,
)
from kvguard.kernels import paged_attention, write_kv
from kvguard.kernels.dispatch import layer_ops
from kvguard.kernels.paged_attention import decode_attention


class StepInterrupted(Exception):  # noqa: N818 - a signal, not an error
    """A forward stopped between two layers because its `stop` event was set: nothing it
    computed is used, and the KV it wrote is rewritten when the step runs again."""


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] flat cache slot per token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: list[int]  # tokens in cache per sequence after this step's writes
    query_lens: list[int]  # tokens computed this step per sequence
    # A CUDA-graph decode step (kvguard.engine.cuda_graphs) has no host lists: one token per
    # row, lengths in this device tensor, the attention grid sized for graph_max_len.
    seq_lens_t: torch.Tensor | None = None
    graph_max_len: int = 0
    # Per entry: a prompt's rows (a prefill chunk, a preempted sequence's recomputed text),
    # which attend by the prefill kernels at any query count, one included, so a prompt's
    # one-token last chunk or cached tail gets the bits its cold, unchunked run gets. None
    # (or False): one query attends as a decode row, more as a prefill chunk.
    prompt_rows: list[bool] | None = None


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
        if x.stride(-1) == 1 and (ops := layer_ops(x)) is not None:
            return ops.rmsnorm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, its norm): the residual add and the norm after it, in one pass where a
        kernel serves (`layer_ops`; x is then updated in place and returned)."""
        if x.is_contiguous() and y.dtype == x.dtype and (ops := layer_ops(x)) is not None:
            return x, ops.rmsnorm(x, self.weight, self.eps, y)
        x = x + y
        return x, self(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on `[T, heads, head_dim]` with `cos/sin` `[T, 1, head_dim]`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        local = shard_config(cfg, tp.size)
        self.nh, self.nkv, self.hd = local.num_heads, local.num_kv_heads, cfg.head_dim
        q, kv = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, tp, bias=cfg.o_proj_bias)
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
        qkv = self.qkv_proj(x)
        # a kernel for RoPE in place: q and k heads are adjacent in each row
        ops = layer_ops(qkv) if qkv.stride(-1) == 1 else None
        if ops is not None:
            ops.rope_(qkv, self.nh + self.nkv, self.hd, cos.view(t, -1), sin.view(t, -1))
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q, k = q.view(t, self.nh, self.hd), k.view(t, self.nkv, self.hd)
        if ops is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # a graph replays decode steps only: each token alone in its sequence's last block
        own = meta.seq_lens_t is not None
        v = v.view(t, self.nkv, self.hd)
        write_kv(kv[0], kv[1], k, v, meta.slot_mapping, kv[2], kv[3], own_blocks=own)
        o = self._attend(q, kv, meta)
        return self.o_proj(o.reshape(t, self.nh * self.hd))

    def _attend(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        tables = meta.block_tables
        if meta.seq_lens_t is not None:  # graph replay: nothing may come from the host
            lens, top = meta.seq_lens_t, meta.graph_max_len
            return decode_attention(q, kv[0], kv[1], tables, lens, top, self.scale, kv[2], kv[3])
        return paged_attention(
            q, kv[0], kv[1], tables, meta.seq_lens, meta.query_lens, self.scale, kv[2], kv[3],
            meta.prompt_rows,
        )  # fmt: skip


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size // tp.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(self.inter, cfg.hidden_size, tp, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if gu.dim() == 2 and gu.stride(1) == 1 and (ops := layer_ops(gu)) is not None:
            return self.down_proj(ops.silu_mul(gu, self.inter))
        gate, up = gu.split(self.inter, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, cos, sin, kv, meta, pending=None):  # noqa: ANN001, ANN201 - hot path
        """The residual stream entering the layer is `x + pending` (`pending`: the previous
        layer's MLP output, added here in the same pass as the norm). Returns the stream after
        attention and this layer's MLP output, still to be added. May update `x` in place (the
        model passes a stream it owns)."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_forward(x, pending)
        a = self.self_attn(h, cos, sin, kv, meta)
        x, h = self.post_attention_layernorm.add_forward(x, a)
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: TPGroup | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp or TPGroup.single()
        self.stage = stage or PipelineStage.single(cfg.num_layers)
        self.shard = shard_of(cfg, self.tp)
        self.vocab = cfg.vocab_size  # the token ids, [0, vocab): `set_token_vocab`
        rows, h = len(self.shard.vocab), cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(rows, h, self.shard.vocab.start, self.tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(rows, h, cfg.vocab_size, self.tp)
        self._keep_stage_only()
        self.tie_weights()
        # CPU steps in one C call per layer (kvguard.engine.cpu_decode); tests turn it
        # off to compare with the per-op path
        self.fuse_cpu_decode = True
        self._cpu_plan: CpuDecode | None | bool = False
        self.register_buffer(
            "cos_cache", torch.empty(max_positions, cfg.head_dim), persistent=False
        )
        self.register_buffer(
            "sin_cache", torch.empty(max_positions, cfg.head_dim), persistent=False
        )

    def _keep_stage_only(self) -> None:
        """A pipeline stage holds only its own layers (the others become empty placeholders,
        so parameter names keep their global layer index); the embedding only on the first
        stage, the final norm and lm_head only on the last. One stage keeps everything."""
        st = self.stage
        for i in range(self.cfg.num_layers):
            if i not in st.layers:
                self.layers[i] = nn.Identity()
        if not st.is_first:
            self.embed_tokens = nn.Identity()
        if not st.is_last:
            self.norm = nn.Identity()
            self.lm_head = nn.Identity()

    def tie_weights(self) -> None:
        """Tied embeddings: the lm_head is the embedding's own parameter, one copy in memory.

        Again after `to_empty`, which gives each module a fresh tensor and so unties them.
        (A quantized pair is tied when it is built: see `_install_quantized`.) A last stage
        that is not also the first holds the lm_head alone, loaded from the embedding's rows."""
        tied = self.cfg.tie_word_embeddings and isinstance(self.lm_head, ParallelLMHead)
        if tied and isinstance(self.embed_tokens, VocabParallelEmbedding):
            self.lm_head.weight = self.embed_tokens.weight

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
        hidden: torch.Tensor | None = None,
        stop: threading.Event | None = None,
        on_layer: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm; on a pipeline stage before the
        last, the residual stream after its layers (what the next stage's `hidden` is: each
        layer adds its output to the stream it was given, so one tensor carries both).
        `kv_caches` are this stage's layers' pools, in order. A set `stop` raises
        StepInterrupted before the next layer. `on_layer` is called after each layer: a long
        prompt step takes seconds to minutes on a CPU, and the engine loop's heartbeat moves
        with its layers, so that a step computing is not taken for a stalled engine."""
        # the layers may update the stream in place: a stage's input is copied, never changed
        x = self.embed_tokens(input_ids) if self.stage.is_first else hidden.clone()
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        # a list, not a ModuleList slice (which registers every layer anew: ~0.1 ms a step)
        own = list(self.layers)[self.stage.layers.start : self.stage.layers.stop]
        pending = None  # the last layer's MLP output, added to the stream by the next norm
        fused = self._cpu_decode(own)
        if fused is not None and fused.takes(x, kv_caches, meta):
            x, pending = fused.run(x, cos, sin, kv_caches, meta, stop, on_layer)
        else:
            for layer, kv in zip(own, kv_caches, strict=True):
                if stop is not None and stop.is_set():
                    raise StepInterrupted("interrupted between layers")
                x, pending = layer(x, cos, sin, kv, meta, pending)
                if on_layer is not None:
                    on_layer()
        if pending is None:
            return self.norm(x)
        if isinstance(self.norm, RMSNorm):
            return self.norm.add_forward(x, pending)[1]
        return x.add_(pending)  # a stage before the last: the whole stream goes on

    def _cpu_decode(self, own: Iterable[nn.Module]) -> CpuDecode | None:
        """The one-call-per-layer CPU decode plan (built on first use; None where the layers
        do not qualify, or `fuse_cpu_decode` is off)."""
        if not self.fuse_cpu_decode:
            return None
        if self._cpu_plan is False:
            self._cpu_plan = CpuDecode.build(list(own), self.tp.size)
        return self._cpu_plan

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full fp32 logits `[n, vocab_size]` on rank 0 (a pipeline's last stage: the ones it
        sends rank 0); None on the other ranks. The columns past `vocab` (a padded
        vocabulary's rows, which name no token) are -inf: no path draws them, and a
        log-softmax over the row is the one over the tokens (`mask_padding`)."""
        logits = self.lm_head(hidden)
        return None if logits is None else mask_padding(logits, self.vocab)

    def set_token_vocab(self, tokens: int) -> None:
        """The token ids the logits cover from now on, [0, tokens) (`token_vocab`: the
        tokenizer's, where a padded embedding has more rows): set on the built model, whichever
        head (dense or quantized) the checkpoint gave it. The logits keep every row's column,
        those past the tokens at -inf (`compute_logits`; a quantized head's refined
        candidates and exact logits too, `QuantizedLMHead.tokens`)."""
        self.vocab = min(tokens, self.cfg.vocab_size)
        if isinstance(self.lm_head, QuantizedLMHead):
            self.lm_head.tokens = self.vocab

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up into single matmuls."""
        self.load_from(DictSource(weights))

    @torch.no_grad()
    def load_from(self, source: WeightSource) -> None:
        """Fill every parameter with this rank's parts of the Hugging Face tensors.

        A tied lm_head is the embedding's parameter, so `named_parameters` visits it once."""
        for key, dst in self.named_parameters():
            specs = hf_parts(key, self.cfg, self.shard)
            parts = [source.read(p) for p in specs]
            for spec, part in zip(specs, parts, strict=True):  # fused parts stack along dim 0
                rows = dst.shape[0] if len(specs) == 1 or spec.span is None else len(spec.span)
                if tuple(part.shape) != (rows, *dst.shape[1:]):
                    raise ModelLoadError(
                        f"tensor {spec.name!r} has shape {tuple(part.shape)}, expected "
                        f"{(rows, *dst.shape[1:])}"
                    )
            src = parts[0] if len(parts) == 1 else torch.cat(parts)
            if src.shape != dst.shape:
                raise ModelLoadError(
                    f"tensor for {key!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(src)


def hf_parts(key: str, cfg: ModelConfig, shard: Shard) -> list[Part]:
    """The Hugging Face tensor parts that make up our parameter `key` on one rank.

    Fused projections are the concatenation of their parts' rows: q, k, v heads for qkv_proj,
    the gate and up columns for gate_up_proj. Row-parallel weights take a column range; their
    biases are whole on every rank (added once, after the all-reduce)."""
    hd, prefix = cfg.head_dim, ("" if key.startswith("lm_head") else "model.")
    name = prefix + key
    q = range(shard.q_heads.start * hd, shard.q_heads.stop * hd)
    kv = range(shard.kv_heads.start * hd, shard.kv_heads.stop * hd)
    if ".qkv_proj." in key:
        spans = {"q_proj": (q, cfg.num_heads * hd), "k_proj": (kv, cfg.num_kv_heads * hd)}
        spans["v_proj"] = spans["k_proj"]
        return [Part(name.replace("qkv_proj", p), s, 0, n) for p, (s, n) in spans.items()]
    if ".gate_up_proj." in key:
        return [
            Part(name.replace("gate_up_proj", p), shard.mlp, 0, cfg.intermediate_size)
            for p in ("gate_proj", "up_proj")
        ]
    if key.endswith((".o_proj.bias", ".down_proj.bias")):
        return [Part(name)]
    if ".o_proj." in key:
        return [Part(name, q, 1, cfg.num_heads * hd)]
    if ".down_proj." in key:
        return [Part(name, shard.mlp, 1, cfg.intermediate_size)]
    if key == "lm_head.weight" and cfg.tie_word_embeddings:  # a last stage's own copy
        return [Part("model.embed_tokens.weight", shard.vocab, 0, cfg.vocab_size)]
    if key in ("embed_tokens.weight", "lm_head.weight"):
        return [Part(name, shard.vocab, 0, cfg.vocab_size)]
    return [Part(name)]  # norms: replicated whole


def _materialise(
    cfg: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup | None,
    quantized: Iterable[str] = (),
    stage: PipelineStage | None = None,
) -> LlamaForCausalLM:
    """Build on the meta device (no random init), then allocate uninitialised real tensors.

    Modules named in `quantized` are left as placeholders, so no full-precision copy of a
    quantized weight is ever allocated; `_install_quantized` puts the real layers in."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, tp, stage)
    for name in quantized:
        model.set_submodule(name, nn.Identity())
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.init_rope(max_positions)
    return model


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LlamaForCausalLM:
    """A single-rank model from a dict of whole Hugging Face-named tensors."""
    model = _materialise(cfg, max_positions, dtype, device, None)
    model.load_hf_weights(weights)
    return model.eval()


def load_model(
    path: Path,
    cfg: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup | None = None,
    quantization: str = "auto",
    stage: PipelineStage | None = None,
) -> LlamaForCausalLM:
    """The model of one rank, reading only that rank's slices from the safetensors files, so a
    rank's weight memory is its share of the sharded tensors (plus the replicated norms).

    A quantized checkpoint (config.json `quantization_config`) is served packed;
    `quantization` (the `model_quantization` knob) must agree with what the directory holds.
    The logits cover every row of the embedding until `set_token_vocab` says otherwise."""
    path = Path(path)
    fmt = checkpoint_quantization(path)
    check_quantization(path / "config.json", fmt, quantization)
    if fmt is not None:
        specs, plain = read_quantized(path, cfg, fmt, dtype)
        cfg = biases_held(cfg, plain)
        check_unused_biases(path, plain, expected_tensor_names(cfg), plain.__getitem__)
        return build_quantized_model(cfg, specs, plain, max_positions, dtype, device, tp, stage)
    with open_safetensors(path, dtype, device) as opened:
        source = head_as_embedding(opened, cfg)
        cfg = biases_held(cfg, source.names)
        model = _materialise(cfg, max_positions, dtype, device, tp, (), stage)
        source.check_has(path, expected_tensor_names(cfg))
        model.load_from(source)
    return model.eval()


EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def head_as_embedding(
    source: SafetensorsSource, cfg: ModelConfig
) -> SafetensorsSource | HeadAsEmbedding:
    """`source`, or where config.json ties the embeddings and the checkpoint holds the tied
    matrix as `lm_head.weight` alone (no `model.embed_tokens.weight`: some exporters keep
    only the head's name for it, and transformers serves such a file, the head's tensor
    being the embedding) the source that reads that tensor for both."""
    names = set(source.names)
    if cfg.tie_word_embeddings and EMBEDDING not in names and HEAD in names:
        return HeadAsEmbedding(source)
    return source


class HeadAsEmbedding:
    """A tied checkpoint's `lm_head.weight` read as the embedding too (`head_as_embedding`)."""

    def __init__(self, source: SafetensorsSource) -> None:
        self.source = source

    @property
    def names(self) -> list[str]:
        return [EMBEDDING if n == HEAD else n for n in self.source.names]

    def read(self, part: Part) -> torch.Tensor:
        if part.name == EMBEDDING:
            part = dataclasses.replace(part, name=HEAD)
        return self.source.read(part)

    def check_has(self, path: Path, expected: Iterable[str]) -> None:
        """The source's checks, with the head's tensor standing for the embedding (so it is
        neither missing nor an unexpected untied head)."""
        self.source.check_has(path, [HEAD if n == EMBEDDING else n for n in expected])


def biases_held(cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """`cfg` without the o_proj (or MLP) biases Llama's `attention_bias` (`mlp_bias`) declares
    where the checkpoint holds none of them (converters that write only q/k/v's): transformers
    serves those as zeros, which leaving them out is. Some layers holding one and others not
    stays an error (a tensor missing)."""
    names = list(names)
    if cfg.o_proj_bias and not any(n.endswith(".self_attn.o_proj.bias") for n in names):
        cfg = dataclasses.replace(cfg, o_proj_bias=False)
    mlp = tuple(f".mlp.{p}_proj.bias" for p in ("gate", "up", "down"))
    if cfg.mlp_bias and not any(n.endswith(mlp) for n in names):
        cfg = dataclasses.replace(cfg, mlp_bias=False)
    return cfg


def read_quantized(
    path: Path, cfg: ModelConfig, fmt: str, dtype: torch.dtype
) -> tuple[dict[str, QuantSpec], dict[str, torch.Tensor]]:
    """({HF module name: QuantSpec}, {HF tensor name: plain tensor}) of a quantized directory."""
    if fmt == "gguf":
        from kvguard.engine.gguf_packed import load_packed  # no `gguf`: see that module

        return load_packed(path, dtype)
    from kvguard.engine.loader.quantized import load_quantized

    return load_quantized(path, cfg, dtype)


# our module -> the parameter whose Hugging Face parts say which checkpoint modules it fuses
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def build_quantized_model(
    cfg: ModelConfig,
    specs: dict[str, QuantSpec],
    plain: dict[str, torch.Tensor],
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup | None = None,
    stage: PipelineStage | None = None,
) -> LlamaForCausalLM:
    """A model whose projections (and embedding / lm_head, where the checkpoint quantized
    them) are `QuantizedLinear`s over this rank's slices of `specs`; the rest from `plain`."""
    tp = tp or TPGroup.single()
    stage = stage or PipelineStage.single(cfg.num_layers)
    shard = shard_of(cfg, tp)
    names = _stage_modules(_quantized_modules(cfg, specs, shard), stage)
    model = _materialise(cfg, max_positions, dtype, device, tp, names, stage)
    model.load_from(DictSource(plain))
    _install_quantized(model, names, specs, plain, dtype, device)
    return model.eval()


def _quantized_modules(cfg: ModelConfig, specs: dict[str, QuantSpec], shard: Shard) -> list[str]:
    """Our modules whose every checkpoint part is quantized; a fused module with only some
    parts quantized is refused (one kernel serves the fused matrix)."""
    ours = [f"layers.{i}.{m}" for i in range(cfg.num_layers) for m in _LINEARS]
    ours += ["embed_tokens"] + ([] if cfg.tie_word_embeddings else ["lm_head"])
    out = []
    for name in ours:
        bases = [p.name.removesuffix(".weight") for p in hf_parts(name + ".weight", cfg, shard)]
        held = [b in specs for b in bases]
        if all(held):
            out.append(name)
        elif any(held):
            raise ModelLoadError(
                f"{name}: fuses {bases}, of which only some are quantized; cannot serve that"
            )
    if cfg.tie_word_embeddings and "embed_tokens" in out:
        out.append("lm_head")
    return out


def _stage_modules(names: list[str], stage: PipelineStage) -> list[str]:
    """The quantized modules a pipeline stage holds: its layers', the embedding on the first
    stage, the lm_head on the last (all of them with one stage)."""

    def held(name: str) -> bool:
        if name.startswith("layers."):
            return int(name.split(".")[1]) in stage.layers
        return stage.is_first if name == "embed_tokens" else stage.is_last

    return [n for n in names if held(n)]


def _install_quantized(
    model: LlamaForCausalLM,
    names: list[str],
    specs: dict[str, QuantSpec],
    plain: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    cfg, shard, tp = model.cfg, model.shard, model.tp
    for name in names:
        if name in ("embed_tokens", "lm_head"):
            continue
        spec = _rank_spec(name, cfg, shard, specs)
        bias = _rank_bias(name, cfg, shard, plain)
        if tp.size > 1 and name.endswith(_ROW_PARALLEL):  # the bias once, after the sum
            bias = None if bias is None else bias.to(device)
            layer = RowParallelQuantized(QuantizedLinear(spec, None, dtype, device), tp, bias)
        else:
            layer = QuantizedLinear(spec, bias, dtype, device)
        model.set_submodule(name, layer)
    if "embed_tokens" in names or "lm_head" in names:
        _install_vocab(model, names, specs, dtype, device)


def _install_vocab(
    model: LlamaForCausalLM,
    names: list[str],
    specs: dict[str, QuantSpec],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The quantized embedding and lm_head, or either alone where they are not tied.

    Tied, the embedding keeps the exact rows (8-bit codes, fp16 scales) and the lm_head a
    kernel copy, which for group-wise 8-bit is per-row int8 (`approximate`): fast, and its top
    candidates are recomputed from the exact rows. A 4-bit vocabulary is served exactly."""
    cfg, shard, tp = model.cfg, model.shard, model.tp
    tied = cfg.tie_word_embeddings
    # a pipeline stage builds only the ends it holds (a tied last stage keeps the exact rows);
    # untied, either end may be quantized alone (GPTQModel's `lm_head: true` packs the head
    # and leaves the embedding plain)
    table = embed = None
    if "embed_tokens" in names or tied:
        embed = _rank_spec("embed_tokens", cfg, shard, specs)
        table = QuantizedEmbedding(embed, dtype, device, None, shard.vocab.start, tp)
    if "embed_tokens" in names:
        model.embed_tokens = table
    if "lm_head" in names:
        head_spec = embed if tied else _rank_spec("lm_head", cfg, shard, specs)
        head = QuantizedLinear(head_spec, None, dtype, device, approximate=tied)
        exact = table.table if tied else None
        model.lm_head = QuantizedLMHead(head, cfg.vocab_size, tp, exact)


def _rank_spec(name: str, cfg: ModelConfig, shard: Shard, specs: dict[str, QuantSpec]) -> QuantSpec:
    """This rank's part of module `name`: its checkpoint parts sliced and fused by rows."""
    parts = []
    for p in hf_parts(name + ".weight", cfg, shard):
        spec = specs[p.name.removesuffix(".weight")]
        if p.full is not None and spec.shape[p.dim] != p.full:
            raise ModelLoadError(
                f"quantized {p.name!r} has shape {spec.shape}, expected {p.full} along dim {p.dim}"
            )
        try:
            parts.append(spec if p.span is None else slice_spec(spec, p.span, p.dim, p.name))
        except ValueError as e:
            advice = str(e) if spec.perm is not None else _split_advice(str(e), cfg, spec)
            raise ModelLoadError(advice) from e
    return cat_rows(parts)


def _split_advice(problem: str, cfg: ModelConfig, spec: QuantSpec) -> str:
    """A row-parallel split off the group grid, with the tensor_parallel values that work."""
    from kvguard.engine.distributed.sharding import valid_tp_sizes

    g = spec.group_size
    ok = [
        n
        for n in valid_tp_sizes(cfg)
        if (cfg.intermediate_size // n) % g == 0 and (cfg.num_heads // n * cfg.head_dim) % g == 0
    ]
    return f"{problem}; tensor_parallel values that keep whole groups: {ok or 'only 1'}"


def _rank_bias(
    name: str, cfg: ModelConfig, shard: Shard, plain: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    """Module `name`'s bias on this rank (None where the model has none): its rows of qkv's
    and gate_up's, the whole of a row-parallel projection's."""
    has = {
        "qkv_proj": cfg.attention_bias,
        "o_proj": cfg.o_proj_bias,
        "gate_up_proj": cfg.mlp_bias,
        "down_proj": cfg.mlp_bias,
    }
    if not has[name.rsplit(".", 1)[-1]]:
        return None
    parts = hf_parts(name + ".bias", cfg, shard)
    source = DictSource(plain)
    return torch.cat([source.read(p) for p in parts])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights this rank holds: parameters and the quantized layers' buffers
    (a tied lm_head counted once; the rotary tables are not weights)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(
        b.numel() * b.element_size()
        for name, b in model.named_buffers()
        if not name.endswith(("cos_cache", "sin_cache"))
    )
    return params + buffers


def step_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step must read: `weight_bytes` less the embedding table's own
    (a step reads one row of it per token), which a tied lm_head reads whole, so it counts
    there. What batch-1 decode's bandwidth limit divides by."""
    emb, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if not isinstance(emb, nn.Module):
        return weight_bytes(model)
    heads = [] if not isinstance(head, nn.Module) else [*head.parameters(), *head.buffers()]
    shared = {id(t) for t in heads}
    table = sum(
        t.numel() * t.element_size()
        for t in (*emb.parameters(), *emb.buffers())
        if id(t) not in shared
    )
    return weight_bytes(model) - table
