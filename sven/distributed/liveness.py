"""Heartbeats in the rendezvous store, and the diagnosis of who is missing.

Every rank of a multi-process job runs a daemon thread (:class:`Liveness`) that writes
a :class:`Beat` (its step, wall clock, a sequence number, a state) to the rendezvous
TCPStore every :func:`heartbeat_interval`. After a collective fails, or while one does
not complete, the beats say which rank died, hung or left (:class:`Diagnosis`), so that
the error names it rather than a timeout that names nobody.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from sven.errors import first_line

# Rank states a heartbeat carries. "failed": saw a collective fail, is finding out who
# is missing; "done": posted its verdict; "exit": tore down without having seen a
# failure (a rank that raised an error of its own, or left early).
_RUN, _FAILED, _DONE, _EXIT = "run", "failed", "done", "exit"


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat as stored under ``sven/liveness/<attempt>/<rank>``.

    Attributes:
        step: The training step the rank last started (:meth:`DistContext.set_step`).
        wall: The rank's wall clock (``time.time()``) when it wrote this beat.
        seq: Beats written so far; it advances every interval while the process lives.
        state: ``"run"``, ``"failed"``, ``"done"`` or ``"exit"``.
        blame: The ranks this rank found missing (its verdict, with ``"done"``).
        seen: The ``seq`` of the store host's beat this rank read last (-1: none).
        node: The node the rank runs on (SLURM's node name, else the host name), so
            that an error can say where a lost rank was; empty where unknown.
    """

    step: int
    wall: float
    seq: int
    state: str = _RUN
    blame: tuple[int, ...] = ()
    seen: int = -1
    node: str = ""

    def encode(self) -> str:
        """The stored text: ``"<step> <wall> <seq> <state> <blame,...|-> <seen> <node|->"``."""
        blame = ",".join(map(str, self.blame)) or "-"
        node = "".join(self.node.split()) or "-"
        return f"{self.step} {self.wall:.3f} {self.seq} {self.state} {blame} {self.seen} {node}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Beat:
        """Parses :meth:`encode`'s text."""
        text = raw.decode() if isinstance(raw, bytes) else raw
        step, wall, seq, state, blame, seen, node = text.split()
        ranks = () if blame == "-" else tuple(int(r) for r in blame.split(","))
        return cls(
            int(step), float(wall), int(seq), state, ranks, int(seen), "" if node == "-" else node
        )


