"""Ingest throughput and peak memory: ``sven data convert`` and ``sven data synth``.

(a) A synthetic raw file (default 10^7 events; ``src,dst,t,f0,f1`` csv with a header, or
    SNAP's whitespace ``SRC DST T``) is written from the generator's chunks, then
    ``sven data convert`` turns it into an event store.
(b) ``sven data synth`` writes a large synthetic store (default 10^8 events) directly.

Each command runs as a child process; its wall time and peak resident memory (the
child's own ``ru_maxrss`` from ``wait4``, children of the child included) are
reported, with the start-up cost of ``sven --version`` for reference (it is part of
every wall time).

Usage:
    python benchmarks/bench_ingest.py --out ingest.json              # full sizes
    python benchmarks/bench_ingest.py --convert-events 1e6 --synth-events 1e6
    python benchmarks/bench_ingest.py --skip-synth --format snap

Needs ~40 bytes of disk per converted event (raw file + store + the writer's spool)
and ~35 bytes per synthetic event (store + spool), under --workdir.

Numbers, not a test: nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from steps import run_measured, sven_cmd

from sven.datasets.cli import parse_count
from sven.datasets.synth import DEFAULT_CHUNK_SIZE, iter_synth_chunks


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def write_raw(
    path: Path, fmt: str, events: int, nodes: int, feat_dim: int, seed: int
) -> dict[str, Any]:
    """Writes the generator's stream as a raw text file, chunk by chunk.

    Returns:
        Seconds taken and the file size.
    """
    import pyarrow as pa
    import pyarrow.csv as pacsv

    start = time.perf_counter()
    dim = feat_dim if fmt == "csv" else 0
    names = ["src", "dst", "t"] + [f"f{j}" for j in range(dim)]
    # pyarrow quotes header names; write a plain header as most raw csv files have.
    opts = pacsv.WriteOptions(include_header=False, delimiter="," if fmt == "csv" else " ")
    with open(path, "wb") as f:
        if fmt == "csv":
            f.write((",".join(names) + "\n").encode())
        writer = None
        for chunk in iter_synth_chunks(events, nodes, seed, dim, chunk_size=DEFAULT_CHUNK_SIZE):
            cols = [chunk["src"], chunk["dst"], chunk["t"]]
            # Rounded: real raw files carry a few digits, not float32 noise.
            cols += [np.round(chunk["edge_feat"][:, j], 4) for j in range(dim)]
            table = pa.table(dict(zip(names, cols)))
            if writer is None:
                writer = pacsv.CSVWriter(f, table.schema, write_options=opts)
            writer.write_table(table)
        if writer is not None:
            writer.close()
    return {"write_s": time.perf_counter() - start, "raw_bytes": path.stat().st_size}


def convert_args(raw: Path, store: Path, fmt: str, feat_dim: int) -> list[str]:
    """The ``sven data convert`` command line for the raw file written by ``write_raw``."""
    args = ["data", "convert", str(raw), "--out", str(store), "--format", fmt]
    if fmt == "csv":
        args += ["--src", "src", "--dst", "dst", "--time", "t"]
        if feat_dim:
            args += ["--feat", ",".join(f"f{j}" for j in range(feat_dim))]
    return sven_cmd(*args)


def bench_convert(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    raw = work / ("events.csv" if args.format == "csv" else "events.txt")
    written = write_raw(raw, args.format, args.convert_events, args.nodes, args.feat_dim, args.seed)
    store = work / "converted"
    res = run_measured(convert_args(raw, store, args.format, args.feat_dim), work / "convert.log")
    res.update(written)
    res.update(
        events=args.convert_events,
        format=args.format,
        store_bytes=dir_bytes(store),
    )
    if not args.keep:
        raw.unlink()
        shutil.rmtree(store)
    return res


def bench_synth(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    store = work / "synth"
    cmd = sven_cmd(
        "data", "synth",
        "--events", str(args.synth_events),
        "--nodes", str(args.synth_nodes),
        "--seed", str(args.seed),
        "--edge-feat-dim", str(args.synth_feat_dim),
        "--out", str(store),
    )  # fmt: skip
    res = run_measured(cmd, work / "synth.log")
    res.update(
        events=args.synth_events,
        nodes=args.synth_nodes,
        edge_feat_dim=args.synth_feat_dim,
        store_bytes=dir_bytes(store),
    )
    if not args.keep:
        shutil.rmtree(store)
    return res


def add_rates(res: dict[str, Any]) -> None:
    """events/s over the whole command, and over the time the command itself reports.

    Both commands end with ``<secs> s (<rate> events/s)``, timed from argument
    parsing to the finished store: that excludes the interpreter and import start-up,
    which is noise on small runs.
    """
    res["events_per_s"] = res["events"] / res["wall_s"]
    found = re.findall(r"([0-9.]+) s \(([0-9,]+) events/s\)", res["tail"])
    res["self_s"] = float(found[-1][0]) if found else None
    res["events_per_s_self"] = int(found[-1][1].replace(",", "")) if found else None


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(results: dict[str, Any]) -> None:
    head = (
        f"{'step':<10}{'events':>14}{'wall s':>9}{'CPU s':>9}{'events/s':>12}"
        f"{'own s':>9}{'own ev/s':>12}{'peak RSS MiB':>14}{'store MiB':>11}"
    )
    print(head)
    print("-" * len(head))
    for step in ("convert", "synth"):
        r = results.get(step)
        if r is None:
            continue
        print(
            f"{step:<10}{r['events']:>14,}{r['wall_s']:>9.1f}{r['cpu_s']:>9.1f}"
            f"{r['events_per_s']:>12,.0f}{_num(r['self_s'], '.1f'):>9}"
            f"{_num(r['events_per_s_self'], ',.0f'):>12}"
            f"{r['peak_rss_mib']:>14,.0f}{r['store_bytes'] / 2**20:>11,.0f}"
        )
    s = results["startup"]
    print(
        f"(own: the time the command reports, without start-up; `sven --version` takes "
        f"{s['wall_s']:.1f} s wall, {s['peak_rss_mib']:.0f} MiB)"
    )
    if "convert" in results:
        c = results["convert"]
        print(
            f"(raw {c['format']} file: {c['raw_bytes'] / 2**20:,.0f} MiB, "
            f"written in {c['write_s']:.1f} s, not part of the convert time)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--convert-events", type=parse_count, default=10**7, help="events in the raw file"
    )
    p.add_argument("--nodes", type=parse_count, default=10**5, help="nodes in the raw file")
    p.add_argument("--format", choices=("csv", "snap"), default="csv", help="raw file format")
    p.add_argument("--feat-dim", type=int, default=2, help="csv feature columns f0..")
    p.add_argument(
        "--synth-events", type=parse_count, default=10**8, help="events for sven data synth"
    )
    p.add_argument(
        "--synth-nodes", type=parse_count, default=10**6, help="nodes for sven data synth"
    )
    p.add_argument("--synth-feat-dim", type=int, default=0, help="edge features for synth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-convert", action="store_true")
    p.add_argument("--skip-synth", action="store_true")
    p.add_argument(
        "--workdir", type=Path, default=None, help="scratch folder (default: a temp dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep the raw file and stores")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="sven-bench-ingest-", dir=args.workdir))
    results: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
        },
        "startup": run_measured(sven_cmd("--version"), work / "version.log"),
    }
    try:
        if not args.skip_convert:
            results["convert"] = bench_convert(args, work)
            add_rates(results["convert"])
        if not args.skip_synth:
            results["synth"] = bench_synth(args, work)
            add_rates(results["synth"])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
