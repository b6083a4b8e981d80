"""One call from an event store to a partition and its cost report.

``partition_arrays`` works on plain arrays (what tests and benchmarks use);
``partition_store`` and ``evaluate_store`` take a ``TemporalEvents``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
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
from sven.partition.graph import InteractionGraph, interaction_graph
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
        access: The model's access pattern in the cost model; None means TGN's.
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
    tr_src, tr_dst = np.asarray(src[:stop]), np.asarray(dst[:stop])
    timings: dict[str, float] = {}
    graph = _training_graph(tr_src, tr_dst, num_nodes, batch_size, timings, say)
    cost = functools.partial(
        SampledCost, src, dst, t, num_nodes, batch_size=batch_size, stop=stop,
        max_events=sample_events, k=k, num_neg=num_neg, seed=seed, sampler=sampler, access=access,
    )  # fmt: skip
    with _phase(timings, "owner_s"):
        owner, prices = _owner(
            strategy, graph, cost, tr_src, tr_dst, parts, balance, seed, batch_balance,
            timings, say,
        )  # fmt: skip
    say(f"owner ({strategy}): {timings['owner_s']:.1f}s")
    with _phase(timings, "assign_s"):
        window = batch_size if batch_balance else None
        assign = _assign(src, dst, stop, graph, owner, prices, parts, balance, seed, window)
    stats = batch_balance_stats(
        tr_src, tr_dst, owner.astype(np.int64), assign[:stop], parts, batch_size, balance=balance
    )
    say(_balance_line(stats, timings["assign_s"]))
    return PartitionResult(owner=owner, assign=assign, timings=timings, batch_stats=stats)


def _balance_line(stats: dict[str, Any], seconds: float) -> str:
    """The progress line of the assignment phase, from ``batch_balance_stats``."""
    return (
        f"assign: {seconds:.1f}s; per-batch event max/mean "
        f"{stats['event_imbalance']:.3f}, {stats['over_cap']} of {stats['batches']} batches "
        f"over the cap ({stats['forced']} by events with both endpoints on one rank)"
    )


def _training_graph(
    tr_src: np.ndarray,
    tr_dst: np.ndarray,
    num_nodes: int,
    batch_size: int,
    timings: dict[str, float],
    say: Callable[[str], None],
) -> InteractionGraph:
    """The interaction graph of the training events, its pairs weighed by the batches of
    ``batch_size`` events they meet in (timed as ``timings["graph_s"]``)."""
    with _phase(timings, "graph_s"):
        # Batch-distinct weights: the redundancy-free cost of a partner is one fetch per
        # batch in which it is touched, not one per event.
        graph = interaction_graph(tr_src, tr_dst, num_nodes, batch_size=batch_size)
    say(f"graph: {graph.num_nodes} vertices, {graph.nnz // 2} edges ({timings['graph_s']:.1f}s)")
    return graph


@contextlib.contextmanager
def _phase(timings: dict[str, float], name: str) -> Iterator[None]:
    """Times the block: its seconds land in ``timings[name]``."""
    t0 = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - t0


def _owner(
    strategy: str,
    graph: InteractionGraph,
    cost: Callable[[], SampledCost],
    tr_src: np.ndarray,
    tr_dst: np.ndarray,
    parts: int,
    balance: float,
    seed: int,
    batch_balance: bool,
    timings: dict[str, float],
    say: Callable[[str], None],
) -> tuple[np.ndarray, np.ndarray]:
    """Owners by ``strategy``, and the per-rank prices ``minmax`` leaves (zero otherwise).

    Args:
        strategy: One of ``STRATEGIES``.
        graph: The batch-distinct interaction graph of the training events.
        cost: Samples ``minmax``'s cost model (timed as ``timings["sample_s"]``).
        tr_src: (n,) sources of the training events (``metis`` and ``minmax`` weigh by
            event counts).
        tr_dst: (n,) their destinations.
        parts: P.
        balance: Load cap as a multiple of the mean.
        seed: Seed of the randomized choices.
        batch_balance: ``minmax`` also caps each global batch's events per rank.
        timings: Seconds per phase, added to.
        say: Progress lines.

    Returns:
        ``(owner (N,), prices (P,))``.
    """
    num_nodes, prices = graph.num_nodes, np.zeros(parts)
    if strategy == "hash":
        return hash_owner(num_nodes, parts, seed), prices
    if strategy == "range":
        return range_owner(graph.load, parts), prices
    if strategy == "ldg":
        return ldg_owner(graph, parts, balance=balance, seed=seed), prices
    if strategy == "metis":
        counts = interaction_graph(tr_src, tr_dst, num_nodes)
        return metis_owner(counts, parts, balance=balance, seed=seed), prices
    t0 = time.perf_counter()
    sampled = cost()
    timings["sample_s"] = time.perf_counter() - t0
    say(f"minmax: sampled {sampled.events.shape[0]} events ({timings['sample_s']:.1f}s)")
    # Event counts as a second start: recent-k sampling follows event frequency.
    counts = interaction_graph(tr_src, tr_dst, num_nodes)
    res = minmax_owner(
        graph, parts, sampled, starts=[counts], balance=balance, seed=seed,
        batch_balance=batch_balance, log=say,
    )  # fmt: skip
    return res.owner, res.prices


def _assign(
    src: np.ndarray,
    dst: np.ndarray,
    stop: int,
    graph: InteractionGraph,
    owner: np.ndarray,
    prices: np.ndarray,
    parts: int,
    balance: float,
    seed: int,
    batch_size: int | None,
) -> np.ndarray:
    """(E,) int32 rank of every event: the training events ``[0, stop)``, then the rest,
    each range under a balance of its own.

    Args:
        src: (E,) source ids of all events.
        dst: (E,) destination ids.
        stop: Number of training events.
        graph: The batch-distinct interaction graph of the training events.
        owner: (N,) owners.
        prices: (P,) per-rank prices that tilt an event towards a rank.
        parts: P.
        balance: Event load cap per rank as a multiple of the mean.
        seed: Seed of the randomized choices.
        batch_size: Cap every window of this many events too; None caps only the range.
    """
    aff = affinity_table(graph, owner, parts)
    owner64 = owner.astype(np.int64)

    def preference(s: np.ndarray, d: np.ndarray) -> np.ndarray:
        return endpoint_preference(aff, owner64, s, d) + prices[owner64[s]] - prices[owner64[d]]

    assign = np.empty(src.shape[0], dtype=np.int32)
    for lo, hi in ((0, stop), (stop, int(src.shape[0]))):
        if hi > lo:
            assign[lo:hi] = assign_events(
                src[lo:hi], dst[lo:hi], owner64, parts, balance=balance, preference=preference,
                seed=seed, index_offset=lo, batch_size=batch_size,
            )  # fmt: skip
    return assign


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
