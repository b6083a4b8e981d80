"""The pure bodies of a step: train, evaluate, encode.

Each body takes its parts explicitly (model, optimizer, exchange, the batch built
before it) and keeps nothing between calls, so that it can run eagerly, be captured as
a CUDA graph or be split into micro-batches without the run loop knowing:

    exchange.fetch (the batch's node-state rows) -> model -> exchange.push (the
    write-back) -> [backward -> gradient all-reduce -> optimizer] -> exchange.wait.

The exchange is where node state lives (:mod:`sven.pipeline.exchange`: the whole state
of one process, or the owners' shards across P ranks); the bodies never know which.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from sven import kernels
from sven.distributed.grads import Gradients, LocalGrads
from sven.models import MemoryModel, MemoryState
from sven.models.base import ModelOutput
from sven.models.memory import DenseUpdate, EarlyRows, MemoryRows
from sven.pipeline import constants
from sven.pipeline.batch import Batch
from sven.pipeline.exchange_api import Exchange, FetchPlan, LocalExchange

__all__ = ["StepInput", "encode_step", "eval_step", "masked_bce", "mean_bce", "train_step"]

T = TypeVar("T")


def masked_bce(out: ModelOutput, valid: torch.Tensor | None) -> torch.Tensor:
    """Sum of the BCE of the positives (label 1) and negatives (label 0), real events only.

    Args:
        out: Logits (B,) and (B, n).
        valid: (B,) bool real-event mask, or None.

    Returns:
        () the summed loss (divide by the global prediction count for the mean).
    """
    # BCE with logits is softplus(-x) against label 1 and softplus(x) against label 0:
    # one softplus over both columns, a few kernels each way where two general BCE
    # losses (label fills, stable log-sum-exp) ran about 28 in a step bound by its
    # kernel count. softplus returns x itself past x = 20, where log1p(exp(-x)) < 3e-9.
    loss = F.softplus(torch.cat([-out.pos[:, None], out.neg], 1))
    if valid is not None:
        # A product, not indexing: padded rows are finite (they repeat a real event),
        # and the shape stays fixed.
        loss = loss * valid.to(loss.dtype)[:, None]
    return loss.sum()


def mean_bce(
    out: ModelOutput, valid: torch.Tensor | None, denom: float | torch.Tensor
) -> torch.Tensor:
    """``masked_bce(out, valid) / denom``: one kernel each way where Triton runs it
    (``kernels.triton_loss``, float32 scores), the reference's few otherwise.

    Args:
        out: Logits (B,) and (B, n).
        valid: (B,) bool real-event mask, or None.
        denom: The global prediction count (a float or a 0-d device tensor).

    Returns:
        () the loss.
    """
    if out.pos.dtype == torch.float32 and kernels.backend_for(out.pos, "bce_loss") == "triton":
        from sven.kernels.triton_loss import bce_loss

        return bce_loss(out.pos, out.neg, valid, denom)
    return masked_bce(out, valid) / denom


@dataclass
class StepInput:
    """One rank's share of a global batch, built (and its ids planned) before its step.

    Attributes:
        micro: The m micro-batches of the share (one when not split).
        plan: Where the rows come from: the exchange's plan of the share's distinct
            nodes (several ranks), their ids (one process), or None (``micro[0]``
            is fetched as it is).
        at: Per micro-batch, (U_j,) positions of its nodes among the planned nodes, or
            None when there is one micro-batch.
        early: The rows of the planned nodes read ahead (the prefetch ring's, with
            node state in host memory: :mod:`sven.models.readahead`), or None: the
            step reads them.
    """

    micro: list[Batch]
    plan: FetchPlan | torch.Tensor | None = None
    at: list[torch.Tensor] | None = None
    early: EarlyRows | None = None

    @property
    def source(self) -> Batch | FetchPlan | torch.Tensor:
        """What the exchange fetches: the plan, or the one batch itself."""
        return self.plan if self.plan is not None else self.micro[0]


def _exchange(exchange: Exchange | MemoryState) -> Exchange:
    # A bare MemoryState is the whole node state of one process.
    return LocalExchange(exchange) if isinstance(exchange, MemoryState) else exchange


def _with_rows(batch: Batch, rows: MemoryRows) -> Batch:
    if rows.node_feat is None:
        return batch
    # A copy of the batch: the built one stays as built (a prefetch ring refills it in
    # place).
    return dataclasses.replace(batch, node_feat=rows.node_feat)


def backward_from(loss: torch.Tensor, seed: torch.Tensor) -> None:
    """``loss.backward(seed)`` without ``torch.autograd.backward``'s checks of the seed.

    Given a seed tensor, those checks import ``torch.fx.experimental.symbolic_shapes``
    and with it sympy and mpmath, the largest imports of a run's start-up
    (docs/performance.md has the figures), for a () seed whose shape is known. The
    engine call is what ``backward`` makes after them; under ``torch.compile`` (which
    traces its own backward) and on a torch without it, ``backward`` itself.

    Args:
        loss: () the loss.
        seed: () its gradient, of its dtype and device.
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None or torch.compiler.is_compiling():
        loss.backward(seed)
        return
    run((loss,), (seed,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def train_step(
    model: MemoryModel,
    optimizer: torch.optim.Optimizer,
    exchange: Exchange | MemoryState,
    batch: Batch | StepInput,
    num_predictions: float | torch.Tensor,
    lap: Callable[[str], None] | None = None,
    *,
    grads: Gradients | None = None,
    vote: torch.Tensor | None = None,
) -> torch.Tensor:
    """One optimisation step of one rank: read, forward, backward, all-reduce, step,
    write back.

    Args:
        model: The model (put in training mode here).
        optimizer: Its optimizer.
        exchange: Where node-state rows come from and go to (a ``MemoryState`` is the
            whole state of one process).
        batch: The rank's share of the batch, or its micro-batches with their plan;
            padded events (``batch.valid``) count for nothing.
        num_predictions: Predictions of the whole global batch's real events,
            B * (1 + n); a float or a 0-d device tensor. Every rank divides by it, so
            the ranks' gradients sum to the one-process gradient.
        lap: Called with the name of each stage as it ends (``row_fetch``,
            ``compute``, ``grad_allreduce``, ``optimizer``, ``write_back``;
            :class:`sven.engine.timeline.Timeline`); None inside a captured graph, which
            a lap would break.
        grads: How gradients are zeroed and summed (the bucket on several ranks);
            None: the optimizer's own, on one process (:class:`LocalGrads`).
        vote: () this rank's stop vote, summed with the gradients across ranks; None:
            the one ``grads`` holds.

    Returns:
        () the global batch's mean loss (summed over ranks), detached, on the device
        (not read back).
    """
    lap = lap or _no_lap
    ex = _exchange(exchange)
    inp = batch if isinstance(batch, StepInput) else StepInput([batch])
    model.train()
    # A bare call (tests, scripts) trains on one process; the step passes its own.
    grads = grads if grads is not None else LocalGrads(optimizer)
    grads.zero()
    fetched = ex.fetch(inp.source, "train", inp.early)
    lap("row_fetch")
    loss_sum: torch.Tensor | float = 0.0
    dense: list[DenseUpdate] = []
    last = len(inp.micro) - 1
    for j, mb in enumerate(inp.micro):
        rows = fetched if inp.at is None else _take_rows(fetched, inp.at[j])
        out = model(_with_rows(mb, rows), rows)
        loss = mean_bce(out, mb.valid, num_predictions)
        dense.append(out.dense)
        if j == last:
            # The write-back needs only the forward's detached values: it goes out now
            # and overlaps the backward, the all-reduce and the optimizer.
            ex.push(dense[0] if len(dense) == 1 else _cat_dense(dense), "train")
            lap("write_back")
        # The seed gradient a kept constant, where backward() would fill a new one.
        backward_from(loss, constants.filled(1.0, (), loss.dtype, loss.device))
        loss_sum = loss.detach() if j == 0 else loss_sum + loss.detach()
    lap("compute")
    total = grads.reduce(torch.as_tensor(loss_sum), vote, lap)
    optimizer.step()
    lap("optimizer")
    ex.wait()
    lap("write_back")
    return total.detach()


def _read_compute_write(
    exchange: Exchange | MemoryState,
    batch: Batch,
    source: Batch | FetchPlan | torch.Tensor | None,
    mode: str,
    compute: Callable[[Batch, MemoryRows], tuple[T, DenseUpdate]],
    early: EarlyRows | None = None,
) -> T:
    """Reads a batch's rows (or refreshes those read ahead), computes, and commits the
    write-back before returning (the synchronous commit of evaluation and encoding)."""
    ex = _exchange(exchange)
    rows = ex.fetch(batch if source is None else source, mode, early)
    result, dense = compute(_with_rows(batch, rows), rows)
    ex.push(dense, mode)
    ex.wait()
    return result


@torch.no_grad()
def eval_step(
    model: MemoryModel,
    exchange: Exchange | MemoryState,
    batch: Batch,
    *,
    plan: FetchPlan | torch.Tensor | None = None,
    mode: str = "eval",
    early: EarlyRows | None = None,
) -> ModelOutput:
    """Scores a batch without gradients and writes its memory update (synchronously).

    Args:
        model: The model (put in evaluation mode here).
        exchange: Where node-state rows come from and go to (a ``MemoryState``: the
            whole state of one process).
        batch: The batch.
        plan: Its rows' plan, made beforehand (:class:`StepInput`), or None.
        mode: Whose exchange capacities (an evaluation width's).
        early: Its rows read ahead (:class:`StepInput`), or None.

    Returns:
        The model output (logits of every slot, padded ones included).
    """
    model.eval()

    def compute(b: Batch, rows: MemoryRows) -> tuple[ModelOutput, DenseUpdate]:
        out = model(b, rows)
        return out, out.dense

    return _read_compute_write(exchange, batch, plan, mode, compute, early)


@torch.no_grad()
def encode_step(
    model: MemoryModel,
    exchange: Exchange,
    item: StepInput,
    mode: str,
) -> torch.Tensor:
    """Embeds a batch's roots without gradients and writes its memory update.

    Args:
        model: The model (put in evaluation mode by the caller).
        exchange: Where node-state rows come from and go to.
        item: The batch (one micro-batch) with its plan.
        mode: Whose exchange capacities.

    Returns:
        (R, embed_dim) the roots' embeddings (:meth:`MemoryModel.encode`).
    """
    return _read_compute_write(exchange, item.micro[0], item.plan, mode, model.encode, item.early)


def _fields(obj: object) -> list[Any]:
    # Not dataclasses.astuple: it deep-copies every tensor.
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]


def _take_rows(rows: MemoryRows, at: torch.Tensor) -> MemoryRows:
    return MemoryRows(*[None if x is None else x[at] for x in _fields(rows)])


def _cat_dense(parts: list[DenseUpdate]) -> DenseUpdate:
    """The micro-batches' write-back candidates as one batch's (a node written by
    several micro-batches keeps its last event's row: the keys decide)."""
    return DenseUpdate(*[torch.cat(col) for col in zip(*[_fields(p) for p in parts])])


def _no_lap(stage: str) -> None:
    pass
