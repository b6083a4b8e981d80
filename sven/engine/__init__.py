"""The training engine: one step for every world size and what drives it.

The step (``step``: the pure train and eval bodies; its captured graphs, batch
building and prefetch ring, exchange capacities and evaluation pass), the run's
components (``components``: data, optimizer, evaluator), the trainer and its run loop
(``trainer``), checkpoints (``checkpoint``), and the per-run instruments (``timeline``,
``tblog``, ``metrics``, ``startup``).
"""
