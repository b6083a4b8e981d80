"""``python -m sven.cli`` is the ``sven`` command, as ``torchrun -m sven.cli`` runs it."""

import sys

from sven.cli import main

sys.exit(main())
