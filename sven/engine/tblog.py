"""Optional TensorBoard logging of the per-epoch metrics (``log.tensorboard=true``).

The trainer hands every epoch line it appends to ``metrics.jsonl`` to
:meth:`EpochLog.write`; with TensorBoard on, rank 0 writes its numbers as scalars under
``<out>/tb`` (``tensorboard --logdir runs/x/tb``). Per-rank lists (``*_per_rank``)
become one scalar per rank (``comm_bytes_per_rank/rank1``).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from sven.errors import ConfigError
from sven.extras import install_hint


class EpochLog:
    """Writes epoch lines as TensorBoard scalars, or does nothing when disabled.

    Args:
        log_dir: Folder of the event files (``<out>/tb``).
        enabled: ``log.tensorboard``; checked on every rank, so that a missing package
            stops all ranks alike before training.
        main: Only the main rank writes.

    Raises:
        ConfigError: TensorBoard is asked for but the ``tensorboard`` package is absent.
    """

    def __init__(self, log_dir: str | Path, enabled: bool, main: bool = True) -> None:
        self.log_dir = Path(log_dir)
        self.active = enabled and main
        self._writer: Any = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "log.tensorboard=true needs the tensorboard package: "
                    + install_hint("tensorboard")
                ) from None

    def write(self, line: dict[str, Any]) -> None:
        """Logs one epoch line (``{"epoch": e, "train_loss": ..., ...}``) at step ``e``."""
        if not self.active:
            return
        step = int(line["epoch"])
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run logs again the epochs after its checkpoint: purge_step makes
            # TensorBoard drop what an earlier attempt wrote from this step on.
            self._writer = SummaryWriter(str(self.log_dir), purge_step=step)
            weakref.finalize(self, self._writer.close)
        for key, value in line.items():
            if key == "epoch":
                continue
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, step)
            elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                for rank, v in enumerate(value):
                    self._writer.add_scalar(f"{key}/rank{rank}", v, step)
        # Flushed every epoch: the run may end in a signal or a failed rank.
        self._writer.flush()

    def close(self) -> None:
        """Closes the event file (also done when the object is collected)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
