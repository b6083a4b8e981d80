"""Graphs bigger than the GPU, on one GPU: node state in host memory against on the GPU,
checkpoints of large state, and a 10^8-node graph end to end (docs/scale.md).

Every step is a child process (``sven data synth``, ``sven train``, ``sven predict``)
whose wall time and peak resident memory (``wait4``'s ``ru_maxrss``) are recorded;
``<out>/scale.json`` is rewritten after each step, so what came before a step that
fails or runs out of time is kept.

``--graph 1e7``: ``sven data synth --events 1e8 --nodes 1e7``, then the same training
twice, TGN's preset widths at batch 600 with the defaults (``--fast`` adds
``train.compile=true train.matmul_precision=high``; then run the script twice, so that
both arms of the second run read a warm compile cache), ``--batches`` batches of the one
epoch with a checkpoint halfway (``train.checkpoint_every``), validation and test:

* ``gpu``: ``state.device=gpu``;
* ``host``: ``state.device=auto state.gpu_budget_gb=G`` with G below what the run needs
  with its state on the GPU, so that the plan puts the state in host memory.

Reported: train events/s of each and their ratio, test AP of each and the difference,
each checkpoint's training stall and time to disk, peak RSS.

``--graph 1e8``: ``sven data synth --events 2e7 --nodes 1e8``, then one run with
``model.memory_dim=32 model.time_dim=32`` (401 bytes of state a node: 40 GB; the
default step, no compile), ``--batches``
training batches, validation, test, its checkpoint and ``summary.json`` (the run's
figures are in the JSON as soon as it ends), then ``sven predict`` of 100 pairs and of
10^6 pairs from that checkpoint's node state (the default): every step's wall time,
peak RSS, and the disk used. Then, unless ``--skip-replay``, the same pairs with
``--memory replay`` (each a replay of the whole stream: its time only; its scores are
not the checkpoint's, whose memory training built and which has not seen the test
split; that both read the same memory the same way is
``tests/integration/test_predict_stored.py``'s).

``--graph predict`` (a CPU-sized case): ``sven data synth --events 1e6 --nodes 1e5``,
a short training of the same widths (``--batches``, default 20, then validation and
test), then 100 pairs and 10^6 pairs scored both ways, in the order of ``--graph
1e8``. For each: the process's wall time and peak RSS, and from ``sven predict``'s last
line the time to load the model and the time (and pairs/s) to score them once loaded;
of that, for the pairs answered from the checkpoint, the time to load their node state
and neighbour index (``stored_load_s``, and how the state was read: ``stored_read``)
and the time (and pairs/s) to score them once those are loaded (``stored_score_s``,
``stored_pairs_per_s``).

Usage (GPU machine, repository root)::

    python3 benchmarks/bench_scale.py --graph 1e7 --out $OUT --deadline-s 560
    python3 benchmarks/bench_scale.py --graph 1e8 --batches 8000 --skip-replay \
        --out $OUT --deadline-s 340
    python3 benchmarks/bench_scale.py --device cpu --quick --out OUT  # the script
    python3 benchmarks/bench_scale.py --graph predict --device cpu --out OUT

``--quick`` shrinks every size (a check of the script on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from steps import Steps, sven_cmd

SVEN = sven_cmd()


def _rss_gb(rec: dict[str, Any]) -> float | None:
    """A step's peak resident memory in GB (None for a skipped step)."""
    mib = rec.get("peak_rss_mib")
    return None if mib is None else round(mib * 2**20 / 1e9, 2)


def _summary(run: Path) -> dict[str, Any]:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _du(path: Path) -> int:
    """Bytes under ``path``, each inode once (hard links share their bytes)."""
    seen, total = set(), 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", choices=["1e7", "1e8", "predict"], default="1e7")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "sven-scale")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, default=0, help="training batches (0: the graph's)")
    ap.add_argument("--deadline-s", type=float, default=560)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--skip-replay", action="store_true", help="no sven predict --memory replay arm"
    )
    ap.add_argument(
        "--fast",
        action="store_true",
        help="--graph 1e7: train.compile=true train.matmul_precision=high in both arms",
    )
    args = ap.parse_args()
    steps = Steps(args.out, args.deadline_s, "scale")
    scr = args.scratch
    if scr.exists():
        shutil.rmtree(scr)
    scr.mkdir(parents=True)
    steps.record.update(graph=args.graph, device=args.device, quick=args.quick)
    if args.graph == "1e7":
        graph_1e7(steps, scr, args)
    elif args.graph == "1e8":
        graph_1e8(steps, scr, args)
    else:
        graph_predict(steps, scr, args)
    steps.save()
    print(json.dumps(steps.record.get("result", {}), indent=2))
    return 0


