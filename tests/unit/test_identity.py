"""The store fingerprint (sven.datasets.identity): what changes it, what does not, and
the one line that compares two stores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sven.datasets.identity import fingerprint, identity_problem, store_identity
from sven.datasets.negatives import write_eval_negatives
from sven.datasets.store import TemporalEvents, write_events

META = {
    "num_events": 4,
    "num_nodes": 3,
    "bipartite": False,
    "num_src_nodes": None,
    "t_dtype": "int64",
    "split": {"counts": {"train": 2, "val": 1, "test": 1}},
    "checksums": {"src": "a" * 64, "dst": "b" * 64, "t": "c" * 64, "split": "d" * 64},
}


def _with(**changes) -> dict:
    meta = json.loads(json.dumps(META))
    for key, value in changes.items():
        meta[key] = value
    return meta


def test_the_fingerprint_follows_the_events_and_nothing_else() -> None:
    fp = fingerprint(META)
    assert len(fp) == 16 and int(fp, 16) >= 0
    # The order of meta.json's keys, its name, source and provenance do not count.
    shuffled = dict(reversed(list(_with(name="x", source={"path": "/a"}).items())))
    assert fingerprint(shuffled) == fp
    # Any column's bytes, count or id layout does.
    sums = {**META["checksums"], "src": "e" * 64}
    assert fingerprint(_with(checksums=sums)) != fp
    assert fingerprint(_with(checksums={**META["checksums"], "edge_feat": "f" * 64})) != fp
    assert fingerprint(_with(num_nodes=4)) != fp
    assert fingerprint(_with(bipartite=True, num_src_nodes=1)) != fp
    assert fingerprint(_with(split={"counts": {"train": 3, "val": 1, "test": 0}})) != fp
    # Evaluation negatives and labels are targets, not events.
    extra = {**META["checksums"], "neg_val": "1" * 64, "neg_test": "2" * 64, "label": "3" * 64}
    assert fingerprint(_with(checksums=extra)) == fp


def _store(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 10, 50)
    write_events(path, src, (src + 1) % 10, np.arange(50), num_nodes=10, name=path.name)
    return path


def test_a_store_rewritten_in_place_gets_another_fingerprint(tmp_path) -> None:
    a = _store(tmp_path / "a", 0)
    again = _store(tmp_path / "again", 0)
    other = _store(tmp_path / "other", 1)
    fp = fingerprint(json.loads((a / "meta.json").read_text()))
    # The same input converted twice: the same store.
    assert fingerprint(json.loads((again / "meta.json").read_text())) == fp
    # Same path, same file sizes, other events: another store.
    sizes = {f.name: f.stat().st_size for f in a.glob("*.npy")}
    shutil.rmtree(a)
    shutil.copytree(other, a)
    assert {f.name: f.stat().st_size for f in a.glob("*.npy")} == sizes
    assert fingerprint(json.loads((a / "meta.json").read_text())) != fp
    # Fixed negatives added later leave it as it is.
    ev = TemporalEvents.load(again)
    n = ev.split_range("test")[1] - ev.split_range("test")[0]
    write_eval_negatives(again, "test", np.zeros((n, 2), dtype=np.int64), {"path": "x"})
    assert fingerprint(json.loads((again / "meta.json").read_text())) == fp


def _ident(fp: str, edge: int = 2, path: str = "/s/a") -> dict:
    return {"fingerprint": fp, "path": path, "num_events": 1500, "edge_feat_dim": edge,
            "node_feat_dim": 0}  # fmt: skip


def test_identity_problem_names_both_stores_in_one_line() -> None:
    a, b = _ident("aaaa"), _ident("bbbb", path="/s/b")
    assert identity_problem(a, a, "run") == (None, None)
    # Made before Sven recorded identities: the caller's older checks decide.
    assert identity_problem(None, b, "run") == (None, None)
    assert identity_problem({"num_events": 3}, b, "run") == (None, None)
    problem, note = identity_problem(a, b, "ck", verb="was trained on", flag="--other-store")
    assert note is None
    assert problem == (
        "ck was trained on another dataset: /s/a (1,500 events, fingerprint aaaa), not "
        "/s/b (1,500 events, fingerprint bbbb) (that store changed since, or this is "
        "another one); give the store it was trained on, or pass --other-store to apply "
        "it to this store on purpose"
    )
    assert "\n" not in problem
    # Allowed: a note that says so, where the model's widths fit.
    problem, note = identity_problem(a, b, "ck", verb="was trained on", allow_other=True,
                                     flag="--other-store")  # fmt: skip
    assert problem is None
    assert note == (
        "ck was trained on /s/a (1,500 events, fingerprint aaaa); applied to another "
        "store, /s/b (1,500 events, fingerprint bbbb), as --other-store asks"
    )
    problem, _ = identity_problem(a, _ident("cccc", edge=5), "ck", allow_other=True)
    assert problem is not None
    assert "edge features are 5-dimensional where the model takes 2" in problem


def test_store_identity_of_an_opened_store(tmp_path) -> None:
    a = _store(tmp_path / "a", 0)
    ident = store_identity(TemporalEvents.load(a))
    assert ident == {
        "fingerprint": fingerprint(json.loads((a / "meta.json").read_text())),
        "name": "a",
        "path": str(a.absolute()),
        "num_events": 50,
        "num_nodes": 10,
        "edge_feat_dim": 0,
        "node_feat_dim": 0,
    }


@pytest.mark.parametrize("key", ["num_events", "checksums"])
def test_a_meta_without_a_key_still_has_a_fingerprint(key) -> None:
    meta = _with()
    del meta[key]
    assert len(fingerprint(meta)) == 16 and fingerprint(meta) != fingerprint(META)
