"""A checkpoint's model and node state, opened for questions with nothing of the graph's
size in memory.

Answering a query (u, v, t) after a checkpoint's time needs the model's parameters, the
node state of u, v and their sampled temporal neighbours, those neighbours (the events
of u and v before t) and the features of those nodes and events; not the node state of
the other nodes, nor the event tables of the whole stream. :class:`StoredRun` holds the
model, the event store and the checkpoint's node-state files, all three opened without
copying a column or a table (memory-mapped ``.npy`` files); for the nodes of a set of
queries, :meth:`StoredRun.sampler` builds the temporal index of those nodes only
(:class:`LocalSampler`, their incident events found in one pass over the store's source
and destination columns, a chunk at a time), and :meth:`StoredRun.node_rows`,
:meth:`StoredRun.edge_rows` and :meth:`StoredRun.state_rows` read the rows the batch
needs.

What it allocates: the model; O(queried nodes + their incident events) for the index;
the rows read; and chunks of a bounded size while scanning. A trainer
(:func:`sven.tasks.replay.open_run`) holds instead the whole node state (N rows of
memory, mailbox and times: about 40 GB for the 10^8 nodes of ``docs/scale.md``) and the
stream's T-CSR (N + 1 offsets and 2E entries), which a replay walks.

The answers are those of the trainer's tables: a node's list in the local index is its
list in the run's T-CSR (its incident events in (time, event id) order), so that the
neighbours sampled for it (the most recent, or uniform draws keyed by the query) are the
same; features are cast as the trainer casts its columns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sven.errors import SvenError

if TYPE_CHECKING:
    from sven.config import Config
    from sven.models import MemoryModel
    from sven.models.memory import MemoryRows
    from sven.pipeline.sampler import NeighborBlock

__all__ = [
    "LocalSampler",
    "QuerySource",
    "StateTable",
    "StoredRun",
    "events_before",
    "incident_entries",
    "read_in_file_order",
    "unique_ids",
]

#: Events of the store's columns read per chunk while looking for the queried nodes'
#: incident events (about 40 MB of work arrays at a time).
_CHUNK = 1 << 21
#: Bytes of a node-state file read and checked by one task of a read in file order (a
#: whole number of the folder's digest chunks).
_PIECE = 16 << 20
#: 2^64 / golden ratio: the multiplier of Fibonacci hashing.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class StoredRun:
    """The parts of a run that answering from its checkpoint's node state needs.

    Args:
        folder: The ``step-N`` folder (:func:`sven.tasks.replay.run_config`).
        state: Its ``state.pt``.
        cfg: The command's config (the run's, with the command's overrides).
        other_store: Accept another store than the one the model was trained on.

    Attributes:
        cfg: The config.
        device: Where the model runs.
        dtype: Its floating type.
        events: The event store, memory-mapped.
        num_nodes: N.
        ranges: Split -> [lo, hi) event range.
        model: The checkpoint's model, in evaluation mode.
        note: A line saying the model is applied to another store, or None.
    """

    def __init__(
        self, folder: Path, state: dict[str, Any], cfg: Config, *, other_store: bool = False
    ) -> None:
        from sven.datasets.store import open_verified_store
        from sven.distributed.launcher import detect_launcher
        from sven.distributed.process_group import _pick_device
        from sven.engine.data import SPLITS, check_splits
        from sven.engine.store_check import check_same_data
        from sven.errors import ConfigError
        from sven.models import model_from_config

        self.folder, self.cfg = folder, cfg
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        # The device a trainer of this config would run on (sven.engine.trainer).
        self.device = _pick_device(tc.device, detect_launcher(os.environ))
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tc.matmul_precision == "high"
        self.dtype = torch.float64 if tc.dtype == "float64" else torch.float32
        path = cfg.data.path
        if not path or not Path(path).is_dir():
            raise ConfigError(f"data.path: no event store at {path or '(none)'}")
        # Verified as a trainer verifies it (its columns stay memory-mapped).
        self.events = open_verified_store(
            path, verify=cfg.data.verify, hint="set data.verify=false to use it anyway"
        )
        ev = self.events
        self.num_nodes = int(ev.num_nodes)
        self.ranges = {s: tuple(int(x) for x in ev.split_range(s)) for s in SPLITS}
        check_splits(path, self.ranges, 0)
        # What check_same_data reads of a trainer's data: its event count as a size
        # (a view of one element, not E of them).
        facts = SimpleNamespace(
            events=ev, num_nodes=self.num_nodes, ranges=self.ranges, cfg=cfg,
            src=torch.zeros((), dtype=torch.int8).expand(int(ev.num_events)),
        )  # fmt: skip
        self.note = check_same_data(state, facts, folder, other_store=other_store)
        self.edge_dim = 0 if ev.edge_feat is None else int(ev.edge_feat.shape[1])
        node_dim = 0 if ev.node_feat is None else int(ev.node_feat.shape[1])
        # As the trainer builds it, then the saved parameters. JODIE's, DyRep's and
        # APAN's time scale (a statistic of the training events) is saved with them; a
        # checkpoint without it has it worked out from the events, as the trainer does.
        torch.manual_seed(tc.seed)
        model = model_from_config(cfg.model, edge_dim=self.edge_dim, node_dim=node_dim)
        if any(k.endswith(".scale_bits") and k not in state["model"] for k in model.state_dict()):
            lo, hi = self.ranges["train"]
            torch.manual_seed(tc.seed)
            model = model_from_config(
                cfg.model, edge_dim=self.edge_dim, node_dim=node_dim,
                train_events=(ev.src[lo:hi], ev.dst[lo:hi], ev.t[lo:hi]),
            )  # fmt: skip
        self.model: MemoryModel = model.to(self.device, self.dtype)
        self.model.load_state_dict(state["model"])
        self.model.eval()
        self._files: Any = None

    # ------------------------------------------------------------ node state
    def state_files(self) -> Any:
        """The checkpoint's node-state files (:class:`NodeStateFiles`), or None where it
        holds none."""
        from sven.engine.checkpoint.load import NodeStateFiles

        if self._files is None:
            files = NodeStateFiles(self.folder)
            self._files = files if files.source.fields else False
        return self._files or None

    def state_rows(self, nodes: torch.Tensor) -> MemoryRows:
        """The checkpoint's node state of ``nodes`` (U,) int64, read from its
        memory-mapped files: (U, ...) tensors of these rows only, on the device."""
        from sven.engine.checkpoint.load import load_node_state
        from sven.models.memory import MemoryRows, MemoryState

        # The fields' row shapes and types, from a node state of no nodes.
        model = self.model
        empty = MemoryState(0, self.cfg.model.memory_dim, model.mail_dim, model.mailbox_size,
                            self.device, self.dtype)  # fmt: skip
        u = nodes.numel()
        dest = {k: v.new_empty((u, *v.shape[1:])) for k, v in empty.full.items()}
        files = self.state_files()
        load_node_state(self.folder, dest, nodes, self.num_nodes, files=files)
        return MemoryRows(*(dest[k] for k in MemoryState._FIELDS))

    def state_table(self, nodes: np.ndarray) -> StateTable:
        """The checkpoint's node state of ``nodes`` (R,) int64 (ascending, distinct), read
        in one pass over its files in file order (:func:`read_in_file_order`), each chunk
        they lie in checked once: a :class:`StateTable` on the device."""
        from sven.models.memory import MemoryRows, MemoryState

        model = self.model
        empty = MemoryState(0, self.cfg.model.memory_dim, model.mail_dim, model.mailbox_size,
                            self.device, self.dtype)  # fmt: skip
        files = self.state_files()
        if files is None:
            raise SvenError(f"{self.folder} holds no node state")
        if files.source.num_nodes != self.num_nodes:
            raise SvenError(
                f"{self.folder} holds the node state of {files.source.num_nodes} vertices; "
                f"this run's data has {self.num_nodes}"
            )
        host = read_in_file_order(files, nodes, list(MemoryState._FIELDS))
        # Cast as a row-by-row read casts (torch's .to from the file's dtype): the same
        # values; on the CPU in the file's dtype, no copy.
        rows = {k: torch.from_numpy(v).to(empty.full[k].device, empty.full[k].dtype)
                for k, v in host.items()}  # fmt: skip
        return StateTable(nodes, MemoryRows(*(rows[k] for k in MemoryState._FIELDS)))

    # ---------------------------------------------------------------- tables
    def sampler(self, nodes: np.ndarray) -> LocalSampler | None:
        """The temporal neighbour sampler of the compact ``nodes`` (any order, with
        repeats), or None for a model that samples none."""
        if self.model.sample_roots == "none":
            return None
        mc = self.cfg.model
        return LocalSampler(self.events, unique_ids(nodes), mc.num_neighbors, mc.sampling,
                            self.device)  # fmt: skip

    def node_rows(self, nodes: torch.Tensor) -> torch.Tensor | None:
        """(U, d_n) static features of ``nodes``, or None without node features."""
        feat = self.events.node_feat
        if feat is None:
            return None
        rows = np.asarray(feat[nodes.cpu().numpy()])
        return torch.from_numpy(rows).to(self.device, self.dtype)

    def edge_rows(self, eid: torch.Tensor) -> torch.Tensor:
        """(*eid.shape, d_e) features of the events ``eid``."""
        flat = eid.reshape(-1).cpu().numpy()
        rows = torch.from_numpy(np.asarray(self.events.edge_feat[flat]))
        return rows.to(self.device, self.dtype).view(*eid.shape, -1)

    def candidates(self) -> np.ndarray:
        """(C,) the distinct destinations of the stream, ascending (a chunk at a time)."""
        dst = self.events.dst
        out = np.zeros(0, dtype=np.int64)
        for a in range(0, dst.shape[0], _CHUNK):
            out = np.union1d(out, np.asarray(dst[a : a + _CHUNK]).astype(np.int64))
        return out


class LocalSampler:
    """The temporal neighbour sampler of a few nodes: the run's sampler
    (:class:`~sven.pipeline.sampler.TemporalSampler`) over the T-CSR rows of these
    nodes only.

    Args:
        events: The event store (memory-mapped columns ``src``, ``dst``, ``t``).
        nodes: (Q,) int64 ascending distinct node ids: the roots it will sample for.
        k: Neighbours per root (one layer, as a run samples).
        strategy: ``recent`` or ``uniform``.
        device: Where the index lives.
    """

    def __init__(
        self, events: Any, nodes: np.ndarray, k: int, strategy: str, device: torch.device
    ) -> None:
        from sven.pipeline.sampler import TCSR, TemporalSampler

        local, nbr, eid = incident_entries(events, nodes)
        t = events.t
        ts = np.asarray(t[eid])
        # The run's T-CSR keeps integer times as int64, floating ones as float64.
        ts = ts.astype(np.float64 if ts.dtype.kind == "f" else np.int64)
        # Each node's entries in (time, event id) order, as the run's T-CSR has them.
        order = np.lexsort((eid, ts, local))
        counts = np.bincount(local, minlength=nodes.size)
        indptr = np.zeros(nodes.size + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        tcsr = TCSR(
            indptr=torch.from_numpy(indptr).to(device),
            nbr=torch.from_numpy(nbr[order]).to(device),
            eid=torch.from_numpy(eid[order]).to(device),
            ts=torch.from_numpy(ts[order]).to(device),
        )
        self.nodes = torch.from_numpy(nodes).to(device)
        self.inner = TemporalSampler(tcsr, [k], strategy)  # type: ignore[arg-type]
        #: (M,) int64 ascending: every neighbour of these nodes in the index, so every node
        #: a sample of theirs can hold.
        self.neighbours = unique_ids(nbr)

    @property
    def num_entries(self) -> int:
        """The index's (node, event) entries."""
        return self.inner.tcsr.num_entries

    def sample(
        self,
        nodes: torch.Tensor,
        times: torch.Tensor,
        generator: torch.Generator | None = None,
        **options: Any,
    ) -> list[NeighborBlock]:
        """:meth:`TemporalSampler.sample` (``options``: its ``root_mask``, ``keys``) of
        roots ``nodes`` (R,) given by their global ids, each one of this sampler's
        nodes."""
        nodes = nodes.to(self.nodes.device)
        local = torch.searchsorted(self.nodes, nodes)
        known = local < self.nodes.numel()
        if not bool(known.all()) or not torch.equal(self.nodes[local], nodes):
            raise SvenError("a root outside the nodes the local sampler was built for")
        blocks = self.inner.sample(local, times, generator, **options)
        return [dataclasses.replace(blocks[0], nodes=nodes)]


