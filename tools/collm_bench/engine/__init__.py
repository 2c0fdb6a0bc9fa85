"""The engine's benchmarks on SmolLM2-135M-Instruct (CPU): `python -m collm_bench engine NAME`
(`collm_bench.groups`). Each runs the replica's real `Engine` in process and writes
bench/results/engine/<name>.json; `common` holds the model, prompts, timed runs and result files."""
