"""The headline benchmark: goodput and served quality of every coordinator policy on the live stack.

For each trace slice and each of two arrival rates (light: the best baseline keeps >= 95% SLO
attainment; heavy: the best baseline near 85%, both found with the simulator), every policy in turn
(`collm`, `separate`, `fixed_ratio`, `leftover`) gets a fresh stack (NATS, Redis, aggregator,
coordinator, N replicas with local domain data, gateway) with the same model, replicas, data, request
plan and seed; federated rounds run while the load generator replays the slice; then the stack stops.
The simulator, given the same setup, predicts each run's goodput beside the live figure.

    python -m collm_bench headline                      # the defaults: SmolLM2, 2 replicas, conv slice
    python -m collm_bench headline --model tiny         # a quick check of the whole pipeline

Modules: `config` (every size, one dataclass), `setup` (trace, plan, SLOs, data, capacity estimate),
`rate_search` (the search for the rate at which a run meets a target, pure), `rates` (the light and
heavy rates and the capacity formula, pure), `predict` (the simulator with the same setup), `live` (one
policy on the live stack), `bench` (one invocation: the shared setup), `trace_run` (one trace: its rate
search and runs), `replay` (the calibration replay), `policy_run` (one policy at one rate, simulated and
live), `table` (ratios, goals and the Markdown table, pure), `plot` (the PNG), `outputs` (the table and
figure files), `cli` (the command).
"""
