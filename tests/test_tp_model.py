"""Tensor-parallel model sharding: tp ranks in real processes over gloo give tp=1's logits.

Each case spawns `tp` processes that form a gloo group on loopback (a port picked at run time),
load only their slices of the weights, fill their own KV pools (sized from the rank-local
config) and run the same prefill and greedy decode as a single-process model. Rank 0 writes
every step's logits to a file; the parent compares them with the tp=1 run. Workers never
outlive a test: they are joined against a deadline, a dead one fails the test at once with its
traceback, and any still alive are killed.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvguard.engine.config import ConfigError
from kvguard.engine.distributed.parallel_state import TPGroup
from kvguard.engine.distributed.sharding import (
    check_tensor_parallel,
    shard_config,
    shard_of,
    valid_tp_sizes,
)
from kvguard.engine.kv_cache import KVCache
from kvguard.engine.model import (
    AttentionMetadata,
    LlamaForCausalLM,
    build_model,
    load_model,
    weight_bytes,
)
from kvguard.engine.model_config import ModelConfig
from kvguard.engine.weights import load_weights

BLOCK_SIZE = 16
DECODE_STEPS = 4
MAX_POSITIONS = 128
PROMPT_LENS = (5, 17, 33)  # inside one block, across one boundary, across two
DEADLINE_S = 300.0  # for all ranks of one case, spawn and load included
CPU = torch.device("cpu")


def prompts(vocab: range) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(vocab.start, vocab.stop, (n,), generator=gen).tolist() for n in PROMPT_LENS
    ]


def prompt_vocab(cfg: ModelConfig) -> range:
    """Token ids with real embedding rows (the tiny model's rows past 259 are zero)."""
    return range(3, 259) if cfg.vocab_size <= 320 else range(3, cfg.vocab_size)


# -- one run of the model, the same code on every rank -----------------------------------------
def greedy_run(
    model: LlamaForCausalLM, cfg: ModelConfig, tp: TPGroup, steps: int
) -> tuple[torch.Tensor | None, list[list[int]]]:
    """Prefill all prompts in one mixed batch, then `steps` greedy decode steps.

    Returns every step's logits `[steps + 1, n_prompts, vocab]` and the tokens chosen (only
    meaningful on rank 0, which also broadcasts each step's tokens so the ranks stay in step)."""
    seqs = prompts(prompt_vocab(cfg))
    per_seq = -(-(max(PROMPT_LENS) + steps) // BLOCK_SIZE)
    kv = KVCache(shard_config(cfg, tp.size), len(seqs) * per_seq, BLOCK_SIZE, "fp32", CPU)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(seqs))]
    computed = [0] * len(seqs)
    logits, chosen = [], []
    for _ in range(steps + 1):
        ids, pos, slots, rows = [], [], [], []
        for seq, table, start in zip(seqs, tables, computed, strict=True):
            new = range(start, len(seq))
            ids += seq[start:]
            pos += new
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new]
            rows.append(len(ids) - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=[len(s) for s in seqs],
            query_lens=[len(s) - c for s, c in zip(seqs, computed, strict=True)],
        )
        hidden = model(torch.tensor(ids), torch.tensor(pos), kv.layers, meta)
        step_logits = model.compute_logits(hidden[torch.tensor(rows)])
        tokens = agree_on_tokens(step_logits, tp, len(seqs))
        logits.append(step_logits)
        chosen.append(tokens)
        computed = [len(s) for s in seqs]
        for seq, token in zip(seqs, tokens, strict=True):
            seq.append(token)
    return (torch.stack(logits) if tp.is_first else None), chosen


def agree_on_tokens(logits: torch.Tensor | None, tp: TPGroup, n: int) -> list[int]:
    """Rank 0 picks the greedy tokens; the other ranks learn them from it."""
    tokens = logits.argmax(-1) if tp.is_first else torch.zeros(n, dtype=torch.long)
    if tp.size > 1:
        import torch.distributed as dist

        dist.broadcast(tokens, src=0, group=tp.group)
    return tokens.tolist()


