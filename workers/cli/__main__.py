"""`python -m workers.cli` is `rackflow` (the role processes are started this way)."""

import sys

from workers.cli.boot import main

sys.exit(main())
