"""The shared real datasets convert with their published counts (skipped where absent)."""

from __future__ import annotations

import numpy as np

from sven.datasets.info import describe
from sven.datasets.readers import convert, detect_format
from sven.datasets.store import TemporalEvents

# sha256 of the shared files, from ../shared/data/README.md.
SHA256 = {
    "collegemsg/CollegeMsg.txt.gz": (
        "42b894ca71e1963fcfd9682fd9ac5efaeca4ef9a1d472f49891788ef662a5509"
    ),
    "wikipedia/wikipedia.csv.gz": (
        "917dfab40b9668412bc6a27ef694a0e95af4debf77cf1d71d2bbdd64fd3442cf"
    ),
    "bitcoin-otc/soc-sign-bitcoinotc.csv.gz": (
        "4ac08248072f2d5a3f7f79c796fa4610d16249fa9ce55015f2a0c0fc06b5522d"
    ),
}


def check_common(ev, rel: str) -> None:
    assert ev.meta["source"]["sha256"] == SHA256[rel]
    assert np.all(np.diff(ev.t) >= 0)
    assert int(ev.src.max()) < ev.num_nodes and int(ev.dst.max()) < ev.num_nodes
    # Every node occurs (ids were compacted or already contiguous).
    degree = np.bincount(ev.src, minlength=ev.num_nodes) + np.bincount(
        ev.dst, minlength=ev.num_nodes
    )
    assert (degree > 0).all()
    counts = ev.meta["split"]["counts"]
    assert sum(counts.values()) == ev.num_events
    val_time, test_time = np.quantile(ev.t, [0.70, 0.85])
    assert counts["train"] == int((ev.t <= val_time).sum())
    assert counts["test"] == int((ev.t > test_time).sum())
    TemporalEvents.load(ev.path, verify=True)


def test_collegemsg(shared_data, tmp_path):
    rel = "collegemsg/CollegeMsg.txt.gz"
    assert detect_format(shared_data / rel) == "snap"
    ev = convert(shared_data / rel, tmp_path / "s")
    assert (ev.num_events, ev.num_nodes) == (59_835, 1_899)
    assert not ev.bipartite and ev.edge_feat is None and ev.label is None
    assert ev.meta["sorted_on_ingest"] is False
    assert sorted(ev.id_map.tolist()) == list(range(1, 1900))  # raw ids 1..1899
    assert ev.t[-1] - ev.t[0] == 16_736_181  # 193.7 days
    check_common(ev, rel)


def test_wikipedia(shared_data, tmp_path):
    rel = "wikipedia/wikipedia.csv.gz"
    assert detect_format(shared_data / rel) == "jodie"
    ev = convert(shared_data / rel, tmp_path / "s")
    assert (ev.num_events, ev.num_nodes) == (157_474, 9_227)
    assert ev.bipartite and ev.num_src_nodes == 8_227
    assert int(ev.label.sum()) == 217
    # Already offset in the file (users 0..8226, pages 8227..9226): kept as they are.
    np.testing.assert_array_equal(ev.id_map, np.arange(9_227))
    assert int(ev.src.max()) < 8_227 <= int(ev.dst.min())
    check_common(ev, rel)
    info = describe(ev)
    assert info["splits"]["train"]["events"] == 110_232  # DyGLib's Wikipedia train split


def test_bitcoin_otc(shared_data, tmp_path):
    rel = "bitcoin-otc/soc-sign-bitcoinotc.csv.gz"
    assert detect_format(shared_data / rel) == "snap-signed"
    ev = convert(shared_data / rel, tmp_path / "s")
    assert (ev.num_events, ev.num_nodes) == (35_592, 5_881)
    assert ev.t.dtype == np.float64
    assert ev.edge_feat.shape == (35_592, 1)
    assert ev.edge_feat.min() == -10 and ev.edge_feat.max() == 10
    assert int(ev.id_map.max()) == 6_005  # raw ids 1..6005 with gaps, compacted
    check_common(ev, rel)
