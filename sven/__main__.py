"""``python -m sven`` is the same as the ``sven`` command."""

import sys

from sven.cli import main

sys.exit(main())
