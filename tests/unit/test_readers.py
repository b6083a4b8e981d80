"""Every raw-format reader on tiny hand-written files, with exact expected arrays."""

from __future__ import annotations

import bz2
import gzip
import lzma
from pathlib import Path

import numpy as np
import pytest

from sven.datasets.readers import convert, detect_format, open_reader
from sven.datasets.tables import ColumnMap
from sven.errors import ConfigError

SNAP = "# a comment\n3 5 100\n\n5 3 101\n7 3\t102\n"
COMPRESSORS = {"": lambda b: b, ".gz": gzip.compress, ".xz": lzma.compress, ".bz2": bz2.compress}


def write(path: Path, text: str, suffix: str = "") -> Path:
    path = path.with_name(path.name + suffix)
    path.write_bytes(COMPRESSORS[suffix](text.encode()))
    return path


def eq(actual, expected) -> None:
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))
    if isinstance(expected, np.ndarray):
        assert np.asarray(actual).dtype == expected.dtype


@pytest.mark.parametrize("suffix", ["", ".gz", ".xz", ".bz2"])
def test_snap_any_compression(tmp_path, suffix):
    path = write(tmp_path / "edges.txt", SNAP, suffix)
    assert detect_format(path) == "snap"
    ev = convert(path, tmp_path / "out")
    eq(ev.id_map, [3, 5, 7])
    eq(ev.src, [0, 1, 2])
    eq(ev.dst, [1, 0, 0])
    eq(ev.t, np.array([100, 101, 102]))
    assert ev.edge_feat is None and ev.label is None
    assert ev.meta["source"]["format"] == "snap"
    assert ev.meta["name"] == "edges"


def test_snap_crlf_and_blocks_smaller_than_a_line(tmp_path):
    text = "1 2 10\r\n2 3 11\r\n3 1 12\r\n"
    path = write(tmp_path / "crlf.txt", text)
    ev = convert(path, tmp_path / "out", block_bytes=4)
    eq(ev.id_map, [1, 2, 3])
    eq(ev.src, [0, 1, 2])
    eq(ev.t, [10, 11, 12])


def test_snap_signed_rating_feature_and_float_time(tmp_path):
    path = write(
        tmp_path / "otc.csv", "6,2,4,1289241911.72836\n6,5,-2,1289241941.5\n1,15,10,1289243140\n"
    )
    assert detect_format(path) == "snap-signed"
    ev = convert(path, tmp_path / "out")
    eq(ev.id_map, [6, 2, 5, 1, 15])
    eq(ev.src, [0, 0, 3])
    eq(ev.dst, [1, 2, 4])
    eq(ev.t, np.array([1289241911.72836, 1289241941.5, 1289243140.0]))
    eq(ev.edge_feat, np.array([[4.0], [-2.0], [10.0]], dtype=np.float32))


def test_unsorted_input_is_stably_sorted_and_reported(tmp_path):
    path = write(tmp_path / "u.txt", "1 2 5\n2 3 3\n3 4 5\n4 1 3\n")
    ev = convert(path, tmp_path / "out")
    eq(ev.t, [3, 3, 5, 5])
    eq(ev.id_map[ev.src], [2, 4, 1, 3])  # ties keep their input order
    assert ev.meta["sorted_on_ingest"] is True
    assert ev.meta["num_out_of_order"] == 2


JODIE_FEATS = (
    "user_id,item_id,timestamp,state_label,comma_separated_list_of_features\n"
    "0,0,0.0,0,0.5,1.5\n"
    "1,1,2.0,1,-1.0,0.0\n"
    "0,1,3.5,0,2.0,3.0\n"
)


def test_jodie_with_features_offsets_items_after_users(tmp_path):
    path = write(tmp_path / "reddit.csv", JODIE_FEATS)
    assert detect_format(path) == "jodie"
    ev = convert(path, tmp_path / "out")
    eq(ev.src, [0, 1, 0])
    eq(ev.dst, [2, 3, 3])  # items 0, 1 -> 2, 3 after the 2 users
    eq(ev.id_map, [0, 1, 0, 1])  # each side's own raw ids
    eq(ev.t, np.array([0.0, 2.0, 3.5]))
    eq(ev.label, np.array([0, 1, 0]))
    eq(ev.edge_feat, np.array([[0.5, 1.5], [-1.0, 0.0], [2.0, 3.0]], dtype=np.float32))
    assert ev.bipartite and ev.num_src_nodes == 2 and ev.num_nodes == 4


