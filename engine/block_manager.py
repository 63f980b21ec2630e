"""Physical KV block allocation: a free list, the sequences holding each block in use, and the
prefix cache.

Accounting must be exact, so every block is either on the free list or held by the sequences
whose tables name it; `audit` proves it (the property tests call it after every step). One
manager serves the device tier and a second one the host (swap) tier.

Prefix cache (device tier, `caching=True`). Once a block of a sequence is full and its K/V are
computed, its content is registered under an exact key: the key of the block before it (a
content id, 0 for the first block) and the block's own token ids. A request whose leading
full blocks match registered keys starts with those blocks in its table and its computed
count past them, so its prompt runs only from the first block not found (always at least its
last token, whose logits it samples). K/V depend only on the tokens before and at a position,
so a cached block holds exactly what the request would compute (up to the rounding of another
batch shape). Keys are compared whole, not by a hash, so two different prefixes can never share
K/V, whatever their tokens. A block holding registered content is shared read-only: a sequence
writes only at positions past its computed count, which lie in blocks of its own.

A freed block keeps its content and its key until the free list hands it out again: the free
list is ordered by release, least recently released first, and a sequence releases its last
block first, so the ends of prefixes are reused before their starts. Cached blocks count as
free everywhere (admission, pressure, remedies): the cache never holds memory a request needs.
A pool rebuild in another dtype (the live KV dtype switch) drops the cache: converted K/V are
not what a request computes in the new dtype, and the sequences live across it never register
a block (`Sequence.kv_converted`): even the blocks they fill later hold K/V computed from
converted ones. A resize in the same dtype keeps what fits.

A cached block is exact when prompt rows wrote it and every block before it: then it holds the
bits a cold prompt of its length class computes (a prompt shorter than
`cpu_lowbit.bf16_min_prompt()` takes other kernels than a longer one on AMX CPUs: the class is
kept with the block). A block a request's output filled was written by decode rows (other
kernels, another summation order: log-probabilities ~1e-3 apart), and a block computed on top
of such K/V inherits the difference. Those are reused too by default (a follow-up chat turn
starts past the previous answer); with `exact` on a lookup stops at the first block that is not
exact for the looking sequence's class, so every hit is what the request computes cold. An
exact copy of an inexact block's content, once computed, takes over its key (the inexact one
is forgotten, or unfindable while in use), so a prefix recomputed once is found exact from
then on.

A block made unfindable (its content overwritten, replaced by an exact copy, retired, or left
outside a shrunk pool) takes the blocks cached after it along: their keys chain from a content
id no lookup reaches any more. A parent -> children index finds them in O(their number), so
the cached blocks counted (`num_cached`, the `kvguard_prefix_cache_blocks` gauge) are only
those a lookup can reach.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvguard.engine.sequence import Sequence
from kvguard.kernels.cpu_lowbit import bf16_min_prompt

SHORT_ROOT = 1 << 62  # a short prompt's chain root with `exact` on (content ids count from 1)


def short_prompt(seq: Sequence) -> bool:
    """Whether `seq`'s prompt rows are a short prompt's (`cpu_lowbit.bf16_min_prompt()`, by the
    whole text it prefills): on AMX CPUs they take other kernels than a longer prompt's."""
    return seq.prefill_tokens < bf16_min_prompt()


# (content id of the block before, 0 for a first block; the block's token ids)
BlockKey = tuple[int, tuple[int, ...]]


