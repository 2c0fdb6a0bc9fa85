"""Pure policies of the replica: batch scheduler, co-schedulers, LRU, cost model, text streaming."""

from __future__ import annotations

import pytest

from collm_common.stats import percentile
from collm_replica.costs import FinishedSample, LatencyWindow, LinearCost, StepCosts
from collm_replica.engine.cosched import (
    CoSchedInput,
    FixedRatioCoScheduler,
    LeftoverCoScheduler,
    NoTraining,
    ReqTiming,
    SloAwareCoScheduler,
    StepModel,
    TrainCost,
    arrival_guard_s,
    behind_schedule,
    effective_share,
    likely_arrivals,
    make_coscheduler,
    request_deadlines,
    running_timing,
)
from collm_replica.engine.scheduler import BatchConfig, SeqView, plan_iteration
from collm_replica.lru import VersionLru
from collm_replica.sampling import StopMatcher


def sv(i: str, prompt: int, computed: int = 0, reserve: int | None = None) -> SeqView:
    return SeqView(i, prompt, computed, reserve if reserve is not None else prompt + 16)


# --- batching ------------------------------------------------------------------------------------------
def test_decodes_first_then_prefill_chunks_within_budget() -> None:
    cfg = BatchConfig(max_batch=8, max_batch_tokens=20, prefill_chunk_tokens=8, kv_budget_tokens=10_000)
    running = [sv("d1", 5, 6), sv("p1", 30, 8), sv("d2", 5, 9)]
    plan = plan_iteration(cfg, running, [sv("w1", 40)], kv_reserved=100)
    assert plan.items == [("d1", 1), ("d2", 1), ("p1", 8), ("w1", 8)]
    assert plan.admitted == ["w1"] and plan.tokens == 18


def test_budget_cuts_the_last_prefill_chunk() -> None:
    cfg = BatchConfig(max_batch=8, max_batch_tokens=10, prefill_chunk_tokens=8, kv_budget_tokens=10_000)
    plan = plan_iteration(cfg, [sv("d", 3, 4)], [sv("a", 20), sv("b", 20)], 0)
    assert plan.items == [("d", 1), ("a", 8), ("b", 1)]


def test_reserve_admission_respects_max_batch_and_kv_budget_fcfs() -> None:
    cfg = BatchConfig(
        max_batch=2,
        max_batch_tokens=100,
        prefill_chunk_tokens=8,
        kv_budget_tokens=100,
        kv_admission="reserve",
    )
    plan = plan_iteration(cfg, [sv("r", 4, 5, 20)], [sv("a", 10, 0, 90), sv("b", 4, 0, 10)], 20)
    assert plan.admitted == []  # a does not fit the KV budget; b must not overtake it (FCFS)
    plan = plan_iteration(cfg, [sv("r", 4, 5, 20)], [sv("b", 4, 0, 10), sv("c", 4, 0, 10)], 20)
    assert plan.admitted == ["b"]  # max_batch 2


def test_not_ready_sequences_are_skipped() -> None:
    cfg = BatchConfig()
    plan = plan_iteration(cfg, [], [SeqView("a", 4, 0, 8, ready=False), sv("b", 4)], 0)
    assert plan.admitted == ["b"]


def test_batch_config_validates() -> None:
    with pytest.raises(ValueError):
        BatchConfig(max_batch=0)


# --- co-scheduling -----------------------------------------------------------------------------------
def inp(**kw: object) -> CoSchedInput:
    base: dict[str, object] = {
        "now_s": 100.0,
        "share": 0.5,
        "has_job": True,
        "running": 4,
        "waiting": 0,
        "inference_tokens": 4,
        "token_budget": 64,
        "step_ms": 20.0,
        "deadlines_s": (100.5,),
        "train": TrainCost(10.0, 1.0),
        "micro_tokens": 64,
        "batch_tokens": 256,
    }
    base.update(kw)
    return CoSchedInput(**base)  # type: ignore[arg-type]


def primed(share: float = 0.5) -> SloAwareCoScheduler:
    p = SloAwareCoScheduler(margin_ms=5.0, slack_frac=1.0)
    p.decide(inp(now_s=99.0, share=share, has_job=False))
    return p


def test_slo_trains_when_slack_allows() -> None:
    assert primed().decide(inp()) == 64  # slack 500-20-5 ms fits 10+64 ms


def test_slo_shrinks_the_micro_step_to_the_slack() -> None:
    # slack = 60 - 20 - 5 = 35 ms -> (35 - 10) / 1 = 25 tokens
    assert primed().decide(inp(deadlines_s=(100.060,))) == 25


