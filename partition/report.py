"""The cost report: row widths, per-rank and per-batch counts, bytes, and their table.

:class:`CostReport` holds what :func:`~sven.partition.cost.comm_cost` counted for one
epoch, per rank (and per batch with :class:`BatchCounts`); the bytes follow from the
counts and the row widths (:class:`RowBytes`, :func:`row_bytes`, :func:`wire_bytes`);
:func:`format_report` prints it as the table of ``sven partition``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sven.partition.access import Access

__all__ = [
    "COUNT_FIELDS",
    "BatchCounts",
    "CostReport",
    "RowBytes",
    "format_report",
    "row_bytes",
    "wire_bytes",
]


@dataclass(frozen=True)
class RowBytes:
    """Bytes moved per node in each direction.

    Attributes:
        read: Bytes of one fetched row: memory, last-update time, mailbox, mail times.
        write: Bytes of one written-back row: memory, last-update time, one new mail
            and its time.
        id: Bytes per node id sent.
    """

    read: int
    write: int
    id: int = 8


def row_bytes(
    memory_dim: int = 100,
    mail_dim: int | None = None,
    *,
    mailbox_size: int = 1,
    float_bytes: int = 4,
    time_bytes: int = 8,
    id_bytes: int = 8,
) -> RowBytes:
    """Row widths of a memory model.

    Args:
        memory_dim: Memory width.
        mail_dim: Mail width; None means TGN's ``2 * memory_dim + memory_dim`` (two
            memories and a time encoding of the memory width, no edge features).
        mailbox_size: Mails kept per node (1 for TGN/JODIE/DyRep, more for APAN).
        float_bytes: Bytes per float.
        time_bytes: Bytes per timestamp.
        id_bytes: Bytes per node id.

    Returns:
        The widths.
    """
    if mail_dim is None:
        mail_dim = 3 * memory_dim
    memory = memory_dim * float_bytes + time_bytes
    read = memory + mailbox_size * (mail_dim * float_bytes + time_bytes)
    write = memory + mail_dim * float_bytes + time_bytes
    return RowBytes(read=read, write=write, id=id_bytes)


#: Per-rank count arrays of a report, in the order they are printed.
COUNT_FIELDS = (
    "events",
    "vertices",
    "remote_reads",
    "remote_writes",
    "naive_reads",
    "naive_writes",
    "served_reads",
    "received_writes",
)


@dataclass
class BatchCounts:
    """Per-batch, per-rank counts of one epoch: what a synchronous step waits for.

    Row b, column r is what rank r does in global batch b; summed over batches (axis
    0) each array equals the report's epoch total of the same name.

    Attributes:
        events: (nb, P) training events rank r processes in batch b.
        remote_reads: (nb, P) distinct remote nodes r reads in batch b (ids out, rows in).
        remote_writes: (nb, P) distinct remote nodes r writes in batch b.
        served_reads: (nb, P) rows r serves to other ranks in batch b (ids in, rows out).
        received_writes: (nb, P) written rows r takes in for its vertices in batch b.
    """

    events: np.ndarray
    remote_reads: np.ndarray
    remote_writes: np.ndarray
    served_reads: np.ndarray
    received_writes: np.ndarray

    @classmethod
    def empty(cls, parts: int) -> BatchCounts:
        """Counts of no batch: every array (0, P)."""
        z = np.zeros((0, parts), dtype=np.int64)
        return cls(*(z.copy() for _ in dataclasses.fields(cls)))

    @classmethod
    def concat(cls, chunks: Sequence[BatchCounts], parts: int) -> BatchCounts:
        """The chunks' batches one after another."""
        if not chunks:
            return cls.empty(parts)
        return cls(
            *(np.concatenate([getattr(c, f.name) for c in chunks]) for f in dataclasses.fields(cls))
        )


