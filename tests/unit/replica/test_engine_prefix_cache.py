"""The prefix cache in the engine on the tiny model: a request served from cached blocks answers exactly
as without the cache (greedy), concurrent requests and the `n` choices of one share blocks, each adapter
version (and each installation of one) has its own blocks, training and its local refreshes keep
working, and the hit counters reach the snapshot and the metrics."""

from __future__ import annotations

import random
import time

from prometheus_client import REGISTRY

from collm_common.lora import AdapterWeights
from collm_replica import metrics, vllm_metrics
from collm_replica.engine import Engine, EngineConfig, EngineRequest
from collm_replica.engine.cosched import NoTraining, SloAwareCoScheduler
from collm_replica.engine.scheduler import BatchConfig
from collm_replica.lora_bank import LiveLora
from collm_replica.models import LoadedModel
from collm_replica.training import JobConfig, JobSpec
from tests.unit.replica.helpers import Collector, greedy, random_adapter, submit_all
from tests.unit.replica.test_engine import P1, P2, P3, dataset
from tests.unit.replica.test_engine_paged import drive

SYSTEM = [(7 * i + 3) % 380 + 2 for i in range(21)]  # a shared "system prompt": 5 full blocks of 4


def config(caching: bool, kv_tokens: int = 1024, **kw: object) -> EngineConfig:
    return EngineConfig(
        batch=BatchConfig(
            max_batch=8,
            max_batch_tokens=64,
            prefill_chunk_tokens=16,
            kv_budget_tokens=kv_tokens,
            block_size=4,
        ),
        prefix_caching=caching,
        **kw,  # type: ignore[arg-type]
    )


def one(eng: Engine, req: EngineRequest) -> Collector:
    return submit_all(eng, [req])[req.request_id]


def served(eng: Engine, req: EngineRequest) -> tuple[list[int], int, int]:
    """`req`'s greedy output, and the tokens it looked up in the cache and found there."""
    q, h = eng.prefix_cache_queries_total, eng.prefix_cache_hits_total
    out = one(eng, req).token_ids
    return out, eng.prefix_cache_queries_total - q, eng.prefix_cache_hits_total - h


def test_requests_served_from_the_cache_answer_as_without_it(tiny: LoadedModel) -> None:
    first = SYSTEM + P1
    prompts = {
        "first": first,
        "same-system": SYSTEM + P2,
        "other-system": SYSTEM + P3,
        "repeat": first,
        "shorter": SYSTEM[:12],  # 3 full blocks: 2 hit, the last one holds the token to compute
    }
    with Engine(tiny, config(False), NoTraining()) as off:
        want = {rid: one(off, greedy(rid, p, 12)).token_ids for rid, p in prompts.items()}
        turn = first + want["first"] + P2  # a second turn: the first answer's blocks came from decoding
        want["turn"] = one(off, greedy("turn", turn, 12)).token_ids
        assert off.prefix_cache_queries_total == off.prefix_cache_hits_total == 0
    got, hits = {}, {}
    with Engine(tiny, config(True), NoTraining()) as on:
        for rid, p in [*prompts.items(), ("turn", turn)]:
            got[rid], queried, hits[rid] = served(on, greedy(rid, p, 12))
            assert queried == len(p)
        blocks = on.kv_pool.blocks
        assert blocks.num_used == 0 and blocks.num_cached > 0
        blocks.check()
    assert got == want
    assert hits == {
        "first": 0,
        "same-system": 20,
        "other-system": 20,
        "repeat": 28,  # 32 prompt tokens: 7 blocks, the eighth holds the last token
        "shorter": 8,
        "turn": 40,  # the first turn's prompt and the output it fed back (43 tokens): 10 whole blocks
    }


def test_concurrent_requests_share_the_prefix_while_it_is_in_use(tiny: LoadedModel) -> None:
    eng = Engine(tiny, config(True), NoTraining())  # driven by hand, no thread
    a, b, c = Collector(), Collector(), Collector()
    eng.submit(greedy("a", SYSTEM + P1, 40), a)
    drive(eng, lambda: len(a.token_ids) >= 1)
    eng.submit(greedy("b", SYSTEM + P2, 8), b)
    eng.submit(greedy("c", SYSTEM + P3, 8), c)
    drive(eng, lambda: len(b.token_ids) >= 1 and len(c.token_ids) >= 1)
    blocks = eng.kv_pool.blocks
    shared = blocks.table(eng.running[0].kv.seq_id)[:5]  # type: ignore[union-attr]
    assert [blocks.refs(x) for x in shared] == [3] * 5  # a, b and c read one copy of the system prompt
    blocks.check()
    drive(eng, lambda: a.done.is_set() and b.done.is_set() and c.done.is_set())
    assert eng.prefix_cache_hits_total == 40
    eng.stop()
    with Engine(tiny, config(False), NoTraining()) as off:
        want = submit_all(
            off, [greedy("a", SYSTEM + P1, 40), greedy("b", SYSTEM + P2, 8), greedy("c", SYSTEM + P3, 8)]
        )
    assert [x.token_ids for x in (a, b, c)] == [want[r].token_ids for r in "abc"]


