"""Answers from a checkpoint's stored node state, without a replay of the stream.

After the checkpoint's time, :class:`sven.Predictor` reads the node state it saved
(memory, last-update times, mailboxes) for the queried nodes and their sampled
neighbours; earlier times are replayed. Shown here, for the four models:

- given the node state a replay reaches at the checkpoint's position, written as a
  checkpoint by the checkpoint writer, the stored-state answers are the replay's to the
  last bit (scores and embeddings), neighbours from the store's T-CSR in both;
- a query before the checkpoint's time is the replay's answer, in the same call as
  queries after it;
- a run's own best model answers the first test batch's events with the scores ``sven
  eval`` computes for them (evaluation continues its test split from that state).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import sven
from sven.cli import main
from sven.datasets.store import TemporalEvents, write_events
from sven.engine.checkpoint import Checkpointer, find_checkpoint, load_file, load_node_state
from sven.engine.checkpoint.load import NodeStateFiles
from sven.errors import ConfigError, SvenError
from sven.tasks import predict as predict_mod
from sven.tasks.predict import Predictor, _query_keys, checkpoint_position

MODELS = ("tgn", "jodie", "apan", "dyrep")
OFFSET = 500  # raw ids 500..: never the compact ones
B = 50


def _stream(out: Path, e: int = 400, nodes: int = 24, node_dim: int = 0) -> Path:
    """Each node mostly talks to two partners; distinct times; 3 edge features (and
    ``node_dim`` node features)."""
    rng = np.random.default_rng(3)
    src = rng.integers(0, nodes, e)
    partners = rng.integers(0, nodes, (nodes, 2))
    dst = np.where(
        rng.random(e) < 0.8, partners[src, rng.integers(0, 2, e)], rng.integers(0, nodes, e)
    )
    dst = np.where(dst == src, (dst + 1) % nodes, dst)
    feat = rng.random((e, 3)).astype(np.float32)
    if node_dim:
        # Node features fix the node set: compact ids, the raw ones in the id map.
        write_events(out, src, dst, 10 + 5 * np.arange(e), edge_feat=feat, name=out.name,
                     node_feat=rng.random((nodes, node_dim)).astype(np.float32),
                     id_map=np.arange(nodes) + OFFSET)  # fmt: skip
        return out
    write_events(out, src + OFFSET, dst + OFFSET, 10 + 5 * np.arange(e), edge_feat=feat,
                 name=out.name)  # fmt: skip
    return out


def _overrides(store: Path, out: Path, model: str) -> list[str]:
    return [
        f"data.path={store}", f"out={out}", f"model.name={model}", "train.device=cpu",
        "train.threads=1", "quiet=true", "train.epochs=1", f"train.batch_size={B}",
        "model.memory_dim=8", "model.time_dim=4", "model.embed_dim=8",
        "model.num_neighbors=4", "train.lr=0.01",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Per model, a run folder of one epoch on the tiny store."""
    root = tmp_path_factory.mktemp("stored")
    store = _stream(root / "tiny")
    out = {"store": store}
    for model in MODELS:
        run = root / f"run-{model}"
        sven.Trainer(None, _overrides(store, run, model)).fit()
        out[model] = run
    return out


def _latest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step-*"))[-1]


