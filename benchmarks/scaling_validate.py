"""Validates the scaling model against measured runs.

::

    python benchmarks/scaling_validate.py SPEC.json --store NAME=STORE [...] --out OUT.json

The spec (see ``benchmarks/scaling_cases_cpu.json``, ``scaling_cases_gpu.json``) lists
measured runs: ``{"name", "data", "batch", "parts", "strategy", "measured"}``
(events/s). Compute: ``compute_us_per_event`` (b) given, and the fixed part (a) per
data set from its one-rank run (``a = step - b * batch``), or both fitted from several
one-rank runs (``"compute": "fit"``). Link: given (``"link": {"bandwidth_gbs",
"latency_us"}``), or fitted to the runs named in ``"fit_link"`` (least squares on the
step time, which is linear in latency and 1 / bandwidth while the slowest rank of each
batch stays the same). Every run is then predicted and its error printed; runs used
in a fit are marked. A case may carry its own ``"link"`` (measured at its P).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from sven.partition.scaling import Link, Machine, fit_compute, simulate


def _counts(store: str, case: dict[str, Any], spec: dict[str, Any]) -> Any:
    """The per-batch counts of the case's partition (as the trainer builds it)."""
    from sven.datasets.store import TemporalEvents
    from sven.partition.access import Access
    from sven.partition.api import PartitionResult, evaluate_store, partition_store
    from sven.partition.report import row_bytes

    events = TemporalEvents.load(store)
    access = Access.of(spec.get("model", "tgn"))
    kw = {"k": spec.get("k", 10), "num_neg": 1, "seed": spec.get("seed", 0)}
    p, batch = case["parts"], case["batch"]
    if p == 1:
        res = PartitionResult(
            np.zeros(events.num_nodes, dtype=np.int32), np.zeros(events.num_events, dtype=np.int32)
        )
    else:
        res = partition_store(events, p, case["strategy"], batch_size=batch, access=access, **kw)
    rep = evaluate_store(
        events, res, parts=p, batch_size=batch, widths=row_bytes(spec.get("memory_dim", 100)),
        access=access, per_batch=True, **kw,
    )  # fmt: skip
    return rep


def _machine(spec: dict[str, Any], a: float, b: float, link: Link) -> Machine:
    return Machine(
        compute_ms=a,
        compute_us_per_event=b,
        intra=link,
        inter=link,
        ranks_per_node=spec.get("ranks_per_node", 8),
        grad_bytes=spec["grad_bytes"],
        hidden=spec.get("hidden", 0.8),
        concurrent_ranks=spec.get("concurrent_ranks"),
    )


def main(argv: list[str] | None = None) -> int:
    """Fits what the spec asks, predicts every run, prints and writes the errors."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="JSON spec of the measured runs")
    ap.add_argument("--store", nargs="+", default=[], help="NAME=STORE for the spec's data")
    ap.add_argument(
        "--link", nargs=2, type=float, metavar=("GBS", "US"), help="use this link, fit none"
    )
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    if args.link:
        spec["link"] = {"bandwidth_gbs": args.link[0], "latency_us": args.link[1]}
        spec["fit_link"] = []
    stores = dict(s.split("=", 1) for s in args.store)
    cases = spec["cases"]
    reps = [_counts(stores[c["data"]], c, spec) for c in cases]
    b = spec.get("compute_us_per_event", 0.0)
    # Compute: per data set from its one-rank runs.
    compute: dict[str, tuple[float, float]] = {}
    for data in {c["data"] for c in cases}:
        ones = [c for c in cases if c["data"] == data and c["parts"] == 1]
        step_ms = [1e3 * c["batch"] / c["measured"] for c in ones]
        if spec.get("compute") == "fit":
            compute[data] = fit_compute([c["batch"] for c in ones], step_ms)
        else:
            compute[data] = (float(np.mean([s - b * 1e-3 * c["batch"]
                                            for s, c in zip(step_ms, ones)])), b)  # fmt: skip

    def link_of(i: int, link: Link) -> Link:
        """A case's own measured link (``"link"`` in the case) wins."""
        own = cases[i].get("link")
        return link if own is None else Link(own["bandwidth_gbs"], own["latency_us"])

    def predict(i: int, link: Link) -> float:
        a_, b_ = compute[cases[i]["data"]]
        rep = reps[i]
        machine = _machine(spec, a_, b_, link_of(i, link))
        return simulate(rep.batches, rep.widths, machine).events_per_s

    fit_names = spec.get("fit_link", [])
    if "link" in spec:
        link = Link(spec["link"]["bandwidth_gbs"], spec["link"]["latency_us"])
    else:
        # Epoch time is linear in (latency, 1 / bandwidth) while the critical ranks stay
        # put: fit it by least squares, re-linearising around the estimate twice.
        idx = [i for i, c in enumerate(cases) if c["name"] in fit_names]
        lat, inv = 10.0, 1.0 / 100.0  # us, s per GB
        for _ in range(3):
            rows, rhs = [], []
            for i in idx:
                ev = reps[i].batches.events.sum()

                def epoch_s(lat_us: float, inv_gbs: float, i: int = i, ev: int = ev) -> float:
                    return ev / predict(i, Link(1.0 / inv_gbs, lat_us))

                t0 = epoch_s(lat, inv)
                d_lat = (epoch_s(lat + 1.0, inv) - t0) / 1.0
                d_inv = (epoch_s(lat, inv * 1.01) - t0) / (inv * 0.01)
                rows.append([d_lat, d_inv])
                rhs.append(ev / cases[i]["measured"] - t0 + d_lat * lat + d_inv * inv)
            m, y = np.asarray(rows), np.asarray(rhs)
            sol, *_ = np.linalg.lstsq(m, y, rcond=None)
            if sol[0] < 0:
                # A negative latency is no link: fit the bandwidth alone at latency 0.
                sol = np.array([0.0, float(m[:, 1] @ y / (m[:, 1] @ m[:, 1]))])
            lat, inv = float(sol[0]), max(float(sol[1]), 1e-6)
        link = Link(1.0 / inv, lat)
    out = []
    for i, c in enumerate(cases):
        pred = predict(i, link)
        a_, b_ = compute[c["data"]]
        machine = _machine(spec, a_, b_, link_of(i, link))
        piped = simulate(reps[i].batches, reps[i].widths, machine).events_per_s_pipelined
        fitted = c["name"] in fit_names or c["parts"] == 1
        row = {
            **c,
            "predicted": pred,
            "predicted_pipelined": piped,
            "error": pred / c["measured"] - 1.0,
            "role": "fit" if fitted else "held out",
        }
        out.append(row)
        print(
            f"{c['name']:28s} P={c['parts']} B={c['batch']:5d} {c['strategy']:6s} "
            f"measured {c['measured']:10,.0f}  predicted {pred:10,.0f}  "
            f"error {100 * row['error']:+6.1f}%  ({row['role']})"
        )
    result = {
        "compute_ms_and_us_per_event": compute,
        "link": {"bandwidth_gbs": link.bandwidth_gbs, "latency_us": link.latency_us},
        "grad_bytes": spec["grad_bytes"],
        "concurrent_ranks": spec.get("concurrent_ranks"),
        "rows": out,
    }
    print(
        f"link: {link.bandwidth_gbs:.4g} GB/s, {link.latency_us:.4g} us per collective; "
        + "; ".join(f"{d}: a {a_:.3f} ms, b {b_:.3f} us/event" for d, (a_, b_) in compute.items())
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
