"""Start-up of a run, from process start to the first training step, timed by phase.

A user feels the whole run, not the warm epoch's rate; :class:`StartupClock` says where
the seconds before the first step go (``summary.json``'s ``startup_s`` and
``startup_<phase>_s``, and one line of progress output). Phases:

- ``imports``: process start to the trainer's construction (the interpreter, torch,
  Sven's modules); measured from the kernel's record of the process start where there
  is one (Linux ``/proc``), so it includes what no Python timer sees;
- ``cuda_init``: CUDA's own initialisation (context creation on the device), apart so
  that Sven's part can be read without it;
- ``store_open``: ``meta.json``, headers and the value checks of the event store;
- ``plan``: where the run's tensors go and whether they fit (:mod:`sven.engine.plan`);
- ``checksums``: the store's sha256 over every byte
  (:func:`sven.datasets.checksums.verify_checksums`);
- ``to_device``: the event columns copied to the run's device;
- ``model``, ``tables``: the model, the T-CSR sampler and the step's event tables;
- ``optimizer``: Adam's construction, where ``torch.optim`` imports ``torch._dynamo``;
- ``run_start``: the run folder claimed and made, ``config.json``, a resume's checks;
- ``epoch_start``: the node state's reset and the exchange's capacities (on several
  ranks a replay of the epoch's batch building);
- ``first_batches``: the prefetch ring's first batches built (on CUDA the first calls
  of the selection's Triton kernels: hashes, sampler, de-duplication);
- ``preload``: the wait, at the end of the trainer's construction, for Triton's
  imports in a thread (:func:`preload_triton`; CUDA only): what the overlap with CUDA's
  start and the store's loading did not hide;
- ``first_step``: the first training step: on CUDA its warm-up runs (cuBLAS, Triton
  kernels compiled or loaded from the on-disk cache), the graph capture and the first
  replay, waited for;
- ``other``: the rest (logging, the progress bar, small bookkeeping).

What a run imports is kept to what it needs: pandas, pyarrow, torch_geometric,
matplotlib and (on CPU) triton are not imported by ``sven train``, nor the other
commands' modules: ``sven COMMAND`` builds only that command's parser
(:func:`sven.cli.build_parser`), and the config-key list of ``sven train --help``, which
reads the config's source, is built only when shown
(``tests/integration/test_startup.py``). Torch itself would import its compiler front
end (``torch._dynamo``, and with it triton: about as long as importing torch) in two
places a run without ``train.compile`` does not need it: ``torch.optim``'s methods,
wrapped for ``torch.compile`` (see :class:`sven.engine.optim.Optimizer`'s ``lean``),
and ``torch.use_deterministic_algorithms``, which imports the compiler to set one of
its flags (:func:`set_deterministic`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "TRITON_MODULES",
    "Preload",
    "StartupClock",
    "lean_adam",
    "preload_triton",
    "process_age_s",
    "set_deterministic",
    "triton_cache_dir",
    "undecorated",
]


def process_age_s() -> float | None:
    """Seconds since this process started, from ``/proc`` (Linux); None elsewhere.

    The kernel records the start in clock ticks since boot (10 ms on most systems).
    """
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Field 22 (starttime), counted after the command name's closing parenthesis.
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def set_deterministic(mode: bool, warn_only: bool = False) -> None:
    """``torch.use_deterministic_algorithms(mode, warn_only=warn_only)`` without
    importing torch's compiler.

    Torch's function also sets ``torch._inductor.config.deterministic``, importing the
    compiler (and ``torch._dynamo``) for it; here that flag is set only where the
    compiler is loaded already (``train.compile``). Compilation reads it when it runs,
    inside the step's own determinism context, which sets it through this function.
    """
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = mode
    torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


def undecorated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without the wrappers (``functools.wraps``) torch put around it."""
    return inspect.unwrap(fn)


