"""One call from an event store to a partition and its cost report.

``partition_arrays`` works on plain arrays (what tests and benchmarks use);
``partition_store`` and ``evaluate_store`` take a ``TemporalEvents``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from sven.errors import ConfigError
from sven.partition import STRATEGIES
from sven.partition.access import Access, NeighbourFn
from sven.partition.assign import (
    affinity_table,
    assign_events,
    batch_balance_stats,
    endpoint_preference,
)
from sven.partition.cost import SampledCost, comm_cost
from sven.partition.graph import interaction_graph
from sven.partition.minmax import minmax_owner
from sven.partition.report import CostReport, RowBytes
from sven.partition.store import Partition
from sven.partition.strategies import hash_owner, ldg_owner, metis_owner, range_owner

__all__ = [
    "STRATEGIES",
    "PartitionResult",
    "evaluate_store",
    "partition_arrays",
    "partition_store",
    "store_info",
]


class EventsLike(Protocol):
    """What is used of ``sven.datasets.store.TemporalEvents``."""

    src: np.ndarray
    dst: np.ndarray
    t: np.ndarray
    num_nodes: int
    num_events: int
    meta: dict[str, Any]

    def split_range(self, name: str) -> tuple[int, int]: ...


@dataclass
class PartitionResult:
    """Owners, event assignment and what it took to compute them.

    Attributes:
        owner: (N,) int32 owner per vertex.
        assign: (E,) int32 rank per event.
        timings: Seconds per phase (graph, owner, assign).
        batch_stats: How the training events' batch windows meet the per-batch cap
            (``assign.batch_balance_stats``), whether or not it was applied.
    """

    owner: np.ndarray
    assign: np.ndarray
    timings: dict[str, float] = field(default_factory=dict)
    batch_stats: dict[str, Any] = field(default_factory=dict)


def _check(parts: int, strategy: str, batch_size: int, balance: float) -> None:
    """Rejects bad settings with a ConfigError."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if parts < 1:
        raise ConfigError(f"--parts must be >= 1, got {parts}")
    if batch_size < 1:
        raise ConfigError(f"--batch must be >= 1, got {batch_size}")
    if not balance >= 1.0:
        raise ConfigError(f"--balance must be >= 1.0, got {balance}")


def partition_arrays(
    src: np.ndarray,
    dst: np.ndarray,
    t: np.ndarray,
    num_nodes: int,
    parts: int,
    strategy: str,
    *,
    train_stop: int | None = None,
    batch_size: int = 600,
    balance: float = 1.05,
    seed: int = 0,
    k: int = 10,
    num_neg: int = 1,
    sampler: NeighbourFn | None = None,
    access: Access | None = None,
    sample_events: int = 1 << 19,
    batch_balance: bool = True,
    log: Callable[[str], None] | None = None,
) -> PartitionResult:
    """Computes owners from the training events and assigns every event to a rank.

    The training events ``[0, train_stop)`` define the objective: the graph, the
    vertex loads, the balance and, for ``minmax``, the sampled exact cost. Events
    after them (validation and test) are assigned by the same rule with a balance of
    their own.

    Args:
        src: (E,) source ids of all events.
        dst: (E,) destination ids.
        t: (E,) timestamps (``minmax`` replays sampled batches).
        num_nodes: N.
        parts: P.
        strategy: One of ``STRATEGIES``.
        train_stop: Number of training events; None means all.
        batch_size: B of the cost model (``minmax`` weighs pairs by distinct batches).
        balance: Event load cap per rank as a multiple of the mean.
        seed: Seed of every randomized choice and of the negatives.
        k: Neighbours per root in the cost model.
        num_neg: Negatives per event in the cost model.
        sampler: Neighbour function to reuse (see ``cost.recent_sampler``); None
            builds one when ``minmax`` needs it.
        access: The model's access pattern in the cost model (``Access.of(name)``);
            None means TGN's.
        sample_events: Training events (whole batches) ``minmax`` replays per round.
        batch_balance: Also cap each global batch's events per rank (windows of
            ``batch_size`` events from the start of the training events, and from
            ``train_stop`` for the rest), moving cut events within their batch
            (``assign.assign_events``); False caps only the whole split.
        log: Called with a short line after each phase.

    Returns:
        Owners, assignment, timings and the per-batch statistics of the training events.

    Raises:
        ConfigError: On an unknown strategy or out-of-range settings.
    """
    _check(parts, strategy, batch_size, balance)
    say = log or (lambda _msg: None)
    stop = int(src.shape[0]) if train_stop is None else int(train_stop)
    tr_src = np.asarray(src[:stop])
    tr_dst = np.asarray(dst[:stop])
    timings: dict[str, float] = {}
    prices = np.zeros(parts)

    t0 = time.perf_counter()
    # Batch-distinct weights: the redundancy-free cost of a partner is one fetch per
    # batch in which it is touched, not one per event.
    graph = interaction_graph(tr_src, tr_dst, num_nodes, batch_size=batch_size)
    timings["graph_s"] = time.perf_counter() - t0
    say(f"graph: {graph.num_nodes} vertices, {graph.nnz // 2} edges ({timings['graph_s']:.1f}s)")

    t0 = time.perf_counter()
    if strategy == "hash":
        owner = hash_owner(num_nodes, parts, seed)
    elif strategy == "range":
        owner = range_owner(graph.load, parts)
    elif strategy == "ldg":
        owner = ldg_owner(graph, parts, balance=balance, seed=seed)
    elif strategy == "metis":
        counts = interaction_graph(tr_src, tr_dst, num_nodes)
        owner = metis_owner(counts, parts, balance=balance, seed=seed)
        del counts
    else:
        cost = SampledCost(
            src, dst, t, num_nodes,
            batch_size=batch_size, stop=stop, max_events=sample_events, k=k, num_neg=num_neg,
            seed=seed, sampler=sampler, access=access,
        )  # fmt: skip
        timings["sample_s"] = time.perf_counter() - t0
        say(f"minmax: sampled {cost.events.shape[0]} events ({timings['sample_s']:.1f}s)")
        # Event counts as a second start: recent-k sampling follows event frequency.
        counts = interaction_graph(tr_src, tr_dst, num_nodes)
        res = minmax_owner(
            graph, parts, cost, starts=[counts], balance=balance, seed=seed,
            batch_balance=batch_balance, log=say,
        )  # fmt: skip
        del counts
        owner, prices = res.owner, res.prices
        del cost
    timings["owner_s"] = time.perf_counter() - t0
    say(f"owner ({strategy}): {timings['owner_s']:.1f}s")

    t0 = time.perf_counter()
    aff = affinity_table(graph, owner, parts)
    owner64 = owner.astype(np.int64)

    def preference(s: np.ndarray, d: np.ndarray) -> np.ndarray:
        return endpoint_preference(aff, owner64, s, d) + prices[owner64[s]] - prices[owner64[d]]

    assign = np.empty(src.shape[0], dtype=np.int32)
    for lo, hi in ((0, stop), (stop, int(src.shape[0]))):
        if hi > lo:
            assign[lo:hi] = assign_events(
                src[lo:hi], dst[lo:hi], owner64, parts, balance=balance, preference=preference,
                seed=seed, index_offset=lo, batch_size=batch_size if batch_balance else None,
            )  # fmt: skip
    timings["assign_s"] = time.perf_counter() - t0
    stats = batch_balance_stats(
        src[:stop], dst[:stop], owner64, assign[:stop], parts, batch_size, balance=balance
    )
    say(
        f"assign: {timings['assign_s']:.1f}s; per-batch event max/mean "
        f"{stats['event_imbalance']:.3f}, {stats['over_cap']} of {stats['batches']} batches "
        f"over the cap ({stats['forced']} by events with both endpoints on one rank)"
    )
    return PartitionResult(owner=owner, assign=assign, timings=timings, batch_stats=stats)


