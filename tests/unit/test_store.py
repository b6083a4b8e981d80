"""The event store: format, sorting, id compaction, splits, atomicity, round trips."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sven.datasets.splits import sorted_quantile
from sven.datasets.store import StoreWriter, TemporalEvents, write_events
from sven.errors import ConfigError, DataError, SvenError

META_KEYS = {
    "format_version",
    "name",
    "num_events",
    "num_nodes",
    "bipartite",
    "num_src_nodes",
    "t_dtype",
    "t_min",
    "t_max",
    "edge_feat_dim",
    "node_feat_dim",
    "has_label",
    "split",
    "source",
    "sorted_on_ingest",
    "num_out_of_order",
    "checksums",
}


def leftovers(parent: Path) -> list[str]:
    """Hidden temporary directories the writer may have left beside its target."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_sorts_stably_and_numbers_ids_by_first_appearance(tmp_path):
    ev = write_events(
        tmp_path / "s",
        src=np.array([5, 7, 5, 9]),
        dst=np.array([7, 9, 9, 5]),
        t=np.array([3, 1, 2, 2]),
        label=np.array([0, 1, 0, 1]),
        edge_feat=np.arange(8, dtype=np.float32).reshape(4, 2),
    )
    # Time order (stable for the two events at t=2): rows 1, 2, 3, 0. First
    # appearances, source before destination: 7, 9, 5.
    np.testing.assert_array_equal(ev.t, [1, 2, 2, 3])
    np.testing.assert_array_equal(ev.id_map, [7, 9, 5])
    np.testing.assert_array_equal(ev.src, [0, 2, 1, 2])
    np.testing.assert_array_equal(ev.dst, [1, 1, 2, 0])
    np.testing.assert_array_equal(ev.label, [1, 0, 1, 0])
    np.testing.assert_array_equal(ev.edge_feat, [[2, 3], [4, 5], [6, 7], [0, 1]])
    assert ev.src.dtype == np.int32 and ev.t.dtype == np.int64
    assert ev.edge_feat.dtype == np.float32 and ev.label.dtype == np.int64
    assert ev.meta["sorted_on_ingest"] is True
    assert ev.meta["num_out_of_order"] == 1  # only t=1 after t=3 goes backwards
    assert isinstance(ev.src, np.memmap)


def test_meta_json_has_exactly_the_contract_keys(tmp_path):
    ev = write_events(tmp_path / "s", np.array([0, 1]), np.array([1, 0]), np.array([1, 2]))
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert set(meta) == META_KEYS
    assert meta["format_version"] == 1
    assert set(meta["split"]) == {"method", "fractions", "val_time", "test_time", "counts"}
    assert meta["split"]["method"] == "time_quantile"
    assert set(meta["checksums"]) == {"src", "dst", "t", "split", "id_map"}
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "dst.npy",
        "id_map.npy",
        "meta.json",
        "split.npy",
        "src.npy",
        "t.npy",
    ]
    assert ev.meta == meta
    TemporalEvents.load(tmp_path / "s", verify=True)


def test_ids_already_compact_are_kept(tmp_path):
    ev = write_events(tmp_path / "s", np.array([2, 0, 1]), np.array([1, 2, 0]), np.array([1, 2, 3]))
    np.testing.assert_array_equal(ev.src, [2, 0, 1])
    np.testing.assert_array_equal(ev.id_map, [0, 1, 2])


def test_fixed_num_nodes_keeps_ids_and_isolated_nodes(tmp_path):
    ev = write_events(
        tmp_path / "s", np.array([3, 1]), np.array([1, 3]), np.array([1, 2]), num_nodes=6
    )
    assert ev.num_nodes == 6
    np.testing.assert_array_equal(ev.src, [3, 1])
    np.testing.assert_array_equal(ev.id_map, np.arange(6))
    with pytest.raises(DataError, match="event 1: destination id 6 out of range for 6 nodes"):
        write_events(
            tmp_path / "t", np.array([0, 1]), np.array([1, 6]), np.array([1, 2]), num_nodes=6
        )


