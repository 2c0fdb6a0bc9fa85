"""The simulator: deterministic for a seed, goodput accounting (docs/architecture.md, Goodput), the engine's
timing."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from collm_coordinator.core import CoreConfig
from collm_sim import SimConfig, Simulation, WorkloadSpec, simulate
from collm_sim.config import EngineSpec
from collm_sim.quality import QualityModel
from collm_sim.workload import Workload
from tests.unit.sim.calib import calibration_for_tests

pytestmark = pytest.mark.unit


def workload(
    arrivals: list[float], n_in: int = 100, n_out: int = 5, ttft: float = 2000.0, tpot: float = 250.0
) -> Workload:
    n = len(arrivals)
    return Workload(
        arrival_s=np.array(arrivals, dtype=float),
        input_tokens=np.full(n, n_in, dtype=np.int64),
        output_tokens=np.full(n, n_out, dtype=np.int64),
        domain=np.zeros(n, dtype=np.int64),
        domains=("bank", "med"),
        ttft_slo_ms=ttft,
        tpot_slo_ms=tpot,
        duration_s=max(arrivals) + 1 if arrivals else 1.0,
        description="test",
    )


def synthetic(rate: float = 20.0, duration: float = 120.0, seed: int = 0, **kw: object) -> WorkloadSpec:
    return WorkloadSpec(arrivals="gamma", trace=None, rate_rps=rate, duration_s=duration, burstiness=0.5,
                        input_tokens=120, output_tokens=24, seed=seed, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_one_request_has_the_engine_timing() -> None:
    # One 100-token prompt, 5 output tokens, alone on one replica: prefill in one chunk of 100 tokens
    # (10 + 100 x 1 ms = 110 ms) emits the first token; four decode steps of 20 ms each emit the rest.
    cfg = SimConfig(replicas=1, policy="separate", samples_per_replica=0)
    res = Simulation(cfg, calibration_for_tests(), workload([0.5])).run()
    (rec,) = res.records
    assert rec.status == "ok"
    assert rec.ttft_ms == pytest.approx(110.0)
    assert rec.e2e_ms == pytest.approx(110.0 + 4 * 20.0)
    assert rec.completion_tokens == 5 and rec.adapter_version == "bank@v1"
    assert res.summary["counts"]["good"] == 1
    assert res.summary["latency_ms"]["tpot"]["p50"] == pytest.approx(20.0)


def test_lora_overhead_scales_the_step() -> None:
    cfg = SimConfig(replicas=1, policy="separate", samples_per_replica=0)
    res = Simulation(cfg, calibration_for_tests(lora_overhead=0.5), workload([0.5])).run()
    assert res.records[0].ttft_ms == pytest.approx(110.0 * 1.5)


def test_attention_costs_grow_with_context() -> None:
    # Decode steps measured at 100 tokens of context, +0.1 ms per token beyond; a prefill token +0.01 ms
    # per earlier token. Chunks of 64: the 100-token prompt is 64 tokens (10 + 64 ms) then 36 tokens
    # after 64 earlier ones (10 + 36 + 0.01 x 36 x 64 ms); the four decodes see 100..103 earlier tokens.
    cal = calibration_for_tests()
    cost = cal.cost.model_copy(
        update={
            "decode_context_tokens": 100,
            "decode_ms_per_context_token": 0.1,
            "prefill_ms_per_token_per_context_token": 0.01,
        }
    )
    cal = cal.model_copy(update={"cost": cost})
    cfg = SimConfig(
        replicas=1, policy="separate", samples_per_replica=0, engine=EngineSpec(prefill_chunk_tokens=64)
    )
    (rec,) = Simulation(cfg, cal, workload([0.5])).run().records
    assert rec.ttft_ms == pytest.approx(74.0 + 46.0 + 23.04)
    assert rec.e2e_ms == pytest.approx(rec.ttft_ms + 20.0 + 20.1 + 20.2 + 20.3)
    # The cost model says the same of each step.
    assert cost.decode_ms(1, 103) == pytest.approx(20.3) and cost.decode_ms(16) == 50.0
    assert cost.decode_ms(16, 16 * 90) == pytest.approx(50.0 - 0.1 * 16 * 10)
    assert cost.prefill_chunk_ms(36, 64) == pytest.approx(36 + 23.04) and cost.prefill_chunk_ms(0, 64) == 0


def test_goodput_counts_only_good_and_attainment_counts_everything() -> None:
    # A burst of 12 requests at one instant into one replica with a queue of 4: the first is admitted to
    # the batch at once, 4 wait, the other 7 are rejected (the gateway's retries have nowhere else to go);
    # the late ones of those served miss a tight TTFT SLO.
    eng = replace(EngineSpec(), max_queue=4, max_batch=2)
    cfg = SimConfig(replicas=1, policy="separate", samples_per_replica=0, engine=eng)
    res = Simulation(cfg, calibration_for_tests(), workload([1.0] * 12, ttft=300.0)).run()
    s = res.summary
    by = s["counts"]["by_status"]
    assert (by["ok"], by["rejected"]) == (5, 7)
    assert s["counts"]["submitted"] == 12
    assert by["ok"] + by["rejected"] + by["timeout"] == 12
    good = sum(1 for r in res.records if r.status == "ok" and r.ttft_ms <= 300.0)
    assert s["counts"]["good"] == good < by["ok"]
    assert s["attainment"] == pytest.approx(good / 12)
    assert s["goodput_rps"] == pytest.approx(good / s["duration_s"])


def test_waiting_past_the_deadline_is_a_timeout() -> None:
    eng = replace(EngineSpec(), max_batch=1)
    cfg = SimConfig(replicas=1, policy="separate", samples_per_replica=0, engine=eng, request_timeout_s=0.5)
    # Long outputs hold the only batch slot; the later requests wait past 0.5 s and are dropped.
    res = Simulation(cfg, calibration_for_tests(), workload([0.0, 0.01, 0.02], n_out=60)).run()
    statuses = [r.status for r in res.records]
    assert statuses[0] == "ok" and statuses.count("timeout") == 2
    assert res.summary["counts"]["good"] <= 1


@pytest.mark.parametrize("policy", ["collm", "separate", "fixed_ratio", "leftover"])
def test_deterministic_for_a_seed(policy: str) -> None:
    cal = calibration_for_tests()
    core = {"slow_interval_s": 20.0, "round_deadline_s": 15.0}
    cfg = SimConfig(replicas=4, policy=policy, workload=synthetic(rate=10.0, duration=50.0), core=core)
    a, b = simulate(cfg, cal), simulate(cfg, cal)
    assert [r.to_json() for r in a.records] == [r.to_json() for r in b.records]
    for key in (
        "ft_tokens",
        "ft_tokens_published",
        "rounds",
        "quality_gain_by_domain",
        "events",
        "iterations",
    ):
        assert a.sim[key] == b.sim[key], key
    assert a.summary["goodput_rps"] == b.summary["goodput_rps"]
    c = simulate(replace(cfg, workload=synthetic(rate=10.0, duration=50.0, seed=1), seed=1), cal)
    assert [r.to_json() for r in c.records] != [r.to_json() for r in a.records]


def test_rounds_train_and_publish_and_quality_follows_the_curve() -> None:
    cal = calibration_for_tests()
    cfg = SimConfig(replicas=4, policy="leftover", workload=synthetic(rate=2.0, duration=100.0),
                    core={"slow_interval_s": 30.0, "round_deadline_s": 20.0})  # fmt: skip
    sim = Simulation(cfg, cal)
    res = sim.run()
    assert res.sim["rounds"]["published"] >= 4
    assert res.sim["ft_tokens_published"] > 0
    assert res.sim["ft_tokens_published"] <= res.sim["ft_tokens"]
    q = QualityModel(cal.quality)
    for d, gain in res.sim["quality_gain_by_domain"].items():
        assert gain == pytest.approx(q.gain(d, sim.trained_tokens[d]))
        assert gain > 0
    # Requests record the exact version that served them; later versions have lower loss.
    versions = {r.adapter_version for r in res.records if r.status == "ok"}
    assert any(v.endswith("@v1") for v in versions) and any(not v.endswith("@v1") for v in versions)
    assert res.summary["quality"]["available"] is not False


def test_job_time_counts_each_round_jobs_span_by_how_it_ended() -> None:
    """`job_s` sums, over replicas, the time from each round job's start to its end; no job outlives its
    round (20 s from its opening), so the total is at most 20 s per participant of each round."""
    cal = calibration_for_tests()
    cfg = SimConfig(replicas=4, policy="leftover", workload=synthetic(rate=2.0, duration=100.0),
                    core={"slow_interval_s": 30.0, "round_deadline_s": 20.0})  # fmt: skip
    sim = Simulation(cfg, cal)
    res = sim.run()
    job_s = res.sim["job_s"]
    assert set(job_s) == {"budget", "stop", "replaced"}
    total = sum(job_s.values())
    assert total > 0
    spans = sum(len(r.participants) * 20.0 for r in sim.rounds.values())  # each job within its round
    assert total <= spans + 1e-6
    assert res.sim["job_time_frac"] == pytest.approx(total / (4 * sim.now), rel=1e-4)


def test_participants_send_the_aggregators_publish_lead_before_the_round_deadline() -> None:
    """As the aggregator (`collm_aggregator.lead`): a round's participants train until its deadline less
    the publish lead: 5 s before any round published, then 1.25x the longest close-to-publication time
    of the adapter's last rounds, at most a quarter of the round; the collection still closes at the
    deadline. With `publish_lead_s=0` they train to the deadline."""
    cal = calibration_for_tests()
    core = {"slow_interval_s": 30.0, "round_deadline_s": 24.0}

    Jobs = list[tuple[str, int, float, float]]  # (adapter, round, opened at, send by)
    Pubs = list[tuple[str, float, float]]  # (adapter, published at, close to publication)

    def run(**kw: Any) -> tuple[Simulation, Jobs, Pubs]:
        wl = synthetic(rate=2.0, duration=120.0)
        cfg = SimConfig(replicas=2, policy="leftover", workload=wl, core=core, **kw)  # type: ignore[arg-type]
        sim = Simulation(cfg, cal)
        jobs: Jobs = []
        pubs: Pubs = []
        for rep in sim.replicas.values():

            def start(adapter: str, round_id: int, base: int, budget: int, deadline_s: float, now: float,
                      f: Any = rep.start_job) -> None:  # fmt: skip
                jobs.append((adapter, round_id, now, deadline_s))
                f(adapter, round_id, base, budget, deadline_s, now)

            rep.start_job = start  # type: ignore[method-assign]

        def publish(rnd: Any, t: float, f: Any = sim.aggregator.publish) -> None:
            pubs.append((rnd.adapter, t, t - rnd.closed_s))
            f(rnd, t)

        sim.aggregator.publish = publish  # type: ignore[method-assign]
        sim.run()
        return sim, jobs, pubs

    sim, jobs, pubs = run()
    measured = 0
    for adapter, rid, opened_s, send_by_s in jobs:
        rnd = sim.rounds[rid]
        before = [dt for a, t, dt in pubs if t <= opened_s and a == adapter][-5:]
        before = before or [dt for _, t, dt in pubs if t <= opened_s][-5:]
        lead_s = min(1.25 * max(before) if before else 5.0, 0.25 * (rnd.deadline_s - opened_s))
        measured += bool(before)
        assert send_by_s == pytest.approx(rnd.deadline_s - lead_s)
    assert len(jobs) >= 4 and measured >= 2 and pubs
    assert all(dt > 0 for _, _, dt in pubs)

    sim, jobs, _ = run(publish_lead_s=0.0)
    assert jobs and all(send_by_s == sim.rounds[rid].deadline_s for _, rid, _, send_by_s in jobs)
    with pytest.raises(ValueError, match="publish_lead"):
        SimConfig(publish_lead_s=-1.0)


def test_separate_keeps_requests_off_the_training_side() -> None:
    cal = calibration_for_tests()
    cfg = SimConfig(replicas=4, policy="separate", workload=synthetic(rate=3.0, duration=60.0))
    sim = Simulation(cfg, cal)
    sim.run()
    train = {rid for rid, r in sim.replicas.items() if r.ft_tokens_total > 0}
    assert len(train) == 1
    served = {r.replica for r in sim.requests if r.arrival_s > 10.0}
    assert not served & train


def test_collm_cuts_training_when_load_rises() -> None:
    cal = calibration_for_tests()
    core = {"slow_interval_s": 30.0, "round_deadline_s": 25.0}
    light = simulate(
        SimConfig(replicas=4, policy="collm", workload=synthetic(rate=1.0, duration=90.0), core=core), cal
    )
    heavy = simulate(
        SimConfig(replicas=4, policy="collm", workload=synthetic(rate=40.0, duration=90.0), core=core), cal
    )
    assert light.sim["ft_tokens"] > 2 * heavy.sim["ft_tokens"]


def test_a_share_reaches_a_replica_as_the_coordinator_service_sends_it() -> None:
    """Shares are sent when they change or are half their TTL old (`share_command_due`), not every
    tick, and only a share sent, a round's job started or a request ends a busy replica's training
    stretch: under the fixed ratio's constant share, the stretches run as the co-scheduler granted them."""
    cal = calibration_for_tests()
    core = {"slow_interval_s": 30.0, "round_deadline_s": 25.0}
    cfg = SimConfig(replicas=2, policy="fixed_ratio", workload=synthetic(rate=2.0, duration=60.0), core=core)
    sim = Simulation(cfg, cal)
    ttl_s = CoreConfig().share_ttl_s
    sent: dict[str, list[tuple[float, float]]] = {rid: [] for rid in sim.replicas}  # (when, share)
    cut: dict[str, list[float]] = {rid: [] for rid in sim.replicas}
    started: dict[str, set[float]] = {rid: set() for rid in sim.replicas}
    for rid, rep in sim.replicas.items():

        def record_start(*args: Any, rid: str = rid, f: Any = rep.start_job) -> None:
            started[rid].add(round(args[-1], 6))
            f(*args)

        def record_share(
            share: float, expires_s: float, spend: float = 0.0, rid: str = rid, f: Any = rep.set_share
        ) -> None:
            sent[rid].append((expires_s - ttl_s, share))
            f(share, expires_s, spend)

        def record_cut(now: float, rid: str = rid, f: Any = rep.interrupt) -> float | None:
            end = f(now)
            if end is not None:
                cut[rid].append(now)
            return end

        rep.set_share, rep.interrupt, rep.start_job = record_share, record_cut, record_start  # type: ignore[method-assign]
    res = sim.run()
    assert res.sim["ft_tokens"] > 0
    arrivals = {float(t) for t in sim.workload.arrival_s}
    ticks = len(sim.share_samples)
    for rid in sim.replicas:
        assert 0 < len(sent[rid]) < ticks / 2, (rid, len(sent[rid]), ticks)
        for (t_a, share_a), (t_b, share_b) in itertools.pairwise(sent[rid]):
            assert abs(share_a - share_b) >= 1e-3 or t_b - t_a >= ttl_s / 2 - 1e-6
        # Every stretch cut short was cut by a request, a share that was sent or a job that started.
        sent_at = {round(t, 6) for t, _ in sent[rid]} | started[rid]
        assert cut[rid], rid
        assert all(t in arrivals or round(t, 6) in sent_at for t in cut[rid])


