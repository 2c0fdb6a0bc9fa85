"""Federated learning's benchmarks: `python -m collm_bench federated rounds|strategies`
(`collm_bench.groups`)."""
