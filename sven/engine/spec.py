"""How a run runs, decided once: :class:`RunSpec`, resolved from the config, the plan
(the node-state tier it chose) and the process group.

The step's parts (:class:`~sven.engine.step.Step`, its batch source, evaluation and
capacity planner) and the trainer read these facts from the one frozen description
they are handed; none reads the config's ``pipeline`` or ``train.cuda_graph`` itself,
and none asks again whether the run spans ranks at each call: an alternative that
depends on it (how rows are planned, whether capacities are measured) is chosen when
the part is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RunSpec", "fixed_shapes", "largest_share", "resolve_spec"]


@dataclass(frozen=True)
class RunSpec:
    """One frozen description of how a run runs.

    Attributes:
        device: Where this rank's step runs.
        rank: This rank r.
        world_size: P.
        distributed: Whether the run spans a process group (the P-rank step, its
            exchange and gradient bucket); true under a launcher even on one rank.
        fixed_shapes: Whether every step has static shapes: on CUDA, where a graph
            captures it, and across ranks, whose collectives move buffers of fixed
            sizes (on one CPU process an exact-size eager step computes less).
        capacity: Events of this rank's share of any global batch on a fixed-shape
            step (the largest share on P ranks, B on one process), None on the
            exact-size step.
        tier: The node-state tier (``gpu``, ``host`` or ``disk``).
        graph_mode: How the step runs (``train.cuda_graph``; ``off`` where node-state
            rows are staged through host copies, which synchronise every step).
        depth: Prefetch depth D (0 on the exact-size step).
        micro_batches: Parts a share is split into (1 on the exact-size step).
        staleness: Steps a write-back may be held for (0 on one process).
    """

    device: torch.device
    rank: int
    world_size: int
    distributed: bool
    fixed_shapes: bool
    capacity: int | None
    tier: str
    graph_mode: str
    depth: int
    micro_batches: int
    staleness: int


def fixed_shapes(device: torch.device, distributed: bool) -> bool:
    """Whether a step runs on static shapes: on CUDA, where a graph captures it, and
    across ranks, whose collectives move buffers of fixed sizes. (On one CPU process an
    exact-size eager step computes less.)"""
    return device.type == "cuda" or distributed


def largest_share(
    assign: torch.Tensor, ranges: Mapping[str, tuple[int, int]], batch_size: int, world_size: int
) -> int:
    """The most events any rank has of any global batch of any split (at least 1).

    Args:
        assign: (E,) rank of each event.
        ranges: Split -> [lo, hi) event range.
        batch_size: The global batch size B.
        world_size: P.
    """
    owner = assign.cpu().numpy()
    p, most = world_size, 1
    for lo, hi in ranges.values():
        if hi <= lo:
            continue
        batch = (np.arange(lo, hi) - lo) // batch_size
        per = np.bincount(batch * p + owner[lo:hi], minlength=(batch[-1] + 1) * p)
        most = max(most, int(per.max()))
    return most


def resolve_spec(
    cfg: Any,
    *,
    device: torch.device,
    rank: int,
    world_size: int,
    distributed: bool,
    tier: str,
    staged: bool,
    data: Any,
    log: Callable[[str], None],
) -> RunSpec:
    """The run's :class:`RunSpec`; notices of a setting that does not apply go to ``log``.

    Args:
        cfg: The run's config (``train``, ``pipeline``).
        device: This rank's device.
        rank: This rank.
        world_size: P.
        distributed: Whether a process group is up.
        tier: The node-state tier the storage resolved from the plan's.
        staged: Whether node-state rows travel through host copies each step
            (:attr:`~sven.models.storage.Storage.staged`).
        data: The run's data (``assign``, ``ranges``), loaded.
        log: Where notices go.
    """
    tc, pc = cfg.train, cfg.pipeline
    fixed = fixed_shapes(device, distributed)
    if distributed:
        capacity: int | None = largest_share(data.assign, data.ranges, tc.batch_size, world_size)
    else:
        capacity = tc.batch_size if fixed else None
    graph_mode = tc.cuda_graph
    if staged:
        if device.type == "cuda":
            log(
                "sven: node state is in files (state.device=disk): rows are staged "
                "through host copies each step, which runs uncaptured"
            )
        graph_mode = "off"
    # The pipeline's knobs act on fixed-shape steps (an exact-size eager step has
    # nothing to overlap and a share of no fixed size to split).
    depth = int(pc.prefetch) if fixed else 0
    m = 1 if pc.micro_batches == "auto" else int(pc.micro_batches)
    if not fixed or capacity is None:
        m = 1
    return RunSpec(
        device=device,
        rank=rank,
        world_size=world_size,
        distributed=distributed,
        fixed_shapes=fixed,
        capacity=capacity,
        tier=tier,
        graph_mode=graph_mode,
        depth=depth,
        micro_batches=max(1, min(m, capacity or 1)),
        staleness=pc.staleness if distributed else 0,
    )
