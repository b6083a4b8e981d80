"""The writer's column files (sven.datasets.spool): spooled columns that widen, ``.npy``
files appended chunk by chunk, and the stable time sort, in memory or bucketed on disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sven.datasets.spool import NpyAppender, Spool, sorted_stream


def test_a_spool_widens_its_dtype_once_a_wider_chunk_comes(tmp_path: Path) -> None:
    t = Spool(tmp_path / "t")
    t.append(np.array([3, 1], dtype=np.int64))
    t.append(np.array([2.5]))
    t.finish()
    assert (t.dtype, t.rows) == (np.float64, 3)
    assert t.read(0, 3).tolist() == [3.0, 1.0, 2.5]
    ids = Spool(tmp_path / "ids")
    ids.append(np.array(["a", "b"]))
    ids.append(np.array(["ccc"]))
    ids.finish()
    assert ids.read(1, 3).tolist() == ["b", "ccc"]


def test_npy_appender_writes_a_column_of_known_shape(tmp_path: Path) -> None:
    out = NpyAppender(tmp_path / "f.npy", np.float32, (3, 2))
    out.append(np.array([[1, 2]]))
    out.append(np.array([[3, 4], [5, 6]]))
    out.close()
    assert np.load(tmp_path / "f.npy").tolist() == [[1, 2], [3, 4], [5, 6]]
    short = NpyAppender(tmp_path / "g.npy", np.int64, (2,))
    short.append(np.array([1]))
    with pytest.raises(RuntimeError, match="wrote 1 rows, expected 2"):
        short.close()


def _spools(folder: Path, t: list, ids: list) -> dict[str, Spool]:
    folder.mkdir()
    out = {"t": Spool(folder / "t"), "src": Spool(folder / "src")}
    out["t"].append(np.array(t))
    out["src"].append(np.array(ids))
    for s in out.values():
        s.finish()
    return out


@pytest.mark.parametrize("budget", [1 << 20, 64])
def test_events_come_back_in_stable_time_order(tmp_path: Path, budget: int) -> None:
    # 16 bytes a row: a 64-byte budget sorts 4 rows at once, in buckets on disk.
    t = [5, 1, 3, 1, 5, 0, 3, 2, 1, 4]
    spools = _spools(tmp_path / "in", t, list(range(10)))
    chunks = list(sorted_stream(spools, False, budget, tmp_path))
    t_out = np.concatenate([c["t"] for c in chunks]).tolist()
    src_out = np.concatenate([c["src"] for c in chunks]).tolist()
    assert t_out == sorted(t)
    # Equal times keep their input order.
    assert src_out == [5, 1, 3, 8, 7, 2, 6, 9, 0, 4]


def test_events_in_order_are_read_as_they_are(tmp_path: Path) -> None:
    spools = _spools(tmp_path / "in", [0, 1, 1], [7, 8, 9])
    (chunk,) = sorted_stream(spools, True, 64, tmp_path)
    assert (chunk["t"].tolist(), chunk["src"].tolist()) == ([0, 1, 1], [7, 8, 9])