def incident_entries(events: Any, nodes: np.ndarray) -> tuple[np.ndarray, ...]:
    """The T-CSR entries of ``nodes``: for every event (u, v) with u among them, one
    entry under u with neighbour v, and one under v with neighbour u where v is (a
    self-loop twice), found in one pass over the store's columns, a chunk at a time.

    Args:
        events: The event store (memory-mapped ``src``, ``dst``).
        nodes: (Q,) int64 ascending distinct node ids.

    Returns:
        (n,) int64 each: the entry's node as a position in ``nodes``, its neighbour
        (a global id) and its event id.
    """
    src, dst = events.src, events.dst
    empty = np.zeros(0, dtype=np.int64)
    if nodes.size == 0:
        return empty, empty, empty
    # A one-hash filter first (Fibonacci hashing into at most 2^24 flags, whatever N):
    # a gather per event where a binary search among the nodes took ten times as long;
    # only the events it passes are searched for.
    bits = int(np.clip(np.ceil(np.log2(64 * nodes.size)), 10, 24))
    shift = np.uint64(64 - bits)
    flags = np.zeros(1 << bits, dtype=bool)
    flags[(nodes.astype(np.uint64) * _GOLDEN) >> shift] = True
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for a in range(0, src.shape[0], _CHUNK):
        s = np.asarray(src[a : a + _CHUNK]).astype(np.int64)
        d = np.asarray(dst[a : a + _CHUNK]).astype(np.int64)
        for mine, other in ((s, d), (d, s)):
            cand = np.flatnonzero(flags[(mine.view(np.uint64) * _GOLDEN) >> shift])
            c = mine[cand]
            pos = np.minimum(np.searchsorted(nodes, c), nodes.size - 1)
            ok = nodes[pos] == c
            parts.append((pos[ok], other[cand[ok]], a + cand[ok]))
    if not parts:
        return empty, empty, empty
    return tuple(np.concatenate(c) for c in zip(*parts))


