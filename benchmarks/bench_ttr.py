"""Time to a result (issue 22): what a user waits for, from typing ``sven train`` to
``summary.json``, on one GPU. One command, every step a child process with its own
time limit under one overall deadline; ``<out>/ttr.json`` is rewritten after each step,
so what came before a step that hangs is kept.

Steps, in order (each records its command, process time and the run's summary):

1. ``env``: torch, CUDA, the GPU; the process time of ``import torch`` and of
   ``import torch`` plus CUDA's initialisation (a tensor on the device), the floor that
   any CUDA program pays.
2. ``wiki-convert``: ``sven data convert`` of JODIE's Wikipedia (not part of the timed
   runs).
3. ``wiki-cold``: ``sven train --config configs/tgn.yaml data.path=WIKI train.epochs=3
   out=OUT --quiet`` with an empty Triton cache (``TRITON_CACHE_DIR`` set to a fresh
   folder): the process time, ``startup_s`` and its phases, first against warm epoch
   rate, evaluation events/s against training's.
4. ``wiki-warm``: the same command again with that cache kept (a second run of a user:
   the Triton kernels load from disk).
5. ``syn6``: ``sven data synth --events 1000000 --nodes 10000 --seed 0``, then two
   epochs of ``configs/tgn.yaml`` on it: start-up to the first step on a 10^6-event
   store, epoch 0 against epoch 1, evaluation (all three protocols on test) against
   training events/s.
6. ``syn7``, ``syn8`` (``--large 1e7 1e8``, each when the deadline leaves room):
   ``sven data synth --events E --nodes E/10 --seed 0``, then one epoch of
   ``configs/tgn.yaml`` at batch 600 with ``eval.all_protocols=false`` (the issue's
   runs; ``--fast`` adds ``train.compile=true train.matmul_precision=high``): training
   and validation seconds from the epoch's rates.

Usage (GPU machine, repository root)::

    python3 benchmarks/bench_ttr.py --setup --wiki .device_data/wikipedia/wikipedia.csv.gz \\
        --out $OUT --deadline-s 330
    # the 10^8-event epoch alone, with the fast settings (about 6 minutes on an H200)
    python3 benchmarks/bench_ttr.py --setup --skip-small --large 1e8 --fast --out $OUT \\
        --deadline-s 560

``--device cpu --quick`` runs the same steps on CPU with small sizes (a check of the
script itself on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from steps import PY, Steps, sven_cmd


def run_facts(out: Path) -> dict[str, Any]:
    """The parts of a run's summary.json and metrics.jsonl that the issue asks for."""
    facts: dict[str, Any] = {}
    summary_path = out / "summary.json"
    if not summary_path.is_file():
        return facts
    s = json.loads(summary_path.read_text())
    keep = (
        "wall_s",
        "train_events_per_s",
        "eval_events_per_s",
        "test_events_per_s",
        "eval_s",
        "checkpoint_s",
        "test_ap",
        "val_ap",
        "triton_cache_dir",
    )
    facts.update({k: s.get(k) for k in keep if k in s})
    facts.update({k: v for k, v in s.items() if k.startswith("startup_")})
    facts.update({k: v for k, v in s.items() if k.endswith("_graph_warmup_s")})
    facts.update({k: v for k, v in s.items() if k.endswith("_graph_capture_s")})
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    facts["epochs"] = [
        {k: e.get(k) for k in ("epoch", "events_per_s", "val_events_per_s", "val_ap") if k in e}
        for e in epochs
    ]
    rates = [e.get("events_per_s") or 0.0 for e in epochs]
    if len(rates) >= 2 and max(rates[1:]) > 0:
        warm = sum(rates[1:]) / len(rates[1:])
        facts["first_over_warm_epoch_rate"] = round(rates[0] / warm, 4)
    if s.get("train_events_per_s"):
        facts["eval_over_train_events_per_s"] = round(
            s["eval_events_per_s"] / s["train_events_per_s"], 3
        )
    return facts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "ttr-out"))
    ap.add_argument("--wiki", default=".device_data/wikipedia/wikipedia.csv.gz")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--deadline-s", type=float, default=330.0)
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU check)")
    ap.add_argument("--setup", action="store_true", help="pip install -e . (offline) first")
    ap.add_argument("--skip-syn7", action="store_true", help="no large-graph runs")
    ap.add_argument(
        "--large", nargs="*", default=["1e7"], help="event counts of the large graphs (1e7 1e8)"
    )
    ap.add_argument(
        "--fast",
        action="store_true",
        help="large graphs with train.compile=true train.matmul_precision=high",
    )
    ap.add_argument("--skip-small", action="store_true", help="no Wikipedia or 10^6 runs")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    work = Path(tempfile.mkdtemp(prefix="ttr-"))
    r = Steps(out, args.deadline_s, "ttr")
    if args.setup:
        r.run(
            "setup",
            [PY, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."],
            120,
        )
    quick = args.quick

    def synth(events: str, nodes: str, out: Path) -> list[str]:
        return sven_cmd("data", "synth", "--events", events, "--nodes", nodes, "--seed", "0",
                        "--out", str(out))  # fmt: skip

    def train(data: Path, run_out: Path, *extra: str) -> list[str]:
        cap = ["train.max_batches=20"] if quick else []
        return sven_cmd("train", *extra, f"data.path={data}", f"out={run_out}", "--quiet",
                        f"train.device={args.device}", *cap)  # fmt: skip

    # 1. env and the floor every CUDA process pays.
    probe = (
        "import json, torch; print(json.dumps({'torch': torch.__version__, "
        "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0) "
        "if torch.cuda.is_available() else None}))"
    )
    try:
        r.record["env"] = json.loads(subprocess.check_output([PY, "-c", probe], text=True))
    except (subprocess.CalledProcessError, ValueError):
        pass
    r.run("import-torch", [PY, "-c", "import torch"], 60)
    if args.device == "cuda":
        r.run(
            "import-torch-cuda-init",
            [PY, "-c", "import torch; torch.empty(1, device='cuda'); torch.cuda.synchronize()"],
            60,
        )

    # 2-4. Wikipedia, three epochs, cold then warm Triton cache.
    wiki = work / "wiki"
    if Path(args.wiki).is_file() and not args.skip_small:
        r.run("wiki-convert", sven_cmd("data", "convert", args.wiki, "--out", str(wiki)), 120)
    triton_cache = work / "triton-cache"
    for name in () if args.skip_small else ("wiki-cold", "wiki-warm"):
        if not (wiki / "meta.json").is_file() or r.left() < 30:
            break
        run_out = work / name
        cmd = train(wiki, run_out, "--config", "configs/tgn.yaml", "train.epochs=3")
        rec = r.run(name, cmd, 150, env={"TRITON_CACHE_DIR": str(triton_cache)})
        rec["run"] = run_facts(run_out)
        r.save()

    # 5. The 10^6-event store: start-up to the first step, epochs, evaluation.
    syn6 = work / "syn6"
    events6 = "20000" if quick else "1000000"
    rec = {"rc": "skipped"}
    if not args.skip_small:
        rec = r.run("syn6-synth", synth(events6, "10000", syn6), 120)
    if rec["rc"] == 0 and r.left() > 30:
        run_out = work / "syn6-run"
        cmd = train(syn6, run_out, "--config", "configs/tgn.yaml", "train.epochs=2")
        rec = r.run("syn6", cmd, 150, env={"TRITON_CACHE_DIR": str(triton_cache)})
        rec["run"] = run_facts(run_out)
        r.save()

    # 6. The large graphs, one epoch at batch 600 each (the runs): synthetic,
    # 10 events per node, training plus validation seconds from the epoch's rates.
    fast = ["train.compile=true", "train.matmul_precision=high"] if args.fast else []
    for size in [] if args.skip_syn7 else args.large:
        events = int(float(size))
        name = f"syn{round(math.log10(events))}"
        if quick:
            events = 60000
        need = 60 + events / 1e6 * 3  # synth, then at least the start of an epoch
        if r.left() < need:
            r.record["steps"][name] = {"skipped": f"{r.left():.0f} s left, {need:.0f} s needed"}
            break
        store = work / name
        rec = r.run(f"{name}-synth", synth(str(events), str(events // 10), store), 300)
        if rec["rc"] != 0 or r.left() < 60:
            continue
        run_out = work / f"{name}-run"
        cmd = train(store, run_out, "--config", "configs/tgn.yaml", "train.batch_size=600",
                    "train.epochs=1", "eval.all_protocols=false", *fast)  # fmt: skip
        rec = r.run(name, cmd, 590, env={"TRITON_CACHE_DIR": str(triton_cache)})
        facts = rec["run"] = run_facts(run_out)
        counts = json.loads((store / "meta.json").read_text())["split"]["counts"]
        ep = (facts.get("epochs") or [{}])[0]
        if ep.get("events_per_s") and ep.get("val_events_per_s"):
            train_events = counts["train"] if not quick else min(counts["train"], 20 * 600)
            rec["train_s"] = round(train_events / ep["events_per_s"], 2)
            rec["val_s"] = round(counts["val"] / ep["val_events_per_s"], 2)
            rec["train_plus_val_s"] = round(rec["train_s"] + rec["val_s"], 2)
        r.save()
    r.save()
    print(json.dumps(r.record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
