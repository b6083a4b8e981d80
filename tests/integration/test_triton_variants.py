"""benchmarks/triton_variants.py: the Triton variants a fit compiles, counted on CPU."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_safety import store as store  # the fixture

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_a_fit_compiles_one_segment_sum_one_sampler_and_three_hashes(store) -> None:
    """TGN's fit on a tiny store: every variant listed once with its phase, and the
    kernels whose values differ between calls (the segment sum's row bounds, the
    planner's int epochs, the sampler's rows and id list) are not compiled again for
    them."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_variants.py"), "--data", str(store),
         "model.name=tgn", "train.batch_size=8", "model.num_neighbors=3",
         "eval.all_protocols=false"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    total = re.search(r"^variants: (\d+) \(", out, re.M)
    assert total, out
    listed = [line for line in out.splitlines() if re.match(r"^(plan|train|eval) +_", line)]
    assert len(listed) == int(total.group(1))
    # One variant each: no "N variants" section.
    assert "_segment_sum_kernel: " not in out and "_recent_kernel: " not in out
    assert sum(" _hash_columns_kernel " in line for line in listed) <= 3
