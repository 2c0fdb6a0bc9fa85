"""`python -m collm_sim` (see collm_sim.cli)."""

import sys

from collm_sim.cli import main

sys.exit(main())
