"""The segment sum of the batch's row gathers (``sven.kernels.triton_gather``) at a
Wikipedia training batch's shape, for several tile choices, against the embedding
backward it replaces.

The id list is synthetic, shaped like Wikipedia's at batch 200: S = 6,600 ids (600
roots, 6,000 neighbour slots), ``--masked`` of the neighbour slots the padding id (its
run the last of the sorted order), the rest drawn from ``--distinct`` ids by a Zipf law
(by default about 500 distinct ids, the longest run about 480 entries). Two calls as in
the step: the roots' (lo = 0, D = 100) and the neighbours' (lo = 600, D = 200). For
each choice of (CH, BC, W, num_warps) prints microseconds per pair of calls (CUDA events over
``--iters`` launches after a warm-up), the largest difference from a float64
``index_add`` and whether two calls are equal to the bit; then the same pair through
``torch.ops.aten.embedding_dense_backward`` (what the gather's backward ran before).
``--module FILE`` times another version of the module (say an earlier commit's,
``git show REV:sven/kernels/triton_gather.py > FILE``) at its own tiles instead.

Usage::

    python benchmarks/bench_segment_sum.py                       # on the GPU
    python benchmarks/bench_segment_sum.py --module OLD_GATHER.py   # git show output
    TRITON_INTERPRET=1 python benchmarks/bench_segment_sum.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable

import torch

from sven.kernels import triton_gather
from sven.pipeline.dedupe import dedupe_sorted

CHOICES = [(32, 32, 256, 4), (32, 64, 128, 4), (32, 32, 128, 4), (16, 32, 256, 4), (32, 32, 512, 8)]


def id_list(args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    """(S,) ids: roots then neighbour slots, a Zipf law over ``--distinct`` ids."""
    rank = torch.arange(1, args.distinct + 1, dtype=torch.float64)
    weight = rank**-args.zipf
    s = args.roots + args.nbrs
    ids = torch.multinomial(weight, s, replacement=True, generator=gen)
    masked = torch.rand(args.nbrs, generator=gen) < args.masked
    ids[args.roots :][masked] = args.pad
    return ids


def timed(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Microseconds per call of ``fn``."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--roots", type=int, default=600)
    p.add_argument("--nbrs", type=int, default=6000)
    p.add_argument("--distinct", type=int, default=600)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--masked", type=float, default=0.5)
    p.add_argument("--pad", type=int, default=9227)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="a tenth of the ids, 2 iterations")
    p.add_argument("--module", help="a file with another segment_sum, timed at its tiles")
    args = p.parse_args()
    if args.quick:
        args.roots, args.nbrs, args.iters = 60, 600, 2
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    ids = id_list(args, gen).to(device)
    s = ids.shape[0]
    nodes, inverse, perm, sorted_ids = dedupe_sorted(ids, args.pad)
    counts = torch.unique(ids[ids != args.pad], return_counts=True)[1]
    print(f"ids {s}, distinct {counts.numel()}, longest run {int(counts.max())}, "
          f"padding {int((ids == args.pad).sum())}")  # fmt: skip
    calls = []
    for lo, n, d in ((0, args.roots, 100), (args.roots, args.nbrs, 200)):
        g = torch.randn(n, d, generator=gen).to(device)
        want = torch.zeros(s, d, dtype=torch.float64, device=device)
        want.index_add_(0, inverse[lo : lo + n], g.double())
        want[nodes == args.pad] = 0.0
        calls.append((g, lo, want))

    module, choices = triton_gather, CHOICES
    if args.module:
        spec = importlib.util.spec_from_file_location("other_gather", args.module)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        choices = [(module._CH, module._BC, getattr(module, "_WALK", 0), 4)]

    def pair() -> list[torch.Tensor]:
        return [
            module.segment_sum(g, perm, inverse, sorted_ids, args.pad, lo, s) for g, lo, _ in calls
        ]

    for ch, bc, w, warps in choices:
        if not args.module:
            module._CH, module._BC, module._WALK, module._WARPS = ch, bc, w, warps
        got, again = pair(), pair()
        err = max(float((a.double() - c[2]).abs().max()) for a, c in zip(got, calls))
        same = all(torch.equal(a, b) for a, b in zip(got, again))
        us = timed(pair, args.iters, device)
        print(f"CH {ch:3d} BC {bc:3d} W {w:4d} warps {warps}: {us:8.1f} us per pair, "
              f"max |diff| {err:.2e}, repeatable {same}")  # fmt: skip

    def embedding_pair() -> None:
        for g, lo, _ in calls:
            idx = inverse[lo : lo + g.shape[0]]
            torch.ops.aten.embedding_dense_backward(g, idx, s, -1, False)

    print(f"embedding backward: {timed(embedding_pair, args.iters, device):8.1f} us per pair")


if __name__ == "__main__":
    main()
