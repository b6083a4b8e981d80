"""Evaluation negatives of the field's protocols: random, historical, inductive.

Poursafaei et al. (NeurIPS 2022, "Towards Better Evaluation for Dynamic Link
Prediction") add two harder protocols to the random one, as implemented in DyGLib:

- historical: the negative is an edge seen before the current batch and not in it,
  which tests whether a model only remembers past pairs;
- inductive: an edge seen before the current batch but after the training split (so
  never seen in training), and not in the current batch.

When no such edge is eligible the draw falls back to a random destination that does
not form an edge of the current batch. Sven scores each positive's source against n
negative destinations, so the eligible edges are those of the positive's own source:
the negative destination ``d'`` of event (s, d) is drawn from the destinations that s
met before the batch (DyGLib draws whole edges (s', d'), sources included).

Every draw is a function of (seed, stream, global event index, try): two runs with the
same seed evaluate against the same negatives, on any number of ranks.

All work is vectorised over the events of a batch: a sorted table of the graph's unique
(source, destination) pairs, ordered by source and then by first occurrence, turns
"the pairs of s first seen in [lo, hi)" into one contiguous range found by binary search.
"""

from __future__ import annotations

import torch

from sven.pipeline.negatives import hash_counter

PROTOCOLS = ("random", "historical", "inductive")
#: Draws tried per event before falling back (eligible pair, then random destination).
TRIES = 8


