import sys

from collm_ops.cli import main

sys.exit(main())
