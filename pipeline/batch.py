"""The batch: one dataclass carried through the per-rank pipeline stages.

Roots are laid out as ``[src (B), dst (B), neg[:, 0] (B), ..., neg[:, n-1] (B)]``; every
per-root tensor follows that order. ``nodes`` holds each node the batch reads exactly
once (the redundancy-free set) and ``root_pos``/``nbr_pos`` index into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sven.pipeline import constants
from sven.pipeline.negatives import node_keys, root_keys

if TYPE_CHECKING:
    from sven.pipeline.dedupe import SortedRuns
    from sven.pipeline.sampler import NeighborBlock, TemporalSampler


@dataclass
class Batch:
    """A batch of B positive events with negatives, neighbours and the unique node set.

    Attributes:
        index: (B,) int64 global event indices.
        src: (B,) int64 source nodes.
        dst: (B,) int64 destination nodes.
        t: (B,) float64 event times.
        neg: (B, n) int64 negative destinations.
        edge_feat: (B, d_e) features of the events, or None.
        nodes: (U,) int64 unique nodes whose state the batch reads.
        root_pos: (R,) int64 position in ``nodes`` of each root, R = B * (2 + n).
        root_t: (R,) float64 time of each root.
        block: Sampled neighbours of the first ``block_roots`` roots, or None.
        nbr_pos: (block_roots, K) position in ``nodes`` of each neighbour (where
            masked any row: 0 on exact-size batches, a distinct row per slot on
            fixed-slot ones), or None when neighbour state is not read.
        nbr_edge_feat: (block_roots, K, d_e) features of the neighbour events (zero where
            masked), or None: read from ``edge_table`` where they are used.
        node_feat: (U, d_n) static features of ``nodes``, or None.
        root_key: (R,) int64 random keys of the roots (uniform sampling, dropout), or
            None when the batch draws from torch's generators instead.
        node_key: (U,) int64 random keys of ``nodes`` for this global batch, or None.
        valid: (B,) bool, False for the padding events of a fixed-capacity batch (they
            repeat a real event, and their loss, scores and writes are masked), or None
            when every event is real.
        runs: The fixed-slot de-duplication's sort (fixed-capacity batches), which the
            backward of the row gathers reuses; None otherwise.
        edge_table: The events' feature table, whose rows ``block.eid`` names for the
            neighbour slots (:meth:`neighbour_edges`), or None.
    """

    index: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    t: torch.Tensor
    neg: torch.Tensor
    edge_feat: torch.Tensor | None
    nodes: torch.Tensor
    root_pos: torch.Tensor
    root_t: torch.Tensor
    block: NeighborBlock | None = None
    nbr_pos: torch.Tensor | None = None
    nbr_edge_feat: torch.Tensor | None = None
    node_feat: torch.Tensor | None = None
    root_key: torch.Tensor | None = None
    node_key: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    edge_table: FeatureTable | None = None
    runs: SortedRuns | None = None

    def neighbour_edges(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The neighbour slots' event features as their consumer reads them.

        Returns:
            (features, rows): (block_roots, K, d_e) features and None where the batch
            holds them (``nbr_edge_feat``); else the (E, d_e) table and the (block_roots,
            K) rows of it each slot reads (``block.eid``; the consumer masks), which a
            wide batch (100 MRR negatives: 206,000 slots at batch 200) never writes out
            per slot; (None, None) without edge features.
        """
        if self.nbr_edge_feat is not None:
            return self.nbr_edge_feat, None
        if self.edge_table is None or self.block is None:
            return None, None
        return self.edge_table.rows, self.block.eid

    @property
    def size(self) -> int:
        """B, the number of positive events."""
        return self.src.shape[0]

    @property
    def num_neg(self) -> int:
        """n, negatives per positive."""
        return self.neg.shape[1]

    @property
    def roots(self) -> torch.Tensor:
        """(R,) root node ids."""
        return self.nodes[self.root_pos]


class FeatureTable:
    """A feature table a batch reads rows of, held by reference.

    Not a tensor nor a dataclass: a leaf of a batch's tree that the prefetch ring's
    copies of a built batch and a capture's state pass over (the table is the store's,
    the same for every batch).

    Attributes:
        rows: (E, F) the table.
    """

    __slots__ = ("rows",)

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows


