"""Where a step's batches come from: their inputs, this rank's share, the build, the ring.

A step does not read its batch from the host: a batch is named by a few numbers (its
share's range in this rank's event order, its global start, its random stream, its
split's start) that live in :class:`BatchInputs` (0-d device tensors refilled in place
on a fixed-shape step, which a captured graph reads; plain numbers on the exact-size
one). :class:`BatchSource` builds the batch those numbers name (selection, negatives,
neighbour sampling, de-duplication into node slots) and plans where its node-state
rows come from; none of it reads node state or parameters, so a batch can be built
ahead of its step. A :class:`Ring` of D + 1 built batches does that with prefetch
depth D (:class:`Inline` builds each batch in its own step).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np
import torch

from sven.engine.body import StepInput
from sven.engine.spec import RunSpec
from sven.kernels.strides import is_dense
from sven.pipeline.batch import Batch
from sven.pipeline.dedupe import dedupe_fixed, slot_count
from sven.pipeline.exchange_api import Exchange, read_occurrences

__all__ = [
    "BatchInputs",
    "BatchSource",
    "Inline",
    "Ring",
    "Shares",
    "batch_bounds",
    "copy_tree",
    "tree_tensors",
]

#: The numbers that name a batch.
INPUT_NAMES = ("start", "stop", "gstart", "stream", "split_lo")

Lap = Callable[[str], None]


def batch_bounds(lo: int, hi: int, b: int, i: int) -> tuple[int, int]:
    """Events of batch i of size b in [lo, hi) (empty past ``hi``)."""
    return min(lo + i * b, hi), min(lo + (i + 1) * b, hi)


class BatchInputs:
    """The numbers that name one batch (:data:`INPUT_NAMES`, plus extras such as the
    prediction count).

    On a fixed-shape step they are 0-d views of one device tensor, refilled in place (a
    captured graph reads them where they are) by one host-to-device copy per
    :meth:`fill`, where a fill per number was a kernel launch each (nine per training
    step); on the exact-size step plain numbers.

    Args:
        fixed: Device tensors (True) or numbers.
        device: Where the tensors live.
        extra: More named numbers: name -> dtype of its tensor (int64 or float64).
    """

    def __init__(
        self, fixed: bool, device: torch.device, extra: dict[str, torch.dtype] | None = None
    ) -> None:
        self.fixed, self.device = fixed, device
        kinds = {**dict.fromkeys(INPUT_NAMES, torch.int64), **(extra or {})}
        if any(dt not in (torch.int64, torch.float64) for dt in kinds.values()):
            raise ValueError(f"batch inputs are int64 or float64, got {kinds}")
        self.kinds = kinds
        self.values: dict[str, Any] = dict.fromkeys(kinds, 0)
        if fixed:
            self._numbers = dict(self.values)
            self._bind(torch.zeros(len(kinds), dtype=torch.int64, device=device))
            self._staging = _Staging(len(kinds), device)

    def _bind(self, buf: torch.Tensor) -> None:
        # Every number is one 8-byte word of ``buf``; float64 ones are read through a view.
        self._buf = buf
        self.values = {
            k: (buf[i : i + 1] if dt == torch.int64 else buf[i : i + 1].view(dt))[0]
            for i, (k, dt) in enumerate(self.kinds.items())
        }

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def fill(self, **values: float) -> None:
        """Sets named numbers (on the device: one copy of all of them)."""
        if not self.fixed:
            self.values.update(values)
            return
        unknown = set(values) - set(self._numbers)
        if unknown:
            raise KeyError(f"no batch input named {sorted(unknown)}")
        self._numbers.update(values)
        self._staging.upload(self._buf, self._numbers, self.kinds)

    def copy(self) -> BatchInputs:
        """Inputs of their own with the same values (a replay walks beside the step)."""
        new = BatchInputs.__new__(BatchInputs)
        new.fixed, new.device, new.kinds = self.fixed, self.device, self.kinds
        if self.fixed:
            new._numbers = dict(self._numbers)
            new._bind(self._buf.clone())
            new._staging = _Staging(len(self.kinds), self.device)
        else:
            new.values = dict(self.values)
        return new


class _Staging:
    """Host words copied to a device tensor without waiting for the device.

    On CUDA a ring of pinned buffers: the copy from one is queued behind the steps
    already queued, so a buffer is written again only once its last copy has run (its
    event), and the host never waits for the step in flight unless it is a ring ahead.
    """

    SLOTS = 4

    def __init__(self, n: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.bufs = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(self.SLOTS)]
        # Written through numpy views: a tensor's item assignment costs microseconds.
        self.words = [b.numpy() for b in self.bufs]
        self.events: list[Any] = [None] * self.SLOTS
        self.cuda = pin
        self.next = 0

    def upload(self, dst: torch.Tensor, numbers: dict[str, float], kinds: dict) -> None:
        """Writes ``numbers`` (in the order of ``kinds``) into ``dst`` (n,) int64."""
        k = self.next
        self.next = (k + 1) % self.SLOTS
        if self.events[k] is not None:
            self.events[k].synchronize()
        ints = self.words[k]
        floats = ints.view(np.float64)
        for i, (name, dt) in enumerate(kinds.items()):
            if dt == torch.int64:
                ints[i] = int(numbers[name])
            else:
                floats[i] = float(numbers[name])
        dst.copy_(self.bufs[k], non_blocking=self.cuda)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.events[k] = ev


class Shares:
    """This rank's share of every global batch: where its events lie, how many slots.

    One process owns every event: a global batch's share is the batch itself. On P
    ranks, rank r processes the events the partition assigns to it, in time order
    (``order``); its share of a global batch is padded to the largest share any rank
    has of any batch (the same number everywhere, from the assignment every rank
    holds), so that every step has one shape.

    Args:
        data: The run's data (``assign``).
        spec: How the run runs (its ranks, and the share's capacity:
            :attr:`~sven.engine.spec.RunSpec.capacity`).
    """

    def __init__(self, data: Any, spec: RunSpec) -> None:
        self.rank, self.world_size = spec.rank, spec.world_size
        #: Events of a share on a fixed-shape step, or None (exact-size step).
        self.capacity = spec.capacity
        self.order: torch.Tensor | None = None
        self._order_host: np.ndarray | None = None
        if spec.distributed:
            mine = (data.assign == spec.rank).nonzero().squeeze(1)
            self._order_host = mine.cpu().numpy()
            # A filler entry: a padded slot repeats the share's last event.
            filler = mine[-1:] if mine.numel() else mine.new_zeros(1)
            self.order = torch.cat([mine, filler])

    def of(self, g_lo: int, g_hi: int) -> tuple[int, int]:
        """Where a global batch's share of this rank lies in ``order``."""
        if self._order_host is None:
            return g_lo, g_hi
        a, z = np.searchsorted(self._order_host, [g_lo, g_hi])
        return int(a), int(z)

    def name(self, inp: BatchInputs, g_lo: int, g_hi: int, stream: int, **extra: float) -> None:
        """Sets ``inp`` to the share of global batch [g_lo, g_hi) drawn from ``stream``,
        and the ``extra`` numbers with it."""
        lo, hi = self.of(g_lo, g_hi)
        inp.fill(start=lo, stop=hi, gstart=g_lo, stream=stream, **extra)


