"""The synthetic generator: determinism, shape of the data, learnability, bounded memory."""

from __future__ import annotations

import argparse
import json
import tracemalloc
from collections import deque

import numpy as np
import pytest

from sven.datasets import cli, synth
from sven.datasets.synth import SynthParams, iter_synth_chunks
from sven.datasets.synth_stream import SynthStream
from sven.errors import ConfigError, SvenError

E, N = 30_000, 1_000


def _collect(**kwargs) -> dict[str, np.ndarray]:
    chunks = list(iter_synth_chunks(**kwargs))
    return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


@pytest.fixture(scope="module")
def stream() -> dict[str, np.ndarray]:
    return _collect(events=E, nodes=N, seed=7, edge_feat_dim=4, chunk_size=10_000)


@pytest.fixture(scope="module")
def bip_stream() -> dict[str, np.ndarray]:
    return _collect(events=E, nodes=N, seed=7, bipartite=True, chunk_size=10_000)


def average_precision(y: np.ndarray, score: np.ndarray) -> float:
    """AP as sklearn computes it: tied scores form one threshold."""
    order = np.argsort(-score, kind="stable")
    y, score = y[order], score[order]
    last = np.r_[np.flatnonzero(np.diff(score)), len(score) - 1]
    tp = np.cumsum(y)[last]
    precision = tp / (last + 1)
    recall = tp / y.sum()
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def test_average_precision_helper_on_hand_values():
    # Scores 3 > 2 = 2 > 1: thresholds give (P, R) = (1, 1/2), (2/3, 1), (1/2, 1).
    y = np.array([1, 1, 0, 0])
    s = np.array([3.0, 2.0, 2.0, 1.0])
    assert average_precision(y, s) == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)


def test_same_seed_same_bytes_for_any_chunk_size(stream):
    other = _collect(events=E, nodes=N, seed=7, edge_feat_dim=4, chunk_size=777)
    assert other.keys() == stream.keys()
    for key in stream:
        assert other[key].dtype == stream[key].dtype
        assert other[key].tobytes() == stream[key].tobytes()


def test_edge_features_do_not_change_the_events(stream):
    plain = _collect(events=E, nodes=N, seed=7, chunk_size=10_000)
    assert "edge_feat" not in plain
    for key in ("src", "dst", "t"):
        np.testing.assert_array_equal(plain[key], stream[key])


def test_chunks_have_requested_size():
    sizes = [len(c["t"]) for c in iter_synth_chunks(events=2_500, nodes=100, chunk_size=1_000)]
    assert sizes == [1_000, 1_000, 500]


def test_different_seeds_differ(stream):
    other = _collect(events=E, nodes=N, seed=8, edge_feat_dim=4, chunk_size=10_000)
    assert np.mean(other["src"] != stream["src"]) > 0.5
    assert np.mean(other["dst"] != stream["dst"]) > 0.5


def test_time_sorted_ids_in_range_no_self_loops(stream):
    assert stream["t"].dtype == np.int64
    assert np.all(np.diff(stream["t"]) >= 0)
    for key in ("src", "dst"):
        assert stream[key].dtype == np.int32
        assert stream[key].min() >= 0 and stream[key].max() < N
    assert not np.any(stream["src"] == stream["dst"])
    assert stream["edge_feat"].shape == (E, 4) and stream["edge_feat"].dtype == np.float32
    assert np.isfinite(stream["edge_feat"]).all()


def test_bipartite_sides(bip_stream):
    n_src = SynthParams(nodes=N, bipartite=True).num_src_nodes
    assert n_src == 800
    assert bip_stream["src"].max() < n_src
    assert bip_stream["dst"].min() >= n_src and bip_stream["dst"].max() < N
    assert "edge_feat" not in bip_stream


def test_heavy_tailed_activity(stream):
    deg = np.bincount(np.concatenate([stream["src"], stream["dst"]]), minlength=N)
    top = np.sort(deg)[::-1][: N // 10]
    assert top.sum() / deg.sum() > 0.4


def _repeat_ratio(src: np.ndarray, dst: np.ndarray) -> float:
    key = src.astype(np.int64) * N + dst
    return 1.0 - len(np.unique(key)) / len(key)


def test_repeated_interactions(stream):
    rng = np.random.default_rng(0)
    uniform = _repeat_ratio(rng.integers(0, N, E), rng.integers(0, N, E))
    ratio = _repeat_ratio(stream["src"], stream["dst"])
    assert ratio > 0.5
    assert ratio > 10 * uniform


def test_community_structure(stream):
    comm = SynthStream(SynthParams(events=E, nodes=N, seed=7, edge_feat_dim=4)).community
    intra = np.mean(comm[stream["src"]] == comm[stream["dst"]])
    # Two random endpoints share a community with probability sum of squared shares.
    chance = np.sum((np.bincount(comm) / N) ** 2)
    assert intra > 0.6
    assert intra > 3 * chance


def test_bursty_inter_event_times(stream):
    gaps = np.diff(stream["t"]).astype(np.float64)
    assert gaps.std() / gaps.mean() > 1.0


def test_edge_features_repeat_with_the_pair(stream):
    key = stream["src"].astype(np.int64) * N + stream["dst"]
    order = np.argsort(key, kind="stable")
    same = key[order][1:] == key[order][:-1]
    feat = stream["edge_feat"][order]
    feat = feat / np.linalg.norm(feat, axis=1, keepdims=True)
    cos_same = np.sum(feat[1:][same] * feat[:-1][same], axis=1).mean()
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, E, 2_000), rng.integers(0, E, 2_000)
    cos_random = np.sum(feat[a] * feat[b], axis=1).mean()
    assert cos_same > 0.5
    assert cos_same > cos_random + 0.3


