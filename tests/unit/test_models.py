"""Models, memory and write-back on tiny hand-built graphs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sven import kernels
from sven.config import ModelConfig
from sven.models import MODELS, MemoryState, build_model, model_from_config, time_gap_scale
from sven.pipeline.batch import last_occurrence, make_batch
from sven.pipeline.sampler import TCSR, TemporalSampler

# 6 events on 5 nodes; node 4 never appears in an event.
SRC = torch.tensor([0, 1, 0, 2, 1, 3])
DST = torch.tensor([1, 2, 2, 3, 0, 0])
T = torch.tensor([1.0, 2.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
N = 5


def _model(name: str, edge_dim: int = 0, dtype: torch.dtype = torch.float64):
    kw = dict(memory_dim=4, time_dim=3, embed_dim=4, edge_dim=edge_dim)
    if name in ("tgn", "apan"):
        kw.update(num_heads=2, dropout=0.0)
    if name == "apan":
        kw["mailbox_size"] = 3
    return build_model(name, **kw).to(dtype)


def _batch(model, lo: int, hi: int, neg: torch.Tensor, edge_feat=None):
    sampler = None
    if model.sample_roots != "none":
        sampler = TemporalSampler(TCSR.from_events(SRC, DST, T, N), [2], "recent")
    idx = torch.arange(lo, hi)
    return make_batch(
        idx,
        SRC[lo:hi],
        DST[lo:hi],
        T[lo:hi],
        neg,
        edge_feat_table=edge_feat,
        sampler=sampler,
        sample_roots=model.sample_roots,
        read_neighbors=model.read_neighbors,
    )


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("edge_dim", [0, 2])
def test_forward_shapes(name: str, edge_dim: int) -> None:
    torch.manual_seed(0)
    model = _model(name, edge_dim)
    mem = MemoryState(N, 4, model.mail_dim, model.mailbox_size, dtype=torch.float64)
    ef = torch.randn(6, edge_dim, dtype=torch.float64) if edge_dim else None
    for lo, hi in [(0, 3), (3, 6)]:
        neg = torch.tensor([[4, 3], [4, 2], [1, 4]])[: hi - lo]
        batch = _batch(model, lo, hi, neg, ef)
        out = model(batch, mem.gather(batch.nodes))
        assert out.pos.shape == (3,)
        assert out.neg.shape == (3, 2)
        assert torch.isfinite(out.pos).all() and torch.isfinite(out.neg).all()
        mem.commit(out.update)
    assert mem.mail_valid[:, 0].tolist() == [True, True, True, True, False]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradcheck_float64(name: str) -> None:
    """Backward through updater, embedding and decoder, w.r.t. the memory read."""
    torch.manual_seed(1)
    model = _model(name)
    mem = MemoryState(N, 4, model.mail_dim, model.mailbox_size, dtype=torch.float64)
    # Give every node a mail and a memory so every path is active.
    mem.memory.normal_()
    mem.mail.normal_()
    mem.mail_valid.fill_(True)
    mem.mail_ts.fill_(0.5)
    batch = _batch(model, 3, 6, torch.tensor([[4], [2], [1]]))
    rows = mem.gather(batch.nodes)

    def f(memory: torch.Tensor, mail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows.memory, rows.mail = memory, mail
        out = model(batch, rows)
        return out.pos, out.neg

    m = rows.memory.clone().requires_grad_(True)
    ml = rows.mail.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (m, ml), eps=1e-6, atol=1e-5)
    # Parameters get gradients too.
    out = model(batch, mem.gather(batch.nodes))
    (out.pos.sum() - out.neg.sum()).backward()
    updater = model.mlp if name == "apan" else model.updater.cell
    assert updater.weight.grad is not None if name == "apan" else updater.weight_ih.grad is not None
    assert model.decoder.lin_out.weight.grad.abs().sum() > 0


def test_write_back_keeps_last_event_and_negatives_write_nothing() -> None:
    model = _model("jodie")
    mem = MemoryState(N, 4, model.mail_dim, 1, dtype=torch.float64)
    # Events 0..3: node 0 at events 0 (src) and 2 (src); node 2 at 1 (dst), 2 (dst), 3 (src).
    batch = _batch(model, 0, 4, torch.tensor([[4], [4], [4], [4]]))
    out = model(batch, mem.gather(batch.nodes))
    up = out.update
    assert up.nodes.tolist() == [0, 1, 2, 3]  # node 4 (only a negative) writes nothing
    assert up.mail_nodes.tolist() == [0, 1, 2, 3]
    # Keys are 4 * event index + side (0 src, 1 dst): the last event of each node.
    assert up.mail_key.tolist() == [4 * 2 + 0, 4 * 1 + 0, 4 * 3 + 0, 4 * 3 + 1]
    assert up.mail_ts.tolist() == [2.0, 2.0, 3.0, 3.0]
    # Memory is all zero and no node had mail, so mails are [0, 0] (no edge features).
    assert torch.equal(up.mail, torch.zeros(4, model.mail_dim, dtype=torch.float64))
    mem.commit(up)
    assert mem.mail_valid[:, 0].tolist() == [True, True, True, True, False]
    assert mem.mail_ts[:, 0].tolist() == [2.0, 2.0, 3.0, 3.0, 0.0]


def test_write_back_mail_content_uses_current_memory() -> None:
    model = _model("tgn")
    mem = MemoryState(N, 4, model.mail_dim, 1, dtype=torch.float64)
    mem.memory = torch.arange(N * 4, dtype=torch.float64).view(N, 4)
    batch = _batch(model, 5, 6, torch.tensor([[4]]))  # event 5: 3 -> 0 at t=5
    out = model(batch, mem.gather(batch.nodes))
    up = out.update
    assert up.mail_nodes.tolist() == [0, 3]
    # No pending mail: current memory == stored memory; mail = [own, other].
    assert torch.equal(up.mail[0], torch.cat([mem.memory[0], mem.memory[3]]))
    assert torch.equal(up.mail[1], torch.cat([mem.memory[3], mem.memory[0]]))
    assert torch.equal(up.memory, mem.memory[[0, 3]])


def test_apan_delivers_mail_to_neighbours_and_queues() -> None:
    model = _model("apan")
    mem = MemoryState(N, 4, model.mail_dim, 3, dtype=torch.float64)
    # Event 4 (1 -> 0, t=4): neighbours strictly before t=4 of 1 are {2 (t=2), 0 (t=1)},
    # of 0 are {2 (t=2), 1 (t=1)}; both endpoints receive their own side's mail.
    batch = _batch(model, 4, 5, torch.tensor([[4]]))
    out = model(batch, mem.gather(batch.nodes))
    assert out.update.mail_nodes.tolist() == [0, 1, 2]
    assert out.update.nodes.tolist() == [0, 1]
    mem.commit(out.update)
    mem.commit(out.update)
    assert mem.mail_valid[:3].tolist() == [[True, True, False]] * 3


def test_first_occurrences_keeps_one_slot_per_node_and_row() -> None:
    """Repeats of a node within a row are dropped, the first kept; invalid slots never
    count as an earlier occurrence (their ids may repeat a valid one)."""
    from sven.models.apan import first_occurrences

    nbr = torch.tensor([[3, 1, 3, 3], [2, 2, 5, 2], [7, 7, 7, 7]])
    mask = torch.tensor(
        [[True, True, True, False], [False, True, True, True], [False, False, False, False]]
    )
    assert first_occurrences(nbr, mask).tolist() == [
        [True, True, False, False],
        [False, True, True, False],
        [False, False, False, False],
    ]


def test_apan_write_back_candidates_have_one_key_per_node() -> None:
    """Node 2 sampled twice for event 3's destination side (0 met 2 twice, at t=1 and
    t=2): the dense update still offers each node at most one candidate per key, the
    write-back's contract (a tie would make the Triton commit shift a queue twice)."""
    model = _model("apan")
    mem = MemoryState(N, 4, model.mail_dim, 3, dtype=torch.float64)
    src = torch.tensor([0, 2, 0, 3])
    dst = torch.tensor([2, 0, 1, 0])
    t = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    sampler = TemporalSampler(TCSR.from_events(src, dst, t, N), [3], "recent")
    batch = make_batch(
        torch.arange(3, 4), src[3:], dst[3:], t[3:], torch.tensor([[4]]),
        sampler=sampler, sample_roots=model.sample_roots,
        read_neighbors=model.read_neighbors,
    )  # fmt: skip
    nbr_of_0 = batch.block.nbr[1][batch.block.mask[1]].tolist()
    assert sorted(nbr_of_0) == [1, 2, 2]
    up = model(batch, mem.gather(batch.nodes)).dense
    live = up.mail_key >= 0
    pairs = list(zip(up.mail_nodes[live].tolist(), up.mail_key[live].tolist()))
    assert len(pairs) == len(set(pairs))
    assert sorted(up.mail_nodes[live].tolist()) == [0, 1, 2, 3]


