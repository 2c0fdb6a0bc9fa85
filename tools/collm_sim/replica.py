"""A simulated replica: the engine's iteration loop with costs from the calibration file, no model.

Each iteration does what `collm_replica.engine.Engine._iteration` does, in virtual time:

1. drop waiting requests past their deadline;
2. the replica's `engine.scheduler.plan_iteration` picks decode tokens and prefill chunks, admits FCFS
   and preempts by the blocks of the paged KV cache (`kv_admission`, as the replica: a preempted request
   goes back to the front of the queue and recomputes its prompt and output before its next token);
3. the replica's `engine.scheduler.decide_background` decides the training and evaluation windows after
   the step, through its co-scheduler (`collm_replica.cosched`), given the coordinator's share (with its
   TTL: `effective_share`), the requests as the engine's `Sequence.timing` shows them (`max_tokens` is
   the output length: the benchmark client asks for exactly that many tokens) and the arrival history's
   tightest TTFT SLO and likely arrivals, exactly as the engine's `_decide_background` calls it;
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
costs online). Telemetry is built like the live replica's (a window of `slo_window_s` for latency
percentiles and attainment, rates over the interval).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from itertools import islice

from collm_common.calibration import CostModel
from collm_common.slo import meets_slo
from collm_common.step_log import BackgroundWork, InferenceStep
from collm_common.wire.telemetry import ReplicaTelemetry, ResidentAdapter, TrainingJobStatus
from collm_sim.background import Background, EvalTask, Job
from collm_sim.config import EngineSpec
from collm_sim.plugins import (
    BackgroundInput,
    BackgroundSettings,
    BatchConfig,
    CoScheduler,
    FinishedSample,
    JobView,
    LatencyWindow,
    RequestView,
    SeqView,
    blocks_for,
    decide_background,
    effective_share,
    likely_arrivals,
    plan_iteration,
    repeated_decodes,
)


class Req:
    """One request's life in the simulation."""

    __slots__ = (
        "idx",
        "sid",
        "arrival_s",
        "prompt_len",
        "out_len",
        "domain",
        "computed",
        "generated",
        "t_first",
        "t_end",
        "status",
        "replica",
        "version",
        "view",
        "reserve",
        "attempts",
        "target",
        "blocks",
    )

    def __init__(self, idx: int, arrival_s: float, prompt_len: int, out_len: int, domain: str) -> None:
        self.idx = idx
        self.sid = str(idx)
        self.arrival_s = arrival_s
        self.prompt_len = prompt_len
        self.out_len = out_len
        self.domain = domain
        self.computed = 0
        self.generated = 0
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.status = "pending"
        self.replica: str | None = None
        self.version: str | None = None
        self.reserve = prompt_len + out_len
        # The scheduler's view (None: to be built from the request's state, `seq_view`).
        self.view: SeqView | None = SeqView(self.sid, prompt_len, 0, self.reserve)
        self.attempts = 0
        self.target = (
            prompt_len  # tokens to compute before the next token: the prompt (+ output to recompute)
        )
        self.blocks = 0  # KV blocks held (paged admission)

    def seq_view(self) -> SeqView:
        """The scheduler's view of the request: the one set last, or, after `SimReplica._set_view`, its
        state now (built when a plan first needs it: iterations that reuse a plan never do)."""
        view = self.view
        if view is None:
            view = self.view = SeqView(
                self.sid, self.prompt_len, self.kv_tokens(), self.reserve, output_len=self.generated,
                blocks_held=self.blocks,
            )  # fmt: skip
        return view

    def kv_tokens(self) -> int:
        """Tokens in the KV cache: the prefill done so far, or the prompt and all but the last output."""
        return self.computed if self.computed < self.target else self.prompt_len + self.generated - 1


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


