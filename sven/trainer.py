"""Training and evaluation, on one process or on P ranks with vertex-owned memory.

One epoch walks the training events in time order in global batches of B; each batch
draws deterministic negatives, samples temporal neighbours, reads the memory of its
unique nodes, runs the model, steps the optimizer and commits the model's memory update.
Validation continues the memory from the end of training and test from the end of
validation ("Training semantics" in docs/design.md).

With P ranks (launched by torchrun, srun or mpirun; see :mod:`sven.dist`), rank r
processes the events of each global batch that the partition assigns to it, reads and
writes memory through :class:`~sven.pipeline.memory_exchange.MemoryExchange`, and
normalises its loss by the global number of predictions, so that the all-reduced
gradient is the one-process gradient ("Distributed semantics"). With P = 1 the same code
runs with the whole memory as the only shard and no collective.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from sven.checkpoint import Checkpointer, find_checkpoint, load_file
from sven.config import Config, dump_config, load_config
from sven.errors import ConfigError, DataError, Stopped, SvenError
from sven.metrics import average_precision, link_metrics, mrr
from sven.models import (
    MemoryModel,
    MemoryRows,
    MemoryState,
    MemoryUpdate,
    model_from_config,
)
from sven.pipeline.batch import Batch
from sven.pipeline.eval_negatives import (
    EvalNegatives,
    eval_negative_columns,
    filtered_mrr_negatives,
    protocol_order,
)
from sven.pipeline.negatives import sample_negatives
from sven.pipeline.rank_step import RankStep, naive_writes, read_occurrences
from sven.tblog import EpochLog
from sven.timeline import STAGES, StepProfiler, Timeline, timeline_line

# Negative streams of evaluation are fixed per split, independent of the epoch, so every
# run and every epoch evaluates against the same negatives.
_EVAL_STREAM = {"train": (1 << 20) + 2, "val": 1 << 20, "test": (1 << 20) + 1}
_MRR_STREAM = {"train": (1 << 21) + 2, "val": 1 << 21, "test": (1 << 21) + 1}
_SPLITS = ("train", "val", "test")
# Signals that stop training after the current step with a checkpoint: scancel and
# preemption send SIGTERM; SLURM's --signal=USR1@N warns N seconds before the time limit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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


def _eval_result(
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


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def owned_nodes(owner: torch.Tensor, rank: int) -> torch.Tensor:
    """Global ids of the vertices ``rank`` owns, in shard row order (ascending id)."""
    return torch.nonzero(owner == rank).flatten()


class Trainer:
    """Trains and evaluates one model on one event store, on one or many ranks.

    Args:
        config: A :class:`~sven.config.Config`, a nested dict, or a path to a YAML preset.
        overrides: Dotted ``key=value`` overrides applied on top.

    Example:
        >>> summary = sven.Trainer("configs/tgn.yaml", ["data.path=stores/uci"]).fit()
    """

    # A stop signal this process received (set by the handler fit() installs), and
    # the all-ranks vote on it from the last step's gradient all-reduce (a tensor, read
    # only after the loss's own host sync).
    _stop_signal: int | None = None
    _stop_votes: torch.Tensor | None = None
    # Where training is, for failure messages.
    _where: str = "start"

    def __init__(
        self, config: Config | dict | str | Path | None = None, overrides: list[str] | None = None
    ):
        if isinstance(config, Config):
            cfg = (
                config if not overrides else load_config(None, _config_overrides(config, overrides))
            )
        elif isinstance(config, dict):
            cfg = Config.from_dict(config)
            if overrides:
                cfg = load_config(None, _config_overrides(cfg, overrides))
        else:
            cfg = load_config(config, overrides)
        self.cfg = cfg
        tc, mc = cfg.train, cfg.model
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if tc.deterministic:
            # cuBLAS reads this once, at its first use in the process.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        from sven.dist import init_distributed

        self.ctx = init_distributed(
            cfg.dist.backend, timeout_s=cfg.dist.timeout_s, device=tc.device
        )
        self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
        self.device = torch.device(self.ctx.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device is cuda but no CUDA device is available")
        self.dtype = torch.float64 if tc.dtype == "float64" else torch.float32
        self.out = Path(cfg.out)
        self.epoch_log = EpochLog(self.out / "tb", cfg.log.tensorboard, main=self.rank == 0)
        self._load_data()
        self._partition()
        torch.manual_seed(tc.seed)
        lo, hi = self.ranges["train"]
        ev = self.events
        self.model: MemoryModel = model_from_config(
            mc,
            edge_dim=self.edge_dim,
            node_dim=self.node_dim,
            train_events=(ev.src[lo:hi], ev.dst[lo:hi], ev.t[lo:hi]),
        ).to(self.device, self.dtype)
        self.memory = MemoryState(
            int(self.owned.numel()),
            mc.memory_dim,
            self.model.mail_dim,
            self.model.mailbox_size,
            self.device,
            self.dtype,
            time_origin=float(self.t[0]) if self.t.numel() else 0.0,
        )
        self.exchange = None
        feat = self.events.node_feat
        if self.world_size > 1:
            from sven.pipeline.memory_exchange import MemoryExchange

            # Only the owned rows are read from the memory-mapped table; the other
            # ranks' rows travel with the fetched memory rows.
            owned_feat = None
            if feat is not None:
                rows = np.asarray(feat[self.owned.cpu().numpy()])
                owned_feat = torch.as_tensor(rows, device=self.device).to(self.dtype)
            self.exchange = MemoryExchange(
                self.owner, self.rank, self.world_size, self.memory, node_feat=owned_feat
            )
        elif feat is not None:
            self.node_feat = torch.as_tensor(np.array(feat), device=self.device).to(self.dtype)
        self.sampler = None
        if self.model.sample_roots != "none":
            from sven.pipeline.sampler import TCSR, TemporalSampler

            ev = self.events
            tcsr = TCSR.from_events(ev.src, ev.dst, ev.t, self.num_nodes, device=self.device)
            self.sampler = TemporalSampler(tcsr, [mc.num_neighbors], mc.sampling)
        from sven.pipeline.stages import EventTables

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
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=tc.lr, **self._adam_flags())
        self._hooks: dict[str, list[Callable[[Trainer], None]]] = {
            "before_step": [],
            "after_step": [],
        }
        # Per-stage times of each epoch (sven.timeline); the exchange laps its id
        # exchange, and a trace of a few steps where profile=true.
        self.timeline = Timeline(self.device)
        if self.exchange is not None:
            # The id plans of prefetched batches run in the prefetch thread; a lap is
            # taken on the training thread only (the timeline is not thread-safe).
            self.exchange.lap = _main_thread_only(self.timeline.lap)
        self.profiler: StepProfiler | None = None
        if cfg.profile:
            trace = self.out / "traces" / f"rank{self.rank}.json"
            lc = cfg.log
            self.profiler = StepProfiler(trace, self.device, lc.profile_start, lc.profile_steps)
        self.single: _SingleProcessStep | None = None
        self.rank_step: RankStep | None = None
        if self.world_size == 1:
            self.single = _SingleProcessStep(self)
        else:
            from datetime import timedelta

            # The prefetch thread's id exchanges get a group of their own: collectives of
            # two threads must never interleave on one group. Made here, in the same order
            # on every rank. gloo even beside NCCL: the ids are small, their counts go to
            # the host anyway, and two NCCL communicators driven from two threads can
            # deadlock on the device.
            plan_group = dist.new_group(
                list(range(self.world_size)),
                timeout=timedelta(seconds=cfg.dist.timeout_s),
                backend="gloo",
            )
            self.rank_step = RankStep(self, plan_group)
        self.checkpointer = Checkpointer(self.out / "checkpoints", tc.keep_latest_k)
        self.best = Checkpointer(self.out / "best", 1)
        self._log(self.ctx.describe() if self.world_size > 1 else "single process")
        self.predicted_comm = self._predict_comm() if self.world_size > 1 else None

    def add_hook(self, when: str, fn: Callable[[Trainer], None]) -> None:
        """Calls ``fn(trainer)`` before or after every training step, on every rank.

        For observing a run (tests record parameters and memory after each step, or
        interrupt one) without subclassing. An ``after_step`` hook that reads device
        tensors waits for the step to finish, which costs speed on CUDA.

        Args:
            when: "before_step" or "after_step".
            fn: The hook; exceptions propagate out of ``fit``.
        """
        if when not in self._hooks:
            raise ValueError(f"when must be one of {sorted(self._hooks)}, got {when!r}")
        self._hooks[when].append(fn)

    def _adam_flags(self) -> dict[str, bool]:
        """Adam's implementation: on CUDA the fused kernel with its step count on the
        device, so that the optimizer step can be captured in a CUDA graph."""
        if self.device.type == "cuda":
            return {"fused": True, "capturable": True}
        return {}

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        """Loads optimizer state saved by any run (CPU or GPU) with this run's flags."""
        flags = self._adam_flags()
        for g in state.get("param_groups", []):
            for k in ("fused", "capturable"):
                g[k] = flags.get(k, False)
        self.optimizer.load_state_dict(state)

    # ------------------------------------------------------------------ data
    def _load_data(self) -> None:
        path = self.cfg.data.path
        if not path:
            from sven.datasets.synth import default_dataset

            path = str(default_dataset())
        if not Path(path).is_dir():
            raise ConfigError(
                f"data.path: no event store at {path} (create one with `sven data convert`)"
            )
        ev = self._open_store(path)
        self.events = ev
        self.dataset_name = ev.meta.get("name") or Path(path).name
        self.num_nodes = int(ev.num_nodes)
        dev = self.device
        self.src = torch.as_tensor(np.asarray(ev.src, dtype=np.int64), device=dev)
        self.dst = torch.as_tensor(np.asarray(ev.dst, dtype=np.int64), device=dev)
        self.t = torch.as_tensor(np.array(ev.t), device=dev)
        self.edge_feat = (
            None
            if ev.edge_feat is None
            else torch.as_tensor(np.array(ev.edge_feat), device=dev).to(self.dtype)
        )
        # Node features are loaded once the owners are known: on several ranks each
        # rank holds only its own vertices' rows (see __init__).
        self.node_feat: torch.Tensor | None = None
        self.edge_dim = 0 if self.edge_feat is None else self.edge_feat.shape[1]
        self.node_dim = 0 if ev.node_feat is None else int(ev.node_feat.shape[1])
        self.ranges = {s: tuple(int(x) for x in ev.split_range(s)) for s in _SPLITS}
        _check_splits(path, self.ranges, self.rank)
        self.candidates = torch.unique(self.dst)
        self.inductive = {
            s: torch.as_tensor(np.asarray(ev.inductive_mask(s)), dtype=torch.bool)
            for s in ("val", "test")
        }

    def _open_store(self, path: str) -> Any:
        """Loads the store (structure checked); verifies its checksums once, on rank 0.

        Rank 0's verdict is shared, so that every rank stops with the same error
        instead of the others waiting for rank 0 in a collective.
        """
        from sven.datasets.store import TemporalEvents, verify_checksums

        ev = TemporalEvents.load(path)
        if not self.cfg.data.verify:
            return ev
        problem = None
        if self.rank == 0:
            try:
                verify_checksums(ev.path, ev.meta)
            except DataError as exc:
                problem = str(exc)
        problem = self._agree(problem)
        if problem is not None:
            err = DataError(f"{problem} (set data.verify=false to train anyway)")
            err.quiet = self.rank != 0
            raise err
        return ev

    def _claim_out(self) -> None:
        """Rank 0 checks ``out`` (see :func:`prepare_out`); every rank learns its verdict
        before anything is written, and all stop together on a refusal."""
        tc = self.cfg.train
        problem = None
        if self.rank == 0:
            try:
                prepare_out(self.out, resume=tc.resume, overwrite=tc.overwrite, log=self._log)
            except ConfigError as exc:
                problem = str(exc)
        problem = self._agree(problem)
        if problem is not None:
            err = ConfigError(problem)
            err.quiet = self.rank != 0
            raise err

    def _agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a no-op on one process)."""
        if self.world_size == 1:
            return value
        from sven.dist import broadcast_object

        return broadcast_object(value)

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

                part = load_partition(dc.partition)
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

    # --------------------------------------------------------- state access
    def _read(self, batch: Batch) -> MemoryRows:
        """Memory rows of ``batch.nodes``: local on one rank, fetched from owners on many.

        On many ranks the nodes' static features come with the rows and are set as
        ``batch.node_feat``.
        """
        if self.exchange is None:
            return self.memory.gather(batch.nodes)
        rows = self.exchange.fetch(batch.nodes, read_occurrences(batch))
        self.timeline.lap("row_fetch")
        if rows.node_feat is not None:
            batch.node_feat = rows.node_feat
        return rows

    def _commit(self, update: MemoryUpdate, batch: Batch) -> None:
        """Writes a batch's memory update: locally, or pushed to the owners."""
        if self.exchange is None:
            self.memory.commit(update)
            return
        self.exchange.push(update, naive_writes(self, batch))

    def _event_index(self, lo: int, hi: int) -> torch.Tensor:
        """Global indices of this rank's events in [lo, hi)."""
        idx = torch.arange(lo, hi, device=self.device)
        if self.world_size == 1:
            return idx
        return idx[self.assign[lo:hi] == self.rank]

    def _batch(
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
            sample_roots=self.model.sample_roots,
            read_neighbors=self.model.read_neighbors,
            mrr_stream=mrr_stream,
            mrr_negatives=self.mrr_negatives if mrr_stream is not None else 0,
            neg=neg,
        )

    def _empty_update(self) -> MemoryUpdate:
        z = torch.zeros(0, dtype=torch.int64, device=self.device)
        f64 = torch.zeros(0, dtype=torch.float64, device=self.device)
        return MemoryUpdate(
            nodes=z,
            memory=torch.zeros(0, self.memory.memory_dim, dtype=self.dtype, device=self.device),
            last_update=f64,
            key=z,
            mail_nodes=z,
            mail=torch.zeros(0, self.memory.mail_dim, dtype=self.dtype, device=self.device),
            mail_ts=f64,
            mail_key=z,
        )

    # -------------------------------------------------------------- training
    def _allreduce_grads(self, loss: torch.Tensor) -> torch.Tensor:
        """Sums gradients (and the loss) over ranks in one flat all-reduce.

        Plain sum, not DDP's mean: each rank already divides by the global prediction
        count. One bucket also serves ranks with an empty share of the batch, which
        DDP's forward hooks would not. A parameter without gradient on every rank stays
        without one (Adam then skips it, as in one process). One more element carries
        this rank's stop signal (:func:`_stop_vote`), so that every rank learns of a
        signal any rank got after the same step, without a collective of its own.
        """
        params = list(self.model.parameters())
        has = torch.tensor(
            [p.grad is not None for p in params], dtype=self.dtype, device=self.device
        )
        vote = torch.tensor(
            [_stop_vote(self._stop_signal, self.world_size)], dtype=self.dtype, device=self.device
        )
        flat = torch.cat(
            [
                p.grad.reshape(-1)
                if p.grad is not None
                else torch.zeros(p.numel(), dtype=self.dtype, device=self.device)
                for p in params
            ]
            + [has, vote, loss.to(self.dtype).reshape(1)]
        )
        dist.all_reduce(flat)
        p_count = self.world_size
        # Ring all-reduce: each rank sends 2 (P - 1) / P of the buffer.
        self.exchange.counter.grads += int(
            2 * (p_count - 1) * flat.numel() * flat.element_size() // p_count
        )
        off = 0
        n_par = len(params)
        has_all = flat[-2 - n_par : -2]
        self._stop_votes = flat[-2]
        for i, p in enumerate(params):
            n = p.numel()
            p.grad = flat[off : off + n].view_as(p).clone() if has_all[i] > 0 else None
            off += n
        return flat[-1].to(torch.float64)

    def num_batches(self, split: str) -> int:
        """Number of global batches of a split at the configured batch size."""
        lo, hi = self.ranges[split]
        b = self.cfg.train.batch_size
        return (hi - lo + b - 1) // b

    @torch.no_grad()
    def evaluate(self, split: str) -> EvalResult:
        """Walks a split without gradients, updating memory; returns all scores."""
        if self.single is not None:
            return self.single.evaluate(split)
        self.model.eval()
        lo, hi = self.ranges[split]
        b = self.cfg.train.batch_size
        q = self.mrr_negatives
        protocols = protocol_order(
            self.cfg.eval.negatives, self.cfg.eval.all_protocols and split == "test"
        )
        n_neg = len(protocols)
        idx_all, pos, neg = [], [], []
        for start in range(lo, hi, b):
            idx = self._event_index(start, min(start + b, hi))
            negs = eval_negative_columns(
                protocols,
                self.candidates,
                self._eval_negatives() if protocols != ["random"] else None,
                self.cfg.train.seed,
                _EVAL_STREAM[split],
                idx,
                start,
                min(start + b, hi),
            )
            batch = self._batch(
                idx, start, _EVAL_STREAM[split], 1, _MRR_STREAM[split] if q else None, neg=negs
            )
            rows = self._read(batch)
            update = self._empty_update()
            if batch.size > 0:
                out = self.model(batch, rows)
                update = out.update
                idx_all.append(idx)
                pos.append(out.pos)
                neg.append(out.neg)
            self._commit(update, batch)
        idx_t = (
            torch.cat(idx_all) if idx_all else torch.zeros(0, dtype=torch.int64, device=self.device)
        )
        if pos:
            scores = torch.cat([torch.cat(pos)[:, None], torch.cat(neg)], 1)
        else:
            scores = torch.zeros(0, 1 + n_neg + q, dtype=self.dtype, device=self.device)
        idx_t, scores = self._gather_rows(idx_t, scores)
        order = torch.argsort(idx_t)
        scores = scores[order].cpu()
        valid = None
        if q:
            # The MRR negatives are a function of (seed, stream, event): redrawn here for
            # TGB's filter rather than carried through the gather.
            idx_s = idx_t[order]
            mrr_neg = sample_negatives(
                self.cfg.train.seed, _MRR_STREAM[split], idx_s, self.candidates, q
            )
            valid = filtered_mrr_negatives(
                self.src, self.dst, self.t, idx_s, mrr_neg, self.num_nodes
            ).cpu()
        return _eval_result(scores, protocols, n_neg, q, valid)

    def _eval_negatives(self) -> EvalNegatives:
        """The evaluation negative sampler (historical/inductive pair table), built once."""
        if getattr(self, "_eval_neg", None) is None:
            self._eval_neg = EvalNegatives(
                self.src, self.dst, self.num_nodes, self.ranges["train"][1], self.candidates
            )
        return self._eval_neg

    def _gather_rows(
        self, idx: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' (index, row) pairs on every rank (one padded all_gather)."""
        if self.world_size == 1:
            return idx, rows
        n = torch.tensor([idx.numel()], device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n)
        m = int(max(int(s) for s in sizes))
        pad_idx = torch.full((m,), -1, dtype=torch.int64, device=self.device)
        pad_idx[: idx.numel()] = idx
        pad_rows = torch.zeros(m, rows.shape[1], dtype=rows.dtype, device=self.device)
        pad_rows[: rows.shape[0]] = rows
        gi = [torch.empty_like(pad_idx) for _ in range(self.world_size)]
        gr = [torch.empty_like(pad_rows) for _ in range(self.world_size)]
        dist.all_gather(gi, pad_idx)
        dist.all_gather(gr, pad_rows)
        gi_t, gr_t = torch.cat(gi), torch.cat(gr)
        keep = gi_t >= 0
        return gi_t[keep], gr_t[keep]

    def split_metrics(self, split: str, res: EvalResult) -> dict[str, float]:
        """AP/AUC (mean of per-batch values, and pooled), inductive, MRR of a split."""
        b = self.cfg.train.batch_size
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
            if pos.numel() == 0:
                return float("nan"), float("nan")
            aps, aucs = zip(
                *(link_metrics(pos[i : i + b], neg[i : i + b]) for i in range(0, pos.numel(), b))
            )
            return float(np.mean(aps)), float(np.mean(aucs))

        out[f"{split}_ap"], out[f"{split}_auc"] = per_batch(res.pos, res.neg)
        labels = torch.cat([torch.ones_like(res.pos), torch.zeros_like(res.neg)])
        out[f"{split}_ap_pooled"] = average_precision(torch.cat([res.pos, res.neg]), labels)
        if split in self.inductive:
            m = self.inductive[split]
            out[f"{split}_ap_inductive"], out[f"{split}_auc_inductive"] = per_batch(
                res.pos[m], res.neg[m]
            )
            out[f"{split}_inductive_events"] = int(m.sum())
        for name, neg in res.protocol_neg.items():
            # The other evaluation protocols: test_<protocol>neg_ap[_inductive] etc.
            p = f"{split}_{name}neg"
            out[f"{p}_ap"], out[f"{p}_auc"] = per_batch(res.pos, neg)
            if split in self.inductive:
                m = self.inductive[split]
                out[f"{p}_ap_inductive"], out[f"{p}_auc_inductive"] = per_batch(res.pos[m], neg[m])
        if res.mrr_neg is not None:
            out[f"{split}_mrr"] = mrr(res.pos, res.mrr_neg, res.mrr_valid)
        return out

    @property
    def mrr_negatives(self) -> int:
        """``eval.mrr_negatives``, or its older spelling ``train.mrr_negatives``."""
        return self.cfg.eval.mrr_negatives or self.cfg.train.mrr_negatives

    # ----------------------------------------------------------- checkpoints
    def _barrier(self, what: str) -> None:
        if self.world_size > 1:
            from sven.dist import barrier_or_die

            barrier_or_die(self.ctx, what)

    def _rng_state(self) -> dict[str, Any]:
        # Negatives, uniform sampling and dropout are keyed by event and batch (see
        # pipeline/negatives.py) and need no state; torch's is kept for user code.
        return {"torch": torch.get_rng_state()}

    def _set_rng_state(self, s: dict[str, Any]) -> None:
        # Shards load onto the run's device, but torch's RNG state must be a CPU tensor
        # (on a GPU run, resume otherwise fails: "RNG state must be a torch.ByteTensor").
        torch.set_rng_state(s["torch"].cpu())

    def _shard_file(self) -> dict[str, Any]:
        return {
            f"memory-rank{self.rank}": {
                "memory": self.memory.state_dict(),
                "rng": self._rng_state(),
                "rank": self.rank,
                "world_size": self.world_size,
                "comm": self._counter_state(),
            }
        }

    def _save(self, ck: Checkpointer, step: int, state: dict[str, Any]) -> None:
        ck.save(
            step,
            {
                **state,
                "owner": self.owner.cpu(),
                "world_size": self.world_size,
                "config": self.cfg.to_dict(),
            },
            self._shard_file(),
            rank=self.rank,
            world_size=self.world_size,
            barrier=self._barrier,
        )

    def _latest(self, ck: Checkpointer) -> int | None:
        """The newest valid checkpoint, as judged by rank 0 for all ranks."""
        step = ck.latest() if self.rank == 0 else None
        if self.world_size > 1:
            from sven.dist import broadcast_object

            step = broadcast_object(step)
        return step

    def _load_shard(self, ck: Checkpointer, step: int) -> dict[str, Any]:
        """Loads rank 0's state and this rank's memory shard of a checkpoint."""
        state = ck.load(step, map_location=self.device)
        _check_resume_config(state, self.cfg, ck.path(step), self.rank)
        ws = int(state.get("world_size", 1))
        if ws != self.world_size:
            raise ConfigError(
                f"checkpoint {ck.path(step)} was written by {ws} ranks; resume it on {ws} ranks "
                f"(this run has {self.world_size})"
            )
        if not torch.equal(state["owner"].to(self.device), self.owner):
            raise ConfigError(f"checkpoint {ck.path(step)} was written with another partition")
        shard = ck.load(step, f"memory-rank{self.rank}", map_location=self.device)
        self.memory.load_state_dict(shard["memory"])
        state["rng"] = shard["rng"]
        state["comm"] = shard.get("comm", {})
        return state

    # ------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        """Trains with early stopping on val AP, then evaluates the best model on test.

        SIGTERM and SIGUSR1 (:data:`STOP_SIGNALS`) stop training after the step that
        follows them, on every rank at the same step, with a checkpoint; the previous
        handlers are back when fit returns.

        Returns:
            The summary (also written to ``<out>/summary.json`` by rank 0).

        Raises:
            Stopped: A stop signal arrived; the checkpoint is written (exit code 75).
            DistError: A rank died or hung; the message names it (exit code 4).
        """
        restore = self._catch_stop_signals()
        peer_lost = False
        try:
            return self._fit()
        except RuntimeError as exc:
            if self.world_size == 1 or not _is_comm_failure(exc):
                raise
            from sven.dist import DistError

            peer_lost = True
            # A peer died or hung inside a collective; gloo/NCCL then raise a bare
            # RuntimeError that does not say which. The heartbeats do (sven.dist).
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            diag = self.ctx.diagnose_failure()
            peers = list(diag.ranks)
            timeout = self.cfg.dist.timeout_s
            if peers:
                who = diag.reason
            elif self.world_size == 2:
                peers = [1 - self.rank]
                who = f"rank {peers[0]} died or did not answer within {timeout:.0f} s, see its log"
            else:
                who = f"another rank died or did not answer within {timeout:.0f} s, see the logs"
            raise DistError(
                f"rank {self.rank}: a collective failed at {self._where} ({first}); {who}. "
                "The last complete checkpoint is intact: rerun with train.resume=true",
                ranks=peers,
                what=self._where,
            ) from exc
        finally:
            if getattr(self, "_bar", None) is not None:
                # A bar left open by an error would run into the error's one line.
                self._bar.close()
            try:
                if self.rank_step is not None:
                    # Before the teardown: the prefetch thread may use the plan group.
                    # Its last id exchanges match the peers' unless a peer is gone.
                    self.rank_step.close(finish=not peer_lost)
            finally:
                try:
                    self.ctx.teardown()
                finally:
                    # After the teardown: a SIGTERM that srun sends once another rank
                    # has exited must not kill this one halfway through.
                    restore()

    def _catch_stop_signals(self) -> Callable[[], None]:
        """Makes SIGTERM/SIGUSR1 set a flag; returns what puts the old handlers back.

        Only the main thread may install handlers; elsewhere (a Trainer run in a
        thread) signals keep their handlers and training cannot be stopped by them.
        """
        self._stop_signal = None
        self._stop_votes = None
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: object) -> None:
            # Only a flag: the step boundary where all ranks agree is the train loop's.
            if self._stop_signal is None:
                self._stop_signal = signum

        old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}

        def restore() -> None:
            for s, handler in old.items():
                # None: installed from C; the default is the closest we can put back.
                signal.signal(s, signal.SIG_DFL if handler is None else handler)

        return restore

    def _stop_requested(self) -> int:
        """The stop signal all ranks agreed on after the last step, or 0."""
        if self.world_size == 1:
            return self._stop_signal or 0
        if self._stop_votes is None:
            return 0
        got = _stop_from_votes(round(self._stop_votes.item()), self.world_size)
        # Rank 0 speaks for all: name its own signal where it had one.
        return (self._stop_signal or got) if got else 0

    def _stop(
        self,
        signum: int,
        epoch: int,
        next_batch: int,
        last: int,
        progress: dict[str, Any],
        saved: bool,
    ) -> Stopped:
        """Writes the stop checkpoint (unless this step's periodic one is it).

        Returns:
            The :class:`Stopped` to raise, which says where and what was written.
        """
        step = progress["global_step"]
        if not saved:
            self._save(self.checkpointer, step, self._state(epoch, next_batch, progress))
        name = signal.Signals(signum).name
        path = self.checkpointer.path(step)
        return Stopped(
            f"stopped by {name} at epoch {epoch} step {step} (batch {next_batch} of {last}); "
            f"checkpoint {path}; rerun with train.resume=true",
            signal_name=name,
            checkpoint=path,
            quiet=self.rank != 0,
        )

    def _fit(self) -> dict[str, Any]:
        cfg, tc = self.cfg, self.cfg.train
        wall0 = time.perf_counter()
        main = self.rank == 0
        self._claim_out()
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.out / "config.json")
        self._barrier("start")
        progress: dict[str, Any] = {
            "history": [],
            "best_val_ap": -1.0,
            "best_epoch": -1,
            "bad_epochs": 0,
            "epoch_loss": 0.0,
            "epoch_batches": 0,
            "epoch_time": 0.0,
            "train_time": 0.0,
            "train_events": 0,
            "global_step": 0,
            "stopped": False,
        }
        start_epoch, start_batch = 0, 0
        if tc.resume:
            step = self._latest(self.checkpointer)
            if step is None:
                self._log(f"no checkpoint under {self.out}, starting fresh")
            else:
                st = self._load_shard(self.checkpointer, step)
                self.model.load_state_dict(st["model"])
                self._load_optimizer(st["optimizer"])
                self._set_rng_state(st["rng"])
                progress = st["progress"]
                start_epoch, start_batch = st["cursor"]["epoch"], st["cursor"]["next_batch"]
                if self.exchange is not None and st["comm"]:
                    for k, v in st["comm"].items():
                        setattr(self.exchange.counter, k, v)
                self._log(
                    f"resumed from {self.checkpointer.path(step)} "
                    f"(epoch {start_epoch}, batch {start_batch})"
                )
        if main:
            # metrics.jsonl is rebuilt from the checkpointed history, so lines written
            # after the checkpoint by an interrupted run do not appear twice.
            _atomic_write_text(
                "".join(json.dumps(h) + "\n" for h in progress["history"]),
                self.out / "metrics.jsonl",
            )

        nb = self.num_batches("train")
        lo, hi = self.ranges["train"]
        b = tc.batch_size
        for epoch in range(start_epoch, tc.epochs):
            if progress["stopped"]:
                break
            if start_batch == 0:
                self.memory.reset()
                progress.update(epoch_loss=0.0, epoch_batches=0, epoch_time=0.0)
                if self.exchange is not None:
                    self.exchange.counter.reset()
            last = nb if not tc.max_batches else min(nb, tc.max_batches)
            bar = self._bar = tqdm(
                total=last,
                initial=start_batch,
                desc=f"epoch {epoch}",
                disable=cfg.quiet or not main,
                file=sys.stderr,
                leave=False,
                dynamic_ncols=True,
            )
            tl, prof = self.timeline, self.profiler
            if prof is not None:
                prof.fit(start_batch, last)
            rs = self.rank_step
            if rs is not None:
                if rs.auto and rs.profile is None:
                    rs.choose_micro_batches(epoch, start_batch, last)
                rs.start_epoch(epoch, start_batch, last)
            ep_t0, paused = time.perf_counter(), 0.0
            tl.begin()
            for i in range(start_batch, last):
                self._where = f"epoch {epoch} batch {i}"
                self.ctx.set_step(progress["global_step"])
                g_lo, g_hi = lo + i * b, min(lo + (i + 1) * b, hi)
                for fn in self._hooks["before_step"]:
                    fn(self)
                tl.lap("wait")
                if prof is not None:
                    prof.before(i)
                if self.single is not None:
                    # Nothing is read back: the loss accumulates on the device.
                    self.single.train_batch(epoch, g_lo, g_hi)
                else:
                    loss = rs.step(i)
                    progress["epoch_loss"] += loss
                    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                    if self._hooks["after_step"] and rs.staleness == 0:
                        # Observers see the step's write-back committed.
                        rs.drain()
                if prof is not None:
                    prof.after(i)
                for fn in self._hooks["after_step"]:
                    fn(self)
                progress["epoch_batches"] += 1
                progress["train_events"] += g_hi - g_lo
                progress["global_step"] += 1
                bar.update(1)
                saved = False
                stop = self._stop_requested()
                at_ckpt = (
                    tc.checkpoint_every and (i + 1) % tc.checkpoint_every == 0 and i + 1 < last
                )
                if at_ckpt or stop:
                    tl.pause()  # the checkpoint is no stage of the epoch's training
                    t_save = time.perf_counter()
                    self._flush_step(progress)
                    if at_ckpt:
                        self._save(
                            self.checkpointer,
                            progress["global_step"],
                            self._state(epoch, i + 1, progress),
                        )
                        saved = True
                    paused += time.perf_counter() - t_save
                    tl.begin()
                if stop:
                    bar.close()
                    raise self._stop(stop, epoch, i + 1, last, progress, saved)
            self._flush_step(progress)
            tl.lap("wait")
            if rs is not None:
                rs.close()
            # Wall time of the epoch's training, device work included (the steps run
            # asynchronously; _flush_step waited for them), checkpoints excluded.
            dt = time.perf_counter() - ep_t0 - paused
            if prof is not None:
                prof.close()
            progress["epoch_time"] += dt
            progress["train_time"] += dt
            bar.close()
            start_batch = 0
            epoch_events = min(hi, lo + last * b) - lo
            comm = self._comm_line()
            stages = self._timeline_line(dt)
            self._where = f"epoch {epoch} validation"
            val = self.split_metrics("val", self.evaluate("val"))
            line = {
                "epoch": epoch,
                "train_loss": progress["epoch_loss"] / max(progress["epoch_batches"], 1),
                "val_ap": val["val_ap"],
                "val_auc": val["val_auc"],
                "events_per_s": epoch_events / max(progress["epoch_time"], 1e-9),
                **{k: v for k, v in val.items() if k not in ("val_ap", "val_auc")},
                **comm,
                **stages,
            }
            line = _finite_or_none(line)
            progress["history"].append(line)
            if main:
                with open(self.out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
                self.epoch_log.write(line)
            self._log(
                f"epoch {epoch}: loss {line['train_loss']:.4f} val AP {_fmt(line['val_ap'])} "
                f"AUC {_fmt(line['val_auc'])} ({line['events_per_s']:.0f} events/s)"
            )
            if val["val_ap"] > progress["best_val_ap"]:
                progress.update(best_val_ap=val["val_ap"], best_epoch=epoch, bad_epochs=0)
                self._save(
                    self.best,
                    epoch,
                    {"model": self.model.state_dict(), "epoch": epoch, "memory_phase": "val_end"},
                )
            else:
                progress["bad_epochs"] += 1
                if tc.patience and progress["bad_epochs"] >= tc.patience:
                    progress["stopped"] = True
            progress["global_step"] += 1
            self._save(
                self.checkpointer, progress["global_step"], self._state(epoch + 1, 0, progress)
            )

        step = self._latest(self.best)
        if step is None:
            raise SvenError(f"no valid best model under {self.best.root}")
        best = self._load_shard(self.best, step)
        self.model.load_state_dict(best["model"])
        self._where = "test"
        test = self.split_metrics("test", self.evaluate("test"))
        hist = {h["epoch"]: h for h in progress["history"]}
        best_line = hist.get(best["epoch"], {})
        summary = {
            "model": cfg.model.name,
            "dataset": self.dataset_name,
            "world_size": self.world_size,
            "partition": self.partition_meta.get("strategy"),
            "epochs_run": len(progress["history"]),
            "best_epoch": best["epoch"],
            "val_ap": best_line.get("val_ap"),
            "val_auc": best_line.get("val_auc"),
            "eval_negatives": cfg.eval.negatives,
            "eval_mrr_negatives": self.mrr_negatives,
            **test,
            "train_events_per_s": progress["train_events"] / max(progress["train_time"], 1e-9),
            "wall_s": time.perf_counter() - wall0,
        }
        if self.rank_step is not None:
            rs = self.rank_step
            summary.update(
                pipeline_prefetch=rs.depth,
                pipeline_micro_batches=rs.micro_batches,
                pipeline_staleness=rs.staleness,
            )
            if rs.profile:
                summary["pipeline_micro_batches_profile_s"] = {
                    str(m): t for m, t in rs.profile.items()
                }
        for key in (
            "comm_bytes",
            "comm_bytes_naive",
            "comm_bytes_max_rank",
            "comm_bytes_per_rank",
            "comm_bytes_exchange",
            "comm_bytes_grads",
            "comm_max_over_mean",
        ):
            if key in best_line:
                summary[key] = best_line[key]
        if self.predicted_comm is not None:
            summary.update(self.predicted_comm)
            first = hist.get(0, {})
            if "comm_bytes_exchange_per_rank" in first:
                summary["comm_bytes_measured_epoch0_per_rank"] = first[
                    "comm_bytes_exchange_per_rank"
                ]
                summary["comm_bytes_naive_measured_epoch0_per_rank"] = first[
                    "comm_bytes_naive_per_rank"
                ]
        summary = _finite_or_none(summary)
        if main:
            _atomic_write_text(json.dumps(summary, indent=2) + "\n", self.out / "summary.json")
        self._log(
            f"test AP {_fmt(summary['test_ap'])} AUC {_fmt(summary['test_auc'])} "
            f"(inductive AP {_fmt(summary['test_ap_inductive'])}); "
            f"summary in {self.out / 'summary.json'}"
        )
        return summary

    def _flush_step(self, progress: dict[str, Any]) -> None:
        """Waits for the queued steps and moves the device-side loss into ``progress``.

        On several ranks the pending write-back is committed, so that a checkpoint or
        an evaluation sees it.
        """
        if self.rank_step is not None:
            self.rank_step.drain()
        if self.single is not None:
            progress["epoch_loss"] += self.single.take_loss()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _state(self, epoch: int, next_batch: int, progress: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "cursor": {"epoch": epoch, "next_batch": next_batch},
            "progress": progress,
        }

    # ---------------------------------------------------------------- comm
    def _predict_comm(self) -> dict[str, Any]:
        """The partition cost model's prediction of epoch 0's exchange, per rank.

        Computed with the runtime's own sampler, row widths and the model's access
        pattern (which roots are sampled, whether neighbours are read or get mail), so
        that the measured bytes of epoch 0 must equal it exactly.
        """
        from sven.partition.cost import Access, RowBytes, comm_cost
        from sven.pipeline.memory_exchange import ID_BYTES

        tc = self.cfg.train
        lo, hi = self.ranges["train"]
        if tc.max_batches:
            hi = min(hi, lo + tc.max_batches * tc.batch_size)
        sampler = None
        if self.sampler is not None:
            smp = self.sampler

            def sampler(
                nodes: torch.Tensor, times: torch.Tensor, keys: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
                dev = self.device
                block = smp.sample(nodes.to(dev), times.to(dev), keys=keys.to(dev))[0]
                return block.nbr.cpu(), block.mask.cpu()

        ev = self.events
        report = comm_cost(
            ev.src,
            ev.dst,
            ev.t,
            self.owner.cpu().numpy(),
            self.assign.cpu().numpy(),
            batch_size=tc.batch_size,
            k=self.cfg.model.num_neighbors if sampler else 0,
            num_neg=tc.num_neg,
            seed=tc.seed,
            epoch=0,
            start=lo,
            stop=hi,
            parts=self.world_size,
            candidates=self.candidates.cpu().numpy(),
            sampler=sampler,
            access=Access.of(self.model),
            widths=RowBytes(
                read=self.exchange.read_codec.row_bytes,
                write=self.exchange.write_codec.row_bytes,
                id=ID_BYTES,
            ),
        )
        return {
            "comm_bytes_predicted_epoch0_per_rank": report.bytes_sent.tolist(),
            "comm_bytes_naive_predicted_epoch0_per_rank": report.naive_bytes.tolist(),
            "comm_max_over_mean_predicted": float(
                report.bytes_sent.max() / max(report.bytes_sent.mean(), 1.0)
            ),
        }

    def _counter_state(self) -> dict[str, int]:
        if self.exchange is None:
            return {}
        return dataclasses.asdict(self.exchange.counter)

    def _timeline_line(self, epoch_s: float) -> dict[str, Any]:
        """This epoch's per-stage times of every rank (:mod:`sven.timeline`).

        The timeline's events are read once here; the totals travel as one host
        tensor (the group carries gloo for host tensors under NCCL too).
        """
        totals = self.timeline.epoch_totals()
        mine = torch.tensor([*(totals[s] for s in STAGES), epoch_s], dtype=torch.float64)
        if self.world_size > 1:
            allr = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(allr, mine)
            per = torch.stack(allr)
        else:
            per = mine[None]
        return timeline_line(per[:, :-1], per[:, -1])

    def _comm_line(self) -> dict[str, Any]:
        """Per-rank bytes of this epoch's training, gathered on every rank."""
        if self.exchange is None:
            return {}
        c = self.exchange.counter
        mine = torch.tensor(
            [c.ids, c.read_rows, c.write_rows, c.grads, c.naive],
            dtype=torch.int64,
            device=self.device,
        )
        allr = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(allr, mine)
        per = torch.stack(allr).cpu()
        exch = per[:, 0] + per[:, 1] + per[:, 2]
        total = exch + per[:, 3]
        return {
            "comm_bytes": int(total.sum()),
            "comm_bytes_exchange": int(exch.sum()),
            "comm_bytes_grads": int(per[:, 3].sum()),
            "comm_bytes_naive": int(per[:, 4].sum()),
            "comm_bytes_naive_per_rank": per[:, 4].tolist(),
            "comm_bytes_per_rank": total.tolist(),
            "comm_bytes_exchange_per_rank": exch.tolist(),
            "comm_bytes_max_rank": int(total.max()),
            "comm_max_over_mean": float(exch.max() / max(float(exch.float().mean()), 1.0)),
        }

    # ------------------------------------------------------------- re-eval
    def evaluate_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Re-evaluates a saved model: a run folder (its best), or a ``step-N`` folder.

        A state saved at the end of validation (the best model) continues into test,
        which reproduces the run's summary exactly. Any other state is re-played:
        memory is rebuilt by walking train and val without parameter updates, then
        test runs. Shards of a P-rank checkpoint are assembled when evaluating on one
        process.
        """
        p = find_checkpoint(path)
        state = load_file(p / "state.pt", self.device)
        self.model.load_state_dict(state["model"])
        ws = int(state.get("world_size", 1))
        owner = state["owner"].to(self.device)
        if ws == self.world_size and torch.equal(owner, self.owner):
            shard = load_file(p / f"memory-rank{self.rank}.pt", self.device)
            self.memory.load_state_dict(shard["memory"])
        elif self.world_size == 1:
            full = {k: v.clone() for k, v in self.memory.state_dict().items()}
            for r in range(ws):
                shard = load_file(p / f"memory-rank{r}.pt", self.device)
                rows = owned_nodes(owner, r)
                for k, v in shard["memory"].items():
                    full[k][rows] = v
            self.memory.load_state_dict(full)
        else:
            raise SvenError(
                f"{p} holds {ws} memory shards; evaluate it on {ws} ranks or on one process"
            )
        res: dict[str, Any] = {}
        if state.get("memory_phase") != "val_end":
            self.memory.reset()
            self.evaluate("train")
            res.update(self.split_metrics("val", self.evaluate("val")))
        res.update(self.split_metrics("test", self.evaluate("test")))
        return {
            "model": self.cfg.model.name,
            "dataset": self.dataset_name,
            "checkpoint": str(p),
            **res,
        }

    def _log(self, msg: str, force: bool = False) -> None:
        if self.rank == 0 and (force or not self.cfg.quiet):
            print(msg, file=sys.stderr, flush=True)


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a Sven run: a ``config.json`` that a trainer wrote."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and {"data", "model", "train", "out"} <= set(cfg)


def prepare_out(
    out: Path, *, resume: bool, overwrite: bool, log: Callable[[str], None] = print
) -> None:
    """Checks (and with ``overwrite`` empties) the run folder before training writes.

    A missing or empty ``out`` is used as is. A non-empty one is refused unless it is
    a Sven run folder and ``resume`` (continue it) or ``overwrite`` (delete it first)
    is set, so that the checkpoints of two runs never mix.

    Raises:
        ConfigError: ``out`` may not be used; the message says what to do.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"out={out} is a file, not a folder")
    # On several ranks, this launch's own per-rank logs (``out/logs``, where
    # sven.dist sends torch's C++ output) are there before the trainer starts.
    content = [p for p in out.iterdir() if p.name != "logs"]
    if not content:
        return
    run = is_run_folder(out)
    if overwrite:
        if not run:
            raise ConfigError(
                f"out={out} is not empty and not a Sven run folder (no config.json of "
                "Sven's); train.overwrite=true only deletes a run folder: choose another out"
            )
        import shutil

        for p in content:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        log(f"train.overwrite: deleted the earlier run in {out}")
        return
    if resume:
        if not run:
            raise ConfigError(
                f"out={out} is not empty and not a Sven run folder: nothing to resume there"
            )
        return
    what = "an earlier run" if run else "files that are not a Sven run"
    raise ConfigError(
        f"out={out} already holds {what}; use another out, train.resume=true to continue "
        "it, or train.overwrite=true to replace it"
    )


def _check_resume_config(state: dict[str, Any], cfg: Config, where: Path, rank: int) -> None:
    """Stops a resume whose checkpoint was written with a different config."""
    from sven.config import config_differences

    saved = state.get("config")
    if not isinstance(saved, dict):
        return
    diff = config_differences(saved, cfg)
    if diff:
        err = ConfigError(
            f"train.resume: {where} was written with another config; differing keys: "
            f"{', '.join(diff)}. Resume with the same settings, or use another out"
        )
        err.quiet = rank != 0
        raise err


def _check_splits(path: str, ranges: dict[str, tuple[int, ...]], rank: int) -> None:
    """Empty splits, before any training: train and val are needed, test is reported."""
    empty = [s for s in _SPLITS if ranges[s][1] <= ranges[s][0]]
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


def _stop_vote(signum: int | None, world_size: int) -> int:
    """This rank's term of the summed stop vote: SIGTERM 1, SIGUSR1 ``world_size + 1``.

    A sum of P such terms still says whether any rank got each signal (see
    :func:`_stop_from_votes`); exact in float32 up to P = 4095.
    """
    if signum is None:
        return 0
    return 1 if signum == signal.SIGTERM else world_size + 1


def _stop_from_votes(total: int, world_size: int) -> int:
    """The signal to report from a summed vote (SIGTERM first), or 0 for none."""
    usr1, term = divmod(total, world_size + 1)
    if term:
        return int(signal.SIGTERM)
    return int(signal.SIGUSR1) if usr1 else 0


def _is_comm_failure(exc: BaseException) -> bool:
    """Whether a RuntimeError comes from a broken or timed-out collective."""
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    text = str(exc).lower()
    # gloo's wording varies with where the peer stopped: a dead peer resets the
    # connection, a hung one trips the application timeout ("... caused pair closure").
    marks = ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe", "closure")
    return any(s in text for s in marks)


def _finite_or_none(d: dict[str, Any]) -> dict[str, Any]:
    """Replaces NaN/inf floats by None: JSON has no NaN, and None reads as "undefined"
    (e.g. inductive metrics of a split without inductive events)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _config_overrides(cfg: Config, overrides: list[str]) -> list[str]:
    """Flattens a config into dotted overrides, followed by ``overrides``."""
    flat: list[str] = []

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat.append(f"{prefix}{k}={json.dumps(v)}")

    walk(cfg.to_dict(), "")
    return flat + list(overrides)


class _SingleProcessStep:
    """The one-process step: device-resident event tables, the pure step functions of
    :mod:`sven.step`, and their CUDA-graph capture.

    On CUDA every batch has the configured capacity (the last one padded) and its inputs
    (event range, random streams, prediction count) live in 0-d device tensors refilled
    in place, so one captured graph serves every training batch and another every
    evaluation batch. On CPU the same functions run eagerly on exact-size batches
    (``torch.unique`` de-duplication, which computes less than fixed slots there).
    """

    def __init__(self, tr: Trainer) -> None:
        from sven.step import StepGraph

        self.tr = tr
        tc, dev = tr.cfg.train, tr.device
        self.tables = tr.tables
        self.fixed = dev.type == "cuda"
        self.capacity = tc.batch_size if self.fixed else None
        from sven.pipeline.stages import select_batch

        self.select: Callable[..., Batch] = select_batch
        self.model: Any = tr.model
        if tc.compile and self.fixed:
            # Fixed shapes: one compilation serves every batch. The batch selection
            # stays eager: inductor cannot yet emit its 64-bit hash constants.
            self.model = torch.compile(tr.model, dynamic=False)
        names = ("start", "stop", "stream", "mrr_stream", "split_lo")
        self.inp: dict[str, Any]
        if self.fixed:
            self.inp = {k: torch.zeros((), dtype=torch.int64, device=dev) for k in names}
            self.inp["npred"] = torch.ones((), dtype=torch.float64, device=dev)
        else:
            self.inp = {**dict.fromkeys(names, 0), "npred": 1.0}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        rows = max(hi - lo for lo, hi in tr.ranges.values()) + 1  # + a scratch row
        # Evaluation negatives: one column per protocol (test scores them all), then the
        # MRR negatives; drawn before each pass into a table the captured step reads, so
        # that every split uses one graph of one width.
        ec = tr.cfg.eval
        self.protocols = protocol_order(ec.negatives, ec.all_protocols)
        self.width = len(self.protocols) + tr.mrr_negatives
        self.neg_table = torch.zeros(rows, self.width, dtype=torch.int64, device=dev)
        self._neg_cache: dict[str, torch.Tensor] = {}
        self.scores = torch.zeros(rows, 1 + self.width, dtype=tr.dtype, device=dev)

        def memory_state() -> list[torch.Tensor]:
            return list(tr.memory.full.values())

        log = lambda msg: tr._log(msg, force=True)  # noqa: E731
        self.train_graph = StepGraph(
            self._train,
            mode=tc.cuda_graph,
            device=dev,
            state=lambda: (
                [p.data for p in tr.model.parameters()] + memory_state() + [self.loss_sum]
            ),
            optimizer=tr.optimizer,
            log=log,
        )
        self.eval_graph = StepGraph(
            self._eval,
            mode=tc.cuda_graph,
            device=dev,
            state=lambda: [*memory_state(), self.scores],
            log=log,
        )

    def _set(self, **values: float) -> None:
        for k, v in values.items():
            if self.fixed:
                self.inp[k].fill_(v)
            else:
                self.inp[k] = v

    def _batch(self, num_neg: int, neg_table: torch.Tensor | None = None) -> Batch:
        tr, inp = self.tr, self.inp
        return self.select(
            self.tables,
            inp["start"],
            inp["stop"],
            inp["stream"],
            seed=tr.cfg.train.seed,
            num_neg=num_neg,
            sample_roots=tr.model.sample_roots,
            read_neighbors=tr.model.read_neighbors,
            capacity=self.capacity,
            neg_table=neg_table,
            table_lo=inp["split_lo"],
        )

    def _train(self) -> None:
        from sven.step import torch_determinism_off, train_step

        tr = self.tr
        with torch_determinism_off(self.fixed):
            batch = self._batch(tr.cfg.train.num_neg)
            # Eager (CPU): a lap per stage; a captured graph is timed as one "step".
            lap = None if self.fixed else tr.timeline.lap
            if lap is not None:
                lap("sample")
            loss = train_step(
                self.model, tr.optimizer, tr.memory, batch, self.inp["npred"], lap=lap
            )
            self.loss_sum += loss

    def _eval(self) -> None:
        from sven.step import eval_step, torch_determinism_off

        tr = self.tr
        with torch_determinism_off(self.fixed):
            batch = self._batch(self.width, self.neg_table)
            out = eval_step(self.model, tr.memory, batch)
            scores = torch.cat([out.pos[:, None], out.neg], 1).to(self.scores.dtype)
            rows = batch.index - self.inp["split_lo"]
            if batch.valid is not None:
                rows = torch.where(batch.valid, rows, self.scores.shape[0] - 1)
            # Padded events all write the scratch row; real ones distinct rows.
            self.scores.index_copy_(0, rows, scores)

    def train_batch(self, epoch: int, lo: int, hi: int) -> None:
        """Queues the training step of global batch [lo, hi) of ``epoch``."""
        npred = (hi - lo) * (1 + self.tr.cfg.train.num_neg)
        self._set(start=lo, stop=hi, stream=epoch, npred=float(npred))
        self.train_graph()
        if self.fixed:
            self.tr.timeline.lap("step")

    def take_loss(self) -> float:
        """The summed mean losses of the steps since the last call (waits for them)."""
        value = float(self.loss_sum)
        self.loss_sum.zero_()
        return value

    def _negatives(self, split: str) -> torch.Tensor:
        """(n, width) evaluation negatives of a split, drawn once and kept (they are fixed
        by the seed): the protocol columns, then the MRR negatives."""
        if split in self._neg_cache:
            return self._neg_cache[split]
        tr = self.tr
        lo, hi = tr.ranges[split]
        b, seed, q = tr.cfg.train.batch_size, tr.cfg.train.seed, tr.mrr_negatives
        protocols = self.protocols if split == "test" else self.protocols[:1]
        sampler = tr._eval_negatives() if protocols != ["random"] else None
        cols = []
        # Historical and inductive draws depend on the global batch; random ones only
        # on the event, so one call covers the split.
        step = b if sampler is not None else max(hi - lo, 1)
        for start in range(lo, hi, step):
            idx = torch.arange(start, min(start + step, hi), device=tr.device)
            c = eval_negative_columns(
                protocols,
                tr.candidates,
                sampler,
                seed,
                _EVAL_STREAM[split],
                idx,
                start,
                min(start + step, hi),
            )
            # Columns of protocols this split does not score repeat the first one.
            c = torch.cat([c, c[:, :1].expand(-1, len(self.protocols) - c.shape[1])], 1)
            if q:
                mrr_neg = sample_negatives(seed, _MRR_STREAM[split], idx, tr.candidates, q)
                c = torch.cat([c, mrr_neg], 1)
            cols.append(c)
        table = torch.cat(cols) if cols else self.neg_table[:0]
        self._neg_cache[split] = table
        return table

    def evaluate(self, split: str) -> EvalResult:
        """Walks a split through the evaluation step; returns all scores."""
        tr = self.tr
        lo, hi = tr.ranges[split]
        b, q = tr.cfg.train.batch_size, tr.mrr_negatives
        negs = self._negatives(split)
        self.neg_table[: hi - lo].copy_(negs)
        self._set(split_lo=lo, stream=_EVAL_STREAM[split])
        for start in range(lo, hi, b):
            self._set(start=start, stop=min(start + b, hi))
            self.eval_graph()
        scores = self.scores[: hi - lo].cpu()
        n_p = len(self.protocols)
        valid = None
        if q:
            idx = torch.arange(lo, hi, device=tr.device)
            mrr_neg = negs[:, n_p:]
            valid = filtered_mrr_negatives(tr.src, tr.dst, tr.t, idx, mrr_neg, tr.num_nodes)
            valid = valid.cpu()
        protocols = self.protocols if split == "test" else self.protocols[:1]
        return _eval_result(scores, protocols, n_p, q, valid)


def _main_thread_only(fn: Callable[[str], None]) -> Callable[[str], None]:
    """``fn`` when called from the main thread, a no-op elsewhere."""

    def call(stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            fn(stage)

    return call
