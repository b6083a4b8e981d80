"""Raw ids and compact ones (sven.tasks.ids): the user's ids through the store's id
map, per side on a bipartite store."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from sven.errors import ConfigError
from sven.tasks.ids import IdMaps


def _events(id_map: list, num_src_nodes: int | None = None) -> SimpleNamespace:
    """The three fields of an event store that IdMaps reads."""
    return SimpleNamespace(
        id_map=np.array(id_map),
        bipartite=num_src_nodes is not None,
        num_src_nodes=num_src_nodes,
    )


def test_lookup_in_an_id_map_in_first_appearance_order() -> None:
    ids = IdMaps(_events([40, 10, 30]))
    compact, known = ids.lookup(np.array([30, 40, 11, 10]), "auto")
    assert compact.tolist() == [2, 0, -1, 1]
    assert known.tolist() == [True, True, False, True]
    assert ids.raw(np.array([2, 0])).tolist() == [30, 40]


def test_ids_given_as_text_are_matched_where_they_are_whole_numbers() -> None:
    compact, known = IdMaps(_events([5, 7])).lookup(np.array(["7", "5.0", "5.5", "x"]), "src")
    assert compact.tolist() == [1, 0, -1, -1]
    assert known.tolist() == [True, True, False, False]


def test_string_ids() -> None:
    compact, known = IdMaps(_events(["b", "a"])).lookup(np.array(["a", "c"]), "auto")
    assert (compact.tolist(), known.tolist()) == ([1, -1], [True, False])


def test_a_bipartite_store_looks_up_each_side_apart() -> None:
    # Sources 0..1 (raw 1, 2), destinations 2..4 (raw 1, 2, 3): raw 1 is on both sides.
    ids = IdMaps(_events([1, 2, 1, 2, 3], num_src_nodes=2))
    assert ids.lookup(np.array([1, 3]), "src")[0].tolist() == [0, -1]
    assert ids.lookup(np.array([1, 3]), "dst")[0].tolist() == [2, 4]
    with pytest.raises(ConfigError, match="this store is bipartite"):
        ids.lookup(np.array([1]), "auto")
    with pytest.raises(ConfigError, match="side must be auto, src or dst, got 'left'"):
        ids.lookup(np.array([1]), "left")
