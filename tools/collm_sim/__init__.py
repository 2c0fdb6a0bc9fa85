"""Discrete-event cluster simulator: the coordinator core, the gateway's routing policy and the replica's
batching and co-scheduling policies, run unchanged against calibrated cost and quality models.

    from collm_sim import SimConfig, WorkloadSpec, simulate
    result = simulate(SimConfig(replicas=8, policy="collm", workload=WorkloadSpec(rate_rps=10)), calibration)
"""

from collm_sim.cluster import Simulation, simulate
from collm_sim.config import EngineSpec, GatewaySpec, SimConfig
from collm_sim.results import SimResult
from collm_sim.workload import WorkloadSpec, build_workload

__all__ = [
    "EngineSpec",
    "GatewaySpec",
    "SimConfig",
    "SimResult",
    "Simulation",
    "WorkloadSpec",
    "build_workload",
    "simulate",
]
