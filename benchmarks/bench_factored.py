"""Where the factored evaluation attention's time goes, at the MRR batch's shape: numbers,
not a test.

``sven.kernels.triton_factored.temporal_attention_factored`` is the costliest kernel of
an evaluation batch with 100 MRR negatives (20,600 roots at batch 200, ten neighbour
slots each, Wikipedia's 172 edge features read from the event table). This script
builds inputs of that shape on the GPU and times the kernel alone (its GPU time from
torch's profiler, median of ``--repeats`` calls) for each case of a set that leaves one
part out or changes one size at a time, so that differences place the time without
hardware counters: no edge features, a narrow time encoding, one neighbour slot, a
tenth of the roots, and each launch setting (``SVEN_FACTORED_WARPS`` and
``SVEN_FACTORED_CHUNK``; ``SVEN_FACTORED_KERNEL`` picks the kernel). Beside each time: the bytes
the kernel must move at least (its inputs read once, its outputs written once) and the
rate that makes.

``--once`` runs one case (``--case NAME``, default the first) once after a warm-up
call, for a profiler that attaches to one launch (Nsight Compute: ``ncu
--clock-control none --kernel-name regex:_factored_ --launch-skip 1 --launch-count
1 python3 benchmarks/bench_factored.py --once``).

Usage:
    python3 benchmarks/bench_factored.py --out OUT          # OUT/bench_factored.json
    TRITON_INTERPRET=1 python3 benchmarks/bench_factored.py --device cpu --quick  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch


@dataclass(frozen=True)
class Case:
    """One shape and launch of the factored kernel."""

    name: str
    roots: int = 20_600
    slots: int = 10
    heads: int = 2
    head_dim: int = 50
    time_dim: int = 100
    edge_dim: int = 172
    events: int = 157_474
    nodes: int = 9_228
    #: None: the kernel's own count (``triton_factored.FACTORED_WARPS``).
    warps: int | None = None
    chunk: int = 64
    #: Queries one row per node, read by each root's node (the wide evaluation's form).
    per_node: bool = False


def cases(quick: bool) -> list[Case]:
    """The default case, then one change each."""
    base = Case("default")
    if quick:
        base = replace(base, roots=40, events=500, nodes=60)
    out = [
        base,
        replace(base, name="no edges", edge_dim=0),
        replace(base, name="time 16", time_dim=16),
        replace(base, name="one slot", slots=1),
        replace(base, name="tenth of roots", roots=max(1, base.roots // 10)),
    ]
    for warps, chunk in ((2, 64), (4, 64), (8, 64), (16, 64), (8, 256), (8, 32)):
        out.append(replace(base, name=f"warps {warps} chunk {chunk}", warps=warps, chunk=chunk))
    # The store the MRR figures use has no edge features: that kernel, its queries one
    # row per node as the wide evaluation passes them, and its warp counts.
    bare = replace(base, edge_dim=0)
    out.append(replace(bare, name="no edges, per-node queries", per_node=True))
    for warps in (2, 4, 8, 16):
        out.append(replace(bare, name=f"no edges, per-node, {warps} warps", per_node=True,
                           warps=warps))  # fmt: skip
    return out


def inputs(c: Case, device: torch.device, seed: int = 0) -> tuple:
    """The wrapper's arguments at case ``c``: edge features as rows of an event table,
    read in place, as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    o = c.heads * c.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    q = rand(c.nodes if c.per_node else c.roots, c.heads, c.head_dim)
    q_rows = torch.randint(0, c.nodes, (c.roots,), generator=gen).to(device)
    kv_node = rand(c.nodes, 2 * o)
    nbr = torch.randint(0, c.nodes, (c.roots, c.slots), generator=gen).to(device)
    # Gaps of the real data's size: most time-encoding arguments are large.
    dt = (torch.rand(c.roots, c.slots, generator=gen) * 1e6).to(device)
    mask = torch.rand(c.roots, c.slots, generator=gen).to(device) < 0.9
    tw = (1.0 / 10 ** torch.linspace(0, 9, c.time_dim)).to(device)
    tb = torch.zeros(c.time_dim, device=device)
    wt = rand(2 * o, c.time_dim) / c.time_dim**0.5
    qr = q_rows if c.per_node else None
    if c.edge_dim == 0:
        return q, kv_node, nbr, dt, mask, tw, tb, wt, None, None, None, qr
    table = rand(c.events, c.edge_dim)
    rows = torch.randint(0, c.events, (c.roots, c.slots), generator=gen).to(device)
    we = rand(2 * o, c.edge_dim) / c.edge_dim**0.5
    return q, kv_node, nbr, dt, mask, tw, tb, wt, table, we, rows, qr


