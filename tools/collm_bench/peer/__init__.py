"""CoLLM against other serving systems on the same machine and model file: `python -m collm_bench peer NAME`
(`collm_bench.groups`); results in bench/results/peer/. `build` builds the peer from source outside the
repository, `servers` starts each server for its turn, `load` is the one load client every server gets,
`table` the result's table."""
