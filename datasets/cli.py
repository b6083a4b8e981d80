"""``sven data ...``: fetch public datasets, convert raw event files, inspect stores,
generate synthetic data."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from sven.errors import ConfigError, SvenError

__all__ = ["add_parser", "add_synth_parser", "parse_count", "run_synth"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``data`` with its ``fetch``, ``convert``, ``info``, ``verify``, ``negatives``
    and ``synth`` subcommands.

    Args:
        subparsers: The top-level ``sven`` subparsers.
    """
    data = subparsers.add_parser(
        "data",
        help="fetch public datasets, convert raw event files, inspect event stores, "
        "generate synthetic data",
        description="Prepare event stores: the canonical on-disk format every stage reads.",
    )
    data.set_defaults(func=lambda args: _usage(data))
    actions = data.add_subparsers(dest="data_command", metavar="ACTION")
    _add_fetch_parser(actions)
    _add_convert_parser(actions)
    _add_store_parsers(actions)
    add_synth_parser(actions)


def _add_convert_parser(actions: argparse._SubParsersAction) -> None:
    from sven.datasets import FORMATS

    conv = actions.add_parser(
        "convert",
        help="convert a raw event file (SNAP, JODIE, DyGLib, TGL, TGB, csv, parquet) to a store",
        description="Stream a raw event file into an event store: sorted by time (stable), "
        "compact node ids, chronological splits. Compressed input (.gz, .xz, .bz2) is read "
        "transparently. A failed conversion leaves nothing at --out.",
    )
    conv.add_argument("input", help="raw file, or a TGL / DyGLib dataset directory")
    conv.add_argument("--out", required=True, help="store directory to create")
    conv.add_argument(
        "--format", default="auto", choices=("auto", *FORMATS), help="input format (default: auto)"
    )
    conv.add_argument("--name", help="dataset name (default: from the input file name)")
    conv.add_argument("--val-frac", type=float, default=0.15, help="validation share (0.15)")
    conv.add_argument("--test-frac", type=float, default=0.15, help="test share (0.15)")
    conv.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing event store at --out (never any other folder)",
    )
    cols = conv.add_argument_group("column map (csv, tgb, parquet)")
    cols.add_argument("--src", help="source id column")
    cols.add_argument("--dst", help="destination id column")
    cols.add_argument("--time", help="timestamp column")
    cols.add_argument("--feat", help="comma-separated edge feature columns")
    cols.add_argument("--label", help="per-event label column")
    cols.add_argument("--sep", default=",", help=r"field separator (default ','; '\s+' for spaces)")
    cols.add_argument(
        "--no-header", action="store_true", help="no header line: columns are 0-based positions"
    )
    cols.add_argument("--string-ids", action="store_true", help="node ids are strings")
    cols.add_argument(
        "--bipartite",
        action="store_true",
        help="sources and destinations are separate id spaces (destinations numbered after)",
    )
    conv.add_argument(
        "--block-mb", type=int, default=16, help="decompressed MiB parsed at once (16)"
    )
    conv.set_defaults(func=_convert)


def _add_store_parsers(actions: argparse._SubParsersAction) -> None:
    """``info``, ``verify`` and ``negatives``: the commands on an existing store."""
    info = actions.add_parser(
        "info",
        help="summary statistics of an event store",
        description="Events, nodes, time span, bipartiteness, repeat-edge ratio, degree "
        "percentiles, split sizes and inductive share of an event store.",
    )
    info.add_argument("dir", help="event store directory")
    info.add_argument("--json", action="store_true", help="print the statistics as JSON")
    info.set_defaults(func=_info)

    verify = actions.add_parser(
        "verify",
        help="check an event store against the checksums in its meta.json",
        description="Recompute the sha256 of every column file and compare it with "
        "meta.json; also check the structure (headers, dtypes, shapes, id ranges, time "
        "order, split labels). Exit 0 if the store is intact, 3 otherwise.",
    )
    verify.add_argument("dir", help="event store directory")
    verify.set_defaults(func=_verify)

    negs = actions.add_parser(
        "negatives",
        help="store fixed evaluation negatives (TGB's *_val_ns.pkl / *_test_ns.pkl)",
        description="Read TGB's negative-sample files of a dataset (a pickle mapping each "
        "val/test edge (src, dst, t) to its negative destinations; read without running "
        "code), line them up with the split's events and store them with the event store "
        "(neg_val.npy / neg_test.npy, in meta.json's checksums). Training then reports "
        "val_mrr/test_mrr against them (eval.mrr_source). A .npz with arrays src, dst, t "
        "(n,) and neg (n, q) is accepted too.",
    )
    negs.add_argument("dir", help="event store directory")
    negs.add_argument("--val", help="negatives of the val split (e.g. tgbl-wiki_val_ns.pkl)")
    negs.add_argument("--test", help="negatives of the test split (e.g. tgbl-wiki_test_ns.pkl)")
    negs.add_argument(
        "--ids",
        default="raw",
        choices=("raw", "compact"),
        help="node ids of the files: raw, those the store was converted from (id_map.npy; "
        "default); compact, the store's own 0..N-1 (e.g. a store written from TGB's arrays)",
    )
    negs.add_argument(
        "--overwrite", action="store_true", help="replace negatives the store already has"
    )
    negs.set_defaults(func=_negatives)