def least_bytes(c: Case) -> int:
    """What the kernel reads and writes at least, in bytes (float32, int64 indices, one
    byte a mask flag): per root its query and the queries' products (per node where
    roots share them), per slot its index, gap, flag, node key and value rows and edge
    row (and that row's index), and per root the output and the weighted sums."""
    o = c.heads * c.head_dim
    query = 4 * (o + c.heads * (c.time_dim + c.edge_dim))  # q, qt, qe
    per_slot = 8 + 4 + 1 + 4 * 2 * o + (4 * c.edge_dim + 8 if c.edge_dim else 0)
    out = 4 * (o + c.heads * (c.time_dim + c.edge_dim))  # o, ft, fe
    # Per-node queries: one row per node, and each root's index of it.
    queries = c.nodes * query + 8 * c.roots if c.per_node else c.roots * query
    return queries + c.roots * (c.slots * per_slot + out)


def kernel_us(c: Case, device: torch.device, repeats: int) -> float:
    """The factored kernel's GPU microseconds per call (median), or on CPU the whole
    call's wall time."""
    from torch.profiler import ProfilerActivity, profile

    from sven.kernels import triton_factored

    if c.warps is None:
        os.environ.pop("SVEN_FACTORED_WARPS", None)
    else:
        os.environ["SVEN_FACTORED_WARPS"] = str(c.warps)
    os.environ["SVEN_FACTORED_CHUNK"] = str(c.chunk)
    args = inputs(c, device)
    q, kvn, nbr, dt, mask, tw, tb, wt, table, we, rows, qr = args

    def call() -> torch.Tensor:
        return triton_factored.temporal_attention_factored(
            q, kvn, nbr, dt, mask, tw, tb, wt, table, we, edge_rows=rows, q_rows=qr
        )

    with torch.no_grad():
        call()  # compile
        if device.type != "cuda":
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                call()
                times.append((time.perf_counter() - t) * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                call()
            torch.cuda.synchronize()
    times = [
        e.device_time
        for e in prof.events()
        if e.name.startswith("_factored_") and e.device_time > 0
    ]
    return statistics.median(times) if times else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for bench_factored.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--once", action="store_true", help="one case, twice, untimed")
    ap.add_argument("--case", default=None, help="the one case to run (its name)")
    ap.add_argument(
        "--matmul-precision",
        default="high",
        help="as train.matmul_precision (high: TF32 products, the default)",
    )
    args = ap.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)
    device = torch.device(args.device)
    named = {c.name: c for c in cases(args.quick)}
    if args.case is not None and args.case not in named:
        raise SystemExit(f"--case: no case {args.case!r}; cases: {', '.join(named)}")
    from sven.kernels import triton_factored

    if args.once:
        case = named[args.case] if args.case else cases(args.quick)[0]
        q, kvn, nbr, dt, mask, tw, tb, wt, table, we, rows, qr = inputs(case, device)
        with torch.no_grad():
            for _ in range(2):
                triton_factored.temporal_attention_factored(
                    q, kvn, nbr, dt, mask, tw, tb, wt, table, we, edge_rows=rows, q_rows=qr
                )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return
    rows = []
    for c in [named[args.case]] if args.case else cases(args.quick):
        us = kernel_us(c, device, args.repeats)
        gb = least_bytes(c) / 1e9
        rows.append({**asdict(c), "us": round(us, 2), "least_gb": round(gb, 4),
                     "gb_per_s": round(gb / (us * 1e-6), 1) if us == us else None})  # fmt: skip
        print(f"{c.name:22s} {us:10.1f} us  {gb * 1e3:8.1f} MB at least  "
              f"{rows[-1]['gb_per_s']} GB/s", flush=True)  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        kernel = os.environ.get("SVEN_FACTORED_KERNEL", triton_factored.FACTORED_KERNEL)
        (out / "bench_factored.json").write_text(
            json.dumps({"device": name, "kernel": kernel, "cases": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
