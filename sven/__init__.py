"""Sven: exact, fast, distributed training of memory-based temporal GNNs.

The public API is small: :class:`sven.Trainer` for training and evaluation,
:class:`sven.Predictor` for questions to a trained model (link scores, top-k, embeddings),
``sven.datasets`` for the event store, ``sven.partition`` for vertex
partitioning and ``sven.pipeline`` for batching and sampling.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["Predictor", "Trainer", "__version__"]


def __getattr__(name: str) -> Any:
    # Import the trainer lazily: `sven --version` and `sven data ...` must not pay
    # for importing the model stack.
    if name == "Trainer":
        from sven.engine.trainer import Trainer

        return Trainer
    if name == "Predictor":
        from sven.tasks.predict import Predictor

        return Predictor
    raise AttributeError(f"module 'sven' has no attribute {name!r}")