class EvalNegatives:
    """Historical and inductive negative destinations over one event stream.

    Args:
        src: (E,) int64 sources of all events, in stream order.
        dst: (E,) int64 destinations.
        num_nodes: N.
        train_stop: Index of the first event after the training split.
        candidates: (C,) int64 destinations of the random fallback.
    """

    def __init__(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        num_nodes: int,
        train_stop: int,
        candidates: torch.Tensor,
    ) -> None:
        e = int(src.numel())
        n = int(num_nodes)
        if n * (e + 1) >= 1 << 62:
            raise ValueError(f"{n} nodes x {e} events: pair keys would overflow int64")
        self.src = src.to(torch.int64)
        self.dst = dst.to(torch.int64)
        self.num_nodes = n
        self.num_events = e
        self.train_stop = int(train_stop)
        self.candidates = candidates
        dev = src.device
        pair = self.src * n + self.dst
        uniq, inv = torch.unique(pair, return_inverse=True)
        first = torch.full((uniq.numel(),), e, dtype=torch.int64, device=dev)
        first = first.scatter_reduce(
            0, inv, torch.arange(e, device=dev), reduce="amin", include_self=True
        )
        #: (U,) the sorted unique pair keys src * N + dst; a pair's id is its row here.
        self.pair_key = uniq
        p_src = uniq // n
        # Order by (source, first occurrence): one sortable key per pair.
        self.order_key, order = torch.sort(p_src * (e + 1) + first)
        self.pair_dst = (uniq % n)[order]

    def _range(
        self, s: torch.Tensor, first_lo: torch.Tensor, first_hi: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Rows [lo, hi) of the pair table: pairs of source s first seen in
        [first_lo, first_hi) (each (B,), or a number)."""
        base = s * (self.num_events + 1)
        lo = torch.searchsorted(self.order_key, base + first_lo)
        hi = torch.searchsorted(self.order_key, base + first_hi)
        return lo, hi

    def draw(
        self,
        protocol: str,
        seed: int,
        stream: int,
        index: torch.Tensor,
        batch_start: int,
        batch_stop: int,
    ) -> torch.Tensor:
        """One negative destination per event.

        Args:
            protocol: "historical" or "inductive" ("random" is
                :func:`sven.pipeline.negatives.sample_negatives`).
            seed: Run seed.
            stream: Stream id (fixed per split and protocol).
            index: (B,) int64 global indices of the events (this rank's part of the batch).
            batch_start: Index of the global batch's first event.
            batch_stop: One past its last event.

        Returns:
            (B,) int64 negative destinations.
        """
        return self.draw_batches(
            protocol, seed, stream, index, batch_start, batch_stop, max(batch_stop - batch_start, 1)
        )

    def draw_batches(
        self,
        protocol: str,
        seed: int,
        stream: int,
        index: torch.Tensor,
        lo: int,
        hi: int,
        batch_size: int,
        chunk: int = 1 << 21,
    ) -> torch.Tensor:
        """:meth:`draw` for the events of many global batches in one vectorised pass.

        The global batches tile [lo, hi) in steps of ``batch_size``; each event's draw
        is the one :meth:`draw` gives it with its own batch's bounds, bit for bit (the
        same hashes, the same tries): "not in the batch" is looked up as the key
        (batch, pair id) among the keys of the events of [lo, hi).

        Args:
            protocol: "historical" or "inductive".
            seed: Run seed.
            stream: Stream id.
            index: (B,) int64 global indices of events in [lo, hi).
            lo: First event of the first global batch.
            hi: One past the last event of the last one.
            batch_size: Events per global batch (the last may be shorter).
            chunk: Events drawn at once (bounds the temporary memory).

        Returns:
            (B,) int64 negative destinations.
        """
        if protocol not in ("historical", "inductive"):
            raise ValueError(f"unknown negative protocol {protocol!r} (historical or inductive)")
        b = int(batch_size)
        n_pairs = int(self.pair_key.numel())
        if ((hi - lo) // b + 1) * (n_pairs + 1) >= 1 << 62:
            raise ValueError(f"{hi - lo} events in batches of {b}: batch keys would overflow")
        out = torch.empty_like(index, dtype=torch.int64)
        if index.numel() == 0:
            return out
        ev = torch.arange(lo, hi, device=self.src.device)
        pairs = self.src[lo:hi] * self.num_nodes + self.dst[lo:hi]
        ev_pair = torch.searchsorted(self.pair_key, pairs)
        batch_keys = torch.unique((ev - lo) // b * n_pairs + ev_pair)
        for c in range(0, index.numel(), chunk):
            idx = index[c : c + chunk]
            k = (idx - lo) // b
            start = lo + k * b
            out[c : c + chunk] = self._draw_chunk(protocol, seed, stream, idx, k, start, batch_keys)
        return out

    def _draw_chunk(
        self,
        protocol: str,
        seed: int,
        stream: int,
        index: torch.Tensor,
        batch: torch.Tensor,
        batch_start: torch.Tensor,
        batch_keys: torch.Tensor,
    ) -> torch.Tensor:
        """The tries of :meth:`draw_batches` for events (B,) of the batches ``batch``
        (B,) that start at ``batch_start`` (B,); ``batch_keys``: the sorted
        (batch, pair id) keys of the batches' events."""
        n, n_pairs = self.num_nodes, int(self.pair_key.numel())
        s = self.src[index]

        def in_batch(cand: torch.Tensor) -> torch.Tensor:
            key = s * n + cand
            # Both tables are non-empty: the events' own pairs and keys are in them.
            pid = torch.searchsorted(self.pair_key, key).clamp_max(n_pairs - 1)
            bk = batch * n_pairs + pid
            at = torch.searchsorted(batch_keys, bk).clamp_max(batch_keys.numel() - 1)
            return (self.pair_key[pid] == key) & (batch_keys[at] == bk)

        if protocol == "historical":
            first_lo = torch.zeros_like(batch_start)
        else:
            first_lo = batch_start.clamp_max(self.train_stop)
        lo, hi = self._range(s, first_lo, batch_start)
        count = hi - lo
        out = torch.full_like(s, -1)
        for j in range(TRIES):
            h = hash_counter(seed, stream, index, j)
            row = lo + h % count.clamp_min(1)
            cand = self.pair_dst[row.clamp_max(self.pair_dst.numel() - 1)]
            ok = (count > 0) & ~in_batch(cand) & (out < 0)
            out = torch.where(ok, cand, out)
        c = self.candidates
        for j in range(TRIES):
            h = hash_counter(seed, stream, index, TRIES + j)
            cand = c[h % c.numel()]
            ok = ~in_batch(cand) & (out < 0)
            # The last try is taken whatever it is: a source that met every candidate
            # in this batch has no valid negative.
            out = torch.where(ok | ((out < 0) & (j == TRIES - 1)), cand, out)
        return out


def filtered_mrr_negatives(
    src: torch.Tensor,
    dst: torch.Tensor,
    t: torch.Tensor,
    index: torch.Tensor,
    negatives: torch.Tensor,
    num_nodes: int,
    chunk: int = 4096,
) -> torch.Tensor:
    """TGB's filter: which one-vs-many negatives are not true edges at the query's time.

    A negative d' of event (s, d, t) is dropped when (s, d', t) is itself an event of
    the stream (d' = d included), so a model is not penalised for ranking another true
    edge of the same instant above the query.

    Args:
        src: (E,) int64 sources of the stream. dst: (E,) destinations. t: (E,) times.
        index: (B,) int64 events of the queries, ascending.
        negatives: (B, q) int64 negative destinations.
        num_nodes: N.
        chunk: Queries handled at once.

    Returns:
        (B, q) bool, True where the negative counts.
    """
    out = torch.ones_like(negatives, dtype=torch.bool)
    # Chunks of queries keep the (time, source, destination) keys of a window small.
    for lo in range(0, index.numel(), chunk):
        sl = slice(lo, lo + chunk)
        out[sl] = _not_true_edges(src, dst, t, index[sl], negatives[sl], num_nodes)
    return out


def _not_true_edges(
    src: torch.Tensor,
    dst: torch.Tensor,
    t: torch.Tensor,
    index: torch.Tensor,
    negatives: torch.Tensor,
    n: int,
) -> torch.Tensor:
    """:func:`filtered_mrr_negatives` on one chunk of queries (a time-sorted stream)."""
    s, tq = src[index], t[index]
    # Events at the queries' times lie in one contiguous slice of the stream.
    lo = int(torch.searchsorted(t, tq.min().reshape(1))[0])
    hi = int(torch.searchsorted(t, tq.max().reshape(1), right=True)[0])
    ws, wd, wt = src[lo:hi], dst[lo:hi], t[lo:hi]
    times, t_rank = torch.unique(wt, return_inverse=True)
    if times.numel() * n * n >= 1 << 62:
        raise ValueError(f"{n} nodes: (time, source, destination) keys would overflow int64")
    true_keys = torch.unique((t_rank * n + ws) * n + wd)
    q_rank = torch.searchsorted(times, tq)
    keys = (q_rank[:, None] * n + s[:, None]) * n + negatives
    # A binary search of each key among the window's few sorted keys: torch.isin sorts
    # the queries' keys with them (q per query, far more than the window's events).
    at = torch.searchsorted(true_keys, keys).clamp_max(true_keys.numel() - 1)
    return true_keys[at] != keys


#: Offsets of the evaluation streams of the historical and inductive protocols from the
#: random protocol's stream, so the three never share draws.
_PROTOCOL_STREAM = {"random": 0, "historical": 1 << 22, "inductive": 2 << 22}


def protocol_order(selected: str, all_protocols: bool) -> list[str]:
    """The negative columns an evaluation draws: the selected protocol first.

    Args:
        selected: ``eval.negatives``.
        all_protocols: Whether the other protocols are scored too.

    Returns:
        Protocol names, one per negative column.
    """
    if selected not in PROTOCOLS:
        raise ValueError(f"unknown negative protocol {selected!r} (one of {PROTOCOLS})")
    if not all_protocols:
        return [selected]
    return [selected] + [p for p in PROTOCOLS if p != selected]


def eval_negative_columns(
    protocols: list[str],
    candidates: torch.Tensor,
    sampler: EvalNegatives | None,
    seed: int,
    stream: int,
    index: torch.Tensor,
    batch_start: int,
    batch_stop: int,
    batch_size: int | None = None,
) -> torch.Tensor:
    """One negative per event and protocol.

    The random column is the draw of :func:`sven.pipeline.negatives.sample_negatives`
    on ``stream``, so ``eval.negatives=random`` evaluates exactly as before the
    protocols existed.

    Args:
        protocols: Column protocols (:func:`protocol_order`).
        candidates: (C,) int64 destinations of the random protocol.
        sampler: The historical/inductive sampler (None when only random is drawn).
        seed: Run seed.
        stream: The split's evaluation stream.
        index: (B,) int64 global event indices.
        batch_start: First event of the global batch.
        batch_stop: One past its last event.
        batch_size: With it, [batch_start, batch_stop) holds many global batches of
            this many events (a whole split drawn at once, as batch by batch).

    Returns:
        (B, len(protocols)) int64 destinations.
    """
    from sven.pipeline.negatives import sample_negatives

    cols = []
    for p in protocols:
        if p == "random":
            cols.append(sample_negatives(seed, stream, index, candidates, 1)[:, 0])
        else:
            if sampler is None:
                raise ValueError(f"{p} evaluation negatives need an EvalNegatives sampler")
            s = stream + _PROTOCOL_STREAM[p]
            b = batch_size or max(batch_stop - batch_start, 1)
            cols.append(sampler.draw_batches(p, seed, s, index, batch_start, batch_stop, b))
    return torch.stack(cols, dim=1)