def test_quality_model_interpolates_between_measured_points() -> None:
    q = QualityModel(calibration_for_tests().quality, extrapolate="hold")
    assert q.loss("med", 0) == 3.0
    assert q.loss("med", 1_000) == pytest.approx(2.8)
    mid = q.loss("med", math.expm1((math.log1p(1_000) + math.log1p(10_000)) / 2))
    assert mid == pytest.approx((2.8 + 2.5) / 2)
    assert q.loss("med", 10**9) == pytest.approx(2.2), "hold: no gain past the last measured point"
    assert q.gain("med", 100_000) == pytest.approx(0.8)


def test_quality_model_extrapolates_along_the_fitted_curve_up_to_a_bound() -> None:
    q = QualityModel(calibration_for_tests().quality, extrapolate="log", max_factor=10.0)
    at_last = q.loss("med", 100_000)
    assert at_last == pytest.approx(2.2)
    further = q.loss("med", 500_000)
    assert further < at_last
    assert q.loss("med", 1_000_000) == pytest.approx(q.loss("med", 10**9)), "held past max_factor"
    # Never worse with more tokens.
    losses = [q.loss("med", t) for t in (0, 500, 1_000, 5_000, 10_000, 50_000, 100_000, 300_000, 2_000_000)]
    assert all(b <= a + 1e-12 for a, b in zip(losses, losses[1:], strict=False))


