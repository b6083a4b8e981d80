"""Temporal neighbour sampling over a T-CSR index.

The T-CSR lists, for every node, its incident events sorted by (time, event id). An
event (u, v) is listed under u with neighbour v and under v with neighbour u; a
self-loop (u, u) is therefore listed twice under u. For a root (node v, time t) the
candidates are the events in v's list with time strictly before t, so that an event
never sees itself or anything simultaneous with it.

Sampling is fully vectorized and host-sync free, so the same code runs on CPU and
CUDA and can be captured in a CUDA graph (see docs/design.md, "Performance rules"): the
number of candidates of every root is found with two ``torch.searchsorted`` calls
over a global key (node, rank of time) that is sorted because every node's segment is
sorted by time, and the K sampled positions are gathered with fixed-shape index
arithmetic. No output shape depends on the data.

Example:
    >>> tcsr = TCSR.from_events(ev.src, ev.dst, ev.t, ev.num_nodes, device="cuda")
    >>> sampler = TemporalSampler(tcsr, fanouts=[10], strategy="recent")
    >>> (block,) = sampler.sample(roots, root_times)
    >>> block.nbr, block.eid, block.ts, block.mask    # (R, 10) each
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from sven import kernels
from sven.kernels import ahead
from sven.pipeline import constants
from sven.pipeline.negatives import draws_from_keys

__all__ = ["TCSR", "NeighborBlock", "TemporalSampler"]

ArrayLike = np.ndarray | torch.Tensor
Strategy = Literal["recent", "uniform"]

# Uniform draws take a 62-bit integer modulo the candidate count: exact integer
# arithmetic with a bias of at most count / 2**62, instead of float rounding at
# u * count near 1.
_RAND_HIGH = 1 << 62


def _as_tensor(x: ArrayLike, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copies a numpy array (possibly a read-only memmap) or a tensor to ``dtype``."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype)
    # np.array(copy=True) reads a memmap into RAM once and yields a writable base
    # ndarray, which torch.from_numpy accepts without a warning.
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    return torch.from_numpy(np.array(x, dtype=np_dtype, copy=True)).to(device)


def _time_dtype(t: ArrayLike) -> torch.dtype:
    """int64 for integer timestamps, float64 for floating ones."""
    if isinstance(t, torch.Tensor):
        floating = t.is_floating_point()
    else:
        floating = np.issubdtype(np.asarray(t).dtype, np.floating)
    return torch.float64 if floating else torch.int64


@dataclass(frozen=True)
class TCSR:
    """Per-node incident events, sorted by (time, event id): a temporal CSR.

    The entries of node v are ``indptr[v]:indptr[v + 1]``; an event (u, v) with id e
    appears under u as (nbr=v, eid=e) and under v as (nbr=u, eid=e), a self-loop
    twice under u.

    Attributes:
        indptr: (N + 1,) int64 segment offsets.
        nbr: (2E,) int64 neighbour of each entry.
        eid: (2E,) int64 event id (index into the event arrays) of each entry.
        ts: (2E,) int64 or float64 event time of each entry, the dtype of the input t.
    """

    indptr: torch.Tensor
    nbr: torch.Tensor
    eid: torch.Tensor
    ts: torch.Tensor

    @classmethod
    def from_events(
        cls,
        src: ArrayLike,
        dst: ArrayLike,
        t: ArrayLike,
        num_nodes: int,
        device: torch.device | str = "cpu",
    ) -> TCSR:
        """Builds the index from event columns, in any time order.

        Args:
            src: (E,) integer source ids in [0, num_nodes); numpy (memmaps and int32
                included) or a tensor.
            dst: (E,) integer destination ids in [0, num_nodes).
            t: (E,) timestamps; integer input is stored as int64, floating as float64.
            num_nodes: N, the number of nodes.
            device: Where to build and keep the index.

        Returns:
            The T-CSR on ``device``. Event ids are positions in the input arrays.

        Raises:
            ValueError: On mismatched lengths, ids outside [0, num_nodes), or NaN times.
        """
        device = torch.device(device)
        src_t = _as_tensor(src, torch.int64, device)
        dst_t = _as_tensor(dst, torch.int64, device)
        t_t = _as_tensor(t, _time_dtype(t), device)
        if not (src_t.ndim == dst_t.ndim == t_t.ndim == 1):
            raise ValueError("src, dst and t must be 1-D")
        if not (src_t.numel() == dst_t.numel() == t_t.numel()):
            raise ValueError(
                f"src, dst and t differ in length: {src_t.numel()}, {dst_t.numel()}, {t_t.numel()}"
            )
        if num_nodes < 0:
            raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
        num_events = src_t.numel()
        if num_events:
            lo = int(torch.minimum(src_t.min(), dst_t.min()))
            hi = int(torch.maximum(src_t.max(), dst_t.max()))
            if lo < 0 or hi >= num_nodes:
                raise ValueError(f"node ids span [{lo}, {hi}], outside [0, {num_nodes})")
            if t_t.is_floating_point() and bool(torch.isnan(t_t).any()):
                raise ValueError("t contains NaN")

        # Stable sort by time keeps equal times in event-id order, so the events are in
        # (t, eid) order; interleaving each event's two entries and stable-sorting by
        # node then gives every node's entries in (t, eid) order without a lexsort.
        if num_events < 2 or bool((t_t[1:] >= t_t[:-1]).all()):
            # An event store is sorted already: its stable order is the identity.
            order = torch.arange(num_events, device=device)
        else:
            order = torch.argsort(t_t, stable=True)
        node = torch.stack((src_t[order], dst_t[order]), dim=1).reshape(-1)
        other = torch.stack((dst_t[order], src_t[order]), dim=1).reshape(-1)
        by_node = torch.argsort(node, stable=True)
        entry_event = order.repeat_interleave(2)[by_node]

        counts = torch.bincount(node, minlength=num_nodes)
        indptr = torch.zeros(num_nodes + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, dim=0, out=indptr[1:])
        return cls(indptr=indptr, nbr=other[by_node], eid=entry_event, ts=t_t[entry_event])

    @property
    def num_nodes(self) -> int:
        """N, the number of nodes."""
        return self.indptr.numel() - 1

    @property
    def num_entries(self) -> int:
        """2E, the number of (node, event) entries."""
        return self.nbr.numel()

    @property
    def device(self) -> torch.device:
        """The device the index lives on."""
        return self.indptr.device

    def degree(self) -> torch.Tensor:
        """Returns the (N,) int64 number of entries per node (a self-loop counts 2)."""
        return self.indptr[1:] - self.indptr[:-1]

    def to(self, device: torch.device | str) -> TCSR:
        """Returns a copy on ``device`` (self if already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return TCSR(
            indptr=self.indptr.to(device),
            nbr=self.nbr.to(device),
            eid=self.eid.to(device),
            ts=self.ts.to(device),
        )


@dataclass(frozen=True)
class NeighborBlock:
    """The sampled neighbours of R roots, one layer.

    Attributes:
        nodes: (R,) int64 root node ids.
        times: (R,) root times, the dtype of the T-CSR's ts.
        nbr: (R, K) int64 neighbour ids; 0 in padded slots.
        eid: (R, K) int64 event ids; 0 in padded slots.
        ts: (R, K) event times, the dtype of the T-CSR's ts; 0 in padded slots.
        mask: (R, K) bool, True for real neighbours. Valid slots come first.
        age: (R, K) float64 time from each neighbour's event to its root's time as the
            sampler was given it (``float64(time) - float64(ts)``), 0 where masked; or
            None where not asked for (``TemporalSampler.sample``'s ``age``).
    """

    nodes: torch.Tensor
    times: torch.Tensor
    nbr: torch.Tensor
    eid: torch.Tensor
    ts: torch.Tensor
    mask: torch.Tensor
    age: torch.Tensor | None = None

    @property
    def dt(self) -> torch.Tensor:
        """(R, K) time since each neighbour's event, ``times[:, None] - ts``, 0 if padded.

        float64 for float64 times; for int64 times the difference is taken exactly in
        int64, then cast to torch's default float dtype.
        """
        diff = self.times[:, None] - self.ts
        if not diff.is_floating_point():
            diff = diff.to(torch.get_default_dtype())
        return torch.where(self.mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def search_steps(indptr: torch.Tensor) -> int:
    """Halvings a binary search needs over the widest segment of ``indptr`` (N + 1,)."""
    if indptr.numel() < 2:
        return 0
    return int((indptr[1:] - indptr[:-1]).max()).bit_length()


class TemporalSampler:
    """Samples temporal neighbours strictly before each root's time, over L layers.

    Args:
        tcsr: The index; sampling runs on its device.
        fanouts: K per layer, e.g. ``[10]`` or ``[10, 10]``.
        strategy: ``"recent"``: the K latest candidates by (ts, eid), most recent
            first. ``"uniform"``: K draws with replacement among the candidates
            (each entry equally likely, so a self-loop counts twice).

    Raises:
        ValueError: On an unknown strategy, an empty or non-positive fanout, or an
            index too large for the int64 search key.
    """

    def __init__(self, tcsr: TCSR, fanouts: Sequence[int], strategy: Strategy = "recent"):
        if strategy not in ("recent", "uniform"):
            raise ValueError(f"strategy must be 'recent' or 'uniform', got {strategy!r}")
        fanouts = [int(k) for k in fanouts]
        if not fanouts or min(fanouts) < 1:
            raise ValueError(f"fanouts must be a non-empty list of positive ints, got {fanouts}")
        self.tcsr = tcsr
        self.fanouts = fanouts
        self.strategy: Strategy = strategy

        # Global search key: node * (U + 1) + rank of the entry's time among the U
        # distinct times. Segments are sorted by node and, within a node, by time, so
        # the key is sorted and one searchsorted finds every root's cut point at once,
        # whatever the degrees (no per-root loop, no per-segment binary search).
        self._times, rank = torch.unique(tcsr.ts, sorted=True, return_inverse=True)
        self._stride = self._times.numel() + 1
        if tcsr.num_nodes * self._stride >= 1 << 63:
            raise ValueError(
                f"{tcsr.num_nodes} nodes x {self._stride - 1} distinct times overflow the "
                "int64 search key"
            )
        node = torch.repeat_interleave(
            torch.arange(tcsr.num_nodes, device=tcsr.device), tcsr.degree()
        )
        self._key = node * self._stride + rank
        # The halvings of the Triton sampler's binary search, which cover the widest
        # segment: read here, with the index's other host syncs, so sampling has none.
        self._steps = search_steps(tcsr.indptr)

    def sample(
        self,
        nodes: torch.Tensor,
        times: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        root_mask: torch.Tensor | None = None,
        keys: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
        pad_id: int = 0,
        age: bool = False,
    ) -> list[NeighborBlock]:
        """Samples ``len(fanouts)`` layers of temporal neighbours.

        Layer l + 1's roots are layer l's ``nbr.flatten()`` at times ``ts.flatten()``.
        A padded slot of layer l becomes a padded root of layer l + 1: its row is fully
        masked (the mask is carried explicitly rather than relying on time 0 having no
        predecessors, which fails for negative or zero-based times).

        Args:
            nodes: (R,) int64 root node ids in [0, N), on the index's device.
            times: (R,) root times. Integer times are compared exactly with int64 ts;
                floating times against int64 ts are rounded up first, which keeps
                ``ts < time`` exact.
            generator: Random source for ``"uniform"``, on the index's device; None uses
                torch's default generator. Unused by ``"recent"``.
            root_mask: (R,) bool, False for padding roots (e.g. of a fixed-size padded
                batch), whose rows come back fully masked. None means all valid.
            keys: (R,) int64 random keys of the roots for ``"uniform"`` (see
                ``negatives.batch_keys``): a root's draws are then a function of its
                key alone, so that they do not depend on which rank samples it or on
                any generator state. Slot j of a root draws from ``mix(key, j)``; the
                next layer's roots are keyed by those draws. Overrides ``generator``.
            ids: (R * fanouts[0],) int64 contiguous, or None: written with the first
                layer's neighbour ids, ``pad_id`` where masked (a batch's id list,
                whose padding is a node of its own).
            pad_id: See ``ids``.
            age: Whether the blocks carry ``age`` (the time since each neighbour's
                event).

        Returns:
            One NeighborBlock per layer; layer l has ``R * prod(fanouts[:l])`` roots and
            ``fanouts[l]`` columns.
        """
        device = self.tcsr.device
        nodes = nodes.to(device=device, dtype=torch.int64)
        # The roots' times as given: each path brings them to the index's time dtype
        # (_cast_times), the Triton kernel inside its one launch.
        times = times.to(device)
        valid = None if root_mask is None else root_mask.to(device=device, dtype=torch.bool)
        if keys is not None:
            keys = keys.to(device=device, dtype=torch.int64)
        blocks = []
        for k in self.fanouts:
            out = _Extras(ids, pad_id, age)
            block, keys = self._sample_layer(nodes, times, valid, k, generator, keys, out)
            blocks.append(block)
            nodes, times, valid = block.nbr.flatten(), block.ts.flatten(), block.mask.flatten()
            ids = None
        return blocks

    def _cast_times(self, times: torch.Tensor) -> torch.Tensor:
        """Brings root times to the index's time dtype without changing ``ts < time``."""
        ts_dtype = self.tcsr.ts.dtype
        if not ts_dtype.is_floating_point and times.is_floating_point():
            # For integer ts, ts < 5.5 <=> ts < 6: rounding up keeps the comparison.
            times = torch.ceil(times)
        return times.to(ts_dtype)

    def _sample_layer(
        self,
        nodes: torch.Tensor,
        times: torch.Tensor,
        valid: torch.Tensor | None,
        k: int,
        generator: torch.Generator | None,
        keys: torch.Tensor | None = None,
        extras: _Extras | None = None,
    ) -> tuple[NeighborBlock, torch.Tensor | None]:
        """One layer: (R,) roots at their (R,) times as given -> (R, k) neighbours, and
        the next layer's (R * k,) keys (None without ``keys`` or for "recent"). See
        ``sample``."""
        tcsr = self.tcsr
        device = tcsr.device
        num_roots = nodes.numel()
        extras = extras or _Extras()
        if (
            self.strategy == "recent"
            and tcsr.num_entries
            and kernels.backend_for(nodes, "sample_recent") == "triton"
        ):
            block = self._recent_triton(nodes, times, valid, k, extras)
            if not ahead.dry_running():
                return block, None
        given, times = times, self._cast_times(times)
        lo = tcsr.indptr.index_select(0, nodes)
        if tcsr.num_entries == 0:
            # No entries to gather from; known at construction, so not a data branch.
            end = lo
        else:
            # Number of distinct times < t, then the first entry of the node with a
            # time >= t: the entries in [lo, end) are exactly those with ts < t.
            time_rank = torch.searchsorted(self._times, times, side="left")
            end = torch.searchsorted(self._key, nodes * self._stride + time_rank, side="left")
        count = end - lo
        if valid is not None:
            count = torch.where(valid, count, torch.zeros_like(count))

        slot = torch.arange(k, device=device)
        next_keys = None
        if self.strategy == "recent":
            pos = end[:, None] - 1 - slot
            mask = slot < count[:, None]
        else:
            if keys is not None:
                draw = draws_from_keys(keys, k)
                next_keys = draw.flatten()
            else:
                draw = torch.randint(
                    0, _RAND_HIGH, (num_roots, k), generator=generator, device=device
                )
            # clamp keeps the modulo defined for empty rows, which are masked anyway.
            pos = lo[:, None] + draw % count.clamp(min=1)[:, None]
            mask = (count > 0)[:, None].repeat(1, k)
        # Padded slots point at entry 0 so the gathers stay in bounds, then get zeroed.
        pos = torch.where(mask, pos, torch.zeros((), dtype=pos.dtype, device=device))
        if tcsr.num_entries == 0:
            nbr = torch.zeros((num_roots, k), dtype=torch.int64, device=device)
            eid = torch.zeros_like(nbr)
            ts = torch.zeros((num_roots, k), dtype=tcsr.ts.dtype, device=device)
        else:
            # index_select on the flat positions: on CPU several times faster than
            # advanced indexing with a 2-D index, and one gather kernel on CUDA.
            flat = pos.reshape(-1)
            zero = torch.zeros((), dtype=torch.int64, device=device)
            nbr = torch.where(mask, tcsr.nbr.index_select(0, flat).view(num_roots, k), zero)
            eid = torch.where(mask, tcsr.eid.index_select(0, flat).view(num_roots, k), zero)
            ts = tcsr.ts.index_select(0, flat).view(num_roots, k)
            ts = torch.where(mask, ts, zero.to(ts.dtype))
        age = extras.write(given, nbr, ts, mask)
        block = NeighborBlock(nodes=nodes, times=times, nbr=nbr, eid=eid, ts=ts, mask=mask, age=age)
        return block, next_keys

    def _recent_triton(
        self,
        nodes: torch.Tensor,
        times: torch.Tensor,
        valid: torch.Tensor | None,
        k: int,
        extras: _Extras,
    ) -> NeighborBlock:
        """The "recent" layer as one Triton kernel (``sven.kernels.triton_sampler``):
        the same block as the reference path above, its times' cast and ``extras``
        included, in one launch instead of ~20."""
        from sven.kernels.triton_sampler import sample_recent

        tcsr = self.tcsr
        nbr, eid, ts, mask, cast, age = sample_recent(
            tcsr.indptr, tcsr.ts, tcsr.nbr, tcsr.eid, nodes, times, valid, k, self._steps,
            ids=extras.ids, pad_id=extras.pad_id, age=extras.age,
        )  # fmt: skip
        return NeighborBlock(nodes=nodes, times=cast, nbr=nbr, eid=eid, ts=ts, mask=mask, age=age)


@dataclass(frozen=True)
class _Extras:
    """What a layer writes beside its block (``TemporalSampler.sample``'s ``ids``,
    ``pad_id`` and ``age``)."""

    ids: torch.Tensor | None = None
    pad_id: int = 0
    age: bool = False

    def write(
        self, given: torch.Tensor, nbr: torch.Tensor, ts: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor | None:
        """Writes ``ids`` from the (R, K) ``nbr`` and ``mask``; returns the (R, K) age
        from the (R,) times as ``given`` and the (R, K) ``ts`` (None without ``age``)."""
        if self.ids is not None:
            pad = constants.filled(self.pad_id, (), torch.int64, nbr.device)
            torch.where(mask, nbr, pad, out=self.ids.view(nbr.shape))
        if not self.age:
            return None
        return torch.where(mask, given.to(torch.float64)[:, None] - ts.to(torch.float64), 0.0)