def test_node_features_fix_the_node_count(tmp_path):
    node_feat = np.arange(8, dtype=np.float32).reshape(4, 2)
    ev = write_events(
        tmp_path / "s", np.array([0, 2]), np.array([2, 0]), np.array([1, 2]), node_feat=node_feat
    )
    assert ev.num_nodes == 4 and ev.meta["node_feat_dim"] == 2
    np.testing.assert_array_equal(ev.node_feat, node_feat)


@pytest.mark.parametrize(
    ("src", "dst", "want_src", "want_dst", "want_map"),
    [
        # 0-based items are offset after the users.
        ([0, 1, 2], [0, 1, 0], [0, 1, 2], [3, 4, 3], [0, 1, 2, 0, 1]),
        # Items already offset after the users (JODIE's Wikipedia copy) are kept.
        ([0, 1, 2], [3, 4, 3], [0, 1, 2], [3, 4, 3], [0, 1, 2, 3, 4]),
        # Gaps: each side numbered by first appearance, items after users.
        ([10, 30, 10], [7, 5, 7], [0, 1, 0], [2, 3, 2], [10, 30, 7, 5]),
    ],
)
def test_bipartite_id_spaces(tmp_path, src, dst, want_src, want_dst, want_map):
    ev = write_events(tmp_path / "s", np.array(src), np.array(dst), np.arange(3), bipartite=True)
    np.testing.assert_array_equal(ev.src, want_src)
    np.testing.assert_array_equal(ev.dst, want_dst)
    np.testing.assert_array_equal(ev.id_map, want_map)
    assert ev.bipartite and ev.num_src_nodes == max(want_src) + 1


def test_bipartite_is_detected_when_sources_precede_destinations(tmp_path):
    ev = write_events(tmp_path / "a", np.array([0, 1]), np.array([2, 3]), np.array([1, 2]))
    assert ev.bipartite and ev.num_src_nodes == 2
    ev = write_events(tmp_path / "b", np.array([0, 2]), np.array([2, 3]), np.array([1, 2]))
    assert not ev.bipartite and ev.num_src_nodes is None
    ev = write_events(
        tmp_path / "c", np.array([0, 1]), np.array([2, 3]), np.array([1, 2]), bipartite=False
    )
    assert not ev.bipartite


def test_string_ids(tmp_path):
    ev = write_events(
        tmp_path / "s",
        np.array(["bob", "al", "bob"]),
        np.array(["al", "carol", "carol"]),
        np.array([2.5, 1.0, 3.0]),
        allow_string_ids=True,
    )
    np.testing.assert_array_equal(ev.id_map, ["al", "carol", "bob"])
    np.testing.assert_array_equal(ev.src, [0, 2, 2])
    np.testing.assert_array_equal(ev.dst, [1, 0, 1])
    with pytest.raises(DataError, match="strings"):
        write_events(tmp_path / "t", np.array(["a"]), np.array(["b"]), np.array([1]))


def test_splits_follow_dyglib_time_quantiles(tmp_path):
    rng = np.random.default_rng(0)
    t = np.sort(rng.integers(0, 50, 1000))  # many ties at the boundaries
    ev = write_events(tmp_path / "s", rng.integers(0, 30, 1000), rng.integers(0, 30, 1000), t)
    val_time, test_time = np.quantile(t, [0.70, 0.85])
    split = ev.meta["split"]
    assert (split["val_time"], split["test_time"]) == (val_time, test_time)
    assert split["fractions"] == [0.7, 0.15, 0.15]
    want = np.where(t <= val_time, 0, np.where(t <= test_time, 1, 2))
    np.testing.assert_array_equal(ev.split, want)
    assert split["counts"] == {
        n: int((want == i).sum()) for i, n in enumerate(("train", "val", "test"))
    }
    assert ev.split_range("train") == (0, int((want == 0).sum()))
    assert ev.split_range("test") == (int((want < 2).sum()), 1000)


