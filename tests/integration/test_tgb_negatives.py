"""TGB's fixed evaluation negatives: ``sven data negatives`` and the MRR that uses them."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import sven
from sven.cli import main
from sven.datasets.negatives import read_negatives
from sven.datasets.store import TemporalEvents, write_events
from sven.engine.metrics import mrr
from sven.errors import ConfigError, DataError

# Raw (TGB) ids 10..60, first met in the order 30, 10, 20, 50, 40, 60: the store's
# compact ids differ from them (id_map.npy), so every lookup goes through the map.
EVENTS = [
    (30, 10), (10, 20), (20, 30), (30, 20), (10, 30), (50, 10), (20, 10),
    (30, 50), (10, 20), (20, 50), (40, 10), (50, 30), (10, 50), (30, 10),
    (20, 40), (40, 30),  # val: t = 14, 15
    (10, 20), (60, 30), (10, 20),  # test: t = 16, 17, 17 (a repeated triple)
]  # fmt: skip
TIMES = [*range(16), 16, 17, 17]
# 14 train, 2 val, 3 test events with these fractions (asserted in the fixture).
SPLIT = {"val_frac": 0.1, "test_frac": 0.15}
# TGB's files: (src, dst, t) -> negative destinations, in raw ids, of varying length.
VAL_NS = {(20, 40, 14): [10, 30, 50], (40, 30, 15): [20, 60]}
TEST_NS = {(10, 20, 16): [30, 40, 50, 60], (60, 30, 17): [10], (10, 20, 17): [20, 30, 60]}


def _events() -> tuple[list[int], list[int], list[int]]:
    src, dst = zip(*EVENTS)
    return list(src), list(dst), TIMES


def _pickle(path: Path, table: dict, *, numpy_keys: bool = True, float_t: bool = False) -> Path:
    """A file as TGB writes it: numpy scalar keys and numpy array values."""
    out = {}
    for (s, d, t), negs in table.items():
        tt = float(t) if float_t else t
        key = (np.int64(s), np.int64(d), np.float64(tt) if float_t else np.int64(tt))
        out[key if numpy_keys else (s, d, tt)] = np.asarray(negs, dtype=np.int64)
    path.write_bytes(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    return path


@pytest.fixture
def store(tmp_path) -> Path:
    src, dst, t = _events()
    out = tmp_path / "s"
    write_events(out, np.array(src), np.array(dst), np.array(t), name="tiny", **SPLIT)
    ev = TemporalEvents.load(out)
    assert ev.meta["split"]["counts"] == {"train": 14, "val": 2, "test": 3}
    assert list(ev.id_map) == [30, 10, 20, 50, 40, 60]
    return out


def _compact(store: Path, raw: list[int]) -> list[int]:
    id_map = list(TemporalEvents.load(store).id_map)
    return [id_map.index(r) for r in raw]


def _expected(store: Path, table: dict, keys: list[tuple[int, int, int]], q: int) -> np.ndarray:
    return np.array([_compact(store, table[k]) + [-1] * (q - len(table[k])) for k in keys])


def test_import_stores_aligned_compact_ids(store, tmp_path, capsys) -> None:
    val = _pickle(tmp_path / "tgbl-tiny_val_ns.pkl", VAL_NS)
    # Float times in the test file (TGB's float timestamps) match the integer ones.
    test = _pickle(tmp_path / "tgbl-tiny_test_ns.pkl", TEST_NS, float_t=True)
    assert main(["data", "negatives", str(store), "--val", str(val), "--test", str(test)]) == 0
    out = capsys.readouterr().out
    assert "val negatives from" in out and "3 events x 4 (padded rows: 2)" in out

    ev = TemporalEvents.load(store)
    np.testing.assert_array_equal(
        ev.eval_negatives["val"], _expected(store, VAL_NS, [(20, 40, 14), (40, 30, 15)], 3)
    )
    # The two (10, 20, 17) events of the test split share one row.
    keys = [(10, 20, 16), (60, 30, 17), (10, 20, 17)]
    want = _expected(store, TEST_NS, keys, 4)
    np.testing.assert_array_equal(ev.eval_negatives["test"], want)
    assert want.tolist()[2] == [2, 0, 5, -1]  # 20, 30, 60 in compact ids, padded
    assert ev.eval_negatives["test"].dtype == np.int64

    meta = json.loads((store / "meta.json").read_text())
    for split, file, q in (("val", val, 3), ("test", test, 4)):
        entry = meta["eval_negatives"][split]
        assert entry["q"] == q
        assert entry["source"]["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
        assert entry["source"]["path"] == file.name
        digest = hashlib.sha256((store / f"neg_{split}.npy").read_bytes()).hexdigest()
        assert meta["checksums"][f"neg_{split}"] == digest
    assert main(["data", "verify", str(store)]) == 0
    assert "7 files match" in capsys.readouterr().out

    # A changed negatives file fails verification (exit 3), like any other column.
    arr = np.load(store / "neg_test.npy")
    arr[0, 0] = 1
    with open(store / "neg_test.npy", "wb") as f:
        np.save(f, arr)
    assert main(["data", "verify", str(store)]) == 3
    assert "neg_test.npy: checksum mismatch" in capsys.readouterr().err


def test_existing_negatives_need_overwrite(store, tmp_path, capsys) -> None:
    test = _pickle(tmp_path / "t.pkl", TEST_NS)
    assert main(["data", "negatives", str(store), "--test", str(test)]) == 0
    other = {**TEST_NS, (60, 30, 17): [20, 40]}
    again = _pickle(tmp_path / "t2.pkl", other)
    assert main(["data", "negatives", str(store), "--test", str(again)]) == 1
    assert "already has test negatives; pass --overwrite" in capsys.readouterr().err
    assert main(["data", "negatives", str(store), "--test", str(again), "--overwrite"]) == 0
    got = TemporalEvents.load(store).eval_negatives["test"]
    assert got[1].tolist() == [*_compact(store, [20, 40]), -1, -1]


def test_npz_and_compact_ids(store, tmp_path) -> None:
    keys = [(20, 40, 14), (40, 30, 15)]
    compact = _expected(store, VAL_NS, keys, 3)
    s, d = (np.array(_compact(store, [k[i] for k in keys])) for i in (0, 1))
    np.savez(tmp_path / "v.npz", src=s, dst=d, t=np.array([14, 15]), neg=compact)
    args = ["data", "negatives", str(store), "--val", str(tmp_path / "v.npz")]
    assert main([*args, "--ids", "compact"]) == 0
    np.testing.assert_array_equal(TemporalEvents.load(store).eval_negatives["val"], compact)
    # The same file read as raw ids names nodes the store's input never had (0).
    assert main([*args, "--overwrite"]) == 3


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({(20, 40, 14): [10]}, "val event 15 (src 40, dst 30, t 15"),  # one edge missing
        ({**VAL_NS, (20, 40, 14): [10, 99]}, "negative id 99 is not a node of the store"),
        ({**VAL_NS, (20, 40, 14, 1): [10]}, "expected a (src, dst, t) tuple"),
        ({**VAL_NS, (20, 40, 14): [10.5]}, "negatives must be a 1-D sequence of integers"),
    ],
)
def test_bad_files_are_refused(store, tmp_path, capsys, table, message) -> None:
    path = tmp_path / "v.pkl"
    path.write_bytes(pickle.dumps(table))
    assert main(["data", "negatives", str(store), "--val", str(path)]) == 3
    err = capsys.readouterr().err
    assert message in err and str(path) in err, err
    assert not (store / "neg_val.npy").exists()
    assert "eval_negatives" not in json.loads((store / "meta.json").read_text())


def test_malformed_and_missing_files(store, tmp_path, capsys) -> None:
    (tmp_path / "l.pkl").write_bytes(pickle.dumps([1, 2, 3]))
    assert main(["data", "negatives", str(store), "--val", str(tmp_path / "l.pkl")]) == 3
    assert "expected a dict of (src, dst, t) -> ids, got list" in capsys.readouterr().err
    (tmp_path / "x.pkl").write_bytes(b"not a pickle at all")
    assert main(["data", "negatives", str(store), "--val", str(tmp_path / "x.pkl")]) == 3
    assert "not a negatives pickle" in capsys.readouterr().err
    assert main(["data", "negatives", str(store), "--val", str(tmp_path / "nope.pkl")]) == 3
    assert main(["data", "negatives", str(store)]) == 2
    assert "give --val FILE and/or --test FILE" in capsys.readouterr().err


class _Exploit:
    """Pickles as a call of os.system: loading it with pickle.load would run a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running(store, tmp_path, capsys) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({(20, 40, 14): _Exploit(marker)}))
    assert main(["data", "negatives", str(store), "--val", str(path)]) == 3
    err = capsys.readouterr().err
    assert "refusing to load" in err and "system" in err, err
    assert not marker.exists()
    path.write_bytes(pickle.dumps({(1, 2, 3): _Call(eval, "1")}))
    with pytest.raises(DataError, match=r"refusing to load builtins\.eval"):
        read_negatives(path)
    assert not marker.exists()


