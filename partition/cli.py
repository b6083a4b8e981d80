"""``sven partition``: partition an event store, or re-evaluate an existing partition.

::

    sven partition DATA --parts P --strategy S --out DIR [--model M] [--batch B] [--k K]
                   [--num-neg N] [--balance 1.05] [--no-batch-balance] [--seed S] [--json]
                   [--overwrite]
    sven partition report DATA PART_DIR [--model M] [--batch B] [--k K] [--num-neg N] [--json]
                          [--simulate [--compute-ms A] [--compute-us-per-event B]
                           [--bandwidth-gbs BW] [--latency-us L] [--inter-bandwidth-gbs BW]
                           [--inter-latency-us L] [--ranks-per-node R] [--grad-bytes G]
                           [--hidden H]]

``--model`` (one of ``sven.models.MODEL_NAMES``) sets which nodes a batch reads and writes in the
cost model: TGN samples neighbours of every root and reads them, JODIE none, DyRep
only those of src and dst, APAN samples src's and dst's neighbours and writes mail to
them without reading them.

Both print the cost report (per-rank events, vertices, remote reads and writes, bytes,
naive bytes; max, mean and max/mean) as a table, or as JSON with ``--json``.
The event cap (``--balance``) applies to the epoch and, unless ``--no-batch-balance``,
to every global batch of ``--batch`` events: a synchronous step waits for the rank with
the most events of each batch. The partition's meta.json records the setting and how
many batches stay over the cap (``batch_stats``).

``report --simulate`` adds the scaling model's step time and events/s for this
partition (``sven.partition.scaling``; docs/scaling.md), synchronous and pipelined,
against one rank at the same global batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from sven.errors import ConfigError, DataError, SvenError
from sven.models.names import MODEL_NAMES

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``partition`` subcommand.

    Args:
        subparsers: The top-level ``sven`` subparsers.
    """
    from sven.partition import STRATEGIES

    p = subparsers.add_parser(
        "partition",
        help="assign vertices and events to ranks; report per-rank communication",
        description="Partition an event store into P ranks (vertex owners plus an "
        "event-to-rank assignment) and print the cost report of one training epoch. "
        "'sven partition report DATA PART_DIR' re-evaluates an existing partition.",
        usage="%(prog)s DATA --parts P --strategy S --out DIR [options]\n"
        "       %(prog)s report DATA PART_DIR [options]",
    )
    p.add_argument(
        "positional", nargs="+", metavar="DATA", help="event store (or: report DATA PART_DIR)"
    )
    p.add_argument("--parts", type=int, help="number of ranks P")
    p.add_argument("--strategy", choices=STRATEGIES, help="partitioning strategy")
    p.add_argument("--out", help="partition directory to create")
    p.add_argument(
        "--batch", type=int, help="global batch size B of the cost model (600; report: as built)"
    )
    p.add_argument(
        "--model",
        choices=MODEL_NAMES,
        help="model whose reads and writes the cost model replays (tgn; report: as built)",
    )
    p.add_argument("--k", type=int, help="neighbours per root (10; report: as built)")
    p.add_argument("--num-neg", type=int, help="negatives per event (1; report: as built)")
    p.add_argument("--balance", type=float, default=1.05, help="event cap as max/mean (1.05)")
    p.add_argument(
        "--batch-balance",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also cap every global batch's events per rank at --balance (default: on)",
    )
    p.add_argument("--seed", type=int, help="seed of the strategy and the negatives (0)")
    p.add_argument("--memory-dim", type=int, default=100, help="memory width for bytes (100)")
    p.add_argument(
        "--mail-dim", type=int, help="mail width for bytes (default 3 x memory-dim, as TGN)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    sim = p.add_argument_group("report --simulate: the scaling model (docs/scaling.md)")
    sim.add_argument(
        "--simulate", action="store_true", help="predict step time and events/s (report only)"
    )
    sim.add_argument("--compute-ms", type=float, default=1.0, help="compute per step, ms (1.0)")
    sim.add_argument(
        "--compute-us-per-event", type=float, default=1.8, help="compute per event, us (1.8)"
    )
    sim.add_argument(
        "--bandwidth-gbs", type=float, default=150.0, help="intra-node GB/s per rank (150)"
    )
    sim.add_argument("--latency-us", type=float, default=20.0, help="intra-node latency, us (20)")
    sim.add_argument(
        "--inter-bandwidth-gbs", type=float, default=25.0, help="inter-node GB/s per rank (25)"
    )
    sim.add_argument(
        "--inter-latency-us", type=float, default=10.0, help="inter-node latency, us (10)"
    )
    sim.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (8)")
    sim.add_argument(
        "--grad-bytes", type=int, default=890_000, help="gradient bytes per step (TGN dims 100)"
    )
    sim.add_argument(
        "--hidden", type=float, default=0.8, help="share of comm the pipeline hides (0.8)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing partition at --out (never any other folder)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_run)


def _setting(args: argparse.Namespace, name: str, meta: dict[str, Any], default: int) -> int:
    """A cost-model setting: the flag if given, else the partition's, else the default."""
    value = getattr(args, name)
    if value is not None:
        return int(value)
    key = {"batch": "batch_size"}.get(name, name)
    return int(meta.get(key, default))


def _model(args: argparse.Namespace, meta: dict[str, Any]) -> str:
    """The model of the cost model: the flag if given, else the partition's, else TGN."""
    return str(args.model or meta.get("model", "tgn"))


def _run(args: argparse.Namespace) -> int:
    """Dispatches on the first positional: ``report`` or a store."""
    pos = args.positional
    if pos[0] == "report":
        if len(pos) != 3:
            raise ConfigError("usage: sven partition report DATA PART_DIR")
        return _report(args, pos[1], pos[2])
    if len(pos) != 1:
        raise ConfigError(f"expected one event store, got {' '.join(pos)}")
    if args.out is None:
        raise ConfigError("sven partition DATA needs --parts, --strategy and --out")
    # What the work imports, imported before the SIGTERM handler is in place: a
    # Terminated raised by the handler inside importlib (compiling a module) did not
    # reach the caller, and the command ran to its end (seen in test_11).
    import sven.datasets.store
    import sven.partition.api
    import sven.partition.cost
    import sven.partition.store  # noqa: F401
    from sven.ownership import lock_folder, report_swept, stop_on_sigterm, sweep_partials

    # The folder is this process's from the check of --out to the rename into place;
    # SIGTERM leaves nothing behind, nor do writers into the same parent that died.
    with stop_on_sigterm(args.out), lock_folder(args.out, "sven partition"):
        report_swept(sweep_partials(Path(args.out).absolute().parent))
        return _partition(args, pos[0])


def _say(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def _emit(
    args: argparse.Namespace, meta: dict[str, Any], report: Any, sim: dict | None = None
) -> None:
    """Prints the report (and the simulation, if any) as a table or as JSON."""
    from sven.partition.report import format_report

    if args.json:
        out = {"partition": meta, "report": report.to_dict()}
        if sim is not None:
            out["simulate"] = sim
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    print(
        f"partition {meta.get('strategy')} into {meta['parts']} ranks "
        f"(balance {meta.get('balance')}{' per batch' if meta.get('batch_balance') else ''}, "
        f"seed {meta.get('seed')}; "
        f"cost model of {_model(args, meta)})"
    )
    print(format_report(report))
    if sim is not None:
        one, p = sim["one_rank"], sim["partition"]
        print(
            f"simulated ({p['num_batches']} batches): 1 rank {one['events_per_s']:,.0f} events/s "
            f"(step {one['step_ms']:.2f} ms); {p['parts']} ranks {p['events_per_s']:,.0f} "
            f"events/s (step {p['step_ms']:.2f} ms = compute {p['compute_ms']:.2f} + comm "
            f"{p['comm_ms']:.2f} on the slowest rank), with the pipeline hiding "
            f"{100 * sim['machine']['hidden']:.0f}%: {p['events_per_s_pipelined']:,.0f} "
            f"events/s; per-batch event max/mean {p['batch_event_imbalance']:.2f}, bytes "
            f"max/mean {p['batch_comm_imbalance']:.2f}"
        )


def _simulate(args: argparse.Namespace, report: Any) -> dict[str, Any]:
    """The scaling model over a report's per-batch counts, and one rank for reference."""
    import numpy as np

    from sven.partition.report import BatchCounts
    from sven.partition.scaling import Link, Machine, machine_dict, simulate

    try:
        machine = Machine(
            compute_ms=args.compute_ms,
            compute_us_per_event=args.compute_us_per_event,
            intra=Link(args.bandwidth_gbs, args.latency_us),
            inter=Link(args.inter_bandwidth_gbs, args.inter_latency_us),
            ranks_per_node=args.ranks_per_node,
            grad_bytes=args.grad_bytes,
            hidden=args.hidden,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    counts = report.batches
    events = counts.events.sum(axis=1, keepdims=True)
    one = BatchCounts(events, *(np.zeros_like(events) for _ in range(4)))
    return {
        "machine": machine_dict(machine),
        "one_rank": simulate(one, report.widths, machine).summary(),
        "partition": simulate(counts, report.widths, machine).summary(),
    }


def _partition_settings(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """``sven partition DATA``'s checked settings: (batch, k, num_neg, seed)."""
    if args.simulate:
        raise ConfigError("--simulate goes with 'sven partition report DATA PART_DIR'")
    if args.parts is None or args.strategy is None or args.out is None:
        raise ConfigError("sven partition DATA needs --parts, --strategy and --out")
    batch = _setting(args, "batch", {}, 600)
    k = _setting(args, "k", {}, 10)
    num_neg = _setting(args, "num_neg", {}, 1)
    seed = _setting(args, "seed", {}, 0)
    if k < 0 or num_neg < 1:
        raise ConfigError("--k must be >= 0 and --num-neg >= 1")
    if args.parts < 1:
        raise ConfigError(f"--parts must be >= 1, got {args.parts}")
    return batch, k, num_neg, seed


def _open_store(data: str, parts: int) -> Any:
    """The store to partition, checked (its bytes, its events, enough nodes for ``parts``)."""
    from sven.datasets.store import open_verified_store

    events = open_verified_store(data)
    if events.num_events == 0:
        raise DataError("the store has no events", data)
    if parts > events.num_nodes:
        raise ConfigError(
            f"--parts {parts} is more than the {events.num_nodes} nodes of {data}: "
            "some ranks would own no vertex; use at most as many parts as nodes"
        )
    return events


def _partition(args: argparse.Namespace, data: str) -> int:
    """``sven partition DATA ...``."""
    from sven.partition.access import Access, recent_sampler
    from sven.partition.api import evaluate_store, partition_store, store_info
    from sven.partition.report import row_bytes
    from sven.partition.store import check_target, is_partition, write_partition

    batch, k, num_neg, seed = _partition_settings(args)
    model = _model(args, {})
    access = Access.of(model)
    widths = row_bytes(args.memory_dim, args.mail_dim)
    # Before any work: a wrong --out fails at once, and never loses data.
    check_target(args.out, args.overwrite, inputs=(data,))
    replacing = args.overwrite and is_partition(args.out)
    events = _open_store(data, args.parts)
    t0 = time.perf_counter()
    # One sampler for minmax's sampled replay and the report's full replay.
    sampler = (
        recent_sampler(events.src, events.dst, events.t, events.num_nodes, k)
        if k > 0 and access.samples
        else None
    )
    sampler_s = time.perf_counter() - t0
    res = partition_store(
        events,
        args.parts,
        args.strategy,
        batch_size=batch,
        balance=args.balance,
        seed=seed,
        k=k,
        num_neg=num_neg,
        sampler=sampler,
        access=access,
        batch_balance=args.batch_balance,
        log=lambda m: _say(args, m),
    )
    t1 = time.perf_counter()
    report = evaluate_store(
        events, res, parts=args.parts, batch_size=batch, k=k, num_neg=num_neg, seed=seed,
        widths=widths, access=access, sampler=sampler,
    )  # fmt: skip
    timings = {"sampler_s": sampler_s, **res.timings, "report_s": time.perf_counter() - t1}
    _say(args, f"report: {timings['report_s']:.1f}s")
    _, train_stop = events.split_range("train")
    meta = {
        "strategy": args.strategy,
        "parts": args.parts,
        "model": model,
        "batch_size": batch,
        "k": k,
        "num_neg": num_neg,
        "balance": args.balance,
        "batch_balance": bool(args.batch_balance),
        "batch_stats": res.batch_stats,
        "seed": seed,
        "num_train_events": int(train_stop),
        "store": {"path": str(events.path), **store_info(events)},
        "timings": {name: round(v, 3) for name, v in timings.items()},
        "report": report.summary(),
        "per_rank": report.to_dict()["per_rank"],
    }
    from sven import __version__

    meta["sven_version"] = __version__
    try:
        part = write_partition(args.out, res.owner, res.assign, meta, overwrite=args.overwrite)
    except OSError as exc:  # disk full, permissions: a message, not a traceback
        raise SvenError(f"{exc.filename or args.out}: {exc.strerror or exc}") from None
    _say(args, f"{'replaced the partition at' if replacing else 'wrote'} {args.out}")
    _emit(args, part.meta, report)
    return 0


def _report(args: argparse.Namespace, data: str, part_dir: str) -> int:
    """``sven partition report DATA PART_DIR``."""
    from sven.datasets.store import open_verified_store
    from sven.partition.access import Access
    from sven.partition.api import evaluate_store
    from sven.partition.report import row_bytes
    from sven.partition.store import check_matches, load_partition

    events = open_verified_store(data)
    part = load_partition(part_dir, verify=True)
    check_matches(part, events, part_dir)
    meta = part.meta
    widths = row_bytes(args.memory_dim, args.mail_dim)
    report = evaluate_store(
        events,
        part,
        parts=int(meta["parts"]),
        batch_size=_setting(args, "batch", meta, 600),
        k=_setting(args, "k", meta, 10),
        num_neg=_setting(args, "num_neg", meta, 1),
        seed=_setting(args, "seed", meta, 0),
        widths=widths,
        access=Access.of(_model(args, meta)),
        per_batch=args.simulate,
    )
    _emit(args, meta, report, _simulate(args, report) if args.simulate else None)
    return 0
