"""Heartbeats and the diagnosis of who is missing (:class:`sven.distributed.liveness.Liveness`),
on one process.

A TCPStore served by the test stands in for the rendezvous store; the other ranks'
beats are written by hand (or by a thread that keeps them fresh), so each verdict is
checked without starting any rank.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from sven.distributed.liveness import Beat, Liveness, heartbeat_interval
from sven.distributed.rendezvous import free_port

INTERVAL_S = 0.1


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore(
        "127.0.0.1",
        free_port(),
        is_master=True,
        timeout=timedelta(seconds=5),
        wait_for_workers=False,
    )
    yield server


def _liveness(store: dist.TCPStore, rank: int, world_size: int, **kw) -> Liveness:
    kw.setdefault("host_rank", 0)
    return Liveness(
        rank, world_size, "127.0.0.1", store.port, interval_s=INTERVAL_S, prefix="t", **kw
    )


class _FakeTime:
    """A clock for :class:`Liveness` that moves only when read or slept on.

    Each read advances it by ``tick``; each sleep advances it by the time slept and
    first lets the live peers write one more beat (as their heartbeat threads would
    in that time). The verdicts then depend on the number of looks, not on how fast
    the machine runs the threads: a loaded machine cannot make a live peer look dead.
    """

    def __init__(self, store: dist.TCPStore, live: dict[int, Beat], tick: float = 0.0) -> None:
        self.port, self.live, self.tick = store.port, live, tick
        self.now = 1000.0
        self.seq = 0
        self._local = threading.local()
        self.beat()

    def clock(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.beat()
        self.now += seconds

    def beat(self) -> None:
        # One client per thread: the diagnosis may run in the heartbeat thread.
        client = getattr(self._local, "client", None)
        if client is None:
            client = dist.TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False)
            self._local.client = client
        for r, b in self.live.items():
            beat = Beat(b.step, time.time(), self.seq, b.state, b.blame, node=b.node)
            client.set(f"t/{r}", beat.encode())
        self.seq += 1

    def kwargs(self) -> dict:
        return {"clock": self.clock, "sleep": self.sleep}


def _until(condition, timeout_s: float = 30.0) -> None:
    """Waits for a condition that a background thread makes true (loaded machines too)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_beat_round_trip_and_interval() -> None:
    b = Beat(40, 1234.5, 7, "done", (2, 3), 12)
    assert Beat.decode(b.encode().encode()) == b
    assert Beat.decode(Beat(1, 2.0, 3, node="n2").encode()).node == "n2"
    assert Beat.decode(Beat(0, 1.0, 0).encode()) == Beat(0, 1.0, 0, "run", (), -1)
    assert heartbeat_interval(600) == 2.0 and heartbeat_interval(5) == 1.0


def test_heartbeat_thread_writes_step_and_final_state(store) -> None:
    store.set("t/0", Beat(12, time.time(), 33, "done", (2,)).encode())
    lv = _liveness(store, 1, 3)
    lv.start()
    lv.step = 12

    def written() -> bool:
        return store.check(["t/1"]) and Beat.decode(store.get("t/1")).step == 12

    _until(written)
    _until(lambda: Beat.decode(store.get("t/1")).seen == 33)
    # It also read the host's beat, and says which one it read.
    assert lv.host_beat.blame == (2,)
    lv.stop()
    last = Beat.decode(store.get("t/1"))
    assert last.state == "exit" and last.step == 12


def test_a_silent_rank_is_named_with_its_last_step(store) -> None:
    # Rank 2 wrote one beat at step 40 and nothing since; rank 1 lives, rank 3 saw the
    # failure too.
    store.set("t/2", Beat(40, time.time() - 24, 5).encode())
    fake = _FakeTime(store, {1: Beat(41, 0, 0), 3: Beat(41, 0, 0, "failed")})
    lv = _liveness(store, 0, 4, **fake.kwargs())
    lv.step = 41
    diag = lv.diagnose()
    assert diag.ranks == (2,)
    assert re.fullmatch(
        r"rank 2 died or hung \(no heartbeat for \d+ s; last at step 40\)", diag.reason
    )
    assert int(diag.reason.split("for ")[1].split(" s")[0]) >= 24


def test_a_live_rank_behind_the_others_is_named_as_hung(store) -> None:
    fake = _FakeTime(store, {1: Beat(41, 0, 0, "failed"), 2: Beat(38, 0, 0)})
    lv = _liveness(store, 0, 3, **fake.kwargs())
    lv.step = 41
    diag = lv.diagnose()
    assert diag.ranks == (2,) and "rank 2 hung (alive, but at step 38" in diag.reason


def test_missing_and_departed_ranks_are_named(store) -> None:
    store.set("t/1", Beat(3, time.time(), 9, "exit").encode())
    lv = _liveness(store, 0, 3)
    diag = lv.diagnose()
    assert diag.ranks == (1, 2)
    assert "rank 1 left the job" in diag.reason and "rank 2 died or hung (it never" in diag.reason


