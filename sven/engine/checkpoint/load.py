"""Reading checkpoints back: finding the one a path stands for, its states, and the node
state of any set of vertices, whatever number of ranks wrote it.

A checkpoint of P ranks holds each rank's rows of the node state in shard order (the
vertices it owned, by ascending id; ``owner.npy`` says who owned what). A run of P' ranks
reads the rows of the vertices it owns now (:func:`load_node_state`): the owner map is
walked in windows, each requested vertex is located (source rank, row in its shard),
and its rows are copied from the memory-mapped ``.npy`` files into the destination
tensors, a few tens of megabytes at a time. Peak host memory is set by those windows,
not by the number of nodes; no code in the files runs (``allow_pickle=False``).
Format 1 checkpoints (``memory-rank{r}.pt``) are read the same way, through
``torch.load(mmap=True, weights_only=True)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from sven.engine.checkpoint.format import (
    NODE_DIR,
    OWNER,
    ChunkChecker,
    chunk_of,
    load_file,
    open_npy,
    read_meta,
    read_sums,
    verify_folder,
)
from sven.engine.checkpoint.writer import Checkpointer
from sven.errors import SvenError

#: Vertices of the owner map located per window.
_WINDOW = 1 << 20
#: Bytes of one field copied at a time.
_COPY_BYTES = 32 << 20


def find_checkpoint(path: str | Path, lazy: bool = False) -> Path:
    """The verified ``step-N`` folder that a path given by the user stands for.

    Args:
        path: A run folder (its best model; else its latest checkpoint), a folder of
            ``step-N`` folders (the latest valid one), a ``step-N`` folder, or its
            ``state.pt``.
        lazy: Leave the node-state files that keep chunk sums to their reader, which
            checks the chunks it reads (:class:`NodeStateFiles`); every other file is
            hashed whole. For a caller that reads a few rows; resuming or replaying
            reads every byte and verifies every byte first.

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
        if not verify_folder(p, lazy=lazy):
            raise SvenError(f"{p}: corrupt or incomplete checkpoint (its checksums do not match)")
        return p
    for root in (p / "best", p / "checkpoints", p):
        ck = Checkpointer(root)
        if ck.steps():
            step = ck.latest(quiet=True, lazy=lazy)
            if step is None:
                bad = ", ".join(ck.path(s).name for s in ck.steps())
                raise SvenError(
                    f"no valid checkpoint under {root}: {bad} "
                    f"{'is' if len(ck.steps()) == 1 else 'are'} corrupt or incomplete "
                    "(their checksums do not match)"
                )
            return ck.path(step)
    raise SvenError(f"no checkpoint at {path}")


