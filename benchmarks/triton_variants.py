"""The Triton kernel variants one run compiles, counted on the CPU.

On an empty Triton cache every variant is a compile (docs/performance.md has the
seconds), and a variant is a kernel with one set of constexprs, argument dtypes,
pointer alignments (16 bytes) and integer facts (equal to 1, divisible by 16). This
runs a fit under Triton's interpreter with the kernels dispatched as ``auto`` does on
CUDA (``census_step.py --as-cuda``), keys each launch as the JIT would (honouring
``do_not_specialize`` and ``do_not_specialize_on_alignment``), and lists the variants by
the phase that first asked for them (plan, train, eval) with the launching line. Where
a kernel has several, it prints what tells them apart.

Usage (a small store is enough; the sizes only change integer facts):
    TRITON_INTERPRET=1 python benchmarks/triton_variants.py --data STORE [overrides]
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import census_step

import sven
import sven.engine.spec as spec_module


def variant_key(fn: Any, options: dict[str, Any], args: tuple, kwargs: dict) -> tuple:
    """The JIT's specialisation of one launch of ``fn`` (an interpreted kernel)."""
    sig = inspect.signature(fn.fn)
    no_value = set(options.get("do_not_specialize") or ())
    no_align = set(options.get("do_not_specialize_on_alignment") or ())
    launch = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    parts: list[tuple] = [("launch", launch)]
    for name, v in bound.arguments.items():
        if "constexpr" in str(sig.parameters[name].annotation):
            parts.append((name, "constexpr", str(v) if isinstance(v, torch.dtype) else v))
        elif isinstance(v, torch.Tensor):
            aligned = name not in no_align and v.data_ptr() % 16 == 0
            parts.append((name, str(v.dtype), "aligned" if aligned else "any address"))
        elif isinstance(v, bool) or not isinstance(v, int):
            parts.append((name, type(v).__name__))
        elif name in no_value:
            parts.append((name, "int"))
        else:
            parts.append((name, "int", "== 1" if v == 1 else "% 16 == 0" if v % 16 == 0 else ""))
    return tuple(parts)


def _phase() -> str:
    names = [f.name for f in traceback.extract_stack(limit=60)]
    if any("plan" in n for n in names):
        return "plan"
    if any(w in n for n in names for w in ("eval", "score", "test")):
        return "eval"
    return "train"


def _site() -> str:
    for f in reversed(traceback.extract_stack(limit=16)):
        if any(p in f.filename for p in ("/sven/", "/pipeline/", "/datasets/", "/partition/")):
            return f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}"
    return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="an event store")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args()
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, list[tuple]] = defaultdict(list)
    first: dict[tuple[str, tuple], tuple[str, str]] = {}
    run = InterpretedFunction.run

    def keyed(self: Any, *a: Any, grid: Any, warmup: Any, **kw: Any) -> Any:
        key = variant_key(self, self.kwargs, a, kw)
        name = self.fn.__name__
        if key not in seen[name]:
            seen[name].append(key)
            first[(name, key)] = (_phase(), _site())
        return run(self, *a, grid=grid, warmup=warmup, **kw)

    InterpretedFunction.run = keyed  # type: ignore[method-assign]
    census_step._dispatch_as_cuda()
    # The fixed-shape step CUDA captures, on the CPU.
    spec_module.fixed_shapes = lambda device, distributed: True  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"data.path={args.data}", f"out={out}", "quiet=true"]
        overrides += ["train.cuda_graph=off", "model.attention_form=fused", "train.epochs=1"]
        sven.Trainer(None, [*overrides, *args.overrides]).fit()
    phases = Counter(phase for phase, _ in first.values())
    for (name, _), (phase, site) in sorted(first.items(), key=lambda x: (x[1][0], x[0][0])):
        print(f"{phase:6s} {name:32s} {site}")
    print(f"variants: {len(first)} ({', '.join(f'{p} {n}' for p, n in sorted(phases.items()))})")
    for name, keys in seen.items():
        if len(keys) < 2:
            continue
        print(f"{name}: {len(keys)} variants")
        for key in keys:
            differ = [p for p in key if any(p not in other for other in keys if other != key)]
            print(f"    {first[(name, key)][0]:6s} {differ}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