@dataclasses.dataclass
class QuerySource:
    """What a group of queries is answered from: the model, the node state (the
    checkpoint's rows, or a replayed memory), the neighbour sampler and the features.

    Attributes:
        model: The model.
        read: Node state of (U,) nodes -> their :class:`MemoryRows`.
        sampler: ``sample(nodes, times, generator, keys=...)``, or None.
        node_rows: (U,) nodes -> (U, d_n) features, or None without node features.
        edge_rows: (...) event ids -> (..., d_e) features, or None without edge features.
    """

    model: MemoryModel
    read: Callable[[torch.Tensor], MemoryRows]
    sampler: Any
    node_rows: Callable[[torch.Tensor], torch.Tensor | None]
    edge_rows: Callable[[torch.Tensor], torch.Tensor] | None


def unique_ids(*parts: np.ndarray) -> np.ndarray:
    """(U,) int64 the distinct ids of the arrays ``parts``, ascending.

    A sort and a comparison of neighbours: ``np.unique`` of millions of ids took ten
    times as long (numpy 2's hash table, then a sort of what it found).
    """
    ids = np.sort(np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]))
    keep = np.ones(ids.size, dtype=bool)
    np.not_equal(ids[1:], ids[:-1], out=keep[1:])
    return ids[keep]


def events_before(times: np.ndarray, t: np.ndarray) -> np.ndarray:
    """(n,) for each query time, the number of events strictly before it, comparing as
    float64 (a query at 5000.5 is after an event at 5000).

    A binary search of the distinct query times in ``times`` (E,) (non-decreasing, a
    memory-mapped column): log2(E) reads per distinct time, no copy of the column.
    """
    tu, inverse = np.unique(np.asarray(t, dtype=np.float64), return_inverse=True)
    lo = np.zeros(tu.size, dtype=np.int64)
    hi = np.full(tu.size, times.shape[0], dtype=np.int64)
    while True:
        active = np.flatnonzero(lo < hi)
        if active.size == 0:
            break
        mid = (lo[active] + hi[active]) // 2
        below = np.asarray(times[mid]).astype(np.float64) < tu[active]
        lo[active] = np.where(below, mid + 1, lo[active])
        hi[active] = np.where(below, hi[active], mid)
    return lo[inverse.reshape(-1)]