def read_state(folder: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """A checkpoint's ``state.pt``, with the owner map back in its data identity.

    Format 2 keeps the owner map out of ``state.pt`` (``owner.npy``, or nothing when one
    rank owned every vertex); it is put back as ``state["data"]["owner"]``, (N,) int64,
    as format 1 had it.
    """
    folder = Path(folder)
    state = load_file(folder / "state.pt", map_location)
    data = state.get("data") if isinstance(state, dict) else None
    if isinstance(data, dict) and "owner" not in data and "num_nodes" in data:
        meta = read_meta(folder)
        if meta["format"] >= 2:
            data["owner"] = _owner(folder, meta, int(data["num_nodes"])).to(map_location)
    return state


def _owner(folder: Path, meta: dict[str, Any], num_nodes: int) -> torch.Tensor:
    """(N,) int64 owner map of a format-2 checkpoint."""
    if OWNER in meta["files"]:
        return torch.from_numpy(np.array(open_npy(folder / OWNER), dtype=np.int64))
    # Every vertex is rank 0's: a view of one zero, not N of them.
    return torch.zeros((), dtype=torch.int64).expand(num_nodes)


def read_shard(folder: str | Path, rank: int, map_location: str | torch.device = "cpu") -> Any:
    """Rank ``rank``'s small state: ``rank{r}.pt`` (format 2) or ``memory-rank{r}.pt``
    without its memory (format 1)."""
    folder = Path(folder)
    if read_meta(folder)["format"] >= 2:
        return load_file(folder / f"rank{rank}.pt", map_location)
    shard = load_file(folder / f"memory-rank{rank}.pt", "cpu", mmap=True)
    shard.pop("memory", None)
    return {k: _to(v, map_location) for k, v in shard.items()}


def read_node_state(folder: str | Path, rank: int) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s node state as it was saved, read whole: field -> (N_r, ...) CPU
    tensor (None: the checkpoint has none). Format 1 kept it as ``memory`` in
    ``memory-rank{r}.pt``."""
    folder = Path(folder)
    meta = read_meta(folder)
    if meta["format"] < 2:
        return load_file(folder / f"memory-rank{rank}.pt").get("memory")
    ns = meta.get("node_state")
    if not ns:
        return None
    # Each file checked against meta.json before its rows are used (open_field).
    return {k: torch.from_numpy(np.array(open_field(folder, meta, rank, k))) for k in ns["fields"]}


def _to(v: Any, where: str | torch.device) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(where)
    if isinstance(v, dict):
        return {k: _to(x, where) for k, x in v.items()}
    return v


class _Source:
    """A checkpoint's node state as arrays: the owner map and each rank's fields."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        meta = read_meta(folder)
        self.format = meta["format"]
        self.world_size = int(meta.get("world_size", 1))
        self.owner: Any = None
        if self.format >= 2:
            ns = meta.get("node_state")
            self.fields = dict(ns["fields"]) if ns else {}
            self.num_nodes = int(ns["num_nodes"]) if ns else 0
            if OWNER in meta["files"]:
                self.owner = open_npy(folder / OWNER)
            return
        state = load_file(folder / "state.pt")
        data = state.get("data", state)
        owner = data["owner"]
        self.num_nodes = int(owner.numel())
        if self.world_size > 1:
            self.owner = owner.numpy()
        first = load_file(folder / "memory-rank0.pt", mmap=True)["memory"]
        self.fields = {k: {"row_shape": list(v.shape[1:])} for k, v in first.items()}

    def rank(self, r: int, names: list[str]) -> dict[str, np.ndarray]:
        """Rank ``r``'s arrays of the fields ``names``, memory-mapped and checked
        against ``meta.json`` (:func:`open_field`)."""
        if self.format >= 2:
            meta = read_meta(self.folder)
            return {k: open_field(self.folder, meta, r, k) for k in names}
        mem = load_file(self.folder / f"memory-rank{r}.pt", mmap=True)["memory"]
        return {k: mem[k].numpy() for k in names}


class NodeStateFiles:
    """A checkpoint's node-state files opened once, for many reads of a few rows each
    (:func:`load_node_state` with ``files``): the ``.npy`` memory maps of every rank
    and the owner map's per-window counts are not set up again for each read.

    Each file that keeps chunk sums matching ``meta.json`` has a :class:`ChunkChecker`:
    the chunks that the rows read lie in are checked before the rows are used, each
    once; the other files are those that :func:`find_checkpoint` (``lazy`` or not)
    hashed whole.

    Args:
        folder: A ``step-N`` folder (format 1 or 2), found by :func:`find_checkpoint`.

    Attributes:
        checkers: Per rank, field -> :class:`ChunkChecker` of the files checked on read.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.source = _Source(self.folder)
        names = list(self.source.fields)
        self.arrays = [self.source.rank(r, names) for r in range(self.source.world_size)]
        self.locate = _Locator(self.source.owner, self.source.world_size, self.source.num_nodes)
        self.checkers: list[dict[str, ChunkChecker]] = [{} for _ in self.arrays]
        if self.source.format < 2:
            return
        meta = read_meta(self.folder)
        for r, arrays in enumerate(self.arrays):
            for k, a in arrays.items():
                rel = f"{NODE_DIR}/rank{r}/{k}.npy"
                sums = read_sums(self.folder, meta, rel)
                if sums is not None:
                    row = a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
                    self.checkers[r][k] = ChunkChecker(
                        self.folder / rel, sums, chunk_of(meta), int(a.offset), row
                    )


def open_field(folder: Path, meta: dict[str, Any], rank: int, name: str) -> np.ndarray:
    """Rank ``rank``'s array of node-state field ``name`` of a format-2 checkpoint,
    memory-mapped, after checking it is what ``meta.json`` says it is.

    A file whose digest matches may still not be Sven's (a hand-edited or foreign
    checkpoint with its digests recomputed): its dtype and shape are checked before
    any row of it is used.

    Args:
        folder: The ``step-N`` folder.
        meta: Its ``meta.json`` (:func:`read_meta`).
        rank: The rank whose shard is read.
        name: The field (``memory``, ``mail``, ...).

    Returns:
        The (N_r, *row_shape) array.

    Raises:
        SvenError: One line naming the file and the mismatch.
    """
    path = folder / NODE_DIR / f"rank{rank}" / f"{name}.npy"
    ns = meta.get("node_state") or {}
    spec = (ns.get("fields") or {}).get(name) or {}
    try:
        arr = open_npy(path)
    except ValueError as exc:
        # Python objects (only a pickle could read them), a damaged header.
        raise SvenError(f"{path}: not a node-state array ({exc})") from None
    except OSError as exc:
        raise SvenError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        dtype = np.dtype(spec["dtype"]) if "dtype" in spec else arr.dtype
    except TypeError:
        dtype = None
    if dtype is None or arr.dtype != dtype or arr.dtype.kind not in "biuf":
        raise SvenError(
            f"{path}: dtype {arr.dtype}; {folder / 'meta.json'} records "
            f"{spec.get('dtype', '?')} for node-state field {name}"
        )
    rows = ns.get("rows")
    want_rows = int(rows[rank]) if isinstance(rows, list) and rank < len(rows) else arr.shape[0]
    want = (want_rows, *spec.get("row_shape", arr.shape[1:]))
    if tuple(arr.shape) != tuple(want):
        raise SvenError(
            f"{path}: shape {tuple(arr.shape)}; {folder / 'meta.json'} records "
            f"{tuple(want)} for node-state field {name}"
        )
    return arr


def load_node_state(
    folder: str | Path,
    dest: dict[str, torch.Tensor],
    rows: torch.Tensor,
    num_nodes: int | None = None,
    files: NodeStateFiles | None = None,
) -> dict[str, torch.Tensor]:
    """Fills ``dest`` with the node state of the vertices ``rows``, from any checkpoint.

    The checkpoint may have been written by any number of ranks, with any partition:
    "train on 2, predict on 1", or resume on the same P.

    Args:
        folder: A ``step-N`` folder (format 1 or 2).
        dest: field -> (n, ...) tensors on any device, filled in place (row i gets
            vertex ``rows[i]``); its fields must be in the checkpoint.
        rows: (n,) int64 global vertex ids.
        num_nodes: The number of vertices the caller's data has; another number in the
            checkpoint is an error.
        files: ``folder``'s files opened before (:class:`NodeStateFiles`), for a caller
            that reads many times; None: opened for this read.

    Returns:
        ``dest``.

    Raises:
        SvenError: The checkpoint holds no node state, another number of vertices,
            other fields or other row shapes.
    """
    folder = Path(folder)
    src = _Source(folder) if files is None else files.source
    if not src.fields:
        raise SvenError(f"{folder} holds no node state")
    if num_nodes is not None and num_nodes != src.num_nodes:
        raise SvenError(
            f"{folder} holds the node state of {src.num_nodes} vertices; this run's data "
            f"has {num_nodes}"
        )
    for k, t in dest.items():
        if k not in src.fields:
            raise SvenError(f"{folder} holds no node-state field {k!r}")
        saved = tuple(src.fields[k]["row_shape"])
        if saved != tuple(t.shape[1:]) or t.shape[0] != rows.numel():
            raise SvenError(
                f"{folder}: node-state field {k} has rows of shape {saved}; this run's "
                f"are {tuple(t.shape[1:])}"
            )
    rows = rows.detach()
    # Unsorted requests (no caller of Sven's makes them) are sorted once: O(n) indices.
    order = host = None
    if not _ascending(rows):
        host = rows.cpu().numpy()
        order = np.argsort(host, kind="stable")
    if files is None:
        arrays = [src.rank(r, list(dest)) for r in range(src.world_size)]
        locate = _Locator(src.owner, src.world_size, src.num_nodes)
        checkers: list[dict[str, ChunkChecker]] = [{} for _ in arrays]
    else:
        arrays, locate, checkers = files.arrays, files.locate, files.checkers
    # Block by block of the requested vertices, in ascending id order: host memory is
    # a block's indices and a window of the owner map, not N.
    for s in range(0, rows.numel(), _WINDOW):
        e = min(s + _WINDOW, rows.numel())
        if order is None:
            at = np.arange(s, e, dtype=np.int64)
            ids = rows[s:e].cpu().numpy().astype(np.int64, copy=False)
        else:
            at = order[s:e]
            ids = host[at].astype(np.int64, copy=False)
        if ids[0] < 0 or ids[-1] >= src.num_nodes:
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise SvenError(f"{folder} holds {src.num_nodes} vertices; asked for id {bad}")
        owner, pos = locate(ids)
        for r in np.unique(owner):
            m = owner == r
            _copy(dest, arrays[int(r)], pos[m], at[m], checkers[int(r)])
    return dest


def _ascending(rows: torch.Tensor) -> bool:
    """Whether ``rows`` is non-decreasing (checked on its device, one flag read)."""
    return rows.numel() < 2 or bool((rows[1:] >= rows[:-1]).all())


class _Locator:
    """Where each vertex's rows are in a checkpoint: its owner, and its row in the
    owner's shard (the vertices the owner has, by ascending id).

    The owner map is read once, window by window, into per-window counts of each
    rank's vertices ((N / window, P) numbers); a window's positions are worked out when
    a block of vertices reaches it (the last one is kept).
    """

    def __init__(self, owner: Any, world_size: int, num_nodes: int) -> None:
        self.owner, self.world_size = owner, world_size
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None
        if owner is None:
            return
        windows = -(-num_nodes // _WINDOW)
        self.before = np.zeros((windows + 1, world_size), dtype=np.int64)
        for w in range(windows):
            o = np.asarray(owner[w * _WINDOW : (w + 1) * _WINDOW]).astype(np.int64)
            self.before[w + 1] = self.before[w] + np.bincount(o, minlength=world_size)

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(owner, row in its shard) of each vertex ``ids`` (ascending)."""
        if self.owner is None:
            # One rank owned everything: a vertex's row is its id.
            return np.zeros_like(ids), ids
        owner, pos = np.empty_like(ids), np.empty_like(ids)
        wins = ids // _WINDOW
        for w in np.unique(wins):
            a, b = np.searchsorted(wins, [w, w + 1])
            o, within = self._window(int(w))
            local = ids[a:b] - w * _WINDOW
            owner[a:b] = o[local]
            pos[a:b] = self.before[w][o[local]] + within[local]
        return owner, pos

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cached is None or self._cached[0] != w:
            o = np.asarray(self.owner[w * _WINDOW : (w + 1) * _WINDOW]).astype(np.int64)
            self._cached = (w, o, _rank_within(o, self.world_size))
        return self._cached[1], self._cached[2]


