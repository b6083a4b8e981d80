"""The one list of node-state tier names (``state.device``), apart from the storage
code so that the config reads it without importing torch.

:class:`~sven.models.storage.Storage` implements each tier; the run's plan
(``sven.engine.plan``) picks one when ``state.device=auto``.
"""

from __future__ import annotations

__all__ = ["STATE_DEVICES", "TIERS"]

#: The tiers node state can live in: beside the compute, in host memory the step reads
#: over the host link, in memory-mapped files.
TIERS: tuple[str, ...] = ("gpu", "host", "disk")

#: What ``state.device`` accepts: a tier, or ``auto`` (the plan picks one).
STATE_DEVICES: tuple[str, ...] = ("auto", *TIERS)
