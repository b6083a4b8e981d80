"""Distributed communication and throughput: redundancy-free vs naive, hash vs minmax.

For each dataset, model, rank count P and partition strategy, runs one training epoch
(TGN by default) with ``torchrun --nproc_per_node P -m sven train`` (gloo on CPU) and
reads the run's
``summary.json``: bytes sent between ranks by the redundancy-free exchange (ids and
memory/mail rows, gradients excluded), what a naive exchange (one fetch per occurrence)
would have sent, their ratio, the max/mean per-rank exchange volume, and training
events/s.

Usage:
    python benchmarks/bench_dist.py --data collegemsg=STORE1 wikipedia=STORE2 \\
        --ranks 2 4 --strategies hash minmax --batch 600 --out dist.json
    python benchmarks/bench_dist.py --data collegemsg=STORE1 --models dyrep apan --ranks 2

Events/s on a 2-core machine with 4 ranks measures oversubscription as much as Sven;
the byte counts are exact whatever the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_one(
    store: str,
    model: str,
    ranks: int,
    strategy: str,
    batch: int,
    extra: list[str],
    workdir: Path,
    python: str = sys.executable,
    tag: str = "",
) -> dict[str, Any]:
    """Runs one distributed epoch and returns its summary.

    ``python`` runs it (another checkout's interpreter, to compare versions); ``tag``
    names the run folder apart from others of the same grid point.
    """
    out = workdir / f"{Path(store).name}-{model}-p{ranks}-{strategy}{tag}"
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--master_port",
        str(29500 + (os.getpid() % 1000)),
        "-m",
        "sven",
        "train",
        f"data.path={store}",
        f"out={out}",
        "train.overwrite=true",  # a rerun of the benchmark replaces its earlier run
        f"model.name={model}",
        f"train.batch_size={batch}",
        "train.epochs=1",
        f"dist.strategy={strategy}",
        "train.threads=1",
        "quiet=true",
        *extra,
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads((out / "summary.json").read_text())


def main() -> int:
    """Runs the grid and prints a table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", required=True, help="NAME=STORE pairs")
    ap.add_argument("--models", nargs="+", default=["tgn"], help="tgn, jodie, dyrep, apan")
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--strategies", nargs="+", default=["hash", "minmax"])
    ap.add_argument("--batch", type=int, default=600)
    ap.add_argument("--extra", nargs="*", default=[], help="further sven train overrides")
    ap.add_argument("--out", default="bench_dist.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.data:
            name, store = item.split("=", 1)
            for model, p, strategy in itertools.product(args.models, args.ranks, args.strategies):
                s = run_one(store, model, p, strategy, args.batch, args.extra, Path(tmp))
                exch = s["comm_bytes_exchange"]
                row = {
                    "dataset": name,
                    "model": model,
                    "ranks": p,
                    "strategy": strategy,
                    "exchange_MB": exch / 1e6,
                    "naive_MB": s["comm_bytes_naive"] / 1e6,
                    "naive_over_exchange": s["comm_bytes_naive"] / max(exch, 1),
                    "max_over_mean": s["comm_max_over_mean"],
                    "grads_MB": s["comm_bytes_grads"] / 1e6,
                    "train_events_per_s": s["train_events_per_s"],
                    "test_ap": s["test_ap"],
                    "predicted_equals_measured": s.get("comm_bytes_predicted_epoch0_per_rank")
                    == s.get("comm_bytes_measured_epoch0_per_rank"),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    hdr = (
        "dataset",
        "model",
        "P",
        "strategy",
        "exchange MB",
        "naive MB",
        "naive/RF",
        "max/mean",
        "events/s",
        "test AP",
        "predicted == measured",
    )
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        print(
            f"| {r['dataset']} | {r['model']} | {r['ranks']} | {r['strategy']} "
            f"| {r['exchange_MB']:.1f} "
            f"| {r['naive_MB']:.1f} "
            f"| {r['naive_over_exchange']:.2f}x | {r['max_over_mean']:.3f} "
            f"| {r['train_events_per_s']:.0f} "
            f"| {r['test_ap']:.4f} | {'yes' if r['predicted_equals_measured'] else 'NO'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
