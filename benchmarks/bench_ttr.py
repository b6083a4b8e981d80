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
   out=OUT --quiet`` with empty Triton and Inductor caches (``TRITON_CACHE_DIR`` and
   ``TORCHINDUCTOR_CACHE_DIR`` set to fresh folders): the process time, ``startup_s``
   and its phases, first against warm epoch rate, evaluation events/s against
   training's. With ``--fast``, ``train.compile=true train.matmul_precision=high``: the
   compiled preset on an empty compile cache (issue 36: at most the floor + 12 s).
4. ``wiki-warm``: the same command again with those caches kept (a second run of a
   user: the Triton kernels, and with ``--fast`` Inductor's compiled graphs, load from
   disk; issue 36: at most the floor + 2.5 s). The floor is step 1's
   ``import-torch-cuda-init``, in the same run.
5. ``syn6``: ``sven data synth --events 1000000 --nodes 10000 --seed 0``, then two
   epochs of ``configs/tgn.yaml`` on it: start-up to the first step on a 10^6-event
   store, epoch 0 against epoch 1, evaluation (all three protocols on test) against
   training events/s.
6. ``syn7``, ``syn8`` (``--large 1e7 1e8``, each when the deadline leaves room):
   ``sven data synth --events E --nodes E/10 --seed 0``, then one epoch of
   ``configs/tgn.yaml`` at batch 600 with ``eval.all_protocols=false`` (the issue's
   runs; ``--fast`` adds ``train.compile=true train.matmul_precision=high``, as it does
   to steps 3 and 4): training
   and validation seconds from the epoch's rates.

Usage (GPU machine, repository root)::

    python3 benchmarks/bench_ttr.py --setup --wiki .device_data/wikipedia/wikipedia.csv.gz \\
        --out $OUT --deadline-s 330
    # the 10^8-event epoch alone, with the fast settings (about 6 minutes on an H200)
    python3 benchmarks/bench_ttr.py --setup --skip-small --large 1e8 --fast --out $OUT \\
        --deadline-s 560

``--device cpu --quick`` runs the same steps on CPU with small sizes (a check of the
script itself on a machine without a GPU).

``--startup N`` runs only the start-up breakdown (issue 36): N times, alternating, the
floor (``import torch; torch.ones(1, device=D)``, timed from the process's start as
``startup_s`` is) and the Wikipedia preset (``--store`` for a store made already, else
``--wiki`` converted), each run's ``startup_s`` and its phases from ``summary.json``,
then one ``python -X importtime`` of each, to say which imports the run adds to the
floor's; a table on stdout, everything in ``<out>/ttr.json`` under ``startup``::

    python3 benchmarks/bench_ttr.py --setup --startup 5 --wiki WIKI.csv.gz --out $OUT
    python3 benchmarks/bench_ttr.py --device cpu --startup 3 --store STORE --out OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steps import PY, ROOT, Steps, sven_cmd

#: The floor under every run: torch imported and a tensor on the device, timed from the
#: process's start (the kernel's record, as ``startup_s`` is; the interpreter counts).
FLOOR = """\
import time
import torch
t1 = time.perf_counter()
torch.ones(1, device={device!r})
if torch.device({device!r}).type == "cuda":
    torch.cuda.synchronize()
t2 = time.perf_counter()
import json
from sven.engine.startup import process_age_s
age, now = process_age_s(), time.perf_counter()
print(json.dumps(None if age is None else {{
    "import_torch_s": round(age - (now - t1), 4), "floor_s": round(age - (now - t2), 4)}}))
"""
#: The phases a run's summary.json reports, in the order they run.
PHASES = ("imports", "init", "cuda_init", "store_open", "plan", "checksums", "to_device",
          "model", "tables", "optimizer", "preload", "run_start", "epoch_start",
          "first_batches", "first_step", "other")  # fmt: skip


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
    facts.update({k: v for k, v in s.items() if "_ahead_" in k})
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


def compiled_variants(cache: Path) -> list[str]:
    """Kernel variants compiled into a Triton cache folder, as ``hash/name``, sorted.

    Each compiled variant leaves a metadata file ``<name>.json`` with its ``name`` in
    a folder of its own, named by the variant's hash; the launchers' and drivers'
    folders have none.
    """
    out = []
    for meta in cache.glob("*/*.json"):
        try:
            name = json.loads(meta.read_text()).get("name")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(name, str) and meta.stem == name:
            out.append(f"{meta.parent.name}/{name}")
    return sorted(out)


def compiled_kernels(cache: Path) -> dict[str, int]:
    """Kernels compiled into a Triton cache folder: variants per kernel name, most first
    (:func:`compiled_variants` counted by name)."""
    counts: dict[str, int] = {}
    for variant in compiled_variants(cache):
        name = variant.split("/", 1)[1]
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def import_times(log: Path) -> dict[str, int]:
    """Self time (us) of each module in a ``python -X importtime`` log."""
    out: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = line[len("import time:") :].split("|")
        out[name.strip()] = int(self_us)
    return out