def test_unknown_domain_and_bad_config_are_refused() -> None:
    with pytest.raises(ValueError, match="no quality curve"):
        Simulation(SimConfig(domains=("law",)), calibration_for_tests())
    with pytest.raises(ValueError, match="unknown policy"):
        SimConfig(policy="fastest")


def test_training_runs_in_pieces_that_yield_to_an_arrival_and_carry_over() -> None:
    """As the engine: a stretch of whole pieces; an arrival ends it after the piece in progress; the
    micro-step carries over and its tokens count when it completes."""
    from collm_replica.engine.cosched import LeftoverCoScheduler
    from collm_sim.replica import SimReplica

    done: list[object] = []
    rep = SimReplica(
        "r0", calibration_for_tests().cost, EngineSpec(train_micro_tokens=128, train_pieces_per_micro_step=4),
        LeftoverCoScheduler(), "med", 100, {}, 2000.0, 250.0, 60.0, done.append,
        lambda _r, job, _t: done.append(job),
    )  # fmt: skip
    rep.start_job("med", 1, 1, budget=1000, deadline_s=1e9, now=0.0)
    # idle: one micro-step of 128 tokens (20 + 128 x 1 ms = 148 ms) in 4 pieces of 37 ms
    assert rep.step(0.0) == pytest.approx(0.148)
    assert rep.interrupt(0.05) == pytest.approx(0.074)  # the piece in progress (37-74 ms) completes
    assert rep.interrupt(0.06) is None  # already cut there
    assert rep.step(0.074) == pytest.approx(0.074 + 0.148)
    assert rep.ft_tokens_total == 0 and rep.job is not None and rep.job.progress_ms == pytest.approx(74.0)
    rep.step(0.222)  # 74 + 148 ms: the micro-step completed, 74 ms of the next one carried over
    assert rep.ft_tokens_total == 128 and rep.job.progress_ms == pytest.approx(74.0)


