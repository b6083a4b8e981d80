"""Every Triton variant a fit launches compiles for the H200 (sm_90), on a machine
without a GPU (``tests.kernels.launches``): the variants are recorded from real fits
under the interpreter, so a kernel or a shape nobody listed by hand is covered too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sven.datasets.store import write_events

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.memory_dim=16", "model.time_dim=16", "model.embed_dim=16"]
# Each fit: the launches of one model and attention form, at small widths (the
# interpreter's time grows with them), TGN's time encoding at its default width: its
# block then differs from the edge features' (evaluation's factored kernel holds both).
FITS = {
    "tgn-factored": [
        "model.name=tgn",
        *SMALL,
        "model.time_dim=100",
        "model.attention_form=factored",
    ],
    "tgn": ["model.name=tgn", *SMALL, "model.time_dim=100"],
    # Evaluation as 100 MRR negatives run it (per-node queries into the factored kernel).
    "tgn-wide": ["--wide", "model.name=tgn", *SMALL, "model.time_dim=100"],
    "jodie": ["model.name=jodie", *SMALL],
    "dyrep": ["model.name=dyrep", *SMALL],
    "apan": ["model.name=apan", *SMALL],
}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    n, nodes = 100, 20
    src = rng.integers(0, nodes, n)
    dst = (src + rng.integers(1, nodes, n)) % nodes
    t = np.sort(rng.integers(0, 10_000, n))
    feat = rng.random((n, 20)).astype(np.float32)  # 20 columns: an edge block of 32
    path = tmp_path_factory.mktemp("launches") / "store"
    write_events(path, src, dst, t, edge_feat=feat, num_nodes=nodes, name="launches")
    return path


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.kernels.launches", *args],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT,
    )  # fmt: skip


def test_every_variant_a_fit_launches_compiles_for_sm90(store, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
        from triton.runtime.interpreter import InterpretedFunction  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no ahead-of-time compile API or interpreter")
    specs = tmp_path / "launches.json"
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env = {**base, "TRITON_INTERPRET": "1", "SVEN_KERNELS": "triton", "OMP_NUM_THREADS": "1"}
    common = [
        f"data.path={store}", "train.epochs=1", "train.batch_size=25", "train.cuda_graph=off",
        "eval.mrr_negatives=3", "eval.all_protocols=false",
    ]  # fmt: skip
    for name, extra in FITS.items():
        flags = [a for a in extra if a == "--wide"]
        args = [a for a in extra if a != "--wide"]
        proc = _run(["record", *flags, str(specs), "--", *common, *args], env)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
    proc = _run(["compile", str(specs)], base)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failures"] == []
    # The fits reach the kernels of every hot path, the factored evaluation's included.
    names = {k.rsplit(".", 1)[1] for k in report["kernels"]}
    assert {"_factored_split_kernel", "_relu_norm_kernel", "_fused_fwd_kernel", "_fused_bwd_kernel",
            "_cell_fwd_kernel", "_write_kernel", "_recent_kernel"} <= names  # fmt: skip
