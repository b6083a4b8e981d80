"""``sven predict`` and ``sven embed``: entry points over :class:`sven.tasks.predict.Predictor`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sven.errors import ConfigError, DataError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers the ``predict`` and ``embed`` subcommands."""
    p = sub.add_parser(
        "predict",
        help="score links (src, dst, t) or rank destinations with a trained model",
        description="Scores the links of a csv/parquet table with columns src,dst,t (raw "
        "ids, as in the converted file) into the same rows plus a score column, or with "
        "--topk ranks the destinations of --src sources at --time. A query after the "
        "checkpoint's time is answered from the node state it saved (no replay); an earlier "
        "one, or every one with --memory replay, from the memory replayed through the "
        "stream up to its time (docs/guide.md, 'Using a trained model').",
    )
    _common(p)
    p.add_argument("--pairs", help="csv or parquet table with columns src, dst, t")
    p.add_argument("--out", required=True, help="output table (.csv or .parquet)")
    p.add_argument("--topk", type=int, metavar="K", help="rank destinations: the K best")
    p.add_argument("--src", help="with --topk: source ids (comma-separated, or @FILE)")
    p.add_argument("--time", type=float, help="with --topk: the query time")
    p.add_argument(
        "--candidates", help="with --topk: destinations to rank (default: every destination)"
    )
    p.add_argument("--logits", action="store_true", help="scores as logits, not probabilities")
    _outputs(p)
    p.set_defaults(func=_predict)

    e = sub.add_parser(
        "embed",
        help="node embeddings at a time from a trained model",
        description="Writes the embeddings of --nodes at --time: .npy (n x d, in the given "
        "order) or .parquet/.csv (columns node, t, e0..e{d-1}).",
    )
    _common(e)
    e.add_argument("--nodes", required=True, help="node ids (comma-separated, or @FILE)")
    e.add_argument("--time", type=float, required=True, help="the time of the embeddings")
    e.add_argument(
        "--side", choices=("auto", "src", "dst"), default="auto",
        help="bipartite stores: which side's ids --nodes are",
    )  # fmt: skip
    e.add_argument("--out", required=True, help="output file (.npy, .parquet or .csv)")
    _outputs(e)
    e.set_defaults(func=_embed)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a run folder or a step-N folder")
    p.add_argument("--data", help="the event store (default: the one the run trained on)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--unknown", choices=("fail", "skip"), default="fail",
        help="ids the store does not know: fail (the default), or skip their rows",
    )  # fmt: skip
    p.add_argument(
        "--replay", choices=("batch", "exact"), default="batch",
        help="memory at the last evaluation batch boundary before t (batch, as sven eval) "
        "or with every event before t (exact)",
    )  # fmt: skip
    p.add_argument(
        "--memory", choices=("checkpoint", "replay"), default="checkpoint",
        help="queries after the checkpoint's time: from its saved node state (checkpoint, "
        "the default; earlier ones are replayed) or from a replay of the stream (replay)",
    )  # fmt: skip
    p.add_argument(
        "--query-batch", type=int, default=20000, metavar="N",
        help="query nodes embedded per forward pass",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument(
        "--other-store", action="store_true",
        help="with --data: apply the model to a store other than the one it was trained on "
        "(same feature widths); its memory is re-played from that store, and a note says so",
    )  # fmt: skip


def _outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite", action="store_true",
        help="replace an existing --out file (never a file or folder the command reads)",
    )  # fmt: skip


def _ids(text: str) -> list[str]:
    """Ids from ``a,b,c`` or ``@FILE`` (one per line)."""
    if text.startswith("@"):
        path = Path(text[1:])
        if not path.is_file():
            raise DataError("no such file", path)
        items = [x.strip() for x in path.read_text().splitlines()]
    else:
        items = [x.strip() for x in text.split(",")]
    items = [x for x in items if x]
    if not items:
        raise ConfigError(f"no ids in {text!r}")
    return items


def _check_out(args: argparse.Namespace, kinds: tuple[str, ...], *files: str | None) -> Path:
    """``--out``, checked before any work (:func:`sven.outputs.check_output`): never a
    file the command reads (``files``, ``@FILE`` ids), never inside the store or the
    checkpoint, an existing file only with ``--overwrite``."""
    from sven.outputs import check_output

    reads: list[str | Path] = [f for f in files if f]
    ids = (getattr(args, name, None) for name in ("src", "candidates", "nodes"))
    reads += [x[1:] for x in ids if _at(x)]
    reads += _run_inputs(Path(args.checkpoint), args.data)
    return check_output(args.out, overwrite=args.overwrite, inputs=reads, suffixes=kinds)


