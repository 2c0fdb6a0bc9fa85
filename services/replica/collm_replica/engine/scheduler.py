"""The engine's scheduling decisions, pure: no torch, no clock of its own, no threads.

Each iteration the engine plans its inference step (`plan_iteration`: which sequences run, how many
tokens each brings, admission and preemption over the paged KV cache), then decides the background work
that fits after it (`decide_background`, on the input `background_input` builds from the replica's
state): how long training and pending evaluations may run and which training job runs. They take plain
data: views of the requests, the cost predictions, the current time as an argument. The simulator
(`tools/collm_sim`) calls the same functions.

## The iteration batch plan

vLLM's schedule -> execute -> update loop: every iteration this policy decides which sequences run, how
many tokens each brings, which waiting sequences are admitted and which running ones are preempted.
Guarantees:

* every running sequence that is decoding gets its next token each iteration when the KV pool allows
  (decodes first, oldest first), so a long prompt never stalls running decodes: prompts are cut into
  chunks of at most `prefill_chunk_tokens`, and an iteration never exceeds `max_batch_tokens` (decode
  tokens plus prefill chunks);
* the running batch is bounded by what the KV pool holds (admission by blocks, below) and by the token
  budget, with `max_batch` only an upper bound (vLLM's `max_num_seqs`): admission stops at
  `BatchConfig.max_running` sequences, so the decodes of a full batch leave `prefill_reserve_tokens` of
  every iteration's budget to prefill chunks. A waiting prompt therefore never waits on the decodes:
  while a prefill is pending and the batch and the pool have room for it, each iteration gives prefill
  chunks (running sequences' first, then admissions, FCFS) at least that many tokens (a request's `n`
  choices fork beyond the bound, by at most `n - 1` sequences, and take from it);
* the KV cache is paged (`kv.BlockManager`): with `kv_admission="paged"` (the default) a sequence
  is admitted when the pool has the blocks its first chunk needs now (plus a small watermark), and it
  takes more blocks as it grows. When the pool runs out, the running sequence that needs a block
  preempts others chosen by `victim` (the latest arrival first, as vLLM does), never one already
  scheduled this iteration; a preempted sequence loses its blocks and returns to the front of the queue
  to recompute its prompt and the tokens it generated (its output so far is kept, so its greedy output is
  unchanged). The oldest running sequence can always proceed, because every request fits the pool alone
  (the engine refuses larger ones), so the plan never deadlocks. Nothing is admitted in an iteration
  that preempted or left a sequence waiting for blocks;
* with `kv_admission="reserve"` the whole sequence (prompt + max_tokens) is reserved at admission
  (`kv_reserve`, in tokens rounded up to whole blocks) and nothing is ever preempted: the baseline the
  paged policy is measured against;
* with the prefix cache (`engine.prefix_cache`), a waiting sequence's view already counts the cached
  prefix it would share at admission as computed and held, so its chunk starts after it; cached blocks
  that no sequence holds count as free until admission takes them (`revive_blocks`), and a preemption
  counts only the blocks the victim holds alone (`freeable_blocks`) as given back;
* admission is FCFS from the waiting queue while the running batch has room (`max_running`); the
  queue itself is bounded by the caller (`max_queue`, refused with 429 before it gets here).

## Background work

`decide_background` grants the time after the step that background work may use without endangering
any request's SLO (the co-scheduler's budget, within the guard for the next arrival), the window of
pending evaluations, and the training job that runs: a round job due at its deadline first, then the
one in progress, then the next in turn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from collm_replica.engine.cosched import (
    CoSchedInput,
    CoScheduler,
    ReqTiming,
    StepModel,
    TrainCost,
    arrival_guard_s,
    background_budget_ms,
    effective_share,
    likely_arrivals,
    request_deadlines,
    running_timing,
    ttft_lost,
)
from collm_replica.engine.kv import blocks_for

TRAIN_MS_CAP = 60_000.0  # the most training time one decision grants
DEFAULT_EVAL_MARGIN_MS = 10.0  # evaluation's margin when the co-scheduler states none (`margin_ms`)

KvAdmission = Literal["paged", "reserve"]


@dataclass(frozen=True)
class BatchConfig:
    """The batch limits of one replica: `max_batch` sequences at most (an upper bound beside the KV pool,
    like vLLM's `max_num_seqs`), `max_batch_tokens` tokens per iteration (decodes and prefill chunks),
    prefill chunks of at most `prefill_chunk_tokens`, a paged KV pool of `kv_budget_tokens` in blocks of
    `block_size` tokens, and its admission rule (`kv_admission`, `watermark_frac`)."""

    max_batch: int = 128
    max_batch_tokens: int = 256
    prefill_chunk_tokens: int = 128
    kv_budget_tokens: int = 32768  # the pool: kv_budget_tokens // block_size blocks
    block_size: int = 16
    kv_admission: KvAdmission = "paged"
    watermark_frac: float = 0.01  # paged admission leaves this share of the pool free for growth

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_batch_tokens, self.prefill_chunk_tokens, self.kv_budget_tokens) < 1:
            raise ValueError("batch sizes must be >= 1")
        if self.block_size < 1 or self.kv_budget_tokens < self.block_size:
            raise ValueError("block_size must be >= 1 and the KV budget at least one block")
        if self.kv_admission not in ("paged", "reserve"):
            raise ValueError(f"kv_admission must be 'paged' or 'reserve', not {self.kv_admission!r}")

    @property
    def prefill_reserve_tokens(self) -> int:
        """The tokens of every iteration that a full batch's decodes leave to prefill chunks: one chunk,
        at most half the budget (so decodes keep the other half)."""
        return min(self.prefill_chunk_tokens, self.max_batch_tokens // 2)

    @property
    def max_running(self) -> int:
        """The most sequences admission lets run at once: `max_batch`, and no more than the token budget
        decodes while it keeps `prefill_reserve_tokens` for prefill (at least one)."""
        return max(1, min(self.max_batch, self.max_batch_tokens - self.prefill_reserve_tokens))

    @property
    def num_blocks(self) -> int:
        return self.kv_budget_tokens // self.block_size

    @property
    def watermark_blocks(self) -> int:
        return max(1, int(self.num_blocks * self.watermark_frac)) if self.num_blocks > 1 else 0

    def reserve_tokens(self, tokens: int) -> int:
        """A reservation of `tokens` tokens in whole blocks (reserve admission)."""
        return blocks_for(tokens, self.block_size) * self.block_size


@dataclass(frozen=True)
class SeqView:
    """What the scheduler knows of one sequence."""

    seq_id: str
    prompt_len: int
    computed: int  # tokens already in the KV cache
    kv_reserve: int = 0  # reserve admission: KV tokens reserved for the whole sequence
    ready: bool = True  # False while its adapter version is not resident yet
    output_len: int = 0  # tokens generated so far (recomputed with the prompt after a preemption)
    blocks_held: int = 0  # blocks of the KV pool the sequence holds
    # Blocks that preempting it gives back (None: `blocks_held`); fewer when it shares blocks with others.
    freeable_blocks: int | None = None
    # A waiting sequence with a prefix-cache hit counts the hit in `computed` and `blocks_held`; of those
    # blocks, `revive_blocks` are held by no sequence now (cached): admission takes them from the pool.
    revive_blocks: int = 0

    @property
    def pending(self) -> int:
        """Known tokens not yet in the KV cache (at least the one a decode feeds)."""
        return max(1, self.prompt_len + self.output_len - self.computed)

    @property
    def freeable(self) -> int:
        """Blocks that preempting it gives back."""
        return self.blocks_held if self.freeable_blocks is None else self.freeable_blocks

    @property
    def prefilling(self) -> bool:
        return self.prompt_len + self.output_len - self.computed > 1


@dataclass
class Plan:
    admitted: list[str] = field(default_factory=list)
    items: list[tuple[str, int]] = field(default_factory=list)  # (seq_id, tokens this iteration)
    preempted: list[str] = field(default_factory=list)  # running sequences that lose their blocks

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.items)


Victim = Callable[[Sequence[SeqView]], SeqView]


def latest_arrival(candidates: Sequence[SeqView]) -> SeqView:
    """The preemption victim: the candidate that arrived last (candidates are in arrival order)."""
    return candidates[-1]


def plan_iteration(
    cfg: BatchConfig,
    running: list[SeqView],
    waiting: list[SeqView],
    kv_reserved: int = 0,
    free_blocks: int | None = None,
    victim: Victim = latest_arrival,
) -> Plan:
    """The work of one iteration. `running` and `waiting` are in arrival order (preempted sequences at
    the front of `waiting`); `kv_reserved` is the running sequences' reservations (reserve admission),
    `free_blocks` the pool's free blocks (paged admission; None: the whole pool less what running
    sequences hold)."""
    if cfg.kv_admission == "reserve":
        return _plan_reserved(cfg, running, waiting, kv_reserved)
    if free_blocks is None:
        free_blocks = cfg.num_blocks - sum(s.blocks_held for s in running)
    plan = Plan()
    budget = cfg.max_batch_tokens
    free = free_blocks
    alive = list(running)
    scheduled: set[str] = set()
    gone: set[str] = set()  # preempted this iteration (no longer in `alive`)
    stalled = False

    def take(s: SeqView, n: int) -> bool:
        """Schedule `n` tokens of `s`, preempting later unscheduled sequences for its blocks."""
        nonlocal free, stalled
        need = blocks_for(s.computed + n, cfg.block_size) - s.blocks_held
        while need > free:
            others = [r for r in alive if r.seq_id not in scheduled and r.seq_id != s.seq_id]
            if not others:
                stalled = True  # it waits, keeping its blocks, for sequences ahead of it to finish
                return False
            out = victim(others)
            alive.remove(out)
            gone.add(out.seq_id)
            plan.preempted.append(out.seq_id)
            free += out.freeable
        free -= need
        scheduled.add(s.seq_id)
        plan.items.append((s.seq_id, n))
        return True

    # 1. Decodes first, oldest first: one token per decoding sequence.
    for s in running:
        if budget > 0 and s.seq_id not in gone and not s.prefilling and take(s, 1):
            budget -= 1
    # 2. Prefill (or recompute) chunks of sequences already running, oldest first.
    for s in running:
        if budget > 0 and s.seq_id not in gone and s.prefilling:
            n = min(s.pending, cfg.prefill_chunk_tokens, budget)
            if take(s, n):
                budget -= n
    if plan.preempted or stalled:
        return plan
    # 3. Admit waiting sequences FCFS while the batch, the token budget and the pool have room.
    n_running = len(alive)
    max_running = cfg.max_running
    for s in waiting:
        if budget <= 0 or n_running >= max_running:
            break
        if not s.ready:
            continue  # its adapter is being fetched; others may go ahead of it
        n = min(s.pending, cfg.prefill_chunk_tokens, budget)
        need = blocks_for(s.computed + n, cfg.block_size) - s.blocks_held + s.revive_blocks
        if need + (cfg.watermark_blocks if n_running else 0) > free:  # alone, it may take the whole pool
            break  # FCFS: do not let small requests starve a large one forever
        plan.admitted.append(s.seq_id)
        plan.items.append((s.seq_id, n))
        budget -= n
        free -= need
        n_running += 1
    return plan


def repeated_decodes(
    cfg: BatchConfig, running: Sequence[SeqView], waiting: Sequence[SeqView], free_blocks: int, most: int
) -> int:
    """How many iterations in a row, this one first, `plan_iteration` gives every running sequence one
    decode token and admits and preempts nothing, when nothing arrives and nothing finishes in between
    (each iteration adds one token to every sequence): at most `most`; 0 when this iteration's plan is
    not that. Lets a caller that knows no request arrives (a simulation) take those iterations at once."""
    if waiting or not running or most < 1 or len(running) > cfg.max_batch_tokens:
        return 0
    if any(s.prefilling for s in running):
        return 0
    if cfg.kv_admission == "reserve":
        return most

    def need(k: int) -> int:  # blocks the sequences take over k iterations
        return sum(blocks_for(s.computed + k, cfg.block_size) - s.blocks_held for s in running)

    if need(most) <= free_blocks:
        return most
    lo, hi = 0, most  # need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= free_blocks else (lo, mid)
    return lo


def _plan_reserved(
    cfg: BatchConfig, running: list[SeqView], waiting: list[SeqView], kv_reserved: int
) -> Plan:
    """Reserve admission: the whole sequence's KV is reserved at admission, nothing is preempted."""
    plan = Plan()
    budget = cfg.max_batch_tokens
    for s in running:
        if not s.prefilling and budget > 0:
            plan.items.append((s.seq_id, 1))
            budget -= 1
    for s in running:
        if s.prefilling and budget > 0:
            n = min(s.pending, cfg.prefill_chunk_tokens, budget)
            plan.items.append((s.seq_id, n))
            budget -= n
    n_running = len(running)
    max_running = cfg.max_running
    for s in waiting:
        if budget <= 0 or n_running >= max_running:
            break
        if not s.ready:
            continue
        if kv_reserved + s.kv_reserve > cfg.kv_budget_tokens:
            break
        n = min(s.pending, cfg.prefill_chunk_tokens, budget)
        plan.admitted.append(s.seq_id)
        plan.items.append((s.seq_id, n))
        budget -= n
        kv_reserved += s.kv_reserve
        n_running += 1
    return plan


