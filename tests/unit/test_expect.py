"""What a long run says about its length (sven.engine.expect)."""

from __future__ import annotations

from sven.engine.expect import LONG_CPU_EVENTS, epoch_estimate, start_hint


def test_a_long_cpu_run_says_so_before_its_first_step() -> None:
    # The node-classification preset on Wikipedia: 100 epochs of 110,232 events.
    assert start_hint("cpu", 100, 110_232) == (
        "expect a long run: up to 100 epochs of 110,232 training events on the CPU (tens "
        "of minutes to hours); an estimate follows the first epoch. train.epochs=N "
        "shortens it, a GPU (train.device=cuda) speeds it up"
    )
    # The quick start (3 epochs of the built-in 70,000 training events), a GPU run, and
    # a run just under the bound say nothing.
    assert start_hint("cpu", 3, 70_000) is None
    assert start_hint("cuda", 100, 110_232) is None
    assert start_hint("cpu", 1, LONG_CPU_EVENTS - 1) is None
    assert start_hint("cpu", 1, LONG_CPU_EVENTS) is not None


def test_the_first_epoch_gives_an_estimate_of_the_rest() -> None:
    assert epoch_estimate(0, 40.0, 99, 20) == (
        "epoch 0 took 40 s with validation: the 99 epochs left take up to 66 min; early "
        "stopping (train.patience=20) may end it sooner"
    )
    assert epoch_estimate(0, 120.0, 99, 0) == (
        "epoch 0 took 2 min with validation: the 99 epochs left take up to 3.3 h"
    )
    assert epoch_estimate(4, 130.0, 10, 0) == (
        "epoch 4 took 2 min with validation: the 10 epochs left take up to 22 min"
    )
    # Nothing left, or a rest of less than two minutes: nothing to say.
    assert epoch_estimate(0, 40.0, 0, 20) is None
    assert epoch_estimate(0, 10.0, 11, 0) is None
    assert epoch_estimate(0, 10.0, 12, 0) is not None
