"""Native output to a log file, not the terminal (:func:`native_stderr_to`).

torch's C++ side writes each failed connection, often with a dump of C++ frames, to
file descriptor 2; a rank's log file takes it, and the terminal keeps the one line
that says what happened.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass
class NativeLog:
    """Where :func:`native_stderr_to` sends native stderr; see :meth:`written`.

    Attributes:
        path: The log file.
        mark: Its size after this process's header line; -1 where it could not be
            opened (nothing is redirected then).
    """

    path: Path
    mark: int

    def written(self) -> bool:
        """Whether native code wrote anything since the header (never without a log)."""
        if self.mark < 0:
            return False
        try:
            return self.path.stat().st_size > self.mark
        except OSError:
            return False


@contextlib.contextmanager
def native_stderr_to(path: str | Path, header: str = "") -> Iterator[NativeLog]:
    """Sends what native code writes to stderr to ``path``; Python's ``sys.stderr`` stays.

    torch's C++ side (the TCPStore client, gloo, c10d) logs each failed connection to
    file descriptor 2, often with a dump of C++ frames: a failed rendezvous, a dead
    peer or a lost store would bury the one line that says what happened. Inside this
    context descriptor 2 is the log file (appended to, after a line with
    ``header``), while ``sys.stderr``, and with it Sven's messages, progress bars
    and Python tracebacks, still writes where stderr went before. A log that got
    nothing but the header is taken back on exit.

    The copy of the old stderr that ``sys.stderr`` wrote to inside the context stays
    open (one descriptor per use): objects that kept that stream, such as a progress
    bar, may still write to it afterwards.

    Args:
        path: The log file; its folder is created.
        header: Written first (with the time), e.g. ``"rank 1 of 2 on node n2"``.

    Yields:
        The log (:meth:`NativeLog.written` says whether it holds anything).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        start = path.stat().st_size if existed else 0
        line = f"== {datetime.now().isoformat(timespec='seconds')} pid {os.getpid()} {header}\n"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        # No log where it cannot be written (the run fails there later, saying why);
        # the C++ output then stays on the terminal.
        yield NativeLog(path, -1)
        return
    try:
        os.write(fd, line.encode())
        log = NativeLog(path, start + len(line.encode()))
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    before = sys.stderr
    sys.stderr = io.TextIOWrapper(
        io.FileIO(saved, "w", closefd=False),
        encoding=getattr(before, "encoding", None) or "utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    try:
        yield log
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        sys.stderr = before
        os.dup2(saved, 2)
        if not log.written():
            with contextlib.suppress(OSError):
                if existed:
                    os.truncate(path, start)
                else:
                    path.unlink()
                    # Only where empty: other ranks' logs may be in it.
                    path.parent.rmdir()
