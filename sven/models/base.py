"""The shared skeleton of memory-based temporal GNNs.

A model maps (batch, memory rows of the batch's unique nodes) to link scores and a
:class:`~sven.models.memory.MemoryUpdate`. The step order is the one of TGN/TGL:

1. apply pending mail to memory (the updater; gradients flow through it),
2. embed each root from the current memory (model specific),
3. score positive and negative pairs with the decoder,
4. build the write-back: current memory and a new mail for every node of a positive
   event, from its last event in the batch.

Models never call collectives and never keep state between calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from sven.kernels.reference import masked_rows, take_rows
from sven.kernels.sums import linear
from sven.models.memory import DenseUpdate, MemoryRows, MemoryUpdate
from sven.models.updaters import RecurrentUpdater
from sven.pipeline import constants
from sven.pipeline.batch import Batch
from sven.pipeline.negatives import dropout_scale

if TYPE_CHECKING:
    from sven.config import ModelConfig
    from sven.pipeline.dedupe import SortedRuns

#: Roots from which an ``auto`` attention without a gradient takes the factored form on
#: CUDA too (:class:`TemporalAttentionLayer`): TGB's one-vs-many evaluation, not the
#: one-negative protocols (3 to 5 roots per event).
WIDE_ROOTS = 4096

#: The training events a model may derive a hyperparameter from: (src, dst, t), each (E,).
TrainEvents = tuple[np.ndarray, np.ndarray, np.ndarray]


def keyed_dropout(
    x: torch.Tensor, p: float, keys: torch.Tensor | None, training: bool
) -> torch.Tensor:
    """Dropout whose mask is a function of each row's key, not of a generator's state.

    A row's key names what the row is (a root's event and slot, or a node in a global
    batch; see ``sven.pipeline.negatives``), so the rank that computes the row draws
    the same mask as one process would, and a resumed run the same as an uninterrupted
    one.

    Args:
        x: (R, D) input.
        p: Drop probability.
        keys: (R,) int64 row keys, or None for ``torch.nn.functional.dropout``.
        training: Whether to drop at all.

    Returns:
        (R, D), zeros where dropped and the rest scaled by 1 / (1 - p).
    """
    if not training or p == 0.0:
        return x
    if keys is None:
        return nn.functional.dropout(x, p, training=True)
    return x * dropout_scale(keys, x.shape[1], p, x.dtype)


def endpoint_keys(batch: Batch, side_offsets: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Ordering keys of the two sides of each event: (2B,) int64, -1 where padded.

    Key: later events win; within an event the destination side wins (a self-loop keeps
    its destination-side mail). Multiples of 4 leave room for neighbour delivery (APAN,
    offsets 2 and 3).
    """
    dev = batch.index.device
    # Both sides in one kernel, the padding in one more (shape constants, kept: the
    # captured step is bound by its kernel count).
    sides = constants.values(tuple(side_offsets), torch.int64, dev)[:, None]
    keys = torch.add(sides, batch.index[None, :], alpha=4)
    if batch.valid is not None:
        keys = torch.where(batch.valid[None, :], keys, constants.filled(-1, (), torch.int64, dev))
    return keys.reshape(-1)