def _add_fetch_parser(actions: argparse._SubParsersAction) -> None:
    fetch = actions.add_parser(
        "fetch",
        help="download a public dataset by name (wikipedia, collegemsg, ...) into a store",
        description="Download a public temporal dataset once into the cache ($SVEN_CACHE or "
        "~/.cache/sven), verify its sha256 (recorded on first download where the registry "
        "has none), convert it and check the published event and node counts. A failed "
        "or corrupted download keeps nothing. With no NAME, list the datasets.",
    )
    fetch.add_argument("name", nargs="?", help="dataset name (see --list)")
    fetch.add_argument(
        "--out", help="store directory to create (default: CACHE/stores/NAME, reused if present)"
    )
    fetch.add_argument("--list", action="store_true", help="list the datasets and exit")
    fetch.add_argument(
        "--download-only", action="store_true", help="download and verify; do not convert"
    )
    fetch.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing event store at --out (never any other folder)",
    )
    fetch.add_argument("--mirror", help="base URL serving the files as MIRROR/FILE")
    fetch.add_argument(
        "--timeout", type=float, default=60.0, help="seconds without data before giving up (60)"
    )
    fetch.set_defaults(func=_fetch)


def _fetch(args: argparse.Namespace) -> int:
    from sven.datasets.registry import REGISTRY, lookup

    if args.list or not args.name:
        for d in REGISTRY.values():
            sha = d.sha256 or "recorded on first download"
            print(f"{d.name:14} {d.events:>10,} events {d.nodes:>7,} nodes  {d.format:11} {d.url}")
            print(f"{'':14} {d.about}; sha256 {sha}")
            print(f"{'':14} licence: {d.licence}; cite: {d.citation}")
        return 0
    from sven.datasets.fetch import fetch
    from sven.ownership import stop_on_sigterm

    entry = lookup(args.name)
    start = time.perf_counter()
    with stop_on_sigterm(args.out or f"the cache's {entry.name}"):
        done = fetch(
            entry,
            args.out,
            overwrite=args.overwrite,
            download_only=args.download_only,
            mirror=args.mirror,
            timeout=args.timeout,
        )
    how = "downloaded" if done.downloaded else "in the cache"
    print(f"fetch: {done.raw} ({how}; sha256 {done.sha256})")
    if done.trusted_now:
        print(
            f"  the registry has no sha256 for {entry.file}: recorded this one in "
            f"{done.raw}.sha256 (trust on first use); later fetches verify against it"
        )
    elif args.download_only and entry.sha256 is None and done.downloaded:
        print("  not yet trusted: its sha256 is recorded once it converts to the published counts")
    if done.store is None:
        return 0
    if not done.converted:
        print(f"fetch: reusing {done.store}")
        return 0
    from sven.datasets.store import TemporalEvents

    meta = TemporalEvents.load(done.store, check_values=False).meta
    print(_summary(meta, str(done.store), time.perf_counter() - start))
    print(f"  licence: {entry.licence}\n  cite: {entry.citation}")
    return 0


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _convert(args: argparse.Namespace) -> int:
    from sven.datasets.readers import convert
    from sven.datasets.tables import ColumnMap
    from sven.datasets.target import check_target

    # Before reading any input: a wrong --out fails at once, and never loses data.
    replaced = check_target(args.out, args.overwrite, inputs=(args.input,))
    if args.block_mb < 1:
        raise ConfigError(f"--block-mb must be >= 1, got {args.block_mb}")
    columns = ColumnMap(
        src=args.src,
        dst=args.dst,
        time=args.time,
        feat=tuple(c.strip() for c in args.feat.split(",") if c.strip()) if args.feat else (),
        label=args.label,
    )
    from sven.ownership import stop_on_sigterm

    start = time.perf_counter()
    try:
        with stop_on_sigterm(args.out):
            ev = convert(
                args.input,
                args.out,
                args.format,
                name=args.name,
                val_frac=args.val_frac,
                test_frac=args.test_frac,
                overwrite=args.overwrite,
                columns=columns,
                sep=args.sep,
                header=not args.no_header,
                string_ids=args.string_ids,
                bipartite=True if args.bipartite else None,
                block_bytes=args.block_mb << 20,
            )
    except OSError as exc:  # disk full, permissions: a message, not a traceback
        raise SvenError(f"{exc.filename or args.out}: {exc.strerror or exc}") from None
    print(_summary(ev.meta, str(ev.path), time.perf_counter() - start))
    report_written(ev.meta, str(ev.path), replaced)
    return 0