def _apan_scores_at(t: float, mail_ts: torch.Tensor) -> torch.Tensor:
    """APAN's logits of event 5 (3 -> 0) against negative 4, moved to time ``t``, with
    every node's memory and mailbox set alike except for the mails' times ``mail_ts`` (N,).
    """
    torch.manual_seed(3)
    model = _model("apan")
    mem = MemoryState(N, 4, model.mail_dim, 3, dtype=torch.float64)
    mem.memory[:] = torch.randn(4, dtype=torch.float64)
    mem.mail[:] = torch.randn(3, model.mail_dim, dtype=torch.float64)
    mem.mail_valid.fill_(True)
    mem.mail_ts[:] = mail_ts[:, None] - torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    mem.last_update[:] = mail_ts - 2.0
    batch = _batch(model, 5, 6, torch.tensor([[4]]))
    batch.t = torch.full_like(batch.t, t)
    batch.root_t = torch.full_like(batch.root_t, t)
    out = model(batch, mem.gather(batch.nodes))
    return torch.cat([out.pos, out.neg[:, 0]])


def test_apan_tells_a_silent_node_from_an_active_one() -> None:
    """Regression (the CollegeMsg val/test gap): APAN's scores ignored the read time.

    Nodes 0, 3 and 4 hold the same memory and the same mails; only when the mails came
    differs. Before the fix the embedding was a function of the stored state and of
    the mails' ages relative to the newest mail, so a node silent since t=1 scored
    exactly like one whose mail came at t=9, and nothing changed as time passed.
    """
    recent = torch.full((N,), 9.0, dtype=torch.float64)
    stale = recent.clone()
    stale[4] = 1.0  # the negative has been silent for 9 time units at t=10
    same = _apan_scores_at(10.0, recent)
    # All three nodes alike: the positive pair and the negative pair score the same.
    assert torch.allclose(same[0], same[1])
    differ = _apan_scores_at(10.0, stale)
    assert not torch.allclose(differ[1], same[1])
    assert torch.equal(differ[0], same[0])  # the positive pair is untouched
    # Reading the same state later changes the scores (the silence grows).
    later = _apan_scores_at(50.0, recent)
    assert not torch.allclose(later, same)


