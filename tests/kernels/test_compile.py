"""Every Triton kernel compiles for the H200 (sm_90) on a machine without a GPU.

The interpreter runs the kernels' arithmetic but not the compiler, whose checks (dot
shapes, layouts, types) only a GPU run would otherwise reach. Triton compiles to a
cubin ahead of time without a device; this runs in a child process, since this one
has the kernels defined for the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

COMPILE_ALL = r"""
import json
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from sven.kernels import triton_attention as ta, triton_decoder as td, triton_rnn as tr

POINTEE = {"m_ptr": "*u8", "pos_ptr": "*i64", "dt_ptr": "*fp32", "tw_ptr": "*fp32",
           "tb_ptr": "*fp32", "dkv_ptr": "*fp32", "has_ptr": "*u8", "ts_ptr": "*fp64",
           "last_ptr": "*fp64", "last_out_ptr": "*fp64"}
cases = []
for dt in ("fp32", "bf16"):
    for fn in (ta._attn_fwd_kernel, ta._attn_bwd_kernel):
        # The smallest tiles too: K = 1 and D = 8 give a 1 x 8 tile.
        for bk, bd in ((16, 64), (1, 8)):
            cases.append((fn, dt, {"BLOCK_K": bk, "BLOCK_D": bd}))
    for fn in (ta._fused_fwd_kernel, ta._fused_bwd_kernel):
        for edge, bd, bt in ((True, 64, 32), (False, 16, 16)):
            cases.append((fn, dt, {"HAS_EDGE": edge, "BF16_DOT": dt == "bf16",
                                   "TF32": edge and dt == "fp32",
                                   "BLOCK_K": 16, "BLOCK_D": bd, "BLOCK_T": bt}))
    for wide in (False, True):
        cases.append((tr._encode_kernel, dt, {"BLOCK": 1024, "WIDE": wide}))
        for fn in (tr._cell_fwd_kernel, tr._cell_bwd_kernel):
            for gru in (True, False):
                for masked in (True, False):
                    cases.append(
                        (fn, dt, {"GRU": gru, "MASKED": masked, "BLOCK": 1024, "WIDE": wide})
                    )
    for keep in (True, False):
        # TF32 products (train.matmul_precision=high) and IEEE ones, both compiled.
        cases.append((td._decoder_fwd_kernel, dt,
                      {"BLOCK_M": 16, "BLOCK_K": 32, "BLOCK_O": 32, "KEEP_Z": keep, "TF32": keep}))
    for tf32 in (True, False):
        # The wide batches' tile (evaluation: no activations kept).
        bm, bk, bo, _ = td.WIDE_TILE
        cases.append((td._decoder_fwd_kernel, dt,
                      {"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_O": bo, "KEEP_Z": False, "TF32": tf32}))
    for tf32 in (True, False):
        cases.append((td._decoder_bwd_kernel, dt,
                      {"BLOCK_M": 16, "BLOCK_D": 128, "BLOCK_O": 32, "TF32": tf32}))
from sven.kernels import triton_grads as tg
for dt in ("fp32", "bf16"):
    for num, (bn, bm) in zip((1, 2, 3, 3), tg._TILES):
        for tf32 in (True, False):
            cases.append((tg._param_grads_kernel, dt,
                          {"NUM": num, "BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": tg._BLOCK_K,
                           "BLOCK_B": tg._BLOCK_B, "TF32": tf32}))
from sven.kernels import triton_sampler as tsm
# Root times of the index's dtype (CAST 0), floating over integer ts (1, rounded up),
# integer over floating ts (2); with and without the id list's tail and the ages.
for tdt, gdt, cast in (("i64", "i64", 0), ("fp64", "fp64", 0), ("i64", "fp64", 1),
                       ("fp64", "i64", 2)):
    for has_valid in (True, False):
        ptrs = {"ts_ptr": "*" + tdt, "times_ptr": "*" + gdt, "out_ts_ptr": "*" + tdt,
                "out_times_ptr": "*" + tdt, "valid_ptr": "*u8", "out_mask_ptr": "*i8",
                "ids_ptr": "*i64", "age_ptr": "*fp64"}
        cases.append((tsm._recent_kernel, "i64",
                      {"HAS_VALID": has_valid, "CAST": cast, "HAS_IDS": has_valid,
                       "HAS_AGE": has_valid, "BLOCK_R": 128, "BLOCK_K": 16}, ptrs))
from sven.kernels import triton_dedupe as tdd
for sdt in ("i32", "i64"):
    cases.append((tdd._compact_kernel, "i64", {"BLOCK": 4096}, {"sorted_ptr": "*" + sdt}))
import triton.language as tl
# The one-program sort at 4 warps (its width up to 2,048 keys): int32 keys, and int64
# keys with int32 sorted ids (a padding id below 2**31) and with int64 ones.
for key, sdt in ((tl.int32, "i32"), (tl.int64, "i32"), (tl.int64, "i64")):
    top = 2**31 - 1 if key == tl.int32 else 2**63 - 1
    cases.append((tdd._sort_kernel, "i64",
                  {"BLOCK": 1024, "POS_BITS": 10, "KEY": key, "TOP": top},
                  {"sorted_ptr": "*" + sdt}))
from sven.kernels import triton_state as tst
# The write-back: one mail per node and a queue of 10 (its shift's barriers), memory
# and mail together or apart.
# Each with and without hot rows (copies in GPU memory, looked up by slot).
HOT = {"slot_ptr": "*i32", "h_mem": "*fp32", "h_lu": "*fp64", "h_mail": "*fp32",
       "h_mts": "*fp64", "h_mv": "*i8"}
