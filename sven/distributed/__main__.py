"""``python -m sven.distributed``: the self-check of a launch (:mod:`.selfcheck`)."""

import sys

from sven.distributed.selfcheck import main

sys.exit(main())
