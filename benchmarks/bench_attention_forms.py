"""The two forms of TGN's temporal attention, fused and factored, forward + backward.

``reference.temporal_attention_fused`` projects every neighbour slot's time encoding
(and edge features) to keys and values; ``reference.temporal_attention_factored``
carries the queries back through the key projection and projects the attention-weighted
sums forwards instead (the CPU path of ``TemporalAttentionLayer``). Both are timed on
the same inputs, interleaved, best of ``--repeats``; numbers, not a test.

Shapes (defaults): a TGN batch of 200 events, R = 600 roots (sources, destinations,
one negative each), K = 10 neighbours with 73% of the slots valid (CollegeMsg's mean),
gaps log-uniform in [1 s, 10^6 s],
H = 2 heads of D = 50, time encoding T = 100, U = 500 unique nodes; edge features of
width 0 (CollegeMsg) and 172 (Wikipedia).

Usage:
    python benchmarks/bench_attention_forms.py [--device cpu] [--threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sven.kernels import reference


def inputs(
    r: int, k: int, h: int, d: int, t: int, u: int, e: int, device: torch.device
) -> list[torch.Tensor | None]:
    """Random inputs of both forms; the float ones that get gradients require them."""
    gen = torch.Generator().manual_seed(0)
    o = h * d

    def rnd(*shape: int, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
        x = (torch.randn(*shape, generator=gen) * scale).to(device)
        return x.requires_grad_(grad)

    return [
        rnd(r, h, d, grad=True),
        rnd(u, 2 * o, grad=True),
        torch.randint(0, u, (r, k), generator=gen).to(device),
        # Gaps from a second to ten days, log-uniform: the time encoding's cos is much
        # slower on CPU for large arguments, so the spread matters.
        (10 ** (torch.rand(r, k, generator=gen) * 6)).to(device),
        (torch.rand(r, k, generator=gen) < 0.73).to(device),
        (1.0 / 10 ** torch.linspace(0, 9, t)).to(device),
        torch.zeros(t, device=device),
        rnd(2 * o, t, scale=t**-0.5, grad=True),
        rnd(r, k, e) if e else None,
        rnd(2 * o, e, scale=e**-0.5, grad=True) if e else None,
    ]


def fused(q, kvn, pos, dt, mask, tw, tb, wt, ef, we):  # type: ignore[no-untyped-def]
    kv_edge = None if ef is None else F.linear(ef, we)
    return reference.temporal_attention_fused(q, kvn, pos, dt, mask, tw, tb, wt, kv_edge)


def factored(q, kvn, pos, dt, mask, tw, tb, wt, ef, we):  # type: ignore[no-untyped-def]
    return reference.temporal_attention_factored(q, kvn, pos, dt, mask, tw, tb, wt, ef, we)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--roots", type=int, default=600)
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = []
    for e in (0, 172):
        x = inputs(args.roots, 10, 2, 50, 100, 500, e, device)
        leaves = [t for t in x if t is not None and t.requires_grad]
        dout = torch.randn(args.roots, 100, device=device)
        best = {"fused": float("inf"), "factored": float("inf")}
        for _ in range(args.repeats):
            for name, fn in (("fused", fused), ("factored", factored)):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                torch.autograd.grad(fn(*x), leaves, dout)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best[name] = min(best[name], time.perf_counter() - t0)
        row = {
            "edge_dim": e,
            "roots": args.roots,
            "fused_ms": best["fused"] * 1e3,
            "factored_ms": best["factored"] * 1e3,
            "speedup": best["fused"] / best["factored"],
        }
        results.append(row)
        print(
            f"edge_dim {e:3d}: fused {row['fused_ms']:.2f} ms, factored "
            f"{row['factored_ms']:.2f} ms (forward + backward): {row['speedup']:.2f}x"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"device": args.device, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
