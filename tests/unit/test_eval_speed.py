"""The vectorised evaluation (issue 22) against the per-batch code it replaced.

The oracles below are the implementation before the change, kept here verbatim in
substance: the per-batch historical/inductive draw (``EvalNegatives.draw`` with one
``torch.isin`` against the batch's pairs), the per-batch negatives loop of the
one-process step, and ``split_metrics``' per-batch ``link_metrics`` loop. The new code
must give the same negatives and the same metrics to the last bit (``==`` on floats).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sven.engine.evaluation import EVAL_STREAM, EvalResult
from sven.engine.metrics import average_precision, batched_link_metrics, link_metrics, mrr
from sven.engine.trainer import Trainer
from sven.pipeline.eval_negatives import TRIES, EvalNegatives, eval_negative_columns
from sven.pipeline.negatives import hash_counter, sample_negatives
from tests.conftest import write_tiny_store


# ------------------------------------------------------------------ the oracles
def _oracle_draw(
    neg: EvalNegatives,
    protocol: str,
    seed: int,
    stream: int,
    index: torch.Tensor,
    batch_start: int,
    batch_stop: int,
) -> torch.Tensor:
    """``EvalNegatives.draw`` before issue 22: one global batch, ``torch.isin``."""
    s = neg.src[index]
    n = neg.num_nodes
    in_batch = torch.unique(neg.src[batch_start:batch_stop] * n + neg.dst[batch_start:batch_stop])
    first_lo = 0 if protocol == "historical" else min(neg.train_stop, batch_start)
    base = s * (neg.num_events + 1)
    lo = torch.searchsorted(neg.order_key, base + first_lo)
    hi = torch.searchsorted(neg.order_key, base + batch_start)
    count = hi - lo
    out = torch.full_like(s, -1)
    for j in range(TRIES):
        h = hash_counter(seed, stream, index, j)
        row = lo + h % count.clamp_min(1)
        cand = neg.pair_dst[row.clamp_max(neg.pair_dst.numel() - 1)]
        ok = (count > 0) & ~torch.isin(s * n + cand, in_batch) & (out < 0)
        out = torch.where(ok, cand, out)
    c = neg.candidates
    for j in range(TRIES):
        h = hash_counter(seed, stream, index, TRIES + j)
        cand = c[h % c.numel()]
        ok = ~torch.isin(s * n + cand, in_batch) & (out < 0)
        out = torch.where(ok | ((out < 0) & (j == TRIES - 1)), cand, out)
    return out


def _oracle_table(tr: Trainer, split: str) -> torch.Tensor:
    """The one-process step's negatives table before issue 22: a loop over batches."""
    step = tr.step
    lo, hi = tr.ranges[split]
    b, seed, q = tr.cfg.train.batch_size, tr.cfg.train.seed, tr.mrr_negatives
    protocols = step.evaluation.split_protocols(split)
    sampler = tr.data.eval_negatives()
    cols = []
    for start in range(lo, hi, b):
        stop = min(start + b, hi)
        idx = torch.arange(start, stop)
        c = []
        for p in protocols:
            if p == "random":
                c.append(sample_negatives(seed, EVAL_STREAM[split], idx, tr.candidates, 1)[:, 0])
            else:
                s = EVAL_STREAM[split] + {"historical": 1 << 22, "inductive": 2 << 22}[p]
                c.append(_oracle_draw(sampler, p, seed, s, idx, start, stop))
        c = torch.stack(c, 1)
        c = torch.cat([c, c[:, :1].expand(-1, len(step.evaluation.protocols) - c.shape[1])], 1)
        if q:
            c = torch.cat([c, tr.data.mrr_draw(split, idx)], 1)
        cols.append(c)
    return torch.cat(cols)


