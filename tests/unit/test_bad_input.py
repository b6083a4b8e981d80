"""Bad input: one test per kind, each asserting the file, the line (or row) and the reason.

Line numbers are 1-based physical lines of the (decompressed) file, header included.
Every failure must also leave nothing at the output path.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from sven.datasets.readers import convert
from sven.datasets.tables import ColumnMap
from sven.errors import DataError


def fails(tmp_path: Path, name: str, text: str | bytes, fmt: str = "auto", **kw) -> DataError:
    """Converts a file that must fail; returns the error after checking nothing was left."""
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DataError) as info:
        convert(path, tmp_path / "out", fmt, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no store, no temp dir
    return info.value


def test_wrong_column_count(tmp_path):
    err = fails(tmp_path, "e.txt", "# header comment\n1 2 3\n2 3 4 5\n")
    assert str(err) == f"{tmp_path / 'e.txt'}, line 3: expected 3 columns, found 4"
    assert (err.path, err.line) == (str(tmp_path / "e.txt"), 3)


def test_too_few_columns_in_csv_after_the_header(tmp_path):
    err = fails(tmp_path, "j.csv", "u,i,ts,label\n0,1,2,0\n1,2\n")
    assert str(err) == f"{tmp_path / 'j.csv'}, line 3: expected 4 columns, found 2"


def test_non_numeric_field(tmp_path):
    err = fails(tmp_path, "e.txt", "1 2 3\n1 abc 5\n")
    assert str(err) == f"{tmp_path / 'e.txt'}, line 2: non-numeric destination id 'abc'"


def test_non_numeric_feature(tmp_path):
    err = fails(
        tmp_path, "r.csv", "user_id,item_id,timestamp,state_label,f\n0,0,1,0,0.5\n0,0,2,0,x\n"
    )
    assert str(err) == f"{tmp_path / 'r.csv'}, line 3: non-numeric feature 'x'"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("1,2,nan,5", "rating is 'nan' (NaN/inf)"),
        ("1,2,3,inf", "time is inf (NaN/inf)"),
        ("1,2,1e999,5", "rating is inf (NaN/inf)"),
    ],
)
def test_nan_or_inf(tmp_path, row, reason):
    err = fails(tmp_path, "otc.csv", f"1,2,3,4\n{row}\n", "snap-signed")
    assert str(err) == f"{tmp_path / 'otc.csv'}, line 2: {reason}"


def test_negative_id(tmp_path):
    err = fails(tmp_path, "e.txt", "1 2 3\n2 3 4\n-3 2 5\n")
    assert str(err) == f"{tmp_path / 'e.txt'}, line 3: negative source id -3"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("99999999999999999999", "source id 99999999999999999999 overflows int64"),
        ("1.5", "non-integer source id 1.5"),
    ],
)
def test_overflowing_or_fractional_id(tmp_path, value, reason):
    err = fails(tmp_path, "e.txt", f"1 2 3\n{value} 2 5\n")
    assert str(err) == f"{tmp_path / 'e.txt'}, line 2: {reason}"


def test_unparseable_time(tmp_path):
    err = fails(tmp_path, "e.txt", "1 2 3\n2 3 yesterday\n")
    assert str(err) == f"{tmp_path / 'e.txt'}, line 2: unparseable time 'yesterday'"


@pytest.mark.parametrize(
    ("name", "text", "fmt", "reason"),
    [
        ("e.txt", "", "snap", "empty file: no events"),
        ("c.txt", "# only comments\n\n", "snap", "empty file: no events"),
        ("j.csv", "u,i,ts,label\n", "jodie", "empty file: no events after the header"),
        ("z.csv", "", "jodie", "empty file: no header and no events"),
        ("a.txt", "\n\n", "auto", "empty file: no events"),
    ],
)
def test_empty_file(tmp_path, name, text, fmt, reason):
    err = fails(tmp_path, name, text, fmt)
    assert str(err) == f"{tmp_path / name}: {reason}"


def test_edge_feature_rows_not_matching_events_dyglib(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "ml_x.csv").write_text(",u,i,ts,label,idx\n0,1,2,0.0,0,1\n1,1,2,1.0,0,2\n")
    np.save(d / "ml_x.npy", np.zeros((4, 2)))  # padding + 3 rows for 2 events
    with pytest.raises(DataError) as info:
        convert(d, tmp_path / "out")
    assert str(info.value) == (
        f"{d / 'ml_x.npy'}: 4 edge feature rows (with the padding row 0) for 2 events; expected 3"
    )
    np.save(d / "ml_x.npy", np.zeros((2, 2)))  # too few: idx 2 has no row
    with pytest.raises(DataError) as info:
        convert(d, tmp_path / "out")
    assert str(info.value) == (
        f"{d / 'ml_x.csv'}, line 3: idx 2 has no row in ml_x.npy (2 rows, row 0 padding)"
    )
    assert not (tmp_path / "out").exists()


def test_edge_feature_rows_not_matching_events_tgl(tmp_path):
    torch = pytest.importorskip("torch")
    d = tmp_path / "T"
    d.mkdir()
    (d / "edges.csv").write_text("src,dst,time,int_roll,ext_roll\n0,1,1,0,0\n1,0,2,0,0\n")
    torch.save(torch.zeros(3, 2), d / "edge_features.pt")
    with pytest.raises(DataError) as info:
        convert(d, tmp_path / "out")
    assert str(info.value) == f"{d / 'edge_features.pt'}: 3 edge feature rows for 2 events"
    torch.save(torch.zeros(1, 2), d / "edge_features.pt")
    with pytest.raises(DataError) as info:
        convert(d, tmp_path / "out")
    assert str(info.value) == (
        f"{d / 'edges.csv'}, line 3: no row for this event in edge_features.pt (1 rows)"
    )


def test_node_feature_rows_not_covering_ids_dyglib(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "ml_x.csv").write_text(",u,i,ts,label,idx\n0,1,2,0.0,0,1\n1,1,5,1.0,0,2\n")
    np.save(d / "ml_x_node.npy", np.zeros((3, 2)))  # padding + nodes 1, 2
    with pytest.raises(DataError) as info:
        convert(d, tmp_path / "out")
    assert (
        str(info.value)
        == f"{d / 'ml_x.csv'}, line 3: node id 5 has no row in ml_x_node.npy (2 nodes)"
    )


def test_dyglib_padding_id(tmp_path):
    err = fails(tmp_path, "ml_p.csv", ",u,i,ts,label,idx\n0,1,2,0.0,0,1\n1,0,2,1.0,0,2\n")
    assert str(err) == (
        f"{tmp_path / 'ml_p.csv'}, line 3: source id 0 is DyGLib's padding id (ids are 1-based)"
    )


def test_errors_in_later_blocks_of_compressed_files_name_the_right_line(tmp_path):
    lines = [f"{i} {i + 1} {i}" for i in range(1000)]
    lines[876] = "5 6"
    err = fails(
        tmp_path, "e.txt.gz", gzip.compress(("\n".join(lines) + "\n").encode()), block_bytes=64
    )
    assert str(err) == f"{tmp_path / 'e.txt.gz'}, line 877: expected 3 columns, found 2"


def test_missing_named_column(tmp_path):
    err = fails(
        tmp_path, "x.csv", "a,b,c\n1,2,3\n", "csv", columns=ColumnMap(src="a", dst="b", time="when")
    )
    assert str(err) == f"{tmp_path / 'x.csv'}, line 1: no column 'when' (columns: a, b, c)"


def test_parquet_errors_name_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pa.table({"src": [1, 2, -4], "dst": [1, 2, 3], "t": [1, 2, 3]}), tmp_path / "p.parquet"
    )
    with pytest.raises(DataError) as info:
        convert(tmp_path / "p.parquet", tmp_path / "out")
    assert str(info.value) == f"{tmp_path / 'p.parquet'}: row 3: negative source id -4"
    pq.write_table(pa.table({"src": [1, 2], "dst": [1, None], "t": [1, 2]}), tmp_path / "p.parquet")
    with pytest.raises(DataError) as info:
        convert(tmp_path / "p.parquet", tmp_path / "out")
    assert str(info.value) == f"{tmp_path / 'p.parquet'}: row 2: missing value in column 'dst'"


def test_undetectable_format(tmp_path):
    err = fails(tmp_path, "e.txt", "1 2 3 4 5\n")
    assert str(err) == (
        f"{tmp_path / 'e.txt'}, line 1: cannot detect the format from 5 headerless columns "
        "('1 2 3 4 5'); pass --format"
    )


def test_in_memory_feature_rows_not_matching(tmp_path):
    from sven.datasets.store import StoreWriter, write_events

    ids = np.array([0, 1, 0, 1])
    with pytest.raises(DataError, match=r"^4 events but 3 rows of edge features$"):
        write_events(tmp_path / "s", ids, ids, np.arange(4), edge_feat=np.zeros((3, 2)))
    with pytest.raises(DataError, match=r"^3 node feature rows for 4 nodes$"):
        StoreWriter(tmp_path / "s", num_nodes=4, node_feat=np.zeros((3, 2)))
    assert list(tmp_path.iterdir()) == []
