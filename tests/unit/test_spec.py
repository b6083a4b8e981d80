"""The run's description (:mod:`sven.engine.spec`), resolved once, on hand-built data."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sven.engine.spec import RunSpec, largest_share, resolve_spec


def _cfg(
    prefetch: int = 1, micro: str = "1", staleness: int = 0, graph: str = "auto"
) -> SimpleNamespace:
    return SimpleNamespace(
        train=SimpleNamespace(batch_size=4, cuda_graph=graph),
        pipeline=SimpleNamespace(prefetch=prefetch, micro_batches=micro, staleness=staleness),
    )


#: Ten events on two ranks, batches of 4: train [0, 8) holds batches of events 0-3 (rank
#: 0 has 3 of them) and 4-7 (rank 1 has 2); val [8, 10) one batch (one event each).
DATA = SimpleNamespace(
    assign=torch.tensor([0, 0, 1, 0, 1, 0, 1, 0, 0, 1]),
    ranges={"train": (0, 8), "val": (8, 10), "test": (10, 10)},
)


def _resolve(cfg: SimpleNamespace, **kw) -> tuple[RunSpec, list[str]]:
    said: list[str] = []
    args = dict(
        device=torch.device("cpu"), rank=0, world_size=1, distributed=False, tier="host",
        staged=False, data=DATA, log=said.append,
    )  # fmt: skip
    return resolve_spec(cfg, **{**args, **kw}), said


def test_largest_share_counts_each_rank_in_each_batch() -> None:
    assert largest_share(DATA.assign, DATA.ranges, 4, 2) == 3
    assert largest_share(DATA.assign, DATA.ranges, 2, 2) == 2
    # No event at all still leaves one slot.
    assert largest_share(DATA.assign, {"train": (0, 0)}, 4, 2) == 1


def test_one_cpu_process_runs_exact_sizes_without_the_pipeline() -> None:
    spec, said = _resolve(_cfg(prefetch=2, micro="2", staleness=1))
    assert (spec.fixed_shapes, spec.capacity, spec.distributed) == (False, None, False)
    assert (spec.depth, spec.micro_batches, spec.staleness) == (0, 1, 0)
    assert spec.graph_mode == "auto" and said == []


def test_ranks_pad_to_the_largest_share_and_keep_the_pipeline() -> None:
    spec, said = _resolve(
        _cfg(prefetch=2, micro="4", staleness=1), rank=1, world_size=2, distributed=True
    )
    assert (spec.fixed_shapes, spec.capacity) == (True, 3)
    # Four micro-batches of a share of three events: three.
    assert (spec.depth, spec.micro_batches, spec.staleness) == (2, 3, 1)
    assert (spec.rank, spec.world_size) == (1, 2) and said == []


def test_cuda_notices_disk_state_and_keeps_the_ring_over_host_state() -> None:
    cuda = torch.device("cuda")  # resolved, never touched
    spec, said = _resolve(_cfg(prefetch=1, micro="2"), device=cuda, tier="gpu")
    assert (spec.capacity, spec.depth, spec.micro_batches, spec.graph_mode) == (4, 1, 2, "auto")
    assert said == []
    # Host state keeps the ring (the capture's snapshot no longer races its warm-up).
    spec, said = _resolve(_cfg(prefetch=1), device=cuda, tier="host")
    assert spec.depth == 1 and said == []
    spec, said = _resolve(_cfg(prefetch=1, graph="on"), device=cuda, tier="disk", staged=True)
    assert (spec.graph_mode, spec.depth) == ("off", 1)
    assert len(said) == 1 and "runs uncaptured" in said[0]


def test_the_description_is_frozen() -> None:
    spec, _ = _resolve(_cfg())
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.depth = 3  # type: ignore[misc]