@dataclass
class RootLayout:
    """Which nodes a batch touches at its roots, in the one layout every consumer uses.

    The batch builder (``make_batch``) and the cost model's replay
    (``sven.partition.access.touches``) both take a batch's roots from here, so the
    predicted reads and writes are those the runtime makes.

    Attributes:
        nodes: (R,) int64 roots ``[src (B), dst (B), neg[:, 0] (B), ...]``, R = B * (2 + n).
        times: (R,) float64 time of each root (its event's).
        keys: (R,) int64 random keys of the roots (``negatives.root_keys``), or None.
        num_sampled: The first ``num_sampled`` roots have their neighbours sampled
            (all of them, or the 2B positive ones).
        num_written: The first ``num_written`` roots (src and dst, 2B) are written
            back; with ``deliver_to_neighbors`` (APAN) also the sampled neighbours of
            these roots.
    """

    nodes: torch.Tensor
    times: torch.Tensor
    keys: torch.Tensor | None
    num_sampled: int
    num_written: int


def root_layout(
    index: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    t: torch.Tensor,
    neg: torch.Tensor,
    *,
    sample_roots: str = "all",
    rng: tuple[int, int | torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> RootLayout:
    """The roots of a batch of events and which of them are sampled and written.

    Args:
        index: (B,) int64 global event indices.
        src: (B,) int64.
        dst: (B,) int64.
        t: (B,) event times (any dtype).
        neg: (B, n) int64 negatives.
        sample_roots: "all" roots or only the "positive" ones (src and dst) have their
            neighbours sampled; "none": no root.
        rng: ``(seed, stream)`` of the roots' random keys, or None for no keys.
        out: (R,) int64 contiguous where the roots are written (the head of a batch's
            id list), or None.

    Returns:
        The layout.
    """
    b = src.shape[0]
    width = 2 + neg.shape[1]
    nodes = torch.cat([src, dst, neg.t().reshape(-1)], out=out)
    keys = None if rng is None else root_keys(rng[0], rng[1], index, width)
    sampled = num_sampled(sample_roots, b, width)
    return RootLayout(nodes, t.to(torch.float64).repeat(width), keys, sampled, 2 * b)


def num_sampled(sample_roots: str, b: int, width: int) -> int:
    """How many of a batch's B * width roots have their neighbours sampled."""
    return {"all": b * width, "positive": 2 * b, "none": 0}[sample_roots]


def make_batch(
    index: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    t: torch.Tensor,
    neg: torch.Tensor,
    *,
    edge_feat_table: torch.Tensor | None = None,
    node_feat_table: torch.Tensor | None = None,
    sampler: TemporalSampler | None = None,
    sample_roots: str = "all",
    read_neighbors: bool = True,
    generator: torch.Generator | None = None,
    rng: tuple[int, int | torch.Tensor, int | torch.Tensor] | None = None,
    valid: torch.Tensor | None = None,
    pad_node: int | None = None,
    slots: int | None = None,
    for_grad: bool = True,
) -> Batch:
    """Builds a :class:`Batch`: samples neighbours and de-duplicates the nodes to read.

    Args:
        index: (B,) int64 global event indices.
        src: (B,) int64.
        dst: (B,) int64.
        t: (B,) event times (any dtype; stored as float64).
        neg: (B, n) int64 negatives.
        edge_feat_table: (E, d_e) features of all events, or None.
        node_feat_table: (N, d_n) features of all nodes, or None.
        sampler: Temporal sampler, or None for models that read no neighbours.
        sample_roots: "all" roots or only the "positive" ones (src and dst).
        read_neighbors: Whether neighbours join ``nodes`` (their state is read).
        generator: RNG for uniform sampling (when ``rng`` is None).
        rng: ``(seed, stream, batch_start)``: key every random choice of the batch by
            ``negatives.batch_keys`` (roots by event and slot, nodes by global batch),
            so that any rank layout draws what one process draws. None leaves uniform
            sampling to ``generator`` and dropout to torch's generator. ``stream`` and
            ``batch_start`` may be 0-d device tensors (the captured step's inputs).
        valid: (B,) bool mask of real events (see ``Batch.valid``), or None.
        pad_node: None: de-duplicate with ``torch.unique`` (U = number of distinct
            nodes). An id (the memory's scratch row N): de-duplicate into fixed slots
            (:mod:`~sven.pipeline.dedupe`), U = number of roots plus neighbour slots,
            or ``pad_node + 1`` if fewer (``slot_count``), masked neighbour slots
            pointing at ``pad_node``; nothing then depends on the data's values, so the
            step can be captured. The node feature table needs a row ``pad_node``.
        slots: With ``pad_node``: U planned by the caller (at most ``slot_count``'s),
            holding the batch's distinct ids and the padding id (an evaluation width's:
            :func:`~sven.engine.capacities.plan_slots`); None: ``slot_count``'s.
        for_grad: With ``pad_node``: keep the de-duplication's sort for the backward of
            the row gathers (``Batch.runs``); False (no gradient: evaluation, encoding):
            no ``runs``, the same slots, the ids counted where that is cheaper.

    Returns:
        The batch.
    """
    ids = _id_list(src.shape[0], neg.shape[1], sampler, sample_roots, read_neighbors, pad_node)
    layout = root_layout(
        index, src, dst, t, neg, sample_roots=sample_roots,
        rng=None if rng is None else (rng[0], rng[1]),
        out=None if ids is None else ids[: src.shape[0] * (2 + neg.shape[1])],
    )  # fmt: skip
    roots, root_t, root_key = layout.nodes, layout.times, layout.keys
    block = None if sampler is None else sample_block(sampler, layout, generator, ids, pad_node)
    runs = None
    if pad_node is not None:
        nbrs = block if read_neighbors else None
        nodes, root_pos, nbr_pos, runs = _fixed_slots(roots, nbrs, pad_node, slots, ids, for_grad)
    else:
        nodes, root_pos, nbr_pos = _unique_slots(roots, block if read_neighbors else None)
    return Batch(
        index=index, src=src, dst=dst, t=t.to(torch.float64), neg=neg,
        edge_feat=None if edge_feat_table is None else edge_feat_table[index],
        nodes=nodes, root_pos=root_pos, root_t=root_t, block=block, nbr_pos=nbr_pos,
        node_feat=None if node_feat_table is None else node_feat_table[nodes],
        root_key=root_key, node_key=None if rng is None else node_keys(*rng, nodes), valid=valid,
        runs=runs,
        edge_table=None if edge_feat_table is None else FeatureTable(edge_feat_table),
    )  # fmt: skip


def _id_list(
    b: int,
    n: int,
    sampler: TemporalSampler | None,
    sample_roots: str,
    read_neighbors: bool,
    pad_node: int | None,
) -> torch.Tensor | None:
    """The empty id list of a fixed-slot batch that reads neighbours: (R + S K,) int64,
    the R roots then the K neighbour slots of the S sampled ones, which the roots'
    layout and the sampler write in place (no concatenation); else None."""
    if pad_node is None or sampler is None or not read_neighbors:
        return None
    r = b * (2 + n)
    k = sampler.fanouts[0]
    return torch.empty(r + num_sampled(sample_roots, b, 2 + n) * k, dtype=torch.int64,
                       device=sampler.tcsr.device)  # fmt: skip


def _fixed_slots(
    roots: torch.Tensor,
    block: NeighborBlock | None,
    pad_node: int,
    slots: int | None,
    ids: torch.Tensor | None = None,
    for_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, SortedRuns | None]:
    """:func:`make_batch`'s fixed-slot de-duplication of (R,) roots and the sampled
    neighbours of ``block`` (None: no neighbour is read) into U slots (``slots``, at
    most ``slot_count``'s); ``ids`` is their id list (:func:`_id_list`) where written
    already, ``pad_node`` in the masked neighbour slots; ``for_grad`` as
    :func:`make_batch`'s.

    Returns:
        nodes (U,), root_pos (R,), nbr_pos (R, K) or None, and the de-duplication's sort
        (None unless ``for_grad``).
    """
    from sven.pipeline.dedupe import SortedRuns, dedupe_fixed, dedupe_sorted, slot_count

    if block is None or ids is None:
        # Otherwise the sampler wrote the neighbour slots into the id list's tail.
        ids = slot_ids(roots, block, pad_node)
    u = slot_count(ids.shape[0], pad_node)
    if slots is not None:
        u = min(u, slots)
    r = roots.shape[0]
    runs = None
    if for_grad:
        nodes, inverse, perm, sorted_ids = dedupe_sorted(ids, pad_node, u)
        runs = SortedRuns(perm, inverse, sorted_ids, pad_node, r)
    else:
        nodes, inverse = dedupe_fixed(ids, pad_node, u)
    if block is None:
        return nodes, inverse[:r], None, runs
    # A masked slot may read any row: each reads a row of its own (its position among
    # the ids, modulo the slots), not the one padding row, so that the zero gradients
    # of the masked slots are not atomic adds piled on one row.
    own = constants.arange_mod(r, ids.shape[0], u, ids.device).view_as(block.nbr)
    nbr_pos = torch.where(block.mask, inverse[r:].view_as(block.nbr), own)
    return nodes, inverse[:r], nbr_pos, runs


def slot_ids(roots: torch.Tensor, block: NeighborBlock | None, pad_node: int) -> torch.Tensor:
    """The ids a fixed-slot batch de-duplicates: its (R,) roots, then the (S, K)
    neighbour slots of ``block`` row by row (None: no neighbour is read), masked ones
    as ``pad_node``.

    Returns:
        (R + S * K,) int64.
    """
    if block is None:
        return roots
    pad = constants.filled(pad_node, (), torch.int64, roots.device)
    return torch.cat([roots, torch.where(block.mask, block.nbr, pad).reshape(-1)])


def sample_block(
    sampler: TemporalSampler,
    layout: RootLayout,
    generator: torch.Generator | None = None,
    ids: torch.Tensor | None = None,
    pad_node: int | None = None,
) -> NeighborBlock:
    """The neighbours of the roots the model samples (the first ``layout.num_sampled``),
    with their ages; written into the tail of the id list ``ids`` too, where there is
    one (:func:`_id_list`)."""
    n = layout.num_sampled
    keys = None if layout.keys is None else layout.keys[:n]
    tail = None if ids is None else ids[layout.nodes.shape[0] :]
    return sampler.sample(
        layout.nodes[:n], layout.times[:n], generator, keys=keys, ids=tail,
        pad_id=0 if pad_node is None else pad_node, age=True,
    )[0]  # fmt: skip


def _unique_slots(
    roots: torch.Tensor, block: NeighborBlock | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`make_batch`'s exact de-duplication (``torch.unique``) of (R,) roots and the
    valid sampled neighbours of ``block`` (None: no neighbour is read).

    Returns:
        nodes (U,), root_pos (R,), nbr_pos (R, K) or None; U the number of distinct
        nodes, masked neighbour slots at position 0.
    """
    if block is None:
        nodes, root_pos = torch.unique(roots, return_inverse=True)
        return nodes, root_pos, None
    valid_nbr = block.nbr[block.mask]
    nodes, inverse = torch.unique(torch.cat([roots, valid_nbr]), return_inverse=True)
    nbr_pos = torch.zeros_like(block.nbr)
    nbr_pos[block.mask] = inverse[roots.shape[0] :]
    return nodes, inverse[: roots.shape[0]], nbr_pos


def last_occurrence(nodes: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each distinct node, the position of its occurrence with the largest key.

    Used for write-back: a node's memory and mail come from its last event in the batch
    (largest global event index, ties broken by the finer key).

    Args:
        nodes: (P,) int64 node ids, with repeats.
        key: (P,) int64 distinct ordering keys.

    Returns:
        uniq (W,) sorted distinct nodes, and pos (W,) positions into ``nodes``.
    """
    order = torch.argsort(key)
    order = order[torch.argsort(nodes[order], stable=True)]
    sorted_nodes = nodes[order]
    is_last = torch.ones_like(sorted_nodes, dtype=torch.bool)
    is_last[:-1] = sorted_nodes[1:] != sorted_nodes[:-1]
    return sorted_nodes[is_last], order[is_last]