class StateTable:
    """The node state of a set of nodes, held compact: row i is node ``ids[i]``.

    Args:
        ids: (R,) int64 ascending distinct node ids.
        rows: Their state, (R, ...) tensors on one device.

    Attributes:
        ids: (R,) the node ids, on the rows' device.
        rows: The state.
    """

    def __init__(self, ids: np.ndarray, rows: MemoryRows) -> None:
        self._host = np.ascontiguousarray(ids, dtype=np.int64)
        self.ids = torch.from_numpy(self._host).to(rows.memory.device)
        self.rows = rows

    @property
    def num_rows(self) -> int:
        """R."""
        return self.ids.numel()

    def covers(self, nodes: np.ndarray) -> bool:
        """Whether every node of ``nodes`` (n,) int64 has a row here."""
        ids = self._host
        if nodes.size == 0:
            return True
        if ids.size == 0:
            return False
        pos = np.minimum(np.searchsorted(ids, nodes), ids.size - 1)
        return bool((ids[pos] == nodes).all())

    def read(self, nodes: torch.Tensor) -> MemoryRows:
        """The state of ``nodes`` (U,) int64, each of them one of the table's: (U, ...)
        tensors, gathered on the table's device."""
        from sven.models.memory import MemoryRows

        nodes = nodes.to(self.ids.device)
        at = torch.searchsorted(self.ids, nodes).clamp_(max=max(self.num_rows - 1, 0))
        if self.num_rows == 0 or not torch.equal(self.ids[at], nodes):
            raise SvenError("a node outside the rows the state table was read for")
        r = self.rows
        return MemoryRows(r.memory[at], r.last_update[at], r.mail[at], r.mail_ts[at],
                          r.mail_valid[at])  # fmt: skip


