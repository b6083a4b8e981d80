"""Summary statistics of an event store (``sven data info``).

Everything is computed in chunks over the memory-mapped columns, so it works on
stores larger than RAM: memory is a few chunks, an (N,) degree array and the set of
distinct (src, dst) pairs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sven.datasets.compact import DistinctValues
from sven.datasets.identity import fingerprint
from sven.datasets.layout import SPLITS, iter_ranges
from sven.datasets.store import TemporalEvents

__all__ = ["describe", "format_info"]

DEGREE_PERCENTILES = (50, 90, 99)
_PAIR_KEY_LIMIT = 3_037_000_499  # floor(sqrt(2^63 - 1))


def _degrees_and_pairs(ev: TemporalEvents) -> tuple[np.ndarray, int | None]:
    """(N,) events per node, and the number of distinct directed (src, dst) pairs (None
    beyond the node count whose pair keys fit in 64 bits)."""
    E, N = ev.num_events, ev.num_nodes
    degree = np.zeros(N, dtype=np.int64)
    # src * N + dst is a unique key per directed pair while N^2 < 2^63.
    pairs = DistinctValues() if N < _PAIR_KEY_LIMIT else None
    for start, stop in iter_ranges(E):
        src = np.asarray(ev.src[start:stop], dtype=np.int64)
        dst = np.asarray(ev.dst[start:stop], dtype=np.int64)
        degree += np.bincount(src, minlength=N)
        degree += np.bincount(dst, minlength=N)
        if pairs is not None:
            pairs.add(src * N + dst)
    return degree, None if pairs is None else int(pairs.result().size)


def _inductive(ev: TemporalEvents) -> dict[str, Any]:
    """Per evaluation split: events with an endpoint never seen in training, their
    share, and the count of such new nodes."""
    seen_train = ev.seen_in("train")
    inductive: dict[str, Any] = {}
    for split in ("val", "test"):
        start, stop = ev.split_range(split)
        mask = ev.inductive_mask(split)
        new_nodes = ev.seen_in(split) & ~seen_train
        inductive[split] = {
            "events": int(mask.sum()),
            "share": float(mask.mean()) if stop > start else 0.0,
            "new_nodes": int(new_nodes.sum()),
        }
    return inductive


def _splits(ev: TemporalEvents) -> dict[str, Any]:
    """Per split: its events and the times of its first and last."""
    splits: dict[str, Any] = {}
    for split in SPLITS:
        start, stop = ev.split_range(split)
        splits[split] = {
            "events": stop - start,
            "t_first": ev.t[start].item() if stop > start else None,
            "t_last": ev.t[stop - 1].item() if stop > start else None,
        }
    return splits


def describe(ev: TemporalEvents) -> dict[str, Any]:
    """Computes the statistics that ``sven data info`` prints.

    Args:
        ev: The store.

    Returns:
        A JSON-serialisable dict: ``events``, ``nodes``, ``bipartite``, time range
        and span, feature dims, labels, ``repeat_edge_ratio`` (share of events whose
        directed (src, dst) pair occurred before; None beyond 3e9 nodes), ``degree``
        (events per node: mean, percentiles, max), ``splits`` (events and time
        bounds per split) and
        ``inductive`` (per evaluation split, the share of events with an endpoint
        never seen in training, and the count of such new nodes), and the store's
        ``fingerprint`` (:mod:`sven.datasets.identity`).
    """
    meta = ev.meta
    E, N = ev.num_events, ev.num_nodes
    degree, unique_pairs = _degrees_and_pairs(ev)
    labels: dict[str, Any] | None = None
    if ev.label is not None:
        positive = sum(
            int(np.count_nonzero(ev.label[start:stop])) for start, stop in iter_ranges(E)
        )
        labels = {"dtype": str(ev.label.dtype), "nonzero": positive}

    return {
        "name": meta.get("name"),
        "path": str(ev.path),
        "events": E,
        "nodes": N,
        "active_nodes": int(np.count_nonzero(degree)),
        "bipartite": ev.bipartite,
        "num_src_nodes": ev.num_src_nodes,
        "t_dtype": meta["t_dtype"],
        "t_min": meta["t_min"],
        "t_max": meta["t_max"],
        "time_span": meta["t_max"] - meta["t_min"],
        "edge_feat_dim": meta["edge_feat_dim"],
        "node_feat_dim": meta["node_feat_dim"],
        "labels": labels,
        "unique_edges": unique_pairs,
        "repeat_edge_ratio": None if unique_pairs is None else 1.0 - unique_pairs / E,
        "degree": {
            "mean": float(degree.mean()),
            **{f"p{q}": float(np.percentile(degree, q)) for q in DEGREE_PERCENTILES},
            "max": int(degree.max()),
        },
        "splits": _splits(ev),
        "inductive": _inductive(ev),
        "sorted_on_ingest": meta["sorted_on_ingest"],
        "num_out_of_order": meta["num_out_of_order"],
        "source": meta["source"],
        # What runs, checkpoints and partitions record of this store (its identity).
        "fingerprint": fingerprint(meta),
    }


def _n(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:,.6g}"


def format_info(info: dict[str, Any]) -> str:
    """Formats :func:`describe`'s dict as a short human-readable report."""
    sp = info["splits"]
    lines = [
        f"{info['name']}  ({info['path']}; fingerprint {info['fingerprint']})",
        f"  events       {_n(info['events'])}  (train {_n(sp['train']['events'])} / "
        f"val {_n(sp['val']['events'])} / test {_n(sp['test']['events'])})",
    ]
    nodes = f"  nodes        {_n(info['nodes'])}  ({_n(info['active_nodes'])} with events)"
    if info["bipartite"]:
        src = info["num_src_nodes"]
        nodes += f"; bipartite: {_n(src)} sources, {_n(info['nodes'] - src)} destinations"
    else:
        nodes += "; not bipartite"
    lines.append(nodes)
    lines.append(
        f"  time         {_n(info['t_min'])} .. {_n(info['t_max'])}  "
        f"(span {_n(info['time_span'])}, {info['t_dtype']})"
    )
    feats = f"  features     edge {info['edge_feat_dim']}, node {info['node_feat_dim']}"
    if info["labels"] is not None:
        feats += f"; labels ({info['labels']['dtype']}): {_n(info['labels']['nonzero'])} non-zero"
    lines.append(feats)
    if info["repeat_edge_ratio"] is not None:
        lines.append(
            f"  repeats      {info['repeat_edge_ratio']:.1%} of events repeat an earlier "
            f"(src, dst) pair; {_n(info['unique_edges'])} distinct pairs"
        )
    deg = info["degree"]
    pct = ", ".join(f"p{q} {_n(deg[f'p{q}'])}" for q in DEGREE_PERCENTILES)
    lines.append(f"  degree       mean {deg['mean']:.2f}, {pct}, max {_n(deg['max'])}")
    ind = info["inductive"]
    lines.append(
        "  inductive    "
        + "; ".join(
            f"{s} {ind[s]['share']:.1%} of events ({_n(ind[s]['new_nodes'])} new nodes)"
            for s in ("val", "test")
        )
    )
    order = (
        f"re-sorted on ingest ({_n(info['num_out_of_order'])} events were earlier than "
        "their predecessor)"
        if info["sorted_on_ingest"]
        else "input was in time order"
    )
    lines.append(f"  ingest       {order}; source format {info['source'].get('format')}")
    return "\n".join(lines)
