"""How many node-state rows each training batch reads, along the training split.

A step reads the state rows of its batch's distinct nodes (roots, negatives and their
sampled neighbours). With state in pinned host memory those rows cross the host link
every step, so a tier's speed can change along a run as its batches reach more
distinct nodes (docs/scale.md: the host tier's step 8,000 steps into a 10^7-node graph
is slower than 30 steps in). This counts them exactly, as the step's slot plan does
(``sven.engine.capacities.batch_node_counts``), on any device, and prints them by
stretch of the split beside the bytes a step moves at the state's row size.

    python3 benchmarks/batch_rows.py --data STORE [--out rows.json] [key=value ...]

Numbers, not a test; ``train.device=cpu`` unless an override says otherwise.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import sven
from sven.engine.capacities import batch_node_counts


def stretches(counts: torch.Tensor, marks: list[int], parts: int) -> list[dict[str, float]]:
    """Mean, median and most rows a batch over windows of the split: ``parts`` equal
    stretches, then 20 batches from each of ``marks`` (batch indices)."""
    rows = []
    n = counts.shape[0]
    edges = [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]
    edges += [(m, min(m + 20, n)) for m in marks if m < n]
    for a, b in edges:
        c = counts[a:b].double()
        rows.append({"from": a, "to": b, "mean": round(float(c.mean()), 1),
                     "median": float(c.median()), "most": int(c.max())})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="an event store (sven data ...)")
    ap.add_argument("--out", help="write the counts' summary here (json)")
    ap.add_argument("--parts", type=int, default=10, help="equal stretches of the split")
    ap.add_argument("--at", type=int, nargs="*", default=[30, 8000],
                    help="20 batches from each of these batch indices")  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="config key=value (train.batch_size=600)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as run:
        tr = sven.Trainer(
            None,
            [f"data.path={args.data}", f"out={run}", "quiet=true", "train.device=cpu",
             *args.overrides],
        )  # fmt: skip
        tc = tr.cfg.train
        lo, hi = tr.ranges["train"]
        counts = batch_node_counts(tr.step.source, tc.batch_size, lo, hi, 0, tc.num_neg)
        row_bytes = sum(t[0].numel() * t.element_size() for t in tr.memory.state_dict().values())
    windows = stretches(counts, args.at, args.parts)
    print(f"{counts.shape[0]} batches of {tc.batch_size}; a state row {row_bytes} bytes")
    for w in windows:
        mb = w["mean"] * row_bytes / 1e6
        print(f"batches {w['from']:>7}..{w['to']:<7} rows mean {w['mean']:>9,.1f} median "
              f"{w['median']:>8,.0f} most {w['most']:>7,}  ({mb:.2f} MB a step)")  # fmt: skip
    if args.out:
        summary = {"data": args.data, "batch_size": tc.batch_size, "row_bytes": row_bytes,
                   "batches": counts.shape[0], "windows": windows}  # fmt: skip
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
