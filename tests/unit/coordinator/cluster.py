"""Builders of core inputs for the coordinator's unit tests (plain test data, not a double of anything)."""

from __future__ import annotations

from dataclasses import replace

from collm_coordinator.core import (
    CoordinatorCore,
    CoreConfig,
    CostPrior,
    ReplicaObservation,
    ResidentAdapterView,
    TickInputs,
)

# Test data: a replica that trains 400 tokens/s when it only trains.
TRAIN_TOKENS_PER_S = 400.0


def config(**kw: object) -> CoreConfig:
    base: dict[str, object] = {
        "fast_interval_s": 1.0,
        "slow_interval_s": 30.0,
        "round_deadline_s": 20.0,
        "stale_after_s": 3.0,
        "warmup_s": 3.0,
        "cost_prior": CostPrior(train_tokens_per_s=TRAIN_TOKENS_PER_S),
        "publish_weights": True,
    }
    base.update(kw)
    return CoreConfig(**base)  # type: ignore[arg-type]


def obs(
    rid: str,
    t: float,
    busy: float = 0.3,
    queue: int = 0,
    domain: str = "med",
    samples: int = 200,
    attainment: float | None = 1.0,
    finished: int = 20,
    arrivals: float = 2.0,
    adapters: tuple[str, ...] = ("med", "bank"),
    **kw: object,
) -> ReplicaObservation:
    o = ReplicaObservation(
        replica_id=rid,
        received_s=t,
        ts_s=t,
        queue_len=queue,
        running=4,
        max_batch=16,
        arrivals_per_s=arrivals,
        finished=finished,
        good=round(finished * attainment) if attainment is not None else 0,
        slo_attainment=attainment,
        # Serving load `busy` of capacity: decode tokens/s at 40 ms per full batch of 16 (test data).
        tokens_per_s=busy * 16 * 1000.0 / 40.0,
        decode_step_ms=40.0,
        prefill_ms_per_token=0.5,
        local_samples=samples,
        domains=(domain,),
        adapters=tuple(ResidentAdapterView(a, 1) for a in adapters),
    )
    return replace(o, **kw) if kw else o


def tick(core: CoordinatorCore, t: float, *observations: ReplicaObservation, **inputs: object):
    return core.on_tick(t, TickInputs(telemetry=tuple(observations), **inputs))  # type: ignore[arg-type]


def steady(core: CoordinatorCore, t0: float, t1: float, loads: dict[str, float], **kw: object):
    """Tick once per second from t0 to t1 (inclusive) with every replica reporting its load."""
    d = None
    t = t0
    while t <= t1 + 1e-9:
        d = tick(core, t, *(obs(r, t, busy=b, **kw) for r, b in loads.items()))  # type: ignore[arg-type]
        t += 1.0
    return d
