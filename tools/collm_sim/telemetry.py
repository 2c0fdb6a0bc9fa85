"""A simulated replica's counters, step log and telemetry, built like the live replica's.

`ReplicaStats` counts what the replica did: over the current telemetry interval (reset by each report),
in total, busy time by kind of work, and the inference steps and training stretches by the time they
ended (so the work done by a cut can be read, as a live replica's counters are when the load generator
stops). It tells the step log (`step_log`, the live engine's records) every inference step and stretch
of background work. `replica_telemetry` builds the replica's telemetry message: a window of
`slo_window_s` for latency percentiles and attainment, rates over the interval.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from collm_common.step_log import BackgroundWork, InferenceStep
from collm_common.wire.telemetry import ReplicaTelemetry, ResidentAdapter, TrainingJobStatus
from collm_sim.plugins import FinishedSample, LatencyWindow

if TYPE_CHECKING:
    from collm_sim.replica import SimReplica

# The shape of one inference step: (decodes, their tokens of context, prefill chunks as (tokens, earlier
# tokens), distinct adapters, (the training budget granted after it (ms), what bounded it)).
StepShape = tuple[int, int, list[tuple[int, int]], int, tuple[float, str | None]]
StepLogFn = Callable[[InferenceStep | BackgroundWork], None]


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


class ReplicaStats:
    """The counters of one simulated replica and its step log (None: none)."""

    def __init__(self, window_s: float) -> None:
        self.window = KeptSummaryWindow(window_s)
        # Counters of the current telemetry interval.
        self.arrivals = 0
        self.gen_tokens = 0
        self.prefill_tokens = 0
        self.ft_tokens = 0
        self.infer_ms = 0.0
        self.train_ms = 0.0
        self.last_report_s = 0.0
        self.ft_tokens_total = 0
        # Busy time by kind of work (ms): inference, training, evaluation (a job's own and the gate's).
        self.busy_ms = {"inference": 0.0, "training": 0.0, "evaluation": 0.0}
        # (end s, ms, tokens) of every inference step, so its work can be read up to a cut
        # (`inference_until`), and (end s, tokens) of every training stretch that completed micro-steps
        # (`ft_tokens_until`).
        self.inference_steps: list[tuple[float, float, int]] = []
        self.training_done: list[tuple[float, int]] = []
        # Told every inference step and stretch of background work, in the live step log's records (the
        # engine's `step_log`), so a simulated run's steps can be set beside a live run's.
        self.step_log: StepLogFn | None = None
        self._resident: dict[tuple[str, int, int], ResidentAdapter] = {}

    def inference_until(self, cut_s: float) -> tuple[float, int]:
        """(seconds, tokens) of the inference steps completed by `cut_s`, as a live replica's counters
        read when the load generator stops at the cut (they count a step when it completes)."""
        done = [(ms, n) for end_s, ms, n in self.inference_steps if end_s <= cut_s]
        return sum(ms for ms, _ in done) / 1e3, sum(n for _, n in done)

    def ft_tokens_until(self, cut_s: float) -> int:
        """Fine-tuning tokens of the micro-steps completed by `cut_s`, as a live replica's counter reads
        when the load generator stops at the cut."""
        return sum(n for end_s, n in self.training_done if end_s <= cut_s)

    def inference_step(self, t_end: float, ms: float, tokens: int, shape: StepShape, logged: bool) -> None:
        """An inference step of `ms` and `tokens` that ended at `t_end`; the step log is told it when
        `logged` (a step with work)."""
        self.infer_ms += ms
        self.busy_ms["inference"] += ms
        self.inference_steps.append((t_end, ms, tokens))
        log = self.step_log
        if log is not None and logged:
            n_dec, dec_context, chunks, n_adapters, (budget_ms, limit) = shape
            log(
                InferenceStep(
                    t_s=t_end - ms / 1e3, decodes=n_dec, decode_context_tokens=dec_context, prefill=chunks,
                    adapters=n_adapters, forward_ms=ms, step_ms=ms, train_budget_ms=budget_ms,
                    train_limit=limit,
                )
            )  # fmt: skip

    def evaluation(self, t_s: float, ms: float) -> None:
        """Evaluation pieces of `ms` from `t_s`."""
        if self.step_log is not None and ms > 0:
            self.step_log(BackgroundWork(kind="eval", t_s=t_s, ms=ms))
        self.busy_ms["evaluation"] += ms

    def training(
        self, t_s: float, t_end: float, ms: float, tokens: int, micro_steps: list[tuple[int, float]]
    ) -> None:
        """A stretch of training of `ms` from `t_s` to `t_end` whose completed micro-steps (tokens, ms)
        trained `tokens`."""
        if self.step_log is not None:
            work = BackgroundWork(kind="train", t_s=t_s, ms=ms, tokens=tokens, micro_steps=micro_steps)
            self.step_log(work)
        self.busy_ms["training"] += ms
        self.ft_tokens += tokens
        self.ft_tokens_total += tokens
        if tokens:
            self.training_done.append((t_end, tokens))

    def resident_adapter(self, name: str, version: int, in_flight: int) -> ResidentAdapter:
        """The telemetry's entry of one resident adapter (built once per value: entries are immutable)."""
        key = (name, version, in_flight)
        entry = self._resident.get(key)
        if entry is None:
            entry = self._resident[key] = ResidentAdapter(
                name=name, version_id=f"{name}@v{version}", version=version, in_flight=in_flight
            )
        return entry

    def new_interval(self, now: float) -> None:
        """Reset the interval's counters: a report at `now` read them."""
        self.arrivals = self.gen_tokens = self.prefill_tokens = self.ft_tokens = 0
        self.infer_ms = self.train_ms = 0.0
        self.last_report_s = now


