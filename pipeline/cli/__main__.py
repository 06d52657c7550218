"""`python -m tierpipe.cli`: the `tierpipe` command."""

import sys

from tierpipe.cli.dispatch import main

sys.exit(main())
