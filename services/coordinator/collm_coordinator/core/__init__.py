"""CoLLM's coordinator core: the two-timescale algorithm as a pure state machine.

    decisions = CoordinatorCore(CoreConfig(...), policy="collm").on_tick(now_s, TickInputs(...))

No I/O happens here (state_machine.py); the service, the simulator and the tests drive the same core.

Two loops share every replica between serving (urgent, short-term value: goodput under SLOs) and
federated fine-tuning (elastic, long-term value: quality gain).

Slow loop, once per federated round (`slow_interval_s`; slow_loop.py). Drift-plus-penalty:

    maximise    V * sum_a d_a * gain_a(x_a)  -  Z * phi(u)
    subject to  u = D_forecast / sum_i (1 - s_i) <= util_cap,   0 <= s_i <= max_share

  * s_i: training share of replica i over the round; its token budget is b_i = s_i * T * r_i (T the
    round length `round_deadline_s`, r_i its training tokens/s, learned from telemetry).
  * gain_a(x_a) = k_a * ln((tau + T_a + x_a) / (tau + T_a)): expected held-out loss decrease of adapter a
    for x_a effective tokens (diminishing returns; k_a learned from the loss history of finished rounds,
    prior from the calibration's quality curve); x_a sums each participant's effective tokens
    E_i * (1 - exp(-b_i / E_i)), E_i its useful local data (volume; fresh samples count fully).
  * d_a: the adapter's share of requests (the served quality is what counts).
  * D_forecast: the next round's serving demand in replica units (max of the recent mean and the
    window mean plus `burst_headroom_sigmas` sigma); phi(u) = u / (1 - u), the SLO risk.
  * Z: virtual queue of the long-term attainment target, Z <- max(0, Z + gain * (target - attainment)
    * dt / slow_interval_s) at every fast tick; it grows while attainment falls short, so training
    yields to serving until the target is met again; it stops at `max_virtual_queue`. Its signed form
    goes negative while attainment stays above the target: headroom h = min(1, headroom_gain * -q)
    (target.py).
  Replicas that are stale, or without local data for the adapter, are not planned, nor those at SLO
  risk now while there is no headroom (with headroom they are, and the fast loop holds their share at 0
  while the risk lasts).
  Starvation floor: an adapter whose wait without a planned round would pass `starvation_floor_s` before
  the next slow tick gets one share step on its best candidate with room, whatever the risk penalty
  (never past util_cap); where none has room it takes a turn in a replica's training time (as much as
  each of that replica's jobs gets round-robin), the replica's share unchanged.
  An adapter left without a plan because every replica holding its data was at risk at the tick is
  planned at the first fast tick where one of them no longer is, and one whose previous round was still
  in flight (training, or its candidate being evaluated) at the first fast tick after that round ends
  (state_machine.py). A round in flight is forgotten when no outcome came `outcome_grace_s` after its
  deadline, `evaluation_grace_s` once the aggregator reported it aggregating or evaluating.

Fast loop, every `fast_interval_s` (fast_loop.py): each participant's share is its planned share, cut to
0 at once when its own SLOs are at risk (a queue, windowed attainment under the target with
`risk_attainment_z` sigmas of confidence, a serving load over `util_cap` judged on the larger of the
latest second and the `burst_window_s` mean, so that a saturated replica's swinging samples do not clear
the risk every other second), scaled down at once for all when the cluster's demand exceeds what the plan
leaves (`burst`, judged on a 3 s mean or a large one-second spike), and raised back gradually
(`share_recover_per_tick`); a replica that trains outside the plan (a round the aggregator's built-in
planner or an operator opened, or a local job) gets the same rule toward an even split of the slack the
plan leaves; every share not cut by a risk or a burst carries the spend s (spend_gain x h, rising by
at most spend_rise_per_s, falling at once, 0 while the last tick's attainment is under the target): the
part of it the replica trains beyond its requests' slack, so attainment comes down to the target;
routing weights favour replicas with slack and with the requested adapter resident; stale replicas get
no weight. The weights reach the gateway only with `publish_weights`: with the gateway's current rule (a
weighted random draw) its least-loaded fallback serves better (bench/README.md, Simulator).

Load units: a replica's load is the fraction of its full-batch capacity its token throughput uses,
decode tokens/s x decode_step_ms(max_batch) / max_batch + prefill tokens/s x prefill_ms_per_token (ms
per second / 1000), not its busy time (one running request keeps a batching engine busy all the time).

Knobs: `CoreConfig` (config.py), each declared once with its meaning and bounds; the service's
`COLLM_COORDINATOR_<KNOB>` settings are made from them (`config.settings()`; docs/settings.md lists them).

Baselines behind the same interface (baselines.py): `separate`, `fixed_ratio`, `leftover`.
"""

from collm_coordinator.core.config import POLICIES, CoreConfig, CostPrior
from collm_coordinator.core.fast_loop import SentShare, share_command_due
from collm_coordinator.core.state_machine import CoordinatorCore
from collm_coordinator.core.types import (
    AdapterVersionView,
    Decisions,
    Diagnostics,
    FastDecision,
    ParticipantBudget,
    ReplicaObservation,
    ResidentAdapterView,
    RoundEvent,
    RoundPlanDecision,
    RoutingDecision,
    ShareDecision,
    SkippedAdapter,
    SlowDecision,
    TickInputs,
    TrainingProgress,
)

__all__ = [
    "POLICIES",
    "AdapterVersionView",
    "CoordinatorCore",
    "CoreConfig",
    "CostPrior",
    "Decisions",
    "Diagnostics",
    "FastDecision",
    "ParticipantBudget",
    "ReplicaObservation",
    "ResidentAdapterView",
    "RoundEvent",
    "RoundPlanDecision",
    "RoutingDecision",
    "ShareDecision",
    "SkippedAdapter",
    "SlowDecision",
    "TickInputs",
    "TrainingProgress",
    "SentShare",
    "share_command_due",
]
