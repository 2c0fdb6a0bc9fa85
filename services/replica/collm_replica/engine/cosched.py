"""Co-scheduling of fine-tuning with inference, decided once per iteration (pure: no torch, no asyncio).

Each iteration the engine asks the policy how much training to run after the inference step it is about
to execute: `budget_ms(inp)`, the time training may take before the next iteration must start (the
engine runs training in pieces of about one decoder layer, as many as fit), or, for callers that run
whole micro-steps (the simulator), `decide(inp)`, the tokens of one micro-step; 0 means none. Three
policies share the interface:

* `SloAwareCoScheduler` (CoLLM): trains only in the *slack* of every request, i.e. the earliest time the
  next iteration must start for every request to stay within its SLO (`deadlines_s`: a decoding request's
  accumulated TPOT budget, so one ahead of its budget has slack; a waiting or prefilling request's TTFT
  deadline minus the prefill still ahead of it; none for a request already past its TTFT SLO, whose
  verdict is settled) minus the cost of this iteration and a margin, of which it spends `slack_frac`;
  within a share of the TTFT SLO (`max_train_ms`, so a request arriving meanwhile still meets its TTFT);
  and only while the fine-tuning *share* allows it (time credit: training may use `share` of the wall
  time while there is inference work). An idle replica trains in `max_train_ms`
  stretches back to back, i.e. at full speed, and always makes progress: `decide` never returns fewer
  than `min_tokens` when idle, so a micro-step that a cost model predicts longer than the guard cannot
  starve training forever. When load rises, slack vanishes and training stops at the next iteration.
  With a *spend* s > 0 from the coordinator (the SLO budget its attainment target leaves unspent), training
  also takes s x share of the wall time under load beyond the slack, in stretches of `spend_stretch_ms`
  (time credit, as the share's): requests then pay for it in latency, and the coordinator's attainment
  target, not each request's slack, bounds training.
* `FixedRatioCoScheduler` (Loquetier-style naive co-location): one full training step (a whole
  accumulation batch) every K iterations, whatever the load.
* `LeftoverCoScheduler` (FlexLLM-style): fills the token budget the running batch leaves spare.

`NoTraining` is fine-tuning off. All of them return 0 when there is no job or the share is 0.
`background_budget_ms` is the same slack rule without share or job, for background work that is not
fine-tuning (a federated evaluation on the publication's critical path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

# What bounded the training time of an iteration: no job to train; the fine-tuning share (0, or its time
# credit spent); an idle replica (the guard only); the requests' slack; the guard for the next arrival; a
# stretch of the coordinator's spend beyond the slack.
Limit = Literal["no_job", "share", "idle", "slack", "guard", "spend"]


@dataclass(frozen=True)
class TrainCost:
    """Predicted training cost: fixed + per token (ms)."""

    fixed_ms: float
    per_token_ms: float

    def ms(self, tokens: int) -> float:
        return self.fixed_ms + self.per_token_ms * tokens if tokens > 0 else 0.0

    def tokens_within(self, ms: float) -> int:
        if ms <= self.fixed_ms:
            return 0
        if self.per_token_ms <= 0:
            return 1 << 30
        return int((ms - self.fixed_ms) / self.per_token_ms)


@dataclass(frozen=True)
class CoSchedInput:
    now_s: float  # monotonic
    share: float  # 0..1
    has_job: bool
    running: int  # sequences in the running batch
    waiting: int  # sequences in the queue
    inference_tokens: int  # tokens of this iteration's inference step
    token_budget: int  # max_batch_tokens
    step_ms: float  # predicted cost of this iteration's inference step
    deadlines_s: tuple[float, ...]  # earliest next deadline of each request (absolute, monotonic)
    train: TrainCost
    micro_tokens: int  # preferred micro-step size
    batch_tokens: int  # tokens of one full optimizer step (fixed-ratio policy)
    min_tokens: int = 8
    iteration: int = 0
    # Longest training pause a request that has not arrived yet could absorb (a share of the TTFT SLO):
    # the slack of present requests says nothing about the next arrival.
    max_train_ms: float = float("inf")
    # Fraction of the share that training takes under load whatever the slack (0..1, the coordinator's
    # spend of the SLO budget), in stretches of `spend_stretch_ms`.
    spend: float = 0.0
    spend_stretch_ms: float = 0.0

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0


class CoScheduler(Protocol):
    name: str

    def decide(self, inp: CoSchedInput) -> int:
        """Training tokens to run after this iteration's inference step (0: none; always 0 without a job
        or with a share of 0, whatever else the input says: `scheduler.decide_background` does not
        compute the requests' deadlines then)."""
        ...

    def charge(self, train_ms: float) -> None:
        """Account a training micro-step that ran."""
        ...

    # Additive: `budget_ms(inp) -> float`, the training time (ms) that fits after this step. Policies
    # without it are run by the engine as `inp.train.ms(decide(inp))`.


