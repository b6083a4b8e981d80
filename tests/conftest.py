"""Shared fixtures: tiny hand-built graphs, the shared real data, and a multi-rank runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The shared real datasets live beside the checkout; a user's fresh clone has none.
SHARED_DATA = Path(os.environ.get("SVEN_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of real datasets; skips the test where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(
            f"real data not found at {SHARED_DATA}: `sven data fetch collegemsg "
            "--download-only` (and bitcoin-otc) downloads the published files into "
            "$SVEN_CACHE/downloads (default ~/.cache/sven/downloads), laid out as these "
            "tests read them; set SVEN_SHARED_DATA to that folder"
        )
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _deterministic_torch():
    import torch

    torch.manual_seed(0)
    # A CUDA run's trainer sets TF32 process-wide (train.matmul_precision, "high" by
    # default): each test starts from torch's default, IEEE float32 products.
    torch.backends.cuda.matmul.allow_tf32 = False
    yield


def write_tiny_store(
    path: Path, *, events: int, nodes: int, seed: int, t_max: int, edge_dim: int = 0
) -> Path:
    """A random event store (no self-loops, sorted times in [0, t_max)) at ``path``."""
    import numpy as np

    from sven.datasets.store import write_events

    rng = np.random.default_rng(seed)
    src = rng.integers(0, nodes, events)
    dst = (src + rng.integers(1, nodes, events)) % nodes
    t = np.sort(rng.integers(0, t_max, events))
    feat = rng.random((events, edge_dim)).astype(np.float32) if edge_dim else None
    write_events(path, src, dst, t, edge_feat=feat, num_nodes=nodes, name="tiny")
    return path


class Interrupted(Exception):
    """What :func:`die_at`'s hook raises."""


def die_at(at: int):
    """A ``before_step`` hook that raises :class:`Interrupted` before the ``at``-th
    training step (1-based; every rank at the same batch)."""
    calls = 0

    def hook(trainer) -> None:
        nonlocal calls
        calls += 1
        if calls == at:
            raise Interrupted

    return hook


def interrupted_then_resumed(config: str | None, overrides: list[str], at: int) -> dict:
    """Trains a run that dies before its ``at``-th training step (1-based), then
    resumes it from its last checkpoint to the end; returns the resumed run's result."""
    import sven

    dying = sven.Trainer(config, overrides)
    dying.add_hook("before_step", die_at(at))
    with pytest.raises(Interrupted):
        dying.fit()
    return sven.Trainer(config, [*overrides, "train.resume=true"]).fit()


def most_distinct(trainer, lo: int, hi: int, stream: int, num_neg: int, neg_table=None) -> int:
    """The most distinct nodes a batch of events [lo, hi) from ``lo`` reads (stream
    ``stream``), from the exact-size build (``torch.unique`` of its roots and real
    neighbours): what a fixed-shape step's planned node slots must hold."""
    return max(distinct_counts(trainer, lo, hi, stream, num_neg, neg_table))


def distinct_counts(
    trainer, lo: int, hi: int, stream: int, num_neg: int, neg_table=None
) -> list[int]:
    """The distinct nodes each batch of events [lo, hi) from ``lo`` reads (stream
    ``stream``), from the exact-size build, batch by batch."""
    from sven.pipeline.stages import select_batch

    src, b = trainer.step.source, trainer.cfg.train.batch_size
    counts = []
    for start in range(lo, hi, b):
        batch = select_batch(
            src.tables,
            start,
            min(start + b, hi),
            stream,
            seed=src.seed,
            num_neg=num_neg,
            sample_roots=src.model.sample_roots,
            read_neighbors=src.model.read_neighbors,
            neg_table=neg_table,
            table_lo=lo,
        )
        counts.append(batch.nodes.shape[0])
    return counts
