"""The static interaction graph that partitioners optimize over.

Every strategy except ``hash`` and ``range`` looks at the same object: the undirected
graph of the training events, with self-loops dropped, stored as a symmetric CSR. Edge
weights are either raw event counts (what METIS is given) or the number of distinct
batches in which the pair interacts (what ``minmax`` is given: with redundancy-free
fetching, a pair that interacts ten times inside one batch costs one fetch, not ten).
Vertex loads are endpoint occurrences in the training events, the proxy for event load:
an event is processed on the owner of one of its endpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "InteractionGraph",
    "gather_rows",
    "interaction_graph",
    "unique_counts",
    "unique_sorted",
    "vertex_loads",
]


@dataclass(frozen=True)
class InteractionGraph:
    """A symmetric weighted CSR over N vertices, without self-loops.

    Attributes:
        indptr: (N + 1,) int64 row offsets.
        indices: (nnz,) int64 neighbour of each entry; each undirected edge appears
            once in each endpoint's row.
        weights: (nnz,) int64 positive edge weights, equal in both directions.
        load: (N,) int64 vertex load: endpoint occurrences in the training events (a
            self-loop counts twice).
    """

    indptr: np.ndarray
    indices: np.ndarray
    weights: np.ndarray
    load: np.ndarray

    @property
    def num_nodes(self) -> int:
        """N."""
        return int(self.indptr.shape[0] - 1)

    @property
    def nnz(self) -> int:
        """Stored entries, twice the number of undirected edges."""
        return int(self.indices.shape[0])

    def rows(self) -> np.ndarray:
        """Returns the (nnz,) int64 row (source vertex) of every entry."""
        return np.repeat(np.arange(self.num_nodes, dtype=np.int64), np.diff(self.indptr))

    def weighted_degree(self) -> np.ndarray:
        """Returns the (N,) int64 sum of edge weights per vertex."""
        csum = np.concatenate(([0], np.cumsum(self.weights, dtype=np.int64)))
        return csum[self.indptr[1:]] - csum[self.indptr[:-1]]

    def subgraph(self, vertices: np.ndarray) -> InteractionGraph:
        """Returns the graph induced by ``vertices``, relabelled 0..len(vertices)-1.

        Args:
            vertices: (n,) int64 distinct vertex ids; their order defines the new ids.
        """
        local = np.full(self.num_nodes, -1, dtype=np.int64)
        local[vertices] = np.arange(vertices.shape[0], dtype=np.int64)
        row, col, w = gather_rows(self, vertices)
        keep = local[col] >= 0
        counts = np.bincount(row[keep], minlength=vertices.shape[0])
        indptr = np.zeros(vertices.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        # gather_rows returns entries grouped by local row in order, so the kept
        # entries are already in CSR order.
        return InteractionGraph(indptr, local[col[keep]], w[keep], self.load[vertices])


def gather_rows(
    graph: InteractionGraph, vertices: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenates the CSR rows of ``vertices`` without a per-vertex loop.

    Args:
        graph: The graph.
        vertices: (n,) int64 vertex ids.

    Returns:
        ``(row, col, w)``: (m,) int64 position in ``vertices`` of each entry's row, its
        neighbour and its weight, grouped by row in the order of ``vertices``.
    """
    starts = graph.indptr[vertices]
    lengths = graph.indptr[vertices + 1] - starts
    total = int(lengths.sum())
    row = np.repeat(np.arange(vertices.shape[0], dtype=np.int64), lengths)
    # Entry j of the output reads graph entry starts[row] + (j - first output of row).
    first = np.cumsum(lengths) - lengths
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - first, lengths)
    return row, graph.indices[pos], graph.weights[pos]


