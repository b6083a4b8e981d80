"""The cost model's view of a batch: which nodes it touches, read or written.

:class:`Access` is a model's access pattern (which roots are sampled, whether the
sampled neighbours are read, whether they get mail); :func:`touches` lists every
(event, node) access of a set of events, roots and sampled neighbours, with the
runtime's own negatives and root layout; :func:`recent_sampler` is the sampler the
replay uses when the caller brings none. What the accesses cost is counted in
:mod:`~sven.partition.cost`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sven.pipeline.batch import root_layout
from sven.pipeline.negatives import sample_negatives

__all__ = ["SAMPLE_ROOTS", "Access", "NeighbourFn", "Touches", "recent_sampler", "touches"]


#: Values of ``Access.sample_roots``.
SAMPLE_ROOTS = ("all", "positive", "none")


@dataclass(frozen=True)
class Access:
    """Which nodes a model's batch touches besides its roots: the cost model's view of
    a model. The default is TGN's.

    Attributes:
        sample_roots: Roots whose neighbours are sampled: "all" (src, dst and
            negatives), "positive" (src and dst) or "none".
        read_neighbors: Whether the sampled neighbours' rows are read (fetched).
        deliver_to_neighbors: Whether the sampled neighbours of positive roots get
            mail (written, whether or not they are read).
    """

    sample_roots: str = "all"
    read_neighbors: bool = True
    deliver_to_neighbors: bool = False

    def __post_init__(self) -> None:
        if self.sample_roots not in SAMPLE_ROOTS:
            raise ValueError(
                f"sample_roots must be one of {SAMPLE_ROOTS}, got {self.sample_roots!r}"
            )

    @property
    def samples(self) -> bool:
        """Whether any neighbour is sampled and used (read or written)."""
        return self.sample_roots != "none" and (self.read_neighbors or self.deliver_to_neighbors)

    @classmethod
    def of(cls, model: Any) -> Access:
        """The access pattern of a model: a name ("tgn", "jodie", "dyrep", "apan"), a
        ``MemoryModel`` subclass or instance.

        Raises:
            ValueError: On an unknown model name.
        """
        if isinstance(model, str):
            from sven.models import model_class

            model = model_class(model)
        return cls(model.sample_roots, bool(model.read_neighbors), bool(model.deliver_to_neighbors))


#: ``f(nodes (R,) int64, times (R,), keys (R,) int64) -> (nbr (R, k) int64, mask (R, k)
#: bool)``; ``keys`` are the roots' random keys (``negatives.root_keys``), which the
#: runtime's uniform sampler draws from, so that the replay draws what training draws.
NeighbourFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


def recent_sampler(
    src: np.ndarray, dst: np.ndarray, t: np.ndarray, num_nodes: int, k: int
) -> NeighbourFn:
    """Layer 1 of the real recent-k ``TemporalSampler`` over a T-CSR of ALL events.

    Args:
        src: (E,) source ids of every event of the store.
        dst: (E,) destination ids.
        t: (E,) timestamps.
        num_nodes: N.
        k: Neighbours per root.

    Returns:
        The neighbour function the cost model calls.
    """
    from sven.pipeline.sampler import TCSR, TemporalSampler

    sampler = TemporalSampler(TCSR.from_events(src, dst, t, num_nodes, "cpu"), [k], "recent")

    def sample(
        nodes: torch.Tensor, times: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block = sampler.sample(nodes, times)[0]
        return block.nbr, block.mask

    return sample


@dataclass(frozen=True)
class Touches:
    """Every (event, node) access of a set of events: what the cost model counts.

    Attributes:
        event: (T,) int64 global index of the event that touches the node.
        node: (T,) int64 the node touched.
        read: (T,) bool, True where the node's row is read (every root; neighbours of
            models that read them).
        write: (T,) bool, True where the node is written (positive endpoint, or an APAN
            neighbour of one, once per root however often it was sampled).
    """

    event: np.ndarray
    node: np.ndarray
    read: np.ndarray
    write: np.ndarray


def touches(
    src: np.ndarray,
    dst: np.ndarray,
    t: np.ndarray,
    events: np.ndarray,
    *,
    candidates: torch.Tensor,
    sampler: NeighbourFn | None,
    k: int,
    num_neg: int,
    seed: int,
    epoch: int,
    access: Access,
) -> Touches:
    """The accesses of ``events``: roots (src, dst, negatives) and their neighbours.

    Args:
        src: (E,) source ids of all events.
        dst: (E,) destination ids.
        t: (E,) timestamps.
        events: (n,) int64 global event indices, increasing.
        candidates: (C,) int64 negative candidates.
        sampler: Neighbour function; unused when ``k == 0``.
        k: Neighbours per root.
        num_neg: Negatives per event.
        seed: Seed of the negatives.
        epoch: Epoch of the negatives.
        access: Which roots are sampled and whether neighbours are read or written.

    Returns:
        The touches, roots first (all src, all dst, each negative draw), then the
        used neighbour slots in root order.
    """
    index = torch.from_numpy(events)
    neg = sample_negatives(seed, epoch, index, candidates, num_neg)
    # The batch builder's own layout of the roots (which are sampled, which written).
    layout = root_layout(
        index,
        torch.from_numpy(np.asarray(src[events]).astype(np.int64)),
        torch.from_numpy(np.asarray(dst[events]).astype(np.int64)),
        torch.from_numpy(np.asarray(t[events])),
        neg,
        sample_roots=access.sample_roots,
        rng=(seed, epoch),
    )
    roots = layout.nodes.numpy()
    root_ev = np.tile(events, 2 + num_neg)
    root_rd = np.ones(roots.shape[0], dtype=bool)
    root_wr = np.zeros(roots.shape[0], dtype=bool)
    root_wr[: layout.num_written] = True
    if k == 0 or sampler is None or not access.samples:
        return Touches(root_ev, roots, root_rd, root_wr)
    m = layout.num_sampled
    times = layout.times.numpy()[:m]
    # Touches are a multiset, so the roots can be sampled in any order: sorted by node,
    # the sampler's binary searches and gathers walk its index nearly sequentially,
    # which on a large T-CSR is several times faster than in event order.
    order = np.argsort(roots[:m])
    keys = layout.keys[:m]
    nbr_t, mask_t = sampler(
        torch.from_numpy(roots[order]), torch.from_numpy(times[order]), keys[order]
    )
    nbr, mask = nbr_t.numpy(), mask_t.numpy()
    if access.deliver_to_neighbors:
        from sven.models.apan import first_occurrences

        # A node in two slots of one root's list gets that root's mail once: the
        # model's own choice of slot, so that the replay writes what it writes.
        first = first_occurrences(nbr_t, mask_t).numpy()
        slot_wr = (root_wr[order][:, None] & first)[mask]
    else:
        slot_wr = np.zeros(int(mask.sum()), dtype=bool)
    slot_rd = np.full(slot_wr.shape[0], access.read_neighbors)
    slot_ev = np.broadcast_to(root_ev[order][:, None], mask.shape)[mask]
    return Touches(
        np.concatenate((root_ev, slot_ev)),
        np.concatenate((roots, nbr[mask])),
        np.concatenate((root_rd, slot_rd)),
        np.concatenate((root_wr, slot_wr)),
    )
