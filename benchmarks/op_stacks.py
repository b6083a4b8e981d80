"""Which calls launch a step's kernels: the eager training step (no captured graph)
under torch.profiler with Python stacks, its operators grouped by where they were
called and sorted by the device time they launched.

A captured step's profile names its kernels but not the code that queued them; this
names the code. Run it on two settings (the node state's tiers, say) and compare the
lines. Numbers, not a test.

Usage:
    python benchmarks/op_stacks.py --data STORE --out OUT.txt [key=value ...]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from profile_step import one_process


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True, type=Path, help="the table, a text file")
    ap.add_argument("--warmup", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--depth", type=int, default=6, help="stack frames kept per operator")
    ap.add_argument("--rows", type=int, default=60)
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()
    over = ["train.cuda_graph=off", *args.overrides]
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as run:
        _, train, sync = one_process(args.data, run, over, args.warmup + args.steps + 100)
        for i in range(args.warmup):
            train(i)
        sync()
        # Stacks reach key_averages only with the verbose experimental config.
        verbose = torch._C._profiler._ExperimentalConfig(verbose=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts, with_stack=True, experimental_config=verbose) as prof:
            for i in range(args.warmup, args.warmup + args.steps):
                train(i)
            sync()
    rows = []
    for e in prof.key_averages(group_by_stack_n=args.depth):
        if not e.key.startswith("aten::"):
            continue
        us = (e.device_time_total if cuda else e.self_cpu_time_total) / args.steps
        where = " <- ".join(f.split("/")[-1] for f in e.stack[: args.depth])
        where = re.sub(r" at 0x[0-9a-f]+", "", where)
        rows.append((us, e.count / args.steps, e.key, where))
    rows.sort(key=lambda r: -r[0])
    unit = "device" if cuda else "CPU"
    lines = [f"# {unit} us per step, calls per step, operator, where (innermost first)"]
    lines += [f"{us:9.1f} {n:5.1f}x {k:28s} {w}" for us, n, k, w in rows[: args.rows]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
