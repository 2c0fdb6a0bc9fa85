"""What every experiment shares, live or simulated: one run of one policy on one trace slice at one rate.

`python -m collm_bench frontier` is the one runner over it (the knob grid, or `--preset headline`: each
policy at its default setting, what `make bench` runs). Modules: `config` (every size and setting, one
dataclass), `setup` (trace, plan, SLOs, data, capacity estimate), `rate_search` (the search for the
rate at which a run meets a target, pure), `rates` (the capacity formula, pure), `predict` (the
simulator with the live run's setup), `live` (one policy on a fresh live stack: NATS, Redis,
aggregator, coordinator, N replicas with local domain data, gateway; the plan replayed while federated
rounds run) and `signals` (SIGINT/SIGTERM stop the run's stack first).
"""
