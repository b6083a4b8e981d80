"""Checks that a figure is a real, non-trivial image."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Bars are drawn in this colour (sven.cli.plot's redundancy-free series).
BAR_BLUE = "#1f77b4"


def assert_png(path: Path, colour: str | None = None) -> None:
    """A real, non-trivial PNG: signature, size, many colours, and ``colour`` drawn."""
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    img = np.asarray(Image.open(path).convert("RGB"))
    assert img.shape[0] >= 300 and img.shape[1] >= 400, img.shape
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 20, "nearly a single colour"
    if colour is not None:
        rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
        near = np.abs(img.astype(int) - rgb).sum(axis=2) < 12
        assert near.sum() > 500, f"{path.name}: hardly any {colour} pixels ({near.sum()})"
