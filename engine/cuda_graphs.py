"""CUDA-graph replay of decode steps, padded to a few batch-size buckets.

Why: on a GPU a decode step of a 135M-7B model is a few hundred small kernels (per layer: norms,
qkv, rope, KV write, attention, o, gate_up, down), and at small batches launching them costs
more than running them. A captured graph launches the whole step at once. A graph is fixed in
shape and in the addresses it reads, so:

- steps are padded up to the nearest captured batch size (`graph_buckets`, `bucket_for`);
- every input lives in one set of static buffers (sized for the largest bucket) that each step
  is copied into (`pad_decode`, `DecodeGraphs.run`);
- padding rows must be harmless: their KV slot is -1, which the Triton KV write skips, and
  their length is 0, so the Triton decode kernel reads nothing for them (its output row is 0):
  a dummy never writes or reads a live block. Unused block-table columns are never read
  (reads stop at each row's length);
- attention reads per-sequence lengths from a device tensor and sizes its grid for
  `max_model_len`, never from host lists (a host-to-device copy cannot be captured);
- a KV pool that is rebuilt (the live FP8 switch) has new addresses: its graphs are dropped and
  captured again on first use.

Only all-decode batches of at most the largest bucket replay; anything else (a prefill chunk,
a bigger batch) runs eagerly, as before. The switch (`cuda_graphs`) is on by default since the
first device run (H200, bench/gpu_e2e.py): the tiny model's fp32 tokens equal to eager, and
decode 6.7x faster at batch 1, 5.1x at batch 16 and 64 on the SmolLM2 shape.

Graphs need the Triton kernels (the torch KV write cannot skip a slot), so they run only where
`kvguard.kernels.dispatch.use_triton` holds. An FP8 pool's writes grow block scales: the
general path does that in torch with a host sync (`unique`, a conditional requantise), but a
replayed step writes one token per sequence, each alone in its block, which one Triton kernel
handles without a sync (`triton_kv.store_fp8_own_blocks`); FP8 pools replay only with
`KVGUARD_FP8_GRAPHS=1` until a device run has shown that path's tokens and speed-up. The
bucketing and padding are plain tensor code, tested on CPU with the Triton kernels in the
interpreter; `DecodeGraphs.capture` needs CUDA.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvguard.engine.kv_cache import KVCache
    from kvguard.engine.model_runner import StepInput

# Batch sizes captured by default (cut at max_num_seqs, which is always added): dense at the
# small end, where launch overhead dominates, sparse above, where padding waste would.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
NO_SLOT = -1  # a padding row's KV slot: the Triton write skips negative slots


def graph_buckets(
    max_num_seqs: int, candidates: Sequence[int] = DEFAULT_BUCKETS
) -> tuple[int, ...]:
    """The batch sizes to capture: each candidate below `max_num_seqs`, then `max_num_seqs`
    itself, so a full batch never pads and no batch the scheduler can form is left out."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}: must be at least 1")
    return (*sorted({b for b in candidates if 0 < b < max_num_seqs}), max_num_seqs)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `n` rows; None when `n` is 0 or above the largest bucket
    (that step runs eagerly)."""
    if n < 1:
        return None
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def table_width(max_model_len: int, block_size: int) -> int:
    """Block-table columns for the longest sequence the engine serves: fixed, so it can be
    captured (the eager path pads to the batch's longest table instead)."""
    return -(-max_model_len // block_size)


@dataclass(slots=True)
class DecodeInputs:
    """One decode step's tensors, one row per sequence: what the graph reads."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64: flat KV slot each row writes
    block_tables: torch.Tensor  # [B, width] int32
    seq_lens: torch.Tensor  # [B] int32: tokens each row attends to (its own included)

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


def decode_inputs(step: StepInput) -> DecodeInputs | None:
    """The graph's view of a prepared step; None unless every row is one decode token whose
    next token is sampled (prefill chunks, a prompt's one-token tail or last chunk, and scoring
    run eagerly: a prompt's rows attend by the prefill kernel, `AttentionMetadata.prompt_rows`)."""
    meta = step.meta
    n = len(meta.query_lens)
    if any(q != 1 for q in meta.query_lens) or step.sample_rows.numel() != n:
        return None
    if meta.prompt_rows is not None and any(meta.prompt_rows):
        return None
    lens = step.seq_lens_dev
    if lens is None:
        lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
        lens = lens.to(step.input_ids.device, non_blocking=True)
    return DecodeInputs(step.input_ids, step.positions, meta.slot_mapping, meta.block_tables, lens)


def pad_decode(inp: DecodeInputs, bucket: int, width: int) -> DecodeInputs:
    """`inp` padded to `bucket` rows and `width` table columns.

    Dummy rows: token 0 at position 0, KV slot -1 (not written), length 0 (nothing read), so
    what they compute is finite and touches no block. Padding columns hold block 0 and are
    never read: attention stops at each row's length."""
    n, w = inp.block_tables.shape
    if n > bucket or w > width:
        raise ValueError(f"a step of {n} rows x {w} blocks does not fit bucket {bucket} x {width}")
    tables = torch.zeros((bucket, width), dtype=torch.int32, device=inp.input_ids.device)
    tables[:n, :w] = inp.block_tables
    return DecodeInputs(
        _pad(inp.input_ids, bucket, 0),
        _pad(inp.positions, bucket, 0),
        _pad(inp.slot_mapping, bucket, NO_SLOT),
        tables,
        _pad(inp.seq_lens.to(torch.int32), bucket, 0),
    )


def _pad(t: torch.Tensor, size: int, value: int) -> torch.Tensor:
    out = torch.full((size,), value, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def live_tables_only(inp: DecodeInputs, rows: int) -> DecodeInputs:
    """The first `rows` rows of `inp` (what a caller keeps of a padded step's outputs)."""
    return DecodeInputs(
        inp.input_ids[:rows],
        inp.positions[:rows],
        inp.slot_mapping[:rows],
        inp.block_tables[:rows],
        inp.seq_lens[:rows],
    )


# forward(input_ids, positions, slot_mapping, block_tables, seq_lens) -> hidden [B, hidden]
DecodeForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


class StaticBuffers:
    """One set of input tensors, sized for the largest bucket; bucket `b` reads rows `[:b]`.

    Every graph shares them (and one memory pool), so the graphs cost one step's activations,
    not one per bucket."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        empty = DecodeInputs(
            torch.zeros(0, dtype=torch.long, device=device),
            torch.zeros(0, dtype=torch.long, device=device),
            torch.zeros(0, dtype=torch.long, device=device),
            torch.zeros(0, width, dtype=torch.int32, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
        )
        self.inp = pad_decode(empty, rows, width)
        self._padding = pad_decode(empty, rows, width)

    def clear(self) -> None:
        """Every row back to padding (touches no block), in place."""
        self.load(self._padding)

    def view(self, bucket: int) -> DecodeInputs:
        return live_tables_only(self.inp, bucket)

    def load(self, padded: DecodeInputs) -> None:
        """Copy a padded step in (device to device; never reallocates)."""
        b = padded.rows
        dst = self.view(b)
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens"):
            getattr(dst, name).copy_(getattr(padded, name))


class DecodeGraphs:
    """Captured decode graphs for one KV pool; `run` replays one, or returns None (run eager).

    `forward` must read only its tensor arguments and the pool (no host lists): see the
    module docstring. Capture happens lazily on the first eligible step, for every bucket at
    once (largest first, so the shared pool is sized by the largest), and again after
    `invalidate`."""

    def __init__(
        self,
        forward: DecodeForward,
        buckets: Sequence[int],
        width: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.buckets = tuple(buckets)
        self.width = width
        self.device = device
        self.buffers = StaticBuffers(max(self.buckets), width, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captures = 0  # how many times the set was (re)captured: tests and benches read it

    def invalidate(self) -> None:
        """Drop every graph (the pool they write was replaced); the next step recaptures."""
        self._graphs.clear()

    def run(self, inp: DecodeInputs) -> torch.Tensor | None:
        """Hidden states `[rows, hidden]` of a decode step by replay; None when the step does
        not fit a bucket (the caller runs it eagerly)."""
        bucket = bucket_for(inp.rows, self.buckets)
        if bucket is None or inp.block_tables.shape[1] > self.width:
            return None
        if not self._graphs:
            self.capture()
        self.buffers.load(pad_decode(inp, bucket, self.width))
        graph, out = self._graphs[bucket]
        graph.replay()
        return out[: inp.rows]

    def capture(self) -> None:
        """Capture every bucket (CUDA only). Each is run once eagerly on a side stream first,
        so lazily created state (Triton compiles, cuBLAS workspaces) exists before capture.
        That run writes K/V, so the buffers are padding first: after `invalidate` they still
        hold the last replayed step's slots and tables, the old pool's block ids (past the
        end of a shrunk pool, or another sequence's blocks now)."""
        self.buffers.clear()
        pool, graphs = None, {}
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                args = _args(self.buffers.view(b))
                self.forward(*args)  # warm-up outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.forward(*args)
                pool = graph.pool()
                graphs[b] = (graph, out)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._graphs = graphs  # all or nothing: a capture that fails (OOM) leaves none
        self.captures += 1


def model_decode_forward(model: torch.nn.Module, kv_cache: KVCache, max_len: int) -> DecodeForward:
    """The model's forward in graph form: lengths from a device tensor, the attention grid
    sized for `max_len`, the pool's layers read at call time (a capture after the live dtype
    switch sees the new pool)."""
    from kvguard.engine.model import AttentionMetadata

    def forward(
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        meta = AttentionMetadata(slots, tables, [], [], seq_lens_t=lens, graph_max_len=max_len)
        return model(ids, pos, kv_cache.layers, meta)

    return forward


def _args(inp: DecodeInputs) -> tuple[torch.Tensor, ...]:
    return (inp.input_ids, inp.positions, inp.slot_mapping, inp.block_tables, inp.seq_lens)
