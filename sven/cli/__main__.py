"""``python -m sven.cli`` is the same as the ``sven`` command (``torchrun -m sven.cli``)."""

import sys

from sven.cli import main

sys.exit(main())
