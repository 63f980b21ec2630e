"""How a Llama-family model splits over tensor-parallel ranks, and which sizes it can split by.

Rank r of tp holds query heads `[r·H/tp, (r+1)·H/tp)`, the matching slice of the MLP width, and a
contiguous range of the (padded) vocabulary. KV heads are split when tp divides their count;
when there are fewer KV heads than ranks each rank holds the one KV head its query heads read
under GQA grouping, so consecutive ranks hold copies of the same KV head. Everything else
(norms, rotary tables) is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvguard.engine.distributed.parallel_state import TPGroup
from kvguard.engine.knobs import ConfigError
from kvguard.engine.model_config import ModelConfig


def divides(cfg: ModelConfig, tp_size: int) -> bool:
    """Whole query heads and MLP columns per rank, and KV heads either split or replicated."""
    kv = cfg.num_kv_heads
    return (
        tp_size >= 1
        and cfg.num_heads % tp_size == 0
        and cfg.intermediate_size % tp_size == 0
        and (kv % tp_size == 0 or tp_size % kv == 0)
    )


def valid_tp_sizes(cfg: ModelConfig) -> list[int]:
    """Every tensor-parallel size the model allows (never more ranks than query heads)."""
    return [n for n in range(1, cfg.num_heads + 1) if divides(cfg, n)]


def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """Refuse a tensor-parallel size that does not divide the model, before anything is spawned,
    with the sizes that would work."""
    if divides(cfg, tp_size):
        return
    ok = [str(n) for n in valid_tp_sizes(cfg)]
    choices = ok[0] if len(ok) == 1 else f"{', '.join(ok[:-1])} or {ok[-1]}"
    raise ConfigError(
        f"tensor_parallel={tp_size} does not divide the model: {cfg.num_heads} query heads, "
        f"{cfg.num_kv_heads} KV heads, MLP width {cfg.intermediate_size}; "
        f"tensor_parallel may be {choices}"
    )


def local_kv_heads(cfg: ModelConfig, tp_size: int) -> int:
    """KV heads one rank holds: its share, or one replicated head when there are fewer than tp."""
    return max(1, cfg.num_kv_heads // tp_size)


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The config as one rank sees its attention: rank-local query and KV head counts.

    Everything else keeps the whole model's value (hidden size, MLP width, vocabulary), so the
    result sizes one rank's KV pools (`KVCache`, `kv_bytes_per_token`) and nothing more.
    """
    check_tensor_parallel(cfg, tp_size)
    return replace(
        cfg, num_heads=cfg.num_heads // tp_size, num_kv_heads=local_kv_heads(cfg, tp_size)
    )


def padded_vocab(cfg: ModelConfig, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of tp; the padding rows are zero and trimmed."""
    return -(-cfg.vocab_size // tp_size) * tp_size


@dataclass(frozen=True, slots=True)
class Shard:
    """What one rank holds, as index ranges into the whole model's dimensions."""

    q_heads: range
    kv_heads: range
    mlp: range  # columns of the MLP width (rows of gate/up, columns of down)
    vocab: range  # rows of the padded vocabulary; may run past vocab_size


def shard_of(cfg: ModelConfig, tp: TPGroup) -> Shard:
    check_tensor_parallel(cfg, tp.size)
    r, n = tp.rank, tp.size
    q = cfg.num_heads // n
    kv = local_kv_heads(cfg, n)
    # Replicated case: ranks r with the same r·kv_heads//tp share one KV head, and their query
    # heads are exactly the GQA group of that head.
    kv_first = r * kv if cfg.num_kv_heads >= n else r * cfg.num_kv_heads // n
    width = cfg.intermediate_size // n
    rows = padded_vocab(cfg, n) // n
    return Shard(
        q_heads=range(r * q, (r + 1) * q),
        kv_heads=range(kv_first, kv_first + kv),
        mlp=range(r * width, (r + 1) * width),
        vocab=range(r * rows, (r + 1) * rows),
    )


def stage_layers(num_layers: int, stages: int, override: list[int] | None = None) -> list[range]:
    """The decoder layers of each pipeline stage, as contiguous global index ranges.

    An even split by default, the earlier stages taking one more layer each while a remainder
    lasts (the last stage also holds the lm_head); `override` gives each stage's count. Refused,
    before anything is spawned, when a stage would hold no layer or the counts miss the model."""
    if stages > num_layers:
        raise ConfigError(
            f"pipeline_parallel={stages} exceeds the model's {num_layers} decoder layers: "
            f"every stage needs at least one (pipeline_parallel may be 1..{num_layers})"
        )
    if override is None:
        base, extra = divmod(num_layers, stages)
        counts = [base + (1 if s < extra else 0) for s in range(stages)]
    else:
        counts = list(override)
        if len(counts) != stages:
            raise ConfigError(
                f"pipeline_layers={counts}: {len(counts)} stages given but pipeline_parallel="
                f"{stages} (expected one layer count per stage)"
            )
        if any(n < 1 for n in counts) or sum(counts) != num_layers:
            raise ConfigError(
                f"pipeline_layers={counts} sums to {sum(counts)}, but the model has {num_layers} "
                f"decoder layers (expected {stages} counts of at least 1 summing to {num_layers})"
            )
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out
