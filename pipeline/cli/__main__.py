"""`python -m tierpipe.cli`: the `tierpipe` command."""

import sys

from tierpipe.cli.main import main

sys.exit(main())
