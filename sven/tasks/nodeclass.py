"""Dynamic node classification: per-event labels from a link-prediction model's embeddings.

The protocol of the TGN paper (Rossi et al. 2020, section 5.3), JODIE (Kumar et al.
2019) and DyGLib (Yu et al. 2023): each event (u, v, t) of a stream such as Wikipedia or
Reddit carries a label of its source (``state_label``: the user is banned after this
edit). A model trained for future-link prediction embeds u at time t, from the memory
before the event (the embedding its link decoder scores); an MLP maps that embedding to
the label. The encoder is frozen (DyGLib's default: its embeddings are computed once, in
one replay of the stream) or fine-tuned with the classifier's loss (``nc.finetune``).
The split is the store's chronological one; the metric ROC AUC over each split (the
labels are highly imbalanced: 0.14% positive on Wikipedia), with early stopping on val
AUC.

On P ranks the replay runs distributed: every rank encodes its share of each global
batch and reads and writes memory through the memory exchange, as evaluation does; the
embeddings and the event indices are then gathered on every rank (the labels are looked
up by event index, so they travel with the rank's share), and each rank trains the same
small classifier on the same rows, so that all ranks hold the same parameters. Fine-tuning
runs on one process.

A run folder holds what a link-prediction run holds: ``config.json``, ``metrics.jsonl``
(one line per epoch), ``checkpoints/`` (resumable: classifier, optimizer, progress, and
the encoder when fine-tuned), ``best/`` and ``summary.json``; with no ``nc.encoder`` the
link-prediction run trained first is in ``<out>/encoder``.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sven.config import Config, dump_config, load_config
from sven.engine.checkpoint import Snapshot
from sven.engine.evaluation import gather_rows
from sven.engine.loop import TrainingState
from sven.engine.metrics import roc_auc
from sven.engine.run_folder import finite_or_none
from sven.errors import ConfigError, DataError
from sven.tasks.replay import encode_events, open_run, split_stream

if TYPE_CHECKING:
    from sven.engine.trainer import Trainer

__all__ = ["NodeClassification", "NodeClassifier", "event_labels"]

SPLITS = ("train", "val", "test")


class NodeClassifier(nn.Module):
    """TGN's node-classification decoder: an MLP dim -> hidden -> 10 -> 1 logit.

    Args:
        dim: Embedding width.
        hidden: First hidden width (80 in TGN).
        dropout: Dropout after each hidden layer.
    """

    def __init__(self, dim: int, hidden: int = 80, dropout: float = 0.1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, 10)
        self.fc3 = nn.Linear(10, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(n, dim) embeddings -> (n,) logits."""
        x = self.dropout(torch.relu(self.fc1(h)))
        x = self.dropout(torch.relu(self.fc2(x)))
        return self.fc3(x).squeeze(-1)


def event_labels(events: Any) -> torch.Tensor:
    """(E,) float 0/1 labels of a store's events (its ``label`` column).

    Raises:
        DataError: The store has no labels, or labels other than 0 and 1.
    """
    if events.label is None:
        raise DataError(
            "task=node_classification needs per-event labels and this store has none "
            "(JODIE-format files carry them as state_label; see docs/data.md)",
            events.path,
        )
    y = np.asarray(events.label)
    values = np.unique(y)
    if not np.isin(values, [0, 1]).all():
        shown = ", ".join(str(v) for v in values[:5])
        raise DataError(
            f"task=node_classification needs binary labels (0/1); the label column holds "
            f"{shown}{'...' if values.size > 5 else ''}",
            events.path,
        )
    return torch.as_tensor(y.astype(np.float32))