def store_info(events: EventsLike) -> dict[str, Any]:
    """The identity of an event store, recorded in a partition's meta.json: its
    fingerprint (:func:`sven.datasets.identity.fingerprint`), counts and the checksums
    of the columns a partition depends on."""
    from sven.datasets.identity import fingerprint

    meta = dict(getattr(events, "meta", {}) or {})
    checksums = meta.get("checksums", {})
    info = {
        "name": meta.get("name"),
        "num_events": int(events.num_events),
        "num_nodes": int(events.num_nodes),
        "checksums": {c: checksums[c] for c in ("src", "dst", "t") if c in checksums},
    }
    if checksums:
        info["fingerprint"] = fingerprint(meta)
    return info


def partition_store(
    events: EventsLike, parts: int, strategy: str, **options: Any
) -> PartitionResult:
    """``partition_arrays`` over a store's events, training split as the objective.

    Args:
        events: The event store.
        parts: P.
        strategy: One of ``STRATEGIES``.
        **options: ``partition_arrays``'s keyword arguments (``batch_size``,
            ``balance``, ``seed``, ``k``, ``num_neg``, ``sampler``, ``access``,
            ``batch_balance``, ``log``...) but ``train_stop``: the store's training
            split is the objective.

    Returns:
        Owners, assignment and timings.
    """
    _, train_stop = events.split_range("train")
    return partition_arrays(
        events.src, events.dst, events.t, events.num_nodes, parts, strategy,
        train_stop=train_stop, **options,
    )  # fmt: skip


def evaluate_store(
    events: EventsLike,
    partition: Partition | PartitionResult,
    *,
    parts: int,
    batch_size: int = 600,
    k: int = 10,
    num_neg: int = 1,
    seed: int = 0,
    widths: RowBytes | None = None,
    access: Access | None = None,
    sampler: NeighbourFn | None = None,
    per_batch: bool = False,
) -> CostReport:
    """The cost report of a partition over the store's training epoch.

    Args:
        events: The event store.
        partition: Owners and assignment.
        parts: P.
        batch_size: B.
        k: Neighbours per root.
        num_neg: Negatives per event.
        seed: Seed of the negatives (epoch 0).
        widths: Row widths; None means ``row_bytes()``.
        access: The model's access pattern; None means TGN's.
        sampler: Neighbour function to reuse; None builds ``recent_sampler``.
        per_batch: Also keep the per-batch, per-rank counts (``report.batches``).

    Returns:
        The report.
    """
    start, stop = events.split_range("train")
    return comm_cost(
        events.src,
        events.dst,
        events.t,
        np.asarray(partition.owner),
        partition.assign,
        batch_size=batch_size,
        k=k,
        num_neg=num_neg,
        seed=seed,
        start=start,
        stop=stop,
        parts=parts,
        widths=widths,
        access=access,
        sampler=sampler,
        per_batch=per_batch,
    )
