"""`python -m collm_bench.headline ...` (the same as `python -m collm_bench headline ...`)."""

from collm_bench.headline.cli import main

raise SystemExit(main())
