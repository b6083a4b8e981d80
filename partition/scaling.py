"""A scaling model: events/s of P synchronous ranks from the exact per-batch bytes.

The cost model (``comm_cost(..., per_batch=True)``) gives, for every global batch b
and rank r, the events r processes and the distinct remote rows it reads and writes,
and the rows it serves and receives as an owner. This module turns those counts into
a step time with a handful of measured or assumed parameters (``Machine``):

- compute: ``compute_ms + compute_us_per_event * events[b, r]`` (affine, fitted from
  one-rank runs), multiplied by ``max(1, P / concurrent_ranks)`` when fewer devices
  (CPU cores) than ranks run at once;
- communication of rank r, one term per collective phase of the runtime's exchange
  (``pipeline/exchange.py``: fetch ids, fetch rows, write-back ids, write-back
  rows; each an ``all_to_all`` of the split sizes then one of the payload, so
  ``collectives_per_phase`` = 2 latencies) plus the gradient all-reduce (ring:
  ``2 (P - 1)`` latencies and ``2 (P - 1) / P`` of the gradient bytes). A phase moves
  ``max(sent, received)`` bytes of r; the share ``(P - R) / (P - 1)`` of them goes to
  ranks on other nodes (R ranks per node, peers assumed evenly spread), over the
  inter-node link, the rest over the intra-node link, the two links in parallel;
- synchronous step: ``max_r (compute_r + comm_r)`` (every batch waits for its slowest
  rank);
- with the pipeline: ``max_r (compute_r + comm_r - min(hidden * comm_r, compute_r))``,
  i.e. at most the share ``hidden`` of the communication overlaps compute. ``hidden`` is
  a parameter (default 0.8, the issue's target), not a measurement.

events/s = events of the epoch / sum over batches of the step time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from sven.partition.report import BatchCounts, RowBytes, wire_bytes

__all__ = [
    "Link",
    "Machine",
    "Prediction",
    "comm_seconds",
    "exchange_bytes",
    "fit_compute",
    "machine_dict",
    "simulate",
]


@dataclass(frozen=True)
class Link:
    """One kind of link as one rank sees it.

    Attributes:
        bandwidth_gbs: Bytes per second per rank and direction, in GB/s (10^9).
        latency_us: Fixed cost of one collective (or one ring step), microseconds.
    """

    bandwidth_gbs: float
    latency_us: float

    def seconds(self, nbytes: np.ndarray | float) -> np.ndarray | float:
        """Transfer time of ``nbytes`` at this bandwidth, no latency."""
        return np.asarray(nbytes, dtype=np.float64) / (self.bandwidth_gbs * 1e9)


@dataclass(frozen=True)
class Machine:
    """What the model needs besides the bytes.

    Attributes:
        compute_ms: Fixed compute per step and rank (a), milliseconds.
        compute_us_per_event: Compute per event of the rank's share (b), microseconds.
        intra: Link between ranks of one node (NVLink, shared memory).
        inter: Link between nodes (InfiniBand).
        ranks_per_node: R; with P <= R every rank is on one node.
        grad_bytes: Bytes of the gradient buffer all-reduced each step.
        hidden: Share of the communication the pipeline can overlap with compute
            (a parameter; 0.8 is the target, not a measured value).
        concurrent_ranks: Ranks that compute at the same time (CPU cores for gloo
            ranks on one machine); None means every rank has its own device.
        collectives_per_phase: Collectives per exchange phase (split sizes + payload).
    """

    compute_ms: float
    compute_us_per_event: float
    intra: Link
    inter: Link
    ranks_per_node: int = 8
    grad_bytes: int = 0
    hidden: float = 0.8
    concurrent_ranks: int | None = None
    collectives_per_phase: int = 2

    def __post_init__(self) -> None:
        if not 0.0 <= self.hidden <= 1.0:
            raise ValueError(f"hidden must be in [0, 1], got {self.hidden}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")


@dataclass
class Prediction:
    """The model's figures for one partition.

    Attributes:
        parts: P.
        events: Events of the epoch.
        num_batches: Global batches.
        step_s: (nb,) synchronous step time per batch, seconds.
        step_pipelined_s: (nb,) step time with the pipeline.
        compute_s: (nb,) compute of the slowest rank (largest compute) per batch.
        comm_s: (nb,) largest per-rank communication per batch.
        batch_event_imbalance: Sum over batches of the largest rank's events over
            their mean (events on the critical path / events / P).
        batch_comm_imbalance: The same for ``max(sent, received)`` bytes of the
            exchange (gradients excluded).
        batch_sent_imbalance: The same for the exchange bytes a rank sends.
        batch_recv_imbalance: The same for the exchange bytes a rank receives.
    """

    parts: int
    events: int
    num_batches: int
    step_s: np.ndarray
    step_pipelined_s: np.ndarray
    compute_s: np.ndarray
    comm_s: np.ndarray
    batch_event_imbalance: float
    batch_comm_imbalance: float
    batch_sent_imbalance: float = 1.0
    batch_recv_imbalance: float = 1.0

    @property
    def events_per_s(self) -> float:
        """Synchronous events/s."""
        return self.events / float(self.step_s.sum())

    @property
    def events_per_s_pipelined(self) -> float:
        """events/s with the pipeline."""
        return self.events / float(self.step_pipelined_s.sum())

    def summary(self) -> dict[str, Any]:
        """JSON-serializable figures (epoch means of the per-batch times, in ms)."""
        nb = max(self.num_batches, 1)
        return {
            "parts": self.parts,
            "events": self.events,
            "num_batches": self.num_batches,
            "events_per_s": self.events_per_s,
            "events_per_s_pipelined": self.events_per_s_pipelined,
            "step_ms": 1e3 * float(self.step_s.sum()) / nb,
            "step_pipelined_ms": 1e3 * float(self.step_pipelined_s.sum()) / nb,
            "compute_ms": 1e3 * float(self.compute_s.sum()) / nb,
            "comm_ms": 1e3 * float(self.comm_s.sum()) / nb,
            "batch_event_imbalance": self.batch_event_imbalance,
            "batch_comm_imbalance": self.batch_comm_imbalance,
            "batch_sent_imbalance": self.batch_sent_imbalance,
            "batch_recv_imbalance": self.batch_recv_imbalance,
        }


def _phase_seconds(nbytes: np.ndarray, machine: Machine, parts: int) -> np.ndarray:
    """Transfer time of per-rank bytes split between the intra- and inter-node links."""
    inter_share = max(0, parts - machine.ranks_per_node) / max(parts - 1, 1)
    return np.maximum(
        machine.intra.seconds(nbytes * (1.0 - inter_share)),
        machine.inter.seconds(nbytes * inter_share),
    )


def comm_seconds(
    counts: BatchCounts, widths: RowBytes, machine: Machine
) -> tuple[np.ndarray, np.ndarray]:
    """Per-batch, per-rank communication time and exchanged bytes.

    Args:
        counts: Per-batch counts, (nb, P) arrays.
        widths: Row widths.
        machine: Link parameters and gradient bytes.

    Returns:
        ``(seconds (nb, P), bytes (nb, P))``: the time of the four exchange phases and
        the gradient all-reduce, and ``sum over phases of max(sent, received)`` bytes.
    """
    parts = counts.events.shape[1]
    shape = counts.events.shape
    if parts == 1:
        return np.zeros(shape), np.zeros(shape)
    c = counts
    # (sent, received) of each phase, as the runtime moves them.
    phases = (
        (c.remote_reads * widths.id, c.served_reads * widths.id),
        (c.served_reads * widths.read, c.remote_reads * widths.read),
        (c.remote_writes * widths.id, c.received_writes * widths.id),
        (c.remote_writes * widths.write, c.received_writes * widths.write),
    )
    multi_node = parts > machine.ranks_per_node
    link = machine.inter if multi_node else machine.intra
    latency = link.latency_us * 1e-6
    seconds = np.zeros(shape)
    moved = np.zeros(shape)
    for sent, recv in phases:
        nbytes = np.maximum(sent, recv).astype(np.float64)
        moved += nbytes
        seconds += machine.collectives_per_phase * latency + _phase_seconds(nbytes, machine, parts)
    # Ring all-reduce: 2 (P - 1) steps, each a 1/P chunk; across nodes the slowest
    # link carries every step.
    ring = 2 * (parts - 1)
    seconds += ring * latency + link.seconds(ring / parts * machine.grad_bytes)
    return seconds, moved


def simulate(counts: BatchCounts, widths: RowBytes, machine: Machine) -> Prediction:
    """Predicts the step times of one partition.

    Args:
        counts: Per-batch, per-rank counts of the epoch (``CostReport.batches``).
        widths: Row widths of the exchange.
        machine: Compute and link parameters.

    Returns:
        The prediction.
    """
    nb, parts = counts.events.shape
    events = counts.events.astype(np.float64)
    slow = 1.0
    if machine.concurrent_ranks is not None:
        slow = max(1.0, parts / machine.concurrent_ranks)
    # A rank with no event in a batch still takes part in the step (it waits in the
    # collectives), but does no compute.
    compute = np.where(
        events > 0,
        (machine.compute_ms * 1e-3 + machine.compute_us_per_event * 1e-6 * events) * slow,
        0.0,
    )
    comm, moved = comm_seconds(counts, widths, machine)
    step = (compute + comm).max(axis=1)
    piped = (compute + comm - np.minimum(machine.hidden * comm, compute)).max(axis=1)
    total = events.sum()
    ev_max = counts.events.max(axis=1).sum() if nb else 0
    sent, recv = exchange_bytes(counts, widths)
    return Prediction(
        parts=parts,
        events=int(total),
        num_batches=nb,
        step_s=step,
        step_pipelined_s=piped,
        compute_s=compute.max(axis=1),
        comm_s=comm.max(axis=1),
        batch_event_imbalance=float(ev_max * parts / total) if total else 1.0,
        batch_comm_imbalance=_critical_over_mean(moved),
        batch_sent_imbalance=_critical_over_mean(sent),
        batch_recv_imbalance=_critical_over_mean(recv),
    )


def _critical_over_mean(x: np.ndarray) -> float:
    """Sum over batches of the largest rank's value over the sum of the rank means."""
    mean = float(x.mean(axis=1).sum()) if x.size else 0.0
    return float(x.max(axis=1).sum()) / mean if mean > 0 else 1.0


def exchange_bytes(counts: BatchCounts, widths: RowBytes) -> tuple[np.ndarray, np.ndarray]:
    """(nb, P) bytes each rank sends and receives in the exchange (ids and rows).

    The per-batch form of ``CostReport.bytes_sent`` and ``bytes_recv``.
    """
    c = counts
    return wire_bytes(c.remote_reads, c.remote_writes, c.served_reads, c.received_writes, widths)


def fit_compute(batch_sizes: list[int], step_ms: list[float]) -> tuple[float, float]:
    """Least-squares ``step_ms = a + b * events`` from one-rank runs.

    Args:
        batch_sizes: Events per step of each run.
        step_ms: Measured milliseconds per step (1000 * batch / events per second).

    Returns:
        ``(a ms, b us per event)``; with one run, a is the whole step and b is 0.
    """
    x = np.asarray(batch_sizes, dtype=np.float64)
    y = np.asarray(step_ms, dtype=np.float64)
    if x.size == 1 or np.ptp(x) == 0:
        return float(y.mean()), 0.0
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b * 1e3)


def machine_dict(machine: Machine) -> dict[str, Any]:
    """The parameters as JSON-serializable data."""
    return dataclasses.asdict(machine)
