"""Physical KV block allocation: a free list and an owner for every block in use.

Accounting must be exact, so every block is either on the free list or owned by exactly one
sequence; `audit` proves it (the property tests call it after every step). One manager serves
the device tier and a second one the host (swap) tier.
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

    def can_allocate(self, n: int, reserve: int = 0) -> bool:
        return len(self._free) - n >= reserve

    # -- raw blocks -----------------------------------------------------------------------
    def take(self, owner: str, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{owner} needs {n} blocks: only {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._owner[b] = owner
        return ids

    def give(self, owner: str, ids: list[int]) -> None:
        for b in ids:
            if self._owner.get(b) != owner:
                raise RuntimeError(
                    f"block {b} returned by {owner} but owned by {self._owner.get(b)}"
                )
            del self._owner[b]
            self._free.append(b)

    # -- device blocks of a sequence ------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `num_new_tokens` more computed tokens."""
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        seq.block_table.extend(self.take(seq.request_id, self.blocks_needed(seq, num_new_tokens)))

    def free(self, seq: Sequence) -> None:
        self.give(seq.request_id, seq.block_table)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token `position` of `seq`."""
        return (
            seq.block_table[position // self.block_size] * self.block_size
            + position % self.block_size
        )

    # -- pool rebuild ---------------------------------------------------------------------
    def resize(self, new_n: int) -> dict[int, int]:
        """Renumber for a pool of `new_n` blocks; returns old -> new id of every used block.

        Blocks below `new_n` keep their ids; those above move to the lowest free ids.
        """
        if self.num_used > new_n:
            raise RuntimeError(f"{self.num_used} blocks in use do not fit a pool of {new_n}")
        used = set(self._owner)
        spare = iter(b for b in range(new_n) if b not in used)
        moves = {b: (b if b < new_n else next(spare)) for b in sorted(used)}
        self._owner = {moves[b]: o for b, o in self._owner.items()}
        taken = set(self._owner)
        self._free = deque(b for b in range(new_n) if b not in taken)
        self.num_blocks = new_n
        return moves

    def audit(self, tables: Iterable[tuple[str, list[int]]]) -> None:
        """Raise AssertionError unless free and owned blocks partition the pool exactly."""
        free = list(self._free)
        assert len(set(free)) == len(free), "a block is on the free list twice"
        assert all(0 <= b < self.num_blocks for b in free), "free list holds an id outside the pool"
        seen: dict[int, str] = {}
        for owner, table in tables:
            for b in table:
                assert b not in seen, f"block {b} used by {seen.get(b)} and {owner}"
                seen[b] = owner
        assert not set(free) & set(seen), "a block is both free and in use"
        assert seen == self._owner, "owner map disagrees with the block tables"
        assert len(free) + len(seen) == self.num_blocks, (
            f"{self.num_blocks - len(free) - len(seen)} blocks leaked"
        )
