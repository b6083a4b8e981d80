"""Evaluation: one pass over a split through the step's own parts, and its metrics.

A pass walks a split in global batches without gradients and carries node state on
(validation continues training's, test validation's). It runs on the same parts as
training (batch source, prefetch ring, exchange, captured graphs): the step of
:func:`~sven.engine.body.eval_step` scores each batch's events against every negative
column of the split (one per evaluation protocol, then the MRR negatives), drawn once
per split into a table the captured step reads, and writes the scores into a table of
the split's rows. One graph per width (val need not score test's extra columns), one
per prefetch-ring position. The metrics (AP, AUC, per batch and pooled, inductive, the
other protocols, MRR) are computed from that table on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sven.engine.batches import BatchInputs, BatchSource, Inline, Ring, batch_bounds, ring
from sven.engine.body import StepInput, eval_step
from sven.engine.capacities import Planner, plan_slots_at_once
from sven.engine.capture import StepGraph, determinism
from sven.engine.metrics import average_precision, batched_link_metrics, mrr
from sven.engine.spec import RunSpec
from sven.pipeline.eval_negatives import protocol_order

__all__ = [
    "EVAL_STREAM",
    "MRR_STREAM",
    "EvalResult",
    "Evaluation",
    "eval_result",
    "gather_rows",
]

# Negative streams of evaluation are fixed per split, independent of the epoch, so every
# run and every epoch evaluates against the same negatives.
EVAL_STREAM = {"train": (1 << 20) + 2, "val": 1 << 20, "test": (1 << 20) + 1}
MRR_STREAM = {"train": (1 << 21) + 2, "val": 1 << 21, "test": (1 << 21) + 1}


@dataclass
class EvalResult:
    """Scores of one evaluation pass over a split, in global event order, on the
    run's device.

    Attributes:
        pos: (n,) positive logits.
        neg: (n,) logits of the one evaluation negative of each event (``eval.negatives``).
        mrr_neg: (n, q) logits of the MRR negatives, or None.
        mrr_valid: (n, q) bool, False for MRR negatives filtered out as true edges (on
            the run's device: the split's filter, computed once).
        protocol_neg: Logits (n,) of the negatives of the other protocols, by name.
    """

    pos: torch.Tensor
    neg: torch.Tensor
    mrr_neg: torch.Tensor | None = None
    mrr_valid: torch.Tensor | None = None
    protocol_neg: dict[str, torch.Tensor] = field(default_factory=dict)


def eval_result(
    scores: torch.Tensor,
    protocols: list[str],
    protocol_cols: int,
    mrr: int,
    mrr_valid: torch.Tensor | None,
) -> EvalResult:
    """Splits (n, 1 + protocol_cols + mrr) scores into an :class:`EvalResult`.

    Columns: the positive, one negative per protocol column (the first is
    ``eval.negatives``; ``protocols`` names the scored ones), then the MRR negatives.
    """
    return EvalResult(
        scores[:, 0],
        scores[:, 1],
        scores[:, 1 + protocol_cols :] if mrr else None,
        mrr_valid,
        {p: scores[:, 1 + i] for i, p in enumerate(protocols) if i > 0},
    )


def gather_rows(
    idx: torch.Tensor, rows: torch.Tensor, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' (index (n_r,), row (n_r, d)) pairs on every rank (one padded
    all_gather); the pairs themselves on one process."""
    import torch.distributed as dist

    p, dev = world_size, idx.device
    if p == 1:
        return idx, rows
    n = torch.tensor([idx.numel()], device=dev)
    sizes = [torch.zeros_like(n) for _ in range(p)]
    dist.all_gather(sizes, n)
    m = int(max(int(s) for s in sizes))
    pad_idx = torch.full((m,), -1, dtype=torch.int64, device=dev)
    pad_idx[: idx.numel()] = idx
    pad_rows = torch.zeros(m, rows.shape[1], dtype=rows.dtype, device=dev)
    pad_rows[: rows.shape[0]] = rows
    gi = [torch.empty_like(pad_idx) for _ in range(p)]
    gr = [torch.empty_like(pad_rows) for _ in range(p)]
    dist.all_gather(gi, pad_idx)
    dist.all_gather(gr, pad_rows)
    gi_t, gr_t = torch.cat(gi), torch.cat(gr)
    keep = gi_t >= 0
    return gi_t[keep], gr_t[keep]


def _own(table: torch.Tensor) -> torch.Tensor:
    """A pass's score table on one rank: a copy of its own (the width's table is
    written again by the next pass of that width)."""
    return table.clone()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Width:
    """What the passes of one width share: the negatives table (rows, width), the
    scores (rows, 1 + width), the ring and one graph per ring position."""

    neg: torch.Tensor
    scores: torch.Tensor
    ring: Inline | Ring
    graphs: list[StepGraph]


