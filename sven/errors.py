"""Errors that the CLI reports as a one-line message and a non-zero exit, never a traceback."""

from __future__ import annotations


class SvenError(Exception):
    """Base class for expected, user-facing errors.

    Attributes:
        exit_code: Process exit code the CLI returns for this error.
    """

    exit_code: int = 1


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
