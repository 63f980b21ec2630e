"""ModelRunner: one rank's model execution — weights, KV pools, input preparation, the forward
and (on the driver) sampling.

It knows nothing of queues, priorities or admission: the scheduler decides what runs and with
which blocks; the runner turns that into tensors, runs the model and returns sampled tokens.
Everything that touches KV memory (writes in the forward, swap copies, the live dtype switch)
goes through here, so a distributed runner can repeat it on every rank.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from kvguard.engine.block_manager import short_prompt
from kvguard.engine.config import ConfigError, EngineConfig
from kvguard.engine.cuda_graphs import (
    DecodeGraphs,
    decode_inputs,
    graph_buckets,
    model_decode_forward,
    table_width,
)
from kvguard.engine.distributed.agreement import agree_any, agree_min
from kvguard.engine.distributed.errors import PoolTorn
from kvguard.engine.distributed.parallel_state import PipelineStage, TPGroup
from kvguard.engine.distributed.sharding import shard_config
from kvguard.engine.host_memory import room_bytes
from kvguard.engine.kv_cache import (
    KV_TORCH_DTYPES,
    KVCache,
    bytes_per_block,
    is_oom,
    kv_dtype_name,
)
from kvguard.engine.layers.quantized_linear import QuantizedLMHead, use_int8_activations
from kvguard.engine.model import AttentionMetadata, LlamaForCausalLM, load_model, weight_bytes
from kvguard.engine.model_config import ModelConfig, ModelLoadError
from kvguard.engine.sampler import (
    adjust_logits,
    log_softmax_entries,
    output_counts,
    rewind,
    run_draws,
    sample,
    token_logprobs,
)
from kvguard.engine.sampling_params import SamplingParams
from kvguard.engine.sequence import Sequence, TokenLogprob
from kvguard.engine.speculative import accepted_prefix
from kvguard.engine.tokenizer import id_end
from kvguard.engine.weights import safetensors_bytes
from kvguard.kernels.cpu_lowbit import StepRows, step_rows
from kvguard.kernels.dispatch import use_triton
from kvguard.kernels.env import env_flag
from kvguard.kernels.paged_attention import decode_workspace_bytes

log = logging.getLogger("kvguard.engine")
HOST_GROW_BELOW = 0.90  # a KV pool grows back only while host memory stays under this
HOST_START_BELOW = 0.95  # a CPU KV pool that would take host memory past this refuses to start
CUDA_GROW_MARGIN = 0.05  # ... and on CUDA while this share of the device stays free
CUDA_GRAPHS_ENV = "KVGUARD_CUDA_GRAPHS"  # on / off overrides the cuda_graphs knob (benchmarks)
# on: an FP8 pool's decode steps replay too (their scales grow in one kernel); opt-in until a
# device run has shown its tokens and speed-up
FP8_GRAPHS_ENV = "KVGUARD_FP8_GRAPHS"


def cuda_graphs_wanted(config: EngineConfig, device: torch.device, world_size: int) -> bool:
    """Graphs only on CUDA with one rank; the environment may override the knob either way."""
    wanted = env_flag(CUDA_GRAPHS_ENV, config.cuda_graphs)
    return wanted and device.type == "cuda" and world_size == 1


class InjectedOOMError(RuntimeError):
    """Raised inside a forward pass by `inject_oom` (the documented fault-injection test hook)."""


def release_freed_memory(device: torch.device) -> None:
    """Hand memory the old pool held back to the system: the CUDA caching allocator keeps
    freed blocks for reuse, and glibc keeps freed heap pages unless trimmed."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator returns large blocks itself
        return
    libc.malloc_trim(0)


def token_vocab(path: Path, mcfg: ModelConfig) -> int:
    """The token ids a model's logits cover, [0, this): the tokenizer's where the embedding
    has more rows (a padded vocabulary: Qwen2's 151936 rows for 151665 tokens, the tiny
    model's 320 for 259). The rows past it name no token: no text could be written for one,
    so their logits are -inf (`LlamaForCausalLM.compute_logits`) and none is drawn. The
    tokenizer's highest id + 1, not its count of tokens (`id_end`: ids may have gaps, and
    the top ones must stay drawable), as `Tokenizer.vocab_size`, which the engine holds its
    eos ids to at load. Read by every rank from its own model directory, so that each builds
    the same head; one without tokenizer.json (which no engine serves: `Tokenizer.from_dir`
    refuses it first) keeps every row."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return mcfg.vocab_size
    try:
        tokens = id_end(HFTokenizer.from_file(str(file)))
    except Exception as e:  # the Rust parser raises plain Exception on bad JSON
        raise ModelLoadError(f"{file}: not a valid tokenizer.json ({e})") from e
    return min(tokens, mcfg.vocab_size)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r}: CUDA is not available on this host")
    return dev


def rank_device(
    name: str, tp: TPGroup, world: TPGroup | None = None, remote_ranks: Collection[int] = ()
) -> torch.device:
    """This rank's device: one GPU per rank on CUDA, the CPU otherwise. A host's ranks take
    its GPUs by their index among the ranks it runs (`host_ranks`), not by world rank: with
    ranks of other hosts between them (ranks 0 and 2 here, 1 and 3 elsewhere) two of them
    would share a GPU while another sat idle. `world`: this rank in the tensor x pipeline
    world (None: `tp` is the world); `remote_ranks`: those `kvguard worker` runs elsewhere.
    The daemon's host running one rank keeps the device as named (`cuda:1`), as one process
    does."""
    dev = pick_device(name)
    world = world or tp
    remote = world.rank in remote_ranks
    ranks = host_ranks(world.rank, world.size, remote_ranks)
    if dev.type != "cuda" or (len(ranks) == 1 and not remote):
        return dev
    gpus = torch.cuda.device_count()
    if remote:  # its host's other ranks are not known here: wrapped at its GPUs
        if gpus < tp.size:
            raise ConfigError(
                f"rank {world.rank}: its tensor-parallel group of {tp.size} ranks runs on this "
                f"host, one GPU each, and torch sees {gpus} (expected at least {tp.size}: make "
                "more GPUs visible to kvguard worker, or lower tensor_parallel)"
            )
        index = ranks.index(world.rank) % gpus
    else:
        if gpus < len(ranks):
            raise ConfigError(
                f"this host runs {len(ranks)} ranks (tensor_parallel x pipeline_parallel less "
                f"distributed.remote_ranks), one GPU each, and torch sees {gpus} (expected at "
                f"most {gpus} ranks here: lower tensor_parallel or pipeline_parallel, list the "
                "ranks other hosts run in distributed.remote_ranks, or make more GPUs visible)"
            )
        index = ranks.index(world.rank)
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    return dev


def host_ranks(rank: int, world_size: int, remote_ranks: Collection[int]) -> list[int]:
    """The world ranks that share `rank`'s host's GPUs, in rank order. The daemon's host runs
    every rank not in `remote_ranks`. A remote rank (`kvguard worker`) is told only its own
    rank, not which other remote ranks its host runs: it counts all the remote ranks, which
    gives each host's ranks GPUs of their own wherever a host runs a consecutive run of them
    (whole pipeline stages, the multi-node layout README shows)."""
    elsewhere = rank in remote_ranks
    return [r for r in range(world_size) if (r in remote_ranks) == elsewhere]


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return KV_TORCH_DTYPES[name]


class RowKind(enum.IntEnum):
    """How a step computes a sequence's rows (`decode_rows`, `build_step`'s `decodes`), in the
    order the step lays them out: a decode's, then a short prompt's, then a prompt's. PROMPT
    and DECODE equal False and True, what `decodes` held before short prompts had a kind."""

    PROMPT = 0  # prompt rows of a prompt of `cpu_lowbit.bf16_min_prompt()` tokens or more
    DECODE = 1
    SHORT_PROMPT = 2  # prompt rows of a shorter prompt (the AMX bf16 tiles do not pay there)


@dataclass(slots=True)
class StepInput:
    """One step's tensors, built the same way on every rank from the scheduled batch."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the hidden states whose next token is sampled
    # meta.seq_lens already on the device (int32), where the caller has it (decode_ahead)
    seq_lens_dev: torch.Tensor | None = None
    # the rows' kinds (decode rows first), as the CPU GEMMs pick their kernels by them; None
    # where the caller did not say (every GEMM then picks by the step's row count)
    kinds: StepRows | None = None


