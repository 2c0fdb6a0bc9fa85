"""The engine over the paged KV cache on the tiny model: preemption (recompute) keeps greedy outputs and
versions, blocks come back on finish and cancel, reserve admission runs fewer requests at once."""

from __future__ import annotations

import time
from collections.abc import Callable

from collm_replica.engine import Engine, EngineConfig
from collm_replica.engine.cosched import NoTraining
from collm_replica.engine.scheduler import BatchConfig
from collm_replica.models import LoadedModel
from tests.unit.replica.helpers import Collector, greedy, random_adapter, submit_all
from tests.unit.replica.test_engine import P1, P2, P3, hf_greedy


def small_pool(tokens: int, admission: str = "paged", max_resident: int = 8) -> EngineConfig:
    return EngineConfig(
        batch=BatchConfig(
            max_batch=4,
            max_batch_tokens=32,
            prefill_chunk_tokens=8,
            kv_budget_tokens=tokens,
            block_size=4,
            kv_admission=admission,  # type: ignore[arg-type]
        ),
        max_resident_adapters=max_resident,
    )


def test_preempted_requests_resume_with_the_same_greedy_output(tiny: LoadedModel) -> None:
    # 16 blocks of 4 tokens hold any one of the three (35, 30, 37 tokens) but not all together.
    with Engine(tiny, small_pool(64), NoTraining()) as eng:
        res = submit_all(eng, [greedy("a", P1, 24), greedy("b", P2, 24), greedy("c", P3, 24)])
        assert eng.preemptions_total > 0
        blocks = eng.kv_pool.blocks
        assert blocks.num_free == blocks.num_blocks  # every block came back
        blocks.check()
    for rid, p in (("a", P1), ("b", P2), ("c", P3)):
        assert res[rid].token_ids == hf_greedy(tiny, p, 24)
        assert res[rid].finished.finish_reason == "length"
        assert [e.seq for e in res[rid].events if e.kind == "token"] == list(range(24))


def drive(eng: Engine, until: Callable[[], bool], limit: int = 2000) -> None:
    for _ in range(limit):
        if until():
            return
        eng._iteration()
    raise AssertionError("the engine did not get there")


def test_a_preempted_request_keeps_its_start_version_across_a_swap(tiny: LoadedModel) -> None:
    v1, v2 = random_adapter(tiny, 1), random_adapter(tiny, 2)
    with Engine(tiny, EngineConfig(), NoTraining()) as ref:
        ref.install_version("med@v1", v1).result(10)
        want = submit_all(ref, [greedy("r", P1, 24, adapter="med")])["r"].token_ids
    eng = Engine(tiny, small_pool(48), NoTraining())  # 12 blocks; driven by hand, no thread
    f = eng.install_version("med@v1", v1)
    drive(eng, f.done)
    first, old = Collector(), Collector()
    eng.submit(greedy("x", P3, 30), first)  # 43 tokens at most
    eng.submit(greedy("old", P1, 24, adapter="med"), old)  # 35: both cannot finish together
    drive(eng, lambda: eng.preemptions_total > 0)
    assert "old" in {s.req.request_id for s in eng.waiting}  # the latest arrival was the victim
    f = eng.install_version("med@v9", v2)
    drive(eng, f.done)
    assert eng.current_version("med") == "med@v9"
    drive(eng, lambda: old.done.is_set() and first.done.is_set())
    assert old.accepted.adapter_version_id == old.finished.adapter_version_id == "med@v1"
    assert old.token_ids == want
    assert first.token_ids == hf_greedy(tiny, P3, 30)
    assert eng.kv_pool.blocks.num_free == eng.kv_pool.blocks.num_blocks
    eng.stop()


def test_cancel_frees_the_blocks_at_once(tiny: LoadedModel) -> None:
    with Engine(tiny, small_pool(256), NoTraining()) as eng:
        c = Collector()
        eng.submit(greedy("long", P1, 200), c)
        while len(c.token_ids) < 2:
            time.sleep(0.001)
        assert eng.kv_pool.blocks.num_used > 0
        assert eng.cancel("long")
        assert c.done.wait(5)
        deadline = time.monotonic() + 5
        while eng.kv_pool.blocks.num_used and time.monotonic() < deadline:
            time.sleep(0.001)
        assert eng.kv_pool.blocks.num_used == 0


def test_paged_admission_runs_more_requests_at_once_than_reserve(tiny: LoadedModel) -> None:
    """Four requests asking for 100 new tokens each (106 with the prompt) in a pool of 256 tokens:
    reserving prompt + max_tokens admits two at a time; paging admits all four."""
    running: dict[str, int] = {}
    for admission in ("reserve", "paged"):
        eng = Engine(tiny, small_pool(256, admission), NoTraining())
        for i in range(4):
            eng.submit(greedy(f"r{i}", P2, 100), Collector())
        eng._iteration()
        running[admission] = len(eng.running)
        eng.stop()
    assert running == {"reserve": 2, "paged": 4}
