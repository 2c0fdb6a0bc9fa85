"""The seven faults of CoLLM, each run against a live `FaultStack` and measured as a `FaultReport`: the
registry of the scenarios in serving_faults.py (1, 2, 5), round_faults.py (3, 4, 6) and supervision.py
(7).

Shared by the fault tests (tests/integration/faults/test_*.py, small parameters) and the figures
(`python -m collm_bench faults scenarios`, larger ones). Each scenario starts from a healthy stack,
injects its fault into the real processes, measures, repairs what it broke, and returns what it saw:
requests sent, succeeded, retried, failed with a clear error, lost (must be 0), the recovery time, and
named checks (each a property the fault must not break). A scenario never asserts: the caller decides
what to do with failed checks, so a figures run reports every fault even when one misbehaves.

1. `replica_kill`: SIGKILL one of two replicas under concurrent load, then restart it.
2. `nats_restart`: stop nats-server, probe the gateway while it is down, start it again (same port and
   JetStream store) and time every service until it serves again.
3. `redis_restart`: Redis restarts between a round's evaluation and its publication, while requests use
   a resident adapter; the publication lands after, and every blob in the store verifies.
4. `aggregator_kill`: SIGKILL the aggregator mid-round (while it collects, then while it evaluates); the
   round resumes from its durable updates and publishes once, or aborts cleanly.
5. `coordinator_down`: SIGKILL the coordinator; the gateway's use of its weights decays to even routing
   and replicas fall back to their local fine-tuning share; both come back after a restart.
6. `straggler`: a participant that never answers does not hold a round past its deadline.
7. `replica_supervised` (supervision.py): with the launcher supervising, as `collm up` does, SIGKILL one
   of two replicas under load; supervision restarts it while the other serves.
"""

from __future__ import annotations

from .report import FaultReport
from .round_faults import aggregator_kill, redis_restart, straggler
from .serving_faults import coordinator_down, nats_restart, replica_kill
from .supervision import replica_supervised

__all__ = ["FaultReport", "SCENARIOS", "VARIANTS"]

SCENARIOS = {
    "replica_kill": replica_kill,
    "nats_restart": nats_restart,
    "redis_restart": redis_restart,
    "aggregator_kill": aggregator_kill,
    "coordinator_down": coordinator_down,
    "straggler": straggler,
    "replica_supervised": replica_supervised,
}
# Harsher variants for the figures: the server process is SIGKILLed instead of stopped.
VARIANTS = {
    "nats_crash": (nats_restart, {"crash": True}),
    "redis_crash": (redis_restart, {"crash": True}),
}
