"""The capture's warm-up leaves parameters, optimizer and memory exactly as without it.

On CUDA, :class:`sven.engine.step.StepGraph` runs ``warmup`` real steps before it captures a
graph and then puts the state back (:func:`sven.engine.step.undone`). On CPU the graph is off,
so the same warm-up runs through :meth:`StepGraph.rehearse`: a run that rehearses
before some of its steps must end bitwise equal to a run that does not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sven.engine.capture import StepGraph, undone
from sven.engine.evaluation import EVAL_STREAM
from sven.engine.trainer import Trainer
from tests.conftest import write_tiny_store

B = 50


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("warmup") / "store"
    return write_tiny_store(path, events=600, nodes=40, seed=4, t_max=5000, edge_dim=2)


def _trainer(store, out, model: str) -> Trainer:
    return Trainer(
        None,
        [
            f"data.path={store}",
            f"out={out}",
            f"model.name={model}",
            "train.device=cpu",
            "train.threads=1",
            "quiet=true",
            f"train.batch_size={B}",
            "model.memory_dim=8",
            "model.time_dim=4",
            "model.embed_dim=8",
            "model.num_neighbors=3",
            "model.mailbox_size=2",
            "eval.mrr_negatives=3",
        ],
    )


def _state(tr: Trainer) -> dict[str, Any]:
    opt = tr.optimizer.state_dict()
    return {
        "model": {k: v.clone() for k, v in tr.model.state_dict().items()},
        "optimizer": {
            (i, k): v.clone() if torch.is_tensor(v) else v
            for i, st in opt["state"].items()
            for k, v in st.items()
        },
        "memory": {k: v.clone() for k, v in tr.memory.state_dict().items()},
        "loss_sum": tr.step.loss_sum.clone(),
        "rng": torch.get_rng_state(),
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for part in a:
        x, y = a[part], b[part]
        if isinstance(x, dict):
            assert x.keys() == y.keys(), part
            for k in x:
                assert torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])), (part, k)
        else:
            assert torch.equal(x, y), part


def _run(store, out, model: str, rehearse_at: set[int]) -> tuple[dict[str, Any], Any]:
    torch.manual_seed(0)
    tr = _trainer(store, out, model)
    step = tr.step
    lo, hi = tr.ranges["train"]
    for i, start in enumerate(range(lo, hi, B)):
        stop = min(start + B, hi)
        if i in rehearse_at:
            # What train_batch sets before the graph's first call, then its warm-up.
            step.inp.fill(
                start=start, stop=stop, gstart=start, stream=0, npred=float((stop - start) * 2)
            )
            step.train_graph.rehearse()
        step.train_batch(0, i, start, stop)
    train_state = _state(tr)
    if rehearse_at:
        # The eval graph's warm-up, as at the first batch of the first evaluation.
        vlo, vhi = tr.ranges["val"]
        ev = step.evaluation
        width = ev.width("val")
        (graph,) = width.graphs
        width.neg[: vhi - vlo].copy_(ev.negatives("val"))
        ev.inp.fill(split_lo=vlo, stream=EVAL_STREAM["val"], start=vlo, stop=vlo + B, gstart=vlo)
        graph.rehearse()
    res = tr.evaluate("val")
    return train_state, (res, _state(tr))


@pytest.mark.parametrize("model", ["tgn", "jodie", "apan", "dyrep"])
def test_warm_up_leaves_the_state_exactly_as_without(store, tmp_path, model: str) -> None:
    # Before the first step (the optimizer state the warm-up creates goes back to
    # Adam's initial zeros) and mid-epoch (the existing state restored in place).
    plain, (res_p, after_p) = _run(store, tmp_path / "a", model, set())
    warm, (res_w, after_w) = _run(store, tmp_path / "b", model, {0, 3})
    _equal(plain, warm)
    _equal(after_p, after_w)
    assert torch.equal(res_p.pos, res_w.pos) and torch.equal(res_p.neg, res_w.neg)
    assert torch.equal(res_p.mrr_neg, res_w.mrr_neg)


def test_without_the_restore_the_warm_up_would_change_the_state(store, tmp_path) -> None:
    """The check above can fail: the same warm-up, nothing put back, moves the state."""
    tr = _trainer(store, tmp_path / "c", "tgn")
    step = tr.step
    lo = tr.ranges["train"][0]
    before = _state(tr)
    step.inp.fill(start=lo, stop=lo + B, gstart=lo, stream=0, npred=float(2 * B))
    StepGraph(step._train_fn(0), mode="off", device=tr.device, state=lambda: []).rehearse()
    after = _state(tr)
    assert any(not torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    assert any(not torch.equal(before["memory"][k], after["memory"][k]) for k in before["memory"])
    assert after["optimizer"] and not before["optimizer"]


def test_undone_restores_tensors_and_zeroes_created_optimizer_state() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    acc = torch.zeros(2)
    opt = torch.optim.Adam([w], lr=0.1)
    with undone(lambda: [w.data, acc], opt):
        (w * w).sum().backward()
        opt.step()
        acc += 5
    assert torch.equal(w.data, torch.tensor([1.0, 2.0])) and torch.equal(acc, torch.zeros(2))
    st = opt.state[w]
    assert float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()


class _FakeCuda:
    """CUDA's stream order on the CPU, for what a capture does.

    A copy queued on a stream (the snapshot's, :func:`sven.engine.capture._copies`) is
    taken only when another stream waits for that stream or the device synchronises;
    any other work (the warm-up, run by torch on the CPU at once) goes ahead of it. That
    is a schedule CUDA allows to work on another stream that nothing orders after the
    copies: a snapshot of pinned host state crosses the host link, and takes far longer
    than a warm step (docs/scale.md, "Host memory").
    """

    def __init__(self) -> None:
        self.current = self.default = _FakeStream()
        self.streams = [self.default]
        self.capturing = False

    def stream_ctor(self, *args: Any, **kwargs: Any) -> _FakeStream:
        s = _FakeStream()
        self.streams.append(s)
        return s

    def current_stream(self, *args: Any) -> _FakeStream:
        return self.current

    def synchronize(self, *args: Any) -> None:
        for s in self.streams:
            s.drain()

    def on(self, stream: _FakeStream) -> Any:
        fake = self

        class _On:
            def __enter__(self) -> None:
                self.was, fake.current = fake.current, stream

            def __exit__(self, *exc: Any) -> None:
                fake.current = self.was

        return _On()

    def graph(self, graph: Any) -> Any:
        fake = self

        class _Capture:
            # A capture records the step's work; nothing runs.
            def __enter__(self) -> None:
                fake.synchronize()
                fake.capturing = True

            def __exit__(self, *exc: Any) -> None:
                fake.capturing = False

        return _Capture()

    def copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for t in tensors]
        for dst, src in zip(out, tensors):
            self.current.pending.append(lambda d=dst, s=src: d.copy_(s.detach()))
        return out


class _FakeStream:
    def __init__(self) -> None:
        self.pending: list[Any] = []

    def drain(self) -> None:
        while self.pending:
            self.pending.pop(0)()

    def wait_stream(self, other: _FakeStream) -> None:
        # Work queued here from now on runs after the other stream's queued so far.
        other.drain()


class _FakeGraph:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def _toy_step(fake: _FakeCuda) -> tuple[Any, Any, torch.optim.Optimizer]:
    """A step that trains one parameter and writes a row of its "node state"."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    rows = torch.zeros(3, 2)
    opt = torch.optim.Adam([w], lr=0.1)

    def fn() -> None:
        if fake.capturing:
            return
        opt.zero_grad()
        (w * w).sum().backward()
        opt.step()
        rows[1] += w.detach()

    return fn, (w, rows), opt


def test_a_capture_saves_the_state_before_its_warm_up_runs(monkeypatch) -> None:
    """The state put back after a capture's warm-up is the one before it, whatever the
    warm-up's stream: the copies are taken before the warm-up starts. (Before, the
    warm-up's stream waited for the current stream before the copies were queued on
    it: on CUDA they could run after the warm-up's writes, and the first replay then
    continued from a state partly two steps ahead: the cause found for the drift of the
    host tier's run with the prefetch ring, which captures a graph with warm kernels at
    its second step.)"""
    from sven.engine import capture

    fake = _FakeCuda()
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "Stream", fake.stream_ctor)
    monkeypatch.setattr(cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(cuda, "stream", fake.on)
    monkeypatch.setattr(cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(cuda, "graph", fake.graph)
    monkeypatch.setattr(capture, "_copies", fake.copies)

    fn, (w, rows), opt = _toy_step(fake)
    monkeypatch.setattr(cuda, "CUDAGraph", lambda: _FakeGraph(fn))
    # A graph captured at the second step (the ring's second position): the optimizer
    # has state to save too.
    fn()
    ref_fn, (ref_w, ref_rows), ref_opt = _toy_step(_FakeCuda())
    ref_fn()
    ref_fn()

    graph = StepGraph(
        fn, mode="on", device=torch.device("cuda"), state=lambda: [w.data, rows], optimizer=opt
    )
    graph()
    assert graph.captured
    assert torch.equal(w.data, ref_w.data) and torch.equal(rows, ref_rows)
    got, want = opt.state[w], ref_opt.state[ref_w]
    for k in want:
        assert torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])), k
