"""Hot rows: copies in GPU memory of some nodes' state rows, read in place of the
tables' and written through (``MemoryState.keep_hot``), on both paths: the reference
(``MemoryState``'s own code) and the Triton kernels (``sven.kernels.triton_state``)."""

from __future__ import annotations

import pytest
import torch

from sven.models.memory import DenseUpdate, MemoryState
from tests.kernels.test_state_kernel import _FIELDS
from tests.kernels.test_state_kernel import _state as random_state
from tests.kernels.test_state_kernel import _update as random_update

_BACKENDS = ("reference", "triton")


def _state(device: str, n: int, m: int, seed: int, hot: list[int] | None = None) -> MemoryState:
    """Random tables (``test_state_kernel``'s), with copies of the rows ``hot``."""
    st = random_state(device, n, m, torch.float32, seed)
    if hot is not None:
        st.keep_hot(torch.tensor(hot, device=device))
    return st


def _update(device: str, n: int, p: int, seed: int, receivers: bool) -> DenseUpdate:
    """``test_state_kernel``'s random update; ``receivers``: its mail goes to other nodes
    than the memory's writers (APAN's neighbours), as there."""
    up = random_update(device, n, p, seed=seed, dtype=torch.float32)
    if receivers:
        other = random_update(device, n, p, seed=1000 + seed, dtype=torch.float32)
        up.mail_nodes, up.mail_key = other.nodes, other.key
    return up


def _copies_match(st: MemoryState) -> None:
    """Each hot row's copy equals its row in the tables."""
    hot = st.hot
    assert hot is not None
    for name in _FIELDS:
        assert torch.equal(hot.tables[name][: hot.count], st.full[name][hot.nodes]), name


def test_slots_hand_built(device):
    st = _state(device, 4, 1, seed=0, hot=[2, 0])
    assert st.hot.slot.tolist() == [1, 2, 0, 2, 2]
    assert st.hot.count == 2
    assert [tuple(t.shape) for t in st.hot.tables.values()] == [
        (3, 5), (3,), (3, 1, 7), (3, 1), (3, 1),
    ]  # fmt: skip
    _copies_match(st)
    # The copies are step state: a captured graph's warm-up saves and restores them.
    assert len(st.tensors()) == 10


@pytest.mark.parametrize("backend", _BACKENDS)
def test_hot_rows_are_read_from_their_copies(device, use_kernel, backend):
    """A copy made to differ from its row (never so in a run) shows which is read: the
    hot rows' copies, the other rows' tables."""
    use_kernel("state_gather", backend)
    st = _state(device, 6, 2, seed=1, hot=[4, 1])
    st.hot.tables["memory"][0] = 99.0  # node 4's copy
    st.hot.tables["mail_valid"][1] = True  # node 1's copy
    st.full["mail_valid"][1] = False
    rows = st.gather(torch.tensor([4, 3, 1, 6, 4], device=device))
    assert (rows.memory[[0, 4]] == 99.0).all()
    assert torch.equal(rows.memory[1], st.full["memory"][3])
    assert torch.equal(rows.memory[3], st.full["memory"][6])
    assert rows.mail_valid[2].tolist() == [True, True]
    assert torch.equal(rows.last_update[[0, 2]], st.full["last_update"][[4, 1]])


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("receivers", [False, True])
def test_commits_write_through(device, use_kernel, backend, m, receivers):
    """Commits into a state with hot rows leave its tables as they leave a state
    without, and every copy equal to its row; gathers read the same rows."""
    use_kernel("state_gather", backend, state_commit=backend)
    n = 41
    plain = _state(device, n, m, seed=2)
    hot = _state(device, n, m, seed=2, hot=[7, 0, 40, 13, 22, 5, 31])
    for seed in range(4):
        up = _update(device, n, 30, seed=seed, receivers=receivers)
        plain.commit_dense(up)
        hot.commit_dense(up)
        for name in _FIELDS:
            assert torch.equal(hot.full[name][:n], plain.full[name][:n]), (seed, name)
        _copies_match(hot)
    nodes = torch.tensor([0, 40, 41, 7, 3, 13, 13, 31, 1] * 4, device=device)
    want, got = plain.gather(nodes), hot.gather(nodes)
    for name in _FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_sparse_commit_writes_through(device):
    """``commit`` (a compacted update) keeps the copies too."""
    n = 12
    st = _state(device, n, 3, seed=3, hot=[1, 9, 4])
    up = _update(device, n, 8, seed=5, receivers=False)
    up.nodes = up.mail_nodes = torch.tensor([9, 2, 4, 7, 10, 11, 0, 3], device=device)
    up.key = up.mail_key = torch.arange(8, device=device)
    st.commit(up.compact())
    _copies_match(st)
    assert torch.equal(st.hot.tables["memory"][1], up.memory[0])