def read_in_file_order(files: Any, nodes: np.ndarray, fields: list[str]) -> dict[str, np.ndarray]:
    """The rows of ``nodes`` of a checkpoint's node-state files, read in one pass over
    each file in file order.

    Each file is read a piece at a time (:data:`_PIECE` bytes, the pieces that hold a
    wanted row only, in parallel threads) with ``pread``, not through its memory map: a
    piece's chunks are checked against the file's chunk sums as it is read (each chunk
    once, those checked before skipped), and only the wanted rows are kept. Host memory
    is the rows kept and a piece's buffer per thread, not the files' size; a random
    read of as many rows would fault in most pages of each file in random order and
    check most of its chunks anyway.

    Args:
        files: The checkpoint's :class:`~sven.engine.checkpoint.load.NodeStateFiles`.
        nodes: (R,) int64 ascending distinct node ids, each below the checkpoint's N.
        fields: The fields to read (``memory``, ``mail``, ...).

    Returns:
        field -> (R, *row_shape) array in the file's dtype; row i is node ``nodes[i]``.

    Raises:
        SvenError: A field the checkpoint lacks, an id out of range, or a chunk that
            does not match its sum (one line naming the file and the bytes).
    """
    from concurrent.futures import ThreadPoolExecutor

    from sven.engine.checkpoint.format import default_threads

    src = files.source
    missing = [k for k in fields if k not in src.fields]
    if missing:
        raise SvenError(f"{files.folder} holds no node-state field {missing[0]!r}")
    nodes = np.asarray(nodes, dtype=np.int64)
    if nodes.size and (nodes[0] < 0 or nodes[-1] >= src.num_nodes):
        raise SvenError(f"{files.folder} holds {src.num_nodes} vertices; asked for id "
                        f"{nodes[0] if nodes[0] < 0 else nodes[-1]}")  # fmt: skip
    first = files.arrays[0]
    out = {k: np.empty((nodes.size, *first[k].shape[1:]), dtype=first[k].dtype) for k in fields}
    owner, pos = files.locate(nodes) if nodes.size else (nodes, nodes)
    tasks: list[Callable[[], None]] = []
    for r in np.unique(owner).tolist():
        at = np.flatnonzero(owner == r)
        for k in fields:
            checker = files.checkers[r].get(k)
            tasks += _field_tasks(files.arrays[r][k], checker, pos[at], out[k], at)
    if len(tasks) <= 1:
        for task in tasks:
            task()
    else:
        with ThreadPoolExecutor(default_threads(), thread_name_prefix="sven-state") as pool:
            for done in [pool.submit(task) for task in tasks]:
                done.result()
    return out


