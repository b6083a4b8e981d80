"""Structural checks on every store load, ``verify_checksums``, and the overwrite rules.

Each test damages a tiny hand-built store in one way and expects a one-line
``DataError`` that names the damaged file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sven.datasets.checksums import verify_checksums
from sven.datasets.store import TemporalEvents, write_events
from sven.datasets.target import check_target, is_store
from sven.errors import DataError, SvenError


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """10 events on 4 nodes, with 2-wide edge features: 7 train, 2 val, 1 test (or so)."""
    src = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    dst = np.array([1, 2, 3, 0, 2, 3, 0, 1, 3, 2])
    t = np.arange(10) * 10
    feat = np.arange(20, dtype=np.float32).reshape(10, 2)
    write_events(tmp_path / "s", src, dst, t, edge_feat=feat, num_nodes=4)
    return tmp_path / "s"


def _meta(store: Path) -> dict:
    return json.loads((store / "meta.json").read_text())


def _set_meta(store: Path, meta: object) -> None:
    (store / "meta.json").write_text(json.dumps(meta))


def _error(store: Path, **kw) -> DataError:
    with pytest.raises(DataError) as info:
        TemporalEvents.load(store, **kw)
    assert "\n" not in str(info.value)
    return info.value


def test_an_intact_store_loads_and_verifies(store: Path) -> None:
    ev = TemporalEvents.load(store, verify=True)
    assert ev.num_events == 10 and ev.num_nodes == 4
    assert verify_checksums(store) == 6  # src dst t split edge_feat id_map
    assert is_store(store) and not is_store(store.parent)


def test_a_truncated_column_is_named(store: Path) -> None:
    f = store / "t.npy"
    f.write_bytes(f.read_bytes()[:-3])
    err = _error(store)
    assert err.path == str(f) and err.reason.startswith("truncated:")


def test_trailing_bytes_are_named(store: Path) -> None:
    f = store / "src.npy"
    f.write_bytes(f.read_bytes() + b"\0" * 8)
    assert _error(store).reason.startswith("has trailing bytes")


def test_a_garbage_header_is_named(store: Path) -> None:
    f = store / "dst.npy"
    f.write_bytes(b"this is not an npy file at all" * 4)
    err = _error(store)
    assert err.path == str(f) and "corrupt .npy header" in err.reason


def test_a_wrong_dtype_or_shape_is_named(store: Path) -> None:
    np.save(store / "split.npy", np.zeros(10, dtype=np.int64))
    assert "dtype int64" in _error(store).reason
    np.save(store / "split.npy", np.zeros((10, 1), dtype=np.uint8))
    assert "expected 1 dimension" in _error(store).reason
    np.save(store / "split.npy", np.zeros(9, dtype=np.uint8))
    assert _error(store).reason == "9 rows, meta.json says 10"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: [m], "corrupt meta.json: expected an object, got list"),
        (lambda m: {k: v for k, v in m.items() if k != "num_nodes"}, "missing key 'num_nodes'"),
        (lambda m: {**m, "num_events": "10"}, "num_events is '10'"),
        (lambda m: {**m, "split": {"counts": {"train": 1}}}, "split counts"),
        (lambda m: {**m, "num_src_nodes": 9}, "num_src_nodes is 9"),
    ],
)
def test_a_broken_meta_json_is_named(store: Path, change, reason: str) -> None:
    _set_meta(store, change(_meta(store)))
    err = _error(store)
    assert err.path == str(store / "meta.json") and reason in err.reason


def test_meta_json_that_is_not_json_is_named(store: Path) -> None:
    (store / "meta.json").write_bytes(b"\xff\xfe{")
    assert "corrupt meta.json" in _error(store).reason


def test_ids_beyond_num_nodes_are_named(store: Path) -> None:
    np.save(store / "dst.npy", np.array([1, 2, 3, 0, 2, 7, 0, 1, 3, 2], dtype=np.int32))
    err = _error(store)
    assert err.path == str(store / "dst.npy")
    assert err.reason == "row 5: node id 7 outside [0, 4) (num_nodes in meta.json)"


def test_time_going_backwards_is_named(store: Path) -> None:
    t = np.arange(10, dtype=np.int64) * 10
    t[6] = 5
    np.save(store / "t.npy", t)
    assert _error(store).reason == "row 6: time goes backwards"


def test_split_labels_that_disagree_with_the_counts_are_named(store: Path) -> None:
    split = np.load(store / "split.npy")
    split[0] = 2  # same size, same dtype: only the values or the checksum can tell
    np.save(store / "split.npy", split)
    err = _error(store)
    assert err.path == str(store / "split.npy") and err.reason.startswith("row 0: split label 2")


def test_overwritten_bytes_fail_the_checksums(store: Path) -> None:
    f = store / "edge_feat.npy"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF  # a valid float32 still: only the checksum can tell
    f.write_bytes(bytes(raw))
    TemporalEvents.load(store)  # the structure is fine
    err = _error(store, verify=True)
    assert err.path == str(f) and err.reason.startswith("checksum mismatch")
    with pytest.raises(DataError, match="checksum mismatch"):
        verify_checksums(store)


def test_an_unlisted_column_fails_verification(store: Path) -> None:
    np.save(store / "label.npy", np.zeros(10, dtype=np.int64))
    with pytest.raises(DataError, match=r"not listed in meta\.json's checksums"):
        verify_checksums(store)


def test_overwrite_replaces_only_a_store_and_never_the_input(tmp_path: Path, store: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(SvenError, match="already exists"):
        check_target(folder, overwrite=False)
    with pytest.raises(SvenError, match="not an event store"):
        check_target(folder, overwrite=True)
    with pytest.raises(SvenError, match="holds the input"):
        check_target(folder, overwrite=True, inputs=(folder / "notes.txt",))
    assert (folder / "notes.txt").read_text() == "keep me"
    # An empty folder or a missing one may always be written; a store may be replaced.
    (tmp_path / "empty").mkdir()
    assert check_target(tmp_path / "empty", overwrite=False) is None
    assert check_target(tmp_path / "new", overwrite=False) is None
    assert check_target(store, overwrite=True)["num_events"] == 10
    # write_events applies the same rule.
    with pytest.raises(SvenError, match="not an event store"):
        write_events(folder, np.array([0]), np.array([1]), np.array([0]), overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
