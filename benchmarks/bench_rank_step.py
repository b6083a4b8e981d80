"""The P-rank step at world size 1 against the plain process, as a user runs both.

For each dataset, the same preset run as ``sven train`` (one process, no process group)
and as ``torchrun --nproc_per_node 1 -m sven train`` (a real process group of one: the
P-rank step with its collectives inside the captured graph), each a fresh process, and
optionally with other ``pipeline.*`` knobs. Reports per run the warm train events/s
(epochs after the first, from ``metrics.jsonl``), the first epoch's, test AP, whether
the step was captured, and the process's wall time; the ratio of the launched run to
the plain one per dataset. JSON goes to ``--out`` after every run, so a time-out loses
nothing.

Example (one H200; the stores from ``sven data convert``)::

    python benchmarks/bench_rank_step.py --store collegemsg=STORES/collegemsg \\
        --store wikipedia=STORES/wikipedia --epochs 3 --out $OUT/rank_step.json

On two GPUs (``--nproc 1 --nproc 2``; ``train.batch_size`` is the global batch, the
same for every launcher of a variant, so each variant is a strong-scaling point; weak
scaling compares the plain run of a batch-600 variant with torchrun2 of a batch-1200
one)::

    python benchmarks/bench_rank_step.py --store syn7=STORES/syn7 --nproc 1 --nproc 2 \\
        --variant "train.batch_size=1200 dist.strategy=hash" \\
        --variant "train.batch_size=1200 dist.strategy=minmax" --out $OUT/two_gpus.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(cmd: list[str], out: Path) -> dict:
    """Runs one training process; returns its figures."""
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    res: dict = {"cmd": " ".join(cmd), "rc": proc.returncode, "process_s": wall}
    if proc.returncode != 0:
        res["stderr"] = proc.stderr[-3000:]
        return res
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    rates = [x["events_per_s"] for x in lines]
    summary = json.loads((out / "summary.json").read_text())
    res.update(
        first_epoch_events_per_s=rates[0],
        warm_events_per_s=sum(rates[1:]) / max(len(rates) - 1, 1),
        epoch_events_per_s=rates,
        test_ap=summary.get("test_ap"),
        val_ap=summary.get("val_ap"),
        step_captured=summary.get("step_captured"),
        world_size=summary.get("world_size"),
        wall_s=summary.get("wall_s"),
        pipeline_prefetch=summary.get("pipeline_prefetch"),
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", action="append", required=True, help="NAME=PATH")
    ap.add_argument("--config", default="configs/tgn.yaml")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--runs-dir", default=None, help="run folders (default: a temporary one)")
    ap.add_argument(
        "--variant",
        action="append",
        default=None,
        help="extra overrides of one variant, space separated (default: the preset)",
    )
    ap.add_argument(
        "--nproc",
        type=int,
        action="append",
        default=None,
        help="torchrun process counts to run beside the plain process (default: 1); "
        "e.g. --nproc 1 --nproc 2 on a two-GPU machine",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    nprocs = args.nproc or [1]
    variants = args.variant or [""]
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="sven-bench-rank-step-")
    report: dict = {"runs": [], "ratios": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.store:
        name, path = spec.split("=", 1)
        for var in variants:
            extra = var.split()
            common = [
                "--config", args.config, f"data.path={path}", f"train.epochs={args.epochs}",
                "--quiet", *extra,
            ]  # fmt: skip
            got = {}
            launchers = [("plain", [sys.executable, "-m", "sven", "train"])] + [
                (f"torchrun{n}", ["torchrun", "--standalone", "--nproc_per_node", str(n),
                                  "-m", "sven", "train"])
                for n in nprocs
            ]  # fmt: skip
            for how, prefix in launchers:
                o = Path(runs_dir) / f"{name}-{how}-{len(report['runs'])}"
                res = run([*prefix, *common, f"out={o}"], o)
                res.update(dataset=name, launcher=how, variant=var)
                report["runs"].append(res)
                got[how] = res
                out.write_text(json.dumps(report, indent=2) + "\n")
                print(json.dumps({k: res.get(k) for k in (
                    "dataset", "launcher", "variant", "rc", "warm_events_per_s",
                    "first_epoch_events_per_s", "test_ap", "step_captured", "process_s",
                )}), flush=True)  # fmt: skip
            a = got["plain"]
            for how, b in got.items():
                if how != "plain" and a.get("warm_events_per_s") and b.get("warm_events_per_s"):
                    key = f"{name} {var} {how}/plain".replace("  ", " ")
                    report["ratios"][key] = b["warm_events_per_s"] / a["warm_events_per_s"]
            out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ratios"], indent=2))


if __name__ == "__main__":
    main()
