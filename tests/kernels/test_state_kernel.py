"""The node state's gather and write-back kernels (``sven.kernels.triton_state``) against
``MemoryState``'s own code, the reference."""

from __future__ import annotations

import pytest
import torch

from sven.models.memory import DenseUpdate, MemoryState


def _state(device: str, n: int, m: int, dtype: torch.dtype, seed: int) -> MemoryState:
    st = MemoryState(n, 5, 7, mailbox_size=m, device=device, dtype=dtype, time_origin=1.5)
    g = torch.Generator().manual_seed(seed)
    for t in st.full.values():
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=g) < 0.5)
        else:
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64))
    return st


def _copy(st: MemoryState) -> MemoryState:
    out = MemoryState(
        st.num_nodes, st.memory_dim, st.mail_dim, st.mailbox_size, st.device, st.dtype
    )
    for name, t in st.full.items():
        out.full[name].copy_(t)
    return out


def _update(device: str, n: int, p: int, seed: int, dtype: torch.dtype) -> DenseUpdate:
    g = torch.Generator().manual_seed(seed)
    nodes = torch.randint(0, n + 1, (p,), generator=g)
    key = torch.randperm(10 * p, generator=g)[:p]
    key[torch.rand(p, generator=g) < 0.2] = -1
    return DenseUpdate(
        nodes=nodes.to(device),
        memory=torch.randn(p, 5, generator=g, dtype=torch.float64).to(device, dtype),
        last_update=torch.rand(p, generator=g, dtype=torch.float64).to(device),
        key=key.to(device),
        mail_nodes=nodes.to(device),
        mail=torch.randn(p, 7, generator=g, dtype=torch.float64).to(device, dtype),
        mail_ts=torch.rand(p, generator=g, dtype=torch.float64).to(device),
        mail_key=key.to(device),
    )


def _assert_same(a: MemoryState, b: MemoryState) -> None:
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name


