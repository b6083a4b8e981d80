"""Hot-path kernels with one dispatch point.

Each public function runs either its PyTorch reference in :mod:`sven.kernels.reference`
(the CPU path and the test oracle) or its Triton kernel (:mod:`.triton_attention`,
:mod:`.triton_rnn`). The choice, per call, from the first tensor argument:

- ``SVEN_KERNELS`` unset or ``auto``: Triton on CUDA for the functions in
  :data:`AUTO_TRITON` (the fused memory updater, the attention's masked softmax and
  the link scorer, measured faster in the captured step; the factored attention,
  which the models run on CUDA only in wide evaluation batches), and for the counter hashes
  (:func:`hash_backend`); else the reference, whose cuBLAS GEMMs were measured faster
  than the fully fused Triton attention (docs/kernels.md has the figures);
- ``SVEN_KERNELS=reference``: the reference everywhere;
- ``SVEN_KERNELS=triton``: Triton everywhere; on CPU tensors that is Triton's
  interpreter, so it needs ``TRITON_INTERPRET=1`` (set before the first call), and an
  error otherwise;
- per function, after the mode: ``SVEN_KERNELS=auto,recurrent_update=triton`` (comma
  separated ``name=backend`` pairs, backend ``triton`` or ``reference``), so that one
  kernel can be measured in the step against the reference with the rest unchanged.

The environment is read once per process, at the first call; :func:`reset_backend`
makes the next call read it again (for tests).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from sven.kernels import reference

__all__ = [
    "backend_for",
    "gru_cell",
    "hash_backend",
    "link_decoder",
    "recurrent_update",
    "reset_backend",
    "rnn_cell",
    "temporal_attention",
    "temporal_attention_factored",
    "temporal_attention_fused",
]

_MODES = ("auto", "reference", "triton")
#: The functions ``auto`` runs in Triton on CUDA: those measured faster than their
#: reference inside the captured TGN step (docs/kernels.md has the figures and the GPU).
AUTO_TRITON = frozenset(
    {
        "bce_loss",
        "dedupe_compact",
        "gather_rows",
        "link_decoder",
        "recurrent_update",
        "sample_recent",
        "select_events",
        "state_commit",
        "state_gather",
        "temporal_attention",
        "temporal_attention_factored",
    }
)
# Which Triton module implements each public name.
_TRITON_MODULE = {
    "temporal_attention": "sven.kernels.triton_attention",
    "temporal_attention_fused": "sven.kernels.triton_attention",
    "temporal_attention_factored": "sven.kernels.triton_attention",
    "gru_cell": "sven.kernels.triton_rnn",
    "rnn_cell": "sven.kernels.triton_rnn",
    "recurrent_update": "sven.kernels.triton_rnn",
    "link_decoder": "sven.kernels.triton_decoder",
    # The reference is the sampler's own code (sven.pipeline.sampler), the CPU path.
    "sample_recent": "sven.kernels.triton_sampler",
    # The reference is sven.pipeline.stages.select_events's own code.
    "select_events": "sven.kernels.triton_events",
    # The reference is pipeline.dedupe.dedupe_fixed's own code after its sort
    # (dedupe_compact), and with it (dedupe_sort).
    "dedupe_compact": "sven.kernels.triton_dedupe",
    "dedupe_sort": "sven.kernels.triton_dedupe",
    # The references are sven.models.memory.MemoryState's own gather and commit_dense.
    "state_gather": "sven.kernels.triton_state",
    # The reference is sven.engine.body.masked_bce.
    "bce_loss": "sven.kernels.triton_loss",
    # The reference is the model's plain row gather (reference.take_rows).
    "gather_rows": "sven.kernels.triton_gather",
    "state_commit": "sven.kernels.triton_state",
}
# The cached choice: (mode, interpreter on, triton importable, per-function backends);
# None until first read.
_state: tuple[str, bool, bool, dict[str, str]] | None = None


def reset_backend() -> None:
    """Forgets the cached choice, so the next call re-reads ``SVEN_KERNELS``."""
    global _state
    _state = None


def _parse(value: str) -> tuple[str, dict[str, str]]:
    """(mode, per-function backends) from ``SVEN_KERNELS``."""
    mode, per_fn = "auto", {}
    for i, part in enumerate(p.strip().lower() for p in value.split(",")):
        if "=" not in part:
            if i or part not in _MODES:
                raise ValueError(
                    f"SVEN_KERNELS={value!r}: expected one of {', '.join(_MODES)}, "
                    "then name=triton|reference pairs"
                )
            mode = part
            continue
        name, backend = (x.strip() for x in part.split("=", 1))
        if name not in _TRITON_MODULE or backend not in ("triton", "reference"):
            raise ValueError(
                f"SVEN_KERNELS={value!r}: {part!r} is not name=triton|reference with name "
                f"one of {', '.join(sorted(_TRITON_MODULE))}"
            )
        per_fn[name] = backend
    return mode, per_fn


def _read_state() -> tuple[str, bool, bool, dict[str, str]]:
    global _state
    if _state is None:
        mode, per_fn = _parse(os.environ.get("SVEN_KERNELS", "auto").strip() or "auto")
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        # Whether triton is installed, without importing it (0.5 s): a run that takes
        # the reference path (every CPU run) never loads it.
        try:
            has_triton = importlib.util.find_spec("triton") is not None
        except (ImportError, ValueError):
            has_triton = False
        _state = (mode, interpret, has_triton, per_fn)
    return _state


def backend_for(t: torch.Tensor, name: str | None = None) -> str:
    """Names the backend a call on tensor ``t`` dispatches to ("triton" or "reference").

    Args:
        t: The call's first tensor.
        name: The public function, for a per-function choice in ``SVEN_KERNELS``.

    Raises:
        RuntimeError: Triton asked for where it cannot run ``t`` (triton not installed,
            or a CPU tensor without ``TRITON_INTERPRET=1``).
    """
    mode, interpret, has_triton, per_fn = _read_state()
    mode = per_fn.get(name, mode) if name is not None else mode
    if mode == "auto":
        if name in AUTO_TRITON and t.is_cuda and has_triton and not torch.compiler.is_compiling():
            return "triton"
        return "reference"
    if mode == "reference":
        return "reference"
    if not has_triton:
        raise RuntimeError("SVEN_KERNELS=triton but the triton package is not installed")
    if not t.is_cuda and not interpret:
        raise RuntimeError(
            f"SVEN_KERNELS=triton on a {t.device.type} tensor: Triton runs CPU tensors only "
            "under its interpreter; set TRITON_INTERPRET=1 before the first kernel call, "
            "or use SVEN_KERNELS=auto"
        )
    return "triton"


def hash_backend(t: torch.Tensor) -> str:
    """Names the backend of the counter hashes (:mod:`sven.pipeline.negatives`) on ``t``.

    As :func:`backend_for`, except that ``auto`` picks Triton for CUDA tensors when
    triton is installed: the hashes are chains of a dozen int64 element-wise kernels
    that :mod:`.triton_hash` runs as one, and the captured step is bound by its kernel
    count (docs/performance.md has the measurement). Inside ``torch.compile`` ``auto``
    gives the reference; the compiled model's one hash, keyed dropout's, does not get
    here: it is the opaque op ``sven::dropout_scale`` there, since Inductor fails on
    the traced kernel and on the traced reference in torch 2.11 (docs/kernels.md).
    """
    mode, _, has_triton, _ = _read_state()
    if mode == "auto":
        if torch.compiler.is_compiling():
            return "reference"
        return "triton" if t.is_cuda and has_triton else "reference"
    return backend_for(t)


def _dispatch(name: str, **ref_kwargs: Any) -> Callable[..., torch.Tensor]:
    """The public function ``name``; ``ref_kwargs`` go to its reference only."""
    ref = getattr(reference, name)
    impl: dict[str, Any] = {}

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        if backend_for(args[0], name) == "reference":
            return ref(*args, **kwargs, **ref_kwargs)
        if not impl:
            # Imported at first use: triton.jit reads TRITON_INTERPRET when the kernels
            # are defined, and CPU-only runs never pay for importing triton.
            impl["fn"] = getattr(importlib.import_module(_TRITON_MODULE[name]), name)
        return impl["fn"](*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = ref.__doc__
    return call


temporal_attention = _dispatch("temporal_attention")
# The reference builds keys and values with cuBLAS, then runs the dispatched attention:
# ``SVEN_KERNELS=auto,temporal_attention=triton`` keeps the projections and fuses the
# masked softmax into one kernel.
temporal_attention_fused = _dispatch("temporal_attention_fused", attention=temporal_attention)
# The CPU form of the fused attention (fewer multiply-adds), tested against
# ``temporal_attention_fused``; on CUDA, without a gradient (evaluation), one Triton
# kernel between two GEMMs, which writes no per-slot tensor (the reference where a
# gradient is needed).
temporal_attention_factored = _dispatch("temporal_attention_factored")
gru_cell = _dispatch("gru_cell")
rnn_cell = _dispatch("rnn_cell")

# The link scorer of every model: the reference runs three linear layers per pair
# column; Triton the source projection once per event and the rest as one kernel each
# way (docs/kernels.md).
link_decoder = _dispatch("link_decoder")

# The memory updater: the reference composes the reference cells; Triton fuses it
# (four kernels forward, docs/kernels.md).
recurrent_update = _dispatch("recurrent_update")
