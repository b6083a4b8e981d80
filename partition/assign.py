"""Event-to-rank assignment: every event goes to the owner of one of its endpoints.

An event whose endpoints share an owner has no choice. A cut event (u, v) can go to
a = owner(u) or b = owner(v): both ranks then read the other endpoint remotely and
write it back, so the choice is decided by the sampled neighbourhoods, which are
mostly local where the endpoints are well connected. The preference for a is

    s = A(u, a) + A(v, a) - A(u, b) - A(v, b),

where A(x, r) is the share of x's interaction weight that goes to vertices on r (the
expected share of x's sampled neighbours that r holds). Each cut event goes to its
preferred side; then, while a rank exceeds the event cap ``balance * mean``, its cut
events with the weakest preference move to their other endpoint's rank where that rank
has room. Everything is vectorized; the loop is over rebalancing rounds.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from sven.partition.graph import InteractionGraph

__all__ = ["affinity_table", "assign_events", "endpoint_preference"]


def affinity_table(graph: InteractionGraph, owner: np.ndarray, parts: int) -> np.ndarray:
    """Share of every vertex's edge weight held by each rank.

    Args:
        graph: Interaction graph.
        owner: (N,) owners.
        parts: P.

    Returns:
        (N, P) float32 table ``A[x, r]``; rows sum to 1 (0 for isolated vertices).
        float32 halves the one dense N x P table.
    """
    n = graph.num_nodes
    rows = graph.rows()
    deg = np.maximum(graph.weighted_degree().astype(np.float64), 1.0)
    aff = np.bincount(
        rows * parts + owner[graph.indices],
        weights=graph.weights / deg[rows],
        minlength=n * parts,
    )
    return aff.astype(np.float32).reshape(n, parts)


def endpoint_preference(
    aff: np.ndarray, owner: np.ndarray, src: np.ndarray, dst: np.ndarray
) -> np.ndarray:
    """Preference of each event for ``owner[src]`` over ``owner[dst]`` (see module doc).

    Args:
        aff: (N, P) affinity table (``affinity_table``).
        owner: (N,) owners.
        src: (E,) source ids.
        dst: (E,) destination ids.

    Returns:
        (E,) float64 preference, positive for the source's owner; 0 for uncut events.
    """
    parts = aff.shape[1]
    flat = aff.reshape(-1)
    # Flat indices: numpy's 2-D fancy indexing is several times slower than 1-D.
    s = np.asarray(src, dtype=np.int64) * parts
    d = np.asarray(dst, dtype=np.int64) * parts
    a = owner[src]
    b = owner[dst]
    pref = flat[s + a].astype(np.float64) + flat[d + a]
    pref -= flat[s + b].astype(np.float64) + flat[d + b]
    return pref


def assign_events(
    src: np.ndarray,
    dst: np.ndarray,
    owner: np.ndarray,
    parts: int,
    *,
    balance: float = 1.05,
    preference: np.ndarray | Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    seed: int = 0,
    event_index: np.ndarray | None = None,
    index_offset: int = 0,
    chunk: int = 1 << 22,
    max_rounds: int = 64,
) -> np.ndarray:
    """Assigns each event to the owner of its source or of its destination.

    Only the cut events (endpoints on different ranks) are ever held in full; the rest
    is streamed in chunks, so memory stays near 30 bytes per cut event.

    Args:
        src: (E,) source ids (a memory map is fine).
        dst: (E,) destination ids.
        owner: (N,) owners.
        parts: P.
        balance: Event cap per rank as a multiple of the mean; met whenever the cut
            events leave enough freedom.
        preference: Preference for the source's owner: an (E,) array, or a function
            ``f(src (m,), dst (m,)) -> (m,)`` called on each chunk's cut events (e.g.
            ``endpoint_preference`` plus prices); None means load alone decides.
        seed: Breaks exact preference ties pseudo-randomly.
        event_index: (E,) global indices of the events, which key the tie-breaks so
            that a subset of the events is assigned as within the whole; None means
            ``index_offset + (0..E-1)``.
        index_offset: Global index of the first event when ``event_index`` is None.
        chunk: Events read at once.
        max_rounds: Rebalancing rounds at most.

    Returns:
        (E,) int32 rank per event.
    """
    num = int(src.shape[0])
    out = np.empty(num, dtype=np.int32)
    fixed = np.zeros(parts, dtype=np.int64)
    parts_idx, parts_a, parts_b, parts_pref = [], [], [], []
    for lo in range(0, num, chunk):
        hi = min(lo + chunk, num)
        s = np.asarray(src[lo:hi]).astype(np.int64)
        d = np.asarray(dst[lo:hi]).astype(np.int64)
        a = owner[s].astype(np.int64)
        b = owner[d].astype(np.int64)
        out[lo:hi] = a
        c = np.flatnonzero(a != b)
        fixed += np.bincount(a, minlength=parts) - np.bincount(a[c], minlength=parts)
        if preference is None:
            pref = np.zeros(c.shape[0])
        elif callable(preference):
            pref = np.asarray(preference(s[c], d[c]), dtype=np.float64)
        else:
            pref = np.asarray(preference[lo:hi], dtype=np.float64)[c]
        # Exact ties (no preference at all) alternate by a hash of the event index, so
        # that neither endpoint role is favoured systematically.
        if event_index is None:
            idx = index_offset + lo + c
        else:
            idx = np.asarray(event_index[lo:hi])[c]
        coin = ((idx * 0x9E3779B1 + seed * 0x85EBCA77) >> 7) & 1
        pref = np.where(pref == 0.0, np.where(coin == 1, 1e-12, -1e-12), pref)
        parts_idx.append(lo + c)
        parts_a.append(a[c])
        parts_b.append(b[c])
        parts_pref.append(pref)
    if num == 0:
        return out
    cut = np.concatenate(parts_idx)
    a = np.concatenate(parts_a)
    b = np.concatenate(parts_b)
    pref = np.concatenate(parts_pref)
    del parts_idx, parts_a, parts_b, parts_pref
    cap = max(int(np.floor(balance * num / parts)), -(-num // parts))
    choice = np.where(pref > 0, a, b)
    out[cut] = _rebalance(choice, a, b, pref, fixed, cap, parts, max_rounds)
    return out


def _rebalance(
    choice: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    pref: np.ndarray,
    fixed: np.ndarray,
    cap: int,
    parts: int,
    max_rounds: int,
) -> np.ndarray:
    """Moves cut events between their two ranks until no rank exceeds ``cap``.

    Direct moves go from an over-full rank to the other endpoint's rank where it has
    room, weakest preference first. When no direct move is left but a rank is still
    over, the excess travels along the shortest chain of ranks (breadth-first on the
    P x P graph of movable events) to a rank with room, one hop at a time; events moved
    on a chain are frozen so that chains cannot undo each other.

    Args:
        choice: (m,) int64 current rank of each cut event, updated in place.
        a: (m,) int64 source owner.
        b: (m,) int64 destination owner (never equal to ``a``).
        pref: (m,) preference for ``a``.
        fixed: (P,) events per rank that have no choice.
        cap: Events per rank at most.
        parts: P.
        max_rounds: Rounds at most.

    Returns:
        ``choice``.
    """
    frozen = np.zeros(choice.shape[0], dtype=bool)
    for _ in range(max_rounds):
        counts = fixed + np.bincount(choice, minlength=parts)
        excess = counts - cap
        if excess.max() <= 0:
            break
        room = cap - counts
        alt = a + b - choice
        movable = np.flatnonzero(~frozen & (excess[choice] > 0) & (room[alt] > 0))
        if movable.shape[0]:
            loss = _loss(movable, choice, a, pref)
            keep = _take_per_group(movable, choice[movable], loss, excess)
            keep = _take_per_group(keep, alt[keep], _loss(keep, choice, a, pref), room)
            choice[keep] = alt[keep]
            continue
        ev = np.flatnonzero(~frozen)
        flow = np.bincount(choice[ev] * parts + alt[ev], minlength=parts * parts)
        path = _chain(flow.reshape(parts, parts), int(np.argmax(excess)), room > 0)
        if path is None:
            break
        hops = list(itertools.pairwise(path))
        amount = min(excess[path[0]], room[path[-1]], *(flow[r * parts + q] for r, q in hops))
        for r, q in hops:
            on = ev[(choice[ev] == r) & (alt[ev] == q)]
            moved = on[np.lexsort((on, _loss(on, choice, a, pref)))[:amount]]
            choice[moved] = q
            frozen[moved] = True
    return choice


def _loss(idx: np.ndarray, choice: np.ndarray, a: np.ndarray, pref: np.ndarray) -> np.ndarray:
    """Preference lost by moving events ``idx`` off their current rank."""
    return np.where(choice[idx] == a[idx], pref[idx], -pref[idx])


def _chain(flow: np.ndarray, start: int, has_room: np.ndarray) -> list[int] | None:
    """Shortest chain of ranks from ``start`` to a rank with room (BFS over P ranks).

    Args:
        flow: (P, P) movable events from rank r to rank q.
        start: The over-full rank.
        has_room: (P,) bool.

    Returns:
        The ranks along the chain, ``start`` first, or None if none is reachable.
    """
    parent = {start: start}
    frontier = [start]
    while frontier:
        nxt = []
        for r in frontier:
            for q in np.flatnonzero(flow[r] > 0).tolist():
                if q in parent:
                    continue
                parent[q] = r
                if has_room[q]:
                    path = [q]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1]
                nxt.append(q)
        frontier = nxt
    return None


def _take_per_group(
    items: np.ndarray, group: np.ndarray, key: np.ndarray, quota: np.ndarray
) -> np.ndarray:
    """Per group, the ``quota[group]`` items with the smallest key.

    Args:
        items: (m,) item ids.
        group: (m,) group of each item.
        key: (m,) sort key, smallest first; ties by item id.
        quota: (G,) how many to take from each group (non-positive takes none).

    Returns:
        (k,) the selected items, in group then key order.
    """
    order = np.lexsort((items, key, group))
    g = group[order]
    first = np.searchsorted(g, g, side="left")
    pos = np.arange(g.shape[0]) - first
    return items[order][pos < quota[g]]
