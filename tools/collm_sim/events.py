"""The simulation's event queue: one heap of timed events, taken in time order, ties in insertion order.

An event is (time s, insertion number, kind, payload). Arrivals come from the workload and are merged
with the heap by the event loop (`collm_sim.cluster.Simulation`), which dispatches on the kind.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collm_sim.replica import SimReplica

# Event kinds: a replica's iteration ends (payload: (replica, its `gen` when pushed)); every replica's
# telemetry is due; the coordinator ticks; a round's deadline (payload: the round); a round publishes;
# the aggregator stops waiting for a round's evaluations.
ITER, TELEMETRY, TICK, DEADLINE, PUBLISH, EVAL_TIMEOUT = range(6)


class EventQueue:
    """The timed events (`heap`, a heap of (time s, insertion number, kind, payload); `seq` numbers
    them)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()

    def push(self, t: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def wake(self, rep: SimReplica, now: float) -> None:
        """Something reached `rep` at `now` (a request, a job, an evaluation, a share): an idle replica
        starts an iteration now; a busy one's training stretch in progress yields to it (its iteration's
        new end, when it moved, stands for the old one: `SimReplica.interrupt`)."""
        if rep.idle:
            rep.idle = False
            self.push(now, ITER, (rep, rep.gen))
        else:
            end = rep.interrupt(now)
            if end is not None:
                self.push(end, ITER, (rep, rep.gen))