def _queries(store: Path, pos: int, n: int = 30) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n raw (src, dst, t) pairs at distinct times after event ``pos - 1`` and up to the
    last event of the evaluation batch that starts at ``pos``: a batch replay answers
    them all from its memory at ``pos``."""
    ev = TemporalEvents.load(store)
    t = np.asarray(ev.t, dtype=np.float64)
    rng = np.random.default_rng(7)
    times = np.linspace(t[pos - 1] + 0.5, t[pos + B - 1], n)
    raw = np.asarray(ev.id_map)
    src, dst = raw[rng.integers(0, raw.size, n)], raw[rng.integers(0, raw.size, n)]
    return src, dst, times


def _replayed_checkpoint(run: Path, pos: int, out: Path, p: Predictor) -> Path:
    """The run's latest checkpoint, its node state replaced by ``p``'s replayed memory
    (which must be at ``pos``), written by the checkpoint writer."""
    assert p._pos == pos
    ck = _latest(run)
    state = load_file(ck / "state.pt")
    writer = Checkpointer(out)
    folder = writer.save(1, state, node_state=p.tr.memory.state_dict())
    writer.wait()
    return folder


@pytest.mark.parametrize("model", MODELS)
def test_stored_state_answers_as_the_replay_at_the_checkpoints_time(runs, tmp_path, model):
    store, run = runs["store"], runs[model]
    ck = _latest(run)
    ev = TemporalEvents.load(store)
    ranges = {k: ev.split_range(k) for k in ("train", "val", "test")}
    pos = checkpoint_position(load_file(ck / "state.pt"), ranges, B)
    # An epoch's checkpoint is taken after validation: its memory ends with val.
    assert pos == ev.split_range("val")[1]
    src, dst, t = _queries(store, pos)
    replay = Predictor(ck, device="cpu", memory="replay")
    # A few queries (2 pairs, 3 nodes: fewer rows with their neighbours than N = 24) and
    # many (30 pairs, 10 nodes): read row by row, then the whole state read once.
    few = replay.score(src[:2], dst[:2], t[:2], logits=True)
    nodes = np.asarray(ev.id_map)[:10]
    few_h = replay.embed(nodes[:3], t[3])
    want = replay.score(src, dst, t, logits=True)
    want_h = replay.embed(nodes, t[3])
    folder = _replayed_checkpoint(run, pos, tmp_path / "replayed", replay)

    # Each batch's rows read where they lie (a share of N above 1: never in one pass),
    # then every question's rows read in one pass over the files in file order.
    for share in (np.inf, 0.0):
        stored = Predictor(folder, device="cpu")
        stored.wide_fraction = share
        assert stored.stored_events == pos
        assert stored.checkpoint_time == float(ev.t[pos - 1])
        np.testing.assert_array_equal(stored.score(src[:2], dst[:2], t[:2], logits=True), few)
        np.testing.assert_array_equal(stored.embed(nodes[:3], t[3]), few_h)
        np.testing.assert_array_equal(stored.score(src, dst, t, logits=True), want)
        np.testing.assert_array_equal(stored.embed(nodes, t[3]), want_h)
        assert (stored._stored_table is None) == (share > 1)
        # Nothing was replayed: no trainer (no node state of the whole graph) was built.
        assert stored._tr is None
    # The state carries what each model reads: memory, times and mail all filled.
    files = NodeStateFiles(folder)
    a = files.arrays[0]
    assert np.abs(a["memory"]).sum() > 0 and a["mail_valid"].any()
    assert (a["last_update"] > ev.t[0]).any() and a["mail_ts"].max() > 0
    if model == "apan":
        assert a["mail_valid"][:, 1:].any()  # more than one mail in some mailbox
    # The run's own state (built while training) is another state: other answers.
    own = Predictor(ck, device="cpu").score(src, dst, t, logits=True)
    assert not np.array_equal(own, want)


@pytest.mark.parametrize("model", ["tgn", "apan"])
def test_earlier_times_are_replayed_in_the_same_call(runs, model):
    store, run = runs["store"], runs[model]
    ck = _latest(run)
    ev = TemporalEvents.load(store)
    pos = ev.split_range("val")[1]
    src, dst, late = _queries(store, pos, 6)
    t = np.asarray(ev.t, dtype=np.float64)
    early = np.array([t[60] + 1, t[130], t[pos - 1]])  # the last at the checkpoint's time
    both = np.concatenate([late[:3], early, late[3:]])
    idx = [0, 1, 2, 0, 1, 2, 3, 4, 5]
    p = Predictor(ck, device="cpu")
    got = p.score(src[idx], dst[idx], both, logits=True)
    replayed = Predictor(ck, device="cpu", memory="replay")
    want_early = replayed.score(src[:3], dst[:3], early, logits=True)
    np.testing.assert_array_equal(got[3:6], want_early)
    # The later ones are the stored state's, as asked alone.
    alone = Predictor(ck, device="cpu").score(src, dst, late, logits=True)
    np.testing.assert_array_equal(got[[0, 1, 2, 6, 7, 8]], alone)
    # A replay went as far as the earlier times needed, no further.
    assert 0 < p._pos < pos


def test_best_model_answers_the_first_test_batch_as_eval(runs, tmp_path) -> None:
    """``sven eval`` continues the best model's test split from its saved node state;
    the stored-state answers for the first test batch's events are its scores."""
    store, run = runs["store"], runs["tgn"]
    best = find_checkpoint(run)
    assert best.parent.name == "best"
    state = load_file(best / "state.pt")
    tr = sven.Trainer(None, _overrides(store, tmp_path / "eval", "tgn"))
    tr.model.load_state_dict(state["model"])
    load_node_state(best, tr.memory.state_dict(), tr.owned, tr.num_nodes)
    pos_logits = tr.evaluate("test").pos[:B]
    ev = TemporalEvents.load(store)
    lo, _ = ev.split_range("test")
    raw = np.asarray(ev.id_map)
    src, dst = raw[np.asarray(ev.src[lo : lo + B])], raw[np.asarray(ev.dst[lo : lo + B])]
    t = np.asarray(ev.t[lo : lo + B], dtype=np.float64)
    got = Predictor(run, device="cpu").score(src, dst, t, logits=True)
    np.testing.assert_allclose(got, pos_logits.numpy(), rtol=1e-5, atol=1e-6)