def _oracle_per_batch(pos: torch.Tensor, neg: torch.Tensor, b: int) -> tuple[float, float]:
    if pos.numel() == 0:
        return float("nan"), float("nan")
    aps, aucs = zip(
        *(link_metrics(pos[i : i + b], neg[i : i + b]) for i in range(0, pos.numel(), b))
    )
    return float(np.mean(aps)), float(np.mean(aucs))


def _oracle_metrics(tr: Trainer, split: str, res: EvalResult) -> dict[str, float]:
    """``Evaluator.split_metrics`` before issue 22."""
    b = tr.cfg.train.batch_size
    inductive = tr.data.inductive
    res = EvalResult(
        res.pos.float(),
        res.neg.float(),
        None if res.mrr_neg is None else res.mrr_neg.float(),
        res.mrr_valid,
        {k: v.float() for k, v in res.protocol_neg.items()},
    )
    out: dict[str, float] = {}
    out[f"{split}_ap"], out[f"{split}_auc"] = _oracle_per_batch(res.pos, res.neg, b)
    labels = torch.cat([torch.ones_like(res.pos), torch.zeros_like(res.neg)])
    out[f"{split}_ap_pooled"] = average_precision(torch.cat([res.pos, res.neg]), labels)
    if split in inductive:
        m = inductive[split]
        out[f"{split}_ap_inductive"], out[f"{split}_auc_inductive"] = _oracle_per_batch(
            res.pos[m], res.neg[m], b
        )
        out[f"{split}_inductive_events"] = int(m.sum())
    for name, neg in res.protocol_neg.items():
        p = f"{split}_{name}neg"
        out[f"{p}_ap"], out[f"{p}_auc"] = _oracle_per_batch(res.pos, neg, b)
        if split in inductive:
            m = inductive[split]
            out[f"{p}_ap_inductive"], out[f"{p}_auc_inductive"] = _oracle_per_batch(
                res.pos[m], neg[m], b
            )
    if res.mrr_neg is not None:
        out[f"{split}_mrr"] = mrr(res.pos, res.mrr_neg, res.mrr_valid)
    return out


def _same(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        both_nan = isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])
        assert both_nan or a[k] == b[k], (k, a[k], b[k])


# ------------------------------------------------------------------------ tests
def test_batched_link_metrics_on_hand_values() -> None:
    # Two batches of two events. Batch 1: pos (3, 1) against neg (2, 0): ranking
    # 3+, 2-, 1+, 0- -> AP (1 + 2/3) / 2, AUC 3/4. Batch 2: pos (5, 5), neg (5, 4):
    # one tie run {5+, 5+, 5-} -> AP 2/3 (one threshold), AUC (1 + 1 + 0.5 + 0.5) / 4.
    pos = torch.tensor([3.0, 1.0, 5.0, 5.0])
    neg = torch.tensor([2.0, 0.0, 5.0, 4.0])
    ap, auc = batched_link_metrics(pos, neg, 2)
    assert ap == pytest.approx(((1 + 2 / 3) / 2 + 2 / 3) / 2, abs=1e-15)
    assert auc == pytest.approx((3 / 4 + 3 / 4) / 2, abs=1e-15)
    assert math.isnan(batched_link_metrics(pos[:0], neg[:0], 2)[0])


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("cols", [0, 1, 3])
def test_batched_link_metrics_equal_the_per_batch_loop(ties: bool, cols: int) -> None:
    g = torch.Generator().manual_seed(7 + cols + 10 * ties)
    for _ in range(40):
        n = int(torch.randint(1, 300, (1,), generator=g))
        b = int(torch.randint(1, 50, (1,), generator=g))
        shape = (n,) if cols == 0 else (n, cols)
        if ties:
            pos = torch.randint(0, 4, (n,), generator=g).float()
            neg = torch.randint(0, 4, shape, generator=g).float()
        else:
            pos, neg = torch.randn(n, generator=g), torch.randn(shape, generator=g)
        assert batched_link_metrics(pos, neg, b) == _oracle_per_batch(pos, neg, b)


