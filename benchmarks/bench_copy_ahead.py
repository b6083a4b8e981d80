"""The copy-engine read-ahead's job on its own: how long a host thread takes to gather a
batch's node-state rows and copy them over (:mod:`sven.models.copyahead`).

Builds the host tier's node state (:class:`sven.models.memory.MemoryState`, pinned on
CUDA) of ``--nodes`` nodes at TGN's widths (``--memory-dim``, mail of twice that: a
row of 1,217 bytes at 100), then per repetition requests ``--rows`` random distinct
rows under one key, launches the job and waits for it: the request-to-rows time a step
of the prefetch ring has to hide (a step of batch 600 on 10^7 nodes took 0.53 ms on
an H100's GPU tier, docs/performance.md). Also the host gather alone
(``torch.index_select`` into the staging buffers), per intra-op thread count. Median
of ``--reps``; one JSON line per case, all of them in ``--out``.

    python3 benchmarks/bench_copy_ahead.py --nodes 1e7 --rows 1944 3403 5184 --out OUT/copy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sven.models.memory import MemoryState
from sven.models.storage import Storage


def _median_ms(fn, reps: int) -> float:
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _job_ms(st: MemoryState, picks: list[torch.Tensor], key: str) -> float:
    """Median request-to-rows time of the copier's job (its first run makes the
    buffers and is not timed)."""
    copier, dev = st.copier, st.device
    assert copier is not None

    on_dev = [p.to(dev) for p in picks]

    def job(i: int) -> None:
        st.read_ahead(on_dev[i], key)
        copier.launch(key)
        copier.wait(key)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    job(0)
    return _median_ms(job, len(picks))


def _gather_ms(tables: tuple[torch.Tensor, ...], picks: list[torch.Tensor]) -> float:
    """Median time of the host gather alone, into pinned buffers like the job's."""
    pin = torch.cuda.is_available()
    u = picks[0].shape[0]
    outs = [torch.empty((u, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in tables]

    def gather(i: int) -> None:
        for t, o in zip(tables, outs):
            torch.index_select(t, 0, picks[i], out=o)

    return _median_ms(gather, len(picks))


def _copy_ms(tables: tuple[torch.Tensor, ...], u: int, dev: torch.device, reps: int) -> float:
    """Median time of the job's copy alone: one pinned (U, ...) buffer per table to the
    device, on a side stream, waited for."""
    pin = dev.type == "cuda"
    src = [torch.zeros((u, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in tables]
    dst = [torch.empty_like(t, device=dev) for t in src]
    stream = torch.cuda.Stream(dev) if pin else None

    def copy(i: int) -> None:
        if stream is None:
            for d, s in zip(dst, src):
                d.copy_(s)
            return
        with torch.cuda.stream(stream):
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
        stream.synchronize()

    copy(0)
    return _median_ms(copy, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=float, default=1e6)
    ap.add_argument("--rows", type=int, nargs="+", default=[1944, 3403])
    ap.add_argument("--memory-dim", type=int, default=100)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev, n = torch.device(args.device), int(args.nodes)
    t0 = time.perf_counter()
    d = args.memory_dim
    st = MemoryState(n, d, 2 * d, device=dev, storage=Storage("host", dev))
    made_s = time.perf_counter() - t0
    st.track_writes(copy=True)
    copier = st.copier
    assert copier is not None
    row_bytes = sum(t[0].numel() * t.element_size() for t in copier.tables)
    g = torch.Generator().manual_seed(0)
    results = []
    for u in args.rows:
        # Fresh rows each repetition, as a later batch reads other nodes.
        picks = [torch.randperm(n, generator=g)[:u] for _ in range(args.reps)]
        for threads in args.threads:
            torch.set_num_threads(threads)
            copier.threads = threads
            job_ms = _job_ms(st, picks, f"bench{u}")
            gather_ms = _gather_ms(copier.tables, picks)
            copy_ms = _copy_ms(copier.tables, u, dev, args.reps)
            rec = {
                "device": str(dev),
                "nodes": n,
                "rows": u,
                "row_bytes": row_bytes,
                "threads": threads,
                "job_ms": round(job_ms, 4),
                "host_gather_ms": round(gather_ms, 4),
                "host_gather_GB_per_s": round(u * row_bytes / gather_ms / 1e6, 2),
                "copy_ms": round(copy_ms, 4),
                "state_made_s": round(made_s, 2),
            }
            results.append(rec)
            print(json.dumps(rec), flush=True)
    st.close()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