def eval_replica(
    engine: EngineSpec, cosched: object, done: list[object], ttft_ms: float = 2000.0, tpot_ms: float = 250.0
) -> object:
    from collm_sim.replica import SimReplica

    cost = calibration_for_tests(eval_cost=(10.0, 0.5)).cost
    return SimReplica(
        "r0", cost, engine, cosched, "med", 100, {}, ttft_ms, tpot_ms, 60.0,  # type: ignore[arg-type]
        done.append, lambda _r, job, _t: done.append(job),
    )  # fmt: skip


def test_a_round_job_only_trains_as_the_engines_does() -> None:
    """As the engine's round job: no evaluation of its own (the aggregator's gate scores the candidate),
    so its whole training time goes to its micro-steps, with or without evaluation costs known."""
    from collm_replica.engine.cosched import LeftoverCoScheduler

    engine = EngineSpec(
        train_micro_tokens=128, train_pieces_per_micro_step=4, train_batch_tokens=128,
        eval_tokens=100, eval_batch_tokens=100, eval_pieces_per_batch=2,
    )  # fmt: skip
    done: list[object] = []
    rep = eval_replica(engine, LeftoverCoScheduler(), done)
    assert rep.eval_ms_each == pytest.approx(60.0)  # type: ignore[attr-defined]  # 10 + 100 x 0.5 ms
    rep.start_job("med", 1, 1, budget=256, deadline_s=1e9, now=0.0)  # type: ignore[attr-defined]
    # Two micro-steps of 148 ms: 296 ms, 8 whole pieces of 37 ms.
    assert rep.bg.ms_to_finish(rep.job) == pytest.approx(8 * 37.0)  # type: ignore[attr-defined]
    t = 0.0
    while (nxt := rep.step(t)) is not None:  # type: ignore[attr-defined]
        t = nxt
    (job,) = done
    assert job.tokens_done == 256 and job.done  # type: ignore[attr-defined]
    assert rep.busy_ms["evaluation"] == 0.0  # type: ignore[attr-defined]
    assert rep.busy_ms["training"] == pytest.approx(1e3 * t)  # type: ignore[attr-defined]
    # A calibration without the evaluation cost: the same micro-steps.
    from collm_sim.replica import SimReplica

    plain = SimReplica(
        "r1", calibration_for_tests().cost, engine, LeftoverCoScheduler(), "med", 100, {}, 2000.0, 250.0,
        60.0, done.append, lambda _r, job, _t: done.append(job),
    )  # fmt: skip
    plain.start_job("med", 1, 1, budget=256, deadline_s=1e9, now=0.0)
    assert plain.eval_ms_each is None and plain.bg.ms_to_finish(plain.job) == pytest.approx(296.0)  # type: ignore[arg-type]


