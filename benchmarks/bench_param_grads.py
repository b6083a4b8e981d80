"""The linear layers' parameter gradients at the TGN step's sites: cuBLAS against one
Triton launch (``sven.kernels.sums.param_grads``, ``param_grads=triton``).

Each site is one backward's layers, ``(K, M, N, bias)``: the input x (K, M) and the
output's gradient g (K, N) (N = 0: a 1-D g, the scorer's output layer). The reference is
today's ``g^T x`` GEMM and column sum per layer; ``triton`` is one launch for the
site. Both are timed captured in a CUDA graph and replayed (as the captured step runs
them), in microseconds per site, with TF32 products on (``train.matmul_precision=high``,
the default). The kernels each form launches are counted by the profiler.

Defaults: Wikipedia at batch 200 (600 roots, 6,000 neighbour slots, memory, embedding
and time 100, edge features 172, TGN's mail 372 plus the time encoding), U the unique
nodes of a batch.

Usage::

    python benchmarks/bench_param_grads.py [--unique 3000] [--out OUT.json]   # on a GPU
    python benchmarks/bench_param_grads.py --sweep   # also each tile, K step, warps, stages
    TRITON_INTERPRET=1 python benchmarks/bench_param_grads.py --device cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
from bench_kernels import time_eager, time_graph


def sites(unique: int) -> dict[str, list[tuple[int, int, int, bool]]]:
    """Site name -> its layers (K, M, N, bias)."""
    roots, slots = 600, 6000
    return {
        "w_q / w_out (Projection)": [(roots, 200, 100, True)],
        "w_kv_node (Projection)": [(unique, 100, 200, True)],
        "edge projection (no bias)": [(slots, 172, 200, False)],
        "time projection (no bias)": [(slots, 100, 200, False)],
        "memory updater (GRU)": [(unique, 472, 300, True), (unique, 100, 300, True)],
        "link scorer": [(200, 100, 100, True), (400, 100, 100, False), (400, 100, 0, True)],
    }


def _sweep(call, iters: int) -> dict:
    """The Triton form's time (us) under each fixed configuration, and the fastest."""
    from sven.kernels import triton_grads as tg

    saved = (tg._TILES, tg._BLOCK_K, tg._NUM_WARPS, tg._NUM_STAGES)
    times = {}
    try:
        for tile in saved[0]:
            for bk, warps, stages in itertools.product((32, 64), (2, 4), (3, 4)):
                tg._TILES, tg._BLOCK_K, tg._NUM_WARPS, tg._NUM_STAGES = (tile,), bk, warps, stages
                key = f"{tile[0]}x{tile[1]} k{bk} w{warps} s{stages}"
                times[key] = round(time_graph(call, iters, 3) * 1e6, 2)
    finally:
        tg._TILES, tg._BLOCK_K, tg._NUM_WARPS, tg._NUM_STAGES = saved
    best = min(times, key=times.__getitem__)
    return {"sweep_us": times, "best": best, "best_us": times[best]}


def _kernels(fn, device: torch.device) -> int:
    """CUDA kernels one call of fn launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--unique", type=int, default=3000, help="unique nodes of a batch")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", type=Path, default=None, help="a JSON file of the rows")
    p.add_argument("--sweep", action="store_true", help="time every kernel configuration")
    args = p.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    from sven import kernels
    from sven.kernels.sums import param_grads

    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, layers in sites(args.unique if on_gpu else 70).items():
        problems = []
        for k, m, n, bias in layers:
            rows_k = k if on_gpu else min(k, 70)  # the interpreter: a smoke run
            x = torch.randn(rows_k, m, generator=gen).to(device)
            g = torch.randn(rows_k, *([n] if n else []), generator=gen).to(device)
            problems.append((x, g, True, bias))
        row = {"site": name, "layers": layers}
        for backend in ("reference", "triton"):
            os.environ["SVEN_KERNELS"] = f"auto,param_grads={backend}"
            kernels.reset_backend()

            def call(problems: list = problems) -> None:
                param_grads(*problems)

            if on_gpu:
                row[f"{backend}_us"] = time_graph(call, args.iters, 3) * 1e6
                row[f"{backend}_kernels"] = _kernels(call, device)
                if args.sweep and backend == "triton":
                    row.update(_sweep(call, args.iters))
            else:
                row[f"{backend}_us"] = time_eager(call, 1, 1, device) * 1e6
        rows.append(row)
        print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
