"""Compiling a step's Triton kernels ahead of its first run, side by side.

On an empty Triton cache every kernel variant a step launches is compiled at its
first launch, one after another, while the GPU waits. :func:`compile_ahead` runs the
step once as a *dry run*: every launch of one of Sven's kernels is only looked up
(Triton's warm-up launch: compiled and loaded, never run), and a variant not loaded yet
is recorded instead of compiled (Triton's ``jit_cache_hook``). The recorded variants
are then compiled on a pool of threads (Triton's compiler passes and ``ptxas`` run
outside the GIL) and loaded into each kernel's cache (``JITFunction.preload``), so
that the step's real runs find every kernel ready.

A dry run runs none of Sven's kernels, so their outputs hold whatever memory they
were given. The caller puts the state back afterwards (:func:`sven.engine.capture.
undone`); what must still be right are integers that index tensors later in the step,
since an index out of range stops a CUDA process. Every function whose Triton kernel
produces such integers (the counter hashes' draws, the sampler's neighbours, the
events' selection, the de-duplication) therefore also runs its reference during a
dry run and returns that (:func:`dry_running`). The CPU tests dry-run a fit under
Triton's interpreter with new memory filled with out-of-range values, and compare
the state after it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AheadReport", "available", "compile_ahead", "dry_run", "dry_running"]

#: Module prefixes of the kernels a dry run holds back (Sven's own; torch's and
#: other libraries' Triton kernels launch as usual).
_OURS = ("sven.", "pipeline.", "partition.", "datasets.")
# The dry run in progress, if any: its records (kernel, specialisation, device).
_active: list[tuple[Any, str, int]] | None = None
_lock = threading.Lock()


def dry_running() -> bool:
    """Whether a dry run is running: Sven's kernels launch as look-ups only, so a
    function whose Triton outputs index tensors later returns its reference's."""
    return _active is not None


def available() -> bool:
    """Whether this Triton offers what a dry run needs (the compile hook and
    ``JITFunction.preload``) and compiling ahead is not turned off
    (``SVEN_COMPILE_AHEAD=0``)."""
    if os.environ.get("SVEN_COMPILE_AHEAD", "1").strip() == "0":
        return False
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)
    return (
        knobs is not None
        and hasattr(knobs.runtime, "jit_cache_hook")
        and hasattr(JITFunction, "preload")
        and "warmup" in inspect.signature(JITFunction.run).parameters
    )


def _ours(kernel: Any) -> bool:
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__module__", "").startswith(_OURS)


def _record(
    *, key: Any, repr: str, fn: Any, compile: dict, is_manual_warmup: bool, **_: Any
) -> bool | None:
    """Triton's ``jit_cache_hook``: a variant of Sven's not loaded yet is recorded, and
    its compile skipped (True); anything else compiles as usual (None)."""
    records = _active
    if records is None or not _ours(fn.jit_function):
        return None
    with _lock:
        records.append((fn.jit_function, compile["specialization_data"], compile["device"]))
    return True


def _kernel_classes() -> list[type]:
    """The classes whose ``run`` launches a kernel: the JIT's, and the interpreter's."""
    from triton.runtime.jit import JITFunction

    classes: list[type] = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return classes
    return [*classes, InterpretedFunction]


@contextlib.contextmanager
def dry_run() -> Iterator[list[tuple[Any, str, int]]]:
    """Runs the ``with`` block as a dry run; yields the list the variants it asked
    for and that were not loaded are appended to (kernel, specialisation, device).

    Only the calling thread's launches of Sven's kernels become look-ups. Under
    Triton's interpreter (CPU) they are skipped as well, and nothing is recorded:
    there is nothing to compile.
    """
    global _active
    import triton

    if _active is not None:
        raise RuntimeError("a dry run is already running")
    records: list[tuple[Any, str, int]] = []
    owner = threading.get_ident()
    runs = {cls: cls.run for cls in _kernel_classes()}
    previous_hook = triton.knobs.runtime.jit_cache_hook

    def look_up(run: Callable[..., Any]) -> Callable[..., Any]:
        def run_or_look_up(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            # A warm-up launch compiles and loads the kernel but never runs it.
            warmup = warmup or (threading.get_ident() == owner and _ours(self))
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

        return run_or_look_up

    def hook(**kwargs: Any) -> bool | None:
        mine = _record(**kwargs) if threading.get_ident() == owner else None
        if mine is None and previous_hook is not None:
            return previous_hook(**kwargs)
        return mine

    for cls, run in runs.items():
        cls.run = look_up(run)  # type: ignore[method-assign]
    triton.knobs.runtime.jit_cache_hook = hook
    _active = records
    try:
        yield records
    finally:
        _active = None
        triton.knobs.runtime.jit_cache_hook = previous_hook
        for cls, run in runs.items():
            cls.run = run  # type: ignore[method-assign]


@dataclass
class AheadReport:
    """What :func:`compile_ahead` did.

    Attributes:
        variants: Kernel variants the dry run found not loaded, compiled (or read
            from Triton's disk cache) and loaded on the pool.
        threads: Threads of the pool.
        dry_run_s: Seconds of the dry run itself.
        compile_s: Seconds from the pool's start to its last variant loaded.
        failed: Variants whose compile failed (each compiles again at its first
            launch, which raises the compiler's error where it belongs).
    """

    variants: int = 0
    threads: int = 0
    dry_run_s: float = 0.0
    compile_s: float = 0.0
    failed: list[str] = field(default_factory=list)


def _threads(n: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(n, cores, 32))


def _preload(item: tuple[Any, str, int]) -> str | None:
    kernel, data, device = item
    import torch

    # A new thread's current CUDA device is the first one; the kernel is loaded for
    # the device the dry run launched it on.
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    try:
        kernel.preload(data)
    except Exception as exc:  # the real launch raises it where it belongs
        return f"{getattr(kernel.fn, '__name__', kernel)}: {type(exc).__name__}: {exc}"
    return None


def compile_ahead(step: Callable[[], None]) -> AheadReport:
    """Dry-runs ``step`` once, then compiles and loads the kernels it found missing.

    The step's effects on tensors are garbage (its kernels do not run): the caller
    restores what it changes. Nothing is dry-run where :func:`available` is False.

    Args:
        step: The step function (no arguments, results written in place).

    Returns:
        What was compiled, and the seconds it took.
    """
    report = AheadReport()
    if not available():
        return report
    t0 = time.perf_counter()
    with dry_run() as records:
        step()
    report.dry_run_s = time.perf_counter() - t0
    # One record per variant: a kernel launched twice with the same variant in the
    # dry run is recorded twice (the second launch missed the cache too).
    unique = list({(id(k), data): (k, data, dev) for k, data, dev in records}.values())
    report.variants = len(unique)
    if not unique:
        return report
    from concurrent.futures import ThreadPoolExecutor

    report.threads = _threads(len(unique))
    t1 = time.perf_counter()
    with ThreadPoolExecutor(report.threads, thread_name_prefix="sven-compile") as pool:
        report.failed = [e for e in pool.map(_preload, unique) if e is not None]
    report.compile_s = time.perf_counter() - t1
    return report
