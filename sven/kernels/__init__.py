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
makes the next call read it again (for tests). The choice lives in
:mod:`sven.kernels.backend`, which the Triton modules' helpers ask too (the linear
layers' parameter gradients, ``param_grads``: :func:`sven.kernels.sums.param_grads`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from sven.kernels import reference
from sven.kernels.backend import AUTO_TRITON, NAMES, backend_for, hash_backend, reset_backend

__all__ = [
    "AUTO_TRITON",
    "backend_for",
    "gru_cell",
    "hash_backend",
    "link_decoder",
    "recurrent_update",
    "relu_norm",
    "reset_backend",
    "rnn_cell",
    "temporal_attention",
    "temporal_attention_factored",
    "temporal_attention_fused",
]

# Which Triton module implements each public name.
_TRITON_MODULE = {
    "temporal_attention": "sven.kernels.triton_attention",
    "temporal_attention_fused": "sven.kernels.triton_attention",
    "temporal_attention_factored": "sven.kernels.triton_factored",
    "gru_cell": "sven.kernels.triton_rnn",
    "rnn_cell": "sven.kernels.triton_rnn",
    "recurrent_update": "sven.kernels.triton_rnn",
    "link_decoder": "sven.kernels.triton_decoder",
    "relu_norm": "sven.kernels.triton_norm",
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
    # The weight and bias gradients of the linear layers' backward (sums.param_grads,
    # whose reference is a GEMM and a column sum), one launch for up to three layers.
    "param_grads": "sven.kernels.triton_grads",
    # The reference is torch.optim.Adam's own step (sven.engine.optim.Optimizer).
    "adam_step": "sven.kernels.triton_adam",
}
if set(_TRITON_MODULE) != NAMES:
    raise ImportError("sven.kernels.backend.NAMES and the table of Triton modules differ")


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

# The attention layer's output in a wide evaluation batch (per-node queries): the
# per-node half's gather, the activation and the layer norm as one pass (forward only;
# the reference where a gradient is needed).
relu_norm = _dispatch("relu_norm")