def test_slo_pauses_when_load_rises() -> None:
    p = primed()
    assert p.decide(inp()) == 64
    assert p.decide(inp(now_s=100.01, deadlines_s=(100.03,), waiting=5)) == 0  # no slack left


def test_slo_idle_replica_trains_and_share_zero_never() -> None:
    assert SloAwareCoScheduler().decide(inp(running=0, waiting=0, deadlines_s=())) == 64
    assert primed(0.0).decide(inp(share=0.0)) == 0
    assert primed().decide(inp(has_job=False)) == 0


def test_slo_share_is_a_time_budget() -> None:
    p = primed(0.1)  # 1 s at 10% -> 100 ms of credit
    assert p.decide(inp(share=0.1)) == 64
    p.charge(150.0)  # spent more than the credit
    assert p.decide(inp(now_s=100.1, share=0.1)) == 0
    assert p.decide(inp(now_s=101.0, share=0.1, deadlines_s=(101.5,))) == 64  # credit came back


def test_slo_says_what_bounded_training() -> None:
    p = primed()
    p.budget_ms(inp(has_job=False))
    assert p.limit == "no_job"
    p.budget_ms(inp(share=0.0))
    assert p.limit == "share"
    p.budget_ms(inp(running=0, waiting=0, deadlines_s=(), max_train_ms=300.0))
    assert p.limit == "idle"
    # slack 500 - 20 - 5 = 475 ms: a guard of 100 ms binds, one of 1 s does not
    assert p.budget_ms(inp(max_train_ms=100.0)) == 100.0 and p.limit == "guard"
    assert p.budget_ms(inp(max_train_ms=1000.0)) == pytest.approx(475.0) and p.limit == "slack"
    p.charge(10_000.0)  # the share's time credit is spent
    assert p.budget_ms(inp(now_s=100.01)) == 0.0 and p.limit == "share"


def test_slo_spend_trains_beyond_the_slack_for_its_part_of_the_share() -> None:
    # No slack at all (a deadline now), but a spend of 0.5 of a share of 0.4: training takes 0.2 of the
    # wall time under load in stretches of 300 ms, once the spend's credit holds a whole stretch.
    p = SloAwareCoScheduler(margin_ms=5.0, slack_frac=1.0)
    busy = {"share": 0.4, "spend": 0.5, "spend_stretch_ms": 300.0, "max_train_ms": 50.0}
    p.budget_ms(inp(now_s=0.0, deadlines_s=(0.0,), **busy))
    trained_ms, t = 0.0, 0.0
    while t < 60.0:
        t = round(t + 0.05, 3)
        ms = p.budget_ms(inp(now_s=t, deadlines_s=(t,), **busy))
        assert ms in (0.0, 300.0)
        if ms:
            assert p.limit == "spend"
            p.charge(ms)
            trained_ms += ms
    assert trained_ms / 60_000 == pytest.approx(0.2, abs=0.01)


def test_slo_spend_only_adds_to_the_slack_and_stops_with_the_spend() -> None:
    p = primed()
    busy = {"spend": 1.0, "spend_stretch_ms": 300.0}
    # slack 475 ms under a guard of 1 s: more than a stretch, so the slack decides, not the spend
    assert p.budget_ms(inp(max_train_ms=1000.0, **busy)) == pytest.approx(475.0) and p.limit == "slack"
    p.budget_ms(inp(now_s=101.0, deadlines_s=(101.0,), **busy))  # credit accrues while serving
    assert p.budget_ms(inp(now_s=101.1, deadlines_s=(101.1,), **busy)) == 300.0
    # The spend withdrawn (0): training is back to the slack only, and the credit is gone
    assert p.budget_ms(inp(now_s=102.0, deadlines_s=(102.0,), spend=0.0)) == 0.0
    assert p.budget_ms(inp(now_s=102.1, deadlines_s=(102.1,), spend_stretch_ms=300.0)) == 0.0
    assert p.spend_credit_ms == 0.0


def test_fixed_ratio_trains_a_full_step_every_k_iterations_blindly() -> None:
    p = FixedRatioCoScheduler(every=4)
    got = [p.decide(inp(iteration=i, deadlines_s=(100.001,))) for i in range(8)]
    assert got == [256, 0, 0, 0, 256, 0, 0, 0]


