"""The min-max communication partitioner, after Sven's Re-FlexBiCut.

Objective: minimize the largest per-rank communication of a training epoch, subject
to each rank's event load staying within ``balance`` times the mean (Xia et al.,
"Redundancy-Free and Load-Balanced TGNN Training With Hierarchical Pipeline
Parallelism", TPDS 2024).

Two phases:

1. **Recursive flexible bisection.** P parts are split into floor(P/2) + ceil(P/2) by a
   METIS bisection with target load fractions in that ratio, recursively, on the
   interaction graph (vertex weights: event occurrences). The balance bound is
   *flexible*: each level may use the slack that the levels above left unused,
   ``(balance / imbalance so far) ** (1 / levels left)``, rather than a fixed share, so
   an easy early cut leaves room for a better cut deeper down while the product of the
   per-level imbalances stays within ``balance``. Two starts are bisected: edge weights
   counting the distinct batches in which a pair interacts (with redundancy-free
   fetching a partner costs one fetch per batch) and raw event counts (recent-k
   sampling follows event frequency).
2. **Min-max refinement against the exact cost.** The cost model replays an evenly
   spread sample of batches once (``SampledCost``: real negatives, real sampler);
   every proposal is then scored exactly on those batches by counting alone. Round
   after round, boundary vertices of the rank with the largest communication move to
   the neighbouring rank with less communication that they are most connected to,
   and the per-rank prices of the event assignment shift cut events from expensive
   ranks to cheap ones; each proposal is kept only if it lowers the largest per-rank
   communication with every rank's events within the cap. The loop is over rounds,
   never over vertices. The start whose refined maximum is lower wins.

Why prices matter as much as vertex moves: a large share of every rank's traffic comes
from the negatives and their neighbours, uniform draws that no ownership can make
local. That part scales with the events a rank processes, so balancing the
communication means giving cheap ranks more of the cut events (up to the cap) and
expensive ranks fewer, which is what the prices do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sven.partition.assign import affinity_table, assign_events, endpoint_preference
from sven.partition.cost import SampledCost
from sven.partition.graph import InteractionGraph, gather_rows
from sven.partition.strategies import metis_bisect

__all__ = ["MinMaxResult", "minmax_owner"]


def _bisect_recursive(
    graph: InteractionGraph,
    vertices: np.ndarray,
    first_part: int,
    parts: int,
    slack: float,
    seed: int,
    owner: np.ndarray,
) -> None:
    """Splits ``vertices`` into ``parts`` ranks starting at ``first_part`` (in place).

    Args:
        graph: The whole graph.
        vertices: (n,) int64 vertices of this branch.
        first_part: The lowest rank of this branch.
        parts: Ranks in this branch.
        slack: Imbalance still allowed below this branch (1.05 means 5%).
        seed: METIS seed for this branch.
        owner: (N,) output, written for ``vertices``.
    """
    if parts == 1 or vertices.shape[0] == 0:
        owner[vertices] = first_part
        return
    left = parts // 2
    levels = math.ceil(math.log2(parts))
    level_tol = slack ** (1.0 / levels)
    sub = graph.subgraph(vertices)
    side = metis_bisect(
        sub,
        2,
        tpwgts=[left / parts, 1.0 - left / parts],
        ufactor=max(1, math.floor((level_tol - 1.0) * 1000)),
        seed=seed,
    )
    load = np.maximum(sub.load, 1).astype(np.float64)
    total = load.sum()
    for s, (lo, n) in enumerate(((first_part, left), (first_part + left, parts - left))):
        mine = side == s
        # What this cut actually used; the rest of the slack goes to the levels below.
        used = max(load[mine].sum() / (total * n / parts), 1.0) if mine.any() else 1.0
        _bisect_recursive(
            graph, vertices[mine], lo, n, max(slack / used, 1.0), seed * 2 + 1 + s, owner
        )


@dataclass
class MinMaxResult:
    """Owners and the per-rank assignment prices that go with them.

    Attributes:
        owner: (N,) int32 owners.
        prices: (P,) float64 price of each rank in the event assignment: an event's
            preference for its source's owner a over its destination's owner b is
            shifted by ``prices[a] - prices[b]`` (see ``assign.assign_events``).
        history: Max per-rank sampled comm bytes after each accepted round, first the
            bisection's.
    """

    owner: np.ndarray
    prices: np.ndarray
    history: list[int] = field(default_factory=list)


class _Refiner:
    """Min-max refinement against the exact cost of sampled batches.

    State: owners, the (N, P) affinity table ``aff[x, r]`` (share of x's edge weight
    on r, which drives the event assignment and is updated incrementally when vertices
    move) and the assignment prices.
    """

    def __init__(
        self,
        graph: InteractionGraph,
        owner: np.ndarray,
        parts: int,
        cost: SampledCost,
        balance: float,
        seed: int,
        batch_balance: bool = False,
    ) -> None:
        self.graph = graph
        # The sampled events are whole batches indexed from the epoch start, so their
        # global indices give the batch windows of the per-batch cap.
        self.batch_size = cost.batch_size if batch_balance else None
        self.seed = seed
        self.parts = parts
        self.cost = cost
        self.balance = balance
        self.owner = owner.astype(np.int64)
        self.deg = np.maximum(graph.weighted_degree().astype(np.float64), 1.0)
        self.aff = affinity_table(graph, self.owner, parts)
        self.prices = np.zeros(parts, dtype=np.float64)
        self.cap = max(
            int(np.floor(balance * cost.events.shape[0] / parts)), -(-cost.events.shape[0] // parts)
        )

    def evaluate(self, prices: np.ndarray) -> np.ndarray | None:
        """Sampled per-rank comm bytes under the current owners and ``prices``.

        Returns:
            (P,) bytes, or None when the event cap cannot be met.
        """
        c = self.cost
        pref = endpoint_preference(self.aff, self.owner, c.src, c.dst)
        a, b = self.owner[c.src], self.owner[c.dst]
        assign = assign_events(
            c.src, c.dst, self.owner, self.parts,
            balance=self.balance, preference=pref + prices[a] - prices[b], seed=self.seed,
            event_index=c.events, batch_size=self.batch_size,
        )  # fmt: skip
        if np.bincount(assign, minlength=self.parts).max() > self.cap:
            return None
        return c.comm(self.owner, assign, self.parts)

    def move(self, vertices: np.ndarray, to: np.ndarray) -> np.ndarray:
        """Moves ``vertices`` to ranks ``to``; returns their old ranks (for undo)."""
        old = self.owner[vertices].copy()
        row, col, w = gather_rows(self.graph, vertices)
        share = (w / self.deg[col]).astype(np.float32)
        flat = self.aff.reshape(-1)
        # A neighbour x of a moved u now has u's weight on u's new rank.
        np.add.at(flat, col * self.parts + old[row], -share)
        np.add.at(flat, col * self.parts + to[row], share)
        self.owner[vertices] = to
        return old

    def propose_moves(self, comm: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Boundary vertices to move off the rank with the largest comm, and where.

        A vertex u of the max rank r qualifies when its edge weight to r is less than
        half its total (moving it shrinks r's boundary); it goes to the rank, among
        those with less comm than r, holding most of its edge weight. The ``count``
        largest boundary reductions are returned.
        """
        parts = self.parts
        r = int(np.argmax(comm))
        mine = np.flatnonzero(self.owner == r)
        row, col, w = gather_rows(self.graph, mine)
        table = np.bincount(
            row * parts + self.owner[col], weights=w, minlength=mine.shape[0] * parts
        ).reshape(mine.shape[0], parts)
        deg = table.sum(axis=1)
        gain = deg - 2.0 * table[:, r]
        # Targets: ranks below r's comm; ties in weight go to the rank with less comm.
        allowed = comm < comm[r]
        score = np.where(allowed[None, :], table, -np.inf) - 1e-9 * (comm / comm.max())[None, :]
        to = np.argmax(score, axis=1)
        ok = np.flatnonzero((gain > 0) & allowed[to])
        ok = ok[np.lexsort((mine[ok], -gain[ok]))][:count]
        return mine[ok], to[ok]