def test_the_background_windows_are_the_replicas_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each iteration's training window is what the replica's `scheduler.decide_background` grants,
    asked with the requests as the engine's `Sequence.timing` shows them; a preempted request waits
    with its prompt and output to recompute and the rest of its output to generate."""
    import collm_sim.batch as sim_batch
    import collm_sim.windows as sim_windows
    from collm_replica.engine.cosched import SloAwareCoScheduler
    from collm_replica.engine.scheduler import BackgroundDecision, BackgroundInput, timings

    real = sim_windows.decide_background
    seen: list[tuple[BackgroundInput, BackgroundDecision]] = []

    def spy(inp: BackgroundInput, settings: Any, policy: Any) -> BackgroundDecision:
        d = real(inp, settings, policy)
        seen.append((inp, d))
        return d

    monkeypatch.setattr(sim_windows, "decide_background", spy)
    done: list[object] = []
    engine = EngineSpec(train_micro_tokens=32, train_pieces_per_micro_step=4)
    rep: Any = eval_replica(engine, SloAwareCoScheduler(), done, ttft_ms=2000.0, tpot_ms=400.0)
    rep.set_share(1.0, 1e9)
    rep.start_job("med", 1, 1, budget=100_000, deadline_s=1e9, now=0.0)
    req = sim_batch.Req(0, 0.0, 100, 20, "med")
    rep.enqueue(req, 0.0)
    t: float | None = 0.0
    trained = 0
    while t is not None and req.t_end is None:
        t = rep.step(t)
        if t is None:
            break
        inp, d = seen[-1]
        _, _, t_ev, t_train, _ = rep.pending
        assert (t_train - t_ev) * 1e3 <= max(0.0, d.train_ms) + 1e-6
        trained += (t_train - t_ev) > 0
        if inp.running:
            (view,) = inp.running
            assert (view.max_tokens, view.prompt_len) == (20, 100)
            assert (view.n_output, view.computed) == (req.generated, req.computed)  # before the step's tokens
    assert len(seen) > 5 and trained > 0 and req.status == "ok"
    # A request preempted after 7 tokens: 107 tokens to recompute, 13 to generate.
    late = sim_batch.Req(1, 0.0, 100, 20, "med")
    late.generated, late.computed, late.target = 7, 0, 107
    (_, (waiting,), _) = timings(0.0, [], [rep.batch.request_view(late)], [], rep.settings, 20.0, 1.0)
    assert (waiting.prompt_left, waiting.tokens_left) == (107, 13)


def test_the_background_input_is_built_by_the_engines_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated replica's decision input comes from the engine's `scheduler.background_input` on
    its state: the tightest TTFT SLO of the requests present and of the arrivals within the SLO window
    (the engine's default once they left it), the coordinator's share and spend until its TTL, the job
    as the engine's `JobView` shows it, the round-robin counter the last decision returned."""
    import collm_sim.windows as sim_windows
    from collm_replica.engine.cosched import SloAwareCoScheduler
    from collm_replica.engine.scheduler import BackgroundDecision, BackgroundInput, JobView
    from collm_sim.batch import Req

    real = sim_windows.decide_background
    seen: list[tuple[BackgroundInput, BackgroundDecision]] = []

    def spy(inp: BackgroundInput, settings: Any, policy: Any) -> BackgroundDecision:
        d = real(inp, settings, policy)
        seen.append((inp, d))
        return d

    monkeypatch.setattr(sim_windows, "decide_background", spy)
    engine = EngineSpec(train_micro_tokens=32, train_pieces_per_micro_step=4, slo_window_s=30.0)
    rep: Any = eval_replica(engine, SloAwareCoScheduler(), [], ttft_ms=150.0, tpot_ms=50.0)
    rep.set_share(0.5, 10.0, 0.2)
    rep.start_job("med", 1, 1, budget=100_000, deadline_s=1e9, now=0.0)
    req = Req(0, 0.0, 20, 2, "med")
    rep.enqueue(req, 0.0)
    t = 0.0
    while req.t_end is None:
        t = rep.step(t)
    first, _ = seen[0]
    assert (first.min_ttft_slo_ms, first.share, first.spend) == (pytest.approx(150.0), 0.5, 0.2)
    assert first.jobs == [JobView(due=False, in_progress=False)] and not first.training_paused
    assert first.iteration == 0 and first.job_rr == 0
    for (_, before), (after, _) in itertools.pairwise(seen):
        assert after.job_rr == before.job_rr
    assert seen[-1][1].job_rr >= 1
    rep.step(40.0)  # the arrival left the SLO window and the share its TTL
    late, _ = seen[-1]
    assert late.min_ttft_slo_ms == engine.default_ttft_slo_ms
    assert (late.share, late.spend) == (engine.ft_share_default, 0.0)