@dataclass(frozen=True)
class Diagnosis:
    """Who is missing after a collective failed, as far as the heartbeats tell.

    Attributes:
        ranks: The ranks found dead, hung or gone (empty: none could be named).
        reason: One clause per rank, e.g. ``"rank 2 died or hung (no heartbeat for
            24 s; last at step 40)"``; empty when ``ranks`` is.
    """

    ranks: tuple[int, ...] = ()
    reason: str = ""


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between two heartbeats: ``min(2, timeout_s / 5)``.

    Short enough that a diagnosis (a few intervals) fits well inside the collective
    timeout, long enough to cost nothing (one small store write per interval).
    """
    return min(2.0, timeout_s / 5.0)


class Liveness:
    """A daemon thread writing this rank's :class:`Beat` to the rendezvous store.

    The store is the TCPStore of the process group's rendezvous: hosted by rank 0
    under a plain env:// launch (srun, mpirun, a hand-made one), by the torchrun agent
    under torchrun. Every rank can reach it as long as its host lives, and the host
    is the one thing a reader that cannot reach it needs to name. The main thread
    only sets :attr:`step` (an int attribute; no collective, no I/O); the thread
    writes on its own connection every ``interval_s`` and whenever the state changes.

    After a collective failed, :meth:`diagnose` reads every rank's beats for a few
    intervals and names the ranks whose beats stopped (dead, or frozen by SIGSTOP),
    that left, or that are alive but behind the others' step (hung in Python).

    Each beat also reads the host rank's beat (one key), so that its verdict is known
    here even when the host has ended before this rank could ask: a rank waiting in
    ``monitored_barrier`` for rank 0's release learns that rank 0 failed only when
    rank 0's process exits, taking the store with it.

    Args:
        rank: This rank.
        world_size: Number of ranks.
        host: The store's host.
        port: The store's port.
        host_rank: The rank whose process hosts the store, or None (torchrun's agent).
        interval_s: Seconds between beats.
        prefix: Key prefix (one per start of the job, so a restarted torchrun attempt
            does not read the beats of the previous one).
        server: On the host rank, the store object; holding it keeps the server up
            after the process group is destroyed, while the others still read.
        clock: Monotonic seconds for the diagnosis window and the stall watchdog.
        sleep: Waits between two reads of the diagnosis. Tests pass a clock that
            advances only in ``sleep`` (which also writes the peers' beats), so that
            their verdicts do not depend on how loaded the machine is.
        node: The node this rank runs on, carried in its beats (:attr:`Beat.node`).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        *,
        host_rank: int | None,
        interval_s: float,
        prefix: str = "sven/liveness",
        server: Any = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        node: str = "",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.port = port
        self.host_rank = host_rank
        self.interval_s = interval_s
        self.prefix = prefix
        self.step = 0
        self.state = _RUN
        self.blame: tuple[int, ...] = ()
        self.store_error: str | None = None
        self.host_beat: Beat | None = None
        self.node = node
        # Rank -> node, from the beats read so far (for the messages, see label()).
        self.nodes: dict[int, str] = {rank: node} if node else {}
        self._server = server
        self._clock = clock
        self._sleep = sleep
        # seq of this (host) rank's first beat that carried its verdict.
        self._verdict_seq: int | None = None
        self._seq = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # (stall seconds, callback) of :meth:`watch`, or None.
        self._stall: tuple[float, Callable[[Diagnosis, float], None]] | None = None

    def watch(self, stall_s: float, on_stall: Callable[[Diagnosis, float], None]) -> None:
        """Has the heartbeat thread act when this rank stops making progress.

        For backends where a dead peer leaves this rank blocked outside Python: under
        NCCL a collective that never completes blocks the next host sync, and NCCL's
        own watchdog later ends the process with an abort that names nobody. When
        :attr:`step` has not changed for ``stall_s`` seconds, the thread diagnoses;
        if that names a rank, it posts the verdict and calls ``on_stall(diagnosis,
        seconds stalled)``, which should end the process. Ranks that are slow together
        (a long evaluation, a checkpoint) are named by nobody and go on.

        Args:
            stall_s: Seconds without a new step before the thread looks.
            on_stall: Called from the heartbeat thread with the diagnosis.
        """
        self._stall = (stall_s, on_stall)

    def _check_stall(self, progress: list[float | int], diagnose: Callable[[], Diagnosis]) -> bool:
        """One watchdog look (heartbeat thread); ``progress`` is ``[step, since]``.

        Args:
            progress: The step last seen and since when (monotonic), updated here.
            diagnose: Who to blame once stalled (the heartbeats, or the lost store).

        Returns:
            True when ``on_stall`` was called (the thread then ends).
        """
        if self._stall is None or self.state != _RUN:
            return False
        now = self._clock()
        if self.step != progress[0]:
            progress[0], progress[1] = self.step, now
            return False
        if now - progress[1] <= self._stall[0]:
            return False
        diag = diagnose()
        if not diag.ranks:
            progress[1] = self._clock()
            return False
        self.state, self.blame = _DONE, diag.ranks
        if self.store_error is None:
            self._post_verdict()
            self.linger(skip=diag.ranks)
        self._stall[1](diag, self._clock() - progress[1])
        return True

    def _post_verdict(self) -> None:
        """Writes this rank's ``done`` beat with its verdict, from the calling thread."""
        try:
            client = self._connect(max(2 * self.interval_s, 1.0))
            beat = Beat(self.step, time.time(), self._seq, _DONE, self.blame, node=self.node)
            client.set(self.key(self.rank), beat.encode())
            self._verdict_seq = self._seq
            self._seq += 1
        except RuntimeError:
            pass  # the store is gone: nobody can read a verdict anyway

    @property
    def window_s(self) -> float:
        """How long :meth:`diagnose` watches for beats: a live rank writes twice in it."""
        return 2.5 * self.interval_s + 0.5

    def key(self, rank: int) -> str:
        """The store key of ``rank``'s beat."""
        return f"{self.prefix}/{rank}"

    def _connect(self, timeout_s: float) -> dist.TCPStore:
        return dist.TCPStore(
            self.host,
            self.port,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def start(self) -> None:
        """Starts the heartbeat thread (it writes its first beat at once)."""
        self._thread = threading.Thread(target=self._run, name="sven-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        progress: list[float | int] = [self.step, self._clock()]
        try:
            client = self._connect(max(2 * self.interval_s, 1.0))
            host_key = None
            if self.host_rank is not None and self.host_rank != self.rank:
                host_key = self.key(self.host_rank)
            while True:
                stopping = self._stop.is_set()
                seen = -1 if self.host_beat is None else self.host_beat.seq
                state = self.state
                beat = Beat(self.step, time.time(), self._seq, state, self.blame, seen, self.node)
                client.set(self.key(self.rank), beat.encode())
                if state == _DONE and self._verdict_seq is None:
                    self._verdict_seq = self._seq
                self._seq += 1
                if host_key is not None and client.check([host_key]):
                    self.host_beat = Beat.decode(client.get(host_key))
                    self._note_node(self.host_rank, self.host_beat)
                if stopping or self._check_stall(progress, lambda: self.diagnose(failed=False)):
                    return
                self._wake.wait(self.interval_s)
                self._wake.clear()
        except RuntimeError as err:  # DistStoreError, DistNetworkError
            # The store's host is gone: the job is failing anyway, and retrying would
            # only fill the log with the store client's warnings.
            self.store_error = first_line(err)
        # Watching, the thread still ends a rank that stalls with its store gone.
        lost = self.store_error or ""
        while self._stall is not None and self.state == _RUN and not self._stop.is_set():
            if self._check_stall(progress, lambda: self._store_gone(lost)):
                return
            self._stop.wait(self.interval_s)

    def mark(self, state: str, blame: Sequence[int] = ()) -> None:
        """Sets this rank's state (and verdict) and has the thread write it now."""
        self.state, self.blame = state, tuple(blame)
        self._wake.set()

    def stop(self) -> None:
        """Writes a last beat (state ``"exit"`` unless a failure was seen) and joins."""
        if self.state == _RUN:
            self.state = _EXIT
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            # Bounded: a frozen store host would otherwise hold the exit up.
            self._thread.join(timeout=max(2 * self.interval_s, 1.0) + 1.0)
            self._thread = None
        self._server = None

    def _read(self, client: dist.TCPStore) -> dict[int, Beat | None]:
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [self.key(r) for r in others]
        if client.check(keys):
            present = dict(zip(others, client.multi_get(keys)))
        else:
            present = {r: client.get(k) for r, k in zip(others, keys) if client.check([k])}
        beats = {r: Beat.decode(present[r]) if r in present else None for r in others}
        for r, b in beats.items():
            self._note_node(r, b)
        return beats

    def _note_node(self, rank: int | None, beat: Beat | None) -> None:
        if rank is not None and beat is not None and beat.node:
            self.nodes[rank] = beat.node

    def label(self, rank: int) -> str:
        """``"rank R"``, with ``" (node N)"`` where the job spans several nodes.

        Only the nodes of the beats read so far are known; a job whose known ranks
        all run on one node names none.
        """
        node = self.nodes.get(rank)
        if node and len(set(self.nodes.values())) > 1:
            return f"rank {rank} (node {node})"
        return f"rank {rank}"

    def read_nodes(self) -> None:
        """Reads every rank's beat once, to learn their nodes (for :meth:`label`)."""
        if self.store_error is not None:
            return
        try:
            self._read(self._connect(min(self.window_s, 5.0)))
        except RuntimeError:
            pass  # the store is gone: the labels keep what was known

    def _store_gone(self, err: BaseException | str) -> Diagnosis:
        text = err if isinstance(err, str) else first_line(err)
        where = f"{self.host}:{self.port}"
        if self.host_rank is None:
            return Diagnosis((), f"the rendezvous store at {where} does not answer ({text})")
        if self.host_rank == self.rank:
            return Diagnosis()
        host = self.host_beat
        if host is not None and host.state == _DONE:
            # The host posted a verdict, then ended (as it does after a failure).
            ranks = tuple(r for r in host.blame if r != self.rank)
            if ranks:
                return Diagnosis(
                    ranks,
                    "; ".join(
                        f"{self.label(r)} did not answer ({self.label(self.host_rank)} says)"
                        for r in ranks
                    ),
                )
        return Diagnosis(
            (self.host_rank,),
            f"{self.label(self.host_rank)} died or hung (the rendezvous store it hosts at {where} "
            "does not answer)",
        )

    def diagnose(self, failed: bool = True) -> Diagnosis:
        """Names the ranks that are gone, from their beats over :attr:`window_s`.

        A rank is named when its beats stop advancing (dead, or frozen), when it is
        missing or has left (state ``"exit"``), or when it is alive but its step is
        behind the highest one (hung in Python); a rank that saw the failure itself
        is a survivor. Without such a rank, the verdicts the other survivors posted
        are used, then (``failed``: a collective is known to have failed) the live
        ranks that never saw the failure.

        Args:
            failed: Whether a collective failed; the watchdog, which only sees a
                stall, passes False so that live ranks stalled alike are not named.

        Returns:
            The diagnosis; an unreachable store names its host rank.
        """
        if self.store_error is not None:
            # The heartbeat thread already lost the store (its host closed it).
            return self._store_gone(self.store_error)
        try:
            # A plain connect first: the store client retries a refused connection until
            # its timeout, logging a stack trace on every try.
            with socket.create_connection((self.host, self.port), timeout=2.0):
                pass
        except OSError as err:
            return self._store_gone(str(err))
        try:
            client = self._connect(min(self.window_s, 5.0))
            first = self._read(client)
            deadline = self._clock() + self.window_s
            cur = first
            while self._clock() < deadline:
                # A survivor says so at once; a dead rank only by the silence of a window.
                if all(b is not None and b.state != _RUN for b in cur.values()):
                    break
                self._sleep(min(0.25, self.interval_s / 2))
                cur = self._read(client)
        except RuntimeError as err:
            return self._store_gone(err)
        named = self._name_gone(first, cur, failed)
        ranks = tuple(sorted(named))
        return Diagnosis(ranks, "; ".join(named[r] for r in ranks))

    def _name_gone(
        self, first: dict[int, Beat | None], cur: dict[int, Beat | None], failed: bool
    ) -> dict[int, str]:
        """Rank -> why it is named, from the beats at the start and at the end of the
        window (:meth:`diagnose`)."""
        now = time.time()

        def alive(r: int, b: Beat) -> bool:
            # A survivor says so; a rank still running proves it lives by a new beat.
            if b.state in (_FAILED, _DONE):
                return True
            before = first[r]
            return b.state == _RUN and before is not None and b.seq != before.seq

        live = {r: b for r, b in cur.items() if b is not None and alive(r, b)}
        top = max([self.step, *(b.step for b in live.values())])
        named: dict[int, str] = {}
        for r, b in cur.items():
            if b is None:
                named[r] = f"{self.label(r)} died or hung (it never wrote a heartbeat)"
            elif b.state == _EXIT:
                named[r] = f"{self.label(r)} left the job (its process ended; see its log)"
            elif r not in live:
                age = max(now - b.wall, 0.0)
                named[r] = (
                    f"{self.label(r)} died or hung (no heartbeat for {age:.0f} s; last at "
                    f"step {b.step})"
                )
            elif b.state == _RUN and b.step < top:
                named[r] = (
                    f"{self.label(r)} hung (alive, but at step {b.step} while others reached {top})"
                )
        if not named:
            # Nothing to see from here (e.g. the missing rank came back): trust a survivor
            # that saw more, then the live ranks that never saw the failure.
            for q, b in cur.items():
                if b is not None and b.state == _DONE:
                    for r in b.blame:
                        if r != self.rank:
                            named.setdefault(
                                r, f"{self.label(r)} did not answer ({self.label(q)} says)"
                            )
        if not named and failed:
            named = {
                r: f"{self.label(r)} did not answer (alive, but it did not see the failure: hung?)"
                for r, b in live.items()
                if b.state == _RUN
            }
        return named

    def linger(self, skip: Sequence[int] = ()) -> None:
        """On the store's host: waits until the other ranks are done with the store.

        The store ends with this process. After a failure the survivors' diagnosis
        reads it, and exiting at once would make them name this rank instead of the
        missing one: wait until each has posted its verdict or read this rank's. At a
        normal end, wait until each has written its last beat, so that none of their
        heartbeat threads meets a closed store. Two diagnosis windows at most.
        """
        if self.host_rank != self.rank or self._server is None:
            return
        others = [r for r in range(self.world_size) if r != self.rank and r not in skip]
        deadline = time.monotonic() + 2 * self.window_s + 2.0
        failed = self.state in (_FAILED, _DONE)

        def informed(b: Beat | None) -> bool:
            if b is None:
                return False
            mine = self._verdict_seq
            if b.state in (_DONE, _EXIT):
                return True
            return failed and mine is not None and b.seen >= mine

        try:
            client = self._connect(min(self.window_s, 5.0))
            while time.monotonic() < deadline:
                beats = self._read(client)
                if all(informed(beats[r]) for r in others):
                    return
                time.sleep(0.1)
        except RuntimeError:
            return


def _store_address() -> tuple[str, int, Any] | None:
    """(host, port, store) of the default group's rendezvous TCPStore, if it is one."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    return store.host, int(store.port), store


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    """The node this process runs on: SLURM's name for it, else the short host name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _start_liveness(rank: int, world_size: int, timeout_s: float) -> Liveness | None:
    """A started :class:`Liveness` on the default group's store, or None without one."""
    if world_size < 2:
        return None
    found = _store_address()
    if found is None:
        return None
    host, port, store = found
    # torchrun's workers join the agent's store (TORCHELASTIC_USE_AGENT_STORE); every
    # other env:// rendezvous runs the store's server inside rank 0.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host_rank = None if agent else 0
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    live = Liveness(
        rank,
        world_size,
        host,
        port,
        host_rank=host_rank,
        interval_s=heartbeat_interval(timeout_s),
        prefix=f"sven/liveness/{attempt}",
        server=store if host_rank == rank else None,
        node=node_name(),
    )
    live.start()
    return live
