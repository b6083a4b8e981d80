"""The node state's row gather and its write-back, as Triton kernels.

:meth:`sven.models.memory.MemoryState.gather` reads five tables (memory, last-update
time, mailbox, mail times, mail flags) at a batch's node ids: five gathers on CUDA.
:meth:`~sven.models.memory.MemoryState.commit_dense` picks each node's winning
candidate (a max-scatter of the keys, a gather, compares, a reset) and writes five
tables: about a dozen kernels. Here the gather is one kernel, and the write-back two:

1. ``best[node] = max(best[node], key)`` over the candidates (atomic max);
2. each candidate whose key equals its node's maximum writes its rows, shifts the
   node's mailbox queue, and puts ``best[node]`` back to -1.

Keys are distinct, so each node has one winner; a loser reads either the winner's key
or the -1 it left, never its own, so the reset needs no third kernel. Losers write
nothing (the reference sends them to the scratch row, whose content is meaningless).
The reference, the CPU path and the oracle, is the ``MemoryState`` code itself.

With a :class:`~sven.models.readahead.WriteLog` the first kernel also takes the
commit's number (its first program bumps the counter) and the second stamps each
winner's row with it; the gather, given rows read ahead, reads again only the rows
stamped since (``REFRESH``).

With hot rows (:class:`~sven.models.memory.HotRows`: copies in GPU memory of some rows of
tables in pinned host memory, ``HOT``) both kernels look up each row's slot: the gather
reads a kept row from its copy and any other from the tables, and the write kernel
writes each winner into the tables and, where it has one, into its copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["commit_rows", "gather_rows"]

_ROWS = 32


@triton.jit
def _read(cold, hot, rc, rh, HOT: tl.constexpr):
    """Values at ``cold`` (the tables) where ``rc``, at ``hot`` (the copies) where
    ``rh``: two loads under complementary masks, so each row is read once."""
    x = tl.load(cold, mask=rc)
    if HOT:
        x = tl.where(rh, tl.load(hot, mask=rh), x)
    return x


@triton.jit
def _write(cold, hot, x, mc, mh, HOT: tl.constexpr):
    """``x`` into the tables at ``cold`` where ``mc``, and into the copies at ``hot``
    where ``mh`` (written through)."""
    tl.store(cold, x, mask=mc)
    if HOT:
        tl.store(hot, x, mask=mh)


@triton.jit
def _gather_kernel(
    nodes_ptr, mem_ptr, lu_ptr, mail_ptr, mts_ptr, mv_ptr,
    o_mem, o_lu, o_mail, o_mts, o_mv, U, stamp_ptr, since_ptr, wipe_ptr,
    slot_ptr, h_mem, h_lu, h_mail, h_mts, h_mv, H,
    D_MEM: tl.constexpr, D_MAIL: tl.constexpr, M: tl.constexpr,
    B_MEM: tl.constexpr, B_MAIL: tl.constexpr, B_M: tl.constexpr, ROWS: tl.constexpr,
    REFRESH: tl.constexpr, HOT: tl.constexpr,
):  # fmt: skip
    # Programs walk blocks pid, pid + P, ...: one block each at the full grid; a grid
    # capped below that (rows read ahead, beside the step) loops, so that a gather
    # bound by the host link holds a few SMs rather than all of them.
    for start in range(tl.program_id(0) * ROWS, U, tl.num_programs(0) * ROWS):
        rows = start + tl.arange(0, ROWS)
        rm = rows < U
        n = tl.load(nodes_ptr + rows, mask=rm, other=0).to(tl.int64)
        if REFRESH:
            # Rows read ahead: only those written since their read (or all, after a
            # wholesale change) are read again (sven.models.readahead).
            since = tl.load(since_ptr)
            s = tl.load(stamp_ptr + n, mask=rm, other=-1)
            # The wipe as a block: a scalar comparison in the mask is refused by the
            # interpreter.
            w = tl.load(wipe_ptr) + tl.zeros_like(s)
            rm = rm & ((s >= since) | (w >= since))
        r64 = rows.to(tl.int64)
        # A hot row (slot below H) is read from its copy in GPU memory, any other from
        # the tables.
        if HOT:
            s = tl.load(slot_ptr + n, mask=rm, other=H).to(tl.int64)
            rh = rm & (s < H)
            rc = rm & (s >= H)
        else:
            s = n
            rh = rm
            rc = rm
        c = tl.arange(0, B_MEM)
        cm = (c < D_MEM)[None, :]
        x = _read(mem_ptr + n[:, None] * D_MEM + c[None, :], h_mem + s[:, None] * D_MEM
                  + c[None, :], rc[:, None] & cm, rh[:, None] & cm, HOT)  # fmt: skip
        tl.store(o_mem + r64[:, None] * D_MEM + c[None, :], x, mask=rm[:, None] & cm)
        tl.store(o_lu + r64, _read(lu_ptr + n, h_lu + s, rc, rh, HOT), mask=rm)
        c = tl.arange(0, B_MAIL)
        cm = (c < M * D_MAIL)[None, :]
        x = _read(mail_ptr + n[:, None] * (M * D_MAIL) + c[None, :],
                  h_mail + s[:, None] * (M * D_MAIL) + c[None, :], rc[:, None] & cm,
                  rh[:, None] & cm, HOT)  # fmt: skip
        tl.store(o_mail + r64[:, None] * (M * D_MAIL) + c[None, :], x, mask=rm[:, None] & cm)
        c = tl.arange(0, B_M)
        cm = (c < M)[None, :]
        src = n[:, None] * M + c[None, :]
        hs = s[:, None] * M + c[None, :]
        dst = r64[:, None] * M + c[None, :]
        mc, mh, mo = rc[:, None] & cm, rh[:, None] & cm, rm[:, None] & cm
        tl.store(o_mts + dst, _read(mts_ptr + src, h_mts + hs, mc, mh, HOT), mask=mo)
        tl.store(o_mv + dst, _read(mv_ptr + src, h_mv + hs, mc, mh, HOT), mask=mo)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def gather_rows(
    tables: tuple[torch.Tensor, ...],
    nodes: torch.Tensor,
    outs: tuple[torch.Tensor, ...] | None = None,
    refresh: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    programs: int = 0,
    hot: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The five state tables' rows at ``nodes``, as ``tuple(t[nodes] for t in tables)``.

    Args:
        tables: memory (N1, d_mem), last_update (N1,) float64, mail (N1, M, d_mail),
            mail_ts (N1, M) float64, mail_valid (N1, M) bool; contiguous.
        nodes: (U,) int64 row ids in [0, N1).
        outs: The five (U, ...) contiguous tensors to write, or None (new ones).
        refresh: (stamp (N1,), since (1,), wipe (1,)) int64 of a
            :class:`~sven.models.readahead.WriteLog`: ``outs`` hold rows read ahead at
            ``since``, and only the stale ones (``WriteLog.stale``) are read again.
        programs: At most this many programs, each looping over blocks of rows (0: one
            program per block).
        hot: (slot (N1,) int32, the five tables' hot copies (H + 1, ...)) of a
            :class:`~sven.models.memory.HotRows`: a row whose slot is below H is read
            from its copy, at the slot; or None.

    Returns:
        The five (U, ...) tensors, in the same order.
    """
    mem, lu, mail, mts, mv = tables
    u = nodes.shape[0]
    m, d_mail = mail.shape[1], mail.shape[2]
    if outs is None:
        outs = tuple(t.new_empty((u, *t.shape[1:])) for t in tables)
    # Unused pointers get a real tensor of the right kind: the kernel never reads them.
    stamp, since, wipe = refresh if refresh is not None else (nodes, nodes, nodes)
    slot, (h_mem, h_lu, h_mail, h_mts, h_mv) = hot if hot is not None else (nodes, tables)
    if u:
        blocks = triton.cdiv(u, _ROWS)
        _gather_kernel[(min(blocks, programs) if programs > 0 else blocks,)](
            nodes, mem, lu, mail, mts, mv.view(torch.int8), outs[0], outs[1], outs[2],
            outs[3], outs[4].view(torch.int8), u, stamp, since, wipe,
            slot, h_mem, h_lu, h_mail, h_mts, h_mv.view(torch.int8), h_mem.shape[0] - 1,
            mem.shape[1], d_mail, m, _block(mem.shape[1]), _block(m * d_mail), _block(m),
            ROWS=_ROWS, REFRESH=refresh is not None, HOT=hot is not None,
        )  # fmt: skip
    return outs


