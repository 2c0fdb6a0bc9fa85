"""The fault benchmarks: `python -m collm_bench faults scenarios|supervise|soak` (`collm_bench.groups`).
They drive the stacks and scenarios of tests/integration/faults, so they run from the repository root
(where `tests` is importable); results go to bench/results/faults/."""
