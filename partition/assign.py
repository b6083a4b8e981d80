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

Per-batch balance (``batch_size``): a synchronous step waits for the slowest rank of
each global batch, so the cap can also be applied per batch window (events
``[i * B, (i + 1) * B)``): first each (batch, rank) above ``balance`` times the batch's
mean hands its weakest cut events to their other endpoint's rank where that rank has
room in the same batch (through a chain of full ranks where needed), then the epoch
cap is met as above, preferring moves that keep every batch within its cap. A batch
stays over its cap only where no assignment meets it: some set of ranks holds more
events with both endpoints' owners among them than the set's cap, most simply a rank
whose own internal events exceed it (``batch_balance_stats`` counts both).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sven.partition.graph import InteractionGraph

__all__ = ["affinity_table", "assign_events", "batch_balance_stats", "endpoint_preference"]


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
    batch_size: int | None = None,
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
        max_rounds: Rebalancing rounds at most (per phase).
        batch_size: B: also cap every batch window's events per rank (see module
            doc). Event ``e`` (global index ``idx``) is in window ``(idx -
            index_offset) // B``; None caps only the epoch.

    Returns:
        (E,) int32 rank per event.
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    num = int(src.shape[0])
    out = np.empty(num, dtype=np.int32)
    nw = None if batch_size is None else _num_windows(num, batch_size, event_index, index_offset)
    cut = _CutEvents(parts, nw)
    for lo in range(0, num, chunk):
        hi = min(lo + chunk, num)
        s = np.asarray(src[lo:hi]).astype(np.int64)
        d = np.asarray(dst[lo:hi]).astype(np.int64)
        a = owner[s].astype(np.int64)
        b = owner[d].astype(np.int64)
        out[lo:hi] = a
        c = np.flatnonzero(a != b)
        every = _event_ids(event_index, index_offset, lo, hi)
        pref = _tie_break(_preference(preference, s, d, c, lo, hi), every[c], seed)
        win = None if batch_size is None else (every - index_offset) // batch_size
        cut.add(lo, a, b, c, pref, win)
    if num == 0:
        return out
    idx, a, b, pref, win = cut.gathered()
    choice = np.where(pref > 0, a, b)
    balanced = None
    if win is not None:
        balanced = _Windows(win * parts, cut.win_fixed, np.repeat(cut.win_cap(balance), parts))
        _balance_windows(choice, a, b, pref, balanced, max_rounds)
    cap = _cap(num, parts, balance)
    out[idx] = _rebalance(choice, a, b, pref, cut.fixed, cap, parts, max_rounds, balanced)
    return out


def _num_windows(
    num: int, batch_size: int, event_index: np.ndarray | None, index_offset: int
) -> int:
    """Batch windows of ``batch_size`` events from ``index_offset`` up to the last event."""
    last = num - 1
    if event_index is not None:
        last = int(np.max(event_index, initial=index_offset)) - index_offset
    return max(last, 0) // batch_size + 1


def _event_ids(event_index: np.ndarray | None, index_offset: int, lo: int, hi: int) -> np.ndarray:
    """(hi - lo,) int64 global indices of events ``[lo, hi)``."""
    if event_index is None:
        return index_offset + lo + np.arange(hi - lo, dtype=np.int64)
    return np.asarray(event_index[lo:hi]).astype(np.int64)


def _preference(
    preference: np.ndarray | Callable[[np.ndarray, np.ndarray], np.ndarray] | None,
    s: np.ndarray,
    d: np.ndarray,
    c: np.ndarray,
    lo: int,
    hi: int,
) -> np.ndarray:
    """(m,) float64 preference for the source's owner of the chunk's cut events.

    Args:
        preference: As :func:`assign_events` takes it.
        s: (hi - lo,) int64 sources of events ``[lo, hi)``.
        d: (hi - lo,) int64 destinations.
        c: (m,) positions of the cut events in the chunk.
        lo: First event of the chunk.
        hi: End of the chunk.
    """
    if preference is None:
        return np.zeros(c.shape[0])
    if callable(preference):
        return np.asarray(preference(s[c], d[c]), dtype=np.float64)
    return np.asarray(preference[lo:hi], dtype=np.float64)[c]


