"""``python -m sven.cli`` (what ``torchrun -m sven.cli`` runs) is the ``sven`` command."""

import sys

from sven.cli import main

sys.exit(main())