def test_leftover_fills_spare_budget() -> None:
    p = LeftoverCoScheduler()
    assert p.decide(inp(inference_tokens=40)) == 24
    assert p.decide(inp(inference_tokens=60)) == 0  # 4 spare < min 8
    assert p.decide(inp(running=0, inference_tokens=0)) == 64


def test_make_coscheduler_and_off() -> None:
    assert make_coscheduler("off").decide(inp()) == 0
    assert isinstance(make_coscheduler("off"), NoTraining)
    assert make_coscheduler("fixed", 3).every == 3  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        make_coscheduler("nope")


@pytest.mark.parametrize("name", ["slo", "fixed", "leftover", "off"])
def test_no_coscheduler_trains_without_a_job_or_a_share(name: str) -> None:
    """The contract `scheduler.decide_background` relies on to skip the requests' deadlines: nothing to
    train without a job or with a share of 0, idle or loaded, with every slack in the world."""
    for kw in ({"has_job": False}, {"share": 0.0}, {"share": 0.0, "running": 0}):
        p = make_coscheduler(name)
        p.decide(inp(now_s=90.0, share=1.0, has_job=False))  # credit, for the policies that keep one
        for deadlines in ((), (1e9,)):
            case = inp(deadlines_s=deadlines, max_train_ms=1e6, **kw)
            assert p.decide(case) == 0
            assert getattr(p, "budget_ms", lambda _i: 0.0)(case) == 0.0


def test_effective_share_ttl() -> None:
    assert effective_share(10.0, 0.8, 20.0, 0.3) == (0.8, "coordinator")
    assert effective_share(25.0, 0.8, 20.0, 0.3) == (0.3, "local_default")
    assert effective_share(10.0, None, None, 0.3) == (0.3, "local_default")


# --- LRU ------------------------------------------------------------------------------------------------
def test_lru_prefers_superseded_then_least_recent_and_skips_in_use() -> None:
    lru = VersionLru(3)
    lru.add("a@v1", "a", 0)
    lru.add("b@v1", "b", 1)
    lru.add("a@v2", "a", 2)  # a@v1 superseded
    lru.acquire("b@v1")
    lru.release("b@v1")
    assert lru.slot_for_new() == (0, lru.by_id["a@v1"])
    lru.acquire("a@v1")  # an in-flight request still reads a@v1
    assert lru.victim().version_id == "a@v2"  # type: ignore[union-attr]  # b@v1 was used after a@v2
    lru.acquire("b@v1")
    lru.acquire("a@v2")
    assert lru.slot_for_new() is None
    with pytest.raises(ValueError):
        lru.evict("a@v1")
    assert lru.current_of("a") == "a@v2"


def test_lru_add_not_current_keeps_current() -> None:
    lru = VersionLru(2)
    lru.add("a@v3", "a", 0)
    lru.add("a@v1", "a", 1, current=False)  # a pinned old version
    assert lru.current_of("a") == "a@v3"
    lru.make_current("a@v1")
    assert lru.current_of("a") == "a@v1"
    with pytest.raises(ValueError):
        lru.add("a@v1", "a", 1)
    with pytest.raises(ValueError):
        lru.release("a@v3")


# --- costs and windows -----------------------------------------------------------------------------------
def test_linear_cost_learns_fixed_and_slope() -> None:
    c = LinearCost(0.0, 0.0)
    for units in (1, 2, 4, 8, 16, 32) * 5:
        c.observe(units, 10 + 2 * units)
    fixed, per = c.params()
    assert fixed == pytest.approx(10, abs=1e-6) and per == pytest.approx(2, abs=1e-6)
    one = LinearCost(5.0, 3.0)
    one.observe(4, 20.0)
    assert one.predict(4) == pytest.approx(20.0)


