"""Sven's TGN against PyG's TGN on one event store, in one run: train events/s and test AP.

Both sides read the same store (``TemporalEvents.load``) with its chronological
train/val/test split, and train TGN for the same number of epochs with the published
UCI/Enron settings: memory, time and embedding width 100, batches of 200 events in time
order, the 10 most recent temporal neighbours, Adam with lr 1e-4, and one negative
destination per positive.

(a) Sven: ``sven.Trainer(None, [overrides]).fit()``, ``model.name=tgn``, no early
    stopping (``train.patience=0``). Its summary gives ``train_events_per_s`` and
    ``test_ap``; the per-epoch rates come from its ``metrics.jsonl``.
(b) PyG: ``torch_geometric.nn.models.tgn`` (``TGNMemory`` with ``IdentityMessage`` and
    ``LastAggregator``, ``LastNeighborLoader``), a ``TransformerConv`` graph-attention
    embedding (2 heads of 50, dropout 0.1, edge attributes [time encoding, message]) and
    the example's MLP link predictor (the same layers as Sven's ``LinkDecoder``, which
    serves here), arranged as in PyG's ``examples/tgn.py``. ``TGNMemory``
    needs a raw message of width >= 1: the store's edge features, or zeros (E, 1) when
    it has none. ``TGNMemory`` keeps ``last_update`` as int64, so float timestamps are
    truncated to integers on this side.

What is measured, identically for both:

- **train events/s**: training events divided by training wall time, summed over the
  epochs (per-epoch rates are in the JSON). The time of a batch runs from drawing its
  negatives to the end of the step (neighbours, memory read, forward, backward,
  optimizer step, memory and neighbour writes, the loss read back to the host, which
  synchronises CUDA); memory resets, validation, test and checkpoints are outside it.
  Sven times its batches itself; the PyG loop here times the same span.
- **test AP**: the mean over test batches of 200 events of the average precision
  (``sven.engine.metrics.average_precision`` on the float32 logits of the positive and of one
  negative per event), with memory continued from training through validation into
  test, as DyGLib and Sven evaluate. Both sides report the test AP of the epoch with
  the best validation AP: Sven by reloading that epoch's model and end-of-validation
  memory, the PyG loop by evaluating test right after validation in every epoch, which
  is the same state.

The negatives are the same on both sides: ``sven.pipeline.negatives.sample_negatives``,
uniform over the nodes that occur as destinations, a function of (seed, epoch, event),
with Sven's fixed evaluation streams for val and test. The PyG loss is the mean BCE
over the 2B predictions of a batch, as Sven's.

Where the two setups differ (these are the libraries' own semantics, kept on purpose):

- **Neighbours.** Sven samples, for every root (source, destination, negative) at the
  event's time, the 10 most recent events of the node strictly before that time from a
  T-CSR index of the whole store, so a root sees earlier events of its own batch.
  PyG's ``LastNeighborLoader`` holds each node's last 10 events inserted so far and
  the events of a batch are inserted after it, so a batch sees only events of previous
  batches (PyG's example says so in its header).
- **Memory.** Both apply a node's pending mail (its last event's message) when the node
  is next read, with gradients through the GRU, and write the batch's events to memory
  after the batch. PyG's ``TGNMemory`` keeps its message store as a Python dict per
  node and walks it with ``.tolist()`` at every read and write; Sven's mailbox is a
  tensor. PyG's ``train(False)`` flushes every pending message into memory before
  evaluation; Sven applies pending mail when a node is next read. Both see the same
  events.
- **Embedding.** Sven: TGN's temporal attention (query [memory, time encoding of 0],
  keys and values [neighbour memory, edge features, time encoding of t - t_nbr], output
  ReLU, dropout and LayerNorm over [attention, memory]). PyG: ``TransformerConv`` from
  neighbour to root with edge attribute [time encoding of (the neighbour's last update
  - the neighbour event's time), message], and a root skip connection, as in the
  example. Sven embeds each of the 3B roots over K = 10 slots, padded where a node has
  fewer neighbours; PyG embeds each distinct node of the batch once, over its valid
  edges only.
- **Time encoding.** Sven's is cos(dt w) with fixed geometric frequencies
  (TGAT/DyGLib); PyG's ``TimeEncoder`` is a trainable Linear(1, 100) followed by cos.
  On unix-second timestamps trained frequencies drift (Sven's ``TimeEncoding``
  docstring: val AP 0.85 trained vs 0.91 fixed, Sven's TGN on CollegeMsg). It is a
  likely cause of a gap in AP, with the neighbour rule above; this script does not
  separate the two.
- **Determinism.** Sven's trainer turns on ``torch.use_deterministic_algorithms`` (its
  default); the flag is restored after each Sven run so that PyG runs with torch's
  defaults.

Figures from a shared machine are noisy: every configuration runs ``--repeats`` times
(the sides alternating which goes first, seed ``--seed + repeat``), and the table shows
the median with the range; the load average before and after is printed with it.

Usage:
    python benchmarks/bench_vs_pyg.py --data STORE --epochs 3 --threads 1
    python benchmarks/bench_vs_pyg.py --data STORE --device cuda --out r.json

Numbers, not a test: nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import TransformerConv
from torch_geometric.nn.models.tgn import (
    IdentityMessage,
    LastAggregator,
    LastNeighborLoader,
    TGNMemory,
)

import sven
from sven.datasets.store import TemporalEvents

# Sven's fixed negative streams of evaluation, so both sides score the same val and
# test negatives.
from sven.engine.evaluation import EVAL_STREAM
from sven.engine.metrics import average_precision
from sven.models.base import LinkDecoder
from sven.pipeline.negatives import sample_negatives

DIM = 100  # memory, time and embedding width
BATCH = 200
NEIGHBORS = 10
LR = 1e-4
HEADS = 2
DROPOUT = 0.1


@dataclass
class RunResult:
    """One training run of one side.

    Attributes:
        side: "sven" or "pyg".
        seed: Seed of parameters, negatives and dropout.
        train_events: Training events over all epochs.
        train_s: Training wall seconds over all epochs (no evaluation).
        epoch_events_per_s: Rate of each epoch.
        best_epoch: Epoch (0-based) with the best validation AP.
        val_ap: Validation AP of that epoch.
        test_ap: Test AP after that epoch.
        wall_s: Wall seconds of the whole run (set-up, training, evaluation).
        cpu_s: Process CPU seconds of the whole run; with one thread, ``cpu_s / wall_s``
            well below 1 means the run waited for a core (a loaded machine).
    """

    side: str
    seed: int
    train_events: int
    train_s: float
    epoch_events_per_s: list[float]
    best_epoch: int
    val_ap: float
    test_ap: float
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def train_events_per_s(self) -> float:
        return self.train_events / max(self.train_s, 1e-9)


@dataclass
class Events:
    """The store's columns as tensors on the device.

    Attributes:
        src, dst: (E,) int64 node ids.
        t: (E,) int64 timestamps (PyG keeps ``last_update`` as int64).
        msg: (E, d_msg) float32 raw messages: edge features, or zeros (E, 1).
        candidates: (C,) int64 nodes that occur as destinations (negative pool).
        ranges: Half-open event ranges of train, val and test.
        num_nodes: N.
    """

    src: torch.Tensor
    dst: torch.Tensor
    t: torch.Tensor
    msg: torch.Tensor
    candidates: torch.Tensor
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    num_nodes: int = 0


def load_events(path: str, device: torch.device) -> Events:
    """Reads a store into :class:`Events` on ``device``."""
    ev = TemporalEvents.load(path)
    src = torch.as_tensor(np.asarray(ev.src, dtype=np.int64), device=device)
    dst = torch.as_tensor(np.asarray(ev.dst, dtype=np.int64), device=device)
    t = torch.as_tensor(np.array(ev.t), device=device)
    if t.is_floating_point():
        t = t.to(torch.int64)
    if ev.edge_feat is None:
        msg = torch.zeros(src.numel(), 1, device=device)
    else:
        msg = torch.as_tensor(np.array(ev.edge_feat, dtype=np.float32), device=device)
    ranges = {s: ev.split_range(s) for s in ("train", "val", "test")}
    return Events(src, dst, t, msg, torch.unique(dst), ranges, ev.num_nodes)


# ----------------------------------------------------------------------------- PyG side
class GraphAttentionEmbedding(nn.Module):
    """PyG example's embedding: one ``TransformerConv`` from neighbours to roots.

    Args:
        in_dim: Memory width.
        out_dim: Embedding width (``HEADS`` heads of ``out_dim // HEADS``).
        msg_dim: Raw message width.
        time_enc: The memory's time encoder (shared, as in the example).
    """

    def __init__(self, in_dim: int, out_dim: int, msg_dim: int, time_enc: nn.Module) -> None:
        super().__init__()
        self.time_enc = time_enc
        self.conv = TransformerConv(
            in_dim,
            out_dim // HEADS,
            heads=HEADS,
            dropout=DROPOUT,
            edge_dim=msg_dim + time_enc.out_channels,
        )

    def forward(
        self,
        x: torch.Tensor,
        last_update: torch.Tensor,
        edge_index: torch.Tensor,
        t: torch.Tensor,
        msg: torch.Tensor,
    ) -> torch.Tensor:
        """Embeds nodes.

        Args:
            x: (U, in_dim) memory of the batch's nodes.
            last_update: (U,) int64 last memory update of each.
            edge_index: (2, M) local (neighbour, root) pairs.
            t: (M,) int64 time of each neighbour event.
            msg: (M, msg_dim) raw message of each neighbour event.

        Returns:
            (U, out_dim) embeddings.
        """
        rel = self.time_enc((last_update[edge_index[0]] - t).to(x.dtype))
        return self.conv(x, edge_index, torch.cat([rel, msg], dim=-1))


class PygTGN:
    """PyG's TGN pieces on one device, with the state a run walks through.

    Args:
        ev: The events.
        seed: Parameter seed.
        device: Where every tensor lives.
    """

    def __init__(self, ev: Events, seed: int, device: torch.device) -> None:
        torch.manual_seed(seed)
        d_msg = ev.msg.shape[1]
        self.ev = ev
        self.memory = TGNMemory(
            ev.num_nodes,
            d_msg,
            DIM,
            DIM,
            message_module=IdentityMessage(d_msg, DIM, DIM),
            aggregator_module=LastAggregator(),
        ).to(device)
        self.gnn = GraphAttentionEmbedding(DIM, DIM, d_msg, self.memory.time_enc).to(device)
        # The example's link predictor is Sven's decoder, layer for layer.
        self.pred = LinkDecoder(DIM).to(device)
        self.loader = LastNeighborLoader(ev.num_nodes, size=NEIGHBORS, device=device)
        # The time encoder is shared by memory and embedding: list each parameter once.
        params = {id(p): p for m in (self.memory, self.gnn, self.pred) for p in m.parameters()}
        self.optimizer = torch.optim.Adam(list(params.values()), lr=LR)
        self.assoc = torch.empty(ev.num_nodes, dtype=torch.int64, device=device)

    def set_mode(self, train: bool) -> None:
        for m in (self.memory, self.gnn, self.pred):
            m.train(train)

    def reset(self) -> None:
        """Fresh memory and neighbour lists (start of an epoch)."""
        self.memory.reset_state()
        self.loader.reset_state()

    def scores(self, lo: int, hi: int, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the positive events [lo, hi) and of their negatives ``neg`` (B,)."""
        ev = self.ev
        src, dst = ev.src[lo:hi], ev.dst[lo:hi]
        n_id, edge_index, e_id = self.loader(torch.cat([src, dst, neg]).unique())
        self.assoc[n_id] = torch.arange(n_id.numel(), device=n_id.device)
        z, last_update = self.memory(n_id)
        # The loader numbers events in insertion order; every epoch inserts from event
        # 0 (the train range starts there), so its ids are the store's.
        z = self.gnn(z, last_update, edge_index, ev.t[e_id], ev.msg[e_id])
        h_src = z[self.assoc[src]]
        return self.pred(h_src, z[self.assoc[dst]]), self.pred(h_src, z[self.assoc[neg]])

    def observe(self, lo: int, hi: int) -> None:
        """Writes events [lo, hi) to the memory's message store and the neighbour lists."""
        ev = self.ev
        src, dst = ev.src[lo:hi], ev.dst[lo:hi]
        self.memory.update_state(src, dst, ev.t[lo:hi], ev.msg[lo:hi])
        self.loader.insert(src, dst)

    def train_epoch(self, epoch: int, seed: int) -> tuple[int, float]:
        """One epoch over the train range; returns (events, training seconds)."""
        ev = self.ev
        self.set_mode(True)
        self.reset()
        lo, hi = ev.ranges["train"]
        seconds = 0.0
        for start in range(lo, hi, BATCH):
            stop = min(start + BATCH, hi)
            t0 = time.perf_counter()
            idx = torch.arange(start, stop, device=ev.src.device)
            neg = sample_negatives(seed, epoch, idx, ev.candidates, 1)[:, 0]
            self.optimizer.zero_grad(set_to_none=True)
            pos_out, neg_out = self.scores(start, stop, neg)
            logits = torch.cat([pos_out, neg_out])
            labels = torch.cat([torch.ones_like(pos_out), torch.zeros_like(neg_out)])
            loss = F.binary_cross_entropy_with_logits(logits, labels)
            # PyG's order: the batch's events go into the message store before the
            # backward pass; they are applied (with gradient) when the nodes are next read.
            self.observe(start, stop)
            loss.backward()
            self.optimizer.step()
            self.memory.detach()
            float(loss.detach())  # host sync, as Sven's step reads its loss back
            seconds += time.perf_counter() - t0
        return hi - lo, seconds

    @torch.no_grad()
    def evaluate(self, split: str, seed: int) -> float:
        """Mean per-batch AP over ``split``, continuing memory; updates memory."""
        ev = self.ev
        self.set_mode(False)
        lo, hi = ev.ranges[split]
        aps = []
        for start in range(lo, hi, BATCH):
            stop = min(start + BATCH, hi)
            idx = torch.arange(start, stop, device=ev.src.device)
            neg = sample_negatives(seed, EVAL_STREAM[split], idx, ev.candidates, 1)[:, 0]
            pos_out, neg_out = self.scores(start, stop, neg)
            aps.append(batch_ap(pos_out, neg_out))
            self.observe(start, stop)
        return float(np.mean(aps))


def batch_ap(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """AP of one batch: (B,) positive against (B,) negative logits, in float32."""
    scores = torch.cat([pos, neg]).float()
    labels = torch.cat([torch.ones_like(pos), torch.zeros_like(neg)])
    return average_precision(scores, labels)


def run_pyg(ev: Events, epochs: int, seed: int, device: torch.device) -> RunResult:
    """Trains and evaluates PyG's TGN; test AP of the best-validation epoch."""
    model = PygTGN(ev, seed, device)
    events, seconds, rates = 0, 0.0, []
    best = (-1.0, -1, float("nan"))  # val AP, epoch, test AP
    for epoch in range(epochs):
        n, s = model.train_epoch(epoch, seed)
        events, seconds = events + n, seconds + s
        rates.append(n / max(s, 1e-9))
        val_ap = model.evaluate("val", seed)
        test_ap = model.evaluate("test", seed)
        if val_ap > best[0]:
            best = (val_ap, epoch, test_ap)
    return RunResult("pyg", seed, events, seconds, rates, best[1], best[0], best[2])


# ---------------------------------------------------------------------------- Sven side
def run_sven(
    ev: Events,
    data: str,
    epochs: int,
    seed: int,
    device: str,
    threads: int,
    workdir: str | None,
    extra: tuple[str, ...] = (),
    side: str = "sven",
) -> RunResult:
    """Trains and evaluates Sven's TGN through ``sven.Trainer`` (``ev`` gives the split).

    ``extra`` overrides name a variant (e.g. ``train.cuda_graph=off``), reported as
    ``side``.
    """
    det = torch.are_deterministic_algorithms_enabled()
    det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    # A variant with train.matmul_precision=high turns TF32 on process-wide: PyG's side
    # runs with torch's default (off) whatever ran before it.
    tf32 = torch.backends.cuda.matmul.allow_tf32
    with tempfile.TemporaryDirectory(prefix="bench_vs_pyg-", dir=workdir) as out:
        overrides = [
            f"data.path={data}",
            f"out={out}",
            "model.name=tgn",
            f"model.memory_dim={DIM}",
            f"model.time_dim={DIM}",
            f"model.embed_dim={DIM}",
            f"model.num_neighbors={NEIGHBORS}",
            "model.sampling=recent",
            f"model.num_heads={HEADS}",
            f"model.dropout={DROPOUT}",
            f"train.batch_size={BATCH}",
            f"train.lr={LR}",
            "train.num_neg=1",
            f"train.epochs={epochs}",
            "train.patience=0",
            f"train.seed={seed}",
            f"train.threads={threads}",
            f"train.device={device}",
            "quiet=true",
            *extra,
        ]
        try:
            summary = sven.Trainer(None, overrides).fit()
        finally:
            torch.use_deterministic_algorithms(det, warn_only=det_warn)
            torch.backends.cuda.matmul.allow_tf32 = tf32
        lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rate = float(summary["train_events_per_s"])
    rates = [float(x["events_per_s"]) for x in lines]
    # Sven reports the rate over all epochs; every epoch walks the whole train range.
    lo, hi = ev.ranges["train"]
    events = int(summary["epochs_run"]) * (hi - lo)
    return RunResult(
        side,
        seed,
        events,
        events / rate,
        rates,
        int(summary["best_epoch"]),
        float(summary["val_ap"]),
        float(summary["test_ap"]),
    )


# --------------------------------------------------------------------------------- main
def median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def fmt(values: list[float], digits: int) -> str:
    med, lo, hi = median_range(values)
    if len(values) == 1:
        return f"{med:,.{digits}f}"
    return f"{med:,.{digits}f} ({lo:,.{digits}f}..{hi:,.{digits}f})"


def table(results: list[RunResult]) -> str:
    """Markdown table: median (min..max) over the repeats of each side."""
    rows = [
        "| side | runs | train events/s | per-epoch events/s (median of runs) | test AP | "
        "val AP | best epoch | CPU s / wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    sides = list(dict.fromkeys(r.side for r in results))
    for side in sides:
        rs = [r for r in results if r.side == side]
        if not rs:
            continue
        per_epoch = [
            statistics.median(r.epoch_events_per_s[e] for r in rs)
            for e in range(len(rs[0].epoch_events_per_s))
        ]
        rows.append(
            f"| {side} | {len(rs)} | {fmt([r.train_events_per_s for r in rs], 0)} | "
            f"{' / '.join(f'{x:,.0f}' for x in per_epoch)} | "
            f"{fmt([r.test_ap for r in rs], 4)} | {fmt([r.val_ap for r in rs], 4)} | "
            f"{', '.join(str(r.best_epoch) for r in rs)} | "
            f"{fmt([r.cpu_s / max(r.wall_s, 1e-9) for r in rs], 2)} |"
        )
    pyg_runs = [r for r in results if r.side == "pyg"]
    for side in sides:
        sven_runs = [r for r in results if r.side == side]
        if side == "pyg" or not pyg_runs:
            continue
        # Each repeat ran both sides back to back: their ratio is less exposed to the
        # machine's load drifting between repeats than either rate alone.
        ratios = [s.train_events_per_s / p.train_events_per_s for s, p in zip(sven_runs, pyg_runs)]
        rows.append(f"\n{side} / pyg train events/s, paired by repeat: {fmt(ratios, 2)}")
    return "\n".join(rows)


def main() -> None:
    global BATCH
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="event store (sven data convert output)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first repeat")
    ap.add_argument("--sides", nargs="+", default=["sven", "pyg"], choices=["sven", "pyg"])
    ap.add_argument("--batch", type=int, default=BATCH, help="events per batch, both sides")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE[,KEY=VALUE...]",
        help="a Sven variant with its own overrides, e.g. eager=train.cuda_graph=off; "
        "repeatable; replaces the plain 'sven' side",
    )
    ap.add_argument("--workdir", default=None, help="where Sven's run folders go (temporary)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()

    BATCH = args.batch
    variants: dict[str, tuple[str, ...]] = {}
    for spec in args.variant:
        name, _, over = spec.partition("=")
        variants[f"sven-{name}"] = tuple(x for x in over.split(",") if x)
    sides: list[str] = []
    for side in args.sides:
        sides.extend(variants or {"sven": ()}) if side == "sven" else sides.append(side)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    if args.threads:
        torch.set_num_threads(args.threads)
    ev = load_events(args.data, device)
    load_before = os.getloadavg()
    results: list[RunResult] = []
    for rep in range(args.repeats):
        seed = args.seed + rep
        # Alternate which side goes first, so drift in the machine's load hits both.
        order = sides if rep % 2 == 0 else sides[::-1]
        for side in order:
            wall0, cpu0 = time.perf_counter(), time.process_time()
            if side != "pyg":
                r = run_sven(
                    ev,
                    args.data,
                    args.epochs,
                    seed,
                    args.device,
                    args.threads,
                    args.workdir,
                    variants.get(side, ()),
                    side,
                )
            else:
                r = run_pyg(ev, args.epochs, seed, device)
            r.wall_s = time.perf_counter() - wall0
            r.cpu_s = time.process_time() - cpu0
            results.append(r)
            print(
                f"repeat {rep} {side}: {r.train_events_per_s:,.0f} train events/s, "
                f"test AP {r.test_ap:.4f} (best epoch {r.best_epoch}), {r.wall_s:.0f} s wall, "
                f"{r.cpu_s:.0f} s CPU",
                flush=True,
            )
    load_after = os.getloadavg()

    lo, hi = ev.ranges["train"]
    print(
        f"\n{args.data}: {hi - lo:,} training events, {args.epochs} epochs, device {args.device}, "
        f"threads {torch.get_num_threads()}, load average {load_before[0]:.1f} before / "
        f"{load_after[0]:.1f} after; median (min..max) of {args.repeats} runs\n"
    )
    print(table(results))
    if args.out:
        record: dict[str, Any] = {
            "data": args.data,
            "epochs": args.epochs,
            "batch": BATCH,
            "variants": {k: list(v) for k, v in variants.items()},
            "device": args.device,
            "threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "torch": torch.__version__,
            "runs": [asdict(r) | {"train_events_per_s": r.train_events_per_s} for r in results],
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
