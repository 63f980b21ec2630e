"""How much a KV dtype changes the model's choices: teacher-forced next-token agreement.

Each token sequence is scored twice through the paged cache, once per dtype, with the same
tokens forced in; the share of continuation positions where both pick the same top-1 token
is the agreement. The engine must be idle (it switches its own cache dtype to measure).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvguard.engine.llm_engine import LLMEngine


def _top1(engine: LLMEngine, seqs: list[tuple[list[int], int]]) -> list[list[int]]:
    out = []
    for ids, start in seqs:
        logits = engine.score(ids)
        out.append(logits[start - 1 : len(ids) - 1].argmax(-1).tolist())
    return out


def _switch(engine: LLMEngine, dtype: str) -> None:
    fut = engine.set_kv_cache_dtype(dtype)
    engine.step()
    res = fut.result(0)
    if not res.ok:
        raise RuntimeError(res.detail)


def teacher_forced_agreement(
    engine: LLMEngine, seqs: list[tuple[list[int], int]], reference: str, candidate: str
) -> tuple[float, int]:
    """Agreement of `candidate` with `reference` dtype over continuation positions.

    `seqs` holds (token ids, index of the first continuation token). Returns (ratio, positions).
    The engine's cache is left in the dtype it had on entry.
    """
    original = engine.kv_cache.dtype
    _switch(engine, reference)
    ref = _top1(engine, seqs)
    _switch(engine, candidate)
    cand = _top1(engine, seqs)
    _switch(engine, original)
    same = sum(a == b for r, c in zip(ref, cand, strict=True) for a, b in zip(r, c, strict=True))
    total = sum(len(r) for r in ref)
    return same / total, total
