"""How many kernels a fixed-shape training step launches, and from which line of Sven.

Runs the step that a CUDA graph captures (static capacities, padded de-duplication, the
prefetch ring) eagerly, on any device, and counts what it dispatches: every ATen
operator that launches work (views, allocations and metadata excluded) and every Triton
launch, each under the innermost line of Sven that issued it (operators of the backward
pass under ``backward``). On the CPU this is the census of the captured CUDA step that
a change can be checked against without a GPU; on CUDA, ``profile_step.py`` counts the
kernels themselves (an operator may launch more than one).

Usage:
    python benchmarks/census_step.py --data STORE [--steps 3] [--json OUT.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sven
import sven.engine.spec as spec_module

_ROOTS = ("sven", "pipeline", "partition", "datasets")
# Operators that allocate, alias or read metadata: no kernel.
_FREE = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "_unsafe_view",
    "promote_types",
    "_record_function_enter_new",
    "_record_function_exit",
    "detach",
    "alias",
    "lift_fresh",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "_local_scalar_dense",
    "is_nonzero",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "record_stream",
    "set_",
    "resize_",
}


def _site() -> str:
    repo = Path(sven.__file__).resolve().parent.parent
    if torch._C._current_autograd_node() is not None:
        # In the backward: the stack ends at the line that called it.
        return _backward_site(repo)
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(repo) and path.relative_to(repo).parts[0] in _ROOTS:
            if "census_step" in path.name:
                continue
            return f"{path.relative_to(repo)}:{frame.lineno} {frame.name}"
    return "backward"


def _backward_site(repo: Path) -> str:
    """The forward line of Sven that made the autograd node now running its backward,
    where anomaly mode recorded it (``--backward-sites``), else ``backward``."""
    node = torch._C._current_autograd_node()
    trace = None if node is None else node.metadata.get("traceback_")
    for line in reversed(trace or []):
        # 'File "PATH", line N, in NAME' lines, innermost last.
        head = line.strip().split("\n")[0]
        if not head.startswith('File "'):
            continue
        path = Path(head.split('"')[1]).resolve()
        if path.is_relative_to(repo) and path.relative_to(repo).parts[0] in _ROOTS:
            lineno = head.split(", line ")[1].split(",")[0]
            return f"backward of {path.relative_to(repo)}:{lineno} {head.rsplit(' in ', 1)[-1]}"
    return "backward"


class Census(TorchDispatchMode):
    """Counts the kernel-launching operators dispatched while active, by site."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, str]] = Counter()
        self.on = False
        # Under torch.profiler (``--kernels``): each counted operator in a range named by
        # its site, so that the device kernels it launches can be attributed to it.
        self.mark = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.on:
            name = func.overloadpacket.__name__
            if not (func.is_view or name in _FREE):
                site = _site()
                self.ops[(site, name)] += 1
                if self.mark:
                    with torch.profiler.record_function(f"@{site}|{name}"):
                        return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _count_triton(census: Census) -> None:
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    for cls in (JITFunction, InterpretedFunction):
        cls.run = _counted(cls.run, census)  # type: ignore[method-assign]


def _counted(run: Any, census: Census) -> Any:
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not census.on:
            return run(self, *args, **kwargs)
        site, name = _site(), f"triton:{self.fn.__name__}"
        census.ops[(site, name)] += 1
        # Under Triton's interpreter a launch runs torch operators of its own: not kernels.
        census.on = False
        try:
            if census.mark:
                with torch.profiler.record_function(f"@{site}|{name}"):
                    return run(self, *args, **kwargs)
            return run(self, *args, **kwargs)
        finally:
            census.on = True

    return counted


