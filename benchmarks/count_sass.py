"""The instructions of the factored evaluation kernels as compiled for sm_90, without a
GPU: numbers, not a test.

The MRR batch's factored kernel is bound by issuing instructions (Nsight Compute: 72%
of issue slots busy, DRAM 4%; docs/performance.md, session 22), so its instruction
count per root is the figure to lower. Without edges the kernel has no loop: its
static SASS count per thread is what each thread issues per root, plus the branches
of libdevice's cosine that a run never takes (``SVEN_TRITON_COS=poly`` has none, so its
count is exact). Times the warps, it is the warp instructions per root that
``ncu``'s "Issued Instructions" divides into (9,728 static against 9,810 measured for
the 3-D kernel on an H100).

This compiles a kernel with Triton's ahead-of-time API for sm_90 (ptxas and nvdisasm
come with Triton's wheel), disassembles it and counts the instructions by opcode. The
stride arguments that are 1 in a real launch are compiled as the constant 1, as
Triton's launcher specialises them.

Usage:
    python3 benchmarks/count_sass.py [--kernel fwd|dot|split] [--warps 8] [--edges]
    SVEN_TRITON_COS=poly python3 benchmarks/count_sass.py --kernel dot
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

# The ahead-of-time compile needs the real compiler, not the interpreter.
os.environ.pop("TRITON_INTERPRET", None)

import triton

from sven.kernels import triton_factored

KERNELS = {
    "fwd": triton_factored._factored_fwd_kernel,
    "dot": triton_factored._factored_dot_kernel,
    "split": triton_factored._factored_split_kernel,
}
#: Each kernel's name in ``SVEN_FACTORED_KERNEL`` (for its default warp count).
KERNEL_KINDS = {"fwd": "tiles", "dot": "dot", "split": "split"}
# Pointer types other than float32, and the strides a real launch passes as 1.
POINTERS = {"er_ptr": "*i64", "qr_ptr": "*i64", "pos_ptr": "*i64", "m_ptr": "*u8"}
UNIT_STRIDES = ("sq_d", "sn_c", "sp_k", "sdt_k", "sm_k", "se_c")


def sass_ops(fn: Any, consts: dict[str, Any], warps: int) -> collections.Counter:
    """Instructions by opcode of ``fn`` compiled for sm_90 with ``consts`` and ``warps``.

    Args:
        fn: A factored-attention kernel (its arguments as
            ``triton_factored._factored_fwd_kernel``'s).
        consts: Its constexpr arguments.
        warps: Warps per program.

    Returns:
        Opcode (without modifiers) -> static count in the kernel's SASS.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fixed = {**consts, **dict.fromkeys(UNIT_STRIDES, 1)}
    sig = {}
    for a in fn.arg_names:
        if a in fixed:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = POINTERS.get(a, "*fp32")
        else:
            sig[a] = "fp32" if a == "scale" else "i32"
    idx = {(fn.arg_names.index(k),): v for k, v in fixed.items()}
    # A launch specialises pointers to 16-byte-aligned tensors (torch's allocations are):
    # without the attribute no load is compiled as a vector load.
    ptrs = [i for i, a in enumerate(fn.arg_names) if a.endswith("_ptr")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in ptrs}
    src = ASTSource(fn=fn, signature=sig, constexprs=idx, attrs=attrs)
    k = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        text = subprocess.run(
            [str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    ops: collections.Counter = collections.Counter()
    for line in text.splitlines():
        # "/*0040*/  @!P0 LDG.E.64 R2, desc[UR4][R2.64] ;": the opcode after the address
        # and any predicate.
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="dot")
    ap.add_argument("--warps", type=int, help="default: the kernel's own count")
    ap.add_argument("--edges", action="store_true", help="edge rows of a table (E = 172)")
    args = ap.parse_args()
    if args.warps is None:
        args.warps = triton_factored.FACTORED_WARPS[KERNEL_KINDS[args.kernel]]
    consts = {
        "HAS_EDGE": args.edges, "EDGE_ROWS": args.edges, "Q_ROWS": True, "EAGER": False,
        "BLOCK_K": 16, "BLOCK_H": 2, "BLOCK_D": 64, "BLOCK_T": 128, "BLOCK_E": 64,
    }  # fmt: skip
    if args.kernel == "dot":
        # Heads padded to a product's smallest side; H D = 100 node columns; TF32 on
        # (train.matmul_precision=high, the default).
        consts.update(
            {"BLOCK_H": 16, "BLOCK_O": 128, "TF32": True, "H": 2, "D": 50, "OD": 100, "ROW_VEC": 4}
        )
    if args.kernel == "split":
        # Ten slots: tiles of eight and two.
        consts.update({"BLOCK_K": 8, "BLOCK_K2": 2})
    ops = sass_ops(KERNELS[args.kernel], consts, args.warps)
    total = sum(ops.values())
    print(json.dumps({
        "kernel": args.kernel, "warps": args.warps, "edges": args.edges,
        "cos": os.environ.get("SVEN_TRITON_COS", "reduced"),
        "per_thread": total, "per_root_warp_instructions": total * args.warps,
        "ops": dict(ops.most_common()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
