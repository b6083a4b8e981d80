"""Node memory: explicit state with a lifecycle (the modules that advance it are in
:mod:`sven.models.updaters`).

The state lives in :class:`MemoryState` as plain tensors. A training step reads the rows
of the nodes it touches (:meth:`MemoryState.gather`), the model computes from those rows
and returns a :class:`MemoryUpdate`, and the trainer commits it after the optimizer step
(:meth:`MemoryState.commit`). Nothing is stored on the model during forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch

from sven import kernels
from sven.models.copyahead import CopyAhead
from sven.models.readahead import WriteLog, ahead_programs
from sven.models.storage import Storage


def winner_rows(
    best: torch.Tensor, nodes: torch.Tensor, key: torch.Tensor, scratch: int
) -> torch.Tensor:
    """Where each write candidate goes: its node if its key is the node's largest, else
    ``scratch``.

    Args:
        best: (scratch + 1,) int64 work buffer, -1 everywhere (left so on return): kept
            by the caller rather than refilled per call, which on a large graph would be
            a memset of every node where only the batch's rows change.
        nodes: (P,) int64 node ids in [0, scratch].
        key: (P,) int64 distinct ordering keys, -1 for candidates that write nothing.
        scratch: The row losers go to.

    Returns:
        (P,) int64 target rows, unique among the winners.
    """
    best.scatter_reduce_(0, nodes, key, reduce="amax")
    win = (key >= 0) & (best.gather(0, nodes) == key)
    best.index_fill_(0, nodes, -1)
    return torch.where(win, nodes, scratch)


@dataclass
class MemoryRows:
    """The memory state of U nodes, as read at the start of a batch.

    Attributes:
        memory: (U, d_mem) memory vectors.
        last_update: (U,) float64 time of the last mail applied to the memory.
        mail: (U, M, d_mail) mailbox, newest mail in slot 0.
        mail_ts: (U, M) float64 time of each mail.
        mail_valid: (U, M) bool, True where a mail slot holds a mail.
        node_feat: (U, d_n) static node features, when they travel with the rows
            (fetched from the owners on several ranks), else None.
    """

    memory: torch.Tensor
    last_update: torch.Tensor
    mail: torch.Tensor
    mail_ts: torch.Tensor
    mail_valid: torch.Tensor
    node_feat: torch.Tensor | None = None


@dataclass
class EarlyRows:
    """A batch's node-state rows read before its step (:mod:`sven.models.readahead`).

    Attributes:
        rows: The rows as read (U rows each), refreshed in place by the step that
            uses them (:meth:`MemoryState.refresh`).
        since: (1,) int64 the first commit number whose writes the read may miss
            (:meth:`~sven.models.readahead.WriteLog.since`, taken just before it).
    """

    rows: MemoryRows
    since: torch.Tensor


@dataclass
class HotRows:
    """Copies in GPU memory of some nodes' rows, where the tables are in pinned host
    memory (on a CPU run, beside them; :meth:`MemoryState.keep_hot`): the step reads
    those rows from their copies and every write goes to both (written through: the
    tables stay whole, for checkpoints and any other reader of them).

    Attributes:
        nodes: (H,) int64 the rows kept, distinct.
        slot: (N + 1,) int32 where each row's copy is: its position in ``nodes``, H for a
            row not kept.
        tables: field -> (H + 1, ...) the copies, in the tables' dtypes; row H is the
            scratch row that writes of rows not kept go to (the reference path).
    """

    nodes: torch.Tensor
    slot: torch.Tensor
    tables: dict[str, torch.Tensor]

    @property
    def count(self) -> int:
        """H, the rows kept."""
        return int(self.nodes.shape[0])


@dataclass
class MemoryUpdate:
    """What a batch writes back: new memory for some nodes, new mail for others.

    Attributes:
        nodes: (W,) node ids whose memory is written.
        memory: (W, d_mem) their new memory (detached).
        last_update: (W,) float64 their new last-update times.
        mail_nodes: (W2,) node ids that receive a mail (unique).
        mail: (W2, d_mail) the mail each receives (detached).
        mail_ts: (W2,) float64 time of that mail.
        mail_key: (W2,) int64 ordering key of the event that produced each mail
            (global event index based); the owner keeps the largest when several
            writers send mail for one node.
        key: (W,) int64 ordering key of the event that produced each memory row.
    """

    nodes: torch.Tensor
    memory: torch.Tensor
    last_update: torch.Tensor
    key: torch.Tensor
    mail_nodes: torch.Tensor
    mail: torch.Tensor
    mail_ts: torch.Tensor
    mail_key: torch.Tensor


@dataclass
class DenseUpdate:
    """A batch's write-back before last-occurrence selection: one candidate row per writer.

    Every candidate carries an ordering key (global-event based, see
    :meth:`MemoryModel.mail_receivers`); a key of -1 marks a candidate that writes
    nothing (a padded event, a masked neighbour slot). Selecting the winner of each
    node (the largest key) is a scatter, not a compaction, so the shapes depend only on
    the batch capacity: the captured step commits it with
    :meth:`MemoryState.commit_dense`, and :meth:`compact` gives the
    :class:`MemoryUpdate` that the memory exchange sends on several ranks.

    Attributes:
        nodes: (P,) int64 node of each memory candidate.
        memory: (P, d_mem) candidate memory (detached).
        last_update: (P,) float64.
        key: (P,) int64 ordering key, -1 for none.
        mail_nodes: (Q,) int64 receiver of each mail candidate.
        mail: (Q, d_mail) candidate mail (detached).
        mail_ts: (Q,) float64.
        mail_key: (Q,) int64 ordering key, -1 for none.
    """

    nodes: torch.Tensor
    memory: torch.Tensor
    last_update: torch.Tensor
    key: torch.Tensor
    mail_nodes: torch.Tensor
    mail: torch.Tensor
    mail_ts: torch.Tensor
    mail_key: torch.Tensor

    def compact(self) -> MemoryUpdate:
        """The winners only, one per node (data-dependent size: synchronises on CUDA)."""
        from sven.pipeline.batch import last_occurrence

        m = self.key >= 0
        nodes, p = last_occurrence(self.nodes[m], self.key[m])
        q_m = self.mail_key >= 0
        mail_nodes, q = last_occurrence(self.mail_nodes[q_m], self.mail_key[q_m])
        return MemoryUpdate(
            nodes=nodes,
            memory=self.memory[m][p],
            last_update=self.last_update[m][p],
            key=self.key[m][p],
            mail_nodes=mail_nodes,
            mail=self.mail[q_m][q],
            mail_ts=self.mail_ts[q_m][q],
            mail_key=self.mail_key[q_m][q],
        )


def _to_scratch_row(update: DenseUpdate, scratch: int) -> DenseUpdate:
    """``update`` with every candidate's row the scratch row (its memory and mail
    receivers alike; one tensor for both where they were one)."""
    nodes = torch.full_like(update.nodes, scratch)
    same = update.mail_nodes is update.nodes
    mail = nodes if same else torch.full_like(update.mail_nodes, scratch)
    return dataclasses.replace(update, nodes=nodes, mail_nodes=mail)


class MemoryState:
    """Memory, last-update time and mailbox of N nodes.

    Args:
        num_nodes: N.
        memory_dim: d_mem.
        mail_dim: d_mail.
        mailbox_size: M (1 for TGN/JODIE/DyRep, more for APAN).
        device: Where the state lives.
        dtype: Floating dtype of memory and mail (float32, or float64 for exactness tests).
        time_origin: Last-update time of a node that never received mail.

    The tensors hold one more row than N, a scratch row at index N: fixed-shape steps
    point padded reads and losing writes at it instead of compacting (see
    :meth:`commit_dense`). Its content is never meaningful; ``state_dict`` leaves it out.
    """

    def __init__(
        self,
        num_nodes: int,
        memory_dim: int,
        mail_dim: int,
        mailbox_size: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        time_origin: float = 0.0,
        storage: Storage | None = None,
    ) -> None:
        self.num_nodes = num_nodes
        self.time_origin = float(time_origin)
        self.memory_dim = memory_dim
        self.mail_dim = mail_dim
        self.mailbox_size = mailbox_size
        self.device = torch.device(device)
        self.dtype = dtype
        #: Where the tensors live (:mod:`sven.models.storage`; default: beside the
        #: compute).
        self.storage = storage if storage is not None else Storage("gpu", self.device)
        n1, m = num_nodes + 1, mailbox_size
        shapes = {
            "memory": ((n1, memory_dim), dtype),
            "last_update": ((n1,), torch.float64),
            "mail": ((n1, m, mail_dim), dtype),
            "mail_ts": ((n1, m), torch.float64),
            "mail_valid": ((n1, m), torch.bool),
        }
        # Full buffers with the scratch row; the public attributes are views of the
        # first N rows. ``host`` holds the host tensor behind each where the tier has
        # one (pinned memory, a mapped file): checkpoints read and write it directly.
        self.full: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}
        for name, (shape, dt) in shapes.items():
            view, host = self.storage.empty(name, shape, dt)
            self.full[name] = view
            if host is not None:
                self.host[name] = host
        #: The record of writes that rows read ahead are checked against
        #: (:mod:`sven.models.readahead`), once :meth:`track_writes` is called.
        self.log: WriteLog | None = None
        #: The host thread that reads rows ahead for the copy engine, once
        #: :meth:`track_writes` asks for it.
        self.copier: CopyAhead | None = None
        #: Copies in GPU memory of the most active nodes' rows, once :meth:`keep_hot`
        #: is called.
        self.hot: HotRows | None = None
        # Set by writes_to_scratch(): commits write the scratch row only.
        self._to_scratch = False
        self.reset()
        # The winners' per-node maximum key, -1 everywhere between calls: kept rather
        # than refilled per call, which on a large graph was a memset of N + 1 words
        # per write (160 MB a step on 10^7 nodes) where only the batch's rows change.
        # Beside the tensors the commit indexes (the host when rows are staged).
        self._best = torch.full((n1,), -1, device=self.storage.host_device, dtype=torch.int64)

    _FIELDS = ("memory", "last_update", "mail", "mail_ts", "mail_valid")

    def _field(name: str) -> property:  # type: ignore[misc]
        def get(self: MemoryState) -> torch.Tensor:
            return self.full[name][: self.num_nodes]

        def put(self: MemoryState, value: torch.Tensor) -> None:
            # Assignment writes in place: the buffers keep their addresses, which a
            # captured CUDA graph has recorded.
            self.full[name][: self.num_nodes].copy_(value)
            self.invalidate(tables=True)

        return property(get, put, doc=f"(N, ...) view of the ``{name}`` buffer.")

    memory = _field("memory")
    last_update = _field("last_update")
    mail = _field("mail")
    mail_ts = _field("mail_ts")
    mail_valid = _field("mail_valid")
    del _field

    def reset(self) -> None:
        """Zeroes the whole state (start of an epoch); last-update times go to the origin.

        The origin is the stream's first timestamp, so that a node's first mail is
        encoded with the time since the stream began (as with DyGLib's time-shifted
        data), not since 1970 for unix-second timestamps.
        """
        tables = [self.full] + ([self.hot.tables] if self.hot is not None else [])
        for group in tables:
            for t in group.values():
                t.zero_()
            group["last_update"].fill_(self.time_origin)
        self.invalidate(tables=False)

    def detach(self) -> None:
        """Kept for API symmetry: the state is stored detached (commits detach)."""

    def close(self) -> None:
        """Releases the tier's host resources (pinned pages, mapped files), after any
        read of them ahead."""
        if self.copier is not None:
            self.copier.close()
            self.copier = None
        self.storage.close()

    @property
    def nbytes(self) -> int:
        """Bytes of the state's tensors (the scratch row and winners' buffer included)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def hot_rows(self) -> int:
        """How many rows have copies (:meth:`keep_hot`; 0: none)."""
        return self.hot.count if self.hot is not None else 0

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a step writes: the tables, then the hot rows' copies."""
        hot = list(self.hot.tables.values()) if self.hot is not None else []
        return list(self.full.values()) + hot

    def keep_hot(self, nodes: torch.Tensor) -> None:
        """Keeps copies of the rows of ``nodes`` in GPU memory (:class:`HotRows`): the
        step reads them there, not over the host link, and writes them there too.

        Args:
            nodes: (H,) int64 distinct rows in [0, N), the most read first (any order
                is exact); none: no copies.

        Raises:
            ValueError: Rows staged through the host (``state.device=disk``), or ids
                out of range or repeated.
        """
        if self.storage.staged:
            raise ValueError("rows staged through the host (state.device=disk) have no hot copies")
        nodes = nodes.to(self.device, torch.int64)
        h = int(nodes.numel())
        if h == 0:
            self.hot = None
            return
        if int(nodes.min()) < 0 or int(nodes.max()) >= self.num_nodes:
            raise ValueError(f"hot rows must lie in [0, {self.num_nodes})")
        slot = torch.full((self.num_nodes + 1,), h, dtype=torch.int32, device=self.device)
        slot[nodes] = torch.arange(h, dtype=torch.int32, device=self.device)
        if int((slot < h).sum()) != h:
            raise ValueError("hot rows must be distinct")
        tables = {
            name: torch.empty((h + 1, *t.shape[1:]), dtype=t.dtype, device=self.device)
            for name, t in self.full.items()
        }
        self.hot = HotRows(nodes, slot, tables)
        self._load_hot()

    def _load_hot(self) -> None:
        """Copies the hot rows from the tables (after a wholesale change of them)."""
        hot = self.hot
        if hot is None:
            return
        h = hot.count
        for name, t in self.full.items():
            # Rows as flat vectors: a 3-d index_select on the CPU is ten times slower.
            out = hot.tables[name][:h].view(h, -1)
            torch.index_select(t.view(t.shape[0], -1), 0, hot.nodes, out=out)
            hot.tables[name][h].copy_(t[self.num_nodes])

    def _hot_args(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The hot rows as the Triton kernels take them, or None."""
        if self.hot is None:
            return None
        return self.hot.slot, tuple(self.hot.tables[name] for name in self._FIELDS)

    def _read(self, nodes: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The five tables' rows of ``nodes`` (U,), hot rows from their copies (the
        reference path)."""
        tables = tuple(self.full[name] for name in self._FIELDS)
        if self.hot is None:
            return tuple(t[nodes] for t in tables)
        s = self.hot.slot[nodes].to(torch.int64)
        kept = s < self.hot.count
        return tuple(
            torch.where(kept.view(-1, *[1] * (t.dim() - 1)), self.hot.tables[name][s], t[nodes])
            for name, t in zip(self._FIELDS, tables)
        )

    def _mirror(self, rows: torch.Tensor) -> None:
        """Copies the rows ``rows`` (R,) from the tables into their hot copies (the
        reference path's writes; rows not kept go to the copies' scratch row)."""
        if self.hot is None:
            return
        at = self.hot.slot[rows].to(torch.int64)
        for name, t in self.full.items():
            self.hot.tables[name].index_copy_(0, at, t.index_select(0, rows))

    def put_rows(self, nodes: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Writes whole rows outside a commit (an undo): ``rows`` field -> (R, ...) the
        new rows of ``nodes`` (R,), distinct; into the tables and the hot copies, and
        rows read ahead before now are read again."""
        for name, v in rows.items():
            self.full[name].index_copy_(0, nodes, v.to(self.full[name].dtype))
        self._mirror(nodes)
        self.invalidate(tables=False)

    @property
    def scratch(self) -> int:
        """Index of the scratch row (N)."""
        return self.num_nodes

    def gather(self, nodes: torch.Tensor, programs: int = 0) -> MemoryRows:
        """Reads the rows of ``nodes`` (U,) as a :class:`MemoryRows` (N: the scratch row),
        on the compute device; the Triton gather with at most ``programs`` programs
        (0: one per block of rows)."""
        if self.storage.staged:
            # Rows in files: indexed on the host, then copied over (a host sync).
            idx = nodes.cpu()
            return MemoryRows(*(self.full[name][idx].to(self.device) for name in self._FIELDS))
        tables = tuple(self.full[name] for name in self._FIELDS)
        if kernels.backend_for(nodes, "state_gather") == "triton":
            from sven.kernels.triton_state import gather_rows

            # One kernel for the five tables' rows.
            return MemoryRows(*gather_rows(tables, nodes, programs=programs, hot=self._hot_args()))
        return MemoryRows(*self._read(nodes))

    def track_writes(self, copy: bool = False) -> None:
        """Starts the record of writes that makes rows read ahead exact
        (:meth:`read_ahead`); every commit stamps its rows from now on. ``copy``: rows
        read ahead under a key are gathered by a host thread and copied over by the
        copy engine (:mod:`sven.models.copyahead`), not by the SMs."""
        if self.storage.staged:
            raise ValueError("rows staged through the host (state.device=disk) are not read ahead")
        if self.log is None:
            self.log = WriteLog(self.num_nodes + 1, self.storage.host_device)
        if copy and self.copier is None:
            tables = [self.host.get(name, self.full[name]) for name in self._FIELDS]
            self.copier = CopyAhead(tables, self.device)

    def invalidate(self, tables: bool = True) -> None:
        """Marks the state as replaced wholesale: rows read ahead before now are all read
        again at their use, and (``tables``) the hot rows' copies are taken again from
        the tables. Whoever writes the tables other than through :meth:`commit`,
        :meth:`commit_dense`, :meth:`put_rows`, :meth:`reset`, :meth:`load_state_dict`
        or the attributes calls it; ``tables=False`` where only rows read ahead must be
        read again (the tables were written by those)."""
        if self.log is not None:
            self.log.invalidate()
        if tables:
            self._load_hot()

    def read_ahead(self, nodes: torch.Tensor, key: Hashable | None = None) -> EarlyRows:
        """Reads the rows of ``nodes`` (U,) before their step (on a side stream, while
        other steps may still write them); :meth:`refresh` makes them exact at the
        step. Needs :meth:`track_writes`.

        With the copy engine (``track_writes(copy=True)``) and a ``key`` (the ring
        position the batch goes to) only the ids are sent to the host here: the rows
        arrive in the key's buffers once ``copier.launch(key)``'s job has run and
        ``copier.wait(key)`` has ordered the step after them."""
        if self.log is None:
            raise RuntimeError("read_ahead needs track_writes() first")
        # Read before the rows, in stream order (sven.models.readahead says why).
        since = self.log.since()
        if key is not None and self.copier is not None:
            return EarlyRows(MemoryRows(*self.copier.request(key, nodes)), since)
        return EarlyRows(self.gather(nodes, programs=ahead_programs()), since)

    def refresh(self, early: EarlyRows, nodes: torch.Tensor) -> MemoryRows:
        """The rows of ``nodes`` (U,) as :meth:`gather` reads them now, from rows read
        ahead by :meth:`read_ahead`: the rows written since are read again, in place."""
        log, rows = self.log, early.rows
        if log is None:
            raise RuntimeError("refresh needs track_writes() first")
        tables = tuple(self.full[name] for name in self._FIELDS)
        outs = tuple(getattr(rows, name) for name in self._FIELDS)
        if kernels.backend_for(nodes, "state_gather") == "triton":
            from sven.kernels.triton_state import gather_rows

            refresh = (log.stamp, early.since, log.wipe)
            gather_rows(tables, nodes, outs, refresh, hot=self._hot_args())
            return rows
        stale = log.stale(nodes, early.since)
        for out, now in zip(outs, self._read(nodes)):
            out.copy_(torch.where(stale.view(-1, *[1] * (out.dim() - 1)), now, out))
        return rows

    def winners(self, nodes: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Where each candidate writes: its node if its key is the node's largest, else N.

        Args:
            nodes: (P,) int64 node ids in [0, N].
            key: (P,) int64 distinct ordering keys, -1 for candidates that write nothing.

        Returns:
            (P,) int64 target rows: unique among the winners; every other candidate goes
            to the scratch row, so the writes need no compaction and their result does
            not depend on the order of duplicate writes (only the scratch row has any).
        """
        return winner_rows(self._best, nodes, key, self.num_nodes)

    @contextlib.contextmanager
    def writes_to_scratch(self) -> Iterator[None]:
        """Inside the block commits write the scratch row only (a dense commit runs its
        kernels as always, every candidate pointed at row N; a sparse one writes
        nothing): a captured graph's warm-up runs real steps and leaves the node state
        as it was, so it need not be saved and put back (a copy as large as the state,
        in GPU memory). The write log still counts the commits (whoever uses the block
        puts its tensors back)."""
        was, self._to_scratch = self._to_scratch, True
        try:
            yield
        finally:
            self._to_scratch = was

    def commit_dense(self, update: DenseUpdate) -> None:
        """Writes a :class:`DenseUpdate` with fixed shapes (capturable in a CUDA graph).

        The same result as ``commit(update.compact())``: each node gets the memory and
        the mail of its candidate with the largest key.
        """
        if self._to_scratch:
            update = _to_scratch_row(update, self.num_nodes)
        self._write_dense(update)
        if self.log is not None:
            # After the writes, in stream order (sven.models.readahead).
            self.log.finish()

    def _write_dense(self, update: DenseUpdate) -> None:
        """:meth:`commit_dense`'s writes (and stamps)."""
        if self.storage.staged:
            # The write-back goes to the host, where the rows live.
            update = DenseUpdate(*(t.detach().cpu() for t in vars(update).values()))
        elif kernels.backend_for(update.nodes, "state_commit") == "triton":
            self._commit_triton(update)
            return
        f = self.full
        tgt = self.winners(update.nodes, update.key)
        n = tgt
        if update.mail_nodes is not update.nodes or update.mail_key is not update.key:
            # Other receivers than the memory's writers (APAN's neighbours).
            n = self.winners(update.mail_nodes, update.mail_key)
        if self.log is not None:
            # The commit's number and stamps before its writes (sven.models.readahead);
            # losers go to the scratch row: stamping it too is harmless.
            number = self.log.next()
            self.log.mark(tgt, number)
            self.log.mark(n, number)
        f["memory"].index_copy_(0, tgt, update.memory.detach().to(self.dtype))
        f["last_update"].index_copy_(0, tgt, update.last_update.to(torch.float64))
        if self.mailbox_size > 1:
            # Shift the queue of each receiver by one slot (the oldest falls out).
            for name in ("mail", "mail_ts", "mail_valid"):
                f[name].index_copy_(0, n, torch.roll(f[name].index_select(0, n), 1, dims=1))
        f["mail"][:, 0].index_copy_(0, n, update.mail.detach().to(self.dtype))
        f["mail_ts"][:, 0].index_copy_(0, n, update.mail_ts.to(torch.float64))
        f["mail_valid"][:, 0].index_fill_(0, n, True)
        if self.hot is not None:
            self._mirror(tgt if n is tgt else torch.cat([tgt, n]))

    def _commit_triton(self, update: DenseUpdate) -> None:
        """:meth:`commit_dense` as two kernels per set of winners (``triton_state``)."""
        from sven.kernels.triton_state import commit_rows

        tables = tuple(self.full[name] for name in self._FIELDS)
        same = update.mail_nodes is update.nodes and update.mail_key is update.key
        mem = (update.memory.detach(), update.last_update)
        mail = (update.mail.detach(), update.mail_ts)
        log = (self.log.stamp, self.log.counter) if self.log is not None else None
        hot = self._hot_args()
        if same:
            commit_rows(tables, self._best, update.nodes, update.key, *mem, *mail, log=log, hot=hot)
            return
        # Other receivers than the memory's writers (APAN's neighbours): their own
        # winners.
        commit_rows(
            tables, self._best, update.nodes, update.key, *mem, None, None, log=log, hot=hot
        )
        # One commit, one number: the second set of winners takes the first's.
        commit_rows(
            tables,
            self._best,
            update.mail_nodes,
            update.mail_key,
            None,
            None,
            *mail,
            log=log,
            new_number=False,
            hot=hot,
        )

    def commit(self, update: MemoryUpdate) -> None:
        """Writes a batch's update: memory rows, then one new mail per mail node.

        With M > 1 the mailbox is a queue: the new mail enters slot 0 and the oldest
        falls out of slot M-1.
        """
        if self._to_scratch:
            return
        log = self.log
        if log is not None:
            number = log.next()
            log.mark(update.nodes, number)
            log.mark(update.mail_nodes, number)
        self.memory[update.nodes] = update.memory.detach().to(self.dtype)
        self.last_update[update.nodes] = update.last_update
        self._write_mail(update)
        if self.hot is not None:
            self._mirror(torch.cat([update.nodes, update.mail_nodes]))
        if log is not None:
            log.finish()

    def _write_mail(self, update: MemoryUpdate) -> None:
        """:meth:`commit`'s mail: one new mail at the front of each receiver's queue."""
        n = update.mail_nodes
        if n.numel() == 0:
            return
        if self.mailbox_size > 1:
            self.mail[n] = torch.roll(self.mail[n], 1, dims=1)
            self.mail_ts[n] = torch.roll(self.mail_ts[n], 1, dims=1)
            self.mail_valid[n] = torch.roll(self.mail_valid[n], 1, dims=1)
        self.mail[n, 0] = update.mail.detach().to(self.dtype)
        self.mail_ts[n, 0] = update.mail_ts
        self.mail_valid[n, 0] = True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All state tensors without the scratch row (for checkpoints): the host tensors
        where the tier has them (written without a copy through the device), else the
        device's."""
        if self.host and self.device.type == "cuda":
            # The host tensors are written by the device's kernels (pinned memory read
            # and written over the host link): a host read waits for the queued steps,
            # as a device-to-host copy of device tensors would.
            torch.cuda.synchronize(self.device)
        return {
            name: self.host.get(name, self.full[name])[: self.num_nodes] for name in self._FIELDS
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores :meth:`state_dict` output, checking shapes."""
        for name in self._FIELDS:
            cur = getattr(self, name)
            new = state[name]
            if new.shape != cur.shape:
                raise ValueError(
                    f"memory state {name}: shape {tuple(new.shape)} != {tuple(cur.shape)}"
                )
            cur = self.host.get(name, self.full[name])[: self.num_nodes]
            cur.copy_(new.to(cur.device))
        self.invalidate(tables=True)