class BatchSource:
    """Builds the batch a :class:`BatchInputs` names and plans its node-state rows.

    Reads no node state and no parameter, so it may run ahead of the step (prefetch).

    Args:
        tables: The step's event tables (:class:`~sven.pipeline.stages.EventTables`).
        model: The model (its ``sample_roots`` and ``read_neighbors``).
        seed: The run's seed.
        shares: This rank's shares.
        exchange: Where rows come from: a :class:`FixedExchange` plans each share's
            remote rows with their owners; a :class:`LocalExchange` reads them in place.
        spec: How the run runs: across ranks a share's rows are planned through the
            exchange; on one process they are read in place (chosen here, once).
    """

    def __init__(
        self,
        tables: Any,
        model: Any,
        seed: int,
        shares: Shares,
        exchange: Exchange,
        spec: RunSpec,
    ) -> None:
        self.tables, self.model, self.seed = tables, model, seed
        self.shares = shares
        self.exchange = exchange
        self._rows = self._planned_rows if spec.distributed else self._local_rows
        #: Node slots per kind of step (``train``, ``eval<width>``) planned from a replay of its
        #: batches; a kind not listed takes the most its ids could need.
        self.slots: dict[str, int] = {}

    def select(
        self,
        inp: BatchInputs,
        num_neg: int,
        start: Any,
        stop: Any,
        capacity: int | None,
        neg_table: torch.Tensor | None = None,
        slots: int | None = None,
        for_grad: bool = True,
    ) -> Batch:
        """The events [start, stop) of this rank's order, as one batch (``slots``:
        its planned node slots, or None; ``for_grad``: a gradient will be taken through
        it, :func:`~sven.pipeline.batch.make_batch`)."""
        from sven.pipeline.stages import select_batch

        return select_batch(
            self.tables,
            start,
            stop,
            inp["stream"],
            seed=self.seed,
            num_neg=num_neg,
            sample_roots=self.model.sample_roots,
            read_neighbors=self.model.read_neighbors,
            capacity=capacity,
            neg_table=neg_table,
            table_lo=inp["split_lo"],
            order=self.shares.order,
            batch_start=inp["gstart"],
            slots=slots,
            for_grad=for_grad,
        )

    def select_share(
        self,
        inp: BatchInputs,
        num_neg: int,
        neg_table: torch.Tensor | None,
        micro: int,
        slots: int | None = None,
        for_grad: bool = True,
    ) -> list[Batch]:
        """The share named by ``inp``, whole (in ``slots`` node slots, or None for
        the most its ids could need) or as ``micro`` parts of equal capacity that its
        events fill in order (``for_grad``: as :meth:`select`'s)."""
        start, stop, cap = inp["start"], inp["stop"], self.shares.capacity
        if micro == 1:
            return [self.select(inp, num_neg, start, stop, cap, neg_table, slots, for_grad)]
        c = -(-cap // micro)  # type: ignore[operator]
        return [
            self.select(
                inp,
                num_neg,
                torch.minimum(start + j * c, stop),
                torch.minimum(start + (j + 1) * c, stop),
                c,
                neg_table,
                for_grad=for_grad,
            )
            for j in range(micro)
        ]

    def build(
        self,
        inp: BatchInputs,
        num_neg: int,
        mode: str,
        neg_table: torch.Tensor | None = None,
        micro: int = 1,
        group: Any = None,
        lap: Lap | None = None,
        read_ahead: bool = False,
        ahead_key: Hashable | None = None,
    ) -> StepInput:
        """A share's micro-batches and the plan of its rows; ``lap`` ends the
        ``sample`` and ``id_exchange`` stages (eager runs); ``read_ahead``: its rows
        are read now too, where the exchange reads rows ahead (a batch built ahead of
        its step by the prefetch ring), under ``ahead_key`` (the ring position it
        goes to) where the copy engine reads them."""
        lap = lap or _no_lap
        # Only training differentiates through its batches' row gathers.
        batches = self.select_share(
            inp, num_neg, neg_table, micro, self.slots.get(mode), for_grad=mode == "train"
        )
        lap("sample")
        item = self._rows(batches, mode, group, lap)
        if read_ahead:
            src = item.source
            nodes = src if isinstance(src, torch.Tensor) else src.nodes
            item.early = self.exchange.read_ahead(nodes, ahead_key)
        return item

    def _local_rows(self, batches: list[Batch], mode: str, group: Any, lap: Lap) -> StepInput:
        """One process: rows are read in place, a whole share's from its batch; a share
        in micro-batches reads each node once."""
        if len(batches) == 1:
            return StepInput(batches)
        nodes, _, at = self._share_nodes(batches)
        return StepInput(batches, nodes, at)

    def _planned_rows(self, batches: list[Batch], mode: str, group: Any, lap: Lap) -> StepInput:
        """P ranks: the share's rows planned with their owners through the exchange."""
        nodes, occ, at = self._share_nodes(batches)
        plan = self.exchange.plan(nodes, occ, mode, group=group)
        lap("id_exchange")
        return StepInput(batches, plan, at)

    def _share_nodes(
        self, batches: list[Batch]
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """The (U,) nodes a share reads, their (U,) read counts, and where each
        micro-batch's nodes are among them (None for a whole share)."""
        if len(batches) == 1:
            return batches[0].nodes, read_occurrences(batches[0]), None
        # One fetch for the whole share: each node is read once, by whichever
        # micro-batch needs it, so the bytes are those of the unsplit share.
        cat = torch.cat([mb.nodes for mb in batches])
        n = self.tables.num_nodes
        nodes, inverse = dedupe_fixed(cat, n, slot_count(cat.shape[0], n))
        at = list(torch.split(inverse, [mb.nodes.shape[0] for mb in batches]))
        occ = torch.zeros_like(nodes)
        for mb, pos in zip(batches, at):
            occ.index_add_(0, pos, read_occurrences(mb))
        return nodes, occ, at


class Inline:
    """Depth 0: each step builds its own batch, from the step's own inputs."""

    depth = 0

    def take(self, k: int, build: Callable[[int], StepInput]) -> StepInput:
        """The batch of the step at ring position ``k``: built now (into position 0)."""
        return build(0)

    def join(self) -> None:
        """Nothing runs beside the step."""

    def fill(self, *args: Any, **kwargs: Any) -> None:
        """Nothing is built ahead."""

    def tensors(self) -> list[torch.Tensor]:
        """No batch is kept between steps."""
        return []


class Ring:
    """The prefetch ring of depth D: during step i the batch of step i + D is built (on
    a side stream on CUDA) into position (i + D) mod (D + 1), in place once the position
    exists, so that the graph captured at each position finds its batch where it was.

    Args:
        depth: D >= 1.
        device: Where the steps run (a side stream on CUDA).
        determinism: The step's arithmetic mode (:func:`sven.engine.capture.determinism`).
    """

    def __init__(
        self,
        depth: int,
        device: torch.device,
        determinism: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self.depth = depth
        self.slots: list[StepInput | None] = [None] * (depth + 1)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._determinism = determinism

    def _put(self, k: int, item: StepInput) -> None:
        if self.slots[k] is None:
            self.slots[k] = item
        else:
            copy_tree(self.slots[k], item)

    def take(self, k: int, build: Callable[[int], StepInput]) -> StepInput:
        """Builds the batch D ahead of position k into its position (on the side
        stream; ``build`` is given the position) and returns position k's batch,
        built D steps before."""
        d = self.depth
        p = (k + d) % (d + 1)
        with self._ahead_stream():
            self._put(p, build(p))
        return self.slots[k]  # type: ignore[return-value]

    def join(self) -> None:
        """The step's stream waits for the batch built beside it (before the step that
        uses it)."""
        if self._side is not None:
            torch.cuda.current_stream().wait_stream(self._side)

    def fill(
        self,
        inputs: BatchInputs,
        shares: Shares,
        first: int,
        bounds: Callable[[int], tuple[int, int]],
        stream: int,
        build: Callable[[int], StepInput],
    ) -> None:
        """Builds batches ``first..first + D`` (batch i's global events ``bounds(i)``)
        into positions i mod (D + 1) (``build`` is given the position): every
        position, the one the step of ``first`` builds too, so that the ring has all
        its tensors before a graph is captured."""
        d = self.depth
        with self._determinism():
            for i in range(first, first + d + 1):
                shares.name(inputs, *bounds(i), stream)
                self._put(i % (d + 1), build(i % (d + 1)))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the ring holds (a captured graph's warm-up restores them)."""
        return [t for item in self.slots for t in tree_tensors(item)]

    @contextlib.contextmanager
    def _ahead_stream(self) -> Iterator[None]:
        """Where a batch ahead is built: on CUDA a side stream that starts after the
        work queued so far (it reads no memory or parameter, so it runs beside the
        step's compute); elsewhere the current stream."""
        if self._side is None:
            yield
            return
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            yield


def ring(
    depth: int,
    device: torch.device,
    determinism: Callable[[], contextlib.AbstractContextManager[None]],
) -> Inline | Ring:
    """The ring of a step with prefetch depth ``depth`` (0: :class:`Inline`)."""
    return Ring(depth, device, determinism) if depth else Inline()


def copy_tree(dst: Any, src: Any) -> None:
    """Copies a built batch (dataclasses, lists and tensors) into one of the same
    shapes, in place: one multi-tensor copy per device where a copy per tensor was one
    kernel each (27 in TGN's prefetched step). Pairs laid out alike are copied as
    their bytes, whatever their dtype; any other pair in a copy of its dtype."""
    groups: dict[tuple[torch.dtype, torch.device], tuple[list, list]] = {}
    for a, b in _tensor_pairs(dst, src):
        if a is b:
            # A buffer the batch was built into in place (rows the copy engine fills
            # from the host, sven.models.copyahead): a copy onto itself would race
            # with that fill.
            continue
        flat = _as_bytes(a, b)
        key = (torch.uint8 if flat else a.dtype, a.device)
        to, frm = groups.setdefault(key, ([], []))
        to.append(flat[0] if flat else a)
        frm.append(flat[1] if flat else b)
    for to, frm in groups.values():
        torch._foreach_copy_(to, frm)


def _as_bytes(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(n,) uint8 views of the bytes of ``a`` and ``b`` in the same element order, or
    None: both dense (no gaps, no overlaps) with one dtype, one device and one layout,
    so that their storage order pairs the same elements."""
    if (
        a.dtype != b.dtype
        or a.device != b.device
        or a.shape != b.shape
        or a.stride() != b.stride()
        or a.numel() == 0
        or not is_dense(a)
    ):
        return None
    n = a.numel()
    return (
        a.as_strided((n,), (1,)).view(torch.uint8),
        b.as_strided((n,), (1,)).view(torch.uint8),
    )


def _children(obj: Any) -> list[Any] | None:
    """The parts of a tree node (a list, tuple or dataclass instance), or None for a
    leaf."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # Not dataclasses.astuple: it deep-copies every tensor.
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return None


def _tensor_pairs(dst: Any, src: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The tensors of two trees of the same structure, pairwise (None leaves skipped)."""
    if isinstance(dst, torch.Tensor):
        yield dst, src
        return
    parts = _children(dst)
    if parts is not None:
        for a, b in zip(parts, _children(src) or [], strict=True):
            yield from _tensor_pairs(a, b)


def tree_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a tree of lists, tuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    parts = _children(obj)
    return [] if parts is None else [t for x in parts for t in tree_tensors(x)]


def _no_lap(stage: str) -> None:
    pass
