"""The components the :class:`~sven.engine.trainer.Trainer` orchestrates.

Each component owns one part of a run's state and says what of it a checkpoint needs
through ``state_dict()`` / ``load_state_dict(state)`` (the contract is in
docs/contracts.md, "Trainer components"):

* :class:`Data`: the event store, its splits, the partition (owner and assignment
  maps), the device-resident event tables, the T-CSR sampler and the evaluation
  negatives table. All of it follows from the config and the store; its state_dict is
  the identity a checkpoint must match (partition, world size, node and event counts).
* the model (a :class:`~sven.models.MemoryModel`, an ``nn.Module``) and the memory shard
  (:class:`~sven.models.MemoryState`) have their own state_dicts;
* the exchange (:class:`~sven.pipeline.exchange.FixedExchange`, under a process group):
  its byte counters;
* :class:`Optimizer`: Adam with this run's device flags;
* the checkpointer (:class:`~sven.engine.checkpoint.RunCheckpoints`): the run's checkpoint
  folders;
* :class:`Evaluator`: evaluation passes, their metrics and :class:`EvalResult`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from sven.engine.metrics import average_precision, batched_link_metrics, mrr
from sven.engine.startup import StartupClock, lean_adam, undecorated
from sven.errors import ConfigError, DataError
from sven.models import MemoryModel
from sven.pipeline.batch import Batch
from sven.pipeline.eval_negatives import (
    EvalNegatives,
    eval_negative_columns,
    filtered_mrr_negatives,
)
from sven.pipeline.negatives import sample_negatives

if TYPE_CHECKING:
    from sven.pipeline.exchange import FixedExchange

__all__ = [
    "EVAL_STREAM",
    "MRR_STREAM",
    "SPLITS",
    "Data",
    "EvalResult",
    "Evaluator",
    "Optimizer",
    "eval_result",
    "owned_nodes",
    "predict_comm",
]

# Negative streams of evaluation are fixed per split, independent of the epoch, so every
# run and every epoch evaluates against the same negatives.
EVAL_STREAM = {"train": (1 << 20) + 2, "val": 1 << 20, "test": (1 << 20) + 1}
MRR_STREAM = {"train": (1 << 21) + 2, "val": 1 << 21, "test": (1 << 21) + 1}
SPLITS = ("train", "val", "test")


def owned_nodes(owner: torch.Tensor, rank: int) -> torch.Tensor:
    """Global ids of the vertices ``rank`` owns, in shard row order (ascending id)."""
    return torch.nonzero(owner == rank).flatten()


# ---------------------------------------------------------------------------- data
class Data:
    """The event store, its splits and partition, on this rank's device.

    Built in two steps: the constructor loads the store and the partition (what the
    model's construction needs: feature widths, training events); :meth:`attach` then
    builds what depends on the model (the T-CSR sampler, the event tables of the step).

    Args:
        cfg: The run's config (``data``, ``dist``, ``train``, ``model`` sections are read).
        rank: This rank.
        world_size: Number of ranks P.
        device: Where the event tensors live.
        dtype: Floating type of features.
        agree: Rank 0's value on every rank (a no-op on one process).

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
    ) -> None:
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.device, self.dtype = device, dtype
        self._agree = agree
        self._clock = clock or StartupClock()
        self._load()
        self._partition()
        self.sampler: Any = None
        self.tables: Any = None
        self.sample_roots = "none"
        self.read_neighbors = False
        self._eval_neg: EvalNegatives | None = None

    def _load(self) -> None:
        path = self.cfg.data.path
        if not path:
            from sven.datasets.synth import default_dataset

            path = str(default_dataset())
        clock = self._clock
        ev = self._open_store(path)
        self.events = ev
        self.dataset_name = ev.meta.get("name") or Path(path).name
        self.num_nodes = int(ev.num_nodes)
        dev = self.device
        t_dev = time.perf_counter()
        # Ids travel in the store's width (int32 for most graphs) and widen on the
        # device: half the bytes read into host memory and copied.
        self.src = torch.from_numpy(np.array(ev.src)).to(dev).to(torch.int64)
        self.dst = torch.from_numpy(np.array(ev.dst)).to(dev).to(torch.int64)
        self.t = torch.as_tensor(np.array(ev.t), device=dev)
        self.edge_feat = (
            None
            if ev.edge_feat is None
            else torch.as_tensor(np.array(ev.edge_feat), device=dev).to(self.dtype)
        )
        # Node features of one process are loaded whole; on several ranks each rank
        # holds only its own vertices' rows (owned_node_feat), once owners are known.
        self.node_feat: torch.Tensor | None = None
        if self.world_size == 1 and ev.node_feat is not None:
            self.node_feat = torch.as_tensor(np.array(ev.node_feat), device=dev).to(self.dtype)
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

    def _open_store(self, path: str) -> Any:
        """Loads the store (structure checked); verifies its checksums once, on rank 0.

        Rank 0's verdict is shared, so that every rank stops with the same error (a
        missing store too) instead of the others waiting for rank 0 in a collective,
        and only rank 0 says it.
        """
        from sven.datasets.store import open_verified_store, verify_store

        ev, problem = None, None
        try:
            if not Path(path).is_dir():
                raise ConfigError(
                    f"data.path: no event store at {path} (create one with `sven data convert`)"
                )
            # Structure on every rank, checksums (every byte) on rank 0; one function
            # for every command that reads a store (sven.datasets.store).
            with self._clock.phase("store_open"):
                ev = open_verified_store(path, verify=False)
            if self.cfg.data.verify and self.rank == 0:
                with self._clock.phase("checksums"):
                    verify_store(ev, "set data.verify=false to train anyway")
        except (ConfigError, DataError) as exc:
            problem = (type(exc) is ConfigError, str(exc))
        problem = self._agree(problem)
        if problem is not None or ev is None:
            kind, text = problem or (False, "the store could not be opened on this rank")
            err = ConfigError(text) if kind else DataError(text)
            err.quiet = self.rank != 0 and problem is not None
            raise err
        return ev

    def _partition(self) -> None:
        """owner (N,) and assign (E,): from a partition folder, computed, or all rank 0."""
        n, e = self.num_nodes, int(self.src.numel())
        p = self.world_size
        if p == 1:
            self.owner = torch.zeros(n, dtype=torch.int64, device=self.device)
            self.assign = torch.zeros(e, dtype=torch.int64, device=self.device)
            self.partition_meta: dict[str, Any] = {"strategy": "single", "parts": 1}
        else:
            dc = self.cfg.dist
            if dc.partition:
                from sven.partition import load_partition
                from sven.partition.store import check_matches

                part = load_partition(dc.partition)
                try:
                    check_matches(part, self.events, dc.partition)
                except DataError as exc:
                    raise ConfigError(f"dist.partition: {exc}") from None
                owner, assign = np.asarray(part.owner), np.asarray(part.assign)
                meta = dict(part.meta)
                if int(meta.get("parts", p)) != p:
                    raise ConfigError(
                        f"dist.partition {dc.partition} has {meta.get('parts')} parts "
                        f"but {p} ranks run"
                    )
                if owner.shape[0] != n or assign.shape[0] != e:
                    raise ConfigError(
                        f"dist.partition {dc.partition} does not match the data "
                        f"at {self.cfg.data.path}"
                    )
            else:
                owner = np.zeros(n, dtype=np.int64)
                assign = np.zeros(e, dtype=np.int64)
                meta = {"strategy": dc.strategy, "parts": p}
                if self.rank == 0:
                    from sven.partition.api import partition_arrays
                    from sven.partition.cost import Access

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

            ev = self.events
            tcsr = TCSR.from_events(ev.src, ev.dst, ev.t, self.num_nodes, device=self.device)
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


