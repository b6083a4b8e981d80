"""Rows read ahead by a host thread for the copy engine (``sven.models.copyahead``), on
hand-built states: the rows a job reads, before or after a commit, are made exact by the
step's refresh; misuse is refused. On the CPU (the job's copy is a host copy); the
same on CUDA with pinned host state, in the GPU suite."""

from __future__ import annotations

import pytest
import torch

from sven.models.memory import DenseUpdate, MemoryState
from sven.models.storage import Storage

_FIELDS = ("memory", "last_update", "mail", "mail_ts", "mail_valid")


def _state(device: str, n: int = 9) -> MemoryState:
    """N = 9 nodes of width 3 (mail 4), mailbox 1, every value distinct; the host tier
    (pinned on CUDA)."""
    dev = torch.device(device)
    st = MemoryState(n, 3, 4, device=dev, storage=Storage("host", dev), time_origin=0.0)
    for i, t in enumerate(st.full.values()):
        if t.dtype == torch.bool:
            t.fill_(False)
        else:
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + 100 * i)
    st.invalidate()
    return st


def _update(device: str, nodes: list[int], value: float) -> DenseUpdate:
    """Writes ``value`` into the memory and mail of ``nodes``, keys in order."""
    p = len(nodes)
    idx = torch.tensor(nodes, device=device)
    key = torch.arange(p, device=device)
    return DenseUpdate(
        nodes=idx,
        memory=torch.full((p, 3), value, device=device),
        last_update=torch.full((p,), value, dtype=torch.float64, device=device),
        key=key,
        mail_nodes=idx,
        mail=torch.full((p, 4), value, device=device),
        mail_ts=torch.full((p,), value, dtype=torch.float64, device=device),
        mail_key=key,
    )


def _same(got, want, label: str) -> None:
    for name in _FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), (label, name)


def _commit(st: MemoryState, nodes: list[int], value: float) -> None:
    st.commit_dense(_update(str(st.device), nodes, value))


def _devices() -> list[str]:
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("job_first", [True, False])
def test_rows_a_job_reads_are_exact_after_the_refresh(device: str, job_first: bool) -> None:
    """Rows requested, then a commit writes some of them before or after the job reads
    (the job joined first, or launched after the commit): the refresh gives what a
    gather gives now, and without the commit the rows are the state's as they were."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    st = _state(device)
    st.track_writes(copy=True)
    assert st.copier is not None
    nodes = torch.tensor([4, 0, 9, 2, 7, 9], device=device)
    before = st.gather(nodes)
    early = st.read_ahead(nodes, key=("train", 0))
    if job_first:
        st.copier.launch(("train", 0))
        st.copier.wait(("train", 0))
        # As read: the state before the commit.
        _same(early.rows, before, "as read")
        _commit(st, [2, 7], 5.0)
    else:
        _commit(st, [2, 7], 5.0)
        st.copier.launch(("train", 0))
        st.copier.wait(("train", 0))
    got = st.refresh(early, nodes)
    want = st.gather(nodes)
    assert not torch.equal(want.memory, before.memory)
    _same(got, want, "refreshed")
    st.close()


@pytest.mark.parametrize("device", _devices())
def test_a_slot_is_filled_again_at_each_request(device: str) -> None:
    """One key, three requests of other nodes: each launch refills the same buffers
    (the ring's position keeps its tensors), a wipe in between included."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    st = _state(device)
    st.track_writes(copy=True)
    key = ("train", 1)
    first = None
    for j, ids in enumerate(([1, 2, 3], [9, 8, 0], [5, 5, 6])):
        nodes = torch.tensor(ids, device=device)
        early = st.read_ahead(nodes, key)
        first = first if first is not None else early.rows.memory
        assert early.rows.memory is first
        if j == 1:
            st.reset()
        st.copier.launch(key)
        st.copier.wait(key)
        _same(st.refresh(early, nodes), st.gather(nodes), f"request {j}")
    st.close()


def test_misuse_is_refused() -> None:
    """A wait for rows never launched, a launch without a request, another size under
    one key: each a clear error, not rows of another batch."""
    st = _state("cpu")
    st.track_writes(copy=True)
    c = st.copier
    with pytest.raises(RuntimeError, match="launched without a request"):
        c.launch("k")
    st.read_ahead(torch.tensor([1, 2]), "k")
    with pytest.raises(RuntimeError, match="used before its rows were read"):
        c.wait("k")
    with pytest.raises(ValueError, match="3 ids against 2"):
        st.read_ahead(torch.tensor([1, 2, 3]), "k")
    # Without a key the rows are gathered at once (evaluation's rings).
    early = st.read_ahead(torch.tensor([3, 4]))
    _same(early.rows, st.gather(torch.tensor([3, 4])), "no key")
    st.close()


def test_a_job_error_reaches_the_step(monkeypatch) -> None:
    """A job that fails raises its error where the step waits for its rows."""
    st = _state("cpu")
    st.track_writes(copy=True)

    def broken(self, slot) -> None:
        raise OSError("host read failed")

    monkeypatch.setattr(type(st.copier), "_read", broken)
    st.read_ahead(torch.tensor([1]), 0)
    st.copier.launch(0)
    with pytest.raises(OSError, match="host read failed"):
        st.copier.wait(0)


@pytest.mark.gpu
def test_a_request_captured_in_a_graph_is_made_again_at_each_replay() -> None:
    """The ring's build runs inside the captured step: the request (the ids' copy to
    the host, the event) is replayed with no Python call, and each launch after a
    replay reads the ids that replay sent."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    st = _state("cuda")
    st.track_writes(copy=True)
    c = st.copier
    key = ("train", 0)
    nodes = torch.tensor([1, 2, 3], device="cuda")
    # The slot is made outside the capture (pinned buffers are not capturable).
    early = st.read_ahead(nodes, key)
    c.launch(key)
    c.wait(key)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        st.read_ahead(nodes, key)
    torch.cuda.current_stream().wait_stream(side)
    for ids in ([9, 8, 0], [5, 5, 6], [4, 7, 2]):
        nodes.copy_(torch.tensor(ids))
        graph.replay()
        c.launch(key)
        c.wait(key)
        _same(st.refresh(early, nodes), st.gather(nodes), f"replay {ids}")
        _same(early.rows, st.gather(nodes), f"as read {ids}")
    st.close()
