"""The store's layout (sven.datasets.layout): the chunking of every streaming pass and
the checks of ``meta.json`` that every stage relies on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sven.datasets.layout import FORMAT_VERSION, first_bad, iter_ranges, load_meta
from sven.errors import DataError


def test_ranges_tile_the_events_in_chunks() -> None:
    assert list(iter_ranges(5, 2)) == [(0, 2), (2, 4), (4, 5)]
    assert list(iter_ranges(4, 2)) == [(0, 2), (2, 4)]
    assert list(iter_ranges(0, 2)) == []
    assert first_bad(np.array([False, False, True, True])) == 2


def _meta(**changes: object) -> dict:
    meta = {
        "format_version": FORMAT_VERSION,
        "num_events": 3,
        "num_nodes": 4,
        "bipartite": False,
        "split": {"counts": {"train": 1, "val": 1, "test": 1}},
        "checksums": {},
    }
    return {**meta, **changes}


def test_meta_is_read_where_it_holds_what_every_stage_reads(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text(json.dumps(_meta()))
    assert load_meta(tmp_path) == _meta()


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        (_meta(format_version=0), "unsupported store format_version 0 (this Sven reads 1)"),
        (_meta(num_nodes=True), "corrupt meta.json: num_nodes is True"),
        (
            _meta(num_events=4),
            "corrupt meta.json: split counts {'train': 1, 'val': 1, 'test': 1} do not "
            "add up to num_events 4",
        ),
        (_meta(num_src_nodes=5), "corrupt meta.json: num_src_nodes is 5"),
    ],
)
def test_bad_meta_is_named(tmp_path: Path, meta: dict, reason: str) -> None:
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError) as err:
        load_meta(tmp_path)
    assert str(err.value) == f"{tmp_path / 'meta.json'}: {reason}"


def test_a_folder_without_meta_is_no_store(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"not an event store \(no meta.json\)"):
        load_meta(tmp_path)
