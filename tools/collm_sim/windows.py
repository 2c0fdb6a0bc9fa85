"""A simulated replica's background decision: the windows of evaluation and training after each step.

Each iteration with a round job or an evaluation pending, the replica's `engine.scheduler.
decide_background` decides through its co-scheduler (`collm_replica.engine.cosched`), on the input that
`scheduler.background_input` builds from the replica's state as it does for the engine: the
coordinator's share (with its TTL: `effective_share`) and spend, the requests as the engine's
`Sequence.timing` shows them, the step planned and its cost, the arrival history's tightest TTFT SLO and
likely arrivals (`ArrivalHistory`) and the guess of the next prompt's length. The windows are then spent
as the engine's background work spends them (`collm_sim.background.Background`): evaluation pieces first
(at least one, more while behind their pace), training in whole pieces within what is left of the
decision's window (at least one when idle and no evaluation is pending), never past what the job still
needs. The co-scheduler is given the calibration's costs as its predictions (the live engine learns the
same costs online).
"""

from __future__ import annotations

from typing import NamedTuple

from collm_sim.background import Background
from collm_sim.batch import Req, ServingBatch
from collm_sim.config import EngineSpec
from collm_sim.plugins import (
    ArrivalHistory,
    BackgroundSettings,
    BatchConfig,
    CoScheduler,
    background_input,
    decide_background,
    effective_share,
)


class Grant(NamedTuple):
    """The background work after one inference step: evaluation and training time (ms), whether the
    evaluation catches up on its pace, and (the training budget decided, what bounded it) for the step
    log."""

    eval_ms: float
    train_ms: float
    catch_up: bool
    decision: tuple[float, str | None]


NO_GRANT = Grant(0.0, 0.0, False, (0.0, None))


class BackgroundWindows:
    """The co-scheduling state of one simulated replica (the coordinator's share, the arrival history) and
    its decision; `bg` holds the work the windows are spent on."""

    def __init__(
        self,
        engine: EngineSpec,
        cosched: CoScheduler,
        batch_cfg: BatchConfig,
        decode_ms: list[float],
        prefill_ms_per_token: float,
        bg: Background,
    ) -> None:
        self.engine = engine
        self.cosched = cosched
        self.bg = bg
        self.decode_ms = decode_ms  # a decode step's cost by number of decoding sequences
        self.prefill_ms_per_token = prefill_ms_per_token
        self.settings = BackgroundSettings(
            batch=batch_cfg,
            train_guard_frac=engine.ft_guard_frac,
            train_slack_frac=engine.ft_slack_frac,
            train_slo_reserve_frac=engine.ft_slo_reserve_frac,
            micro_tokens=engine.train_micro_tokens,
            batch_tokens=engine.train_batch_tokens,
            train_spend_stretch_frac=engine.ft_spend_stretch_frac,
        )
        self.share: float | None = None
        self.share_expires_s: float | None = None
        self.spend = 0.0
        self.arrivals = ArrivalHistory(engine.slo_window_s)
        self.prompt_tokens_ewma = 64.0

    def arrived(self, now: float, ttft_slo_ms: float, prompt_len: int) -> None:
        """As the engine at each arrival: the arrival history and the next prompt's length guess."""
        self.arrivals.record(now, ttft_slo_ms)
        self.prompt_tokens_ewma = 0.9 * self.prompt_tokens_ewma + 0.1 * prompt_len

    def set_share(self, share: float, expires_s: float, spend: float) -> None:
        self.share = share
        self.share_expires_s = expires_s
        self.spend = spend

    def share_in_force(self, now: float) -> tuple[float, str]:
        """(the training share in force at `now`, its source): the coordinator's until its TTL, then the
        default (`effective_share`)."""
        return effective_share(now, self.share, self.share_expires_s, self.engine.ft_share_default)

    def grant(
        self,
        now: float,
        iteration: int,
        batch: ServingBatch,
        items: list[tuple[Req, int]],
        tokens: int,
        inf_ms: float,
    ) -> Grant:
        """The background work after this iteration's inference step (`items`, `tokens`, predicted to
        take `inf_ms` from `now`); `iteration`: the iterations before this one."""
        bg = self.bg
        job = bg.job
        has_job = job is not None and job.active
        if not (has_job or bg.evals):
            return NO_GRANT
        view = batch.request_view
        inp = background_input(
            now,
            [view(r) for r in batch.running],
            [view(r) for r in batch.waiting],
            [(r.sid, n) for r, n in items],
            tokens,
            inf_ms,
            share=self.share,
            share_expires_s=self.share_expires_s,
            share_default=self.engine.ft_share_default,
            spend=self.spend,
            decode_ms_at=self.decode_ms.__getitem__,
            prefill_ms_per_token=self.prefill_ms_per_token,
            train=bg.train_cost,
            arrivals=self.arrivals,
            default_ttft_slo_ms=self.engine.default_ttft_slo_ms,
            prompt_tokens_ewma=self.prompt_tokens_ewma,
            jobs=[job.view(now)] if has_job and job else [],
            # Nothing in the simulated cluster pauses training: `PauseTraining` is an operator's command,
            # and the coordinator core sends none.
            training_paused=False,
            evals_pending=bool(bg.evals),
            # The iterations before this one (the engine's counter includes this one).
            iteration=iteration,
            job_rr=bg.job_rr,
        )
        d = decide_background(inp, self.settings, self.cosched)
        bg.job_rr = d.job_rr
        eval_ms, catch_up = 0.0, False
        if bg.evals:
            catch_up_ms = self.engine.ft_guard_frac * inp.min_ttft_slo_ms
            eval_ms, catch_up = bg.eval_stretch(d.eval_ms, catch_up_ms, now + inf_ms / 1e3)
        if not d.has_job:
            return Grant(eval_ms, 0.0, catch_up, (0.0, None))
        decision = (max(0.0, d.train_ms), d.limit)
        if job is None or d.job is None:
            return Grant(eval_ms, 0.0, catch_up, decision)
        # As the engine: the decision's training window, spent in whole pieces (at least one when idle and
        # no evaluation is pending), never past what the job still needs; evaluation pieces count against
        # the same window.
        window_ms = d.train_ms
        if d.idle and not bg.evals:
            window_ms = max(window_ms, bg.piece_ms)
        pieces = int(max(0.0, window_ms - eval_ms) / bg.piece_ms + 1e-9)
        return Grant(eval_ms, min(pieces * bg.piece_ms, bg.ms_to_finish(job)), catch_up, decision)
