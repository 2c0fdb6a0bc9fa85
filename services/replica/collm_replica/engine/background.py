"""Background work of the engine thread, between iterations: evaluations and training jobs.

`Examples` holds the local data set and its rendering; `Evaluations` the pending federated evaluations,
run in pieces (highest priority first) and cached by weights digest and eval set; `Training` the
training jobs, run in pieces, with their local refreshes into adapter slots, statuses and events. The
engine decides how long each may run (`scheduler.decide_background`) and calls `work` with the end of
that window on its clock; both stop at the window, or earlier when news waits (`news()`: new requests
or commands).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from collm_common.data import Example, LocalDataset
from collm_common.lora import AdapterWeights
from collm_common.step_log import BackgroundWork
from collm_common.wire.telemetry import TrainingJobStatus
from collm_replica.costs import PieceCosts
from collm_replica.engine.cosched import CoScheduler, behind_schedule
from collm_replica.engine.executor import Executor
from collm_replica.engine.slots import Slots
from collm_replica.engine.types import EngineConfig, EngineRefusal, JobEvent
from collm_replica.lora_bank import LiveLora
from collm_replica.models import LoadedModel
from collm_replica.training import (
    EvalRun,
    JobSpec,
    PieceWork,
    Rendered,
    TrainingJob,
    eval_set_digests,
    render_example,
    select_eval_items,
)

log = logging.getLogger(__name__)

StepLog = Callable[[BackgroundWork], None]


class Examples:
    """The local data set and its chat-template renderings (cached: examples are immutable)."""

    def __init__(self, dataset: LocalDataset, tokenizer: Any, cfg: EngineConfig) -> None:
        self.dataset = dataset
        self.tok = tokenizer
        self.cfg = cfg
        self._render_cache: dict[tuple[Example, int], Rendered | None] = {}

    def add(self, examples: list[Example]) -> int:
        """Add new local samples (split by the stable hash of their id, as when they are loaded again
        after a restart); an id already present is ignored (a redelivered sample). The number held."""
        known = {e.id for e in self.dataset.train} | {e.id for e in self.dataset.eval}
        for e in examples:
            if e.id not in known:
                self.dataset.add(e, self.cfg.eval_fraction)
                known.add(e.id)
        return len(self.dataset.train) + len(self.dataset.eval)

    def for_adapter(self, adapter: str) -> tuple[list[Example], list[Example]]:
        """The local examples a job for `adapter` trains on: its domain's, or all when none is tagged."""
        train = [e for e in self.dataset.train if e.domain == adapter]
        held = [e for e in self.dataset.eval if e.domain == adapter]
        if not train:
            return list(self.dataset.train), list(self.dataset.eval)
        return train, held

    def render(self, e: Example) -> Rendered | None:
        """Render through the chat template once per example."""
        key = (e, self.cfg.job.max_seq_len)
        if key not in self._render_cache:
            self._render_cache[key] = render_example(self.tok, e, self.cfg.job.max_seq_len)
        return self._render_cache[key]


@dataclass
class _PendingEval:
    """An evaluation waiting for or in its pieces; `pace` = (asked, deadline) on the engine's clock."""

    priority: int
    runs: list[EvalRun]
    fut: Future[Any]
    finish: Callable[[list[EvalRun]], Any]
    pace: tuple[float, float] | None = None

    def behind(self, at_s: float) -> bool:
        """Behind the even pace to its deadline at `at_s` (never without a deadline)."""
        if self.pace is None:
            return False
        progress = sum(r.progress for r in self.runs) / len(self.runs) if self.runs else 1.0
        return behind_schedule(progress, at_s, *self.pace)


