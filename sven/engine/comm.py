"""The exchange's predicted bytes: the partition cost model replayed with this run's
sampler, row widths and access pattern (epoch 0's measured bytes must equal it)."""

from __future__ import annotations

from typing import Any

import torch

from sven.engine.data import Data
from sven.models import MemoryModel
from sven.pipeline.exchange import FixedExchange

__all__ = ["comm_report", "predict_comm"]


def predict_comm(
    cfg: Any, data: Data, model: MemoryModel, exchange: FixedExchange
) -> dict[str, Any]:
    """The partition cost model's prediction of epoch 0's exchange, per rank.

    Computed with the runtime's own sampler, row widths and the model's access
    pattern (which roots are sampled, whether neighbours are read or get mail), so
    that the measured bytes of epoch 0 must equal it exactly.
    """
    report = comm_report(cfg, data, model, exchange)
    return {
        "comm_bytes_predicted_epoch0_per_rank": report.bytes_sent.tolist(),
        "comm_bytes_naive_predicted_epoch0_per_rank": report.naive_bytes.tolist(),
        "comm_max_over_mean_predicted": float(
            report.bytes_sent.max() / max(report.bytes_sent.mean(), 1.0)
        ),
    }


def comm_report(
    cfg: Any, data: Data, model: MemoryModel, exchange: FixedExchange, per_batch: bool = False
) -> Any:
    """The cost model's replay of epoch 0 (:func:`sven.partition.cost.comm_cost`) with
    this run's sampler, row widths and access pattern; ``per_batch`` keeps the counts of
    every batch (``report.batches``)."""
    from sven.partition.access import Access
    from sven.partition.cost import comm_cost
    from sven.partition.report import RowBytes
    from sven.pipeline.wire import ID_BYTES

    tc = cfg.train
    lo, hi = data.ranges["train"]
    if tc.max_batches:
        hi = min(hi, lo + tc.max_batches * tc.batch_size)
    sampler = None
    if data.sampler is not None:
        smp = data.sampler

        def sampler(
            nodes: torch.Tensor, times: torch.Tensor, keys: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            dev = data.device
            block = smp.sample(nodes.to(dev), times.to(dev), keys=keys.to(dev))[0]
            return block.nbr.cpu(), block.mask.cpu()

    ev = data.events
    report = comm_cost(
        ev.src,
        ev.dst,
        ev.t,
        data.owner.cpu().numpy(),
        data.assign.cpu().numpy(),
        batch_size=tc.batch_size,
        k=cfg.model.num_neighbors if sampler else 0,
        num_neg=tc.num_neg,
        seed=tc.seed,
        epoch=0,
        start=lo,
        stop=hi,
        parts=data.world_size,
        candidates=data.candidates.cpu().numpy(),
        sampler=sampler,
        access=Access.of(model),
        widths=RowBytes(
            read=exchange.read_codec.row_bytes,
            write=exchange.write_codec.row_bytes,
            id=ID_BYTES,
        ),
        per_batch=per_batch,
    )
    return report
