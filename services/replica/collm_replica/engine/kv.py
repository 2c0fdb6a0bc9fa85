"""The paged KV cache's block manager (pure: no torch, no clock).

The cache is one pool of `num_blocks` fixed-size blocks of `block_size` tokens (the tensors live in
`executor.KVPool`); a sequence holds a *block table*, the list of blocks its tokens occupy in order
(token `p` of a sequence is in block `table[p // block_size]` at offset `p % block_size`). Blocks are
allocated as a sequence grows, never ahead of need, and all of a sequence's blocks are released at once
when it finishes, is cancelled or is preempted.

Blocks are reference-counted: a block may be in several tables (`share`), the full blocks of a common
prefix (the prefix cache, `engine.prefix_cache`) and the prompt of a request's `n` choices. A full
block can be *registered* under a key of its content (`register`: the hash chain of the tokens up to
its end and of the adapter version that computed it); `match` finds the registered blocks of a chain of
keys. With `caching=True`, a registered block whose last holder releases it stays *cached*: it counts as
free, and `match` still finds it until the pool needs it, when the least recently released cached block
is evicted (its key forgotten) and handed out again. A block that is not registered returns to the free
blocks at once.

Guarantees: a block's reference count is the number of tables it is in, and a block is either held
(count > 0), cached (count 0, registered, `caching` only) or free, never two of these (`check`);
allocation takes the lowest-numbered free block first and evicts a cached block only when no free block
is left, so the pool's touched memory stays as compact as the cache allows (the pool tensors are
allocated uninitialised and the OS maps their pages on first write: with caching, the cached blocks'
pages stay mapped, up to the whole pool); `grow` either allocates every block a sequence needs or none
(`OutOfBlocks`), so a failed growth leaves the manager unchanged.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Sequence


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a growth needs."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)


class BlockManager:
    """Allocation of one pool's blocks to sequences, with shared and cached blocks (see the module doc)."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest block first
        self._tables: dict[str, list[int]] = {}
        self._refs: list[int] = [0] * num_blocks
        self._n_shared = 0  # blocks in more than one table
        self._key_of: dict[int, Hashable] = {}  # registered blocks (held or cached) -> content key
        self._block_of: dict[Hashable, int] = {}  # content key -> its registered block
        self._cached: OrderedDict[int, None] = OrderedDict()  # count 0, registered: eviction order

    @property
    def num_free(self) -> int:
        """Blocks a growth can take: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that no sequence holds but that keep their registered content."""
        return len(self._cached)

    def table(self, seq_id: str) -> list[int]:
        """The sequence's block table (empty when it holds none); the caller must not change it."""
        return self._tables.get(seq_id, [])

    def held(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def refs(self, block: int) -> int:
        """How many tables hold `block`."""
        return self._refs[block]

    def exclusive(self, seq_id: str) -> int:
        """Blocks of the sequence that no other sequence holds: what releasing it gives back."""
        if self._n_shared == 0:
            return self.held(seq_id)
        return sum(1 for b in self._tables.get(seq_id, ()) if self._refs[b] == 1)

    def needed(self, seq_id: str, tokens: int) -> int:
        """More blocks the sequence needs to hold `tokens` tokens."""
        return max(0, blocks_for(tokens, self.block_size) - self.held(seq_id))

    def grow(self, seq_id: str, tokens: int) -> list[int]:
        """Extend the sequence's table to hold `tokens` tokens; returns the blocks added (free blocks
        first, lowest first; then the least recently released cached blocks, whose keys are forgotten)."""
        n = self.needed(seq_id, tokens)
        if n == 0:
            return []
        if n > self.num_free:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {n} more blocks for {tokens} tokens; {self.num_free} are free"
            )
        added = [self._take() for _ in range(n)]
        self._tables.setdefault(seq_id, []).extend(added)
        return added

    def _take(self) -> int:
        if self._free:
            b = heapq.heappop(self._free)
        else:
            b, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
        self._refs[b] = 1
        return b

    def free(self, seq_id: str) -> int:
        """Release every block of the sequence; returns how many it held (0 when none). A block whose
        count drops to 0 becomes cached when it is registered and caching is on (the sequence's last
        block first in eviction order, its first block last), else free."""
        table = self._tables.pop(seq_id, [])
        for b in reversed(table):
            self._refs[b] -= 1
            if self._refs[b] > 0:
                self._n_shared -= self._refs[b] == 1
                continue
            if self.caching and b in self._key_of:
                self._cached[b] = None
            else:
                self._forget(b)
                heapq.heappush(self._free, b)
        return len(table)

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]

    # --- sharing and the content index -----------------------------------------------------------------
    def share(self, seq_id: str, blocks: Sequence[int]) -> None:
        """Append `blocks` (each held by another sequence, or cached) to the sequence's table and count
        it as their holder: the sequence reads those tokens' keys and values and never writes them."""
        for b in blocks:
            if self._refs[b] == 0 and b not in self._cached:
                raise ValueError(f"block {b} is free: there is nothing in it to share")
        for b in blocks:
            if self._refs[b] == 0:
                del self._cached[b]
            self._n_shared += self._refs[b] == 1
            self._refs[b] += 1
        self._tables.setdefault(seq_id, []).extend(blocks)

    def register(self, seq_id: str, index: int, key: Hashable) -> bool:
        """Record that block `index` of the sequence's table is full and holds the content `key`, so that
        `match` finds it; returns False (nothing changes) when the block already has a key or another
        block holds that content (both computed it at once: the first one stays the cached copy)."""
        b = self._tables[seq_id][index]
        if b in self._key_of or key in self._block_of:
            return False
        self._key_of[b] = key
        self._block_of[key] = b
        return True

    def match(self, keys: Sequence[Hashable]) -> list[int]:
        """The registered blocks (held or cached) of the longest prefix of `keys` (changes nothing)."""
        out: list[int] = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def is_cached(self, block: int) -> bool:
        """`block` is held by no sequence but keeps its content (taking it takes it from the free count)."""
        return block in self._cached

    def sequences(self) -> list[str]:
        return list(self._tables)

    def check(self) -> None:
        """Raise AssertionError unless every block's count is the number of tables holding it and every
        block is held, cached or free, exactly one of them."""
        count = [0] * self.num_blocks
        for sid, table in self._tables.items():
            assert len(set(table)) == len(table), f"{sid}: a block twice in one table"
            for b in table:
                assert 0 <= b < self.num_blocks, f"{sid}: block {b} outside the pool"
                count[b] += 1
        assert count == self._refs, "reference counts differ from the tables"
        assert self._n_shared == sum(1 for c in count if c > 1), "the count of shared blocks is off"
        free = set(self._free)
        cached = set(self._cached)
        held = {b for b in range(self.num_blocks) if count[b] > 0}
        assert len(free) == len(self._free), "a block is free twice"
        assert not (free & held) and not (cached & held) and not (free & cached), "a block in two states"
        assert len(free) + len(cached) + len(held) == self.num_blocks, "blocks leaked"
        assert cached <= set(self._key_of), "a cached block without content"
        assert not (free & set(self._key_of)), "a free block keeps a content key"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "the content index disagrees"
        assert len(self._block_of) == len(self._key_of), "the content index disagrees"
        assert self.caching or not cached, "a cached block with caching off"
