"""One iteration of the engine thread (`EngineCore.step`), and the co-scheduling state it keeps.

1. take the accepted requests (their arrivals and prompt lengths feed the background decision) and run
   the commands queued for the engine thread (adapter installs and shadow refreshes happen here, at the
   boundary, as a copy into a free LoRA-bank slot: running requests keep reading their own slot); drop
   the waiting requests past their deadline;
2. the scheduler (`batcher.Batcher`) plans the iteration, preempts and admits;
3. the co-scheduler decides how much background time fits after this step (the slack of every request,
   from the cost model's estimates of this step and the next: `scheduler.decide_background` on
   `scheduler.background_input`);
4. the model runner (`runner.ModelRunner`) runs the planned batch; every sequence that has computed all
   its known tokens (a request's first choice forks the others first: `Batcher.fork`) samples its next
   token (`sequence.Seq.sample`), records it, and the output processor (`output.OutputProcessor`)
   streams it and ends the choice when a stop condition holds;
5. background work: evaluations, then the training job decided, in their windows (absolute, from the
   iteration's start), and every round job past its deadline wraps up.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

import torch

from collm_common.step_log import BackgroundWork, InferenceStep
from collm_replica.costs import PieceCosts, StepCosts
from collm_replica.engine.background import Evaluations, Examples, Training
from collm_replica.engine.batcher import Batcher
from collm_replica.engine.cosched import CoScheduler, TrainCost, effective_share
from collm_replica.engine.executor import Executor
from collm_replica.engine.output import OutputProcessor
from collm_replica.engine.runner import ModelRunner
from collm_replica.engine.scheduler import (
    ArrivalHistory,
    BackgroundSettings,
    JobView,
    Plan,
    background_input,
    decide_background,
)
from collm_replica.engine.sequence import Seq
from collm_replica.engine.slots import Slots
from collm_replica.engine.types import EngineConfig, JobEvent
from collm_replica.models import LoadedModel
from collm_replica.sampling import TokenLogprobs
from collm_replica.training import TRAIN_HEAD_ROWS, TrainingJob

log = logging.getLogger(__name__)

StepLog = Callable[[InferenceStep | BackgroundWork], None]


def background_settings(cfg: EngineConfig) -> BackgroundSettings:
    """The settings of `cfg` the background decision reads."""
    return BackgroundSettings(
        batch=cfg.batch,
        train_guard_frac=cfg.train_guard_frac,
        train_slack_frac=cfg.train_slack_frac,
        train_slo_reserve_frac=cfg.train_slo_reserve_frac,
        micro_tokens=cfg.job.micro_tokens,
        batch_tokens=cfg.job.batch_tokens,
        train_spend_stretch_frac=cfg.train_spend_stretch_frac,
    )


class EngineCore:
    """The engine thread's iteration over the engine's parts (see the module doc): `batcher`, `runner`
    (on `executor`), `output`, `slots`, and the background work it owns, `evals` and `training` (on
    `examples`). `cmds`: the commands other threads queue for the iteration boundary; `step_log`, when
    set, is told every inference step and stretch of background work; `emit_job_event` gets the training
    jobs' events. Counters: `iteration`, `infer_ms_total` (wall time of the inference steps),
    `longest_background_ms`, `train_limits` (iterations that served with a training job active, by what
    bounded their training time: `cosched.Limit`, "policy" for co-schedulers that do not say)."""

    def __init__(
        self,
        cfg: EngineConfig,
        loaded: LoadedModel,
        executor: Executor,
        batcher: Batcher,
        output: OutputProcessor,
        slots: Slots,
        examples: Examples,
        cosched: CoScheduler,
        cmds: queue.SimpleQueue[Callable[[], None]],
        clock: Callable[[], float],
        wall: Callable[[], float],
        emit_job_event: Callable[[JobEvent], None],
    ) -> None:
        self.cfg = cfg
        self.executor = executor
        self.batcher = batcher
        self.output = output
        self.slots = slots
        self.cosched = cosched
        self._cmds = cmds
        self.clock = clock
        self.wall = wall
        self.step_log: StepLog | None = None
        self.step_costs = StepCosts()
        self.piece_costs = PieceCosts()
        self.runner = ModelRunner(executor, self.step_costs, clock)
        self.evals = Evaluations(
            cfg, executor, loaded, examples, self.piece_costs, clock, wall, self.min_ttft_slo_ms, self.news,
            self.log_background,
        )  # fmt: skip
        self.training = Training(
            cfg, executor, examples, slots, self.piece_costs, cosched, batcher.lock, clock, wall,
            self.min_ttft_slo_ms, self.news, self.log_background, emit_job_event,
        )  # fmt: skip
        # A finished request is judged also as if the replica had not trained while it was in flight.
        output.train_ms_total = lambda: self.training.train_ms_total

        # The co-scheduling state: the coordinator's share (`set_share`), the arrivals, the settings.
        self._share: float | None = None
        self._share_expires: float | None = None
        self._spend = 0.0  # with the coordinator's share: its spend beyond the slack (`cosched`)
        self._arrivals = ArrivalHistory(cfg.slo_window_s)
        self._prompt_tokens_ewma = 64.0  # prompt length of recent arrivals (the next one's, as a guess)
        self._settings = background_settings(cfg)
        # The training budget decided for the iteration in progress and what bounded it (for the step log).
        self._train_decision: tuple[float, str | None] = (0.0, None)

        self.iteration = 0
        self.infer_ms_total = 0.0
        self.longest_background_ms = 0.0
        self.train_limits: dict[str, int] = {}

    @property
    def running(self) -> list[Seq]:
        return self.batcher.running

    @property
    def waiting(self) -> list[Seq]:
        return self.batcher.waiting

    def set_share(self, share: float, ttl_s: float, spend: float) -> None:
        """The coordinator's training share (and its `spend` beyond the slack) for the next `ttl_s`."""
        self._share = share
        self._spend = spend
        self._share_expires = self.clock() + ttl_s

    def share_now(self, now: float) -> tuple[float, str, float]:
        """The share in force at `now`, where it comes from (`cosched.effective_share`) and the spend
        beyond the slack (0 unless the coordinator's share is in force)."""
        share, source = effective_share(now, self._share, self._share_expires, self.cfg.ft_share_default)
        return share, source, self._spend if source == "coordinator" else 0.0

    def news(self) -> bool:
        """New requests or commands are waiting: background work yields to the next iteration."""
        return bool(self.batcher.inbox) or not self._cmds.empty()

    def log_background(self, work: BackgroundWork) -> None:
        if self.step_log is not None:
            self.step_log(work)

    def min_ttft_slo_ms(self) -> float:
        """The tightest TTFT SLO of present requests and of those that arrived within the SLO window
        (`scheduler.ArrivalHistory`), now."""
        present = [s.ttft_slo * 1e3 for s in (*self.running, *self.waiting)]
        return self._arrivals.min_ttft_slo_ms(self.clock(), present, self.cfg.default_ttft_slo_ms)

    def fail_running(self, message: str) -> None:
        """Every running request fails with a 500 and `message`."""
        for seq in list(self.running):
            self.output.fail(seq, 500, message)

    def step(self) -> bool:
        """One iteration (see the module doc); whether it did any work."""
        now = self.clock()
        for seq in self.batcher.take_inbox():
            seq.train_ms_arrival = self.output.train_ms_total()
            if not seq.req.internal:
                self._arrivals.record(now, seq.ttft_slo * 1e3)
            self._prompt_tokens_ewma = 0.9 * self._prompt_tokens_ewma + 0.1 * seq.prompt_len
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            cmd()
        self.slots.run_pending()
        for seq in self.batcher.expire(self.wall()):
            self.output.finish(seq, "deadline", now)
        self.iteration += 1

        plan = self.batcher.schedule(now)
        step_ms, train_ms, eval_ms, job, idle = self._decide_background(now, plan)
        worked = False
        if plan.items:
            t0 = time.perf_counter()
            self._execute(plan.items)
            self.infer_ms_total += (time.perf_counter() - t0) * 1e3
            worked = True
        return self._background(now, step_ms, train_ms, eval_ms, job, idle) or worked

    def _execute(self, items: list[tuple[str, int]]) -> None:
        """The planned step: the forward of `items`, then every sequence that has computed all its known
        tokens samples the next one (a request's first choice forks the others first)."""
        t_start = time.perf_counter()
        work = self.batcher.work(items)
        step = self.runner.run(work)
        now = self.clock()
        for (seq, n), lg in zip(work, step.logits, strict=True):
            if seq.done or not self.batcher.advance(seq, n):
                continue  # ended, or more prompt (or recompute) chunks to come
            try:
                choices = [seq] if seq.group.forked else [seq, *self.batcher.fork(seq)]
                for choice in choices:
                    self._sample(choice, lg, now)
            except Exception as exc:  # noqa: BLE001 - fail this request, keep the batch
                log.exception("request %s failed", seq.req.request_id)
                self.output.fail(seq, 500, f"generation failed: {type(exc).__name__}")
        if self.step_log is not None:
            self.step_log(
                InferenceStep(
                    t_s=step.t_s,
                    decodes=step.decodes,
                    decode_context_tokens=step.decode_context_tokens,
                    prefill=step.prefill,
                    adapters=step.adapters,
                    forward_ms=step.forward_ms,
                    step_ms=(time.perf_counter() - t_start) * 1e3,
                    train_budget_ms=self._train_decision[0],
                    train_limit=self._train_decision[1],
                )
            )

    def _sample(self, seq: Seq, logits: torch.Tensor, now: float) -> None:
        """`seq`'s next token from its last-position logits (`Seq.sample`), then recorded and streamed."""
        tok, lp = seq.sample(logits)
        self._on_token(seq, tok, now, lp)

    def _on_token(self, seq: Seq, tok: int, now: float, lp: TokenLogprobs | None) -> None:
        """The sequence records its token; the output processor streams it and ends the choice there
        when a stop condition holds."""
        if seq.t_first is None:
            seq.train_ms_first = self.output.train_ms_total()
        seq.record(tok, now)
        self.output.token(seq, tok, now, lp)

    def _background(
        self, now: float, step_ms: float, train_ms: float, eval_ms: float, job: TrainingJob | None, idle: bool
    ) -> bool:
        """This iteration's background work in the windows decided (`_decide_background`); whether any
        ran. The windows are absolute (from `now`), so an inference step slower than predicted shortens
        them, and evaluation time counts against training's window."""
        worked = False
        t_bg = time.perf_counter()
        if self.evals:
            worked = self.evals.work(now + (step_ms + eval_ms) / 1e3) or worked
        if train_ms > 0 and job is not None:
            force = idle and not self.evals  # pending evaluations come first, even when idle
            worked = self.training.work(job, now + (step_ms + train_ms) / 1e3, force_one=force) or worked
        # A round job past its deadline (less the margin) wraps up and sends its update whatever this
        # iteration granted training (a zero share, no slack, training paused): the wrap-up is bounded (at
        # most the backward of the micro-step in progress, or a first micro-step's rest within the guard,
        # and one optimizer step: `TrainingJob._finish_training`), and an update held back would cost the
        # whole round its participant.
        for due in [j for j in self.training.active_jobs() if j.due(self.cfg.round_deadline_margin_s)]:
            worked = self.training.work(due, now, force_one=False) or worked
        bg_ms = (time.perf_counter() - t_bg) * 1e3
        if bg_ms > self.longest_background_ms:
            self.longest_background_ms = bg_ms
        return worked

    def _decide_background(
        self, now: float, plan: Plan
    ) -> tuple[float, float, float, TrainingJob | None, bool]:
        """(predicted inference ms, training ms, evaluation ms, the job to train, idle) of this iteration
        (`scheduler.decide_background` on the engine's state)."""
        jobs = self.training.active_jobs()
        fixed, per = self.piece_costs.micro_step(self.executor.n_layers, head_rows=TRAIN_HEAD_ROWS)
        margin_s = self.cfg.round_deadline_margin_s
        inp = background_input(
            now,
            [s.timing() for s in self.running],
            [s.timing() for s in self.waiting],
            plan.items,
            plan.tokens,
            self.step_costs.line.predict(plan.tokens) if plan.tokens else 0.0,
            share=self._share,
            share_expires_s=self._share_expires,
            share_default=self.cfg.ft_share_default,
            spend=self._spend,
            decode_ms_at=self.step_costs.decode_at,
            prefill_ms_per_token=self.step_costs.prefill_ms_per_token(),
            train=TrainCost(fixed, per),
            arrivals=self._arrivals,
            default_ttft_slo_ms=self.cfg.default_ttft_slo_ms,
            prompt_tokens_ewma=self._prompt_tokens_ewma,
            jobs=[JobView(due=j.due(margin_s), in_progress=j.in_progress) for j in jobs],
            training_paused=self.training.paused,
            evals_pending=bool(self.evals),
            iteration=self.iteration,
            job_rr=self.training.job_rr,
        )
        d = decide_background(inp, self._settings, self.cosched)
        self.training.job_rr = d.job_rr
        self._train_decision = (max(0.0, d.train_ms), d.limit) if d.has_job else (0.0, None)
        if d.has_job and not d.idle:  # what bounded training while serving (observability)
            self.train_limits[d.limit] = self.train_limits.get(d.limit, 0) + 1
        job = jobs[d.job] if d.job is not None else None
        return d.step_ms, d.train_ms, d.eval_ms, job, d.idle