def test_jodie_already_offset_is_not_offset_again(tmp_path):
    # Like the Wikipedia copy: users 0..2, pages 3..4, header u,i,ts,label.
    path = write(tmp_path / "wikipedia.csv", "u,i,ts,label\n0,3,0,0\n1,4,36,1\n2,3,77,0\n")
    assert detect_format(path) == "jodie"
    ev = convert(path, tmp_path / "out")
    eq(ev.src, [0, 1, 2])
    eq(ev.dst, [3, 4, 3])
    eq(ev.id_map, [0, 1, 2, 3, 4])
    eq(ev.label, [0, 1, 0])
    assert ev.bipartite and ev.num_src_nodes == 3 and ev.edge_feat is None


def write_dyglib(tmp_path: Path, edge_rows: int | None = None) -> Path:
    d = tmp_path / "dyg"
    d.mkdir()
    # Rows out of idx order on purpose: features must follow idx, not the row.
    (d / "ml_toy.csv").write_text(
        ",u,i,ts,label,idx\n0,1,3,0.0,0,1\n1,2,4,1.0,1,3\n2,1,4,1.0,0,2\n"
    )
    rows = 4 if edge_rows is None else edge_rows
    edge = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2)
    edge[0] = -99  # padding
    np.save(d / "ml_toy.npy", edge)
    node = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    node[0] = -99
    np.save(d / "ml_toy_node.npy", node)
    return d


def test_dyglib_drops_padding_and_follows_idx(tmp_path):
    d = write_dyglib(tmp_path)
    assert detect_format(d) == "dyglib"
    assert detect_format(d / "ml_toy.csv") == "dyglib"
    ev = convert(d, tmp_path / "out")
    eq(ev.src, [0, 1, 0])  # 1-based -> 0-based
    eq(ev.dst, [2, 3, 3])
    eq(ev.id_map, [1, 2, 3, 4])
    eq(ev.t, np.array([0.0, 1.0, 1.0]))
    eq(ev.label, [0, 1, 0])
    eq(ev.edge_feat, np.array([[2, 3], [6, 7], [4, 5]], dtype=np.float32))
    eq(ev.node_feat, np.arange(3, 15, dtype=np.float32).reshape(4, 3))
    assert ev.meta["name"] == "toy" and ev.bipartite and ev.num_src_nodes == 2


def test_dyglib_without_node_features(tmp_path):
    d = write_dyglib(tmp_path)
    (d / "ml_toy_node.npy").unlink()
    ev = convert(d / "ml_toy.csv", tmp_path / "out")
    eq(ev.src, [0, 1, 0])
    eq(ev.id_map, [1, 2, 3, 4])
    assert ev.node_feat is None


def test_tgl_with_feature_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    d = tmp_path / "WIKI"
    d.mkdir()
    (d / "edges.csv").write_text(
        ",src,dst,time,int_roll,ext_roll\n0,0,2,1,0,0\n1,1,2,4,0,1\n2,0,3,9,0,2\n"
    )
    torch.save(torch.tensor([[1.0], [2.0], [3.0]]), d / "edge_features.pt")
    torch.save(torch.arange(8, dtype=torch.float64).reshape(4, 2), d / "node_features.pt")
    assert detect_format(d) == "tgl"
    ev = convert(d, tmp_path / "out")
    eq(ev.src, [0, 1, 0])
    eq(ev.dst, [2, 2, 3])
    eq(ev.t, np.array([1, 4, 9]))
    eq(ev.edge_feat, np.array([[1.0], [2.0], [3.0]], dtype=np.float32))
    eq(ev.node_feat, np.arange(8, dtype=np.float32).reshape(4, 2))
    eq(ev.id_map, [0, 1, 2, 3])
    assert ev.meta["name"] == "WIKI"