# -- the worker processes ----------------------------------------------------------------------
def _worker(rank: int, size: int, port: int, model_dir: str, out_dir: str) -> None:
    """One rank: join the group, load this rank's slices, run, and (rank 0) save the result."""
    import torch.distributed as dist

    out = Path(out_dir)
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=60),
        )
        tp = TPGroup(rank, size)
        cfg = ModelConfig.from_dir(Path(model_dir))
        model = load_model(Path(model_dir), cfg, MAX_POSITIONS, torch.float32, CPU, tp)
        logits, tokens = greedy_run(model, cfg, tp, DECODE_STEPS)
        if tp.is_first:
            torch.save({"logits": logits, "tokens": tokens}, out / "result.pt")
        dist.destroy_process_group()
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(model_dir: Path, size: int, out_dir: Path) -> dict:
    """Spawn `size` ranks and return rank 0's result; fail (never hang) if any rank dies."""
    ctx = torch.multiprocessing.get_context("spawn")
    args = (size, free_port(), str(model_dir), str(out_dir))
    procs = [ctx.Process(target=_worker, args=(r, *args), daemon=True) for r in range(size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + DEADLINE_S
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
        failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if failed:
            errors = "\n".join(f.read_text() for f in sorted(out_dir.glob("error-*.txt")))
            pytest.fail(f"ranks failed or timed out (exit codes {failed}):\n{errors}")
        return torch.load(out_dir / "result.pt")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def single_process_run(model_dir: Path) -> tuple[torch.Tensor | None, list[list[int]]]:
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, MAX_POSITIONS, torch.float32, CPU)
    return greedy_run(model, cfg, TPGroup.single(), DECODE_STEPS)


def odd_vocab_tiny(tiny_dir: Path, dst: Path, vocab: int) -> Path:
    """The tiny model cut to a vocabulary that tp does not divide (the cut rows are zero)."""
    shutil.copytree(tiny_dir, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    weights = load_file(dst / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:vocab].clone()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# -- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "tp"),
    [
        ("tiny", 2),
        ("tiny", 4),  # 2 KV heads over 4 ranks: each KV head replicated on two ranks
        ("tiny-vocab-318", 4),  # 318 rows padded to 320: the last rank holds 2 zero rows
        pytest.param("smollm2", 3, marks=pytest.mark.slow),  # 9 heads, 3 KV heads
    ],
)
def test_tensor_parallel_matches_single_process(
    request: pytest.FixtureRequest, tmp_path: Path, model: str, tp: int
) -> None:
    if model == "tiny-vocab-318":
        model_dir = odd_vocab_tiny(request.getfixturevalue("tiny_dir"), tmp_path / "model", 318)
    else:
        model_dir = request.getfixturevalue(f"{model}_dir")
    out = tmp_path / "out"
    out.mkdir()
    ref_logits, ref_tokens = single_process_run(model_dir)
    got = run_ranks(model_dir, tp, out)
    assert got["logits"].shape == ref_logits.shape
    assert got["logits"].dtype == torch.float32
    diff = float((got["logits"] - ref_logits).abs().max())
    assert diff <= 1e-4, f"max |logit difference| {diff:.3g} at tp={tp}"
    assert got["tokens"] == ref_tokens


def test_kv_heads_replicate_in_gqa_order(tiny_dir: Path) -> None:
    """With fewer KV heads than ranks, a rank's query heads all read the KV head it holds."""
    cfg = ModelConfig.from_dir(tiny_dir)  # 4 query heads over 2 KV heads
    group = cfg.num_heads // cfg.num_kv_heads
    for tp in (1, 2, 4):
        for rank in range(tp):
            shard = shard_of(cfg, TPGroup(rank, tp))
            assert {h // group for h in shard.q_heads} == set(shard.kv_heads)
    assert [shard_of(cfg, TPGroup(r, 4)).kv_heads for r in range(4)] == [range(0, 1)] * 2 + [
        range(1, 2)
    ] * 2
    assert shard_config(cfg, 4).num_kv_heads == shard_config(cfg, 2).num_kv_heads == 1
    assert (shard_config(cfg, 4).num_heads, shard_config(cfg, 1)) == (1, cfg)


@pytest.mark.slow
def test_tp_that_does_not_divide_is_refused_with_the_sizes_that_work(smollm2_dir: Path) -> None:
    cfg = ModelConfig.from_dir(smollm2_dir)
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(cfg, 2)
    message = str(err.value)
    for text in ("tensor_parallel=2", "9 query heads", "3 KV heads", "1536", "may be 1 or 3"):
        assert text in message
    assert valid_tp_sizes(cfg) == [1, 3]  # 9 would split the heads, not the MLP width 1536
    check_tensor_parallel(cfg, 3)


@pytest.mark.slow
def test_each_rank_holds_about_a_third_of_the_weights_at_tp3(smollm2_dir: Path) -> None:
    """Loading needs no communication, so each rank's model is built here without a group.

    Replicated on every rank: the RMSNorm weights (two per layer and the final one, about 35k
    parameters) and the rotary cos/sin tables (buffers, not counted). Everything else — the
    tied embedding/lm_head (vocab-parallel, one shared tensor), qkv, o, gate_up, down — is split
    three ways, so a rank holds just over 1/3."""
    cfg = ModelConfig.from_dir(smollm2_dir)
    whole = weight_bytes(load_model(smollm2_dir, cfg, MAX_POSITIONS, torch.float32, CPU))
    for rank in range(3):
        shard = load_model(smollm2_dir, cfg, MAX_POSITIONS, torch.float32, CPU, TPGroup(rank, 3))
        assert weight_bytes(shard) <= 0.45 * whole, (rank, weight_bytes(shard), whole)


def test_load_model_at_tp1_equals_build_model(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    weights = load_weights(tiny_dir, torch.float32, CPU)
    built = build_model(cfg, weights, MAX_POSITIONS, torch.float32, CPU)
    loaded = load_model(tiny_dir, cfg, MAX_POSITIONS, torch.float32, CPU)
    one = TPGroup.single()
    a, a_tokens = greedy_run(built, cfg, one, DECODE_STEPS)
    b, b_tokens = greedy_run(loaded, cfg, one, DECODE_STEPS)
    assert torch.equal(a, b)
    assert a_tokens == b_tokens
    assert loaded.lm_head.weight is loaded.embed_tokens.weight  # tied: one tensor