def replica_telemetry(rep: SimReplica, now: float, interval_s: float) -> ReplicaTelemetry:
    """The replica's telemetry at `now` over the interval since its last report (`interval_s` for the
    first); starts the next interval."""
    stats = rep.stats
    engine = rep.engine
    dt = max(1e-9, now - stats.last_report_s) if stats.last_report_s else interval_s
    lat = stats.window.summary(now)
    share, source = rep.windows.share_in_force(now)
    in_flight: dict[str, int] = {}
    for r in rep.batch.running:
        in_flight[r.domain] = in_flight.get(r.domain, 0) + 1
    job = rep.bg.job
    role: Literal["idle", "participant", "done"] = "idle"
    if job is not None:
        role = "participant" if job.active else "done"
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
    busy = engine.report_busy_fractions
    t = ReplicaTelemetry(
        replica_id=rep.replica_id,
        ts_unix_s=now,
        interval_s=interval_s,
        model="simulated",
        queue_len=len(rep.batch.waiting),
        running=len(rep.batch.running),
        max_batch=engine.max_batch,
        kv_used_frac=rep.batch.kv_used_frac,
        tokens_per_s=stats.gen_tokens / dt,
        prefill_tokens_per_s=stats.prefill_tokens / dt,
        arrivals_per_s=stats.arrivals / dt,
        **lat,  # the latency window's summary: TTFT/TPOT p50/p99, finished, good, attainment
        decode_step_ms=rep.decode_ms[engine.max_batch],
        prefill_ms_per_token=rep.prefill_per_token_ms,
        train_step_ms=rep.bg.train_cost.ms(engine.train_micro_tokens),
        infer_busy_frac=min(1.0, stats.infer_ms / 1e3 / dt) if busy else None,
        train_busy_frac=min(1.0, stats.train_ms / 1e3 / dt) if busy else None,
        ft_share=share,
        ft_share_source=source,  # type: ignore[arg-type]
        ft_spend=rep.windows.spend if source == "coordinator" else 0.0,
        ft_tokens_per_s=stats.ft_tokens / dt,
        training_jobs=jobs,
        adapters=[
            stats.resident_adapter(d, v, in_flight.get(d, 0)) for d, v in sorted(rep.batch.versions.items())
        ],
        round_role=role,
        round_id=job.round_id if job is not None else None,
        local_samples=rep.samples,
        domains=[rep.domain],
    )
    stats.new_interval(now)
    return t