def endpoints(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory writers of a batch: (2B,) ``[src, dst]`` and their (2B,)
    :func:`endpoint_keys` (what :meth:`MemoryModel.mail_receivers` is given)."""
    return torch.cat([batch.src, batch.dst]), endpoint_keys(batch)


@dataclass
class ModelOutput:
    """What a forward pass returns.

    Attributes:
        pos: (B,) logits of the positive events.
        neg: (B, n) logits of the negatives.
        dense: The memory write-back of the batch, one candidate per writer.
    """

    pos: torch.Tensor
    neg: torch.Tensor
    dense: DenseUpdate

    @property
    def update(self) -> MemoryUpdate:
        """The write-back with one row per written node (see ``DenseUpdate.compact``)."""
        return self.dense.compact()


class LinkDecoder(nn.Module):
    """MLP link scorer: relu(W_s h_src + W_d h_dst) -> logit (TGN's link predictor).

    Args:
        dim: Embedding width.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_src = nn.Linear(dim, dim)
        self.lin_dst = nn.Linear(dim, dim)
        self.lin_out = nn.Linear(dim, 1)

    def forward(self, h_src: torch.Tensor, h_dst: torch.Tensor) -> torch.Tensor:
        """Scores (..., d) pairs into (...,) logits."""
        return self.lin_out(torch.relu(self.lin_src(h_src) + self.lin_dst(h_dst))).squeeze(-1)

    def batch(self, h: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores a batch's pairs (:func:`sven.kernels.link_decoder`).

        Args:
            h: (R, d) root embeddings in the batch layout ``[src (B), dst (B), neg[:, 0]
                (B), ...]``, R = (2 + n) B.
            b: B.

        Returns:
            (B,) logits of the positive events and (B, n) of the negatives.
        """
        from sven import kernels

        return kernels.link_decoder(
            h,
            b,
            self.lin_src.weight,
            self.lin_src.bias,
            self.lin_dst.weight,
            self.lin_dst.bias,
            self.lin_out.weight,
            self.lin_out.bias,
        )


def time_gap_scale(src: np.ndarray, dst: np.ndarray, t: np.ndarray) -> float:
    """Std of the time since a node's previous event, over the given events (JODIE's scale).

    Args:
        src: (E,) sources. dst: (E,) destinations. t: (E,) sorted times.

    Returns:
        The standard deviation, or 1.0 where it is zero or undefined.
    """
    nodes = np.concatenate([src, dst]).astype(np.int64)
    times = np.concatenate([t, t]).astype(np.float64)
    order = np.lexsort((times, nodes))
    n, ts = nodes[order], times[order]
    same = n[1:] == n[:-1]
    gaps = (ts[1:] - ts[:-1])[same]
    std = float(gaps.std()) if gaps.size else 0.0
    return std if std > 0 and math.isfinite(std) else 1.0


class MemoryModel(nn.Module):
    """Base class: memory updater, decoder and write-back; subclasses define ``embed``.

    Args:
        num_nodes: N (used only for shape checks by subclasses).
        memory_dim: d_mem.
        time_dim: Width of time encodings.
        embed_dim: Width of root embeddings given to the decoder.
        edge_dim: d_e (0 without edge features).
        node_dim: d_n (0 without node features).
        cell: "gru" or "rnn" memory cell.
        message: "identity" (raw mail to the cell) or "mlp" (a 2-layer MLP first).
    """

    #: Which roots get sampled neighbours: "all", "positive" or "none".
    sample_roots: str = "none"
    #: Whether the sampled neighbours' memory is read.
    read_neighbors: bool = False
    #: Mailbox slots M.
    mailbox_size: int = 1
    #: Whether mail also goes to the sampled neighbours of the events' endpoints.
    deliver_to_neighbors: bool = False

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        *,
        edge_dim: int = 0,
        node_dim: int = 0,
        train_events: TrainEvents | None = None,
    ) -> MemoryModel:
        """The model that ``model_cfg`` describes, for data with these facts.

        Each model reads the config fields it uses (:meth:`config_kwargs`); the data
        facts are what the config cannot know.

        Args:
            model_cfg: The ``model`` section of the config.
            edge_dim: d_e of the event features (0 without).
            node_dim: d_n of the node features (0 without).
            train_events: (src, dst, t) of the training events, each (E,), for models
                that scale time by the data's time gaps (JODIE, APAN); None: scale 1.

        Returns:
            The model, on the CPU in the default dtype (parameters drawn from torch's
            global generator, as the constructor draws them).
        """
        return cls(
            **cls.config_kwargs(
                model_cfg, edge_dim=edge_dim, node_dim=node_dim, train_events=train_events
            )
        )

    @classmethod
    def config_kwargs(
        cls,
        model_cfg: ModelConfig,
        *,
        edge_dim: int = 0,
        node_dim: int = 0,
        train_events: TrainEvents | None = None,
    ) -> dict[str, Any]:
        """The constructor's keyword arguments from the config and the data facts.

        The shared ones here; a subclass adds the fields of its own (see
        :meth:`from_config` for the arguments).
        """
        kwargs: dict[str, Any] = dict(
            memory_dim=model_cfg.memory_dim,
            time_dim=model_cfg.time_dim,
            embed_dim=model_cfg.embed_dim,
            edge_dim=edge_dim,
            node_dim=node_dim,
            message=model_cfg.message,
        )
        if model_cfg.cell:
            kwargs["cell"] = model_cfg.cell
        return kwargs

    @staticmethod
    def _time_scale(train_events: TrainEvents | None) -> float:
        """:func:`time_gap_scale` of the training events (1.0 without them)."""
        return 1.0 if train_events is None else time_gap_scale(*train_events)

    def __init__(
        self,
        *,
        memory_dim: int,
        time_dim: int,
        embed_dim: int,
        edge_dim: int = 0,
        node_dim: int = 0,
        cell: str = "gru",
        message: str = "identity",
    ) -> None:
        super().__init__()
        self.memory_dim = memory_dim
        self.time_dim = time_dim
        self.embed_dim = embed_dim
        self.edge_dim = edge_dim
        self.node_dim = node_dim
        self.mail_dim = 2 * memory_dim + edge_dim
        if message == "identity":
            self.message: nn.Module = nn.Identity()
            msg_dim = self.mail_dim
        elif message == "mlp":
            msg_dim = memory_dim
            self.message = nn.Sequential(
                nn.Linear(self.mail_dim, msg_dim), nn.ReLU(), nn.Linear(msg_dim, msg_dim)
            )
        else:
            raise ValueError(f"unknown message function {message!r} (expected identity or mlp)")
        self.updater = RecurrentUpdater(cell, msg_dim, time_dim, memory_dim)
        self.node_proj = nn.Linear(node_dim, memory_dim) if node_dim > 0 else None
        self.decoder = LinkDecoder(embed_dim)

    # -- step 1 -----------------------------------------------------------------
    def current_memory(self, batch: Batch, rows: MemoryRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Applies pending mail; returns memory (U, d_mem) and last_update (U,)."""
        msg = self.message(rows.mail[:, 0])
        return self.updater(rows, msg)

    def node_state(self, batch: Batch, memory: torch.Tensor) -> torch.Tensor:
        """Memory plus projected static node features, (U, d_mem)."""
        if self.node_proj is not None and batch.node_feat is not None:
            return memory + self.node_proj(batch.node_feat.to(memory.dtype))
        return memory

    # -- step 2 -----------------------------------------------------------------
    def embed(self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor) -> torch.Tensor:
        """Embeds every root; returns (R, embed_dim). Subclasses implement."""
        raise NotImplementedError

    # -- step 4 -----------------------------------------------------------------
    def event_mail(
        self, batch: Batch, memory: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw mails of the positive events from each side.

        Args:
            batch: The batch.
            memory: (U, d_mem) the batch's updated memory.
            own: (2B, d_mem) ``memory`` at the events' sources then destinations, read
                once by the caller for the mails and the write-back.

        Returns:
            (B, d_mail) mails for the source side and (B, d_mail) for the destination side:
            [own memory, what the side sees of the other endpoint, edge features].
        """
        b = batch.size
        m_src, m_dst = own[:b], own[b:]
        seen_by_src, seen_by_dst = self.other_endpoint(batch, memory, own)
        parts_s = [m_src, seen_by_src]
        parts_d = [m_dst, seen_by_dst]
        if self.edge_dim > 0 and batch.edge_feat is not None:
            e = batch.edge_feat.to(memory.dtype)
            parts_s.append(e)
            parts_d.append(e)
        return torch.cat(parts_s, dim=1), torch.cat(parts_d, dim=1)

    def other_endpoint(
        self, batch: Batch, memory: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What each side's mail carries of the other endpoint: its memory (TGN's identity
        message). ``own`` is (2B, d_mem) the sources' then the destinations' memory.
        Returns (B, d_mem) for the source side and (B, d_mem) for the destination.
        """
        b = batch.size
        return own[b:], own[:b]

    def mail_receivers(
        self,
        batch: Batch,
        mail_src: torch.Tensor,
        mail_dst: torch.Tensor,
        endpoints: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Who receives which mail: by default the two endpoints of each event.

        Args:
            batch: The batch.
            mail_src: (B, d_mail) mails of the source sides.
            mail_dst: (B, d_mail) mails of the destination sides.
            endpoints: (2B,) ``[src, dst]`` and their (2B,) :func:`endpoint_keys`, the
                memory writers; returned as they are when the endpoints are the
                receivers, so that the write-back picks one set of winners for both.

        Returns:
            receivers (P,), mails (P, d_mail), times (P,) float64, keys (P,) int64
            (-1 for the padded events of a fixed-capacity batch).
        """
        mails = torch.cat([mail_src, mail_dst])
        # The roots' times start with [t (B), t (B)]: those of the sources and the
        # destinations, a view where a concatenation was a kernel.
        ts = batch.root_t[: 2 * batch.size]
        return endpoints[0], mails, ts, endpoints[1]

    def write_back(
        self, batch: Batch, memory: torch.Tensor, last_update: torch.Tensor
    ) -> DenseUpdate:
        """Builds the memory update of the batch (all detached), one row per writer."""
        b = batch.size
        memory = memory.detach()
        rp = batch.root_pos[: 2 * b]
        own = memory[rp]
        mail_src, mail_dst = self.event_mail(batch, memory, own)
        nodes, key = endpoints(batch)
        recv, mails, ts, keys = self.mail_receivers(batch, mail_src, mail_dst, (nodes, key))
        return DenseUpdate(
            nodes=nodes,
            memory=own,
            last_update=last_update.detach()[rp],
            key=key,
            mail_nodes=recv,
            mail=mails.detach(),
            mail_ts=ts,
            mail_key=keys,
        )

    def encode(self, batch: Batch, rows: MemoryRows) -> tuple[torch.Tensor, DenseUpdate]:
        """The forward pass without the link decoder: root embeddings and the write-back.

        What other heads build on (node classification, embeddings out of a trained
        model; ``sven.tasks.nodeclass``, ``sven.tasks.predict``): the embedding of a root is the one
        the link decoder scores.

        Args:
            batch: The batch (roots, neighbours, unique nodes).
            rows: Memory state of ``batch.nodes`` at the end of the previous batch.

        Returns:
            (R, embed_dim) embeddings of the roots in the batch's layout ``[src (B), dst
            (B), neg[:, 0] (B), ...]``, and the batch's memory write-back.
        """
        memory, last_update = self.current_memory(batch, rows)
        h = self.embed(batch, memory, last_update)
        return h, self.write_back(batch, memory, last_update)

    def forward(self, batch: Batch, rows: MemoryRows) -> ModelOutput:
        """One step: scores of the batch and its memory update.

        Args:
            batch: The batch (roots, neighbours, unique nodes).
            rows: Memory state of ``batch.nodes`` at the end of the previous batch.

        Returns:
            Logits and the write-back.
        """
        h, dense = self.encode(batch, rows)
        pos, neg = self.decoder.batch(h, batch.size)
        return ModelOutput(pos=pos, neg=neg, dense=dense)


class Projection(nn.Linear):
    """``nn.Linear`` (the same parameters and state), whose bias gradient on CUDA is a
    cuBLAS product (``sven.kernels.sums.linear``) rather than autograd's column
    reduction; elsewhere ``nn.Linear`` itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(M, in) -> (M, out)."""
        return linear(x, self.weight, self.bias)


class TimeProjection(nn.Linear):
    """JODIE's time projection of an embedding: h = z (1 + W dt / scale + b).

    A ``Linear(1, d)`` (its parameters keep the names ``weight`` and ``bias``), with
    W ~ N(0, 1/d) and b = 0 so that it starts near the identity.

    The scale is saved with the parameters (buffer ``scale_bits``: the float64's bits,
    which a cast of the model leaves exact), so that a model loaded from a checkpoint
    has it without the training events; a state saved without it leaves the scale
    given here.

    Args:
        dim: Width d of the projected embeddings.
        time_scale: Divides dt first, so that the layer sees O(1) inputs whatever the
            time unit (the trainer passes the training data's time-gap std).
    """

    def __init__(self, dim: int, time_scale: float = 1.0) -> None:
        super().__init__(1, dim)
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.time_scale = float(time_scale)
        self.register_buffer(
            "scale_bits", torch.tensor([self.time_scale], dtype=torch.float64).view(torch.int64)
        )
        nn.init.normal_(self.weight, 0.0, 1.0 / dim**0.5)
        nn.init.zeros_(self.bias)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # (The dict is load_state_dict's own copy of the caller's.)
        state_dict.setdefault(prefix + "scale_bits", self.scale_bits)
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.time_scale = float(self.scale_bits.cpu().view(torch.float64)[0])

    def project(self, z: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """Projects (R, d) embeddings by (R,) time differences (any float dtype)."""
        x = (dt / self.time_scale).to(z.dtype)[:, None]
        return z * (1 + self(x))


def _root_rows(
    z: torch.Tensor, root_pos: torch.Tensor, runs: SortedRuns | None
) -> tuple[torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None]:
    """The roots' rows of ``z`` (R, D), and how the neighbours' key/value rows are read:
    with a backward that sums over ``runs`` (``kernels.triton_gather``) where it runs
    (float32 tables, Triton chosen for ``gather_rows``), else None (the attention's own
    gather)."""
    from sven import kernels

    usable = runs is not None and z.dtype == torch.float32
    if not usable or kernels.backend_for(z, "gather_rows") != "triton":
        return take_rows(z, root_pos), None
    from sven.kernels.triton_gather import gather_rows_sorted

    def gather(table: torch.Tensor, idx: torch.Tensor, lo: int) -> torch.Tensor:
        return gather_rows_sorted(
            table, idx, runs.perm, runs.inverse, runs.sorted_ids, runs.pad_id, lo
        )

    def kv_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return gather(table, idx, runs.nbr_lo)

    return gather(z, root_pos, 0), kv_rows


class TemporalAttentionLayer(nn.Module):
    """One layer of temporal graph attention over sampled neighbours (TGAT/TGN).

    Query: [h_root, time_enc(0)]; keys/values: [h_nbr, edge features, time_enc(t - t_nbr)].
    Output: LayerNorm(ReLU(W_o [attention, h_root])). Attention, with the neighbour
    gather and the time encoding of the keys, runs in
    :func:`sven.kernels.temporal_attention_fused`.

    The key/value projection of the concatenation is split by blocks, W [h; e; te] =
    W_h h + W_e e + W_t te, so that W_h h is computed once per unique node and gathered
    (a batch reads each node once, however many roots list it as a neighbour).

    Args:
        in_dim: Width of node states h.
        edge_dim: d_e.
        time_dim: Time encoding width.
        out_dim: Output width.
        num_heads: Attention heads.
        dropout: Dropout on the output.
        form: ``fused``, ``factored`` (the same function, computed in another order:
            :func:`sven.kernels.reference.temporal_attention_factored`) or ``auto``
            (factored on CPU, fused on CUDA and under the Triton backend, except for
            batches of at least :data:`WIDE_ROOTS` roots without a gradient).
    """

    def __init__(
        self,
        in_dim: int,
        edge_dim: int,
        time_dim: int,
        out_dim: int,
        num_heads: int,
        dropout: float,
        form: str = "auto",
    ) -> None:
        super().__init__()
        from sven.models.updaters import TimeEncoding

        if form not in ("auto", "fused", "factored"):
            raise ValueError(f"attention form must be auto, fused or factored, got {form!r}")
        self.form = form
        if out_dim % num_heads:
            raise ValueError(f"embedding dim {out_dim} not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.time_enc = TimeEncoding(time_dim)
        self.w_q = Projection(in_dim + time_dim, out_dim)
        self.w_kv_node = Projection(in_dim, 2 * out_dim)
        self.w_kv_edge = nn.Linear(edge_dim, 2 * out_dim, bias=False) if edge_dim > 0 else None
        self.w_kv_time = nn.Linear(time_dim, 2 * out_dim, bias=False)
        self.w_out = Projection(out_dim + in_dim, out_dim)
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(out_dim)

    def forward(
        self,
        z: torch.Tensor,
        root_pos: torch.Tensor,
        nbr_pos: torch.Tensor,
        dt: torch.Tensor,
        mask: torch.Tensor,
        edge_feat: torch.Tensor | None,
        row_key: torch.Tensor | None = None,
        edge_rows: torch.Tensor | None = None,
        runs: SortedRuns | None = None,
    ) -> torch.Tensor:
        """Attends from each root to its neighbours.

        Args:
            z: (U, in_dim) states of the batch's unique nodes.
            root_pos: (R,) row of each root in ``z``.
            nbr_pos: (R, K) row of each neighbour in ``z`` (any valid row where masked).
            dt: (R, K) time since each neighbour event.
            mask: (R, K) bool validity.
            edge_feat: (R, K, d_e) neighbour event features, or None; with ``edge_rows``
                the (E, d_e) table they are rows of.
            row_key: (R,) int64 dropout keys of the roots, or None (torch's RNG).
            edge_rows: (R, K) row of ``edge_feat`` of each slot (any row where masked),
                or None.
            runs: The batch's de-duplication (``Batch.runs``), when ``root_pos`` and
                ``nbr_pos`` are its slots: the row gathers' backward then sums over its
                sorted runs instead of sorting again (``kernels.triton_gather``).

        Returns:
            (R, out_dim) embeddings.
        """
        from sven import kernels

        r = mask.shape[0]
        dtype = z.dtype
        wide = r >= WIDE_ROOTS and not torch.is_grad_enabled()
        form = self._form(z, wide)
        if form == "factored" and wide and z.shape[0] < r and not self.training:
            return self._per_node(z, root_pos, nbr_pos, dt, mask, edge_feat, edge_rows)
        h_root, kv_rows = _root_rows(z, root_pos, runs)

        zero = self.time_enc.at_zero(r).to(dtype)
        q = self.w_q(torch.cat([h_root, zero], dim=1))
        w_edge = None if self.w_kv_edge is None else self.w_kv_edge.weight
        args = (
            q.view(r, self.num_heads, -1),
            self.w_kv_node(z),
            nbr_pos,
            dt.to(dtype),
            mask,
            self.time_enc.weight,
            self.time_enc.bias,
            self.w_kv_time.weight,
        )
        if form == "fused":
            # The neighbour gather, the time encoding of dt and its projection happen
            # inside the attention kernel (Triton), or in the reference whose few large
            # GEMMs were measured fastest in the captured CUDA step (docs/performance.md).
            if edge_rows is not None and w_edge is not None:
                edge_feat = masked_rows(edge_feat, edge_rows, mask)
            kv_edge = None if w_edge is None else linear(edge_feat.to(dtype), w_edge, None)
            out = kernels.temporal_attention_fused(*args, kv_edge, rows=kv_rows)
        else:
            # On CPU FLOPs are the cost: the factored form projects queries and
            # attention-weighted sums instead of every neighbour slot, faster forward
            # and backward for TGN's dims (docs/performance.md has the timings).
            # A table (edge_rows) stays in its dtype: each form converts the rows it reads.
            feat = edge_feat if w_edge is None or edge_rows is not None else edge_feat.to(dtype)
            out = kernels.temporal_attention_factored(*args, feat, w_edge, edge_rows)
        out = self.w_out(torch.cat([out, h_root], dim=1))
        out = keyed_dropout(torch.relu(out), self.dropout.p, row_key, self.training)
        return self.norm(out)

    def _form(self, z: torch.Tensor, wide: bool) -> str:
        """The form (``fused`` or ``factored``) a batch of states ``z`` (U, in_dim) takes,
        ``wide`` when it has many roots and needs no gradient."""
        from sven import kernels

        if self.form != "auto":
            return self.form
        if not (z.is_cuda or kernels.backend_for(z) == "triton"):
            return "factored"
        # A wide batch without a gradient (the MRR's evaluation: 100 negatives make
        # 20,600 roots at batch 200): the factored form's Triton kernel reads each
        # neighbour slot once, where the fused form writes its (R, K, 2 O) keys and
        # values several times.
        return "factored" if wide else "fused"

    def _per_node(
        self,
        z: torch.Tensor,
        root_pos: torch.Tensor,
        nbr_pos: torch.Tensor,
        dt: torch.Tensor,
        mask: torch.Tensor,
        edge_feat: torch.Tensor | None,
        edge_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """:meth:`forward`'s factored form for a wide batch without a gradient, whose
        U node rows are fewer than its R roots (100 MRR negatives list each node many
        times): what depends on a root's node alone (its query, the query's products
        with the key blocks, and the output projection's node half) is computed once
        per node row and read by ``root_pos``. The same function; only rounding
        differs. No dropout (no gradient: evaluation)."""
        from sven import kernels

        u, dtype, o = z.shape[0], z.dtype, self.w_out.weight.shape[0]
        zero = self.time_enc.at_zero(u).to(dtype)
        q = self.w_q(torch.cat([z, zero], dim=1)).view(u, self.num_heads, -1)
        w_edge = None if self.w_kv_edge is None else self.w_kv_edge.weight
        # A table (edge_rows) stays in its dtype: the kernel converts the rows it reads.
        feat = edge_feat if w_edge is None or edge_rows is not None else edge_feat.to(dtype)
        att = kernels.temporal_attention_factored(
            q, self.w_kv_node(z), nbr_pos, dt.to(dtype), mask, self.time_enc.weight,
            self.time_enc.bias, self.w_kv_time.weight, feat, w_edge, edge_rows, root_pos,
        )  # fmt: skip
        # W_out [att; h_root] + b = W_att att + (W_h h + b), the second per node.
        w = self.w_out.weight
        node_half = linear(z, w[:, o:], self.w_out.bias)
        n = self.norm
        return kernels.relu_norm(linear(att, w[:, :o], None), node_half, root_pos, n.weight,
                                 n.bias, n.eps)  # fmt: skip
