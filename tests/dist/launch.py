"""Runs a function on several local ranks and reports every rank's failure.

``run_ranks(fn, world_size, *args)`` starts one ``python`` process per rank with the
env:// variables a launcher would set (``MASTER_ADDR=127.0.0.1``, a free
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), runs
``fn(rank, world_size, *args)`` in each and returns the ranks' return values. When a
rank raises, crashes or hangs, the error carries every rank's traceback (a hung rank's
stack is dumped by faulthandler before it is killed), so a failure on rank 1 is never
hidden behind the collective timeout it causes on rank 0.

``fn`` must be a module-level function; its module is imported in each rank by name
when possible, else from its file. ``args`` and return values must pickle.

Fresh interpreters rather than ``fork``: a forked child inherits the parent's torch
threads and any process group, and ``spawn`` pickles ``fn`` by a module name that
pytest's importlib mode does not make importable in the child.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sven.distributed.rendezvous import free_port

__all__ = ["RankFailure", "free_port", "run_ranks"]

# After one rank fails the others usually block in a collective until the process
# group timeout; this long is left for them to fail on their own first.
_GRACE_S = 3.0
_TAIL_CHARS = 4000


class RankFailure(AssertionError):
    """One or more ranks raised, crashed or hung; the message holds each rank's report.

    Attributes:
        reports: rank -> what went wrong there (traceback, exit status, stack dump).
        hung: Ranks still running at the timeout.
    """

    def __init__(self, message: str, reports: dict[int, str], hung: list[int]) -> None:
        super().__init__(message)
        self.reports = reports
        self.hung = hung


def _module_root(fn: Callable[..., Any]) -> tuple[str, str, str | None]:
    """(module name, file, sys.path entry that makes the name importable, if any)."""
    if "<" in fn.__qualname__:
        raise TypeError(f"run_ranks needs a module-level function, got {fn.__qualname__}")
    module = sys.modules[fn.__module__]
    file = str(Path(module.__file__ or "").resolve())
    parts = fn.__module__.split(".")
    root = Path(file).parents[len(parts) - 1]
    if root.joinpath(*parts[:-1], parts[-1] + ".py") != Path(file):
        return fn.__module__, file, None
    return fn.__module__, file, str(root)


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text if len(text) <= _TAIL_CHARS else "...\n" + text[-_TAIL_CHARS:]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str | None = "gloo",
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` local processes.

    Args:
        fn: Module-level function; each rank calls it once.
        world_size: Number of ranks.
        *args: Picklable arguments passed after ``(rank, world_size)``.
        timeout: Seconds for the whole run; ranks still running then are killed and
            reported as hung. Also the process group's collective timeout.
        backend: Process group each rank joins before calling ``fn`` (and destroys
            after), or None to leave that to ``fn`` (to test ``sven.distributed`` itself).

    Returns:
        The return values, indexed by rank.

    Raises:
        RankFailure: A rank raised, exited without a result, or hung; the message has
            every failed rank's traceback or stack and output.
    """
    name, file, root = _module_root(fn)
    with tempfile.TemporaryDirectory(prefix="sven-ranks-") as tmp:
        work = Path(tmp)
        job = {
            "module": name,
            "file": file,
            "root": root,
            "qualname": fn.__qualname__,
            "backend": backend,
            "timeout": timeout,
        }
        (work / "job.pkl").write_bytes(pickle.dumps(job))
        # Apart from the job: they may need fn's module, which the rank imports first.
        (work / "args.pkl").write_bytes(pickle.dumps(args))
        port = free_port("127.0.0.1")
        procs = []
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
            )
            # Ranks share the machine's few cores: one thread each avoids oversubscription.
            env.setdefault("OMP_NUM_THREADS", "1")
            with open(work / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, str(work), str(rank)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        hung, killed = _wait(procs, time.monotonic() + timeout)

        results: list[Any] = [None] * world_size
        reports: dict[int, str] = {}
        for rank, proc in enumerate(procs):
            out = work / f"rank{rank}.out"
            log = _tail(work / f"rank{rank}.log")
            if rank in hung:
                reports[rank] = f"hung: still running after {timeout:g} s; its stack:\n{log}"
            elif rank in killed:
                reports[rank] = f"killed {_GRACE_S:g} s after another rank failed; stack:\n{log}"
            elif out.exists():
                status, value = pickle.loads(out.read_bytes())
                if status == "ok":
                    results[rank] = value
                else:
                    reports[rank] = f"raised:\n{value}" + (f"\noutput:\n{log}" if log else "")
            else:
                reports[rank] = f"exited with status {proc.returncode}, no result; output:\n{log}"
    if reports:
        what = "; ".join(
            f"{_ranks(rs)} {verb}"
            for rs, verb in (
                ([r for r in reports if r not in hung and r not in killed], "failed"),
                (hung, "hung"),
                (killed, "killed"),
            )
            if rs
        )
        body = "\n".join(f"===== rank {r}: {text}" for r, text in sorted(reports.items()))
        raise RankFailure(
            f"run_ranks({fn.__qualname__}, world_size={world_size}): {what}\n{body}",
            reports,
            hung,
        )
    return results


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float) -> tuple[list[int], list[int]]:
    """Waits for the ranks; returns (hung ranks, ranks killed after another failed)."""
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [], []
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        timed_out = now >= deadline
        if timed_out or (failed_at is not None and now - failed_at >= _GRACE_S):
            alive = [r for r, c in enumerate(codes) if c is None]
            _kill(procs, alive)
            return (alive, []) if timed_out else ([], alive)
        time.sleep(0.05)


def _kill(procs: list[subprocess.Popen[bytes]], ranks: list[int]) -> None:
    """Dumps the stacks of ``ranks`` (faulthandler on SIGUSR1), then kills their sessions."""
    for r in ranks:
        procs[r].send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    for r in ranks:
        # Each rank leads its own session, so this reaches anything it started too.
        try:
            os.killpg(procs[r].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        procs[r].wait()


def _load(meta: dict[str, Any]) -> Callable[..., Any]:
    """Imports the rank function: by module name where it resolves, else from its file."""
    import importlib
    import importlib.util

    name, file, root = meta["module"], meta["file"], meta["root"]
    if root is not None:
        sys.path.insert(0, root)
        module = importlib.import_module(name)
    else:
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # Registered under its name so that pickled arguments of its classes resolve.
        sys.modules[name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in meta["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def _child(work: Path, rank: int) -> int:
    """One rank: import fn, join the group if asked, call fn, write the outcome."""
    import faulthandler
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        meta = pickle.loads((work / "job.pkl").read_bytes())
        fn = _load(meta)
        args = pickle.loads((work / "args.pkl").read_bytes())
        if meta["backend"] is not None:
            dist.init_process_group(meta["backend"], timeout=timedelta(seconds=meta["timeout"]))
        try:
            value = fn(rank, int(os.environ["WORLD_SIZE"]), *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        payload, code = pickle.dumps(("ok", value)), 0
    except BaseException:
        payload, code = pickle.dumps(("error", traceback.format_exc())), 1
    (work / f"rank{rank}.out").write_bytes(payload)
    return code


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1]), int(sys.argv[2])))