def _field_tasks(
    array: np.ndarray, checker: Any, rows: np.ndarray, out: np.ndarray, at: np.ndarray
) -> list[Callable[[], None]]:
    """The tasks that copy rows ``rows`` (n,) (ascending) of one file's ``array`` into
    rows ``at`` (n,) of ``out``: one per piece of the file that holds the start of a
    wanted row (a plain read of the rows, in ascending blocks, where the array is not a
    memory-mapped ``.npy`` file)."""
    row = array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
    if rows.size == 0 or row == 0:
        return []
    filename = getattr(array, "filename", None)
    if not isinstance(array, np.memmap) or filename is None:
        step = max(1, _PIECE // row)

        def gather(a: int) -> None:
            out[at[a : a + step]] = array[rows[a : a + step]]

        return [lambda a=a: gather(a) for a in range(0, rows.size, step)]
    chunk = checker.chunk if checker is not None else _PIECE
    piece = max(1, _PIECE // chunk) * chunk
    piece_file = _PieceReader(Path(filename), int(array.offset), row, chunk, piece, checker)
    target = out.reshape(out.shape[0], -1).view(np.uint8)
    starts = int(array.offset) + rows * row
    cuts = np.flatnonzero(np.diff(starts // piece)) + 1
    bounds = zip([0, *cuts.tolist()], [*cuts.tolist(), rows.size])
    return [lambda a=a, b=b: piece_file.copy(rows[a:b], target, at[a:b]) for a, b in bounds]


class _PieceReader:
    """Reads the pieces of one node-state file, checks their chunks and copies rows.

    Args:
        path: The ``.npy`` file.
        offset: Where its rows start.
        row: Bytes of a row.
        chunk: The digest chunk (bytes).
        piece: Bytes of a piece, a multiple of ``chunk``.
        checker: Its :class:`~sven.engine.checkpoint.format.ChunkChecker`, or None for a
            file that was checked whole when the checkpoint was opened.
    """

    def __init__(
        self, path: Path, offset: int, row: int, chunk: int, piece: int, checker: Any
    ) -> None:
        self.path, self.offset, self.row = path, offset, row
        self.chunk, self.piece, self.checker = chunk, piece, checker
        self.size = path.stat().st_size
        self._local = threading.local()

    def copy(self, rows: np.ndarray, target: np.ndarray, at: np.ndarray) -> None:
        """``target[at] = `` the bytes of rows ``rows`` (n,) (ascending, each starting in
        one piece), after checking every chunk of the bytes read."""
        row = self.row
        a0 = (self.offset + int(rows[0]) * row) // self.piece * self.piece
        # The piece, and past it to the end of its last wanted row, in whole chunks.
        end = max(a0 + self.piece, self.offset + (int(rows[-1]) + 1) * row)
        stop = min(-(-end // self.chunk) * self.chunk, self.size)
        buf = self._buffer(stop - a0)
        with open(self.path, "rb", buffering=0) as f:
            got = 0
            while got < stop - a0:
                n = os.preadv(f.fileno(), [buf[got : stop - a0]], a0 + got)
                if n <= 0:
                    raise SvenError(f"{self.path}: shorter than its header says")
                got += n
        if self.checker is not None:
            self._check(buf, a0, stop)
        first = int(rows[0])
        lo = self.offset + first * row - a0
        span = np.frombuffer(buf, dtype=np.uint8, count=(int(rows[-1]) + 1 - first) * row,
                             offset=lo).reshape(-1, row)  # fmt: skip
        target[at] = span[rows - first]

    def _buffer(self, size: int) -> memoryview:
        """This thread's read buffer, at least ``size`` bytes."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = memoryview(bytearray(size))
            self._local.buf = buf
        return buf

    def _check(self, buf: memoryview, a0: int, stop: int) -> None:
        """Checks the chunks of bytes [a0, stop) of the file, held in ``buf``."""
        checker, c = self.checker, self.chunk
        k0, k1 = a0 // c, -(-stop // c)
        if checker.checked[k0:k1].all():
            return
        sums = b"".join(
            hashlib.sha256(buf[a - a0 : min(a + c, stop) - a0]).digest()
            for a in range(k0 * c, k1 * c, c)
        )
        want = checker.sums[32 * k0 : 32 * k1]
        if sums != want:
            bad = next(
                i
                for i in range(k1 - k0)
                if sums[32 * i : 32 * i + 32] != want[32 * i : 32 * i + 32]
            )
            k = k0 + bad
            raise SvenError(
                f"{self.path}: corrupt checkpoint: bytes {k * c} to {(k + 1) * c} do not "
                "match their recorded digest"
            )
        checker.checked[k0:k1] = True