def _dispatch_as_cuda() -> None:
    """Makes ``auto`` pick what it picks for CUDA tensors, for CPU tensors."""
    from sven import kernels
    from sven.engine import optim
    from sven.kernels import backend, sums

    kernels.reset_backend()
    mode, _, has_triton, per_fn = backend._read_state()
    if mode != "auto" or not has_triton:
        raise SystemExit("--as-cuda needs SVEN_KERNELS=auto (or unset) and triton installed")

    def backend_for(t: torch.Tensor, name: str | None = None) -> str:
        return per_fn.get(name, "triton" if name in kernels.AUTO_TRITON else "reference")

    # Every module that bound the choice by name asks the patched one.
    for module in (kernels, backend, sums, optim):
        module.backend_for = backend_for  # type: ignore[attr-defined]
    kernels.hash_backend = lambda t: "triton"  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the census here")
    ap.add_argument("--top", type=int, default=60, help="sites to print")
    ap.add_argument(
        "--as-cuda",
        action="store_true",
        help="on the CPU, dispatch the kernels as SVEN_KERNELS=auto does on CUDA (Triton's "
        "interpreter: needs TRITON_INTERPRET=1) and use the fused attention form",
    )
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="on CUDA: count the device kernels each site launches (torch.profiler), "
        "beside its operators",
    )
    ap.add_argument(
        "--backward-sites",
        action="store_true",
        help="name each backward operator by the forward line that made its autograd node "
        "(anomaly mode records it: slower)",
    )
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()
    if args.as_cuda:
        _dispatch_as_cuda()
        args.overrides = ["model.attention_form=fused", *args.overrides]
    # The step that CUDA captures, on any device.
    spec_module.fixed_shapes = lambda device, distributed: True  # type: ignore[assignment]
    census = Census()
    _count_triton(census)
    with tempfile.TemporaryDirectory() as run:
        tr = sven.Trainer(
            None,
            [
                f"data.path={args.data}",
                f"out={run}",
                "quiet=true",
                "train.cuda_graph=off",
                *args.overrides,
            ],
        )
        st, b = tr.step, tr.cfg.train.batch_size
        lo, _ = tr.ranges["train"]
        n = args.warmup + args.steps
        st.plan_capacities(0)
        st.start_epoch(0, 0, n)
        prof = None
        anomaly = torch.autograd.set_detect_anomaly(args.backward_sites, check_nan=False)
        with anomaly, census:
            for i in range(n):
                census.on = i >= args.warmup
                if census.on and args.kernels and prof is None:
                    census.mark = True
                    prof = torch.profiler.profile(
                        activities=[
                            torch.profiler.ProfilerActivity.CUDA,
                            torch.profiler.ProfilerActivity.CPU,
                        ]
                    )
                    prof.__enter__()
                st.train_batch(0, i, lo + i * b, lo + (i + 1) * b)
                if tr.device.type == "cuda":
                    torch.cuda.synchronize()
            census.on = False
            if prof is not None:
                prof.__exit__(None, None, None)
        model = tr.cfg.model.name
    if prof is not None:
        _print_kernels(prof, args.steps, args.top, args.json)
    per_step = {k: v / args.steps for k, v in census.ops.items()}
    total = sum(per_step.values())
    by_site: Counter[str] = Counter()
    for (site, _), v in per_step.items():
        by_site[site] += v
    print(f"model: {model}")
    print(f"kernels per step: {total:.0f}")
    for site, v in by_site.most_common(args.top):
        ranked = sorted(per_step.items(), key=lambda x: -x[1])
        ops = ", ".join(f"{op}x{c:g}" for (s, op), c in ranked if s == site)
        print(f"{v:6.1f}  {site}  [{ops}]")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": model,
                    "kernels_per_step": total,
                    "ops": [
                        {"site": s, "op": o, "per_step": c}
                        for (s, o), c in sorted(per_step.items(), key=lambda x: -x[1])
                    ],
                },
                indent=1,
            )
        )
    sys.stdout.flush()


def _subtree_kernels(e: Any) -> list[Any]:
    out = list(e.kernels)
    for c in e.cpu_children:
        out += _subtree_kernels(c)
    return out


def _print_kernels(prof: Any, steps: int, top: int, json_path: str | None) -> None:
    """Device kernels per step by the site whose operator launched them."""
    per: Counter[str] = Counter()
    us: Counter[str] = Counter()
    names: dict[str, Counter[str]] = {}
    for e in prof.events():
        if not e.name.startswith("@"):
            continue
        site, op = e.name[1:].split("|", 1)
        for k in _subtree_kernels(e):
            per[site] += 1 / steps
            us[site] += k.duration / steps
            names.setdefault(site, Counter())[f"{op}:{k.name[:40]}"] += 1 / steps
    print(f"device kernels per step: {sum(per.values()):.0f} ({sum(us.values()):.1f} us)")
    for site, v in per.most_common(top):
        ks = ", ".join(f"{n}x{c:g}" for n, c in names[site].most_common(8))
        print(f"{v:6.1f} {us[site]:7.1f}us  {site}  [{ks}]")
    if json_path:
        Path(json_path).with_suffix(".kernels.json").write_text(
            json.dumps(
                [
                    {"site": s, "kernels": per[s], "us": us[s], "names": dict(names[s])}
                    for s, _ in per.most_common()
                ],
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
