"""sven.kernels.strides: which layouts a kernel may read and write in place."""

from __future__ import annotations

import pytest
import torch

from sven.kernels.strides import is_dense


def test_dense_layouts_in_any_dim_order() -> None:
    x = torch.zeros(4, 6)
    assert is_dense(x) and is_dense(x.t()) and is_dense(torch.zeros(5))
    # The link scorer's negatives: a transposed view of the scores' tail.
    assert is_dense(torch.zeros(12)[3:].view(3, 3).t())
    # A size-1 dim may have any stride.
    assert is_dense(torch.zeros(6, 1).as_strided((6, 1), (1, 99)))
    assert is_dense(torch.zeros(0, 3))


def test_gaps_and_overlaps_are_not_dense() -> None:
    assert not is_dense(torch.zeros(4, 6)[:, :3])  # a gap after each row
    assert not is_dense(torch.zeros(10)[::2])
    assert not is_dense(torch.zeros(3).expand(4, 3))  # rows overlap (stride 0)


def test_unaligned_is_an_option_this_triton_takes() -> None:
    """The option where triton.jit has it (a kernel made with it takes a pointer at any
    address as one variant), no option where it does not; triton.jit accepts either."""
    import inspect

    triton = pytest.importorskip("triton")
    from sven.kernels.strides import unaligned

    opts = unaligned("a_ptr", "b_ptr")
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        assert opts == {"do_not_specialize_on_alignment": ["a_ptr", "b_ptr"]}
    else:
        assert opts == {}
    triton.jit(**opts)  # the decorator is made without an error