@pytest.mark.parametrize("protocol", ["historical", "inductive"])
def test_split_draws_equal_the_per_batch_draws(protocol: str) -> None:
    g = torch.Generator().manual_seed(3)
    e, n = 3000, 40
    src = torch.randint(0, n, (e,), generator=g)
    dst = torch.randint(0, n, (e,), generator=g)
    cand = torch.unique(dst)
    neg = EvalNegatives(src, dst, n, 2000, cand)
    lo, hi, b = 2100, 2987, 37
    ref = torch.cat(
        [
            _oracle_draw(neg, protocol, 5, 11, torch.arange(s, min(s + b, hi)), s, min(s + b, hi))
            for s in range(lo, hi, b)
        ]
    )
    got = neg.draw_batches(protocol, 5, 11, torch.arange(lo, hi), lo, hi, b, chunk=100)
    assert torch.equal(got, ref)
    # A rank's share of the events (every third) draws what the whole split does.
    every3 = torch.arange(lo, hi)[::3]
    assert torch.equal(neg.draw_batches(protocol, 5, 11, every3, lo, hi, b), ref[::3])
    # One batch: draw() is draw_batches over that batch alone.
    one = torch.arange(lo, lo + b)
    assert torch.equal(neg.draw(protocol, 5, 11, one, lo, lo + b), ref[:b])
    cols = eval_negative_columns(
        ["random", protocol], cand, neg, 5, 11, torch.arange(lo, hi), lo, hi, batch_size=b
    )
    assert torch.equal(
        cols[:, 1],
        torch.cat(
            [
                _oracle_draw(
                    neg,
                    protocol,
                    5,
                    11 + {"historical": 1 << 22, "inductive": 2 << 22}[protocol],
                    torch.arange(s, min(s + b, hi)),
                    s,
                    min(s + b, hi),
                )
                for s in range(lo, hi, b)
            ]
        ),
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # Coarse times: many events share an instant (MRR's filter has work to do).
    path = tmp_path_factory.mktemp("evalspeed") / "store"
    return write_tiny_store(path, events=1500, nodes=60, seed=1, t_max=300, edge_dim=3)


@pytest.mark.parametrize("selected", ["random", "historical", "inductive"])
def test_evaluation_metrics_equal_the_per_batch_code(store, tmp_path, selected: str) -> None:
    """Every protocol and a sampled MRR, through a trained model's real scores."""
    tr = Trainer(
        "configs/tgn.yaml",
        [
            f"data.path={store}",
            f"out={tmp_path / 'run'}",
            "train.device=cpu",
            "train.threads=1",
            "quiet=true",
            "train.epochs=1",
            "train.batch_size=64",
            "model.memory_dim=8",
            "model.time_dim=4",
            "model.embed_dim=8",
            "model.num_neighbors=3",
            f"eval.negatives={selected}",
            "eval.mrr_negatives=5",
        ],
    )
    lo, hi = tr.ranges["train"]
    for i, start in enumerate(range(lo, hi, 64)):
        tr.step.train_batch(0, i, start, min(start + 64, hi))
    for split in ("val", "test"):
        # The inductive masks, now from the device columns, are the store's.
        store_mask = torch.from_numpy(np.asarray(tr.data.events.inductive_mask(split)))
        assert torch.equal(tr.data.inductive[split], store_mask)
        # The old table repeated a split's first column up to the widest split's width;
        # each split now has its own width.
        old = _oracle_table(tr, split)
        n_p, n_all = (
            len(tr.step.evaluation.split_protocols(split)),
            len(tr.step.evaluation.protocols),
        )
        assert torch.equal(
            tr.step.evaluation.negatives(split), torch.cat([old[:, :n_p], old[:, n_all:]], 1)
        )
        res = tr.evaluate(split)
        assert res.protocol_neg or split == "val"
        _same(tr.split_metrics(split, res), _oracle_metrics(tr, split, res))