def build_step(
    tables: list[list[int]],
    starts: list[int],
    num_tokens: list[int],
    sampled: list[int],
    token_ids: list[int],
    block_size: int,
    device: torch.device,
    every_row: bool = False,
    as_decode: list[bool] | None = None,
    decodes: list[RowKind] | list[bool] | None = None,
) -> StepInput:
    """The step's tensors from each sequence's block table, first uncomputed position, token
    count and how many of its last rows get logits (`logit_rows`: 1 where a token is sampled,
    all of a prompt chunk whose log-probabilities were asked; `every_row`: all rows, for
    scoring). A sequence marked in `as_decode` (a last token with its speculative drafts, or
    with the tokens its grammar forced after it) attends as one decode row a position, each
    seeing the positions up to its own: the same causal attention, by the decode kernels, so
    each row's logits are what a decode step of its own would give (up to how a long
    sequence's rows are split over threads, and the blocks they share read once for them: a
    greedy request keeps its tokens but at a near tie), and a few queries no longer pay for a
    prompt tile (the CPU prefill kernel's sixteen: two queries over 512 cached tokens
    took 7.8 ms a step, 4.8 as decode rows). Every rank of a tensor-parallel engine calls
    this with the same lists, so slots agree.

    `decodes` gives each sequence's rows their kind (`decode_rows`: a `RowKind`, or a bool:
    decode rows or a prompt's): decode rows come first in the step, then short prompts'
    chunks, then the other prompt chunks (`kinds`), so that the CPU GEMMs can give each kind
    its own kernel; the sampled rows stay in batch order. It also marks the prompt chunks for
    attention (`AttentionMetadata.prompt_rows`): a one-token chunk or cached tail attends by
    the prefill kernel, as its prompt's other rows did. Without it the rows are in batch
    order, the step says nothing of their kinds, and a one-row entry attends as a decode
    row."""
    order = range(len(tables))
    kinds = None
    if decodes is not None:
        layout = (RowKind.DECODE, RowKind.SHORT_PROMPT, RowKind.PROMPT)
        order = [i for kind in layout for i in order if decodes[i] == kind]
        decoding = sum(kind == RowKind.DECODE for kind in decodes)
        short = sum(
            n for n, k in zip(num_tokens, decodes, strict=True) if k == RowKind.SHORT_PROMPT
        )
        decode = sum(num_tokens[i] for i in order[:decoding])
        kinds = StepRows(sum(num_tokens), decode, decoding, short)
    at = [0] * len(tables)  # each sequence's first token id in `token_ids` (batch order)
    for i in range(1, len(tables)):
        at[i] = at[i - 1] + num_tokens[i - 1]
    first = [0] * len(tables)  # ... and its first row in the step
    pos, slots, ids = [], [], []
    entries, lens, qlens = [], [], []  # attention entries: a table, its length, its queries
    prompt = []  # ... and whether it is a prompt's (`decodes`)
    for i in order:
        table, start, n = tables[i], starts[i], num_tokens[i]
        span = range(start, start + n)
        first[i] = len(pos)
        pos.extend(span)
        ids.extend(token_ids[at[i] : at[i] + n])
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        if as_decode is not None and as_decode[i]:
            entries.extend([table] * n)
            lens.extend(range(start + 1, start + n + 1))
            qlens.extend([1] * n)
            prompt.extend([False] * n)
        else:
            entries.append(table)
            lens.append(start + n)
            qlens.append(n)
            prompt.append(decodes is not None and decodes[i] != RowKind.DECODE)
    rows = []
    for i, (n, k) in enumerate(zip(num_tokens, sampled, strict=True)):
        rows.extend(range(first[i] + (0 if every_row else n - int(k)), first[i] + n))
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in entries]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        seq_lens=lens,
        query_lens=qlens,
        prompt_rows=prompt if decodes is not None else None,
    )
    return StepInput(
        torch.tensor(ids, device=device),
        torch.tensor(pos, device=device),
        meta,
        torch.tensor(rows, dtype=torch.long, device=device),
        kinds=kinds,
    )


