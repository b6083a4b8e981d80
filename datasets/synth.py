"""Synthetic temporal interaction streams, realistic enough to train and benchmark on.

The generator is the built-in default data of ``sven train`` and the source of the
ingest benchmark, so it has to be (1) shaped like real interaction data, so that a
memory model has something to remember, (2) a pure function of its parameters, and
(3) streaming: 10^8 events in memory that depends on the node count only.

The model, per event (see ``docs/synthetic.md`` for the full description):

- **Source.** With probability ``p_reply`` the event answers a recent event (u -> v
  becomes v -> u; not on bipartite graphs). With probability ``p_excite`` the source
  is an endpoint of a recent event (self-excitation: active nodes stay active for a
  while, as in a Hawkes process). Otherwise the source is drawn from a Zipf law over
  activity ranks, so a few nodes carry most of the events.
- **Partner.** With probability ``p_repeat`` the source re-contacts one of its last
  ``history`` partners, biased towards the most recent. Otherwise it picks a new
  partner: with probability ``p_intra`` inside its own community, else anywhere, by a
  Zipf law over popularity ranks (correlated with activity on non-bipartite graphs).
- **Time.** Inter-event gaps are a mixture of short exponential gaps (inside a burst)
  and Pareto gaps (between bursts), so the gaps have a coefficient of variation well
  above 1, as real streams do.
- **Node arrival.** Ids are compact 0..N-1 in order of arrival: at stream position
  ``f`` in [0, 1] the first ``initial_active + (1 - initial_active) * f`` share of each
  side's ids may take part, so later splits contain unseen (inductive) nodes.
- **Edge features** (optional): a community centroid of the destination plus a
  per-pair vector (a hash of the pair, so a repeated pair carries a similar feature)
  plus noise.

Vectorization and its one approximation: events are produced in fixed blocks of
``block_size`` events. Inside a block every event is drawn in parallel from the state
at the start of the block (per-node ring buffers of the last ``history`` partners, and
the previous block as the pool of "recent events"); the state is updated once at the
end of the block with numpy scatters. An event therefore cannot repeat, reply to or be
excited by an event of its own block. With the default 4096-event blocks that is a lag
of at most a few thousand events, far below the time between a typical node's events.

Determinism: every block draws its randomness from its own stream, keyed by
``(seed, block index)``, in fixed amounts. The output therefore depends on the
parameters (including ``block_size``) and never on ``chunk_size``, which only decides
how the stream is cut into arrays. Two runs with the same parameters produce the same
bytes.

This module holds the parameters (:class:`SynthParams`), the stream in chunks
(:func:`iter_synth_chunks`), its store (:func:`generate`) and the cached default
dataset (:func:`default_dataset`); the draw itself is
:class:`~sven.datasets.synth_stream.SynthStream`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sven.datasets.synth_stream import SynthStream
from sven.errors import ConfigError

if TYPE_CHECKING:
    from sven.datasets.store import TemporalEvents

#: Bumped whenever the generated stream changes for the same parameters, so that cached
#: default datasets from an older generator are not reused.
GENERATOR_VERSION = 1

#: Size of the built-in default dataset (``sven data synth`` with no arguments, and the
#: default data of ``sven train``).
DEFAULT_EVENTS = 100_000
DEFAULT_NODES = 2_000
DEFAULT_SEED = 0
#: Events per array handed to the store; it bounds the generator's transient memory.
DEFAULT_CHUNK_SIZE = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SynthParams:
    """Every knob of the generator; the stream is a pure function of these values."""

    events: int = DEFAULT_EVENTS
    """Number of events E."""
    nodes: int = DEFAULT_NODES
    """Number of nodes N; ids are 0..N-1 (bipartite: sources first, then items)."""
    seed: int = DEFAULT_SEED
    """Seed of every random stream."""
    edge_feat_dim: int = 0
    """Edge feature dimension d_e; 0 writes no edge features."""
    bipartite: bool = False
    """Sources (users) and destinations (items) are disjoint sets, as in JODIE data."""
    src_fraction: float = 0.8
    """Bipartite only: share of the nodes that are sources (ids 0..num_src_nodes-1)."""
    communities: int = 0
    """Number of communities; 0 picks max(1, N // 100)."""
    activity_exponent: float = 1.0
    """Zipf exponent of source activity (higher: more concentrated on a few nodes)."""
    popularity_exponent: float = 0.5
    """Zipf exponent of destination popularity."""
    community_exponent: float = 0.5
    """Zipf exponent of community sizes (0: equal sizes in expectation)."""
    p_reply: float = 0.2
    """Probability that an event replies to a recent event (ignored if bipartite)."""
    p_excite: float = 0.2
    """Probability that the source is an endpoint of a recent event."""
    p_repeat: float = 0.65
    """Probability of re-contacting one of the source's last ``history`` partners."""
    p_intra: float = 0.85
    """Probability that a new partner comes from the source's community."""
    history: int = 8
    """Partners remembered per node (ring buffer length H)."""
    initial_active: float = 0.5
    """Share of each side's nodes present from the start; the rest arrive over time."""
    burst_prob: float = 0.9
    """Share of inter-event gaps drawn inside a burst (short exponential gaps)."""
    burst_gap: float = 1.0
    """Mean gap inside a burst, in time units."""
    pause_gap: float = 30.0
    """Scale of the Pareto gap between bursts, in time units."""
    pause_shape: float = 2.0
    """Pareto shape of the gaps between bursts (< 2: infinite variance)."""
    label_share: float = 0.0
    """Per-event labels (for node classification) when > 0: this share of the
    communities, at least one and never all, is flagged (drawn from a stream of their own, so the
    events do not change), and an event is labelled 1 when its source belongs to a
    flagged community, else 0. 0 writes no labels."""
    block_size: int = 0
    """Events drawn in parallel from one state snapshot (see the module docstring);
    0 picks N // 4 within [256, 4096], so a typical node rarely occurs twice in a block."""

    def __post_init__(self) -> None:
        if self.events < 1:
            raise ConfigError(f"synth: events must be >= 1, got {self.events}")
        if self.nodes < 2:
            raise ConfigError(f"synth: nodes must be >= 2, got {self.nodes}")
        if self.seed < 0:
            raise ConfigError(f"synth: seed must be >= 0, got {self.seed}")
        if self.edge_feat_dim < 0:
            raise ConfigError(f"synth: edge_feat_dim must be >= 0, got {self.edge_feat_dim}")
        if self.communities < 0:
            raise ConfigError(f"synth: communities must be >= 0, got {self.communities}")
        if self.history < 1 or self.block_size < 0:
            raise ConfigError("synth: history must be >= 1 and block_size >= 0")
        for name in ("p_reply", "p_excite", "p_repeat", "p_intra", "burst_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"synth: {name} must be in [0, 1], got {value}")
        if not 0.0 <= self.label_share < 1.0:
            raise ConfigError(f"synth: label_share must be in [0, 1), got {self.label_share}")
        if self.label_share and self.num_communities < 2:
            raise ConfigError("synth: labels need at least 2 communities (raise communities)")
        if self.p_reply + self.p_excite > 1.0:
            raise ConfigError("synth: p_reply + p_excite must be <= 1")
        if not 0.0 < self.initial_active <= 1.0:
            raise ConfigError(f"synth: initial_active must be in (0, 1], got {self.initial_active}")
        if self.bipartite:
            if not 0.0 < self.src_fraction < 1.0:
                raise ConfigError(f"synth: src_fraction must be in (0, 1), got {self.src_fraction}")
            if self.num_src_nodes < 1 or self.num_src_nodes >= self.nodes:
                raise ConfigError("synth: bipartite needs at least one source and one item")
        if self.burst_gap <= 0 or self.pause_gap <= 0 or self.pause_shape <= 0:
            raise ConfigError("synth: burst_gap, pause_gap and pause_shape must be > 0")
        for name in ("activity_exponent", "popularity_exponent", "community_exponent"):
            if getattr(self, name) < 0:
                raise ConfigError(f"synth: {name} must be >= 0")

    @property
    def num_src_nodes(self) -> int:
        """Bipartite: sources are ids 0..num_src_nodes-1; otherwise N."""
        if not self.bipartite:
            return self.nodes
        return round(self.nodes * self.src_fraction)

    @property
    def block(self) -> int:
        """The block size actually used."""
        return self.block_size or min(4096, max(256, self.nodes // 4))

    @property
    def num_communities(self) -> int:
        """The community count actually used."""
        return self.communities or max(1, self.nodes // 100)

    def to_dict(self) -> dict[str, Any]:
        """The parameters as JSON-ready values, with the generator version."""
        values = dataclasses.asdict(self)
        if not self.label_share:  # unlabelled streams keep the keys they had before it
            del values["label_share"]
        return {"generator_version": GENERATOR_VERSION, **values}

    def key(self) -> str:
        """A short stable digest of the parameters, for cache directory names."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def iter_synth_chunks(
    events: int = DEFAULT_EVENTS,
    nodes: int = DEFAULT_NODES,
    seed: int = DEFAULT_SEED,
    edge_feat_dim: int = 0,
    *,
    bipartite: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    **knobs: Any,
) -> Iterator[dict[str, np.ndarray]]:
    """Streams a synthetic event sequence in time order, ``chunk_size`` events at a time.

    The concatenation of the chunks is the same for every ``chunk_size``.

    Args:
        events: number of events E.
        nodes: number of nodes N.
        seed: random seed.
        edge_feat_dim: edge feature dimension d_e (0: none).
        bipartite: sources 0..num_src_nodes-1 interact only with items after them.
        chunk_size: events per yielded chunk (the last one may be shorter).
        **knobs: further :class:`SynthParams` fields.

    Yields:
        Dicts with ``src``, ``dst`` (n,) int32 (int64 if N >= 2^31), ``t`` (n,) int64
        non-decreasing across chunks, ``edge_feat`` (n, d_e) float32 when
        ``edge_feat_dim`` > 0, and ``label`` (n,) int64 0/1 when ``label_share`` > 0.
    """
    params = SynthParams(
        events=events,
        nodes=nodes,
        seed=seed,
        edge_feat_dim=edge_feat_dim,
        bipartite=bipartite,
        **knobs,
    )
    yield from iter_param_chunks(params, chunk_size=chunk_size)


def iter_param_chunks(
    params: SynthParams, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Iterator[dict[str, np.ndarray]]:
    """:func:`iter_synth_chunks` for a ready :class:`SynthParams`."""
    if chunk_size < 1:
        raise ConfigError(f"synth: chunk_size must be >= 1, got {chunk_size}")
    stream = SynthStream(params)
    pending: list[dict[str, np.ndarray]] = []
    held = 0
    for b in range(stream.num_blocks):
        block = stream.block(b)
        pending.append(block)
        held += len(block["t"])
        while held >= chunk_size:
            merged = _concat(pending)
            yield {k: v[:chunk_size] for k, v in merged.items()}
            pending = [{k: v[chunk_size:] for k, v in merged.items()}]
            held -= chunk_size
    if held:
        yield _concat(pending)


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder for generated datasets: ``cache_dir``, else $SVEN_CACHE, else ~/.cache/sven."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("SVEN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sven"


def cached_name(params: SynthParams) -> str:
    """Directory name of ``params`` inside the cache (readable, and unique by digest)."""
    kind = "bip" if params.bipartite else "uni"
    return f"synth-{kind}-e{params.events}-n{params.nodes}-s{params.seed}-{params.key()}"


def write_synth(
    params: SynthParams,
    out_dir: str | os.PathLike[str],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    name: str = "synth",
    overwrite: bool = False,
) -> TemporalEvents:
    """Streams the dataset of ``params`` into an event store at ``out_dir``.

    Memory stays bounded: chunks go straight to :class:`~sven.datasets.store.StoreWriter`.
    Ids are already compact (the store keeps them, ``id_map`` is the identity) and
    times sorted (no sort on ingest). ``meta.json`` records
    ``source = {"format": "synth", "params": params.to_dict()}``. On a bipartite
    graph the store derives ``num_src_nodes`` as the largest source id + 1, which is
    below ``params.num_src_nodes`` when the last-arrived users never act.

    Args:
        params: generator parameters.
        out_dir: the store directory to create (atomically, by the store writer).
        chunk_size: events per append; it does not change the data.
        name: dataset name in ``meta.json``.
        overwrite: replace an existing ``out_dir``.

    Returns:
        The written store, loaded (memory-mapped).
    """
    from sven.datasets.store import StoreWriter

    writer = StoreWriter(
        out_dir,
        name=name,
        num_nodes=params.nodes,
        bipartite=params.bipartite,
        source={"format": "synth", "params": params.to_dict()},
        overwrite=overwrite,
    )
    try:
        for chunk in iter_param_chunks(params, chunk_size=chunk_size):
            writer.append(
                chunk["src"],
                chunk["dst"],
                chunk["t"],
                edge_feat=chunk.get("edge_feat"),
                label=chunk.get("label"),
            )
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def generate(
    out_dir: str | os.PathLike[str],
    events: int = DEFAULT_EVENTS,
    nodes: int = DEFAULT_NODES,
    seed: int = DEFAULT_SEED,
    edge_feat_dim: int = 0,
    *,
    bipartite: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    name: str = "synth",
    overwrite: bool = False,
    **knobs: Any,
) -> TemporalEvents:
    """Generates a synthetic dataset into an event store.

    Args:
        out_dir: the store directory to create.
        events: number of events E.
        nodes: number of nodes N.
        seed: random seed.
        edge_feat_dim: edge feature dimension d_e (0: none).
        bipartite: sources 0..num_src_nodes-1 interact only with items after them.
        chunk_size: events per append to the store (memory, not content).
        name: dataset name in ``meta.json``.
        overwrite: replace an existing ``out_dir``.
        **knobs: further :class:`SynthParams` fields.

    Returns:
        The written store: src, dst (E,), t (E,) int64, edge_feat (E, d_e) float32.
    """
    params = SynthParams(
        events=events,
        nodes=nodes,
        seed=seed,
        edge_feat_dim=edge_feat_dim,
        bipartite=bipartite,
        **knobs,
    )
    return write_synth(params, out_dir, chunk_size=chunk_size, name=name, overwrite=overwrite)


def cached_dataset(
    params: SynthParams,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Path, bool]:
    """Generates ``params`` into the cache once; later calls reuse it.

    Safe against concurrent callers and interruptions: the store is written into a
    private temporary folder inside the cache and renamed into place, and a caller
    that loses the race keeps the winner's copy (the content is the same).

    Returns:
        The store path and whether this call generated it.
    """
    root = cache_root(cache_dir)
    final = root / cached_name(params)
    if (final / "meta.json").is_file():
        return final, False
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        write_synth(params, tmp / "store", chunk_size=chunk_size)
        try:
            os.rename(tmp / "store", final)
        except OSError:
            # Another process finished first (rename onto a non-empty folder fails).
            if not (final / "meta.json").is_file():
                raise
            return final, False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, True


def default_dataset(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The built-in default dataset (DEFAULT_EVENTS events, DEFAULT_NODES nodes, seed 0).

    Generated on first use into ``cache_dir`` (default $SVEN_CACHE or ~/.cache/sven),
    reused afterwards.

    Returns:
        Path of the event store.
    """
    return cached_dataset(SynthParams(), cache_dir)[0]


@dataclass(frozen=True)
class StoreShape:
    """What a run's plan reads of a store (counts and feature tables), for a store
    not generated yet.

    Attributes:
        path: Where the store would be.
        num_events, num_nodes: Its counts.
        edge_feat: None, or an empty (0, d_e) array: the width of its features.
        node_feat: None (the generator writes no node features).
        meta: Its ``name``.
    """

    path: Path
    num_events: int
    num_nodes: int
    edge_feat: np.ndarray | None = None
    node_feat: None = None
    meta: dict[str, Any] = field(default_factory=lambda: {"name": "synth"})


def default_dataset_shape(cache_dir: str | os.PathLike[str] | None = None) -> StoreShape | None:
    """The default dataset's shape where it is not in the cache yet (None where it is):
    what ``sven train --dry-run`` plans with, generating nothing."""
    params = SynthParams()
    final = cache_root(cache_dir) / cached_name(params)
    if (final / "meta.json").is_file():
        return None
    d = params.edge_feat_dim
    feat = np.empty((0, d), dtype=np.float32) if d else None
    return StoreShape(final, params.events, params.nodes, edge_feat=feat)