def test_cli_memory_option(runs, tmp_path, capsys) -> None:
    import pandas as pd

    store, run = runs["store"], runs["jodie"]
    ev = TemporalEvents.load(store)
    src, dst, t = _queries(store, ev.split_range("val")[1], 5)
    pairs = tmp_path / "pairs.csv"
    pd.DataFrame({"src": src, "dst": dst, "t": t}).to_csv(pairs, index=False)
    base = ["predict", "--checkpoint", str(run), "--pairs", str(pairs), "--device", "cpu"]
    assert main([*base, "--out", str(tmp_path / "a.csv")]) == 0
    assert "answered from its node state, no replay" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "b.csv"), "--memory", "replay"]) == 0
    assert "node state" not in capsys.readouterr().err
    a, b = pd.read_csv(tmp_path / "a.csv"), pd.read_csv(tmp_path / "b.csv")
    np.testing.assert_allclose(
        a["score"], Predictor(run, device="cpu").score(src, dst, t), rtol=1e-6
    )
    np.testing.assert_allclose(
        b["score"], Predictor(run, device="cpu", memory="replay").score(src, dst, t), rtol=1e-6
    )
    emb = ["embed", "--checkpoint", str(run), "--nodes", f"{src[0]},{dst[0]}", "--time",
           str(t[0]), "--device", "cpu", "--out", str(tmp_path / "e.npy")]  # fmt: skip
    assert main(emb) == 0
    want = Predictor(run, device="cpu").embed([src[0], dst[0]], t[0])
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), want)
    with pytest.raises(ConfigError, match="memory must be checkpoint or replay"):
        Predictor(run, device="cpu", memory="stored")


def test_checkpoint_position_of_each_kind_of_checkpoint() -> None:
    ranges = {"train": (0, 700), "val": (700, 850), "test": (850, 1000)}
    assert checkpoint_position({"memory_phase": "val_end"}, ranges, 100) == 850
    assert checkpoint_position({"cursor": {"epoch": 2, "next_batch": 0}}, ranges, 100) == 850
    assert checkpoint_position({"cursor": {"epoch": 0, "next_batch": 3}}, ranges, 100) == 300
    assert checkpoint_position({"cursor": {"epoch": 1, "next_batch": 8}}, ranges, 100) == 700
    assert checkpoint_position({"cursor": {"epoch": 0, "next_batch": 0}}, ranges, 100) == 0
    assert checkpoint_position({"model": {}}, ranges, 100) is None


def test_repeated_queries_are_embedded_once_with_the_same_answers(runs) -> None:
    """A million pairs over few nodes at one time embed each (node, time) once: the
    scores of repeated pairs are those of the distinct ones, asked alone."""
    store, run = runs["store"], runs["tgn"]
    ev = TemporalEvents.load(store)
    src, dst, t = _queries(store, ev.split_range("val")[1], 8)
    p = Predictor(run, device="cpu")
    alone = p.score(src, dst, t, logits=True)
    rep = np.random.default_rng(1).integers(0, 8, 500)
    many = p.score(src[rep], dst[rep], t[rep], logits=True)
    np.testing.assert_allclose(many, alone[rep], rtol=1e-6, atol=1e-6)
    # The random key of a query is its (node, time)'s: equal for equal queries only.
    k = _query_keys(np.array([3, 3, 4, 3]), np.array([5.0, 5.0, 5.0, 5.5]))
    assert k[0] == k[1] and len(set(k[1:].tolist())) == 3 and (k >= 0).all()


