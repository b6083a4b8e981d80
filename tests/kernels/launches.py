"""The Triton launches a CPU fit makes, recorded under the interpreter and compiled
for the H200 (sm_90) in a process without it.

The interpreter runs a kernel's arithmetic but never Triton's compiler, whose checks
(a loop-carried value's shape, dot shapes, layouts) a GPU run would otherwise be the
first to reach. A hand-written list of compile cases misses the variants nobody
listed; recording what a fit really launches (its kernels, their argument types and
constexprs) and compiling each variant ahead of time for ``cuda:90`` does not.

Run as ``python -m tests.kernels.launches record [--wide] OUT.json -- TRAINER_ARGS...``
(``--wide``: every evaluation batch takes the wide batches' path, as 100 MRR negatives
do, ``sven.models.base.WIDE_ROOTS`` set to 1) under
``TRITON_INTERPRET=1 SVEN_KERNELS=triton`` (a fit with the fixed-shape step CUDA
captures, every Triton launch recorded), then ``python -m tests.kernels.launches
compile OUT.json`` without the interpreter (prints a JSON report: variants and
failures).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_TORCH_TYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
}  # fmt: skip


def describe(value: Any) -> list[Any]:
    """A launch argument as JSON: its kind and what the compiler needs of it."""
    import torch

    if isinstance(value, torch.Tensor):
        return ["ptr", _TORCH_TYPES[str(value.dtype).removeprefix("torch.")]]
    if value is None:
        return ["none", None]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", value]
    name = getattr(value, "name", None)  # a triton.language dtype given as a constexpr
    if isinstance(name, str) and type(value).__module__.startswith("triton"):
        return ["tl", name]
    raise TypeError(f"cannot describe a launch argument of type {type(value).__name__}")


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Records every interpreted launch of Sven's kernels in the ``with`` block; when
    the block ends, the yielded list holds one dict per distinct variant (module,
    kernel, arguments by name, launch options)."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction

    from sven.kernels.ahead import _ours  # which kernels are Sven's: the dry run's test

    seen: dict[str, dict[str, Any]] = {}
    run = InterpretedFunction.run

    def recorded(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        fn = self.fn
        if _ours(self):
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
            spec = {"module": fn.__module__, "kernel": fn.__name__, "options": options,
                    "args": {k: describe(v) for k, v in bound.items()}}  # fmt: skip
            seen.setdefault(json.dumps(spec, sort_keys=True), spec)
            kwargs.update(options)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    records: list[dict[str, Any]] = []
    InterpretedFunction.run = recorded  # type: ignore[method-assign]
    try:
        yield records
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
        records.extend(seen.values())


def _signature(kernel: Any, args: dict[str, list[Any]]) -> tuple[dict, dict]:
    """Triton's ahead-of-time signature and constexprs of one recorded variant."""
    import triton.language as tl

    sig: dict[str, str] = {}
    consts: dict[tuple[int, ...], Any] = {}
    for i, p in enumerate(kernel.params):
        kind, value = args.get(p.name, ["default", p.default])
        if kind == "tl":
            value = getattr(tl, value)
        if p.is_constexpr or kind in ("none", "default", "tl"):
            sig[p.name] = "constexpr"
            consts[(i,)] = value
        elif kind == "ptr":
            sig[p.name] = "*" + value
        elif kind == "int":
            sig[p.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            sig[p.name] = {"float": "fp32", "bool": "i1"}[kind]
    return sig, consts


def _compile_one(spec: dict[str, Any]) -> str | None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    try:
        sig, consts = _signature(kernel, spec["args"])
        compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", 90, 32), options=spec["options"])  # fmt: skip
    except Exception as exc:
        consts = {k: v[1] for k, v in spec["args"].items() if v[0] not in ("ptr",)}
        return f"{spec['kernel']} {consts}: {type(exc).__name__}: {exc}"[-2500:]
    return None


def compile_all(specs: list[dict[str, Any]], threads: int = 2) -> dict[str, Any]:
    """Compiles each recorded variant for sm_90; the kernels' names and failures."""
    with ThreadPoolExecutor(threads) as pool:
        failures = [f for f in pool.map(_compile_one, specs) if f is not None]
    kernels = sorted({f"{s['module']}.{s['kernel']}" for s in specs})
    return {"variants": len(specs), "kernels": kernels, "failures": failures}


def _record_fit(out: Path, trainer_args: list[str], wide: bool = False) -> None:
    import sven
    import sven.engine.spec as spec_module
    import sven.models.base as base

    if wide:
        base.WIDE_ROOTS = 1

    # The fixed-shape step that CUDA captures, on the CPU: the GPU's launches.
    spec_module.fixed_shapes = lambda device, distributed: True
    with recording() as records, tempfile.TemporaryDirectory() as run:
        sven.Trainer(None, [f"out={run}", "quiet=true", *trainer_args]).fit()
    previous = json.loads(out.read_text()) if out.exists() else []
    merged = {json.dumps(s, sort_keys=True): s for s in [*previous, *records]}
    out.write_text(json.dumps(list(merged.values())))


def main(argv: list[str]) -> int:
    """``record [--wide] OUT -- ARGS...`` (adds to OUT) or ``compile OUT``."""
    wide = argv[1:2] == ["--wide"]
    if wide:
        argv = argv[:1] + argv[2:]
    if len(argv) >= 2 and argv[0] == "record":
        _record_fit(Path(argv[1]), [a for a in argv[2:] if a != "--"], wide)
        return 0
    if len(argv) == 2 and argv[0] == "compile":
        print(json.dumps(compile_all(json.loads(Path(argv[1]).read_text()))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
