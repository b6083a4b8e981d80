"""Running a step function as one captured CUDA graph, and the modes around it.

:class:`StepGraph` runs a step eagerly or captures it once and replays it (the
per-kernel launch cost bounds a small temporal-GNN step, and a replay removes it);
:func:`undone` puts the state back after a capture's warm-up runs, so that the first
replay continues exactly where an eager run would. :func:`determinism` is the
arithmetic mode a step runs in: torch's deterministic mode off on CUDA (the step is
deterministic by construction), on without its fill of new tensors on CPU.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from sven.engine.startup import set_deterministic
from sven.kernels.ahead import AheadReport

#: Held while a CUDA graph is captured, and by the threads that issue CUDA work beside
#: the run (the checkpoint's background commit copies node state to the host): in
#: CUDA's global capture mode a copy, a synchronisation or a pinned allocation from any
#: thread of the process invalidates the capture in progress
#: (``cudaErrorStreamCaptureInvalidated``), so the two take turns.
CUDA_SIDE_WORK = threading.Lock()

__all__ = [
    "StepGraph",
    "determinism",
    "no_collection",
    "no_uninitialized_fill",
    "torch_determinism_off",
    "undone",
]


@contextlib.contextmanager
def torch_determinism_off(active: bool = True) -> Iterator[None]:
    """Turns ``torch.use_deterministic_algorithms`` off for the fixed-shape CUDA step.

    The step is deterministic by construction: repeated rows' gradients are summed by
    the embedding backward (sorted segments, see ``models.base.take_rows``), writes go
    to distinct rows (losers to a scratch row), winners are chosen by max-scatters, and
    duplicate slot writes store equal values. Torch's deterministic mode would add
    nothing to that but a fill of every new tensor and sort-based ``index_put_`` for
    every scatter (a third of a TGN step on CUDA: docs/performance.md). A GPU test
    checks that two runs give bitwise equal parameters.
    """
    if not active:
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    # sven.engine.startup's setter: torch's own imports its compiler at the first step.
    set_deterministic(False)
    try:
        yield
    finally:
        set_deterministic(was, warn_only=warn)


@contextlib.contextmanager
def no_uninitialized_fill() -> Iterator[None]:
    """Keeps deterministic algorithms but stops torch filling every new tensor.

    With ``torch.use_deterministic_algorithms(True)`` torch also writes NaN into every
    tensor it allocates uninitialized, so that a read of uninitialized memory cannot
    differ between runs. The step never reads memory it has not written (on CUDA it
    runs with the whole mode off, and the GPU test finds two runs bitwise equal), so
    on CPU the fill is pure cost, most of it the fill of index_select's gathered keys
    and values (docs/performance.md, "On CPU", has its share of the step).
    """
    fill = torch.utils.deterministic
    was = fill.fill_uninitialized_memory
    fill.fill_uninitialized_memory = False
    try:
        yield
    finally:
        fill.fill_uninitialized_memory = was


class StepGraph:
    """Runs a step function eagerly, or captured once as a CUDA graph and replayed.

    The function reads its inputs from tensors whose addresses do not change (the
    caller refills them in place before each call) and writes its results in place.
    Capture needs warm-up runs (lazy initialisation: optimizer state, cuBLAS handles,
    Triton compilation); they modify the state, so the tensors ``state()`` lists are
    saved before and restored after them, and the optimizer's state is put back in
    place (zeroed where the warm-up created it), so the first replay continues exactly
    where the eager run would.

    Args:
        fn: The step; no arguments, no return value.
        mode: "on" (capture, fail loudly), "off" (eager) or "auto" (capture on CUDA,
            fall back to eager with a notice if capture fails).
        device: Where the step runs; capture needs CUDA.
        state: Returns the tensors the step modifies (parameters, memory buffers,
            accumulators), restored after the warm-up.
        optimizer: Its state is restored after the warm-up too, or None.
        warmup: Eager runs before capture.
        log: Where notices go.
        compile_ahead: Dry-run the step once before the warm-up and compile the Triton
            kernels it launches side by side (:mod:`sven.kernels.ahead`).
        quiet: A context the warm-up (and the dry run) runs in, which keeps the step
            from changing what ``state()`` leaves out (node state written to its
            scratch row only: :meth:`~sven.models.memory.MemoryState.writes_to_scratch`),
            or None.
    """

    def __init__(
        self,
        fn: Callable[[], None],
        *,
        mode: str,
        device: torch.device,
        state: Callable[[], list[torch.Tensor]],
        optimizer: torch.optim.Optimizer | None = None,
        warmup: int = 2,
        log: Callable[[str], None] = print,
        compile_ahead: bool = True,
        quiet: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graph must be auto, on or off, got {mode!r}")
        if mode == "on" and device.type != "cuda":
            raise ValueError("train.cuda_graph=on needs a CUDA device")
        self.fn = fn
        self.mode = mode if device.type == "cuda" else "off"
        self.state = state
        self.optimizer = optimizer
        self.warmup = warmup
        self.log = log
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured = False
        #: Seconds of the capture's warm-up runs (cuBLAS, Triton kernels compiled or
        #: loaded from the disk cache) and of the capture itself; 0 until captured.
        self.warmup_s = 0.0
        self.capture_s = 0.0
        self.compile_ahead = compile_ahead
        self.quiet = quiet if quiet is not None else contextlib.nullcontext
        #: What compiling ahead did (None until a capture ran it).
        self.ahead: AheadReport | None = None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        if self.mode == "off":
            self.fn()
            return
        try:
            graph = self._capture()
        except Exception as exc:
            if self.mode == "on":
                raise
            self.log(f"sven: CUDA-graph capture failed ({type(exc).__name__}: {exc}); eager")
            self.mode = "off"
            self.graph = None
            self.fn()
            return
        graph.replay()

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Warms up, captures the graph and keeps it (the state put back as it was)."""
        side = torch.cuda.Stream()
        # The warm-up runs real steps (and a failed capture may run part of one): the
        # state is put back as it was, so the first replay continues where the eager
        # run would (tested on CPU through rehearse()).
        with undone(self.state, self.optimizer):
            # The warm-up's stream starts after the state's snapshot, queued on the
            # current stream just now: a stream that waited before it would run the
            # warm-up beside the copies, which then save some of its writes.
            side.wait_stream(torch.cuda.current_stream())
            t0 = time.perf_counter()
            with torch.cuda.stream(side), self.quiet():
                if self.compile_ahead:
                    self._compile_ahead()
                for _ in range(self.warmup):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            self.warmup_s = time.perf_counter() - t0
            graph = torch.cuda.CUDAGraph()
            with CUDA_SIDE_WORK, no_collection(), torch.cuda.graph(graph):
                self.fn()
            torch.cuda.synchronize()
            self.capture_s = time.perf_counter() - t0 - self.warmup_s
        self.graph = graph
        self.captured = True
        return graph

    def _compile_ahead(self) -> None:
        """Compiles the step's missing Triton kernels side by side before the warm-up
        (:func:`sven.kernels.ahead.compile_ahead`; the warm-up's undo puts back what
        its dry run wrote). A failed dry run costs only its time: the warm-up then
        compiles each kernel at its first launch, as without it."""
        from sven.kernels import ahead

        try:
            self.ahead = ahead.compile_ahead(self.fn)
        except Exception as exc:  # the warm-up below raises real errors
            self.log(f"sven: compiling ahead failed ({type(exc).__name__}: {exc}); skipped")
            return
        for failure in self.ahead.failed:
            self.log(f"sven: compiling ahead: {failure}")

    def rehearse(self) -> None:
        """The warm-up of a capture without the capture: ``warmup`` eager runs, then the
        state put back (:func:`undone`). On any device; afterwards the state must be
        exactly as before (the CPU tests check parameters, optimizer and memory)."""
        with undone(self.state, self.optimizer), self.quiet():
            for _ in range(self.warmup):
                self.fn()


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No garbage collection inside the block: the garbage is collected on entry, and
    automatic collection is off until the exit (as it was before, after).

    Collecting during a capture frees whatever sat in reference cycles: another
    trainer's captured graph or pinned tables, whose release is a CUDA call that a
    capture forbids (the process aborted, once, in the GPU suite). torch (from 2.9)
    no longer collects before a capture itself.
    """
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def undone(
    state: Callable[[], list[torch.Tensor]], optimizer: torch.optim.Optimizer | None = None
) -> Iterator[None]:
    """Runs the ``with`` block, then puts back in place the tensors ``state()`` lists and
    the optimizer's state (state the block created goes to zero: Adam's initial state).
    The copies are whole before the block starts (on CUDA it waits for them), so the
    block's work may run on any stream.

    Args:
        state: The tensors the block may modify (parameters, memory, accumulators).
        optimizer: Its state is restored too, or None.
    """
    saved = _copies(state())
    opt_saved = _optimizer_tensors(optimizer)
    # On CUDA the copies are queued on the current stream: the block starts once they
    # are taken, so that no work of its, on any stream, is saved with them (a step
    # over pinned host state writes its rows long before a copy of the whole table
    # over the host link ends: docs/scale.md).
    _settle()
    try:
        yield
    finally:
        _settle()
        with torch.no_grad():
            for t, s in zip(state(), saved, strict=True):
                t.copy_(s)
            _restore_optimizer(optimizer, opt_saved)


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (on CUDA queued on the current stream)."""
    return [t.detach().clone() for t in tensors]


def _settle() -> None:
    """Waits for the device's queued work, where CUDA is in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _optimizer_tensors(opt: torch.optim.Optimizer | None) -> dict[int, dict[str, Any]]:
    if opt is None:
        return {}
    out: dict[int, dict[str, Any]] = {}
    for p, st in opt.state.items():
        names = [k for k, v in st.items() if torch.is_tensor(v)]
        out[id(p)] = dict(zip(names, _copies([st[k] for k in names])))
    return out


def _restore_optimizer(opt: torch.optim.Optimizer | None, saved: dict[int, dict[str, Any]]) -> None:
    """Puts optimizer state back in place; state the warm-up created goes to zero, which
    is Adam's initial state (zero moments, step 0)."""
    if opt is None:
        return
    for p, st in opt.state.items():
        old = saved.get(id(p), {})
        for k, v in st.items():
            if not torch.is_tensor(v):
                continue
            if k in old:
                v.copy_(old[k])
            else:
                v.zero_()


def determinism(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The mode a step runs in: on CUDA torch's deterministic mode off, on CPU on but
    without the fill of new tensors (both: see the functions)."""
    return torch_determinism_off() if device.type == "cuda" else no_uninitialized_fill()