for m in (1, 10):
    for wm, wl in ((True, True), (True, False), (False, True)):
        for hot in (False, True):
            cases.append((tst._write_kernel, "fp32",
                          {"D_MEM": 16, "D_MAIL": 35, "M": m, "B_MEM": 16, "B_MAIL": 64,
                           "WRITE_MEM": wm, "WRITE_MAIL": wl, "ROWS": 32, "STAMP": hot,
                           "HOT": hot},
                          {"nodes_ptr": "*i64", "key_ptr": "*i64", "best_ptr": "*i64",
                           "src_lu": "*fp64", "src_mts": "*fp64", "lu_ptr": "*fp64",
                           "mts_ptr": "*fp64", "mv_ptr": "*i8", "stamp_ptr": "*i64",
                           "counter_ptr": "*i64", **HOT}))
# The gather: rows read, or read again where stale (a refresh), with and without hot rows.
for m in (1, 3):
    for refresh in (False, True):
        for hot in (False, True):
            cases.append((tst._gather_kernel, "fp32",
                          {"D_MEM": 16, "D_MAIL": 35, "M": m, "B_MEM": 16,
                           "B_MAIL": tst._block(m * 35), "B_M": tst._block(m), "ROWS": 32,
                           "REFRESH": refresh, "HOT": hot},
                          {"nodes_ptr": "*i64", "lu_ptr": "*fp64", "mts_ptr": "*fp64",
                           "mv_ptr": "*i8", "o_mem": "*fp32", "o_lu": "*fp64",
                           "o_mail": "*fp32", "o_mts": "*fp64", "o_mv": "*i8",
                           "stamp_ptr": "*i64", "since_ptr": "*i64", "wipe_ptr": "*i64",
                           **HOT}))
from sven.kernels import triton_adam as tad
# Adam's step: pointers from the address table, the bias corrections in double.
for decay in (False, True):
    cases.append((tad._adam_kernel, "i64", {"BLOCK": tad.BLOCK, "DECAY": decay},
                  {"hyper_ptr": "*fp64"}))
from sven.kernels import triton_factored as tfa, triton_norm as tno
# The factored evaluation attention with its slots' index read eagerly or after the
# flags, edges in place, as table rows or none; the wide layer's output norm.
for eager in (False, True):
    for edge, rows in ((False, False), (True, True), (True, False)):
        cases.append((tfa._factored_fwd_kernel, "fp32",
                      {"HAS_EDGE": edge, "EDGE_ROWS": rows, "Q_ROWS": True, "EAGER": eager,
                       "BLOCK_K": 16, "BLOCK_H": 2, "BLOCK_D": 64, "BLOCK_T": 128,
                       "BLOCK_E": 64}, {"er_ptr": "*i64", "qr_ptr": "*i64"}))
# The kernel of matrix products: heads padded to a product's side, TF32 products and
# IEEE ones, rows aligned to 4 floats and unaligned.
for (edge, rows), tf32, vec in (((False, False), True, 4), ((True, True), False, 1),
                                ((True, False), True, 2)):
    cases.append((tfa._factored_dot_kernel, "fp32",
                  {"HAS_EDGE": edge, "EDGE_ROWS": rows, "Q_ROWS": True, "EAGER": False,
                   "BLOCK_K": 16, "BLOCK_H": 16, "BLOCK_D": 64, "BLOCK_T": 128, "BLOCK_E": 64,
                   "BLOCK_O": 128, "TF32": tf32, "H": 2, "D": 50, "OD": 100, "ROW_VEC": vec},
                  {"er_ptr": "*i64", "qr_ptr": "*i64"}))
# The kernel of two slot tiles: ten slots as eight and two, sixteen as sixteen and one
# (the second all masked), one as one and one; edges in place, as table rows or none.
for (edge, rows), (k1, k2) in (((False, False), (8, 2)), ((True, True), (16, 1)),
                               ((True, False), (1, 1))):
    cases.append((tfa._factored_split_kernel, "fp32",
                  {"HAS_EDGE": edge, "EDGE_ROWS": rows, "Q_ROWS": True, "EAGER": False,
                   "BLOCK_K": k1, "BLOCK_K2": k2, "BLOCK_H": 2, "BLOCK_D": 64, "BLOCK_T": 128,
                   "BLOCK_E": 64}, {"er_ptr": "*i64", "qr_ptr": "*i64"}))
cases.append((tno._relu_norm_kernel, "fp32", {"BLOCK_R": 16, "BLOCK_C": 128},
              {"rows_ptr": "*i64"}))
failures = []
for fn, dt, consts, *over in cases:
    pointee = {**POINTEE, **(over[0] if over else {})}
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a.endswith("_ptr") or a.startswith("src_") or a in pointee:
            sig[a] = pointee.get(a, "*" + dt)
        else:
            sig[a] = "fp32" if a in ("scale", "eps") else "i32"
    idx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    try:
        compile(ASTSource(fn=fn, signature=sig, constexprs=idx), target=GPUTarget("cuda", 90, 32))
    except Exception as e:
        failures.append(f"{fn.__name__} {dt} {consts}: {type(e).__name__}: {e}"[:2000])
print(json.dumps({"cases": len(cases), "failures": failures}))
"""


@pytest.mark.parametrize("cos", ["reduced", "poly"])
def test_kernels_compile_for_sm90(cos: str) -> None:
    # Every kernel with each way of cos32 that a GPU run may ask for (SVEN_TRITON_COS
    # is read at import: one process each).
    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no ahead-of-time compile API")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["SVEN_TRITON_COS"] = cos
    res = subprocess.run(
        [sys.executable, "-c", COMPILE_ALL], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["cases"] == 128
    assert report["failures"] == []
