"""The open-loop run: send each planned request at its scheduled time, whatever the server is doing.

Arrivals never wait for completions (open loop). An optional client concurrency cap holds requests in a
local queue instead; the wait is recorded as `client_wait_ms` and is not part of TTFT (as in vLLM), so a
run with a cap should report it beside the latencies. The run is bounded by the plan (its requests and
their schedule), then by `drain_timeout_s` for the requests still running after the last arrival; what
is still running then is cancelled and recorded as `timeout` (sent) or `dropped` (never sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TextIO, TypeVar

import httpx

from collm_bench.client import ClientOptions, new_record, send_request
from collm_common.stats import percentile
from collm_workload.goodput import verdict
from collm_workload.records import RequestRecord
from collm_workload.workload import PlannedRequest

_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass
class RunResult:
    records: list[RequestRecord]
    started_unix_s: float
    wall_s: float
    interrupted: bool
    planned: int


@dataclass
class Progress:
    """Live counters of a run, rendered as one status line."""

    total: int
    duration_s: float
    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    good: int = 0
    recent_ttft_ms: list[float] = field(default_factory=list)

    def finished(self, rec: RequestRecord) -> None:
        self.statuses[rec.status] += 1
        self.good += verdict(rec) == "good"
        if rec.ttft_ms is not None and rec.status == "ok":
            self.recent_ttft_ms = [*self.recent_ttft_ms[-199:], rec.ttft_ms]

    def line(self, elapsed_s: float) -> str:
        done = sum(self.statuses.values())
        bad = done - self.statuses["ok"]
        p50 = f"{percentile(self.recent_ttft_ms, 50):.0f}" if self.recent_ttft_ms else "-"
        att = f"{100.0 * self.good / done:.1f}%" if done else "-"
        return (
            f"[collm-bench] {elapsed_s:6.1f}/{self.duration_s:.0f}s sent {self.sent}/{self.total} "
            f"in-flight {self.sent - done + self.statuses['dropped']} done {done} ok {self.statuses['ok']} "
            f"failed {bad} good {self.good} ({att}) ttft-p50 {p50} ms"
        )


async def _report(progress: Progress, t0: float, interval_s: float, out: TextIO) -> None:
    tty = out.isatty()
    while True:
        await asyncio.sleep(interval_s)
        line = progress.line(time.perf_counter() - t0)
        out.write(("\r" + line.ljust(120)) if tty else line + "\n")
        out.flush()


def _heap_frozen(
    fn: Callable[_P, Awaitable[_T]],
) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """`fn` with what the process held before the call frozen out of the collector meanwhile: in a
    process with a large heap (a benchmark that also simulates, a long test session) a full collection
    scans it all, stalls the event loop, and every send due meanwhile leaves late. No collection first:
    that is the very stall (0.45 s or more in a fresh-clone test session), and the caller's clock
    already runs; freezing moves the generations aside at no cost."""

    @functools.wraps(fn)
    async def frozen(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        gc.freeze()
        try:
            return await fn(*args, **kwargs)
        finally:
            gc.unfreeze()

    return frozen


@dataclass
class _OpenLoop:
    """One open-loop run in progress: sends the plan's requests at their times over `http`, and keeps
    a record of every request scheduled so far (`records`, and the task of each one sent in `tasks`)."""

    plan: Sequence[PlannedRequest]
    opts: ClientOptions
    http: httpx.AsyncClient
    progress: Progress
    stop: asyncio.Event
    sem: asyncio.Semaphore | None
    on_record: Callable[[RequestRecord], None] | None
    t0: float
    records: list[RequestRecord] = field(default_factory=list)
    tasks: dict[asyncio.Task[None], RequestRecord] = field(default_factory=dict)

    def now(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.t0

    def done(self, rec: RequestRecord) -> None:
        self.progress.finished(rec)
        if self.on_record is not None:
            self.on_record(rec)

    async def _send(self, p: PlannedRequest, rec: RequestRecord) -> None:
        self.progress.sent += 1
        try:
            await send_request(self.http, p, self.opts, rec, self.now)
        except Exception as e:  # a failure nobody foresaw still ends as a failed record, not a lost one
            rec.end_s = self.now()
            rec.status, rec.error = "error", f"client failure: {type(e).__name__}: {e}"[:300]

    async def _one(self, p: PlannedRequest, rec: RequestRecord) -> None:
        if self.sem is None:
            await self._send(p, rec)
        else:
            async with self.sem:
                await self._send(p, rec)
        self.done(rec)

    async def arrive(self) -> bool:
        """Start each planned request at its scheduled time; whether `stop` interrupted the arrivals
        (the requests already due then are recorded as never sent)."""
        for pos, p in enumerate(self.plan):
            delay = p.scheduled_s - self.now()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), timeout=delay)
            if self.stop.is_set():
                # Requests whose time had come are part of the run and were never sent.
                for q in self.plan[pos:]:
                    if q.scheduled_s <= self.now():
                        rec = new_record(q)
                        rec.end_s = self.now()
                        rec.error = "run interrupted before it was sent"
                        self.records.append(rec)
                        self.done(rec)
                return True
            rec = new_record(p)
            self.records.append(rec)
            self.tasks[asyncio.create_task(self._one(p, rec))] = rec
        return False

    async def drain(self, drain_s: float) -> bool:
        """Wait up to `drain_s` for the requests still running (unless stopped); whether `stop` cut
        the wait short."""
        pending: set[asyncio.Task[None]] = set(self.tasks)
        if not pending or self.stop.is_set():
            return False
        stopper = asyncio.create_task(self.stop.wait())
        deadline = self.now() + drain_s
        while pending and not self.stop.is_set() and self.now() < deadline:
            finished, _ = await asyncio.wait(
                pending | {stopper}, timeout=deadline - self.now(), return_when=asyncio.FIRST_COMPLETED
            )
            pending -= finished
        stopper.cancel()
        return self.stop.is_set()

    async def cancel_unfinished(self) -> None:
        """Cancel the requests still running, recorded as `dropped` (never sent) or `timeout`."""
        pending = {t for t in self.tasks if not t.done()}
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in pending:
            if not t.cancelled():
                continue  # it finished on its own before the cancel landed
            rec = self.tasks[t]
            rec.end_s = self.now()
            if rec.sent_s is None:
                rec.status, rec.error = "dropped", "run ended before it was sent"
            else:
                rec.status, rec.error = "timeout", "run ended before it completed"
            self.done(rec)


@_heap_frozen
async def run_plan(
    plan: Sequence[PlannedRequest],
    opts: ClientOptions,
    *,
    max_concurrency: int | None = None,
    drain_timeout_s: float | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    progress_interval_s: float | None = 5.0,
    progress_out: TextIO | None = None,
    stop: asyncio.Event | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    duration_s: float | None = None,
) -> RunResult:
    """Run `plan` open-loop against `opts.url`; return one record per request scheduled in the run
    (the heap frozen meanwhile: `_heap_frozen`)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    drain = opts.request_timeout_s if drain_timeout_s is None else drain_timeout_s
    stop = stop or asyncio.Event()
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # Shown in the status line only: the nominal duration, else the last scheduled arrival.
    shown = duration_s if duration_s is not None else (plan[-1].scheduled_s if plan else 0.0)
    progress = Progress(total=len(plan), duration_s=shown)
    t0 = time.perf_counter()
    started_unix = time.time()
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=None)
    timeout = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None)
    async with httpx.AsyncClient(
        limits=limits, timeout=timeout, trust_env=False, transport=transport
    ) as http:
        run = _OpenLoop(plan, opts, http, progress, stop, sem, on_record, t0)
        out = progress_out or sys.stderr
        reporter = None
        if progress_interval_s:
            reporter = asyncio.create_task(_report(progress, t0, progress_interval_s, out))
        try:
            interrupted = await run.arrive()
            interrupted = await run.drain(drain) or interrupted
            await run.cancel_unfinished()
        finally:
            if reporter is not None:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
                out.write(("\r" if out.isatty() else "") + progress.line(run.now()) + "\n")
                out.flush()
    run.records.sort(key=lambda r: r.index)
    return RunResult(run.records, started_unix, run.now(), interrupted, len(plan))