def test_step_costs_price_a_prefill_token_beyond_a_decode_step_of_as_many_sequences() -> None:
    c = StepCosts()
    # Before any prefill-bearing step: the slope of the steps' line.
    assert c.prefill_ms_per_token() == pytest.approx(2.0)
    c.observe(sequences=4, tokens=4, prefill_tokens=0, ms=100.0)
    # Three decodes and a 32-token chunk (4 sequences, 35 tokens): 64 ms beyond the decode step of 4,
    # 2 ms per prefill token (not 164 / 35 ms, the step's time over all its tokens).
    c.observe(sequences=4, tokens=35, prefill_tokens=32, ms=164.0)
    assert c.prefill_ms_per_token() == pytest.approx(2.0)
    c.observe(sequences=4, tokens=35, prefill_tokens=32, ms=196.0)  # 3 ms per token, smoothed by 0.2
    assert c.prefill_ms_per_token() == pytest.approx(0.8 * 2.0 + 0.2 * 3.0)
    # A chunk under 16 tokens, or a step whose size has no decode-only measurement, teaches nothing.
    c.observe(sequences=4, tokens=12, prefill_tokens=9, ms=500.0)
    c.observe(sequences=7, tokens=70, prefill_tokens=64, ms=900.0)
    assert c.prefill_ms_per_token() == pytest.approx(2.2)
    assert c.decode_at(4) == 100.0 and c.decode_ms == {4: 100.0}
    c.observe(sequences=4, tokens=4, prefill_tokens=0, ms=110.0)
    assert c.decode_at(4) == pytest.approx(102.0)
    assert c.decode_at(9) == pytest.approx(c.line.predict(9))  # never seen: the line


def test_latency_window_percentiles_and_attainment() -> None:
    w = LatencyWindow(10.0)
    for i in range(10):
        w.add(FinishedSample(float(i), ttft_ms=float(i * 10), tpot_ms=5.0, good=i < 8))
    s = w.summary(9.0)
    assert s["finished"] == 10 and s["good"] == 8 and s["slo_attainment"] == 0.8
    assert s["ttft_ms_p50"] == 45.0 and s["ttft_ms_p99"] == pytest.approx(89.1)  # linear between ranks
    assert w.summary(15.5)["finished"] == 4  # t=6..9 remain in the window
    assert percentile([], 50) is None


# --- stop strings ------------------------------------------------------------------------------------------
def test_stop_matcher_holds_back_possible_prefixes() -> None:
    m = StopMatcher(["END"])
    assert m.push("hello E") == "hello "
    assert m.push("N") == ""
    assert m.push("x") == "ENx"
    assert m.push(" fin") == " fin"
    assert m.push("EN") == ""
    assert m.push("D more") == ""
    assert m.stopped


def test_stop_matcher_earliest_of_several_and_flush() -> None:
    m = StopMatcher(["zz", "ab"])
    assert m.push("xxa") == "xx"
    assert m.push("bzz") == ""
    assert m.stopped
    f = StopMatcher(["###"])
    assert f.push("a#") == "a"
    assert f.flush() == "#"


def test_slo_spends_only_part_of_the_slack() -> None:
    p = SloAwareCoScheduler(margin_ms=5.0, slack_frac=0.5)
    p.decide(inp(now_s=99.0, has_job=False))
    # slack = 60 - 20 - 5 = 35 ms, half of it 17.5 ms -> (17.5 - 10) / 1 = 7 tokens < min 8 -> no training
    assert p.decide(inp(deadlines_s=(100.060,))) == 0
    assert p.decide(inp(now_s=100.001, deadlines_s=(100.101,))) == 27  # (75 * 0.5 - 10) / 1


def test_slo_bounds_the_micro_step_for_future_arrivals() -> None:
    # Plenty of slack (500 ms) but at most 40 ms of training: (40 - 10) / 1 = 30 tokens.
    assert primed().decide(inp(max_train_ms=40.0)) == 30


def test_slo_idle_training_is_bounded_by_the_arrival_guard() -> None:
    p = SloAwareCoScheduler()
    idle = {"running": 0, "waiting": 0, "deadlines_s": ()}
    assert p.decide(inp(**idle, max_train_ms=40.0)) == 30  # type: ignore[arg-type]
    # A guard too short for even `min_tokens`: an idle replica still trains `min_tokens` (progress is
    # guaranteed; the engine itself runs such a step in layer-sized pieces).
    assert p.decide(inp(**idle, max_train_ms=12.0)) == 8  # type: ignore[arg-type]


def test_slo_training_progresses_when_a_micro_step_is_longer_than_the_guard() -> None:
    """A long example (a micro-step predicted at 950 ms + 8 ms/token) never starves training: an idle
    replica gets the whole guard (the engine fills it with layer-sized pieces), callers that run whole
    micro-steps get at least `min_tokens`, and under load any slack becomes a time budget."""
    long_step = TrainCost(950.0, 8.0)
    idle = inp(running=0, waiting=0, deadlines_s=(), train=long_step, max_train_ms=400.0)
    assert SloAwareCoScheduler().budget_ms(idle) == 400.0
    assert SloAwareCoScheduler().decide(idle) == 8
    busy = inp(deadlines_s=(100.5,), train=long_step, max_train_ms=400.0)
    assert primed().budget_ms(busy) == 400.0  # slack 500 - 20 - 5 = 475 ms, capped by the guard
    assert primed().budget_ms(inp(deadlines_s=(100.1,), train=long_step)) == pytest.approx(75.0)
    assert primed().budget_ms(inp(deadlines_s=(100.02,), train=long_step)) == 0.0  # no slack: none


