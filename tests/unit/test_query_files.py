"""The files of sven predict and sven embed (sven.tasks.query_files): the pairs table
read, with errors that name the file and the row, and answers written whole or not at
all."""

from __future__ import annotations

import numpy as np
import pytest

from sven.errors import DataError, SvenError
from sven.tasks.query_files import read_pairs, write_table

pd = pytest.importorskip("pandas")


def test_read_pairs_keeps_ids_as_text_and_times_as_numbers(tmp_path) -> None:
    path = tmp_path / "pairs.csv"
    path.write_text("src,dst,t\n007,a,1.5\n12,b,3\n")
    df = read_pairs(path)
    assert df["src"].tolist() == ["007", "12"] and df["dst"].tolist() == ["a", "b"]
    assert df["t"].tolist() == [1.5, 3.0]


def test_read_pairs_reads_parquet(tmp_path) -> None:
    pytest.importorskip("pyarrow")
    path = tmp_path / "pairs.parquet"
    pd.DataFrame({"src": [1, 2], "dst": [3, 4], "t": [5.0, 6.0]}).to_parquet(path, index=False)
    assert read_pairs(path)[["src", "dst", "t"]].values.tolist() == [[1, 3, 5.0], [2, 4, 6.0]]


def test_read_pairs_errors_name_the_file_and_what_is_wrong(tmp_path) -> None:
    with pytest.raises(DataError, match="no such file"):
        read_pairs(tmp_path / "absent.csv")
    path = tmp_path / "pairs.csv"
    path.write_text("src,when\n1,2\n")
    with pytest.raises(DataError, match="missing column\\(s\\) dst, t") as info:
        read_pairs(path)
    assert str(path) in str(info.value)
    path.write_text("src,dst,t\n1,2,3\n1,2,soon\n")
    with pytest.raises(DataError, match="row 1: t is not a number \\('soon'\\)"):
        read_pairs(path)


def test_write_table_by_suffix(tmp_path) -> None:
    df = pd.DataFrame({"src": ["a"], "score": [0.5]})
    write_table(df, tmp_path / "out.csv")
    assert (tmp_path / "out.csv").read_text() == "src,score\na,0.5\n"
    h = np.arange(6, dtype=np.float32).reshape(2, 3)
    write_table(h, tmp_path / "h.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "h.npy"), h)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.npy", "out.csv"]


def test_write_table_refuses_a_missing_folder_and_a_file_that_appeared(tmp_path) -> None:
    df = pd.DataFrame({"src": ["a"]})
    with pytest.raises(DataError, match="output folder does not exist"):
        write_table(df, tmp_path / "nowhere" / "out.csv")
    (tmp_path / "out.csv").write_text("theirs\n")
    with pytest.raises(SvenError, match="appeared meanwhile"):
        write_table(df, tmp_path / "out.csv", overwrite=False)
    assert (tmp_path / "out.csv").read_text() == "theirs\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.csv"]
