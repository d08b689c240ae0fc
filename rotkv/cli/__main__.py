"""`python -m rotkv.cli`: the same as the `rotkv` command."""

import sys

from rotkv.cli import main

sys.exit(main())
