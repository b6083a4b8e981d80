"""The modules that advance node memory: the time encoding and the recurrent cell that
applies pending mail (:class:`~sven.models.memory.MemoryState` holds the state they
advance)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from sven import kernels

if TYPE_CHECKING:
    from sven.models.memory import MemoryRows

__all__ = ["RecurrentUpdater", "TimeEncoding"]


class TimeEncoding(nn.Module):
    """cos(dt * w + b), with w = 1 / 10^linspace(0, 9, d) and b = 0.

    The geometric frequencies follow TGAT/DyGLib and are fixed by default: the gradient
    of cos(dt * w) with respect to w scales with dt, which is 10^5..10^9 for unix-second
    timestamps, so trained frequencies drift by whole periods per step and the encoding
    turns into noise (docs/benchmarks.md has TGN's val AP with either). DyGLib and
    GraphMixer fix them for the same reason.

    Args:
        dim: Output dimension d.
        trainable: Whether w and b receive gradients.
    """

    def __init__(self, dim: int, trainable: bool = False) -> None:
        super().__init__()
        self.dim = dim
        w = 1.0 / 10 ** torch.linspace(0, 9, dim, dtype=torch.float64)
        self.weight = nn.Parameter(w.float(), requires_grad=trainable)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=trainable)

    def forward(self, dt: torch.Tensor) -> torch.Tensor:
        """Encodes time differences.

        Args:
            dt: (...,) time differences (any float dtype; computed in the parameter dtype).

        Returns:
            (..., d) encodings.
        """
        dt = dt.to(self.weight.dtype)
        return torch.cos(dt[..., None] * self.weight + self.bias)

    def at_zero(self, rows: int) -> torch.Tensor:
        """The encoding of dt = 0 for ``rows`` rows: (rows, d), a broadcast view.

        ``forward(zeros(rows))`` to the bit (0 * w + b is b for finite w) in one kernel
        instead of four (a fill, the product, the sum, the cosine).
        """
        return torch.cos(self.bias)[None, :].expand(rows, -1)


class RecurrentUpdater(nn.Module):
    """Applies pending mail to memory with a GRU or RNN cell.

    Input to the cell is [mail, time_enc(mail_ts - last_update)] (TGN/TGL); nodes without
    a valid mail keep their memory. Hot path through :mod:`sven.kernels`.

    Args:
        cell: "gru" or "rnn".
        mail_dim: d_mail.
        time_dim: Time encoding width.
        memory_dim: d_mem.
    """

    def __init__(self, cell: str, mail_dim: int, time_dim: int, memory_dim: int) -> None:
        super().__init__()
        if cell not in ("gru", "rnn"):
            raise ValueError(f"unknown memory cell {cell!r} (expected 'gru' or 'rnn')")
        self.cell_type = cell
        cls = nn.GRUCell if cell == "gru" else nn.RNNCell
        self.cell = cls(mail_dim + time_dim, memory_dim)
        self.time_enc = TimeEncoding(time_dim)

    def forward(
        self, rows: MemoryRows, message: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Computes current memory from stored memory and pending mail.

        Args:
            rows: State of U nodes; slot 0 of the mailbox is the pending mail.
            message: Optional (U, d_mail) aggregated message replacing slot 0 (APAN).

        Returns:
            memory (U, d_mem) with gradient, and last_update (U,) float64 after the update.
        """
        mail = rows.mail[:, 0] if message is None else message
        c = self.cell
        return kernels.recurrent_update(
            mail,
            rows.mail_ts[:, 0],
            rows.last_update,
            rows.mail_valid[:, 0],
            rows.memory,
            self.time_enc.weight,
            self.time_enc.bias,
            c.weight_ih,
            c.weight_hh,
            c.bias_ih,
            c.bias_hh,
            cell=self.cell_type,
        )