def test_background_budget_ignores_share_and_job_but_not_slack() -> None:
    from collm_replica.engine.cosched import background_budget_ms

    assert (
        background_budget_ms(inp(has_job=False, share=0.0, running=0, deadlines_s=(), max_train_ms=80.0))
        == 80.0
    )
    assert background_budget_ms(inp(has_job=False, deadlines_s=(100.1,)), 5.0, 0.5) == pytest.approx(37.5)
    assert background_budget_ms(inp(deadlines_s=(100.01,)), 5.0, 0.5) == 0.0


# --- request deadlines ---------------------------------------------------------------------------------
def model(**kw: float) -> StepModel:
    base: dict[str, float] = {
        "decode_step_s": 0.1,
        "prefill_s_per_token": 0.001,
        "max_batch": 4,
        "max_batch_tokens": 64,
        "prefill_chunk_tokens": 32,
    }
    base.update(kw)
    return StepModel(**base)  # type: ignore[arg-type]


def decoding(first_s: float, next_index: int, left: int = 10) -> ReqTiming:
    return ReqTiming(0.0, 5.0, 0.2, first_s=first_s, next_index=next_index, tokens_left=left)


def test_decoding_deadline_is_its_accumulated_tpot_budget_minus_the_next_step() -> None:
    # Token 3 is due at 10 + 3 * 0.2; the next step (0.1 s) must start by then.
    assert request_deadlines([decoding(10.0, 3)], [], model()) == pytest.approx((10.5,))


def test_queued_prompts_lengthen_the_next_step() -> None:
    waiting = [ReqTiming(10.0, 1.0, 0.2, prompt_left=40, tokens_left=8)]
    d = request_deadlines([decoding(10.0, 3)], waiting, model())
    # the next step prefills min(40, 64 - 1) tokens: 0.1 + 0.04 s
    assert d[0] == pytest.approx(10.6 - 0.14)
    # the waiting request: its 40 tokens take two chunks of 32, so two iterations, before its first token
    assert d[1] == pytest.approx(11.0 - 2 * 0.1 - 0.04)


def test_prefill_ahead_spreads_over_iterations() -> None:
    waiting = [ReqTiming(10.0, 1.0, 0.2, prompt_left=60, tokens_left=8) for _ in range(2)]
    d = request_deadlines([], waiting, model(max_batch_tokens=64, prefill_chunk_tokens=64))
    assert d[0] == pytest.approx(11.0 - 1 * 0.1 - 0.06)
    assert d[1] == pytest.approx(11.0 - 2 * 0.1 - 0.12)  # 120 tokens ahead: two iterations


def test_a_full_batch_delays_waiting_requests_until_a_slot_frees() -> None:
    running = [decoding(10.0, 3, left=left) for left in (7, 2, 9, 5)]  # the batch of 4 is full
    waiting = [ReqTiming(10.0, 3.0, 0.2, prompt_left=10, tokens_left=8) for _ in range(2)]
    d = request_deadlines(running, waiting, model())
    # first waiting: 2 iterations until the earliest finishes, then 1 to prefill its 10 tokens
    assert d[4] == pytest.approx(13.0 - 3 * 0.1 - 0.01)
    # second: the next to finish has 5 tokens left
    assert d[5] == pytest.approx(13.0 - 6 * 0.1 - 0.02)
    # the queue does not lengthen the next step: nobody can be admitted into it
    assert d[0] == pytest.approx(10.6 - 0.1)


def test_prefilling_request_counts_whole_iterations() -> None:
    pre = ReqTiming(10.0, 1.0, 0.2, prompt_left=40, tokens_left=8)
    d = request_deadlines([pre], [], model(prefill_chunk_tokens=16))
    assert d == pytest.approx((11.0 - 3 * 0.1 - 0.04,))  # 40 tokens in chunks of 16: 3 iterations


