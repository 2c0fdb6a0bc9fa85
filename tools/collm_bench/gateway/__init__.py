"""The gateway's benchmarks: `python -m collm_bench gateway overhead|overload` (`collm_bench.groups`);
results in bench/results/gateway/."""
