"""Paged attention in plain torch: the path that runs everywhere (CPU and CUDA).

The KV pools are `[num_blocks, block_size, num_kv_heads, head_dim]`; a sequence's tokens live in
the blocks its block table lists, in order. Queries come as one flattened batch of sequences,
each contributing its last `query_len` positions (a prefill chunk, or one decode token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvguard.kernels import cpu_ops
from kvguard.kernels.dispatch import use_triton, use_triton_prefill
from kvguard.kernels.fp8 import FP8_DTYPE, as_bytes, dequantize, write_kv_fp8


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    own_blocks: bool = False,
) -> None:
    """Store this step's K/V `[T, kv_heads, head_dim]` at flat slots `block * block_size + offset`.

    An fp8 cache needs its `[num_blocks, kv_heads]` scale tensors, updated in place.
    `own_blocks`: every token is alone in its block (a decode step), which lets the Triton path
    update FP8 scales without a host sync (CUDA graphs); the other paths need no hint.
    """
    if use_triton(k_cache.device, k_cache.dtype):
        from kvguard.kernels import triton_kv

        triton_kv.write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale, own_blocks)
        return
    if (
        cpu_ops.enabled(k)
        and cpu_ops.write_supported(k_cache, k_scale, k, slot_mapping)
        and cpu_ops.write_supported(v_cache, v_scale, v, slot_mapping)
    ):
        # one C pass per pool (same bits: tests): on fp8 pools instead of about twenty small
        # torch ops; on the others instead of torch's index_copy_, which took 105 us for a
        # mixed step's 165 rows of 192 floats (0.5 s of the 64-request trace on 2 cores)
        cpu_ops.write_kv(k_cache, k_scale, k, slot_mapping)
        cpu_ops.write_kv(v_cache, v_scale, v, slot_mapping)
        return
    if k_cache.dtype == FP8_DTYPE:
        write_kv_fp8(k_cache, k_scale, k, slot_mapping)
        write_kv_fp8(v_cache, v_scale, v, slot_mapping)
        return
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Contiguous `[length, kv_heads, head_dim]` copy of one sequence's cached tokens."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    ids = block_table[:nblocks].long()
    if cache.dtype == FP8_DTYPE:
        raw = as_bytes(cache).index_select(0, ids).view(FP8_DTYPE)
        blocks = dequantize(raw, scales.index_select(0, ids)[:, None, :, None], dtype)
    else:
        blocks = cache.index_select(0, ids)
    return blocks.flatten(0, 1)[:length]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    prompt_rows: list[bool] | None = None,
) -> torch.Tensor:
    """Causal attention of a mixed prefill/decode batch over the paged cache.

    `seq_lens[i]` counts all of sequence i's tokens (this step's included, already written);
    its queries are the last `query_lens[i]` of them. Returns `[T, num_heads, head_dim]`.
    An fp8 cache is dequantised with its per-block, per-head `k_scale` / `v_scale`.
    `prompt_rows` (`AttentionMetadata.prompt_rows`) marks the entries that attend as prefill
    chunks at one query too (`split_rows`).
    """
    kv = (k_cache, v_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    starts = row_starts(query_lens)
    decode, chunks = split_rows(query_lens, prompt_rows)
    if decode and use_triton(q.device, k_cache.dtype):
        from kvguard.kernels import triton_attention

        triton_attention.decode_rows(
            q, out, k_cache, v_cache, block_tables, seq_lens, starts, decode, scale, *kv[2:]
        )
    elif decode and cpu_ops.enabled(q) and cpu_ops.decode_supported(q, k_cache):
        _decode_native(q, out, kv, block_tables, seq_lens, starts, decode, scale)
    elif decode:
        _decode(q, out, kv, block_tables, seq_lens, starts, decode, scale)
    if chunks and use_triton_prefill(q.device, k_cache.dtype):
        from kvguard.kernels import triton_attention

        triton_attention.prefill_rows(
            q, out, k_cache, v_cache, block_tables, seq_lens, query_lens, starts, chunks, scale,
            *kv[2:],
        )  # fmt: skip
        return out
    if chunks and cpu_ops.enabled(q) and cpu_ops.decode_supported(q, k_cache):
        _prefill_native(q, out, kv, block_tables, seq_lens, query_lens, starts, chunks, scale)
        return out
    for i in chunks:
        s, qlen = starts[i], query_lens[i]
        out[s : s + qlen] = _prefill_one(q[s : s + qlen], kv, block_tables[i], seq_lens[i], scale)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-token queries `[B, heads, head_dim]` with lengths in a device tensor and a grid
    sized for `max_seq_len`: no host list and no device sync, so a CUDA graph can capture it
    (kvguard.engine.cuda_graphs). A row of length 0 (graph padding) reads nothing and is 0.

    Only the Triton kernel does this (the torch path needs host lengths): on CUDA callers use
    it only where `use_triton` holds, and this raises elsewhere rather than silently syncing;
    on CPU it runs in Triton's interpreter (TRITON_INTERPRET=1, tests)."""
    if q.device.type == "cuda" and not use_triton(q.device, k_cache.dtype):
        raise RuntimeError("decode_attention needs the Triton decode kernel (CUDA + triton)")
    from kvguard.kernels import triton_attention

    return triton_attention.paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, k_scale, v_scale
    )


