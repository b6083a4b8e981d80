"""Where node state lives: beside the compute, in pinned host memory, or in files.

Everything sized by the number of nodes (memory, mailbox, last-update times: a
:class:`~sven.models.memory.MemoryState`) is allocated by a :class:`Storage` of one
tier (``state.device``):

* ``gpu``: tensors in GPU memory (on a run without a GPU the name is an alias of
  ``host``: :func:`~sven.models.names.resolve_tier`).
* ``host``: host memory; on a CPU run plain host tensors. On CUDA page-locked
  ("pinned") host memory: each table is registered with
  the driver and read and written by the step's own kernels through a CUDA view of
  the same memory (unified virtual addressing): a batch's rows cross the host link
  inside the captured step, with no copy of the whole table anywhere and no host
  synchronisation. Each table is one registration (a copy or a fill that spans two
  registrations is refused by the driver); its pages are first faulted in by a
  multi-threaded zero fill, so the registration only locks them.
* ``disk``: memory-mapped files (``<folder>/<name>.bin``, raw little-endian rows, the
  folder given by ``state.path`` or the run's ``state/``), for state larger than host
  memory: the operating system pages them in and out. A CPU step reads the mapping in
  place; on CUDA the batch's rows are gathered on the host and copied over (and the
  write-back copied back), which synchronises every step, so such a step runs
  uncaptured (:attr:`Storage.staged`).

The step never knows which: it gathers rows by index and scatters its write-back into
the same tensors.
"""

from __future__ import annotations

import mmap
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sven.models.names import TIERS, resolve_tier

__all__ = ["MARKER", "TIERS", "Storage", "claim_state_folder", "is_state_folder", "uva_view"]


class _CudaArray:
    """A CUDA array interface over registered host memory: ``torch.as_tensor`` of it
    is a CUDA tensor whose kernels read and write the host memory directly."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # kept alive as long as the view
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": np.dtype(_numpy_dtype(host.dtype)).str,
            "data": (host.data_ptr(), False),
            "version": 3,
        }


def uva_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over a registered, contiguous host tensor (the same memory)."""
    return torch.as_tensor(_CudaArray(host), device=device)


#: The file that marks a folder as node-state files Sven wrote (and may replace).
MARKER = ".sven-state"


def claim_state_folder(folder: Path) -> None:
    """Makes ``folder`` the disk tier's, refusing one that holds files Sven did not
    write there (they would be replaced).

    Raises:
        ConfigError: The folder holds something else, named.
    """
    from sven.errors import ConfigError

    if folder.exists() and not (folder / MARKER).exists():
        other = sorted(p.name for p in folder.iterdir())
        if other:
            raise ConfigError(
                f"state.path: {folder} holds files Sven did not write there ({other[0]}"
                f"{' ...' if len(other) > 1 else ''}); choose an empty folder for the "
                "node-state files"
            )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).touch()


def is_state_folder(folder: Path) -> bool:
    """Whether ``folder`` holds the disk tier's files (its marker)."""
    return (folder / MARKER).is_file() or any(
        (sub / MARKER).is_file() for sub in folder.glob("rank*") if sub.is_dir()
    )


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype


def _release(ptrs: list[int], mapping: Any) -> None:
    """Unregisters pinned chunks (then the mapping may go)."""
    if ptrs:
        cudart = torch.cuda.cudart()
        for ptr in ptrs:
            cudart.cudaHostUnregister(ptr)


