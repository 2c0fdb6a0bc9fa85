"""bench/README.md's tables, rendered from committed result files (`python -m collm_bench readme`).

Each table of the page sits in a marked region that names its renderer (the result kind) and its
result files:

    <!-- table: engine-concurrency bench/results/engine/concurrency_kv32768.json -->
    ...generated: the table, then the result files it came from (and its plot, if the kind draws one)...
    <!-- /table -->

`regions` finds and fills the regions (pure), `kinds` registers one renderer per result kind (pure
functions of the parsed JSON), `cli` reads the files, rewrites or checks the page and draws the plots.
"""