def _rank_within(o: np.ndarray, world_size: int) -> np.ndarray:
    """For each vertex of a window, how many vertices before it in the window have its
    owner: (w,) positions in the owners' shards, relative to the window's start."""
    order = np.argsort(o, kind="stable")
    first = np.searchsorted(o[order], np.arange(world_size))
    pos = np.empty_like(order)
    pos[order] = np.arange(o.size) - first[o[order]]
    return pos


def _copy(
    dest: dict[str, torch.Tensor],
    src: dict[str, np.ndarray],
    src_rows: np.ndarray,
    dest_rows: np.ndarray,
    checkers: dict[str, ChunkChecker],
) -> None:
    """``dest[k][dest_rows] = src[k][src_rows]`` for every field, in bounded pieces,
    each field's chunks checked first where it has a checker."""
    for k, t in dest.items():
        a = src[k]
        if k in checkers:
            checkers[k].rows(src_rows)
        row_bytes = max(1, a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)))
        step = max(1, _COPY_BYTES // row_bytes)
        for s in range(0, src_rows.size, step):
            sr, dr = src_rows[s : s + step], dest_rows[s : s + step]
            if _run(sr):
                block = np.array(a[sr[0] : sr[-1] + 1])  # consecutive rows: one read
            else:
                block = a[sr]
            part = torch.from_numpy(block).to(device=t.device, dtype=t.dtype)
            if _run(dr):
                t[int(dr[0]) : int(dr[-1]) + 1].copy_(part)
            else:
                t.index_copy_(0, torch.from_numpy(dr).to(t.device), part)


def _run(idx: np.ndarray) -> bool:
    """Whether ``idx`` is a run of consecutive ids (a slice, not a gather)."""
    return bool(idx[-1] - idx[0] + 1 == idx.size and np.all(np.diff(idx) == 1))