def test_split_fractions_are_configurable_and_checked(tmp_path):
    ids = np.arange(10) % 2
    ev = write_events(tmp_path / "s", ids, 1 - ids, np.arange(10), val_frac=0.2, test_frac=0.1)
    assert ev.meta["split"]["counts"] == {"train": 7, "val": 2, "test": 1}  # 0.7 / 0.9 quantiles
    with pytest.raises(ConfigError, match=r"val \+ test < 1"):
        write_events(tmp_path / "t", ids, 1 - ids, np.arange(10), val_frac=0.5, test_frac=0.5)


@given(
    st.lists(st.integers(-(10**6), 10**6), min_size=1, max_size=60),
    st.floats(0, 1),
)
@settings(max_examples=200, deadline=None)
def test_sorted_quantile_equals_numpy(values, q):
    t = np.sort(np.array(values, dtype=np.int64))
    assert sorted_quantile(t, q) == np.quantile(t, q)


def test_split_range_and_inductive_mask(tmp_path):
    # 10 events at t = 0..9: train 0..6 (t <= 6.3), val 7 (t <= 7.65), test 8, 9.
    src = np.array([0, 1, 0, 1, 0, 1, 0, 2, 0, 3])
    dst = np.array([1, 0, 1, 0, 1, 0, 1, 0, 1, 1])
    ev = write_events(tmp_path / "s", src, dst, np.arange(10), num_nodes=4)
    assert [ev.split_range(s) for s in ("train", "val", "test")] == [(0, 7), (7, 8), (8, 10)]
    np.testing.assert_array_equal(ev.inductive_mask("val"), [True])
    np.testing.assert_array_equal(ev.inductive_mask("test"), [False, True])
    np.testing.assert_array_equal(ev.seen_in("train"), [True, True, False, False])
    with pytest.raises(ValueError, match="split must be one of"):
        ev.split_range("dev")


def _table(rng: np.random.Generator, n: int, *, float_t: bool) -> dict[str, np.ndarray]:
    t = rng.random(n) * 100 if float_t else rng.integers(0, 40, n)
    return {
        "src": rng.integers(0, 50, n) * 3,
        "dst": rng.integers(0, 50, n) * 3 + 1,
        "t": t,
        "edge_feat": rng.standard_normal((n, 3)).astype(np.float32),
        "label": rng.integers(0, 2, n),
    }


@pytest.mark.parametrize("float_t", [False, True])
def test_streaming_and_out_of_core_sort_match_in_memory(tmp_path, float_t):
    rng = np.random.default_rng(1)
    cols = _table(rng, 5000, float_t=float_t)
    ref = write_events(tmp_path / "ref", **cols)
    # A tiny sort budget forces the on-disk time buckets; odd chunk sizes cross them.
    with StoreWriter(tmp_path / "ooc", sort_budget_bytes=20_000) as w:
        for lo, hi in [(0, 1), (1, 1234), (1234, 1234), (1234, 5000)]:
            w.append(**{k: v[lo:hi] for k, v in cols.items()})
        ev = w.close()
    assert ev.meta["checksums"] == ref.meta["checksums"]
    perm = np.argsort(cols["t"], kind="stable")
    np.testing.assert_array_equal(ev.id_map[ev.src], cols["src"][perm])
    np.testing.assert_array_equal(ev.edge_feat, cols["edge_feat"][perm])


def test_time_dtype_widens_when_a_later_chunk_is_fractional(tmp_path):
    with StoreWriter(tmp_path / "s") as w:
        w.append(np.array([0, 1]), np.array([1, 0]), np.array([1, 2]))
        w.append(np.array([0]), np.array([1]), np.array([2.5]))
        ev = w.close()
    assert ev.t.dtype == np.float64
    np.testing.assert_array_equal(ev.t, [1.0, 2.0, 2.5])
    assert ev.meta["t_dtype"] == "float64" and ev.meta["t_max"] == 2.5


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), StoreWriter(tmp_path / "s") as w:
        w.append(np.array([0, 1]), np.array([1, 0]), np.array([1, 2]))
        raise RuntimeError("boom")
    with pytest.raises(DataError, match="event 3: negative source id -1"):
        write_events(tmp_path / "s", np.array([0, 1, 2, -1]), np.zeros(4, int), np.arange(4))
    with pytest.raises(DataError, match="no events"):
        write_events(tmp_path / "s", np.array([], int), np.array([], int), np.array([], int))
    assert list(tmp_path.iterdir()) == []


