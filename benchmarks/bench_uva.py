"""Row gathers and scatters over pinned host memory from the GPU, by table size and by
how the memory was pinned: what the host tier's step pays per access (docs/scale.md).

For each table size (rows of ``--row-bytes``), the table is pinned two ways: as the
host tier does (an anonymous mapping, transparent huge pages asked for, registered
with ``cudaHostRegister``: ``sven.models.storage.Storage``) and by the CUDA allocator
(``cudaHostAlloc`` through ``torch.empty(pin_memory=True)``); then ``--rows`` random
rows are gathered (``index_select`` of the CUDA view) and scattered back, timed with
CUDA events (median of ``--reps``). Prints one JSON line per case and the host's
transparent-huge-page settings.

    python3 benchmarks/bench_uva.py --sizes 1e6 1e7 --out OUT/uva.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sven.models.storage import Storage, uva_view


def _thp() -> dict[str, str]:
    out = {}
    for name in ("enabled", "defrag"):
        p = Path("/sys/kernel/mm/transparent_hugepage") / name
        out[name] = p.read_text().strip() if p.exists() else "absent"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(("AnonHugePages", "Hugepagesize", "HugePages_Total")):
            k, v = line.split(":", 1)
            out[k] = v.strip()
    return out


def _time(fn, reps: int) -> float:
    """Median milliseconds of ``fn(i)`` on the current stream, for i in 0..reps."""
    fn(reps)
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def case(view: torch.Tensor, rows: int, reps: int, seed: int) -> dict[str, float]:
    """Gather and scatter ``rows`` random rows of the CUDA view of a pinned table, other
    rows each time (as a step's: the same rows again would find their pages'
    translations cached)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.randint(0, view.shape[0], (reps + 1, rows), device="cuda", generator=g)
    buf = view.index_select(0, idx[0])
    nbytes = rows * view.shape[1] * view.element_size()
    gather = _time(lambda i: torch.index_select(view, 0, idx[i], out=buf), reps)
    scatter = _time(lambda i: view.index_copy_(0, idx[i], buf), reps)
    return {
        "gather_ms": gather,
        "gather_gb_s": nbytes / gather / 1e6,
        "scatter_ms": scatter,
        "scatter_gb_s": nbytes / scatter / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7])
    ap.add_argument("--row-bytes", type=int, default=1216)
    ap.add_argument("--rows", type=int, default=5184)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    width = args.row_bytes // 4
    results = {"thp": _thp(), "cases": []}
    print(json.dumps(results["thp"]))
    for n in (int(s) for s in args.sizes):
        for how in ("register", "hostalloc"):
            if how == "register":
                st = Storage("host", "cuda")
                view, host = st.empty("t", (n, width), torch.float32)
            else:
                st = None
                host = torch.zeros((n, width), dtype=torch.float32, pin_memory=True)
                view = uva_view(host, torch.device("cuda"))
            rec = {"rows_in_table": n, "pinned_by": how, "thp_after": _thp().get("AnonHugePages")}
            rec.update(case(view, args.rows, args.reps, seed=n))
            results["cases"].append(rec)
            print(json.dumps(rec), flush=True)
            del view, host
            if st is not None:
                st.close()
            torch.cuda.synchronize()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
