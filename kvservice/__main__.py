"""``python -m kvservice``: the same command line as the ``kvservice`` script."""

import sys

from .cli import main

sys.exit(main())