@dataclass(frozen=True)
class ReqTiming:
    """What the deadline rule needs of one request, as it will be after this iteration's step."""

    arrival_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    # Time of its first token (None: not produced by the end of this step; a first token that this step
    # produces counts from the step's start), and the index of the token the next iteration produces.
    first_s: float | None = None
    next_index: int = 0
    prompt_left: int = 0  # prompt tokens still to prefill after this step
    tokens_left: int = 0  # output tokens it may still produce after this step (max_tokens bound)
    # Its SLO is already missed (its first token came, or will come, past its TTFT SLO): no background
    # work can save or cost it its verdict, so it sets no deadline; it still holds its batch slot and its
    # prompt still stands in the queue.
    lost: bool = False


def running_timing(
    now_s: float,
    arrival_s: float,
    ttft_slo_s: float,
    tpot_slo_s: float,
    first_s: float | None,
    prompt_len: int,
    computed: int,
    generated: int,
    max_tokens: int,
    step_tokens: int,
    lost: bool = False,
) -> ReqTiming:
    """A running request as it will be after a step that gives it `step_tokens` (prefill or its next
    decode token), the step starting at `now_s`: a token comes out of the step when it leaves no prompt
    to prefill, and a first token then counts from the step's start."""
    prompt_left = max(0, prompt_len - computed - step_tokens)
    produces = 1 if step_tokens and prompt_left == 0 else 0
    first = first_s if first_s is not None else (now_s if produces else None)
    return ReqTiming(
        arrival_s, ttft_slo_s, tpot_slo_s, first, generated + produces, prompt_left,
        max_tokens - generated - produces, lost,
    )  # fmt: skip


def ttft_lost(now_s: float, arrival_s: float, first_s: float | None, ttft_slo_s: float) -> bool:
    """Whether a request has missed its TTFT SLO for good: its first token came past it, or it is
    past it with none yet (`ReqTiming.lost`)."""
    return (first_s if first_s is not None else now_s) - arrival_s > ttft_slo_s


def likely_arrivals(count: int, first_s: float, last_s: float, within_s: float) -> int:
    """Arrivals to expect within `within_s` at the rate of `count` recent ones (the first at `first_s`,
    the last at `last_s`), rounded up (a burst of that many must find room), at least 1 and at most 4."""
    if count < 2:
        return 1
    span_s = max(last_s - first_s, within_s)
    return max(1, min(4, math.ceil(count / span_s * within_s)))


@dataclass(frozen=True)
class StepModel:
    """Predicted costs of the iterations ahead: a decode step of the running batch (s), the extra time
    of each prefill token in a step (s), and the batch limits that decide when a waiting request starts."""

    decode_step_s: float
    prefill_s_per_token: float
    max_batch: int
    max_batch_tokens: int
    prefill_chunk_tokens: int


