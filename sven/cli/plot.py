"""``sven plot``: PNG figures of a training run or of a partition.

``sven plot RUN`` reads a run folder (``metrics.jsonl``, ``summary.json``) and writes:

- ``training.png``: train loss and validation AP/AUC per epoch, the best epoch marked;
- ``comm_per_rank.png`` (runs on more than one rank): the memory-exchange bytes each
  rank sent in the last epoch, redundancy-free (as sent) beside naive (one fetch per
  occurrence), from the ``comm_bytes_exchange_per_rank`` and
  ``comm_bytes_naive_per_rank`` keys;
- ``stage_times.png`` (when the run recorded them): seconds per rank of each pipeline
  stage in the last epoch, from keys ``stage_<name>_s_per_rank``.

``sven plot PART`` reads a partition folder (``sven partition --out PART``) and writes
``partition.png``: training events, owned vertices and bytes sent per rank, each
against the mean, with the max/mean imbalance in the panel title.

Figures go to ``--out`` (default ``<RUN or PART>/plots``) and their paths are printed.
Each is written whole or not at all, and recorded in the folder's manifest
(:mod:`sven.outputs`): a later ``sven plot`` replaces Sven's own figures, never a PNG of
the user's of the same name without ``--overwrite``.
Drawn with matplotlib's Agg canvas, without pyplot, so no display and no global state
is touched; matplotlib is the optional extra ``plot``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from sven.errors import DataError, SvenError
from sven.extras import install_hint
from sven.outputs import atomic_output, check_output_folder, record_outputs

_STAGE_KEY = re.compile(r"^stage_(?P<name>.+)_s_per_rank$")
# Colours of the two byte counts, the same in the run's and the partition's figures.
_NAIVE, _FREE = "#bbbbbb", "#1f77b4"


def _require_matplotlib() -> None:
    """Fails with the install hint before anything is read or written."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        raise SvenError(f"sven plot needs matplotlib: {install_hint('plot')}") from None


