"""Prefetch: the stages of the next D batches run ahead of the step, in a background thread.

:class:`Prefetcher` runs ``stage(desc)`` for the descriptors of an iterator (a batch's
number and event range) up to ``depth`` items ahead of the consumer, in one daemon
thread (on CPU; on CUDA the trainer's stage enqueues its kernels on a side stream, see
:class:`SideStream`). What a stage computes for the trainer (negatives, neighbour
sampling, de-duplication and the id plan of the memory exchange) depends on the events
and the ownership only, never on memory values or parameters, so computing it early
changes no result.

Bounded: items started and not yet taken never exceed ``depth``, so the queue holds
at most ``depth`` prepared batches. Deterministic: the thread starts item k only once
the consumer has taken item ``k - depth``; :meth:`Prefetcher.close` lets it finish the
items it may start, that is every item below ``taken + depth``, and no more. Ranks
that close after taking the same number of items (the trainer's stop is agreed by all
ranks) therefore issue the same collectives in a stage (the id exchange), in the same
order, and none is left waiting for a peer. An exception in a stage is raised in the
consumer, at the item that failed.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

import torch

__all__ = ["Prefetcher", "SideStream"]

D = TypeVar("D")
T = TypeVar("T")

_END = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher(Generic[D, T]):
    """Iterates ``stage(desc)`` over ``source``, computed up to ``depth`` items ahead.

    Args:
        source: The descriptors, consumed only by the background thread.
        stage: Builds an item from a descriptor (runs in the background thread).
        depth: D, how many items may be prepared ahead; 0 runs each stage in the
            consumer's thread when the item is taken (no thread).
        name: The thread's name.
        join_timeout_s: How long :meth:`close` waits for the thread (a stage blocked in
            a collective whose peer died returns only at the collective's timeout).

    Example:
        >>> with Prefetcher(range(4), lambda i: i * i, depth=2) as items:
        ...     list(items)
        [0, 1, 4, 9]
    """

    def __init__(
        self,
        source: Iterable[D],
        stage: Callable[[D], T],
        depth: int,
        name: str = "sven-prefetch",
        join_timeout_s: float = 60.0,
    ) -> None:
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.depth = depth
        self._source: Iterator[D] = iter(source)
        self._stage = stage
        self._join_timeout_s = join_timeout_s
        self._items: deque[object] = deque()
        self._cond = threading.Condition()
        self._taken = 0
        self._closing = False
        self._abort = False
        #: Most items held at once (prepared and not yet taken), for tests and logs.
        self.high_water = 0
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ producer side
    def _run(self) -> None:
        k = 0
        try:
            while True:
                with self._cond:
                    # Item k may start once item k - depth is taken; after close, only
                    # the items that were allowed before it.
                    while k >= self._taken + self.depth and not self._closing:
                        self._cond.wait()
                    if k >= self._taken + self.depth or self._abort:
                        return
                try:
                    desc = next(self._source)
                except StopIteration:
                    self._put(_END)
                    return
                item = self._stage(desc)
                self._put(item)
                k += 1
        except BaseException as exc:  # re-raised in the consumer, at this item
            self._put(_Failure(exc))

    def _put(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self.high_water = max(self.high_water, sum(1 for x in self._items if _is_item(x)))
            self._cond.notify_all()

    # ------------------------------------------------------------ consumer side
    def __iter__(self) -> Prefetcher[D, T]:
        return self

    def __next__(self) -> T:
        if self._thread is None:
            if self._closing:
                raise StopIteration
            item = self._stage(next(self._source))
            self._taken += 1
            return item
        with self._cond:
            while not self._items:
                if not self._thread.is_alive() and not self._items:
                    raise RuntimeError("the prefetch thread ended without a result")
                self._cond.wait(timeout=1.0)
            item = self._items[0]
            if item is _END:
                raise StopIteration
            if isinstance(item, _Failure):
                raise item.exc
            self._items.popleft()
            self._taken += 1
            self._cond.notify_all()
        return item  # type: ignore[return-value]

    @property
    def taken(self) -> int:
        """Items the consumer has taken."""
        return self._taken

    def close(self, finish: bool = True) -> None:
        """Stops the thread and drops every prepared item. Idempotent; safe after an
        exception.

        Args:
            finish: Let the thread finish the items it may start (see the module
                docstring), so that their collectives match the other ranks'. False
                (a peer is gone): start no further item; one already running ends when
                its collectives do (at their timeout at worst).
        """
        with self._cond:
            self._closing = True
            self._abort = self._abort or not finish
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self._join_timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(
                    f"the prefetch thread did not stop within {self._join_timeout_s:g} s"
                )
        with self._cond:
            self._items.clear()

    def __enter__(self) -> Prefetcher[D, T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_item(x: object) -> bool:
    return x is not _END and not isinstance(x, _Failure)


class SideStream:
    """Runs a stage's device work on a CUDA side stream and hands it to the consumer.

    On CUDA, :meth:`run` enqueues ``fn`` on a stream of its own (so that building batch
    i + 1 overlaps the step of batch i on the default stream) and records an event;
    :meth:`hand_over` makes the consumer's stream wait for that event and marks every
    tensor of the item with ``record_stream`` (its memory must not be reused by the side
    stream's allocator while the consumer's stream still reads it). On CPU both are
    plain calls. Untested here on GPU hardware (this path needs a CUDA device).

    Args:
        device: The stage's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, fn: Callable[[], T]) -> tuple[T, object]:
        """``fn()`` on the side stream; returns its result and the event that ends it."""
        if self.stream is None:
            return fn(), None
        # The stage reads tables the default stream wrote (at start): wait for them.
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            out = fn()
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def hand_over(self, tensors: Iterable[torch.Tensor], event: object) -> None:
        """Makes the current stream wait for ``event`` and keeps ``tensors`` alive for it."""
        if self.stream is None or event is None:
            return
        cur = torch.cuda.current_stream(self.stream.device)
        cur.wait_event(event)  # type: ignore[arg-type]
        for t in tensors:
            if t.is_cuda:
                t.record_stream(cur)