class RequestView(NamedTuple):
    """A request as the background decision sees it; times on the engine's clock (s), SLOs in s. A named
    tuple: one is built for every present request at every iteration."""

    request_id: str
    t_arrival_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    t_first_s: float | None
    prompt_len: int
    computed: int
    n_output: int
    max_tokens: int


class JobView(NamedTuple):
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
    # A stretch of training beyond the slack (the coordinator's spend): this share of the tightest TTFT SLO.
    train_spend_stretch_frac: float = 0.1


class BackgroundInput(NamedTuple):
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
    spend: float = 0.0  # the coordinator's spend beyond the slack (`cosched.CoSchedInput.spend`)


class BackgroundDecision(NamedTuple):
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
            ttft_lost(now_s, s.t_arrival_s, s.t_first_s, s.ttft_slo_s),
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
            lost=ttft_lost(now_s, s.t_arrival_s, None, s.ttft_slo_s),
        )
        for s in waiting
    ]
    b = settings.batch
    model = StepModel(
        decode_step_s=decode_step_ms / 1e3,
        prefill_s_per_token=prefill_ms_per_token / 1e3,
        max_batch=b.max_running,
        max_batch_tokens=b.max_batch_tokens,
        prefill_chunk_tokens=b.prefill_chunk_tokens,
    )
    return run, wait, model


