"""Kernel tests: Triton against the reference, on CUDA or under the Triton interpreter.

Without a GPU the Triton kernels run on CPU tensors under ``TRITON_INTERPRET=1``, which
must be set before the kernels are defined (``triton.jit`` reads it then); this file is
loaded before the test modules import them.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where CUDA is present, a test on the ``device`` or ``cuda`` fixture runs there:
    it is marked ``gpu``, so that ``pytest -m gpu`` checks every kernel on the GPU (on a
    machine without one they run under the interpreter with the rest of the suite)."""
    if not torch.cuda.is_available():
        return
    for item in items:
        if {"device", "cuda"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def device() -> str:
    """CUDA where present, else CPU under the interpreter (skips without triton)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    return "cpu"


@pytest.fixture
def cuda() -> str:
    """The CUDA device; skips without one."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return "cuda"


@pytest.fixture
def use_kernel(monkeypatch):
    """``use_kernel(name, backend, **others)``: the next calls of kernel ``name`` (and
    of each of ``others``) run on that backend (``SVEN_KERNELS=auto,name=backend,...``);
    the choice is undone after the test."""
    from sven import kernels

    def use(name: str, backend: str, **others: str) -> None:
        pairs = [f"{name}={backend}", *(f"{k}={v}" for k, v in others.items())]
        monkeypatch.setenv("SVEN_KERNELS", ",".join(["auto", *pairs]))
        kernels.reset_backend()

    yield use
    monkeypatch.undo()
    kernels.reset_backend()
