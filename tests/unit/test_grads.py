"""A step's gradients (sven.distributed.grads): the optimizer's own on one process, one
flat bucket summed in one all-reduce across ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sven.distributed.grads import GradBucket, LocalGrads


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(3))]


def test_local_grads_drop_the_gradients_and_sum_nothing() -> None:
    params = _params()
    grads = LocalGrads(torch.optim.SGD(params, lr=0.1))
    (params[0].sum() * 2).backward()
    grads.zero()
    assert params[0].grad is None
    loss = torch.tensor(0.5)
    assert grads.reduce(loss) is loss
    assert (grads.crosses_ranks, grads.bytes_per_step, grads.tensors()) == (False, 0, [])


def test_bucket_gradients_are_views_of_one_buffer() -> None:
    params = _params()
    bucket = GradBucket(params, None, world_size=4)
    # 7 gradients, the loss and the vote in float32; a ring sends 2 (P - 1) / P of it.
    assert bucket.flat.shape == (9,)
    assert bucket.bytes_per_step == 2 * 3 * 9 * 4 // 4
    (params[0].sum() * 2 + params[1].sum() * 3).backward()
    assert bucket.flat.tolist() == [2.0] * 4 + [3.0] * 3 + [0.0, 0.0]
    params[1].grad = torch.zeros(3)  # replaced (as an optimizer may): zero re-attaches
    bucket.zero()
    assert params[1].grad.data_ptr() == bucket.flat[4:7].data_ptr()
    assert bucket.flat.tolist() == [0.0] * 9


@pytest.fixture
def one_rank():
    """A process group of one rank, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bucket_sums_loss_and_votes_with_the_gradients(one_rank) -> None:
    params = _params()
    bucket = GradBucket(params, None, world_size=1)
    (params[1].sum() * 3).backward()
    bucket.set_vote(1)
    laps = []
    total = bucket.reduce(torch.tensor(0.25), lap=laps.append)
    assert (total.item(), laps) == (0.25, ["grad_allreduce"])
    assert bucket.flat.tolist() == [0.0] * 4 + [3.0] * 3 + [0.25, 1.0]
    counter = torch.zeros(5, dtype=torch.int64)
    status = torch.zeros(3, dtype=torch.float64)
    bucket.record(counter, status, torch.tensor([2, 0]))
    assert counter.tolist() == [0, 0, 0, 0, 0]  # one rank sends nothing
    assert status.tolist() == [1.0, 2.0, 0.0]
