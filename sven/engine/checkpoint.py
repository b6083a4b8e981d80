"""Step-numbered, atomic, checksummed checkpoints, written by one or many ranks.

Layout under a root folder (``<out>/checkpoints`` or ``<out>/best``)::

    step-000000420/
        state.pt            rank 0: data identity (owner map), model, optimizer,
                            evaluator, progress, cursor, config
        memory-rank0.pt     each rank: its memory shard, exchange counters, RNG state
        memory-rank1.pt
        meta.json           {"step": 420, "world_size": 2, "files": {name: sha256}, ...}

All ranks write into one hidden temporary folder; rank 0 adds ``meta.json`` and renames
the folder into place once every rank's files are on disk, so a crash leaves either a
whole checkpoint or none (multi-node runs need the output folder on a shared file
system, as is usual on clusters). On load the checksums are verified; a corrupt or
partial checkpoint is skipped with a ``sven: warning:`` line on stderr in favour of the
previous one.

Files are read with ``torch.load(weights_only=True)``: a checkpoint holds only tensors
and plain Python values (dicts, lists, numbers, strings), so loading one never runs
code from the file, whoever wrote it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sven.errors import SvenError

_PREFIX = "step-"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes the bytes on their way to ``f`` (no seeking)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.h = hashlib.sha256()
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self.f.write(b)
        self.h.update(memoryview(b).cast("B")[:n])
        self.written += n
        return n

    def flush(self) -> None:
        self.f.flush()


def _save_hashed(obj: Any, fp: Path) -> str:
    """``torch.save`` to ``fp`` and fsync; returns the file's sha256.

    The digest is taken from the bytes as torch writes them, so a checkpoint is not
    read back to be hashed (the memory of a 10^7-node graph is gigabytes). Should a
    torch seek while it writes (the file would then differ from the hashed stream),
    the file is saved again by path and hashed by reading.
    """
    with open(fp, "wb") as f:
        w = _HashingWriter(f)
        try:
            torch.save(obj, w)
            w.flush()
            streamed = f.tell() == w.written
        except (io.UnsupportedOperation, OSError, AttributeError):
            streamed = False
        if streamed:
            os.fsync(f.fileno())
            return w.h.hexdigest()
    torch.save(obj, fp)
    _fsync(fp)
    return _sha256(fp)


def load_file(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """Loads one checkpoint file without running code from it.

    Args:
        path: A ``.pt`` file written by :meth:`Checkpointer.save`.
        map_location: Where tensors go.

    Raises:
        SvenError: The file is missing, truncated, not a checkpoint, or holds more
            than tensors and plain values (one line, naming the file).
    """
    try:
        # torch warns about files of other versions and layouts on the way; the error
        # below (or nothing) is what the user gets.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise SvenError(f"{path}: no such checkpoint file") from None
    except Exception as exc:  # pickle, zip and torch raise many kinds
        raise SvenError(f"{path}: {_unreadable(exc)}") from None


def _unreadable(exc: Exception) -> str:
    """Why torch could not load a file, as one whole sentence (torch's own message is
    a page of advice, with terminal escapes, to load it unsafely)."""
    text = str(exc)
    if "Weights only load failed" in text or "weights_only" in text:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        named = f" (it names {found.group(1)})" if found else ""
        return (
            f"not a Sven checkpoint: it holds more than tensors and plain values{named}; "
            "Sven never loads such a file, since loading it could run code from it."
        )
    first = re.sub(r"\x1b\[[0-9;]*m", "", (text.strip().splitlines() or [""])[0]).strip()
    first = first or type(exc).__name__
    if len(first) > 160:
        first = first[:157].rsplit(" ", 1)[0] + " ..."
    return f"not a readable Sven checkpoint (truncated or corrupt): {first.rstrip('.')}."


def verify_folder(folder: str | Path) -> bool:
    """Whether a ``step-N`` folder is complete and every file matches its checksum."""
    p = Path(folder)
    try:
        meta = json.loads((p / "meta.json").read_text())
        files = meta["files"]
        return "state.pt" in files and all(
            _sha256(p / name) == digest for name, digest in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def find_checkpoint(path: str | Path) -> Path:
    """The verified ``step-N`` folder that a path given by the user stands for.

    Args:
        path: A run folder (its best model; else its latest checkpoint), a folder of
            ``step-N`` folders (the latest valid one), a ``step-N`` folder, or its
            ``state.pt``.

    Raises:
        SvenError: Nothing there is a checkpoint, or the one named is corrupt.
    """
    p = Path(path)
    if p.is_file():
        if p.name != "state.pt":
            raise SvenError(
                f"{path}: not a checkpoint (give a run folder, or a step-N folder of one)"
            )
        p = p.parent
    if not p.is_dir():
        raise SvenError(f"no checkpoint at {path}")
    if (p / "state.pt").is_file():
        if not verify_folder(p):
            raise SvenError(f"{p}: corrupt or incomplete checkpoint (its checksums do not match)")
        return p
    for root in (p / "best", p / "checkpoints", p):
        ck = Checkpointer(root)
        if ck.steps():
            step = ck.latest(quiet=True)
            if step is None:
                bad = ", ".join(ck.path(s).name for s in ck.steps())
                raise SvenError(
                    f"no valid checkpoint under {root}: {bad} "
                    f"{'is' if len(ck.steps()) == 1 else 'are'} corrupt or incomplete "
                    "(their checksums do not match)"
                )
            return ck.path(step)
    raise SvenError(f"no checkpoint at {path}")


def warn(message: str) -> None:
    """A ``sven: warning:`` line on stderr (what the CLI prints, not a Python warning)."""
    print(f"sven: warning: {message}", file=sys.stderr, flush=True)


class Checkpointer:
    """Saves and restores training state under one root folder.

    Args:
        root: Folder holding the ``step-N`` checkpoints.
        keep_latest_k: Number of checkpoints kept; older ones are deleted after a save.
    """

    def __init__(self, root: str | Path, keep_latest_k: int = 2) -> None:
        self.root = Path(root)
        self.keep_latest_k = keep_latest_k

    def steps(self) -> list[int]:
        """Steps of the checkpoint folders on disk, ascending."""
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
        self,
        step: int,
        state: dict[str, Any] | None,
        files: dict[str, Any] | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[str], None] | None = None,
    ) -> Path:
        """Writes a checkpoint atomically; every rank calls it.

        Args:
            step: Global step number (monotone over the run).
            state: Rank 0's ``state.pt`` content (ignored on other ranks).
            files: This rank's further ``name -> object`` files (saved as ``name.pt``).
            rank: This rank.
            world_size: Number of ranks writing.
            barrier: Synchronises the ranks (required when ``world_size > 1``).

        Returns:
            The checkpoint folder.
        """
        if world_size > 1 and barrier is None:
            raise ValueError("a multi-rank checkpoint needs a barrier")
        sync = barrier or (lambda what: None)
        final = self.path(step)
        tmp = self.root / f".tmp-{final.name}"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        sync(f"checkpoint {step}: folder")
        mine = dict(files or {})
        if rank == 0:
            mine = {"state": state, **mine}
        sums = {}
        for name, obj in mine.items():
            fp = tmp / f"{name}.pt"
            sums[fp.name] = _save_hashed(obj, fp)
        (tmp / f"sums-rank{rank}.json").write_text(json.dumps(sums))
        sync(f"checkpoint {step}: files")
        if rank == 0:
            all_sums: dict[str, str] = {}
            for r in range(world_size):
                sp = tmp / f"sums-rank{r}.json"
                all_sums.update(json.loads(sp.read_text()))
                sp.unlink()
            meta = {
                "step": step,
                "world_size": world_size,
                "files": all_sums,
                "created": time.time(),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            _fsync(tmp / "meta.json")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        sync(f"checkpoint {step}: commit")
        return final

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep_latest_k]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def meta(self, step: int) -> dict[str, Any]:
        """The ``meta.json`` of a checkpoint."""
        return json.loads((self.path(step) / "meta.json").read_text())

    def verify(self, step: int) -> bool:
        """Whether the checkpoint at ``step`` is complete and matches its checksums."""
        return verify_folder(self.path(step))

    def load(self, step: int, name: str = "state", map_location: str | torch.device = "cpu") -> Any:
        """Loads one file of a checkpoint (verification is :meth:`latest`'s job)."""
        return load_file(self.path(step) / f"{name}.pt", map_location)

    def latest(self, quiet: bool = False) -> int | None:
        """The newest checkpoint that verifies, skipping broken ones.

        Args:
            quiet: Say nothing; otherwise a ``sven: warning:`` line names the broken
                ones skipped, and what is used instead (an older one, or none).
        """
        bad = []
        for step in reversed(self.steps()):
            if self.verify(step):
                if bad and not quiet:
                    warn(
                        f"checkpoint {', '.join(bad)} is corrupt or incomplete; using the "
                        f"older {self.path(step)}"
                    )
                return step
            bad.append(str(self.path(step)))
        if bad and not quiet:
            warn(f"checkpoint {', '.join(bad)} is corrupt or incomplete, and there is no older one")
        return None

    def state_dict(self) -> dict[str, Any]:
        """The setting that is not on disk: how many checkpoints are kept.

        The checkpoints themselves are the folders under :attr:`root`.
        """
        return {"keep_latest_k": self.keep_latest_k}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sets what :meth:`state_dict` gave."""
        self.keep_latest_k = int(state["keep_latest_k"])


class RunCheckpoints:
    """A training run's checkpoints: the latest ones and the best model, on every rank.

    ``<out>/checkpoints`` keeps the newest ``keep_latest_k`` states to resume from;
    ``<out>/best`` the best model so far (one). Each checkpoint is rank 0's ``state``
    (with the run's config added) and one ``memory-rank{r}`` file per rank (its
    ``shard``, with its rank and the world size added). What goes into them is the
    trainer's (assembled from its components' state_dicts); this class writes, finds
    and reads them, and refuses a checkpoint of another config.

    Args:
        out: The run folder.
        keep_latest_k: Resumable checkpoints kept.
        config: The run's :class:`~sven.config.Config`, saved with and compared to each
            checkpoint.
        rank: This rank.
        world_size: Number of ranks P.
        barrier: Synchronises the ranks (``barrier(what)``), needed when P > 1.
        agree: Rank 0's value on every rank (a no-op on one process).
    """

    def __init__(
        self,
        out: str | Path,
        keep_latest_k: int,
        *,
        config: Any,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[str], None] | None = None,
        agree: Callable[[Any], Any] = lambda value: value,
    ) -> None:
        self.latest = Checkpointer(Path(out) / "checkpoints", keep_latest_k)
        self.best = Checkpointer(Path(out) / "best", 1)
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.barrier, self.agree = barrier, agree

    def save(
        self, ck: Checkpointer, step: int, state: dict[str, Any], shard: dict[str, Any]
    ) -> Path:
        """Writes one checkpoint of ``ck`` (``latest`` or ``best``); every rank calls it."""
        return ck.save(
            step,
            {**state, "config": self.config.to_dict()},
            {
                f"memory-rank{self.rank}": {
                    **shard,
                    "rank": self.rank,
                    "world_size": self.world_size,
                }
            },
            rank=self.rank,
            world_size=self.world_size,
            barrier=self.barrier,
        )

    def newest(self, ck: Checkpointer) -> int | None:
        """The newest valid checkpoint of ``ck``, as judged by rank 0 for all ranks."""
        return self.agree(ck.latest() if self.rank == 0 else None)

    def load(
        self, ck: Checkpointer, step: int, map_location: str | torch.device = "cpu"
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Rank 0's state and this rank's shard of a checkpoint.

        Raises:
            ConfigError: The checkpoint was written with another config.
        """
        state = ck.load(step, map_location=map_location)
        check_resume_config(state, self.config, ck.path(step), self.rank)
        shard = ck.load(step, f"memory-rank{self.rank}", map_location=map_location)
        return state, shard

    def state_dict(self) -> dict[str, Any]:
        """The settings of both folders (the checkpoints themselves are on disk)."""
        return {"latest": self.latest.state_dict(), "best": self.best.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sets what :meth:`state_dict` gave."""
        self.latest.load_state_dict(state["latest"])
        self.best.load_state_dict(state["best"])


def check_resume_config(state: dict[str, Any], cfg: Any, where: Path, rank: int) -> None:
    """Stops a resume whose checkpoint was written with a different config.

    Raises:
        ConfigError: The keys that differ, quiet on ranks other than 0.
    """
    from sven.config import config_differences
    from sven.errors import ConfigError

    saved = state.get("config")
    if not isinstance(saved, dict):
        return
    diff = config_differences(saved, cfg)
    if diff:
        err = ConfigError(
            f"train.resume: {where} was written with another config; differing keys: "
            f"{', '.join(diff)}. Resume with the same settings, or use another out"
        )
        err.quiet = rank != 0
        raise err