def _common(args: argparse.Namespace, fast: bool = False) -> list[str]:
    flags = ["train.compile=true", "train.matmul_precision=high"]
    flags = flags if fast and args.device == "cuda" else []
    return [
        f"train.device={args.device}",
        "train.batch_size=600",
        "train.epochs=1",
        "train.keep_latest_k=1",
        "eval.all_protocols=false",
        "quiet=true",
        *flags,
    ]


def graph_1e7(steps: Steps, scr: Path, args: argparse.Namespace) -> None:
    events, nodes = (200_000, 20_000) if args.quick else (100_000_000, 10_000_000)
    batches = args.batches or (40 if args.quick else 40_000)
    store = scr / "s7"
    steps.run("synth", [*SVEN, "data", "synth", "--events", str(events), "--nodes", str(nodes),
                        "--seed", "0", "--out", str(store)])  # fmt: skip
    train = [
        "--config", "configs/tgn.yaml", f"data.path={store}", *_common(args, fast=args.fast),
        f"train.max_batches={batches}", f"train.checkpoint_every={batches // 2}",
    ]  # fmt: skip
    # GPU budget below the run's need with its state on the GPU (state 12.2 GB; the
    # event tables, sampler and the rest about 15 GB): the plan puts it in host memory.
    host = ["state.device=auto", "state.gpu_budget_gb=20"]
    if args.device != "cuda":
        host = ["state.device=host"]  # a CPU run has no GPU budget
    steps.run("plan-host", [*SVEN, "train", "--dry-run", *train, *host, f"out={scr / 'p'}"], 120)
    res: dict[str, Any] = {}
    for arm, extra in (("gpu", ["state.device=gpu"]), ("host", host)):
        run = scr / arm
        rec = steps.run(arm, [*SVEN, "train", *train, *extra, f"out={run}"])
        s = _summary(run)
        res[arm] = {
            k: s.get(k)
            for k in (
                "state_tier", "state_hot_rows", "train_events_per_s", "test_ap", "test_auc",
                "val_ap",
                "checkpoints_written", "checkpoint_stall_max_s", "checkpoint_on_disk_max_s",
                "checkpoint_s", "startup_s", "wall_s", "eval_events_per_s",
            )
        }  # fmt: skip
        res[arm]["peak_rss_gb"] = _rss_gb(rec)
        res[arm]["run_folder_gb"] = round(_du(run) / 1e9, 2)
        steps.record["result"] = res
        steps.save()
        shutil.rmtree(run, ignore_errors=True)  # the disk holds one run at a time
    g, h = res.get("gpu", {}), res.get("host", {})
    if g.get("train_events_per_s") and h.get("train_events_per_s"):
        res["host_over_gpu"] = round(h["train_events_per_s"] / g["train_events_per_s"], 3)
    if g.get("test_ap") is not None and h.get("test_ap") is not None:
        res["test_ap_diff"] = abs(h["test_ap"] - g["test_ap"])
    steps.record["result"] = res


def graph_1e8(steps: Steps, scr: Path, args: argparse.Namespace) -> None:
    events, nodes = (300_000, 1_000_000) if args.quick else (20_000_000, 100_000_000)
    batches = args.batches or (50 if args.quick else 15_000)
    t0 = time.perf_counter()
    store, run = _synth_and_train(steps, scr / "s8", scr / "run", args, events, nodes, batches)
    s = _summary(run)
    t_end = time.perf_counter()
    res = {
        k: s.get(k)
        for k in (
            "state_tier", "state_bytes", "train_events_per_s", "test_ap", "val_ap",
            "checkpoints_written", "checkpoint_stall_max_s", "checkpoint_on_disk_max_s",
            "checkpoint_s", "startup_s", "wall_s", "plan_gpu_bytes", "plan_host_bytes",
            "plan_disk_bytes",
        )
    }  # fmt: skip
    res["train_events"] = min(batches * 600, int(events * 0.7))
    res["synth_to_summary_s"] = round(t_end - t0, 1)
    res["peak_rss_gb"] = {k: _rss_gb(steps.record["steps"][k]) for k in ("synth", "train")}
    res["disk_gb"] = {"store": round(_du(store) / 1e9, 2), "run": round(_du(run) / 1e9, 2)}
    res["disk_free_gb"] = round(shutil.disk_usage(scr).free / 1e9, 2)
    # The run's figures on disk before the questions (which the deadline may cut).
    steps.record["result"] = res
    steps.save()
    sizes = (100, 10_000) if args.quick else (100, 10**6)
    res["predict"] = _predict_both_ways(steps, scr, run, args, nodes, sizes)
    res["end_to_end_s"] = round(time.perf_counter() - t0, 1)
    steps.record["result"] = res