def step_token_ids(seqs: list[Sequence], num_tokens: list[int]) -> list[int]:
    """The token ids a step computes: each sequence's next `n`, its drafts after its last."""
    ids: list[int] = []
    for seq, n in zip(seqs, num_tokens, strict=True):
        ids.extend(seq.token_slice(seq.num_computed_tokens, seq.num_computed_tokens + n))
        ids.extend(seq.draft[: n - seq.num_uncomputed])
    return ids


def decode_rows(seq: Sequence) -> RowKind:
    """Whether a step computes decode rows of `seq` (`Sequence.decoding`, `RowKind.DECODE`): its
    last drawn token, with the tokens its grammar forced after it (jump-forward) or the drafts
    verified after it; not a prompt chunk (nor a preempted sequence's recomputed text). A
    prompt's rows are SHORT_PROMPT where the whole text it prefills is shorter than
    `cpu_lowbit.bf16_min_prompt()` (a request's prompt; a preempted sequence's prompt and
    output so far, all it recomputes), never by the chunk: the same kind however the prompt is
    chunked or the prefix cache serves it."""
    if seq.decoding:
        return RowKind.DECODE
    return RowKind.SHORT_PROMPT if short_prompt(seq) else RowKind.PROMPT


def drafted(seqs: list[Sequence]) -> list[bool] | None:
    """Which sequences compute decode rows after their last drawn token this step, each
    attending as a decode row of its own (`build_step`'s `as_decode`): speculative drafts,
    or a grammar's forced tokens; None when none does."""
    marks = [bool(s.draft) or (s.forced > 0 and s.decoding) for s in seqs]
    return marks if any(marks) else None


def finishes_prompt(seq: Sequence, n: int) -> bool:
    """Whether computing `n` more tokens of `seq` reaches its end (a token is then sampled;
    with drafts, `n` goes past it)."""
    return seq.num_computed_tokens + n >= seq.num_tokens


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether `seq` asked for its prompt's log-probabilities and lacks some still (one for
    each prompt token after the first)."""
    got = seq.prompt_logprobs
    return got is not None and len(got) < len(seq.prompt_token_ids) - 1


def prompt_rows_wanted(seq: Sequence, k: int) -> list[int]:
    """Which of the `k` logit rows of `seq`'s step (`logit_rows`, all of its chunk while it
    collects its prompt's log-probabilities) give a prompt position it still lacks: row j
    predicts the token at `num_computed_tokens + j + 1`."""
    if not wants_prompt_logprobs(seq):
        return []
    start, have = seq.num_computed_tokens, len(seq.prompt_logprobs)  # held: positions 1..have
    return [j for j in range(k) if have < start + j + 1 < len(seq.prompt_token_ids)]


class ExactRows:
    """Some of a step's logit rows computed exactly (`ModelRunner.exact_logits`), found by
    their row in the step's logits."""

    def __init__(self, rows: list[int], logits: torch.Tensor) -> None:
        self.logits, self.place = logits, {r: i for i, r in enumerate(rows)}

    def take(self, rows: list[int]) -> torch.Tensor:
        index = torch.tensor([self.place[r] for r in rows], device=self.logits.device)
        return self.logits[index]


def logit_rows(seq: Sequence, n: int) -> int:
    """How many of the last of `n` rows computed for `seq` this step get logits: all of them
    while its prompt's log-probabilities are being collected, else 1 where a token is sampled
    (`finishes_prompt`), else none."""
    if wants_prompt_logprobs(seq):
        return n
    if seq.draft:  # its last token and each draft: a row per token that follows
        return 1 + len(seq.draft)
    return int(finishes_prompt(seq, n))


