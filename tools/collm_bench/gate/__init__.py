"""The promotion gate's noise: `python -m collm_bench gate noise` (`collm_bench.groups`)."""
