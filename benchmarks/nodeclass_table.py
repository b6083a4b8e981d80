"""Node classification on Wikipedia: TGN and JODIE, several seeds, against published AUCs.

Each (model, seed) is one command, ``sven train --config configs/<model>.yaml
task=node_classification ...``, which trains the link-prediction encoder first (into
``<run>/encoder``) and then the classifier on its frozen embeddings; the runs go as
parallel processes (several share one GPU). Each finished run's summary is recorded in
``OUT/results.json`` as it goes (a rerun skips recorded runs); the table of test ROC AUC,
mean +- sample std, is printed and written to ``OUT/table.md``. With ``--check-predict``
the script also checks, on the first TGN run, that ``sven.Predictor``'s scores of the
test events equal evaluation's (the max absolute logit difference goes to
``OUT/predict_check.json``).

    python benchmarks/nodeclass_table.py --data .device_data/wikipedia/wikipedia.csv.gz \\
        --out $OUT --device cuda --epochs 30 --parallel 6 --check-predict
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Published Wikipedia node-classification ROC AUC (%), mean +- std. TGN paper (Rossi
#: et al. 2020, arXiv:2006.10637, Table 3; their Wikipedia has 172-dim edge features).
PUBLISHED = {"tgn": "87.81 ± 0.3", "jodie": "84.84 ± 1.2"}


def _store(data: Path, out: Path) -> Path:
    if (data / "meta.json").is_file():
        return data
    store = out / "stores" / "wikipedia"
    if not (store / "meta.json").is_file():
        cmd = [sys.executable, "-m", "sven", "data", "convert", str(data), "--out", str(store)]
        subprocess.run(cmd, check=True)
    return store


def _run(args: argparse.Namespace, store: Path, model: str, seed: int) -> dict[str, Any]:
    run = args.out / f"nc-{model}-{seed}"
    cmd = [
        sys.executable, "-m", "sven", "train", "--config", str(ROOT / "configs" / f"{model}.yaml"),
        "task=node_classification", f"data.path={store}", f"train.device={args.device}",
        f"train.epochs={args.epochs}", f"train.seed={seed}", f"train.threads={args.threads}",
        f"out={run}", "quiet=true", "train.resume=true",
    ]  # fmt: skip
    with open(args.out / f"nc-{model}-{seed}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads((run / "summary.json").read_text())


def _check_predict(args: argparse.Namespace, store: Path) -> dict[str, Any]:
    """Predictor scores of the test events against evaluation's, on the TGN encoder."""
    import time

    import numpy as np

    import sven
    from sven.datasets.store import TemporalEvents
    from sven.engine.checkpoint import load_file

    enc = args.out / f"nc-tgn-{args.seeds[0]}" / "encoder"
    step = sorted((enc / "checkpoints").glob("step-*"))[-1]
    cfg = json.loads((enc / "config.json").read_text())
    tr = sven.Trainer(cfg, [f"train.device={args.device}", "train.resume=false", "quiet=true"])
    tr.model.load_state_dict(load_file(step / "state.pt")["model"])
    tr.memory.reset()
    tr.evaluate("train")
    tr.evaluate("val")
    pos = tr.evaluate("test").pos.double().cpu().numpy()
    ev = TemporalEvents.load(store)
    lo, hi = ev.split_range("test")
    raw = np.asarray(ev.id_map)
    p = sven.Predictor(step, device=args.device)
    w0 = time.perf_counter()
    got = p.score(
        raw[np.asarray(ev.src[lo:hi])], raw[np.asarray(ev.dst[lo:hi])],
        np.asarray(ev.t[lo:hi]), logits=True,
    )  # fmt: skip
    return {
        "events": hi - lo,
        "max_abs_logit_diff": float(np.abs(got - pos).max()),
        "predict_wall_s": time.perf_counter() - w0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="wikipedia.csv(.gz) or a store")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/nc")))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--epochs", type=int, default=5, help="link-prediction epochs")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--models", nargs="+", default=["tgn", "jodie"])
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-predict", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store = _store(args.data, args.out)
    res_path = args.out / "results.json"
    results: dict[str, Any] = json.loads(res_path.read_text()) if res_path.is_file() else {}
    todo = [(m, s) for m in args.models for s in args.seeds if f"{m}-{s}" not in results]
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(_run, args, store, m, s): (m, s) for m, s in todo}
        for fut, (m, s) in futures.items():
            results[f"{m}-{s}"] = fut.result()
            res_path.write_text(json.dumps(results, indent=2))
            print(f"{m} seed {s}: test AUC {results[f'{m}-{s}']['test_auc']:.4f}", flush=True)
    lines = [
        "| model | seeds | LP epochs | val AUC | test AUC | published test AUC (TGN paper) |",
        "|---|---|---|---|---|---|",
    ]
    for m in args.models:
        rs = [results[f"{m}-{s}"] for s in args.seeds if f"{m}-{s}" in results]
        if not rs:
            continue
        cells = []
        for key in ("val_auc", "test_auc"):
            v = [100 * r[key] for r in rs]
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            cells.append(f"{statistics.mean(v):.2f} ± {sd:.2f}")
        pub = PUBLISHED.get(m, "-")
        lines.append(f"| {m} | {len(rs)} | {args.epochs} | {cells[0]} | {cells[1]} | {pub} |")
    table = "\n".join(lines) + "\n"
    (args.out / "table.md").write_text(table)
    print(table)
    if args.check_predict and "tgn" in args.models:
        check = _check_predict(args, store)
        (args.out / "predict_check.json").write_text(json.dumps(check, indent=2))
        print(json.dumps(check))


if __name__ == "__main__":
    main()
