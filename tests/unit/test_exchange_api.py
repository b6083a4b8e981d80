"""The exchange's interface (sven.pipeline.exchange_api): how often a batch reads each
node, and the exchange of one process, where every row is local."""

from __future__ import annotations

import torch

from sven.models.memory import MemoryState
from sven.pipeline.batch import make_batch
from sven.pipeline.exchange_api import LocalExchange, read_occurrences
from sven.pipeline.sampler import TCSR, TemporalSampler

# Two events: 0 -> 2 (negative 3) and 1 -> 2 (negative 4).
INDEX, SRC, DST, T, NEG = (
    torch.tensor([0, 1]),
    torch.tensor([0, 1]),
    torch.tensor([2, 2]),
    torch.tensor([1.0, 2.0]),
    torch.tensor([[3], [4]]),
)


def test_occurrences_count_the_roots_of_real_events() -> None:
    batch = make_batch(INDEX, SRC, DST, T, NEG)
    assert batch.nodes.tolist() == [0, 1, 2, 3, 4]
    assert read_occurrences(batch).tolist() == [1, 1, 2, 1, 1]
    # The second event is padding: its roots are read by nothing.
    padded = make_batch(INDEX, SRC, DST, T, NEG, valid=torch.tensor([True, False]), pad_node=5)
    assert padded.nodes.tolist() == [0, 1, 2, 3, 4, 5]
    assert read_occurrences(padded).tolist() == [1, 0, 1, 1, 0, 0]


def test_occurrences_count_sampled_neighbours_not_masked_slots() -> None:
    # Earlier events 0-1 (t 1), 1-2 (t 2), 0-2 (t 3); the batch: 0 -> 3 at t 5, negative 1.
    graph = TCSR.from_events(
        torch.tensor([0, 1, 0]), torch.tensor([1, 2, 2]), torch.tensor([1.0, 2.0, 3.0]), 4
    )
    sampler = TemporalSampler(graph, [2], "recent")
    batch = make_batch(
        torch.tensor([3]),
        torch.tensor([0]),
        torch.tensor([3]),
        torch.tensor([5.0]),
        torch.tensor([[1]]),
        sampler=sampler,
    )
    # Roots 0, 3, 1; 0's neighbours 2 and 1, 3 has none (two masked slots), 1's are 2, 0.
    assert batch.block.mask.tolist() == [[True, True], [False, False], [True, True]]
    assert read_occurrences(batch).tolist() == [2, 2, 2, 1]


def test_local_exchange_owns_every_row() -> None:
    memory = MemoryState(3, 2, 2)
    memory.memory[:3] = torch.arange(6.0).view(3, 2)
    ex = LocalExchange(memory)
    # Every vertex on rank 0, the padding id (3) on rank 1.
    assert ex.owners().tolist() == [0, 0, 0, 1]
    # Id 3 is the padding slot: its row is the scratch row.
    assert ex.fetch(torch.tensor([2, 0, 3])).memory.tolist() == [[4, 5], [0, 1], [0, 0]]
    assert (ex.distributed, ex.state_dict(), ex.epoch_bytes()) == (False, {}, {})