def split_rows(
    query_lens: list[int], prompt_rows: list[bool] | None = None
) -> tuple[list[int], list[int]]:
    """A step's attention entries as (decode rows, prefill chunks): one query attends as a
    decode row unless `prompt_rows` marks it a prompt's, more as a chunk. The decode kernels
    never give the prefill kernels' bits (another summation order, a long sequence split over
    the threads), so a prompt's one-token last chunk or cached tail attends as its other rows
    do: its request gets the same log-probabilities however the prompt is chunked or cached."""
    decode, chunks = [], []
    for i, n in enumerate(query_lens):
        if n == 1 and not (prompt_rows is not None and prompt_rows[i]):
            decode.append(i)
        elif n >= 1:
            chunks.append(i)
    return decode, chunks


def row_starts(lens: list[int]) -> list[int]:
    """The first row of each sequence in a step whose sequences have `lens` rows each."""
    starts, total = [], 0
    for n in lens:
        starts.append(total)
        total += n
    return starts


KV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _prefill_one(
    q: torch.Tensor,
    kv: KV,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One prefill chunk: its queries sit at the end of the sequence (bottom-right causal)."""
    qlen = q.shape[0]
    k = gather_kv(kv[0], block_table, seq_len, kv[2], q.dtype).transpose(0, 1)
    v = gather_kv(kv[1], block_table, seq_len, kv[3], q.dtype).transpose(0, 1)
    # a cache may be stored narrower than compute; a batch dimension of one, because with
    # 3-d inputs torch's CPU attention takes its unfused math path (2-4x slower at 96-1024
    # tokens here) where 4-d ones take the fused one
    k, v = k.to(q.dtype).unsqueeze(0), v.to(q.dtype).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)
    if qlen == seq_len:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos_q = torch.arange(seq_len - qlen, seq_len, device=q.device)
        mask = pos_q[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _decode(
    q: torch.Tensor,
    out: torch.Tensor,
    kv: KV,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    starts: list[int],
    rows: list[int],
    scale: float,
) -> None:
    """Single-token queries of many sequences, attended in one batched call.

    K/V blocks are gathered into a reused workspace (fresh allocations cost more than the copy
    on CPU), and query heads are folded onto their KV head so GQA needs no K/V repeat.
    """
    dev = q.device
    nb, bs, hkv, d = kv[0].shape
    g, nh = len(rows), q.shape[1]
    lens = [seq_lens[i] for i in rows]
    nblocks = (max(lens) + bs - 1) // bs
    idx = torch.tensor(rows, device=dev)
    tables = block_tables.index_select(0, idx)[:, :nblocks].reshape(-1).long()
    k = _gather_into(kv[0], tables, 0, kv[2], q.dtype).view(g, nblocks * bs, hkv, d).transpose(1, 2)
    v = _gather_into(kv[1], tables, 1, kv[3], q.dtype).view(g, nblocks * bs, hkv, d).transpose(1, 2)
    qpos = torch.tensor([starts[i] for i in rows], device=dev)
    qg = q.index_select(0, qpos).view(g, hkv, nh // hkv, d)
    mask = None
    if min(lens) != nblocks * bs:
        lens_t = torch.tensor(lens, device=dev)
        mask = (torch.arange(nblocks * bs, device=dev)[None, :] < lens_t[:, None])[:, None, None, :]
    k, v = k.to(q.dtype), v.to(q.dtype)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    out.index_copy_(0, qpos, o.reshape(g, nh, d).to(out.dtype))


def decode_workspace_bytes(
    rows: int,
    max_len: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    dtype: torch.dtype,
) -> int:
    """The most memory `_decode` holds for `rows` sequences of up to `max_len` tokens: its
    persistent gathered K and V (plus their dequantised copies from an fp8 cache), and the
    transients of one call (a cast to the compute `dtype`, the length mask, fp32 scores).
    A maximal prefill never allocates these, so pool sizing adds them where this path serves."""
    tokens = rows * -(-max_len // block_size) * block_size
    elems = tokens * num_kv_heads * head_dim
    held = 2 * elems * cache_dtype.itemsize
    if cache_dtype != dtype:  # an fp8 cache's dequantised copies, or another dtype's casts
        held += 2 * elems * dtype.itemsize
    return held + tokens * (1 + 4 * num_heads)  # mask rows x len; scores rows x heads x len


def _decode_native(
    q: torch.Tensor,
    out: torch.Tensor,
    kv: KV,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    starts: list[int],
    rows: list[int],
    scale: float,
) -> None:
    """`_decode` by the CPU kernel, which reads the paged pool in place (no gather)."""
    qrows, lens, tables = decode_rows(block_tables, seq_lens, starts, rows)
    cpu_ops.paged_decode(q, out, qrows, lens, kv[0], kv[1], tables, scale, kv[2], kv[3])


def _prefill_native(
    q: torch.Tensor,
    out: torch.Tensor,
    kv: KV,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    starts: list[int],
    chunks: list[int],
    scale: float,
) -> None:
    """The prompt chunks `chunks` by the CPU kernel, in one call: it reads the paged pool in
    place (no gather, no mask tensor) and skips the blocks a query cannot see. Against torch's
    attention over gathered K/V, 2.1-3.6x faster for chunks of 16-128 tokens over 128-400
    cached ones (2 cores), where that was a tenth of the 64-request trace."""
    rows, qlens, lens, tables = prefill_chunks(block_tables, seq_lens, query_lens, starts, chunks)
    cpu_ops.paged_prefill(q, out, rows, qlens, lens, kv[0], kv[1], tables, scale, kv[2], kv[3])


def prefill_chunks(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    starts: list[int],
    chunks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompt chunks `chunks` as the CPU kernel takes them: (first query row of each,
    int64; its query count, its cached length, int32; its block table, int32, unit stride)."""

    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = torch.tensor([starts[i] for i in chunks], dtype=torch.int64)
        qlens = torch.tensor([query_lens[i] for i in chunks], dtype=torch.int32)
        lens = torch.tensor([seq_lens[i] for i in chunks], dtype=torch.int32)
        return rows, qlens, lens, _kernel_tables(block_tables, chunks)

    return _per_step("chunks", block_tables, seq_lens, build)


def _kernel_tables(block_tables: torch.Tensor, seqs: list[int]) -> torch.Tensor:
    """The block tables of sequences `seqs` as the CPU kernels read them: int32, unit stride."""
    tables = block_tables
    if len(seqs) != block_tables.shape[0]:
        tables = block_tables.index_select(0, torch.tensor(seqs, dtype=torch.int64))
    if tables.dtype != torch.int32 or tables.stride(1) != 1:
        tables = tables.to(torch.int32).contiguous()
    return tables


# The step in flight's decode rows and prompt chunks as the kernels take them: every layer of
# a step passes the same block-table tensor and seq_lens list, so they are built once per
# step, not per layer (kind -> (block_tables, seq_lens, value)).
_NATIVE_STEP: dict[str, tuple] = {}


def _per_step(kind: str, block_tables: torch.Tensor, seq_lens: list[int], build):  # noqa: ANN001, ANN202
    held = _NATIVE_STEP.get(kind)
    if held is not None and held[0] is block_tables and held[1] is seq_lens:
        return held[2]
    value = build()
    _NATIVE_STEP[kind] = (block_tables, seq_lens, value)
    return value


def decode_rows(
    block_tables: torch.Tensor, seq_lens: list[int], starts: list[int], rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode sequences `rows` as the CPU kernel takes them: (query row of each, int64;
    its cached length, int32; its block table, int32 with unit stride)."""

    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qrows = torch.tensor([starts[i] for i in rows], dtype=torch.int64)
        lens = torch.tensor([seq_lens[i] for i in rows], dtype=torch.int32)
        return qrows, lens, _kernel_tables(block_tables, rows)

    return _per_step("decode", block_tables, seq_lens, build)


_WORKSPACE: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def _gather_into(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    slot: int,
    scales: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Copy `blocks` of `cache` into a persistent buffer (grown on demand, reused per call);
    fp8 blocks come out dequantised to `dtype`."""
    nb, bs, h, d = cache.shape
    row = bs * h * d
    gathered = torch.index_select(
        cache.view(nb, row),
        0,
        blocks,
        out=_buffer(cache.dtype, cache.device, slot, blocks.numel() * row).view(-1, row),
    )
    if cache.dtype != FP8_DTYPE:
        return gathered
    out = _buffer(dtype, cache.device, slot + 2, blocks.numel() * row).view(-1, bs, h, d)
    out.copy_(gathered.view(-1, bs, h, d))
    out.mul_(scales.index_select(0, blocks)[:, None, :, None])
    return out.view(-1, row)


def _buffer(dtype: torch.dtype, device: torch.device, slot: int, numel: int) -> torch.Tensor:
    key = (device, dtype, slot)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor, even when first needed under inference_mode: callers outside it
        # (tests, benchmarks) may write into it later, which an inference tensor forbids.
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype, device=device)
        _WORKSPACE[key] = buf
    return buf[:numel]
