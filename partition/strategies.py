"""Vertex partitioners: owner(v) for every vertex, one function per strategy.

Each returns an (N,) int32 array with values in [0, parts). All are deterministic
functions of their inputs and ``seed``. The min-max strategy lives in ``minmax.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from sven.errors import ConfigError
from sven.partition.graph import InteractionGraph, gather_rows
from sven.pipeline.negatives import hash_counter

__all__ = ["hash_owner", "ldg_owner", "metis_bisect", "metis_owner", "range_owner"]


def hash_owner(num_nodes: int, parts: int, seed: int = 0) -> np.ndarray:
    """Assigns each vertex to a pseudo-random rank, a hash of (seed, vertex id).

    Args:
        num_nodes: N.
        parts: P.
        seed: Hash seed.

    Returns:
        (N,) int32 owners.
    """
    # The negatives' counter hash, on a stream of its own (epoch -1) so that owners are
    # uncorrelated with any epoch's negatives.
    h = hash_counter(seed, -1, torch.arange(num_nodes, dtype=torch.int64))
    return (h % parts).numpy().astype(np.int32)


def range_owner(load: np.ndarray, parts: int) -> np.ndarray:
    """Cuts the vertex id range into ``parts`` contiguous runs of about equal load.

    Compact ids follow first appearance, so a run is roughly a period of the stream's
    history; balancing by load rather than by vertex count keeps the event load even.

    Args:
        load: (N,) vertex loads (endpoint occurrences).
        parts: P.

    Returns:
        (N,) int32 owners, non-decreasing in the vertex id.
    """
    # Place each vertex by the midpoint of its load interval, so that a heavy vertex
    # lands in the run that holds most of it.
    csum = np.cumsum(load, dtype=np.float64)
    total = csum[-1] if csum.shape[0] else 0.0
    if total <= 0:
        return (np.arange(load.shape[0]) * parts // max(load.shape[0], 1)).astype(np.int32)
    mid = csum - 0.5 * load
    return np.minimum((mid * parts / total).astype(np.int64), parts - 1).astype(np.int32)


def ldg_owner(
    graph: InteractionGraph,
    parts: int,
    *,
    balance: float = 1.05,
    seed: int = 0,
    chunk: int | None = None,
) -> np.ndarray:
    """Linear Deterministic Greedy streaming partitioning (Stanton & Kliot, KDD 2012).

    Vertices arrive in id order (compact ids follow first appearance, so this is the
    order of the stream). Each goes to ``argmax_r w(v, V_r) * (1 - L_r / C)``: its
    edge weight to the vertices already on r, discounted by how full r is, where L_r
    is r's load and C = balance * total / P. To stay vectorized, vertices are placed
    in chunks of about N / 1024 that all see the state at the start of their chunk;
    within a chunk, vertices that would overflow a rank go to the emptiest ones.

    Args:
        graph: Interaction graph with vertex loads.
        parts: P.
        balance: Load cap as a multiple of the mean.
        seed: Breaks score ties (vertices with no placed neighbour) pseudo-randomly.
        chunk: Vertices per step; None picks max(64, N // 1024).

    Returns:
        (N,) int32 owners.
    """
    n = graph.num_nodes
    owner = np.full(n, -1, dtype=np.int64)
    load = graph.load.astype(np.float64)
    cap = balance * max(load.sum(), 1.0) / parts
    part_load = np.zeros(parts, dtype=np.float64)
    tie = hash_owner(n, 1 << 20, seed).astype(np.float64) / (1 << 20)
    step = chunk or max(64, n // 1024)
    for lo in range(0, n, step):
        vs = np.arange(lo, min(lo + step, n), dtype=np.int64)
        row, col, w = gather_rows(graph, vs)
        placed = owner[col] >= 0
        aff = np.bincount(
            row[placed] * parts + owner[col[placed]],
            weights=w[placed],
            minlength=vs.shape[0] * parts,
        ).reshape(vs.shape[0], parts)
        room = np.clip(1.0 - part_load / cap, 0.0, None)
        # (1 + aff) keeps the load term for vertices with no placed neighbour, so those
        # go to the emptiest rank; the tiny tie term spreads exact ties by seed.
        score = (1.0 + aff) * room[None, :] + 1e-9 * ((tie[vs, None] + np.arange(parts)) % 1.0)
        choice = np.argmax(score, axis=1)
        choice = _spill(choice, load[vs], part_load, cap)
        owner[vs] = choice
        part_load += np.bincount(choice, weights=load[vs], minlength=parts)
    return owner.astype(np.int32)


def _spill(choice: np.ndarray, load: np.ndarray, part_load: np.ndarray, cap: float) -> np.ndarray:
    """Sends the vertices that would push their chosen rank over ``cap`` to the emptiest.

    Args:
        choice: (n,) int64 chosen rank per vertex, in placement order.
        load: (n,) float64 vertex loads.
        part_load: (P,) current rank loads (not modified).
        cap: Load cap per rank.

    Returns:
        (n,) int64 ranks.
    """
    parts = part_load.shape[0]
    order = np.argsort(choice, kind="stable")
    sorted_choice = choice[order]
    csum = np.cumsum(load[order])
    group_start = np.searchsorted(sorted_choice, np.arange(parts))
    before = np.concatenate(([0.0], csum))[group_start]
    within = csum - before[sorted_choice]
    over = np.zeros(choice.shape[0], dtype=bool)
    over[order] = part_load[sorted_choice] + within > cap
    if not over.any():
        return choice
    out = choice.copy()
    idx = np.flatnonzero(over)
    # Round-robin over ranks from emptiest to fullest (counting what stays placed).
    staying = part_load + np.bincount(choice[~over], weights=load[~over], minlength=parts)
    out[idx] = np.argsort(staying, kind="stable")[np.arange(idx.shape[0]) % parts]
    return out


def metis_bisect(
    graph: InteractionGraph,
    parts: int,
    *,
    tpwgts: list[float] | None = None,
    ufactor: int = 30,
    seed: int = 0,
) -> np.ndarray:
    """Calls METIS on the graph with vertex weights = loads and edge weights.

    Args:
        graph: The graph.
        parts: Number of parts.
        tpwgts: Target load fraction per part (sums to 1); None means equal.
        ufactor: METIS imbalance tolerance in thousandths (30 means 1.03).
        seed: METIS random seed.

    Returns:
        (N,) int64 part per vertex.
    """
    n = graph.num_nodes
    if parts == 1 or n == 0:
        return np.zeros(n, dtype=np.int64)
    if graph.nnz == 0:
        # METIS needs edges; without any, balancing load is all there is to do.
        return range_owner(graph.load, parts).astype(np.int64)
    # METIS rejects zero total weight in a part target and needs positive vertex
    # weights to balance by; vertices without training events weigh 1 so that they
    # are spread out too.
    vweights = np.maximum(graph.load, 1).astype(np.int64)
    try:
        # Imported here: a missing METIS must only break this strategy, not `sven`.
        import pymetis
    except ImportError as exc:
        raise ConfigError(
            f"strategy metis needs pymetis, which does not import ({exc}); "
            "pip install pymetis, or use another --strategy"
        ) from None
    opts = pymetis.Options(seed=int(seed) & 0x7FFFFFFF, ufactor=int(ufactor))
    res = pymetis.part_graph(
        parts,
        pymetis.CSRAdjacency(graph.indptr.astype(np.int64), graph.indices.astype(np.int64)),
        vweights=vweights,
        eweights=graph.weights.astype(np.int64),
        tpwgts=tpwgts,
        options=opts,
    )
    return np.asarray(res.vertex_part, dtype=np.int64)


def metis_owner(
    graph: InteractionGraph, parts: int, *, balance: float = 1.05, seed: int = 0
) -> np.ndarray:
    """METIS k-way on the interaction graph weighted by event counts.

    Args:
        graph: Interaction graph; edge weights are event counts, vertex weights loads.
        parts: P.
        balance: Load cap as a multiple of the mean (METIS ``ufactor``).
        seed: METIS seed.

    Returns:
        (N,) int32 owners.
    """
    ufactor = max(1, round((balance - 1.0) * 1000))
    return metis_bisect(graph, parts, ufactor=ufactor, seed=seed).astype(np.int32)
