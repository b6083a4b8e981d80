"""What crosses ranks in the memory exchange: row packing, byte counters, capacities.

Rows travel as raw bytes (:class:`RowCodec`), so float memory and float64 timestamps
share one message without a lossy cast. :class:`CommCounter` counts what a rank sends,
on the device. :class:`Capacities` are the static split sizes of one kind of step
(:mod:`sven.engine.capacities` measures them); a batch over them stops the run
(:class:`CapacityError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sven.errors import SvenError

__all__ = ["COUNTERS", "ID_BYTES", "Capacities", "CapacityError", "CommCounter", "RowCodec"]

ID_BYTES = 8
#: The byte counters, in the order of :attr:`CommCounter.value`.
COUNTERS = ("ids", "read_rows", "write_rows", "grads", "naive")


class CommCounter:
    """Bytes this rank sent to other ranks, by kind, kept on the device.

    ``naive`` counts what a scheme without de-duplication would send: one request and one
    row per occurrence of a remote node in the batch, one row per remote write.

    Args:
        device: Where the counters live (the step adds to them without a host sync).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.value = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)

    def add(self, **counts: torch.Tensor | int) -> None:
        """Adds byte counts by name (0-d tensors or ints)."""
        for name, n in counts.items():
            self.value[COUNTERS.index(name)] += n

    def reset(self) -> None:
        """Zeroes every counter."""
        self.value.zero_()

    def read(self) -> dict[str, int]:
        """The counters on the host (one device read)."""
        return dict(zip(COUNTERS, self.value.tolist()))

    def __getattr__(self, name: str) -> int:
        if name in COUNTERS:
            return int(self.value[COUNTERS.index(name)])
        raise AttributeError(name)


@dataclass
class Capacities:
    """The static sizes of one kind of step (training, or evaluation) on P ranks.

    Attributes:
        events: Event slots of a rank's share of one global batch.
        fetch: (P, P) most node rows rank r requests from rank q in one batch (0 on
            the diagonal: local rows are read in place).
        push: (P, P) most written nodes rank r sends to rank q in one batch.
    """

    events: int
    fetch: list[list[int]]
    push: list[list[int]]

    def grown(self, slack: float, extra: int = 8) -> Capacities:
        """Room for later epochs, whose negatives and uniform draws differ: each
        off-diagonal capacity times ``slack`` plus ``extra`` rows."""

        def grow(m: list[list[int]]) -> list[list[int]]:
            return [
                [0 if r == q else math.ceil(c * slack) + extra for q, c in enumerate(row)]
                for r, row in enumerate(m)
            ]

        return Capacities(self.events, grow(self.fetch), grow(self.push))


class RowCodec:
    """Packs per-node tensors of mixed dtypes into uint8 rows and back.

    Rows travel as raw bytes so that float memory and float64 timestamps share one
    message without a lossy cast.
    """

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.specs = specs
        self.numels = [math.prod(shape) for shape, _ in specs]
        self.sizes = [
            n * torch.empty((), dtype=dt).element_size() for n, (_, dt) in zip(self.numels, specs)
        ]
        self.row_bytes = sum(self.sizes)

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """(n, ...) tensors -> (n, row_bytes) uint8."""
        n = tensors[0].shape[0]
        parts = []
        for t, numel in zip(tensors, self.numels):
            flat = t.contiguous().reshape(n, numel)
            # Bool has no byte view guarantee across versions; convert explicitly.
            parts.append(flat.to(torch.uint8) if t.dtype == torch.bool else flat.view(torch.uint8))
        return torch.cat(parts, dim=1)

    def unpack(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """(n, row_bytes) uint8 -> the tensors, in spec order."""
        n = rows.shape[0]
        out, off = [], 0
        for (shape, dt), size in zip(self.specs, self.sizes):
            # Contiguous columns: a column slice keeps the row stride, which a dtype view
            # rejects.
            chunk = rows[:, off : off + size].contiguous().reshape(-1)
            off += size
            t = chunk.to(torch.bool) if dt == torch.bool else chunk.view(dt)
            out.append(t.reshape(n, *shape))
        return out


class CapacityError(SvenError):
    """A batch needed more rows than a fixed capacity of the exchange holds (a bigger
    ``dist.capacity_slack`` fixes it, so it is reported like a configuration error)."""

    exit_code = 2
