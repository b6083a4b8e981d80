"""The node state (sven.models.memory.MemoryState): the dense write-back and its winners."""

from __future__ import annotations

import pytest
import torch

from sven.models import MemoryState
from sven.models.memory import DenseUpdate

# Nodes of the state the updates write.
N = 7


def _random_dense(g: torch.Generator, p: int, q: int, d: int, dm: int) -> DenseUpdate:
    keys = torch.randperm(4 * p, generator=g)[:p]
    keys[torch.rand(p, generator=g) < 0.3] = -1
    mkeys = torch.randperm(4 * q, generator=g)[:q]
    mkeys[torch.rand(q, generator=g) < 0.3] = -1
    f64 = torch.float64
    return DenseUpdate(
        nodes=torch.randint(0, N, (p,), generator=g),
        memory=torch.randn(p, d, generator=g, dtype=f64),
        last_update=torch.rand(p, generator=g, dtype=f64),
        key=keys,
        mail_nodes=torch.randint(0, N, (q,), generator=g),
        mail=torch.randn(q, dm, generator=g, dtype=f64),
        mail_ts=torch.rand(q, generator=g, dtype=f64),
        mail_key=mkeys,
    )


@pytest.mark.parametrize("mailbox", [1, 3])
def test_commit_dense_equals_compact_commit(mailbox: int) -> None:
    g = torch.Generator().manual_seed(mailbox)
    a = MemoryState(N, 4, 6, mailbox, dtype=torch.float64)
    b = MemoryState(N, 4, 6, mailbox, dtype=torch.float64)
    for _ in range(6):
        up = _random_dense(g, 12, 20, 4, 6)
        a.commit_dense(up)
        b.commit(up.compact())
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k]), k


def test_winners_pick_the_largest_key_and_park_the_rest() -> None:
    mem = MemoryState(N, 2, 2)
    nodes = torch.tensor([3, 1, 3, 3, 1, 0])
    key = torch.tensor([8, 5, 12, -1, 2, -1])
    assert mem.winners(nodes, key).tolist() == [N, 1, 3, N, N, N]
