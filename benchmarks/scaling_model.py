"""Scaling model: predicted events/s for P ranks, hash vs minmax, with and without the
pipeline, from the exact per-batch bytes of the cost model.

::

    python benchmarks/scaling_model.py --data STORE --parts-list 1,2,4,8,16,32,64 \\
        --batch-per-rank 600 --compute-ms 1.0 --compute-us-per-event 1.8 \\
        --intra-gbs 150 --intra-us 20 --inter-gbs 25 --inter-us 5 --ranks-per-node 8 \\
        --out OUT

For every P and strategy it partitions the store (``partition_store``), replays the
training epoch with ``comm_costs(..., per_batch=True)`` (one replay serves every
partition, each with its own global batch) and feeds the per-batch, per-rank counts to
``sven.partition.scaling.simulate``. Writes ``OUT/scaling.json``, ``OUT/scaling.md``
(table) and ``OUT/scaling.png`` (events/s vs P). ``--measured STRATEGY:P=EV_PER_S``
adds measured figures and the model's relative error to the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sven.partition.report import BatchCounts, RowBytes
from sven.partition.scaling import Link, Machine, fit_compute, machine_dict, simulate


def _parts_list(text: str) -> list[int]:
    parts = sorted({int(x) for x in text.split(",") if x.strip()})
    if not parts or parts[0] < 1:
        raise argparse.ArgumentTypeError(f"bad --parts-list {text!r}")
    return parts


def _measured(items: list[str]) -> dict[tuple[str, int], float]:
    """``hash:2=7454`` -> {("hash", 2): 7454.0}; ``1=11500`` applies to every strategy."""
    out = {}
    for item in items:
        key, value = item.split("=", 1)
        strategy, _, p = key.rpartition(":")
        out[(strategy or "*", int(p))] = float(value)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="event store")
    ap.add_argument("--name", help="name of the data in the table (default: the folder)")
    ap.add_argument("--title", help="second line of the plot's title (the machine, say)")
    ap.add_argument("--parts-list", type=_parts_list, default=_parts_list("1,2,4,8,16,32,64"))
    ap.add_argument("--strategies", nargs="+", default=["hash", "minmax"])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--batch", type=int, help="global batch (strong scaling)")
    size.add_argument(
        "--batch-per-rank", type=int, help="batch per rank; global = P x this (weak scaling)"
    )
    ap.add_argument("--model", default="tgn", choices=("tgn", "jodie", "dyrep", "apan"))
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--num-neg", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-dim", type=int, default=100)
    ap.add_argument("--mail-dim", type=int)
    ap.add_argument("--compute-ms", type=float, help="fixed compute per step (a), ms")
    ap.add_argument("--compute-us-per-event", type=float, default=1.8, help="(b), us/event (1.8)")
    ap.add_argument(
        "--fit-compute",
        nargs="+",
        metavar="BATCH=EV_PER_S",
        help="fit a and b from one-rank runs instead (e.g. 600=3327 300=2870)",
    )
    ap.add_argument("--intra-gbs", type=float, default=150.0, help="intra-node GB/s per rank")
    ap.add_argument("--intra-us", type=float, default=20.0, help="intra-node latency, us")
    ap.add_argument("--inter-gbs", type=float, default=25.0, help="inter-node GB/s per rank")
    ap.add_argument("--inter-us", type=float, default=10.0, help="inter-node latency, us")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument(
        "--grad-bytes", type=int, default=890_000, help="gradient buffer bytes (TGN dims 100)"
    )
    ap.add_argument("--hidden", type=float, default=0.8, help="share the pipeline hides")
    ap.add_argument("--concurrent-ranks", type=int, help="ranks computing at once (CPU cores)")
    ap.add_argument("--measured", nargs="*", default=[], metavar="STRATEGY:P=EV_PER_S")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument(
        "--counts",
        help="npz cache of the per-batch counts: read if it exists (no partitioning or "
        "replay; the same data and settings are assumed), else written",
    )
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.batch is None and args.batch_per_rank is None:
        args.batch = 600
    if args.compute_ms is None and not args.fit_compute:
        ap.error("give --compute-ms (and --compute-us-per-event) or --fit-compute")
    return args


def machine_of(args: argparse.Namespace) -> tuple[Machine, dict[str, Any]]:
    """The model parameters from the flags, fitting the compute when asked."""
    fit: dict[str, Any] = {}
    a, b = args.compute_ms, args.compute_us_per_event
    if args.fit_compute:
        pairs = [tuple(float(v) for v in x.split("=")) for x in args.fit_compute]
        sizes = [int(p[0]) for p in pairs]
        step_ms = [1e3 * p[0] / p[1] for p in pairs]
        a, b = fit_compute(sizes, step_ms)
        fit = {"batch_sizes": sizes, "step_ms": step_ms}
    machine = Machine(
        compute_ms=a,
        compute_us_per_event=b,
        intra=Link(args.intra_gbs, args.intra_us),
        inter=Link(args.inter_gbs, args.inter_us),
        ranks_per_node=args.ranks_per_node,
        grad_bytes=args.grad_bytes,
        hidden=args.hidden,
        concurrent_ranks=args.concurrent_ranks,
    )
    return machine, fit


_FIELDS = ("events", "remote_reads", "remote_writes", "served_reads", "received_writes")


def _add_row(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    measured: dict[tuple[str, int], float],
    strategy: str,
    p: int,
    batch: int,
    counts: BatchCounts,
    widths: RowBytes,
    machine: Machine,
) -> None:
    """Simulates one partition and appends its row (with the measured error, if any)."""
    pred = simulate(counts, widths, machine)
    row = {"strategy": strategy, "parts": p, "batch": batch, **pred.summary()}
    for s in [strategy] if p > 1 else [*args.strategies, "-"]:
        got = measured.get((s, p), measured.get(("*", p)))
        if got is not None and "measured_events_per_s" not in row:
            row["measured_events_per_s"] = got
            row["error"] = pred.events_per_s / got - 1.0
    rows.append(row)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Partitions, replays and simulates; returns the rows and the parameters."""
    from sven.datasets.store import TemporalEvents
    from sven.partition.access import Access, recent_sampler
    from sven.partition.api import partition_store
    from sven.partition.cost import comm_costs
    from sven.partition.report import row_bytes

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    machine, fit = machine_of(args)
    events = TemporalEvents.load(args.data)
    start, stop = events.split_range("train")
    access = Access.of(args.model)
    widths = row_bytes(args.memory_dim, args.mail_dim)
    t0 = time.perf_counter()
    sampler = None
    if args.k > 0 and access.samples and not (args.counts and Path(args.counts).exists()):
        sampler = recent_sampler(events.src, events.dst, events.t, events.num_nodes, args.k)
    say(f"sampler: {time.perf_counter() - t0:.1f}s")
    cfg = {"k": args.k, "num_neg": args.num_neg, "seed": args.seed}
    items: list[tuple[str, int, int]] = []
    for p in args.parts_list:
        batch = args.batch if args.batch is not None else args.batch_per_rank * p
        items.extend((s, p, batch) for s in (["-"] if p == 1 else args.strategies))
    measured = _measured(args.measured)
    rows: list[dict[str, Any]] = []
    cache = Path(args.counts) if args.counts else None
    cached = dict(np.load(cache)) if cache is not None and cache.exists() else None
    saved: dict[str, np.ndarray] = {}
    if cached is not None:
        for strategy, p, batch in items:
            key = f"{strategy}_{p}_{batch}"
            counts = BatchCounts(*(cached[f"{key}_{f}"] for f in _FIELDS))
            _add_row(rows, args, measured, strategy, p, batch, counts, widths, machine)
    else:
        parts_of = []
        for strategy, p, batch in items:
            t1 = time.perf_counter()
            if p == 1:
                owner = np.zeros(events.num_nodes, dtype=np.int64)
                assign = np.zeros(events.num_events, dtype=np.int32)
            else:
                res = partition_store(
                    events, p, strategy, batch_size=batch, sampler=sampler, access=access,
                    **cfg,
                )  # fmt: skip
                owner, assign = res.owner, res.assign
            say(f"partition {strategy} P={p} B={batch}: {time.perf_counter() - t1:.1f}s")
            parts_of.append((owner, assign, p, batch))
        t1 = time.perf_counter()
        # One replay for every partition: the touches do not depend on the batching.
        reports = comm_costs(
            events.src, events.dst, events.t, parts_of, batch_size=parts_of[0][3],
            start=start, stop=stop, sampler=sampler, access=access, widths=widths,
            per_batch=True, **cfg,
        )  # fmt: skip
        say(f"replay ({len(items)} partitions): {time.perf_counter() - t1:.1f}s")
        for (strategy, p, batch), rep in zip(items, reports):
            for f in _FIELDS:
                saved[f"{strategy}_{p}_{batch}_{f}"] = getattr(rep.batches, f)
            _add_row(rows, args, measured, strategy, p, batch, rep.batches, widths, machine)
    if cache is not None and cached is None:
        np.savez_compressed(cache, **saved)
    return {
        "data": str(args.data),
        "name": args.name or Path(args.data).name,
        "title": args.title,
        "model": args.model,
        "num_train_events": int(stop - start),
        "scaling": "strong" if args.batch is not None else "weak",
        "batch": args.batch,
        "batch_per_rank": args.batch_per_rank,
        "row_bytes": {"read": widths.read, "write": widths.write, "id": widths.id},
        "machine": machine_dict(machine),
        "compute_fit": fit,
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    """The rows as a markdown table."""
    scale = (
        f"global batch {result['batch']}"
        if result["scaling"] == "strong"
        else f"batch {result['batch_per_rank']} per rank"
    )
    head = (
        f"{result['name']} ({result['num_train_events']:,} training events, "
        f"{result['model']}, {scale})\n\n"
        "| strategy | P | global batch | events/s | events/s, pipeline | step ms | "
        "compute ms | comm ms | batch event max/mean | batch sent / recv max/mean | measured | "
        "error |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in result["rows"]:
        meas = r.get("measured_events_per_s")
        lines.append(
            f"| {r['strategy']} | {r['parts']} | {r['batch']} | {r['events_per_s']:,.0f} | "
            f"{r['events_per_s_pipelined']:,.0f} | {r['step_ms']:.2f} | {r['compute_ms']:.2f} | "
            f"{r['comm_ms']:.2f} | {r['batch_event_imbalance']:.2f} | "
            f"{r['batch_sent_imbalance']:.2f} / {r['batch_recv_imbalance']:.2f} | "
            + (f"{meas:,.0f} | {100 * r['error']:+.1f}% |" if meas is not None else "- | - |")
        )
    return head + "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """events/s vs P, one line per strategy and mode (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    one = [r for r in result["rows"] if r["parts"] == 1]
    strategies = sorted({r["strategy"] for r in result["rows"]} - {"-"})
    for color, strategy in zip(("tab:blue", "tab:red", "tab:green", "tab:purple"), strategies):
        rows = one + [r for r in result["rows"] if r["strategy"] == strategy]
        rows.sort(key=lambda r: r["parts"])
        ps = [r["parts"] for r in rows]
        ax.plot(
            ps, [r["events_per_s"] for r in rows], marker="o", color=color,
            label=f"{strategy}, synchronous",
        )  # fmt: skip
        ax.plot(
            ps, [r["events_per_s_pipelined"] for r in rows], marker="s", linestyle="--",
            color=color,
            label=f"{strategy}, pipeline (hides {100 * result['machine']['hidden']:.0f}%)",
        )  # fmt: skip
    meas = [r for r in result["rows"] if "measured_events_per_s" in r]
    if meas:
        ax.scatter(
            [r["parts"] for r in meas], [r["measured_events_per_s"] for r in meas],
            color="black", zorder=5, label="measured",
        )  # fmt: skip
    ax.set_xscale("log", base=2)
    ps = sorted({r["parts"] for r in result["rows"]})
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("train events/s")
    scale = "strong" if result["scaling"] == "strong" else "weak"
    title = f"{result['name']}: {scale} scaling (model)"
    if result.get("title"):
        title += f"\n{result['title']}"
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Runs the model and writes JSON, markdown and PNG."""
    args = parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "scaling.md").write_text(markdown(result))
    plot(result, out / "scaling.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