class Evaluations:
    """Pending evaluations, highest priority first (then FIFO), and the cache of finished ones
    (`cfg.eval_cache_entries`, by weights digest and eval set). `ms_total`: wall time of their pieces."""

    def __init__(
        self,
        cfg: EngineConfig,
        executor: Executor,
        loaded: LoadedModel,
        examples: Examples,
        piece_costs: PieceCosts,
        clock: Callable[[], float],
        wall: Callable[[], float],
        min_ttft_slo_ms: Callable[[], float],
        news: Callable[[], bool],
        step_log: StepLog,
    ) -> None:
        self.cfg = cfg
        self.executor = executor
        self.loaded = loaded
        self.examples = examples
        self.piece_costs = piece_costs
        self.clock = clock
        self.wall = wall
        self._min_ttft_slo_ms = min_ttft_slo_ms
        self._news = news
        self._step_log = step_log
        self._evals: list[_PendingEval] = []
        self._eval_cache: dict[tuple[str, str], EvalRun] = {}
        self.ms_total = 0.0

    def __bool__(self) -> bool:
        """Evaluations are pending."""
        return bool(self._evals)

    def enqueue(
        self,
        fut: Future[dict[str, EvalRun]],
        candidates: list[tuple[str, AdapterWeights | None]],
        max_examples: int,
        adapter: str | None,
        max_tokens: int | None,
        digests: list[str | None] | None,
        priority: int,
        deadline_unix_s: float | None,
        t_asked: float,
    ) -> None:
        """Render the held-out items and queue the runs not cached (engine thread; `Engine.evaluate`
        states the contract). `fut` gets the runs by candidate label, or the failure."""
        labels = [label for label, _ in candidates]
        keys = list(digests) if digests is not None else [None] * len(candidates)
        caps = [m for m in (max_tokens, self.cfg.eval_max_tokens) if m is not None]
        t_start = self.clock()
        try:
            _, held = (
                self.examples.for_adapter(adapter) if adapter else ([], list(self.examples.dataset.eval))
            )
            rendered = [r for e in held if (r := self.examples.render(e)) is not None]
            items = select_eval_items(rendered, max_examples, min(caps) if caps else None)
            eval_set = eval_set_digests(items, self.cfg.job.max_seq_len, self.executor.eval_precision)
            set_key = "|".join(f"{d}={h}" for d, h in sorted(eval_set.items()))
            runs: list[EvalRun] = []
            todo: list[EvalRun] = []
            for (_label, w), key in zip(candidates, keys, strict=True):
                cached = self._eval_cache.get((key, set_key)) if key else None
                if cached is not None:
                    runs.append(cached)
                    continue
                live = (
                    LiveLora.from_weights(w, self.executor.n_layers, self.executor.shapes,
                                          self.loaded.dtype, self.loaded.device)
                    if w is not None else None
                )  # fmt: skip
                run = EvalRun(items, live, self.cfg.job.eval_chunk_tokens, eval_set=eval_set)
                run.cache_key = (key, set_key) if key else None
                runs.append(run)
                todo.append(run)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller
            fut.set_exception(exc)
            return

        def finish(_rs: list[EvalRun]) -> dict[str, EvalRun]:
            for run in todo:
                if run.cache_key is not None:
                    run.live = None  # the weights are not needed any more
                    self._eval_cache[run.cache_key] = run
            while len(self._eval_cache) > self.cfg.eval_cache_entries:
                self._eval_cache.pop(next(iter(self._eval_cache)))
            now = self.clock()
            log.info(
                "evaluated %s: %d of %d versions scored (%d tokens each, priority %d) in %.0f ms "
                "(%.0f ms waiting for the engine)",
                adapter or "all domains", len(todo), len(runs), sum(len(r.ids) for r in items),
                priority, (now - t_asked) * 1e3, (t_start - t_asked) * 1e3,
            )  # fmt: skip
            return dict(zip(labels, runs, strict=True))

        if not todo:
            fut.set_result(finish([]))
            return
        pace = None
        if deadline_unix_s is not None:
            pace = (t_asked, t_asked + deadline_unix_s - self.wall())
        pos = next((i for i, e in enumerate(self._evals) if e.priority < priority), len(self._evals))
        self._evals.insert(pos, _PendingEval(priority, todo, fut, finish, pace))

    def work(self, until: float) -> bool:
        """Evaluation pieces (highest priority first) while the next is predicted to end by `until`;
        at least one piece, so an evaluation progresses under any load; past `until` while the first
        evaluation is behind its deadline's pace, up to the guard for the next arrival."""
        pad = int(self.examples.tok.pad_token_id or 0)
        ran = False
        catch_up_until = self.clock() + self.cfg.train_guard_frac * self._min_ttft_slo_ms() / 1e3
        while self._evals:
            ev = self._evals[0]
            try:
                run = next((r for r in ev.runs if not r.done), None)
                if run is None:
                    self._evals.pop(0)
                    ev.fut.set_result(ev.finish(ev.runs))
                    continue
                nxt = run.next_piece(self.executor, pad)
                if nxt is None:
                    continue
                end = self.clock() + self.piece_costs.predict(*nxt) / 1e3
                if ran and (end > until or self._news()) and not (end <= catch_up_until and ev.behind(end)):
                    break
                t_clock = self.clock()
                ms, tokens = run.run_piece(self.executor, pad, self.piece_costs)
                self.ms_total += ms
                ran = True
                self._step_log(BackgroundWork(kind="eval", t_s=t_clock, ms=ms, tokens=tokens))
            except Exception as exc:  # noqa: BLE001 - delivered to the caller
                self._evals.pop(0)
                ev.fut.set_exception(exc)
        return ran