def test_existing_target_needs_overwrite(tmp_path):
    args = (np.array([0, 1]), np.array([1, 0]), np.array([1, 2]))
    write_events(tmp_path / "s", *args)
    with pytest.raises(SvenError, match="already exists; pass --overwrite"):
        write_events(tmp_path / "s", *args)
    ev = write_events(tmp_path / "s", *args, name="again", overwrite=True)
    assert ev.meta["name"] == "again"
    assert leftovers(tmp_path) == []
    (tmp_path / "empty").mkdir()
    write_events(tmp_path / "empty", *args)  # an empty directory is fine


def test_load_rejects_non_stores_and_corruption(tmp_path):
    with pytest.raises(DataError, match="not an event store"):
        TemporalEvents.load(tmp_path)
    write_events(tmp_path / "s", np.array([0, 1]), np.array([1, 0]), np.array([1, 2]))
    t = np.load(tmp_path / "s" / "t.npy")
    np.save(tmp_path / "s" / "t.npy", t + 1)
    TemporalEvents.load(tmp_path / "s")  # cheap load does not hash
    with pytest.raises(DataError, match=r"t\.npy: checksum mismatch"):
        TemporalEvents.load(tmp_path / "s", verify=True)
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    meta["format_version"] = 99
    (tmp_path / "s" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="unsupported store format_version 99"):
        TemporalEvents.load(tmp_path / "s")


@pytest.mark.parametrize(("per_thread", "threaded"), [(1, True), (1 << 40, False)])
def test_checksums_find_a_change_in_threads_and_in_one(tmp_path, monkeypatch, per_thread, threaded):
    """A small store hashes in the calling thread, a large one in threads: both hash
    every file and find the same change."""
    import os
    import threading

    from sven.datasets import checksums

    monkeypatch.setattr(checksums, "_BYTES_PER_THREAD", per_thread)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    hashed: list[tuple[str, bool]] = []
    sha256_file = checksums.sha256_file

    def spy(path):
        hashed.append((Path(path).name, threading.current_thread() is threading.main_thread()))
        return sha256_file(path)

    monkeypatch.setattr(checksums, "sha256_file", spy)
    write_events(tmp_path / "s", np.array([0, 1, 2]), np.array([1, 2, 0]), np.array([1, 2, 3]))
    assert checksums.verify_checksums(tmp_path / "s") == 5
    names = ["dst.npy", "id_map.npy", "split.npy", "src.npy", "t.npy"]
    assert sorted(name for name, _ in hashed) == names
    assert {main for _, main in hashed} == {not threaded}
    dst = np.load(tmp_path / "s" / "dst.npy")
    np.save(tmp_path / "s" / "dst.npy", dst[::-1])  # same size, other bytes
    with pytest.raises(DataError, match=r"dst\.npy: checksum mismatch"):
        checksums.verify_checksums(tmp_path / "s")


def test_pyg_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    cols = _table(rng, 40, float_t=False)
    ev = write_events(tmp_path / "a", **cols, node_feat=np.ones((151, 2), np.float32))
    data = ev.to_pyg()
    assert data.num_events == 40
    assert data.msg.shape == (40, 3) and data.y.shape == (40,) and data.x.shape == (151, 2)
    np.testing.assert_array_equal(data.src.numpy(), ev.src)
    back = TemporalEvents.from_pyg(data, tmp_path / "b")
    for col in ("src", "dst", "t", "edge_feat", "label", "node_feat", "split"):
        np.testing.assert_array_equal(getattr(back, col), getattr(ev, col))
    assert back.meta["source"] == {"format": "pyg"}


# -- the property: any valid event table survives write -> read ------------------------