def test_a_gate_evaluation_takes_the_idle_time_and_one_piece_per_iteration_under_load() -> None:
    from collm_replica.engine.cosched import SloAwareCoScheduler
    from collm_sim.background import EvalTask
    from collm_sim.batch import Req

    engine = EngineSpec(eval_tokens=100, eval_batch_tokens=100, eval_pieces_per_batch=2)  # 2 x 30 ms
    reported: list[tuple[int, float]] = []

    def report(_r: object, task: EvalTask, t: float) -> None:
        reported.append((task.round_id, t))

    idle = eval_replica(engine, SloAwareCoScheduler(), [])
    idle.add_eval(EvalTask(7, 60.0, 0.0, 60.0, report))  # type: ignore[attr-defined]
    assert idle.step(0.0) == pytest.approx(0.060)  # type: ignore[attr-defined]  # within the guard
    assert idle.step(0.060) is None and reported == [(7, pytest.approx(0.060))]  # type: ignore[attr-defined]
    assert idle.busy_ms["evaluation"] == pytest.approx(60.0)  # type: ignore[attr-defined]
    # A request with no slack (TTFT SLO 150 ms, its 100-token prefill takes 110): the evaluation still
    # progresses by one piece per iteration, after the inference step.
    busy = eval_replica(engine, SloAwareCoScheduler(), [], ttft_ms=150.0, tpot_ms=25.0)
    busy.add_eval(EvalTask(8, 60.0, 0.0, 60.0, report))  # type: ignore[attr-defined]
    busy.enqueue(Req(0, 0.0, 100, 5, "med"), 0.0)  # type: ignore[attr-defined]
    assert busy.step(0.0) == pytest.approx(0.110 + 0.030)  # type: ignore[attr-defined]
    assert busy.step(0.140) == pytest.approx(0.140 + 0.020 + 0.030)  # type: ignore[attr-defined]
    # Decode only from here: the last three decodes (20 ms each) are one run, ending with the request.
    assert busy.step(0.190) == pytest.approx(0.250)  # type: ignore[attr-defined]
    assert reported[-1] == (8, pytest.approx(0.190))  # reported when its last piece ended
    assert busy.step(0.250) is None  # type: ignore[attr-defined]
    ends = [t for t, _, _ in busy.inference_steps]  # type: ignore[attr-defined]
    assert ends == pytest.approx([0.110, 0.160, 0.210, 0.230, 0.250])