class Training:
    """The training jobs (one per adapter), their pieces of work, local refreshes, statuses and events.

    `ft_tokens_total`, `train_ms_total` and `live_work` (the stretch in progress) change under `lock`;
    `job_rr` is the round-robin counter of `scheduler.decide_background`."""

    def __init__(
        self,
        cfg: EngineConfig,
        executor: Executor,
        examples: Examples,
        slots: Slots,
        piece_costs: PieceCosts,
        cosched: CoScheduler,
        lock: threading.Lock,
        clock: Callable[[], float],
        wall: Callable[[], float],
        min_ttft_slo_ms: Callable[[], float],
        news: Callable[[], bool],
        step_log: StepLog,
        on_job_event: Callable[[JobEvent], None],
    ) -> None:
        self.cfg = cfg
        self.executor = executor
        self.examples = examples
        self.slots = slots
        self.piece_costs = piece_costs
        self.cosched = cosched
        self._lock = lock
        self.clock = clock
        self.wall = wall
        self._min_ttft_slo_ms = min_ttft_slo_ms
        self._news = news
        self._step_log = step_log
        self._on_job_event = on_job_event
        self.jobs: dict[str, TrainingJob] = {}
        self.job_rr = 0
        self.paused = False
        self.ft_tokens_total = 0
        self.train_ms_total = 0.0  # wall time of training pieces
        self.eval_ms_total = 0.0  # wall time of the jobs' own evaluation pieces
        self.ft_loss: float | None = None
        self.train_step_ms: float | None = None
        self.live_work: PieceWork | None = None  # the job's work of the stretch in progress
        self.last_work: PieceWork | None = None  # the last stretch of training (for tests and benchmarks)

    def active_jobs(self) -> list[TrainingJob]:
        return [j for j in self.jobs.values() if j.active]

    def start_job(self, spec: JobSpec) -> TrainingJobStatus:
        """Start (or restart) the job of `spec.adapter`; EngineRefusal 409 if there is no local data."""
        old = self.jobs.pop(spec.adapter, None)
        if old is not None:
            old.stop()
        train, held = self.examples.for_adapter(spec.adapter)
        job = TrainingJob(
            spec, self.executor, self.examples.tok, train, held, self.cfg.job, wall=self.wall,
            render=self.examples.render,
        )  # fmt: skip
        if job.state == "failed":
            raise EngineRefusal(409, f"cannot train {spec.adapter}: {job.message}", "conflict")
        self.jobs[spec.adapter] = job
        return self.job_status(job)

    def stop_job(self, adapter: str) -> bool:
        job = self.jobs.get(adapter)
        if job is None:
            return False
        job.stop()
        return True

    def publish_now(self, adapter: str) -> str | None:
        """Refresh the shadow of `adapter` from its live copy now (the new version id)."""
        job = self.jobs.get(adapter)
        if job is None:
            raise EngineRefusal(404, f"no training job for adapter {adapter!r}", "not_found")
        return self.local_refresh(job, force=True)

    def work(self, job: TrainingJob, until: float, force_one: bool) -> bool:
        """Pieces of `job` while the next is predicted to end by `until` (at least one when idle)."""
        t_clock = self.clock()
        res = PieceWork()
        self.last_work = res
        with self._lock:
            self.live_work = res
        try:
            job.work(
                until,
                self.clock,
                self.piece_costs,
                force_one,
                self.cfg.round_deadline_margin_s,
                self._news,
                out=res,
                yield_at_boundary=len(self.active_jobs()) > 1,
                # a first micro-step completed at the deadline stalls serving at most this long
                wrap_up_ms=self.cfg.train_guard_frac * self._min_ttft_slo_ms(),
            )
        except Exception as exc:  # noqa: BLE001 - a failed job must not take the replica down
            log.exception("training job %s failed", job.spec.adapter)
            job.stop()
            job.state = "failed"
            job.message = f"{type(exc).__name__}: {exc}"
            self.job_event("failed", job)
            self.account_work(job, res)
            return False
        self.account_work(job, res)
        if res.did_work:
            if res.train_ms > 0:
                self._step_log(
                    BackgroundWork(
                        kind="train",
                        t_s=t_clock,
                        ms=res.train_ms,
                        tokens=res.train_tokens,
                        micro_steps=list(res.micro_steps),
                    )
                )
            if res.eval_ms > 0:
                self._step_log(
                    BackgroundWork(kind="eval", t_s=t_clock, ms=res.eval_ms, tokens=res.eval_tokens)
                )
        return res.did_work or not job.active

    def account_work(self, job: TrainingJob, res: PieceWork) -> None:
        if res.did_work:
            self.cosched.charge(res.train_ms + res.eval_ms)
        with self._lock:
            self.live_work = None
            self.ft_tokens_total += res.train_tokens
            self.train_ms_total += res.train_ms
        self.eval_ms_total += res.eval_ms
        for _tokens, ms in res.micro_steps:
            old = self.train_step_ms
            self.train_step_ms = ms if old is None else 0.8 * old + 0.2 * ms
        if job.train_loss is not None:
            self.ft_loss = job.train_loss
        if job.pending_refresh:
            job.pending_refresh = False
            self.local_refresh(job)
        if job.finished_update:
            job.finished_update = False
            self.job_event("round_update", job, weights=job.live.to_weights())
        elif job.state == "done":
            self.job_event("done", job)

    def local_refresh(self, job: TrainingJob, force: bool = False) -> str | None:
        """Copy the live weights into a new shadow version `name@vN+<replica>.<k>` and make it current."""
        name = job.spec.adapter
        base_n = job.spec.base_version
        newest = self.slots.global_version(name)
        if not force and newest is not None and base_n is not None and newest > base_n:
            log.info(
                "not refreshing %s: the store has v%d, newer than the job's base v%d", name, newest, base_n
            )
            return None
        version_id = self.slots.install_refresh(
            name, job.spec.base_version_id, job.live.snapshot, job.live.spec.scaling
        )
        if version_id is None:
            self.refresh_blocked(job)
            return None
        job.slot_wait_since = None
        job.message = ""
        job.refreshes += 1
        self.job_event("refresh", job, version_id=version_id)
        return version_id

    def refresh_blocked(self, job: TrainingJob) -> None:
        """No slot for a local refresh: every resident version is pinned by in-flight requests (idle ones
        are evicted, least recently used first). The job keeps training and retries at its next
        improvement; a local job (no round) whose refreshes stay blocked `refresh_slot_wait_s` fails with
        that reason instead of training for nothing. A round job's result goes to the aggregator, not to a
        slot, so it never fails for this."""
        now = self.clock()
        n = self.cfg.max_resident_adapters
        if job.slot_wait_since is None:
            job.slot_wait_since = now
            log.warning("%s: local refresh waits for an adapter slot (all %d pinned)", job.spec.adapter, n)
        waited = now - job.slot_wait_since
        job.message = (
            f"local refresh waiting for an adapter slot for {waited:.0f}s: all {n} slots "
            "(COLLM_MAX_RESIDENT_ADAPTERS) are pinned by in-flight requests"
        )
        if job.spec.round_id is None and waited >= self.cfg.refresh_slot_wait_s:
            job.stop()
            job.state = "failed"
            job.message = (
                f"no adapter slot for a local refresh within {self.cfg.refresh_slot_wait_s:.0f}s: all {n} "
                "slots are pinned by in-flight requests; raise COLLM_MAX_RESIDENT_ADAPTERS"
            )
            self.job_event("failed", job)
        else:
            job.pending_refresh = True  # retried after the next piece of work

    def job_status(self, job: TrainingJob) -> TrainingJobStatus:
        state = job.state
        if state == "running" and self.paused:
            state = "paused"
        return TrainingJobStatus(
            adapter=job.spec.adapter,
            state=state,  # type: ignore[arg-type]
            base_version_id=job.spec.base_version_id,
            round_id=job.spec.round_id,
            tokens_done=job.tokens_done,
            token_budget=job.spec.token_budget,
            steps_done=job.steps_done,
            train_loss=job.train_loss,
            eval_loss=job.eval_loss,
            message=job.message,
        )

    def job_event(self, kind: str, job: TrainingJob, **kw: Any) -> None:
        ev = JobEvent(
            kind=kind,
            adapter=job.spec.adapter,
            status=self.job_status(job),
            num_samples=job.samples_seen,
            num_tokens=job.tokens_done,
            round_id=job.spec.round_id,
            base_version=job.spec.base_version,
            train_loss=job.train_loss,
            eval_loss_before=job.eval_loss_before,
            eval_loss_after=job.eval_loss_after,
            **kw,
        )
        try:
            self._on_job_event(ev)
        except Exception:  # noqa: BLE001
            log.exception("job event handler failed")