def _figure(cols: int, width: float = 5.2, height: float = 4.0) -> tuple[Any, list[Any]]:
    """A figure with ``cols`` panels on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * cols, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, cols, squeeze=False)[0]
    return fig, list(axes)


def _bytes_unit(values: np.ndarray) -> tuple[float, str]:
    """The divisor and name of a binary unit that keeps ``values`` readable."""
    top = float(np.max(values)) if np.size(values) else 0.0
    for power, name in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if top >= 1024**power:
            return float(1024**power), name
    return 1.0, "bytes"


def _ranks_axis(ax: Any, parts: int, legend: bool = True) -> None:
    """Rank ticks, and headroom above the bars for a legend that covers none of them."""
    ax.set_xlabel("rank")
    ax.set_xticks(range(parts))
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)
    if legend:
        ax.legend(loc="upper right", fontsize="small", ncols=2)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError as exc:
            raise DataError(f"not JSON: {exc}", path, i) from None
    return lines


def _save(fig: Any, path: Path) -> None:
    """The figure as a PNG at ``path``, whole or not at all (:func:`atomic_output`)."""
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")


def plot_run(
    run: str | Path, out: str | Path | None = None, *, overwrite: bool = False
) -> list[Path]:
    """Writes the figures of a run folder.

    Args:
        run: Folder with ``metrics.jsonl`` (one line per epoch) and, when the run
            finished, ``summary.json``.
        out: Folder for the PNGs (default ``<run>/plots``).
        overwrite: Replace a PNG of the same name that Sven did not write there
            (its own earlier figures are replaced anyway; see :mod:`sven.outputs`).

    Returns:
        The paths written, ``training.png`` first.

    Raises:
        DataError: No epoch line in ``metrics.jsonl``.
        SvenError: ``out`` is a file, or holds a PNG of the user's of the same name.
    """
    _require_matplotlib()
    run = Path(run)
    lines = _read_lines(run / "metrics.jsonl")
    if not lines:
        raise DataError("no epoch finished yet (metrics.jsonl is empty)", run / "metrics.jsonl")
    summary = {}
    if (run / "summary.json").is_file():
        summary = json.loads((run / "summary.json").read_text())
    cfg = {}
    if (run / "config.json").is_file():
        cfg = json.loads((run / "config.json").read_text())
    last = lines[-1]
    comm = "comm_bytes_exchange_per_rank" in last and "comm_bytes_naive_per_rank" in last
    stages = {m["name"]: last[k] for k in last if (m := _STAGE_KEY.match(k))}
    names = ["training.png", *(["comm_per_rank.png"] if comm else [])]
    names += ["stage_times.png"] if stages else []
    # Before drawing anything: a file where the folder goes, or a PNG of the user's.
    # The run's own plots folder is Sven's: one an older Sven plotted into has no manifest.
    out = check_output_folder(
        out if out is not None else run / "plots", names, overwrite=overwrite, legacy=out is None
    )
    out.mkdir(parents=True, exist_ok=True)
    model = str(summary.get("model") or cfg.get("model", {}).get("name", "model")).upper()
    dataset = summary.get("dataset") or Path(cfg.get("data", {}).get("path", "") or "data").name
    ranks = summary.get("world_size")
    who = f"{model} on {dataset}" + (f", {ranks} rank{'s' * (ranks != 1)}" if ranks else "")
    paths = [_plot_training(lines, summary, who, out / "training.png")]
    if comm:
        paths.append(_plot_comm(last, who, out / "comm_per_rank.png"))
    if stages:
        paths.append(_plot_stages(stages, int(last["epoch"]), who, out / "stage_times.png"))
    record_outputs(out, paths)
    return paths


def _plot_training(
    lines: list[dict[str, Any]], summary: dict[str, Any], who: str, path: Path
) -> Path:
    from matplotlib.ticker import MaxNLocator

    epochs = [int(x["epoch"]) for x in lines]

    def series(key: str) -> list[float]:
        return [np.nan if x.get(key) is None else float(x[key]) for x in lines]

    fig, (loss_ax, ap_ax) = _figure(2)
    loss_ax.plot(epochs, series("train_loss"), marker="o", color="#d62728")
    loss_ax.set_title("Training loss")
    loss_ax.set_ylabel("binary cross-entropy (mean over batches)")
    ap_ax.plot(epochs, series("val_ap"), marker="o", color=_FREE, label="val AP")
    ap_ax.plot(epochs, series("val_auc"), marker="s", ls="--", color="#ff7f0e", label="val AUC")
    ap_ax.axhline(0.5, color="grey", lw=0.8, ls=":", label="random (0.5)")
    best = summary.get("best_epoch")
    if best is not None and best in epochs:
        ap_ax.axvline(best, color="green", lw=1.0, alpha=0.6, label=f"best epoch ({best})")
    ap_ax.set_title("Validation link prediction")
    ap_ax.set_ylabel("score")
    ap_ax.legend(loc="best", fontsize="small")
    for ax in (loss_ax, ap_ax):
        ax.set_xlabel("epoch")
        if len(epochs) <= 12:
            ax.set_xticks(epochs)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(min(epochs) - 0.5, max(epochs) + 0.5)
        ax.grid(alpha=0.3)
    title = who
    if summary.get("test_ap") is not None:
        title += f": test AP {summary['test_ap']:.4f}"
        if summary.get("test_auc") is not None:
            title += f", AUC {summary['test_auc']:.4f}"
    fig.suptitle(title)
    _save(fig, path)
    return path


def _plot_comm(line: dict[str, Any], who: str, path: Path) -> Path:
    free = np.asarray(line["comm_bytes_exchange_per_rank"], dtype=np.float64)
    naive = np.asarray(line["comm_bytes_naive_per_rank"], dtype=np.float64)
    parts = free.shape[0]
    scale, unit = _bytes_unit(np.concatenate([free, naive]))
    fig, (ax,) = _figure(1, width=max(5.2, 1.0 + 0.9 * parts))
    x = np.arange(parts)
    ax.bar(x - 0.2, naive / scale, 0.4, color=_NAIVE, label="naive (one fetch per occurrence)")
    ax.bar(x + 0.2, free / scale, 0.4, color=_FREE, label="redundancy-free (sent)")
    _ranks_axis(ax, parts)
    ax.set_ylabel(f"memory exchange sent ({unit})")
    saving = 1.0 - free.sum() / naive.sum() if naive.sum() else 0.0
    ax.set_title(
        f"Memory-exchange bytes per rank, epoch {line['epoch']}\n"
        f"de-duplication saves {saving:.0%}; max/mean {free.max() / max(free.mean(), 1.0):.2f}",
        fontsize="medium",
    )
    fig.suptitle(f"{who} (gradient all-reduce not included)", fontsize="medium")
    _save(fig, path)
    return path


def _plot_stages(stages: dict[str, list[float]], epoch: int, who: str, path: Path) -> Path:
    names = sorted(stages)
    table = np.asarray([stages[n] for n in names], dtype=np.float64)  # (stages, ranks)
    parts = table.shape[1]
    fig, (ax,) = _figure(1, width=max(5.2, 1.5 + 0.9 * parts))
    bottom = np.zeros(parts)
    for name, row in zip(names, table):
        ax.bar(np.arange(parts), row, 0.6, bottom=bottom, label=name)
        bottom += row
    _ranks_axis(ax, parts, legend=False)
    ax.set_ylabel("seconds in the epoch")
    ax.legend(title="stage", fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"Time per pipeline stage, epoch {epoch}")
    fig.suptitle(who, fontsize="medium")
    _save(fig, path)
    return path


def plot_partition(
    part: str | Path, out: str | Path | None = None, *, overwrite: bool = False
) -> list[Path]:
    """Writes ``partition.png`` of a partition folder.

    Training events and vertices per rank come from ``assign.npy`` and ``owner.npy``;
    the bytes per rank from the cost report stored in ``meta.json`` (``per_rank``),
    when the partition has it.

    Args:
        part: Folder written by ``sven partition --out``.
        out: Folder for the PNG (default ``<part>/plots``).
        overwrite: Replace a ``partition.png`` that Sven did not write there.

    Returns:
        The path written.
    """
    _require_matplotlib()
    from matplotlib.ticker import MaxNLocator

    from sven.partition.store import load_partition

    part = Path(part)
    p = load_partition(part, rank=0)
    meta = p.meta
    parts = int(meta["parts"])
    train = int(meta.get("num_train_events", p.assign.shape[0]))
    events = np.bincount(np.asarray(p.assign[:train]), minlength=parts)
    vertices = np.bincount(np.asarray(p.owner), minlength=parts)
    per_rank = meta.get("per_rank") or {}
    has_bytes = "comm_bytes" in per_rank and "naive_bytes" in per_rank
    out = check_output_folder(
        out if out is not None else part / "plots",
        ["partition.png"],
        overwrite=overwrite,
        legacy=out is None,
    )
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = _figure(3 if has_bytes else 2, width=max(4.2, 1.2 + 0.6 * parts))
    x = np.arange(parts)
    for ax, values, what in (
        (axes[0], events, "training events"),
        (axes[1], vertices, "vertices owned"),
    ):
        ax.bar(x, values, 0.6, color=_FREE)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        _mean_line(ax, values)
        _ranks_axis(ax, parts)
        ax.set_ylabel(what)
        ax.set_title(f"{what.capitalize()} per rank\nmax/mean {_imbalance(values):.3f}")
    if has_bytes:
        free = np.asarray(per_rank["comm_bytes"], dtype=np.float64)
        naive = np.asarray(per_rank["naive_bytes"], dtype=np.float64)
        scale, unit = _bytes_unit(np.concatenate([free, naive]))
        ax = axes[2]
        ax.bar(x - 0.2, naive / scale, 0.4, color=_NAIVE, label="naive")
        ax.bar(x + 0.2, free / scale, 0.4, color=_FREE, label="redundancy-free")
        _mean_line(ax, free / scale, "mean (redundancy-free)")
        _ranks_axis(ax, parts)
        ax.set_ylabel(f"bytes sent per epoch ({unit})")
        ax.set_title(f"Communication per rank (cost model)\nmax/mean {_imbalance(free):.3f}")
    store = (meta.get("store") or {}).get("name") or "store"
    fig.suptitle(
        f"Partition of {store}: {meta.get('strategy')} into {parts} ranks "
        f"(model {meta.get('model', 'tgn')}, batch {meta.get('batch_size')})"
    )
    path = out / "partition.png"
    _save(fig, path)
    record_outputs(out, [path])
    return [path]


def _imbalance(values: np.ndarray) -> float:
    mean = float(np.mean(values)) if np.size(values) else 0.0
    return float(np.max(values)) / mean if mean > 0 else 1.0


def _mean_line(ax: Any, values: np.ndarray, label: str = "mean") -> None:
    ax.axhline(float(np.mean(values)), color="black", lw=1.0, ls="--", label=label)


def plot(path: str | Path, out: str | Path | None = None, *, overwrite: bool = False) -> list[Path]:
    """Plots a run folder or a partition folder, whichever ``path`` is.

    Raises:
        DataError: ``path`` is neither (no ``metrics.jsonl``, no partition ``meta.json``).
        SvenError: ``out`` is a file, or holds a PNG of the same name that Sven did not
            write, and ``overwrite`` is False.
    """
    p = Path(path)
    if (p / "metrics.jsonl").is_file():
        return plot_run(p, out, overwrite=overwrite)
    if (p / "meta.json").is_file() and (p / "owner.npy").is_file():
        return plot_partition(p, out, overwrite=overwrite)
    raise DataError(
        "neither a run folder (no metrics.jsonl) nor a partition folder (no meta.json "
        "and owner.npy)",
        p,
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers the ``plot`` subcommand."""
    p = sub.add_parser(
        "plot",
        help="PNG figures of a run (loss, val AP, bytes per rank) or of a partition",
        description="Plot a training run folder (train loss and val AP per epoch; per-rank "
        "bytes, naive vs redundancy-free, and per-rank stage times when recorded) or a "
        "partition folder (events, vertices and bytes per rank). Needs matplotlib: "
        f"{install_hint('plot')}.",
    )
    p.add_argument("path", metavar="RUN_OR_PART", help="a run folder or a partition folder")
    p.add_argument("--out", metavar="DIR", help="folder for the PNGs (default: RUN_OR_PART/plots)")
    p.add_argument(
        "--overwrite", action="store_true",
        help="replace PNGs of the same names in --out that Sven did not write (its own "
        "earlier figures are replaced anyway)",
    )  # fmt: skip
    p.set_defaults(func=_plot)


def _plot(args: argparse.Namespace) -> int:
    for path in plot(args.path, args.out, overwrite=args.overwrite):
        print(path)
    return 0