def _commit_both(ref: MemoryState, tri: MemoryState, up: DenseUpdate, use_kernel) -> None:
    """Commits ``up`` with the reference into ``ref`` and the kernel into ``tri``; the
    two states must be equal and the kernel's winners' buffer back to -1."""
    use_kernel("state_commit", "reference")
    ref.commit_dense(up)
    use_kernel("state_commit", "triton")
    tri.commit_dense(up)
    _assert_same(ref, tri)
    assert (tri._best == -1).all()


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gather_equals_indexing(device, use_kernel, m, dtype):
    st = _state(device, 37, m, dtype, seed=m)
    nodes = torch.tensor([0, 36, 37, 5, 5, 12, 37, 1] * 9, device=device)
    use_kernel("state_gather", "reference")
    want = st.gather(nodes)
    use_kernel("state_gather", "triton")
    got = st.gather(nodes)
    for name in ("memory", "last_update", "mail", "mail_ts", "mail_valid"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == getattr(want, name).dtype


@pytest.mark.parametrize("programs", [1, 2, 3, 9, 100])
def test_gather_on_a_capped_grid_reads_every_row(device, use_kernel, programs):
    # 72 rows are 3 blocks of 32: fewer programs loop over them (1, 2: one program
    # takes two or three blocks), more than the blocks run one each.
    st = _state(device, 37, 3, torch.float32, seed=8)
    nodes = torch.tensor([0, 36, 37, 5, 5, 12, 37, 1] * 9, device=device)
    want = tuple(t[nodes] for t in (st.full[name] for name in _FIELDS))
    use_kernel("state_gather", "triton")
    got = st.gather(nodes, programs=programs)
    for name, w in zip(_FIELDS, want):
        assert torch.equal(getattr(got, name), w), (programs, name)


def test_read_ahead_takes_its_program_cap_from_the_environment(monkeypatch):
    from sven.models.readahead import ahead_programs

    monkeypatch.delenv("SVEN_AHEAD_PROGRAMS", raising=False)
    assert ahead_programs() == 0
    monkeypatch.setenv("SVEN_AHEAD_PROGRAMS", "24")
    assert ahead_programs() == 24
    for bad in ("-1", "many", "2.5"):
        monkeypatch.setenv("SVEN_AHEAD_PROGRAMS", bad)
        with pytest.raises(ValueError, match="SVEN_AHEAD_PROGRAMS"):
            ahead_programs()


def test_commit_hand_built(device, use_kernel):
    """Node 2 has two candidates (keys 5 and 7): the later one's rows land; key -1 writes
    nothing; every node's maximum is back at -1."""
    use_kernel("state_commit", "triton")
    st = MemoryState(4, 2, 1, device=device)
    up = DenseUpdate(
        nodes=torch.tensor([2, 2, 1, 3], device=device),
        memory=torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]], device=device),
        last_update=torch.tensor([10.0, 20.0, 30.0, 40.0], device=device, dtype=torch.float64),
        key=torch.tensor([5, 7, 1, -1], device=device),
        mail_nodes=torch.tensor([], device=device),
        mail=torch.tensor([[9.0], [8.0], [7.0], [6.0]], device=device),
        mail_ts=torch.tensor([1.0, 2.0, 3.0, 4.0], device=device, dtype=torch.float64),
        mail_key=torch.tensor([], device=device),
    )
    up.mail_nodes, up.mail_key = up.nodes, up.key
    st.commit_dense(up)
    assert st.memory.tolist() == [[0, 0], [3, 3], [2, 2], [0, 0]]
    assert st.last_update.tolist() == [0.0, 30.0, 20.0, 0.0]
    assert st.mail[:, 0, 0].tolist() == [0.0, 7.0, 8.0, 0.0]
    assert st.mail_ts[:, 0].tolist() == [0.0, 3.0, 2.0, 0.0]
    assert st.mail_valid[:, 0].tolist() == [False, True, True, False]
    assert (st._best == -1).all()


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("receivers", ["writers", "others"])
def test_commit_equals_reference(device, use_kernel, m, dtype, receivers):
    n = 53
    ref = _state(device, n, m, dtype, seed=7)
    tri = _copy(ref)
    for step in range(3):
        up = _update(device, n, 300, seed=step, dtype=torch.float64)
        if receivers == "others":
            # APAN: the mail goes to other nodes than the memory's writers.
            other = _update(device, n, 300, seed=100 + step, dtype=torch.float64)
            up.mail_nodes, up.mail_key = other.nodes, other.key
        _commit_both(ref, tri, up, use_kernel)


@pytest.mark.parametrize("m", [1, 10])
def test_commit_wide_rows_many_writers_per_node(device, use_kernel, m):
    # A training batch's shape: 400 writers on 60 nodes, mails of 35 columns (a row
    # spans several thread groups on the GPU), one mail per node (TGN) or APAN's queue
    # of 10. Every column of each winner's row must land, and the queue move by one
    # slot exactly, on every repetition: the winner resets its node's maximum only
    # after all of its program's reads of it, and each slot is read before it is
    # written.
    n, p = 60, 400
    g = torch.Generator().manual_seed(3)
    ref = MemoryState(n, 16, 35, mailbox_size=m, device=device)
    tri = MemoryState(n, 16, 35, mailbox_size=m, device=device)
    for rep in range(20 if device == "cuda" else 2):
        nodes = torch.randint(0, n, (p,), generator=g).to(device)
        up = DenseUpdate(
            nodes=nodes,
            memory=torch.randn(p, 16, generator=g).to(device),
            last_update=torch.rand(p, generator=g, dtype=torch.float64).to(device),
            key=(torch.randperm(p, generator=g) + rep * p).to(device),
            mail_nodes=nodes,
            mail=torch.randn(p, 35, generator=g).to(device),
            mail_ts=torch.rand(p, generator=g, dtype=torch.float64).to(device),
            mail_key=None,  # set below: the same tensor as key (one set of winners)
        )
        up.mail_key = up.key
        _commit_both(ref, tri, up, use_kernel)


_FIELDS = ("memory", "last_update", "mail", "mail_ts", "mail_valid")