class NodeClassification:
    """Trains and evaluates a node classifier on a link-prediction encoder.

    Args:
        config: The run's config (``task=node_classification``; the ``nc`` section).

    Example:
        >>> summary = NodeClassification(load_config("configs/tgn.yaml",
        ...     ["task=node_classification", "data.path=stores/wikipedia"])).fit()
    """

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.out = Path(config.out)
        self.nc = config.nc
        if self.nc.finetune and _world_size() > 1:
            raise ConfigError("nc.finetune=true runs on one process; frozen runs on P ranks")

    # ------------------------------------------------------------------ run
    def fit(self) -> dict[str, Any]:
        """Trains the encoder if none is named, then the classifier; tests the best.

        Returns:
            The summary (also ``<out>/summary.json``): ``{split}_auc`` of the best epoch
            (by val AUC), the encoder, the label counts.
        """
        from sven.engine.run_folder import prepare_out

        cfg, tc = self.cfg, self.cfg.train
        wall0 = time.perf_counter()
        rank0 = _rank() == 0
        # Before anything is written or trained: the store's labels and the encoder
        # named, so that a mistake costs no encoder training and leaves nothing behind.
        self._check_early()
        existed = self.out.exists()
        fresh = not existed
        if rank0:
            # Before any process group exists (the encoder's trainer makes one): only
            # rank 0 touches the folder; the others write nothing into it before the
            # rendezvous of the first trainer, which waits for rank 0.
            prepare_out(self.out, resume=tc.resume, overwrite=tc.overwrite, log=self._log)
            # This launch's own per-rank logs may be there already (sven.cli.train).
            fresh = fresh or all(p.name == "logs" for p in self.out.iterdir())
            self.out.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.out / "config.json")
        try:
            encoder = self._encoder()
            tr, folder, _ = open_run(encoder, self._encoder_overrides())
        except BaseException:
            if rank0 and fresh:
                self._undo_start(keep_folder=existed)
            raise
        try:
            return self._fit(tr, folder, wall0)
        finally:
            tr.ctx.teardown()

    def _check_early(self) -> None:
        """The errors a run can know before any work: a store without binary labels, an
        encoder that is not a checkpoint, or one trained on another store.

        Raises:
            DataError: The labels (exit 3); quiet on ranks other than 0, which find the
                same in the same files.
            SvenError: The encoder (exit 1).
        """
        from sven.datasets.identity import identity_problem, store_identity
        from sven.datasets.store import TemporalEvents
        from sven.errors import SvenError
        from sven.tasks.replay import read_checkpoint

        try:
            if not self.cfg.data.path:
                raise DataError(
                    "task=node_classification needs per-event labels and the built-in "
                    "synthetic dataset has none: give data.path=STORE of a labelled store "
                    "(`sven data synth --labels 0.2 --communities 10 --out STORE`, or "
                    "`sven data fetch wikipedia --out STORE`)"
                )
            events = TemporalEvents.load(self.cfg.data.path, check_values=False)
            event_labels(events)
            if self.nc.encoder:
                folder, state = read_checkpoint(self.nc.encoder)
                problem, _ = identity_problem(
                    (state.get("data") or {}).get("store"), store_identity(events),
                    str(folder), verb="was trained on",
                )  # fmt: skip
                if problem is not None:
                    raise SvenError(f"nc.encoder: {problem}")
        except SvenError as err:
            err.quiet = _rank() != 0
            raise

    def _undo_start(self, keep_folder: bool) -> None:
        """Removes what this run wrote into a fresh ``out`` when it stopped before its
        encoder started: its ``config.json`` would refuse the rerun. ``out`` itself goes
        too where this run created it (``keep_folder`` False) and nothing is in it."""
        if (self.out / "encoder" / "config.json").exists():
            return  # the encoder's training began: resumable work, kept
        (self.out / "config.json").unlink(missing_ok=True)
        for sub in ("encoder", "encoder-replay", "logs", *([] if keep_folder else [""])):
            folder = self.out / sub
            with contextlib.suppress(OSError):
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()

    def _encoder(self) -> str:
        """The encoder's checkpoint: ``nc.encoder``, or the run trained here first."""
        if self.nc.encoder:
            return self.nc.encoder
        sub = self.out / "encoder"
        if (sub / "summary.json").is_file():
            self._log(f"encoder: the link-prediction run in {sub}")
            return str(sub)
        from sven.config.load import config_overrides
        from sven.engine.trainer import Trainer

        self._log(f"encoder: training link prediction first, into {sub}")
        lp = load_config(
            None,
            config_overrides(
                self.cfg, ["task=link_prediction", f"out={sub}", "train.overwrite=false"]
            ),
        )
        Trainer(lp).fit()
        return str(sub)

    def _encoder_overrides(self) -> list[str]:
        """This run's settings of where and how to run, on the encoder's config."""
        cfg = self.cfg
        keys = {
            "train.device": cfg.train.device,
            "train.threads": cfg.train.threads,
            "data.verify": cfg.data.verify,
            "dist.backend": cfg.dist.backend,
            "dist.timeout_s": cfg.dist.timeout_s,
            "dist.partition": cfg.dist.partition,
            "dist.strategy": cfg.dist.strategy,
        }
        out = [f"{k}={json.dumps(v)}" for k, v in keys.items()]
        if cfg.data.path:
            out.append(f"data.path={cfg.data.path}")
        # The trainer's own outputs (per-rank logs, never checkpoints) stay in this run.
        out.append(f"out={self.out / 'encoder-replay'}")
        return out

    def _fit(self, tr: Trainer, folder: Path, wall0: float) -> dict:
        from sven.engine.checkpoint import RunCheckpoints
        from sven.engine.loop import RunLoop, end_run, new_progress

        cfg, nc = self.cfg, self.nc
        rank0 = tr.rank == 0
        y = event_labels(tr.data.events).to(tr.device, tr.dtype)
        torch.manual_seed(cfg.train.seed)
        clf = NodeClassifier(tr.model.embed_dim, nc.hidden, nc.dropout).to(tr.device, tr.dtype)
        params = list(clf.parameters())
        if nc.finetune:
            params += list(tr.model.parameters())
        opt = torch.optim.Adam(params, lr=nc.lr)
        ck = RunCheckpoints(
            self.out,
            cfg.train.keep_latest_k,
            config=cfg,
            rank=tr.rank,
            world_size=tr.world_size,
            barrier=tr.barrier,
            agree=tr.agree,
            asynchronous=cfg.train.checkpoint_async,
            threads=cfg.train.checkpoint_threads,
            timeout_s=cfg.dist.timeout_s,
        )
        task = _Classification(self, tr, folder, clf, opt, y)
        loop = RunLoop(
            task,
            ck,
            out=self.out,
            epochs=nc.epochs,
            patience=nc.patience,
            checkpoint_every=0,
            main=rank0,
            log=self._log,
            device=tr.device,
        )
        progress = new_progress(best_val_auc=-math.inf)
        start_epoch, start_batch = 0, 0
        if cfg.train.resume:
            progress, start_epoch, start_batch = loop.resume(progress)
        if nc.finetune is False:
            task.frozen = self._frozen_embeddings(tr)
        progress = loop.run(progress, start_epoch, start_batch)
        hist = {h["epoch"]: h for h in progress["history"]}
        best_line = hist.get(progress["best_epoch"], {})
        counts = {f"{s}_positives": int(y[slice(*tr.data.ranges[s])].sum()) for s in SPLITS}
        summary = finite_or_none(
            {
                "task": "node_classification",
                "model": tr.cfg.model.name,
                "dataset": tr.data.dataset_name,
                "world_size": tr.world_size,
                "encoder": str(folder),
                "finetune": nc.finetune,
                "epochs_run": len(progress["history"]),
                "best_epoch": progress["best_epoch"],
                **{f"{s}_auc": best_line.get(f"{s}_auc") for s in SPLITS},
                **counts,
                **{f"{s}_events": tr.data.ranges[s][1] - tr.data.ranges[s][0] for s in SPLITS},
                "wall_s": time.perf_counter() - wall0,
            }
        )
        # A checkpoint that could not be written ends the run with exit code 5, once
        # the summary is written (sven.engine.checkpoint.RunCheckpoints).
        missing = ck.finish()

        def say(s: dict[str, Any]) -> None:
            self._log(
                f"node classification: test AUC {_fmt(s['test_auc'])} (val "
                f"{_fmt(s['val_auc'])}, epoch {s['best_epoch']}); "
                f"summary in {self.out / 'summary.json'}"
            )

        summary = end_run(ck, summary, missing, out=self.out, main=rank0, say=say)
        if not rank0:
            summary["rank"] = tr.rank
        return summary

    # -------------------------------------------------------------- frozen
    def _frozen_embeddings(self, tr: Trainer) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every event's source embedding, from one replay of the stream: split ->
        (event indices (n,), embeddings (n, d)), the same rows on every rank."""
        tr.memory.reset()
        out = {}
        for s in SPLITS:
            lo, hi = tr.data.ranges[s]
            idx, h = encode_events(tr, lo, hi, split_stream(s))
            idx, h = gather_rows(idx, h, tr.world_size)
            order = torch.argsort(idx)
            out[s] = (idx[order], h[order])
        return out

    def _classifier_epoch(
        self,
        clf: NodeClassifier,
        opt: torch.optim.Optimizer,
        frozen: dict[str, tuple[torch.Tensor, torch.Tensor]],
        y: torch.Tensor,
        epoch: int,
    ) -> float:
        """One pass over the training rows in a seeded random order; the mean loss."""
        idx, h = frozen["train"]
        b = self.nc.batch_size or self.cfg.train.batch_size
        gen = torch.Generator().manual_seed(self.cfg.train.seed * 100_003 + epoch)
        order = torch.randperm(idx.numel(), generator=gen).to(idx.device)
        clf.train()
        total, steps = 0.0, 0
        for i in range(0, idx.numel(), b):
            rows = order[i : i + b]
            opt.zero_grad(set_to_none=True)
            loss = F.binary_cross_entropy_with_logits(clf(h[rows]), y[idx[rows]])
            loss.backward()
            opt.step()
            total += float(loss.detach())
            steps += 1
        return total / max(steps, 1)

    @torch.no_grad()
    def _logits(self, clf: NodeClassifier, h: torch.Tensor) -> torch.Tensor:
        """(n,) logits of (n, d) embeddings, dropout off."""
        clf.eval()
        return clf(h)

    # ------------------------------------------------------------ finetune
    def _finetune_epoch(
        self,
        tr: Trainer,
        clf: NodeClassifier,
        opt: torch.optim.Optimizer,
        y: torch.Tensor,
        epoch: int,
    ) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Train walks with gradients through the encoder; val and test continue its
        memory without. Returns the mean loss and each split's (indices, logits)."""
        d, model = tr.data, tr.model
        tr.memory.reset()
        lo, hi = d.ranges["train"]
        b = self.cfg.train.batch_size
        total, steps = 0.0, 0
        scores: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        idx_all, logit_all = [], []
        for start in range(lo, hi, b):
            model.train()
            clf.train()
            idx = d.event_index(start, min(start + b, hi))
            # The epoch's stream: dropout and uniform sampling differ between epochs,
            # as in link-prediction training.
            batch = d.batch(idx, start, epoch, 0)
            opt.zero_grad(set_to_none=True)
            h, dense = model.encode(batch, tr.memory.gather(batch.nodes))
            logits = clf(h[: batch.size])
            loss = F.binary_cross_entropy_with_logits(logits, y[idx])
            loss.backward()
            opt.step()
            tr.memory.commit_dense(dense)
            total += float(loss.detach())
            steps += 1
            idx_all.append(idx)
            logit_all.append(logits.detach())
        scores["train"] = (torch.cat(idx_all), torch.cat(logit_all))
        for s in ("val", "test"):
            idx, h = encode_events(tr, *d.ranges[s], split_stream(s))
            scores[s] = (idx, self._logits(clf, h))
        return total / max(steps, 1), scores

    def _log(self, msg: str) -> None:
        if _rank() == 0 and not self.cfg.quiet:
            print(msg, file=sys.stderr, flush=True)