def _tie_break(pref: np.ndarray, idx: np.ndarray, seed: int) -> np.ndarray:
    """``pref`` with each exact 0 made +-1e-12 by a hash of the (m,) event indices.

    Exact ties (no preference at all) alternate by a hash of the event index, so that
    neither endpoint role is favoured systematically.
    """
    coin = ((idx * 0x9E3779B1 + seed * 0x85EBCA77) >> 7) & 1
    return np.where(pref == 0.0, np.where(coin == 1, 1e-12, -1e-12), pref)


class _CutEvents:
    """The cut events of a stream of chunks, and per-rank counts of the events without
    choice.

    Only the cut events are held in full; of the others only counts are kept.

    Args:
        parts: P.
        num_windows: W, the batch windows counted; None counts none.

    Attributes:
        fixed: (P,) int64 events without choice per rank.
        win_events: (W,) int64 events per window (None without windows).
        win_fixed: (W * P,) int64 events without choice per (window, rank).
    """

    def __init__(self, parts: int, num_windows: int | None) -> None:
        self.parts = parts
        self.fixed = np.zeros(parts, dtype=np.int64)
        self.win_events: np.ndarray | None = None
        self.win_fixed: np.ndarray | None = None
        if num_windows is not None:
            self.win_events = np.zeros(num_windows, dtype=np.int64)
            self.win_fixed = np.zeros(num_windows * parts, dtype=np.int64)
        self._chunks: list[tuple[np.ndarray, ...]] = []

    def add(
        self,
        lo: int,
        a: np.ndarray,
        b: np.ndarray,
        c: np.ndarray,
        pref: np.ndarray,
        win: np.ndarray | None,
    ) -> None:
        """Adds one chunk of events starting at ``lo``.

        Args:
            lo: Position of the chunk's first event in the stream.
            a: (n,) int64 owner of each event's source.
            b: (n,) int64 owner of each event's destination.
            c: (m,) positions of the cut events (``a != b``) in the chunk.
            pref: (m,) preference of the cut events for ``a``.
            win: (n,) int64 batch window of each event; None without windows.
        """
        parts = self.parts
        self.fixed += np.bincount(a, minlength=parts) - np.bincount(a[c], minlength=parts)
        if win is not None:
            nw = self.win_events.shape[0]
            self.win_events += np.bincount(win, minlength=nw)
            uncut = a == b
            self.win_fixed += np.bincount(win[uncut] * parts + a[uncut], minlength=nw * parts)
        self._chunks.append((lo + c, a[c], b[c], pref, None if win is None else win[c]))

    def gathered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The cut events of all chunks, once: ``(position, a, b, pref, window)``,
        each (m,); ``window`` None without windows."""
        chunks, self._chunks = self._chunks, []
        idx, a, b, pref, win = (list(column) for column in zip(*chunks, strict=True))
        del chunks
        return (
            np.concatenate(idx),
            np.concatenate(a),
            np.concatenate(b),
            np.concatenate(pref),
            None if self.win_events is None else np.concatenate(win),
        )

    def win_cap(self, balance: float) -> np.ndarray:
        """(W,) events per rank at most in each window."""
        return _cap(self.win_events, self.parts, balance)


def _cap(events: np.ndarray | int, parts: int, balance: float) -> np.ndarray | int:
    """Events per rank at most: ``balance`` times the mean, never below the ceiling."""
    if isinstance(events, int):
        return max(int(np.floor(balance * events / parts)), -(-events // parts))
    return np.maximum(np.floor(balance * events / parts).astype(np.int64), -(-events // parts))


@dataclass
class _Windows:
    """Batch windows of the cut events and what else each (window, rank) holds.

    Attributes:
        base: (m,) int64 ``window * P`` of each cut event; ``base + rank`` is its
            (window, rank) group.
        fixed: (W * P,) events without choice per (window, rank).
        cap: (W * P,) events per (window, rank) at most.
    """

    base: np.ndarray
    fixed: np.ndarray
    cap: np.ndarray

    def room(self, choice: np.ndarray) -> np.ndarray:
        """(W * P,) ``cap - events`` per (window, rank) under ``choice``."""
        return self.cap - self.fixed - np.bincount(self.base + choice, minlength=self.cap.shape[0])


def _balance_windows(
    choice: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    pref: np.ndarray,
    win: _Windows,
    max_rounds: int,
    max_depth: int = 4,
) -> np.ndarray:
    """Moves cut events within their batch window until no (window, rank) is over cap.

    Direct rounds: every over-cap (window, rank) hands up to its excess of cut events,
    weakest preference first, to their other endpoint's rank where that rank has room
    in the same window (at most the room of each receiving group). A group is either
    over or has room, never both, so a round never overfills a group, and every round
    that moves an event lowers the total excess.

    When no direct move is left, the excess often still fits: the over rank's partners
    are full, but one of them has a cut event whose other rank has room. A chain round
    makes that room (``_make_room``), and the next direct round uses it.

    Args:
        choice: (m,) int64 current rank of each cut event, updated in place.
        a: (m,) int64 source owner.
        b: (m,) int64 destination owner.
        pref: (m,) preference for ``a``.
        win: The windows.
        max_rounds: Rounds at most.
        max_depth: Longest chain of full ranks a chain round looks through.

    Returns:
        ``choice``.
    """
    for _ in range(max_rounds):
        room = win.room(choice)
        if room.min() >= 0:
            break
        here = win.base + choice
        alt = a + b - choice
        there = win.base + alt
        movable = np.flatnonzero((room[here] < 0) & (room[there] > 0))
        if movable.shape[0] == 0:
            if not _make_room(choice, a, pref, here, alt, there, room, max_depth):
                break
            continue
        keep = _take_per_group(movable, here[movable], _loss(movable, choice, a, pref), -room)
        keep = _take_per_group(keep, there[keep], _loss(keep, choice, a, pref), room)
        choice[keep] = alt[keep]
    return choice


def _make_room(
    choice: np.ndarray,
    a: np.ndarray,
    pref: np.ndarray,
    here: np.ndarray,
    alt: np.ndarray,
    there: np.ndarray,
    room: np.ndarray,
    max_depth: int,
) -> int:
    """One step of the chains that carry a window's excess through full ranks.

    Breadth-first over (window, rank) groups, all windows at once: level 0 are the
    full groups (room 0) that events of over-cap groups could move to; level d + 1
    the full groups that events of level d could move to. At the first level where
    some of its events can move to a group with room, those move (at most as many
    per group as events want in, at most the room of each receiver). Room then opens
    one level closer to the over-cap group; later rounds carry it the rest of the way.

    Args:
        choice: (m,) current rank of each cut event, updated in place.
        a: (m,) source owner.
        pref: (m,) preference for ``a``.
        here: (m,) current group ``window * P + choice``.
        alt: (m,) the other endpoint's rank.
        there: (m,) the group ``window * P + alt``.
        room: (G,) ``cap - events`` per group.
        max_depth: Levels at most.

    Returns:
        Events moved.
    """
    seen = room < 0
    asking = room[here] < 0
    for _ in range(max_depth):
        ask = asking & (room[there] == 0) & ~seen[there]
        wanted = np.bincount(there[ask], minlength=room.shape[0])
        if not wanted.any():
            return 0
        seen |= wanted > 0
        free = np.flatnonzero((wanted[here] > 0) & (room[there] > 0))
        if free.shape[0]:
            keep = _take_per_group(free, here[free], _loss(free, choice, a, pref), wanted)
            keep = _take_per_group(keep, there[keep], _loss(keep, choice, a, pref), room)
            choice[keep] = alt[keep]
            return int(keep.shape[0])
        asking = wanted[here] > 0
    return 0


def _rebalance(
    choice: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    pref: np.ndarray,
    fixed: np.ndarray,
    cap: int,
    parts: int,
    max_rounds: int,
    windows: _Windows | None = None,
) -> np.ndarray:
    """Moves cut events between their two ranks until no rank exceeds ``cap``.

    Direct moves go from an over-full rank to the other endpoint's rank where it has
    room, weakest preference first; with ``windows``, moves that keep the event's
    batch window within its cap go first, the others only when none is left. When no
    direct move is left but a rank is still over, the excess travels along the
    shortest chain of ranks (breadth-first on the P x P graph of movable events) to a
    rank with room, one hop at a time; events moved on a chain are frozen so that
    chains cannot undo each other.

    Args:
        choice: (m,) int64 current rank of each cut event, updated in place.
        a: (m,) int64 source owner.
        b: (m,) int64 destination owner (never equal to ``a``).
        pref: (m,) preference for ``a``.
        fixed: (P,) events per rank that have no choice.
        cap: Events per rank at most.
        parts: P.
        max_rounds: Rounds at most.
        windows: Batch windows to keep within their caps where possible.

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
        if windows is not None and movable.shape[0]:
            win_room = windows.room(choice)
            there = windows.base[movable] + alt[movable]
            kind = movable[win_room[there] > 0]
            if kind.shape[0]:
                # At most each receiving window's room, so no batch goes over its cap.
                kind = _take_per_group(
                    kind, windows.base[kind] + alt[kind], _loss(kind, choice, a, pref), win_room
                )
                movable = kind
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


