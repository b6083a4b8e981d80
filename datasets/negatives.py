"""Fixed evaluation negatives: TGB's negative-sample files, aligned with a store's events.

TGB evaluates its ``tgbl-*`` datasets one-vs-many against negatives it ships per split
(``<name>_val_ns.pkl``, ``<name>_test_ns.pkl``): a pickled dict that maps each val/test
edge ``(src, dst, t)`` (TGB's node ids) to an array of negative destination ids. This
module reads such a file without running anything it contains (:func:`read_negatives`),
maps its ids to the store's compact ids and lines its rows up with the split's events in
store order (:func:`align_negatives`); :func:`import_negatives` does both and adds the
result to the store with :func:`write_eval_negatives` (``neg_<split>.npy``, with its
width, source and checksum in ``meta.json``).

A ``.npz`` with arrays ``src``, ``dst``, ``t`` (n,) and ``neg`` (n, q), -1 padded, is
accepted as well.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sven.datasets.layout import NEG_SPLITS, load_meta
from sven.digest import sha256_file
from sven.errors import DataError, SvenError
from sven.ownership import lock_folder

__all__ = [
    "RawNegatives",
    "align_negatives",
    "import_negatives",
    "read_negatives",
    "refuse_existing_negatives",
    "write_eval_negatives",
]

# What a pickle of TGB's negatives needs: containers and numbers, and numpy's array,
# dtype and scalar reconstruction (``numpy.core`` before numpy 2, ``numpy._core`` after;
# ``_codecs.encode`` carries array bytes in protocol-2 pickles). Nothing else is found.
_SAFE_GLOBALS = frozenset(
    {
        ("builtins", "dict"),
        ("builtins", "list"),
        ("builtins", "tuple"),
        ("builtins", "int"),
        ("builtins", "float"),
        ("_codecs", "encode"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        *(
            (f"numpy.{core}.{mod}", name)
            for core in ("core", "_core")
            for mod, name in (
                ("multiarray", "_reconstruct"),
                ("multiarray", "scalar"),
                ("numeric", "_frombuffer"),
            )
        ),
    }
)


class _NegativesUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`_SAFE_GLOBALS`: a pickle naming any other
    callable (``os.system``, ``builtins.eval``...) fails before it can be called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _SAFE_GLOBALS:
            raise DataError(
                f"refusing to load {module}.{name}: a negatives file holds only a dict of "
                "(src, dst, t) tuples to arrays of node ids"
            )
        if module.startswith("numpy.core."):
            # numpy >= 2 keeps these under numpy._core (numpy.core warns on import).
            try:
                return getattr(importlib.import_module("numpy._core" + module[10:]), name)
            except ImportError:
                pass
        return getattr(importlib.import_module(module), name)


@dataclass
class RawNegatives:
    """Negatives as a file gives them, in its own node ids.

    Attributes:
        src, dst: (n,) int64 raw ids of the edges' endpoints.
        t: (n,) int64 or float64 times.
        neg: (n, q) int64 raw ids of the negatives, -1 where an edge has fewer than q.
    """

    src: np.ndarray
    dst: np.ndarray
    t: np.ndarray
    neg: np.ndarray


def _int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def read_negatives(path: str | os.PathLike[str]) -> RawNegatives:
    """Reads a TGB negatives pickle (or the ``.npz`` alternative) without executing it.

    Args:
        path: ``*.pkl`` (a dict ``(src, dst, t) -> sequence of ids``) or ``*.npz``.

    Raises:
        DataError: Unreadable or malformed content, or a pickle that names anything
            beyond plain containers, numbers and numpy arrays.
    """
    path = Path(path)
    if path.suffix == ".npz":
        return _read_npz(path)
    try:
        with open(path, "rb") as f:
            obj = _NegativesUnpickler(f).load()
    except DataError as exc:
        raise DataError(exc.reason, path) from None
    except OSError as exc:
        raise DataError(f"cannot read: {exc.strerror or exc}", path) from None
    except Exception as exc:  # a truncated or foreign file: any unpickling error
        raise DataError(f"not a negatives pickle: {type(exc).__name__}: {exc}", path) from None
    if not isinstance(obj, dict):
        raise DataError(f"expected a dict of (src, dst, t) -> ids, got {type(obj).__name__}", path)
    n = len(obj)
    src = np.empty(n, dtype=np.int64)
    dst = np.empty(n, dtype=np.int64)
    times: list[Any] = []
    rows: list[np.ndarray] = []
    for i, (key, value) in enumerate(obj.items()):
        if not isinstance(key, tuple) or len(key) != 3:
            raise DataError(
                f"key {key!r}: expected a (src, dst, t) tuple (files of edge-typed "
                "datasets, keyed (src, dst, t, type), are not supported)",
                path,
            )
        s, d, t = key
        if not (_int(s) and _int(d)) or not isinstance(t, int | float | np.integer | np.floating):
            raise DataError(f"key {key!r}: src and dst must be integers, t a number", path)
        src[i], dst[i] = s, d
        times.append(t)
        arr = np.asarray(value)
        if arr.ndim != 1 or not (arr.size == 0 or arr.dtype.kind in "iu" or _all_int(arr)):
            raise DataError(f"key {key!r}: negatives must be a 1-D sequence of integers", path)
        rows.append(arr.astype(np.int64))
    if any(r.size and r.min() < 0 for r in rows):
        raise DataError("negative node ids in the negatives", path)
    q = max((r.size for r in rows), default=0)
    neg = np.full((n, q), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        neg[i, : r.size] = r
    tk = np.asarray(times)
    t_arr = tk.astype(np.int64) if tk.dtype.kind in "iu" else tk.astype(np.float64)
    return RawNegatives(src, dst, t_arr, neg)


def _all_int(arr: np.ndarray) -> bool:
    """An object array of Python/numpy integers (a list of ints becomes int64 anyway)."""
    return arr.dtype.kind == "O" and all(_int(x) for x in arr)


def _read_npz(path: Path) -> RawNegatives:
    try:
        with np.load(path, allow_pickle=False) as z:
            cols = {k: np.asarray(z[k]) for k in ("src", "dst", "t", "neg") if k in z}
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"cannot read: {exc}", path) from None
    missing = [k for k in ("src", "dst", "t", "neg") if k not in cols]
    if missing:
        raise DataError(f"missing arrays {missing} (needs src, dst, t (n,) and neg (n, q))", path)
    src, dst, t, neg = cols["src"], cols["dst"], cols["t"], cols["neg"]
    n = src.shape[0]
    if src.shape != (n,) or dst.shape != (n,) or t.shape != (n,) or neg.ndim != 2:
        raise DataError("src, dst, t must be (n,) and neg (n, q)", path)
    if neg.shape[0] != n or any(a.dtype.kind not in "iu" for a in (src, dst, neg)):
        raise DataError("src, dst and neg must be integers, neg with one row per edge", path)
    if t.dtype.kind not in "iuf":
        raise DataError(f"t must be numeric, got {t.dtype}", path)
    if (src < 0).any() or (dst < 0).any() or (neg < -1).any():
        raise DataError("node ids must be >= 0 (neg: -1 pads)", path)
    t = t.astype(np.int64) if t.dtype.kind in "iu" else t.astype(np.float64)
    return RawNegatives(src.astype(np.int64), dst.astype(np.int64), t, neg.astype(np.int64))


def _sorted(id_map: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``id_map`` sorted, and the compact id of each sorted entry (for :func:`_compact`)."""
    order = np.argsort(id_map, kind="stable")
    return id_map[order], order


