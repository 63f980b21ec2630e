"""Physical KV block allocation: a free list and per-sequence block tables.

Accounting must be exact, so every block is either on the free list or in exactly one
sequence's table; `audit` proves it (the property tests call it after every step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvguard.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `num_new_tokens` more computed tokens."""
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, n: int, reserve: int = 0) -> bool:
        return len(self._free) - n >= reserve

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        n = self.blocks_needed(seq, num_new_tokens)
        if n > len(self._free):
            raise RuntimeError(
                f"allocate {n} blocks for {seq.request_id}: only {len(self._free)} free"
            )
        for _ in range(n):
            block = self._free.popleft()
            self._owner[block] = seq.request_id
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            if self._owner.pop(block, None) != seq.request_id:
                raise RuntimeError(f"block {block} freed by {seq.request_id} but not owned by it")
            self._free.append(block)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token `position` of `seq`."""
        return (
            seq.block_table[position // self.block_size] * self.block_size
            + position % self.block_size
        )

    def audit(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError unless free and owned blocks partition the pool exactly."""
        free = list(self._free)
        assert len(set(free)) == len(free), "a block is on the free list twice"
        seen: dict[int, str] = {}
        for seq in live:
            for b in seq.block_table:
                assert b not in seen, f"block {b} used by {seen.get(b)} and {seq.request_id}"
                seen[b] = seq.request_id
            assert len(seq.block_table) == self.blocks_for(seq.num_computed_tokens), (
                f"{seq.request_id} holds {len(seq.block_table)} blocks for {seq.num_computed_tokens} tokens"
            )
        assert not set(free) & set(seen), "a block is both free and in use"
        assert seen == self._owner, "owner map disagrees with the block tables"
        assert len(free) + len(seen) == self.num_blocks, (
            f"{self.num_blocks - len(free) - len(seen)} blocks leaked"
        )