def test_rounds_wait_for_their_evaluators_and_evaluations_cost_replica_time() -> None:
    cfg = SimConfig(replicas=4, policy="leftover", workload=synthetic(rate=2.0, duration=100.0),
                    core={"slow_interval_s": 30.0, "round_deadline_s": 20.0})  # fmt: skip
    res = simulate(cfg, calibration_for_tests(eval_cost=(10.0, 0.5)))
    assert res.sim["evaluations_modelled"] and res.sim["rounds"]["published"] >= 4
    busy = res.sim["busy_s_by_replica"]
    # Every replica trains and scores its own domain's rounds: each evaluation of `eval_tokens` tokens in
    # batches of `eval_batch_tokens` costs 10 ms per batch + 0.5 ms per token.
    eng = cfg.engine
    assert eng.eval_tokens is not None
    one_eval_ms = -(-eng.eval_tokens // eng.eval_batch_tokens) * 10.0 + eng.eval_tokens * 0.5
    assert all(b["evaluation"] >= 2 * one_eval_ms / 1e3 for b in busy.values())
    plain = simulate(cfg, calibration_for_tests())
    assert not plain.sim["evaluations_modelled"]
    assert all(b["evaluation"] == 0 for b in plain.sim["busy_s_by_replica"].values())
    # The aggregator's cap on evaluators: with one, only the first of each domain's two holders (r0, r1)
    # scores the rounds' versions; the others (r2, r3) still score their own jobs' progress.
    capped = simulate(replace(cfg, eval_max_replicas=1), calibration_for_tests(eval_cost=(10.0, 0.5)))
    eval_s = {r: b["evaluation"] for r, b in capped.sim["busy_s_by_replica"].items()}
    assert capped.sim["rounds"]["published"] >= 4
    for r in ("r0", "r1"):
        assert eval_s[r] == pytest.approx(busy[r]["evaluation"])
    for r in ("r2", "r3"):  # one evaluation of the gate per round of its domain less
        assert eval_s[r] < busy[r]["evaluation"] - 2 * one_eval_ms / 1e3
    # Evaluations longer than the aggregator waits: rounds publish at its timeout, none is lost.
    slow = simulate(
        replace(cfg, eval_timeout_s=5.0, workload=synthetic(rate=0.5, duration=100.0)),
        calibration_for_tests(eval_cost=(10.0, 20.0)),  # 20 s per evaluation of 1024 tokens
    )
    assert slow.sim["rounds"]["published"] >= 2


def test_the_step_log_accounts_for_every_step_and_stretch_of_background_work() -> None:
    # The simulated replicas tell their steps in the live step log's records: the inference steps carry
    # every prompt token once and take the inference time, the training stretches carry every
    # fine-tuning token, and the stretches' times add up to the replica's busy time by kind.
    from collm_common.step_log import BackgroundWork, InferenceStep

    cfg = SimConfig(replicas=2, policy="leftover", workload=synthetic(rate=2.0, duration=60.0),
                    core={"slow_interval_s": 20.0, "round_deadline_s": 15.0})  # fmt: skip
    sim = Simulation(cfg, calibration_for_tests())
    logs: dict[str, list[InferenceStep | BackgroundWork]] = {rid: [] for rid in sim.replicas}
    for rid, rep in sim.replicas.items():
        rep.step_log = logs[rid].append
    res = sim.run()
    prompt_tokens = 0
    for rid, rep in sim.replicas.items():
        steps = [r for r in logs[rid] if isinstance(r, InferenceStep)]
        train = [r for r in logs[rid] if isinstance(r, BackgroundWork) and r.kind == "train"]
        evals = [r for r in logs[rid] if isinstance(r, BackgroundWork) and r.kind == "eval"]
        assert steps and train
        assert [r.t_s for r in steps] == sorted(r.t_s for r in steps)
        prompt_tokens += sum(n for s in steps for n, _ in s.prefill)
        assert sum(s.step_ms for s in steps) == pytest.approx(rep.busy_ms["inference"])
        assert sum(s.ms for s in train) == pytest.approx(rep.busy_ms["training"])
        assert sum(s.ms for s in evals) == pytest.approx(rep.busy_ms["evaluation"])
        assert sum(s.tokens for s in train) == rep.ft_tokens_total > 0
        # Read at a cut, the fine-tuning tokens are those of the micro-steps completed by then.
        first = next(s for s in train if s.tokens > 0)
        assert rep.ft_tokens_until(first.t_s) == 0
        assert rep.ft_tokens_until(math.inf) == rep.ft_tokens_total
        assert sum(n for s in train for n, _ in s.micro_steps) == rep.ft_tokens_total
        for s in steps:
            assert s.decodes + len(s.prefill) > 0 and s.forward_ms == s.step_ms > 0
        # The co-scheduler's decision rides on each step: none before a round's job, the policy's
        # budget (leftover keeps no limit of its own) while one trains.
        assert {s.train_limit for s in steps} == {None, "policy"}
        assert all(s.train_budget_ms == 0.0 for s in steps if s.train_limit is None)
        assert any(s.train_budget_ms > 0 for s in steps if s.train_limit == "policy")
    started = [r for r in res.records if r.ttft_ms is not None]
    assert prompt_tokens >= sum(r.prompt_tokens for r in started)


def test_an_evaluation_runs_in_the_batches_and_pieces_it_is_given() -> None:
    # 1024 tokens: by default in 2 batches of 512 (2 x 10 + 1024 x 0.5 = 532 ms) of 31 pieces each; given
    # the live shape, 4 batches (4 x 10 + 512 = 552 ms) of 32 pieces: 128 pieces instead of 62.
    from collm_replica.engine.cosched import LeftoverCoScheduler

    done: list[object] = []
    default = eval_replica(EngineSpec(eval_tokens=1024), LeftoverCoScheduler(), done)
    assert default.eval_ms_each == pytest.approx(532.0)  # type: ignore[attr-defined]
    assert default.bg.eval_piece_ms == pytest.approx(532.0 / 62)  # type: ignore[attr-defined]
    spec = EngineSpec(eval_tokens=1024, eval_batches=4, eval_pieces_per_batch=32)
    live_shape = eval_replica(spec, LeftoverCoScheduler(), done)
    assert live_shape.eval_ms_each == pytest.approx(552.0)  # type: ignore[attr-defined]
    assert live_shape.bg.eval_piece_ms == pytest.approx(552.0 / 128)  # type: ignore[attr-defined]


def test_a_replica_can_have_its_own_engine_settings() -> None:
    # r1's evaluations run in 4 batches, r0's in the cluster's 2; an unknown setting is refused.
    cfg = SimConfig(
        replicas=2,
        policy="leftover",
        workload=synthetic(rate=1.0, duration=10.0),
        engine=EngineSpec(eval_tokens=1024),
        engine_by_replica={"r1": {"eval_batches": 4}},
    )
    sim = Simulation(cfg, calibration_for_tests(eval_cost=(10.0, 0.5)))
    assert sim.replicas["r0"].engine.eval_batches is None
    assert sim.replicas["r1"].engine.eval_batches == 4
    assert sim.replicas["r1"].eval_ms_each == pytest.approx(4 * 10.0 + 512.0)
    with pytest.raises(ValueError, match="no engine setting eval_batchez"):
        SimConfig(engine_by_replica={"r0": {"eval_batchez": 3}})


def test_a_small_kv_pool_preempts_and_every_request_still_completes() -> None:
    # 8 requests of 100 + 60 tokens at once into one replica whose pool holds 512 tokens (32 blocks):
    # paged admission starts more than fit to the end, preempts the latest, and all finish with their
    # full output; reserve admission runs 3 at a time (3 x 160 <= 512) and never preempts.
    done = {}
    for admission in ("paged", "reserve"):
        eng = replace(EngineSpec(), kv_budget_tokens=512, max_batch=8, kv_admission=admission)
        cfg = SimConfig(replicas=1, policy="separate", samples_per_replica=0, engine=eng)
        sim = Simulation(cfg, calibration_for_tests(), workload([0.5] * 8, n_out=60))
        res = sim.run()
        assert [r.status for r in res.records] == ["ok"] * 8
        assert [r.completion_tokens for r in res.records] == [60] * 8
        (rep,) = sim.replicas.values()
        assert rep.blocks_used == 0 and not rep.running
        done[admission] = rep.preemptions
    assert done["paged"] > 0 and done["reserve"] == 0


def test_the_snapshots_per_request_are_the_telemetry_snapshots_with_their_age_and_in_flight_count() -> None:
    from collm_gateway.routing import ReplicaSnapshot
    from collm_sim.control import snapshots_at

    base = {
        rid: ReplicaSnapshot(rid, 0.0, 1.0, queue_len=q, running=5, max_batch=16, adapters={"a": 2})
        for rid, q in (("r0", 2), ("r1", 0), ("r2", 7))
    }
    view = {rid: (10.0 + i, snap) for i, (rid, snap) in enumerate(base.items())}
    in_flight = {"r0": 4, "r1": 0, "r2": 1}
    snaps = snapshots_at(view, 12.5, in_flight)
    assert all(type(s) is ReplicaSnapshot for s in snaps)
    assert snaps == [
        replace(base[rid], age_s=12.5 - view[rid][0], local_in_flight=in_flight[rid]) for rid in base
    ]
    assert [s.replica_id for s in snapshots_at(view, 12.5, in_flight, {"r2", "r0"})] == ["r0", "r2"]
    assert all(s.age_s == 0.0 and s.local_in_flight == 0 for s in base.values())
    with pytest.raises(AttributeError):
        snaps[0].age_s = 1.0  # type: ignore[misc]


def test_the_simulators_shortcuts_compute_what_one_iteration_and_one_summary_at_a_time_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reusing a plan `repeated_decodes` vouches for and keeping the latency summary change nothing:
    the same run with each replica planning every iteration and summarizing its window every time."""
    from collm_replica.costs import LatencyWindow
    from collm_sim.cli import load_calibration
    from collm_sim.replica import SimReplica
    from collm_sim.telemetry import KeptSummaryWindow
    from tests.unit.sim.test_fixed_seed_results import CALIBRATION, fingerprint

    core = {"slow_interval_s": 20.0, "round_deadline_s": 15.0}
    cfg = SimConfig(replicas=4, workload=synthetic(rate=3.0, duration=60.0), core=core, seed=2)
    cal = load_calibration(CALIBRATION)  # step costs that grow with the context
    fast = simulate(cfg, cal)
    monkeypatch.setattr(SimReplica, "_plan_repeats", lambda self, *args: None)
    monkeypatch.setattr(KeptSummaryWindow, "summary", LatencyWindow.summary)
    plain = simulate(cfg, cal)
    assert fast.sim["iterations"] > 1000 and fast.summary["counts"]["good"] > 0
    assert fingerprint(fast) == fingerprint(plain)