def test_apan_projects_by_the_nodes_own_silence_not_its_newest_mail() -> None:
    """Regression (APAN under TGN on CollegeMsg): the projection's dt was the age of the
    newest mail, which a neighbour's event refreshes, so a node silent for a long time
    looked active. TGL projects by the time since the node's memory was last written
    (its own last event), and the write-back records the event's time for that.
    """
    torch.manual_seed(5)
    model = _model("apan")
    mem = MemoryState(N, 4, model.mail_dim, 3, dtype=torch.float64)
    mem.memory[:] = torch.randn(N, 4, dtype=torch.float64)
    mem.mail[:] = torch.randn(N, 3, model.mail_dim, dtype=torch.float64)
    mem.mail_valid[:, 0] = True
    mem.mail_ts[:, 0] = 4.5  # every node's newest mail: a neighbour's event at t=4.5
    mem.last_update[:] = torch.tensor([1.0, 2.0, 0.5, 3.0, 0.0], dtype=torch.float64)
    with torch.no_grad():
        model.time_proj.weight.copy_(torch.linspace(0.1, 0.4, 4, dtype=torch.float64)[:, None])
    seen: list[torch.Tensor] = []
    score = model.decoder.batch
    # The scorer's input, the batch layout [src, dst, neg]: one event, one negative.
    model.decoder.batch = lambda h, b: (seen.append(h), score(h, b))[1]
    # Event 5 (3 -> 0, t=5) against negative 4.
    batch = _batch(model, 5, 6, torch.tensor([[4]]))
    out = model(batch, mem.gather(batch.nodes))
    h_dst, h_neg = seen[0][1], seen[0][2]
    rows = mem.gather(torch.tensor([0, 4]))
    z, _ = model.current_memory(
        dataclasses.replace(batch, root_t=batch.t.repeat(2), node_key=None), rows
    )
    # dt = 5 - 1 for node 0 and 5 - 0 for node 4 (their own last events), not 5 - 4.5.
    w = model.time_proj.weight[:, 0]
    assert torch.allclose(h_dst, z[0] * (1 + 4.0 * w), atol=1e-12, rtol=0)
    assert torch.allclose(h_neg, z[1] * (1 + 5.0 * w), atol=1e-12, rtol=0)
    # The endpoints' memory rows are stamped with the event's time, not the mail's.
    assert out.update.nodes.tolist() == [0, 3]
    assert out.update.last_update.tolist() == [5.0, 5.0]


