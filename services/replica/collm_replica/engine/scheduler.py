"""The engine's scheduling decisions, pure: no torch, no clock of its own, no threads.

Each iteration the engine plans its inference step (`batching.plan_iteration`, the iteration batch
planner), then decides the background work that fits after it (`decide_background`): how long training
and pending evaluations may run and which training job runs. Both take plain data: views of the
requests, the cost predictions, the current time as an argument.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from collm_replica.batching import BatchConfig
from collm_replica.cosched import (
    CoSchedInput,
    CoScheduler,
    ReqTiming,
    StepModel,
    TrainCost,
    arrival_guard_s,
    background_budget_ms,
    likely_arrivals,
    request_deadlines,
    running_timing,
)

TRAIN_MS_CAP = 60_000.0  # the most training time one decision grants
DEFAULT_EVAL_MARGIN_MS = 10.0  # evaluation's margin when the co-scheduler states none (`margin_ms`)


@dataclass(frozen=True)
class RequestView:
    """A request as the background decision sees it; times on the engine's clock (s), SLOs in s."""

    request_id: str
    t_arrival_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    t_first_s: float | None
    prompt_len: int
    computed: int
    n_output: int
    max_tokens: int


@dataclass(frozen=True)
class JobView:
    """An active training job as the decision sees it: past its round deadline (less the margin), and
    with a micro-step or evaluation batch half done."""

    due: bool
    in_progress: bool


@dataclass(frozen=True)
class BackgroundSettings:
    """The engine settings the background decision reads (`EngineConfig`'s fields of the same names)."""

    batch: BatchConfig
    train_guard_frac: float
    train_slack_frac: float
    train_slo_reserve_frac: float
    micro_tokens: int
    batch_tokens: int


@dataclass(frozen=True)
class BackgroundInput:
    """One iteration's state for the background decision.

    `plan_items`/`plan_tokens`: the inference step planned this iteration; `step_ms`: its predicted cost;
    `decode_step_ms`: a decode step of the running batch; `prefill_ms_per_token`; `train`: the cost of a
    training micro-step; `min_ttft_slo_ms` and `arrivals_within_ttft`: from `ArrivalHistory`;
    `job_rr`: the round-robin counter over jobs (the decision returns the next value)."""

    now_s: float
    share: float
    running: Sequence[RequestView]
    waiting: Sequence[RequestView]
    plan_items: Sequence[tuple[str, int]]
    plan_tokens: int
    step_ms: float
    decode_step_ms: float
    prefill_ms_per_token: float
    train: TrainCost
    min_ttft_slo_ms: float
    prompt_tokens_guess: int
    arrivals_within_ttft: int
    jobs: Sequence[JobView]
    training_paused: bool
    evals_pending: bool
    iteration: int
    job_rr: int


@dataclass(frozen=True)
class BackgroundDecision:
    """What background work fits after this iteration's step.

    `step_ms`: the predicted inference step; `train_ms`/`eval_ms`: the windows of training and of
    evaluations after it; `job`: the index in `BackgroundInput.jobs` of the job to train (None: none);
    `idle`: nothing to serve; `has_job`: training is possible (an active job, not paused); `limit`: what
    bounded the training time (`cosched.Limit`, "policy" for co-schedulers that do not say);
    `job_rr`: the round-robin counter to keep."""

    step_ms: float
    train_ms: float
    eval_ms: float
    job: int | None
    idle: bool
    has_job: bool
    limit: str
    job_rr: int


class ArrivalHistory:
    """The TTFT SLOs of the arrivals of the last `window_s` (one entry per arrival, oldest first)."""

    def __init__(self, window_s: float, maxlen: int = 4096) -> None:
        self.window_s = window_s
        self.entries: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def record(self, at_s: float, ttft_slo_ms: float) -> None:
        self.entries.append((at_s, ttft_slo_ms))

    def min_ttft_slo_ms(self, now_s: float, present_ms: Sequence[float], default_ms: float) -> float:
        """The tightest TTFT SLO of present requests (`present_ms`) and of those that arrived within the
        window (the next arrival is likely to be like the recent ones); prunes the older arrivals."""
        while self.entries and self.entries[0][0] < now_s - self.window_s:
            self.entries.popleft()
        return min([*present_ms, *(x for _, x in self.entries), default_ms])

    def likely_arrivals(self, within_s: float) -> int:
        """Arrivals to expect within `within_s` at the rate of the window, rounded up (a burst of that
        many must find room), at least 1 and at most 4 (entries as of the last `min_ttft_slo_ms`)."""
        recent = self.entries
        if not recent:
            return 1
        return likely_arrivals(len(recent), recent[0][0], recent[-1][0], within_s)


