"""``train.compile``: the model compiled once per machine, used by training only.

- **Training only.** The training step calls the compiled model; evaluation calls the
  model itself (in its own captured graph on CUDA). Evaluation runs without gradients
  and in evaluation mode, so the training graph cannot serve it: compiling it again would
  cost as much as training's compile in every run, for evaluation passes that the
  captured eager step already runs at the default's rate.
- **Once per machine.** Inductor keeps what it compiled (its FX graphs, the autograd
  graphs around them, the Triton kernels) in ``TORCHINDUCTOR_CACHE_DIR``; unless the
  user pointed that elsewhere, a run points it at :func:`compile_cache_dir`, a folder per torch
  version and device under the user's cache folder, so a later run, a resumed one and
  another run folder on the same machine load the compiled kernels instead of compiling
  them (what is left is torch's tracing of the model).
- **A compile error falls back.** Compilation happens at the compiled model's first
  call, the backward's with the forward's (``force_non_lazy_backward_lowering``), so a
  compiler error surfaces there, before the step has changed any state: the call is
  answered by the model itself, one warning says so, and every later call runs
  uncompiled (on CUDA inside the captured step, as without ``train.compile``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["CompiledModel", "compile_cache_dir", "is_compile_error", "use_compile_cache"]


def compile_cache_dir(device: torch.device) -> Path:
    """The folder of a machine's compiled kernels for ``device``: under
    ``$XDG_CACHE_HOME`` (else ``~/.cache``), ``sven/compile/torch-<version>-<device>``,
    the device named by its model (``NVIDIA-H200``) and compute capability, since a
    kernel compiled for one GPU model is no use on another."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)}-sm{major}{minor}"
    else:
        name = device.type
    tag = re.sub(r"[^A-Za-z0-9.+_-]+", "-", f"torch-{torch.__version__}-{name}")
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "sven" / "compile" / tag


def _torch_default() -> str | None:
    """Inductor's own default cache folder, which torch writes into
    ``TORCHINDUCTOR_CACHE_DIR`` when it first needs one (None: not known)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    except (ImportError, AttributeError, OSError):
        return None


def use_compile_cache(device: torch.device) -> str:
    """Points Inductor's on-disk cache at :func:`compile_cache_dir`, unless
    ``TORCHINDUCTOR_CACHE_DIR`` names another folder than torch's default (the user's
    choice wins); returns the folder in use. Inductor reads the variable when it
    compiles, so this must run before the first compiled call."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not current or os.path.abspath(current) == _torch_default():
        folder = compile_cache_dir(device)
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def is_compile_error(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, is torch's compiler's
    (dynamo's or Inductor's: ``TorchDynamoException``), not the model's own."""
    dynamo = sys.modules.get("torch._dynamo.exc")
    if dynamo is None:
        return False
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, dynamo.TorchDynamoException):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _root(exc: BaseException) -> str:
    """``Type: first line`` of the innermost exception ``exc`` was raised from (the
    compiler's wrappers say little of their own)."""
    seen: set[int] = set()
    inner = exc.__cause__ or getattr(exc, "inner_exception", None)
    while isinstance(inner, BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        exc = inner
        inner = exc.__cause__ or getattr(exc, "inner_exception", None)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class CompiledModel:
    """``model`` called through ``torch.compile(model, dynamic=False)``, or through
    ``model`` itself once a compilation failed (one warning).

    Attribute reads and methods (``train()``, ``eval()``, ``parameters()``) go to the
    module in use; the compiled one shares ``model``'s parameters and flags.

    Args:
        model: The model.
        log: Where the fallback's warning goes.
        backend: Torch's compiler backend (``inductor``; tests pass ``eager`` or one
            that fails).
    """

    def __init__(
        self, model: torch.nn.Module, log: Callable[[str], None], backend: Any = "inductor"
    ) -> None:
        import torch._functorch.config

        # The backward compiled with the forward, so that its errors surface at the
        # forward's call, before the step writes anything.
        torch._functorch.config.force_non_lazy_backward_lowering = True
        self.__dict__.update(
            model=model,
            compiled=torch.compile(model, dynamic=False, backend=backend),
            log=log,
            failed=None,
        )

    @property
    def active(self) -> Any:
        """The module calls go to: the compiled one until a compilation failed."""
        return self.model if self.failed is not None else self.compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is not None:
            return self.model(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as exc:
            if not is_compile_error(exc):
                raise
            self.__dict__["failed"] = exc
            self.log(
                f"sven: warning: train.compile failed ({_root(exc)}); the step runs uncompiled"
            )
            return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.active, name)