def added_imports(run: dict[str, int], floor: dict[str, int]) -> dict[str, Any]:
    """What a run imports beyond the floor's modules: self time in ms per package
    (``sven.<part>`` for Sven's own), largest first, and in all. A module loaded by
    ``importlib.import_module`` has no line of its own in the log (the modules it
    imports do)."""
    groups: dict[str, int] = {}
    for name, us in run.items():
        if name in floor:
            continue
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "sven" else parts[0]
        groups[key] = groups.get(key, 0) + us
    by = sorted(groups.items(), key=lambda kv: -kv[1])
    return {
        "total_ms": round(sum(groups.values()) / 1e3, 1),
        "modules": sum(1 for n in run if n not in floor),
        "by_package_ms": {k: round(v / 1e3, 1) for k, v in by},
    }


def bytecode_state() -> dict[str, Any]:
    """Whether Sven's modules load from cached bytecode or are compiled from source in
    every process (``PYTHONDONTWRITEBYTECODE`` with an editable install and nothing
    compiled ahead: a few tenths of a second of each start on a small VM). A wheel's
    installation compiles them, as ``--setup`` does here."""
    sources = [
        p for d in ("sven", "datasets", "partition", "pipeline") for p in (ROOT / d).rglob("*.py")
    ]
    cached = sum(Path(importlib.util.cache_from_source(str(p))).is_file() for p in sources)
    return {
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE", ""),
        "modules": len(sources),
        "with_bytecode": cached,
    }


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def startup_breakdown(
    r: Steps, train: Callable[[Path], list[str]], device: str, reps: int, work: Path
) -> dict[str, Any]:
    """The floor and ``sven train``'s start-up, ``reps`` times each, alternating (a
    machine's drift falls on both alike); then one ``-X importtime`` run of each.

    Args:
        r: The steps' record.
        train: The ``sven train`` command line for a run folder.
        device: Where the floor's tensor goes (the run's ``train.device``).
        reps: How many of each.
        work: Scratch folder for the run folders.

    Returns:
        ``runs`` (each repetition's floor and phases), the ``median`` and ``min`` of
        each figure, ``bytecode`` (:func:`bytecode_state`) and ``imports_added``
        (:func:`added_imports`).
    """
    floor_cmd = [PY, "-c", FLOOR.format(device=device)]
    runs: list[dict[str, Any]] = []
    for i in range(reps):
        row: dict[str, Any] = {}
        rec = r.run(f"floor-{i}", floor_cmd, 120)
        if rec["rc"] == 0:
            row.update(json.loads(rec["tail"].strip().splitlines()[-1]) or {})
            row["floor_process_s"] = rec["wall_s"]
        run_out = work / f"startup-{i}"
        rec = r.run(f"startup-{i}", train(run_out), 300)
        summary = run_out / "summary.json"
        if rec["rc"] == 0 and summary.is_file():
            s = json.loads(summary.read_text())
            row.update({k: v for k, v in s.items() if k.startswith("startup_")})
            row["run_process_s"] = rec["wall_s"]
            if "floor_s" in row:
                row["beyond_floor_s"] = round(row["startup_s"] - row["floor_s"], 4)
        runs.append(row)
    keys = sorted({k for row in runs for k in row})
    median = {k: round(_median([row[k] for row in runs if k in row]), 4) for k in keys}
    least = {k: min(row[k] for row in runs if k in row) for k in keys}
    # One run each with -X importtime (slower: not among the timed runs).
    logs = {}
    for name, cmd in (("floor", floor_cmd), ("run", train(work / "startup-importtime"))):
        rec = r.run(f"importtime-{name}", [cmd[0], "-X", "importtime", *cmd[1:]], 300)
        logs[name] = import_times(r.out / f"importtime-{name}.log")
    return {
        "device": device,
        "bytecode": bytecode_state(),
        "runs": runs,
        "median": median,
        "min": least,
        "imports_added": added_imports(logs["run"], logs["floor"]),
    }