def background_input(
    now_s: float,
    running: Sequence[RequestView],
    waiting: Sequence[RequestView],
    plan_items: Sequence[tuple[str, int]],
    plan_tokens: int,
    step_ms: float,
    *,
    share: float | None,
    share_expires_s: float | None,
    share_default: float,
    spend: float,
    decode_ms_at: Callable[[int], float],
    prefill_ms_per_token: float,
    train: TrainCost,
    arrivals: ArrivalHistory,
    default_ttft_slo_ms: float,
    prompt_tokens_ewma: float,
    jobs: Sequence[JobView],
    training_paused: bool,
    evals_pending: bool,
    iteration: int,
    job_rr: int,
) -> BackgroundInput:
    """The background decision's input from a replica's state at `now_s`, the one rule for the engine
    and the simulator.

    `running`/`waiting`: the requests (`RequestView`); `plan_items`/`plan_tokens`: this iteration's planned
    step and `step_ms` its predicted cost. The share in force is the coordinator's `share` until
    `share_expires_s`, else `share_default` (`cosched.effective_share`), and the coordinator's `spend`
    counts only while its share is in force. A decode step of the running batch costs
    `decode_ms_at(len(running))` (of one sequence when none runs). The tightest TTFT SLO is that of the
    present requests and of the arrivals within `arrivals`' window (`default_ttft_slo_ms` at most;
    `ArrivalHistory.min_ttft_slo_ms`, which prunes the older arrivals), and the arrivals to expect within
    it are at the window's rate; the next prompt's length is `prompt_tokens_ewma`, rounded. `jobs`,
    `training_paused`, `evals_pending`, `iteration` and `job_rr` are passed through (`BackgroundInput`)."""
    in_force, source = effective_share(now_s, share, share_expires_s, share_default)
    present_ms = [r.ttft_slo_s * 1e3 for r in (*running, *waiting)]
    min_ttft_ms = arrivals.min_ttft_slo_ms(now_s, present_ms, default_ttft_slo_ms)
    return BackgroundInput(
        now_s=now_s,
        share=in_force,
        running=running,
        waiting=waiting,
        plan_items=plan_items,
        plan_tokens=plan_tokens,
        step_ms=step_ms,
        decode_step_ms=decode_ms_at(max(1, len(running))),
        prefill_ms_per_token=prefill_ms_per_token,
        train=train,
        min_ttft_slo_ms=min_ttft_ms,
        prompt_tokens_guess=round(prompt_tokens_ewma),
        arrivals_within_ttft=arrivals.likely_arrivals(min_ttft_ms / 1e3),
        jobs=jobs,
        training_paused=training_paused,
        evals_pending=evals_pending,
        iteration=iteration,
        job_rr=job_rr,
        spend=spend if source == "coordinator" else 0.0,
    )


