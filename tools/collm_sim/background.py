"""A simulated replica's background work: its round job and the gate's evaluations, in virtual time.

The engine's `background.Training` and `background.Evaluations` without a model: a round job trains in
micro-steps of `train_micro_tokens` (`train_fixed_ms + train_ms_per_token * tokens` each, from the
calibration), cut into `train_pieces_per_micro_step` pieces so an arrival ends a stretch after the
piece in progress; a micro-step carries over to the next stretch and its tokens count when it completes.
An evaluation the aggregator asks for (`EvalTask`) costs `CostModel.eval_ms` of the replica's held-out
set, in pieces of one batch's `eval_pieces_per_batch`-th; it runs within the window the replica's
background decision grants, at least one piece per iteration, and more while it is behind the even pace
to its deadline (`behind_schedule`), as the engine's `Evaluations.work`. `windows.BackgroundWindows`
decides the windows (`scheduler.decide_background`) and spends them here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from collm_common.calibration import CostModel
from collm_sim.config import EngineSpec
from collm_sim.plugins import JobView, TrainCost, behind_schedule


class Job:
    """A replica's local training job for one round."""

    __slots__ = (
        "adapter", "round_id", "base_version", "budget", "tokens_done", "stop_s", "active", "progress_ms",
    )  # fmt: skip

    def __init__(self, adapter: str, round_id: int, base_version: int, budget: int, stop_s: float) -> None:
        self.adapter = adapter
        self.round_id = round_id
        self.base_version = base_version
        self.budget = budget
        self.tokens_done = 0
        self.stop_s = stop_s
        self.active = True
        self.progress_ms = 0.0  # training time already spent on the micro-step in progress

    @property
    def done(self) -> bool:
        return self.tokens_done >= self.budget

    def view(self, now_s: float) -> JobView:
        """The job as the engine's background decision sees it (`TrainingJob.due`, `in_progress`): due
        once it is past its round's send-by time less the margin, in progress with a micro-step begun."""
        return JobView(due=self.active and now_s >= self.stop_s, in_progress=self.progress_ms > 0)


class EvalTask:
    """A version the aggregator asked this replica to score: `ms_left` of work, paced to `deadline_s`."""

    __slots__ = ("round_id", "ms_total", "ms_left", "asked_s", "deadline_s", "on_done")

    def __init__(
        self,
        round_id: int,
        ms: float,
        asked_s: float,
        deadline_s: float,
        on_done: Callable[[Any, EvalTask, float], None],
    ) -> None:
        self.round_id = round_id
        self.ms_total = self.ms_left = ms
        self.asked_s = asked_s
        self.deadline_s = deadline_s
        self.on_done = on_done


