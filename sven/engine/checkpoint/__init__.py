"""Checkpoints: step-numbered, atomic, checksummed, sharded by rank, written in the
background, read back into any number of ranks.

- :mod:`~sven.engine.checkpoint.writer`: the on-disk format (documented there) and
  :class:`Checkpointer`, which writes one folder of checkpoints;
- :mod:`~sven.engine.checkpoint.files`: the parallel, chunked writes and their digests;
- :mod:`~sven.engine.checkpoint.format`: digests, ``.npy`` headers, safe readers, checks;
- :mod:`~sven.engine.checkpoint.load`: finding a checkpoint, reading its states, and
  :func:`load_node_state` of any set of vertices (another number of ranks);
- :mod:`~sven.engine.checkpoint.parts`: :class:`Snapshot`, what a run hands the
  checkpointer (one rank's checkpoint in the format's pieces), from :class:`Stateful` parts;
- :mod:`~sven.engine.checkpoint.run`: :class:`RunCheckpoints`, a run's latest and best.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sven.engine.checkpoint.files import WriterPool, write_file
from sven.engine.checkpoint.format import (
    file_digest,
    load_file,
    read_meta,
    serialise,
    verify_folder,
    warn,
)
from sven.engine.checkpoint.load import (
    find_checkpoint,
    load_node_state,
    read_shard,
    read_state,
)
from sven.engine.checkpoint.parts import Snapshot, Stateful
from sven.engine.checkpoint.run import RunCheckpoints, check_resume_config, room_on_device
from sven.engine.checkpoint.writer import Checkpointer

__all__ = [
    "Checkpointer",
    "RunCheckpoints",
    "Snapshot",
    "Stateful",
    "WriterPool",
    "check_resume_config",
    "file_digest",
    "find_checkpoint",
    "load_file",
    "load_node_state",
    "read_meta",
    "read_shard",
    "read_state",
    "room_on_device",
    "verify_folder",
    "warn",
]

#: A file's digest as ``meta.json`` records it (format 2), under its former name.
_sha256 = file_digest


def _save_hashed(obj: Any, fp: Path) -> str:
    """Writes ``obj`` as a checkpoint's small ``.pt`` file and returns its digest, taken
    from the bytes written (the way the writer does it)."""
    return write_file(Path(fp), serialise(obj))
