"""Step-numbered, atomic, checksummed checkpoints.

Layout under ``<out>/checkpoints/``::

    step-000000420/
        state.pt      torch.save of a dict of state_dicts (model, optimizer, memory, cursor, RNG...)
        meta.json     {"step": 420, "sha256": "<of state.pt>", "files": {...}, "created": ...}

A checkpoint is written into a hidden temporary folder and renamed into place, so a
crash leaves either the whole checkpoint or none. On load the checksum is verified; a
corrupt or partial checkpoint is skipped with a warning in favour of the previous one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

_PREFIX = "step-"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Checkpointer:
    """Saves and restores training state under ``<out>/checkpoints``.

    Args:
        out_dir: Run output directory.
        keep_latest_k: Number of checkpoints kept; older ones are deleted after a save.
    """

    def __init__(self, out_dir: str | Path, keep_latest_k: int = 2) -> None:
        self.root = Path(out_dir) / "checkpoints"
        self.keep_latest_k = keep_latest_k

    def steps(self) -> list[int]:
        """Steps of the complete-looking checkpoints on disk, ascending."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith(_PREFIX):
                try:
                    out.append(int(p.name[len(_PREFIX) :]))
                except ValueError:
                    continue
        return sorted(out)

    def path(self, step: int) -> Path:
        """Folder of the checkpoint at ``step``."""
        return self.root / f"{_PREFIX}{step:09d}"

    def save(
        self, step: int, state: dict[str, Any], files: dict[str, dict[str, Any]] | None = None
    ) -> Path:
        """Writes ``state`` (and extra named state files) atomically as step ``step``.

        Args:
            step: Global step number (monotone over the run).
            state: Picklable dict of tensors and plain values.
            files: Further ``name -> state`` dicts saved as ``name.pt`` beside state.pt
                (e.g. one memory shard per rank).

        Returns:
            The checkpoint folder.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        all_files = {"state": state, **(files or {})}
        sums = {}
        for name, obj in all_files.items():
            fp = tmp / f"{name}.pt"
            torch.save(obj, fp)
            sums[f"{name}.pt"] = _sha256(fp)
        meta = {"step": step, "files": sums, "created": time.time()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        # fsync the files before the rename so that a power loss cannot expose a
        # renamed folder with truncated contents.
        for fp in tmp.iterdir():
            with open(fp, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep_latest_k]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def verify(self, step: int) -> bool:
        """Whether the checkpoint at ``step`` is complete and matches its checksums."""
        p = self.path(step)
        try:
            meta = json.loads((p / "meta.json").read_text())
            return all(_sha256(p / name) == digest for name, digest in meta["files"].items())
        except (OSError, ValueError, KeyError):
            return False

    def load(self, step: int, name: str = "state", map_location: str | torch.device = "cpu") -> Any:
        """Loads one state file of a checkpoint (no verification; see :meth:`latest`)."""
        return torch.load(
            self.path(step) / f"{name}.pt", map_location=map_location, weights_only=False
        )

    def latest(self) -> int | None:
        """The newest checkpoint that verifies; warns about and skips broken ones."""
        for step in reversed(self.steps()):
            if self.verify(step):
                return step
            warnings.warn(
                f"checkpoint {self.path(step)} is corrupt or incomplete; falling back to an older one",
                stacklevel=2,
            )
        return None
