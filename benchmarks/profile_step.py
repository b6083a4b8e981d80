"""Where a training step's time goes: a torch.profiler table of the step as configured.

Builds a one-process :class:`sven.Trainer` on a store (``train.device=cuda`` unless an
override says otherwise), runs ``--warmup`` training batches, times ``--steps`` more and
profiles as many, and prints the kernels by device time per step, a census by kind and
the first graph's warm-up and capture seconds. With ``train.cuda_graph=on`` the
captured graph's kernels show; with ``train.device=cpu`` the CPU operators. Numbers,
not a test.

Usage:
    python benchmarks/profile_step.py --data STORE --out OUT [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import sven


def one_process(
    data: str, run: str, overrides: list[str], batches: int
) -> tuple[Any, Callable[[int], None], Callable[[], None]]:
    """A one-process trainer on the store ``data`` (run folder ``run``) with its step
    ready for ``batches`` training batches: capacities planned, prefetch ring filled.

    Returns:
        (trainer, train(i) queueing training batch i, sync waiting for the device).
    """
    tr = sven.Trainer(
        None,
        [f"data.path={data}", f"out={run}", "quiet=true", "train.device=cuda", *overrides],
    )
    st = tr.step
    lo, _ = tr.ranges["train"]
    b = tr.cfg.train.batch_size
    t0 = time.perf_counter()
    # As the run's first epoch: the capacities and the training node slots of every
    # epoch it trains (``train.epochs``), from their replay.
    st.plan_capacities(0)
    # train.device=cpu (a later override) checks a script without a GPU.
    sync = torch.cuda.synchronize if tr.device.type == "cuda" else (lambda: None)
    sync()
    st.plan_s = time.perf_counter() - t0  # type: ignore[attr-defined]
    st.start_epoch(0, 0, batches)

    def train(i: int) -> None:
        st.train_batch(0, i, lo + i * b, lo + (i + 1) * b)

    return tr, train, sync


def steady(
    train: Callable[[int], None], sync: Callable[[], None], warmup: int, steps: int
) -> tuple[float, Any]:
    """Runs ``warmup`` batches, times ``steps`` more and profiles as many again.

    Returns:
        (wall seconds per step, the profile of the last ``steps``).
    """
    for i in range(warmup):
        train(i)
    sync()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        train(i)
    sync()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(warmup + steps, warmup + 2 * steps):
            train(i)
        sync()
    return wall, prof


def cuda_kernels(prof: Any) -> list[Any]:
    """The profile's GPU kernels (``key_averages`` rows on the device)."""
    return [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True, help="folder for the table and JSON")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tag", default="step")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="also write the profiled steps' timeline (trace_TAG.json.gz, Chrome's format; "
        "benchmarks/trace_streams.py reads it)",
    )
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as run:
        n = args.warmup + 2 * args.steps
        tr, train, sync = one_process(args.data, run, args.overrides, n)
        st, b = tr.step, tr.cfg.train.batch_size
        wall, prof = steady(train, sync, args.warmup, args.steps)
    kernels = cuda_kernels(prof)
    total = sum(e.self_device_time_total for e in kernels) / args.steps
    launches = sum(e.count for e in kernels) / args.steps
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
    record = {
        "tag": args.tag,
        "overrides": args.overrides,
        "captured": st.train_graph.captured,
        # The first graph's warm-up (compilation, when the model compiles) and capture.
        "warmup_s": st.train_graph.warmup_s,
        "capture_s": st.train_graph.capture_s,
        # The replay that plans the training slots (every epoch of train.epochs).
        "plan_s": st.plan_s,
        "train_slots": st.source.slots.get("train"),
        # Rows the host tier keeps copies of in GPU memory (state.hot_rows).
        "hot_rows": tr.memory.hot_rows,
        "wall_ms_per_step": wall * 1e3,
        "events_per_s": b / wall,
        "gpu_ms_per_step": total / 1e3,
        "kernels_per_step": launches,
        "census": census(kernels, args.steps),
        "top": [
            {
                "name": e.key[:120],
                "us_per_step": e.self_device_time_total / args.steps,
                "calls_per_step": e.count / args.steps,
            }
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)
        ],
    }
    (out / f"profile_{args.tag}.json").write_text(json.dumps(record, indent=2))
    (out / f"profile_{args.tag}.txt").write_text(table)
    if args.trace:
        prof.export_chrome_trace(str(out / f"trace_{args.tag}.json.gz"))
    print(json.dumps({k: v for k, v in record.items() if k != "top"}))
    print(f"kernels per step: {launches:.0f}")
    for t in record["top"][:25]:
        print(f"{t['us_per_step']:9.1f} us {t['calls_per_step']:6.1f}x  {t['name']}")
    for cat, (n, us) in record["census"].items():
        print(f"{cat:12s} {n:6.1f} kernels {us:8.1f} us per step")


# Kernel name fragments -> category, first match wins (cuBLAS/CUTLASS GEMMs, CUB sorts,
# Triton's own kernels, NCCL, then torch's element-wise, reduction and indexing kernels).
_CATEGORIES = (
    ("gemm", ("gemm", "sm90_", "cutlass", "gemv", "splitk")),
    ("sort", ("radixsort", "radix_sort", "sort", "segmented")),
    ("triton", ("triton_",)),
    ("nccl", ("nccl",)),
    ("scan", ("scan",)),
    ("reduce", ("reduce",)),
    ("index", ("index", "scatter", "gather", "embedding", "take")),
    ("copy/fill", ("memcpy", "memset", "fill", "copy", "cat")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def census(kernels: list, steps: int) -> dict[str, tuple[float, float]]:
    """Kernels per step and device us per step by category (name fragments)."""
    out: dict[str, list[float]] = {}
    for e in kernels:
        name = e.key.lower()
        cat = next((c for c, keys in _CATEGORIES if any(k in name for k in keys)), "other")
        acc = out.setdefault(cat, [0.0, 0.0])
        acc[0] += e.count / steps
        acc[1] += e.self_device_time_total / steps
    return {
        k: (round(v[0], 1), round(v[1], 1)) for k, v in sorted(out.items(), key=lambda x: -x[1][1])
    }


if __name__ == "__main__":
    main()