def test_stored_state_answers_hold_rows_of_the_query_not_of_the_graph(tmp_path, monkeypatch):
    """On a store of 400,000 nodes (a few hundred of them active), the stored-state
    answers build no trainer and no node state of the graph's size: the rows read, the
    neighbour index and the host arrays allocated are those of the query's nodes."""
    import tracemalloc

    from sven.models.memory import MemoryState
    from sven.tasks import stored as stored_mod

    n, active, e = 400_000, 300, 1200
    rng = np.random.default_rng(5)
    src = rng.integers(0, active, e)
    dst = (src + rng.integers(1, active, e)) % active
    store = tmp_path / "wide"
    write_events(store, src, dst, 10 + 5 * np.arange(e), id_map=np.arange(n) + OFFSET,
                 name="wide")  # fmt: skip
    run = tmp_path / "run"
    sven.Trainer(None, _overrides(store, run, "tgn")).fit()
    ev = TemporalEvents.load(store)
    assert ev.num_nodes == n
    # 20 pairs: 10 active sources, 10 destinations never seen in any event.
    s_raw = OFFSET + rng.choice(active, 10, replace=False)
    d_raw = OFFSET + active + rng.choice(n - active, 10, replace=False)
    t = np.full(10, float(ev.t[-1]) + 100.0)

    built: list[int] = []
    init = MemoryState.__init__

    def spy(self, num_nodes, *a, **k):
        built.append(num_nodes)
        init(self, num_nodes, *a, **k)

    monkeypatch.setattr(MemoryState, "__init__", spy)
    read: list[int] = []
    samplers: list[stored_mod.LocalSampler] = []
    rows, sampler = stored_mod.StoredRun.state_rows, stored_mod.StoredRun.sampler

    def rows_spy(self, nodes):
        read.append(nodes.numel())
        return rows(self, nodes)

    def sampler_spy(self, nodes):
        samplers.append(sampler(self, nodes))
        return samplers[-1]

    monkeypatch.setattr(stored_mod.StoredRun, "state_rows", rows_spy)
    monkeypatch.setattr(stored_mod.StoredRun, "sampler", sampler_spy)

    p = Predictor(run, device="cpu")
    # The question traced (its id lookup, neighbour index and rows are built for it);
    # the opening's checksum buffers are of a fixed size.
    tracemalloc.start()
    try:
        scores = p.score(s_raw, d_raw, t, logits=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.isfinite(scores).all() and p.stored_events is not None
    assert p._tr is None  # no trainer: no node state, T-CSR or event tables of N rows
    assert built and max(built) == 0  # only the empty node state that gives row shapes
    # The rows read: the 20 queried nodes and their sampled neighbours (K = 4).
    assert read and max(read) <= 20 * (1 + 4) and p._stored_table is None
    # The neighbour index: the queried nodes' incident events, not the stream's.
    (local,) = samplers
    q = np.concatenate([s_raw, d_raw]) - OFFSET
    incident = np.isin(src, q).sum() + np.isin(dst, q).sum()
    assert local.nodes.numel() == 20 and local.inner.tcsr.indptr.numel() == 21
    assert local.num_entries == incident < 2 * e
    # Host arrays (numpy and Python, what tracemalloc sees): under a quarter of a byte
    # a node, where sorting the id map for the lookup alone took 16 bytes a node.
    assert peak < n // 4, f"{peak} bytes traced"


def test_node_features_are_read_as_the_trainer_reads_them(tmp_path, monkeypatch) -> None:
    """On a store with node features, the stored-state answers (feature rows read from
    the store's file) are the replay's (the trainer's table of every node's features)."""
    from sven.tasks import stored as stored_mod

    store = _stream(tmp_path / "feat", node_dim=5)
    run = tmp_path / "run"
    sven.Trainer(None, _overrides(store, run, "tgn")).fit()
    ev = TemporalEvents.load(store)
    assert ev.node_feat is not None
    pos = ev.split_range("val")[1]
    src, dst, t = _queries(store, pos, 4)
    replay = Predictor(_latest(run), device="cpu", memory="replay")
    # The same questions both ways (another batch of queries rounds differently).
    few = replay.score(src[:2], dst[:2], t[:2], logits=True)
    want = replay.score(src, dst, t, logits=True)
    folder = _replayed_checkpoint(run, pos, tmp_path / "replayed", replay)
    # Batch by batch, then in one pass over the files.
    for share in (np.inf, 0.0):
        stored = Predictor(folder, device="cpu")
        stored.wide_fraction = share
        np.testing.assert_array_equal(stored.score(src[:2], dst[:2], t[:2], logits=True), few)
        np.testing.assert_array_equal(stored.score(src, dst, t, logits=True), want)
        assert (stored._stored_table is None) == (share > 1) and stored._tr is None
    # The features matter: without them, other answers.
    zero = stored_mod.StoredRun.node_rows
    monkeypatch.setattr(stored_mod.StoredRun, "node_rows", lambda self, n: zero(self, n) * 0)
    assert not np.array_equal(stored.score(src, dst, t, logits=True), want)


def test_a_corrupt_chunk_is_refused_where_a_question_reads_it(tmp_path, monkeypatch, capsys):
    """``sven predict`` reads and checks the chunks of the node state its rows lie in
    (chunks of 256 bytes here: 8 rows of JODIE's memory); a corrupt byte elsewhere is
    not read, one in a row it reads is refused with one line."""
    import pandas as pd

    from sven.engine.checkpoint import format as fmt

    monkeypatch.setattr(fmt, "CHUNK", 256)
    # Rows read batch by batch (a question of 2 nodes of 24 would otherwise read its rows
    # in one pass, every chunk of the files checked).
    monkeypatch.setattr(predict_mod, "WIDE_FRACTION", np.inf)
    store = _stream(tmp_path / "tiny")
    run = tmp_path / "run"
    sven.Trainer(None, _overrides(store, run, "jodie")).fit()
    ev = TemporalEvents.load(store)
    raw = np.asarray(ev.id_map)
    pairs = tmp_path / "pairs.csv"
    t = float(ev.t[-1]) + 100.0
    pd.DataFrame({"src": raw[[0]], "dst": raw[[1]], "t": [t]}).to_csv(pairs, index=False)
    base = ["predict", "--checkpoint", str(run), "--pairs", str(pairs), "--device", "cpu"]
    assert main([*base, "--out", str(tmp_path / "a.csv")]) == 0
    capsys.readouterr()
    folder = find_checkpoint(run)
    mem = folder / "nodes/rank0/memory.npy"
    arr = np.load(mem, mmap_mode="r")
    assert arr.shape == (24, 8) and arr.offset == 128  # rows 20..23: the 4th chunk

    def flip(row: int) -> None:
        raw_bytes = bytearray(mem.read_bytes())
        raw_bytes[128 + 32 * row + 3] ^= 0x55
        mem.write_bytes(bytes(raw_bytes))

    flip(22)
    assert main([*base, "--out", str(tmp_path / "b.csv")]) == 0
    a, b = pd.read_csv(tmp_path / "a.csv"), pd.read_csv(tmp_path / "b.csv")
    assert a.equals(b)
    capsys.readouterr()
    flip(1)
    assert main([*base, "--out", str(tmp_path / "c.csv")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{mem}: corrupt checkpoint: bytes 0 to 256 " in err[0], err
    assert not (tmp_path / "c.csv").exists()
    # Evaluation and resume read every row: they refuse the checkpoint as a whole.
    with pytest.raises(SvenError, match="corrupt or incomplete"):
        find_checkpoint(folder)


@pytest.mark.parametrize("model", ["jodie", "apan"])
def test_the_time_scale_is_read_from_the_checkpoint(runs, tmp_path, monkeypatch, model):
    """The time scale is saved with the model: answers from a checkpoint do not scan
    the training events for it; a checkpoint saved without it (an older Sven's) has it
    worked out from them, with the same answers."""
    import json
    import shutil

    from sven.engine.checkpoint.format import file_digest
    from sven.models import base

    store = runs["store"]
    ev = TemporalEvents.load(store)
    lo, hi = ev.split_range("train")
    want = base.time_gap_scale(ev.src[lo:hi], ev.dst[lo:hi], ev.t[lo:hi])
    assert want != 1.0
    scans: list[int] = []
    real = base.time_gap_scale
    monkeypatch.setattr(base, "time_gap_scale", lambda *a: scans.append(1) or real(*a))
    raw = np.asarray(ev.id_map)
    src, dst = raw[:6], raw[6:12]
    t = np.full(6, float(ev.t[-1]) + 100.0)
    p = Predictor(runs[model], device="cpu")
    assert p.model.time_proj.time_scale == want and scans == []
    scores = p.score(src, dst, t, logits=True)
    # The same run, its best checkpoint's model without the scale.
    run = tmp_path / "run"
    shutil.copytree(runs[model], run)
    folder = find_checkpoint(run)
    state = load_file(folder / "state.pt")
    assert state["model"].pop("time_proj.scale_bits").dtype == torch.int64
    torch.save(state, folder / "state.pt")
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["state.pt"] = file_digest(folder / "state.pt")
    (folder / "meta.json").write_text(json.dumps(meta))
    old = Predictor(run, device="cpu")
    assert old.model.time_proj.time_scale == want and scans == [1]
    np.testing.assert_array_equal(old.score(src, dst, t, logits=True), scores)


def test_a_wide_question_reads_its_rows_in_one_pass_in_file_order(tmp_path, monkeypatch):
    """A question whose nodes (with their neighbours) number at least ``wide_fraction``
    of N reads their node state in one pass over the files, a piece at a time (pieces
    of 512 bytes, chunks of 256 here: rows cross both), and keeps those rows only: the
    scores are the batch-by-batch reads', to the last bit; a later question within
    those rows reads nothing; a corrupt chunk among the pieces read is refused."""
    from sven.engine.checkpoint import format as fmt
    from sven.tasks import stored as stored_mod

    monkeypatch.setattr(fmt, "CHUNK", 256)
    monkeypatch.setattr(stored_mod, "_PIECE", 512)
    store = _stream(tmp_path / "s", e=600, nodes=200)
    run = tmp_path / "run"
    sven.Trainer(None, _overrides(store, run, "tgn")).fit()
    ev = TemporalEvents.load(store)
    raw = np.asarray(ev.id_map)
    rng = np.random.default_rng(2)
    n = raw.size  # the nodes of its events: about 200
    src, dst = raw[rng.integers(0, n, 12)], raw[rng.integers(0, n, 12)]
    t = np.full(12, float(ev.t[-1]) + 100.0)
    narrow = Predictor(run, device="cpu")
    narrow.wide_fraction = np.inf
    want = narrow.score(src, dst, t, logits=True)
    wide = Predictor(run, device="cpu")
    wide.wide_fraction = 0.0
    reads: list[int] = []
    real = stored_mod.read_in_file_order
    monkeypatch.setattr(stored_mod, "read_in_file_order",
                        lambda f, n, k: reads.append(n.size) or real(f, n, k))  # fmt: skip
    np.testing.assert_array_equal(wide.score(src, dst, t, logits=True), want)
    table = wide._stored_table
    assert reads == [table.num_rows] and 24 <= table.num_rows < n
    # Its rows are the files' rows of its nodes, and nothing else.
    files = NodeStateFiles(find_checkpoint(run))
    ids = table.ids.numpy()
    for k in ("memory", "last_update", "mail", "mail_ts", "mail_valid"):
        got = getattr(table.rows, k).numpy()
        np.testing.assert_array_equal(got, np.asarray(files.arrays[0][k])[ids].astype(got.dtype))
    # Fewer of the same pairs: answered from the rows read, as batch by batch (the
    # same question: another batch of queries rounds differently).
    few = narrow.score(src[:5], dst[:5], t[:5], logits=True)
    np.testing.assert_array_equal(wide.score(src[:5], dst[:5], t[:5], logits=True), few)
    assert reads == [table.num_rows]
    # Any subset, read alone, is the memory map's rows (rows across pieces included).
    for size in (1, 7, 60, n):
        sub = np.sort(rng.choice(n, size, replace=False))
        got = stored_mod.read_in_file_order(files, sub, ["memory", "mail"])
        for k in ("memory", "mail"):
            np.testing.assert_array_equal(got[k], np.asarray(files.arrays[0][k])[sub])
    # One flipped byte in the last wanted node's memory row (past the header's chunk,
    # which opening the files checks): refused, naming the bytes.
    mem = find_checkpoint(run) / "nodes/rank0/memory.npy"
    off = int(np.load(mem, mmap_mode="r").offset) + 32 * int(ids[-1]) + 1
    assert off >= 256
    data = bytearray(mem.read_bytes())
    data[off] ^= 0x55
    mem.write_bytes(bytes(data))
    again = Predictor(run, device="cpu")
    again.wide_fraction = 0.0
    k = off // 256
    with pytest.raises(SvenError, match=f"corrupt checkpoint: bytes {k * 256} to {(k + 1) * 256} "):
        again.score(src, dst, t, logits=True)
