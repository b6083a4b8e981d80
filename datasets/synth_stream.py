"""The synthetic generator's state and its draw, block by block (:class:`SynthStream`).

The model it draws from, the one approximation of drawing a block of events in
parallel, and why the output depends on the parameters only are described in
:mod:`sven.datasets.synth`, beside the parameters (:class:`~sven.datasets.synth.SynthParams`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sven.datasets.synth import SynthParams

__all__ = ["SynthStream"]

# Rejection rounds when a Zipf draw lands on a node that has not arrived yet; after
# them a uniform arrived node is used. With initial_active >= 0.5 fewer than 1 in 8
# draws fall through.
_ROUNDS = 3
# Rows of the per-block uniform matrix (fixed, so each block consumes a fixed amount of
# randomness whatever the data looks like).
_U_MECH, _U_RECENT, _U_SIDE, _U_REPEAT, _U_AGE, _U_INTRA, _U_GAP, _U_FB_SRC, _U_FB_DST = range(9)
_U_SRC = 9  # _ROUNDS rows: Zipf draws of fresh sources
_U_COMM = _U_SRC + _ROUNDS  # _ROUNDS rows: Zipf draws inside the community
_U_GLOB = _U_COMM + _ROUNDS  # _ROUNDS rows: Zipf draws over all destinations
_U_LOOP = _U_GLOB + _ROUNDS  # self-loop repair
_NUM_U = _U_LOOP + 1
# SeedSequence spawn keys: one stream for the fixed structure, one per block.
_STREAM_SETUP, _STREAM_BLOCK, _STREAM_LABEL = 0, 1, 2


def _block_rng(seed: int, stream: int, index: int = 0) -> np.random.Generator:
    # An independent stream per (seed, stream, index): blocks never share state, so
    # the output cannot depend on how the caller slices the stream.
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(stream, index)))
    )


def _zipf_positions(u: np.ndarray, size: np.ndarray | int, exponent: float) -> np.ndarray:
    """Maps uniforms to Zipf-like ranks by inverting a continuous power law.

    The density is proportional to x^-exponent on [1, size + 1), so rank r gets
    probability about (r + 1.5)^-exponent: a discretised Zipf law in O(1) per draw,
    where a binary search over cumulative weights costs O(log N) scattered reads per
    draw (docs/synthetic.md).

    Args:
        u: uniforms in [0, 1), any shape.
        size: number of ranks, scalar or broadcastable to ``u``; must be >= 1.
        exponent: the Zipf exponent (0 is uniform).

    Returns:
        int64 ranks in [0, size), shape of ``u``.
    """
    top = np.asarray(size, dtype=np.float64) + 1.0
    a = 1.0 - exponent
    if abs(a) < 1e-9:
        x = np.power(top, u)
    else:
        x = np.power(1.0 + u * (np.power(top, a) - 1.0), 1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, np.asarray(size, dtype=np.int64) - 1)


def _rejection(
    u: np.ndarray, draw: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """Rejection sampling in rounds, each round only over the draws still missing.

    The result equals taking, per event, the first of its R candidates that is valid;
    later rounds just skip the work for events already served.

    Args:
        u: (R, m) uniforms, one row per round.
        draw: maps (uniforms (k,), positions (k,) in 0..m-1) to (candidates (k,),
            valid (k,) bool).

    Returns:
        (m,) int64 candidates (undefined where not found) and (m,) bool found.
    """
    m = u.shape[1]
    out = np.zeros(m, dtype=np.int64)
    found = np.zeros(m, dtype=bool)
    todo = np.arange(m)
    for r in range(u.shape[0]):
        if not len(todo):
            break
        cand, ok = draw(u[r, todo], todo)
        out[todo[ok]] = cand[ok]
        found[todo[ok]] = True
        todo = todo[~ok]
    return out, found


def _pair_features(
    src: np.ndarray, dst: np.ndarray, num_nodes: int, seed: int, dim: int
) -> np.ndarray:
    """A pseudo-random vector per (src, dst) pair: same pair, same vector, no table.

    Each coordinate is a splitmix64 hash of (pair, coordinate, seed), turned into an
    approximately standard normal value as the sum of its four 16-bit quarters
    (Irwin-Hall), which costs one hash per value.

    Returns:
        (n, dim) float32.
    """
    key = src.astype(np.uint64) * np.uint64(num_nodes) + dst.astype(np.uint64)
    salt = np.uint64((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF)
    x = (
        key[:, None] * np.uint64(0xD1B54A32D192ED03)
        + np.arange(dim, dtype=np.uint64)[None, :]
        + salt
    )
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    m = np.uint64(0xFFFF)
    total = (x & m) + ((x >> np.uint64(16)) & m) + ((x >> np.uint64(32)) & m) + (x >> np.uint64(48))
    # Four U(0, 1) have mean 2 and variance 1/3.
    return ((total.astype(np.float64) / 65536.0 - 2.0) * np.sqrt(3.0)).astype(np.float32)


class SynthStream:
    """The generator's state: per-node ring buffers plus the fixed random structure.

    Memory is O(N * history) (the ring buffers, int32) plus O(N) for the structure and
    O(block_size) for the previous block; it does not grow with the number of events.

    Args:
        params: the generator parameters.
    """

    def __init__(self, params: SynthParams) -> None:
        self.params = p = params
        self.id_dtype = np.int32 if p.nodes < 2**31 else np.int64
        n_src = p.num_src_nodes
        # Source and destination pools: ids [src_lo, src_lo + src_n) and
        # [dst_lo, dst_lo + dst_n). Non-bipartite: both are all nodes.
        self.src_lo, self.src_n = 0, n_src
        self.dst_lo, self.dst_n = (n_src, p.nodes - n_src) if p.bipartite else (0, p.nodes)
        c = p.num_communities
        rng = _block_rng(p.seed, _STREAM_SETUP)
        # rank -> pool index; the activity rank is independent of arrival order, so
        # late arrivals can become hubs.
        self.src_by_rank = rng.permutation(self.src_n).astype(self.id_dtype)
        if p.bipartite:
            self.dst_by_rank = rng.permutation(self.dst_n).astype(self.id_dtype)
        else:
            # Active senders are also popular receivers, as in messaging data.
            self.dst_by_rank = self.src_by_rank
        dst_rank = np.empty(self.dst_n, dtype=np.int64)
        dst_rank[self.dst_by_rank] = np.arange(self.dst_n)
        # Community of every node (global id), with Zipf-sized communities.
        weights = (np.arange(c) + 1.0) ** -p.community_exponent
        cdf = np.cumsum(weights / weights.sum())
        cdf[-1] = 1.0
        self.community = np.searchsorted(cdf, rng.random(p.nodes), side="right").astype(np.int32)
        # Destinations grouped by community, most popular first inside each one, so a
        # Zipf rank inside a community is an offset into its segment.
        dst_comm = self.community[self.dst_lo : self.dst_lo + self.dst_n]
        order = np.lexsort((dst_rank, dst_comm))
        self.seg_nodes = order.astype(self.id_dtype)  # pool indices
        counts = np.bincount(dst_comm, minlength=c)
        self.seg_size = counts.astype(np.int64)
        self.seg_start = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        self.centroids = (
            rng.standard_normal((c, p.edge_feat_dim)).astype(np.float32)
            if p.edge_feat_dim
            else None
        )
        # Flagged communities: their own stream, so labels leave the events unchanged.
        self.flagged: np.ndarray | None = None
        if p.label_share > 0:
            k = min(max(1, round(p.label_share * c)), c - 1)  # both labels occur
            order = _block_rng(p.seed, _STREAM_LABEL).permutation(c)
            self.flagged = np.zeros(c, dtype=np.int64)
            self.flagged[order[:k]] = 1
        # Ring buffer of the last H partners per node and the number of pushes so far
        # (the next slot is pushes % H).
        self.hist = np.zeros((p.nodes, p.history), dtype=self.id_dtype)
        self.pushes = np.zeros(p.nodes, dtype=np.int64)
        self.prev_src: np.ndarray | None = None
        self.prev_dst: np.ndarray | None = None
        self.clock = 0.0
        self.num_blocks = -(-p.events // p.block)

    def state_nbytes(self) -> int:
        """Bytes held by the state between blocks (constant after the first block)."""
        arrays = [
            self.src_by_rank,
            self.dst_by_rank,
            self.community,
            self.seg_nodes,
            self.seg_size,
            self.seg_start,
            self.hist,
            self.pushes,
        ]
        extra = (self.prev_src, self.prev_dst, self.centroids, self.flagged)
        arrays += [a for a in extra if a is not None]
        # dst_by_rank aliases src_by_rank on non-bipartite graphs.
        seen: dict[int, int] = {id(a): a.nbytes for a in arrays}
        return sum(seen.values())

    def _arrived(self, pool_n: int, block: int) -> int:
        # Nodes of a pool that may take part in this block (ids are in arrival order).
        p = self.params
        f = min(1.0, block * p.block / p.events)
        return max(
            1, min(pool_n, int(np.ceil(pool_n * (p.initial_active + (1 - p.initial_active) * f))))
        )

    def block(self, index: int) -> dict[str, np.ndarray]:
        """Draws block ``index`` (blocks must be drawn in order, each once).

        Returns:
            ``src`` (n,), ``dst`` (n,) compact ids; ``t`` (n,) int64, non-decreasing
            and >= the previous block's times; ``edge_feat`` (n, d_e) float32 when
            ``edge_feat_dim`` > 0; ``label`` (n,) int64 0/1 when ``label_share`` > 0.
            n is ``block_size`` except for the last block.
        """
        p = self.params
        start = index * p.block
        n = min(p.block, p.events - start)
        rng = _block_rng(p.seed, _STREAM_BLOCK, index)
        u = rng.random((_NUM_U, n))
        n_src = self._arrived(self.src_n, index)
        n_dst = self._arrived(self.dst_n, index)

        # Replies and self-excitation point at an event of the previous block, biased
        # towards its end (the most recent events); the first block has no past.
        reply = np.zeros(n, dtype=bool)
        back = np.zeros(n, dtype=bool)
        if self.prev_src is not None:
            p_reply = 0.0 if p.bipartite else p.p_reply
            reply = u[_U_MECH] < p_reply
            back = u[_U_MECH] < p_reply + p.p_excite
        src = np.empty(n, dtype=np.int64)
        dst = np.empty(n, dtype=np.int64)
        # Each mechanism only computes for the events that use it; the uniforms were
        # drawn for every event anyway, so the stream stays a function of the seed.
        fresh = np.flatnonzero(~back)
        src[fresh] = self._fresh_sources(u[:, fresh], n_src)
        bi = np.flatnonzero(back)
        if len(bi):
            m = len(self.prev_src)
            k = m - 1 - (m * u[_U_RECENT, bi] ** 3).astype(np.int64)
            recent_src, recent_dst = self.prev_src[k], self.prev_dst[k]
            if p.bipartite:
                excited = recent_src
            else:
                excited = np.where(u[_U_SIDE, bi] < 0.5, recent_src, recent_dst)
            is_reply = reply[bi]
            src[bi] = np.where(is_reply, recent_dst, excited)
            dst[bi[is_reply]] = recent_src[is_reply]

        # Partner: a recent partner from the source's ring buffer, or a new one.
        oi = np.flatnonzero(~reply)
        s = src[oi]
        pushes = self.pushes[s]
        filled = np.minimum(pushes, p.history)
        use_hist = (u[_U_REPEAT, oi] < p.p_repeat) & (filled > 0)
        hi, s, pushes, filled = oi[use_hist], s[use_hist], pushes[use_hist], filled[use_hist]
        age = (filled * u[_U_AGE, hi] ** 2).astype(np.int64)  # squared: favour recent slots
        dst[hi] = self.hist[s, (pushes - 1 - age) % p.history]
        ni = oi[~use_hist]
        dst[ni] = self._new_partners(u[:, ni], src[ni], n_dst)
        src = src.astype(self.id_dtype)
        dst = dst.astype(self.id_dtype)

        # Bursty clock: short exponential gaps inside bursts, Pareto gaps between them.
        short = rng.exponential(p.burst_gap, n)
        pause = p.pause_gap * (1.0 + rng.pareto(p.pause_shape, n))
        gaps = np.where(u[_U_GAP] < p.burst_prob, short, pause)
        clock = self.clock + np.cumsum(gaps)
        self.clock = float(clock[-1])
        out = {"src": src, "dst": dst, "t": np.floor(clock).astype(np.int64)}
        if self.centroids is not None:
            noise = rng.standard_normal((n, p.edge_feat_dim), dtype=np.float32)
            pair = _pair_features(src, dst, p.nodes, p.seed, p.edge_feat_dim)
            out["edge_feat"] = 0.7 * self.centroids[self.community[dst]] + 0.7 * pair + 0.3 * noise

        if self.flagged is not None:
            out["label"] = self.flagged[self.community[src]]
        self._remember(src, dst)
        self.prev_src, self.prev_dst = src, dst
        return out

    def _fresh_sources(self, u: np.ndarray, n_src: int) -> np.ndarray:
        """Zipf draws over activity ranks among arrived sources.

        Args:
            u: (_NUM_U, m) the events' uniforms.
            n_src: arrived sources (pool indices below it).

        Returns:
            (m,) int64 global ids.
        """
        a = self.params.activity_exponent

        def draw(uu: np.ndarray, _todo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            cand = self.src_by_rank[_zipf_positions(uu, self.src_n, a)]
            return cand, cand < n_src

        out, found = _rejection(u[_U_SRC : _U_SRC + _ROUNDS], draw)
        lost = np.flatnonzero(~found)
        out[lost] = (u[_U_FB_SRC, lost] * n_src).astype(np.int64)
        return out + self.src_lo

    def _new_partners(self, u: np.ndarray, src: np.ndarray, n_dst: int) -> np.ndarray:
        """New partners: Zipf by popularity inside the source's community or overall.

        Args:
            u: (_NUM_U, m) the events' uniforms.
            src: (m,) int64 global source ids.
            n_dst: arrived destinations (pool indices below it).

        Returns:
            (m,) int64 global ids, never equal to ``src``.
        """
        p = self.params
        lo = self.dst_lo
        comm = self.community[src]
        size = self.seg_size[comm]
        intra = np.flatnonzero((u[_U_INTRA] < p.p_intra) & (size > 0))
        i_size, i_start, i_src = size[intra], self.seg_start[comm[intra]], src[intra]

        def draw_comm(uu: np.ndarray, todo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            pos = _zipf_positions(uu, i_size[todo], p.popularity_exponent)
            cand = self.seg_nodes[i_start[todo] + pos].astype(np.int64)
            return cand, (cand < n_dst) & (cand + lo != i_src[todo])

        out = np.empty(len(src), dtype=np.int64)
        cand, found = _rejection(u[_U_COMM : _U_COMM + _ROUNDS, intra], draw_comm)
        out[intra[found]] = cand[found]
        rest = np.setdiff1d(np.arange(len(src)), intra[found], assume_unique=True)
        r_src = src[rest]

        def draw_glob(uu: np.ndarray, todo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            pos = _zipf_positions(uu, self.dst_n, p.popularity_exponent)
            cand = self.dst_by_rank[pos].astype(np.int64)
            return cand, (cand < n_dst) & (cand + lo != r_src[todo])

        cand, found = _rejection(u[_U_GLOB : _U_GLOB + _ROUNDS, rest], draw_glob)
        lost = ~found
        cand[lost] = (u[_U_FB_DST, rest[lost]] * n_dst).astype(np.int64)
        if not p.bipartite:
            # The uniform fallback can still hit the source: move it to another node
            # (an arrived one, unless the source is the only node that has arrived).
            loop = np.flatnonzero(cand == r_src)
            shift = 1 + (u[_U_LOOP, rest[loop]] * max(n_dst - 1, 1)).astype(np.int64)
            cand[loop] = (r_src[loop] + shift) % max(n_dst, 2)
        out[rest] = cand
        return out + lo

    def _remember(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Pushes the block's partners into the ring buffers, in event order.

        Each node's pushes get consecutive slots after its current pointer; only the
        last H pushes per node are written so no slot is written twice, which keeps
        the scatter well defined (numpy leaves the winner of duplicate fancy-index
        writes unspecified).
        """
        p = self.params
        n = len(src)
        if p.bipartite:
            # Only sources pick partners from their history.
            node, partner = src.astype(np.int64), dst
            order_key = node * n + np.arange(n)
        else:
            node = np.concatenate((src, dst)).astype(np.int64)
            partner = np.concatenate((dst, src))
            seq = np.arange(n)
            order_key = node * (2 * n) + np.concatenate((2 * seq, 2 * seq + 1))
        perm = np.argsort(order_key)
        node, partner = node[perm], partner[perm]
        first = np.empty(len(node), dtype=bool)
        first[0] = True
        np.not_equal(node[1:], node[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        sizes = np.diff(np.append(starts, len(node)))
        rank = np.arange(len(node)) - np.repeat(starts, sizes)
        size = np.repeat(sizes, sizes)
        keep = rank >= size - p.history
        base = self.pushes[node]
        self.hist[node[keep], (base[keep] + rank[keep]) % p.history] = partner[keep]
        self.pushes[node[starts]] += sizes
