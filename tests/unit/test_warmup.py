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
