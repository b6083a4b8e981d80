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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sven.models.names import TIERS, resolve_tier

if TYPE_CHECKING:
    from sven.ownership import FolderLock

__all__ = [
    "MARKER",
    "STATE_MANIFEST",
    "TIERS",
    "Storage",
    "check_state_folder",
    "claim_state_folder",
    "is_state_folder",
    "uva_view",
]


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

#: Everything Sven writes into the disk tier's folder (:data:`sven.ownership.Manifest`):
#: its marker, each rank's folder of ``.bin`` files, and the lock file of each rank's
#: folder (held while a run maps its files).
STATE_MANIFEST: dict[str, Any] = {
    r"\.sven-state": None,
    r"\.rank\d+\.sven-lock": None,
    r"rank\d+": {r"\.sven-state": None, r"\.sven-lock": None, r"\w+\.bin": None},
}


def claim_state_folder(root: Path, rank: int = 0, command: str = "sven train") -> FolderLock:
    """Makes ``root`` the disk tier's folder and locks this rank's part of it.

    The folder is Sven's alone: created empty, or found holding only what the disk
    tier writes (:data:`STATE_MANIFEST`). A folder of the user's
    with any other file, at any depth, is refused and named, never written into.
    ``root/rank<r>`` is then locked (:func:`sven.ownership.lock_folder`, the lock of a
    run folder) for as long as the files are mapped, so that two runs given the same
    ``state.path`` never map the same files.

    Args:
        root: ``state.path``, or the run's ``state/``.
        rank: This process's rank; its files go to ``root/rank<r>``.
        command: What this process is, for the refusal of a second one.

    Returns:
        The lock of ``root/rank<r>``; release it when the files are no longer used.

    Raises:
        ConfigError: The folder holds something else, or cannot be created (one line;
            quiet on ranks other than 0, which find the same).
        FolderBusy: Another live process uses ``root/rank<r>`` (exit code 1).
    """
    from sven.errors import ConfigError
    from sven.ownership import lock_folder

    try:
        check_state_folder(root)
        folder = root / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        (root / MARKER).touch()
    except OSError as exc:
        err = ConfigError(f"state.path: cannot create {root}: {exc.strerror or exc}")
        err.quiet = rank != 0
        raise err from None
    except ConfigError as exc:
        exc.quiet = rank != 0
        raise
    lock = lock_folder(folder, command)
    (folder / MARKER).touch()
    return lock


def check_state_folder(root: Path) -> None:
    """Refuses a folder that is not the disk tier's to take: a file, or a folder that
    holds anything the disk tier did not write (:data:`STATE_MANIFEST`), at any depth.
    A missing or empty folder is fine.

    Raises:
        ConfigError: One line naming the folder and (some of) the files of the user's.
    """
    from sven.errors import ConfigError
    from sven.ownership import foreign_paths

    if root.exists() and not root.is_dir():
        raise ConfigError(f"state.path: {root} is a file, not a folder; give a folder")
    if not root.is_dir():
        return
    foreign = foreign_paths(root, STATE_MANIFEST)
    if foreign:
        shown = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise ConfigError(
            f"state.path: {root} holds files Sven did not write there ({shown}); the "
            "node-state files need a folder of their own: give an empty or new folder"
        )


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
        folder: The ``disk`` tier's folder (``state.path`` or the run's ``state/``,
            claimed by :func:`claim_state_folder`); its files go to
            ``folder/rank<r>``. None: a temporary folder of this process's own,
            removed with it (for commands that write nothing: ``sven eval``,
            predictions).
        rank: This process's rank.

    Attributes:
        folder: Where this rank's files are (``disk`` only).
        staged: Whether rows travel through host copies each step (``disk`` on
            CUDA): such a step synchronises and cannot be captured.
    """

    def __init__(
        self,
        tier: str,
        device: torch.device | str,
        folder: str | Path | None = None,
        *,
        rank: int = 0,
    ) -> None:
        self.device = torch.device(device)
        tier = resolve_tier(tier, self.device.type)
        self.tier = tier
        #: Whether tables are pinned host memory the GPU's kernels read (host on CUDA).
        self.pinned = tier == "host" and self.device.type == "cuda"
        self.folder: Path | None = None
        # Released (the lock dropped, a temporary folder removed) at close() or when
        # the storage goes, whichever comes first.
        self._done: weakref.finalize | None = None
        self._lock: FolderLock | None = None
        if tier == "disk":
            if folder is None:
                import shutil
                import tempfile

                scratch = Path(tempfile.mkdtemp(prefix="sven-state-"))
                self._done = weakref.finalize(self, shutil.rmtree, scratch, True)
                self.folder = scratch
            else:
                lock = self._lock = claim_state_folder(Path(folder), rank)
                self._done = weakref.finalize(self, lock.release)
                self.folder = lock.folder
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
        if self._done is not None:
            self._done()

    def release_folder(self) -> None:
        """Drops the lock of the disk tier's folder (the run that used it ended); the
        files stay mapped until :meth:`close`."""
        if self._lock is not None:
            self._lock.release()

    def describe(self) -> str:
        """The tier as a log line says it."""
        if self.tier == "gpu":
            return "in GPU memory"
        if self.tier == "host":
            return "in host memory" + (" (pinned, read by the step's kernels)" * self.pinned)
        return f"in memory-mapped files under {self.folder}"
