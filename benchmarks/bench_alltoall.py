"""Link parameters of a process group: latency and bandwidth of ``all_to_all_single``.

Run under torchrun; rank 0 prints one JSON line (and writes it to ``--out``)::

    torchrun --nproc-per-node 2 benchmarks/bench_alltoall.py --backend gloo --out ping.json

Latency is the median time of an all_to_all with one int64 per peer; bandwidth is
fitted from the median times at several payloads (least squares ``t = lat + bytes / bw``
over the bytes one rank sends). These are the ``Link`` parameters of the scaling
model (``sven.partition.scaling``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist


def _median_seconds(send: torch.Tensor, recv: torch.Tensor, repeats: int) -> float:
    """Median wall time of one all_to_all_single, every rank synchronised first."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        if send.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    # The slowest rank's time is the collective's; reduce the medians with MAX.
    med = torch.tensor([float(np.median(times))], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def main() -> int:
    """Measures and prints the link parameters."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="gloo", help="gloo or nccl")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument(
        "--kib",
        type=int,
        nargs="+",
        default=[16, 64, 256, 1024],
        help="payload per peer, KiB",
    )
    ap.add_argument("--out", help="JSON file to write (rank 0)")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cpu"
    if args.backend == "nccl":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    one = torch.zeros(world, dtype=torch.int64, device=device)
    latency = _median_seconds(one, torch.empty_like(one), args.repeats)
    sizes, times = [], []
    for kib in args.kib:
        n = kib * 1024 * world
        send = torch.zeros(n, dtype=torch.uint8, device=device)
        times.append(_median_seconds(send, torch.empty_like(send), args.repeats))
        # Bytes that leave this rank: every peer's share but its own.
        sizes.append(kib * 1024 * (world - 1))
    slope, _ = np.polyfit(np.asarray(sizes, dtype=np.float64), np.asarray(times), 1)
    res = {
        "backend": args.backend,
        "world_size": world,
        "latency_us": latency * 1e6,
        "bandwidth_gbs": (1.0 / slope) / 1e9 if slope > 0 else float("inf"),
        "payload_bytes_per_rank": sizes,
        "median_s": times,
    }
    if rank == 0:
        print(json.dumps(res))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
