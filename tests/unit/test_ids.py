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


def test_consecutive_and_other_ascending_maps_answer_as_a_search() -> None:
    """Ids 500..599 are found by a subtraction, other ascending maps by a search of the
    queries in ascending order: both the plain binary search's answers, in the queries'
    order, unknown ids (below, above, between) included."""
    rng = np.random.default_rng(0)
    for id_map in (np.arange(500, 600), np.sort(rng.choice(10_000, 100, replace=False))):
        ids = IdMaps(_events(id_map.tolist()))
        q = np.concatenate([rng.choice(id_map, 300), [id_map[0] - 1, id_map[-1] + 1, 9_999]])
        q = rng.permutation(q)
        compact, known = ids.lookup(q, "auto")
        pos = np.minimum(np.searchsorted(id_map, q), id_map.size - 1)
        want = id_map[pos] == q
        assert known.tolist() == want.tolist()
        assert compact.tolist() == np.where(want, pos, -1).tolist()
    # A repeated id spans as many values as a run would: not taken for one.
    compact, _ = IdMaps(_events([0, 0, 2])).lookup(np.array([2, 1]), "auto")
    assert compact.tolist() == [2, -1]


def test_text_of_integers_is_read_at_once_as_one_by_one() -> None:
    ids = IdMaps(_events(list(range(10, 20))))
    text = np.array(["12", " 13", "+14", "19", "20"], dtype=object)
    compact, known = ids.lookup(text, "auto")
    assert compact.tolist() == [2, 3, 4, 9, -1] and known.tolist() == [True] * 4 + [False]
