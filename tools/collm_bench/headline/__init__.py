"""The headline benchmark: goodput and served quality of every coordinator policy on the live stack.

For each trace slice and each of two arrival rates (light: the best baseline keeps >= 95% SLO
attainment; heavy: the best baseline near 85%, both found with the simulator), every policy in turn
(`collm`, `separate`, `fixed_ratio`, `leftover`) gets a fresh stack (NATS, Redis, aggregator,
coordinator, N replicas with local domain data, gateway) with the same model, replicas, data, request
plan and seed; federated rounds run while the load generator replays the slice; then the stack stops.
The simulator, given the same setup, predicts each run's goodput beside the live figure.

    python -m collm_bench headline                      # the defaults: SmolLM2, 2 replicas, conv slice
    python -m collm_bench headline --model tiny         # a quick check of the whole pipeline

Modules: `config` (every size, one dataclass), `setup` (trace, plan, SLOs, data), `rates` (the rate
search, pure), `predict` (the simulator with the same setup), `live` (one policy on the live stack),
`table` (ratios, goals and the Markdown table, pure), `plot` (the PNG), `cli` (the command).
"""
