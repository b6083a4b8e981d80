"""A copy of an event store with its node ids renumbered by activity: the most active
node becomes 0, so that the rows the steps touch most share a few pages of every
node-state table. A benchmark's tool, to see whether a tier's speed depends on where
the hot rows lie (docs/scale.md); the events, times, features and
splits are those of the input, and ``id_map`` still names each node's raw id.

    python3 benchmarks/relabel_store.py STORE OUT
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from sven.datasets.store import TemporalEvents, write_events


def activity_order(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> np.ndarray:
    """(N,) new id of each node: nodes by falling event count, ties by id.

    Args:
        src: (E,) source ids.
        dst: (E,) destination ids.
        num_nodes: N.

    Returns:
        (N,) int64 ``new[old]``.
    """
    count = np.bincount(src, minlength=num_nodes) + np.bincount(dst, minlength=num_nodes)
    # A stable sort of the negated counts keeps equal counts in id order.
    old_by_rank = np.argsort(-count, kind="stable")
    new = np.empty(num_nodes, dtype=np.int64)
    new[old_by_rank] = np.arange(num_nodes, dtype=np.int64)
    return new


def relabel(store: str, out: str) -> dict[str, object]:
    """Writes ``out``: ``store`` with node ids by activity (one side at a time on a
    bipartite store, so that each side keeps its id range)."""
    ev = TemporalEvents.load(store)
    src, dst = np.asarray(ev.src, dtype=np.int64), np.asarray(ev.dst, dtype=np.int64)
    n = ev.num_nodes
    if ev.eval_negatives:
        raise SystemExit("stores with negatives tables are not relabelled by this tool")
    if ev.bipartite:
        ns = ev.meta["num_src_nodes"]
        new = np.concatenate(
            [activity_order(src, np.empty(0, np.int64), ns),
             ns + activity_order(dst - ns, np.empty(0, np.int64), n - ns)]
        )  # fmt: skip
    else:
        new = activity_order(src, dst, n)
    id_map = np.empty_like(np.asarray(ev.id_map))
    id_map[new] = np.asarray(ev.id_map)
    node_feat = None
    if ev.node_feat is not None:
        node_feat = np.empty_like(np.asarray(ev.node_feat))
        node_feat[new] = np.asarray(ev.node_feat)
    write_events(
        out, new[src], new[dst], np.asarray(ev.t),
        edge_feat=None if ev.edge_feat is None else np.asarray(ev.edge_feat),
        label=None if ev.label is None else np.asarray(ev.label),
        node_feat=node_feat, id_map=id_map, num_nodes=n, bipartite=ev.bipartite,
        name=ev.meta["name"] + "-by-activity",
        val_frac=ev.meta["split"]["fractions"][1], test_frac=ev.meta["split"]["fractions"][2],
        source={"format": "relabel", "of": ev.meta.get("source")},
    )  # fmt: skip
    top = np.bincount(src, minlength=n) + np.bincount(dst, minlength=n)
    top.sort()
    share = float(top[::-1][: max(n // 100, 1)].sum() / max(top.sum(), 1))
    return {"store": out, "nodes": n, "events": int(src.shape[0]), "top_1pct_share": share}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("out")
    args = ap.parse_args()
    print(json.dumps(relabel(args.store, args.out)))


if __name__ == "__main__":
    main()
