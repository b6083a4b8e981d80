"""The step pipeline on and off: train events/s and time per step on P gloo ranks.

Runs one training epoch (``train.max_batches`` of them) per setting with
``torchrun --nproc_per_node P -m sven train`` (see ``bench_dist.py``), the settings
interleaved and repeated, and reports the median of each:

* ``off``: ``pipeline.prefetch=0 pipeline.micro_batches=1`` (batches built when trained;
  the write-back is still sent asynchronously and overlaps the gradient all-reduce);
* ``D=2``, ``D=2 m=2``, ``D=2 m=4``, ``D=2 auto``: prefetch and micro-batches, staleness 0;
* ``D=2 s=1``: staleness 1 (changes results; for the speed only);
* ``sync`` (with ``--baseline-python``): another checkout's interpreter, e.g. one from
  before the pipeline, where every stage runs in order.

Usage:
    python benchmarks/bench_pipeline.py --data STORE --ranks 2 --batch 200 \\
        --max-batches 80 --repeat 3 [--baseline-python ../main/.venv/bin/python]

On a shared CPU the figures move with the machine's load (print ``uptime`` with them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dist import run_one  # the sibling script

SETTINGS = {
    "off": ["pipeline.prefetch=0", "pipeline.micro_batches=1"],
    "D=2": ["pipeline.prefetch=2", "pipeline.micro_batches=1"],
    "D=2 m=2": ["pipeline.prefetch=2", "pipeline.micro_batches=2"],
    "D=2 m=4": ["pipeline.prefetch=2", "pipeline.micro_batches=4"],
    "D=2 auto": ["pipeline.prefetch=2", "pipeline.micro_batches=auto"],
    "D=2 s=1": ["pipeline.prefetch=2", "pipeline.staleness=1"],
}


def main() -> int:
    """Runs the settings and prints a table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="event store")
    ap.add_argument("--model", default="tgn")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--strategy", default="minmax")
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--max-batches", type=int, default=80)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--baseline-python", default="", help="interpreter of another checkout")
    ap.add_argument("--extra", nargs="*", default=[], help="further sven train overrides")
    ap.add_argument("--out", default="bench_pipeline.json")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            names = list(args.settings) + (["sync"] if args.baseline_python else [])
            for name in names:
                extra = [f"train.max_batches={args.max_batches}", *args.extra]
                python = sys.executable
                if name == "sync":
                    python = args.baseline_python
                else:
                    extra += SETTINGS[name]
                tag = f"-{name.replace(' ', '_').replace('=', '')}-{r}"
                s = run_one(
                    args.data, args.model, args.ranks, args.strategy, args.batch, extra,
                    Path(tmp), python=python, tag=tag,
                )  # fmt: skip
                runs.setdefault(name, []).append(s)
                print(json.dumps({"setting": name, "repeat": r, **_row(s, args)}), flush=True)
    table = {name: _median(ss, args) for name, ss in runs.items()}
    Path(args.out).write_text(json.dumps({"runs": runs, "median": table}, indent=2))
    base = table.get("sync", table.get("off"))
    print("| setting | train events/s | ms/step | vs " + ("sync" if "sync" in table else "off"))
    print("|---|---|---|---|")
    for name, row in table.items():
        speed = row["events_per_s"] / base["events_per_s"]
        print(f"| {name} | {row['events_per_s']:.0f} | {row['ms_per_step']:.1f} | {speed:.2f}x |")
    return 0


def _row(s: dict, args: argparse.Namespace) -> dict:
    ev_s = s["train_events_per_s"]
    row = {"events_per_s": ev_s, "ms_per_step": 1e3 * args.batch / ev_s}
    if "pipeline_micro_batches" in s:
        row["micro_batches"] = s["pipeline_micro_batches"]
    return row


def _median(ss: list[dict], args: argparse.Namespace) -> dict:
    ev_s = statistics.median(s["train_events_per_s"] for s in ss)
    return {"events_per_s": ev_s, "ms_per_step": 1e3 * args.batch / ev_s}


if __name__ == "__main__":
    sys.exit(main())
