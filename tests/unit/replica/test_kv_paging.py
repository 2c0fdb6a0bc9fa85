"""The paged KV cache's pure parts: the block manager and the paged batch plan (admission by blocks
needed now, growth, preemption of the latest arrival, no leak)."""

from __future__ import annotations

import random

import pytest

from collm_replica.engine.kv import BlockManager, OutOfBlocks, blocks_for
from collm_replica.engine.scheduler import BatchConfig, SeqView, plan_iteration


# --- block manager -------------------------------------------------------------------------------------
def test_blocks_are_allocated_as_a_sequence_grows_lowest_first() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.grow("a", 1) == [0]
    assert bm.grow("a", 4) == []  # still one block
    assert bm.grow("a", 5) == [1]
    assert bm.grow("b", 9) == [2, 3, 4]
    assert bm.table("a") == [0, 1] and bm.num_free == 3
    bm.check()


def test_growth_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.grow("a", 8)
    with pytest.raises(OutOfBlocks):
        bm.grow("b", 12)  # needs 3, 2 free
    assert bm.table("b") == [] and bm.num_free == 2
    bm.check()


def test_free_returns_every_block_at_once_and_they_are_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.grow("a", 3)
    bm.grow("b", 2)
    assert bm.free("a") == 2 and bm.free("a") == 0  # freeing twice is harmless
    assert bm.grow("c", 4) == [0, 1]
    bm.check()


def test_no_leak_after_a_random_workload() -> None:
    rng = random.Random(7)
    bm = BlockManager(num_blocks=64, block_size=16)
    lengths: dict[str, int] = {}
    for step in range(5000):
        op = rng.random()
        if op < 0.3 or not lengths:
            sid = f"s{step}"
            n = rng.randint(1, 200)
            try:
                bm.grow(sid, n)
                lengths[sid] = n
            except OutOfBlocks:
                pass
        elif op < 0.8:
            sid = rng.choice(list(lengths))
            n = lengths[sid] + rng.randint(1, 20)
            try:
                bm.grow(sid, n)
                lengths[sid] = n
            except OutOfBlocks:
                bm.free(sid)  # preempted
                del lengths[sid]
        else:
            sid = rng.choice(list(lengths))
            bm.free(sid)
            del lengths[sid]
        for sid, n in lengths.items():
            assert bm.held(sid) == blocks_for(n, 16)
        bm.check()
    for sid in list(lengths):
        bm.free(sid)
    assert bm.num_free == 64
    bm.check()


# --- the paged plan ------------------------------------------------------------------------------------
def run(sid: str, prompt: int, computed: int, output: int, bs: int = 4) -> SeqView:
    """A running sequence holding exactly the blocks of its computed tokens."""
    return SeqView(sid, prompt, computed, output_len=output, blocks_held=blocks_for(computed, bs))


def test_admission_takes_only_the_blocks_needed_now() -> None:
    # 8 blocks of 4 tokens; a request asking for 1000 new tokens is admitted with its 5-token prompt.
    cfg = BatchConfig(
        max_batch=8, max_batch_tokens=64, prefill_chunk_tokens=16, kv_budget_tokens=32, block_size=4
    )
    plan = plan_iteration(cfg, [], [SeqView("a", 5, 0, kv_reserve=1008), SeqView("b", 5, 0)])
    assert plan.admitted == ["a", "b"] and plan.items == [("a", 5), ("b", 5)]


def test_admission_stops_at_the_watermark_fcfs() -> None:
    cfg = BatchConfig(
        max_batch=8, max_batch_tokens=64, prefill_chunk_tokens=16, kv_budget_tokens=32, block_size=4
    )
    # 7 blocks held, 1 free = the watermark: nothing is admitted, and b must not overtake a.
    plan = plan_iteration(cfg, [run("r", 20, 27, 8)], [SeqView("a", 8, 0), SeqView("b", 1, 0)])
    assert plan.items == [("r", 1)] and plan.admitted == []


def test_a_decode_that_needs_a_block_preempts_the_latest_arrival() -> None:
    cfg = BatchConfig(
        max_batch=8, max_batch_tokens=64, prefill_chunk_tokens=16, kv_budget_tokens=20, block_size=4
    )
    # 5 blocks: a holds 2 (8 tokens, its 9th needs a third), b holds 1 (its 5th needs a second), c holds 2.
    running = [run("a", 6, 8, 3), run("b", 3, 4, 2), run("c", 5, 7, 3)]
    plan = plan_iteration(cfg, running, [SeqView("w", 2, 0)])
    assert plan.preempted == ["c"]
    assert plan.items == [("a", 1), ("b", 1)]  # c's two blocks went to a and b
    assert plan.admitted == []  # nothing is admitted in an iteration that preempted