def _dyrep_scores_at(t: float, last_update: torch.Tensor, projection: bool) -> torch.Tensor:
    """DyRep's logits of event 5 (3 -> 0) against negative 4 at time ``t``; every node
    holds the same memory and no mail; only the last-update times (N,) differ."""
    torch.manual_seed(3)
    model = build_model(
        "dyrep", memory_dim=4, time_dim=3, embed_dim=4, time_projection=projection
    ).double()
    mem = MemoryState(N, 4, model.mail_dim, 1, dtype=torch.float64)
    mem.memory[:] = torch.randn(4, dtype=torch.float64)
    mem.last_update[:] = last_update
    batch = _batch(model, 5, 6, torch.tensor([[4]]))
    batch.t = torch.full_like(batch.t, t)
    batch.root_t = torch.full_like(batch.root_t, t)
    out = model(batch, mem.gather(batch.nodes))
    return torch.cat([out.pos, out.neg[:, 0]])


def test_dyrep_time_projection_tells_a_silent_node_from_an_active_one() -> None:
    """DyRep's embedding is its memory: blind to how long a node has been silent (the
    CollegeMsg val/test gap). With ``time_projection`` it is m (1 + w dt)."""
    recent = torch.full((N,), 9.0, dtype=torch.float64)
    stale = recent.clone()
    stale[4] = 1.0  # the negative has been silent since t=1
    # Without the projection a stale negative scores like the positive, at any time.
    plain = _dyrep_scores_at(10.0, stale, projection=False)
    assert torch.equal(plain[0], plain[1])
    assert torch.equal(_dyrep_scores_at(50.0, stale, projection=False), plain)
    same = _dyrep_scores_at(10.0, recent, projection=True)
    assert torch.equal(same[0], same[1])
    differ = _dyrep_scores_at(10.0, stale, projection=True)
    assert torch.equal(differ[0], same[0])  # the positive pair is untouched
    assert not torch.allclose(differ[1], same[1])
    assert not torch.allclose(_dyrep_scores_at(50.0, recent, projection=True), same)


def test_time_projection_is_h_times_one_plus_w_dt() -> None:
    from sven.models.base import TimeProjection

    proj = TimeProjection(3, time_scale=2.0).double()
    with torch.no_grad():
        proj.weight.copy_(torch.tensor([[1.0], [0.0], [-0.5]]))
        proj.bias.copy_(torch.tensor([0.0, 1.0, 0.0]))
    z = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64)
    out = proj.project(z, torch.tensor([4.0], dtype=torch.float64))  # dt / scale = 2
    assert out.tolist() == [[3.0, 4.0, 0.0]]
    with pytest.raises(ValueError, match="time_scale"):
        TimeProjection(3, time_scale=0.0)


def test_time_projection_config() -> None:
    from sven.config import ConfigError, ModelConfig

    assert ModelConfig(name="dyrep", time_projection=True).time_projection
    with pytest.raises(ConfigError, match="time_projection"):
        ModelConfig(name="tgn", time_projection=True)


def test_last_occurrence() -> None:
    nodes = torch.tensor([5, 3, 5, 1, 3, 5])
    key = torch.tensor([0, 1, 9, 3, 2, 4])
    uniq, pos = last_occurrence(nodes, key)
    assert uniq.tolist() == [1, 3, 5]
    assert pos.tolist() == [3, 4, 2]


def test_reference_cells_match_torch() -> None:
    torch.manual_seed(0)
    x, h = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    for cls, fn in [(torch.nn.GRUCell, kernels.gru_cell), (torch.nn.RNNCell, kernels.rnn_cell)]:
        c = cls(5, 3).double()
        assert torch.allclose(
            fn(x, h, c.weight_ih, c.weight_hh, c.bias_ih, c.bias_hh), c(x, h), atol=1e-14
        )


