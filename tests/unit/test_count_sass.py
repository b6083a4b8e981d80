"""benchmarks/count_sass.py: the factored kernels' instructions as compiled for sm_90,
counted without a GPU (the counts themselves are the benchmark's, not a test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args", [["--kernel", "dot"], ["--kernel", "fwd", "--edges"], ["--kernel", "split"]]
)
def test_it_counts_a_kernels_instructions_by_opcode(args: list[str]) -> None:
    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no ahead-of-time compile API")
    env = {**os.environ, "SVEN_TRITON_COS": "poly"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "count_sass.py"), *args],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    # Each kernel's own default warp count (the split kernel 2, the dot kernel 4, the
    # one-tile kernel 8).
    warps = {"dot": 4, "fwd": 8, "split": 2}[args[1]]
    assert rec["kernel"] == args[1] and rec["cos"] == "poly" and rec["warps"] == warps
    assert rec["per_thread"] == sum(rec["ops"].values()) > 0
    assert rec["per_root_warp_instructions"] == warps * rec["per_thread"]
    # A kernel that gathers rows and reduces across lanes: loads and shuffles are there.
    assert rec["ops"]["LDG"] > 0 and rec["ops"]["SHFL"] > 0
