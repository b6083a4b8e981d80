"""The prefetcher: order, the bound of D prepared items, exceptions at the failing item,
and a close that lets the thread finish exactly the items it was allowed to start."""

from __future__ import annotations

import threading
import time

import pytest

from sven.pipeline.prefetch import Prefetcher


class _Source:
    """Descriptors 0..n-1 that remember how many were drawn."""

    def __init__(self, n: int) -> None:
        self.n, self.drawn = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.drawn += 1
            yield i


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_items_in_order(depth: int) -> None:
    with Prefetcher(range(7), lambda i: i * 10, depth) as pf:
        assert list(pf) == [0, 10, 20, 30, 40, 50, 60]


@pytest.mark.parametrize("depth", [1, 3])
def test_at_most_depth_items_are_prepared(depth: int) -> None:
    src = _Source(20)
    made = []
    pf = Prefetcher(src, lambda i: made.append(i) or i, depth)
    # Nothing taken: the thread prepares exactly D items, then waits.
    _wait_for(lambda: len(made) == depth)
    time.sleep(0.2)
    assert made == list(range(depth)) and src.drawn == depth
    assert next(pf) == 0
    _wait_for(lambda: len(made) == depth + 1)
    time.sleep(0.2)
    assert len(made) == depth + 1
    assert pf.high_water == depth
    pf.close()
    # Closed after one taken item: the items below taken + D were made, no more.
    assert made == list(range(depth + 1))


def test_close_mid_stream_leaks_no_thread() -> None:
    before = threading.active_count()
    gate = threading.Event()

    def slow(i: int) -> int:
        gate.wait(5)
        return i

    pf = Prefetcher(range(100), slow, 3)
    gate.set()
    assert next(pf) == 0
    pf.close()
    pf.close()  # idempotent
    assert threading.active_count() == before


@pytest.mark.parametrize("depth", [0, 2])
def test_an_exception_in_a_stage_is_raised_at_its_item(depth: int) -> None:
    before = threading.active_count()

    def stage(i: int) -> int:
        if i == 3:
            raise KeyError("stage 3")
        return i

    pf = Prefetcher(range(10), stage, depth)
    assert [next(pf) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="stage 3"):
        next(pf)
    pf.close()
    assert threading.active_count() == before


def test_negative_depth_is_refused() -> None:
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(range(3), lambda i: i, -1)


def test_close_without_finishing_starts_no_further_item() -> None:
    gate, started = threading.Event(), []

    def stage(i: int) -> int:
        started.append(i)
        gate.wait(30)
        return i

    pf = Prefetcher(range(10), stage, 3)
    _wait_for(lambda: started == [0])
    # A peer is gone: item 0 (already in its collective, say) ends, 1 and 2 never start.
    threading.Timer(0.1, gate.set).start()
    pf.close(finish=False)
    assert started == [0]
