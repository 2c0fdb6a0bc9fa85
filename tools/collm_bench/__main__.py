"""`python -m collm_bench ...` (see `collm_bench.cli`)."""

from collm_bench.cli import main

raise SystemExit(main())