def _synth_and_train(
    steps: Steps,
    store: Path,
    run: Path,
    args: argparse.Namespace,
    events: int,
    nodes: int,
    batches: int,
) -> tuple[Path, Path]:
    """``sven data synth`` of ``events`` over ``nodes``, then TGN's preset at widths 32
    for ``batches`` training batches, validation and test; returns (store, run)."""
    steps.run("synth", [*SVEN, "data", "synth", "--events", str(events), "--nodes", str(nodes),
                        "--seed", "0", "--out", str(store)])  # fmt: skip
    dims = ["model.memory_dim=32", "model.time_dim=32", "model.embed_dim=32"]
    train = [*SVEN, "train", "--config", "configs/tgn.yaml", f"data.path={store}",
             *_common(args), *dims, f"train.max_batches={batches}", f"out={run}"]  # fmt: skip
    steps.run("train", train)
    return store, run


def graph_predict(steps: Steps, scr: Path, args: argparse.Namespace) -> None:
    """Questions to a trained model from its checkpoint, with and without a replay."""
    events, nodes = (50_000, 5_000) if args.quick else (1_000_000, 100_000)
    batches = args.batches or 20
    _, run = _synth_and_train(steps, scr / "sp", scr / "run", args, events, nodes, batches)
    sizes = (100, 10_000) if args.quick else (100, 10**6)
    res: dict[str, Any] = {"events": events, "nodes": nodes, "train_batches": batches}
    res["predict"] = _predict_both_ways(steps, scr, run, args, nodes, sizes)
    steps.record["result"] = res


#: ``sven predict``'s last line: rows, seconds to score, pairs/s, seconds to load.
_SCORED = re.compile(
    r"(\d+) rows scored in ([\d.]+) s \(([\d,]+) pairs/s; the model loaded in ([\d.]+) s\)"
)
#: Its line on the pairs answered from the checkpoint: seconds to load their node state
#: and neighbour index, how it was read, seconds to score them once loaded, pairs/s.
_STORED = re.compile(
    r"pairs from the checkpoint's node state: load ([\d.]+) s \((.*)\), "
    r"score ([\d.]+) s \(([\d,]+) pairs/s\)"
)


def _predict_both_ways(
    steps: Steps, scr: Path, run: Path, args: argparse.Namespace, nodes: int, sizes: tuple[int, ...]
) -> dict[str, Any]:
    """``sven predict`` of each number of pairs (random ids, all at t = 10^9, after the
    stream) from the checkpoint's node state, then (unless ``--skip-replay``) with
    ``--memory replay``."""
    out: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for n in sizes:
        ids = rng.integers(0, nodes, (n, 2))
        np.savetxt(scr / f"pairs-{n}.csv", np.column_stack([ids, np.full(n, 10**9)]), fmt="%d",
                   delimiter=",", header="src,dst,t", comments="")  # fmt: skip
    arms = ["checkpoint"] if args.skip_replay else ["checkpoint", "replay"]
    # Every answer from the checkpoint first: a deadline cuts the replays, not those.
    for memory in arms:
        for n in sizes:
            name = f"predict-{n}-{memory}"
            rec = steps.run(name, [*SVEN, "predict", "--checkpoint", str(run), "--pairs",
                                   str(scr / f"pairs-{n}.csv"), "--out", str(scr / f"{name}.csv"),
                                   "--device", args.device, "--memory", memory])  # fmt: skip
            got = _SCORED.search(rec.get("tail") or "")
            out[name] = {
                "rc": rec.get("rc"),
                "wall_s": rec.get("wall_s"),
                "peak_rss_gb": _rss_gb(rec),
                "load_s": float(got.group(4)) if got else None,
                "score_s": float(got.group(2)) if got else None,
                "pairs_per_s": int(got.group(3).replace(",", "")) if got else None,
            }
            # Of the scoring above: the node state's read and the index (stored_load_s)
            # apart from the scoring once they are loaded (stored_score_s).
            part = _STORED.search(rec.get("tail") or "")
            out[name].update(
                stored_load_s=float(part.group(1)) if part else None,
                stored_read=part.group(2) if part else None,
                stored_score_s=float(part.group(3)) if part else None,
                stored_pairs_per_s=int(part.group(4).replace(",", "")) if part else None,
            )
            steps.record["result"] = {**steps.record.get("result", {}), "predict": out}
            steps.save()
            (scr / f"{name}.csv").unlink(missing_ok=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