def _compact(
    sorted_map: tuple[np.ndarray, np.ndarray], base: int, raw: np.ndarray, what: str, path: Path
) -> np.ndarray:
    """Compact ids ``base + i`` of raw ids found in an id map (:func:`_sorted`; ids -1
    stay -1)."""
    ids, order = sorted_map
    keys = raw.astype(str) if ids.dtype.kind == "U" else raw
    pos = np.minimum(np.searchsorted(ids, keys), max(ids.size - 1, 0))
    real = raw >= 0
    found = (ids[pos] == keys) if ids.size else np.zeros(raw.shape, dtype=bool)
    if not (found | ~real).all():
        bad = raw[real & ~found].flat[0]
        raise DataError(
            f"{what} id {bad} is not a node of the store; the file's ids must be the "
            "ones the store was converted from (id_map.npy), or its compact ids with "
            "--ids compact",
            path,
        )
    return np.where(real, base + order[pos], -1)


def _store_ids(
    ev: Any, raw: RawNegatives, ids: str, file: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The file's sources, destinations and negatives in the store's compact ids
    (``ids``: how the file numbers nodes, as :func:`align_negatives` takes it).

    Raises:
        DataError: The file names a node the store does not have.
    """
    n_nodes = ev.num_nodes
    if ids == "compact":
        for what, a in (("source", raw.src), ("destination", raw.dst), ("negative", raw.neg)):
            bad = a >= n_nodes
            if bad.any():
                raise DataError(
                    f"{what} id {int(a[bad].flat[0])} is not a node of the store "
                    f"(--ids compact: ids are 0..{n_nodes - 1})",
                    file,
                )
        return raw.src, raw.dst, raw.neg
    if ids == "raw":
        id_map = np.asarray(ev.id_map)
        u = ev.num_src_nodes if ev.bipartite else None
        # A bipartite store keeps each side's own raw ids: look sources up among the
        # first U, destinations (and negatives) among the rest. Each map is sorted once.
        if u is None:
            src_map = dst_map = _sorted(id_map)
            dst_base = 0
        else:
            src_map, dst_map, dst_base = _sorted(id_map[:u]), _sorted(id_map[u:]), u
        return (
            _compact(src_map, 0, raw.src, "source", file),
            _compact(dst_map, dst_base, raw.dst, "destination", file),
            _compact(dst_map, dst_base, raw.neg, "negative", file),
        )
    raise ValueError(f"ids must be raw or compact, got {ids!r}")


def align_negatives(
    ev: Any, split: str, raw: RawNegatives, *, ids: str = "raw", path: str = "negatives"
) -> np.ndarray:
    """The negatives of every event of a split, in store order, in compact ids.

    Each event (s, d, t) takes the row of the file's edge with the same endpoints and
    time; events that repeat a triple share its row.

    Args:
        ev: The store (:class:`~sven.datasets.store.TemporalEvents`).
        split: ``"val"`` or ``"test"``.
        raw: The file's negatives (:func:`read_negatives`).
        ids: ``raw``: the file numbers nodes as the store's input did (``id_map.npy``;
            on a bipartite store sources among the sources', destinations among the
            destinations' raw ids); ``compact``: as the store does (0..N-1).
        path: The file, for messages.

    Returns:
        (n_split, q) int64, -1 where an edge has fewer than q negatives.

    Raises:
        DataError: An event of the split has no row in the file, or the file names a
            node the store does not have.
    """
    file = Path(path)
    src, dst, neg = _store_ids(ev, raw, ids, file)

    lo, hi = ev.split_range(split)
    es = np.asarray(ev.src[lo:hi], dtype=np.int64)
    ed = np.asarray(ev.dst[lo:hi], dtype=np.int64)
    et = np.asarray(ev.t[lo:hi])
    # The file's times in the store's dtype: integral floats match integer times.
    kt = raw.t
    if et.dtype.kind == "i" and kt.dtype.kind == "f":
        integral = np.isfinite(kt) & (kt == np.round(kt))
        kt = np.where(integral, kt, np.nan)
    kt_list = [None if isinstance(x, float) and x != x else x for x in kt.tolist()]
    if et.dtype.kind == "i":
        kt_list = [None if x is None else int(x) for x in kt_list]
    else:
        kt_list = [float(x) for x in kt_list]
    row_of = {key: i for i, key in enumerate(zip(src.tolist(), dst.tolist(), kt_list))}
    rows = np.empty(hi - lo, dtype=np.int64)
    for j, key in enumerate(zip(es.tolist(), ed.tolist(), et.tolist())):
        i = row_of.get(key)
        if i is None:
            raw_s, raw_d = ev.id_map[key[0]], ev.id_map[key[1]]
            raise DataError(
                f"{split} event {lo + j} (src {raw_s}, dst {raw_d}, t {key[2]} in the "
                f"store's input ids) has no negatives in the file: is it the {split} file "
                "of this dataset, converted with TGB's split?",
                file,
            )
        rows[j] = i
    out = neg[rows]
    # Keep the width the file gives only as far as some event of the split uses it.
    q = int((out >= 0).sum(1).max()) if out.size else 0
    return np.ascontiguousarray(out[:, :q])


def import_negatives(
    store: str | os.PathLike[str],
    split: str,
    file: str | os.PathLike[str],
    *,
    ids: str = "raw",
    overwrite: bool = False,
) -> np.ndarray:
    """Reads a negatives file, aligns it with a split of a store and stores it there.

    Args:
        store: The event store directory.
        split: ``"val"`` or ``"test"``.
        file: TGB's ``*_ns.pkl`` for that split (or the ``.npz`` alternative).
        ids: How the file numbers nodes (see :func:`align_negatives`).
        overwrite: Replace negatives the split already has.

    Returns:
        (n_split, q) the stored negatives.
    """
    from sven.datasets.store import TemporalEvents

    ev = TemporalEvents.load(store)
    if not overwrite:  # before reading a large file whose result would be refused
        refuse_existing_negatives(store, ev.meta, split)
    raw = read_negatives(file)
    neg = align_negatives(ev, split, raw, ids=ids, path=str(file))
    source = {"path": Path(file).name, "sha256": sha256_file(file), "ids": ids}
    del ev  # the memory maps, before the store's files are replaced
    write_eval_negatives(store, split, neg, source, overwrite=overwrite)
    return neg


def refuse_existing_negatives(
    path: str | os.PathLike[str], meta: dict[str, Any], split: str
) -> None:
    """Raises SvenError when the store at ``path`` (``meta``) has negatives of ``split``."""
    if split in meta.get("eval_negatives", {}) or (Path(path) / f"neg_{split}.npy").exists():
        raise SvenError(f"{path} already has {split} negatives; pass --overwrite to replace them")


def write_eval_negatives(
    path: str | os.PathLike[str],
    split: str,
    negatives: np.ndarray,
    source: dict[str, Any],
    *,
    overwrite: bool = False,
) -> None:
    """Adds fixed evaluation negatives of one split to a finished store.

    Writes ``neg_<split>.npy`` and records its width, its ``source`` and its checksum
    in ``meta.json``; both files are replaced by a rename, the column first, so an
    interruption leaves at worst a column whose checksum ``sven data verify`` rejects.

    Args:
        path: The store directory.
        split: ``"val"`` or ``"test"``.
        negatives: (n_split, q) int64 compact destination ids, -1 where an event has
            fewer than q.
        source: Where they came from (``{"path", "sha256"}``), kept in ``meta.json``.
        overwrite: Replace negatives the split already has.

    Raises:
        SvenError: The split has negatives and ``overwrite`` is False.
        DataError: The array does not fit the store.
    """
    if split not in NEG_SPLITS:
        raise ValueError(f"split must be one of {NEG_SPLITS}, got {split!r}")
    path = Path(path)
    with lock_folder(path, "sven data negatives"):
        _write_eval_negatives(path, split, negatives, source, overwrite)


def _write_eval_negatives(
    path: Path, split: str, negatives: np.ndarray, source: dict[str, Any], overwrite: bool
) -> None:
    meta = load_meta(path)
    file = path / f"neg_{split}.npy"
    if not overwrite:
        refuse_existing_negatives(path, meta, split)
    neg = np.ascontiguousarray(negatives, dtype=np.int64)
    n = int(meta["split"]["counts"][split])
    if neg.ndim != 2 or neg.shape[0] != n:
        raise DataError(f"{split} negatives of shape {neg.shape}, the split has {n} events", path)
    if neg.size and (neg.min() < -1 or neg.max() >= meta["num_nodes"]):
        raise DataError(f"{split} negatives outside [-1, {meta['num_nodes']})", path)
    tag = uuid.uuid4().hex[:12]
    tmp_col = path / f".{file.name}.{tag}"
    tmp_meta = path / f".meta.json.{tag}"
    try:
        with open(tmp_col, "wb") as f:  # a handle: np.save would append ".npy"
            np.save(f, neg, allow_pickle=False)
        meta.setdefault("eval_negatives", {})[split] = {"q": int(neg.shape[1]), "source": source}
        meta["checksums"][file.stem] = sha256_file(tmp_col)
        with open(tmp_meta, "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        os.replace(tmp_col, file)
        os.replace(tmp_meta, path / "meta.json")
    finally:
        for t in (tmp_col, tmp_meta):
            t.unlink(missing_ok=True)