def unique_sorted(x: np.ndarray) -> np.ndarray:
    """The sorted distinct values of ``x``.

    ``np.unique`` on numpy 2.4 goes through a hash table that is two orders of
    magnitude slower than sorting for millions of int64 keys, so sort and compare.
    Unlike ``sven.datasets.compact.unique_sorted`` the sort is not stable: stability is
    useless for distinct values and costs several times as much on int64 keys, and this
    runs on every chunk of the cost model.

    Args:
        x: (m,) integer array.

    Returns:
        (u,) sorted distinct values.
    """
    x = np.sort(x)
    if x.shape[0] < 2:
        return x
    keep = np.empty(x.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(x[1:], x[:-1], out=keep[1:])
    return x[keep]


def unique_counts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sorted distinct values of ``x`` and how often each occurs (see ``unique_sorted``).

    Args:
        x: (m,) integer array.

    Returns:
        ``(values (u,), counts (u,) int64)``.
    """
    return _runs(np.sort(x))


def _runs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Run-length encoding of a sorted array: ``(values (u,), counts (u,) int64)``."""
    if x.shape[0] == 0:
        return x, np.zeros(0, dtype=np.int64)
    first = np.flatnonzero(np.concatenate(([True], x[1:] != x[:-1])))
    return x[first], np.diff(np.append(first, x.shape[0])).astype(np.int64)


def vertex_loads(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> np.ndarray:
    """Endpoint occurrences per vertex.

    Args:
        src: (E,) integer source ids.
        dst: (E,) integer destination ids.
        num_nodes: N.

    Returns:
        (N,) int64 occurrences (a self-loop counts twice).
    """
    return np.bincount(src, minlength=num_nodes).astype(np.int64) + np.bincount(
        dst, minlength=num_nodes
    )


def interaction_graph(
    src: np.ndarray,
    dst: np.ndarray,
    num_nodes: int,
    *,
    batch_size: int | None = None,
) -> InteractionGraph:
    """Builds the undirected interaction graph of a run of events.

    Args:
        src: (E,) integer source ids, in event order.
        dst: (E,) integer destination ids.
        num_nodes: N.
        batch_size: None weighs an edge by its event count. Otherwise by the number of
            distinct batches (consecutive runs of ``batch_size`` events, counted from
            the first event given) in which the pair interacts.

    Returns:
        The graph. Self-loops add to the vertex load but not to the edges.
    """
    src = np.asarray(src)
    dst = np.asarray(dst)
    load = vertex_loads(src, dst, num_nodes)
    lo = np.minimum(src, dst).astype(np.int64)
    hi = np.maximum(src, dst).astype(np.int64)
    pair = lo * num_nodes + hi
    del lo, hi
    pair_ev = np.flatnonzero(src != dst)
    pair = pair[pair_ev]
    if batch_size is None:
        keys, weights = unique_counts(pair)
    else:
        batch = pair_ev // batch_size
        span = int(batch[-1]) + 1 if batch.shape[0] else 1
        if num_nodes * num_nodes < np.iinfo(np.int64).max // span:
            # One int64 key per (pair, batch): a plain value sort (several times faster
            # than a stable argsort) groups each pair's batches together.
            pair = unique_sorted(pair * span + batch) // span
        else:
            # Keys would overflow: a stable sort keeps each pair's events in event
            # order, so its batch ids are non-decreasing within the pair.
            order = np.argsort(pair, kind="stable")
            pair, batch = pair[order], batch[order]
            del order
            new = np.ones(pair.shape[0], dtype=bool)
            new[1:] = (pair[1:] != pair[:-1]) | (batch[1:] != batch[:-1])
            pair = pair[new]
        del batch
        # ``pair`` now lists each pair once per distinct batch, sorted.
        keys, weights = _runs(pair)
    del pair
    a = keys // num_nodes
    b = keys % num_nodes
    rows = np.concatenate((a, b))
    cols = np.concatenate((b, a))
    w = np.concatenate((weights, weights)).astype(np.int64)
    del a, b, keys, weights
    # Rows in order, each row's neighbours ascending: a canonical CSR.
    order = np.argsort(rows * num_nodes + cols)
    counts = np.bincount(rows, minlength=num_nodes)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return InteractionGraph(indptr, cols[order], w[order], load)
