"""Where a captured step's time goes per CUDA stream, from ``profile_step.py --trace``.

Reads the Chrome trace of the profiled steps and prints, per stream, its kernels' busy
time per step and the kernels with the most of it; then the step's span (first kernel's
start to last kernel's end, per replay: consecutive kernels more than ``--gap`` us apart
start a new step) and how much of the span each stream's kernels cover.

    python3 benchmarks/trace_streams.py OUT/tiers/host/trace_step.json.gz --steps 20
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def kernels(path: Path) -> list[dict]:
    """The trace's GPU kernel and memory events (``ts``, ``dur`` in us, ``tid`` the
    stream), by start."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    cats = {"kernel", "gpu_memcpy", "gpu_memset"}
    return sorted((e for e in events if e.get("cat") in cats), key=lambda e: e["ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    ev = kernels(args.trace)
    busy: dict[str, float] = defaultdict(float)
    names: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in ev:
        s = str(e.get("tid"))
        busy[s] += e["dur"]
        names[s][e["name"][:70]] += e["dur"]
    span = (max(e["ts"] + e["dur"] for e in ev) - ev[0]["ts"]) / args.steps
    print(f"span per step: {span:.1f} us ({len(ev) / args.steps:.0f} kernels a step)")
    for s, t in sorted(busy.items(), key=lambda x: -x[1]):
        print(f"stream {s}: {t / args.steps:.1f} us busy per step")
        for n, d in sorted(names[s].items(), key=lambda x: -x[1])[: args.top]:
            print(f"    {d / args.steps:8.1f} us  {n}")


if __name__ == "__main__":
    main()