def _roots() -> dict[int, dict[int, None]]:
    """The children index of an empty cache: the chain roots, always reachable."""
    return {0: {}, SHORT_ROOT: {}}


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, caching: bool = False, exact: bool = False
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.exact = exact  # lookups find only blocks exact for the sequence (`_exact`)
        # free blocks, least recently released first (a dict keeps order and removes in O(1))
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self._holders: dict[int, set[str]] = {}  # block in use -> request ids holding it
        # prefix cache: key -> block, and back; a block's content id chains the next key
        self._cache: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._content_of: dict[int, int] = {}
        self._next_content = 1
        # content ids of exact blocks (prompt-written chains) -> whether a short prompt wrote
        # them (`short_prompt`)
        self._exact: dict[int, bool] = {}
        # content ids a lookup can reach (the roots, and those of blocks under a findable key)
        # -> the blocks cached under a key chained from them; one missing is unreachable
        self._children: dict[int, dict[int, None]] = _roots()
        self._retired = 0  # entries kept for blocks in use under a key no lookup forms
        self.hit_tokens = 0  # prompt tokens served from the cache
        self.queried_tokens = 0  # prompt tokens of admissions that looked

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding K/V a lookup can reach (in use or free); free ones are handed out
        last."""
        return len(self._cache) - self._retired

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int, reserve: int = 0) -> bool:
        return len(self._free) - n >= reserve

    # -- raw blocks -----------------------------------------------------------------------
    def _pop_free(self) -> int:
        b = next(iter(self._free))
        del self._free[b]
        if b in self._key_of:  # its cached content is overwritten from now on
            self._retire(b)
        return b

    def take(self, owner: str, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{owner} needs {n} blocks: only {len(self._free)} free")
        ids = [self._pop_free() for _ in range(n)]
        for b in ids:
            self._holders[b] = {owner}
        return ids

    def give(self, owner: str, ids: list[int]) -> None:
        """Release `owner`'s hold on `ids`, last block first; a block nobody holds is free."""
        for b in reversed(ids):
            holders = self._holders.get(b)
            if holders is None or owner not in holders:
                raise RuntimeError(
                    f"block {b} returned by {owner} but held by {sorted(holders or ())}"
                )
            holders.discard(owner)
            if not holders:
                del self._holders[b]
                self._free[b] = None

    # -- device blocks of a sequence ------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `num_new_tokens` more computed tokens."""
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        seq.block_table.extend(self.take(seq.request_id, self.blocks_needed(seq, num_new_tokens)))

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those `seq`'s computed tokens fill: blocks taken for
        speculative drafts that were rejected (never registered in the cache: only full
        computed blocks are)."""
        keep = self.blocks_for(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self.give(seq.request_id, seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        self.give(seq.request_id, seq.block_table)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token `position` of `seq`."""
        return (
            seq.block_table[position // self.block_size] * self.block_size
            + position % self.block_size
        )

    # -- prefix cache ---------------------------------------------------------------------
    def _root(self, short: bool) -> int:
        """The parent of a sequence's first block: with `exact` on, short and longer prompts
        keep chains of their own (their K/V differ where their kernels do), so neither takes
        the other's key; else one chain for all."""
        return SHORT_ROOT if self.exact and short else 0

    def _key(self, seq: Sequence, i: int, parent: int) -> BlockKey:
        bs = self.block_size
        tokens = tuple(seq.token_slice(i * bs, (i + 1) * bs))
        # a key is a whole block: one cut short (its tokens not all there yet) is never found
        assert len(tokens) == bs, f"{seq.request_id}: block {i} keyed with {len(tokens)} tokens"
        return parent, tokens

    def match(self, seq: Sequence) -> int:
        """Give a sequence with nothing computed the cached blocks its tokens begin with; its
        computed count moves past them. At least its last token is left to compute. Returns
        the tokens found."""
        if not self.caching or seq.block_table or seq.num_computed_tokens:
            return 0
        table = self._lookup(seq)
        self._hold(seq.request_id, table)
        seq.block_table, seq.block_contents = table, [self._content_of[b] for b in table]
        seq.num_computed_tokens = len(table) * self.block_size
        short = short_prompt(seq)
        exact = next(
            (i for i, c in enumerate(seq.block_contents) if self._exact.get(c) is not short), None
        )
        seq.prompt_written = seq.num_computed_tokens if exact is None else exact * self.block_size
        return seq.num_computed_tokens

    def _lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq`'s tokens begin with, its last token's block excluded (and
        with `exact` on, up to the first block not exact for its length class)."""
        short = short_prompt(seq)
        parent, found = self._root(short), []
        for i in range((seq.num_tokens - 1) // self.block_size):
            b = self._cache.get(self._key(seq, i, parent))
            if b is None or (self.exact and self._exact.get(self._content_of[b]) is not short):
                break
            parent = self._content_of[b]
            found.append(b)
        return found

    def rematch(self, seq: Sequence, limit: int) -> list[int]:
        """The device blocks that still hold, under its keys, the content a swapped-out `seq`
        registered in its leading blocks (`seq.block_contents`): coming back, it shares them
        instead of copying its own host copies in beside them. A prefix that several
        sequences shared stays shared across their eviction (each had come back with a
        private copy: an eviction meant to free memory left them holding more). Content ids
        are never reused, and a pool rebuild in another dtype leaves none findable, so a block
        found holds the very K/V the sequence's copy does. The blocks are held for `seq` (a
        cached free one leaves the free list): give them back with `give`. At most `limit`."""
        found = self._rematched(seq, limit)
        self._hold(seq.request_id, found)
        return found

    def _rematched(self, seq: Sequence, limit: int) -> list[int]:
        """The blocks `rematch` would share, none held."""
        if not self.caching or seq.kv_converted or not seq.block_contents:
            return []
        parent, found = self._root(short_prompt(seq)), []
        for i, content in enumerate(seq.block_contents[:limit]):
            b = self._cache.get(self._key(seq, i, parent))
            if b is None or self._content_of.get(b) != content:
                break
            parent = content
            found.append(b)
        return found

    def shareable(self, seq: Sequence) -> list[int]:
        """The cached device blocks `seq` would start from (`match`: waiting, nothing
        computed) or come back to (`rematch`: swapped out) now, found without holding any:
        the KV demand (`snapshot.demand_blocks`) charges a sequence only the blocks it would
        not share. One key lookup per block found, and one more."""
        if seq.host_block_table:
            return self._rematched(seq, len(seq.host_block_table))
        if not self.caching or seq.block_table or seq.num_computed_tokens:
            return []
        return self._lookup(seq)

    def in_use(self, block: int) -> bool:
        """Whether a sequence holds `block` (else it is free, cached or not)."""
        return block in self._holders

    def _hold(self, owner: str, blocks: list[int]) -> None:
        """`owner` shares cached `blocks` (one that was free leaves the free list)."""
        for b in blocks:
            if b in self._free:
                del self._free[b]
                self._holders[b] = set()
            self._holders[b].add(owner)

    def unmatch(self, seq: Sequence) -> None:
        """Undo `match` for a sequence that could not start after all."""
        self.free(seq)
        seq.num_computed_tokens = 0
        seq.prompt_written = 0
        seq.block_contents = []

    def record(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def commit(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are full and computed since the last call (none
        of a sequence whose K/V a dtype switch converted). Only blocks whose tokens are all
        there: a sequence that finished inside a step's accepted drafts counts K/V for drafts
        it never appended. A block is exact where `seq.prompt_written` covers it; an exact one
        replaces an inexact block cached under its key."""
        if not self.caching or seq.kv_converted:
            return
        contents = seq.block_contents
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for i in range(len(contents), full):
            key = self._key(seq, i, contents[-1] if contents else self._root(short_prompt(seq)))
            exact = (i + 1) * self.block_size <= seq.prompt_written
            b = self._cache.get(key)
            if b is not None and exact and self._content_of[b] not in self._exact:
                self._retire(b)  # and the blocks after it: no lookup reaches them now
                b = None
            if b is None:  # new content: this sequence's block holds it from now on
                b = seq.block_table[i]
                self._register(b, key)
                if exact:
                    self._exact[self._content_of[b]] = short_prompt(seq)
            contents.append(self._content_of[b])

    def _register(self, b: int, key: BlockKey) -> None:
        """Cache block `b`'s new content under `key`. Chained from content no lookup reaches
        (a block before it retired while its sequence ran), it takes a key no lookup forms:
        shared read-only like a retired block, and not counted as reusable."""
        content, self._next_content = self._next_content, self._next_content + 1
        if key[0] in self._children:
            self._children[key[0]][b] = None
            self._children[content] = {}
        else:
            key = (-content, ())
            self._retired += 1
        self._cache[key], self._key_of[b], self._content_of[b] = b, key, content

    def _retire(self, b: int) -> None:
        """Make cached block `b` unfindable, and every block cached after it (their keys chain
        from content no lookup reaches any more): one in use keeps a key no lookup can form,
        so the sequences sharing it go on sharing it read-only; a free one is forgotten.
        O(the blocks retired), through the parent -> children index."""
        parent = self._key_of[b][0]
        if parent >= 0:
            del self._children[parent][b]
        doomed = [b]
        while doomed:
            b = doomed.pop()
            doomed.extend(self._children.pop(self._content_of[b], ()))
            self._unfind(b)

    def _unfind(self, b: int) -> None:
        """Take cached block `b` out of the lookups (its children are the caller's)."""
        key, content = self._key_of[b], self._content_of[b]
        del self._cache[key]
        self._retired -= key[0] < 0
        if b in self._holders:
            retired: BlockKey = (-content, ())
            self._cache[retired], self._key_of[b] = b, retired
            self._retired += 1
        else:
            del self._key_of[b], self._content_of[b]
            self._exact.pop(content, None)

    # -- pool rebuild ---------------------------------------------------------------------
    def resize(self, new_n: int, keep_cache: bool = False) -> dict[int, int]:
        """Renumber for a pool of `new_n` blocks; returns old -> new id of every block whose
        K/V the new pool must hold (every used block, and with `keep_cache` the cached free
        blocks kept).

        Blocks below `new_n` keep their ids; used ones above move to free ids below it. A pool
        rebuilt in another dtype (`keep_cache` False) drops the prefix cache: a cached block
        still in use keeps a key no lookup can form (a negative parent, no tokens), so the
        sequences sharing it go on sharing it read-only and no new one finds its converted K/V.
        A pool resized in the same dtype keeps it: the K/V are the same bytes, so cached blocks
        inside the new pool stay findable, and a moved block takes an uncached free id first,
        then the cached one the free list would hand out next.
        """
        if self.num_used > new_n:
            raise RuntimeError(f"{self.num_used} blocks in use do not fit a pool of {new_n}")
        if not keep_cache:
            return self._rebuild(new_n)
        used = set(self._holders)
        inside = [b for b in self._free if b < new_n]  # in the order they are handed out
        spare = iter(
            [b for b in inside if b not in self._key_of] + [b for b in inside if b in self._key_of]
        )
        moves = {b: (b if b < new_n else next(spare)) for b in sorted(used)}
        taken = set(moves.values())
        cache: dict[BlockKey, int] = {}
        key_of: dict[int, BlockKey] = {}
        content_of: dict[int, int] = {}
        children = _roots()  # new dicts: a failed conversion puts the old ones back
        for key, b in self._cache.items():  # a block's parent was registered before it
            nb = moves[b] if b in used else (b if b < new_n and b not in taken else None)
            if nb is None:  # outside the new pool, or overwritten by a moved block
                continue
            content = self._content_of[b]
            if key[0] >= 0 and key[0] not in children:  # the block before it was dropped
                if b not in used:
                    continue
                key = (-content, ())
            cache[key], key_of[nb], content_of[nb] = nb, key, content
            if key[0] >= 0:
                children[key[0]][nb] = None
                children[content] = {}
            if b not in used:
                moves[b] = nb  # the new pool must hold its K/V too
        self._cache, self._key_of, self._content_of = cache, key_of, content_of
        self._children = children
        kept = set(content_of.values())
        self._exact = {c: s for c, s in self._exact.items() if c in kept}
        self._retired = sum(key[0] < 0 for key in cache)
        self._holders = {moves[b]: h for b, h in self._holders.items()}
        fresh = range(self.num_blocks, new_n)  # a grown pool's new blocks hold nothing: first
        self._free = dict.fromkeys([*fresh, *(b for b in inside if b not in taken)])
        self.num_blocks = new_n
        return moves

    def retire_cache(self, keep: set[int]) -> None:
        """Make the cached content of every block outside `keep` unfindable (their K/V are no
        longer what their keys say), and so the blocks cached after it, kept or not: a block
        in use keeps a key no lookup can form, so the sequences sharing it go on sharing it
        read-only; a free one is forgotten."""
        for key, b in list(self._cache.items()):
            if b in keep or key[0] < 0 or self._key_of.get(b) != key:  # gone with its parent
                continue
            self._retire(b)

    def _rebuild(self, new_n: int) -> dict[int, int]:
        kept = {b: self._content_of[b] for b in self._holders if b in self._content_of}
        self._cache.clear()
        self._key_of.clear()
        self._content_of.clear()
        self._exact.clear()  # the blocks kept are never found again
        self._children = _roots()
        used = set(self._holders)
        spare = iter(b for b in range(new_n) if b not in used)
        moves = {b: (b if b < new_n else next(spare)) for b in sorted(used)}
        for b, content in kept.items():
            key: BlockKey = (-content, ())
            self._cache[key], self._key_of[moves[b]] = moves[b], key
            self._content_of[moves[b]] = content
        self._retired = len(kept)
        self._holders = {moves[b]: h for b, h in self._holders.items()}
        self._free = dict.fromkeys(b for b in range(new_n) if b not in self._holders)
        self.num_blocks = new_n
        return moves

    def audit(self, tables: Iterable[tuple[str, list[int]]]) -> None:
        """Raise AssertionError unless free and held blocks partition the pool exactly, and
        only cached (read-only) blocks are shared."""
        free = set(self._free)
        assert all(0 <= b < self.num_blocks for b in free), "free list holds an id outside the pool"
        seen: dict[int, set[str]] = {}
        for owner, table in tables:
            for b in table:
                holders = seen.setdefault(b, set())
                assert owner not in holders, f"block {b} twice in the table of {owner}"
                assert not holders or b in self._key_of, (
                    f"block {b} used by {sorted(holders)} and {owner} but holds no cached content"
                )
                holders.add(owner)
        assert not free & set(seen), "a block is both free and in use"
        assert seen == self._holders, "holder map disagrees with the block tables"
        assert len(free) + len(seen) == self.num_blocks, (
            f"{self.num_blocks - len(free) - len(seen)} blocks leaked"
        )
        for key, b in self._cache.items():
            assert self._key_of.get(b) == key and b in self._content_of, f"cache entry {b} torn"
        assert len(self._key_of) == len(self._cache) == len(self._content_of), "cache torn"
        assert set(self._exact) <= set(self._content_of.values()), "exact flag of lost content"
        self._check_reachable()

    def _check_reachable(self) -> None:
        """Raise AssertionError unless the blocks under a findable key are exactly those a
        walk from the roots reaches, as the children index and `num_cached` say."""
        findable = {b: key for key, b in self._cache.items() if key[0] >= 0}
        assert len(findable) == self.num_cached, f"{self._retired} retired entries miscounted"
        reached, todo = 0, list(_roots())
        while todo:
            parent = todo.pop()
            kids = self._children.get(parent, {})
            assert all(findable.get(b, (None,))[0] == parent for b in kids), "children index torn"
            reached += len(kids)
            todo.extend(self._content_of[b] for b in kids)
        assert reached == len(findable) == len(self._children) - len(_roots()), (
            f"{len(findable) - reached} cached blocks counted that no lookup reaches"
        )
