"""The partition directory: layout, round trip, checksums, atomic writes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sven.errors import DataError
from sven.partition.store import load_partition, write_partition

OWNER = np.array([0, 2, 1, 1, 0])
ASSIGN = np.array([1, 0, 0, 2, 1, 1, 0])


def _write(path, **kw):
    meta = {"strategy": "hash", "parts": 3, "batch_size": 2}
    return write_partition(path, OWNER, ASSIGN, meta, **kw)


def test_layout_and_round_trip(tmp_path):
    out = tmp_path / "p"
    part = _write(out)
    names = sorted(f.name for f in out.iterdir())
    assert names == [
        "assign.npy",
        "events_rank0.npy",
        "events_rank1.npy",
        "events_rank2.npy",
        "meta.json",
        "owner.npy",
    ]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format_version"] == 1 and meta["parts"] == 3
    assert (meta["num_nodes"], meta["num_events"]) == (5, 7)
    assert set(meta["checksums"]) == set(names) - {"meta.json"}
    assert np.load(out / "owner.npy").dtype == np.int32
    assert np.load(out / "assign.npy").dtype == np.int16
    np.testing.assert_array_equal(part.events[0], [1, 2, 6])
    np.testing.assert_array_equal(part.events[1], [0, 4, 5])
    np.testing.assert_array_equal(part.events[2], [3])

    loaded = load_partition(out, verify=True)
    np.testing.assert_array_equal(loaded.owner, OWNER)
    np.testing.assert_array_equal(loaded.assign, ASSIGN)
    assert loaded.parts == 3
    for r in range(3):
        assert loaded.events[r].dtype == np.int64
        np.testing.assert_array_equal(loaded.events[r], part.events[r])
    # Event lists are a disjoint cover of all events.
    every = np.sort(np.concatenate([loaded.events[r] for r in range(3)]))
    np.testing.assert_array_equal(every, np.arange(7))

    one = load_partition(out, rank=2)
    assert list(one.events) == [2]


def test_refuses_to_overwrite_unless_asked(tmp_path):
    out = tmp_path / "p"
    _write(out)
    with pytest.raises(DataError, match="already exists"):
        _write(out)
    write_partition(out, OWNER, np.zeros(7, int), {"parts": 3}, overwrite=True)
    assert load_partition(out).events[0].shape == (7,)
    assert [f.name for f in tmp_path.iterdir()] == ["p"]


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(DataError, match="owner values"):
        write_partition(tmp_path / "p", np.array([0, 3]), ASSIGN, {"parts": 3})
    with pytest.raises(DataError, match="assign values"):
        write_partition(tmp_path / "p", OWNER, ASSIGN - 1, {"parts": 3})
    assert list(tmp_path.iterdir()) == []


def test_load_rejects_bad_directories(tmp_path):
    with pytest.raises(DataError, match=r"no meta\.json"):
        load_partition(tmp_path)
    out = tmp_path / "p"
    _write(out)
    with pytest.raises(DataError, match="rank 3 outside"):
        load_partition(out, rank=3)
    np.save(out / "events_rank1.npy", np.array([0, 4], dtype=np.int64))
    with pytest.raises(DataError, match=r"checksum mismatch for events_rank1\.npy"):
        load_partition(out, verify=True)
    (out / "owner.npy").unlink()
    with pytest.raises(DataError, match=r"missing owner\.npy"):
        load_partition(out)
    meta = json.loads((out / "meta.json").read_text())
    meta["format_version"] = 99
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="format_version 99"):
        load_partition(out)


def test_a_partition_meets_only_the_store_it_was_built_for(tmp_path) -> None:
    from sven.datasets.store import TemporalEvents, write_events
    from sven.partition.api import store_info
    from sven.partition.store import check_matches

    # Two stores of the same events (src, dst, t) whose edge features differ.
    src, dst, t = np.array([0, 1, 2, 3, 4, 0, 1]), np.array([1, 2, 3, 4, 0, 2, 3]), np.arange(7)
    feat = np.arange(14, dtype=np.float32).reshape(7, 2)
    write_events(tmp_path / "a", src, dst, t, edge_feat=feat, num_nodes=5)
    write_events(tmp_path / "b", src, dst, t, edge_feat=feat + 1, num_nodes=5)
    a, b = TemporalEvents.load(tmp_path / "a"), TemporalEvents.load(tmp_path / "b")
    meta = {"strategy": "hash", "parts": 3, "store": {"path": "a", **store_info(a)}}
    part = write_partition(tmp_path / "p", OWNER, ASSIGN, meta)
    check_matches(part, a, tmp_path / "p")
    with pytest.raises(DataError, match="the partition was built for another dataset"):
        check_matches(part, b, tmp_path / "p")
    # A partition of an older Sven, without a fingerprint: its columns' checksums decide.
    del part.meta["store"]["fingerprint"]
    check_matches(part, b, tmp_path / "p")
