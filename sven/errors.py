"""Errors that the CLI reports as a one-line message and a non-zero exit, never a traceback.

Exit codes of ``sven``:

=====  ==========================================================================
0      success
1      :class:`SvenError` (other expected errors, e.g. no valid checkpoint, a folder
       in use by another Sven process, a training loss that turned NaN)
2      :class:`ConfigError`: a bad configuration or override; rerunning fails again
3      :class:`DataError`: bad input data; rerunning fails again
4      :class:`sven.distributed.collectives.DistError`: a launch that cannot start, or a
       rank that died or hung; the last complete checkpoint is intact
5      :class:`CheckpointError`: a checkpoint could not be written (disk full, a quota,
       a file-size limit); the run went on without it, wrote ``summary.json`` with
       every metric it had and the missing checkpoints under ``checkpoint_errors``;
       the older checkpoints are intact. Rerunning fails again until there is room
75     :class:`Stopped`: training stopped on SIGTERM or SIGUSR1 after a checkpoint
       (``EX_TEMPFAIL``: try again); ``train.resume=true`` continues exactly
130    interrupted by Ctrl-C (SIGINT)
143    :class:`Terminated`: ``sven data convert``/``synth`` or ``sven partition``
       stopped by SIGTERM; its partial output is removed, nothing is written
141    the output pipe was closed by its reader (``sven data info STORE | head``),
       as for a tool ended by SIGPIPE; nothing is written to stderr
=====  ==========================================================================

``slurm/train.sbatch`` requeues the job on 75 and after failures, never on 2, 3 or 5.
"""

from __future__ import annotations


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, or its class name where it has none.

    For one-line reports of errors raised by torch and its C++ side (a failed
    rendezvous, a broken store), whose messages go on with pages of frames.

    Args:
        err: The exception.

    Returns:
        E.g. ``"Connection refused"`` for ``RuntimeError("Connection refused\\n<frames>")``.
    """
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class SvenError(Exception):
    """Base class for expected, user-facing errors.

    Attributes:
        exit_code: Process exit code the CLI returns for this error.
        prefix: What the CLI writes between ``sven:`` and the message.
        quiet: The CLI writes nothing (another rank reports for this one).
    """

    exit_code: int = 1
    prefix: str = "error: "
    quiet: bool = False


class DataError(SvenError, ValueError):
    """Bad input data: the message names the file, the line or row, and the reason."""

    exit_code = 3

    def __init__(self, reason: str, path: object | None = None, line: int | None = None) -> None:
        self.reason = reason
        self.path = None if path is None else str(path)
        self.line = line
        where = ""
        if self.path is not None:
            where = self.path + (f", line {line}" if line is not None else "") + ": "
        super().__init__(where + reason)


class ConfigError(SvenError, ValueError):
    """An invalid configuration value or override."""

    exit_code = 2


class Stopped(SvenError):
    """Training stopped on request (SIGTERM, SIGUSR1) after writing a checkpoint.

    Not a failure: every rank stopped after the same step and wrote its part of the
    checkpoint, and rerunning with ``train.resume=true`` continues exactly as if the
    run had not stopped. Only rank 0 reports it.

    Attributes:
        signal_name: The signal that asked for the stop, e.g. ``"SIGTERM"``.
        checkpoint: The checkpoint folder written at the stop.
    """

    exit_code = 75
    prefix = ""

    def __init__(
        self, message: str, signal_name: str, checkpoint: object, quiet: bool = False
    ) -> None:
        super().__init__(message)
        self.signal_name = signal_name
        self.checkpoint = str(checkpoint)
        self.quiet = quiet


class Diverged(SvenError):
    """The training loss became NaN or infinite; nothing of the diverged state is kept
    (the message names the last checkpoint written before it)."""


class CheckpointError(SvenError):
    """A checkpoint could not be written; its temporary files are removed.

    The message is one line: which checkpoint (folder, step) is missing, why (the OS
    error), and which older checkpoint is intact.

    Attributes:
        checkpoint: The folder the checkpoint would have had.
        step: Its step.
    """

    exit_code = 5

    def __init__(self, message: str, checkpoint: object = "", step: int = -1) -> None:
        super().__init__(message)
        self.checkpoint = str(checkpoint)
        self.step = step


class Terminated(BaseException):
    """SIGTERM stopped a command that writes a store or a partition (exit code 143).

    A BaseException, as KeyboardInterrupt: no ``except Exception`` on the way may take
    it for an error of its own; the writers' cleanup runs and the CLI says one line.
    """

    exit_code = 143