def _refine(
    graph: InteractionGraph,
    owner: np.ndarray,
    parts: int,
    cost: SampledCost,
    balance: float,
    seed: int,
    max_rounds: int,
    patience: int,
    batch_balance: bool = False,
) -> MinMaxResult:
    """Min-max refinement rounds from ``owner`` (see ``minmax_owner``)."""
    ref = _Refiner(graph, owner, parts, cost, balance, seed, batch_balance)
    comm = ref.evaluate(ref.prices)
    if comm is None:
        # The start's internal events alone exceed the cap somewhere; no assignment can
        # repair that, so keep the start as it is.
        return MinMaxResult(owner.astype(np.int32), ref.prices, [])
    history = [int(comm.max())]
    eta = 0.5
    count = max(1, int(0.01 * graph.num_nodes / parts))
    stale = 0
    for _ in range(max_rounds):
        improved = []
        moved, to = ref.propose_moves(comm, count)
        if moved.shape[0]:
            old = ref.move(moved, to)
            new = ref.evaluate(ref.prices)
            # Moves must lower the max without raising the total: a move that only
            # shifts volume onto other ranks is left to the prices, which do that
            # without enlarging the cut.
            if new is not None and new.max() < comm.max() and new.sum() <= comm.sum():
                comm = new
                count = int(count * 1.5) + 1
                improved.append(f"{moved.shape[0]} moves")
            else:
                ref.move(moved, old)
                count = max(1, count // 2)
        # Prices: a normalized subgradient step on the max.
        prices = ref.prices - eta * (comm / comm.mean() - 1.0)
        new = ref.evaluate(prices)
        if new is not None and new.max() < comm.max():
            comm, ref.prices = new, prices
            eta = min(eta * 1.5, 2.0)
            improved.append("prices")
        else:
            eta /= 2.0
        stale = 0 if improved else stale + 1
        if stale >= patience:
            break
        if improved:
            history.append(int(comm.max()))
    # The incrementally updated float32 affinities can differ from a fresh table in the
    # last bit; score the result exactly as the final assignment will see it.
    ref.aff = affinity_table(graph, ref.owner, parts)
    final = ref.evaluate(ref.prices)
    if final is not None:
        history.append(int(final.max()))
    return MinMaxResult(ref.owner.astype(np.int32), ref.prices, history)


def minmax_owner(
    graph: InteractionGraph,
    parts: int,
    cost: SampledCost,
    *,
    starts: Sequence[InteractionGraph] = (),
    balance: float = 1.05,
    seed: int = 0,
    max_rounds: int = 60,
    patience: int = 6,
    batch_balance: bool = False,
    log: Callable[[str], None] | None = None,
) -> MinMaxResult:
    """Recursive flexible bisection followed by min-max refinement.

    Each start (a recursive flexible bisection of ``graph`` and of every graph in
    ``starts``, e.g. the same graph weighted by event counts) is refined, and the one
    with the lowest sampled max comm wins. Refinement rounds make two proposals, each
    kept only if it lowers the largest per-rank comm of the sampled batches:

    - *vertex moves*: boundary vertices of the rank with the largest comm move to the
      neighbouring rank with less comm that they are most connected to
      (``_Refiner.propose_moves``), if the total does not grow;
    - *prices*: every rank's assignment price moves against its comm's deviation from
      the mean, so cut events drift from expensive ranks to cheap ones.

    Both respect the event cap through the assignment. Step sizes grow after a success
    and shrink after a failure; ``patience`` rounds without progress end the loop.

    Args:
        graph: Interaction graph with batch-distinct edge weights and vertex loads;
            it also drives the assignment preference and the vertex moves.
        parts: P.
        cost: The sampled exact cost model of the epoch.
        starts: Other graphs over the same vertices to bisect for a start.
        balance: Event cap per rank as a multiple of the mean.
        seed: METIS seed of the top-level cuts (deeper cuts derive theirs).
        max_rounds: Refinement rounds at most, per start.
        patience: Rounds without progress before stopping.
        batch_balance: Score proposals under the per-batch cap of the assignment
            (``assign_events(batch_size=cost.batch_size)``), as the final assignment
            will be made.
        log: Progress lines.

    Returns:
        Owners and assignment prices; the assignment must use ``graph``'s affinities.
    """
    say = log or (lambda _msg: None)
    best: MinMaxResult | None = None
    for i, g in enumerate((graph, *starts)):
        owner = np.zeros(graph.num_nodes, dtype=np.int64)
        _bisect_recursive(g, np.arange(g.num_nodes, dtype=np.int64), 0, parts, balance, seed, owner)
        if parts == 1:
            return MinMaxResult(owner.astype(np.int32), np.zeros(1))
        res = _refine(graph, owner, parts, cost, balance, seed, max_rounds, patience, batch_balance)
        if not res.history:
            continue
        say(
            f"minmax start {i}: sampled max comm {res.history[0]} -> {res.history[-1]} "
            f"in {len(res.history) - 2} improving rounds"
        )
        if best is None or res.history[-1] < best.history[-1]:
            best = res
    if best is None:
        # No start meets the cap: fall back to the first bisection, unrefined.
        owner = np.zeros(graph.num_nodes, dtype=np.int64)
        _bisect_recursive(graph, np.arange(graph.num_nodes), 0, parts, balance, seed, owner)
        return MinMaxResult(owner.astype(np.int32), np.zeros(parts))
    return best