@pytest.mark.parametrize("bipartite", [False, True])
def test_link_prediction_needs_memory(stream, bip_stream, bipartite):
    """A history scorer beats a memoryless degree scorer on the last 15%.

    For each test event (in order, history updated as events stream past, as a memory
    model's would be): the positive is its true destination, the negative a uniform
    draw from the destinations. History score: occurrences of the candidate among the
    source's last 20 contacts. Degree score: the candidate's degree so far.
    """
    data = bip_stream if bipartite else stream
    src, dst = data["src"], data["dst"]
    cut = int(E * 0.85)
    rng = np.random.default_rng(1)
    cands = np.unique(dst)
    neg = cands[rng.integers(0, len(cands), E - cut)]
    history: dict[int, deque[int]] = {}
    degree = np.zeros(N)
    scores = np.zeros((4, E - cut))  # hist pos, hist neg, degree pos, degree neg
    for i, (u, v) in enumerate(zip(src.tolist(), dst.tolist())):
        if i >= cut:
            h = history.get(u, ())
            j, w = i - cut, int(neg[i - cut])
            scores[:, j] = (sum(x == v for x in h), sum(x == w for x in h), degree[v], degree[w])
        history.setdefault(u, deque(maxlen=20)).append(v)
        history.setdefault(v, deque(maxlen=20)).append(u)
        degree[u] += 1
        degree[v] += 1
    y = np.r_[np.ones(E - cut), np.zeros(E - cut)]
    ap_hist = average_precision(y, np.r_[scores[0], scores[1]])
    ap_degree = average_precision(y, np.r_[scores[2], scores[3]])
    assert ap_hist > 0.8
    assert ap_hist > ap_degree + 0.08


