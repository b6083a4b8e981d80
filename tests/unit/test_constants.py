"""Shape constants (``sven.pipeline.constants``): the values their ops give, made once."""

from __future__ import annotations

import torch

from sven.pipeline import constants


def test_values_are_those_of_the_ops() -> None:
    assert torch.equal(constants.arange(5, "cpu"), torch.arange(5))
    assert torch.equal(constants.arange_mod(7, 19, 5, "cpu"), torch.arange(7, 19) % 5)
    one = constants.filled(-1, (), torch.int64, "cpu")
    assert one.shape == () and one.dtype == torch.int64 and int(one) == -1
    sides = constants.values((2, 3), torch.int64, "cpu")
    assert sides.tolist() == [2, 3] and sides.dtype == torch.int64


def test_made_once_per_shape_and_dtype() -> None:
    """The same tensor for the same key (the captured step reads, never launches it);
    another shape, modulus or dtype is another constant."""
    a = constants.arange_mod(3, 11, 4, "cpu")
    assert constants.arange_mod(3, 11, 4, "cpu") is a
    assert constants.arange_mod(3, 11, 5, "cpu") is not a
    f = constants.filled(0, (), torch.int64, "cpu")
    assert constants.filled(0, (), torch.float64, "cpu").dtype == torch.float64
    assert constants.filled(0, (), torch.int64, "cpu") is f


def test_kept_constants_are_bounded(monkeypatch) -> None:
    """Past the limit the oldest constant is dropped, the newest kept."""
    monkeypatch.setattr(constants, "_CACHE", {})
    monkeypatch.setattr(constants, "_LIMIT", 3)
    for n in range(1, 6):
        constants.arange(n, "cpu")
    assert [k[1] for k in constants._CACHE] == [3, 4, 5]
