"""Accuracy floors on real data (CollegeMsg = DyGLib's UCI), short schedules.

The full published schedules (configs/*.yaml: 100 epochs, patience 20) and their
figures are in docs/accuracy.md; these runs take a few epochs and assert floors that a
broken model or evaluation would not reach.
"""

from __future__ import annotations

import pytest

import sven

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def uci(shared_data, tmp_path_factory) -> str:
    from sven.datasets.readers import convert

    out = tmp_path_factory.mktemp("uci") / "collegemsg"
    convert(shared_data / "collegemsg" / "CollegeMsg.txt.gz", out)
    return str(out)


def _fit(uci: str, out, model: str, epochs: int, *extra: str) -> dict:
    """A short run of ``model`` on CollegeMsg, every epoch (no early stop); its summary."""
    overrides = [f"model.name={model}", *extra, f"data.path={uci}", f"out={out}"]
    overrides += [f"train.epochs={epochs}", "train.patience=0", "quiet=true"]
    return sven.Trainer(None, overrides).fit()


@pytest.mark.parametrize(
    ("model", "epochs", "floor"),
    [
        # TGN reaches val AP ~0.91 after 2 epochs (published test AP 92.34).
        ("tgn", 2, 0.88),
        # JODIE reaches test AP ~0.89 after 5 epochs (published 89.43).
        ("jodie", 5, 0.86),
    ],
)
def test_collegemsg_floor(uci: str, tmp_path, model: str, epochs: int, floor: float) -> None:
    summary = _fit(uci, tmp_path, model, epochs)
    assert summary["test_ap"] >= floor, summary


def test_collegemsg_apan_test_holds_up_to_val(uci: str, tmp_path) -> None:
    # Before the time-projected embedding APAN reached val AP 0.76 and test AP 0.57
    # (docs/accuracy.md); now test AP is at or above val AP. Projecting by the age of
    # the newest mail (which neighbours' events refresh) instead of the time since the
    # node's own last event gave test AP 0.85; the node's own gives about 0.90 (CPU,
    # docs/accuracy.md, session 4).
    summary = _fit(uci, tmp_path, "apan", 2)
    assert summary["test_ap"] >= 0.87, summary
    assert summary["test_ap"] >= summary["val_ap"] - 0.05, summary


def test_collegemsg_dyrep_test_holds_up_to_val(uci: str, tmp_path) -> None:
    # DyRep's bare-memory embedding reached val AP 0.68 and test AP 0.55 after 5 epochs
    # (CPU, docs/accuracy.md); with the time projection of the preset, test AP is above
    # val AP (0.83 / 0.89 after 5 epochs).
    summary = _fit(uci, tmp_path, "dyrep", 2, "model.time_projection=true")
    assert summary["test_ap"] >= 0.80, summary
    assert summary["test_ap"] >= summary["val_ap"] - 0.05, summary
