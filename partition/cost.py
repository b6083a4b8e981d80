"""The exact communication cost model of a partition.

It replays one training epoch the way the distributed runtime executes it, and counts
what crosses ranks. The runtime can call ``comm_cost`` with its own sampler to predict
its traffic; a measured epoch must match the prediction byte for byte.

Semantics, for global batches of B training events (events
``[start + i * B, start + (i + 1) * B)``), event e processed by rank ``assign[e]``,
and for every batch and rank r:

- roots: src and dst of r's events, plus their negatives
  (``sample_negatives(seed, epoch, e, candidates, num_neg)``, candidates the distinct
  destinations of the whole store), each at its event's time;
- neighbours: layer 1 of ``TemporalSampler(TCSR of ALL events, [k], "recent")`` for
  the roots the model samples (``Access.sample_roots``: all of them, TGN; only src
  and dst, DyRep and APAN; none, JODIE); masked (padded) slots are not neighbours;
- reads: the distinct nodes among roots and, where the model reads them
  (``Access.read_neighbors``), neighbours; remote reads are the reads owned by
  another rank. Rank r sends each remote id (``id`` bytes) to its owner and receives
  its row (``read`` bytes);
- writes: the distinct src and dst of r's events (positives only; with
  ``Access.deliver_to_neighbors``, APAN, also the neighbours of those positive roots,
  which need not be read); remote writes are those owned elsewhere, sent as id plus
  row (``id + write`` bytes);
- naive volume: the same with one fetch per occurrence instead of per distinct node
  (every remote read root and neighbour slot; every remote written occurrence).

Counts are summed over the epoch. The owner side is reported too: ``served_reads[r]``
rows that r sends out for other ranks' reads and ``received_writes[r]`` rows it takes
in, so per-rank bytes sent and received follow.

The accesses of a batch come from :mod:`~sven.partition.access`, the report and its
byte figures from :mod:`~sven.partition.report`; this module counts.

Vectorization: a chunk of batches is processed at once. Every (batch, rank, node)
triple becomes one int64 key ``(batch * P + rank) * N + node``; only remote triples are
kept before the sort, so with a good partition most of the work disappears early.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sven.partition.access import Access, NeighbourFn, Touches, recent_sampler, touches
from sven.partition.graph import unique_sorted
from sven.partition.report import (
    COUNT_FIELDS,
    BatchCounts,
    CostReport,
    RowBytes,
    row_bytes,
    wire_bytes,
)

__all__ = ["SampledCost", "comm_cost", "comm_costs", "count_touches"]


@dataclass
class _Tally:
    """Counts of one pass over some touches (see ``count_touches``).

    Attributes:
        totals: (P,) int64 per rank, by the names of the report's counts
            (:data:`COUNT_FIELDS` but ``events`` and ``vertices``).
        batch_reads: (nb, P) distinct remote reads per batch and rank.
        batch_writes: (nb, P) distinct remote writes.
        batch_served: (nb, P) rows served to other ranks.
        batch_received: (nb, P) written rows received from other ranks.
    """

    totals: dict[str, np.ndarray]
    batch_reads: np.ndarray
    batch_writes: np.ndarray
    batch_served: np.ndarray
    batch_received: np.ndarray

    @property
    def batch_comm(self) -> np.ndarray:
        """(nb, P) distinct remote reads and writes per batch and rank."""
        return self.batch_reads + self.batch_writes


def _distinct(
    node: np.ndarray, batch_rank: np.ndarray, num_nodes: int, parts: int, owner: np.ndarray, nb: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (batch, rank, node) triples, tallied per rank, per owner, per batch.

    Args:
        node: (m,) int64 remote nodes.
        batch_rank: (m,) int64 ``batch * P + rank`` of each access.
        num_nodes: N.
        parts: P.
        owner: (N,) owners.
        nb: Batches in this pass.

    Returns:
        ``(per_rank (P,), per_owner (P,), per_batch_rank (nb, P), per_batch_owner
        (nb, P))`` int64.
    """
    # One int64 key per triple; (batch * P + rank) * N + node stays far below 2**63
    # for any realistic chunk.
    uniq = unique_sorted(batch_rank * num_nodes + node)
    br = uniq // num_nodes
    per_rank = np.bincount(br % parts, minlength=parts)
    own = owner[uniq - br * num_nodes]
    per_owner = np.bincount(own, minlength=parts)
    per_batch = np.bincount(br, minlength=nb * parts).reshape(nb, parts)
    per_batch_owner = np.bincount((br // parts) * parts + own, minlength=nb * parts)
    return per_rank, per_owner, per_batch, per_batch_owner.reshape(nb, parts)


def count_touches(
    tch: Touches,
    batch: np.ndarray,
    rank: np.ndarray,
    owner: np.ndarray,
    parts: int,
    num_batches: int,
) -> _Tally:
    """Counts remote reads and writes, distinct per batch and per occurrence.

    Args:
        tch: The touches.
        batch: (T,) int64 batch of each touch, in [0, num_batches).
        rank: (T,) int64 rank that processes each touch's event.
        owner: (N,) int64 owners.
        parts: P.
        num_batches: Number of distinct batch ids.

    Returns:
        The per-rank totals and the per-batch counts.
    """
    num_nodes = owner.shape[0]
    remote = owner[tch.node] != rank
    node, r = tch.node[remote], rank[remote]
    br = batch[remote] * parts + r
    rd, wr = tch.read[remote], tch.write[remote]
    reads, served, read_b, served_b = _distinct(
        node[rd], br[rd], num_nodes, parts, owner, num_batches
    )
    writes, received, write_b, received_b = _distinct(
        node[wr], br[wr], num_nodes, parts, owner, num_batches
    )
    totals = {
        "remote_reads": reads,
        "remote_writes": writes,
        "naive_reads": np.bincount(r[rd], minlength=parts),
        "naive_writes": np.bincount(r[wr], minlength=parts),
        "served_reads": served,
        "received_writes": received,
    }
    return _Tally(totals, read_b, write_b, served_b, received_b)


def _candidates(dst: np.ndarray, candidates: np.ndarray | None) -> torch.Tensor:
    """The negative candidates as an int64 tensor; the distinct destinations by default."""
    if candidates is None:
        candidates = unique_sorted(np.asarray(dst))
    return torch.from_numpy(np.asarray(candidates, dtype=np.int64))


def _defaults(
    src: np.ndarray,
    dst: np.ndarray,
    t: np.ndarray,
    num_nodes: int,
    k: int,
    sampler: NeighbourFn | None,
    access: Access | None,
    widths: RowBytes | None,
) -> tuple[NeighbourFn | None, Access, RowBytes]:
    """A replay's sampler, access pattern and row widths, where the caller gave none.

    TGN's access, ``row_bytes()``, and :func:`recent_sampler` over all events where
    the model samples ``k > 0`` neighbours (None where it samples none).
    """
    access = Access() if access is None else access
    widths = row_bytes() if widths is None else widths
    if sampler is None and k > 0 and access.samples:
        sampler = recent_sampler(src, dst, t, num_nodes, k)
    return sampler, access, widths


@dataclass
class _PartitionCount:
    """What :func:`comm_costs` counts for one partition, chunk by chunk.

    Attributes:
        owner: (N,) int64 owner rank per vertex.
        assign: Rank per event, indexed from ``offset``.
        parts: P.
        offset: The event ``assign[0]`` belongs to: 0 for a full-length ``assign``,
            the epoch start for one of the epoch's length.
        batch_size: B.
        acc: Per-rank totals by :data:`COUNT_FIELDS` name, each (P,) int64.
        batch_max_events, batch_max_comm, batch_max_sent, batch_max_recv: Sums over
            the batches counted so far of the largest per-rank figure.
        chunks: Per-batch counts of each chunk, where asked for.
    """

    owner: np.ndarray
    assign: np.ndarray
    parts: int
    offset: int
    batch_size: int
    acc: dict[str, np.ndarray]
    batch_max_events: int = 0
    batch_max_comm: int = 0
    batch_max_sent: int = 0
    batch_max_recv: int = 0
    chunks: list[BatchCounts] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        item: tuple[np.ndarray, np.ndarray, int] | tuple[np.ndarray, np.ndarray, int, int],
        batch_size: int,
        num_events: int,
        start: int,
        stop: int,
    ) -> _PartitionCount:
        """Checks one of :func:`comm_costs`'s partitions and starts its count at zero.

        Args:
            item: ``(owner, assign, P)`` or ``(owner, assign, P, B)``.
            batch_size: B where the item gives none.
            num_events: E, the store's events.
            start: First event of the epoch.
            stop: End of the epoch.

        Raises:
            ValueError: On a batch size below 1 or a mis-sized ``assign``.
        """
        owner, assign, parts = item[:3]
        bsz = int(item[3]) if len(item) > 3 else batch_size
        if bsz < 1:
            raise ValueError(f"batch_size must be >= 1, got {bsz}")
        owner = np.asarray(owner).astype(np.int64)
        if assign.shape[0] not in (stop - start, num_events):
            raise ValueError(f"assign has {assign.shape[0]} entries, expected {stop - start}")
        acc = {name: np.zeros(parts, dtype=np.int64) for name in COUNT_FIELDS}
        acc["vertices"] = np.bincount(owner, minlength=parts).astype(np.int64)
        # A full-length assign is indexed by event, a short one from the epoch start.
        offset = 0 if assign.shape[0] == num_events else start
        return cls(owner, assign, parts, offset, bsz, acc)

    def count_chunk(self, tch: Touches, idx: np.ndarray, widths: RowBytes, per_batch: bool) -> None:
        """Adds one chunk of whole batches to the count.

        Args:
            tch: The touches of the chunk's events.
            idx: (n,) int64 the chunk's events, consecutive; batches start at ``idx[0]``.
            widths: Row widths of the byte figures.
            per_batch: Keep the chunk's per-batch counts.
        """
        parts, acc, bsz = self.parts, self.acc, self.batch_size
        e0, e1 = int(idx[0]), int(idx[-1]) + 1
        nb = -(-(e1 - e0) // bsz)
        ev_batch = (idx - e0) // bsz
        ev_rank = np.asarray(self.assign[e0 - self.offset : e1 - self.offset]).astype(np.int64)
        ev_br = np.bincount(ev_batch * parts + ev_rank, minlength=nb * parts).reshape(nb, parts)
        acc["events"] += ev_br.sum(axis=0)
        self.batch_max_events += int(ev_br.max(axis=1).sum())
        local = tch.event - e0
        tally = count_touches(tch, ev_batch[local], ev_rank[local], self.owner, parts, nb)
        for name, count in tally.totals.items():
            acc[name] += count
        self.batch_max_comm += int(tally.batch_comm.max(axis=1).sum())
        sent, recv = wire_bytes(
            tally.batch_reads, tally.batch_writes, tally.batch_served, tally.batch_received,
            widths,
        )  # fmt: skip
        self.batch_max_sent += int(sent.max(axis=1).sum())
        self.batch_max_recv += int(recv.max(axis=1).sum())
        if per_batch:
            counts = BatchCounts(
                ev_br.astype(np.int64), tally.batch_reads, tally.batch_writes,
                tally.batch_served, tally.batch_received,
            )  # fmt: skip
            self.chunks.append(counts)

    def report(
        self,
        k: int,
        num_neg: int,
        num_events: int,
        widths: RowBytes,
        access: Access,
        per_batch: bool,
    ) -> CostReport:
        """The report of the epoch counted, ``num_events`` events long."""
        return CostReport(
            parts=self.parts,
            batch_size=self.batch_size,
            k=k,
            num_neg=num_neg,
            num_batches=-(-num_events // self.batch_size),
            widths=widths,
            batch_max_events=self.batch_max_events,
            batch_max_comm=self.batch_max_comm,
            batch_max_sent=self.batch_max_sent,
            batch_max_recv=self.batch_max_recv,
            access=access,
            batches=BatchCounts.concat(self.chunks, self.parts) if per_batch else None,
            **self.acc,
        )


def _chunk_length(batch_sizes: Sequence[int], chunk_events: int) -> int:
    """Events replayed at once: about ``chunk_events``, whole batches of every size.

    Raises:
        ValueError: Where the batch sizes' lcm is far above ``chunk_events``.
    """
    # A multiple of the sizes' lcm holds whole batches of each.
    step = int(np.lcm.reduce(batch_sizes)) if batch_sizes else 1
    if step > max(chunk_events, 1) * 64:
        raise ValueError(f"batch sizes with an lcm of {step} events: replay them separately")
    return max(1, chunk_events // step) * step


def _count_epoch(
    states: Sequence[_PartitionCount],
    touch: Callable[[np.ndarray], Touches],
    start: int,
    stop: int,
    chunk: int,
    widths: RowBytes,
    per_batch: bool,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Counts the epoch chunk by chunk: its touches produced once, counted per partition.

    Args:
        states: The partitions' counts.
        touch: The touches of (n,) int64 consecutive events.
        start: First event of the epoch.
        stop: End of the epoch.
        chunk: Events a chunk, whole batches of every partition.
        widths: Row widths of the byte figures.
        per_batch: Keep the per-batch counts.
        progress: Called with (events done, events total) after each chunk.
    """
    for e0 in range(start, stop, chunk):
        idx = np.arange(e0, min(e0 + chunk, stop), dtype=np.int64)
        tch = touch(idx)
        for st in states:
            st.count_chunk(tch, idx, widths, per_batch)
        if progress is not None:
            progress(int(idx[-1]) + 1 - start, stop - start)


def comm_cost(
    src: np.ndarray,
    dst: np.ndarray,
    t: np.ndarray,
    owner: np.ndarray,
    assign: np.ndarray,
    *,
    parts: int | None = None,
    **replay: Any,
) -> CostReport:
    """Replays one epoch over events ``[start, stop)`` and counts cross-rank traffic:
    :func:`comm_costs` for one partition.

    See the module docstring for the exact semantics.

    Args:
        src: (E,) source ids of ALL events (the T-CSR and the negative candidates come
            from the whole store).
        dst: (E,) destination ids.
        t: (E,) non-decreasing timestamps.
        owner: (N,) owner rank per vertex.
        assign: (E,) or (stop - start,) rank per event (a full-length array is sliced).
        parts: P; None means ``owner.max() + 1``.
        **replay: :func:`comm_costs`'s keyword arguments (``batch_size``, required;
            ``k``, ``num_neg``, ``seed``, ``epoch``, ``start``, ``stop``, ``candidates``,
            ``sampler``, ``access``, ``widths``, ``chunk_events``, ``progress``,
            ``per_batch``).

    Returns:
        The report.

    Raises:
        ValueError: On a batch size below 1 or a mis-sized ``assign``.
    """
    parts = int(np.asarray(owner).max()) + 1 if parts is None else parts
    (report,) = comm_costs(src, dst, t, [(owner, assign, parts)], **replay)
    return report


def comm_costs(
    src: np.ndarray,
    dst: np.ndarray,
    t: np.ndarray,
    partitions: Sequence[
        tuple[np.ndarray, np.ndarray, int] | tuple[np.ndarray, np.ndarray, int, int]
    ],
    *,
    batch_size: int,
    k: int = 10,
    num_neg: int = 1,
    seed: int = 0,
    epoch: int = 0,
    start: int = 0,
    stop: int | None = None,
    candidates: np.ndarray | None = None,
    sampler: NeighbourFn | None = None,
    access: Access | None = None,
    widths: RowBytes | None = None,
    chunk_events: int = 1 << 18,
    progress: Callable[[int, int], None] | None = None,
    per_batch: bool = False,
) -> list[CostReport]:
    """``comm_cost`` for several partitions of the same events, in one replay.

    The accesses (negatives, sampled neighbours) do not depend on the partition, so
    they are produced once per chunk and counted under every partition.

    Args:
        src: (E,) source ids of all events.
        dst: (E,) destination ids.
        t: (E,) timestamps.
        partitions: ``(owner (N,), assign (E,) or (stop - start,), P)`` per partition,
            or ``(owner, assign, P, B)`` with a batch size of its own (weak scaling:
            one replay for every P); the touches do not depend on the batching.
        batch_size: B, the global batch size of the partitions that give none.
        k: Neighbours per root (layer 1, "recent"); 0 samples none.
        num_neg: Negatives per event (>= 1).
        seed: Run seed of the negatives.
        epoch: Epoch number of the negatives.
        start: First event of the epoch (0 for training).
        stop: End of the epoch (the number of training events); None means E.
        candidates: (C,) negative candidates; None means the distinct ``dst``.
        sampler: Neighbour function, e.g. the runtime's own sampler; None builds
            ``recent_sampler``.
        access: The model's access pattern (``Access.of("apan")``, say); None means
            TGN's.
        widths: Row widths; None means ``row_bytes()``.
        chunk_events: Events replayed at once (rounded to whole batches); memory is
            about ``chunk_events * (2 + num_neg) * (k + 1) * 40`` bytes.
        progress: Called with (events done, events total) after each chunk.
        per_batch: Also keep the per-batch, per-rank counts of every report
            (``report.batches``): five (num_batches, P) int64 arrays.

    Returns:
        One report per partition, in order.

    Raises:
        ValueError: On a batch size below 1 or a mis-sized ``assign``.
    """
    stop = int(src.shape[0]) if stop is None else stop
    states = [
        _PartitionCount.of(item, batch_size, src.shape[0], start, stop) for item in partitions
    ]
    if not states:
        return []
    num_nodes = int(states[0].owner.shape[0])
    sampler, access, widths = _defaults(src, dst, t, num_nodes, k, sampler, access, widths)
    touch = functools.partial(
        touches, src, dst, t,
        candidates=_candidates(dst, candidates), sampler=sampler, k=k, num_neg=num_neg,
        seed=seed, epoch=epoch, access=access,
    )  # fmt: skip
    chunk = _chunk_length([st.batch_size for st in states], chunk_events)
    _count_epoch(states, touch, start, stop, chunk, widths, per_batch, progress)
    return [st.report(k, num_neg, stop - start, widths, access, per_batch) for st in states]


class SampledCost:
    """The exact cost model restricted to an evenly spread subset of batches.

    The accesses of the chosen batches are sampled once; afterwards any (owner,
    assign) pair is scored by counting alone, which is what lets ``minmax`` refine
    against the real objective rather than a proxy. The per-rank figures are exact for
    those batches and, scaled by ``1 / fraction``, estimate the full epoch.

    Args:
        src: (E,) source ids of all events.
        dst: (E,) destination ids.
        t: (E,) timestamps.
        num_nodes: N.
        batch_size: B.
        stop: Number of training events (the epoch is ``[0, stop)``).
        max_events: Events to keep at most (whole batches, evenly spaced); all
            batches when the epoch is smaller.
        k: Neighbours per root.
        num_neg: Negatives per event.
        seed: Seed of the negatives.
        sampler: Neighbour function; None builds ``recent_sampler``.
        widths: Row widths; None means ``row_bytes()``.
        candidates: Negative candidates; None means the distinct ``dst``.
        access: The model's access pattern; None means TGN's.
    """

    def __init__(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        t: np.ndarray,
        num_nodes: int,
        *,
        batch_size: int,
        stop: int,
        max_events: int = 1 << 19,
        k: int = 10,
        num_neg: int = 1,
        seed: int = 0,
        sampler: NeighbourFn | None = None,
        widths: RowBytes | None = None,
        candidates: np.ndarray | None = None,
        access: Access | None = None,
    ) -> None:
        num_batches = -(-stop // batch_size)
        keep = min(num_batches, max(1, max_events // batch_size))
        # Evenly spaced batches cover the whole history of a graph that changes over time.
        chosen = unique_sorted(np.linspace(0, num_batches - 1, keep).round().astype(np.int64))
        starts = chosen * batch_size
        lengths = np.minimum(starts + batch_size, stop) - starts
        self.events = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(
            int(lengths.sum()), dtype=np.int64
        )
        self.batch = np.repeat(np.arange(chosen.shape[0], dtype=np.int64), lengths)
        self.num_batches = int(chosen.shape[0])
        self.batch_size = int(batch_size)
        self.fraction = self.events.shape[0] / max(stop, 1)
        sampler, access, self.widths = _defaults(src, dst, t, num_nodes, k, sampler, access, widths)
        tch = touches(
            src, dst, t, self.events,
            candidates=_candidates(dst, candidates), sampler=sampler, k=k, num_neg=num_neg,
            seed=seed, epoch=0, access=access,
        )  # fmt: skip
        # Touches refer to events by their position in self.events from here on.
        pos = np.searchsorted(self.events, tch.event)
        self.tch = Touches(pos, tch.node, tch.read, tch.write)
        self.touch_batch = self.batch[pos]
        self.num_nodes = int(num_nodes)
        # Compact copies for ``comm``, which runs once per refinement proposal: int32
        # halves the bytes its gathers move.
        self._event32 = pos.astype(np.int32)
        self._node32 = tch.node.astype(np.int32)
        self._write = tch.write
        # Most models read every touch; then the read mask is skipped.
        self._read = None if tch.read.all() else tch.read
        self.src = np.asarray(src[self.events]).astype(np.int64)
        self.dst = np.asarray(dst[self.events]).astype(np.int64)

    def comm(self, owner: np.ndarray, assign: np.ndarray, parts: int) -> np.ndarray:
        """Per-rank ``comm_bytes`` over the sampled batches.

        The same count as ``count_touches`` (distinct remote (batch, rank, node) reads
        and writes), trimmed to what the objective needs.

        Args:
            owner: (N,) owners.
            assign: (n,) rank of each sampled event (aligned with ``self.events``).
            parts: P.

        Returns:
            (P,) int64 bytes.
        """
        rank = np.asarray(assign, dtype=np.int32)[self._event32]
        remote = np.asarray(owner, dtype=np.int32)[self._node32] != rank
        br = self.touch_batch[remote] * parts + rank[remote]
        key = br * self.num_nodes + self._node32[remote]
        wr = self._write[remote]
        rd = None if self._read is None else self._read[remote]
        del br, rank, remote
        reads = self._distinct_per_rank(key if rd is None else key[rd], parts)
        writes = self._distinct_per_rank(key[wr], parts)
        w = self.widths
        return reads * (w.id + w.read) + writes * (w.id + w.write)

    def _distinct_per_rank(self, key: np.ndarray, parts: int) -> np.ndarray:
        """(P,) number of distinct keys per rank (keys as in ``comm``)."""
        uniq = unique_sorted(key)
        return np.bincount((uniq // self.num_nodes) % parts, minlength=parts)
