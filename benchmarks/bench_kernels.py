"""The kernels at TGN's shapes in each form: Triton, the PyTorch reference and, for the
attention over neighbour slots, the factored form of the CPU path; with roofline figures.

For each kernel (temporal attention, the fused gather/time-encoding attention, the GRU
and RNN cells), dtype and pass (forward; forward + backward), times each backend two
ways: launched eagerly, and captured once as a CUDA graph and replayed (as the captured
training step runs them, where launch overhead is gone). Backends: ``triton``,
``reference`` (torch eager) and ``factored``
(``reference.temporal_attention_factored``, the same function as the fused attention
with the slot projections carried to the queries and the weighted sums: the model's
form on CPU). Prints milliseconds per call and, from a count of the minimum bytes each
pass must move and the FLOPs it must do, the achieved GB/s and GFLOP/s against the
H200's roofline (about 4.8 TB/s HBM; about 60 TFLOP/s fp32 without tensor cores, 990
TFLOP/s bf16 dense). The counts are those of the fused form for every backend, so the
ratio of the rates is the speed-up; the reference's real traffic is higher (its
intermediates), the factored form's arithmetic lower.

Shapes (defaults): R = 600 * 3 roots (a batch of 600 events, sources, destinations and
one negative), K = 10 neighbours, H = 2 heads of D = 50, memory 100, mail 200 plus a
time encoding of 100 (cell input 300), U unique nodes (default 2000); the fused
attention without edge features (CollegeMsg) and with 172 (Wikipedia), ``fused-e0``
and ``fused-e172``.

Usage::

    python benchmarks/bench_kernels.py --out OUTDIR          # on the GPU: OUTDIR/bench_kernels.json
    python benchmarks/bench_kernels.py --device cpu --threads 1 --backends reference factored \\
        --kernels fused --roots 600 --unique 500 --dtypes float32   # the two forms on CPU
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --device cpu --quick  # a smoke run
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HBM_GBS = 4800.0
PEAK_GFLOPS = {torch.float32: 60_000.0, torch.bfloat16: 990_000.0}
# The Triton modules, imported only when their backend is asked for.
ATT, RNN = "sven.kernels.triton_attention", "sven.kernels.triton_rnn"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> float:
    """Seconds per call of fn launched eagerly."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def time_graph(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """Seconds per replay of fn captured once as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def problems(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> dict:
    """name -> (backend -> function of the leaves, the leaves (given grad), forward bytes,
    backward bytes, forward FLOPs, backward FLOPs); the functions close over the other
    inputs. Only the backends in ``args.backends`` are built (Triton may be absent)."""
    from sven.kernels import reference

    def forms(**makers: Callable[[], Callable]) -> dict[str, Callable]:
        return {name: make() for name, make in makers.items() if name in args.backends}

    def triton(module: str, fn: str) -> Callable:
        return getattr(importlib.import_module(module), fn)

    g = torch.Generator(device="cpu").manual_seed(0)
    r, k, h, d, t, u = args.roots, args.k, args.heads, args.head_dim, args.time_dim, args.unique
    o = h * d
    mem, inp = args.memory, args.mail + args.time_dim
    es = torch.tensor([], dtype=dtype).element_size()

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    mask = (torch.rand(r, k, generator=g) < 0.8).to(device)
    nbr = torch.randint(0, u, (r, k), generator=g).to(device)
    # Gaps from a second to ten days, log-uniform: on CPU the time encoding's cos is much
    # slower for large arguments, so the spread matters.
    dt = (10 ** (torch.rand(r, k, generator=g) * 6)).to(device)
    tw = (1.0 / 10 ** torch.linspace(0, 9, t)).to(device)
    tb = torch.zeros(t, device=device)

    def split_kv(fn: Callable) -> Callable:
        def call(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            key, val = kv.chunk(2, dim=2)
            return fn(q, key.reshape(r, k, h, d), val.reshape(r, k, h, d), mask)

        return call

    def fused(fn: Callable, ef: torch.Tensor | None) -> Callable:
        def call(q, kvn, wt, *we):  # type: ignore[no-untyped-def]
            kv_edge = None if ef is None else F.linear(ef, we[0])
            return fn(q, kvn, nbr, dt, mask, tw, tb, wt, kv_edge)

        return call

    def factored(ef: torch.Tensor | None) -> Callable:
        def call(q, kvn, wt, *we):  # type: ignore[no-untyped-def]
            return reference.temporal_attention_factored(q, kvn, nbr, dt, mask, tw, tb, wt, ef, *we)

        return call

    rk = r * k
    att_fwd_bytes = es * (2 * r * o + 2 * rk * o) + rk
    att_fwd_flops = 4 * rk * o
    gru_gemm = 2 * u * (inp + mem) * 3 * mem
    gru_bytes = es * (u * inp + 2 * u * mem + 3 * mem * (inp + mem))
    rnn_gemm = 2 * u * (inp + mem) * mem
    rnn_bytes = es * (u * inp + 2 * u * mem + mem * (inp + mem))
    out = {
        "attention": (
            forms(
                triton=lambda: split_kv(triton(ATT, "temporal_attention")),
                reference=lambda: split_kv(reference.temporal_attention),
            ),
            [rnd(r, h, d), rnd(r, k, 2 * o)],
            att_fwd_bytes,
            # Backward reads q, k, v, dout and writes dq, dk, dv.
            att_fwd_bytes + es * (2 * r * o + 2 * rk * o),
            att_fwd_flops,
            att_fwd_flops + 8 * rk * o,
        ),
    }
    for e in args.edge_dims:
        # Edge features are data (no gradient); their projection is a weight.
        ef = rnd(r, k, e) if e else None
        fwd_bytes = es * (2 * r * o + 2 * rk * o + 2 * o * t + rk * e + 2 * o * e) + rk * 13
        fwd_flops = 4 * rk * o + 2 * rk * t * 2 * o + 3 * rk * t + 2 * rk * e * 2 * o
        out[f"fused-e{e}"] = (
            forms(
                triton=lambda ef=ef: fused(triton(ATT, "temporal_attention_fused"), ef),
                reference=lambda ef=ef: fused(reference.temporal_attention_fused, ef),
                factored=lambda ef=ef: factored(ef),
            ),
            [rnd(r, h, d), rnd(u, 2 * o), rnd(2 * o, t, scale=0.1)]
            + ([rnd(2 * o, e, scale=e**-0.5)] if e else []),
            fwd_bytes,
            # Backward: the forward's reads again, dout, dq, the (R, K, 2 O) slot
            # gradient (written, read by the scatter and the weight GEMM) and dkv_node.
            2 * fwd_bytes + es * 2 * r * o + 4 * 3 * rk * 2 * o + es * u * 2 * o,
            fwd_flops,
            2 * fwd_flops + 8 * rk * o + 2 * rk * 2 * o * t,
        )
    out["gru"] = (
        forms(triton=lambda: triton(RNN, "gru_cell"), reference=lambda: reference.gru_cell),
        [
            rnd(u, inp),
            rnd(u, mem),
            rnd(3 * mem, inp, scale=inp**-0.5),
            rnd(3 * mem, mem, scale=mem**-0.5),
            rnd(3 * mem),
            rnd(3 * mem),
        ],
        gru_bytes,
        3 * gru_bytes,
        gru_gemm + 12 * u * mem,
        3 * gru_gemm + 40 * u * mem,
    )
    out["rnn"] = (
        forms(triton=lambda: triton(RNN, "rnn_cell"), reference=lambda: reference.rnn_cell),
        [
            rnd(u, inp),
            rnd(u, mem),
            rnd(mem, inp, scale=inp**-0.5),
            rnd(mem, mem, scale=mem**-0.5),
            rnd(mem),
            rnd(mem),
        ],
        rnn_bytes,
        3 * rnn_bytes,
        rnn_gemm + 3 * u * mem,
        3 * rnn_gemm + 6 * u * mem,
    )
    return out


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    dtypes = [getattr(torch, name) for name in args.dtypes]
    for dtype in dtypes:
        for name, spec in problems(args, dtype, device).items():
            if name.split("-")[0] not in args.kernels:
                continue
            fns, leaves, fb, bb, ff, bf = spec
            leaves = [x.requires_grad_() for x in leaves]
            for backend, fn in fns.items():
                out0 = fn(*leaves)
                gout = torch.randn_like(out0)

                def fwd(fn: Callable = fn, leaves: list = leaves) -> None:
                    with torch.no_grad():
                        fn(*leaves)

                def fwd_bwd(fn: Callable = fn, leaves: list = leaves, gout=gout) -> None:
                    torch.autograd.grad(fn(*leaves), leaves, gout)

                for pas, call, nbytes, flops in (
                    ("fwd", fwd, fb, ff),
                    ("fwd+bwd", fwd_bwd, fb + bb, ff + bf),
                ):
                    modes = ["eager"] + (["graph"] if device.type == "cuda" else [])
                    for mode in modes:
                        if mode == "eager":
                            sec = time_eager(call, args.iters, args.warmup, device)
                        else:
                            sec = time_graph(call, args.iters, args.warmup)
                        gbs = nbytes / sec / 1e9
                        gfs = flops / sec / 1e9
                        rows.append(
                            {
                                "kernel": name,
                                "dtype": str(dtype).removeprefix("torch."),
                                "pass": pas,
                                "backend": backend,
                                "mode": mode,
                                "ms": sec * 1e3,
                                "bytes": nbytes,
                                "flops": flops,
                                "GB/s": gbs,
                                "GFLOP/s": gfs,
                                "hbm_frac": gbs / HBM_GBS,
                                "flop_frac": gfs / PEAK_GFLOPS[dtype],
                            }
                        )
                        w = rows[-1]
                        print(
                            f"{name:10s} {w['dtype']:8s} {pas:7s} {backend:9s} {mode:5s} "
                            f"{w['ms']:8.4f} ms {gbs:9.1f} GB/s ({100 * w['hbm_frac']:5.2f}%) "
                            f"{gfs:9.1f} GFLOP/s ({100 * w['flop_frac']:5.2f}%)",
                            flush=True,
                        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--roots", type=int, default=1800, help="R (600 events x 3)")
    parser.add_argument("--k", type=int, default=10, help="neighbours per root")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=50)
    parser.add_argument("--time-dim", type=int, default=100)
    parser.add_argument("--memory", type=int, default=100)
    parser.add_argument("--mail", type=int, default=200)
    parser.add_argument("--unique", type=int, default=2000, help="U unique nodes")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--kernels", nargs="+", default=["attention", "fused", "gru", "rnn"])
    parser.add_argument("--backends", nargs="+", default=["triton", "reference", "factored"])
    parser.add_argument("--edge-dims", type=int, nargs="+", default=[0, 172], help="fused's")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
    parser.add_argument("--out", type=Path, default=None, help="folder for bench_kernels.json")
    args = parser.parse_args()
    if args.quick:
        args.roots, args.unique, args.iters, args.warmup = 5, 7, 2, 1
    triton_on_cpu = args.device == "cpu" and "triton" in args.backends
    if triton_on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("triton on --device cpu runs its interpreter: set TRITON_INTERPRET=1")
    if args.threads:
        torch.set_num_threads(args.threads)
    info = {"torch": torch.__version__, "device": args.device, "threads": torch.get_num_threads()}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    print(" ".join(f"{key}={val}" for key, val in info.items()))
    rows = run(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "bench_kernels.json"
        keys = "roots k heads head_dim time_dim memory mail unique edge_dims".split()
        shapes = {key: getattr(args, key) for key in keys}
        path.write_text(json.dumps({"env": info, "shapes": shapes, "rows": rows}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
