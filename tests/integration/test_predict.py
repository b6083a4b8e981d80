"""`sven predict`, `sven embed` and `sven.Predictor` on a trained tiny model.

The scores of a stream's held-back (test) events equal the ones evaluation computes for
them; top-k agrees with the MRR that evaluation reports over the same candidates; raw ids
go in and come out; each kind of bad input stops with one line or is skipped and said.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import sven
from sven.cli import main
from sven.datasets.negatives import write_eval_negatives
from sven.datasets.store import TemporalEvents, write_events
from sven.engine.checkpoint import find_checkpoint, load_file
from sven.errors import DataError, SvenError
from sven.tasks.predict import Predictor

OFFSET = 1000  # raw ids 1000..1059: never equal to the compact ones


def _stream(out: Path, seed: int = 0, e: int = 1500, nodes: int = 30) -> Path:
    """Each node mostly talks to two partners; distinct event times."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, nodes, e)
    partners = rng.integers(0, nodes, (nodes, 2))
    dst = np.where(
        rng.random(e) < 0.8, partners[src, rng.integers(0, 2, e)], rng.integers(0, nodes, e)
    )
    t = 100 + 7 * np.arange(e)
    feat = rng.random((e, 3)).astype(np.float32)
    write_events(out, src + OFFSET, dst + OFFSET, t, edge_feat=feat, name=out.name)
    return out


