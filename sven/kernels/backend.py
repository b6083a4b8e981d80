"""Which backend each kernel call takes: ``SVEN_KERNELS`` and the tensor's device.

A leaf of :mod:`sven.kernels` (which re-exports it), so that the Triton modules'
helpers can ask it too (:func:`sven.kernels.sums.param_grads`) without an import
circle through the package's table of Triton modules.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["AUTO_TRITON", "NAMES", "backend_for", "hash_backend", "reset_backend"]

_MODES = ("auto", "reference", "triton")
#: The functions ``auto`` runs in Triton on CUDA: those measured faster than their
#: reference inside the captured TGN step (docs/kernels.md has the figures and the GPU).
AUTO_TRITON = frozenset(
    {
        "adam_step",
        "bce_loss",
        "dedupe_compact",
        "gather_rows",
        "link_decoder",
        "recurrent_update",
        "relu_norm",
        "sample_recent",
        "select_events",
        "state_commit",
        "state_gather",
        "temporal_attention",
        "temporal_attention_factored",
    }
)
#: Every name a per-function choice may give: the keys of ``sven.kernels``' table of
#: Triton modules (which checks that they agree). Those not in ``auto``'s set are opt-in.
NAMES = AUTO_TRITON | frozenset(
    {
        "dedupe_sort",
        "gru_cell",
        "param_grads",
        "rnn_cell",
        "temporal_attention_fused",
    }
)
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
        if name not in NAMES or backend not in ("triton", "reference"):
            raise ValueError(
                f"SVEN_KERNELS={value!r}: {part!r} is not name=triton|reference with name "
                f"one of {', '.join(sorted(NAMES))}"
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