def test_choices_share_the_prompt_blocks_and_copy_only_the_last_partial_one(tiny: LoadedModel) -> None:
    prompt = SYSTEM + P1  # 32 tokens: 8 full blocks
    eng = Engine(tiny, config(True), NoTraining())
    c = Collector()
    eng.submit(EngineRequest("n", prompt[:30], n=3, max_tokens=6, temperature=0.0, ignore_eos=True), c)
    drive(eng, lambda: len({e.index for e in c.events if e.kind == "token"}) == 3)
    blocks = eng.kv_pool.blocks
    tables = [blocks.table(s.kv.seq_id) for s in eng.running]  # type: ignore[union-attr]
    assert len(tables) == 3 and tables[0][:7] == tables[1][:7] == tables[2][:7]  # 7 full blocks, shared
    assert len({t[7] for t in tables}) == 3  # the partial eighth block: one copy per choice
    drive(eng, c.done.is_set)
    eng.stop()
    with Engine(tiny, config(False), NoTraining()) as off:
        want = one(off, greedy("one", prompt[:30], 6)).token_ids
    per_choice: list[list[int]] = [[], [], []]
    for e in c.events:
        if e.kind == "token":
            per_choice[e.index].extend(e.token_ids)
    assert per_choice == [want, want, want]


def test_each_adapter_version_and_installation_has_its_own_blocks(tiny: LoadedModel) -> None:
    w1, w2, w3 = (random_adapter(tiny, s) for s in (1, 2, 3))
    prompt = SYSTEM + P3

    def run(eng: Engine) -> list[tuple[list[int], int]]:
        out = []
        eng.install_version("med@v1", w1).result(10)
        for rid, adapter, version in [
            ("base", None, None),
            ("v1", "med", "med@v1"),
            ("base-again", None, None),
            ("v1-again", "med", "med@v1"),
        ]:
            tokens, _, hit = served(eng, greedy(rid, prompt, 10, adapter=adapter, version=version))
            out.append((tokens, hit))
        eng.install_version("med@v2", w2).result(10)  # a new version: current
        tokens, _, hit = served(eng, greedy("v2", prompt, 10, adapter="med"))
        out.append((tokens, hit))
        assert eng.offload_version("med@v1").result(10)
        eng.install_version("med@v1", w3, make_current=False).result(10)  # the same id installed again
        tokens, _, hit = served(eng, greedy("v1-reinstalled", prompt, 10, adapter="med", version="med@v1"))
        out.append((tokens, hit))
        return out

    with Engine(tiny, config(True), NoTraining()) as on:
        got = run(on)
    with Engine(tiny, config(False), NoTraining()) as off:
        want = run(off)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [h for _, h in got] == [0, 0, 32, 32, 0, 0]  # only the same installation's blocks are found
    assert len({tuple(t) for t, _ in got[:2] + got[4:]}) == 4  # four sets of weights: four answers


def test_a_local_refresh_never_reads_the_blocks_of_the_version_it_came_from(tiny: LoadedModel) -> None:
    cfg = config(True, job=JobConfig(micro_tokens=32, batch_tokens=32, publish_every_steps=1000))
    prompt = SYSTEM + P2
    with Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset()) as eng:
        w = random_adapter(tiny, 1)
        eng.install_version("med@v1", w).result(10)
        before, _, _ = served(eng, greedy("before", prompt, 10, adapter="med"))
        live = LiveLora.from_weights(w, eng.executor.n_layers, eng.executor.shapes)
        eng.start_job(JobSpec("med", "med@v1", 1, live, token_budget=10**6, learning_rate=1e-2)).result(10)
        deadline = time.monotonic() + 30
        while eng.snapshot().jobs[0].steps_done < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        eng.pause_training().result(10)
        refresh = eng.publish_now("med").result(10)
        assert refresh is not None and eng.current_version("med") == refresh
        weights: AdapterWeights = live.to_weights()  # what the refresh installed (training paused)
        eng.resume_training().result(10)
        after, _, hit = served(eng, greedy("after", prompt, 10, adapter="med"))  # while training goes on
        again, _, hit_again = served(eng, greedy("again", prompt, 10, adapter="med"))
        assert eng.snapshot().jobs[0].state == "running"
    assert (hit, hit_again) == (0, 24)  # 27 prompt tokens: 6 whole blocks before the last token
    assert after == again
    with Engine(tiny, config(False), NoTraining()) as off:
        off.install_version(refresh, weights).result(10)
        assert one(off, greedy("ref", prompt, 10, adapter="med")).token_ids == after
        off.install_version("med@v1", w, make_current=False).result(10)
        assert one(off, greedy("ref1", prompt, 10, adapter="med", version="med@v1")).token_ids == before