@triton.jit
def _amax_kernel(nodes_ptr, key_ptr, best_ptr, counter_ptr, P, BLOCK: tl.constexpr,
                 BUMP: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < P
    n = tl.load(nodes_ptr + offs, mask=m, other=0)
    k = tl.load(key_ptr + offs, mask=m, other=-1)
    tl.atomic_max(best_ptr + n, k, mask=m & (k >= 0))
    if BUMP:
        # The commit's number, taken before the write kernel runs (WriteLog.next).
        if tl.program_id(0) == 0:
            tl.atomic_add(counter_ptr, 1)


@triton.jit
def _write_kernel(
    nodes_ptr, key_ptr, best_ptr, P,
    src_mem, src_lu, src_mail, src_mts,
    mem_ptr, lu_ptr, mail_ptr, mts_ptr, mv_ptr, stamp_ptr, counter_ptr,
    slot_ptr, h_mem, h_lu, h_mail, h_mts, h_mv, H,
    D_MEM: tl.constexpr, D_MAIL: tl.constexpr, M: tl.constexpr,
    B_MEM: tl.constexpr, B_MAIL: tl.constexpr,
    WRITE_MEM: tl.constexpr, WRITE_MAIL: tl.constexpr, ROWS: tl.constexpr,
    STAMP: tl.constexpr, HOT: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = rows < P
    n = tl.load(nodes_ptr + rows, mask=rm, other=0).to(tl.int64)
    k = tl.load(key_ptr + rows, mask=rm, other=-1)
    b = tl.load(best_ptr + n, mask=rm & (k >= 0), other=-2)
    win = rm & (k >= 0) & (b == k)
    r64 = rows.to(tl.int64)
    # A hot row (slot below H) is written twice: into the tables and into its copy in
    # GPU memory (written through: the tables stay whole for whoever reads them).
    if HOT:
        s = tl.load(slot_ptr + n, mask=win, other=H).to(tl.int64)
        wh = win & (s < H)
    else:
        s = n
        wh = win
    if WRITE_MEM:
        c = tl.arange(0, B_MEM)
        cm = (c < D_MEM)[None, :]
        m2 = win[:, None] & cm
        x = tl.load(src_mem + r64[:, None] * D_MEM + c[None, :], mask=m2)
        _write(mem_ptr + n[:, None] * D_MEM + c[None, :], h_mem + s[:, None] * D_MEM
               + c[None, :], x, m2, wh[:, None] & cm, HOT)  # fmt: skip
        _write(lu_ptr + n, h_lu + s, tl.load(src_lu + r64, mask=win), win, wh, HOT)
    if WRITE_MAIL:
        c = tl.arange(0, B_MAIL)
        cm = (c < D_MAIL)[None, :]
        m2 = win[:, None] & cm
        mh = wh[:, None] & cm
        row = n[:, None] * (M * D_MAIL) + c[None, :]
        hrow = s[:, None] * (M * D_MAIL) + c[None, :]
        # The queue moves by one slot, the oldest mail falling out of the last. Every
        # thread loads slot j - 1 before any stores into it (at the next step, or the
        # new mail below): a row's times and flags are held by several threads, and
        # one thread ahead of another would otherwise shift a slot twice.
        for j in tl.static_range(M - 1, 0, -1):
            prev = tl.load(mail_ptr + row + (j - 1) * D_MAIL, mask=m2)
            t = tl.load(mts_ptr + n * M + (j - 1), mask=win)
            v = tl.load(mv_ptr + n * M + (j - 1), mask=win)
            tl.debug_barrier()
            _write(mail_ptr + row + j * D_MAIL, h_mail + hrow + j * D_MAIL, prev, m2, mh, HOT)
            _write(mts_ptr + n * M + j, h_mts + s * M + j, t, win, wh, HOT)
            _write(mv_ptr + n * M + j, h_mv + s * M + j, v, win, wh, HOT)
        x = tl.load(src_mail + r64[:, None] * D_MAIL + c[None, :], mask=m2)
        _write(mail_ptr + row, h_mail + hrow, x, m2, mh, HOT)
        _write(mts_ptr + n * M, h_mts + s * M, tl.load(src_mts + r64, mask=win), win, wh, HOT)
        _write(mv_ptr + n * M, h_mv + s * M, tl.full([ROWS], 1, tl.int8), win, wh, HOT)
    # Only the winner resets its node's maximum, and only once every thread of this
    # program is past its reads of it: the compiler may load ``best`` again in each
    # thread that needs ``win`` (one per column group of a row), and a read after the
    # reset would drop the winner's remaining columns. A loser in another program reads
    # either the winner's key or -1, neither its own (keys are >= 0 and distinct).
    if STAMP:
        tl.store(stamp_ptr + n, tl.load(counter_ptr) + tl.zeros([ROWS], tl.int64), mask=win)
    tl.debug_barrier()
    tl.store(best_ptr + n, tl.full([ROWS], -1, tl.int64), mask=win)


def commit_rows(
    tables: tuple[torch.Tensor, ...],
    best: torch.Tensor,
    nodes: torch.Tensor,
    key: torch.Tensor,
    memory: torch.Tensor | None,
    last_update: torch.Tensor | None,
    mail: torch.Tensor | None,
    mail_ts: torch.Tensor | None,
    *,
    log: tuple[torch.Tensor, torch.Tensor] | None = None,
    new_number: bool = True,
    hot: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None,
) -> None:
    """Writes each node's winning candidate (largest key) into the state tables.

    Args:
        tables: memory (N1, d_mem), last_update (N1,) float64, mail (N1, M, d_mail),
            mail_ts (N1, M) float64, mail_valid (N1, M) bool; contiguous, written in
            place.
        best: (N1,) int64, -1 everywhere (left so on return).
        nodes: (P,) int64 candidate rows.
        key: (P,) int64 distinct keys, -1 for candidates that write nothing.
        memory: (P, d_mem) and last_update (P,): the memory to write, or None (no
            memory written).
        mail: (P, d_mail) and mail_ts (P,): the mail to put at the front of the
            winners' queues, or None (no mail written).
        log: (stamp (N1,), counter (1,)) int64 of the state's
            :class:`~sven.models.readahead.WriteLog`, or None: the commit takes its
            number and stamps its winners' rows with it.
        new_number: Whether this call takes a new number (False: a commit's second
            set of winners, stamped with the first's number).
        hot: (slot (N1,) int32, the five tables' hot copies (H + 1, ...)), or None: a
            winner whose slot is below H is written into its copy too.
    """
    p = nodes.shape[0]
    if p == 0:
        return
    t_mem, t_lu, t_mail, t_mts, t_mv = tables
    m, d_mail = t_mail.shape[1], t_mail.shape[2]
    block = 1024
    stamp, counter = log if log is not None else (best, best)
    _amax_kernel[(triton.cdiv(p, block),)](
        nodes, key, best, counter, p, BLOCK=block, BUMP=log is not None and new_number
    )
    write_mem, write_mail = memory is not None, mail is not None
    # Unused pointers get a real tensor of the right kind: the kernel never reads them.
    src_mem = memory.contiguous().to(t_mem.dtype) if write_mem else t_mem
    src_lu = last_update.to(torch.float64).contiguous() if write_mem else t_lu
    src_mail = mail.contiguous().to(t_mail.dtype) if write_mail else t_mail
    src_mts = mail_ts.to(torch.float64).contiguous() if write_mail else t_mts
    slot, (h_mem, h_lu, h_mail, h_mts, h_mv) = hot if hot is not None else (nodes, tables)
    _write_kernel[(triton.cdiv(p, _ROWS),)](
        nodes, key, best, p, src_mem, src_lu, src_mail, src_mts,
        t_mem, t_lu, t_mail, t_mts, t_mv.view(torch.int8), stamp, counter,
        slot, h_mem, h_lu, h_mail, h_mts, h_mv.view(torch.int8), h_mem.shape[0] - 1,
        t_mem.shape[1], d_mail, m, _block(t_mem.shape[1]), _block(d_mail),
        WRITE_MEM=write_mem, WRITE_MAIL=write_mail, ROWS=_ROWS, STAMP=log is not None,
        HOT=hot is not None,
    )  # fmt: skip