def lean_adam() -> bool:
    """Whether torch's Adam can run without importing ``torch._dynamo`` (see
    :class:`sven.engine.optim.Optimizer`); prepares it where it can.

    Adam's step calls the functional ``torch.optim.adam.adam``, which torch wraps in a
    ``torch._dynamo.disable`` that imports the compiler at its first call and caches
    the disabled function on the wrapped one (``__dynamo_disable``). Setting that cache
    to the function itself, before anything compiles, leaves the eager call as it is
    and skips the import. Not done once the compiler is loaded (a compiled optimizer
    may rely on the real one), nor on a torch without these attributes.
    """
    if "torch._dynamo" in sys.modules:
        return False
    from torch.optim import adam

    fn = getattr(adam.adam, "__wrapped__", None)
    if fn is None or not hasattr(torch.optim.Adam.step, "__wrapped__"):
        return False
    if getattr(fn, "__dynamo_disable", None) is None:
        fn.__dynamo_disable = fn  # type: ignore[attr-defined]
    return True


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels between runs: ``TRITON_CACHE_DIR``, else
    ``$TRITON_HOME/.triton/cache`` (``TRITON_HOME`` defaults to the home folder).

    A kernel compiled once loads from there in later processes (tens of ms instead of
    a compilation); the same holds for Sven's hash kernels and, with
    ``train.compile``, for inductor's, which keeps its own cache under
    ``TORCHINDUCTOR_CACHE_DIR``.
    """
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")


#: Sven's Triton kernels (:mod:`sven.kernels`), each module imported at its first call on
#: CUDA: the selection's (hashes, sampler, de-duplication) in the first batches, the
#: model's in the first step.
TRITON_MODULES = (
    "sven.kernels.triton_hash",
    "sven.kernels.triton_sampler",
    "sven.kernels.triton_dedupe",
    "sven.kernels.triton_rnn",
    "sven.kernels.triton_attention",
    "sven.kernels.triton_factored",
    "sven.kernels.triton_decoder",
)


class Preload:
    """Imports ``modules``, then calls ``then``, in a daemon thread while the caller
    works on; :meth:`join` waits for it.

    Python's import locks keep this safe: a module the caller imports meanwhile is
    either loaded already or waited for. The thread only overlaps work that releases the
    GIL (CUDA's start, the checksums, the copies to the device); a failure is kept in
    :attr:`error`, not raised, since the caller's own import or call at the module's
    first use raises it where it belongs.

    Args:
        modules: Names of the modules to import, in order.
        then: Called once they are imported (None: nothing).
    """

    def __init__(self, modules: Sequence[str], then: Callable[[], Any] | None = None) -> None:
        self.error: Exception | None = None
        self._thread = threading.Thread(
            target=self._run, args=(tuple(modules), then), name="sven-preload", daemon=True
        )
        self._thread.start()

    def _run(self, modules: tuple[str, ...], then: Callable[[], Any] | None) -> None:
        try:
            for name in modules:
                importlib.import_module(name)
            if then is not None:
                then()
        except Exception as exc:  # kept for the caller (see the class)
            self.error = exc

    def join(self) -> float:
        """Waits for the thread; returns the seconds waited."""
        t = time.perf_counter()
        self._thread.join()
        return time.perf_counter() - t


def _triton_driver() -> None:
    """Triton's driver made active: its launcher utilities built or loaded from the
    on-disk cache and the CUDA library located (no CUDA context is touched)."""
    import triton

    _ = triton.runtime.driver.active


def preload_triton(device: str | torch.device) -> Preload | None:
    """On a CUDA run whose kernels may take Triton: ``import triton``, Sven's Triton
    modules (:data:`TRITON_MODULES`) and Triton's driver, in a :class:`Preload` thread
    that overlaps CUDA's start and the store's loading (each module is otherwise
    imported inside the first batches or the first step). None where nothing is
    preloaded: CPU, no triton installed, ``SVEN_KERNELS=reference``.

    Args:
        device: The run's ``train.device`` (``auto`` counts as CUDA where there is one).
    """
    name = str(device)
    cuda = name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())
    mode = os.environ.get("SVEN_KERNELS", "").strip().lower()
    if not cuda or mode.startswith("reference"):
        return None
    try:
        if importlib.util.find_spec("triton") is None:
            return None
    except (ImportError, ValueError):
        return None
    return Preload(("triton", *TRITON_MODULES), then=_triton_driver)


class StartupClock:
    """Wall time of each start-up phase (seconds), in the order they ran.

    Args:
        age_s: Seconds the process had run when the clock was made (the ``imports``
            phase); None where unknown (the phase is then left out).
    """

    def __init__(self, age_s: float | None = None) -> None:
        self.parts: dict[str, float] = {}
        self._t0 = time.perf_counter()
        self._offset = age_s or 0.0
        if age_s is not None:
            self.parts["imports"] = age_s
        self.done = False

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Adds the time of the ``with`` block to phase ``name``."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        """Adds ``seconds`` to phase ``name``."""
        if not self.done:
            self.parts[name] = self.parts.get(name, 0.0) + seconds

    def finish(self) -> None:
        """Stops the clock (at the end of the first training step); later phases are
        ignored."""
        if not self.done:
            self.total = self._offset + time.perf_counter() - self._t0
            self.done = True

    def elapsed(self) -> float:
        """Seconds from process start (or the clock's creation) to now or to finish."""
        if self.done:
            return self.total
        return self._offset + time.perf_counter() - self._t0

    def summary(self) -> dict[str, float]:
        """``startup_s`` (process start to the end of the first step), each measured
        phase as ``startup_<phase>_s`` (``startup_other_s`` is the rest: logging, the
        progress bar) and ``startup_s_without_cuda_init``; flat, for summary.json."""
        total = self.elapsed()
        out = {"startup_s": round(total, 4)}
        for k, v in self.parts.items():
            out[f"startup_{k}_s"] = round(v, 4)
        out["startup_other_s"] = round(max(total - sum(self.parts.values()), 0.0), 4)
        out["startup_s_without_cuda_init"] = round(total - self.parts.get("cuda_init", 0.0), 4)
        return out

    def line(self) -> str:
        """One line of progress output: the total and the phases over 10 ms."""
        s = self.summary()
        parts = ", ".join(
            f"{k[len('startup_') : -2]} {v:.2f}"
            for k, v in s.items()
            if k != "startup_s" and k.startswith("startup_") and k.endswith("_s") and v >= 0.01
        )
        return f"start-up {s['startup_s']:.2f} s to the first step ({parts})"
