"""Rows read ahead by a host thread and copied over by the copy engine.

The prefetch ring builds the batch of step i + D during step i (:mod:`sven.models.readahead`).
With node state in pinned host memory the SM gather that reads its rows there holds
SMs while it waits on the host link, and the step's kernels beside it slow down
(docs/scale.md). Here the rows travel another way:

1. the ring's build copies the batch's ids to pinned host memory and records an event
   (on its stream, inside a captured graph too: the event is external);
2. after the step is queued, a host thread waits for that event, gathers the rows
   from the host tables into a pinned staging buffer (``torch.index_select``, on the
   CPU's cores) and queues one copy per table to the device on a copy stream;
3. before the step that uses the batch is queued, the host joins that thread's job and
   the step's stream waits for the copy.

The rows carry the write log's ``since``, taken on the ring's stream before the ids'
copy and so before the host reads a row: whatever a commit writes after it is stamped
at least ``since`` and read again at the step (:meth:`MemoryState.refresh`), a row
torn by a commit writing while the host reads it included.

On the CPU the same jobs run on the thread beside the steps (the copy is a host copy),
which the tests use: every row a job reads may be written at the same time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

__all__ = ["CopyAhead", "external_events"]


def external_events() -> bool:
    """Whether this torch records events from inside a captured CUDA graph for the
    host to wait on (``torch.cuda.Event(external=True)``)."""
    try:
        torch.cuda.Event(external=True)
    except TypeError:
        return False
    return True


@dataclass
class _Slot:
    """One ring position's buffers: the ids on the host, the rows on the host and on
    the device, the events between them, and the job in flight."""

    ids: torch.Tensor
    staging: list[torch.Tensor]
    rows: list[torch.Tensor]
    ids_ready: torch.cuda.Event | None
    rows_in: torch.cuda.Event | None
    job: Future | None = None
    #: Ids requested (a build ran) and not yet handed to a job.
    requested: bool = False
    #: The request was captured in a CUDA graph: each replay requests again, with no
    #: call here to say so, and each launch after one reads the ids it sent.
    standing: bool = False
    #: The last request was handed to a job; a wait for rows never launched is refused.
    launched: bool = False


class CopyAhead:
    """The host-thread read-ahead of one node state's rows.

    Args:
        tables: The state's host tables (pinned on CUDA), each (N + 1, ...), in the
            order of the rows handed back.
        device: Where the steps run (CUDA: a copy stream and events; CPU: host copies).
    """

    def __init__(self, tables: Sequence[torch.Tensor], device: torch.device) -> None:
        self.tables = tuple(tables)
        self.device = device
        self.cuda = device.type == "cuda"
        self._copy = torch.cuda.Stream(device) if self.cuda else None
        #: Intra-op threads of the job's gather: by default as many as the steps'
        #: thread has (a new thread's OpenMP count is the library's, not torch's).
        self.threads = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sven-copy-ahead")
        self._slots: dict[Hashable, _Slot] = {}

    def _slot(self, key: Hashable, nodes: torch.Tensor) -> _Slot:
        """The buffers of ``key`` for ``nodes`` (U,), made at its first request."""
        slot = self._slots.get(key)
        u = nodes.shape[0]
        if slot is not None:
            if slot.ids.shape[0] != u:
                raise ValueError(f"copy-ahead slot {key!r}: {u} ids against {slot.ids.shape[0]}")
            return slot
        if self.cuda and torch.cuda.is_current_stream_capturing():
            # Pinned allocations are not capturable; the ring's fill makes every slot.
            raise RuntimeError(f"copy-ahead slot {key!r} first requested inside a capture")
        pin = self.cuda
        shapes = [((u, *t.shape[1:]), t.dtype) for t in self.tables]
        slot = _Slot(
            ids=torch.empty(u, dtype=torch.int64, pin_memory=pin),
            staging=[torch.empty(s, dtype=d, pin_memory=pin) for s, d in shapes],
            rows=[torch.zeros(s, dtype=d, device=self.device) for s, d in shapes],
            ids_ready=torch.cuda.Event(external=True) if self.cuda else None,
            rows_in=torch.cuda.Event() if self.cuda else None,
        )
        self._slots[key] = slot
        return slot

    def request(self, key: Hashable, nodes: torch.Tensor) -> list[torch.Tensor]:
        """On the ring's stream (in stream order, capturable once the slot exists):
        the ids of ``nodes`` (U,) to the host for a job that :meth:`launch` starts.

        Returns:
            The slot's device rows, one (U, ...) tensor per table, which the job fills.
        """
        slot = self._slot(key, nodes)
        # A job still reading the previous ids finishes before they are replaced.
        self._join(slot)
        slot.ids.copy_(nodes, non_blocking=True)
        if slot.ids_ready is not None:
            slot.ids_ready.record()
        if self.cuda and torch.cuda.is_current_stream_capturing():
            slot.standing = True
        slot.requested, slot.launched = True, False
        return slot.rows

    def launch(self, key: Hashable) -> None:
        """Starts the job reading the rows of ``key``'s last request (after the step
        that requested it is queued)."""
        slot = self._slots.get(key)
        if slot is None or not (slot.requested or slot.standing):
            raise RuntimeError(f"copy-ahead slot {key!r} launched without a request")
        self._join(slot)
        slot.requested, slot.launched = False, True
        slot.job = self._pool.submit(self._read, slot)

    def wait(self, key: Hashable) -> None:
        """Before the step that uses ``key``'s rows is queued: joins its job (raising
        its error) and makes the current stream wait for the rows' copy."""
        slot = self._slots.get(key)
        if slot is None or not slot.launched:
            raise RuntimeError(f"copy-ahead slot {key!r} used before its rows were read")
        self._join(slot)
        if slot.rows_in is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.rows_in)

    def wait_all(self) -> None:
        """Joins every job and makes the current stream wait for every copy (before a
        capture, whose warm-up saves and puts back the rows, and before evaluation)."""
        for key, slot in self._slots.items():
            if slot.launched:
                self.wait(key)

    def close(self) -> None:
        """Joins the jobs and stops the thread (before the host tables are released)."""
        for slot in self._slots.values():
            self._join(slot)
        self._pool.shutdown(wait=True)
        if self._copy is not None:
            self._copy.synchronize()

    @staticmethod
    def _join(slot: _Slot) -> None:
        job, slot.job = slot.job, None
        if job is not None:
            job.result()

    def _read(self, slot: _Slot) -> None:
        """The job: waits for the ids, gathers the rows on the host, queues their copy."""
        ready, copied, stream = slot.ids_ready, slot.rows_in, self._copy
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if ready is not None and copied is not None:
            ready.synchronize()
            # The staging buffer's previous copy is over (it was waited on by the step
            # that used it, before this request; this makes it certain).
            copied.synchronize()
        # On CUDA the copies go on the copy stream; on the CPU they are host copies.
        on_copy_stream = contextlib.ExitStack()
        if stream is not None:
            on_copy_stream.enter_context(torch.cuda.device(self.device))
            on_copy_stream.enter_context(torch.cuda.stream(stream))
        with on_copy_stream:
            # Each table's copy is queued as soon as its rows are gathered: it crosses
            # the link while the host gathers the next table.
            for table, out, dst in zip(self.tables, slot.staging, slot.rows):
                torch.index_select(table, 0, slot.ids, out=out)
                dst.copy_(out, non_blocking=self.cuda)
            if copied is not None:
                copied.record(stream)