def print_breakdown(b: dict[str, Any]) -> None:
    """The breakdown as a few lines of text (medians)."""
    m, n = b["median"], len(b["runs"])
    print(f"\nstart-up on {b['device']}, median of {n} runs (seconds):")
    print(f"  floor (import torch; torch.ones(1, device)): {m.get('floor_s', float('nan')):.3f}"
          f" (import torch {m.get('import_torch_s', float('nan')):.3f}; process"
          f" {m.get('floor_process_s', float('nan')):.3f})")  # fmt: skip
    print(f"  sven train to the end of its first step:    {m.get('startup_s', float('nan')):.3f}"
          f" (process {m.get('run_process_s', float('nan')):.3f})")  # fmt: skip
    print(f"  beyond the floor:                           "
          f"{m.get('beyond_floor_s', float('nan')):.3f} (issue 36: at most 1.5; least of the"
          f" runs {b['min'].get('beyond_floor_s', float('nan')):.3f})")  # fmt: skip
    if "startup_imports_s" in m and "import_torch_s" in m:
        print(f"  imports beyond import torch:                "
              f"{m['startup_imports_s'] - m['import_torch_s']:.3f}")  # fmt: skip
    for ph in PHASES:
        if f"startup_{ph}_s" in m:
            print(f"    {ph:<12} {m[f'startup_{ph}_s']:.3f}")
    bc = b["bytecode"]
    print(f"  Sven's modules with bytecode: {bc['with_bytecode']} of {bc['modules']}"
          f" (PYTHONDONTWRITEBYTECODE={bc['PYTHONDONTWRITEBYTECODE']!r})")  # fmt: skip
    added = b["imports_added"]
    top = ", ".join(f"{k} {v:.0f}" for k, v in list(added["by_package_ms"].items())[:12])
    print(f"  imported beyond the floor (-X importtime, self ms, one run): "
          f"{added['total_ms']:.0f} ms in {added['modules']} modules: {top}")  # fmt: skip


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
    ap.add_argument(
        "--large-epochs", type=int, default=1,
        help="epochs on each large graph; from 2 the later epochs' mean rate is reported as "
        "warm_train_events_per_s (the first epoch pays the capture's warm-up)",
    )  # fmt: skip
    ap.add_argument("--skip-small", action="store_true", help="no Wikipedia or 10^6 runs")
    ap.add_argument(
        "--startup", type=int, default=0, metavar="N",
        help="only the start-up breakdown: the floor and the Wikipedia preset, N runs each",
    )  # fmt: skip
    ap.add_argument("--store", help="an event store to use instead of converting --wiki")
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
        # Bytecode, as a wheel's installation compiles it: an editable install under
        # PYTHONDONTWRITEBYTECODE would compile Sven's modules in every timed process.
        r.run("compile", [PY, "-m", "compileall", "-q", "sven", "datasets", "partition",
                          "pipeline"], 120)  # fmt: skip
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
    wiki = Path(args.store) if args.store else work / "wiki"
    if not args.store and Path(args.wiki).is_file() and not args.skip_small:
        r.run("wiki-convert", sven_cmd("data", "convert", args.wiki, "--out", str(wiki)), 120)
    if args.startup:
        # The preset's command, as in wiki-cold and wiki-warm (--quick: one short epoch).
        extra = ["train.epochs=1"] if quick else ["train.epochs=3"]
        b = startup_breakdown(
            r, lambda run_out: train(wiki, run_out, "--config", "configs/tgn.yaml", *extra),
            args.device, args.startup, work,
        )  # fmt: skip
        r.record["startup"] = b
        r.save()
        print_breakdown(b)
        return 0
    triton_cache = work / "triton-cache"
    fast = ["train.compile=true", "train.matmul_precision=high"] if args.fast else []
    caches = {"TRITON_CACHE_DIR": str(triton_cache),
              "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache")}  # fmt: skip
    for name in () if args.skip_small else ("wiki-cold", "wiki-warm"):
        if not (wiki / "meta.json").is_file() or r.left() < 30:
            break
        run_out = work / name
        cmd = train(wiki, run_out, "--config", "configs/tgn.yaml", "train.epochs=3", *fast)
        rec = r.run(name, cmd, 150, env=caches)
        rec["run"] = run_facts(run_out)
        if name == "wiki-cold":
            # What the empty cache had to compile: the variants of each kernel.
            rec["triton_compiles"] = compiled_kernels(triton_cache)
            rec["triton_compiles_total"] = sum(rec["triton_compiles"].values())
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
        rec = r.run("syn6", cmd, 150, env=caches)
        rec["run"] = run_facts(run_out)
        r.save()

    # 6. The large graphs, --large-epochs epochs at batch 600 each (the runs): synthetic,
    # 10 events per node, training plus validation seconds from the epoch's rates.
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
                    f"train.epochs={args.large_epochs}", "train.patience=0",
                    "eval.all_protocols=false", *fast)  # fmt: skip
        rec = r.run(name, cmd, 590, env=caches)
        facts = rec["run"] = run_facts(run_out)
        counts = json.loads((store / "meta.json").read_text())["split"]["counts"]
        ep = (facts.get("epochs") or [{}])[0]
        if ep.get("events_per_s") and ep.get("val_events_per_s"):
            train_events = counts["train"] if not quick else min(counts["train"], 20 * 600)
            rec["train_s"] = round(train_events / ep["events_per_s"], 2)
            rec["val_s"] = round(counts["val"] / ep["val_events_per_s"], 2)
            rec["train_plus_val_s"] = round(rec["train_s"] + rec["val_s"], 2)
        later = [e.get("events_per_s") or 0.0 for e in (facts.get("epochs") or [])[1:]]
        if later and min(later) > 0:
            rec["warm_train_events_per_s"] = round(sum(later) / len(later))
        r.save()
    r.save()
    print(json.dumps(r.record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
