"""The frontier benchmark, the one experiment runner: each coordinator policy's trade-off curve over its
knob grid, or with `--preset headline` each policy once at its default setting (`make bench`).

Every policy x knob (fixed_ratio's training share, separate's training replicas, leftover as is,
collm's quality weight V and attainment target, and the serving_only reference) runs at one offered
rate over the same slice; each point's SLO attainment, goodput, fine-tuning tokens and mean served
quality gain give each policy's Pareto frontier and the goals (bench/README.md, Frontier).

    python -m collm_bench frontier --sim --replicas 64 --window-s 3600 --trace conv
    make bench-frontier                  # live, on the default stack
    make bench                           # live, the headline preset

Modules: `points` (knob grids, dominance, frontiers, readings, goals; pure), `curves` (quality curves
of uncalibrated domains; pure), `sim` (the points in the simulator), `live` (the points on the live
stack), `render` (the Markdown table and the figure), `cli` (the command); what a run is, live or
simulated, lives in `collm_bench.experiment`.
"""