def test_the_oldest_sequence_always_proceeds() -> None:
    cfg = BatchConfig(
        max_batch=8, max_batch_tokens=64, prefill_chunk_tokens=16, kv_budget_tokens=16, block_size=4
    )
    # 4 blocks; b and c arrived later and hold the rest; a (oldest, prefilling) needs 2 more.
    running = [run("a", 16, 8, 0), run("b", 2, 3, 2), run("c", 2, 3, 2)]
    plan = plan_iteration(cfg, running, [])
    # decodes go first (b, c fit in their blocks); a then cannot preempt already-scheduled ones: it waits
    assert plan.items == [("b", 1), ("c", 1)] and not plan.preempted
    # when b and c are not decoding yet (prefilling), a preempts c then b for its blocks
    running = [run("a", 16, 8, 0), SeqView("b", 8, 4, blocks_held=1), SeqView("c", 8, 4, blocks_held=1)]
    plan = plan_iteration(cfg, running, [])
    assert plan.preempted == ["c", "b"] and plan.items == [("a", 8)]


def test_a_preempted_sequence_recomputes_its_prompt_and_output() -> None:
    cfg = BatchConfig(
        max_batch=8, max_batch_tokens=64, prefill_chunk_tokens=16, kv_budget_tokens=64, block_size=4
    )
    # back in the queue with 10 prompt tokens and 7 generated: it recomputes 16 (a chunk), then the rest
    plan = plan_iteration(cfg, [], [SeqView("p", 10, 0, output_len=7)])
    assert plan.items == [("p", 16)]
    plan = plan_iteration(cfg, [SeqView("p", 10, 16, output_len=7, blocks_held=4)], [])
    assert plan.items == [("p", 1)]  # the last known token: a decode that yields the 8th output token


def test_random_workload_never_oversubscribes_the_pool() -> None:
    """Drive the planner and a block manager together: every plan's growth fits, nothing leaks."""
    rng = random.Random(3)
    cfg = BatchConfig(
        max_batch=6, max_batch_tokens=32, prefill_chunk_tokens=8, kv_budget_tokens=128, block_size=4
    )
    bm = BlockManager(cfg.num_blocks, cfg.block_size)
    seqs: dict[str, dict[str, int]] = {}
    running: list[str] = []
    waiting: list[str] = []
    finished = 0
    for step in range(3000):
        if rng.random() < 0.3 and len(waiting) < 10:
            sid = f"q{step}"
            seqs[sid] = {"prompt": rng.randint(1, 40), "max": rng.randint(1, 60), "computed": 0, "out": 0}
            waiting.append(sid)

        def view(sid: str) -> SeqView:
            s = seqs[sid]
            return SeqView(sid, s["prompt"], s["computed"], output_len=s["out"], blocks_held=bm.held(sid))

        plan = plan_iteration(
            cfg, [view(s) for s in running], [view(s) for s in waiting], free_blocks=bm.num_free
        )
        for sid in plan.preempted:
            bm.free(sid)
            seqs[sid]["computed"] = 0
            running.remove(sid)
        waiting = list(plan.preempted) + [s for s in waiting if s not in plan.admitted]
        running += plan.admitted
        for sid, n in plan.items:
            s = seqs[sid]
            bm.grow(sid, s["computed"] + n)  # raises if the plan oversubscribed the pool
            s["computed"] += n
            if s["computed"] == s["prompt"] + s["out"]:
                s["out"] += 1
                if s["out"] >= s["max"]:
                    bm.free(sid)
                    running.remove(sid)
                    finished += 1
        bm.check()
        assert sum(bm.held(s) for s in running) == bm.num_used
    assert finished > 100


def test_a_request_alone_may_take_the_whole_pool() -> None:
    # 4 blocks, a first chunk that needs all 4: admitted when nothing runs (no watermark to keep).
    cfg = BatchConfig(
        max_batch=4, max_batch_tokens=64, prefill_chunk_tokens=16, kv_budget_tokens=16, block_size=4
    )
    assert plan_iteration(cfg, [], [SeqView("a", 16, 0)]).admitted == ["a"]


def test_attention_groups_bound_the_padding_and_keep_decodes_apart() -> None:
    from collm_replica.engine.executor import attention_groups

    q = [1, 1, 1, 1, 128, 1, 40]
    k = [200, 1500, 210, 1400, 300, 190, 2000]
    groups = attention_groups(q, k, max_padding=1.3)
    assert sorted(i for g in groups for i in g) == list(range(len(q)))
    for g in groups:
        assert len({q[i] == 1 for i in g}) == 1  # decodes never share a call with a chunk
        padded = len(g) * max(q[i] for i in g) * max(k[i] for i in g)
        assert padded <= 1.3 * sum(q[i] * k[i] for i in g) or len(g) == 1
    assert [1, 3] in groups and [2, 0, 5] in groups  # long contexts together, short ones together
    assert attention_groups([1] * 4, [100] * 4) == [[0, 1, 2, 3]]  # equal lengths: one call
