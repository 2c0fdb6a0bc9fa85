"""The policies the simulator runs unchanged, named in one place.

The simulator does not model these decisions: it calls the very code the services run.

* coordinator: `collm_coordinator.core.CoordinatorCore` (both loops, every policy);
* gateway routing: `collm_gateway.routing.rank_replicas` (weighted draw on fresh coordinator weights,
  least-loaded otherwise, stale replicas never ranked);
* aggregator: `collm_aggregator.planner.choose_evaluators` (which replicas score a round's versions);
* replica: `collm_replica.engine.scheduler.plan_iteration` (continuous batching with chunked prefill,
  paged KV admission and preemption: `engine.kv.blocks_for`), `scheduler.decide_background` (the
  training and evaluation windows after each step and the job to train, through the co-schedulers of
  `collm_replica.engine.cosched`: `slo`, `fixed`, `leftover`) on the input `scheduler.background_input` builds
  (the coordinator's share and its TTL, the `ArrivalHistory` of TTFT SLOs), with `effective_share` for
  the share in force and `behind_schedule` for an evaluation's pace; `repeated_decodes` says how many
  iterations in a row its plan stays one decode token per running request.

Which co-scheduler a replica runs follows the policy under test, as the live benchmark configures the
replicas (`COLLM_COSCHEDULER`): the two-timescale policy and the static split use the SLO-aware one,
the fixed-ratio baseline the fixed one (Loquetier), the leftover baseline the leftover one (FlexLLM).
"""

from __future__ import annotations

from collm_aggregator.planner import choose_evaluators
from collm_coordinator.core import CoordinatorCore, CoreConfig
from collm_coordinator.core.config import COSCHEDULER_FOR_POLICY
from collm_gateway.routing import ReplicaSnapshot, RoutingConfig, WeightsSnapshot, rank_replicas
from collm_replica.costs import FinishedSample, LatencyWindow
from collm_replica.engine.cosched import (
    CoScheduler,
    TrainCost,
    behind_schedule,
    effective_share,
    make_coscheduler,
)
from collm_replica.engine.kv import blocks_for
from collm_replica.engine.scheduler import (
    ArrivalHistory,
    BackgroundSettings,
    BatchConfig,
    JobView,
    RequestView,
    SeqView,
    background_input,
    decide_background,
    plan_iteration,
    repeated_decodes,
)

# Reference series run beside the policies (not a policy): name -> (the coordinator's policy, the replicas'
# co-scheduler). `serving_only` is collm's coordinator and routing with fine-tuning off on every replica:
# what the cluster serves when it trains nothing, the practical ceiling of a co-located policy's goodput.
REFERENCES = {"serving_only": ("collm", "off")}


def series_setup(series: str) -> tuple[str, str]:
    """(coordinator policy, replica co-scheduler) of a policy or a reference series."""
    if series in REFERENCES:
        return REFERENCES[series]
    return series, COSCHEDULER_FOR_POLICY[series]


__all__ = [
    "COSCHEDULER_FOR_POLICY",
    "REFERENCES",
    "ArrivalHistory",
    "BackgroundSettings",
    "BatchConfig",
    "CoScheduler",
    "CoordinatorCore",
    "CoreConfig",
    "FinishedSample",
    "JobView",
    "LatencyWindow",
    "ReplicaSnapshot",
    "RequestView",
    "RoutingConfig",
    "SeqView",
    "TrainCost",
    "WeightsSnapshot",
    "background_input",
    "behind_schedule",
    "choose_evaluators",
    "decide_background",
    "effective_share",
    "make_coscheduler",
    "plan_iteration",
    "repeated_decodes",
    "blocks_for",
    "rank_replicas",
    "series_setup",
]