def batch_balance_stats(
    src: np.ndarray,
    dst: np.ndarray,
    owner: np.ndarray,
    assign: np.ndarray,
    parts: int,
    batch_size: int,
    *,
    balance: float = 1.05,
    chunk: int = 1 << 22,
) -> dict[str, float | int]:
    """How far each batch window of an assignment is from the per-batch cap.

    Windows are events ``[i * B, (i + 1) * B)`` of the given arrays; the cap of a
    window of n events is ``max(floor(balance * n / P), ceil(n / P))`` per rank.

    Args:
        src: (E,) source ids (a memory map is fine).
        dst: (E,) destination ids.
        owner: (N,) owners.
        assign: (E,) rank per event.
        parts: P.
        batch_size: B.
        balance: The cap as a multiple of the batch's mean.
        chunk: Events read at once (rounded to whole windows).

    Returns:
        ``batches``; ``over_cap``: windows where some rank is above the cap;
        ``forced``: windows where some rank's events with both endpoints on it alone
        exceed the cap, which no assignment can repair; ``event_imbalance``: the sum
        over windows of the largest rank's events over the sum of the means.
    """
    num = int(src.shape[0])
    step = max(1, chunk // batch_size) * batch_size
    batches = over = forced = worst = 0
    for lo in range(0, num, step):
        hi = min(lo + step, num)
        s = owner[np.asarray(src[lo:hi])]
        d = owner[np.asarray(dst[lo:hi])]
        r = np.asarray(assign[lo:hi]).astype(np.int64)
        win = np.arange(hi - lo, dtype=np.int64) // batch_size
        nw = int(win[-1]) + 1
        counts = np.bincount(win * parts + r, minlength=nw * parts).reshape(nw, parts)
        uncut = s == d
        fixed = np.bincount(win[uncut] * parts + r[uncut], minlength=nw * parts)
        cap = _cap(counts.sum(axis=1), parts, balance)[:, None]
        batches += nw
        over += int((counts > cap).any(axis=1).sum())
        forced += int((fixed.reshape(nw, parts) > cap).any(axis=1).sum())
        worst += int(counts.max(axis=1).sum())
    return {
        "batches": batches,
        "over_cap": over,
        "forced": forced,
        "event_imbalance": worst * parts / num if num else 1.0,
    }
