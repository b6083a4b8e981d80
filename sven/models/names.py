"""The lists of names of the models and of the node-state tiers, in a module that
imports nothing: the config, ``sven partition`` and ``sven --help`` read them without
importing torch or the models (nor their types).

:data:`MODEL_CLASSES` maps each model name to its class's name; :mod:`sven.models`
loads the class (:func:`~sven.models.model_class`).

A tier's name says where node state lives on every machine: ``gpu`` in GPU memory,
``host`` in host memory, ``disk`` in memory-mapped files. On a run without a GPU the
config's ``gpu`` (beside the compute, as it was named) is host memory: it is accepted
as an alias and resolved to ``host`` (:func:`resolve_tier`), which is the name the
plan, the log and the summary show. :class:`~sven.models.storage.Storage` implements
each tier; the run's plan (``sven.engine.plan``) picks one when ``state.device=auto``.
"""

from __future__ import annotations

__all__ = ["MODEL_CLASSES", "MODEL_NAMES", "STATE_DEVICES", "TIERS", "resolve_tier"]

#: Model name -> the name of its class in :mod:`sven.models`.
MODEL_CLASSES: dict[str, str] = {"tgn": "TGN", "jodie": "JODIE", "apan": "APAN", "dyrep": "DyRep"}

#: The model names, in the order the docs list them.
MODEL_NAMES: tuple[str, ...] = tuple(MODEL_CLASSES)

#: The tiers node state can live in: GPU memory, host memory (on CUDA pinned and read
#: by the step's kernels over the host link), memory-mapped files.
TIERS: tuple[str, ...] = ("gpu", "host", "disk")

#: What ``state.device`` accepts: a tier, or ``auto`` (the plan picks one).
STATE_DEVICES: tuple[str, ...] = ("auto", *TIERS)


def resolve_tier(tier: str, device_type: str) -> str:
    """The tier ``tier`` names on a run whose compute is ``device_type``.

    Args:
        tier: One of :data:`TIERS`.
        device_type: ``cuda``, ``cpu``...

    Returns:
        ``tier``, except ``gpu`` without a GPU: ``host`` (state beside a CPU's compute
        is in host memory).

    Raises:
        ValueError: On a name outside :data:`TIERS`.
    """
    if tier not in TIERS:
        raise ValueError(f"state tier must be one of {TIERS}, got {tier!r}")
    return "host" if tier == "gpu" and device_type != "cuda" else tier
