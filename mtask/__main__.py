"""``python -m mtask``: the ``mtask`` command line."""

import sys

from mtask.cli import main

sys.exit(main())
