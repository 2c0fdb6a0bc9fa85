"""`n` choices from one prefill: each choice decodes as its own request would, the prompt is computed
once, chunks of all choices share one gapless numbering, one `Finished` sums them, and cancellation,
failures and a pool too small to copy the prompt for every choice all end cleanly."""

from __future__ import annotations

import time

import pytest

from collm_replica.engine import Engine, EngineConfig, EngineRequest
from collm_replica.engine.cosched import NoTraining
from collm_replica.engine.types import EngineRefusal
from collm_replica.models import LoadedModel
from tests.unit.replica.helpers import Collector, submit_all
from tests.unit.replica.test_engine import P1, P2, hf_greedy
from tests.unit.replica.test_engine_paged import drive, small_pool


def by_choice(c: Collector, n: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for e in c.events:
        if e.kind == "token":
            out[e.index].extend(e.token_ids)
    return out


def choices(rid: str, ids: list[int], max_tokens: int, n: int) -> EngineRequest:
    return EngineRequest(rid, ids, n=n, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def sampled(rid: str, ids: list[int], n: int, seed: int, max_tokens: int = 12) -> EngineRequest:
    return EngineRequest(
        rid, ids, n=n, max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True
    )


def test_greedy_choices_share_one_prefill_and_equal_the_single_answer(tiny: LoadedModel) -> None:
    want = hf_greedy(tiny, P1, 10)
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        before = eng.prefill_tokens_total
        res = submit_all(eng, [choices("g", P1, 10, 3)])["g"]
        prefilled = eng.prefill_tokens_total - before
        blocks = eng.kv_pool.blocks
        assert blocks.num_free == blocks.num_blocks
        blocks.check()
    assert prefilled == len(P1)  # the prompt was computed once for the three choices
    assert by_choice(res, 3) == [want, want, want]
    fin = res.finished
    assert fin.completion_tokens == 30 and fin.finish_reason == "length"
    assert fin.choices is not None and [
        (c.index, c.finish_reason, c.completion_tokens) for c in fin.choices
    ] == [
        (0, "length", 10),
        (1, "length", 10),
        (2, "length", 10),
    ]
    seqs = [e.seq for e in res.events if e.kind in ("token", "finished")]
    assert seqs == list(range(len(seqs)))
    assert [e for e in res.events if e.kind == "finished"] == [fin]


def test_seeded_choice_i_draws_as_a_single_request_seeded_seed_plus_i(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        res = submit_all(
            eng,
            [
                sampled("n", P2, 3, seed=40),
                sampled("s0", P2, 1, 40),
                sampled("s1", P2, 1, 41),
                sampled("s2", P2, 1, 42),
            ],
        )
    choices = by_choice(res["n"], 3)
    assert choices == [res["s0"].token_ids, res["s1"].token_ids, res["s2"].token_ids]
    assert len({tuple(c) for c in choices}) > 1
    assert res["s0"].finished.choices is None


def test_a_choice_recomputes_the_prompt_when_the_pool_cannot_copy_it(tiny: LoadedModel) -> None:
    # 12 blocks of 4 tokens, 9 of them held elsewhere: the two-choice request's prompt (11 tokens) takes
    # the other 3, so at its first token choice 1 cannot copy the prompt and queues to recompute it; it
    # is admitted once the blocks come back, and ends with the same greedy answer.
    eng = Engine(tiny, small_pool(48), NoTraining())  # driven by hand, no thread
    blocks = eng.kv_pool.blocks
    blocks.grow("held-elsewhere", 36)
    c = Collector()
    eng.submit(choices("g", P1, 4, 2), c)
    drive(eng, lambda: any(e.kind == "token" and e.index == 1 for e in c.events))
    assert [s.index for s in eng.waiting] == [1] and all(s.kv is not None for s in eng.running)
    blocks.free("held-elsewhere")
    drive(eng, c.done.is_set)
    want = hf_greedy(tiny, P1, 4)
    assert by_choice(c, 2) == [want, want]
    assert c.finished.completion_tokens == 8
    assert blocks.num_free == blocks.num_blocks
    blocks.check()
    eng.stop()


def test_cancel_ends_every_choice_and_frees_every_block(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        c = Collector()
        eng.submit(choices("long", P1, 400, 3), c)
        while len({e.index for e in c.events if e.kind == "token"}) < 3:
            time.sleep(0.001)
        assert eng.cancel("long")
        assert c.done.wait(5)
        deadline = time.monotonic() + 5
        while eng.kv_pool.blocks.num_used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.kv_pool.blocks.num_used == 0
        assert not eng._active
    fin = c.finished
    assert fin.finish_reason == "cancelled" and fin.choices is not None
    assert {x.finish_reason for x in fin.choices} == {"cancelled"}


def test_too_many_choices_are_refused_naming_n(tiny: LoadedModel) -> None:
    with Engine(tiny, small_pool(64), NoTraining()) as eng:
        for n in (5, 2):  # more than max_batch=4; two copies of 11 + 40 tokens exceed 64
            with pytest.raises(EngineRefusal) as err:
                eng.submit(choices("x", P1, 40, n), Collector())
            assert err.value.code == 400 and err.value.param == "n"
        assert submit_all(eng, [choices("one", P1, 40, 1)])["one"].finished.completion_tokens == 40
