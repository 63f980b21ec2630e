"""Cached blocks no lookup can reach are not counted as cached: a block made unfindable (its
content overwritten, replaced by an exact copy, retired, left outside a shrunk pool) takes the
blocks cached after it along, since their keys chain from content no lookup forms any more.
Before, they stayed in `num_cached` and the `kvguard_prefix_cache_blocks` gauge (20 blocks
counted where 11 could be found), overstating the reusable cache."""

from __future__ import annotations

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.block_manager import SHORT_ROOT, BlockManager
from tests.test_prefix_cache import _compute, _seq


def _reachable(bm: BlockManager) -> int:
    """The cache entries a lookup can reach: walked from the roots by key, as `_lookup` walks
    (content ids grow along a chain, so a parent comes before its children)."""
    reached, count = {0, SHORT_ROOT}, 0
    for (parent, _), b in sorted(bm._cache.items(), key=lambda e: bm._content_of[e[1]]):
        if parent in reached:
            reached.add(bm._content_of[b])
            count += 1
    return count


def test_blocks_after_one_an_exact_copy_replaced_are_not_counted() -> None:
    """A chat turn caches 11 blocks on top of blocks the first answer's decode rows wrote; the
    same text computed as a prompt (prompt log-probabilities, or a recompute) replaces the
    decode-written block with an exact copy and caches a new chain after it. The 9 blocks
    chained after the replaced one can never be found again: 11 blocks are cached, not 20."""
    engine = LLMEngine.from_config(
        EngineConfig(model="tiny", kv_cache_bytes="8MiB", num_threads=2, max_model_len=512),
        progress=False,
    )
    bm = engine.block_manager
    prompt = [5 + (i * 37) % 250 for i in range(20)]  # tokens: no padding row's logprobs
    answer = engine.generate([prompt], [SamplingParams(max_tokens=60, ignore_eos=True)])[0]
    turn = [*prompt, *answer.token_ids, *(7 + (i * 11) % 250 for i in range(100))]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert engine.generate([turn], [params])[0].num_cached_tokens == 64
    assert bm.num_cached == _reachable(bm) == 11
    asked = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    engine.generate([turn], [asked])
    assert bm.num_cached == _reachable(bm) == 11
    assert engine.snapshot().prefix_cache["blocks"] == 11
    bm.audit([])
    # the new chain is the one found: the whole text but its last block
    assert engine.generate([turn], [params])[0].num_cached_tokens == 176


def test_blocks_after_an_overwritten_block_are_not_counted() -> None:
    """A free cached block handed out again while a sequence that computed the same text beside
    it holds the blocks chained after it: those stay in use, shared read-only, never found;
    and a block that sequence fills after them chains from unreachable content too."""
    bm = BlockManager(16, 4, caching=True)
    a, b = _seq("a", range(12)), _seq("b", [*range(8), *range(50, 62)])
    _compute(bm, a, 12)
    _compute(bm, b, 18)  # computed beside a: b's first two blocks take a's keys, 2 more its own
    assert bm.num_cached == _reachable(bm) == 5
    bm.free(a)
    filler = _seq("f", [900] * 40)
    bm.allocate(filler, 40)  # the 8 never-used blocks, then a's third and second block
    assert bm.num_cached == _reachable(bm) == 1  # a's first block: b's two hang off its second
    _compute(bm, b, 2)  # b fills its fifth block, chained after unreachable content too
    assert bm.num_cached == _reachable(bm) == 1
    bm.audit([("b", b.block_table), ("f", filler.block_table)])
    assert bm.match(_seq("c", [*range(8), *range(50, 62), 1])) == 4


def test_a_retire_takes_the_kept_blocks_after_a_retired_one() -> None:
    bm = BlockManager(8, 4, caching=True)
    chain = _seq("chain", range(12))
    _compute(bm, chain, 12)
    third = chain.block_table[2]
    bm.free(chain)
    bm.retire_cache({third})  # kept, but chained after two retired blocks
    assert bm.num_cached == _reachable(bm) == 0
    bm.audit([])


def test_a_resize_drops_the_blocks_after_a_block_outside_the_pool() -> None:
    """A same-dtype shrink keeps the cached blocks inside the new pool, but not one chained
    after a block outside it (nor copies it over)."""
    bm = BlockManager(8, 4, caching=True)
    low = _seq("low", [900] * 24)
    bm.allocate(low, 24)  # blocks 0-5
    parent = _seq("p", range(8))
    _compute(bm, parent, 4)  # its first block: 6
    high = _seq("high", [901] * 4)
    bm.allocate(high, 4)  # 7
    bm.free(low)
    _compute(bm, parent, 4)  # its second block: 5, chained after block 6
    assert parent.block_table == [6, 5]
    for s in (parent, high):
        bm.free(s)
    moves = bm.resize(6, keep_cache=True)  # block 6 is outside; 5 inside, after it
    assert bm.num_cached == _reachable(bm) == 0 and 5 not in moves
    bm.audit([])