def _overrides(store: Path, out: Path, model: str, *extra: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        f"model.name={model}",
        "train.device=cpu",
        "train.threads=1",
        "quiet=true",
        "train.epochs=1",
        "train.batch_size=100",
        "model.memory_dim=16",
        "model.time_dim=8",
        "model.embed_dim=16",
        "model.num_neighbors=5",
        "train.lr=0.003",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per model: (store, the run's last step-N checkpoint, whose memory is replayed)."""
    root = tmp_path_factory.mktemp("predict")
    store = _stream(root / "tiny")
    # Fixed MRR negatives: every other destination of the stream, for each test event.
    ev = TemporalEvents.load(store)
    cands = np.unique(np.asarray(ev.dst))
    lo, hi = ev.split_range("test")
    dst = np.asarray(ev.dst[lo:hi])
    neg = np.stack([np.setdiff1d(cands, [d], assume_unique=True) for d in dst])
    write_eval_negatives(store, "test", neg, {"path": "all-candidates", "sha256": ""})
    out = {}
    for model in ("tgn", "jodie"):
        run = root / f"run-{model}"
        sven.Trainer(None, _overrides(store, run, model)).fit()
        steps = sorted((run / "checkpoints").glob("step-*"))
        out[model] = (store, steps[-1])
    return out


def _eval_scores(store: Path, ckpt: Path, model: str) -> tuple[torch.Tensor, dict]:
    """The test split's positive logits as evaluation computes them for a checkpoint
    without saved memory (``Trainer.evaluate_checkpoint``: train and val replayed)."""
    tr = sven.Trainer(None, _overrides(store, ckpt.parent / "eval-out", model))
    state = load_file(find_checkpoint(ckpt) / "state.pt")
    tr.model.load_state_dict(state["model"])
    metrics = tr.evaluate_checkpoint(ckpt)
    tr.memory.reset()
    tr.evaluate("train")
    tr.evaluate("val")
    return tr.evaluate("test").pos, metrics


def _test_events(store: Path) -> pd.DataFrame:
    ev = TemporalEvents.load(store)
    lo, hi = ev.split_range("test")
    raw = np.asarray(ev.id_map)
    return pd.DataFrame(
        {
            "src": raw[np.asarray(ev.src[lo:hi])],
            "dst": raw[np.asarray(ev.dst[lo:hi])],
            "t": np.asarray(ev.t[lo:hi]),
        }
    )


@pytest.mark.parametrize("model", ["tgn", "jodie"])
def test_predict_equals_eval_scores_on_the_held_back_split(trained, tmp_path, model) -> None:
    store, ckpt = trained[model]
    pos, _ = _eval_scores(store, ckpt, model)
    pairs = _test_events(store)
    pairs.to_csv(tmp_path / "pairs.csv", index=False)
    out = tmp_path / "scored.parquet"
    argv = ["predict", "--checkpoint", str(ckpt), "--pairs", str(tmp_path / "pairs.csv")]
    # The test events are after the checkpoint's time: replayed on request (the
    # checkpoint's own node state answers them by default, test_predict_stored.py).
    argv += ["--memory", "replay"]
    assert main([*argv, "--out", str(out), "--device", "cpu"]) == 0
    got = pd.read_parquet(out)
    assert len(got) == len(pairs)
    # The same rows, in the same order, with a score.
    assert (got["src"].astype(int).to_numpy() == pairs["src"].to_numpy()).all()
    np.testing.assert_allclose(got["score"], torch.sigmoid(pos).numpy(), rtol=1e-5, atol=1e-6)
    # The Python API's logits are evaluation's logits.
    p = Predictor(ckpt, device="cpu", memory="replay")
    logits = p.score(pairs["src"], pairs["dst"], pairs["t"], logits=True)
    np.testing.assert_allclose(logits, pos.numpy(), rtol=1e-5, atol=1e-6)


def test_exact_replay_sees_every_earlier_event(trained) -> None:
    """With one event per batch, batch replay is exact replay; with B events per batch,
    exact replay differs from batch replay only inside a batch."""
    store, ckpt = trained["tgn"]
    pairs = _test_events(store).iloc[:40]
    batch = Predictor(ckpt, device="cpu", memory="replay")
    batch = batch.score(pairs["src"], pairs["dst"], pairs["t"])
    exact = Predictor(ckpt, device="cpu", replay="exact", memory="replay")
    ex = exact.score(pairs["src"], pairs["dst"], pairs["t"])
    # The first event of the test split starts a batch: both replays agree there.
    assert ex[0] == pytest.approx(batch[0], abs=1e-6)
    assert not np.allclose(ex, batch)
    # Exact replay undoes its partial batches: asking again gives the same answers.
    np.testing.assert_allclose(exact.score(pairs["src"], pairs["dst"], pairs["t"]), ex, atol=1e-6)


def test_topk_ranks_agree_with_the_mrr_of_evaluation(trained, tmp_path) -> None:
    store, ckpt = trained["tgn"]
    _, metrics = _eval_scores(store, ckpt, "tgn")
    pairs = _test_events(store)
    p = Predictor(ckpt, device="cpu", memory="replay")
    n_cand = int(p.tr.data.candidates.numel())
    ranks = []
    for row in pairs.itertuples():
        ids, scores = p.topk([row.src], row.t, n_cand)
        assert (np.diff(scores[0]) <= 0).all()  # best first
        ranks.append(int(np.flatnonzero(ids[0] == row.dst)[0]) + 1)
    ranks = np.asarray(ranks)
    # Evaluation's MRR against every other destination is the mean reciprocal rank.
    assert np.mean(1.0 / ranks) == pytest.approx(metrics["test_mrr"], abs=1e-6)
    # Top-3 holds the true destination exactly as often as its rank is at most 3.
    hits = []
    for row in pairs.itertuples():
        ids, _ = p.topk([row.src], row.t, 3)
        hits.append(row.dst in ids[0])
    assert np.mean(hits) == pytest.approx(np.mean(ranks <= 3))
    # The CLI writes one row per (source, rank).
    out = tmp_path / "top.csv"
    src = f"{pairs.src[0]},{pairs.src[1]}"
    argv = ["predict", "--checkpoint", str(ckpt), "--topk", "3", "--src", src, "--memory", "replay"]
    assert main([*argv, "--time", str(pairs.t[0]), "--out", str(out), "--device", "cpu"]) == 0
    top = pd.read_csv(out)
    assert list(top.columns) == ["src", "t", "rank", "dst", "score"]
    assert len(top) == 6 and set(top["rank"]) == {1, 2, 3}


def test_raw_ids_round_trip_and_embeddings(trained, tmp_path) -> None:
    _, ckpt = trained["jodie"]
    p = Predictor(ckpt, device="cpu")
    raw = np.arange(OFFSET, OFFSET + 30)
    compact, known = p.compact_ids(raw)
    assert known.all()
    assert (p.raw_ids(compact) == raw).all()
    assert sorted(compact) == list(range(30))
    # Strings that spell the ids are the same ids (a csv read as text).
    assert (p.compact_ids([str(x) for x in raw])[0] == compact).all()
    h = p.embed(raw[:4], 5000.0)
    assert h.shape == (4, 16) and np.isfinite(h).all()
    out = tmp_path / "emb.npy"
    ids = ",".join(str(x) for x in raw[:4])
    argv = ["embed", "--checkpoint", str(ckpt), "--nodes", ids, "--time", "5000"]
    assert main([*argv, "--out", str(out), "--device", "cpu"]) == 0
    np.testing.assert_allclose(np.load(out), h, atol=1e-6)
    pq = tmp_path / "emb.parquet"
    assert main([*argv, "--out", str(pq), "--device", "cpu"]) == 0
    df = pd.read_parquet(pq)
    assert list(df["node"].astype(int)) == list(raw[:4])
    np.testing.assert_allclose(df[[f"e{j}" for j in range(16)]].to_numpy(), h, atol=1e-6)


def test_unknown_ids_fail_or_are_skipped(trained, tmp_path, capsys) -> None:
    _, ckpt = trained["tgn"]
    pairs = pd.DataFrame({"src": [1000, 5, 1001], "dst": [1002, 1003, 77], "t": [5000] * 3})
    pairs.to_csv(tmp_path / "pairs.csv", index=False)
    out = tmp_path / "scored.csv"
    base = ["predict", "--checkpoint", str(ckpt), "--pairs", str(tmp_path / "pairs.csv")]
    base += ["--out", str(out), "--device", "cpu"]
    assert main(base) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "row 1: '5'" in err and "--unknown skip" in err
    assert not out.exists()
    assert main([*base, "--unknown", "skip"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 rows whose source ids" in err and "skipped 1 rows whose destination" in err
    got = pd.read_csv(out)
    assert len(got) == 3
    assert got["score"].isna().tolist() == [False, True, True]


def test_times_outside_the_stream_are_said_and_answered(trained, capsys) -> None:
    _, ckpt = trained["tgn"]
    p = Predictor(ckpt, device="cpu", memory="replay")
    capsys.readouterr()
    s = p.score([1000, 1000], [1001, 1001], [-50.0, 1e9])
    err = capsys.readouterr().err
    assert "1 queries at or before the stream's first event (t=100)" in err
    assert "no history" in err
    assert "1 queries after the stream's last event" in err
    assert np.isfinite(s).all()
    # From the checkpoint's node state (the default), a time after the stream is after
    # the checkpoint's time too, and said so, with the events it has not seen.
    stored = Predictor(ckpt, device="cpu")
    capsys.readouterr()
    assert np.isfinite(stored.score([1000], [1001], [1e9])).all()
    err = capsys.readouterr().err
    assert "1 queries after the checkpoint's time (t=9018)" in err
    assert "later than events it has not seen" in err and "--memory replay" in err
    # Before the start there is no history: TGN's embedding of an empty memory without
    # neighbours is the same at any time.
    assert s[0] == pytest.approx(float(p.score([1000], [1001], [50.0])[0]), abs=1e-6)
    assert s[0] != pytest.approx(float(p.score([1000], [1001], [5000.0])[0]), abs=1e-6)
    # Times compare as numbers, not in the store's integer type: 107.5 is after 107.
    assert list(p._positions(np.array([107.0, 107.5, 114.0]))) == [1, 2, 2]
    with pytest.raises(DataError, match="finite"):
        p.score([1000], [1001], [float("nan")])


def test_checkpoint_of_another_dataset_is_refused(trained, tmp_path, capsys) -> None:
    _, ckpt = trained["tgn"]
    other = _stream(tmp_path / "other", seed=1, e=900, nodes=25)
    with pytest.raises(SvenError, match="trained on another dataset"):
        Predictor(ckpt, data=other, device="cpu")
    argv = ["embed", "--checkpoint", str(ckpt), "--data", str(other), "--nodes", "1000"]
    out = tmp_path / "e.npy"
    assert main([*argv, "--time", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another dataset" in err
    assert not out.exists()


def test_bad_tables_and_outputs_are_one_line_each(trained, tmp_path, capsys) -> None:
    _, ckpt = trained["tgn"]
    cases = {
        "missing.csv": None,
        "nocol.csv": "src,t\n1000,5\n",
        "badt.csv": "src,dst,t\n1000,1001,soon\n",
    }
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        argv = ["predict", "--checkpoint", str(ckpt), "--pairs", str(tmp_path / name)]
        assert main([*argv, "--out", str(tmp_path / "o.csv")]) == 3, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
    assert "row 0: t is not a number" in err
    assert not (tmp_path / "o.csv").exists()
    (tmp_path / "ok.csv").write_text("src,dst,t\n1000,1001,5\n")
    argv = ["predict", "--checkpoint", str(tmp_path), "--pairs", str(tmp_path / "ok.csv")]
    assert main([*argv, "--out", str(tmp_path / "o.csv")]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    argv = ["predict", "--checkpoint", str(ckpt), "--pairs", "x.csv", "--out", "o.txt"]
    assert main(argv) == 2


def test_bipartite_store_asks_for_the_side(tmp_path, capsys) -> None:
    rng = np.random.default_rng(0)
    e = 600
    src, dst = rng.integers(0, 20, e), rng.integers(0, 6, e)
    store = tmp_path / "bip"
    write_events(store, src, dst, 10 * np.arange(e), bipartite=True, name="bip")
    run = tmp_path / "run"
    sven.Trainer(None, _overrides(store, run, "jodie")).fit()
    p = Predictor(run, device="cpu")
    # Raw id 3 is a source and a destination: different nodes.
    a, _ = p.compact_ids([3], "src")
    b, _ = p.compact_ids([3], "dst")
    assert a[0] != b[0] and b[0] >= 20
    with pytest.raises(SvenError, match="--side src or --side dst"):
        p.embed([3], 100.0)
    assert np.isfinite(p.embed([3], 100.0, side="dst")).all()
    # Pairs map src and dst on their own sides.
    s = p.score([3], [3], [100.0])
    assert np.isfinite(s).all()
    assert json.loads((run / "summary.json").read_text())["model"] == "jodie"


def test_replay_does_not_compile(tmp_path) -> None:
    """A checkpoint trained with ``train.compile=true`` replays with the uncompiled
    model (the replay never calls the compiled one), so predictions import no
    compiler."""
    from sven.tasks.replay import open_run

    store = _stream(tmp_path / "s")
    run = tmp_path / "run"
    sven.Trainer(None, _overrides(store, run, "tgn", "train.compile=true")).fit()
    assert json.loads((run / "config.json").read_text())["train"]["compile"] is True
    tr, _, _ = open_run(run)
    assert tr.cfg.train.compile is False and tr.step.model is tr.model
