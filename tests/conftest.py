"""Shared fixtures: tiny hand-built graphs, the shared real data, and a multi-rank runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The shared real datasets live beside the checkout; a user's fresh clone has none.
SHARED_DATA = Path(os.environ.get("SVEN_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of real datasets; skips the test where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared real data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _deterministic_torch():
    import torch

    torch.manual_seed(0)
    yield