def predict_comm(
    cfg: Any, data: Data, model: MemoryModel, exchange: FixedExchange
) -> dict[str, Any]:
    """The partition cost model's prediction of epoch 0's exchange, per rank.

    Computed with the runtime's own sampler, row widths and the model's access
    pattern (which roots are sampled, whether neighbours are read or get mail), so
    that the measured bytes of epoch 0 must equal it exactly.
    """
    report = comm_report(cfg, data, model, exchange)
    return {
        "comm_bytes_predicted_epoch0_per_rank": report.bytes_sent.tolist(),
        "comm_bytes_naive_predicted_epoch0_per_rank": report.naive_bytes.tolist(),
        "comm_max_over_mean_predicted": float(
            report.bytes_sent.max() / max(report.bytes_sent.mean(), 1.0)
        ),
    }


def comm_report(
    cfg: Any, data: Data, model: MemoryModel, exchange: FixedExchange, per_batch: bool = False
) -> Any:
    """The cost model's replay of epoch 0 (:func:`sven.partition.cost.comm_cost`) with
    this run's sampler, row widths and access pattern; ``per_batch`` keeps the counts of
    every batch (``report.batches``)."""
    from sven.partition.cost import Access, RowBytes, comm_cost
    from sven.pipeline.exchange import ID_BYTES

    tc = cfg.train
    lo, hi = data.ranges["train"]
    if tc.max_batches:
        hi = min(hi, lo + tc.max_batches * tc.batch_size)
    sampler = None
    if data.sampler is not None:
        smp = data.sampler

        def sampler(
            nodes: torch.Tensor, times: torch.Tensor, keys: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            dev = data.device
            block = smp.sample(nodes.to(dev), times.to(dev), keys=keys.to(dev))[0]
            return block.nbr.cpu(), block.mask.cpu()

    ev = data.events
    report = comm_cost(
        ev.src,
        ev.dst,
        ev.t,
        data.owner.cpu().numpy(),
        data.assign.cpu().numpy(),
        batch_size=tc.batch_size,
        k=cfg.model.num_neighbors if sampler else 0,
        num_neg=tc.num_neg,
        seed=tc.seed,
        epoch=0,
        start=lo,
        stop=hi,
        parts=data.world_size,
        candidates=data.candidates.cpu().numpy(),
        sampler=sampler,
        access=Access.of(model),
        widths=RowBytes(
            read=exchange.read_codec.row_bytes,
            write=exchange.write_codec.row_bytes,
            id=ID_BYTES,
        ),
        per_batch=per_batch,
    )
    return report


# ----------------------------------------------------------------------- optimizer
class Optimizer(torch.optim.Adam):
    """Adam with this run's implementation flags: the fused kernel, on CUDA with its
    step count on the device (so the optimizer step can be captured in a CUDA graph).
    On CPU too the fused step is one C++ loop instead of a Python loop of small ops per
    parameter (TGN's 23 tensors: 0.24 ms against 0.82 ms per step, one thread).

    Its state_dict is Adam's; :meth:`load_state_dict` accepts one saved by any run (CPU
    or GPU) and applies this run's flags.

    ``lean`` (the default, unless the run compiles): torch's ``step``, ``zero_grad``,
    ``add_param_group`` and ``state_dict`` run without the ``torch._dynamo`` wrappers
    torch puts around them for ``torch.compile``. Those wrappers import torch's
    compiler front end (and with it triton) at the first call, which took as long as
    importing torch itself; outside compilation they do nothing else, so the same code
    runs and the results are the same (:func:`sven.engine.startup.undecorated`).

    Args:
        params: The model's parameters.
        lr: Learning rate.
        device: Where the parameters live.
        lean: Call torch's methods without their compiler wrappers.
    """

    def __init__(self, params: Any, lr: float, device: torch.device, *, lean: bool = True) -> None:
        flags = {"cuda": {"fused": True, "capturable": True}, "cpu": {"fused": True}}
        self._flags = flags.get(device.type, {})
        self._lean = lean and lean_adam()
        super().__init__(params, lr=lr, **self._flags)

    def _call(self, name: str, base: type, *args: Any) -> Any:
        if self._lean:
            return undecorated(getattr(base, name))(self, *args)
        return getattr(super(), name)(*args)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, without its compiler wrapper (``lean``)."""
        self._call("add_param_group", torch.optim.Optimizer, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, without its compiler wrapper (``lean``)."""
        self._call("zero_grad", torch.optim.Optimizer, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's, without its compiler wrapper (``lean``)."""
        return self._call("state_dict", torch.optim.Optimizer)

    def step(self, closure: Any = None) -> Any:
        """Adam's step; ``lean``: without the wrapper that imports ``torch._dynamo`` for
        a graph break, keeping what it does in eager mode (gradients off)."""
        if not self._lean:
            return super().step(closure)
        prev = torch.is_grad_enabled()
        torch.set_grad_enabled(self.defaults["differentiable"])
        try:
            return undecorated(torch.optim.Adam.step)(self, closure)
        finally:
            torch.set_grad_enabled(prev)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads Adam state saved by any run, with this run's flags."""
        for g in state_dict.get("param_groups", []):
            for k in ("fused", "capturable"):
                g[k] = self._flags.get(k, False)
        self._call("load_state_dict", torch.optim.Optimizer, state_dict)


# ----------------------------------------------------------------------- evaluator
@dataclass
class EvalResult:
    """Scores of one evaluation pass over a split, in global event order.

    Attributes:
        pos: (n,) positive logits.
        neg: (n,) logits of the one evaluation negative of each event (``eval.negatives``).
        mrr_neg: (n, q) logits of the MRR negatives, or None.
        mrr_valid: (n, q) bool, False for MRR negatives filtered out as true edges.
        protocol_neg: Logits (n,) of the negatives of the other protocols, by name.
    """

    pos: torch.Tensor
    neg: torch.Tensor
    mrr_neg: torch.Tensor | None = None
    mrr_valid: torch.Tensor | None = None
    protocol_neg: dict[str, torch.Tensor] = field(default_factory=dict)


def eval_result(
    scores: torch.Tensor,
    protocols: list[str],
    protocol_cols: int,
    mrr: int,
    mrr_valid: torch.Tensor | None,
) -> EvalResult:
    """Splits (n, 1 + protocol_cols + mrr) scores into an :class:`EvalResult`.

    Columns: the positive, one negative per protocol column (the first is
    ``eval.negatives``; ``protocols`` names the scored ones), then the MRR negatives.
    """
    return EvalResult(
        scores[:, 0],
        scores[:, 1],
        scores[:, 1 + protocol_cols :] if mrr else None,
        mrr_valid,
        {p: scores[:, 1 + i] for i, p in enumerate(protocols) if i > 0},
    )


class Evaluator:
    """Evaluation passes over a split and their metrics (AP, AUC, inductive, MRR).

    A pass walks the split in global batches without gradients and carries the memory
    on (validation continues training's memory, test validation's). The pass is the
    step's (``fast``, :meth:`sven.engine.step.Step.evaluate`: the same captured path as
    training, on every world size); this component computes the metrics.

    The evaluator keeps no state between passes (its negatives are functions of the
    seed, the split and the event): its state_dict is empty.

    Args:
        cfg: The run's config.
        data: The run's :class:`Data`.
        model: The model.
    """

    def __init__(self, cfg: Any, data: Data, model: MemoryModel) -> None:
        self.cfg, self.data, self.model = cfg, data, model
        #: The step's pass (the trainer sets it).
        self.fast: Callable[[str], EvalResult] | None = None
        #: Makes a progress bar (description, events); the trainer sets it.
        self.progress: Callable[[str, int], Any] | None = None

    def evaluate(self, split: str) -> EvalResult:
        """Walks a split without gradients, updating memory; returns all scores."""
        if self.fast is None:
            raise RuntimeError("Evaluator.fast is not set: the trainer sets the step's pass")
        return self.fast(split)

    def _gather_rows(
        self, idx: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' (index, row) pairs on every rank (one padded all_gather)."""
        p, dev = self.data.world_size, self.data.device
        if p == 1:
            return idx, rows
        n = torch.tensor([idx.numel()], device=dev)
        sizes = [torch.zeros_like(n) for _ in range(p)]
        dist.all_gather(sizes, n)
        m = int(max(int(s) for s in sizes))
        pad_idx = torch.full((m,), -1, dtype=torch.int64, device=dev)
        pad_idx[: idx.numel()] = idx
        pad_rows = torch.zeros(m, rows.shape[1], dtype=rows.dtype, device=dev)
        pad_rows[: rows.shape[0]] = rows
        gi = [torch.empty_like(pad_idx) for _ in range(p)]
        gr = [torch.empty_like(pad_rows) for _ in range(p)]
        dist.all_gather(gi, pad_idx)
        dist.all_gather(gr, pad_rows)
        gi_t, gr_t = torch.cat(gi), torch.cat(gr)
        keep = gi_t >= 0
        return gi_t[keep], gr_t[keep]

    def split_metrics(self, split: str, res: EvalResult) -> dict[str, float]:
        """AP/AUC (mean of per-batch values, and pooled), inductive, MRR of a split."""
        b = self.cfg.train.batch_size
        inductive = self.data.inductive
        out: dict[str, float] = {}
        # Rank metrics on float32 scores: float64 runs on P ranks differ from one process
        # in the last bits (reduction order), which would otherwise break exact ties (e.g.
        # two nodes with the same memory) in a different direction and move AP.
        res = EvalResult(
            res.pos.float(),
            res.neg.float(),
            None if res.mrr_neg is None else res.mrr_neg.float(),
            res.mrr_valid,
            {k: v.float() for k, v in res.protocol_neg.items()},
        )

        def per_batch(pos: torch.Tensor, neg: torch.Tensor) -> tuple[float, float]:
            # All batches at once on the run's device (the batches' sorts are the cost),
            # equal to a per-batch loop of link_metrics to the last bit.
            dev = self.data.device
            return batched_link_metrics(pos.to(dev), neg.to(dev), b)

        out[f"{split}_ap"], out[f"{split}_auc"] = per_batch(res.pos, res.neg)
        labels = torch.cat([torch.ones_like(res.pos), torch.zeros_like(res.neg)])
        out[f"{split}_ap_pooled"] = average_precision(
            torch.cat([res.pos, res.neg]).to(self.data.device), labels.to(self.data.device)
        )
        if split in inductive:
            m = inductive[split]
            out[f"{split}_ap_inductive"], out[f"{split}_auc_inductive"] = per_batch(
                res.pos[m], res.neg[m]
            )
            out[f"{split}_inductive_events"] = int(m.sum())
        for name, neg in res.protocol_neg.items():
            # The other evaluation protocols: test_<protocol>neg_ap[_inductive] etc.
            p = f"{split}_{name}neg"
            out[f"{p}_ap"], out[f"{p}_auc"] = per_batch(res.pos, neg)
            if split in inductive:
                m = inductive[split]
                out[f"{p}_ap_inductive"], out[f"{p}_auc_inductive"] = per_batch(res.pos[m], neg[m])
        if res.mrr_neg is not None:
            out[f"{split}_mrr"] = mrr(res.pos, res.mrr_neg, res.mrr_valid)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Empty: an evaluation pass starts from the memory and model it is given."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accepts the empty state; anything else is another evaluator's."""
        if state:
            raise ValueError(f"Evaluator has no state; got keys {sorted(state)}")