@pytest.mark.parametrize("backend", _BACKENDS)
def test_refresh_reads_stale_hot_rows_from_their_copies(device, use_kernel, backend):
    """Rows read ahead, then a commit: the refresh gives what a gather gives now, hot
    rows and others alike."""
    use_kernel("state_gather", backend, state_commit=backend)
    n = 20
    st = _state(device, n, 1, seed=7, hot=[3, 8, 15])
    st.track_writes()
    nodes = torch.tensor([3, 4, 8, 15, 16, 20, 3], device=device)
    early = st.read_ahead(nodes)
    up = _update(device, n, 4, seed=8, receivers=False)
    up.nodes = up.mail_nodes = torch.tensor([3, 4, 15, 19], device=device)
    up.key = up.mail_key = torch.tensor([1, 2, 3, 4], device=device)
    st.commit_dense(up)
    got = st.refresh(early, nodes)
    want = st.gather(nodes)
    for name in _FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.memory[[0, 3, 6]], up.memory[[0, 2, 0]])


def test_wholesale_changes_take_the_copies_again(device):
    """A reset zeroes the copies; a load, an assignment and ``invalidate()`` take them
    again from the tables; ``invalidate(tables=False)`` (rows read ahead only) leaves
    them; ``put_rows`` writes both."""
    n = 10
    st = _state(device, n, 1, seed=9, hot=[2, 6])
    st.reset()
    assert (st.hot.tables["memory"] == 0).all()
    assert (st.hot.tables["last_update"] == 1.5).all()
    src = _state(device, n, 1, seed=10)
    st.load_state_dict(src.state_dict())
    _copies_match(st)
    st.memory = torch.full((n, 5), 2.0, device=device)
    _copies_match(st)
    st.full["memory"][6] = 3.0
    st.invalidate(tables=False)
    assert (st.hot.tables["memory"][1] == 2.0).all()
    st.invalidate()
    _copies_match(st)
    rows = {name: src.full[name][[6, 1]].clone() for name in _FIELDS}
    st.put_rows(torch.tensor([6, 1], device=device), rows)
    _copies_match(st)
    assert torch.equal(st.full["memory"][1], src.full["memory"][1])


def test_keep_hot_refuses_bad_rows(device):
    st = _state(device, 5, 1, seed=11)
    with pytest.raises(ValueError, match="distinct"):
        st.keep_hot(torch.tensor([1, 3, 1], device=device))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        st.keep_hot(torch.tensor([5], device=device))
    st.keep_hot(torch.tensor([], dtype=torch.int64, device=device))
    assert st.hot is None


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("receivers", [False, True])
def test_writes_to_scratch_change_only_the_scratch_row(device, use_kernel, backend, receivers):
    """What a captured graph's warm-up commits (``writes_to_scratch``): the dense
    commit's kernels run, every candidate pointed at the scratch row, so the tables,
    their hot copies and the winners' buffer are as before; a sparse commit writes
    nothing; after the block commits write again."""
    use_kernel("state_gather", backend, state_commit=backend)
    n = 30
    st = _state(device, n, 3, seed=12, hot=[4, 9, 17])
    before = {name: t.clone() for name, t in st.full.items()}
    copies = {name: t.clone() for name, t in st.hot.tables.items()}
    up = _update(device, n, 12, seed=13, receivers=receivers)
    with st.writes_to_scratch():
        st.commit_dense(up)
        st.commit(up.compact())
    for name in _FIELDS:
        assert torch.equal(st.full[name][:n], before[name][:n]), name
        assert torch.equal(st.hot.tables[name][:3], copies[name][:3]), name
    # The kernels ran: the scratch row holds a candidate's memory now.
    assert not torch.equal(st.full["memory"][n], before["memory"][n])
    assert (st._best == -1).all()
    st.commit_dense(up)
    assert any(not torch.equal(st.full[k][:n], before[k][:n]) for k in _FIELDS)
    _copies_match(st)
