"""``sven train`` on P ranks against one plain process: train events/s, test AP and the
bytes the ranks exchange.

For each store and variant (extra overrides), the same preset run as ``sven train`` (one
process, no process group) and under ``torchrun --nproc_per_node N`` for each
``--nproc`` (a real process group: the P-rank step with its collectives inside the
captured graph on CUDA, gloo on CPU), each a fresh process; ``--repeat`` times, the runs
of a repeat interleaved, so that a machine's drift spreads over every setting alike.
Reported per setting, the median (min..max) over the repeats: the warm train events/s
(epochs after the first, from ``metrics.jsonl``; the only epoch's when there is one),
test AP, and on P > 1 ranks the exchange's bytes (ids and memory/mail rows between
ranks), what a naive exchange (one fetch per occurrence) would send, the largest rank's
over the mean, and whether the measured epoch-0 bytes per rank equal the cost model's
prediction; the launched run's rate over the plain one's. JSON goes to ``--out`` after
every run, so a time-out loses nothing.

One H200, the presets on two real stores::

    python benchmarks/bench_rank_step.py --store collegemsg=STORES/collegemsg \\
        --store wikipedia=STORES/wikipedia --epochs 3 --out $OUT/rank_step.json

Two GPUs (``train.batch_size`` is the global batch, the same for every launcher of a
variant, so each variant is a strong-scaling point)::

    python benchmarks/bench_rank_step.py --store syn7=STORES/syn7 --nproc 1 --nproc 2 \\
        --variant "train.batch_size=1200 dist.strategy=hash" \\
        --variant "train.batch_size=1200 dist.strategy=minmax" --out $OUT/two_gpus.json

Gloo ranks alone (``--no-plain``): partition strategies, one epoch, exact bytes; the
pipeline's settings, three interleaved runs each::

    python benchmarks/bench_rank_step.py --store collegemsg=STORE --no-plain --epochs 1 \\
        --nproc 2 --nproc 4 --variant "train.batch_size=600 dist.strategy=hash" \\
        --variant "train.batch_size=600 dist.strategy=minmax" --out dist.json
    python benchmarks/bench_rank_step.py --store collegemsg=STORE --no-plain --epochs 1 \\
        --nproc 2 --repeat 3 --variant "pipeline.prefetch=0 train.max_batches=60" \\
        --variant "pipeline.prefetch=2 train.max_batches=60" --out pipeline.json

On a shared CPU the rates move with the machine's load; the byte counts are exact.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run(cmd: list[str], out: Path) -> dict[str, Any]:
    """Runs one training process; returns its figures."""
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    res: dict[str, Any] = {"cmd": " ".join(cmd), "rc": proc.returncode, "process_s": wall}
    if proc.returncode != 0:
        res["stderr"] = proc.stderr[-3000:]
        return res
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    rates = [x["events_per_s"] for x in lines]
    s = json.loads((out / "summary.json").read_text())
    res.update(
        first_epoch_events_per_s=rates[0],
        warm_events_per_s=statistics.mean(rates[1:] or rates),
        epoch_events_per_s=rates,
        **{k: s.get(k) for k in ("test_ap", "val_ap", "step_captured", "world_size", "wall_s")},
    )
    if s.get("world_size", 1) > 1:
        res.update(
            {k: s.get(k) for k in ("comm_bytes_exchange", "comm_bytes_naive", "comm_max_over_mean")}
        )
        predicted = s.get("comm_bytes_predicted_epoch0_per_rank")
        res["predicted_equals_measured"] = predicted == s.get("comm_bytes_measured_epoch0_per_rank")
    return res


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown: one row per (store, variant, launcher), medians over the repeats."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        if r["rc"] == 0:
            groups.setdefault((r["dataset"], r["variant"], r["launcher"]), []).append(r)
    head = (
        "| store | variant | launcher | runs | warm train events/s | vs plain | test AP "
        "| exchange MB | naive MB | naive / exchange | max/mean | predicted == measured |"
    )
    lines = [head, "|" + "---|" * 12]
    for (name, var, how), rs in groups.items():
        rates = [r["warm_events_per_s"] for r in rs]
        rate = statistics.median(rates)
        plain = groups.get((name, var, "plain"))
        ratio = "-"
        if plain and how != "plain":
            ratio = f"{rate / statistics.median(r['warm_events_per_s'] for r in plain):.2f}x"
        comm = ["-"] * 5
        if "comm_bytes_exchange" in rs[0]:
            exch = statistics.median(r["comm_bytes_exchange"] for r in rs)
            naive = statistics.median(r["comm_bytes_naive"] for r in rs)
            equal = all(r["predicted_equals_measured"] for r in rs)
            comm = [f"{exch / 1e6:.1f}", f"{naive / 1e6:.1f}", f"{naive / max(exch, 1):.2f}x",
                    f"{rs[0]['comm_max_over_mean']:.3f}", "yes" if equal else "NO"]  # fmt: skip
        ap = statistics.median(r["test_ap"] for r in rs)
        spread = f"{rate:,.0f} ({min(rates):,.0f}..{max(rates):,.0f})"
        cells = [name, var or "preset", how, str(len(rs)), spread, ratio, f"{ap:.4f}", *comm]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", action="append", required=True, help="NAME=PATH")
    ap.add_argument("--config", default="configs/tgn.yaml")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--runs-dir", default=None, help="run folders (default: a temporary one)")
    ap.add_argument(
        "--variant",
        action="append",
        default=None,
        help="extra overrides of one variant, space separated (default: the preset)",
    )
    ap.add_argument(
        "--nproc",
        type=int,
        action="append",
        default=None,
        help="torchrun process counts to run beside the plain process (default: 1); "
        "e.g. --nproc 1 --nproc 2 on a two-GPU machine",
    )
    ap.add_argument("--no-plain", action="store_true", help="only the launched runs")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every setting")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    launchers = [] if args.no_plain else [("plain", [sys.executable, "-m", "sven", "train"])]
    launchers += [
        (f"torchrun{n}", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", str(n), "-m", "sven", "train"])
        for n in args.nproc or [1]
    ]  # fmt: skip
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="sven-bench-rank-step-"))
    report: dict[str, Any] = {"runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for rep in range(args.repeat):
        for spec in args.store:
            name, path = spec.split("=", 1)
            for var in args.variant or [""]:
                common = ["--config", args.config, f"data.path={path}",
                          f"train.epochs={args.epochs}", "--quiet", *var.split()]  # fmt: skip
                for how, prefix in launchers:
                    o = runs_dir / f"{name}-{how}-{len(report['runs'])}"
                    res = run([*prefix, *common, f"out={o}"], o)
                    res.update(dataset=name, launcher=how, variant=var, repeat=rep)
                    report["runs"].append(res)
                    out.write_text(json.dumps(report, indent=2) + "\n")
                    print(json.dumps({k: res.get(k) for k in (
                        "dataset", "launcher", "variant", "repeat", "rc", "warm_events_per_s",
                        "test_ap", "comm_bytes_exchange", "process_s",
                    )}), flush=True)  # fmt: skip
    report["table"] = table(report["runs"])
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(report["table"])


if __name__ == "__main__":
    main()
