"""A simulated replica: the engine's iteration loop with costs from the calibration file, no model.

Each iteration does what `collm_replica.engine.Engine._iteration` does, in virtual time:

1. drop waiting requests past their deadline (`collm_sim.batch.ServingBatch`);
2. the replica's `engine.scheduler.plan_iteration` picks decode tokens and prefill chunks, admits FCFS
   and preempts by the blocks of the paged KV cache (`kv_admission`, as the replica: a preempted request
   goes back to the front of the queue and recomputes its prompt and output before its next token);
3. the replica's `engine.scheduler.decide_background` decides the training and evaluation windows after
   the step, through its co-scheduler (`collm_replica.engine.cosched`), on the input `scheduler.
   background_input` builds from the replica's state, the rule the engine's `_decide_background` uses
   (`collm_sim.windows.BackgroundWindows`: the coordinator's share with its TTL, the requests as the
   engine's `Sequence.timing` shows them, with `max_tokens` their output length as the benchmark client
   asks for exactly that many tokens, the arrival history's tightest TTFT SLO and likely arrivals);
4. the inference step costs `CostModel.step_ms` (what the step log's comparison predicts too):
   `decode_step_ms(decodes)`, plus `decode_ms_per_context_token` per token of the decoding sequences'
   contexts beyond `decode_context_tokens` each, plus `prefill_ms_per_token` per prefill token and
   `prefill_ms_per_token_per_context_token` per prefill token and earlier token of its sequence
   (`prefill_fixed_ms` instead of a decode step when the step has no decodes), times (1 +
   `lora_overhead_frac_per_adapter` per distinct adapter in the batch); training runs after it, so
   requests wait for it, exactly as on the real engine (one process, one device, no overlap): a stretch
   of whole pieces (a micro-step of `train_micro_tokens` costs `train_fixed_ms + train_ms_per_token *
   tokens`, in `train_pieces_per_micro_step` pieces) within the budget, at least one when idle; a
   micro-step carries over to the next stretch, its tokens count when it completes, and a request
   arriving during a stretch ends it after the piece in progress (the engine's `_news`);
5. tokens are emitted at the end of the inference step: a prompt's last prefill chunk emits its first
   token (TTFT), every decode one more token.

Background work (`collm_sim.background.Background`): a round job only trains, as the engine's does; the
aggregator's gate asks every evaluator to score a version (`EvalTask`, when the calibration has its cost,
`CostModel.eval_ms`), which runs before training after the inference step, as the engine's pending
evaluations do; training gets what is left of the decision's window.

A run of decode iterations is taken at once when nothing can change its plan: every running request
decodes, nothing waits, no job or evaluation is pending, and `scheduler.repeated_decodes` says the plan
stays one token per request for that many iterations (up to the first request to finish). Each of them
keeps its own step cost, end time and step-log record; a request, a job or an evaluation reaching the
replica cuts the run at the iteration in progress, and telemetry applies the iterations done before
it reads the replica, so the results are those of one iteration at a time. With a job or an evaluation
pending each iteration still gets its co-scheduler decision, but its plan is the last one's while
`repeated_decodes` vouches for it and nothing arrives (`SamePlan`): `plan_iteration` is not asked again.

The co-scheduler is given the calibration's costs as its predictions (the live engine learns the same
costs online). Telemetry is built like the live replica's (`collm_sim.telemetry`: a window of
`slo_window_s` for latency percentiles and attainment, rates over the interval).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from collm_common.calibration import CostModel
from collm_common.wire.telemetry import ReplicaTelemetry
from collm_sim.background import Background, EvalTask, Job
from collm_sim.batch import Req, ServingBatch
from collm_sim.config import EngineSpec
from collm_sim.plugins import BackgroundSettings, CoScheduler
from collm_sim.telemetry import ReplicaStats, StepLogFn, StepShape, replica_telemetry
from collm_sim.windows import BackgroundWindows


class SamePlan:
    """The plan of the iterations after one that `scheduler.repeated_decodes` says plan the same (every
    running request decodes one token, nothing admitted or preempted) while nothing arrives: `left` of
    them, and the last one's items, decodes, tokens of context and distinct adapters."""

    __slots__ = ("items", "n_dec", "dec_context", "n_adapters", "left")

    def __init__(
        self, items: list[tuple[Req, int]], n_dec: int, dec_context: int, n_adapters: int, left: int
    ) -> None:
        self.items = items
        self.n_dec = n_dec
        self.dec_context = dec_context
        self.n_adapters = n_adapters
        self.left = left


