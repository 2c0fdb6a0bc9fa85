"""The prefix cache's pure parts: shared and cached blocks in the block manager (reference counts, LRU
eviction, no leak), the blocks' content keys (hash chain and adapter salt), lookups that leave the last
token to compute, and the paged plan's accounting of hits and shared blocks."""

from __future__ import annotations

import random

import pytest

from collm_replica.engine.kv import BlockManager, OutOfBlocks
from collm_replica.engine.prefix_cache import BlockChain, PrefixCache, block_hash, root_hash
from collm_replica.engine.scheduler import BatchConfig, SeqView, plan_iteration


def fill(bm: BlockManager, sid: str, keys: list[str]) -> list[int]:
    """`sid` takes one full block per key and registers it under that key."""
    bm.grow(sid, bm.held(sid) * bm.block_size + len(keys) * bm.block_size)
    start = bm.held(sid) - len(keys)
    for i, key in enumerate(keys):
        assert bm.register(sid, start + i, key)
    return bm.table(sid)[start:]


# --- block manager ---------------------------------------------------------------------------------
def test_shared_blocks_are_counted_and_come_back_with_their_last_holder() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, caching=True)
    a = fill(bm, "a", ["k0", "k1"])
    assert bm.match(["k0", "k1", "k2"]) == a
    bm.share("b", a)
    bm.grow("b", 9)  # its own third block
    assert [bm.refs(x) for x in a] == [2, 2] and bm.exclusive("b") == 1 and bm.exclusive("a") == 0
    assert bm.num_used == 3
    bm.free("a")
    assert bm.num_used == 3 and bm.exclusive("b") == 3  # b holds them alone now
    bm.free("b")
    assert bm.num_used == 0 and bm.num_free == 8 and bm.num_cached == 2
    assert bm.match(["k0", "k1"]) == a  # released, still cached
    bm.check()


def test_a_cached_block_is_revived_by_a_share_and_free_blocks_go_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, caching=True)
    a = fill(bm, "a", ["k0"])
    bm.free("a")
    assert bm.is_cached(a[0])
    assert bm.grow("x", 12) == [1, 2, 3]  # the free blocks, not the cached one
    assert bm.match(["k0"]) == a
    bm.share("b", a)
    assert not bm.is_cached(a[0]) and bm.num_free == 0
    with pytest.raises(OutOfBlocks):
        bm.grow("b", 8)
    bm.check()


def test_cached_blocks_are_evicted_least_recently_released_first_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, caching=True)
    fill(bm, "old", ["o0", "o1"])
    fill(bm, "new", ["n0", "n1"])
    bm.free("old")
    bm.free("new")
    bm.grow("x", 4)  # the two free blocks
    assert bm.num_cached == 4
    bm.grow("y", 2)  # one block: the old sequence's last block is evicted first
    assert bm.match(["o0", "o1"]) == [0] and bm.match(["n0", "n1"]) == [2, 3]
    bm.share("z", bm.match(["n0"]))  # used again: no longer an eviction candidate
    bm.free("z")  # ... and released most recently
    bm.grow("y", 6)  # two more: o0 and then n1
    assert bm.match(["o0"]) == [] and bm.match(["n0", "n1"]) == [2]
    bm.check()


def test_without_caching_released_blocks_are_free_and_forgotten() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = fill(bm, "a", ["k0"])
    bm.share("b", a)  # sharing works without caching (the choices of one request)
    bm.free("a")
    assert bm.match(["k0"]) == a
    bm.free("b")
    assert bm.match(["k0"]) == [] and bm.num_cached == 0 and bm.num_free == 4
    bm.check()


def test_a_key_is_registered_once_and_free_blocks_cannot_be_shared() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, caching=True)
    fill(bm, "a", ["k0"])
    bm.grow("b", 4)
    assert not bm.register("b", 0, "k0")  # computed twice at once: the first copy stays the cached one
    assert not bm.register("a", 0, "other")  # a block keeps its first key
    bm.free("b")
    assert bm.num_cached == 0  # b's copy was never registered: free at once
    with pytest.raises(ValueError):
        bm.share("c", [3])
    bm.check()


