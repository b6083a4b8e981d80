"""Partition quality and cost: every strategy, P in {2, 4, 8, 16}, real and synthetic data.

(a) **Quality matrix.** For each dataset and P, every strategy partitions the store
    (in process) and the exact cost model replays the training epoch once for all of
    them (the accesses do not depend on the partition). Reported per cell: the max
    per-rank comm bytes (the objective), its max/mean, the event max/mean, the naive
    (one fetch per occurrence) max bytes beside the redundancy-free one, the per-batch
    event imbalance and the partitioning time.
(b) **Scale.** ``sven partition`` of a large synthetic store (default 10^8 events over
    10^6 nodes) into 16 parts with ``minmax``, as a child process: wall time and peak
    RSS (``ru_maxrss`` from ``wait4``), with the per-phase timings it records.

Datasets: ``collegemsg``, ``wikipedia``, ``bitcoin-otc`` are converted from
a folder of the raw public files (``$SVEN_SHARED_DATA``; see docs/data.md, "Public
datasets") into ``--workdir`` with ``sven data convert``; ``synth`` is made with
``sven data synth`` (``--synth-events`` over ``--synth-nodes``). Stores are reused
when already there.

Usage:
    python benchmarks/bench_partition.py --out real.json                # three real datasets
    python benchmarks/bench_partition.py --datasets synth --out synth.json   # 10^7 events
    python benchmarks/bench_partition.py --scale --out scale.json       # 10^8 into 16 parts

Numbers, not a test: nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from steps import run_measured, sven_cmd

REPO = Path(__file__).resolve().parents[1]
# The raw public files (docs/data.md, "Public datasets"): where $SVEN_SHARED_DATA says.
SHARED = Path(os.environ.get("SVEN_SHARED_DATA", "data"))
REAL = {
    "collegemsg": ("collegemsg/CollegeMsg.txt.gz", "snap"),
    "wikipedia": ("wikipedia/wikipedia.csv.gz", "jodie"),
    "bitcoin-otc": ("bitcoin-otc/soc-sign-bitcoinotc.csv.gz", "snap-signed"),
}


def ensure_store(name: str, args: argparse.Namespace, work: Path) -> Path:
    """Converts or generates dataset ``name`` into ``work`` unless already there."""
    if name in REAL:
        out = work / name
        if not (out / "meta.json").is_file():
            raw, fmt = REAL[name]
            if not (SHARED / raw).is_file():
                raise SystemExit(f"missing {SHARED / raw}")
            cmd = sven_cmd("data", "convert", str(SHARED / raw), "--format", fmt)
            run_measured([*cmd, "--out", str(out)], work / f"{name}.log")
        return out
    out = work / f"synth_{args.synth_events}_{args.synth_nodes}"
    if not (out / "meta.json").is_file():
        cmd = sven_cmd("data", "synth", "--events", args.synth_events, "--nodes", args.synth_nodes)
        run_measured([*cmd, "--seed", "0", "--out", str(out)], work / "synth.log")
    return out


def bench_matrix(name: str, store: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every strategy at every P on one store; one exact replay for all of them."""
    from sven.datasets.store import TemporalEvents
    from sven.partition.access import recent_sampler
    from sven.partition.api import partition_store
    from sven.partition.cost import comm_costs

    ev = TemporalEvents.load(store)
    _, stop = ev.split_range("train")
    t0 = time.perf_counter()
    sampler = recent_sampler(ev.src, ev.dst, ev.t, ev.num_nodes, args.k)
    print(f"{name}: {ev.num_events} events, {ev.num_nodes} nodes, sampler "
          f"{time.perf_counter() - t0:.1f}s", flush=True)  # fmt: skip
    cells, parts_list = [], []
    for parts in args.parts:
        for strategy in args.strategies:
            t0 = time.perf_counter()
            res = partition_store(
                ev, parts, strategy, batch_size=args.batch, balance=args.balance,
                k=args.k, sampler=sampler,
            )  # fmt: skip
            secs = time.perf_counter() - t0
            print(f"  P={parts:<3} {strategy:7s} {secs:7.1f}s", flush=True)
            cells.append({"dataset": name, "parts": parts, "strategy": strategy,
                          "partition_s": secs})  # fmt: skip
            parts_list.append((res.owner, res.assign, parts))
    t0 = time.perf_counter()
    reports = comm_costs(
        ev.src, ev.dst, ev.t, parts_list, batch_size=args.batch, k=args.k, stop=stop,
        sampler=sampler,
    )  # fmt: skip
    print(f"  replay of {len(parts_list)} partitions: {time.perf_counter() - t0:.1f}s")
    for cell, rep in zip(cells, reports):
        s = rep.summary()
        m = s["metrics"]
        cell.update(
            events=int(ev.num_events),
            nodes=int(ev.num_nodes),
            train_events=int(stop),
            max_comm_bytes=m["comm_bytes"]["max"],
            mean_comm_bytes=m["comm_bytes"]["mean"],
            comm_imbalance=m["comm_bytes"]["imbalance"],
            event_imbalance=m["events"]["imbalance"],
            max_naive_bytes=m["naive_bytes"]["max"],
            naive_imbalance=m["naive_bytes"]["imbalance"],
            batch_event_imbalance=s["batch_event_imbalance"],
            redundancy_saving=s["redundancy_saving"],
        )
    return cells


