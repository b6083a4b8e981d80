"""The per-stage timeline (sven.engine.timeline) on a fake clock, and its metrics keys."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from sven.engine import timeline as tlmod
from sven.engine.timeline import STAGES, Timeline, timeline_line


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """perf_counter reads the last value of this list (set by the test)."""
    now = [0.0]
    monkeypatch.setattr(tlmod.time, "perf_counter", lambda: now[0])
    return now


def test_laps_split_the_time_between_them(clock) -> None:
    tl = Timeline(torch.device("cpu"))
    tl.lap("compute")  # not begun: ignored
    clock[0] = 1.0
    tl.begin()
    clock[0] = 1.5
    tl.lap("sample")
    clock[0] = 4.0
    tl.lap("compute")
    clock[0] = 4.25
    tl.lap("sample")
    tl.pause()
    clock[0] = 10.0  # paused (a checkpoint): counts nowhere
    tl.lap("wait")
    tl.begin()
    clock[0] = 11.0
    tl.lap("wait")
    got = tl.epoch_totals()
    assert list(got) == list(STAGES)
    assert got["sample"] == 0.75 and got["compute"] == 2.5 and got["wait"] == 1.0
    assert sum(got.values()) == 4.25
    # Reset, and paused until begun again.
    clock[0] = 20.0
    tl.lap("compute")
    assert sum(tl.epoch_totals().values()) == 0.0


def test_unknown_stage_is_an_error(clock) -> None:
    tl = Timeline(torch.device("cpu"))
    tl.begin()
    with pytest.raises(ValueError, match="unknown stage 'fetch'"):
        tl.lap("fetch")


def test_line_has_per_rank_lists_of_the_stages_used() -> None:
    per = torch.zeros(2, len(STAGES), dtype=torch.float64)
    per[0, STAGES.index("compute")] = 2.0
    per[1, STAGES.index("compute")] = 3.0
    per[1, STAGES.index("wait")] = 0.5
    line = timeline_line(per, torch.tensor([4.0, 4.0], dtype=torch.float64))
    assert line == {
        "stage_compute_s_per_rank": [2.0, 3.0],
        "stage_wait_s_per_rank": [0.0, 0.5],
        "timeline_stages_s_per_rank": [2.0, 3.5],
        "timeline_epoch_s_per_rank": [4.0, 4.0],
    }


class _FakeEvent:
    """A CUDA event on a fake device clock: recorded at ``now[0]`` ms, complete once
    ``done[0]`` has reached that time."""

    now: ClassVar[list[float]] = [0.0]
    done: ClassVar[list[float]] = [0.0]
    synced: ClassVar[list[float]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: float | None = None

    def record(self) -> None:
        self.t = self.now[0]

    def query(self) -> bool:
        return self.t <= self.done[0]

    def synchronize(self) -> None:
        self.synced.append(self.t)
        self.done[0] = max(self.done[0], self.t)

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an incomplete event"
        return end.t - self.t


def test_cuda_laps_are_events_read_without_waiting_until_the_epoch_ends(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(tlmod, "_FOLD_EVERY", 3)
    _FakeEvent.now[0], _FakeEvent.done[0] = 0.0, 0.0
    _FakeEvent.synced.clear()
    tl = Timeline(torch.device("cuda", 0))
    tl.begin()
    for i, stage in enumerate(["sample", "compute", "sample", "compute"]):
        _FakeEvent.now[0] = 1000.0 * (i + 1)  # ms
        if i == 2:
            _FakeEvent.done[0] = 2000.0  # the device has run the first two stages
        tl.lap(stage)
    # The third lap folded the two complete stages without a wait; two are pending.
    assert _FakeEvent.synced == []
    assert len(tl._pending) == 2
    got = tl.epoch_totals()
    assert _FakeEvent.synced == [4000.0]  # one wait, on the last event
    assert got["sample"] == 2.0 and got["compute"] == 2.0
    assert tl._pending == []