class Evaluation:
    """Evaluation passes of one rank on the step's parts, and their metrics.

    Its passes keep no state between calls (negatives are functions of the seed, the
    split and the event), so its state_dict is empty.

    Args:
        cfg: The run's config (``train``, ``eval`` sections).
        spec: How the run runs (fixed shapes, prefetch depth D, graph mode; on P ranks
            a pass's score table is summed over the ranks, chosen here, once).
        data: The run's :class:`~sven.engine.data.Data`.
        model: The model the step runs (compiled or not).
        model_ref: The model itself (its flags).
        source: The step's batch source.
        planner: The step's capacity planner.
        node_state: Returns the tensors a pass changes besides its own and node state
            (the exchange's counters, the write log): a capture's warm-up
            restores them; its node-state writes go to the scratch row.
        plan_group: Process group of prefetched id exchanges, or None.
        log: Where notices go.
        progress: ``progress(split, events)`` -> a bar with ``update(n)`` and
            ``close()``, or None for none.
    """

    def __init__(
        self,
        *,
        cfg: Any,
        spec: RunSpec,
        data: Any,
        model: Any,
        model_ref: Any,
        source: BatchSource,
        planner: Planner,
        node_state: Callable[[], list[torch.Tensor]],
        plan_group: Any,
        log: Callable[[str], None],
        progress: Callable[[str, int], Any] | None = None,
    ) -> None:
        self.cfg, self.data = cfg, data
        self.model, self.model_ref = model, model_ref
        self.source, self.planner = source, planner
        self.exchange = source.exchange
        self.shares = source.shares
        self._node_state = node_state
        self.depth, self.plan_group = spec.depth, plan_group
        self.graph_mode = spec.graph_mode
        self.device = spec.device
        # Each event is scored by one rank; the others' rows stay zero, so on P ranks a
        # sum over the ranks assembles a pass's table.
        self._assemble = self._summed if spec.world_size > 1 else _own
        #: The batch being scored, and the one built ahead of it.
        self.inp = BatchInputs(spec.fixed_shapes, self.device)
        self.ahead = BatchInputs(spec.fixed_shapes, self.device)
        ec = cfg.eval
        # One column per protocol the split reports (test: all of them, with
        # eval.all_protocols), then the MRR negatives.
        self.protocols = protocol_order(ec.negatives, ec.all_protocols)
        self._neg_cache: dict[str, torch.Tensor] = {}
        self._valid_cache: dict[str, torch.Tensor] = {}
        self.widths: dict[int, _Width] = {}
        self._log = log
        self.progress = progress or (lambda split, n: _NoBar())

    # ------------------------------------------------------------ layout
    def split_protocols(self, split: str) -> list[str]:
        """The protocols ``split`` scores: all on test, ``eval.negatives`` elsewhere."""
        return self.protocols if split == "test" else self.protocols[:1]

    def split_width(self, split: str) -> int:
        """Negatives scored per event of ``split``: its protocols, then the MRR ones."""
        return len(self.split_protocols(split)) + self.data.mrr_negatives

    def negatives(self, split: str) -> torch.Tensor:
        """(n, width) evaluation negatives of a split, drawn once and kept (they are
        fixed by the seed): the protocol columns, then the MRR negatives."""
        if split not in self._neg_cache:
            protocols = self.split_protocols(split)
            self._neg_cache[split] = self.data.eval_negative_table(split, protocols, len(protocols))
        return self._neg_cache[split]

    def mrr_valid(self, split: str) -> torch.Tensor:
        """(n, q) bool on the device: which MRR negatives of a split count (TGB's filter
        of true edges, :meth:`~sven.engine.data.Data.mrr_valid`), computed once, like
        the negatives it filters (every pass of the split scores the same ones)."""
        if split not in self._valid_cache:
            lo, hi = self.data.ranges[split]
            idx = torch.arange(lo, hi, device=self.device)
            mrr_negs = self.negatives(split)[:, len(self.split_protocols(split)) :]
            valid = self.data.mrr_valid(split, idx, mrr_negs)
            self._valid_cache[split] = valid.to(self.device)
        return self._valid_cache[split]

    def width(self, split: str) -> _Width:
        """The negatives table, scores and graphs of ``split``'s width, made at the
        first pass of that width (each split of a width fits its rows, plus a scratch
        row), with its exchange capacities."""
        w = self.split_width(split)
        if w not in self.widths:
            rows = 1 + max(
                hi - lo for s, (lo, hi) in self.data.ranges.items() if self.split_width(s) == w
            )
            dev, fdt = self.device, self.planner.dtype
            neg = torch.zeros(rows, w, dtype=torch.int64, device=dev)
            scores = torch.zeros(rows, 1 + w, dtype=fdt, device=dev)
            rg = ring(self.depth, dev, lambda: determinism(dev))

            def state() -> list[torch.Tensor]:
                return [*self._node_state(), scores, *rg.tensors()]

            graphs = [
                StepGraph(
                    self._step_fn(k, neg, scores, rg),
                    mode=self.graph_mode,
                    device=dev,
                    state=state,
                    log=self._log,
                    quiet=self.exchange.shard.writes_to_scratch,
                )
                for k in range(self.depth + 1)
            ]
            self.widths[w] = _Width(neg, scores, rg, graphs)
            self._plan_capacities(w, neg)
        return self.widths[w]

    def _plan_capacities(self, w: int, neg_table: torch.Tensor) -> None:
        """Exact capacities of the evaluation step of width ``w``, from a replay of
        every split of that width (its negatives are fixed by the seed): the
        exchange's, and on a fixed-shape step its node slots (the most distinct nodes
        a batch of the width reads, where the default holds every id it lists;
        counted from the ids of many batches at once)."""

        def ready(split: str) -> Callable[[], tuple[int, int, int, int, torch.Tensor]]:
            def fn() -> tuple[int, int, int, int, torch.Tensor]:
                lo, hi = self.data.ranges[split]
                neg_table[: hi - lo].copy_(self.negatives(split))
                return lo, hi, EVAL_STREAM[split], w, neg_table

            return fn

        splits = [
            s
            for s, (lo, hi) in self.data.ranges.items()
            if s != "train" and hi > lo and self.split_width(s) == w
        ]
        passes = [ready(s) for s in splits]
        self.planner.plan_passes(f"eval{w}", passes)
        if self.inp.fixed and passes:
            b = self.cfg.train.batch_size
            self.source.slots[f"eval{w}"] = plan_slots_at_once(self.source, b, passes)

    # --------------------------------------------------------------- step
    def _build(self, inp: BatchInputs, neg_table: torch.Tensor, group: Any = None) -> StepInput:
        w = neg_table.shape[1]
        # Built ahead of its step with a ring: the exchange reads its rows now where it
        # tracks writes.
        return self.source.build(
            inp, w, f"eval{w}", neg_table, group=group, read_ahead=self.depth > 0
        )

    def _step_fn(
        self, k: int, neg_table: torch.Tensor, scores_out: torch.Tensor, rg: Inline | Ring
    ) -> Callable[[], None]:
        """The evaluation step of ring position k at the width of ``neg_table``: with
        prefetch depth D it builds the batch D ahead on the side stream into the
        width's ring, as the training step does, and scores the one built before."""
        w = neg_table.shape[1]
        mode = f"eval{w}"
        # Depth 0 builds the batch being scored; depth D the one D ahead, on the
        # prefetch's process group.
        inp, group = (self.inp, None) if self.depth == 0 else (self.ahead, self.plan_group)

        def fn() -> None:
            with determinism(self.device):
                item = rg.take(k, lambda _p: self._build(inp, neg_table, group))
                batch = item.micro[0]
                out = eval_step(
                    self.model, self.exchange, batch, plan=item.plan, mode=mode, early=item.early
                )
                scores = torch.cat([out.pos[:, None], out.neg], 1).to(scores_out.dtype)
                rows = batch.index - self.inp["split_lo"]
                if batch.valid is not None:
                    rows = torch.where(batch.valid, rows, scores_out.shape[0] - 1)
                # Padded events all write the scratch row; real ones distinct rows.
                scores_out.index_copy_(0, rows, scores)
                rg.join()

        return fn

    # --------------------------------------------------------------- pass
    def _summed(self, table: torch.Tensor) -> torch.Tensor:
        """A pass's (n, 1 + width) score table summed over the ranks (a copy)."""
        import torch.distributed as dist

        table = table.clone()
        dist.all_reduce(table, group=self.exchange.group)
        return table

    def run(self, split: str) -> EvalResult:
        """Walks a split through the evaluation step (every rank scores its share);
        returns all scores, on every rank."""
        d = self.data
        lo, hi = d.ranges[split]
        b, q = self.cfg.train.batch_size, d.mrr_width(split)
        self.exchange.flush()
        copier = self.exchange.shard.copier
        if copier is not None:
            # Training's rows read ahead land before evaluation's graphs are captured
            # (a copy landing in a capture's warm-up would be undone with it).
            copier.wait_all()
        negs = self.negatives(split)
        wd = self.width(split)
        wd.neg[: hi - lo].copy_(negs)
        stream, depth = EVAL_STREAM[split], self.depth
        self.inp.fill(split_lo=lo, stream=stream)
        self.ahead.fill(split_lo=lo, stream=stream)
        # The rows of events another rank scores stay zero here.
        wd.scores.zero_()

        def bounds(i: int) -> tuple[int, int]:
            return batch_bounds(lo, hi, b, i)

        wd.ring.fill(
            self.ahead,
            self.shares,
            0,
            bounds,
            stream,
            lambda _p: self._build(self.ahead, wd.neg, self.plan_group),
        )
        # Rows read by the fill are read again at their steps (as the training ring's).
        self.exchange.shard.invalidate(tables=False)
        bar = self.progress(split, hi - lo)
        for i in range(len(range(lo, hi, b))):
            g_lo, g_hi = bounds(i)
            self.shares.name(self.inp, g_lo, g_hi, stream)
            if depth:
                self.shares.name(self.ahead, *bounds(i + depth), stream)
            wd.graphs[i % (depth + 1)]()
            bar.update(g_hi - g_lo)
        bar.close()
        table = self._assemble(wd.scores[: hi - lo])
        self.exchange.check()
        # The scores stay on the run's device, where the metrics are computed: a copy to
        # the host and back would move the (n, 1 + width) table twice (100 MRR negatives:
        # n x 101 floats).
        scores = table
        protocols = self.split_protocols(split)
        valid = self.mrr_valid(split) if q else None
        return eval_result(scores, protocols, len(protocols), q, valid)

    # ------------------------------------------------------------ metrics
    def metrics(self, split: str, res: EvalResult) -> dict[str, float]:
        """AP/AUC (mean of per-batch values, and pooled), inductive, the other
        protocols and MRR of a split's scores."""
        b = self.cfg.train.batch_size
        inductive = self.data.inductive
        dev = self.device
        out: dict[str, float] = {}
        # Rank metrics on float32 scores: float64 runs on P ranks differ from one process
        # in the last bits (reduction order), which would otherwise break exact ties (e.g.
        # two nodes with the same memory) in a different direction and move AP.
        res = EvalResult(
            res.pos.float(),
            res.neg.float(),
            None if res.mrr_neg is None else res.mrr_neg.float(),
            res.mrr_valid,
            {k: v.float() for k, v in res.protocol_neg.items()},
        )

        def per_batch(pos: torch.Tensor, neg: torch.Tensor) -> tuple[float, float]:
            # All batches at once on the run's device (the batches' sorts are the cost),
            # equal to a per-batch loop of link_metrics to the last bit.
            return batched_link_metrics(pos.to(dev), neg.to(dev), b)

        out[f"{split}_ap"], out[f"{split}_auc"] = per_batch(res.pos, res.neg)
        labels = torch.cat([torch.ones_like(res.pos), torch.zeros_like(res.neg)])
        out[f"{split}_ap_pooled"] = average_precision(
            torch.cat([res.pos, res.neg]).to(dev), labels.to(dev)
        )
        if split in inductive:
            m = inductive[split].to(res.pos.device)
            out[f"{split}_ap_inductive"], out[f"{split}_auc_inductive"] = per_batch(
                res.pos[m], res.neg[m]
            )
            out[f"{split}_inductive_events"] = int(m.sum())
        for name, neg in res.protocol_neg.items():
            # The other evaluation protocols: test_<protocol>neg_ap[_inductive] etc.
            p = f"{split}_{name}neg"
            out[f"{p}_ap"], out[f"{p}_auc"] = per_batch(res.pos, neg)
            if split in inductive:
                m = inductive[split].to(res.pos.device)
                out[f"{p}_ap_inductive"], out[f"{p}_auc_inductive"] = per_batch(res.pos[m], neg[m])
        if res.mrr_neg is not None:
            # The n x q comparisons on the run's device, not the host.
            out[f"{split}_mrr"] = mrr(res.pos.to(dev), res.mrr_neg.to(dev), res.mrr_valid)
        return out

    def graphs(self) -> list[StepGraph]:
        """Every evaluation graph made so far."""
        return [g for wd in self.widths.values() for g in wd.graphs]

    def state_dict(self) -> dict[str, Any]:
        """Empty: a pass starts from the node state and model it is given."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accepts the empty state; anything else is another evaluator's."""
        if state:
            raise ValueError(f"Evaluator has no state; got keys {sorted(state)}")
