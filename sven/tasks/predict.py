"""Questions to a trained model: link scores, top-k destinations, node embeddings.

:class:`Predictor` loads a link-prediction checkpoint and answers, for any time t:
the score of candidate links (u, v, t), the k most likely destinations of a source, and
node embeddings (for a downstream model). Ids are the user's raw ids (the store's id
map), never the compact ones.

What the model knows at time t. A query after the checkpoint's time (every event the
checkpoint's node state has seen is before t) is answered from that node state: the
memory, last-update times and mailboxes the run saved, read from the checkpoint's
memory-mapped files for the query's nodes and their sampled neighbours only, never the
whole state, with no replay (``memory="checkpoint"``, the default), and with nothing of
the graph's size built for it (:mod:`sven.tasks.stored`: no trainer, no node state of
every node, a neighbour index of the queried nodes' events only). That state is the
run's own, built while its parameters were being trained, as ``sven eval`` continues
its test split from it; it has not seen the events after the checkpoint's time (for the
best model, those of the test split). The checkpoint's time is the last event its
memory folded in: the end of validation for an epoch's checkpoint or the best model,
the last trained batch for one taken mid-epoch.

A query at an earlier time, or every query with ``memory="replay"``, is answered from a
replay: the memory is replayed through the event stream with
the checkpoint's parameters, from the start, in evaluation's batches (each split in
batches of ``train.batch_size`` from its first event). With ``replay="batch"`` (the
default) a query at t is answered from the memory at the last batch boundary at or
before the first event at or after t, which is exactly what ``sven eval`` uses for an
event of the stream at t (so that the scores of a stream's events equal the ones
``sven eval`` computes, for distinct event times); ``replay="exact"`` also applies the
events of that last, partial batch that are before t (then undone), so every event
strictly before t is in the memory. In both, the sampled temporal neighbours are the
events strictly before t, from the event store's T-CSR, in both ways of answering. A
replay's memory at the checkpoint's position equal to the checkpoint's node state gives
the same answers as that state (``tests/integration/test_predict_stored.py``). Queries
are sorted by time and answered in batches of ``query_batch`` roots, one walk of the
stream for all of them, on the GPU when the run's device is one.

Times outside the stream: before its first event a query sees no history (empty
memory, no neighbours); after its last one, the memory of the whole stream when
replayed, the checkpoint's when read from it (the model knows nothing that happened
after the stream ended, or after the checkpoint's time). Both are said on stderr, with
counts.

Unknown ids: ``unknown="fail"`` raises a :class:`~sven.errors.DataError` naming the
rows and ids; ``"skip"`` leaves those rows' scores NaN (the output keeps one row per
input row) and says how many on stderr.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sven.errors import ConfigError, DataError
from sven.tasks.ids import IdMaps
from sven.tasks.query_files import read_pairs, write_table
from sven.tasks.replay import (
    checkpoint_position,
    encode_events,
    open_run,
    run_config,
    split_stream,
)
from sven.tasks.stored import QuerySource, StateTable, StoredRun, events_before, unique_ids

if TYPE_CHECKING:
    from sven.engine.trainer import Trainer
    from sven.models.memory import MemoryRows

#: Reads the node state of a batch's nodes (U,): the replayed memory or the checkpoint's.
ReadRows = Callable[[torch.Tensor], "MemoryRows"]

__all__ = ["Predictor", "checkpoint_position", "read_pairs", "write_table"]

#: Random stream of query batches (uniform neighbour sampling of query roots).
QUERY_STREAM = (1 << 22) + 7


class Predictor:
    """A trained link-prediction model, ready for questions at any time.

    Args:
        checkpoint: A run folder (its best model) or a ``step-N`` checkpoint folder.
        data: The event store, when not the one the run names (it must be the one the
            model was trained on: the same fingerprint, :mod:`sven.datasets.identity`).
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:N``.
        replay: ``batch`` or ``exact`` (see the module docstring).
        memory: ``checkpoint``: queries after the checkpoint's time are answered from its
            node state, earlier ones from a replay; ``replay``: every query from a
            replay of the stream (see the module docstring).
        query_batch: Query roots embedded per forward pass.
        threads: torch CPU threads (0: torch's default).
        log: Where notes go (stderr by default).
        other_store: Apply the model to ``data`` although it is another store than the
            one it was trained on (same feature widths); a note says so.

    Example:
        >>> p = sven.Predictor("runs/wiki-tgn")
        >>> p.score(["12", "40"], ["7", "7"], [2.6e6, 2.6e6])
        array([0.91, 0.12], dtype=float32)
    """

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        data: str | Path | None = None,
        device: str = "auto",
        replay: str = "batch",
        memory: str = "checkpoint",
        query_batch: int = 20000,
        threads: int = 0,
        log: Callable[[str], None] | None = None,
        other_store: bool = False,
    ) -> None:
        if replay not in ("batch", "exact"):
            raise ConfigError(f"replay must be batch or exact, got {replay!r}")
        if memory not in ("checkpoint", "replay"):
            raise ConfigError(f"memory must be checkpoint or replay, got {memory!r}")
        overrides = [f"train.device={device}", f"train.threads={threads}"]
        if data is not None:
            overrides.append(f"data.path={data}")
        self.log = log or (lambda msg: print(f"sven: {msg}", file=sys.stderr, flush=True))
        self._open = (overrides, other_store)
        # The node-state files are checked chunk by chunk as their rows are read; a
        # replay's trainer verifies the whole checkpoint when it opens it.
        self.checkpoint, state, cfg = run_config(
            checkpoint, overrides, other_store=other_store, lazy=True
        )
        #: The model, the store and the checkpoint's node-state files, with nothing of the
        #: graph's size in memory (:class:`~sven.tasks.stored.StoredRun`).
        self.run = StoredRun(self.checkpoint, state, cfg, other_store=other_store)
        if self.run.note is not None:
            self.log(f"note: {self.run.note}")
        self.cfg, self.model = cfg, self.run.model
        self.replay = replay
        self.query_batch = max(1, int(query_batch))
        self.events = self.run.events
        # The store's column, memory-mapped: queries are placed in it by a binary search
        # (_events_before), never by a copy of it.
        self.times = self.events.t
        b = cfg.train.batch_size
        ranges = self.run.ranges
        # Evaluation's batch boundaries: each split from its first event in steps of B.
        starts = [np.arange(lo, hi, b) for lo, hi in ranges.values()]
        self._starts = np.unique(np.concatenate([*starts, [self.times.shape[0]]]))
        self._split_of = np.array([_split_at(ranges, int(s)) for s in self._starts])
        self._pos = 0
        self._tr: Trainer | None = None
        self._ids = IdMaps(self.events)
        #: Events the checkpoint's node state has seen (its memory's position in the
        #: stream), or None where queries are all replayed.
        self.stored_events: int | None = None
        #: The rows (a share of N) from which a question reads the node state it needs in
        #: one pass over the checkpoint's files in file order, instead of each batch's
        #: rows where they lie (:meth:`_stored_source`).
        self.wide_fraction = WIDE_FRACTION
        # The node state a wide question read, kept for later questions it covers.
        self._stored_table: StateTable | None = None
        if memory == "checkpoint":
            self.stored_events = self._stored_position(state, other_store)
        else:
            # Every query replays: the trainer now, as part of opening the model.
            self._tr = self.tr

    @property
    def tr(self) -> Trainer:
        """The trainer a replay walks the stream with (:func:`open_run`): the run's whole
        node state and event tables, built at the first question that needs a replay."""
        if self._tr is None:
            overrides, other_store = self._open
            # The note on another store was said when the run was opened.
            self._tr, _, _ = open_run(
                self.checkpoint, overrides, other_store=other_store, log=lambda m: None
            )
            self._tr.memory.reset()
        return self._tr

    def _stored_position(self, state: dict[str, Any], other_store: bool) -> int | None:
        """Where in the stream the checkpoint's node state is, or None when it has none
        that this store can use (another store's, a node classifier's own)."""
        if other_store and self.run.note is not None:
            return None  # another store's memory: its rows are not this store's nodes
        pos = checkpoint_position(state, self.run.ranges, self.cfg.train.batch_size)
        if pos is None or self.run.state_files() is None:
            return None
        return pos

    @property
    def checkpoint_time(self) -> float | None:
        """The time of the last event the checkpoint's node state has seen (None: no
        usable node state; -inf: it has seen none)."""
        p = self.stored_events
        if p is None:
            return None
        return float(self.times[p - 1]) if p > 0 else -np.inf

    # ------------------------------------------------------------------ ids
    @property
    def num_nodes(self) -> int:
        """N, the store's node count."""
        return self.run.num_nodes

    def compact_ids(
        self, raw: Sequence[Any] | np.ndarray, side: str = "auto"
    ) -> tuple[np.ndarray, np.ndarray]:
        """Compact ids of raw ones: (n,) int64 (-1 where unknown) and (n,) bool known.

        Args:
            raw: The user's ids (ints or strings, as in the converted file).
            side: ``src`` or ``dst`` on a bipartite store (separate id spaces);
                ``auto``: the one id space of a non-bipartite store.
        """
        return self._ids.lookup(np.asarray(raw), side)

    def raw_ids(self, compact: np.ndarray) -> np.ndarray:
        """The raw ids of compact ones (the store's id map)."""
        return self._ids.raw(np.asarray(compact, dtype=np.int64))

    def _known(
        self, what: str, raw: np.ndarray, side: str, unknown: str, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        ids, known = self.compact_ids(raw, side)
        if not known.all():
            bad = np.flatnonzero(~known)
            rows = bad if rows is None else rows[bad]
            shown = ", ".join(f"row {r}: {_plain(raw[i])!r}" for r, i in zip(rows[:5], bad[:5]))
            more = f" and {bad.size - 5} more" if bad.size > 5 else ""
            if unknown == "fail":
                raise DataError(
                    f"{bad.size} {what} not in the store's id map ({shown}{more}); "
                    "pass --unknown skip to leave their rows' scores empty"
                )
            self.log(
                f"skipped {bad.size} rows whose {what} the store does not know ({shown}{more})"
            )
        return ids, known

    # ----------------------------------------------------------------- times
    def _positions(self, t: np.ndarray) -> np.ndarray:
        """(n,) events strictly before each time; says what happens outside the stream."""
        if not np.isfinite(t).all():
            bad = np.flatnonzero(~np.isfinite(t))
            raise DataError(f"query times must be finite numbers; row {bad[0]} has {t[bad[0]]}")
        ts = self.times
        if ts.size:
            before, after = int((t <= ts[0]).sum()), int((t > ts[-1]).sum())
            if before:
                self.log(
                    f"{before} queries at or before the stream's first event (t={ts[0]}): "
                    "answered with no history (empty memory, no neighbours)"
                )
            stored = self.stored_events is not None
            if after and not stored:
                self.log(
                    f"{after} queries after the stream's last event (t={ts[-1]}): answered "
                    "with the memory of the whole stream"
                )
        pos = events_before(self.times, t)
        if self.stored_events is not None and ts.size:
            late = pos >= self.stored_events
            if late.any():
                unseen = int((pos[late] > self.stored_events).sum())
                self.log(
                    f"{int(late.sum())} queries after the checkpoint's time "
                    f"(t={self.times[self.stored_events - 1] if self.stored_events else '-inf'}): "
                    "answered from its node state, no replay"
                    + (
                        f" ({unseen} of them later than events it has not seen, e.g. the "
                        "test split; --memory replay replays the stream up to each query)"
                        if unseen
                        else ""
                    )
                )
        return pos

    # ---------------------------------------------------------------- replay
    def _advance(self, target: int) -> None:
        """Replays the stream's batches from the current position to boundary ``target``."""
        tr = self.tr
        if target < self._pos:
            tr.memory.reset()
            self._pos = 0
        i = int(np.searchsorted(self._starts, self._pos))
        while self._starts[i] < target:
            lo, hi = int(self._starts[i]), int(self._starts[i + 1])
            encode_events(tr, lo, hi, split_stream(self._split_of[i]))
            i += 1
        self._pos = target

    def _states(self, pos: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
        """Groups of queries (sorted by position) that share one memory state:
        (boundary, events before the query, query rows)."""
        base = self._starts[np.searchsorted(self._starts, pos, side="right") - 1]
        key = pos if self.replay == "exact" else base
        order = np.argsort(key, kind="stable")
        groups = []
        cuts = np.flatnonzero(np.diff(key[order])) + 1
        for rows in np.split(order, cuts):
            if rows.size:
                r0 = rows[0]
                groups.append((int(base[r0]), int(key[r0]), rows))
        return groups

    def _answer(
        self,
        pos: np.ndarray,
        fn: Callable[[np.ndarray, QuerySource], None],
        nodes_of: Callable[[np.ndarray], np.ndarray],
        what: str = "queries",
    ) -> None:
        """Calls ``fn(rows, source)`` for each group of queries with ``source`` what they
        are answered from: the checkpoint's node state for those after its time (one
        group), the replayed memory at each other group's state. ``nodes_of(rows)``: the
        nodes the stored group embeds (its sampler holds their neighbours only);
        ``what``: the queries' name in the line that gives the stored group's times."""
        later = np.zeros(pos.shape, dtype=bool)
        if self.stored_events is not None:
            later = pos >= self.stored_events
            if later.any():
                rows = np.flatnonzero(later)
                t0 = time.perf_counter()
                nodes = nodes_of(rows)
                source, how = self._stored_source(nodes)
                self._warm_up(source, nodes[:1])
                t1 = time.perf_counter()
                fn(rows, source)
                t2 = time.perf_counter()
                # The state's read and the index apart from the scoring (a question's
                # figures, whatever its size: sven predict's last line adds the rest).
                self.log(
                    f"{rows.size} {what} from the checkpoint's node state: load "
                    f"{t1 - t0:.2f} s ({how}), score {t2 - t1:.2f} s "
                    f"({rows.size / max(t2 - t1, 1e-9):,.0f} {what}/s)"
                )
        rest = np.flatnonzero(~later)
        if rest.size == 0:
            return  # no replay: no trainer, no state of the whole graph
        tr = self.tr
        source = self._replay_source()
        for base, upto, rows in self._states(pos[rest]):
            rows = rest[rows]
            self._advance(base)
            if upto <= base:
                fn(rows, source)
                continue
            # The partial batch [base, upto) of exact replay, undone afterwards.
            saved = self._apply_partial(base, upto)
            try:
                fn(rows, source)
            finally:
                nodes, rows_saved = saved
                with torch.no_grad():
                    tr.memory.put_rows(nodes, rows_saved)

    @torch.no_grad()
    def _warm_up(self, src: QuerySource, node: np.ndarray) -> None:
        """Embeds compact ``node`` (1,) at the checkpoint's time from ``src`` and scores
        it against itself, the result dropped: a model's first call on a device pays for
        its start (kernels loaded, libraries' handles made), no question's cost."""
        dev, at = self.run.device, self.checkpoint_time
        h, _ = self._embed_unique(
            node, np.full(1, at if at is not None and np.isfinite(at) else 0.0), src
        )
        src.model.decoder(h, h)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _apply_partial(self, lo: int, hi: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        tr, d = self.tr, self.tr.data
        i = int(np.searchsorted(self._starts, lo))
        idx = d.event_index(lo, hi)
        batch = d.batch(idx, lo, split_stream(self._split_of[i]), 0)
        with torch.no_grad():
            _, dense = tr.model.encode(batch, tr.memory.gather(batch.nodes))
            nodes = torch.unique(
                torch.cat([dense.nodes[dense.key >= 0], dense.mail_nodes[dense.mail_key >= 0]])
            )
            saved = {k: v[nodes].clone() for k, v in tr.memory.full.items()}
            tr.memory.commit_dense(dense)
        return nodes, saved

    def _replay_source(self) -> QuerySource:
        """The trainer's replayed memory and its tables of the whole stream."""
        tab = self.tr.data.tables
        nf, ef = tab.node_feat, tab.edge_feat
        return QuerySource(
            self.tr.model, self.tr.memory.gather, tab.sampler,
            (lambda n: None) if nf is None else (lambda n: nf[n]),
            None if ef is None else (lambda eid: ef[eid]),
        )  # fmt: skip

    def _stored_source(self, nodes: np.ndarray) -> tuple[QuerySource, str]:
        """The checkpoint's node state of the (compact) ``nodes`` a group embeds, their
        neighbours and their features, read for these nodes only
        (:class:`~sven.tasks.stored.StoredRun`), and a few words on how.

        The neighbour index of ``nodes`` comes first: with it, every node whose state the
        group can read (the nodes, and their neighbours where the model reads those). A
        few of them are read batch by batch, the rows each batch needs, from the files'
        memory maps. Where they number at least ``wide_fraction`` of N, they are read
        once, in one pass over the files in file order
        (:meth:`~sven.tasks.stored.StoredRun.state_table`), and each batch indexes them
        on the device; a later question whose nodes that read holds uses it again."""
        run = self.run
        nodes = unique_ids(nodes)
        sampler = run.sampler(nodes)
        index = "" if sampler is None else f"; an index of {sampler.num_entries:,} events"
        wanted = nodes
        if sampler is not None and self.model.read_neighbors:
            wanted = unique_ids(nodes, sampler.neighbours)
        read: ReadRows = run.state_rows
        table = self._stored_table
        if table is not None and table.covers(wanted):
            read, how = table.read, f"{table.num_rows:,} rows read before"
        elif wanted.size >= self.wide_fraction * self.num_nodes:
            table = self._stored_table = None  # its memory back before the next read
            table = self._stored_table = run.state_table(wanted)
            read, how = table.read, f"{wanted.size:,} of {self.num_nodes:,} rows in file order"
        else:
            how = f"rows of at most {wanted.size:,} nodes, batch by batch"
        edge = run.edge_rows if run.edge_dim else None
        return QuerySource(self.model, read, sampler, run.node_rows, edge), how + index

    # ------------------------------------------------------------ embeddings
    @torch.no_grad()
    def _embed_unique(
        self, nodes: np.ndarray, t: np.ndarray, src: QuerySource
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings of compact ``nodes`` (n,) at times ``t`` (n,), each distinct
        (node, time) once: (U, d) and (n,) the row of each query in them, both on the
        device.

        A node's embedding at t is a function of the node state, the node and t (its
        neighbours are the events before t, uniform draws keyed by (node, t)): a million
        pairs over a hundred thousand nodes at one time embed each node once. The
        distinct keys are found on the device (a sort of n keys on the host took as long
        as embedding them on a GPU), in ascending order, as ``np.unique`` gives them.
        """
        dev = self.run.device
        keys = torch.from_numpy(_query_keys(nodes, t)).to(dev)
        n_ = torch.from_numpy(np.ascontiguousarray(nodes, dtype=np.int64)).to(dev)
        t_ = torch.from_numpy(np.ascontiguousarray(t, dtype=np.float64)).to(dev)
        uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        # Each distinct key's first query.
        first = torch.full_like(uniq, keys.numel())
        first.scatter_reduce_(0, inverse, torch.arange(keys.numel(), device=dev), "amin")
        if not (torch.equal(n_[first][inverse], n_) and torch.equal(t_[first][inverse], t_)):
            # Two (node, time) of one key (a hash collision, never seen): no sharing.
            first = inverse = torch.arange(keys.numel(), device=dev)
        return self._embed_now(n_[first], t_[first], keys[first], src), inverse.reshape(-1)

    def _embed_now(
        self, nodes: torch.Tensor, t: torch.Tensor, keys: torch.Tensor, src: QuerySource
    ) -> torch.Tensor:
        """(n, d) embeddings of compact ``nodes`` (n,) int64 at times ``t`` (n,) float64
        from ``src`` (its node state, neighbours and features); ``keys`` (n,) int64 the
        queries' random keys (:func:`_query_keys`: their uniform neighbour draws,
        whatever the batches they fall in); all three on the device."""
        from sven.pipeline.batch import make_batch

        dev, dtype, model = self.run.device, self.run.dtype, src.model
        model.eval()
        out = []
        for s in range(0, nodes.numel(), self.query_batch):
            n_ = torch.as_tensor(nodes[s : s + self.query_batch], dtype=torch.int64, device=dev)
            t_ = torch.as_tensor(t[s : s + self.query_batch], dtype=torch.float64, device=dev)
            k = n_.numel()
            index = torch.as_tensor(keys[s : s + self.query_batch], dtype=torch.int64, device=dev)
            batch = make_batch(
                index, n_, n_, t_, torch.zeros(k, 0, dtype=torch.int64, device=dev),
                sampler=src.sampler, sample_roots=model.sample_roots,
                read_neighbors=model.read_neighbors, rng=(self.cfg.train.seed, QUERY_STREAM, 0),
            )  # fmt: skip
            batch.node_feat = src.node_rows(batch.nodes)
            if src.edge_rows is not None:
                # The query is no event: no features of its own (they only enter the
                # write-back, which a query never commits), its neighbours' as stored.
                batch.edge_feat = torch.zeros(k, self.run.edge_dim, dtype=dtype, device=dev)
                if batch.block is not None:
                    mask = batch.block.mask[..., None].to(dtype)
                    batch.nbr_edge_feat = src.edge_rows(batch.block.eid) * mask
            h, _ = model.encode(batch, src.read(batch.nodes))
            out.append(h[:k])
        if not out:
            return torch.zeros(0, model.embed_dim, dtype=dtype, device=dev)
        return torch.cat(out)

    def _embed_at(self, nodes: np.ndarray, t: np.ndarray) -> torch.Tensor:
        """(n, d) embeddings of compact nodes, each at its time, in input order."""
        h = torch.zeros(nodes.size, self.model.embed_dim, dtype=self.run.dtype)

        def fill(rows: np.ndarray, src: QuerySource) -> None:
            hu, inv = self._embed_unique(nodes[rows], t[rows], src)
            h[torch.as_tensor(rows)] = hu[torch.as_tensor(inv, device=hu.device)].cpu()

        self._answer(self._positions(t), fill, lambda rows: nodes[rows], "nodes")
        return h

    # -------------------------------------------------------------- public
    def score(
        self,
        src: Sequence[Any] | np.ndarray,
        dst: Sequence[Any] | np.ndarray,
        t: Sequence[float] | np.ndarray,
        *,
        unknown: str = "fail",
        logits: bool = False,
    ) -> np.ndarray:
        """Scores of links (src[i], dst[i], t[i]): (n,) float32 probabilities.

        Args:
            src: Raw source ids.
            dst: Raw destination ids.
            t: Times (the store's time unit).
            unknown: ``fail`` or ``skip`` (NaN scores) for rows with an unknown id.
            logits: Return the decoder's logits instead of sigmoid probabilities.
        """
        src, dst = np.asarray(src), np.asarray(dst)
        t = np.asarray(t, dtype=np.float64)
        if not (src.shape == dst.shape == t.shape) or src.ndim != 1:
            raise DataError(f"src, dst and t must be equal-length lists; got {src.shape}, "
                            f"{dst.shape}, {t.shape}")  # fmt: skip
        _check_unknown(unknown)
        s, ks = self._known("source ids", src, "src", unknown)
        d, kd = self._known("destination ids", dst, "dst", unknown)
        ok = np.flatnonzero(ks & kd)
        out = np.full(src.size, np.nan, dtype=np.float32)
        if ok.size == 0:
            return out
        s, d, t = s[ok], d[ok], t[ok]
        z = torch.zeros(ok.size)
        dev = self.run.device

        def fill(rows: np.ndarray, src: QuerySource) -> None:
            # Pairs a block at a time (their distinct (node, time) embedded once), the
            # decoder a pass's worth of pairs at a time: a million pairs of distinct
            # times never hold 2 * 10^6 embeddings at once.
            for a in range(0, rows.size, _PAIR_BLOCK):
                r = rows[a : a + _PAIR_BLOCK]
                m = r.size
                hu, inv = self._embed_unique(np.concatenate([s[r], d[r]]), np.tile(t[r], 2), src)
                inv_t = torch.as_tensor(inv, device=hu.device)
                with torch.no_grad():
                    for b in range(0, m, self.query_batch):
                        e = min(m, b + self.query_batch)
                        hs, hd = hu[inv_t[b:e]].to(dev), hu[inv_t[m + b : m + e]].to(dev)
                        zs = src.model.decoder(hs, hd)
                        z[torch.as_tensor(r[b:e])] = zs.float().cpu()

        self._answer(
            self._positions(t), fill, lambda rows: np.concatenate([s[rows], d[rows]]), "pairs"
        )
        out[ok] = (z if logits else torch.sigmoid(z)).numpy()
        return out

    def embed(
        self,
        nodes: Sequence[Any] | np.ndarray,
        t: float | Sequence[float] | np.ndarray,
        *,
        side: str = "auto",
        unknown: str = "fail",
    ) -> np.ndarray:
        """Node embeddings at time t: (n, embed_dim) float32 (NaN rows for skipped ids).

        Args:
            nodes: Raw node ids.
            t: One time for all, or one per node.
            side: ``src`` or ``dst`` on a bipartite store (see :meth:`compact_ids`).
            unknown: ``fail`` or ``skip``.
        """
        raw = np.asarray(nodes)
        t = np.broadcast_to(np.asarray(t, dtype=np.float64), raw.shape).copy()
        _check_unknown(unknown)
        ids, known = self._known("node ids", raw, side, unknown)
        out = np.full((raw.size, self.model.embed_dim), np.nan, dtype=np.float32)
        ok = np.flatnonzero(known)
        if ok.size:
            out[ok] = self._embed_at(ids[ok], t[ok]).float().numpy()
        return out

    def topk(
        self,
        src: Sequence[Any] | np.ndarray,
        t: float | Sequence[float] | np.ndarray,
        k: int,
        *,
        candidates: Sequence[Any] | np.ndarray | None = None,
        unknown: str = "fail",
    ) -> tuple[np.ndarray, np.ndarray]:
        """The k highest-scoring destinations of each source at its time.

        Args:
            src: Raw source ids (n,).
            t: One time for all, or one per source.
            k: How many (at most the number of candidates).
            candidates: Raw destination ids to rank; None: every node that is a
                destination of some event of the stream (on a bipartite store, the
                destination side).
            unknown: ``fail`` or ``skip``, for sources and candidates alike.

        Returns:
            Raw destination ids (n, k) and their probabilities (n, k), best first; a
            skipped source's row has NaN scores (and the first candidate's id).
        """
        _check_unknown(unknown)
        raw = np.asarray(src)
        t = np.broadcast_to(np.asarray(t, dtype=np.float64), raw.shape).copy()
        s, ks = self._known("source ids", raw, "src", unknown)
        if candidates is None:
            cand = self.run.candidates()
        else:
            craw = np.asarray(candidates)
            cand, kc = self._known("candidate ids", craw, "dst", unknown)
            cand = np.unique(cand[kc])
        if cand.size == 0:
            raise DataError("no candidate destinations to rank")
        k = min(int(k), cand.size)
        if k <= 0:
            raise ConfigError(f"--topk must be positive, got {k}")
        ids = np.full((raw.size, k), cand[0], dtype=np.int64)
        scores = np.full((raw.size, k), np.nan, dtype=np.float32)
        ok = np.flatnonzero(ks)
        c = cand.size

        def rank(rows: np.ndarray, src: QuerySource) -> None:
            # The candidates at the group's time(s): one embedding per (candidate, time).
            q = ok[rows]
            times = np.unique(t[q])
            for tt in times:
                sel = q[t[q] == tt]
                hu, inv = self._embed_unique(
                    np.concatenate([s[sel], cand]), np.full(sel.size + c, tt), src
                )
                h = hu[torch.as_tensor(inv, device=hu.device)]
                h_s, h_c = h[: sel.size], h[sel.size :]
                with torch.no_grad():
                    for a in range(0, sel.size, max(1, self.query_batch // max(c, 1))):
                        hs = h_s[a : a + max(1, self.query_batch // max(c, 1))]
                        z = src.model.decoder(hs[:, None, :].expand(-1, c, -1), h_c[None].expand(
                            hs.shape[0], -1, -1))  # fmt: skip
                        top = torch.topk(z.float(), k, dim=1)
                        r = sel[a : a + hs.shape[0]]
                        ids[r] = cand[top.indices.cpu().numpy()]
                        scores[r] = torch.sigmoid(top.values).cpu().numpy()

        if ok.size:
            self._answer(
                self._positions(t[ok]),
                rank,
                lambda rows: np.concatenate([s[ok[rows]], cand]),
                "sources",
            )
        return self.raw_ids(ids), scores


#: A question whose nodes with their neighbours number at least this share of N reads
#: their node state in one pass over the checkpoint's files (Predictor.wide_fraction).
#: Past it, random rows would touch most of each file's digest chunks (a chunk holds
#: hundreds of rows), each row read through a page fault and each chunk checked anyway.
WIDE_FRACTION = 1 / 64

#: Pairs whose distinct (node, time) are embedded together (at most twice as many
#: embeddings held at once).
_PAIR_BLOCK = 1 << 19


def _query_keys(nodes: np.ndarray, t: np.ndarray) -> np.ndarray:
    """(n,) int64 random keys of queries (node, time), the same for the same query in
    any batch and any call: a hash of the node and the time's bits."""
    bits = np.ascontiguousarray(t, dtype=np.float64).view(np.uint64)
    k = nodes.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    k ^= bits * np.uint64(0xBF58476D1CE4E5B9)
    k ^= k >> np.uint64(31)
    return (k >> np.uint64(1)).astype(np.int64)


def _split_at(ranges: dict[str, tuple[int, ...]], i: int) -> str:
    for s, (lo, hi) in ranges.items():
        if lo <= i < hi:
            return s
    return "test"


def _plain(x: Any) -> Any:
    """A numpy scalar as the Python value it holds (its repr is what a user typed)."""
    return x.item() if isinstance(x, np.generic) else x


def _check_unknown(unknown: str) -> None:
    if unknown not in ("fail", "skip"):
        raise ConfigError(f"unknown must be fail or skip, got {unknown!r}")