def bench_scale(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``sven partition`` of a large synthetic store into ``--scale-parts`` ranks."""
    store = work / f"synth_{args.scale_events}_{args.scale_nodes}"
    gen = None
    if not (store / "meta.json").is_file():
        cmd = sven_cmd("data", "synth", "--events", args.scale_events, "--nodes", args.scale_nodes)
        gen = run_measured([*cmd, "--seed", "0", "--out", str(store)], work / "scale_synth.log")
    out = work / f"part_{args.scale_events}_{args.scale_parts}"
    cmd = sven_cmd(
        "partition", str(store), "--parts", str(args.scale_parts), "--strategy",
        args.scale_strategy, "--batch", str(args.batch), "--k", str(args.k), "--out", str(out),
        "--overwrite",
    )  # fmt: skip
    res = run_measured(cmd, work / "scale_partition.log")
    meta = json.loads((out / "meta.json").read_text())
    res.update(
        store=str(store),
        synth=gen,
        timings=meta["timings"],
        report={n: meta["report"]["metrics"][n] for n in ("comm_bytes", "events", "naive_bytes")},
    )
    return res


def fmt_mb(x: float) -> str:
    return f"{x / 1e6:.1f}"


def print_tables(cells: list[dict[str, Any]], strategies: list[str]) -> None:
    """Markdown: max per-rank comm MB (comm max/mean, events max/mean); then naive vs RF."""
    print("\nMax per-rank comm MB per epoch (comm max/mean; event max/mean); * = lowest\n")
    print("| dataset | P | " + " | ".join(strategies) + " |")
    print("|---|---|" + "---|" * len(strategies))
    rows: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for c in cells:
        rows.setdefault((c["dataset"], c["parts"]), {})[c["strategy"]] = c
    for (ds, parts), row in rows.items():
        best = min(c["max_comm_bytes"] for c in row.values())
        out = []
        for s in strategies:
            c = row.get(s)
            if c is None:
                out.append("-")
                continue
            star = "*" if c["max_comm_bytes"] == best else ""
            out.append(
                f"{fmt_mb(c['max_comm_bytes'])}{star} "
                f"({c['comm_imbalance']:.2f}; {c['event_imbalance']:.2f})"
            )
        print(f"| {ds} | {parts} | " + " | ".join(out) + " |")
    print("\nNaive (one fetch per occurrence) vs redundancy-free max per-rank MB\n")
    print("| dataset | P | " + " | ".join(strategies) + " |")
    print("|---|---|" + "---|" * len(strategies))
    for (ds, parts), row in rows.items():
        out = [
            f"{fmt_mb(row[s]['max_naive_bytes'])} / {fmt_mb(row[s]['max_comm_bytes'])}"
            if s in row else "-"
            for s in strategies
        ]  # fmt: skip
        print(f"| {ds} | {parts} | " + " | ".join(out) + " |")
    print("\nPartitioning seconds\n")
    print("| dataset | P | " + " | ".join(strategies) + " |")
    print("|---|---|" + "---|" * len(strategies))
    for (ds, parts), row in rows.items():
        out = [f"{row[s]['partition_s']:.1f}" if s in row else "-" for s in strategies]
        print(f"| {ds} | {parts} | " + " | ".join(out) + " |")


def main(argv: list[str] | None = None) -> int:
    from sven.partition.api import STRATEGIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--datasets", default="collegemsg,wikipedia,bitcoin-otc",
                   help="comma list of collegemsg, wikipedia, bitcoin-otc, synth")  # fmt: skip
    p.add_argument("--parts", default="2,4,8,16")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--batch", type=int, default=600)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--balance", type=float, default=1.05)
    p.add_argument("--synth-events", default="1e7")
    p.add_argument("--synth-nodes", default="1e5")
    p.add_argument("--scale", action="store_true", help="run the scale test instead")
    p.add_argument("--scale-events", default="1e8")
    p.add_argument("--scale-nodes", default="1e6")
    p.add_argument("--scale-parts", type=int, default=16)
    p.add_argument("--scale-strategy", default="minmax")
    p.add_argument("--workdir", help="stores and partitions (default: a temp dir, kept)")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    args.parts = [int(x) for x in args.parts.split(",")]
    args.strategies = args.strategies.split(",")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="sven-bench-partition-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "settings": {"batch": args.batch, "k": args.k, "balance": args.balance},
    }
    if args.scale:
        res = bench_scale(args, work)
        results["scale"] = res
        print(json.dumps({k: v for k, v in res.items() if k != "tail"}, indent=2))
    else:
        cells = []
        for name in args.datasets.split(","):
            cells += bench_matrix(name, ensure_store(name, args, work), args)
        results["cells"] = cells
        print_tables(cells, args.strategies)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nworkdir: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