class _Call:
    def __init__(self, fn, arg) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


def test_numpy_core_names_of_older_pickles(tmp_path) -> None:
    # A file written by numpy < 2 names numpy.core.multiarray; it reads the same.
    data = pickle.dumps({(np.int64(1), np.int64(2), np.int64(3)): np.array([4, 5])}, protocol=2)
    assert b"numpy._core.multiarray" in data
    path = tmp_path / "old.pkl"
    path.write_bytes(data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    raw = read_negatives(path)
    assert raw.src.tolist() == [1] and raw.t.tolist() == [3] and raw.neg.tolist() == [[4, 5]]


# --------------------------------------------------------------------- evaluation
def _overrides(store: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        "train.device=cpu",
        "quiet=true",
        "train.epochs=1",
        "train.batch_size=4",
        "train.dtype=float64",
        "model.name=tgn",
        "model.memory_dim=4",
        "model.time_dim=4",
        "model.embed_dim=4",
        "model.num_neighbors=2",
        *extra,
    ]


def test_mrr_uses_the_fixed_negatives(store, tmp_path) -> None:
    # The first val row lists its own destination (40): a true edge, filtered out.
    val_ns = {(20, 40, 14): [10, 40, 50], (40, 30, 15): [20, 60]}
    val = _pickle(tmp_path / "v.pkl", val_ns)
    test = _pickle(tmp_path / "t.pkl", TEST_NS)
    assert main(["data", "negatives", str(store), "--val", str(val), "--test", str(test)]) == 0

    tr = sven.Trainer(None, _overrides(store, tmp_path / "run"))
    d = tr.data
    assert (d.mrr_source, d.mrr_negatives) == ("fixed", 4)  # the widest split's q
    # The negatives scored: the stored ones, padding replaced by the event's own
    # destination; padding and true edges of the instant do not count.
    lo = d.ranges["test"][0]
    idx = torch.arange(lo, lo + 3)
    c = _compact(store, [30, 40, 50, 60, 10, 20])
    n30, n40, n50, n60, n10, n20 = c
    assert d.mrr_draw("test", idx).tolist() == [
        [n30, n40, n50, n60],
        [n10, n30, n30, n30],
        [n20, n30, n60, n20],
    ]
    # Event (10, 20, 17) scores 20: its own destination, at its own instant.
    valid = d.mrr_valid("test", idx, d.mrr_draw("test", idx))
    assert valid.tolist() == [
        [True, True, True, True],
        [True, False, False, False],
        [False, True, True, False],
    ]
    vlo = d.ranges["val"][0]
    vidx = torch.arange(vlo, vlo + 2)
    assert d.mrr_valid("val", vidx, d.mrr_draw("val", vidx)).tolist() == [
        [True, False, True, False],
        [True, True, False, False],
    ]
    summary = tr.fit()
    assert summary["eval_mrr_source"] == "fixed" and summary["eval_mrr_negatives"] == 4
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["eval_mrr_source"] == "fixed"

    # The MRR by hand from the scores of an evaluation pass.
    res = tr.evaluate("test")
    assert res.mrr_valid.tolist() == valid.tolist()
    pos, neg = res.pos.double(), res.mrr_neg.double()
    ranks = []
    for i in range(3):
        kept = [float(neg[i, j]) for j in range(4) if valid[i, j]]
        p = float(pos[i])
        ranks.append(1 + sum(x > p for x in kept) + 0.5 * sum(x == p for x in kept))
    hand = sum(1 / r for r in ranks) / 3
    assert mrr(res.pos, res.mrr_neg, res.mrr_valid) == pytest.approx(hand, abs=1e-12)
    assert tr.split_metrics("test", res)["test_mrr"] == pytest.approx(hand, abs=1e-12)
    # Column j scores negative j: the padding of event 2 is its own destination.
    assert float(neg[2, 3]) == pytest.approx(float(pos[2]), abs=1e-9)


def test_mrr_source_choices(store, tmp_path) -> None:
    with pytest.raises(ConfigError, match="sven data negatives STORE"):
        sven.Trainer(None, _overrides(store, tmp_path / "a", "eval.mrr_source=fixed"))
    with pytest.raises(ConfigError, match=r"needs eval\.mrr_negatives > 0"):
        sven.Trainer(None, _overrides(store, tmp_path / "b", "eval.mrr_source=sampled"))
    with pytest.raises(ConfigError, match=r"eval\.mrr_source must be auto, fixed or sampled"):
        sven.Trainer(None, _overrides(store, tmp_path / "c", "eval.mrr_source=tgb"))
    none = sven.Trainer(None, _overrides(store, tmp_path / "d")).fit()
    assert none["eval_mrr_source"] is None and "test_mrr" not in none

    # Only test negatives stored: auto uses them (val reports no MRR) even with
    # eval.mrr_negatives set; sampled ignores them.
    test = _pickle(tmp_path / "t.pkl", TEST_NS)
    assert main(["data", "negatives", str(store), "--test", str(test)]) == 0
    tr = sven.Trainer(None, _overrides(store, tmp_path / "e", "eval.mrr_negatives=3"))
    assert (tr.data.mrr_source, tr.data.mrr_negatives) == ("fixed", 4)
    assert "val_mrr" not in tr.split_metrics("val", tr.evaluate("val"))
    sampled = sven.Trainer(
        None, _overrides(store, tmp_path / "f", "eval.mrr_source=sampled", "eval.mrr_negatives=3")
    ).fit()
    assert sampled["eval_mrr_source"] == "sampled" and sampled["eval_mrr_negatives"] == 3
    assert 0.0 < sampled["test_mrr"] <= 1.0
