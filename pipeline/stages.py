"""Batch selection on the device: the one place a batch's layout is built from the store.

A batch is named by its global event range [start, stop) and a random stream (the
epoch, or a fixed evaluation stream). With a capacity, the range is padded to that many
events (``Batch.valid`` marks the real ones) and the node ids are de-duplicated into
fixed slots, so the whole construction (negatives, neighbour sampling, de-duplication,
feature gathers) runs on the device with no host synchronisation and with shapes that
depend only on the capacity: a CUDA graph can capture it, with ``start``, ``stop`` and
``stream`` as 0-d device tensors that are refilled before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sven import kernels
from sven.kernels import ahead
from sven.pipeline import constants
from sven.pipeline.batch import (
    Batch,
    RootLayout,
    make_batch,
    root_layout,
    sample_block,
)
from sven.pipeline.negatives import sample_negatives
from sven.pipeline.sampler import TemporalSampler

__all__ = ["EventTables", "event_ids", "events_batch", "select_batch", "select_events"]


@dataclass
class EventTables:
    """The event store's columns where the step runs (GPU-resident when it fits).

    Attributes:
        src: (E,) int64 sources.
        dst: (E,) int64 destinations.
        t: (E,) event times (int64 or float64).
        edge_feat: (E, d_e) or None.
        node_feat: (N + 1, d_n) with a zero scratch row N, or None.
        candidates: (C,) int64 nodes negatives are drawn from.
        sampler: Temporal sampler on the same device, or None for models that sample
            no neighbours.
        num_nodes: N.
    """

    src: torch.Tensor
    dst: torch.Tensor
    t: torch.Tensor
    edge_feat: torch.Tensor | None
    node_feat: torch.Tensor | None
    candidates: torch.Tensor
    sampler: TemporalSampler | None
    num_nodes: int


def select_batch(
    tables: EventTables,
    start: int | torch.Tensor,
    stop: int | torch.Tensor,
    stream: int | torch.Tensor,
    *,
    seed: int,
    num_neg: int,
    sample_roots: str,
    read_neighbors: bool,
    capacity: int | None = None,
    mrr_stream: int | torch.Tensor | None = None,
    mrr_negatives: int = 0,
    neg_table: torch.Tensor | None = None,
    table_lo: int | torch.Tensor = 0,
    order: torch.Tensor | None = None,
    batch_start: int | torch.Tensor | None = None,
    slots: int | None = None,
    for_grad: bool = True,
) -> Batch:
    """The batch of events [start, stop) with its negatives, neighbours and node slots.

    Args:
        tables: Device-resident event columns.
        start: First global event index (int, or a 0-d int64 device tensor).
        stop: One past the last event.
        stream: Random stream of the negatives and keys (the epoch, or an evaluation
            stream id).
        seed: Run seed.
        num_neg: Negatives per event for the loss / the AP metrics.
        sample_roots: The model's ``sample_roots``.
        read_neighbors: The model's ``read_neighbors``.
        capacity: None: exactly the events of the range, de-duplicated with
            ``torch.unique`` (eager path). An int B: B event slots, the range padded by
            repeating its last event (masked by ``Batch.valid``), fixed-slot
            de-duplication; nothing synchronises with the host.
        mrr_stream: Random stream of the extra MRR negatives, appended after the
            ``num_neg`` columns, or None.
        mrr_negatives: How many MRR negatives.
        neg_table: (n, m) negatives of events table_lo.. (evaluation protocols drawn
            ahead), used instead of uniform draws; row ``idx - table_lo`` of each event.
        table_lo: The global index of the table's first row.
        order: (E_r + 1,) int64 global indices of one rank's events in time order (its
            share of every batch, then one filler entry), or None (every event).
            ``start`` and ``stop`` then index into it: the batch is a rank's share
            ``order[start:stop]`` of a global batch.
        batch_start: First event of the global batch (keys the nodes' random draws);
            None: ``start``.
        slots: With a capacity, the node slots U planned for this kind of batch, or
            None for the most its ids could need (:func:`~sven.pipeline.batch.make_batch`).
        for_grad: Whether a gradient will be taken through the batch (see
            :func:`~sven.pipeline.batch.make_batch`).

    Returns:
        The batch; with a capacity, ``batch.size == capacity``.
    """
    idx, valid, *columns = select_events(tables, start, stop, capacity, order)
    neg = None if neg_table is None else _table_negatives(neg_table, idx, table_lo)
    return events_batch(
        tables,
        idx,
        stream,
        start if batch_start is None else batch_start,
        neg=neg,
        seed=seed,
        num_neg=num_neg,
        sample_roots=sample_roots,
        read_neighbors=read_neighbors,
        valid=valid,
        fixed=capacity is not None,
        mrr_stream=mrr_stream,
        mrr_negatives=mrr_negatives,
        slots=slots,
        columns=tuple(columns),
        for_grad=for_grad,
    )


def select_events(
    tables: EventTables,
    start: int | torch.Tensor,
    stop: int | torch.Tensor,
    capacity: int | None,
    order: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global event of each of a batch's event slots, which are real, and their
    columns; arguments as :func:`select_batch`'s.

    Returns:
        idx (B,) int64, valid (B,) bool (None without a capacity), and the events' src
        (B,), dst (B,) and t (B,) float64.
    """
    if capacity is not None and kernels.backend_for(tables.src, "select_events") == "triton":
        from sven.kernels.triton_events import select_events as fused

        out = fused(tables.src, tables.dst, tables.t, start, stop, capacity, order)
        if not ahead.dry_running():
            return out
    idx, valid = _event_slots(tables.src.device, start, stop, capacity, order)
    return idx, valid, tables.src[idx], tables.dst[idx], tables.t[idx].to(torch.float64)


def _table_negatives(
    neg_table: torch.Tensor, idx: torch.Tensor, table_lo: int | torch.Tensor
) -> torch.Tensor:
    """The (B, n) rows of ``neg_table`` (events ``table_lo``..) of the events ``idx``."""
    # The padding of a rank's share may come from another split: any row will do.
    rows = (idx - table_lo).clamp(min=0, max=neg_table.shape[0] - 1)
    return neg_table.index_select(0, rows)


def event_ids(
    tables: EventTables,
    idx: torch.Tensor,
    stream: int,
    *,
    seed: int,
    num_neg: int,
    sample_roots: str,
    read_neighbors: bool,
    neg_table: torch.Tensor | None = None,
    table_lo: int = 0,
    part: str = "all",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids that a fixed-slot batch holding the events ``idx`` de-duplicates, and
    the event each comes from, for any number of events at once.

    Every id of a batch is a function of its event and the stream alone (its
    negatives, its roots' keys and so their uniform draws; the nodes' keys, which
    depend on the batch, key dropout only), so a batch's ids are the union of its
    events'. They are built here as :func:`select_batch` builds them (the same
    negatives, root layout, keyed sampling and slot ids), laid out for many batches.

    Args:
        tables: Event columns.
        idx: (M,) int64 global event indices.
        stream, seed, num_neg, sample_roots, read_neighbors, neg_table, table_lo: See
            :func:`select_batch`.
        part: "all" the ids; "positive" those of the src and dst roots and their
            sampled neighbours; "negative" the others (each root's neighbours are
            drawn from its node, time and key alone, whichever roots are sampled
            with it).

    Returns:
        ids (I,) int64 in [0, N] (N: a masked neighbour slot), and (I,) int64 the
        position in ``idx`` of each id's event.
    """
    if neg_table is None:
        neg = sample_negatives(seed, stream, idx, tables.candidates, num_neg)
    else:
        neg = _table_negatives(neg_table, idx, table_lo)
    layout = root_layout(
        idx, tables.src[idx], tables.dst[idx], tables.t[idx], neg,
        sample_roots=sample_roots, rng=(seed, stream),
    )  # fmt: skip
    if part != "all":
        layout = _root_part(layout, 2 * idx.shape[0], part == "positive")
    ids, block = layout.nodes, None
    if tables.sampler is not None and read_neighbors:
        # The id list as the step's batch has it: the sampler writes the neighbour
        # slots (masked ones as N) into its tail, the same call as the step's, so the
        # planner compiles no sampler variant of its own.
        r, k = layout.nodes.shape[0], tables.sampler.fanouts[0]
        ids = torch.empty(r + layout.num_sampled * k, dtype=torch.int64, device=idx.device)
        ids[:r].copy_(layout.nodes)
        block = sample_block(tables.sampler, layout, None, ids, tables.num_nodes)
    # Roots are slot-major ([src, dst, neg...] of all the events); a sampled root's
    # neighbour slots follow the roots, row by row.
    at = torch.arange(layout.nodes.shape[0], device=idx.device) % idx.shape[0]
    if block is not None:
        at = torch.cat([at, at[: layout.num_sampled, None].expand_as(block.nbr).reshape(-1)])
    return ids, at


def _root_part(layout: RootLayout, cut: int, first: bool) -> RootLayout:
    """The roots of ``layout`` before ``cut`` (``first``) or from it, with theirs of its
    sampled and written roots."""
    sl = slice(None, cut) if first else slice(cut, None)
    keys = None if layout.keys is None else layout.keys[sl]
    if first:
        return RootLayout(
            layout.nodes[sl], layout.times[sl], keys, min(layout.num_sampled, cut),
            min(layout.num_written, cut),
        )  # fmt: skip
    return RootLayout(
        layout.nodes[sl], layout.times[sl], keys, max(layout.num_sampled - cut, 0),
        max(layout.num_written - cut, 0),
    )  # fmt: skip


def _event_slots(
    dev: torch.device,
    start: int | torch.Tensor,
    stop: int | torch.Tensor,
    capacity: int | None,
    order: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global event of each of a batch's event slots, and which are real (None
    without a capacity); arguments as :func:`select_batch`'s."""
    if capacity is None:
        idx = torch.arange(int(start), int(stop), device=dev)
        valid = None
    else:
        idx = constants.arange(capacity, dev) + start
        valid = idx < stop
        # Padding repeats the last real event; an empty share (possible on several
        # ranks) repeats an earlier one of the rank, or the filler entry.
        idx = torch.clamp(idx, max=stop - 1)
        if order is not None:
            idx = idx.clamp(min=0)
    if order is not None:
        idx = order[idx]
    return idx, valid


def events_batch(
    tables: EventTables,
    idx: torch.Tensor,
    stream: int | torch.Tensor,
    batch_start: int | torch.Tensor,
    *,
    seed: int,
    num_neg: int,
    sample_roots: str,
    read_neighbors: bool,
    valid: torch.Tensor | None = None,
    fixed: bool = False,
    mrr_stream: int | torch.Tensor | None = None,
    mrr_negatives: int = 0,
    neg: torch.Tensor | None = None,
    slots: int | None = None,
    columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    for_grad: bool = True,
) -> Batch:
    """The batch of the given events (any subset, e.g. one rank's share of a global batch).

    Args:
        tables: Event columns.
        idx: (B,) int64 global event indices.
        stream: Random stream (see :func:`select_batch`).
        batch_start: First event of the global batch: keys the nodes' random draws.
        seed, num_neg, sample_roots, read_neighbors, mrr_stream, mrr_negatives: See
            :func:`select_batch`.
        valid: (B,) real-event mask, or None.
        fixed: De-duplicate into fixed slots (``pad_node`` = N) instead of
            ``torch.unique``.
        neg: (B, n) negatives to use instead of uniform draws (evaluation protocols);
            the MRR negatives are still appended.
        slots: See :func:`select_batch`.
        columns: The events' (B,) src, dst and t, gathered already, or None.
        for_grad: See :func:`select_batch`.

    Returns:
        The batch.
    """
    if columns is None:
        columns = (tables.src[idx], tables.dst[idx], tables.t[idx])
    if neg is None:
        neg = sample_negatives(seed, stream, idx, tables.candidates, num_neg)
    if mrr_stream is not None and mrr_negatives:
        neg = torch.cat(
            [neg, sample_negatives(seed, mrr_stream, idx, tables.candidates, mrr_negatives)], 1
        )
    return make_batch(
        idx,
        *columns,
        neg,
        edge_feat_table=tables.edge_feat,
        node_feat_table=tables.node_feat,
        sampler=tables.sampler,
        sample_roots=sample_roots,
        read_neighbors=read_neighbors,
        # Uniform draws and dropout keyed by event and global batch: the same on any
        # number of ranks and after a resume.
        rng=(seed, stream, batch_start),
        valid=valid,
        pad_node=tables.num_nodes if fixed else None,
        slots=slots,
        for_grad=for_grad,
    )
