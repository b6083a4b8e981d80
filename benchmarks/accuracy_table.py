"""Accuracy table: every model's preset on every shared dataset, several seeds.

Trains ``configs/<model>.yaml`` on CollegeMsg, Wikipedia and bitcoin-otc for each seed,
as parallel ``sven train`` processes (several share one GPU), records each finished
run's summary in ``OUT/results.json`` as it goes (a timeout loses only the runs in
flight; a rerun skips the recorded ones), and renders the mean +- std of test AP/AUC,
transductive and inductive, under the random, historical and inductive negative
protocols, next to DyGLib's published figures.

    python benchmarks/accuracy_table.py --data-root DATA --out runs/acc \\
        --device cuda --parallel 6 --seeds 0 1 2
    python benchmarks/accuracy_table.py --out runs/acc --render-only --docs docs/accuracy.md

``--data-root`` holds event stores (``DIR/<dataset>``, from ``sven data convert``) or
the raw files (``DIR/collegemsg/CollegeMsg.txt.gz`` ...), converted once into
``OUT/stores``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("tgn", "jodie", "dyrep", "apan")
#: Dataset name -> raw file under the data root (relative).
RAW = {
    "collegemsg": "collegemsg/CollegeMsg.txt.gz",
    "wikipedia": "wikipedia/wikipedia.csv.gz",
    "bitcoin-otc": "bitcoin-otc/soc-sign-bitcoinotc.csv.gz",
}
#: DyGLib (Yu et al., NeurIPS 2023), Table 1 (transductive, random negatives) and the
#: inductive table, mean +- std of 5 runs, in %: (AP, AUC) or AP only for inductive.
#: CollegeMsg is DyGLib's "UCI". Wikipedia there has 172-dim edge features.
PUBLISHED: dict[tuple[str, str], dict[str, str]] = {
    ("collegemsg", "tgn"): {"ap": "92.34 ± 1.04", "auc": "92.03 ± 1.13", "ap_ind": "88.12 ± 2.05"},
    ("collegemsg", "jodie"): {
        "ap": "89.43 ± 1.09",
        "auc": "90.44 ± 0.49",
        "ap_ind": "79.86 ± 1.48",
    },
    ("collegemsg", "dyrep"): {"ap": "65.14 ± 2.30", "auc": "68.77 ± 2.34"},
    ("wikipedia", "tgn"): {"ap": "98.45 ± 0.06", "auc": "98.37 ± 0.07"},
    ("wikipedia", "jodie"): {"ap": "96.50 ± 0.14", "auc": "96.33 ± 0.07"},
}
#: Table columns: (header, summary key).
COLUMNS = (
    ("val AP", "val_ap"),
    ("test AP", "test_ap"),
    ("test AUC", "test_auc"),
    ("ind. AP", "test_ap_inductive"),
    ("ind. AUC", "test_auc_inductive"),
    ("hist. neg AP", "test_historicalneg_ap"),
    ("hist. neg AUC", "test_historicalneg_auc"),
    ("hist. neg ind. AP", "test_historicalneg_ap_inductive"),
    ("ind. neg AP", "test_inductiveneg_ap"),
    ("ind. neg AUC", "test_inductiveneg_auc"),
    ("ind. neg ind. AP", "test_inductiveneg_ap_inductive"),
)
BEGIN = "<!-- accuracy-table:begin -->"
END = "<!-- accuracy-table:end -->"


def _is_store(path: Path) -> bool:
    # ``sven data convert`` writes meta.json last: its presence marks a whole store.
    return (path / "meta.json").is_file()


def resolve_store(name: str, data_root: Path, out: Path) -> Path:
    """The event store of ``name``: under the data root, or converted from its raw file."""
    for cand in (data_root / name, out / "stores" / name):
        if _is_store(cand):
            return cand
    raw = data_root / RAW[name]
    if not raw.exists():
        raise FileNotFoundError(f"{name}: neither a store nor {raw} under {data_root}")
    dest = out / "stores" / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "sven", "data", "convert", str(raw), "--out", str(dest)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return dest


def run_id(dataset: str, model: str, seed: int) -> str:
    """The key of one run in results.json and its folder name."""
    return f"{dataset}-{model}-s{seed}"


def load_results(path: Path) -> dict[str, Any]:
    """results.json, or an empty record."""
    return json.loads(path.read_text()) if path.exists() else {}


def save_results(results: dict[str, Any], path: Path) -> None:
    """Atomic rewrite (a killed run leaves the previous complete file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def train_one(
    dataset: str, model: str, seed: int, store: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Runs one ``sven train``; returns its summary plus the run's settings."""
    rid = run_id(dataset, model, seed)
    out = Path(args.out) / "runs" / rid
    cmd = [
        sys.executable,
        "-m",
        "sven",
        "train",
        "--config",
        str(ROOT / "configs" / f"{model}.yaml"),
        f"data.path={store}",
        f"train.seed={seed}",
        f"train.device={args.device}",
        f"out={out}",
        "quiet=true",
        "eval.all_protocols=true",
    ]
    if args.max_epochs:
        cmd.append(f"train.epochs={args.max_epochs}")
    if args.threads:
        cmd.append(f"train.threads={args.threads}")
    if (out / "config.json").exists():
        # A run killed mid-way: resume from its checkpoint rather than start over.
        cmd.append("train.resume=true")
    cmd += args.override
    # The log sits beside the run folder: sven train refuses an out holding other files.
    log_path = out.with_name(out.name + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "a") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}; see {log_path}", "cmd": cmd}
    summary = json.loads((out / "summary.json").read_text())
    summary.update(seed=seed, dataset_key=dataset, wall_s_outer=time.time() - t0, cmd=cmd)
    return summary


def store_events(store: Path) -> int:
    """Number of events of a store (its meta.json), the cost proxy of its runs."""
    return int(json.loads((store / "meta.json").read_text())["num_events"])


def schedule(
    todo: list[tuple[str, str, int]], events: dict[str, int]
) -> list[tuple[str, str, int]]:
    """Runs in the order to start them: largest dataset first, stable otherwise.

    With ``--parallel`` workers the longest runs start first (longest-processing-time
    first), so a single call does not end with one Wikipedia run going on alone while
    the other workers idle.
    """
    return sorted(todo, key=lambda run: -events[run[0]])


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Trains every missing (dataset, model, seed), ``--parallel`` at a time."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = load_results(path)
    if not args.data_root:
        raise SystemExit("--data-root is needed to train (see docs/data.md, 'Public datasets')")
    stores = {d: resolve_store(d, Path(args.data_root), out) for d in args.datasets}
    todo = [
        (d, m, s)
        for d in args.datasets
        for m in args.models
        for s in args.seeds
        if "error" in results.get(run_id(d, m, s), {"error": ""})
    ]
    todo = schedule(todo, {d: store_events(stores[d]) for d in args.datasets})
    print(f"{len(todo)} runs to do ({len(results)} recorded) in {out}", flush=True)
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        running: dict[Future, tuple[str, str, int]] = {}
        queue = list(todo)
        while queue or running:
            while queue and len(running) < args.parallel:
                d, m, s = queue.pop(0)
                running[pool.submit(train_one, d, m, s, stores[d], args)] = (d, m, s)
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                d, m, s = running.pop(fut)
                try:
                    res = fut.result()
                except Exception as exc:  # recorded, so the table shows what failed
                    res = {"error": repr(exc)}
                results[run_id(d, m, s)] = res
                save_results(results, path)
                what = res.get("error") or f"test AP {res.get('test_ap')}"
                print(f"{run_id(d, m, s)}: {what}", flush=True)
    return results


def _mean_std(values: list[float]) -> str:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return "-"
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return f"{100 * mean:.2f}"
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def render(results: dict[str, Any]) -> str:
    """The markdown table (values in %, mean ± sample std over seeds) of results.json."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for res in results.values():
        if "error" in res:
            continue
        d, m = res.get("dataset_key"), res.get("model")
        groups.setdefault((d, m), []).append(res)
    head = ["dataset", "model", "seeds", "epochs (mean)"] + [c for c, _ in COLUMNS]
    head += ["published AP", "published AUC", "published ind. AP"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {d: i for i, d in enumerate(RAW)}
    morder = {m: i for i, m in enumerate(MODELS)}
    for d, m in sorted(groups, key=lambda k: (order.get(k[0], 99), morder.get(k[1], 99))):
        runs = groups[(d, m)]
        epochs = sum(r.get("epochs_run", 0) for r in runs) / len(runs)
        row = [d, m, str(len(runs)), f"{epochs:.1f}"]
        row += [_mean_std([r.get(k) for r in runs]) for _, k in COLUMNS]
        pub = PUBLISHED.get((d, m), {})
        row += [pub.get("ap", "-"), pub.get("auc", "-"), pub.get("ap_ind", "-")]
        lines.append("| " + " | ".join(row) + " |")
    failed = sorted(rid for rid, r in results.items() if "error" in r)
    if failed:
        lines.append("")
        lines.append("Failed runs: " + ", ".join(failed))
    return "\n".join(lines) + "\n"


def write_docs(table: str, docs: Path) -> None:
    """Replaces the marked table section of ``docs`` (appends one if absent)."""
    text = docs.read_text() if docs.exists() else ""
    block = f"{BEGIN}\n{table}{END}"
    if BEGIN in text and END in text:
        pre, rest = text.split(BEGIN, 1)
        post = rest.split(END, 1)[1]
        text = pre + block + post
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    docs.write_text(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--data-root",
        default="",
        help="event stores (DIR/<dataset>) or the raw public files (docs/data.md, "
        '"Public datasets"); needed unless --render-only',
    )
    ap.add_argument("--out", required=True, help="runs, stores and results.json go here")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--datasets", nargs="+", default=list(RAW), choices=list(RAW))
    ap.add_argument("--max-epochs", type=int, default=0, help="cap train.epochs (0: preset)")
    ap.add_argument("--threads", type=int, default=0, help="train.threads of each run")
    ap.add_argument("--render-only", action="store_true", help="only render results.json")
    ap.add_argument("--docs", default="", help="also write the table into this markdown file")
    ap.add_argument(
        "--override", nargs="*", default=[], help="extra key=value overrides for every run"
    )
    args = ap.parse_args(argv)
    results_path = Path(args.out) / "results.json"
    results = load_results(results_path) if args.render_only else run_all(args)
    table = render(results)
    (Path(args.out) / "accuracy_table.md").write_text(table)
    print(table)
    if args.docs:
        write_docs(table, Path(args.docs))


if __name__ == "__main__":
    main()
