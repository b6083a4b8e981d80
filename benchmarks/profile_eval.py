"""Where an evaluation pass's time goes, beside a training step's: numbers, not a test.

Builds a one-process :class:`sven.Trainer` on a store, trains ``--train-batches``
batches, then for each split times, with the device waited for: the split's negatives
(drawn once per run), the first pass (its graphs' warm-up and capture included), the
metrics, a second pass (warm graphs) and a profiled third (kernels and GPU time per
batch); the training step is timed and profiled (``--profile-batches`` steps) first.

Usage:
    python benchmarks/profile_eval.py --data STORE --out OUT [key=value ...]
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


def _kernels(prof: Any, n: int) -> dict[str, float]:
    """Kernels and GPU us per call from a profile of ``n`` calls."""
    ks = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "kernels": sum(e.count for e in ks) / n,
        "gpu_us": sum(e.self_device_time_total for e in ks) / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True, help="folder for profile_eval_<tag>.json")
    ap.add_argument("--tag", default="eval")
    ap.add_argument("--train-batches", type=int, default=50)
    ap.add_argument("--profile-batches", type=int, default=20, help="profiled train steps")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {"tag": args.tag, "overrides": args.overrides}
    with tempfile.TemporaryDirectory() as run:
        tr = sven.Trainer(
            None,
            [
                f"data.path={args.data}",
                f"out={run}",
                "quiet=true",
                "train.device=cuda",
                *args.overrides,
            ],
        )
        st = tr.step
        cuda = tr.device.type == "cuda"
        sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        lo, _ = tr.ranges["train"]
        b = tr.cfg.train.batch_size
        n = args.train_batches + args.profile_batches
        st.plan_capacities(0)
        st.start_epoch(0, 0, n)

        def train(i: int) -> None:
            st.train_batch(0, i, lo + i * b, lo + (i + 1) * b)

        for i in range(args.train_batches):
            train(i)
        sync()
        t0 = time.perf_counter()
        for i in range(args.train_batches // 2, args.train_batches):
            train(i)
        sync()
        per = (time.perf_counter() - t0) / (args.train_batches - args.train_batches // 2)
        rec["train_ms_per_batch"] = per * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(args.train_batches, n):
                train(i)
            sync()
        rec["train_step"] = _kernels(prof, args.profile_batches)
        st.take_loss()

        def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
            sync()
            t = time.perf_counter()
            value = fn()
            sync()
            return value, time.perf_counter() - t

        for split in ("val", "test"):
            s_lo, s_hi = tr.ranges[split]
            events, batches = s_hi - s_lo, -(-(s_hi - s_lo) // b)
            r: dict[str, Any] = {"events": events, "batches": batches}
            _, r["negatives_s"] = timed(lambda split=split: st._negatives(split))
            res, r["pass1_s"] = timed(lambda split=split: st.evaluate(split))
            _, r["metrics_s"] = timed(lambda split=split, res=res: tr.split_metrics(split, res))
            _, r["pass2_s"] = timed(lambda split=split: st.evaluate(split))
            graphs = st.eval_graph(split)[2]
            r["warmup_s"] = sum(g.warmup_s for g in graphs)
            r["capture_s"] = sum(g.capture_s for g in graphs)
            r["ms_per_batch_warm"] = r["pass2_s"] / batches * 1e3
            r["events_per_s_warm"] = events / r["pass2_s"]
            r["events_per_s_first"] = events / (r["negatives_s"] + r["pass1_s"] + r["metrics_s"])
            # Kernels of a warm evaluation pass, per batch.
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                st.evaluate(split)
                sync()
            r["step"] = _kernels(prof, batches)
            rec[split] = r
    rec["train_events_per_s"] = b / (rec["train_ms_per_batch"] / 1e3)
    (out / f"profile_eval_{args.tag}.json").write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