class _Classification:
    """Node classification as a task of the run loop: each epoch one pass of the
    classifier (over the frozen embeddings, or fine-tuning the encoder through the
    training events), then the AUC of every split; the best epoch by val AUC."""

    where = "start"
    best_links_latest = False

    def __init__(
        self,
        run: NodeClassification,
        tr: Trainer,
        folder: Path,
        clf: NodeClassifier,
        opt: torch.optim.Optimizer,
        y: torch.Tensor,
    ) -> None:
        self.run, self.tr, self.folder = run, tr, folder
        self.clf, self.opt, self.y = clf, opt, y
        self.finetune = run.nc.finetune
        self.frozen: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        #: The epoch's pass, until its line is made: its mean loss and, fine-tuning,
        #: every split's (indices, logits).
        self._pass: dict[str, Any] = {}

    def begin_epoch(self, epoch: int, first: int, progress: dict[str, Any]) -> int:
        """One batch: the epoch's pass."""
        self._t0 = time.perf_counter()
        self.where = f"epoch {epoch}"
        return 1

    def train_batch(self, epoch: int, i: int, progress: dict[str, Any]) -> None:
        """The epoch's pass of the classifier (and the encoder, fine-tuning)."""
        run, seed = self.run, self.run.cfg.train.seed
        # The classifier's dropout draws from torch's generator: seeded per epoch, so
        # that a resumed run draws what an uninterrupted one does.
        torch.manual_seed(seed * 100_003 + epoch)
        if self.frozen is None:
            loss, scores = run._finetune_epoch(self.tr, self.clf, self.opt, self.y, epoch)
            self._pass = {"loss": loss, "scores": scores}
        else:
            loss = run._classifier_epoch(self.clf, self.opt, self.frozen, self.y, epoch)
            self._pass = {"loss": loss}

    def stop_requested(self) -> int:
        """Never: an epoch is one short pass, and node classification installs no
        signal handler (a stop signal ends the process; ``train.resume=true`` goes on
        from the last epoch's checkpoint)."""
        return 0

    def pause(self, progress: dict[str, Any]) -> dict[str, Any]:
        """Nothing is queued."""
        return progress

    def unpause(self) -> None:
        """Nothing to restart."""

    def end_epoch(self, epoch: int, progress: dict[str, Any]) -> dict[str, Any]:
        """The AUC of every split from the epoch's classifier."""
        scores = self._pass.get("scores")
        if scores is None:
            assert self.frozen is not None
            clf = self.clf
            scores = {s: (idx, self.run._logits(clf, h)) for s, (idx, h) in self.frozen.items()}
        y = self.y
        aucs = {f"{s}_auc": roc_auc(scores[s][1].cpu(), y[scores[s][0]].cpu()) for s in SPLITS}
        return {
            "epoch": epoch,
            "train_loss": self._pass["loss"],
            **aucs,
            "epoch_s": time.perf_counter() - self._t0,
        }

    def describe(self, line: dict[str, Any]) -> str:
        """The epoch's log line."""
        return (
            f"epoch {line['epoch']}: loss {line['train_loss']:.4f} val AUC "
            f"{_fmt(line['val_auc'])} test AUC {_fmt(line['test_auc'])}"
        )

    def improved(self, line: dict[str, Any], progress: dict[str, Any]) -> bool:
        """Val AUC above the best so far (an undefined AUC never improves)."""
        val = line["val_auc"]
        if val is None or math.isnan(val) or val <= progress["best_val_auc"]:
            return False
        progress["best_val_auc"] = val
        return True

    def _models(self) -> dict[str, Any]:
        state: dict[str, Any] = {"classifier": self.clf.state_dict(), "encoder": str(self.folder)}
        if self.finetune:
            state["model"] = self.tr.model.state_dict()
        return state

    def state_dict(self, training: TrainingState) -> Snapshot:
        """Classifier, optimizer, cursor, progress (and the encoder, fine-tuning)."""
        state = {**self._models(), "optimizer": self.opt.state_dict(), **training.state_dict()}
        return Snapshot(state)

    def load_state_dict(self, snap: Snapshot) -> None:
        """Loads :meth:`state_dict`'s checkpoint (also one of a run written before the
        run loop, whose cursor was its ``epoch``)."""
        state = snap.state
        self.clf.load_state_dict(state["classifier"])
        self.opt.load_state_dict(state["optimizer"])
        if self.finetune:
            self.tr.model.load_state_dict(state["model"])

    def best_state(self, epoch: int) -> Snapshot:
        """The classifier (and the encoder, fine-tuning) of the best epoch."""
        return Snapshot({**self._models(), "epoch": epoch})


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def _rank() -> int:
    from sven.distributed.launcher import detect_launcher

    return detect_launcher().rank


def _world_size() -> int:
    from sven.distributed.launcher import detect_launcher

    return detect_launcher().world_size
