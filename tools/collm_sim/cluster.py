"""The discrete-event cluster simulation: arrivals, replica iterations, telemetry, coordinator ticks, rounds.

Time is virtual: nothing sleeps, events are taken in time order from one heap (`collm_sim.events`, ties
in insertion order), and every random draw comes from generators seeded by `SimConfig.seed`, so a
configuration gives the same result on every run.

`Simulation` composes the parts and runs the event loop:

* arrival (from the workload, merged with the heap): the gateway's routing (`collm_sim.control.
  ControlPlane.route`) ranks the replicas; the request joins the first ranked replica's queue, or the
  next one's when that queue is full (at most `max_retries` more), or is rejected;
* replica iteration end: the replica emits tokens, then starts its next iteration (or goes idle until a
  request, a job or a share wakes it); a run of identical decode iterations is one event (see
  `collm_sim.replica`), with the same results as one event per iteration;
* telemetry (every `telemetry_interval_s`) and coordinator ticks (when the core asks): the control plane
  (`collm_sim.control`: the gateway's view and weights, the coordinator's shares and round plans);
* round deadline, publication, evaluation timeout: the simulated aggregator (`collm_sim.rounds`).

The run's records and figures are collected by `collm_sim.results`.

Simplifications, stated: control messages and weights arrive at once (the bus adds milliseconds);
every replica holds every domain's adapter resident (no adapter loading cost); a published version is
served by every replica at once (the live rollout is measured separately); replica-local refreshes of
an adapter (served before the round publishes) are not modelled, so served quality moves only at
publication; rounds aggregate by adding the accepted participants' tokens (a rebased round's too: the
live stack's quality per token with async rounds is measured, `bench/README.md`, Frontier).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from collm_common.calibration import Calibration
from collm_sim.background import Job
from collm_sim.batch import Req
from collm_sim.config import SimConfig
from collm_sim.control import ControlPlane
from collm_sim.events import DEADLINE, EVAL_TIMEOUT, ITER, PUBLISH, TELEMETRY, TICK, EventQueue
from collm_sim.plugins import COSCHEDULER_FOR_POLICY, make_coscheduler
from collm_sim.quality import QualityModel
from collm_sim.replica import SimReplica
from collm_sim.results import SimResult, request_records, sim_result
from collm_sim.rounds import SimAggregator, SimRound
from collm_sim.workload import Workload, build_workload
from collm_workload.quality import QualityTable
from collm_workload.records import RequestRecord

# Collector thresholds during a run (`rare_collections`): a young-generation pass every this many
# allocations, the older generations as rarely.
_GC_THRESHOLDS = (50_000, 50, 100)


@contextmanager
def rare_collections() -> Iterator[None]:
    """Python's cyclic garbage collector runs rarely while the block runs (thresholds at least
    `_GC_THRESHOLDS`), as before after it. A run allocates millions of short-lived objects, few of them
    in reference cycles, while what it keeps (requests, step records) grows: at the default thresholds
    the collector's passes over that heap take about a tenth of a large run. What it computes does not
    depend on when garbage is collected."""
    before = gc.get_threshold()
    gc.set_threshold(*(max(a, b) for a, b in zip(before, _GC_THRESHOLDS, strict=False)))
    try:
        yield
    finally:
        gc.set_threshold(*before)


class Simulation:
    """One simulated cluster: its replicas, the simulated aggregator (`aggregator`), the gateway and the
    coordinator (`control`; `core` is its `CoordinatorCore`), and the event loop over the workload."""

    def __init__(self, cfg: SimConfig, calibration: Calibration, workload: Workload | None = None) -> None:
        self.cfg = cfg
        self.cal = calibration
        self.quality = QualityModel(calibration.quality, cfg.quality_extrapolate, cfg.quality_max_factor)
        domains = cfg.domains or self.quality.domains
        missing = [d for d in domains if d not in self.quality.curves]
        if missing:
            raise ValueError(
                f"domains {missing} have no quality curve in the calibration ({calibration.command})"
            )
        self.domains = tuple(domains)
        self.workload = workload or build_workload(cfg.workload, self.domains)
        self.versions: dict[str, int] = dict.fromkeys(self.domains, 1)
        self.queue = EventQueue()
        self.replicas = self._replicas()
        self.aggregator = SimAggregator(
            cfg, self.quality, self.domains, self.replicas, self.versions, self.queue
        )
        self.control = ControlPlane(cfg, calibration, self.replicas, self.aggregator, self.queue)
        self.core = self.control.core
        self.requests: list[Req] = []
        self.outstanding = 0
        self.events = 0
        self.now = 0.0

    def _replicas(self) -> dict[str, SimReplica]:
        """The replicas `r0`, `r1`, ...: each with the engine settings (and its own, `engine_by_replica`),
        the co-scheduler of the policy under test, and a domain of its local data in turn."""
        cfg = self.cfg
        eng = cfg.engine
        cos_name = cfg.coscheduler or COSCHEDULER_FOR_POLICY[cfg.policy]
        replicas: dict[str, SimReplica] = {}
        for i in range(cfg.replicas):
            rid = f"r{i}"
            replicas[rid] = SimReplica(
                rid,
                self.cal.cost,
                dataclasses.replace(eng, **cfg.engine_by_replica.get(rid, {})),  # type: ignore[arg-type]
                make_coscheduler(cos_name, eng.fixed_every_iterations, slack_frac=eng.ft_slack_frac),
                self.domains[i % len(self.domains)],
                cfg.samples_per_replica,
                self.versions,
                self.workload.ttft_slo_ms,
                self.workload.tpot_slo_ms,
                cfg.request_timeout_s,
                self._on_finish,
                self._on_job_done,
            )
        return replicas

    @property
    def rounds(self) -> dict[int, SimRound]:
        return self.aggregator.rounds

    @property
    def trained_tokens(self) -> dict[str, float]:
        return self.aggregator.trained_tokens

    @property
    def share_samples(self) -> list[float]:
        return self.control.share_samples

    # --- callbacks from replicas ----------------------------------------------------------------------
    def _on_finish(self, req: Req) -> None:
        self.outstanding -= 1
        if req.replica is not None:
            self.control.in_flight[req.replica] -= 1

    def _on_job_done(self, rep: SimReplica, job: Job, now: float) -> None:
        self.aggregator.on_job_done(rep, job, now)

    # --- the run --------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        with rare_collections():
            return self._run()

    def _run(self) -> SimResult:
        wall0 = time.perf_counter()
        wl = self.workload
        n = len(wl)
        arrivals = wl.arrival_s
        draws = np.random.default_rng([self.cfg.seed, 7]).random(n)
        queue, control, agg = self.queue, self.control, self.aggregator
        queue.push(0.0, TELEMETRY)
        queue.push(0.0, TICK)
        interval = self.cfg.engine.telemetry_interval_s
        i = 0
        heap, seq = queue.heap, queue.seq
        done_arrivals = n == 0
        while True:
            t_arr = arrivals[i] if i < n else math.inf
            if heap and heap[0][0] <= t_arr:
                t, _, kind, payload = heapq.heappop(heap)
                self.now = t
                self.events += 1
                if kind == ITER:
                    rep, gen = payload
                    if gen != rep.gen:
                        continue  # an arrival moved this iteration's end: a newer event stands for it
                    nxt = rep.step(t)
                    if nxt is not None:
                        heapq.heappush(heap, (nxt, next(seq), ITER, payload))
                elif kind == TELEMETRY:
                    control.telemetry(t, interval)
                    if not self._finished(done_arrivals):
                        queue.push(t + interval, TELEMETRY)
                elif kind == TICK:
                    nxt_tick = control.tick(t)
                    if not self._finished(done_arrivals):
                        queue.push(nxt_tick, TICK)
                elif kind == DEADLINE:
                    if not payload.closed:
                        agg.close_round(payload, t)
                elif kind == PUBLISH:
                    agg.publish(payload, t)
                elif kind == EVAL_TIMEOUT:
                    agg.schedule_publish(payload, t)
            elif i < n:
                self.now = t = float(t_arr)
                self.events += 1
                self._arrive(i, t, float(draws[i]))
                i += 1
                done_arrivals = i >= n
            else:
                break
            if done_arrivals and self.outstanding == 0 and self.now >= wl.duration_s:
                break
        return sim_result(self, time.perf_counter() - wall0)

    def _finished(self, done_arrivals: bool) -> bool:
        return done_arrivals and self.outstanding == 0

    def _arrive(self, i: int, t: float, draw: float) -> None:
        """The workload's request `i` arrives at `t`: the gateway's routing, then the first replica of the
        ranking with room in its queue."""
        wl = self.workload
        domain = wl.domains[int(wl.domain[i])]
        req = Req(i, t, int(wl.input_tokens[i]), int(wl.output_tokens[i]), domain)
        self.requests.append(req)
        self.outstanding += 1
        ranked = self.control.route(domain, t, draw)
        for rid in ranked:
            req.attempts += 1
            rep = self.replicas[rid]
            if rep.enqueue(req, t):
                self.control.in_flight[rid] += 1
                self.queue.wake(rep, t)
                return
        req.status = "rejected" if ranked else "error"
        req.t_end = t
        self.outstanding -= 1

    # --- results --------------------------------------------------------------------------------------
    def records(self) -> list[RequestRecord]:
        """The benchmark's record of every request of the run."""
        return request_records(self.requests, self.workload)

    def quality_table(self) -> QualityTable:
        return self.aggregator.quality_table()


def simulate(cfg: SimConfig, calibration: Calibration, workload: Workload | None = None) -> SimResult:
    return Simulation(cfg, calibration, workload).run()