def test_no_leak_after_a_random_workload_with_sharing() -> None:
    rng = random.Random(11)
    bm = BlockManager(num_blocks=48, block_size=4, caching=True)
    prefixes = [[f"p{j}-{i}" for i in range(6)] for j in range(3)]
    live: list[str] = []
    for step in range(4000):
        op = rng.random()
        if op < 0.4 or not live:
            sid = f"s{step}"
            want = prefixes[rng.randrange(3)][: rng.randint(1, 6)]
            hit = bm.match(want)
            bm.share(sid, hit)
            try:
                bm.grow(sid, (len(want) + rng.randint(0, 2)) * 4)
            except OutOfBlocks:
                bm.free(sid)
                continue
            for i in range(len(hit), len(want)):
                bm.register(sid, i, want[i])
            live.append(sid)
        elif op < 0.7:
            sid = rng.choice(live)
            try:
                bm.grow(sid, bm.held(sid) * 4 + rng.randint(1, 8))
            except OutOfBlocks:
                bm.free(sid)
                live.remove(sid)
        else:
            sid = rng.choice(live)
            bm.free(sid)
            live.remove(sid)
        bm.check()
    for sid in live:
        bm.free(sid)
    assert bm.num_free == 48 and bm.num_used == 0
    bm.check()


# --- keys and lookups --------------------------------------------------------------------------------
def test_block_keys_chain_the_prefix_and_the_adapter_salt() -> None:
    toks = list(range(12))
    a = BlockChain("base").extend(toks, 4, 3)
    assert a == BlockChain("base").extend(toks, 4, 3)
    assert BlockChain("med@v1#1").extend(toks, 4, 3)[0] != a[0]  # another version's weights
    other = BlockChain("base").extend([99, *toks[1:]], 4, 3)
    assert other[1] != a[1]  # the same tokens after another prefix: another key
    assert a[1] == block_hash(block_hash(root_hash("base"), toks[:4]), toks[4:8])


def test_a_lookup_leaves_the_last_known_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, caching=True)
    cache = PrefixCache(bm, enabled=True)
    toks = list(range(8))
    chain = cache.chain("base")
    assert chain is not None
    bm.grow("a", 8)
    cache.record("a", chain, lambda: toks, 8)
    assert bm.num_used == 2 and chain.registered == 2
    again = cache.chain("base")
    assert cache.lookup(again, toks).tokens == 4  # both blocks cached; the second holds the last token
    assert cache.lookup(again, [*toks, 8]).tokens == 8
    assert cache.lookup(cache.chain("med@v1#1"), [*toks, 8]).tokens == 0
    hit = cache.lookup(again, [*toks, 8])
    assert cache.take("b", again, hit, 9) == 8 and bm.table("b") == bm.table("a")
    assert (cache.queries_total, cache.hits_total) == (9, 8)
    off = PrefixCache(bm, enabled=False)
    assert off.chain("base") is None and off.lookup(None, toks).tokens == 0


# --- the paged plan ------------------------------------------------------------------------------------
CFG = BatchConfig(
    max_batch=8, max_batch_tokens=64, prefill_chunk_tokens=16, kv_budget_tokens=64, block_size=4
)


def test_a_hit_starts_the_chunk_after_the_cached_prefix_and_revived_blocks_count() -> None:
    # 16 blocks, 10 free of which the hit's 4 are cached: admission needs 2 new blocks plus the 4 revived.
    hit = SeqView("w", 24, 16, blocks_held=4, revive_blocks=4)
    plan = plan_iteration(CFG, [], [hit], free_blocks=5)
    assert plan.admitted == [] and plan.items == []  # 2 + 4 > 5
    plan = plan_iteration(CFG, [], [hit], free_blocks=6)
    assert plan.admitted == ["w"] and plan.items == [("w", 8)]
    shared = SeqView("w", 24, 16, blocks_held=4)  # held by running sequences: no cost
    assert plan_iteration(CFG, [], [shared], free_blocks=2).items == [("w", 8)]


def test_preempting_a_sequence_that_shares_its_blocks_counts_only_its_own() -> None:
    old = SeqView("old", 16, 16, output_len=1, blocks_held=4)  # its next token needs a fifth block
    sharer = SeqView("sharer", 16, 16, output_len=1, blocks_held=4, freeable_blocks=0)
    other = SeqView("other", 4, 4, output_len=1, blocks_held=1)
    plan = plan_iteration(CFG, [old, other, sharer], [], free_blocks=0)
    # the sharer gives back nothing, so the next latest arrival goes too
    assert plan.preempted == ["sharer", "other"] and plan.items[0] == ("old", 1)