def report_written(meta: dict[str, Any], out: str, replaced: dict[str, Any] | None) -> None:
    """What a command that wrote a store says besides its summary: the store it
    replaced (stdout) and empty evaluation splits (a warning on stderr)."""
    from sven.datasets.target import describe_replaced

    if replaced is not None:
        print(describe_replaced(out, replaced))
    counts = meta["split"]["counts"]
    empty = [s for s in ("val", "test") if counts[s] == 0]
    if empty:
        print(
            f"sven: warning: {out}: the {' and '.join(empty)} split"
            f"{'s are' if len(empty) > 1 else ' is'} empty; training cannot evaluate "
            "(raise --val-frac/--test-frac or use more events)",
            file=sys.stderr,
        )


def _summary(meta: dict[str, Any], out: str, seconds: float) -> str:
    """The few lines ``convert`` prints: counts, time range, splits, any reordering."""
    E, N = meta["num_events"], meta["num_nodes"]
    counts = meta["split"]["counts"]
    src = meta["source"]
    lines = [
        f"wrote {out}: {E:,} events, {N:,} nodes"
        + (f" (bipartite, {meta['num_src_nodes']:,} sources)" if meta["bipartite"] else ""),
        f"  from {src.get('path')} ({src.get('format')})",
        f"  time {meta['t_min']} .. {meta['t_max']} ({meta['t_dtype']}); "
        f"edge features {meta['edge_feat_dim']}, node features {meta['node_feat_dim']}, "
        f"labels {'yes' if meta['has_label'] else 'no'}",
        f"  splits train {counts['train']:,} / val {counts['val']:,} / test {counts['test']:,}",
    ]
    if meta["sorted_on_ingest"]:
        lines.append(
            f"  note: input was not in time order ({meta['num_out_of_order']:,} events earlier "
            "than the one before them); events were stable-sorted by time"
        )
    else:
        lines.append("  input was in time order; no reordering")
    rate = E / seconds if seconds > 0 else float("inf")
    lines.append(f"  {seconds:.1f} s ({rate:,.0f} events/s)")
    return "\n".join(lines)


def _info(args: argparse.Namespace) -> int:
    from sven.datasets.info import describe, format_info
    from sven.datasets.store import TemporalEvents

    stats = describe(TemporalEvents.load(args.dir))
    print(json.dumps(stats, indent=2) if args.json else format_info(stats))
    return 0