class RunTokens:
    """A launched run's tokens, step by step (`ModelRunner.decode_ahead`): `step(j)` waits for
    step j alone (on a GPU its own event, the later steps still running) and gives its tokens,
    one a sequence, with the time they were ready. A token of -1 is a row whose probabilities
    were not finite (`Scheduler.update_ahead` refuses it as `sample` does in a single step)."""

    def __init__(self) -> None:
        self._steps: list[tuple[torch.Tensor, torch.cuda.Event | None, float]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, ids: torch.Tensor) -> None:
        """Step `len(self)`'s tokens: on a GPU copied to pinned host memory behind the step,
        with an event to wait for; elsewhere already computed."""
        if ids.device.type != "cuda":
            self._steps.append((ids, None, time.monotonic()))
            return
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._steps.append((host, event, 0.0))

    def step(self, j: int) -> tuple[list[int], float]:
        host, event, ready = self._steps[j]
        if event is not None:
            event.synchronize()
            ready = time.monotonic()
        return host.tolist(), ready


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        kv_cache: KVCache,
        tp: TPGroup | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.kv_cache = kv_cache
        self.tp = tp or TPGroup.single()
        self.stage = stage or PipelineStage.single(model_config.num_layers, self.tp)
        self.device = next(model.parameters()).device
        self.block_size = kv_cache.block_size
        self._inject_oom = 0
        self.graphs: DecodeGraphs | None = None
        # set for one step by the engine: the forward stops between layers once it is set
        self.step_stop: threading.Event | None = None
        # called after each decoder layer this rank's forward runs (a CUDA-graph replay
        # calls none: a decode step is short): a prompt step of thousands of tokens takes
        # seconds to minutes on a CPU, and the engine loop beats its heartbeat here, so that
        # a step computing is not taken for a stalled engine while a layer that hangs still is
        self.on_layer: Callable[[], None] | None = None
        # the last `execute`'s tokens' log-probabilities, a list for each sequence it returned
        # tokens for, aligned with them (entries None where a request did not ask; no lists
        # when none did), and its prompts' (sequence, entries for the prompt positions it
        # lacked, in order)
        self.logprobs: list[list[TokenLogprob | None]] = []
        self.prompt_logprobs: list[tuple[Sequence, list[TokenLogprob]]] = []
        # the last forward's hidden states of the rows it gave logits for (`exact_logits`)
        self.logit_hidden: torch.Tensor | None = None

    # whether a step can stop between layers (one process; ranks of a distributed runner would
    # be left half way through a collective)
    can_interrupt = True
    # whether `decode_ahead` serves (one process: it runs steps no other rank is told of)
    can_run_ahead = True

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        path,  # noqa: ANN001 - Path
        mcfg: ModelConfig,
        tp: TPGroup | None = None,
        stage: PipelineStage | None = None,
    ) -> ModelRunner:
        """This rank's model (its shards of its stage's layers only) and KV pools (its KV
        heads of its stage's layers only). Every rank of every stage holds the same number of
        blocks, the fewest any rank can afford, so block ids mean the same KV slots everywhere."""
        tp = tp or TPGroup.single()
        stage = stage or PipelineStage.single(mcfg.num_layers, tp)
        device = rank_device(config.device, tp, stage.world, config.distributed.remote_ranks)
        dtype = pick_dtype(config.dtype, device)
        max_len = min(config.max_model_len, mcfg.max_position_embeddings)
        t0 = time.perf_counter()
        size = safetensors_bytes(Path(path))
        log.info(
            "rank %d loading %s (%.2f GiB of safetensors)", stage.world.rank, path, size / 2**30
        )
        vocab = token_vocab(path, mcfg)
        if vocab < mcfg.vocab_size and stage.world.rank == 0:
            log.info(
                "the lm_head's logits past the tokenizer's %d tokens of the embedding's %d rows "
                "are -inf (the rows past them are padding, which no text could be written for)",
                vocab,
                mcfg.vocab_size,
            )
        model = load_model(path, mcfg, max_len, dtype, device, tp, config.model_quantization, stage)
        model.set_token_vocab(vocab)
        # the load's temporaries (a module's unpacked codes at a time; a conversion's arrays
        # where this process converted the model first) go back to the system, not to a heap
        # that serving never fills again
        release_freed_memory(torch.device("cpu"))
        if config.cpu_activations == "int8" and use_int8_activations(model):
            log.info("packed projections quantise activations to int8 (cpu_activations: int8)")
        log.info(
            "rank %d loaded %s in %.2fs (%.2f GiB of weights)",
            stage.world.rank,
            path,
            time.perf_counter() - t0,
            weight_bytes(model) / 2**30,
        )
        local = replace(shard_config(mcfg, tp.size), num_layers=len(stage.layers))
        kv_dtype = kv_dtype_name(config.kv_cache_dtype, dtype)
        num_blocks = config.num_gpu_blocks
        if not num_blocks:
            num_blocks = profiled_num_blocks(model, local, config, kv_dtype, device, max_len)
        num_blocks = agree_min(stage.world, num_blocks)
        host_blocks = 0
        if config.enable_cpu_offload:
            host_blocks = int(num_blocks * config.cpu_cache_ratio / (1.0 - config.cpu_cache_ratio))
            check_host_pool(config, local, kv_dtype, device, num_blocks, host_blocks)
        kv = build_kv_cache(config, local, kv_dtype, device, num_blocks, host_blocks)
        log_kv_pools(kv, stage.world.rank)
        runner = cls(model, mcfg, kv, tp, stage)
        if cuda_graphs_wanted(config, device, stage.world.size):
            runner.enable_cuda_graphs(config.max_num_seqs, max_len)
        return runner

    def enable_cuda_graphs(self, max_num_seqs: int, max_len: int) -> None:
        """Replay all-decode steps as CUDA graphs from now on (captured on first use)."""
        forward = model_decode_forward(self.model, self.kv_cache, max_len)
        width = table_width(max_len, self.block_size)
        self.graphs = DecodeGraphs(forward, graph_buckets(max_num_seqs), width, self.device)

    @property
    def dtype(self) -> torch.dtype:
        """The model's compute dtype (what `kv_cache_dtype: auto` resolves to)."""
        return next(self.model.parameters()).dtype

    @property
    def vocab(self) -> int:
        """The token ids, [0, vocab) (`token_vocab`): the logits it returns are as wide as
        the config's `vocab_size`, their columns from `vocab` on at -inf."""
        return self.model.vocab

    # -- one step -------------------------------------------------------------------------
    def prepare(
        self, seqs: list[Sequence], num_tokens: list[int], every_row: bool = False
    ) -> StepInput:
        return build_step(
            [s.block_table for s in seqs],
            [s.num_computed_tokens for s in seqs],
            num_tokens,
            [logit_rows(s, n) for s, n in zip(seqs, num_tokens, strict=True)],
            step_token_ids(seqs, num_tokens),
            self.block_size,
            self.device,
            every_row,
            drafted(seqs),
            [decode_rows(s) for s in seqs],
        )

    def forward(self, inp: StepInput) -> torch.Tensor | None:
        """Run the model; logits of the sampled rows (rank 0; None elsewhere or when no row is
        sampled)."""
        if self._inject_oom:
            self._inject_oom -= 1
            raise InjectedOOMError("injected out-of-memory fault (inject_oom test hook)")
        hidden = self._replay(inp)
        if hidden is None:
            # the CPU GEMMs read the rows' kinds on this thread, for this forward only
            with step_rows(inp.kinds):
                hidden = self.model(
                    inp.input_ids, inp.positions, self.kv_cache.layers, inp.meta,
                    stop=self.step_stop, on_layer=self.on_layer,
                )  # fmt: skip
        if not inp.sample_rows.numel():
            self.logit_hidden = None
            return None
        self.logit_hidden = hidden[inp.sample_rows]
        return self.model.compute_logits(self.logit_hidden)

    def decode_ahead(self, seqs: list[Sequence], steps: int) -> RunTokens:
        """Launch `steps` decode steps of `seqs` back to back, each step's tokens fed to the
        next on the device; their tokens come back step by step (`RunTokens`). Each step is
        the one `execute` runs for a batch of single decode tokens (same inputs, same forward,
        the sampler's argmax or temperature draw), so the tokens are the ones `steps`
        separate steps give. What the steps need from the host (positions, KV slots,
        lengths) does not depend on the tokens and goes to the device in one copy before the
        first; on a GPU the host then only launches, the device runs the steps without
        waiting on it, and the host handles step j's tokens while the later steps run. The
        caller has given every sequence blocks for `steps` more tokens and drops what a
        sequence that finished early does not keep. Greedy sequences and ones sampled with
        only a temperature (no seed, top-k or top-p: `sampler.run_draws`); nothing here
        adjusts logits."""
        if steps < 1 or not seqs:
            raise ValueError(f"decode_ahead needs sequences and steps >= 1, got {steps}")
        bs, b = self.block_size, len(seqs)
        starts = [s.num_computed_tokens for s in seqs]
        if any(s.num_uncomputed != 1 for s in seqs):
            raise ValueError("decode_ahead runs sequences whose only uncomputed token is the last")
        pos = [[p + j for p in starts] for j in range(steps)]
        slots = [
            [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, row, strict=True)]
            for row in pos
        ]
        dev = self.device
        host = torch.tensor([pos, slots], dtype=torch.long).to(dev)  # [2, steps, b]
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor(
            [s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
            dtype=torch.int32,
        ).to(dev)
        lens_t = (host[0] + 1).to(torch.int32)  # tokens each row attends to, its own included
        ids = torch.tensor([s.token_slice(p, p + 1)[0] for s, p in zip(seqs, starts, strict=True)])
        ids, rows, run = ids.to(dev), torch.arange(b, device=dev), RunTokens()
        kinds = StepRows(b, b, b)  # decode rows alone, as a single step of them
        # A sampled row draws from the global generator only at the steps single steps would
        # have run it: not past its last token (max_tokens, its length limit), so the rows
        # after it draw what they would have drawn. (One that ends early on EOS or a stop
        # string is found only when its step is read, after the later steps were launched.)
        left = [
            min(s.max_tokens - len(s.output_token_ids), s.max_total_len - s.num_tokens)
            for s in seqs
        ]
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        drawn, rows_drawn = None, None
        for j in range(steps):
            now = [i for i in sampled if j < left[i]]
            if now != rows_drawn:
                rows_drawn, temps = now, [seqs[i].params.temperature for i in now]
                drawn = (
                    (torch.tensor(now, device=dev), torch.tensor(temps, device=dev))
                    if now
                    else None
                )
            meta = AttentionMetadata(host[1, j], tables, [p + 1 for p in pos[j]], [1] * b)
            logits = self.forward(StepInput(ids, host[0, j], meta, rows, lens_t[j], kinds))
            if logits is None:
                raise RuntimeError("decode_ahead: the forward sampled no row")
            ids = run_draws(logits, drawn)
            run.add(ids)  # -1 where a row was refused: the run fails when that step is read
            ids = ids.clamp_min(0)  # the next step's input must be a token id
        return run

    def _replay(self, inp: StepInput) -> torch.Tensor | None:
        """The step's hidden states by CUDA-graph replay; None when it must run eagerly (no
        graphs, a prefill row, too big a batch, an FP8 pool unless `KVGUARD_FP8_GRAPHS=1`, or
        the Triton path turned off)."""
        kv = self.kv_cache
        if self.graphs is None:
            return None
        if kv.dtype == "fp8_e4m3" and not env_flag(FP8_GRAPHS_ENV, False):
            return None
        if not use_triton(self.device, KV_TORCH_DTYPES[kv.dtype]):
            return None
        step = decode_inputs(inp)
        return None if step is None else self.graphs.run(step)

    def logits(
        self, seqs: list[Sequence], num_tokens: list[int], every_row: bool = False
    ) -> torch.Tensor | None:
        """Compute `num_tokens` of each sequence into the KV cache; the logits of the rows
        that are sampled (`every_row`: of every computed row, exact where the lm_head's are
        not (`exact_logits`), as scoring a text teacher-forced gives the log-probabilities a
        request gets back)."""
        logits = self.forward(self.prepare(seqs, num_tokens, every_row))
        if every_row and logits is not None:
            exact = self.exact_logits(list(range(len(logits))))
            return logits if exact is None else exact
        return logits

    def exact_logits(self, rows: list[int]) -> torch.Tensor | None:
        """Rows `rows` of the last forward's logits computed exactly
        (`QuantizedLMHead.exact_logits`: the packed model's int8 lm_head is exact only at each
        row's best, and a log-softmax over the rest is off by up to 0.036): what returned
        log-probabilities are taken from, never what is sampled from. None where the lm_head's
        logits are exact already, or where this process does not hold all of it (a tensor or
        pipeline parallel engine keeps its head's logits)."""
        head, hidden = self._exact_head(), self.logit_hidden
        if head is None or hidden is None:
            return None
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        with torch.inference_mode():
            return head.exact_logits(hidden[index])

    def _exact_head(self) -> QuantizedLMHead | None:
        """The lm_head where its logits are exact only at each row's best and this process
        holds all of it; None where `exact_logits` has nothing to do."""
        head = getattr(self.model, "lm_head", None)
        if not isinstance(head, QuantizedLMHead) or not head.approximate or head.tp.size > 1:
            return None
        return head

    def _exact_for_logprobs(self, seqs: list[Sequence], num_tokens: list[int]) -> ExactRows | None:
        """The step's logit rows whose log-probabilities go back to a request (its prompt's
        positions it lacks, the sampled rows of a sequence that asked for its tokens'),
        computed exactly; None where no row is, or the logits are exact already (checked
        first: a step of requests asking for none pays one pass over its sequences)."""
        if (
            not any(s.params.logprobs is not None or s.params.prompt_logprobs is not None
                    for s in seqs)
            or self._exact_head() is None
        ):  # fmt: skip
            return None
        rows, at = [], 0
        for seq, n in zip(seqs, num_tokens, strict=True):
            k = logit_rows(seq, n)
            rows.extend(at + j for j in prompt_rows_wanted(seq, k))
            if finishes_prompt(seq, n) and seq.params.logprobs is not None:
                rows.extend(range(at + k - 1 - len(seq.draft), at + k))
            at += k
        rows = list(dict.fromkeys(rows))
        exact = self.exact_logits(rows) if rows else None
        return None if exact is None else ExactRows(rows, exact)

    def execute(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """Compute `num_tokens` of each sequence; for every sequence whose tokens are now all
        computed, in batch order, its new tokens: the next one, or with drafts
        (`seq.draft`, computed after its last token) the drafts its rows chose in turn and the
        token after them (speculative.py). Sequences themselves are not changed: the
        scheduler advances them from what this returns (and, where asked, from the tokens'
        log-probabilities left in `self.logprobs`, one list a returned sequence)."""
        self.logprobs, self.prompt_logprobs = [], []
        logits = self.logits(seqs, num_tokens)
        if logits is None:
            return []
        # what is sampled is `logits`, asked for log-probabilities or not: the exact rows
        # only give the log-probabilities returned
        exact = self._exact_for_logprobs(seqs, num_tokens)
        origin: list[int] | None = None  # each sampled row's row in the logits, where it differs
        if any(wants_prompt_logprobs(s) for s in seqs):
            logits, origin = self._take_prompt_logprobs(seqs, num_tokens, logits, exact)
        done = [s for s, n in zip(seqs, num_tokens, strict=True) if finishes_prompt(s, n)]
        params, gens, outputs, allowed = [], [], [], []
        for s in done:  # a row for the last token, and one after each draft
            counts = output_counts(s)
            for j in range(len(s.draft) + 1):
                params.append(s.params)
                gens.append(s.generator)
                outputs.append(counts.ahead(s.draft[:j]) if j and counts is not None else counts)
                allowed.append(None if s.grammar is None else s.grammar.allowed())
        # a seeded sequence's generator before its rows drew: rows past the first rejected
        # draft give their draws back, so its stream is one draw a token, drafts or not
        seeded = {id(s): s.generator.get_state() for s in done if s.draft and s.generator}
        logits = self._refine_adjusted(logits, params, outputs, allowed, origin)
        chosen = sample(logits, params, gens, outputs, allowed)
        lps = None
        if any(p.logprobs is not None for p in params):
            asked = [i if origin is None else origin[i]
                     for i, p in enumerate(params) if p.logprobs is not None]  # fmt: skip
            exact_asked = None if exact is None else exact.take(asked)
            lps = token_logprobs(logits, params, chosen, exact_asked)
        tokens, at = [], 0
        for s in done:
            rows = len(s.draft) + 1
            emitted = accepted_prefix(s.draft, chosen[at : at + rows])
            if len(emitted) < rows and id(s) in seeded:
                rewind(s.generator, seeded[id(s)], len(emitted))
            tokens.append(emitted)
            if lps is not None:
                self.logprobs.append(lps[at : at + len(emitted)])
            at += rows
        return tokens

    def _refine_adjusted(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        outputs: list[Any],
        allowed: list[torch.Tensor | None],
        origin: list[int] | None,
    ) -> torch.Tensor:
        """The sampled rows whose logits the sampler moves (a logit bias, penalties, a
        grammar's mask) with their new best candidates exact too. The lm_head makes exact only
        each row's best by its own ranking (`QuantizedLMHead.REFINED`); a bias that lifts
        tokens ranked below them, or a ban of the best, left the pick to the int8 kernel's
        logits, which blur near ties: a greedy answer could take a token the model ranks
        lower. The rows' candidates after the sampler's changes (`adjust_logits`, whose
        changes the sampler then makes again, to these exact logits) are recomputed from the
        hidden states. Rows that ask nothing of the kind, and heads exact already, cost
        nothing. The logits are refined in place (the sampled rows' own: more of them exact).
        """
        rows = [i for i, p in enumerate(params) if p.adjusts_logits or allowed[i] is not None]
        if not rows:
            return logits
        head, hidden = self._exact_head(), self.logit_hidden
        if head is None or hidden is None:
            return logits
        every = len(rows) == logits.shape[0]  # a batch of biased rows: no copies of its rows
        index = None if every else torch.tensor(rows, dtype=torch.long, device=logits.device)
        sub = logits if index is None else logits.index_select(0, index)
        moved = adjust_logits(
            sub,
            [params[i] for i in rows],
            [outputs[i] for i in rows],
            [allowed[i] for i in rows],
        )  # a copy: the sampler adjusts the refined logits again
        at = rows if origin is None else [origin[i] for i in rows]
        if at != list(range(hidden.shape[0])):
            hidden = hidden.index_select(
                0, torch.tensor(at, dtype=torch.long, device=hidden.device)
            )
        with torch.inference_mode():
            head.refine_at(hidden, sub, head.best(moved))  # in place
            if index is not None:
                logits.index_copy_(0, index, sub)
        return logits

    def _take_prompt_logprobs(
        self,
        seqs: list[Sequence],
        num_tokens: list[int],
        logits: torch.Tensor,
        exact: ExactRows | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Collect the prompt log-probabilities the step's extra logit rows hold into
        `self.prompt_logprobs` ((sequence, entries) for the positions it still lacked, in
        order; from `exact`'s rows where given); the rows that are sampled, one a finishing
        sequence, in batch order, with their rows in `logits`."""
        sample_rows, at = [], 0
        for seq, n in zip(seqs, num_tokens, strict=True):
            k = logit_rows(seq, n)
            want = prompt_rows_wanted(seq, k)  # all its k = n rows have logits where asked
            if want:
                start, prompt = seq.num_computed_tokens, seq.prompt_token_ids
                targets = [prompt[start + j + 1] for j in want]
                picked = [at + j for j in want]
                rows = (
                    exact.take(picked)
                    if exact is not None
                    else logits[torch.tensor(picked, device=logits.device)]
                )
                self.prompt_logprobs.append(
                    (seq, log_softmax_entries(rows, targets, seq.params.prompt_logprobs))
                )
            if finishes_prompt(seq, n):  # with drafts, every row
                sample_rows.extend(range(at + k - 1 - len(seq.draft), at + k))
            at += k
        index = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
        return logits[index], sample_rows

    def inject_oom(self, times: int = 1) -> None:
        """Test hook: the next `times` forward passes fail as if the device ran out of memory."""
        self._inject_oom += times

    # -- KV memory ------------------------------------------------------------------------
    def swap_out(self, device_ids: list[int], host_ids: list[int]) -> None:
        self.kv_cache.swap_out(device_ids, host_ids)

    def swap_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        self.kv_cache.swap_in(host_ids, device_ids)

    def convert_kv(self, dtype: str, tiers: dict[str, tuple[int, dict[int, int]]]) -> int:
        """Rebuild each tier (`device`, `host`) as (new block count, moves) in `dtype`; the
        peak of bytes held beyond the larger pool, over the tiers."""
        kv = self.kv_cache
        pools = {"device": kv.device_pool, "host": kv.host_pool}
        if self.graphs is not None:
            self.graphs.invalidate()  # they write the old pool's addresses
        extra, done = 0, []
        try:
            for tier, (n, moves) in tiers.items():
                pool = pools[tier]
                before = (pool.dtype, pool.num_blocks)
                extra = max(extra, kv.convert(pool, dtype, n, moves))
                done.append((tier, pool, before, moves))
        except PoolTorn:
            raise
        except BaseException as e:  # the failed tier is whole again: put the others back too
            for tier, pool, (was, n), moves in reversed(done):
                try:
                    kv.convert(pool, was, n, {new: old for old, new in moves.items()})
                except BaseException as again:
                    raise PoolTorn(
                        f"the {tier} KV pool could not be put back to {was} ({again}) after "
                        f"another tier's conversion failed ({e})"
                    ) from again
            raise
        if self.device.type == "cuda":  # the copies are queued: done (or failed) before the
            torch.cuda.synchronize(self.device)  # engine resumes and the pause is clocked
        release_freed_memory(self.device)  # every rank runs this: each gives its own back
        return extra

    def can_convert(self, dtype: str, new_n: int) -> bool:
        """Whether every rank has room for the switch's transient extra (one layer of the new
        pool beside the old one); all ranks of all stages agree, so a switch happens
        everywhere or nowhere."""
        ok = True
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            layer = bytes_per_block(self.kv_cache.cfg, self.block_size, dtype) * new_n
            ok = free > 2 * layer // max(1, self.kv_cache.cfg.num_layers)
        return not agree_any(self.stage.world, not ok)

    def can_grow(self, extra_bytes: int) -> bool:
        """Whether every rank has room for `extra_bytes` more KV and stays clear of pressure:
        on CUDA the free device memory less a margin of the whole; on CPU the host's (or its
        memory cgroup's) room below HOST_GROW_BELOW of its limit, the line under which the
        default ladder's host-mem rule gives memory back, so that taking it again cannot
        press the host into giving it back once more."""
        ok = True
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            ok = extra_bytes <= free - int(total * CUDA_GROW_MARGIN)
        else:
            room = room_bytes(HOST_GROW_BELOW)
            ok = room is None or extra_bytes <= room
        return not agree_any(self.stage.world, not ok)

    def blocks_for_budget(self, dtype: str, host: bool = False) -> int:
        return self.kv_cache.blocks_for_budget(dtype, host)

    def shutdown(self) -> None:
        """Nothing to stop in one process; a distributed runner stops its workers."""

    def worker_pids(self) -> list[int]:
        return []

    def check_alive(self) -> None:
        """Nothing to check with one rank; a distributed runner checks its workers."""

    def kv_bytes_per_rank(self) -> list[int]:
        return [self.kv_cache.device_pool.nbytes]


def check_host_pool(
    config: EngineConfig,
    cfg: ModelConfig,
    kv_dtype: str,
    device: torch.device,
    num_blocks: int,
    host_blocks: int,
) -> None:
    """ConfigError when the swap pool (host memory on any device), with the KV pool itself on
    a CPU, is more than the host holds below HOST_START_BELOW."""
    per_block = bytes_per_block(cfg, config.block_size, kv_dtype)
    swap = host_blocks * per_block
    need = swap + (num_blocks * per_block if device.type == "cpu" else 0)
    room = room_bytes(HOST_START_BELOW)
    if room is not None and need > room:
        beside = " beside the KV pool's" if device.type == "cpu" else ""
        raise ConfigError(
            f"the swap pool (cpu_cache_ratio={config.cpu_cache_ratio}: {swap / 2**20:.0f} MiB"
            f"{beside}) is more than this host can hold: {room / 2**20:.0f} MiB are free below "
            f"{HOST_START_BELOW:.0%} of its memory (or of the service's MemoryMax=); lower "
            "cpu_cache_ratio"
        )


def build_kv_cache(
    config: EngineConfig,
    cfg: ModelConfig,
    kv_dtype: str,
    device: torch.device,
    num_blocks: int,
    host_blocks: int,
) -> KVCache:
    """The KV pools, or ConfigError when the process cannot allocate them.

    The checks before compare with the memory that is free; a limit on the address space
    (`LimitAS=`, `prlimit --as`) or strict overcommit (`vm.overcommit_memory=2`) can still
    refuse the allocation itself. The next start would fail the same way, so it is a refusal
    (exit 2, which systemd does not restart), not a traceback restarted for ever."""
    try:
        return KVCache(cfg, num_blocks, config.block_size, kv_dtype, device, host_blocks)
    except Exception as e:
        if not is_oom(e):
            raise
        why = pool_not_allocated(config, cfg, kv_dtype, device, num_blocks, host_blocks)
        raise ConfigError(why) from e


def pool_not_allocated(
    config: EngineConfig,
    cfg: ModelConfig,
    kv_dtype: str,
    device: torch.device,
    num_blocks: int,
    host_blocks: int,
) -> str:
    """The refusal for pools the allocator would not give: what was asked and what to lower."""
    per_block = bytes_per_block(cfg, config.block_size, kv_dtype)
    pool = num_blocks * per_block
    if device.type == "cpu":
        budget = int(config.kv_cache_bytes)
        what, lower = f"kv_cache_bytes={budget} ({budget / 2**20:.0f} MiB)", "kv_cache_bytes"
    else:
        what, lower = f"the KV pool on {device} ({pool / 2**20:.0f} MiB)", "gpu_memory_utilization"
    pools = f"the KV pool's {num_blocks} blocks"
    if host_blocks:
        pools += f" and the swap pool's {host_blocks}"
        lower += " or cpu_cache_ratio"
    asked = (num_blocks + host_blocks) * per_block
    return (
        f"{what} could not be allocated: the allocator refused {pools} ({asked} bytes in all; "
        "an address-space limit such as LimitAS= or prlimit --as, or strict overcommit); "
        f"lower {lower}, or raise that limit"
    )


def log_kv_pools(kv: KVCache, rank: int) -> None:
    """One line for sizing the memory the daemon needs: the pools are most of it on a CPU host,
    and the swap pool's share of host memory is otherwise found only by arithmetic."""
    per_block = kv.bytes_per_block
    swap = kv.host_pool.num_blocks
    log.info(
        "rank %d KV pool: %d blocks of %d bytes (%.1f MiB, %d tokens), %s; swap pool: %d blocks "
        "(%.1f MiB of host memory)",
        rank,
        kv.num_blocks,
        per_block,
        kv.num_blocks * per_block / 2**20,
        kv.num_blocks * kv.block_size,
        kv.dtype,
        swap,
        swap * per_block / 2**20,
    )


def num_kv_blocks(
    config: EngineConfig,
    cfg: ModelConfig,
    kv_dtype: str,
    device: torch.device,
    activation_bytes: int = 0,
) -> int:
    """Blocks the KV budget holds: `kv_cache_bytes` on CPU; on CUDA what is left of the
    `gpu_memory_utilization` share of the whole GPU after what is in use now (weights, the CUDA
    context) and the activation peak of one maximal step (`activation_peak`)."""
    per_block = bytes_per_block(cfg, config.block_size, kv_dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = cuda_kv_budget(total, free, activation_bytes, config.gpu_memory_utilization)
        advice = "raise gpu_memory_utilization or lower max_num_batched_tokens"
    else:
        budget = int(config.kv_cache_bytes)
        advice = "raise kv_cache_bytes"
        room = room_bytes(HOST_START_BELOW)
        if room is not None and budget > room:
            raise ConfigError(
                f"kv_cache_bytes={budget} ({budget / 2**20:.0f} MiB) is more than this host can hold: "
                f"{room / 2**20:.0f} MiB are free below {HOST_START_BELOW:.0%} of its memory "
                "(or of the service's MemoryMax=); lower kv_cache_bytes"
            )
    n = budget // per_block
    if n < 1:
        raise ConfigError(
            f"KV budget of {budget} bytes holds no block of {per_block} bytes: {advice}"
        )
    return n


def cuda_kv_budget(total: int, free: int, activation_bytes: int, utilization: float) -> int:
    """KV bytes on a GPU: `utilization` of all its memory, less everything already in use
    (`total - free`: weights, CUDA context, and anyone else's) and the activation peak. A share
    of the whole GPU, not of what is free, so the knob means what it says with any model."""
    return int(total * utilization) - (total - free) - activation_bytes


def profile_step(
    model: LlamaForCausalLM,
    cfg: ModelConfig,
    config: EngineConfig,
    kv_dtype: str,
    device: torch.device,
    max_len: int,
) -> int:
    """One maximal step on a throwaway pool: `max_num_batched_tokens` prompt tokens in as few
    sequences as `max_len` allows (one long prompt's attention is the largest temporary, and
    every projection's activations grow with the step's tokens, however many sequences hold
    them) and logits for `max_num_seqs` rows. Returns the throwaway pool's bytes."""
    tokens = max(1, config.max_num_batched_tokens)
    lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    tables, first = [], 0
    for n in lens:
        blocks = -(-n // config.block_size)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    scratch = KVCache(cfg, first, config.block_size, kv_dtype, device)
    step = build_step(
        tables, [0] * len(lens), lens, [True] * len(lens), [0] * tokens, config.block_size, device
    )
    # A later pipeline stage's input is the previous stage's hidden states: zeros do here (the
    # peak depends on shapes, and each stage profiles alone, with no transfer between stages).
    zeros = torch.zeros(
        tokens, cfg.hidden_size, dtype=next(model.parameters()).dtype, device=device
    )
    hidden = model(step.input_ids, step.positions, scratch.layers, step.meta, zeros)
    if model.stage.is_last:
        model.compute_logits(hidden[: min(tokens, config.max_num_seqs)])
    return scratch.device_pool.nbytes


def activation_peak(
    model: LlamaForCausalLM,
    cfg: ModelConfig,
    config: EngineConfig,
    kv_dtype: str,
    device: torch.device,
    max_len: int,
) -> int:
    """Bytes `profile_step` allocates at its peak beyond what was resident before it, its
    throwaway pool left out. CUDA only: 0 elsewhere, where the budget is a fixed byte count.
    Every tensor-parallel rank runs it (its forward has collectives)."""
    if device.type != "cuda":
        return 0
    # Reserved, not allocated, bytes: the caching allocator keeps what a step's tensors left
    # in pieces too small to reuse, and that is memory the pool cannot have. The cache is
    # emptied first so the base holds no free blocks the step could reuse unseen.
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_reserved(device)
    pool = profile_step(model, cfg, config, kv_dtype, device, max_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - base - pool
    torch.cuda.empty_cache()
    log.info("one maximal step peaks at %.1f MiB of activations", peak / 2**20)
    return peak


def torch_decode_reserve(
    cfg: ModelConfig,
    config: EngineConfig,
    kv_dtype: str,
    device: torch.device,
    max_len: int,
    dtype: torch.dtype,
) -> int:
    """What the torch decode path's workspace can grow to (`decode_workspace_bytes`) on a
    CUDA device where it serves instead of the Triton kernel (`KVGUARD_TRITON=0`, or an fp8
    cache on a GPU older than compute capability 8.9): `max_num_seqs` sequences of `max_len`
    tokens, for the KV dtype now and for fp8, which a live switch may bring. 0 elsewhere."""
    if device.type != "cuda":
        return 0
    need = 0
    for name in {kv_dtype, "fp8_e4m3"}:
        cache = KV_TORCH_DTYPES[name]
        if not use_triton(device, cache):
            need = max(
                need,
                decode_workspace_bytes(
                    config.max_num_seqs,
                    max_len,
                    config.block_size,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    cfg.head_dim,
                    cache,
                    dtype,
                ),
            )
    return need


def profiled_num_blocks(
    model: LlamaForCausalLM,
    cfg: ModelConfig,
    config: EngineConfig,
    kv_dtype: str,
    device: torch.device,
    max_len: int,
) -> int:
    """`num_kv_blocks` with the activations of one maximal step measured (`activation_peak`)
    and the torch decode workspace added where that path serves (`torch_decode_reserve`)."""
    dtype = next(model.parameters()).dtype
    reserve = activation_peak(model, cfg, config, kv_dtype, device, max_len)
    reserve += torch_decode_reserve(cfg, config, kv_dtype, device, max_len, dtype)
    return num_kv_blocks(config, cfg, kv_dtype, device, reserve)
