"""Column parsing (sven.datasets.fields): checked arrays, or the first bad value named
by its line or row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sven.datasets.fields import Where, parse_floats, parse_ids, parse_labels, parse_times
from sven.errors import DataError


def _where(n: int, unit: str = "line") -> Where:
    """Rows 0..n-1 of a chunk that starts at line (or row) 5 of e.csv."""
    return Where(Path("e.csv"), np.arange(5, 5 + n), unit)


def test_ids_from_text_whole_floats_and_strings() -> None:
    ids = parse_ids(pd.Series(["3", "0", "12"]), "source", _where(3))
    assert ids.dtype == np.int64 and ids.tolist() == [3, 0, 12]
    assert parse_ids(pd.Series([1.0, 7.0]), "source", _where(2)).tolist() == [1, 7]
    names = parse_ids(pd.Series(["a", "b"]), "source", _where(2), strings=True)
    assert names.tolist() == ["a", "b"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["1", "x", "-1"], "e.csv, line 6: non-numeric source id 'x'"),
        (["1", "2", "-1"], "e.csv, line 7: negative source id -1"),
        ([1.0, 2.5, 3.0], "e.csv, line 6: non-integer source id 2.5"),
        (["1", "nan", "2"], "e.csv, line 6: source id is 'nan' (NaN/inf)"),
    ],
)
def test_the_first_bad_id_is_named_with_its_line(values: list, message: str) -> None:
    with pytest.raises(DataError) as err:
        parse_ids(pd.Series(values), "source", _where(3))
    assert str(err.value) == message


def test_a_bad_value_of_parquet_is_named_by_its_row() -> None:
    with pytest.raises(DataError) as err:
        parse_ids(pd.Series(["", "b"]), "target", _where(2, unit="row"), strings=True)
    assert str(err.value) == "e.csv: row 5: empty target id"


def test_times_floats_and_labels() -> None:
    times = parse_times(pd.Series(["10", "20"]), _where(2))
    assert times.dtype == np.int64 and times.tolist() == [10, 20]
    assert parse_times(pd.Series([0.5, 1.5]), _where(2)).dtype == np.float64
    with pytest.raises(DataError, match=r"line 6: unparseable time '2020-01-01'"):
        parse_times(pd.Series(["1", "2020-01-01"]), _where(2))
    frame = pd.DataFrame({"a": ["1", "2"], "b": [0.5, 0.25]})
    feats = parse_floats(frame, ["a", "b"], "feature", _where(2))
    assert feats.dtype == np.float32 and feats.tolist() == [[1.0, 0.5], [2.0, 0.25]]
    # 1e39 becomes inf in the cast to float32 (numpy warns); the check after it is tested.
    with np.errstate(over="ignore"), pytest.raises(DataError, match="line 5: feature overflows"):
        parse_floats(pd.DataFrame({"a": [1e39, 1.0]}), ["a"], "feature", _where(2))
    assert parse_labels(pd.Series(["0", "1"]), _where(2)).dtype == np.int64
    assert parse_labels(pd.Series([0.0, 0.5]), _where(2)).tolist() == [0.0, 0.5]