def wire_bytes(
    remote_reads: np.ndarray,
    remote_writes: np.ndarray,
    served_reads: np.ndarray,
    received_writes: np.ndarray,
    widths: RowBytes,
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes a rank sends and receives in the exchange, from its counts (any shape).

    Sent: the ids of its remote reads, the rows it serves, its remote writes (id and
    row). Received: the ids it serves, the rows it reads, the writes to its vertices.

    Returns:
        ``(sent, received)``, each the shape of the counts.
    """
    w = widths
    sent = remote_reads * w.id + served_reads * w.read + remote_writes * (w.id + w.write)
    recv = served_reads * w.id + remote_reads * w.read + received_writes * (w.id + w.write)
    return sent, recv


@dataclass
class CostReport:
    """Per-rank communication of one training epoch under a partition.

    Attributes:
        parts: P.
        batch_size: B.
        k: Neighbours per root.
        num_neg: Negatives per event.
        num_batches: Batches in the epoch.
        widths: Row widths used for the byte figures.
        events: (P,) training events processed per rank.
        vertices: (P,) vertices owned per rank.
        remote_reads: (P,) distinct remote nodes read per batch, summed over batches.
        remote_writes: (P,) distinct remote nodes written per batch, summed.
        naive_reads: (P,) remote read occurrences (one fetch per occurrence).
        naive_writes: (P,) remote write occurrences.
        served_reads: (P,) remote reads of r's vertices by other ranks.
        received_writes: (P,) remote writes to r's vertices by other ranks.
        batch_max_events: Sum over batches of the largest per-rank event count: the
            event load on the critical path when every batch waits for its slowest rank.
        batch_max_comm: Sum over batches of the largest per-rank ``remote_reads +
            remote_writes``.
        batch_max_sent: Sum over batches of the largest per-rank exchange bytes sent
            (``bytes_sent`` of that batch).
        batch_max_recv: The same for the bytes received (``bytes_recv``).
        access: The model access pattern replayed.
        batches: Per-batch counts when asked for (``comm_cost(..., per_batch=True)``),
            else None.
    """

    parts: int
    batch_size: int
    k: int
    num_neg: int
    num_batches: int
    widths: RowBytes
    events: np.ndarray
    vertices: np.ndarray
    remote_reads: np.ndarray
    remote_writes: np.ndarray
    naive_reads: np.ndarray
    naive_writes: np.ndarray
    served_reads: np.ndarray
    received_writes: np.ndarray
    batch_max_events: int = 0
    batch_max_comm: int = 0
    batch_max_sent: int = 0
    batch_max_recv: int = 0
    # Access is a frozen dataclass: one shared default instance is safe.
    access: Access = Access()  # noqa: RUF009
    batches: BatchCounts | None = None

    @property
    def comm_bytes(self) -> np.ndarray:
        """(P,) the objective: ids and rows of r's own remote reads and writes."""
        b = self.widths
        return self.remote_reads * (b.id + b.read) + self.remote_writes * (b.id + b.write)

    @property
    def naive_bytes(self) -> np.ndarray:
        """(P,) ``comm_bytes`` with one fetch per occurrence."""
        b = self.widths
        return self.naive_reads * (b.id + b.read) + self.naive_writes * (b.id + b.write)

    @property
    def bytes_sent(self) -> np.ndarray:
        """(P,) bytes rank r puts on the wire: its read ids, the rows it serves, its writes."""
        return self._wire()[0]

    @property
    def bytes_recv(self) -> np.ndarray:
        """(P,) bytes rank r takes off the wire: ids to serve, its rows, writes to it."""
        return self._wire()[1]

    def _wire(self) -> tuple[np.ndarray, np.ndarray]:
        return wire_bytes(
            self.remote_reads,
            self.remote_writes,
            self.served_reads,
            self.received_writes,
            self.widths,
        )

    def metrics(self) -> dict[str, np.ndarray]:
        """Returns every per-rank metric by name, counts then bytes."""
        out = {name: getattr(self, name) for name in COUNT_FIELDS}
        for name in ("comm_bytes", "naive_bytes", "bytes_sent", "bytes_recv"):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> dict[str, Any]:
        """Max, mean and max/mean of every metric, plus epoch-level figures.

        Returns:
            A JSON-serializable dict.
        """
        stats = {}
        for name, arr in self.metrics().items():
            mean = float(arr.mean()) if arr.size else 0.0
            mx = int(arr.max()) if arr.size else 0
            stats[name] = {
                "max": mx,
                "mean": mean,
                "imbalance": mx / mean if mean > 0 else 1.0,
                "total": int(arr.sum()),
            }
        total_events = int(self.events.sum())
        naive = int(self.naive_bytes.sum())
        sent, recv = int(self.bytes_sent.sum()), int(self.bytes_recv.sum())
        return {
            "parts": self.parts,
            "batch_size": self.batch_size,
            "k": self.k,
            "num_neg": self.num_neg,
            "num_batches": self.num_batches,
            "access": dataclasses.asdict(self.access),
            "row_bytes": dataclasses.asdict(self.widths),
            "metrics": stats,
            "batch_event_imbalance": (
                self.batch_max_events * self.parts / total_events if total_events else 1.0
            ),
            "batch_max_comm": int(self.batch_max_comm),
            # Per batch, the slowest rank's bytes over the mean rank's, summed over
            # batches: what a synchronous exchange waits for.
            "batch_sent_imbalance": self.batch_max_sent * self.parts / sent if sent else 1.0,
            "batch_recv_imbalance": self.batch_max_recv * self.parts / recv if recv else 1.0,
            "redundancy_saving": 1.0 - int(self.comm_bytes.sum()) / naive if naive else 0.0,
        }

    def to_dict(self) -> dict[str, Any]:
        """Full report (per-rank arrays and summary) as JSON-serializable data."""
        return {
            "per_rank": {name: arr.tolist() for name, arr in self.metrics().items()},
            "summary": self.summary(),
        }


def _human(x: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.4g}" if not float(x).is_integer() else str(int(x))


def format_report(report: CostReport) -> str:
    """Renders the report as a fixed-width table: one row per rank, then max/mean.

    Args:
        report: The report.

    Returns:
        The table, lines joined by newlines.
    """
    metrics = report.metrics()
    names = [*COUNT_FIELDS, "comm_bytes", "naive_bytes"]
    header = ["rank", *names]
    rows = [[str(r)] + [_human(float(metrics[n][r])) for n in names] for r in range(report.parts)]
    summ = report.summary()["metrics"]
    rows.append(["max"] + [_human(summ[n]["max"]) for n in names])
    rows.append(["mean"] + [_human(summ[n]["mean"]) for n in names])
    rows.append(["max/mean"] + [f"{summ[n]['imbalance']:.3f}" for n in names])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    s = report.summary()
    lines.append(
        f"batches {report.num_batches} of {report.batch_size}, k={report.k}, "
        f"negatives {report.num_neg}; per-batch max/mean: events "
        f"{s['batch_event_imbalance']:.3f}, bytes sent {s['batch_sent_imbalance']:.3f}, "
        f"received {s['batch_recv_imbalance']:.3f}; redundancy-free saves "
        f"{100 * s['redundancy_saving']:.1f}% of the naive bytes"
    )
    return "\n".join(lines)