class KeptSummaryWindow(LatencyWindow):
    """The replica's `LatencyWindow`, whose summary is computed again only when a sample came in or
    leaves the window (its pruning drops samples older than `window_s`); the same summaries."""

    def __init__(self, window_s: float) -> None:
        super().__init__(window_s)
        self._times: deque[float] = deque()  # the samples' times, as the window holds them
        self._summary: dict[str, float | int | None] | None = None

    def add(self, sample: FinishedSample) -> None:
        super().add(sample)
        self._times.append(sample.t_s)
        self._summary = None

    def summary(self, now_s: float) -> dict[str, float | int | None]:
        times = self._times
        limit = now_s - self.window_s
        if times and times[0] < limit:
            while times and times[0] < limit:
                times.popleft()
            self._summary = None
        if self._summary is None:
            self._summary = super().summary(now_s)
        return self._summary


# The most decode iterations one run takes at once (anything reaching the replica cuts a run, and the
# step costs of the iterations after the cut are wasted work).
RUN_MAX = 64

FinishFn = Callable[["Req"], None]
JobDoneFn = Callable[["SimReplica", Job, float], None]


class SimReplica:
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
        self.cosched = cosched
        self.domain = domain
        self.samples = samples
        self.versions = versions  # the cluster's current version of each adapter (shared, read-only here)
        self.batch_cfg = BatchConfig(
            engine.max_batch,
            engine.max_batch_tokens,
            engine.prefill_chunk_tokens,
            engine.kv_budget_tokens,
            block_size=engine.kv_block_tokens,
            kv_admission=engine.kv_admission,  # type: ignore[arg-type]
        )
        # Decode step cost by number of decoding sequences, computed once (the cost model interpolates).
        self.decode_ms = [0.0] + [cost.decode_ms(b) for b in range(1, engine.max_batch_tokens + 1)]
        self.cost = cost
        self.prefill_per_token_ms = cost.prefill_ms_per_token
        self.ttft_slo_s = (ttft_slo_ms or 1e12) / 1e3
        self.tpot_slo_s = (tpot_slo_ms or 1e12) / 1e3
        self.ttft_slo_ms = ttft_slo_ms
        self.tpot_slo_ms = tpot_slo_ms
        self.request_timeout_s = request_timeout_s
        self.on_finish = on_finish

        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.by_sid: dict[str, Req] = {}
        self.kv_reserved = 0
        self.blocks_used = 0  # KV blocks held by running requests (paged admission)
        self.preemptions = 0
        self.idle = True
        # The iteration in progress: (items, end of its inference step, end of its evaluation pieces, end
        # of its training stretch, whether its evaluation catches up on its pace).
        self.pending: tuple[list[tuple[Req, int]], float, float, float, bool] | None = None
        self.gen = 0  # bumped when an arrival cuts the iteration short (its old end event is stale)
        # A run of decode-only iterations taken at once (`_decode_run`): (end s, inference ms, decode context
        # tokens) of the iterations before `pending`, not yet applied from index `_run_i` on.
        self._run: list[tuple[float, float, int]] = []
        self._run_i = 0
        self._resident: dict[tuple[str, int, int], ResidentAdapter] = {}
        # The iterations ahead that plan as the last one did (`_plan_repeats`), or None.
        self._same_plan: SamePlan | None = None
        self.block_size = engine.kv_block_tokens
        self.settings = BackgroundSettings(
            batch=self.batch_cfg,
            train_guard_frac=engine.ft_guard_frac,
            train_slack_frac=engine.ft_slack_frac,
            train_slo_reserve_frac=engine.ft_slo_reserve_frac,
            micro_tokens=engine.train_micro_tokens,
            batch_tokens=engine.train_batch_tokens,
            train_spend_stretch_frac=engine.ft_spend_stretch_frac,
        )
        self.iteration = 0
        self.share: float | None = None
        self.share_expires_s: float | None = None
        self.spend = 0.0
        self.bg = Background(self, cost, engine, on_job_done)
        self.window = KeptSummaryWindow(engine.slo_window_s)
        # Counters of the current telemetry interval, and totals.
        self._arrivals = 0
        self._recent_arrivals: deque[float] = deque()
        self._prompt_tokens_ewma = 64.0
        self._gen_tokens = 0
        self._prefill_tokens = 0
        self._ft_tokens = 0
        self._infer_ms = 0.0
        self._train_ms = 0.0
        self._pending_step = (0.0, 0)  # the pending iteration's inference step: (ms, tokens)
        # Busy time by kind of work (ms): inference, training, evaluation (a job's own and the gate's).
        self.busy_ms = {"inference": 0.0, "training": 0.0, "evaluation": 0.0}
        # (end s, ms, tokens) of every inference step, so its work can be read up to a cut
        # (`inference_until`), and (end s, tokens) of every training stretch that completed micro-steps
        # (`ft_tokens_until`).
        self.inference_steps: list[tuple[float, float, int]] = []
        self.training_done: list[tuple[float, int]] = []
        self._last_telemetry_s = 0.0
        self.ft_tokens_total = 0
        self.iterations_total = 0
        # Told every inference step and stretch of background work, in the live step log's records (the
        # engine's `step_log`), so a simulated run's steps can be set beside a live run's.
        self.step_log: Callable[[InferenceStep | BackgroundWork], None] | None = None
        self._step_shape: tuple[int, int, list[tuple[int, int]], int, tuple[float, str | None]] = (
            0, 0, [], 0, (0.0, None),
        )  # fmt: skip

    def inference_until(self, cut_s: float) -> tuple[float, int]:
        """(seconds, tokens) of the inference steps completed by `cut_s`, as a live replica's counters
        read when the load generator stops at the cut (they count a step when it completes)."""
        done = [(ms, n) for end_s, ms, n in self.inference_steps if end_s <= cut_s]
        return sum(ms for ms, _ in done) / 1e3, sum(n for _, n in done)

    def ft_tokens_until(self, cut_s: float) -> int:
        """Fine-tuning tokens of the micro-steps completed by `cut_s`, as a live replica's counter reads
        when the load generator stops at the cut."""
        return sum(n for end_s, n in self.training_done if end_s <= cut_s)

    # --- requests ----------------------------------------------------------------------------------
    def enqueue(self, req: Req, now: float) -> bool:
        """Admission to the waiting queue; False (a 429) when the queue is full."""
        if len(self.waiting) >= self.engine.max_queue:
            return False
        req.replica = self.replica_id
        self.waiting.append(req)
        self._arrivals += 1
        # As the engine at each arrival: the window of recent arrivals and the next prompt's length guess.
        self._recent_arrivals.append(now)
        self._prompt_tokens_ewma = 0.9 * self._prompt_tokens_ewma + 0.1 * req.prompt_len
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

    def _set_view(self, req: Req) -> None:
        """After the request's step: the KV blocks it now holds, and its view for the planner to be
        built from its state (`Req.seq_view`)."""
        blocks = blocks_for(req.kv_tokens(), self.block_size)
        self.blocks_used += blocks - req.blocks
        req.blocks = blocks
        req.view = None

    def _preempt(self, sids: list[str]) -> None:
        """Preempted requests give back their blocks and return to the front of the queue, in arrival
        order, to recompute their prompt and output (as the replica's engine does)."""
        for req in sorted((self.by_sid[s] for s in sids), key=lambda r: r.idx, reverse=True):
            self.running.remove(req)
            del self.by_sid[req.sid]
            self.kv_reserved -= req.reserve
            self.blocks_used -= req.blocks
            req.blocks = 0
            req.computed = 0
            req.target = req.prompt_len + req.generated
            req.view = SeqView(req.sid, req.prompt_len, 0, req.reserve, output_len=req.generated)
            self.waiting.appendleft(req)
        self.preemptions += len(sids)

    def _finish(self, req: Req, t: float, status: str) -> None:
        req.t_end = t
        req.status = status
        if status == "ok":
            self.running.remove(req)
            del self.by_sid[req.sid]
            self.kv_reserved -= req.reserve
            self.blocks_used -= req.blocks
            req.blocks = 0
            # As the engine: an answer without tokens has its first token at its end (TTFT = e2e).
            first_s = req.t_first if req.t_first is not None else t
            ttft_ms = (first_s - req.arrival_s) * 1e3
            tpot_ms = None
            if req.generated > 1 and req.t_first is not None:
                tpot_ms = (t - req.t_first) * 1e3 / (req.generated - 1)
            good = meets_slo(ttft_ms, tpot_ms, self.ttft_slo_ms, self.tpot_slo_ms)
            self.window.add(FinishedSample(t, ttft_ms, tpot_ms, good))
        elif status == "timeout":  # as the engine: dropped from the queue at its deadline, a miss
            self.window.add(FinishedSample(t, None, None, False))
        self.on_finish(req)

    def _expire(self, now: float) -> None:
        w = self.waiting
        limit = now - self.request_timeout_s
        while w and w[0].arrival_s < limit:
            self._finish(w.popleft(), now, "timeout")

    # --- control --------------------------------------------------------------------------------------
    def set_share(self, share: float, expires_s: float, spend: float = 0.0) -> None:
        self.share = share
        self.share_expires_s = expires_s
        self.spend = spend

    def share_now(self, now: float) -> float:
        """The training share in force at `now`: the coordinator's until its TTL, then the default."""
        return effective_share(now, self.share, self.share_expires_s, self.engine.ft_share_default)[0]

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
        running = self.running
        most = min(r.out_len - r.generated for r in running)
        if most < 2:
            return None
        free_blocks = self.batch_cfg.num_blocks - self.blocks_used
        k = repeated_decodes(
            self.batch_cfg, [r.seq_view() for r in running], (), free_blocks, min(most, RUN_MAX)
        )
        if k < 2:
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
        log = self.step_log
        n_dec, _, _, n_adapters, _ = self._step_shape
        for t_inf, ms, ctx in self._run[start:upto]:
            self._infer_ms += ms
            self.busy_ms["inference"] += ms
            self.inference_steps.append((t_inf, ms, n))
            if log is not None:
                log(
                    InferenceStep(
                        t_s=t_inf - ms / 1e3, decodes=n_dec, decode_context_tokens=ctx, prefill=[],
                        adapters=n_adapters, forward_ms=ms, step_ms=ms, train_budget_ms=0.0, train_limit=None,
                    )
                )  # fmt: skip
        m = upto - start
        self._gen_tokens += m * n
        for req, _ in items:
            req.generated += m
            self._set_view(req)
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
        if not (self.waiting or self.bg.evals or self.bg.has_job):
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

    def _request_view(self, r: Req) -> RequestView:
        """The request as the engine's background decision sees it (`Sequence.timing`): its SLOs, first
        token, prompt, tokens computed and output so far; `max_tokens` is its output length (the benchmark
        client asks for exactly the trace's output length)."""
        return RequestView(
            r.sid, r.arrival_s, self.ttft_slo_s, self.tpot_slo_s, r.t_first, r.prompt_len, r.computed,
            r.generated, r.out_len,
        )  # fmt: skip

    def _likely_arrivals(self, now: float, within_s: float) -> int:
        """The engine's `_likely_arrivals`: arrivals to expect within `within_s` at the rate of the last
        SLO window, at least 1 and at most 4."""
        recent = self._recent_arrivals
        while recent and recent[0] < now - self.engine.slo_window_s:
            recent.popleft()
        if not recent:
            return 1
        return likely_arrivals(len(recent), recent[0], recent[-1], within_s)

    def _start(self, now: float) -> float | None:
        self._expire(now)
        job = self.bg.job
        if job is not None and job.active and now >= job.stop_s:
            self.bg.finish_job(now, "stop")
        running = self.running
        memo = self._same_plan
        if memo is not None and memo.left > 0 and not self.waiting and len(running) == memo.n_dec:
            # The plan `repeated_decodes` vouched for: one more decode token for every running request.
            memo.left -= 1
            memo.dec_context += memo.n_dec  # every sequence's context grew by the token it decoded
            items, n_dec, dec_context, n_adapters = memo.items, memo.n_dec, memo.dec_context, memo.n_adapters
            chunks: list[tuple[int, int]] = []
            tokens, changed = n_dec, False
        else:
            items, n_dec, dec_context, chunks, n_adapters, tokens, changed = self._plan(running)
            memo = self._same_plan = None
        inf_ms = self.cost.step_ms(n_dec, dec_context, chunks, n_adapters) if items else 0.0
        train_ms = eval_ms = 0.0
        catch_up = False
        job = self.bg.job
        has_job = job is not None and job.active
        decision: tuple[float, str | None] = (0.0, None)  # the training budget and what bounded it
        if has_job or self.bg.evals:
            share, source = effective_share(
                now, self.share, self.share_expires_s, self.engine.ft_share_default
            )
            min_ttft_ms = min(
                self.ttft_slo_ms or self.engine.default_ttft_slo_ms, self.engine.default_ttft_slo_ms
            )
            d = decide_background(
                BackgroundInput(
                    now_s=now,
                    share=share,
                    running=[self._request_view(r) for r in running],
                    waiting=[self._request_view(r) for r in self.waiting],
                    plan_items=[(r.sid, n) for r, n in items],
                    plan_tokens=tokens,
                    step_ms=inf_ms,
                    decode_step_ms=self.decode_ms[max(1, len(running))],
                    prefill_ms_per_token=self.prefill_per_token_ms,
                    train=self.bg.train_cost,
                    min_ttft_slo_ms=min_ttft_ms,
                    prompt_tokens_guess=round(self._prompt_tokens_ewma),
                    arrivals_within_ttft=self._likely_arrivals(now, min_ttft_ms / 1e3),
                    jobs=[JobView(due=False, in_progress=job.progress_ms > 0)] if has_job and job else [],
                    training_paused=False,
                    evals_pending=bool(self.bg.evals),
                    iteration=self.iteration,
                    job_rr=0,
                    spend=self.spend if source == "coordinator" else 0.0,
                ),
                self.settings,
                self.cosched,
            )  # fmt: skip
            if self.bg.evals:
                catch_up_ms = self.engine.ft_guard_frac * min_ttft_ms
                eval_ms, catch_up = self.bg.eval_stretch(d.eval_ms, catch_up_ms, now + inf_ms / 1e3)
            if job is not None and d.job is not None:
                # As the engine: the decision's training window, spent in whole pieces (at least one when
                # idle and no evaluation is pending), never past what the job still needs; evaluation
                # pieces count against the same window.
                decision = (max(0.0, d.train_ms), d.limit)
                window_ms = d.train_ms
                if d.idle and not self.bg.evals:
                    window_ms = max(window_ms, self.bg.piece_ms)
                pieces = int(max(0.0, window_ms - eval_ms) / self.bg.piece_ms + 1e-9)
                train_ms = min(pieces * self.bg.piece_ms, self.bg.ms_to_finish(job))
            elif d.has_job:
                decision = (max(0.0, d.train_ms), d.limit)
        self.iteration += 1
        if not items and train_ms <= 0 and eval_ms <= 0:
            self.idle = True
            return None
        self.iterations_total += 1
        t_inf = now + inf_ms / 1e3
        t_ev = t_inf + eval_ms / 1e3
        self.pending = (items, t_inf, t_ev, t_ev + train_ms / 1e3, catch_up)
        self._pending_step = (inf_ms, tokens)
        self._step_shape = (n_dec, dec_context, chunks, n_adapters, decision)
        self.idle = False
        if n_dec == len(items) == len(running) and not (self.waiting or changed):
            if not (has_job or self.bg.evals):
                end = self._decode_run(now, items, inf_ms)
                if end is not None:
                    self._same_plan = None
                    return end
            elif memo is None and items:
                self._same_plan = self._plan_repeats(items, n_dec, dec_context, n_adapters)
        return t_ev + train_ms / 1e3

    def _plan(
        self, running: list[Req]
    ) -> tuple[list[tuple[Req, int]], int, int, list[tuple[int, int]], int, int, bool]:
        """This iteration's inference step by the replica's `plan_iteration`, with its admissions and
        preemptions applied: (items, decodes, their tokens of context, prefill chunks as (tokens, earlier
        tokens), distinct adapters, tokens, whether it admitted or preempted)."""
        free = self.engine.max_batch - len(running)
        wviews = [r.seq_view() for r in islice(self.waiting, free)] if free > 0 and self.waiting else []
        free_blocks = self.batch_cfg.num_blocks - self.blocks_used
        plan = plan_iteration(
            self.batch_cfg, [r.seq_view() for r in running], wviews, self.kv_reserved, free_blocks
        )
        if plan.preempted:
            self._preempt(plan.preempted)
        for sid in plan.admitted:
            req = self.waiting.popleft()
            assert req.sid == sid, "admission is FCFS"
            running.append(req)
            self.by_sid[sid] = req
            self.kv_reserved += req.reserve
            v = self.versions.get(req.domain)
            req.version = f"{req.domain}@v{v}" if v else "base"
        items: list[tuple[Req, int]] = []
        n_dec = 0
        dec_context = 0  # tokens of context of the decoding sequences
        chunks: list[tuple[int, int]] = []  # (tokens, earlier tokens) of each prefill chunk
        adapters: set[str] = set()
        by_sid = self.by_sid
        tokens = 0
        for sid, n in plan.items:
            req = by_sid[sid]
            items.append((req, n))
            adapters.add(req.domain)
            tokens += n
            if req.computed >= req.target:
                n_dec += 1
                dec_context += req.prompt_len + req.generated - 1  # the tokens before this one
            else:
                chunks.append((n, req.computed))
        changed = bool(plan.admitted or plan.preempted)
        return items, n_dec, dec_context, chunks, len(adapters), tokens, changed

    def _plan_repeats(
        self, items: list[tuple[Req, int]], n_dec: int, dec_context: int, n_adapters: int
    ) -> SamePlan | None:
        """After a plan that gives every running request one decode token with nothing waiting: the
        iterations after it that `repeated_decodes` says plan the same while nothing arrives (none
        finishes before the first request to finish does, at the last of them), or None."""
        running = self.running
        most = min(r.out_len - r.generated for r in running)
        if most < 2:
            return None
        # Blocks before this iteration's step: those its plan takes are counted by `repeated_decodes`.
        free_blocks = self.batch_cfg.num_blocks - self.blocks_used
        k = repeated_decodes(self.batch_cfg, [r.seq_view() for r in running], (), free_blocks, most)
        if k < 2:
            return None
        return SamePlan(items, n_dec, dec_context, n_adapters, k - 1)

    def _complete(self) -> None:
        assert self.pending is not None
        items, t_inf, t_ev, t_end, _ = self.pending
        self.pending = None
        eval_ms = max(0.0, (t_ev - t_inf) * 1e3)
        train_ms = max(0.0, (t_end - t_ev) * 1e3)  # an arrival may have cut the stretch short
        inf_ms, tokens = self._pending_step
        self._infer_ms += inf_ms
        self._train_ms += train_ms
        busy = self.busy_ms
        busy["inference"] += inf_ms
        self.inference_steps.append((t_inf, inf_ms, tokens))
        log = self.step_log
        if log is not None and items:
            n_dec, dec_context, chunks, n_adapters, (budget_ms, limit) = self._step_shape
            log(
                InferenceStep(
                    t_s=t_inf - inf_ms / 1e3,
                    decodes=n_dec,
                    decode_context_tokens=dec_context,
                    prefill=chunks,
                    adapters=n_adapters,
                    forward_ms=inf_ms,
                    step_ms=inf_ms,
                    train_budget_ms=budget_ms,
                    train_limit=limit,
                )
            )
        if log is not None and eval_ms > 0:
            log(BackgroundWork(kind="eval", t_s=t_inf, ms=eval_ms))
        busy["evaluation"] += eval_ms
        block_size = self.block_size
        generated = grown = 0  # tokens out of this step, blocks taken by the decoding requests
        for req, n in items:
            if req.computed < req.target:
                req.computed += n
                self._prefill_tokens += n
                if req.computed < req.target:
                    self._set_view(req)
                    continue
                if req.t_first is None:
                    req.t_first = t_inf
            req.generated += 1
            generated += 1
            if req.generated >= req.out_len:
                self._finish(req, t_inf, "ok")
            else:  # `_set_view` of a decoding request: its KV holds the prompt and all but the last output
                blocks = blocks_for(req.prompt_len + req.generated - 1, block_size)
                grown += blocks - req.blocks
                req.blocks = blocks
                req.view = None
        self._gen_tokens += generated
        self.blocks_used += grown
        if eval_ms > 0:
            self.bg.spend_evals(eval_ms, t_ev)
        job = self.bg.job
        if train_ms > 0 and job is not None and job.active:
            self.cosched.charge(train_ms)
            train_tokens, micro_steps = self.bg.train(job, train_ms)
            if log is not None:
                log(
                    BackgroundWork(
                        kind="train", t_s=t_ev, ms=train_ms, tokens=train_tokens, micro_steps=micro_steps
                    )
                )
            self.busy_ms["training"] += train_ms
            self._ft_tokens += train_tokens
            self.ft_tokens_total += train_tokens
            if train_tokens:
                self.training_done.append((t_end, train_tokens))
            if job.done:
                self.bg.finish_job(t_end, "budget")

    # --- telemetry ------------------------------------------------------------------------------------
    def _resident_adapter(self, name: str, version: int, in_flight: int) -> ResidentAdapter:
        """The telemetry's entry of one resident adapter (built once per value: entries are immutable)."""
        key = (name, version, in_flight)
        entry = self._resident.get(key)
        if entry is None:
            entry = self._resident[key] = ResidentAdapter(
                name=name, version_id=f"{name}@v{version}", version=version, in_flight=in_flight
            )
        return entry

    def telemetry(self, now: float, interval_s: float) -> ReplicaTelemetry:
        self.sync(now)
        dt = max(1e-9, now - self._last_telemetry_s) if self._last_telemetry_s else interval_s
        lat = self.window.summary(now)
        share, source = effective_share(now, self.share, self.share_expires_s, self.engine.ft_share_default)
        in_flight: dict[str, int] = {}
        for r in self.running:
            in_flight[r.domain] = in_flight.get(r.domain, 0) + 1
        job = self.bg.job
        jobs = []
        if job is not None:
            jobs.append(
                TrainingJobStatus(
                    adapter=job.adapter,
                    state="running" if job.active else "done",
                    base_version_id=f"{job.adapter}@v{job.base_version}",
                    round_id=job.round_id,
                    tokens_done=job.tokens_done,
                    token_budget=job.budget,
                )
            )
        busy = self.engine.report_busy_fractions
        t = ReplicaTelemetry(
            replica_id=self.replica_id,
            ts_unix_s=now,
            interval_s=interval_s,
            model="simulated",
            queue_len=len(self.waiting),
            running=len(self.running),
            max_batch=self.engine.max_batch,
            kv_used_frac=(
                self.blocks_used / self.batch_cfg.num_blocks
                if self.batch_cfg.kv_admission == "paged"
                else self.kv_reserved / self.engine.kv_budget_tokens
            ),
            tokens_per_s=self._gen_tokens / dt,
            prefill_tokens_per_s=self._prefill_tokens / dt,
            arrivals_per_s=self._arrivals / dt,
            ttft_ms_p50=lat["ttft_ms_p50"],
            ttft_ms_p99=lat["ttft_ms_p99"],
            tpot_ms_p50=lat["tpot_ms_p50"],
            tpot_ms_p99=lat["tpot_ms_p99"],
            finished=int(lat["finished"] or 0),
            good=int(lat["good"] or 0),
            slo_attainment=lat["slo_attainment"],
            decode_step_ms=self.decode_ms[self.engine.max_batch],
            prefill_ms_per_token=self.prefill_per_token_ms,
            train_step_ms=self.bg.train_cost.ms(self.engine.train_micro_tokens),
            infer_busy_frac=min(1.0, self._infer_ms / 1e3 / dt) if busy else None,
            train_busy_frac=min(1.0, self._train_ms / 1e3 / dt) if busy else None,
            ft_share=share,
            ft_share_source=source,  # type: ignore[arg-type]
            ft_spend=self.spend if source == "coordinator" else 0.0,
            ft_tokens_per_s=self._ft_tokens / dt,
            training_jobs=jobs,
            adapters=[
                self._resident_adapter(d, v, in_flight.get(d, 0)) for d, v in sorted(self.versions.items())
            ],
            round_role="participant"
            if job is not None and job.active
            else ("done" if job is not None else "idle"),
            round_id=job.round_id if job is not None else None,
            local_samples=self.samples,
            domains=[self.domain],
        )
        self._arrivals = self._gen_tokens = self._prefill_tokens = self._ft_tokens = 0
        self._infer_ms = self._train_ms = 0.0
        self._last_telemetry_s = now
        return t
