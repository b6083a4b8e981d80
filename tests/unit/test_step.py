"""The fixed-shape step: padded batches and their neighbour rows, the masked loss, the
prefetch ring's in-place copies, the step graph and the compiled model."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from sven.engine.batches import copy_tree, tree_tensors
from sven.engine.body import StepInput, masked_bce, train_step
from sven.engine.capture import StepGraph, no_collection
from sven.models import MODELS, MemoryState, build_model
from sven.models.base import ModelOutput
from sven.pipeline.negatives import register_compiled_ops
from sven.pipeline.sampler import TCSR, TemporalSampler
from sven.pipeline.stages import EventTables, select_batch

# 11 events on 7 nodes (node 6 never occurs), with a self-loop and repeated pairs.
SRC = torch.tensor([0, 1, 0, 2, 1, 3, 4, 4, 0, 5, 2])
DST = torch.tensor([1, 2, 2, 3, 0, 0, 4, 1, 5, 1, 3])
T = torch.tensor([1.0, 2.0, 2.0, 3.0, 4.0, 5.0, 5.0, 6.0, 7.0, 7.0, 9.0], dtype=torch.float64)
N = 7


def test_masked_neighbour_slots_read_distinct_rows() -> None:
    """On a fixed-slot batch every real neighbour slot points at its node's row, and
    the masked slots spread over the rows (each its own where there are as many rows),
    so that no row collects the zero gradients of all masked slots (atomic adds on one
    row on CUDA)."""
    tables = _tables(k=3)
    batch = select_batch(
        tables, torch.tensor(0), torch.tensor(4), 0, seed=3, num_neg=1,
        sample_roots="all", read_neighbors=True, capacity=4,
    )  # fmt: skip
    mask, pos = batch.block.mask, batch.nbr_pos
    assert (~mask).any() and mask.any()
    assert torch.equal(batch.nodes[pos[mask]], batch.block.nbr[mask])
    masked = pos[~mask]
    u = batch.nodes.shape[0]
    # Fewer nodes than ids: the slots are capped at the node ids and the padding id.
    assert u == tables.num_nodes + 1 < batch.root_pos.numel() + mask.numel()
    # Neighbour slot j reads row j mod U: no row takes more than its share.
    assert masked.bincount(minlength=u).max() <= -(-mask.numel() // u)
    assert ((masked >= 0) & (masked < u)).all()


def _tables(dtype: torch.dtype = torch.float64, k: int = 3, strategy: str = "recent"):
    ef = torch.arange(SRC.numel() * 2, dtype=dtype).view(-1, 2) / 10
    sampler = TemporalSampler(TCSR.from_events(SRC, DST, T, N), [k], strategy)
    return EventTables(
        src=SRC,
        dst=DST,
        t=T,
        edge_feat=ef,
        node_feat=None,
        candidates=torch.unique(DST),
        sampler=sampler,
        num_nodes=N,
    )


def _model(name: str, **extra):
    kw = dict(memory_dim=4, time_dim=3, embed_dim=4, edge_dim=2, **extra)
    if name in ("tgn", "apan"):
        kw.update(num_heads=2, dropout=0.1)
    if name == "apan":
        kw["mailbox_size"] = 3
    return build_model(name, **kw).to(torch.float64)


def _train_batches(tables, model, step_model, opt, mem, capacity):
    """Two epochs of batches of 4 over the 11 events; (loss, parameters, memory) after
    each. ``step_model`` is what the step calls (``model`` or a compiled wrapper)."""
    trace = []
    for epoch in range(2):
        mem.reset()
        for start in range(0, 11, 4):
            stop = min(start + 4, 11)
            batch = select_batch(
                tables,
                start,
                stop,
                epoch,
                seed=3,
                num_neg=2,
                sample_roots=model.sample_roots,
                read_neighbors=model.read_neighbors,
                capacity=capacity,
            )
            if capacity:
                assert batch.size == 4 and batch.valid.sum() == stop - start
            loss = train_step(step_model, opt, mem, batch, float((stop - start) * 3))
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            trace.append((float(loss), params.clone(), mem.state_dict()))
    return trace


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padded_fixed_batches_train_like_exact_batches(name: str) -> None:
    """Capacity 4 over 11 events (last batch: 3 real + 1 padded): the same parameters,
    memory and losses after every batch as exact-size batches with torch.unique."""
    torch.manual_seed(0)
    tables = _tables(strategy="uniform")
    runs = []
    base = _model(name)
    for capacity in (None, 4):
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        mem = MemoryState(N, 4, model.mail_dim, model.mailbox_size, dtype=torch.float64)
        runs.append((model, _train_batches(tables, model, model, opt, mem, capacity)))
    (_, exact), (_, padded) = runs
    # float64; padded rows add exact zeros, but the sums over differently shaped
    # tensors may group their terms differently (last-bit differences).
    tol = dict(rtol=1e-9, atol=1e-11)
    for i, ((l0, p0, m0), (l1, p1, m1)) in enumerate(zip(exact, padded, strict=True)):
        assert l0 == pytest.approx(l1, rel=1e-9, abs=1e-11), i
        torch.testing.assert_close(p0, p1, **tol)
        for key in m0:
            torch.testing.assert_close(m0[key], m1[key], **tol)


def test_masked_bce_is_the_bce_with_logits_of_real_events() -> None:
    # Logits far past softplus's threshold (20) too: there it returns x and slope 1,
    # which differ from BCE's x + log1p(exp(-x)) and sigmoid(x) by less than
    # exp(-20) = 2.1e-9 per element.
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(40, generator=g, dtype=torch.float64) * 15
    neg = torch.randn(40, 3, generator=g, dtype=torch.float64) * 15
    valid = torch.rand(40, generator=g) > 0.25
    pos.requires_grad_(True)
    neg.requires_grad_(True)
    loss = masked_bce(ModelOutput(pos, neg, None), valid)
    v = valid.double()
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    ref = (bce(pos, torch.ones_like(pos), reduction="none") * v).sum()
    ref = ref + (bce(neg, torch.zeros_like(neg), reduction="none") * v[:, None]).sum()
    assert abs(float(loss - ref)) < 160 * 2.1e-9
    gp, gn = torch.autograd.grad(loss, (pos, neg))
    rp, rn = torch.autograd.grad(ref, (pos, neg))
    torch.testing.assert_close(gp, rp, rtol=0, atol=2.1e-9)
    torch.testing.assert_close(gn, rn, rtol=0, atol=2.1e-9)
    # Padded events count for nothing; without a mask every event counts.
    assert (gp[~valid] == 0).all() and (gn[~valid] == 0).all()
    whole = masked_bce(ModelOutput(pos, neg, None), None)
    assert float(whole) > float(loss)


def test_copy_tree_fills_a_ring_slot_in_place() -> None:
    # A prefetched batch (mixed dtypes, a None leaf, a list of micro-batches) copied
    # into the ring slot a captured graph reads: values the new ones, tensors the old.
    g = torch.Generator().manual_seed(0)
    tables, model = _tables(), _model("tgn")

    def built(start: int) -> StepInput:
        mb = select_batch(
            tables,
            start,
            start + 3,
            1,
            seed=0,
            num_neg=1,
            sample_roots=model.sample_roots,
            read_neighbors=model.read_neighbors,
            capacity=4,
        )
        return StepInput([mb], torch.randint(0, N, (5,), generator=g), None)

    slot, new = built(0), built(5)
    before = {id(t): t for t in _tensors(slot)}
    assert any(t.dtype == torch.bool for t in before.values())
    assert any(t.is_floating_point() for t in before.values())
    copy_tree(slot, new)
    after = _tensors(slot)
    assert [id(t) for t in after] == list(before)
    for a, b in zip(after, _tensors(new), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _tensors(item: StepInput) -> list[torch.Tensor]:
    return tree_tensors(item)


def test_step_graph_off_runs_eagerly_and_validates_mode() -> None:
    calls = []
    sg = StepGraph(lambda: calls.append(1), mode="auto", device=torch.device("cpu"), state=list)
    sg()
    sg()
    assert calls == [1, 1] and sg.graph is None
    with pytest.raises(ValueError, match="cuda_graph"):
        StepGraph(lambda: None, mode="maybe", device=torch.device("cpu"), state=list)
    with pytest.raises(ValueError, match="CUDA"):
        StepGraph(lambda: None, mode="on", device=torch.device("cpu"), state=list)


class _Cycle:
    def __init__(self, payload: object = None) -> None:
        self.me = self
        self.payload = payload


def test_no_collection_collects_on_entry_and_holds_collection_off_inside() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        stale = _Cycle()
        gone = weakref.ref(stale)
        del stale
        with no_collection():
            # The cycle made before the block is gone on entry; none made inside is
            # collected automatically, however many allocations follow.
            assert gone() is None and not gc.isenabled()
            made = _Cycle()
            inside = weakref.ref(made)
            del made
            junk = [_Cycle() for _ in range(5 * gc.get_threshold()[0])]
            del junk
            assert inside() is not None
        assert gc.isenabled()
        gc.collect()
        assert inside() is None
        # Collection that was off before stays off after.
        gc.disable()
        with no_collection():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.gpu
def test_capture_with_a_stale_graph_in_a_cycle_and_garbage_made_inside() -> None:
    # A graph of an earlier run left in a reference cycle; the step captured now makes
    # enough cyclic garbage for automatic collection to fire inside the capture, which
    # would destroy the stale graph there (a CUDA call a capture forbids).
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.ones(4, device="cuda")
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        x.add_(1)
    was = gc.isenabled()
    gc.disable()
    _Cycle(old)
    del old
    gc.enable()

    def step() -> None:
        junk = [_Cycle() for _ in range(5 * gc.get_threshold()[0])]
        del junk
        x.mul_(2)

    try:
        sg = StepGraph(step, mode="on", device=torch.device("cuda"), state=lambda: [x], warmup=1)
        sg()
        sg()
        torch.cuda.synchronize()
    finally:
        (gc.enable if was else gc.disable)()
    # The stale graph never replayed; the warm-up's doubling is undone; the two
    # replays double twice.
    assert sg.captured and x.tolist() == [4.0] * 4


@pytest.mark.slow
@pytest.mark.parametrize("form", ["fused", "factored"])
def test_compiled_model_trains_like_the_eager_model(form: str) -> None:
    """``train.compile`` compiles the model as ``torch.compile(model, dynamic=False)``
    over fixed-capacity batches: Inductor's kernels (C++ on CPU) give the same losses
    and parameters as eager in float64 (TGN: attention, GRU updater, keyed dropout;
    the fused attention form is the one CUDA runs, the factored one CPU's)."""
    tables = _tables(strategy="uniform")
    base = _model("tgn", attention_form=form)
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        mem = MemoryState(N, 4, model.mail_dim, model.mailbox_size, dtype=torch.float64)
        if compiled:
            # Keyed dropout through the custom op, as the CUDA step compiles it.
            register_compiled_ops()
        step_model = torch.compile(model, dynamic=False) if compiled else model
        runs.append(_train_batches(tables, model, step_model, opt, mem, 4))
    for i, ((l0, p0, m0), (l1, p1, m1)) in enumerate(zip(*runs, strict=True)):
        assert l0 == pytest.approx(l1, rel=1e-9), i
        torch.testing.assert_close(p0, p1, rtol=1e-9, atol=1e-11)
        for key in m0:
            torch.testing.assert_close(m0[key], m1[key], rtol=1e-9, atol=1e-11)


def test_copy_tree_copies_every_layout_and_dtype() -> None:
    """Dense tensors of any dtype and layout (a transposed view) go as bytes in one
    copy; a strided slice and a 0-d tensor by their dtype: each slot ends up equal to
    its source, and nothing outside a strided slice is written."""
    from dataclasses import dataclass

    @dataclass
    class Tree:
        ints: torch.Tensor
        floats: torch.Tensor
        flags: torch.Tensor
        scalar: torch.Tensor
        part: torch.Tensor

    def tree(seed: int, base: torch.Tensor) -> Tree:
        g = torch.Generator().manual_seed(seed)
        return Tree(
            ints=torch.randint(0, 99, (5, 3), generator=g).t(),
            floats=torch.rand(4, 2, generator=g, dtype=torch.float64),
            flags=torch.rand(7, generator=g) < 0.5,
            scalar=torch.rand((), generator=g),
            part=base[:, 1:3],
        )

    dst_base = torch.zeros(6, 4)
    dst, src = tree(0, dst_base), tree(1, torch.rand(6, 4))
    copy_tree(dst, src)
    for name in ("ints", "floats", "flags", "scalar", "part"):
        assert torch.equal(getattr(dst, name), getattr(src, name)), name
    assert (dst_base[:, [0, 3]] == 0).all()
