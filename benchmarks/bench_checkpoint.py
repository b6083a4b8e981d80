"""Checkpoint of a node state: how long training stalls, how long until it is on disk.

A node state of ``--nodes`` rows with the TGN preset's widths (configs/tgn.yaml: memory
100; mail 2 x 100 + edge features; one mail slot) is saved with Sven's checkpointer
(:class:`sven.engine.checkpoint.Checkpointer`, in the background) and, for comparison,
with one ``torch.save`` of the same dict. Prints one JSON line (and appends it to
``--out``)::

    python benchmarks/bench_checkpoint.py --nodes 1000000 --device cpu
    python benchmarks/bench_checkpoint.py --nodes 10000000 --device cuda --dir /scratch/x

Figures: ``stall_s`` (``save()`` returning: what training waits for), ``committed_s``
(from the save to the checkpoint renamed into place, fsynced), ``bytes_on_disk``,
``verify_s`` (every digest checked, in parallel), ``load_s`` (the rows read back into a
state on the same device), ``peak_rss_growth_mb`` (the process's peak resident memory
during the save and commit, above its peak before: a full host copy would show the
state's size) and ``torch_save_s`` (``torch.save`` of the dict, fsynced).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from sven.engine.checkpoint import (
    Checkpointer,
    load_node_state,
    room_on_device,
    verify_folder,
)


def node_state(n: int, device: str, pinned: bool, edge_dim: int) -> dict[str, torch.Tensor]:
    """A random node state of ``n`` rows, TGN's widths (one mail slot)."""
    g = torch.Generator().manual_seed(0)
    d, mail = 100, 2 * 100 + edge_dim
    host = {
        "memory": torch.randn(n, d, generator=g),
        "last_update": torch.rand(n, generator=g, dtype=torch.float64),
        "mail": torch.randn(n, 1, mail, generator=g),
        "mail_ts": torch.rand(n, 1, generator=g, dtype=torch.float64),
        "mail_valid": torch.rand(n, 1, generator=g) > 0.5,
    }
    if device == "cuda":
        return {k: v.cuda() for k, v in host.items()}
    if pinned:
        return {k: v.pin_memory() for k, v in host.items()}
    return host


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sync(state: dict[str, torch.Tensor]) -> None:
    if any(t.is_cuda for t in state.values()):
        torch.cuda.synchronize()


def main() -> int:
    """Runs the benchmark; prints its JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--pinned", action="store_true", help="a pinned host state (cpu)")
    ap.add_argument("--edge-dim", type=int, default=0, help="edge features in a mail")
    ap.add_argument("--threads", type=int, default=0, help="writer threads (0: auto)")
    ap.add_argument("--repeats", type=int, default=2, help="checkpoints saved in a row")
    ap.add_argument("--dir", help="where to write (default: a temporary folder)")
    ap.add_argument("--no-torch-save", action="store_true", help="skip the comparison")
    ap.add_argument("--out", help="JSON-lines file to append the result to")
    args = ap.parse_args()

    state = node_state(args.nodes, args.device, args.pinned, args.edge_dim)
    _sync(state)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    base = Path(tempfile.mkdtemp(prefix="sven-bench-ckpt-", dir=args.dir))
    try:
        ck = Checkpointer(base / "ck", keep_latest_k=1, asynchronous=True, threads=args.threads)
        snapshot = room_on_device(state)
        stalls, commits = [], []
        rss0 = _peak_rss_mb()
        for step in range(args.repeats):
            # Each save starts with no dirty pages left by the one before (the kernel's
            # writeback of those would slow this one down, and not torch.save's).
            os.sync()
            t0 = time.perf_counter()
            ck.save(step, {"step": step}, node_state=state, device_snapshot=snapshot)
            stalls.append(time.perf_counter() - t0)
            ck.wait()
            commits.append(time.perf_counter() - t0)
        rss_growth = _peak_rss_mb() - rss0
        folder = ck.path(args.repeats - 1)
        on_disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        t0 = time.perf_counter()
        assert verify_folder(folder, args.threads)
        verify_s = time.perf_counter() - t0
        dest = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        load_node_state(folder, dest, torch.arange(args.nodes))
        _sync(dest)
        load_s = time.perf_counter() - t0
        assert all(torch.equal(dest[k], state[k]) for k in state)
        del dest
        res = {
            "bench": "checkpoint",
            "nodes": args.nodes,
            "device": args.device,
            "pinned": args.pinned,
            "threads": ck.pool.threads,
            "device_snapshot": snapshot,
            "node_state_bytes": nbytes,
            "stall_s": stalls,
            "committed_s": commits,
            "bytes_on_disk": on_disk,
            "verify_s": verify_s,
            "load_s": load_s,
            "peak_rss_growth_mb": round(rss_growth, 1),
        }
        ck.pool.close()
        if not args.no_torch_save:
            path = base / "torch.pt"
            os.sync()
            t0 = time.perf_counter()
            torch.save(state, path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            res["torch_save_s"] = time.perf_counter() - t0
            res["torch_save_bytes"] = path.stat().st_size
    finally:
        shutil.rmtree(base, ignore_errors=True)
    line = json.dumps(res)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