def _run_inputs(ckpt: Path, data: str | None) -> list[str | Path]:
    """The folders a model's questions read: its checkpoints (pruned by a later run, so
    no place for an output) and the event store (which holds only its own files)."""
    if (ckpt / "state.pt").is_file() or ckpt.name == "state.pt":
        step = ckpt if ckpt.is_dir() else ckpt.parent
        return [step.parent, *([data] if data else [])]
    if data is None:
        try:
            data = json.loads((ckpt / "config.json").read_text())["data"]["path"] or None
        except (OSError, ValueError, KeyError, TypeError):
            data = None
    return [ckpt / "checkpoints", ckpt / "best", *([data] if data else [])]


def _at(ids: str | None) -> bool:
    return isinstance(ids, str) and ids.startswith("@")


def _predictor(args: argparse.Namespace) -> Any:
    from sven.tasks.predict import Predictor

    return Predictor(
        args.checkpoint,
        data=args.data,
        device=args.device,
        replay=args.replay,
        memory=args.memory,
        query_batch=args.query_batch,
        threads=args.threads,
        other_store=args.other_store,
    )


def _predict(args: argparse.Namespace) -> int:
    import pandas as pd

    from sven.tasks.predict import read_pairs, write_table

    # Each question has its own options; one of the other is a mistake, not a no-op.
    if args.topk is None:
        extra = [f for f, v in (("--src", args.src), ("--time", args.time),
                                ("--candidates", args.candidates)) if v is not None]  # fmt: skip
        if extra:
            raise ConfigError(f"{', '.join(extra)} go with --topk K; scoring --pairs uses none")
        if not args.pairs:
            raise ConfigError("sven predict needs --pairs FILE, or --topk K --src IDS --time T")
    elif args.pairs:
        raise ConfigError(
            "--pairs and --topk are two questions: score the pairs of a table, or rank the "
            "destinations of --src at --time; give one"
        )
    out = _check_out(args, (".csv", ".parquet"), args.pairs)
    if args.topk is None:
        df = read_pairs(args.pairs)
        t0 = time.perf_counter()
        pred = _predictor(args)
        t1 = time.perf_counter()
        df["score"] = pred.score(
            df["src"].to_numpy(), df["dst"].to_numpy(), df["t"].to_numpy(),
            unknown=args.unknown, logits=args.logits,
        )  # fmt: skip
        t2 = time.perf_counter()
        write_table(df, out, overwrite=args.overwrite)
        # The model's loading apart from the scoring (a replay, if any, is scoring's).
        rate = len(df) / max(t2 - t1, 1e-9)
        print(
            f"{len(df)} rows scored in {t2 - t1:.2f} s ({rate:,.0f} pairs/s; the model "
            f"loaded in {t1 - t0:.2f} s) -> {out}",
            file=sys.stderr,
        )
        return 0
    if args.src is None or args.time is None:
        raise ConfigError("--topk needs --src IDS and --time T")
    src = _ids(args.src)
    pred = _predictor(args)
    cands = None if args.candidates is None else _ids(args.candidates)
    ids, scores = pred.topk(src, args.time, args.topk, candidates=cands, unknown=args.unknown)
    # --unknown skip: a source the store does not know has no destinations to rank; its
    # rows are left out (Predictor.topk fills them with NaN scores).
    _, known = pred.compact_ids(np.asarray(src), "src")
    kept = np.asarray(src, dtype=object)[known]
    k = ids.shape[1]
    df = pd.DataFrame(
        {
            "src": np.repeat(kept, k),
            "t": args.time,
            "rank": np.tile(np.arange(1, k + 1), kept.size),
            "dst": ids[known].reshape(-1),
            "score": scores[known].reshape(-1),
        }
    )
    write_table(df, out, overwrite=args.overwrite)
    print(f"top {k} destinations of {kept.size} sources -> {out}", file=sys.stderr)
    return 0


def _embed(args: argparse.Namespace) -> int:
    import pandas as pd

    from sven.tasks.predict import write_table

    out = _check_out(args, (".npy", ".csv", ".parquet"))
    nodes = _ids(args.nodes)
    h = _predictor(args).embed(nodes, args.time, side=args.side, unknown=args.unknown)
    table: Any = h
    if out.suffix != ".npy":
        cols = {"node": nodes, "t": args.time}
        cols.update({f"e{j}": h[:, j] for j in range(h.shape[1])})
        table = pd.DataFrame(cols)
    write_table(table, out, overwrite=args.overwrite)
    print(f"{h.shape[0]} embeddings of width {h.shape[1]} -> {out}", file=sys.stderr)
    return 0
