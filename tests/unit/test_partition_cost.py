"""The communication cost model on hand-built graphs, with every count worked by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sven.partition.access import Access, touches
from sven.partition.cost import SampledCost, comm_cost, comm_costs
from sven.partition.report import CostReport, RowBytes, row_bytes
from sven.partition.scaling import exchange_bytes

# Four nodes, four events, two ranks, batches of two events:
#
#   e0: 0 -> 1 at t=1   rank 0        owner = [0, 0, 1, 1]
#   e1: 2 -> 3 at t=2   rank 1        batch 0 = {e0, e1}, batch 1 = {e2, e3}
#   e2: 0 -> 2 at t=3   rank 0
#   e3: 1 -> 3 at t=4   rank 1
#
# The only negative candidate is node 3, so every event's negative is 3.
# T-CSR (per node, by time): 0: (1@1, 2@3)  1: (0@1, 3@4)  2: (3@2, 0@3)  3: (2@2, 1@4).
# Recent k=2 neighbours strictly before the root time:
#   batch 0: nothing for any root (no node has an event before t=1, or before t=2
#            except at t=2 itself, which is not strictly before).
#   batch 1, rank 0 (t=3): 0 -> [1], 2 -> [3], negative 3 -> [2]
#   batch 1, rank 1 (t=4): 1 -> [0], 3 -> [2], negative 3 -> [2]
SRC = np.array([0, 2, 0, 1])
DST = np.array([1, 3, 2, 3])
T = np.array([1, 2, 3, 4])
OWNER = np.array([0, 0, 1, 1])
ASSIGN = np.array([0, 1, 0, 1])
WIDTHS = RowBytes(read=100, write=50, id=8)


def _cost(**kw) -> CostReport:
    args = dict(batch_size=2, k=2, candidates=np.array([3]), widths=WIDTHS)
    args.update(kw)
    return comm_cost(SRC, DST, T, OWNER, ASSIGN, **args)


def test_hand_built_reads_writes_and_naive_volume():
    rep = _cost()
    # Rank 0. Batch 0 reads {0, 1, 3}: 3 is remote. Batch 1 reads roots {0, 2, 3} and
    # neighbours {1, 3, 2}: remote 2 and 3 (distinct), while the naive scheme fetches
    # root 2, root 3, neighbour 3, neighbour 2 = 4 times. Writes {0, 2}: 2 is remote.
    # Rank 1. Batch 0 reads {2, 3}: all local. Batch 1 reads roots {1, 3, 3} and
    # neighbours {0, 2, 2}: remote 1 and 0. Writes {1, 3}: 1 is remote.
    np.testing.assert_array_equal(rep.events, [2, 2])
    np.testing.assert_array_equal(rep.vertices, [2, 2])
    np.testing.assert_array_equal(rep.remote_reads, [1 + 2, 0 + 2])
    np.testing.assert_array_equal(rep.naive_reads, [1 + 4, 0 + 2])
    np.testing.assert_array_equal(rep.remote_writes, [1, 1])
    np.testing.assert_array_equal(rep.naive_writes, [1, 1])
    # Owner side: rank 1 serves 3 (batch 0), 2 and 3 (batch 1); rank 0 serves 1 and 0.
    np.testing.assert_array_equal(rep.served_reads, [2, 3])
    np.testing.assert_array_equal(rep.received_writes, [1, 1])
    # Per-batch maxima: events 1 + 1; comm max(1, 0) + max(2 + 1, 2 + 1) = 4.
    assert rep.batch_max_events == 2
    assert rep.batch_max_comm == 4
    assert rep.num_batches == 2
    # Bytes: reads cost id + row (108), writes id + row (58).
    np.testing.assert_array_equal(rep.comm_bytes, [3 * 108 + 1 * 58, 2 * 108 + 1 * 58])
    np.testing.assert_array_equal(rep.naive_bytes, [5 * 108 + 58, 2 * 108 + 58])
    # Sent by rank 0: 3 read ids, 2 served rows, 1 write (id + row).
    np.testing.assert_array_equal(rep.bytes_sent, [3 * 8 + 2 * 100 + 58, 2 * 8 + 3 * 100 + 58])
    np.testing.assert_array_equal(rep.bytes_recv, [2 * 8 + 3 * 100 + 58, 3 * 8 + 2 * 100 + 58])
    assert rep.bytes_sent.sum() == rep.bytes_recv.sum()


def test_summary_max_mean_imbalance():
    s = _cost().summary()
    reads = s["metrics"]["remote_reads"]
    assert (reads["max"], reads["mean"], reads["total"]) == (3, 2.5, 5)
    assert reads["imbalance"] == pytest.approx(3 / 2.5)
    assert s["metrics"]["events"]["imbalance"] == 1.0
    # Events on the critical path: 2 of a mean 4 / 2 = 2 per rank.
    assert s["batch_event_imbalance"] == 1.0
    assert s["redundancy_saving"] == pytest.approx(1 - (382 + 274) / (598 + 274))


def test_without_neighbours_only_roots_count():
    rep = _cost(k=0)
    # Rank 0: batch 0 {0, 1, 3} -> 3; batch 1 {0, 2, 3} -> 2, 3. Rank 1: batch 0 {2, 3}
    # -> none; batch 1 {1, 3} -> 1 (the negative 3 twice is one read).
    np.testing.assert_array_equal(rep.remote_reads, [3, 1])
    np.testing.assert_array_equal(rep.naive_reads, [3, 1])
    np.testing.assert_array_equal(rep.remote_writes, [1, 1])


def test_delivery_to_neighbours_of_positive_roots():
    # TGN's reads plus mail to the neighbours of positive roots.
    rep = _cost(access=Access("all", True, True))
    # Batch 1 only (batch 0 has no neighbours). Rank 0 writes {0, 2} and their
    # neighbours {1, 3}: remote 2, 3. Rank 1 writes {1, 3} and {0, 2}: remote 1, 0.
    # The negative's neighbours are never written.
    np.testing.assert_array_equal(rep.remote_writes, [2, 2])
    np.testing.assert_array_equal(rep.naive_writes, [2, 2])
    np.testing.assert_array_equal(rep.remote_reads, [3, 2])


def test_dyrep_reads_neighbours_of_positive_roots_only():
    rep = _cost(access=Access.of("dyrep"))
    # As TGN, but the negative 3 is not sampled: rank 0 no longer reads its neighbour
    # 2 in batch 1 (one naive read fewer; 2 is read as a root anyway). Rank 1's
    # negative neighbour 2 was local.
    np.testing.assert_array_equal(rep.remote_reads, [1 + 2, 0 + 2])
    np.testing.assert_array_equal(rep.naive_reads, [1 + 3, 0 + 2])
    np.testing.assert_array_equal(rep.remote_writes, [1, 1])
    np.testing.assert_array_equal(rep.naive_writes, [1, 1])
    assert rep.summary()["access"] == {
        "sample_roots": "positive",
        "read_neighbors": True,
        "deliver_to_neighbors": False,
    }


def test_apan_writes_neighbours_without_reading_them():
    rep = _cost(access=Access.of("apan"))
    # Reads are the roots alone: rank 0 {3} then {2, 3}; rank 1 nothing then {1}.
    # Writes: rank 0 batch 1 {0, 2} + neighbours {1, 3} -> remote 2, 3; rank 1
    # {1, 3} + {0, 2} -> remote 1, 0.
    np.testing.assert_array_equal(rep.remote_reads, [3, 1])
    np.testing.assert_array_equal(rep.naive_reads, [3, 1])
    np.testing.assert_array_equal(rep.remote_writes, [2, 2])
    np.testing.assert_array_equal(rep.naive_writes, [2, 2])
    np.testing.assert_array_equal(rep.served_reads, [1, 3])
    np.testing.assert_array_equal(rep.received_writes, [2, 2])


def test_apan_mails_a_neighbour_sampled_twice_once():
    # Event e2 (0 -> 2, rank 0): the sampler hands each root the list [1, 1, 3] with its
    # last slot masked, so the sources' and destinations' lists repeat node 1.
    def twice(nodes, times, keys):
        nbr = torch.tensor([[1, 1, 3]]).expand(nodes.shape[0], 3)
        return nbr, torch.tensor([[True, True, False]]).expand(nodes.shape[0], 3)

    tch = touches(
        SRC, DST, T, np.array([2]), candidates=torch.tensor([3]), sampler=twice, k=3,
        num_neg=1, seed=0, epoch=0, access=Access.of("apan"),
    )  # fmt: skip
    # Roots 0, 2 (written) and 3 (negative, not sampled); node 1 is in four valid slots,
    # two per positive root, and is written once per root.
    np.testing.assert_array_equal(tch.node, [0, 2, 3, 1, 1, 1, 1])
    np.testing.assert_array_equal(tch.read, [True, True, True, False, False, False, False])
    np.testing.assert_array_equal(tch.write, [True, True, False, True, False, True, False])


def test_jodie_samples_nothing_whatever_k():
    np.testing.assert_array_equal(
        _cost(access=Access.of("jodie")).remote_reads, _cost(k=0).remote_reads
    )


def test_access_of_models_and_bad_values():
    assert Access.of("tgn") == Access()
    assert Access.of("JODIE") == Access("none", False, False)
    with pytest.raises(ValueError, match="unknown model"):
        Access.of("tgat")
    with pytest.raises(ValueError, match="sample_roots"):
        Access("some")


def test_single_rank_has_no_traffic():
    rep = comm_cost(SRC, DST, T, np.zeros(4, int), np.zeros(4, int), batch_size=2, k=2)
    assert rep.comm_bytes.sum() == 0 and rep.naive_bytes.sum() == 0
    np.testing.assert_array_equal(rep.events, [4])


def test_batch_boundaries_change_distinct_counts():
    # One batch of all four events: rank 0 reads 3 (batch 0 root, batch 1 root and
    # neighbour) once and 2 once; rank 1 reads 1 and 0 once.
    rep = _cost(batch_size=4)
    np.testing.assert_array_equal(rep.remote_reads, [2, 2])
    np.testing.assert_array_equal(rep.naive_reads, [5, 2])
    assert rep.num_batches == 1


def test_epoch_range_and_chunking_do_not_change_counts():
    full = _cost()
    chunked = _cost(chunk_events=1)
    for name in ("remote_reads", "remote_writes", "naive_reads", "served_reads"):
        np.testing.assert_array_equal(getattr(full, name), getattr(chunked, name))
    # The epoch [2, 4) is batch 1 alone; a short assign covers just the epoch.
    part = _cost(start=2, stop=4)
    np.testing.assert_array_equal(part.remote_reads, [2, 2])
    short = comm_cost(
        SRC, DST, T, OWNER, ASSIGN[2:], batch_size=2, k=2, start=2, stop=4,
        candidates=np.array([3]), widths=WIDTHS,
    )  # fmt: skip
    np.testing.assert_array_equal(short.remote_reads, part.remote_reads)


def test_negatives_follow_seed_epoch_and_event_index():
    import torch

    from sven.pipeline.negatives import sample_negatives

    cand = np.array([1, 3])
    for seed, epoch in ((0, 0), (5, 2)):
        rep = comm_cost(
            SRC, DST, T, OWNER, ASSIGN, batch_size=2, k=0, num_neg=3, seed=seed, epoch=epoch,
            candidates=cand,
        )  # fmt: skip
        neg = sample_negatives(seed, epoch, torch.arange(4), torch.from_numpy(cand), 3).numpy()
        # Without neighbours every root occurrence on a rank that does not own it is
        # one naive read: src, dst and the three negatives of each event.
        roots = np.concatenate([SRC[:, None], DST[:, None], neg], axis=1)
        remote = OWNER[roots] != ASSIGN[:, None]
        expect = np.bincount(ASSIGN, weights=remote.sum(axis=1), minlength=2)
        np.testing.assert_array_equal(rep.naive_reads, expect)


@pytest.mark.parametrize("model", ["tgn", "jodie", "dyrep", "apan"])
def test_sampled_cost_on_all_batches_equals_full_replay(model: str):
    rng = np.random.default_rng(0)
    n, e = 30, 400
    src = rng.integers(0, n, e)
    dst = rng.integers(0, n, e)
    t = np.sort(rng.integers(0, 100, e))
    owner = rng.integers(0, 3, n)
    assign = np.where(rng.random(e) < 0.5, owner[src], owner[dst])
    acc = Access.of(model)
    kw = dict(batch_size=50, k=3, stop=300, access=acc)
    full = comm_cost(src, dst, t, owner, assign, parts=3, **kw)
    sampled = SampledCost(src, dst, t, n, max_events=10**6, **kw)
    assert sampled.fraction == 1.0
    np.testing.assert_array_equal(sampled.comm(owner, assign[sampled.events], 3), full.comm_bytes)
    if model != "tgn":
        # The access pattern matters on a random graph: TGN's cost differs.
        tgn = comm_cost(src, dst, t, owner, assign, parts=3, batch_size=50, k=3, stop=300)
        assert not np.array_equal(tgn.comm_bytes, full.comm_bytes)
    # A sample of every other batch: whole batches, evenly spread.
    half = SampledCost(src, dst, t, n, batch_size=50, stop=300, k=3, max_events=150)
    assert half.num_batches == 3 and half.events.shape[0] == 150
    assert set(np.unique(half.events // 50).tolist()) == {0, 2, 5}


def test_row_bytes_defaults():
    w = row_bytes(100)
    # Memory 100 floats + time; mail 300 floats + time.
    assert (w.read, w.write, w.id) == (408 + 1208, 408 + 1208, 8)
    assert row_bytes(10, 20, mailbox_size=2).read == 48 + 2 * 88


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        comm_cost(SRC, DST, T, OWNER, ASSIGN, batch_size=0)
    with pytest.raises(ValueError, match="assign"):
        comm_cost(SRC, DST, T, OWNER, ASSIGN[:3], batch_size=2)


def test_no_partition_gives_no_report():
    assert comm_costs(SRC, DST, T, [], batch_size=2, k=2) == []


def test_many_partitions_in_one_replay_match_one_at_a_time():
    from sven.partition.cost import comm_costs

    other = (np.array([1, 0, 0, 1]), np.array([0, 0, 1, 1]), 2)
    reports = comm_costs(
        SRC, DST, T, [(OWNER, ASSIGN, 2), other], batch_size=2, k=2, candidates=np.array([3])
    )
    for rep, (owner, assign, parts) in zip(reports, [(OWNER, ASSIGN, 2), other]):
        one = comm_cost(
            SRC, DST, T, owner, assign, batch_size=2, k=2, parts=parts, candidates=np.array([3])
        )
        assert rep.to_dict() == one.to_dict()


def test_per_batch_counts_by_hand_and_summing_to_the_epoch():
    rep = _cost(per_batch=True)
    b = rep.batches
    # Batch 0: rank 0 reads 3 remotely, served by rank 1; no remote write (0 and 1 are
    # rank 0's, 2 and 3 rank 1's). Batch 1: as in the hand-built test above.
    np.testing.assert_array_equal(b.events, [[1, 1], [1, 1]])
    np.testing.assert_array_equal(b.remote_reads, [[1, 0], [2, 2]])
    np.testing.assert_array_equal(b.remote_writes, [[0, 0], [1, 1]])
    np.testing.assert_array_equal(b.served_reads, [[0, 1], [2, 2]])
    np.testing.assert_array_equal(b.received_writes, [[0, 0], [1, 1]])
    # Sent = reads * 8 + served * 100 + writes * 58: batch 0 (8, 100), batch 1 (274,
    # 274). Received = served * 8 + reads * 100 + received * 58: (100, 8), (274, 274).
    # Each epoch total is 656 bytes, 328 per rank; the slowest ranks sum to 374.
    assert rep.batch_max_sent == 374 and rep.batch_max_recv == 374
    summ = rep.summary()
    assert summ["batch_sent_imbalance"] == summ["batch_recv_imbalance"] == 374 / 328
    assert _cost().batches is None


@pytest.mark.parametrize("model", ["tgn", "apan"])
def test_per_batch_counts_sum_to_the_epoch_totals(model: str):
    rng = np.random.default_rng(3)
    n, e, parts = 30, 400, 3
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    t = np.sort(rng.integers(0, 1000, e))
    owner, assign = rng.integers(0, parts, n), rng.integers(0, parts, e)
    rep = comm_cost(
        src, dst, t, owner, assign, batch_size=37, k=3, parts=parts, chunk_events=100,
        access=Access.of(model), per_batch=True,
    )  # fmt: skip
    b = rep.batches
    assert b.events.shape == (rep.num_batches, parts) == (11, 3)
    for name in ("events", "remote_reads", "remote_writes", "served_reads", "received_writes"):
        np.testing.assert_array_equal(getattr(b, name).sum(axis=0), getattr(rep, name))
    assert int(b.events.max(axis=1).sum()) == rep.batch_max_events
    comm = b.remote_reads + b.remote_writes
    assert int(comm.max(axis=1).sum()) == rep.batch_max_comm
    # Per-batch bytes: the slowest rank's sent (received) bytes of each batch, summed,
    # over the mean rank's epoch bytes.
    sent, recv = exchange_bytes(b, rep.widths)
    np.testing.assert_array_equal(sent.sum(axis=0), rep.bytes_sent)
    np.testing.assert_array_equal(recv.sum(axis=0), rep.bytes_recv)
    summ = rep.summary()
    want_sent = sent.max(axis=1).sum() * parts / rep.bytes_sent.sum()
    want_recv = recv.max(axis=1).sum() * parts / rep.bytes_recv.sum()
    assert summ["batch_sent_imbalance"] == pytest.approx(want_sent, rel=1e-12)
    assert summ["batch_recv_imbalance"] == pytest.approx(want_recv, rel=1e-12)
    assert summ["batch_sent_imbalance"] > 1.0


def test_partitions_with_batch_sizes_of_their_own_match_separate_replays():
    rng = np.random.default_rng(5)
    n, e = 25, 300
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    t = np.sort(rng.integers(0, 500, e))
    parts = [(rng.integers(0, p, n), rng.integers(0, p, e), p, 20 * p) for p in (1, 2, 4)]
    both = comm_costs(
        src, dst, t, parts, batch_size=7, k=3, chunk_events=50, per_batch=True, stop=290
    )
    for (owner, assign, p, b), rep in zip(parts, both):
        alone = comm_cost(
            src, dst, t, owner, assign, batch_size=b, k=3, parts=p, per_batch=True, stop=290
        )
        assert (rep.batch_size, rep.num_batches) == (b, alone.num_batches)
        assert rep.summary() == alone.summary()
        for name in ("events", "remote_reads", "remote_writes", "served_reads"):
            np.testing.assert_array_equal(getattr(rep.batches, name), getattr(alone.batches, name))


@pytest.mark.parametrize("model", ["tgn", "jodie", "dyrep", "apan"])
def test_touches_are_what_the_batch_builder_reads_and_writes(model: str):
    # The replay and make_batch share the root layout: the same roots, the same
    # sampled roots and keys (uniform draws), the same written nodes.
    from sven.models.apan import first_occurrences
    from sven.pipeline.batch import make_batch
    from sven.pipeline.negatives import sample_negatives
    from sven.pipeline.sampler import TCSR, TemporalSampler

    rng = np.random.default_rng(7)
    n, e, k, num_neg, seed = 20, 120, 3, 2, 1
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    t = np.sort(rng.integers(0, 500, e))
    access = Access.of(model)
    sampler = TemporalSampler(TCSR.from_events(src, dst, t, n, "cpu"), [k], "uniform")

    def neighbours(nodes, times, keys):
        block = sampler.sample(nodes, times, keys=keys)[0]
        return block.nbr, block.mask

    cand = torch.arange(n)
    idx = np.arange(40, 80)
    tch = touches(
        src, dst, t, idx, candidates=cand, sampler=neighbours, k=k, num_neg=num_neg,
        seed=seed, epoch=0, access=access,
    )  # fmt: skip
    index = torch.from_numpy(idx)
    batch = make_batch(
        index, torch.from_numpy(src[idx]), torch.from_numpy(dst[idx]), torch.from_numpy(t[idx]),
        sample_negatives(seed, 0, index, cand, num_neg),
        sampler=sampler if access.sample_roots != "none" else None,
        sample_roots=access.sample_roots, read_neighbors=access.read_neighbors,
        rng=(seed, 0, 40),
    )  # fmt: skip
    block, b = batch.block, batch.size
    read = [batch.roots]
    written = [batch.src, batch.dst]
    if block is not None and access.read_neighbors:
        read.append(block.nbr[block.mask])
    if block is not None and access.deliver_to_neighbors:
        # The model mails a node once per root, however often that root sampled it.
        first = first_occurrences(block.nbr[: 2 * b], block.mask[: 2 * b])
        written.append(block.nbr[: 2 * b][first])
    np.testing.assert_array_equal(np.sort(tch.node[tch.read]), np.sort(torch.cat(read).numpy()))
    np.testing.assert_array_equal(np.sort(tch.node[tch.write]), np.sort(torch.cat(written).numpy()))
    assert (block is None) == (model == "jodie")