def _ahead(
    running: list[ReqTiming], waiting: list[ReqTiming], model: StepModel
) -> tuple[float, list[tuple[int, int]], list[tuple[int, int]]]:
    """(the next step's time, and per running and per waiting request (iterations before its first token,
    prompt tokens prefilled before it and with it)); iterations 0 for a request past its prefill."""
    n_run = len(running)
    prefill_per_iter = max(1, model.max_batch_tokens - n_run)
    chunk = max(1, model.prefill_chunk_tokens)
    free = model.max_batch - n_run
    queued = sum(r.prompt_left for r in running) + sum(r.prompt_left for r in waiting[: max(0, free)])
    next_step = model.decode_step_s + min(queued, prefill_per_iter) * model.prefill_s_per_token
    ahead = 0
    run_out: list[tuple[int, int]] = []
    for r in running:
        if r.first_s is not None:
            run_out.append((0, 0))
            continue
        ahead += r.prompt_left
        run_out.append((max(-(-ahead // prefill_per_iter), -(-r.prompt_left // chunk)), ahead))
    # Iterations until the k-th batch slot frees: running requests finish after their remaining tokens.
    finishing = sorted(max(1, r.tokens_left) for r in running)
    wait_out: list[tuple[int, int]] = []
    for j, r in enumerate(waiting):
        ahead += r.prompt_left
        iters = max(-(-ahead // prefill_per_iter), -(-r.prompt_left // chunk))
        if j >= free and finishing:
            iters += finishing[min(j - free, len(finishing) - 1)]
        wait_out.append((iters, ahead))
    return next_step, run_out, wait_out


def request_deadlines(
    running: list[ReqTiming], waiting: list[ReqTiming], model: StepModel
) -> tuple[float, ...]:
    """Per request, the latest time the iteration *after* this one may start for the request to stay within
    its SLO; background work between the two iterations must end by then.

    * A decoding request's next token is due at `first_s + next_index * tpot_slo_s` (TPOT is the mean over
      the request, so one ahead of its budget has slack) and takes the next step.
    * A prefilling or waiting request must get its first token by `arrival_s + ttft_slo_s`. Before that
      come whole iterations, not just its own prefill: the prefill ahead of it in the queue (at most
      `max_batch_tokens` minus the decodes per iteration, `prefill_chunk_tokens` of one sequence), and,
      when the batch is full, the iterations until enough running requests finish to free a slot. Each of
      those iterations costs a decode step of the batch plus its prefill tokens.

    The next step is a decode step plus the prefill that the queue will bring into it, so TPOT deadlines
    also leave room for the prompts that arrived. A request whose SLO is already missed (`lost`) counts
    in the queue and the batch but sets no deadline."""
    next_step, run_plan, wait_plan = _ahead(running, waiting, model)
    step, per_tok = model.decode_step_s, model.prefill_s_per_token
    out: list[float] = []
    for r, (iters, ahead) in zip(running, run_plan, strict=True):
        if r.lost:
            continue
        if r.first_s is not None:
            out.append(r.first_s + r.next_index * r.tpot_slo_s - next_step)
        else:
            out.append(r.arrival_s + r.ttft_slo_s - iters * step - ahead * per_tok)
    for r, (iters, ahead) in zip(waiting, wait_plan, strict=True):
        if not r.lost:
            out.append(r.arrival_s + r.ttft_slo_s - iters * step - ahead * per_tok)
    return tuple(out)


def arrival_guard_s(
    running: list[ReqTiming],
    waiting: list[ReqTiming],
    model: StepModel,
    step_s: float,
    ttft_slo_s: float,
    prompt_tokens: int,
    arrivals: int = 1,
) -> float:
    """The longest background stretch per iteration gap that the next `arrivals` requests (the burst the
    arrival rate makes likely within a TTFT SLO) could absorb and still meet `ttft_slo_s`, judged by the
    last of them: it waits out this iteration's step (`step_s`), then the iterations before its first
    token (the queue's prefill, the others' included, and, when they filled the batch, until a running
    request frees a slot), with a stretch in each gap between them. When the batch is (nearly) full and
    its requests are far from done, that is nothing: training would keep the batch full and the queue
    would miss its TTFT."""
    probe = ReqTiming(0.0, ttft_slo_s, 0.0, prompt_left=max(1, prompt_tokens), tokens_left=1)
    _, _, wait_plan = _ahead(running, [*waiting, *([probe] * max(1, arrivals))], model)
    iters, ahead = wait_plan[-1]
    left = ttft_slo_s - step_s - iters * model.decode_step_s - ahead * model.prefill_s_per_token
    return max(0.0, left / max(1, iters))


def slack_ms(inp: CoSchedInput, margin_ms: float) -> float:
    """Time (ms) between the end of this iteration's inference step and the latest start of the next."""
    if not inp.deadlines_s:
        return float("inf")
    return (min(inp.deadlines_s) - inp.now_s) * 1e3 - inp.step_ms - margin_ms


def background_budget_ms(inp: CoSchedInput, margin_ms: float = 10.0, slack_frac: float = 0.5) -> float:
    """Time for background work after this step that keeps every request within its SLO: `max_train_ms`
    when idle, else `slack_frac` of the slack, capped at `max_train_ms` (never negative)."""
    if inp.idle:
        return inp.max_train_ms
    return max(0.0, min(slack_ms(inp, margin_ms) * slack_frac, inp.max_train_ms))


def behind_schedule(
    progress: float, now_s: float, start_s: float, deadline_s: float, finish_frac: float = 0.8
) -> bool:
    """Whether background work with a deadline (an evaluation someone waits for) is behind the even pace
    that finishes it at `finish_frac` of its window: done less than the share of that time elapsed. The
    engine then runs more of it than the slack allows, so it does not finish after the requester gave up."""
    window_s = (deadline_s - start_s) * finish_frac
    if progress >= 1.0:
        return False
    if window_s <= 0:
        return True
    return progress < min(1.0, (now_s - start_s) / window_s)


class NoTraining:
    name = "off"

    def decide(self, inp: CoSchedInput) -> int:  # noqa: ARG002
        return 0

    def budget_ms(self, inp: CoSchedInput) -> float:  # noqa: ARG002
        return 0.0

    def charge(self, train_ms: float) -> None:  # noqa: ARG002
        return None


class SloAwareCoScheduler:
    """See module docstring. `margin_ms` is kept free of training before any deadline."""

    name = "slo"

    def __init__(
        self, margin_ms: float = 10.0, max_credit_ms: float = 2000.0, slack_frac: float = 0.5
    ) -> None:
        self.margin_ms = margin_ms
        self.max_credit_ms = max_credit_ms
        # Spend only this fraction of the slack: step costs jitter, and the slack must also absorb the
        # next iterations, which may be slower than the one predicted now.
        self.slack_frac = slack_frac
        self.credit_ms = 0.0
        # Time credit of the spend (`CoSchedInput.spend`): training beyond the slack, paid by requests.
        self.spend_credit_ms = 0.0
        self._beyond_slack_ms = 0.0  # of the last budget, the part beyond the slack
        self._last_s: float | None = None
        self.limit: Limit = "no_job"

    def _accrue(self, inp: CoSchedInput) -> None:
        if self._last_s is not None and inp.now_s > self._last_s:
            dt_ms = (inp.now_s - self._last_s) * 1e3
            self.credit_ms = min(self.max_credit_ms, self.credit_ms + inp.share * dt_ms)
            if inp.spend > 0 and not inp.idle:
                cap = max(self.max_credit_ms, inp.spend_stretch_ms)
                self.spend_credit_ms = min(cap, self.spend_credit_ms + inp.spend * inp.share * dt_ms)
            elif inp.spend <= 0:
                self.spend_credit_ms = 0.0
        self._last_s = inp.now_s

    def slack_ms(self, inp: CoSchedInput) -> float:
        return slack_ms(inp, self.margin_ms)

    def budget_ms(self, inp: CoSchedInput) -> float:
        """Training time (ms) that fits after this step (0: none); inf only when nothing bounds it.
        `limit` says what bounded it (`Limit`)."""
        self._accrue(inp)
        self._beyond_slack_ms = 0.0
        if not inp.has_job or inp.share <= 0:
            self.limit = "no_job" if not inp.has_job else "share"
            return 0.0
        if inp.idle:  # nothing to serve: training takes the idle time, in stretches an arrival can wait out
            self.limit = "idle"
            return inp.max_train_ms
        if self.credit_ms <= 0:
            self.limit = "share"
            return 0.0
        # The credit gates training on and off (the share is a long-run time budget); it does not cut a
        # stretch short, so a small share still trains in stretches long enough to be efficient.
        slack = self.slack_ms(inp) * self.slack_frac
        self.limit = "slack" if slack < inp.max_train_ms else "guard"
        budget = max(0.0, min(slack, inp.max_train_ms))
        stretch = inp.spend_stretch_ms
        if inp.spend > 0 and stretch > budget and self.spend_credit_ms >= stretch:
            self.limit = "spend"
            self._beyond_slack_ms = stretch - budget
            return stretch
        return budget

    def decide(self, inp: CoSchedInput) -> int:
        budget = self.budget_ms(inp)
        if budget <= 0:
            return 0
        if budget == float("inf"):
            return inp.micro_tokens
        tokens = min(inp.micro_tokens, inp.train.tokens_within(budget))
        if inp.idle:  # progress guarantee: an idle replica always trains
            return max(tokens, min(inp.min_tokens, inp.micro_tokens))
        return tokens if tokens >= inp.min_tokens else 0

    def charge(self, train_ms: float) -> None:
        self.credit_ms -= train_ms
        self.spend_credit_ms -= min(train_ms, self._beyond_slack_ms)


class FixedRatioCoScheduler:
    """One full training step (`batch_tokens`) every `every` iterations, blind to load."""

    name = "fixed"

    def __init__(self, every: int = 8) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.every = every

    def decide(self, inp: CoSchedInput) -> int:
        if not inp.has_job or inp.share <= 0:
            return 0
        if inp.idle:
            return inp.batch_tokens
        return inp.batch_tokens if inp.iteration % self.every == 0 else 0

    def budget_ms(self, inp: CoSchedInput) -> float:
        tokens = self.decide(inp)
        return inp.train.ms(tokens) if tokens > 0 else 0.0

    def charge(self, train_ms: float) -> None:  # noqa: ARG002
        return None


class LeftoverCoScheduler:
    """Training tokens fill whatever the running batch leaves of the iteration's token budget."""

    name = "leftover"

    def decide(self, inp: CoSchedInput) -> int:
        if not inp.has_job or inp.share <= 0:
            return 0
        spare = inp.token_budget - inp.inference_tokens
        tokens = min(spare, inp.micro_tokens) if not inp.idle else inp.micro_tokens
        return tokens if tokens >= inp.min_tokens else 0

    def budget_ms(self, inp: CoSchedInput) -> float:
        tokens = self.decide(inp)
        return inp.train.ms(tokens) if tokens > 0 else 0.0

    def charge(self, train_ms: float) -> None:  # noqa: ARG002
        return None


def make_coscheduler(
    name: str, fixed_every: int = 8, slack_frac: float | None = None, margin_ms: float | None = None
) -> CoScheduler:
    if name == "slo":
        kw: dict[str, float] = {}
        if slack_frac is not None:
            kw["slack_frac"] = slack_frac
        if margin_ms is not None:
            kw["margin_ms"] = margin_ms
        return SloAwareCoScheduler(**kw)
    if name == "fixed":
        return FixedRatioCoScheduler(fixed_every)
    if name == "leftover":
        return LeftoverCoScheduler()
    if name == "off":
        return NoTraining()
    raise ValueError(f"unknown co-scheduler {name!r} (slo, fixed, leftover, off)")


def effective_share(
    now_s: float, coordinator_share: float | None, expires_s: float | None, default: float
) -> tuple[float, str]:
    """The share in force: the coordinator's while its TTL lasts, else the local default."""
    if coordinator_share is not None and expires_s is not None and now_s < expires_s:
        return coordinator_share, "coordinator"
    return default, "local_default"
