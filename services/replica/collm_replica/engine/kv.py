"""The paged KV cache's block manager (pure: no torch, no clock).

The cache is one pool of `num_blocks` fixed-size blocks of `block_size` tokens (the tensors live in
`executor.KVPool`); a sequence holds a *block table*, the list of blocks its tokens occupy in order
(token `p` of a sequence is in block `table[p // block_size]` at offset `p % block_size`). Blocks are
allocated as a sequence grows, never ahead of need, and all of a sequence's blocks return to the pool at
once when it finishes, is cancelled or is preempted.

Guarantees: a block is in at most one table or in the free list, never both (`check`); allocation takes
the lowest-numbered free blocks first, so the pool's touched memory stays compact (the pool tensors are
allocated uninitialised and the OS maps their pages on first write); `grow` either allocates every block
a sequence needs or none (`OutOfBlocks`), so a failed growth leaves the manager unchanged.
"""

from __future__ import annotations

import heapq


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a growth needs."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)


class BlockManager:
    """Allocation of one pool's blocks to sequences (see the module doc)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest block first
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def table(self, seq_id: str) -> list[int]:
        """The sequence's block table (empty when it holds none); the caller must not change it."""
        return self._tables.get(seq_id, [])

    def held(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def needed(self, seq_id: str, tokens: int) -> int:
        """More blocks the sequence needs to hold `tokens` tokens."""
        return max(0, blocks_for(tokens, self.block_size) - self.held(seq_id))

    def grow(self, seq_id: str, tokens: int) -> list[int]:
        """Extend the sequence's table to hold `tokens` tokens; returns the blocks added."""
        n = self.needed(seq_id, tokens)
        if n == 0:
            return []
        if n > len(self._free):
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {n} more blocks for {tokens} tokens; {len(self._free)} are free"
            )
        added = [heapq.heappop(self._free) for _ in range(n)]
        self._tables.setdefault(seq_id, []).extend(added)
        return added

    def free(self, seq_id: str) -> int:
        """Return every block of the sequence to the pool; returns how many (0 when it held none)."""
        table = self._tables.pop(seq_id, [])
        for b in table:
            heapq.heappush(self._free, b)
        return len(table)

    def sequences(self) -> list[str]:
        return list(self._tables)

    def check(self) -> None:
        """Raise AssertionError unless every block is either free or in exactly one table."""
        seen: set[int] = set()
        for sid, table in self._tables.items():
            for b in table:
                assert 0 <= b < self.num_blocks, f"{sid}: block {b} outside the pool"
                assert b not in seen, f"block {b} is in two tables"
                seen.add(b)
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert not (free & seen), "a block is both free and held"
        assert len(free) + len(seen) == self.num_blocks, "blocks leaked"
