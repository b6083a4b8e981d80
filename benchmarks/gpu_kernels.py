"""The kernel work of one GPU session in one call: the GPU tests, the captured step's
profile and the warm training rate, the PyTorch reference against the fused paths.

Every step runs as a child process under one overall deadline, and
``<out>/gpu_kernels.json`` is rewritten after each, so a step that fails or hangs costs
only its own time. Steps, in order:

1. ``convert``: ``sven data convert`` of the raw CollegeMsg file (SNAP's
   ``CollegeMsg.txt.gz``) into an event store under ``--work``.
2. ``tests``: ``python -m pytest -m gpu -q`` (the whole GPU suite); its summary line.
3. ``profile-<variant>``: ``benchmarks/profile_step.py`` on the store with
   ``train.cuda_graph=on`` (TGN preset, batch 200): kernels and GPU ms per captured
   step, wall ms per step and the warm events/s it implies.
4. ``train-<variant>``: ``benchmarks/bench_vs_pyg.py --sides sven --epochs 2
   --repeats 1`` (TGN at the PyG comparison's dims, batch 200): train events/s per
   epoch (the second is warm) and the test AP.

Variants: ``reference`` (``SVEN_KERNELS=auto``: the PyTorch reference for the
attention and the updater, Triton hashes), ``updater`` (``SVEN_KERNELS=auto,
recurrent_update=triton``: the fused memory updater), ``core`` (``auto,
temporal_attention=triton``: the attention's projections on cuBLAS, its masked softmax
as one Triton kernel), ``both`` (the two), ``triton`` (``SVEN_KERNELS=triton``: every
Triton kernel, the attention's projections in its kernel), ``compile``
(``train.compile=true``: the model compiled by Inductor inside the captured step) and
``fast`` (``compile`` with ``train.matmul_precision=high``: TF32 matrix products).

Usage (on the GPU machine, from the repository root)::

    python benchmarks/gpu_kernels.py --raw .device_data/collegemsg/CollegeMsg.txt.gz \\
        --out $OUT --deadline-s 350

``--device cpu --quick`` checks the driver on a machine without a GPU (the GPU tests
skip, profiles and runs are eager and short).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from steps import PY, Steps, sven_cmd

HERE = Path(__file__).resolve().parent

VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "reference": ({"SVEN_KERNELS": "auto"}, []),
    "updater": ({"SVEN_KERNELS": "auto,recurrent_update=triton"}, []),
    "core": ({"SVEN_KERNELS": "auto,temporal_attention=triton"}, []),
    "both": ({"SVEN_KERNELS": "auto,recurrent_update=triton,temporal_attention=triton"}, []),
    "triton": ({"SVEN_KERNELS": "triton"}, []),
    "compile": ({"SVEN_KERNELS": "auto"}, ["train.compile=true"]),
    "fast": ({"SVEN_KERNELS": "auto"}, ["train.compile=true", "train.matmul_precision=high"]),
}
SUMMARY = re.compile(r"\d+ (passed|failed|skipped|error)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--raw", required=True, help="CollegeMsg.txt.gz (SNAP)")
    ap.add_argument("--out", required=True, help="folder for gpu_kernels.json and profiles")
    ap.add_argument("--work", default=None, help="folder for the store (default: temporary)")
    ap.add_argument("--deadline-s", type=float, default=350)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a few steps: checks the driver")
    args = ap.parse_args()
    out = Path(args.out)
    runner = Steps(out, args.deadline_s, "gpu_kernels")
    with tempfile.TemporaryDirectory(prefix="gpu_kernels-", dir=args.work) as work:
        store = str(Path(work) / "collegemsg")
        rec = runner.run("convert", sven_cmd("data", "convert", args.raw, "--out", store), 120)
        if rec["rc"] != 0:
            return
        _tests(runner, args)
        steps = ["--steps", "5", "--warmup", "3"] if args.quick else []
        epochs = "1" if args.quick else "2"
        graph = "train.cuda_graph=on" if args.device.startswith("cuda") else "train.cuda_graph=off"
        # Most wanted first: a step that the deadline cuts off is skipped, not guessed.
        order = [("profile", "reference"), ("profile", "fast"), ("train", "fast")]
        order += [("profile", "both"), ("train", "compile")]
        order += [("profile", "updater"), ("profile", "core"), ("train", "reference")]
        order += [("train", "both"), ("train", "updater"), ("profile", "triton")]
        order += [("profile", "compile")]
        for kind, variant in order:
            env, over = VARIANTS[variant]
            if not args.device.startswith("cuda"):
                env = {**env, "TRITON_INTERPRET": "1"}
            if kind == "profile":
                cmd = [PY, str(HERE / "profile_step.py"), "--data", store, "--out", str(out)]
                cmd += ["--tag", variant, *steps, graph, f"train.device={args.device}", *over]
                rec = runner.run(f"profile-{variant}", cmd, 200, env=env)
                path = out / f"profile_{variant}.json"
                if rec["rc"] == 0 and path.exists():
                    prof = json.loads(path.read_text())
                    rec["figures"] = {k: v for k, v in prof.items() if k != "top"}
            else:
                bench = out / f"train_{variant}.json"
                cmd = [PY, str(HERE / "bench_vs_pyg.py"), "--data", store, "--sides", "sven"]
                cmd += ["--device", args.device, "--epochs", epochs, "--repeats", "1"]
                cmd += ["--out", str(bench)]
                if over:
                    cmd += ["--variant", f"{variant}=" + ",".join(over)]
                rec = runner.run(f"train-{variant}", cmd, 200, env=env)
                if rec["rc"] == 0 and bench.exists():
                    rec["figures"] = _train_figures(json.loads(bench.read_text()))
            runner.save()
    runner.save()
    print(json.dumps(_digest(runner.record["steps"]), indent=2))


def _tests(runner: Any, args: argparse.Namespace) -> None:
    cmd = [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    if args.quick:
        cmd += ["tests/kernels/test_updater.py", "tests/kernels/test_cells.py"]
    rec = runner.run("tests", cmd, 240)
    log = runner.out / "tests.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    summary = [x.strip() for x in lines if SUMMARY.search(x) and " in " in x]
    rec["summary"] = summary[-1] if summary else None
    rec["failed"] = [x.strip() for x in lines if x.startswith("FAILED")][:60]
    runner.save()


def _train_figures(bench: dict[str, Any]) -> dict[str, Any]:
    """Per-epoch rates (the last ones warm) and the AP of the run in ``bench_vs_pyg``'s
    JSON."""
    run = bench["runs"][0]
    keys = ("side", "epoch_events_per_s", "train_events_per_s", "val_ap", "test_ap")
    return {k: run[k] for k in keys if k in run}


def _digest(steps: dict[str, Any]) -> dict[str, Any]:
    """The figures of every step, without the output tails."""
    keep = ("rc", "wall_s", "summary", "figures", "skipped")
    return {k: {x: v[x] for x in keep if x in v} for k, v in steps.items()}


if __name__ == "__main__":
    main()