def _negatives(args: argparse.Namespace) -> int:
    from sven.datasets.negatives import import_negatives, refuse_existing_negatives
    from sven.datasets.store import TemporalEvents

    files = {s: f for s, f in (("val", args.val), ("test", args.test)) if f}
    if not files:
        raise ConfigError("sven data negatives: give --val FILE and/or --test FILE")
    if not args.overwrite:  # both splits checked before either is written
        meta = TemporalEvents.load(args.dir, check_values=False).meta
        for split in files:
            refuse_existing_negatives(args.dir, meta, split)
    for split, file in files.items():
        neg = import_negatives(args.dir, split, file, ids=args.ids, overwrite=args.overwrite)
        padded = int((neg < 0).any(1).sum())
        print(
            f"{args.dir}: {split} negatives from {file}: {neg.shape[0]:,} events x "
            f"{neg.shape[1]} (padded rows: {padded:,})"
        )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from sven.datasets.checksums import verify_checksums
    from sven.datasets.store import TemporalEvents

    events = TemporalEvents.load(args.dir)
    files = verify_checksums(events.path, events.meta)
    print(
        f"{args.dir}: ok ({events.num_events:,} events, {events.num_nodes:,} nodes; "
        f"{files} files match their checksums)"
    )
    return 0


def parse_count(text: str) -> int:
    """Parses a count given as ``100000``, ``1e8`` or ``100_000_000``."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def add_synth_parser(data_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``sven data synth`` to the ``sven data`` subcommands.

    Args:
        data_subparsers: the object returned by ``add_subparsers`` of ``sven data``.

    Returns:
        The new subparser (its handler is set as ``func``).
    """
    from sven.datasets.synth import DEFAULT_CHUNK_SIZE, DEFAULT_EVENTS, DEFAULT_NODES, DEFAULT_SEED

    p = data_subparsers.add_parser(
        "synth",
        help="generate a synthetic event stream into an event store",
        description=(
            "Generate a realistic synthetic interaction stream (heavy-tailed activity, "
            "repeated contacts, communities, bursty times) into an event store. With no "
            "arguments it makes the built-in default dataset in the cache."
        ),
    )
    p.add_argument(
        "--events",
        type=parse_count,
        default=DEFAULT_EVENTS,
        help="number of events (default %(default)s)",
    )
    p.add_argument(
        "--nodes",
        type=parse_count,
        default=DEFAULT_NODES,
        help="number of nodes (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help="random seed (default %(default)s)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="store directory to create (default: a folder in $SVEN_CACHE or ~/.cache/sven, "
        "reused if present)",
    )
    p.add_argument(
        "--edge-feat-dim", type=int, default=0, help="edge feature dimension (default 0: none)"
    )
    p.add_argument(
        "--bipartite", action="store_true", help="users interact with items (JODIE-style)"
    )
    p.add_argument(
        "--communities", type=int, default=0, help="number of communities (default: nodes // 100)"
    )
    p.add_argument(
        "--labels",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="write per-event 0/1 labels (for task=node_classification): an event is 1 when "
        "its source is in one of SHARE of the communities (default 0: no labels)",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK_SIZE,
        help="events per write; bounds memory, not content",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing event store at --out (never any other folder)",
    )
    p.set_defaults(func=run_synth)
    return p


def run_synth(args: argparse.Namespace) -> int:
    """Handler of ``sven data synth``; returns the exit code."""
    from sven.datasets.synth import SynthParams, cached_dataset, write_synth

    params = SynthParams(
        events=args.events,
        nodes=args.nodes,
        seed=args.seed,
        edge_feat_dim=args.edge_feat_dim,
        bipartite=args.bipartite,
        communities=args.communities,
        label_share=args.labels,
    )
    start = time.perf_counter()
    if args.out is None:
        path, made = cached_dataset(params, chunk_size=args.chunk_size)
        if not made:
            print(f"synth: reusing {path}")
            return 0
        replaced = None
    else:
        from sven.datasets.target import check_target
        from sven.ownership import stop_on_sigterm

        path = args.out
        replaced = check_target(path, args.overwrite)
        with stop_on_sigterm(path):
            write_synth(params, path, chunk_size=args.chunk_size, overwrite=args.overwrite)
    secs = time.perf_counter() - start
    print(
        f"synth: wrote {params.events:,} events, {params.nodes:,} nodes to {path} "
        f"in {secs:.1f} s ({params.events / max(secs, 1e-9):,.0f} events/s)"
    )
    from sven.datasets.store import TemporalEvents

    report_written(TemporalEvents.load(path, check_values=False).meta, str(path), replaced)
    return 0