def _deadlines_and_guard(
    inp: BackgroundInput, settings: BackgroundSettings, guard_ms: float
) -> tuple[tuple[float, ...], float]:
    """The requests' deadlines after the planned step (`cosched.request_deadlines`), and the background
    time (ms) within `guard_ms` that the next arrivals could absorb while requests run
    (`cosched.arrival_guard_s`; `guard_ms` when none runs)."""
    running, waiting, model = timings(
        inp.now_s,
        inp.running,
        inp.waiting,
        inp.plan_items,
        settings,
        inp.decode_step_ms,
        inp.prefill_ms_per_token,
    )
    deadlines = request_deadlines(running, waiting, model)
    if inp.running:
        guard_ms = min(
            guard_ms,
            1e3
            * arrival_guard_s(
                running,
                waiting,
                model,
                inp.step_ms / 1e3,
                (1.0 - settings.train_slo_reserve_frac) * inp.min_ttft_slo_ms / 1e3,
                inp.prompt_tokens_guess,
                inp.arrivals_within_ttft,
            ),
        )
    return deadlines, guard_ms


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
    min_ttft_ms = inp.min_ttft_slo_ms
    has_job = bool(inp.jobs) and not inp.training_paused
    guard_ms = settings.train_guard_frac * min_ttft_ms
    deadlines: tuple[float, ...] = ()
    # Without background work to grant (no evaluation pending, and no job or a share of 0: no
    # co-scheduler trains then) the requests' deadlines and the arrival guard are not needed.
    if inp.evals_pending or (has_job and inp.share > 0):
        deadlines, guard_ms = _deadlines_and_guard(inp, settings, guard_ms)
    cin = CoSchedInput(
        now_s=inp.now_s,
        share=inp.share,
        has_job=has_job,
        running=len(inp.running),
        waiting=len(inp.waiting),
        inference_tokens=inp.plan_tokens,
        token_budget=settings.batch.max_batch_tokens,
        step_ms=inp.step_ms,
        deadlines_s=deadlines,
        train=inp.train,
        micro_tokens=settings.micro_tokens,
        batch_tokens=settings.batch_tokens,
        iteration=inp.iteration,
        max_train_ms=guard_ms,
        spend=inp.spend,
        spend_stretch_ms=settings.train_spend_stretch_frac * min_ttft_ms,
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