def test_preempted_requests_find_their_own_blocks_and_answer_the_same(tiny: LoadedModel) -> None:
    # 24 blocks of 4: the three requests (43 to 47 prompt tokens, 16 new ones each; a and c alike) cannot
    # all run at once.
    reqs = [greedy(r, SYSTEM + p + p, 16) for r, p in (("a", P1), ("b", P3), ("c", P1))]
    with Engine(tiny, config(True, kv_tokens=96), NoTraining()) as on:
        got = submit_all(on, reqs)
        assert on.preemptions_total > 0 and on.prefix_cache_hits_total > 0
        on.kv_pool.blocks.check()
    with Engine(tiny, config(False, kv_tokens=96), NoTraining()) as off:
        want = submit_all(off, [greedy(r.request_id, r.prompt_ids, 16) for r in reqs])
    assert {r: c.token_ids for r, c in got.items()} == {r: c.token_ids for r, c in want.items()}


def test_the_hit_counters_reach_the_snapshot_and_the_metrics(tiny: LoadedModel) -> None:
    with Engine(tiny, config(True), NoTraining()) as eng:
        submit_all(eng, [greedy("a", SYSTEM + P1, 2)])
        submit_all(eng, [greedy("b", SYSTEM + P2, 2)])
        snap = eng.snapshot()
        metrics.ENGINE_TOKENS.attach("prefix-test", lambda: eng)
        try:
            scraped = {
                fam.name: s.value
                for fam in REGISTRY.collect()
                if fam.name.startswith("collm_replica_prefix_cache_")
                for s in fam.samples
                if s.labels.get("replica") == "prefix-test"
            }
        finally:
            metrics.ENGINE_TOKENS.detach("prefix-test")
    assert (snap.prefix_cache_queries_total, snap.prefix_cache_hits_total) == (32 + 27, 20)
    assert scraped == {
        "collm_replica_prefix_cache_query_tokens": 59.0,
        "collm_replica_prefix_cache_hit_tokens": 20.0,
    }
    labels = {"model_name": "m-prefix", "engine": "e-prefix"}
    vllm_metrics.record_prefix_cache("m-prefix", "e-prefix", 59, 20)
    vllm_metrics.record_prefix_cache("m-prefix", "e-prefix", 70, 28)
    vllm_metrics.record_prefix_cache("m-prefix", "e-prefix", 5, 1)  # a new engine under the same labels
    assert REGISTRY.get_sample_value("vllm:prefix_cache_queries_total", labels) == 75
    assert REGISTRY.get_sample_value("vllm:prefix_cache_hits_total", labels) == 29


def test_a_crowded_pool_with_shared_prefixes_and_choices_answers_as_without_the_cache(
    tiny: LoadedModel,
) -> None:
    """Requests over three system prompts, some with two choices, in a pool that forces preemptions:
    no request fails for want of blocks, every answer equals the uncached one, no block leaks."""
    rng = random.Random(5)
    systems = [[(k * 31 + 7 * i) % 380 + 2 for i in range(rng.randint(9, 30))] for k in range(3)]
    reqs = []
    for i in range(12):
        prompt = rng.choice(systems) + [rng.randrange(2, 380) for _ in range(rng.randint(1, 9))]
        n = 2 if i % 4 == 1 else 1
        reqs.append(EngineRequest(f"r{i}", prompt, n=n, max_tokens=rng.randint(4, 14), temperature=0.0,
                                  ignore_eos=True))  # fmt: skip

    def answers(caching: bool) -> dict[str, list[list[int]]]:
        with Engine(tiny, config(caching, kv_tokens=128), NoTraining()) as eng:
            res = submit_all(eng, [EngineRequest(**vars(r)) for r in reqs], timeout_s=120)
            assert eng.preemptions_total > 0
            eng.kv_pool.blocks.check()
            assert eng.kv_pool.blocks.num_used == 0
            if caching:
                assert eng.prefix_cache_hits_total > 0
        out = {}
        for rid, c in res.items():
            assert c.finished.finish_reason == "length", rid
            per: list[list[int]] = [[] for _ in range(2)]
            for e in c.events:
                if e.kind == "token":
                    per[e.index].extend(e.token_ids)
            out[rid] = per
        return out

    assert answers(True) == answers(False)