def test_csv_with_column_map(tmp_path):
    path = write(
        tmp_path / "x.csv", "time,a,b,w1,w2,y,junk\n5,10,20,0.5,1,1,x\n7,20,30,1.5,2,0,y\n"
    )
    assert detect_format(path) == "csv"
    ev = convert(
        path,
        tmp_path / "out",
        "csv",
        columns=ColumnMap(src="a", dst="b", time="time", feat=("w1", "w2"), label="y"),
    )
    eq(ev.id_map, [10, 20, 30])
    eq(ev.src, [0, 1])
    eq(ev.dst, [1, 2])
    eq(ev.t, [5, 7])
    eq(ev.edge_feat, np.array([[0.5, 1], [1.5, 2]], dtype=np.float32))
    eq(ev.label, [1, 0])


def test_csv_default_names_positions_and_separators(tmp_path):
    path = write(tmp_path / "a.tsv", "ts\tsource\ttarget\n1\t0\t1\n2\t1\t0\n")
    ev = convert(path, tmp_path / "a", "csv", sep="\t")
    eq(ev.src, [0, 1])
    eq(ev.t, [1, 2])
    path = write(tmp_path / "b.txt", "9 1 0\n8 0 1\n")
    ev = convert(
        path,
        tmp_path / "b",
        "csv",
        sep="\\s+",
        header=False,
        columns=ColumnMap(src="1", dst="2", time="0"),
    )
    eq(ev.t, [8, 9])
    eq(ev.src, [0, 1])


def test_csv_string_ids_and_forced_bipartite(tmp_path):
    path = write(tmp_path / "s.csv", "src,dst,t\nann,x,1\nbob,x,2\nann,y,3\n")
    ev = convert(path, tmp_path / "out", string_ids=True, bipartite=True)
    eq(ev.id_map, ["ann", "bob", "x", "y"])
    eq(ev.src, [0, 1, 0])
    eq(ev.dst, [2, 2, 3])
    assert ev.bipartite and ev.num_src_nodes == 2


def test_tgb_edge_list_with_feature_tail(tmp_path):
    path = write(
        tmp_path / "tgbl-toy_edgelist.csv",
        "user_id,item_id,timestamp,state_label,comma_separated_list_of_features\n"
        "a,p,0,0,1.0,2.0\nb,p,5,1,3.0,4.0\n",
    )
    ev = convert(path, tmp_path / "out", "tgb")
    eq(ev.id_map, ["a", "p", "b"])
    eq(ev.src, [0, 2])
    eq(ev.dst, [1, 1])
    eq(ev.edge_feat, np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {"s": [4, 2, 4], "d": [2, 9, 9], "when": [1.5, 2.0, 3.0], "f": [0.1, 0.2, 0.3]}
    )
    pq.write_table(table, tmp_path / "e.parquet")
    assert detect_format(tmp_path / "e.parquet") == "parquet"
    ev = convert(
        tmp_path / "e.parquet",
        tmp_path / "out",
        columns=ColumnMap(src="s", dst="d", time="when", feat=("f",)),
    )
    eq(ev.id_map, [4, 2, 9])
    eq(ev.src, [0, 1, 0])
    eq(ev.dst, [1, 2, 2])
    eq(ev.t, [1.5, 2.0, 3.0])
    eq(ev.edge_feat, np.array([[0.1], [0.2], [0.3]], dtype=np.float32))


def test_many_blocks_give_the_same_store(tmp_path):
    rng = np.random.default_rng(0)
    rows = np.stack([rng.integers(0, 40, 300), rng.integers(0, 40, 300), np.arange(300)], 1)
    text = "\n".join(" ".join(map(str, r)) for r in rows) + "\n"
    path = write(tmp_path / "many.txt", text, ".gz")
    small = convert(path, tmp_path / "small", block_bytes=50)
    big = convert(path, tmp_path / "big")
    assert small.meta["checksums"] == big.meta["checksums"]
    eq(small.id_map[small.src], rows[:, 0])


def test_column_map_only_for_tabular_formats(tmp_path):
    path = write(tmp_path / "e.txt", SNAP)
    with pytest.raises(
        ConfigError, match=r"apply to csv, tgb and parquet input only; e\.txt is snap"
    ):
        open_reader(path, columns=ColumnMap(src="a"))
    with pytest.raises(ConfigError, match="apply to csv, tgb and parquet"):
        open_reader(path, bipartite=True)
    with pytest.raises(ConfigError, match="unknown format 'nope'"):
        open_reader(path, "nope")