def timings(
    now_s: float,
    running: Sequence[RequestView],
    waiting: Sequence[RequestView],
    plan_items: Sequence[tuple[str, int]],
    settings: BackgroundSettings,
    decode_step_ms: float,
    prefill_ms_per_token: float,
) -> tuple[list[ReqTiming], list[ReqTiming], StepModel]:
    """The running and waiting requests as they will be after the planned step, and the step model. The
    SLOs are the requests' own less the reserve (`train_slo_reserve_frac`): background work spends only
    the slack within them."""
    n_tokens = dict(plan_items)
    keep = 1.0 - settings.train_slo_reserve_frac
    run = [
        running_timing(
            now_s,
            s.t_arrival_s,
            keep * s.ttft_slo_s,
            keep * s.tpot_slo_s,
            s.t_first_s,
            s.prompt_len,
            s.computed,
            s.n_output,
            s.max_tokens,
            n_tokens.get(s.request_id, 0),
        )
        for s in running
    ]
    wait = [
        ReqTiming(
            s.t_arrival_s,
            keep * s.ttft_slo_s,
            keep * s.tpot_slo_s,
            prompt_left=s.prompt_len + s.n_output - s.computed,
            tokens_left=s.max_tokens - s.n_output,
        )
        for s in waiting
    ]
    b = settings.batch
    model = StepModel(
        decode_step_s=decode_step_ms / 1e3,
        prefill_s_per_token=prefill_ms_per_token / 1e3,
        max_batch=b.max_batch,
        max_batch_tokens=b.max_batch_tokens,
        prefill_chunk_tokens=b.prefill_chunk_tokens,
    )
    return run, wait, model


def decide_background(
    inp: BackgroundInput, settings: BackgroundSettings, policy: CoScheduler
) -> BackgroundDecision:
    """The training and evaluation windows after this iteration's step, and the job to train.

    A request arriving meanwhile must still meet its TTFT: background work lasts at most
    `train_guard_frac` of the tightest TTFT SLO and, under load, no more than the arrival could absorb
    given the queue and, when the batch is full, its wait for a free slot (idle, an arrival interrupts
    the work at the next piece). Within that, `policy` grants training its time; pending evaluations get
    the slack (`cosched.background_budget_ms`). The job: a round job past its deadline first (it only
    wraps up and sends its update), then one with a micro-step or evaluation batch half done, else the
    next in turn (jobs yield to each other at those boundaries, so each gets its share)."""
    running, waiting, model = timings(
        inp.now_s,
        inp.running,
        inp.waiting,
        inp.plan_items,
        settings,
        inp.decode_step_ms,
        inp.prefill_ms_per_token,
    )
    min_ttft_ms = inp.min_ttft_slo_ms
    guard_ms = settings.train_guard_frac * min_ttft_ms
    if inp.running:
        guard_ms = min(
            guard_ms,
            1e3
            * arrival_guard_s(
                running,
                waiting,
                model,
                inp.step_ms / 1e3,
                (1.0 - settings.train_slo_reserve_frac) * min_ttft_ms / 1e3,
                inp.prompt_tokens_guess,
                inp.arrivals_within_ttft,
            ),
        )
    cin = CoSchedInput(
        now_s=inp.now_s,
        share=inp.share,
        has_job=bool(inp.jobs) and not inp.training_paused,
        running=len(inp.running),
        waiting=len(inp.waiting),
        inference_tokens=inp.plan_tokens,
        token_budget=settings.batch.max_batch_tokens,
        step_ms=inp.step_ms,
        deadlines_s=request_deadlines(running, waiting, model),
        train=inp.train,
        micro_tokens=settings.micro_tokens,
        batch_tokens=settings.batch_tokens,
        iteration=inp.iteration,
        max_train_ms=guard_ms,
    )
    budget = getattr(policy, "budget_ms", None)
    train_ms = budget(cin) if budget is not None else cin.train.ms(policy.decide(cin))
    train_ms = min(train_ms, TRAIN_MS_CAP)
    limit = getattr(policy, "limit", "policy")
    eval_ms = 0.0
    if inp.evals_pending:
        margin = getattr(policy, "margin_ms", DEFAULT_EVAL_MARGIN_MS)
        eval_ms = background_budget_ms(cin, margin, settings.train_slack_frac)
    job: int | None = None
    job_rr = inp.job_rr
    if train_ms > 0 and inp.jobs and cin.has_job:
        job = next((i for i, j in enumerate(inp.jobs) if j.due), None)
        if job is None:
            job = next((i for i, j in enumerate(inp.jobs) if j.in_progress), None)
        if job is None:
            job_rr += 1
            job = job_rr % len(inp.jobs)
    return BackgroundDecision(
        step_ms=inp.step_ms,
        train_ms=train_ms,
        eval_ms=eval_ms,
        job=job,
        idle=cin.idle,
        has_job=cin.has_job,
        limit=limit,
        job_rr=job_rr,
    )
