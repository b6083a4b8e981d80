"""Child processes for the benchmark drivers: each one's exit code, wall and CPU time,
peak memory and output, under one deadline, with the record on disk after every step.

Not a benchmark: the scripts beside it import it (``python benchmarks/X.py`` puts this
folder first on ``sys.path``). A driver that runs many steps on a lent machine keeps
what came before a step that hangs or fails: each step has its own time limit, is
killed with its process group when it runs past it, and the JSON is rewritten after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def sven_cmd(*args: str) -> list[str]:
    """The ``sven`` command line through this interpreter (no PATH lookup)."""
    return [PY, "-m", "sven", *args]


def measure(
    cmd: list[str], log: Path, limit_s: float | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs ``cmd`` from the repository root, its output to ``log``, to its end or for
    ``limit_s`` seconds.

    ``subprocess.run`` reaps the child itself and loses its resource usage, and
    ``RUSAGE_CHILDREN`` is a maximum over every child so far; ``wait4`` gives this
    child's own figures (its children included).

    Returns:
        ``cmd``, ``rc`` (``"timeout"`` when it was killed at the limit), ``wall_s``,
        ``cpu_s``, ``peak_rss_mib`` and ``tail``, the end of its output.
    """
    rec: dict[str, Any] = {"cmd": " ".join(cmd)}
    end = None if limit_s is None else time.monotonic() + max(limit_s, 1.0)
    with open(log, "w") as f:
        start = time.perf_counter()
        # A session of its own: a time-out kills the launcher's workers too (torchrun).
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        while True:
            pid, status, usage = os.wait4(proc.pid, 0 if end is None else os.WNOHANG)
            if pid:
                break
            if time.monotonic() > end:
                os.killpg(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                rec["timed_out"] = True
                break
            time.sleep(0.1)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    rec.update(
        rc="timeout" if rec.get("timed_out") else proc.returncode,
        wall_s=round(wall, 3),
        cpu_s=round(usage.ru_utime + usage.ru_stime, 3),
        peak_rss_mib=round(usage.ru_maxrss / 1024, 1),  # Linux reports KiB
        tail=log.read_text(errors="replace")[-1500:],
    )
    return rec


def run_measured(cmd: list[str], log: Path) -> dict[str, Any]:
    """:func:`measure` without a limit; a failure ends the benchmark with its output."""
    rec = measure(cmd, log)
    if rec["rc"] != 0:
        raise SystemExit(f"failed ({rec['rc']}): {rec['cmd']}\n{rec['tail']}")
    return rec


class Steps:
    """Steps of one driver under one deadline; ``<out>/<name>.json`` after each.

    Args:
        out: Folder for the JSON and each step's log (``<step>.log``).
        deadline_s: Seconds from now that every step together may take.
        name: The JSON's name.
        env: Variables every step gets on top of this process's.
    """

    def __init__(
        self, out: Path, deadline_s: float, name: str, env: dict[str, str] | None = None
    ) -> None:
        self.out, self.name = out, name
        self.end = time.monotonic() + deadline_s
        self.t0 = time.monotonic()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.record: dict[str, Any] = {"steps": {}}
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.end - time.monotonic()

    def save(self) -> None:
        """Writes the record (atomically: a reader never sees half a file)."""
        self.record["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        tmp = self.out / f".{self.name}.json.tmp"
        tmp.write_text(json.dumps(self.record, indent=2) + "\n")
        os.replace(tmp, self.out / f"{self.name}.json")

    def run(
        self,
        name: str,
        cmd: list[str],
        limit_s: float | None = None,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Runs step ``name`` for at most ``limit_s`` seconds and what the deadline
        leaves; a step with less than 10 s left is skipped (``rc`` None)."""
        limit = min(limit_s or self.left(), self.left())
        if limit < 10:
            rec: dict[str, Any] = {"cmd": " ".join(cmd), "rc": None, "skipped": "deadline"}
        else:
            print(f"{name}: {' '.join(cmd)}  (limit {limit:.0f} s)", flush=True)
            rec = measure(cmd, self.out / f"{name}.log", limit, {**self.env, **(env or {})})
            print(f"{name}: rc={rec['rc']} in {rec['wall_s']:.1f} s", flush=True)
        self.record["steps"][name] = rec
        self.save()
        return rec
