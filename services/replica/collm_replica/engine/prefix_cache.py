"""The prefix cache over the paged KV cache (pure: no torch, no clock).

A full KV block is keyed by what determines its keys and values: the tokens up to its end and the
weights that computed them. The key of block `i` of a sequence is the hash chain
`h_i = sha256(h_{i-1} || tokens of block i)`, rooted at a hash of the *salt* (`root_hash`): the adapter
version bound to the request and its installation in the LoRA bank (`Slots.cache_salt`; the base model
has its own), since a LoRA on any projection changes the keys and values. Only full blocks are keyed; a
block's key covers every token before it, so equal keys mean equal prefixes.

`PrefixCache` is the engine's side of it (setting `prefix_caching`, on by default):

* at admission (`lookup`, then `take`), a sequence whose known tokens (its prompt; after a preemption,
  its prompt and the output to recompute) start with registered blocks shares them
  (`BlockManager.share`) and starts computing after them. The hit is whole blocks and leaves at least
  the last known token to compute (its logits give the next token), so a sequence never writes into a
  shared block;
* after every forward (`record`), the blocks a sequence has filled are registered under their keys
  (`BlockManager.register`), prompt and generated tokens alike: later requests with the same prefix,
  and the sequence itself after a preemption, find them;
* released registered blocks stay cached until the pool needs them (LRU eviction, `kv.BlockManager`).

Counters (tokens): `queries_total`, the known tokens of every admission; `hits_total`, of those, the
tokens taken from the cache instead of computed (vLLM's `prefix_cache_queries` / `prefix_cache_hits`).
Turned off, every sequence computes all of its tokens, nothing is registered or shared and both
counters stay 0.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from collm_replica.engine.kv import BlockManager


def root_hash(salt: str) -> bytes:
    """The parent key of a sequence's first block: the weights that compute it (`salt`)."""
    return hashlib.sha256(b"collm-kv\0" + salt.encode()).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its parent's key and its tokens."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


@dataclass
class BlockChain:
    """One sequence's block keys: `keys[i]` is the key of its block `i` (full blocks only, computed as
    its known tokens grow); `registered`: its leading blocks already registered (or shared)."""

    salt: str
    keys: list[bytes] = field(default_factory=list)
    registered: int = 0

    def extend(self, tokens: Sequence[int], block_size: int, upto_blocks: int) -> list[bytes]:
        """The keys of the first `upto_blocks` blocks of `tokens` (which must hold them all)."""
        parent = self.keys[-1] if self.keys else root_hash(self.salt)
        for i in range(len(self.keys), upto_blocks):
            parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
            self.keys.append(parent)
        return self.keys[:upto_blocks]

    def fork(self) -> BlockChain:
        """A copy for a choice that shares this sequence's blocks (its keys diverge from its output on)."""
        return BlockChain(self.salt, list(self.keys), self.registered)


@dataclass(frozen=True)
class PrefixHit:
    """What the cache holds of a sequence's known tokens: its first `tokens` tokens in `blocks`, of
    which `revived` are held by no sequence now (taking them takes them from the pool's free count)."""

    tokens: int = 0
    blocks: tuple[int, ...] = ()
    revived: int = 0


NO_HIT = PrefixHit()


class PrefixCache:
    """The engine's prefix cache over one pool's `BlockManager` (see the module doc)."""

    def __init__(self, blocks: BlockManager, enabled: bool) -> None:
        self.blocks = blocks
        self.enabled = enabled
        self.queries_total = 0  # known tokens of the sequences admitted
        self.hits_total = 0  # of which taken from the cache

    def chain(self, salt: str) -> BlockChain | None:
        """A new sequence's block keys (None when the cache is off)."""
        return BlockChain(salt) if self.enabled else None

    def lookup(self, chain: BlockChain | None, tokens: Sequence[int]) -> PrefixHit:
        """The cached prefix of a sequence whose known tokens are `tokens` (changes no block)."""
        if chain is None or len(tokens) <= self.blocks.block_size:
            return NO_HIT
        bs = self.blocks.block_size
        found = self.blocks.match(chain.extend(tokens, bs, (len(tokens) - 1) // bs))
        if not found:
            return NO_HIT
        revived = sum(1 for b in found if self.blocks.is_cached(b))
        return PrefixHit(len(found) * bs, tuple(found), revived)

    def take(self, seq_id: str, chain: BlockChain | None, hit: PrefixHit, known_tokens: int) -> int:
        """Admit a sequence holding no blocks with `hit` (from `lookup` in this iteration): it shares
        the hit's blocks; counts the query. Returns the tokens it need not compute."""
        if chain is None:
            return 0
        self.queries_total += known_tokens
        self.hits_total += hit.tokens
        if hit.blocks:
            self.blocks.share(seq_id, hit.blocks)
        chain.registered = len(hit.blocks)
        return hit.tokens

    def record(
        self, seq_id: str, chain: BlockChain | None, tokens: Callable[[], Sequence[int]], computed: int
    ) -> None:
        """Register the sequence's blocks filled by its first `computed` tokens (`tokens()`: its known
        tokens, at least `computed` of them, asked for only when a block has filled)."""
        if chain is None:
            return
        full = computed // self.blocks.block_size
        if full <= chain.registered:
            return
        keys = chain.extend(tokens(), self.blocks.block_size, full)
        for i in range(chain.registered, full):
            self.blocks.register(seq_id, i, keys[i])
        chain.registered = full