def test_ranks_are_named_with_their_node_when_the_job_spans_several(store) -> None:
    store.set("t/2", Beat(40, time.time() - 24, 5, node="n2").encode())
    fake = _FakeTime(store, {1: Beat(41, 0, 0, node="n1")})
    lv = _liveness(store, 0, 3, node="n1", **fake.kwargs())
    lv.step = 41
    diag = lv.diagnose()
    assert diag.ranks == (2,) and diag.reason.startswith("rank 2 (node n2) died or hung (no")
    # All on one node: the node says nothing.
    store.set("t/2", Beat(40, time.time() - 24, 5, node="n1").encode())
    lv = _liveness(store, 0, 3, node="n1", **fake.kwargs())
    lv.step = 41
    assert lv.diagnose().reason.startswith("rank 2 died or hung (no")


def test_survivors_only_adopt_a_verdict(store) -> None:
    # Nothing wrong in sight from rank 1, but rank 0 found rank 2 missing.
    fake = _FakeTime(store, {0: Beat(5, 0, 0, "done", (2,)), 2: Beat(5, 0, 0, "failed")})
    diag = _liveness(store, 1, 3, **fake.kwargs()).diagnose()
    assert diag.ranks == (2,) and "rank 0 says" in diag.reason


def test_an_unreachable_store_names_its_host() -> None:
    lv = Liveness(2, 4, "127.0.0.1", free_port(), host_rank=0, interval_s=INTERVAL_S, prefix="t")
    diag = lv.diagnose()
    assert diag.ranks == (0,) and "rendezvous store it hosts" in diag.reason
    # The host's last beat, read while it lived, carried a verdict: it ended after a
    # failure it found, so the rank it named is the one missing.
    lv.host_beat = Beat(7, time.time(), 50, "done", (3,))
    diag = lv.diagnose()
    assert diag.ranks == (3,) and diag.reason == "rank 3 did not answer (rank 0 says)"
    # Its node is known from that beat.
    lv.host_beat, lv.node = Beat(7, time.time(), 50, node="n1"), "n3"
    lv.nodes = {2: "n3", 0: "n1"}
    assert "rank 0 (node n1) died or hung (the rendezvous store" in lv.diagnose().reason
    # Under torchrun the agent hosts it: no rank to name.
    lv.host_rank = None
    assert lv.diagnose().ranks == ()


def _watched(store: dist.TCPStore, rank: int, world_size: int, stall_s: float, **kw):
    """A started Liveness whose watchdog records its calls instead of exiting."""
    calls: list = []
    called = threading.Event()

    def on_stall(diag, seconds: float) -> None:
        calls.append((diag, seconds))
        called.set()

    lv = _liveness(store, rank, world_size, **kw)
    lv.watch(stall_s, on_stall)
    lv.start()
    return lv, calls, called


def test_watchdog_ends_a_rank_stalled_by_a_dead_peer(store) -> None:
    # Rank 1 (say, under NCCL) is blocked in a collective whose peer, rank 2, died at
    # step 7: rank 1's step stops advancing and rank 2's beats stopped.
    store.set("t/2", Beat(7, time.time(), 3).encode())
    fake = _FakeTime(store, {0: Beat(7, 0, 0)}, tick=0.05)
    lv, calls, called = _watched(store, 1, 3, stall_s=0.3, **fake.kwargs())
    lv.step = 7
    _until(called.is_set)
    lv.stop()
    ((diag, seconds),) = calls
    assert diag.ranks == (2,) and "rank 2 died or hung" in diag.reason
    assert seconds >= 0.3
    # It posted its verdict for the other survivors.
    last = Beat.decode(store.get("t/1"))
    assert last.state == "done" and last.blame == (2,)


def test_watchdog_spares_ranks_that_are_slow_together_or_progress(store) -> None:
    # Every peer beats at this rank's step (a long evaluation): nobody to name, however
    # often the watchdog looks.
    fake = _FakeTime(store, {0: Beat(7, 0, 0), 2: Beat(7, 0, 0)}, tick=0.05)
    lv, calls, _ = _watched(store, 1, 3, stall_s=0.2, **fake.kwargs())
    lv.step = 7
    start = fake.now
    _until(lambda: fake.now - start > 5.0)  # many stall checks and diagnoses
    lv.stop()
    assert calls == []
    # A rank that keeps stepping is never stalled, even next to a silent peer; once it
    # stops stepping, the silent peer is named. (The watchdog's look, step by step.)
    store.set("t/2", Beat(7, time.time(), 3).encode())
    fake = _FakeTime(store, {0: Beat(30, 0, 0)})
    lv = _liveness(store, 1, 3, **fake.kwargs())
    named = []
    lv.watch(0.3, lambda diag, seconds: named.append(diag.ranks))
    progress = [lv.step, fake.now]
    for step in range(20):
        lv.step = 8 + step
        fake.now += 0.1
        assert not lv._check_stall(progress, lambda: lv.diagnose(failed=False))
    fake.now += 0.31
    assert lv._check_stall(progress, lambda: lv.diagnose(failed=False))
    assert named == [(2,)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Application timeout caused pair closure", True),  # gloo, hung peer
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer", True),
        ("Connection reset by peer", True),
        ("NCCL communicator was aborted", True),
        ("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)", False),
        ("CUDA out of memory", False),
    ],
)
def test_comm_failures_are_told_from_other_errors(text: str, expected: bool) -> None:
    from sven.engine.trainer import _is_comm_failure

    assert _is_comm_failure(RuntimeError(text)) is expected