class Storage:
    """Allocates node-state tensors in one tier.

    Args:
        tier: ``gpu``, ``host`` or ``disk`` (:data:`TIERS`); ``gpu`` without a GPU
            is ``host`` (:attr:`tier` holds the resolved name).
        device: The compute device.
        folder: Where the ``disk`` tier's files go (created; required for ``disk``).

    Attributes:
        staged: Whether rows travel through host copies each step (``disk`` on
            CUDA): such a step synchronises and cannot be captured.
    """

    def __init__(
        self,
        tier: str,
        device: torch.device | str,
        folder: str | Path | None = None,
    ) -> None:
        self.device = torch.device(device)
        tier = resolve_tier(tier, self.device.type)
        self.tier = tier
        #: Whether tables are pinned host memory the GPU's kernels read (host on CUDA).
        self.pinned = tier == "host" and self.device.type == "cuda"
        self.folder = None if folder is None else Path(folder)
        if tier == "disk":
            if self.folder is None:
                raise ValueError("the disk tier needs a folder")
            claim_state_folder(self.folder)
        self.staged = tier == "disk" and self.device.type == "cuda"
        self._keep: list[Any] = []
        # One per pinned table: unregisters its pages before its memory is unmapped
        # (when its last tensor goes, or at close()), so that a later table mapped at
        # the same address can be registered again.
        self._releases: list[weakref.finalize] = []

    @property
    def host_device(self) -> torch.device:
        """Where the tensors the step indexes live when rows are staged."""
        return torch.device("cpu") if self.staged else self.device

    def empty(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A new tensor of this tier (contents undefined, except zero in ``disk``'s new
        files).

        Returns:
            (the tensor the step indexes, the host tensor behind it or None): for
            ``host`` on CUDA the first is a CUDA view of the second; for ``disk`` both
            are the mapped file (a CPU tensor; on CUDA the step stages its rows).
        """
        if self.pinned:
            host = self._pinned(shape, dtype)
            return uva_view(host, self.device), host
        if self.tier != "disk":
            # GPU memory, or host memory beside a CPU's compute.
            return torch.empty(shape, dtype=dtype, device=self.device), None
        path = self.folder / f"{name}.bin"  # type: ignore[operator]
        if path.exists():
            path.unlink()
        arr = np.memmap(path, dtype=_numpy_dtype(dtype), mode="w+", shape=shape)
        self._keep.append(arr)
        host = torch.from_numpy(arr)
        return host, host

    def _pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A page-aligned host tensor, page-locked and registered with CUDA."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(int(np.prod(shape, dtype=np.int64)) * itemsize, 1)
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Fewer pages to fault in and lock (a 12 GB table is 3 M small pages).
            buf.madvise(mmap.MADV_HUGEPAGE)
        arr = np.frombuffer(buf, dtype=_numpy_dtype(dtype), count=nbytes // itemsize)
        host = torch.from_numpy(arr).view(shape)
        # Fault the pages in on torch's threads (the registration then only locks them).
        host.zero_()
        ptrs = self._register(host.data_ptr(), nbytes)
        # The finalizer holds the mapping: it is unmapped only after its pages are
        # unregistered.
        self._releases.append(weakref.finalize(arr, _release, ptrs, buf))
        return host

    def _register(self, ptr: int, nbytes: int) -> list[int]:
        """Page-locks and maps [ptr, ptr + nbytes) for the GPU as one registration;
        returns its address (unregistered when the table goes)."""
        # 1: cudaHostRegisterPortable (every context sees it as pinned).
        code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))
        if code != 0:
            self.close()
            raise RuntimeError(
                f"state.device=host: pinning {nbytes / 1e9:.1f} GB of host memory failed "
                f"(CUDA error {code}); lower the state's size or use state.device=disk"
            )
        return [ptr]

    def close(self) -> None:
        """Unregisters pinned memory and drops the mappings (the tensors must not be
        used afterwards)."""
        for release in self._releases:
            release()
        self._releases = []
        for obj in self._keep:
            if isinstance(obj, np.memmap):
                obj.flush()
        self._keep = []

    def describe(self) -> str:
        """The tier as a log line says it."""
        if self.tier == "gpu":
            return "in GPU memory"
        if self.tier == "host":
            return "in host memory" + (" (pinned, read by the step's kernels)" * self.pinned)
        return f"in memory-mapped files under {self.folder}"