def test_later_nodes_arrive_over_time(stream):
    first_seen = np.full(N, E)
    for key in ("src", "dst"):
        np.minimum.at(first_seen, stream[key], np.arange(E))
    # Ids are in arrival order: the second half's ids show up later on average.
    assert np.median(first_seen[N // 2 :]) > np.median(first_seen[: N // 2])
    cut = int(E * 0.85)
    assert np.mean(first_seen[stream["src"][cut:]] >= cut) > 0.0


def test_state_does_not_grow_with_events():
    st = SynthStream(SynthParams(events=50_000, nodes=500))
    st.block(0)
    size = st.state_nbytes()
    for b in range(1, st.num_blocks):
        st.block(b)
        # Equal until the last, shorter block.
        assert st.state_nbytes() <= size
    assert size < 500 * 8 * 4 + 500 * 40 + 4 * st.params.block * 8


def _peak_bytes(events: int) -> int:
    tracemalloc.start()
    try:
        for _ in iter_synth_chunks(events=events, nodes=500, chunk_size=2_048, block_size=1_024):
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_streaming_peak_memory_is_bounded():
    _peak_bytes(1_000)  # first use allocates one-off caches; keep them out of the comparison
    small, large = _peak_bytes(8_000), _peak_bytes(64_000)
    assert large < 1.25 * small


def test_invalid_parameters_are_rejected():
    with pytest.raises(ConfigError, match="nodes"):
        SynthParams(nodes=1)
    with pytest.raises(ConfigError, match="p_repeat"):
        SynthParams(p_repeat=1.5)
    with pytest.raises(ConfigError, match="chunk_size"):
        next(iter_synth_chunks(events=10, nodes=10, chunk_size=0))
    with pytest.raises(TypeError):
        SynthParams(no_such_knob=1)  # type: ignore[call-arg]


def test_params_key_is_stable_and_sensitive():
    assert SynthParams().key() == SynthParams().key()
    assert SynthParams().key() != SynthParams(seed=1).key()
    assert SynthParams().to_dict()["generator_version"] == synth.GENERATOR_VERSION
    assert (synth.DEFAULT_EVENTS, synth.DEFAULT_NODES) == (100_000, 2_000)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sven data")
    cli.add_synth_parser(parser.add_subparsers(dest="data_command"))
    return parser.parse_args(argv)


def test_cli_parser_defaults():
    args = _parse(["synth"])
    assert (args.events, args.nodes, args.seed, args.edge_feat_dim) == (100_000, 2_000, 0, 0)
    assert args.out is None and not args.bipartite and args.func is cli.run_synth


def test_cli_counts_accept_scientific_notation():
    args = _parse(["synth", "--events", "1e8", "--nodes", "10_000"])
    assert (args.events, args.nodes) == (100_000_000, 10_000)
    with pytest.raises(SystemExit):
        _parse(["synth", "--events", "1.5"])


def test_cli_refuses_existing_out(tmp_path):
    (tmp_path / "x").write_text("taken")
    args = _parse(["synth", "--events", "100", "--nodes", "10", "--out", str(tmp_path)])
    with pytest.raises(SvenError, match="already exists"):
        args.func(args)


def test_generate_writes_the_stream_into_a_store(tmp_path):
    ev = synth.generate(tmp_path / "s", events=5_000, nodes=300, seed=3, edge_feat_dim=2)
    ref = _collect(events=5_000, nodes=300, seed=3, edge_feat_dim=2, chunk_size=5_000)
    for key in ("src", "dst", "t", "edge_feat"):
        np.testing.assert_array_equal(getattr(ev, key), ref[key])
    assert ev.num_events == 5_000 and ev.num_nodes == 300 and not ev.bipartite
    assert ev.meta["source"] == {
        "format": "synth",
        "params": SynthParams(events=5_000, nodes=300, seed=3, edge_feat_dim=2).to_dict(),
    }
    assert ev.meta["sorted_on_ingest"] is False
    np.testing.assert_array_equal(ev.id_map, np.arange(300))
    assert set(ev.meta["split"]["counts"]) == {"train", "val", "test"}


def test_generate_bipartite_store(tmp_path):
    ev = synth.generate(tmp_path / "b", events=3_000, nodes=200, seed=3, bipartite=True)
    assert ev.bipartite
    assert ev.src.max() < ev.meta["num_src_nodes"] <= 160 <= ev.dst.min()


def test_default_dataset_is_generated_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SVEN_CACHE", str(tmp_path / "cache"))
    path = synth.default_dataset()
    assert path.parent == tmp_path / "cache" and (path / "meta.json").is_file()
    assert json.loads((path / "meta.json").read_text())["num_events"] == synth.DEFAULT_EVENTS
    stamp = (path / "meta.json").stat().st_mtime_ns
    assert synth.default_dataset() == path
    assert (path / "meta.json").stat().st_mtime_ns == stamp
    # Only the finished store is left in the cache, no temporary folders.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]


def test_cli_generates_then_reuses_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SVEN_CACHE", str(tmp_path))
    args = _parse(["synth", "--events", "1500", "--nodes", "120", "--seed", "2"])
    assert args.func(args) == 0
    assert "wrote 1,500 events" in capsys.readouterr().out
    assert args.func(args) == 0
    assert "reusing" in capsys.readouterr().out


def test_cached_dataset_keeps_the_copy_of_a_faster_process(tmp_path, monkeypatch):
    params = SynthParams(events=1_000, nodes=50)
    final = tmp_path / synth.cached_name(params)
    real_write = synth.write_synth

    def write_while_another_process_finishes(*args, **kwargs):
        real_write(*args, **kwargs)
        real_write(params, final)  # the other process renames its store first

    monkeypatch.setattr(synth, "write_synth", write_while_another_process_finishes)
    path, made = synth.cached_dataset(params, tmp_path)
    assert (path, made) == (final, False)
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_labels_mark_the_flagged_communities_and_leave_the_events(stream, tmp_path):
    params = SynthParams(events=E, nodes=N, seed=7, edge_feat_dim=4, label_share=0.3)
    gen = SynthStream(params)
    # 10 communities (N // 100): 3 flagged, from a stream of their own.
    assert gen.flagged is not None and gen.flagged.tolist().count(1) == 3
    labelled = _collect(events=E, nodes=N, seed=7, edge_feat_dim=4, label_share=0.3)
    for key in stream:
        np.testing.assert_array_equal(labelled[key], stream[key])
    np.testing.assert_array_equal(labelled["label"], gen.flagged[gen.community[stream["src"]]])
    assert labelled["label"].dtype == np.int64 and 0 < labelled["label"].mean() < 1
    # The store holds them; an unlabelled stream keeps the cache key it had before.
    assert synth.write_synth(params, tmp_path / "s").meta["has_label"] is True
    assert "label_share" not in SynthParams().to_dict()
    assert SynthParams(label_share=0.3).key() != SynthParams().key()


def test_labels_need_two_communities_and_never_flag_all():
    with pytest.raises(ConfigError, match="at least 2 communities"):
        SynthParams(nodes=100, label_share=0.5)  # one community
    with pytest.raises(ConfigError, match="label_share"):
        SynthParams(label_share=1.0)
    # Two communities and a share that rounds to both: one is left unflagged.
    gen = SynthStream(SynthParams(nodes=200, label_share=0.9))
    assert gen.flagged is not None and sorted(gen.flagged.tolist()) == [0, 1]
