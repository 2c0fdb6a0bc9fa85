"""The engine's background-work decision (`collm_replica.engine.scheduler`) on constructed inputs."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from collm_replica.engine.cosched import NoTraining, SloAwareCoScheduler, TrainCost
from collm_replica.engine.scheduler import (
    ArrivalHistory,
    BackgroundInput,
    BackgroundSettings,
    BatchConfig,
    JobView,
    RequestView,
    SeqView,
    decide_background,
    plan_iteration,
    repeated_decodes,
    timings,
)

SETTINGS = BackgroundSettings(
    batch=BatchConfig(max_batch=8, max_batch_tokens=512, prefill_chunk_tokens=256, kv_budget_tokens=8192),
    train_guard_frac=0.4,
    train_slack_frac=0.5,
    train_slo_reserve_frac=0.1,
    micro_tokens=256,
    batch_tokens=1024,
)
NOW = 100.0
IDLE_JOB = JobView(due=False, in_progress=False)


def _request(
    rid: str = "a",
    arrived_s_ago: float = 0.0,
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.25,
    first_s_ago: float | None = None,
    prompt_len: int = 32,
    computed: int = 0,
    n_output: int = 0,
    max_tokens: int = 64,
) -> RequestView:
    return RequestView(
        request_id=rid,
        t_arrival_s=NOW - arrived_s_ago,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        t_first_s=None if first_s_ago is None else NOW - first_s_ago,
        prompt_len=prompt_len,
        computed=computed,
        n_output=n_output,
        max_tokens=max_tokens,
    )


def _input(**kw: object) -> BackgroundInput:
    base = BackgroundInput(
        now_s=NOW,
        share=0.3,
        running=[],
        waiting=[],
        plan_items=[],
        plan_tokens=0,
        step_ms=0.0,
        decode_step_ms=10.0,
        prefill_ms_per_token=0.1,
        train=TrainCost(fixed_ms=5.0, per_token_ms=0.5),
        min_ttft_slo_ms=2000.0,
        prompt_tokens_guess=64,
        arrivals_within_ttft=1,
        jobs=[IDLE_JOB],
        training_paused=False,
        evals_pending=False,
        iteration=1,
        job_rr=0,
    )
    return base._replace(**kw)  # type: ignore[arg-type]


def _primed_policy() -> SloAwareCoScheduler:
    """The SLO-aware policy with share credit to spend (training is on under load)."""
    policy = SloAwareCoScheduler(slack_frac=SETTINGS.train_slack_frac)
    policy.credit_ms = 1000.0
    return policy


def _decoding(tpot_slo_s: float) -> RequestView:
    """A request decoding since 1 s ago, its prompt done, 10 tokens out."""
    return _request(
        arrived_s_ago=1.5, tpot_slo_s=tpot_slo_s, first_s_ago=1.0, computed=42, prompt_len=32, n_output=10
    )


def test_idle_replica_trains_for_the_guard_of_the_next_arrival() -> None:
    d = decide_background(_input(), SETTINGS, _primed_policy())
    assert d.idle and d.has_job
    assert d.train_ms == pytest.approx(0.4 * 2000.0)  # train_guard_frac of the tightest TTFT SLO
    assert d.limit == "idle"
    assert d.job == 0
    assert d.eval_ms == 0.0  # no evaluation pending


def test_no_slack_no_training() -> None:
    # A request waiting 95 ms of its 100-ms TTFT SLO: within the SLO, but past it less the reserve, so
    # there is no slack to spend.
    late = _request(arrived_s_ago=0.095, ttft_slo_s=0.1)
    d = decide_background(_input(waiting=[late], evals_pending=True), SETTINGS, _primed_policy())
    assert not d.idle
    assert d.train_ms == 0.0
    assert d.job is None
    assert d.eval_ms == 0.0
    assert d.limit == "slack"


def test_a_spend_trains_past_the_slack_in_stretches_of_the_ttft_slo() -> None:
    # The same late request: no slack, but the coordinator's spend has time credit for a stretch.
    late = _request(arrived_s_ago=0.095, ttft_slo_s=0.1)
    policy = _primed_policy()
    policy.spend_credit_ms = 1000.0
    inp = _input(waiting=[late], spend=0.5)
    d = decide_background(inp, SETTINGS, policy)
    assert d.train_ms == pytest.approx(SETTINGS.train_spend_stretch_frac * 2000.0)
    assert d.limit == "spend" and d.job == 0
    # Without a spend the same credit buys nothing: training stays in the slack.
    assert decide_background(inp._replace(spend=0.0), SETTINGS, policy).train_ms == 0.0


def test_a_request_past_its_ttft_slo_sets_no_deadline() -> None:
    # Waiting past its whole TTFT SLO, or decoding after a late first token: its verdict is settled, so
    # it holds nothing back; the arrival guard still bounds the training.
    lost_waiting = _request(arrived_s_ago=0.5, ttft_slo_s=0.1)
    lost_running = _request(arrived_s_ago=1.5, ttft_slo_s=0.1, first_s_ago=1.0, computed=42, n_output=10)
    for inp in (_input(waiting=[lost_waiting]), _input(running=[lost_running], plan_items=[("a", 1)])):
        d = decide_background(inp, SETTINGS, _primed_policy())
        assert not d.idle
        assert d.train_ms > 0.0 and d.limit == "guard"
    # Beside a request that can still meet its SLO, that one's deadline binds.
    on_time = _request("b", arrived_s_ago=0.095, ttft_slo_s=0.1)
    d = decide_background(_input(waiting=[lost_waiting, on_time]), SETTINGS, _primed_policy())
    assert d.train_ms == 0.0 and d.limit == "slack"


def test_slack_grants_training_to_the_job_within_the_guard() -> None:
    plan = [("a", 1)]
    inp = _input(running=[_decoding(tpot_slo_s=1.0)], plan_items=plan, plan_tokens=1, step_ms=10.0)
    d = decide_background(inp, SETTINGS, _primed_policy())
    assert 0.0 < d.train_ms <= 0.4 * 2000.0
    assert d.limit in ("slack", "guard")
    assert d.job == 0
    assert d.step_ms == 10.0
    # A tighter TPOT SLO leaves less slack, hence less training.
    tight = decide_background(inp._replace(running=[_decoding(tpot_slo_s=0.1)]), SETTINGS, _primed_policy())
    assert 0.0 <= tight.train_ms < d.train_ms


def test_training_waits_without_share_credit_under_load() -> None:
    inp = _input(running=[_decoding(tpot_slo_s=1.0)], plan_items=[("a", 1)], plan_tokens=1, step_ms=10.0)
    d = decide_background(inp, SETTINGS, SloAwareCoScheduler())
    assert d.train_ms == 0.0 and d.job is None and d.limit == "share"


def test_no_job_or_paused_means_no_training_but_evaluations_still_run() -> None:
    for inp in (_input(jobs=[], evals_pending=True), _input(training_paused=True, evals_pending=True)):
        d = decide_background(inp, SETTINGS, _primed_policy())
        assert not d.has_job
        assert d.train_ms == 0.0 and d.job is None and d.limit == "no_job"
        # Evaluations take the idle time up to the guard, whatever training is granted.
        assert d.eval_ms == pytest.approx(0.4 * 2000.0)


def test_evaluations_get_their_own_window_beside_training() -> None:
    inp = _input(running=[_decoding(tpot_slo_s=1.0)], plan_items=[("a", 1)], plan_tokens=1, step_ms=10.0)
    without = decide_background(inp, SETTINGS, _primed_policy())
    with_evals = decide_background(inp._replace(evals_pending=True), SETTINGS, _primed_policy())
    assert without.eval_ms == 0.0
    assert with_evals.eval_ms > 0.0
    # The training window does not shrink for pending evaluations (the loop runs evaluations first, and
    # their time counts against training's window, which ends at the same absolute time).
    assert with_evals.train_ms == pytest.approx(without.train_ms)
    assert with_evals.job == without.job == 0


def test_a_policy_without_training_grants_none() -> None:
    d = decide_background(_input(evals_pending=True), SETTINGS, NoTraining())
    assert d.train_ms == 0.0 and d.job is None and d.limit == "policy"
    assert d.eval_ms == pytest.approx(0.4 * 2000.0)


def test_job_choice_due_first_then_in_progress_then_round_robin() -> None:
    policy = _primed_policy()
    due = JobView(due=True, in_progress=False)
    busy = JobView(due=False, in_progress=True)
    d = decide_background(_input(jobs=[IDLE_JOB, busy, due], job_rr=5), SETTINGS, policy)
    assert d.job == 2 and d.job_rr == 5
    d = decide_background(_input(jobs=[IDLE_JOB, busy], job_rr=5), SETTINGS, policy)
    assert d.job == 1 and d.job_rr == 5
    rr = 0
    chosen = []
    for _ in range(4):
        d = decide_background(_input(jobs=[IDLE_JOB, IDLE_JOB, IDLE_JOB], job_rr=rr), SETTINGS, policy)
        assert d.job is not None
        chosen.append(d.job)
        rr = d.job_rr
    assert chosen == [1, 2, 0, 1] and rr == 4


def test_guard_counts_the_tightest_recent_ttft_slo() -> None:
    d = decide_background(_input(min_ttft_slo_ms=500.0), SETTINGS, _primed_policy())
    assert d.train_ms == pytest.approx(0.4 * 500.0)


def test_timings_apply_the_plan_and_the_slo_reserve() -> None:
    waiting = _request("w", arrived_s_ago=0.1, prompt_len=40, max_tokens=8)
    running = _request("r", arrived_s_ago=0.2, prompt_len=300, computed=0)
    run, wait, model = timings(NOW, [running], [waiting], [("r", 256)], SETTINGS, 12.0, 0.2)
    assert run[0].prompt_left == 44 and run[0].first_s is None  # a chunk of 256 of its 300 prompt tokens
    assert run[0].ttft_slo_s == pytest.approx(0.9 * 2.0)  # the SLO less the 10% reserve
    assert wait[0].prompt_left == 40 and wait[0].tokens_left == 8
    assert wait[0].tpot_slo_s == pytest.approx(0.9 * 0.25)
    assert model.decode_step_s == pytest.approx(0.012)
    assert model.prefill_s_per_token == pytest.approx(0.0002)
    assert model.max_batch == 8
    # A preempted request waits to recompute its prompt and the output it has so far.
    preempted = _request("p", arrived_s_ago=1.0, prompt_len=40, computed=0, n_output=5, max_tokens=8)
    _, wait, _ = timings(NOW, [], [preempted], [], SETTINGS, 12.0, 0.2)
    assert wait[0].prompt_left == 45 and wait[0].tokens_left == 3


def test_arrival_history_keeps_the_window() -> None:
    h = ArrivalHistory(window_s=30.0)
    assert h.likely_arrivals(1.0) == 1
    assert h.min_ttft_slo_ms(NOW, [], 2000.0) == 2000.0
    h.record(NOW - 40.0, 100.0)  # older than the window
    h.record(NOW - 10.0, 800.0)
    h.record(NOW - 5.0, 1500.0)
    assert h.min_ttft_slo_ms(NOW, [1200.0], 2000.0) == 800.0
    assert len(h.entries) == 2  # the old arrival is pruned
    assert h.min_ttft_slo_ms(NOW, [300.0], 2000.0) == 300.0  # a present request's SLO counts too
    assert 1 <= h.likely_arrivals(2.0) <= 4


@pytest.mark.parametrize("seed", range(30))
def test_repeated_decodes_counts_the_iterations_whose_plan_stays_one_decode_each(seed: int) -> None:
    # Decoding sequences in a pool of varying room: stepping plan_iteration (each sequence one token
    # longer per iteration) gives every sequence one decode token, admitting and preempting nothing,
    # for exactly the iterations repeated_decodes counts (up to `most`).
    rng = random.Random(seed)
    block = 16
    for admission in ("paged", "reserve"):
        cfg = BatchConfig(max_batch=8, max_batch_tokens=64, kv_budget_tokens=4096, block_size=block,
                          kv_admission=admission)  # fmt: skip
        seqs = []
        for i in range(rng.randint(1, 8)):
            prompt, out = rng.randint(1, 60), rng.randint(1, 40)
            kv = prompt + out - 1
            seqs.append(SeqView(f"s{i}", prompt, kv, output_len=out, blocks_held=-(-kv // block)))
        free = rng.randint(0, 12)  # the pool's free blocks: often fewer than the run would take
        most = rng.randint(1, 80)
        k = repeated_decodes(cfg, seqs, [], free, most)
        same = 0
        views = list(seqs)
        while same < most:
            plan = plan_iteration(cfg, views, [], 0, free)
            if plan.admitted or plan.preempted or plan.items != [(s.seq_id, 1) for s in views]:
                break
            same += 1
            grown = [replace(s, computed=s.computed + 1, output_len=s.output_len + 1,
                             blocks_held=-(-(s.computed + 1) // block)) for s in views]  # fmt: skip
            free -= sum(g.blocks_held - s.blocks_held for g, s in zip(grown, views, strict=True))
            views = grown
        assert k == same, (admission, k, same)
    assert repeated_decodes(BatchConfig(), [SeqView("p", 100, 10)], [], 100, 5) == 0  # still prefilling
    assert (
        repeated_decodes(BatchConfig(), [SeqView("d", 10, 10, output_len=1)], [SeqView("w", 5, 0)], 100, 5)
        == 0
    )