def test_attention_masked_rows_are_zero() -> None:
    q = torch.randn(3, 2, 4)
    k = torch.randn(3, 5, 2, 4)
    mask = torch.tensor([[True] * 5, [False] * 5, [True, False, False, False, False]])
    out = kernels.temporal_attention(q, k, k, mask)
    assert torch.equal(out[1], torch.zeros(8))
    # One valid neighbour: attention is all on it.
    assert torch.allclose(out[2], k[2, 0].reshape(-1))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("cell", ["", "rnn"])
def test_from_config_builds_what_the_constructor_builds(name: str, cell: str) -> None:
    # The arguments the trainer passed before Model.from_config existed, written out.
    mc = ModelConfig(
        name=name, memory_dim=6, time_dim=4, embed_dim=9, num_heads=3, dropout=0.2,
        cell=cell, message="mlp", mailbox_size=4,
    )  # fmt: skip
    src, dst, t = SRC.numpy(), DST.numpy(), T.numpy()
    kw = dict(memory_dim=6, time_dim=4, embed_dim=9, edge_dim=2, node_dim=3, message="mlp")
    if cell:
        kw["cell"] = cell
    if name in ("tgn", "apan"):
        kw.update(num_heads=3, dropout=0.2)
    if name == "apan":
        kw["mailbox_size"] = 4
    if name in ("jodie", "apan"):
        kw["time_scale"] = time_gap_scale(src, dst, t)
    torch.manual_seed(7)
    want = build_model(name, **kw)
    torch.manual_seed(7)
    got = MODELS[name].from_config(mc, edge_dim=2, node_dim=3, train_events=(src, dst, t))
    torch.manual_seed(7)
    by_name = model_from_config(mc, edge_dim=2, node_dim=3, train_events=(src, dst, t))
    for model in (got, by_name):
        assert type(model) is type(want)
        assert model.mailbox_size == want.mailbox_size
        assert _time_scale(model) == _time_scale(want)
        a, b = want.state_dict(), model.state_dict()
        assert list(a) == list(b)
        for key in a:
            assert torch.equal(a[key], b[key]), key
    if name in ("jodie", "apan"):
        # The scale comes from the events' gaps, which are not all equal here.
        assert _time_scale(got) != 1.0


def _time_scale(model) -> float | None:
    """The time scale of a model's time projection (JODIE, APAN, DyRep's option)."""
    proj = getattr(model, "time_proj", None)
    return None if proj is None else proj.time_scale


def test_time_gap_scale_by_hand() -> None:
    # Node 0 at t = 0, 2, 6; node 1 at 0, 2 (dst of the first two events); node 2 at 6:
    # gaps 2, 4 (node 0) and 2 (node 1): std of (2, 4, 2) = sqrt(8/9).
    src, dst, t = np.array([0, 0, 0]), np.array([1, 1, 2]), np.array([0.0, 2.0, 6.0])
    assert time_gap_scale(src, dst, t) == pytest.approx((8 / 9) ** 0.5)
    # No node seen twice: no gap, the scale is 1.
    assert time_gap_scale(np.array([0]), np.array([1]), np.array([3.0])) == 1.0


def test_time_encoding_at_zero_is_forward_of_zeros() -> None:
    """The attention's query encoding of dt = 0 (``at_zero``, one kernel) equals the
    encoder applied to zeros to the bit, with trained weights and biases too."""
    from sven.models.updaters import TimeEncoding

    enc = TimeEncoding(16, trainable=True)
    assert torch.equal(enc.at_zero(3), torch.ones(3, 16))
    with torch.no_grad():
        enc.bias.copy_(torch.linspace(-4.0, 4.0, 16))
        enc.weight.mul_(-3.0)
    assert torch.equal(enc.at_zero(5), enc(torch.zeros(5)))
    assert enc.at_zero(0).shape == (0, 16)


def test_the_time_scale_is_saved_exactly_with_the_parameters() -> None:
    """Kept as a float64's bits: a float32 model saves and loads it to the last bit; a
    state saved without it (an older checkpoint's) leaves the one the model was built
    with."""
    from sven.models.base import TimeProjection

    scale = 1 / 3 * 1e7  # not a float32
    proj = TimeProjection(4, scale).to(torch.float32)
    sd = proj.state_dict()
    assert sd["scale_bits"].dtype == torch.int64
    other = TimeProjection(4, 1.0)
    other.load_state_dict(sd)
    assert other.time_scale == scale and float(np.float32(scale)) != scale
    older = TimeProjection(4, 2.5)
    older.load_state_dict({k: v for k, v in sd.items() if k != "scale_bits"})
    assert older.time_scale == 2.5 and torch.equal(older.weight, proj.weight)
