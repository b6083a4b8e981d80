"""The data of a run: the event store, its splits and partition, on this rank's device.

:class:`Data` loads the store (verified), its chronological splits and the partition
(owner of every vertex, rank of every event), and builds what the step reads: the
device-resident event tables, the T-CSR sampler, the evaluation negatives. All of it
follows from the config and the store; its state_dict is the identity a checkpoint
must match (partition, world size, node and event counts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sven.engine.evaluation import EVAL_STREAM, MRR_STREAM
from sven.engine.startup import StartupClock
from sven.errors import ConfigError, DataError
from sven.models import MemoryModel
from sven.pipeline.batch import Batch
from sven.pipeline.eval_negatives import (
    EvalNegatives,
    eval_negative_columns,
    filtered_mrr_negatives,
)
from sven.pipeline.negatives import sample_negatives

__all__ = ["SPLITS", "Data", "check_splits", "most_active", "owned_nodes"]

SPLITS = ("train", "val", "test")


def owned_nodes(owner: torch.Tensor, rank: int) -> torch.Tensor:
    """Global ids of the vertices ``rank`` owns, in shard row order (ascending id)."""
    return torch.nonzero(owner == rank).flatten()


def most_active(
    src: torch.Tensor, dst: torch.Tensor, num_nodes: int, owned: torch.Tensor, limit: int
) -> torch.Tensor:
    """The shard rows of the most active vertices: those with the most events (as
    source or destination, the loads of :func:`sven.partition.graph.vertex_loads`) in
    the whole stream, most first, ties by id; vertices with no event are left out.

    Args:
        src: (E,) int64 source ids, on the device that counts them (the run's columns:
            a GPU counts 10^8 events in well under a second).
        dst: (E,) int64 destination ids, beside them.
        num_nodes: N.
        owned: (N_r,) int64 the global id of each shard row, ascending.
        limit: The most rows returned.

    Returns:
        (min(limit, active),) int64 shard rows, on the CPU.
    """
    counts = torch.bincount(src, minlength=num_nodes) + torch.bincount(dst, minlength=num_nodes)
    local = counts[owned.to(counts.device)]
    rows = torch.nonzero(local).flatten()
    # A stable sort: ties keep their rows' order (ascending id).
    order = torch.sort(local[rows], descending=True, stable=True).indices
    return rows[order][: max(limit, 0)].cpu()


class Data:
    """The event store, its splits and partition, on this rank's device.

    Built in three steps: the constructor opens the store (its structure: what a
    run's plan needs); :meth:`load` verifies its checksums and loads it and the
    partition onto the device (what the model's construction needs: feature widths,
    training events); :meth:`attach` then builds what depends on the model (the T-CSR
    sampler, the event tables of the step).

    Args:
        cfg: The run's config (``data``, ``dist``, ``train``, ``model`` sections are read).
        rank: This rank.
        world_size: Number of ranks P.
        device: Where the event tensors live.
        dtype: Floating type of features.
        agree: Rank 0's value on every rank (a no-op on one process).
        load: Load at once (else call :meth:`load`).

    Attributes:
        src, dst, t: (E,) event endpoints and times, on ``device``.
        edge_feat: (E, edge_dim) edge features or None.
        node_feat: (N, node_dim) node features of one process (None on P ranks, where
            each rank's rows travel with the exchange; see :meth:`owned_node_feat`).
        ranges: Split name -> [lo, hi) event range.
        candidates: (C,) distinct destinations, the negatives' pool.
        inductive: "val"/"test" -> (n,) bool mask of inductive events.
        owner: (N,) owning rank of each vertex; assign: (E,) rank of each event.
        owned: (N_r,) the vertices this rank owns, ascending.
        mrr_source: Where the MRR's negatives come from: "fixed" (the store's),
            "sampled", or None (no MRR); see ``eval.mrr_source``.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        dtype: torch.dtype,
        agree: Callable[[Any], Any],
        clock: StartupClock | None = None,
        load: bool = True,
    ) -> None:
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device, self.dtype = device, dtype
        self._agree = agree
        self._clock = clock or StartupClock()
        self.sampler: Any = None
        self.tables: Any = None
        self.sample_roots = "none"
        self.read_neighbors = False
        self._eval_neg: EvalNegatives | None = None
        self._open()
        if load:
            self.load()

    def _open(self) -> None:
        """Opens the store (its structure, not its checksums: no column is read)."""
        path = self.cfg.data.path
        if not path:
            from sven.datasets.synth import default_dataset

            path = str(default_dataset())
        self.path = path
        self.events = self._agreed(lambda: self._structure(path))
        self.dataset_name = self.events.meta.get("name") or Path(path).name
        self.num_nodes = int(self.events.num_nodes)

    def load(self) -> None:
        """Verifies the store's checksums (rank 0), loads its columns and the partition
        onto the device."""
        if self.cfg.data.verify:
            self._agreed(self._verify)
        self._load()
        self._partition()

    def _load(self) -> None:
        path, ev, clock = self.path, self.events, self._clock
        dev = self.device
        t_dev = time.perf_counter()
        # Ids travel in the store's width (int32 for most graphs) and widen on the
        # device.
        self.src = _column(ev.src, dev, torch.int64)
        self.dst = _column(ev.dst, dev, torch.int64)
        self.t = _column(ev.t, dev)
        self.edge_feat = None if ev.edge_feat is None else _column(ev.edge_feat, dev, self.dtype)
        # Node features of one process are loaded whole; on several ranks each rank
        # holds only its own vertices' rows (owned_node_feat), once owners are known.
        self.node_feat: torch.Tensor | None = None
        if self.world_size == 1 and ev.node_feat is not None:
            self.node_feat = _column(ev.node_feat, dev, self.dtype)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        clock.add("to_device", time.perf_counter() - t_dev)
        t_tab = time.perf_counter()
        self.edge_dim = 0 if self.edge_feat is None else self.edge_feat.shape[1]
        self.node_dim = 0 if ev.node_feat is None else int(ev.node_feat.shape[1])
        self.ranges = {s: tuple(int(x) for x in ev.split_range(s)) for s in SPLITS}
        check_splits(path, self.ranges, self.rank)
        # torch.unique(dst) (sorted distinct destinations) by counting, not sorting.
        self.candidates = torch.nonzero(
            torch.bincount(self.dst, minlength=self.num_nodes)
        ).flatten()
        # TemporalEvents.inductive_mask, from the device columns: the nodes seen in
        # training marked once, then each split's events looked up (host masks, as the
        # metrics index host scores with them).
        seen = torch.zeros(self.num_nodes, dtype=torch.bool, device=dev)
        t_lo, t_hi = self.ranges["train"]
        seen[self.src[t_lo:t_hi]] = True
        seen[self.dst[t_lo:t_hi]] = True
        self.inductive = {}
        for s in ("val", "test"):
            lo, hi = self.ranges[s]
            self.inductive[s] = (~seen[self.src[lo:hi]] | ~seen[self.dst[lo:hi]]).cpu()
        self._mrr_setup(path)
        clock.add("tables", time.perf_counter() - t_tab)

    def _mrr_setup(self, path: str) -> None:
        """Picks the MRR's negatives (``eval.mrr_source``); loads the store's fixed ones.

        Fixed negatives are kept on the host, padded with -1 to one width q (the widest
        split's), and looked up by global event index, so every rank scores the same.
        """
        ec = self.cfg.eval
        sampled = ec.mrr_negatives or self.cfg.train.mrr_negatives
        stored = self.events.eval_negatives
        if ec.mrr_source == "fixed" and not stored:
            raise ConfigError(
                f"eval.mrr_source=fixed: the store at {path} has no fixed negatives; add "
                "them with `sven data negatives STORE --val FILE --test FILE` (TGB's "
                "*_val_ns.pkl / *_test_ns.pkl), or use eval.mrr_source=sampled"
            )
        if ec.mrr_source == "sampled" and not sampled:
            raise ConfigError("eval.mrr_source=sampled needs eval.mrr_negatives > 0")
        self._mrr_fixed: dict[str, torch.Tensor] = {}
        if ec.mrr_source == "fixed" or (ec.mrr_source == "auto" and stored):
            self.mrr_source: str | None = "fixed"
            q = max(int(a.shape[1]) for a in stored.values())
            for split, a in stored.items():
                table = torch.full((a.shape[0], q), -1, dtype=torch.int64)
                table[:, : a.shape[1]] = torch.from_numpy(np.array(a, dtype=np.int64))
                self._mrr_fixed[split] = table
            self._mrr_q = q
        else:
            self.mrr_source = "sampled" if sampled else None
            self._mrr_q = sampled

    def _structure(self, path: str) -> Any:
        from sven.datasets.store import open_verified_store

        if not Path(path).is_dir():
            raise ConfigError(
                f"data.path: no event store at {path} (create one with `sven data convert`)"
            )
        # Structure on every rank; one function for every command that reads a store.
        with self._clock.phase("store_open"):
            return open_verified_store(path, verify=False)

    def _verify(self) -> Any:
        # Checksums (every byte) on rank 0 only.
        from sven.datasets.store import verify_store

        if self.rank == 0:
            with self._clock.phase("checksums"):
                verify_store(self.events, "set data.verify=false to train anyway")
        return self.events

    def _agreed(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, with rank 0's verdict on a data error shared (a missing store too),
        so that every rank stops with the same error instead of the others waiting for
        rank 0 in a collective, and only rank 0 says it."""
        out, problem = None, None
        try:
            out = fn()
        except (ConfigError, DataError) as exc:
            problem = (type(exc) is ConfigError, str(exc))
        problem = self._agree(problem)
        if problem is not None or out is None:
            kind, text = problem or (False, "the store could not be opened on this rank")
            err = ConfigError(text) if kind else DataError(text)
            err.quiet = self.rank != 0 and problem is not None
            raise err
        return out

    def _partition(self) -> None:
        """owner (N,) and assign (E,): from a partition folder, computed, or all rank 0.

        ``dist.partition`` is read and checked on any number of processes (one
        included: a partition of another store, or of another number of parts, is
        refused there as on P ranks), with rank 0's verdict shared, so that a
        refusal is said once.
        """
        n, e = self.num_nodes, int(self.src.numel())
        p = self.world_size
        dc = self.cfg.dist
        folder = self._agreed(self._partition_folder) if dc.partition else None
        if p == 1:
            self.owner = torch.zeros(n, dtype=torch.int64, device=self.device)
            self.assign = torch.zeros(e, dtype=torch.int64, device=self.device)
            self.partition_meta: dict[str, Any] = {"strategy": "single", "parts": 1}
            if folder is not None:
                self.partition_meta = folder[2]
        else:
            if folder is not None:
                owner, assign, meta = folder
            else:
                owner = np.zeros(n, dtype=np.int64)
                assign = np.zeros(e, dtype=np.int64)
                meta = {"strategy": dc.strategy, "parts": p}
                if self.rank == 0:
                    from sven.partition.access import Access
                    from sven.partition.api import partition_arrays

                    ev = self.events
                    res = partition_arrays(
                        ev.src,
                        ev.dst,
                        ev.t,
                        n,
                        p,
                        dc.strategy,
                        train_stop=self.ranges["train"][1],
                        batch_size=self.cfg.train.batch_size,
                        balance=dc.balance,
                        batch_balance=dc.batch_balance,
                        seed=self.cfg.train.seed,
                        k=self.cfg.model.num_neighbors,
                        num_neg=self.cfg.train.num_neg,
                        access=Access.of(self.cfg.model.name),
                    )
                    owner, assign = res.owner, res.assign
            # Rank 0's assignment is the one every rank uses (a partitioner need not be
            # bit-reproducible across processes for this to be exact).
            o = torch.as_tensor(np.asarray(owner, dtype=np.int64))
            a = torch.as_tensor(np.asarray(assign, dtype=np.int64))
            dist.broadcast(o, 0)
            dist.broadcast(a, 0)
            self.owner, self.assign = o.to(self.device), a.to(self.device)
            self.partition_meta = meta
        self.owned = owned_nodes(self.owner, self.rank)

    def _partition_folder(self) -> tuple[Any, Any, dict[str, Any]]:
        """``dist.partition``'s (owner, assign, meta), checked against the store (its
        fingerprint and counts) and the number of ranks.

        Raises:
            ConfigError: Another store's partition, another number of parts, or no
                partition there.
        """
        from sven.partition import load_partition
        from sven.partition.store import check_matches

        dc, p = self.cfg.dist, self.world_size
        try:
            part = load_partition(dc.partition)
            check_matches(part, self.events, dc.partition)
        except DataError as exc:
            raise ConfigError(f"dist.partition: {exc}") from None
        owner, assign = np.asarray(part.owner), np.asarray(part.assign)
        meta = dict(part.meta)
        if int(meta.get("parts", p)) != p:
            ranks = "one process runs" if p == 1 else f"{p} ranks run"
            raise ConfigError(
                f"dist.partition {dc.partition} has {meta.get('parts')} parts but {ranks}"
            )
        if owner.shape[0] != self.num_nodes or assign.shape[0] != int(self.src.numel()):
            raise ConfigError(
                f"dist.partition {dc.partition} does not match the data at {self.cfg.data.path}"
            )
        return owner, assign, meta

    def owned_node_feat(self) -> torch.Tensor | None:
        """(N_r, node_dim) the static features of the owned vertices, or None.

        Only these rows are read from the memory-mapped table; the other ranks' rows
        travel with the fetched memory rows.
        """
        feat = self.events.node_feat
        if feat is None:
            return None
        rows = np.asarray(feat[self.owned.cpu().numpy()])
        return torch.as_tensor(rows, device=self.device).to(self.dtype)

    def attach(self, model: MemoryModel) -> None:
        """Builds the model-dependent parts: the T-CSR sampler and the event tables."""
        from sven.pipeline.stages import EventTables

        mc = self.cfg.model
        self.sample_roots = model.sample_roots
        self.read_neighbors = model.read_neighbors
        self.sampler = None
        if model.sample_roots != "none":
            from sven.pipeline.sampler import TCSR, TemporalSampler

            # From the columns already on the device (the same values as the store's).
            tcsr = TCSR.from_events(self.src, self.dst, self.t, self.num_nodes, device=self.device)
            self.sampler = TemporalSampler(tcsr, [mc.num_neighbors], mc.sampling)
        feat = self.node_feat
        if feat is not None:
            # A zero row for the scratch slot of fixed-size batches.
            feat = torch.cat([feat, feat.new_zeros(1, feat.shape[1])])
        self.tables = EventTables(
            src=self.src,
            dst=self.dst,
            t=self.t,
            edge_feat=self.edge_feat,
            node_feat=feat,
            candidates=self.candidates,
            sampler=self.sampler,
            num_nodes=self.num_nodes,
        )

    @property
    def mrr_negatives(self) -> int:
        """q, the MRR negatives scored per event (0: no MRR): the fixed ones' width
        (the widest split's), else ``eval.mrr_negatives`` (or its older spelling
        ``train.mrr_negatives``)."""
        return self._mrr_q

    def mrr_width(self, split: str) -> int:
        """q for ``split``, or 0 where it reports no MRR: every split has sampled
        negatives, only the splits the store has negatives of have fixed ones."""
        if self.mrr_source == "fixed":
            return self._mrr_q if split in self._mrr_fixed else 0
        return self._mrr_q if self.mrr_source == "sampled" else 0

    def _fixed_rows(self, split: str, idx: torch.Tensor) -> torch.Tensor | None:
        """(B, q) host rows of the stored negatives of the events ``idx`` (-1: padding),
        or None where the split has none."""
        table = self._mrr_fixed.get(split)
        return None if table is None else table[(idx - self.ranges[split][0]).cpu()]

    def mrr_draw(self, split: str, idx: torch.Tensor) -> torch.Tensor:
        """(B, q) int64 MRR negatives of the events ``idx`` (global, of ``split``).

        Sampled ones are keyed by (seed, split, event); fixed ones are the store's rows.
        Padding and splits without fixed negatives get the event's own destination, a
        real node to score that :meth:`mrr_valid` excludes.
        """
        q = self._mrr_q
        if self.mrr_source == "sampled":
            return sample_negatives(self.cfg.train.seed, MRR_STREAM[split], idx, self.candidates, q)
        fill = self.dst[idx][:, None].expand(-1, q)
        rows = self._fixed_rows(split, idx)
        if rows is None:
            return fill.clone()
        rows = rows.to(idx.device)
        return torch.where(rows >= 0, rows, fill)

    def mrr_valid(self, split: str, idx: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """(B, q) bool on the host: the negatives ``neg`` (:meth:`mrr_draw` of the events
        ``idx``) that count: not a true edge of the query's instant (TGB's filter) and,
        with fixed negatives, not padding."""
        valid = filtered_mrr_negatives(self.src, self.dst, self.t, idx, neg, self.num_nodes)
        valid = valid.cpu()
        if self.mrr_source == "fixed":
            rows = self._fixed_rows(split, idx)
            if rows is None:
                return torch.zeros_like(valid)
            valid &= rows >= 0
        return valid

    def num_batches(self, split: str) -> int:
        """Number of global batches of a split at the configured batch size."""
        lo, hi = self.ranges[split]
        b = self.cfg.train.batch_size
        return (hi - lo + b - 1) // b

    def event_index(self, lo: int, hi: int) -> torch.Tensor:
        """Global indices of this rank's events in [lo, hi)."""
        idx = torch.arange(lo, hi, device=self.device)
        if self.world_size == 1:
            return idx
        return idx[self.assign[lo:hi] == self.rank]

    def batch(
        self,
        idx: torch.Tensor,
        start: int,
        stream: int,
        num_neg: int,
        mrr_stream: int | None = None,
        neg: torch.Tensor | None = None,
    ) -> Batch:
        """This rank's part of the global batch that starts at event ``start``.

        ``neg`` (B, n) replaces the uniform negatives (evaluation protocols).
        """
        from sven.pipeline.stages import events_batch

        return events_batch(
            self.tables,
            idx,
            stream,
            start,
            seed=self.cfg.train.seed,
            num_neg=num_neg,
            sample_roots=self.sample_roots,
            read_neighbors=self.read_neighbors,
            mrr_stream=mrr_stream,
            mrr_negatives=self.mrr_negatives if mrr_stream is not None else 0,
            neg=neg,
        )

    def eval_negative_table(self, split: str, protocols: list[str], columns: int) -> torch.Tensor:
        """(n, columns + q) every evaluation negative of a split, drawn in one pass.

        The protocol columns (``protocols``, then copies of the first up to
        ``columns``, so that every split has one width), then the split's q MRR
        negatives (:meth:`mrr_draw`). Each event's draws are those of its global batch
        at the training batch size, as a batch-by-batch walk draws them
        (:meth:`EvalNegatives.draw_batches`).

        Args:
            split: "val" or "test" (or "train").
            protocols: The protocols scored on this split (:func:`protocol_order`).
            columns: Width of the protocol part, >= len(protocols).
        """
        lo, hi = self.ranges[split]
        idx = torch.arange(lo, hi, device=self.device)
        sampler = self.eval_negatives() if protocols != ["random"] else None
        cols = eval_negative_columns(
            protocols,
            self.candidates,
            sampler,
            self.cfg.train.seed,
            EVAL_STREAM[split],
            idx,
            lo,
            hi,
            batch_size=self.cfg.train.batch_size,
        )
        cols = torch.cat([cols, cols[:, :1].expand(-1, columns - cols.shape[1])], 1)
        if self.mrr_negatives:
            cols = torch.cat([cols, self.mrr_draw(split, idx)], 1)
        return cols

    def eval_negatives(self) -> EvalNegatives:
        """The evaluation negative sampler (historical/inductive pair table), built once."""
        if self._eval_neg is None:
            self._eval_neg = EvalNegatives(
                self.src, self.dst, self.num_nodes, self.ranges["train"][1], self.candidates
            )
        return self._eval_neg

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must match: the partition, the store's shape and identity.

        The data themselves follow from the config and the store and are not saved;
        ``store`` is the store's identity (:func:`sven.datasets.identity.store_identity`:
        its fingerprint, path and counts).
        """
        from sven.datasets.identity import store_identity

        return {
            "owner": self.owner.cpu(),
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "num_events": int(self.src.numel()),
            "ranges": {s: list(r) for s, r in self.ranges.items()},
            "store": store_identity(self.events),
        }

    def identity_and_owner(self) -> tuple[dict[str, Any], torch.Tensor]:
        """:meth:`state_dict` without the owner map, and the (N,) owner map: a
        checkpoint keeps the two apart (the map is node-sized; one process has none to
        write)."""
        state = self.state_dict()
        return state, state.pop("owner")

    def load_state_dict(self, state: dict[str, Any], where: str | Path = "checkpoint") -> None:
        """Checks that a checkpoint's data identity is this run's; changes nothing.

        Raises:
            ConfigError: The checkpoint was written by another number of ranks, with
                another partition or on other data (another store fingerprint, where
                the checkpoint recorded one).
        """
        from sven.datasets.identity import identity_problem, store_identity

        problem, _ = identity_problem(
            state.get("store"), store_identity(self.events), str(where), verb="was written on"
        )
        if problem is not None:
            raise ConfigError(problem)
        ws = int(state.get("world_size", 1))
        if ws != self.world_size:
            raise ConfigError(
                f"{where} was written by {ws} ranks; resume it on {ws} ranks "
                f"(this run has {self.world_size})"
            )
        shape = (state.get("num_nodes", self.num_nodes), state.get("num_events", None))
        if shape[1] is not None and shape != (self.num_nodes, int(self.src.numel())):
            raise ConfigError(f"{where} was written on other data")
        if not torch.equal(state["owner"].to(self.device), self.owner):
            raise ConfigError(f"{where} was written with another partition")


def check_splits(path: str, ranges: dict[str, tuple[int, ...]], rank: int) -> None:
    """Empty splits, before any training: train and val are needed, test is reported."""
    import sys

    empty = [s for s in SPLITS if ranges[s][1] <= ranges[s][0]]
    if "train" in empty or "val" in empty:
        which = " and ".join(s for s in empty if s != "test")
        raise DataError(
            f"the {which} split is empty: training needs training events and selects the "
            "best model on val; re-convert with other --val-frac/--test-frac",
            path,
        )
    if "test" in empty and rank == 0:
        print(
            f"sven: warning: {path}: the test split is empty; test metrics will be n/a",
            file=sys.stderr,
            flush=True,
        )


# Columns cross to the device in chunks of this many bytes: host memory holds one chunk
# of a column, not the column (a 10^8-event store's times are 800 MB).
_CHUNK_BYTES = 64 << 20


def _column(arr: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A store column (a memory-mapped array) as a tensor on ``device``, in ``dtype``
    (default: the column's)."""
    if device.type != "cuda":
        host = torch.from_numpy(np.array(arr))
        return host if dtype is None else host.to(dtype)
    n = arr.shape[0]
    kind = torch.from_numpy(np.empty(0, dtype=arr.dtype)).dtype
    out = torch.empty(arr.shape, dtype=dtype or kind, device=device)
    row = max(1, int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize)
    step = max(1, _CHUNK_BYTES // row)
    for a in range(0, n, step):
        # The cast (int32 ids to int64) happens on the device, as .to() did.
        out[a : a + step].copy_(torch.from_numpy(np.array(arr[a : a + step])))
    return out