class Background:
    """The round job and pending evaluations of one simulated replica (`owner`, passed to the callbacks):
    `on_job_done(owner, job, t)` when a job ends (its budget done, its deadline passed, or a new job
    replacing it), each `EvalTask.on_done(owner, task, t)` when its last piece ends."""

    def __init__(
        self, owner: Any, cost: CostModel, engine: EngineSpec, on_job_done: Callable[[Any, Job, float], None]
    ) -> None:
        self.owner = owner
        self.on_job_done = on_job_done
        self.round_deadline_margin_s = engine.round_deadline_margin_s
        self.micro_tokens = engine.train_micro_tokens
        self.train_cost = TrainCost(cost.train_fixed_ms, cost.train_ms_per_token)
        micro_ms = self.train_cost.ms(engine.train_micro_tokens)
        self.piece_ms = micro_ms / max(1, engine.train_pieces_per_micro_step)
        # One evaluation's cost (None: not modelled), and its pieces.
        self.eval_ms_each: float | None = None
        self.eval_piece_ms = 0.0
        batches = 1
        if engine.eval_tokens:
            batches = engine.eval_batches or -(-engine.eval_tokens // max(1, engine.eval_batch_tokens))
            self.eval_ms_each = cost.eval_ms(engine.eval_tokens, -(-engine.eval_tokens // max(1, batches)))
        if self.eval_ms_each:
            self.eval_piece_ms = self.eval_ms_each / (batches * max(1, engine.eval_pieces_per_batch))
        self.evals: deque[EvalTask] = deque()
        self.job: Job | None = None
        self.job_rr = 0  # the background decision's round-robin counter over jobs (`decide_background`)
        # Seconds this replica held an active round job, by how each job ended ("budget": its token
        # budget done; "stop": the round's send-by time; "replaced": a new job took its place).
        self.job_s: dict[str, float] = {"budget": 0.0, "stop": 0.0, "replaced": 0.0}
        self._job_started_s = 0.0

    def start_job(
        self, adapter: str, round_id: int, base_version: int, budget: int, deadline_s: float, now: float
    ) -> None:
        """A round job that stops training `round_deadline_margin_s` before the round's deadline; a job
        still active ends first."""
        self.finish_job(now, "replaced")
        self.job = Job(adapter, round_id, base_version, budget, deadline_s - self.round_deadline_margin_s)
        self._job_started_s = now

    def add_eval(self, task: EvalTask) -> None:
        self.evals.append(task)

    def finish_job(self, now: float, why: str) -> None:
        """End the active job (if any) and report it; `why` is one of `job_s`'s keys."""
        job = self.job
        if job is None or not job.active:
            return
        job.active = False
        self.job_s[why] += max(0.0, now - self._job_started_s)
        self.on_job_done(self.owner, job, now)

    @property
    def has_job(self) -> bool:
        return self.job is not None and self.job.active

    def eval_stretch(self, budget_ms: float, catch_up_ms: float, t_inf: float) -> tuple[float, bool]:
        """Evaluation time after this step (ms), and whether it is catching up on its pace: the engine's
        `Evaluations.work`: the decision's evaluation window (`budget_ms`), at least one piece, and more
        while the first task is behind the even pace to its deadline, up to `catch_up_ms` (the guard
        for the next arrival, `ft_guard_frac` of the TTFT SLO)."""
        piece = self.eval_piece_ms
        left = sum(t.ms_left for t in self.evals)
        if piece <= 0 or left <= 0:
            return 0.0, False
        n = max(1, int(min(budget_ms, 60_000.0) / piece + 1e-9))
        task = self.evals[0]
        limit = int(catch_up_ms / piece + 1e-9)
        catch_up = False
        while n < limit and n * piece < left:
            done_ms = n * piece
            progress = 1.0 - max(0.0, task.ms_left - done_ms) / task.ms_total
            if not behind_schedule(progress, t_inf + done_ms / 1e3, task.asked_s, task.deadline_s):
                break
            n += 1
            catch_up = True
        return min(n * piece, left), catch_up

    def spend_evals(self, ms: float, t: float) -> None:
        """Spend `ms` on the evaluations in order; a finished one is reported at `t`."""
        left = ms
        while self.evals and left > 1e-9:
            task = self.evals[0]
            take = min(task.ms_left, left)
            task.ms_left -= take
            left -= take
            if task.ms_left <= 1e-6:
                self.evals.popleft()
                task.on_done(self.owner, task, t)

    def micro_ms(self, job: Job) -> tuple[int, float]:
        """(tokens, ms) of the job's micro-step in progress (the last one may be short of the budget)."""
        tokens = min(self.micro_tokens, job.budget - job.tokens_done)
        return tokens, self.train_cost.ms(tokens)

    def ms_to_finish(self, job: Job) -> float:
        """Work until the job is done (its token budget), whole pieces."""
        left = job.budget - job.tokens_done
        ms = 0.0
        if left > 0:
            micro = self.micro_tokens
            full, rest = divmod(left, micro)
            ms = full * self.train_cost.ms(micro) + self.train_cost.ms(rest)
        ms -= job.progress_ms
        if ms <= 0:
            return 0.0
        return math.ceil(ms / self.piece_ms - 1e-9) * self.piece_ms

    def train(self, job: Job, ms: float) -> tuple[int, list[tuple[int, float]]]:
        """Spend `ms` on the job's micro-steps: (tokens of the micro-steps it completed, (tokens, ms) of
        each micro-step completed)."""
        done = 0
        micro_steps: list[tuple[int, float]] = []
        job.progress_ms += ms
        while job.active:
            if job.tokens_done >= job.budget:
                break
            tokens, step_ms = self.micro_ms(job)
            if job.progress_ms + 1e-6 < step_ms:
                break
            job.progress_ms -= step_ms
            job.tokens_done += tokens
            done += tokens
            micro_steps.append((tokens, step_ms))
        if job.done:
            job.progress_ms = 0.0
        return done, micro_steps