# The most decode iterations one run takes at once (anything reaching the replica cuts a run, and the
# step costs of the iterations after the cut are wasted work).
RUN_MAX = 64

FinishFn = Callable[[Req], None]
JobDoneFn = Callable[["SimReplica", Job, float], None]


class SimReplica:
    """One simulated replica: the engine's iteration loop over its requests (`batch`), with its background
    decision (`windows`), its background work (`bg`), and its counters, step log and telemetry (`stats`).
    `versions` is the cluster's current version of each adapter (shared, read-only here); `on_finish(req)`
    is told when a request ends, `on_job_done(replica, job, t)` when a round job does."""

    def __init__(
        self,
        replica_id: str,
        cost: CostModel,
        engine: EngineSpec,
        cosched: CoScheduler,
        domain: str,
        samples: int,
        versions: dict[str, int],
        ttft_slo_ms: float | None,
        tpot_slo_ms: float | None,
        request_timeout_s: float,
        on_finish: FinishFn,
        on_job_done: JobDoneFn,
    ) -> None:
        self.replica_id = replica_id
        self.engine = engine
        self.domain = domain
        self.samples = samples
        self.cost = cost
        # Decode step cost by number of decoding sequences, computed once (the cost model interpolates).
        self.decode_ms = [0.0] + [cost.decode_ms(b) for b in range(1, engine.max_batch_tokens + 1)]
        self.prefill_per_token_ms = cost.prefill_ms_per_token
        self.stats = ReplicaStats(engine.slo_window_s)
        self.batch = ServingBatch(
            engine, versions, ttft_slo_ms, tpot_slo_ms, request_timeout_s, self.stats.window, on_finish
        )
        self.bg = Background(self, cost, engine, on_job_done)
        self.windows = BackgroundWindows(
            engine, cosched, self.batch.cfg, self.decode_ms, self.prefill_per_token_ms, self.bg
        )
        self.idle = True
        # The iteration in progress: (items, end of its inference step, end of its evaluation pieces, end
        # of its training stretch, whether its evaluation catches up on its pace), its inference step
        # (ms, tokens) and its shape for the step log.
        self.pending: tuple[list[tuple[Req, int]], float, float, float, bool] | None = None
        self._pending_step = (0.0, 0)
        self._step_shape: StepShape = (0, 0, [], 0, (0.0, None))
        self.gen = 0  # bumped when an arrival cuts the iteration short (its old end event is stale)
        self.iteration = 0
        self.iterations_total = 0
        # A run of decode-only iterations taken at once (`_decode_run`): (end s, inference ms, decode context
        # tokens) of the iterations before `pending`, not yet applied from index `_run_i` on.
        self._run: list[tuple[float, float, int]] = []
        self._run_i = 0
        # The iterations ahead that plan as the last one did (`_plan_repeats`), or None.
        self._same_plan: SamePlan | None = None

    # --- what the cluster and the benchmarks read -----------------------------------------------------
    @property
    def running(self) -> list[Req]:
        return self.batch.running

    @property
    def blocks_used(self) -> int:
        return self.batch.blocks_used

    @property
    def preemptions(self) -> int:
        return self.batch.preemptions

    @property
    def settings(self) -> BackgroundSettings:
        return self.windows.settings

    @property
    def busy_ms(self) -> dict[str, float]:
        return self.stats.busy_ms

    @property
    def ft_tokens_total(self) -> int:
        return self.stats.ft_tokens_total

    @property
    def inference_steps(self) -> list[tuple[float, float, int]]:
        return self.stats.inference_steps

    @property
    def step_log(self) -> StepLogFn | None:
        """Told every inference step and stretch of background work (`ReplicaStats.step_log`)."""
        return self.stats.step_log

    @step_log.setter
    def step_log(self, log: StepLogFn | None) -> None:
        self.stats.step_log = log

    def inference_until(self, cut_s: float) -> tuple[float, int]:
        return self.stats.inference_until(cut_s)

    def ft_tokens_until(self, cut_s: float) -> int:
        return self.stats.ft_tokens_until(cut_s)

    def telemetry(self, now: float, interval_s: float) -> ReplicaTelemetry:
        self.sync(now)
        return replica_telemetry(self, now, interval_s)

    # --- requests ----------------------------------------------------------------------------------
    def enqueue(self, req: Req, now: float) -> bool:
        """Admission to the waiting queue; False (a 429) when the queue is full."""
        if not self.batch.enqueue(req):
            return False
        req.replica = self.replica_id
        self.stats.arrivals += 1
        self.windows.arrived(now, self.batch.ttft_slo_s * 1e3, req.prompt_len)
        return True

    def interrupt(self, now: float) -> float | None:
        """A request arrived: a training stretch in progress stops after its piece in progress (none
        starts once the inference step is over), as the engine's training yields to news. Returns the
        iteration's new end (the cluster reschedules it; `gen` marks the old end stale), or None. A run of
        decode iterations taken at once ends with the iteration in progress (one ending at `now` is over, as
        the event queue takes an iteration's end before an arrival at the same time)."""
        p = self.pending
        if p is None:
            return None
        if self._run_i < len(self._run):
            return self._cut_run(now)
        items, t_inf, t_ev, t_end, catch_up = p
        if now >= t_end or t_end <= t_inf:
            return None
        if now < t_ev:  # evaluation pieces: at least one ran or runs; catching up on its pace, all of them
            if catch_up:
                return None
            piece_s = self.bg.eval_piece_ms / 1e3
            pieces = max(1, math.ceil((now - t_inf) / piece_s - 1e-9)) if piece_s > 0 else 0
            new_ev = min(t_ev, t_inf + pieces * piece_s)
            new_end = new_ev  # training does not start after news
        else:
            new_ev = t_ev
            pieces = max(0, math.ceil((now - t_ev) / (self.bg.piece_ms / 1e3) - 1e-9))
            new_end = min(t_end, t_ev + pieces * self.bg.piece_ms / 1e3)
        if new_end >= t_end:
            return None
        self.pending = (items, t_inf, new_ev, new_end, catch_up)
        self.gen += 1
        return new_end

    # --- control --------------------------------------------------------------------------------------
    def set_share(self, share: float, expires_s: float, spend: float = 0.0) -> None:
        """The coordinator's share command: `share` (and `spend`) in force until `expires_s`."""
        self.windows.set_share(share, expires_s, spend)

    def share_now(self, now: float) -> float:
        """The training share in force at `now`: the coordinator's until its TTL, then the default."""
        return self.windows.share_in_force(now)[0]

    def start_job(
        self, adapter: str, round_id: int, base_version: int, budget: int, deadline_s: float, now: float
    ) -> None:
        self.bg.start_job(adapter, round_id, base_version, budget, deadline_s, now)

    def add_eval(self, task: EvalTask) -> None:
        """The aggregator asks this replica to score a version (the cluster wakes the replica)."""
        self.bg.add_eval(task)

    @property
    def has_job(self) -> bool:
        return self.bg.has_job

    @property
    def job(self) -> Job | None:
        return self.bg.job

    @property
    def eval_ms_each(self) -> float | None:
        return self.bg.eval_ms_each

    # --- the iteration loop ---------------------------------------------------------------------------
    def step(self, now: float) -> float | None:
        """Finish the iteration in progress (if any) and start the next; its end time, or None: idle."""
        if self.pending is not None:
            if self._run_i < len(self._run):
                self._apply_run(len(self._run))
            self._complete()
        return self._start(now)

    # --- runs of decode iterations ------------------------------------------------------------------
    def _decode_run(self, now: float, items: list[tuple[Req, int]], inf_ms: float) -> float | None:
        """When this iteration only decodes, nothing waits and no background work is due, the iterations
        that follow are the same plan (`scheduler.repeated_decodes`) until a request finishes or something
        reaches the replica (which cuts the run: `interrupt`): they are taken at once, each with its own
        step cost (the context grows by a token per sequence), and applied when the run ends or the
        replica is read (`sync`). Returns the run's end, or None when there is no run."""
        k = self.batch.decode_repeats(RUN_MAX)
        if not k:
            return None
        n_dec, dec_context, _, n_adapters, _ = self._step_shape
        run: list[tuple[float, float, int]] = []
        t = now + inf_ms / 1e3
        run.append((t, inf_ms, dec_context))
        cost = self.cost
        for j in range(1, k):
            ctx = dec_context + j * n_dec
            ms = cost.step_ms(n_dec, ctx, (), n_adapters)
            t = t + ms / 1e3
            run.append((t, ms, ctx))
        last_t, last_ms, last_ctx = run.pop()
        self._run, self._run_i = run, 0
        self.pending = (items, last_t, last_t, last_t, False)
        self._pending_step = (last_ms, len(items))
        self._step_shape = (n_dec, last_ctx, [], n_adapters, (0.0, None))
        self.iteration += k - 1
        self.iterations_total += k - 1
        return last_t

    def _apply_run(self, upto: int) -> None:
        """Apply the run's iterations before index `upto` (each gives every running request one token)."""
        start = self._run_i
        if upto <= start:
            return
        assert self.pending is not None
        items = self.pending[0]
        n = len(items)
        stats = self.stats
        n_dec, _, _, n_adapters, _ = self._step_shape
        for t_inf, ms, ctx in self._run[start:upto]:
            stats.inference_step(t_inf, ms, n, (n_dec, ctx, [], n_adapters, (0.0, None)), logged=True)
        m = upto - start
        stats.gen_tokens += m * n
        self.batch.decoded(items, m)
        self._run_i = upto

    def sync(self, now: float) -> None:
        """Apply the iterations of a run that ended before `now` (before reading the replica)."""
        run, i = self._run, self._run_i
        while i < len(run) and run[i][0] < now:
            i += 1
        self._apply_run(i)

    def _cut_run(self, now: float) -> float | None:
        """End the run with its iteration in progress at `now` (`interrupt`), unless the run still holds:
        nothing waits and there is no job or evaluation (a share alone changes nothing without a job)."""
        if not (self.batch.waiting or self.bg.evals or self.bg.has_job):
            return None
        run, i = self._run, self._run_i
        while i < len(run) and run[i][0] <= now:
            i += 1
        self._apply_run(i)
        if i >= len(run):
            return None  # the run's last iteration is in progress: it ends as planned
        assert self.pending is not None
        t_inf, ms, ctx = run[i]
        dropped = len(run) - i  # iterations after the one in progress (the pending one among them)
        n_dec, _, _, n_adapters, _ = self._step_shape
        self.pending = (self.pending[0], t_inf, t_inf, t_inf, False)
        self._pending_step = (ms, len(self.pending[0]))
        self._step_shape = (n_dec, ctx, [], n_adapters, (0.0, None))
        self._run, self._run_i = [], 0
        self.iteration -= dropped
        self.iterations_total -= dropped
        self.gen += 1
        return t_inf

    # --- one iteration -------------------------------------------------------------------------------
    def _start(self, now: float) -> float | None:
        """Start the next iteration at `now`: its plan, its background windows, its end (None: idle)."""
        batch = self.batch
        batch.expire(now)
        job = self.bg.job
        if job is not None and job.active and now >= job.stop_s:
            self.bg.finish_job(now, "stop")
        running = batch.running
        memo = self._same_plan
        if memo is not None and memo.left > 0 and not batch.waiting and len(running) == memo.n_dec:
            # The plan `repeated_decodes` vouched for: one more decode token for every running request.
            memo.left -= 1
            memo.dec_context += memo.n_dec  # every sequence's context grew by the token it decoded
            items, n_dec, dec_context, n_adapters = memo.items, memo.n_dec, memo.dec_context, memo.n_adapters
            chunks: list[tuple[int, int]] = []
            tokens, changed = n_dec, False
        else:
            items, n_dec, dec_context, chunks, n_adapters, tokens, changed = batch.plan()
            memo = self._same_plan = None
        inf_ms = self.cost.step_ms(n_dec, dec_context, chunks, n_adapters) if items else 0.0
        grant = self.windows.grant(now, self.iteration, batch, items, tokens, inf_ms)
        train_ms, eval_ms = grant.train_ms, grant.eval_ms
        self.iteration += 1
        if not items and train_ms <= 0 and eval_ms <= 0:
            self.idle = True
            return None
        self.iterations_total += 1
        t_inf = now + inf_ms / 1e3
        t_ev = t_inf + eval_ms / 1e3
        self.pending = (items, t_inf, t_ev, t_ev + train_ms / 1e3, grant.catch_up)
        self._pending_step = (inf_ms, tokens)
        self._step_shape = (n_dec, dec_context, chunks, n_adapters, grant.decision)
        self.idle = False
        if n_dec == len(items) == len(running) and not (batch.waiting or changed):
            if not (self.bg.has_job or self.bg.evals):
                end = self._decode_run(now, items, inf_ms)
                if end is not None:
                    self._same_plan = None
                    return end
            elif memo is None and items:
                self._same_plan = self._plan_repeats(items, n_dec, dec_context, n_adapters)
        return t_ev + train_ms / 1e3

    def _plan_repeats(
        self, items: list[tuple[Req, int]], n_dec: int, dec_context: int, n_adapters: int
    ) -> SamePlan | None:
        """After a plan that gives every running request one decode token with nothing waiting: the
        iterations after it that `repeated_decodes` says plan the same while nothing arrives (none
        finishes before the first request to finish does, at the last of them), or None."""
        k = self.batch.decode_repeats()
        return SamePlan(items, n_dec, dec_context, n_adapters, k - 1) if k else None

    def _complete(self) -> None:
        """End the iteration in progress: count its inference step, emit its tokens, spend its
        evaluation pieces and its training stretch."""
        assert self.pending is not None
        items, t_inf, t_ev, t_end, _ = self.pending
        self.pending = None
        eval_ms = max(0.0, (t_ev - t_inf) * 1e3)
        train_ms = max(0.0, (t_end - t_ev) * 1e3)  # an arrival may have cut the stretch short
        inf_ms, tokens = self._pending_step
        stats = self.stats
        stats.inference_step(t_inf, inf_ms, tokens, self._step_shape, logged=bool(items))
        stats.train_ms += train_ms
        stats.evaluation(t_inf, eval_ms)
        prefilled, generated = self.batch.emit(items, t_inf)
        stats.prefill_tokens += prefilled
        stats.gen_tokens += generated
        self.batch.train_ms_total += train_ms  # after the step's tokens: the stretch came after them
        if eval_ms > 0:
            self.bg.spend_evals(eval_ms, t_ev)
        job = self.bg.job
        if train_ms > 0 and job is not None and job.active:
            self.windows.cosched.charge(train_ms)
            train_tokens, micro_steps = self.bg.train(job, train_ms)
            stats.training(t_ev, t_end, train_ms, train_tokens, micro_steps)
            if job.done:
                self.bg.finish_job(t_end, "budget")