def test_arrival_guard_leaves_an_arrival_its_ttft() -> None:
    running = [decoding(10.0, 3, left=20) for _ in range(2)]
    # room in the batch: the arrival waits this step (0.1), then one iteration (0.1 + 30 prefill tokens)
    assert arrival_guard_s(running, [], model(), 0.1, 1.0, 30) == pytest.approx(1.0 - 0.2 - 0.03)
    # a 40-token prompt takes two chunks of 32: two iterations, a stretch in each gap
    assert arrival_guard_s(running, [], model(), 0.1, 1.0, 40) == pytest.approx((1.0 - 0.3 - 0.04) / 2)


def test_arrival_guard_is_nothing_when_the_batch_is_full_and_far_from_done() -> None:
    full = [decoding(10.0, 3, left=20) for _ in range(4)]
    assert arrival_guard_s(full, [], model(), 0.1, 1.0, 40) == 0.0  # 20 steps before a slot frees
    nearly_done = [decoding(10.0, 3, left=left) for left in (2, 20, 20, 20)]
    # 2 iterations until a slot frees, 1 to prefill: 1.0 - 0.1 - 3 * 0.1 - 0.03 spread over 3 gaps
    assert arrival_guard_s(nearly_done, [], model(), 0.1, 1.0, 30) == pytest.approx(0.57 / 3)


def test_arrival_guard_keeps_room_for_a_likely_burst() -> None:
    three = [decoding(10.0, 3, left=20) for _ in range(3)]  # one free slot of 4
    one = arrival_guard_s(three, [], model(), 0.1, 1.0, 30, arrivals=1)
    assert one == pytest.approx(1.0 - 0.2 - 0.03)
    # Two arrivals likely within the SLO: the second finds the batch full, 20 steps from a free slot.
    assert arrival_guard_s(three, [], model(), 0.1, 1.0, 30, arrivals=2) == 0.0


def test_deadline_paced_work_is_behind_when_done_lags_the_elapsed_share() -> None:
    # A 10-s window paced to finish at 80% of it (8 s): at 4 s, half must be done.
    assert behind_schedule(0.4, now_s=4.0, start_s=0.0, deadline_s=10.0)
    assert not behind_schedule(0.5, now_s=4.0, start_s=0.0, deadline_s=10.0)
    assert not behind_schedule(0.0, now_s=0.0, start_s=0.0, deadline_s=10.0)
    # Past 80% of the window everything should be done; finished work is never behind.
    assert behind_schedule(0.99, now_s=9.0, start_s=0.0, deadline_s=10.0)
    assert not behind_schedule(1.0, now_s=11.0, start_s=0.0, deadline_s=10.0)
    # A deadline already gone (or none left): behind until done.
    assert behind_schedule(0.2, now_s=5.0, start_s=5.0, deadline_s=4.0)
    assert behind_schedule(0.2, now_s=5.0, start_s=0.0, deadline_s=10.0, finish_frac=0.5)


def test_running_timing_is_the_request_after_the_step() -> None:
    # Its last prefill chunk: the step emits the first token, counted from the step's start.
    last_chunk = running_timing(10.0, 9.0, 2.0, 0.2, None, 100, 60, 0, 8, 40)
    assert last_chunk == ReqTiming(9.0, 2.0, 0.2, 10.0, 1, 0, 7)
    # A chunk that leaves prompt to prefill emits nothing.
    assert running_timing(10.0, 9.0, 2.0, 0.2, None, 100, 0, 0, 8, 40) == ReqTiming(
        9.0, 2.0, 0.2, None, 0, 60, 8
    )
    # Decoding: one more token; not scheduled this step: as it is.
    assert running_timing(10.0, 9.0, 2.0, 0.2, 9.5, 100, 100, 3, 8, 1) == ReqTiming(
        9.0, 2.0, 0.2, 9.5, 4, 0, 4
    )
    assert running_timing(10.0, 9.0, 2.0, 0.2, 9.5, 100, 100, 3, 8, 0) == ReqTiming(
        9.0, 2.0, 0.2, 9.5, 3, 0, 5
    )


def test_likely_arrivals_follow_the_recent_rate_within_bounds() -> None:
    assert likely_arrivals(0, 0.0, 0.0, 2.0) == likely_arrivals(1, 5.0, 5.0, 2.0) == 1
    assert likely_arrivals(10, 0.0, 10.0, 2.0) == 2  # 1 per s over 2 s
    assert likely_arrivals(11, 0.0, 10.0, 2.0) == 3  # rounded up
    assert likely_arrivals(100, 0.0, 10.0, 2.0) == 4  # at most 4
    assert likely_arrivals(3, 0.0, 0.1, 2.0) == 3  # a burst: the span is at least the window asked about
