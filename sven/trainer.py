"""Single-process training and evaluation: the reference semantics of Sven.

One epoch walks the training events in time order in batches of B; each batch draws
deterministic negatives, samples temporal neighbours, reads the memory of its unique
nodes, runs the model, steps the optimizer and commits the model's memory update.
Validation continues the memory from the end of training and test from the end of
validation. See "Training semantics" in DESIGN.md.

The distributed runtime reuses this class and replaces only the state access
(:meth:`Trainer._read` / :meth:`Trainer._commit`) and the reductions.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from sven.checkpoint import Checkpointer
from sven.config import Config, dump_config, load_config
from sven.errors import ConfigError, SvenError
from sven.metrics import average_precision, link_metrics, mrr
from sven.models import MemoryModel, MemoryRows, MemoryState, MemoryUpdate, build_model
from sven.pipeline.batch import Batch, make_batch
from sven.pipeline.negatives import sample_negatives

# Negative streams of evaluation are fixed per split, independent of the epoch, so every
# run and every epoch evaluates against the same negatives.
_EVAL_STREAM = {"train": (1 << 20) + 2, "val": 1 << 20, "test": (1 << 20) + 1}
_MRR_STREAM = {"train": (1 << 21) + 2, "val": 1 << 21, "test": (1 << 21) + 1}
_SPLITS = ("train", "val", "test")


@dataclass
class EvalResult:
    """Scores of one evaluation pass over a split.

    Attributes:
        pos: (n,) positive logits in event order.
        neg: (n,) logits of the one evaluation negative of each event.
        mrr_neg: (n, q) logits of the MRR negatives, or None.
    """

    pos: torch.Tensor
    neg: torch.Tensor
    mrr_neg: torch.Tensor | None = None


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def time_gap_scale(src: np.ndarray, dst: np.ndarray, t: np.ndarray) -> float:
    """Std of the time since a node's previous event, over the given events (JODIE's scale).

    Args:
        src: (E,) sources. dst: (E,) destinations. t: (E,) sorted times.

    Returns:
        The standard deviation, or 1.0 where it is zero or undefined.
    """
    nodes = np.concatenate([src, dst]).astype(np.int64)
    times = np.concatenate([t, t]).astype(np.float64)
    order = np.lexsort((times, nodes))
    n, ts = nodes[order], times[order]
    same = n[1:] == n[:-1]
    gaps = (ts[1:] - ts[:-1])[same]
    std = float(gaps.std()) if gaps.size else 0.0
    return std if std > 0 and math.isfinite(std) else 1.0


class Trainer:
    """Trains and evaluates one model on one event store.

    Args:
        config: A :class:`~sven.config.Config`, a nested dict, or a path to a YAML preset.
        overrides: Dotted ``key=value`` overrides applied on top.

    Example:
        >>> summary = sven.Trainer({"model": {"name": "tgn"}, "train": {"epochs": 1}}).fit()
    """

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
        self.device = torch.device(tc.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device is cuda but no CUDA device is available")
        self.dtype = torch.float64 if tc.dtype == "float64" else torch.float32
        self.out = Path(cfg.out)
        self.world_size = 1
        self.rank = 0
        self._load_data()
        torch.manual_seed(tc.seed)
        kwargs: dict[str, Any] = dict(
            memory_dim=mc.memory_dim,
            time_dim=mc.time_dim,
            embed_dim=mc.embed_dim,
            edge_dim=self.edge_dim,
            node_dim=self.node_dim,
            message=mc.message,
        )
        if mc.cell:
            kwargs["cell"] = mc.cell
        if mc.name in ("tgn", "apan"):
            kwargs.update(num_heads=mc.num_heads, dropout=mc.dropout)
        if mc.name == "apan":
            kwargs["mailbox_size"] = mc.mailbox_size
        if mc.name == "jodie":
            lo, hi = self.ranges["train"]
            kwargs["time_scale"] = time_gap_scale(
                self.events.src[lo:hi], self.events.dst[lo:hi], self.events.t[lo:hi]
            )
        self.model: MemoryModel = build_model(mc.name, **kwargs).to(self.device, self.dtype)
        self.memory = MemoryState(
            self.num_nodes,
            mc.memory_dim,
            self.model.mail_dim,
            self.model.mailbox_size,
            self.device,
            self.dtype,
        )
        self.sampler = None
        if self.model.sample_roots != "none":
            from sven.pipeline.sampler import TCSR, TemporalSampler

            ev = self.events
            tcsr = TCSR.from_events(ev.src, ev.dst, ev.t, self.num_nodes, device=self.device)
            self.sampler = TemporalSampler(tcsr, [mc.num_neighbors], mc.sampling)
        self.sample_gen = torch.Generator(device=self.device)
        self.sample_gen.manual_seed(tc.seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=tc.lr)
        self.checkpointer = Checkpointer(self.out, tc.keep_latest_k)

    # ------------------------------------------------------------------ data
    def _load_data(self) -> None:
        from sven.datasets.store import TemporalEvents

        path = self.cfg.data.path
        if not path:
            from sven.datasets.synth import default_dataset

            path = str(default_dataset())
        if not Path(path).is_dir():
            raise ConfigError(
                f"data.path: no event store at {path} (create one with `sven data convert`)"
            )
        ev = TemporalEvents.load(path)
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
            else torch.as_tensor(np.asarray(ev.edge_feat), device=dev).to(self.dtype)
        )
        self.node_feat = (
            None
            if ev.node_feat is None
            else torch.as_tensor(np.asarray(ev.node_feat), device=dev).to(self.dtype)
        )
        self.edge_dim = 0 if self.edge_feat is None else self.edge_feat.shape[1]
        self.node_dim = 0 if self.node_feat is None else self.node_feat.shape[1]
        self.ranges = {s: tuple(int(x) for x in ev.split_range(s)) for s in _SPLITS}
        if self.ranges["train"][1] <= self.ranges["train"][0]:
            raise SvenError(f"{path}: the training split is empty")
        self.candidates = torch.unique(self.dst)
        self.inductive = {
            s: torch.as_tensor(np.asarray(ev.inductive_mask(s)), dtype=torch.bool)
            for s in ("val", "test")
        }

    # --------------------------------------------------------- state access
    def _read(self, batch: Batch) -> MemoryRows:
        """Memory rows of ``batch.nodes`` (the distributed runtime fetches from owners)."""
        return self.memory.gather(batch.nodes)

    def _commit(self, update: MemoryUpdate) -> None:
        """Writes a batch's memory update (the distributed runtime pushes to owners)."""
        self.memory.commit(update)

    def _batch(
        self, lo: int, hi: int, stream: int, num_neg: int, mrr_stream: int | None = None
    ) -> Batch:
        idx = torch.arange(lo, hi, device=self.device)
        neg = sample_negatives(self.cfg.train.seed, stream, idx, self.candidates, num_neg)
        if mrr_stream is not None:
            q = self.cfg.train.mrr_negatives
            neg = torch.cat(
                [neg, sample_negatives(self.cfg.train.seed, mrr_stream, idx, self.candidates, q)], 1
            )
        return make_batch(
            idx,
            self.src[lo:hi],
            self.dst[lo:hi],
            self.t[lo:hi],
            neg,
            edge_feat_table=self.edge_feat,
            node_feat_table=self.node_feat,
            sampler=self.sampler,
            sample_roots=self.model.sample_roots,
            read_neighbors=self.model.read_neighbors,
            generator=self.sample_gen,
        )

    # -------------------------------------------------------------- training
    def train_step(self, batch: Batch) -> float:
        """One optimisation step on a batch; returns the loss (mean over predictions)."""
        self.model.train()
        out = self.model(batch, self._read(batch))
        n_pred = out.pos.numel() + out.neg.numel()
        loss = (
            F.binary_cross_entropy_with_logits(out.pos, torch.ones_like(out.pos), reduction="sum")
            + F.binary_cross_entropy_with_logits(
                out.neg, torch.zeros_like(out.neg), reduction="sum"
            )
        ) / n_pred
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self._commit(out.update)
        return float(loss.detach())

    def num_batches(self, split: str) -> int:
        """Number of batches of a split at the configured batch size."""
        lo, hi = self.ranges[split]
        b = self.cfg.train.batch_size
        return (hi - lo + b - 1) // b

    @torch.no_grad()
    def evaluate(self, split: str) -> EvalResult:
        """Walks a split without gradients, updating memory; returns all scores."""
        self.model.eval()
        lo, hi = self.ranges[split]
        b = self.cfg.train.batch_size
        q = self.cfg.train.mrr_negatives
        pos, neg, mrr_neg = [], [], []
        for start in range(lo, hi, b):
            batch = self._batch(
                start, min(start + b, hi), _EVAL_STREAM[split], 1, _MRR_STREAM[split] if q else None
            )
            out = self.model(batch, self._read(batch))
            self._commit(out.update)
            pos.append(out.pos)
            neg.append(out.neg[:, 0])
            if q:
                mrr_neg.append(out.neg[:, 1:])
        cat = lambda xs: torch.cat(xs).cpu() if xs else torch.zeros(0)  # noqa: E731
        return EvalResult(cat(pos), cat(neg), cat(mrr_neg) if q else None)

    def split_metrics(self, split: str, res: EvalResult) -> dict[str, float]:
        """AP/AUC (mean of per-batch values, and pooled), inductive, MRR of a split."""
        b = self.cfg.train.batch_size
        out: dict[str, float] = {}

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
        m = self.inductive[split]
        out[f"{split}_ap_inductive"], out[f"{split}_auc_inductive"] = per_batch(
            res.pos[m], res.neg[m]
        )
        out[f"{split}_inductive_events"] = int(m.sum())
        if res.mrr_neg is not None:
            out[f"{split}_mrr"] = mrr(res.pos, res.mrr_neg)
        return out

    def _rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "sampler": self.sample_gen.get_state()}

    def _set_rng_state(self, s: dict[str, Any]) -> None:
        torch.set_rng_state(s["torch"])
        self.sample_gen.set_state(s["sampler"])

    def _state(self, epoch: int, next_batch: int, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "memory": self.memory.state_dict(),
            "cursor": {"epoch": epoch, "next_batch": next_batch},
            "rng": self._rng_state(),
            "config": self.cfg.to_dict(),
            **extra,
        }

    def fit(self) -> dict[str, Any]:
        """Trains with early stopping on val AP, then evaluates the best model on test.

        Returns:
            The summary (also written to ``<out>/summary.json``).
        """
        cfg, tc = self.cfg, self.cfg.train
        wall0 = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.out / "config.json")
        best_path = self.out / "best.pt"
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
            step = self.checkpointer.latest()
            if step is not None:
                st = self.checkpointer.load(step, map_location=self.device)
                self.model.load_state_dict(st["model"])
                self.optimizer.load_state_dict(st["optimizer"])
                self.memory.load_state_dict(st["memory"])
                self._set_rng_state(st["rng"])
                progress = st["progress"]
                start_epoch, start_batch = st["cursor"]["epoch"], st["cursor"]["next_batch"]
                self._log(
                    f"resumed from {self.checkpointer.path(step)} (epoch {start_epoch}, batch {start_batch})"
                )
        # metrics.jsonl is rebuilt from the checkpointed history, so lines written after
        # the checkpoint by an interrupted run do not appear twice.
        _atomic_write_text(
            "".join(json.dumps(h) + "\n" for h in progress["history"]), self.out / "metrics.jsonl"
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
            last = nb if not tc.max_batches else min(nb, tc.max_batches)
            bar = tqdm(
                total=last,
                initial=start_batch,
                desc=f"epoch {epoch}",
                disable=cfg.quiet,
                file=sys.stderr,
                leave=False,
                dynamic_ncols=True,
            )
            for i in range(start_batch, last):
                t0 = time.perf_counter()
                batch = self._batch(lo + i * b, min(lo + (i + 1) * b, hi), epoch, tc.num_neg)
                loss = self.train_step(batch)
                dt = time.perf_counter() - t0
                progress["epoch_loss"] += loss
                progress["epoch_batches"] += 1
                progress["epoch_time"] += dt
                progress["train_time"] += dt
                progress["train_events"] += batch.size
                progress["global_step"] += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", ev_s=f"{batch.size / max(dt, 1e-9):.0f}")
                if tc.checkpoint_every and (i + 1) % tc.checkpoint_every == 0 and i + 1 < last:
                    self.checkpointer.save(
                        progress["global_step"], self._state(epoch, i + 1, {"progress": progress})
                    )
            bar.close()
            start_batch = 0
            epoch_events = min(hi, lo + last * b) - lo
            val = self.split_metrics("val", self.evaluate("val"))
            line = {
                "epoch": epoch,
                "train_loss": progress["epoch_loss"] / max(progress["epoch_batches"], 1),
                "val_ap": val["val_ap"],
                "val_auc": val["val_auc"],
                "events_per_s": epoch_events / max(progress["epoch_time"], 1e-9),
                **{k: v for k, v in val.items() if k not in ("val_ap", "val_auc")},
            }
            line = _finite_or_none(line)
            progress["history"].append(line)
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            self._log(
                f"epoch {epoch}: loss {line['train_loss']:.4f} val AP {val['val_ap']:.4f} "
                f"AUC {val['val_auc']:.4f} ({line['events_per_s']:.0f} events/s)"
            )
            if val["val_ap"] > progress["best_val_ap"]:
                progress.update(best_val_ap=val["val_ap"], best_epoch=epoch, bad_epochs=0)
                _atomic_save(
                    {
                        "model": self.model.state_dict(),
                        "memory": self.memory.state_dict(),
                        "epoch": epoch,
                        "memory_phase": "val_end",
                        "config": cfg.to_dict(),
                    },
                    best_path,
                )
            else:
                progress["bad_epochs"] += 1
                if tc.patience and progress["bad_epochs"] >= tc.patience:
                    progress["stopped"] = True
            progress["global_step"] += 1
            self.checkpointer.save(
                progress["global_step"], self._state(epoch + 1, 0, {"progress": progress})
            )

        best = torch.load(best_path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(best["model"])
        self.memory.load_state_dict(best["memory"])
        test = self.split_metrics("test", self.evaluate("test"))
        best_line = (
            progress["history"][best["epoch"]] if best["epoch"] < len(progress["history"]) else {}
        )
        summary = {
            "model": cfg.model.name,
            "dataset": self.dataset_name,
            "world_size": self.world_size,
            "epochs_run": len(progress["history"]),
            "best_epoch": best["epoch"],
            "val_ap": best_line.get("val_ap"),
            "val_auc": best_line.get("val_auc"),
            **test,
            "train_events_per_s": progress["train_events"] / max(progress["train_time"], 1e-9),
            "wall_s": time.perf_counter() - wall0,
        }
        summary = _finite_or_none(summary)
        _atomic_write_text(json.dumps(summary, indent=2) + "\n", self.out / "summary.json")
        self._log(
            f"test AP {_fmt(summary['test_ap'])} AUC {_fmt(summary['test_auc'])} "
            f"(inductive AP {_fmt(summary['test_ap_inductive'])}); summary in {self.out / 'summary.json'}"
        )
        return summary

    def evaluate_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Re-evaluates a saved model (``best.pt`` or a ``checkpoints/step-N`` folder).

        A state saved at the end of validation (``best.pt``) continues into test, which
        reproduces the run's summary exactly. Any other state is re-played: memory is
        rebuilt by walking train and val without parameter updates, then test runs.
        """
        p = Path(path)
        st = torch.load(
            p / "state.pt" if p.is_dir() else p, map_location=self.device, weights_only=False
        )
        self.model.load_state_dict(st["model"])
        res: dict[str, Any] = {}
        if st.get("memory_phase") == "val_end":
            self.memory.load_state_dict(st["memory"])
        else:
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

    def _log(self, msg: str) -> None:
        if self.rank == 0 and not self.cfg.quiet:
            print(msg, file=sys.stderr, flush=True)
        elif self.rank == 0 and msg.startswith("test AP"):
            print(msg, file=sys.stderr, flush=True)


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
