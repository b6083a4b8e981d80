"""The per-stage timeline (sven.timeline) on a fake clock, and its metrics keys."""

from __future__ import annotations

import pytest
import torch

from sven import timeline as tlmod
from sven.timeline import STAGES, Timeline, timeline_line


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
