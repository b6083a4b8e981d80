"""Where an evaluation pass's time goes, beside a training step's: numbers, not a test.

Builds a one-process :class:`sven.Trainer` on a store, trains ``--train-batches``
batches, then for each split times, with the device waited for: the split's negatives
(drawn once per run), the first pass (its graphs' warm-up and capture included), the
metrics, a second pass (warm graphs) and its metrics (warm: what each later epoch's
validation pays), and a profiled third (kernels and GPU time per batch); first, after
``--train-batches`` steps, ``--profile-batches`` training steps are timed and as many
profiled (``profile_step.py``'s steady state).

Usage:
    python benchmarks/profile_eval.py --data STORE --out OUT [--fixed-shapes] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import profile_step
from torch.profiler import ProfilerActivity, profile


def _kernels(prof: Any, n: int) -> dict[str, float]:
    """Kernels and GPU us per call from a profile of ``n`` calls."""
    ks = profile_step.cuda_kernels(prof)
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
    ap.add_argument("--profile-batches", type=int, default=20, help="timed, then profiled, steps")
    ap.add_argument(
        "--fixed-shapes",
        action="store_true",
        help="CUDA's fixed-shape step on any device (its padded work, measured on a CPU)",
    )
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {"tag": args.tag, "overrides": args.overrides}
    if args.fixed_shapes:
        import sven.engine.spec

        sven.engine.spec.fixed_shapes = lambda device, distributed: True
        rec["fixed_shapes"] = True
    with tempfile.TemporaryDirectory() as run:
        n = args.train_batches + 2 * args.profile_batches
        tr, train, sync = profile_step.one_process(args.data, run, args.overrides, n)
        st, b = tr.step, tr.cfg.train.batch_size
        per, prof = profile_step.steady(train, sync, args.train_batches, args.profile_batches)
        rec["train_ms_per_batch"] = per * 1e3
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
            _, r["negatives_s"] = timed(lambda split=split: st.evaluation.negatives(split))
            res, r["pass1_s"] = timed(lambda split=split: st.evaluation.run(split))
            _, r["metrics_s"] = timed(lambda split=split, res=res: tr.split_metrics(split, res))
            res2, r["pass2_s"] = timed(lambda split=split: st.evaluation.run(split))
            # The metrics again, warm: what each epoch's validation pays beside its pass.
            _, r["metrics2_s"] = timed(lambda split=split, res=res2: tr.split_metrics(split, res))
            graphs = st.evaluation.width(split).graphs
            r["warmup_s"] = sum(g.warmup_s for g in graphs)
            r["capture_s"] = sum(g.capture_s for g in graphs)
            r["ms_per_batch_warm"] = r["pass2_s"] / batches * 1e3
            r["events_per_s_warm"] = events / r["pass2_s"]
            r["events_per_s_first"] = events / (r["negatives_s"] + r["pass1_s"] + r["metrics_s"])
            # A later epoch's validation rate: the warm pass and the warm metrics.
            r["events_per_s_warm_with_metrics"] = events / (r["pass2_s"] + r["metrics2_s"])
            # Kernels of a warm evaluation pass, per batch.
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                st.evaluation.run(split)
                sync()
            r["step"] = _kernels(prof, batches)
            # Where a batch's GPU time goes: the kernels by their share, per batch.
            top = sorted(profile_step.cuda_kernels(prof), key=lambda e: -e.self_device_time_total)[
                :30
            ]
            r["top_kernels"] = [
                {
                    "name": e.key[:120],
                    "per_batch": round(e.count / batches, 2),
                    "us_per_batch": round(e.self_device_time_total / batches, 2),
                }
                for e in top
            ]
            rec[split] = r
    rec["train_events_per_s"] = b / (rec["train_ms_per_batch"] / 1e3)
    (out / f"profile_eval_{args.tag}.json").write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