@pytest.mark.parametrize("receivers", ["writers", "others"])
def test_commit_stamps_like_the_reference(device, use_kernel, receivers):
    """With a write log the kernel commit takes the same numbers as the reference and
    stamps every winner's row: the rows either stamps as written since a number are
    the same (the reference also stamps the scratch row, for its losers)."""
    n = 41
    ref = _state(device, n, 2, torch.float32, seed=2)
    tri = _copy(ref)
    for st in (ref, tri):
        st.track_writes()
    for step in range(3):
        up = _update(device, n, 200, seed=10 + step, dtype=torch.float64)
        if receivers == "others":
            other = _update(device, n, 200, seed=50 + step, dtype=torch.float64)
            up.mail_nodes, up.mail_key = other.nodes, other.key
        _commit_both(ref, tri, up, use_kernel)
        assert torch.equal(ref.log.counter, tri.log.counter)
        written = tri.log.stamp[:n] == tri.log.counter
        assert torch.equal(written, ref.log.stamp[:n] == ref.log.counter)
        # Exactly the nodes with a winning candidate (a key >= 0) among the receivers.
        real = up.key >= 0
        want = torch.zeros(n + 1, dtype=torch.bool, device=device)
        want[up.nodes[real]] = True
        want[up.mail_nodes[up.mail_key >= 0]] = True
        assert torch.equal(written, want[:n])


@pytest.mark.parametrize("m", [1, 3])
def test_refresh_reads_again_only_the_rows_written_since(device, use_kernel, m):
    """Rows read ahead, then a commit: the refresh gives what a gather gives now, and
    leaves alone the rows no commit wrote since (poisoned here, to see which are read
    again)."""
    n = 37
    st = _state(device, n, m, torch.float32, seed=4)
    st.track_writes()
    nodes = torch.tensor([0, 36, 37, 5, 5, 12, 1, 30] * 5, device=device)
    for j, backend in enumerate(("reference", "triton")):
        use_kernel("state_gather", backend, state_commit=backend)
        # Read ahead after a commit that wrote nodes 30 and 2, then another commit
        # writes nodes 5 and 12.
        for seed, written in ((1, [30, 2]), (2, [5, 12])):
            up = _update(device, n, 2, seed=seed + 10 * j, dtype=torch.float64)
            up.nodes = up.mail_nodes = torch.tensor(written, device=device)
            up.key = up.mail_key = torch.tensor([3, 9], device=device)
            if seed == 2:
                early = st.read_ahead(nodes)
            st.commit_dense(up)
        # Read again: the rows written since the read, not those of the commit over
        # before it (node 30's).
        since = stale = (nodes == 5) | (nodes == 12)
        want = st.gather(nodes)
        # As read, the rows of nodes 5 and 12 are the old ones.
        assert not torch.equal(early.rows.memory[since], want.memory[since])
        # The rows nobody wrote since, poisoned: a refresh that read them again would
        # put the state's values back.
        for name in _FIELDS:
            t = getattr(early.rows, name)
            t[~stale] = True if t.dtype == torch.bool else -7.0
        got = st.refresh(early, nodes)
        for name in _FIELDS:
            g, w = getattr(got, name), getattr(want, name)
            assert torch.equal(g[stale], w[stale]), (backend, name)
            assert (g[~stale] == (True if g.dtype == torch.bool else -7.0)).all(), (backend, name)


def test_refresh_after_a_reset_reads_every_row(device, use_kernel):
    """A wholesale change (here a reset) after the read: every row is read again."""
    st = _state(device, 20, 1, torch.float32, seed=6)
    st.track_writes()
    nodes = torch.arange(21, device=device)
    for backend in ("reference", "triton"):
        use_kernel("state_gather", backend)
        early = st.read_ahead(nodes)
        st.reset()
        got = st.refresh(early, nodes)
        assert torch.equal(got.memory, torch.zeros_like(got.memory)), backend
        assert torch.equal(got.last_update, torch.full_like(got.last_update, 1.5)), backend