@st.composite
def event_tables(draw):
    n = draw(st.integers(1, 40))
    ids = st.integers(0, draw(st.sampled_from([3, 1000, 2**40])))
    float_t = draw(st.booleans())
    times = (
        st.floats(-1e12, 1e12, allow_nan=False, allow_infinity=False)
        if float_t
        else st.integers(-(2**62), 2**62)
    )
    table = {
        "src": np.array(draw(st.lists(ids, min_size=n, max_size=n)), dtype=np.int64),
        "dst": np.array(draw(st.lists(ids, min_size=n, max_size=n)), dtype=np.int64),
        "t": np.array(draw(st.lists(times, min_size=n, max_size=n))),
    }
    if draw(st.booleans()):
        d = draw(st.integers(1, 3))
        feat = st.floats(allow_nan=False, allow_infinity=False, width=32)
        table["edge_feat"] = np.array(
            draw(st.lists(st.lists(feat, min_size=d, max_size=d), min_size=n, max_size=n)),
            dtype=np.float32,
        )
    label_kind = draw(st.sampled_from([None, "int", "float"]))
    if label_kind == "int":
        table["label"] = np.array(draw(st.lists(st.integers(-5, 5), min_size=n, max_size=n)))
    elif label_kind == "float":
        lab = st.floats(-1, 1, allow_nan=False, width=32)
        table["label"] = np.array(draw(st.lists(lab, min_size=n, max_size=n)), dtype=np.float32)
    return table


@given(table=event_tables(), chunk=st.integers(1, 50))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_event_table_survives_write_and_read(tmp_path_factory, table, chunk):
    out = tmp_path_factory.mktemp("prop") / "s"
    E = table["t"].shape[0]
    with StoreWriter(out, sort_budget_bytes=256) as w:  # tiny budget: exercise buckets too
        for lo in range(0, E, chunk):
            w.append(**{k: v[lo : lo + chunk] for k, v in table.items()})
        w.close()
    ev = TemporalEvents.load(out, verify=True)
    perm = np.argsort(table["t"], kind="stable")  # the documented reordering
    assert ev.num_events == E
    assert ev.t.dtype == (np.float64 if table["t"].dtype.kind == "f" else np.int64)
    np.testing.assert_array_equal(ev.t, table["t"][perm])
    np.testing.assert_array_equal(ev.id_map[ev.src], table["src"][perm])
    np.testing.assert_array_equal(ev.id_map[ev.dst], table["dst"][perm])
    assert ev.num_nodes == np.unique(np.concatenate([table["src"], table["dst"]])).size
    for col in ("edge_feat", "label"):
        if col in table:
            np.testing.assert_array_equal(getattr(ev, col), table[col][perm])
        else:
            assert getattr(ev, col) is None
    assert ev.meta["sorted_on_ingest"] == bool((np.diff(table["t"]) < 0).any())
    assert sum(ev.meta["split"]["counts"].values()) == E
    assert np.all(np.diff(ev.split.astype(int)) >= 0)


def test_distinct_values_switches_from_bitmap_to_sorting():
    from sven.datasets.compact import DistinctValues

    d = DistinctValues()
    d.add(np.array([3, 1, 3]))
    np.testing.assert_array_equal(d.result(), [1, 3])
    d.add(np.array([2**40, 1, 7]))  # beyond the bitmap's range
    d.add(np.array([5]))
    np.testing.assert_array_equal(d.result(), [1, 3, 5, 7, 2**40])


def test_large_sparse_ids_are_compacted_through_sorted_search(tmp_path):
    # Ids above the lookup-table limit take the argsort + searchsorted path.
    src = np.array([2**40, 5, 2**40 + 3])
    dst = np.array([5, 2**35, 2**40])
    ev = write_events(tmp_path / "s", src, dst, np.array([3, 1, 2]))
    np.testing.assert_array_equal(ev.id_map, [5, 2**35, 2**40 + 3, 2**40])
    np.testing.assert_array_equal(ev.id_map[ev.src], src[[1, 2, 0]])
    np.testing.assert_array_equal(ev.id_map[ev.dst], dst[[1, 2, 0]])
