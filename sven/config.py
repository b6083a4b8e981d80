"""Run configuration: nested keyword-only dataclasses, YAML presets, dotted overrides.

YAML files supply values only; every field is declared, typed and checked here, so no
untyped dict ever reaches model or trainer code. ``key=value`` overrides address fields
by dotted path (``train.batch_size=600``) and are parsed with YAML scalar rules.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from sven.errors import ConfigError

_INT64 = 2**63


def _check_numbers(section: Any, prefix: str) -> None:
    """Every number of a config section is finite and fits the int64 the code uses.

    Runs first in each section's ``__post_init__``: a NaN passes every ``<`` and
    ``>=`` range check below (``nan <= 0`` is false), and an infinite learning rate
    trains into NaN scores.
    """
    hints = get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if hints[f.name] is float and not math.isfinite(value):
            raise ConfigError(f"{prefix}.{f.name} must be a finite number, got {value}")
        if hints[f.name] is int and not -_INT64 <= value < _INT64:
            raise ConfigError(f"{prefix}.{f.name} is out of range, got {value}")


@dataclass(kw_only=True)
class DataConfig:
    """Where the events come from."""

    path: str = ""
    """Event store directory (``sven data convert`` output). Empty: the built-in
    synthetic dataset, generated once into the cache."""
    verify: bool = True
    """Check the store's sha256 checksums (``sven data verify``) when training opens
    it, so that a file changed on disk is found before it trains a model. This reads
    every byte once; set false for very large stores that were verified already. The
    cheap structural checks (headers, dtypes, shapes, id ranges) run regardless."""


@dataclass(kw_only=True)
class ModelConfig:
    """Model architecture (defaults: the published UCI/Enron settings, dims 100)."""

    name: str = "tgn"
    """One of tgn, jodie, apan, dyrep."""
    memory_dim: int = 100
    """Memory width d_mem."""
    time_dim: int = 100
    """Width of time encodings."""
    embed_dim: int = 100
    """Width of root embeddings."""
    num_neighbors: int = 10
    """K sampled temporal neighbours (TGN, DyRep, APAN delivery)."""
    sampling: str = "recent"
    """Neighbour strategy: recent or uniform."""
    num_heads: int = 2
    """Attention heads."""
    dropout: float = 0.1
    """Dropout in attention layers."""
    cell: str = ""
    """Memory cell (gru or rnn); empty: the model's own (GRU for TGN/APAN, RNN for JODIE/DyRep)."""
    message: str = "identity"
    """Message function: identity or mlp."""
    mailbox_size: int = 10
    """Mails per node for APAN (the others use 1)."""
    time_projection: bool = False
    """DyRep: embed as the memory projected by the time since its last update,
    m (1 + w dt), as JODIE and APAN always do (not in the DyRep paper; see
    docs/accuracy.md). Not available for TGN."""

    attention_form: str = "auto"
    """TGN's attention: fused (every neighbour slot's time encoding projected to keys and
    values), factored (queries carried back through the key projection, weighted sums
    projected forwards: fewer FLOPs, more kernels) or auto (factored on CPU, fused on
    CUDA; docs/performance.md)."""

    def __post_init__(self) -> None:
        _check_numbers(self, "model")
        self.name = self.name.lower()
        if self.name not in ("tgn", "jodie", "apan", "dyrep"):
            raise ConfigError(f"model.name: unknown model {self.name!r} (tgn, jodie, apan, dyrep)")
        for f in ("memory_dim", "time_dim", "embed_dim", "num_heads", "mailbox_size"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model.{f} must be positive, got {getattr(self, f)}")
        if self.num_neighbors < 1:
            raise ConfigError(f"model.num_neighbors must be >= 1, got {self.num_neighbors}")
        if self.sampling not in ("recent", "uniform"):
            raise ConfigError(f"model.sampling must be recent or uniform, got {self.sampling!r}")
        if self.cell not in ("", "gru", "rnn"):
            raise ConfigError(f"model.cell must be gru or rnn, got {self.cell!r}")
        if self.message not in ("identity", "mlp"):
            raise ConfigError(f"model.message must be identity or mlp, got {self.message!r}")
        if self.attention_form not in ("auto", "fused", "factored"):
            raise ConfigError(
                f"model.attention_form must be auto, fused or factored, got {self.attention_form!r}"
            )
        if self.time_projection and self.name == "tgn":
            raise ConfigError("model.time_projection: not available for tgn")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation, evaluation and checkpointing."""

    epochs: int = 3
    """Maximum number of epochs (the presets in configs/ carry the published schedules;
    this default keeps ``sven train`` on the built-in data short)."""
    batch_size: int = 200
    """Global batch size B (events)."""
    lr: float = 1e-4
    """Adam learning rate."""
    patience: int = 5
    """Early stopping: epochs without val AP improvement before stopping (0: never)."""
    select: str = "ap"
    """Which epoch's model is kept and tested, and what counts as improvement for
    ``patience``: ``ap``, a higher val AP than the best so far; ``ap_auc``, val AP and
    val AUC both at or above their best so far (DyGLib's early stopping, which
    produced its published figures)."""
    seed: int = 0
    """Seed of parameters, negatives, sampling and dropout."""
    num_neg: int = 1
    """Negatives per positive in training."""
    mrr_negatives: int = 0
    """Deprecated alias of ``eval.mrr_negatives`` (used when that is 0)."""
    max_batches: int = 0
    """If > 0, stop each training epoch after this many batches (smoke tests)."""
    checkpoint_every: int = 0
    """Also checkpoint every N training batches (0: only at epoch ends)."""
    keep_latest_k: int = 2
    """Checkpoints kept on disk."""
    checkpoint_async: bool = True
    """Write checkpoints in the background while training goes on: training waits only
    for a snapshot (the node state copied on the GPU when there is room, else written
    into its files), and the next checkpoint, or the run's end, waits for the commit.
    false: each checkpoint is on disk before training continues."""
    checkpoint_threads: int = 0
    """Threads that write (and hash) a checkpoint's node state, each a 64 MiB chunk at a
    time (0: one per core, up to 8)."""
    resume: bool = False
    """Continue from the latest valid checkpoint under ``out``; with none there, say
    so and start fresh. The checkpoint's config must equal this run's, except for
    the keys in ``RESUME_MAY_CHANGE`` (epochs, patience, quiet...); otherwise the run
    stops with exit code 2 and names the keys that differ."""
    overwrite: bool = False
    """Delete the earlier run in ``out`` before training (a folder with Sven's
    ``config.json``): only the files a run writes; where ``out`` holds anything else,
    or another process is training into it, the run stops and names it. Without it (or
    ``resume``), a non-empty ``out`` is an error, so that two runs never mix their
    checkpoints."""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu, cuda, or cuda:N. Under a
    multi-process launch, auto and cuda give each rank ``cuda:<local rank>`` on a GPU
    node. A device this machine lacks is an error that lists the ones it has."""
    dtype: str = "float32"
    """float32 or float64 (exactness tests)."""
    threads: int = 0
    """torch intra-op threads on CPU (0: torch's default)."""
    deterministic: bool = True
    """Deterministic kernels (``torch.use_deterministic_algorithms``): multithreaded
    gradient accumulation is otherwise order-dependent, and reruns and resumed runs
    would drift apart in the last bits."""
    cuda_graph: str = "auto"
    """On one process on CUDA, capture the whole training step (and the evaluation
    step) as a CUDA graph and replay it: auto (capture, fall back to eager with a notice
    if capture fails), on (fail if it cannot), off (eager). Ignored on CPU and on
    several ranks."""
    compile: bool = False
    """On CUDA, compile the model with ``torch.compile(model, dynamic=False)`` (Inductor
    fuses its element-wise work, forward and backward) inside the captured step. The
    first steps of each graph pay the compilation (tens of seconds; Inductor caches it on
    disk for later runs), so it pays on long runs. Ignored, with a notice, on CPU, where
    the exact-size eager step runs."""
    matmul_precision: str = "highest"
    """float32 matrix products on CUDA: ``highest`` (IEEE float32 FMAs) or ``high``
    (TF32 tensor cores: products of 10-bit-mantissa operands summed in float32, the
    matrix units' float32 mode; several times the rate on an H100/H200, relative
    error near 1e-3 per product). float64 runs and CPU runs are unaffected.
    docs/performance.md has its speed and test AP against ``highest``."""

    def __post_init__(self) -> None:
        _check_numbers(self, "train")
        if self.matmul_precision not in ("highest", "high"):
            raise ConfigError(
                f"train.matmul_precision must be highest or high, got {self.matmul_precision!r}"
            )
        for f in ("epochs", "batch_size", "num_neg", "keep_latest_k"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"train.{f} must be positive, got {getattr(self, f)}")
        for f in ("patience", "mrr_negatives", "max_batches", "checkpoint_every", "threads"):
            if getattr(self, f) < 0:
                raise ConfigError(f"train.{f} must be >= 0, got {getattr(self, f)}")
        if self.checkpoint_threads < 0:
            raise ConfigError(
                f"train.checkpoint_threads must be >= 0, got {self.checkpoint_threads}"
            )
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr}")
        if self.select not in ("ap", "ap_auc"):
            raise ConfigError(f"train.select must be ap or ap_auc, got {self.select!r}")
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"train.dtype must be float32 or float64, got {self.dtype!r}")
        if self.resume and self.overwrite:
            # slurm/train.sbatch passes resume=true on every start: with overwrite too,
            # each requeue would delete the run it is meant to continue.
            raise ConfigError("train.resume and train.overwrite exclude each other; pick one")
        dev = self.device
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ConfigError(
                f"train.device must be auto, cpu, cuda or cuda:N, got {self.device!r}"
            )
        # YAML 1.1 reads an unquoted on/off (and yes/no) as a boolean.
        mode = str(self.cuda_graph).lower()
        self.cuda_graph = {"true": "on", "yes": "on", "false": "off", "no": "off"}.get(mode, mode)
        if self.cuda_graph not in ("auto", "on", "off"):
            raise ConfigError(f"train.cuda_graph must be auto, on or off, got {self.cuda_graph!r}")


@dataclass(kw_only=True)
class EvalConfig:
    """Evaluation protocols (see docs/accuracy.md)."""

    negatives: str = "random"
    """Negative of each evaluation event for val AP (early stopping) and the headline
    test metrics: random (a uniform destination), historical (a past partner of the
    source not in the batch) or inductive (a partner first met after training); the
    test split is also scored under all three, as ``test_<protocol>neg_*``."""
    mrr_negatives: int = 0
    """If > 0, also report MRR of the true destination against this many sampled
    negatives per evaluation event (TGB's one-vs-many), with TGB's filtering of true
    edges of the same instant."""
    mrr_source: str = "auto"
    """Negatives of the MRR: auto (the store's fixed ones when it has any, from ``sven
    data negatives``, even with mrr_negatives=0; else mrr_negatives sampled ones; else
    no MRR), fixed (the store's; an error if it has none) or sampled (mrr_negatives
    sampled ones, which must be > 0, even where the store has fixed ones)."""
    all_protocols: bool = True
    """Score the test split under all three negative protocols (one pass, three
    negative columns); false: only ``eval.negatives``."""

    def __post_init__(self) -> None:
        _check_numbers(self, "eval")
        self.negatives = self.negatives.lower()
        if self.negatives not in ("random", "historical", "inductive"):
            raise ConfigError(
                f"eval.negatives must be random, historical or inductive, got {self.negatives!r}"
            )
        if self.mrr_negatives < 0:
            raise ConfigError(f"eval.mrr_negatives must be >= 0, got {self.mrr_negatives}")
        self.mrr_source = self.mrr_source.lower()
        if self.mrr_source not in ("auto", "fixed", "sampled"):
            raise ConfigError(
                f"eval.mrr_source must be auto, fixed or sampled, got {self.mrr_source!r}"
            )


@dataclass(kw_only=True)
class DistConfig:
    """Distributed execution (used when launched with more than one rank)."""

    partition: str = ""
    """Partition directory from ``sven partition``; empty: compute one at start."""
    strategy: str = "hash"
    """Strategy when computing the partition at start (hash, range, ldg, metis, minmax)."""
    balance: float = 1.05
    """Event balance factor when computing the partition at start."""
    batch_balance: bool = True
    """When computing the partition at start, also cap each global batch's events per
    rank at the balance factor (a synchronous step waits for its slowest rank), as
    ``sven partition --batch-balance`` (docs/partition.md)."""
    backend: str = "auto"
    """auto (NCCL on GPUs, gloo on CPUs), nccl or gloo."""
    timeout_s: float = 600.0
    """Collective timeout; a rank that does not answer within it is named in the error."""
    capacity_slack: float = 1.25
    """The exchange's buffers have fixed sizes per pair of ranks (so that the step,
    collectives included, can be captured as one CUDA graph): the largest rows any batch
    of the first epoch fetches and writes, from an exact replay of the step's batch
    construction at start, times this factor plus 8 rows for later epochs, whose
    negatives (and uniform neighbour draws) differ. A batch that needs more stops the
    run with a message naming the capacity; padding is never counted as traffic."""

    def __post_init__(self) -> None:
        _check_numbers(self, "dist")
        if not (math.isfinite(self.capacity_slack) and self.capacity_slack >= 1.0):
            raise ConfigError(f"dist.capacity_slack must be >= 1, got {self.capacity_slack}")
        if self.strategy not in ("hash", "range", "ldg", "metis", "minmax"):
            raise ConfigError(f"dist.strategy: unknown strategy {self.strategy!r}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"dist.backend must be auto, nccl or gloo, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"dist.timeout_s must be positive, got {self.timeout_s}")
        if self.balance < 1.0:
            raise ConfigError(f"dist.balance must be >= 1, got {self.balance}")


@dataclass(kw_only=True)
class PipelineConfig:
    """The step's pipeline (:mod:`sven.engine.step`): prefetch, micro-batches, asynchronous
    write-back. It acts on the fixed-shape step (CUDA, or several ranks); an exact-size
    CPU step of one process has nothing to overlap and ignores it."""

    prefetch: int = 1
    """D: the batch of step i + D (selection, negatives, neighbour sampling,
    de-duplication and the id exchange with the owners, on a process group of its own)
    is built during step i, on a side stream on CUDA, into a ring of D + 1 batches (one
    captured graph per ring position). None of it reads memory or parameters, so any D
    gives the same result; 0 builds each batch in its own step. Evaluation passes
    prefetch the same way (a ring per evaluation width)."""
    micro_batches: str = "1"
    """m: 1, 2, 4 (auto: 1). Each rank's share of a batch is split into m micro-batches
    that read the memory of one fetch (each node fetched once for the whole share) and
    sum their gradients; the whole batch's write-back is one push, so every m gives the
    result of m = 1. It bounds the activations of a large share; it does not overlap
    the fetch with compute (the fetch is one collective for the share)."""
    staleness: int = 0
    """0 or 1. The write-back (push) of batch i goes out right after its forward, on a
    side stream and a process group of its own, and overlaps the backward, the gradient
    all-reduce and the optimizer. 0: it is committed before step i ends (results equal
    the synchronous run). 1: it is committed after batch i + 1's read, which sees the
    rows of batch i one batch late; this changes the results. At drained boundaries
    (an epoch's end, a checkpoint, an evaluation) the held write-back is committed."""

    def __post_init__(self) -> None:
        _check_numbers(self, "pipeline")
        if self.prefetch < 0:
            raise ConfigError(f"pipeline.prefetch must be >= 0, got {self.prefetch}")
        if self.micro_batches not in ("1", "2", "4", "auto"):
            raise ConfigError(
                f"pipeline.micro_batches must be 1, 2, 4 or auto, got {self.micro_batches!r}"
            )
        if self.staleness not in (0, 1):
            raise ConfigError(f"pipeline.staleness must be 0 or 1, got {self.staleness}")


@dataclass(kw_only=True)
class LogConfig:
    """What a run writes besides ``metrics.jsonl`` and ``summary.json``."""

    tensorboard: bool = False
    """Also write each epoch's metrics as TensorBoard events under ``<out>/tb`` (rank 0;
    needs ``pip install 'sven[tensorboard]'``)."""
    profile_start: int = 10
    """With ``profile=true``: the first profiled training step of the first epoch run
    (0-based; moved earlier where the epoch is too short to hold the window)."""
    profile_steps: int = 10
    """With ``profile=true``: how many training steps the trace records."""

    def __post_init__(self) -> None:
        _check_numbers(self, "log")
        if self.profile_start < 0:
            raise ConfigError(f"log.profile_start must be >= 0, got {self.profile_start}")
        if self.profile_steps < 1:
            raise ConfigError(f"log.profile_steps must be >= 1, got {self.profile_steps}")


@dataclass(kw_only=True)
class NodeClassConfig:
    """Dynamic node classification (``task=node_classification``; docs/training.md):
    the temporal embedding of each event's source at the event's time, from a
    link-prediction model, feeds an MLP trained on the store's per-event labels (the
    protocol of the TGN and JODIE papers and DyGLib). ROC AUC per split."""

    encoder: str = ""
    """The link-prediction run (or a ``step-N`` checkpoint of one) whose model embeds
    the nodes. Empty: train one first in the same command, with this config's
    link-prediction settings, into ``<out>/encoder``."""
    finetune: bool = False
    """Train the encoder with the classifier's loss too (its memory updater and
    embedding); false: frozen (DyGLib's default), the embeddings computed once."""
    epochs: int = 50
    """Maximum epochs of the classifier."""
    patience: int = 5
    """Early stopping: epochs without a better val AUC before stopping (0: never)."""
    lr: float = 0.001
    """Adam learning rate of the classifier (and of the encoder when fine-tuned)."""
    batch_size: int = 0
    """Events per classifier step; 0: ``train.batch_size``."""
    hidden: int = 80
    """Width of the MLP's first hidden layer (TGN's decoder: 80, then 10)."""
    dropout: float = 0.1
    """Dropout in the MLP."""

    def __post_init__(self) -> None:
        for f in ("epochs", "hidden"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"nc.{f} must be positive, got {getattr(self, f)}")
        for f in ("patience", "batch_size"):
            if getattr(self, f) < 0:
                raise ConfigError(f"nc.{f} must be >= 0, got {getattr(self, f)}")
        if self.lr <= 0:
            raise ConfigError(f"nc.lr must be positive, got {self.lr}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"nc.dropout must be in [0, 1), got {self.dropout}")


TASKS = ("link_prediction", "node_classification")


@dataclass(kw_only=True)
class Config:
    """A whole run."""

    task: str = "link_prediction"
    """What ``sven train`` trains: link_prediction (future links; the default) or
    node_classification (per-event labels on top of a link-prediction model; the
    ``nc`` section)."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    log: LogConfig = field(default_factory=LogConfig)
    nc: NodeClassConfig = field(default_factory=NodeClassConfig)
    out: str = "runs/default"
    """Output directory (metrics, summary, checkpoints)."""
    quiet: bool = False
    """No progress bar."""
    profile: bool = False
    """Write a Chrome trace of a few training steps per rank (``torch.profiler``) to
    ``<out>/traces/rank<R>.json``: steps ``log.profile_start`` to ``log.profile_start +
    log.profile_steps - 1`` of the first epoch; open it in ``chrome://tracing`` or
    https://ui.perfetto.dev. Every run records its per-stage times anyway
    (``stage_<name>_s_per_rank`` in ``metrics.jsonl``)."""

    def __post_init__(self) -> None:
        self.task = self.task.lower()
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (JSON/YAML serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """Builds a config from a nested dict, rejecting unknown keys."""
        return _build(cls, d, "")


#: Keys whose value may differ between a checkpoint's config and the config that
#: resumes it: how long and how verbosely to go on, where and on how many threads to
#: run and with which kernels, and how to treat the folders; none of them changes what
#: the model computes (a device, a compiled model or TF32 products change its rounding,
#: not its function or its state's layout).
RESUME_MAY_CHANGE = frozenset(
    {
        "train.epochs",
        "train.patience",
        "train.resume",
        "train.overwrite",
        "train.checkpoint_every",
        "train.keep_latest_k",
        "train.checkpoint_async",
        "train.checkpoint_threads",
        "train.device",
        "train.threads",
        "train.compile",
        "train.matmul_precision",
        "nc.epochs",
        "nc.patience",
        "data.verify",
        "dist.timeout_s",
        "dist.backend",
        "pipeline.prefetch",
        "pipeline.micro_batches",
        "quiet",
        "profile",
        "log.profile_start",
        "log.profile_steps",
        "out",
    }
)


def config_differences(saved: dict[str, Any], current: Config) -> list[str]:
    """The dotted keys whose values differ between a checkpoint's config and ``current``.

    Keys in :data:`RESUME_MAY_CHANGE` are ignored. A key the checkpoint lacks (it was
    written before the key existed) takes its default; a key this version does not
    know counts as different.

    Args:
        saved: The ``config`` dict stored in a checkpoint.
        current: The config of the run that resumes it.

    Returns:
        Sorted ``key (saved -> current)`` strings; empty when the configs agree.
    """
    try:
        saved = Config.from_dict(saved).to_dict()
    except ConfigError:
        pass  # keys of another version: compared as they are
    a, b = _flatten(saved), _flatten(current.to_dict())
    for flat in (a, b):
        # The same store named relative or absolute is the same store.
        if flat.get("data.path"):
            flat["data.path"] = os.path.realpath(str(flat["data.path"]))
    out = []
    for key in sorted(set(a) | set(b)):
        if key in RESUME_MAY_CHANGE:
            continue
        if a.get(key, "<missing>") != b.get(key, "<missing>"):
            out.append(f"{key} ({a.get(key, '<missing>')!r} -> {b.get(key, '<missing>')!r})")
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _build(cls: type, d: dict[str, Any], prefix: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {d!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in names:
            raise ConfigError(_unknown_key(prefix + key, value, sorted(names)))
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, typ, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(value: Any, typ: Any, name: str) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string.
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if typ is str:
        return "" if value is None else str(value)
    return value


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    cur[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads a YAML preset (optional) and applies ``key=value`` overrides.

    Args:
        path: YAML file with sections data/model/train and top-level out/quiet.
        overrides: Dotted ``key=value`` strings; values parse as YAML scalars.

    Returns:
        The validated config.
    """
    d: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            d = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: invalid YAML: {exc}") from None
        if not isinstance(d, dict):
            kind = {list: "a list", str: "a string", int: "a number", float: "a number"}
            raise ConfigError(
                f"{p}: the top level must be a mapping of sections (data:, model:, "
                f"train:, ...), got {kind.get(type(d), type(d).__name__)}"
            )
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(d, key.strip(), value)
    return Config.from_dict(d)


def dump_config(cfg: Config, path: str | Path) -> None:
    """Writes the resolved config as JSON (exactly what the run used)."""
    Path(path).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


@dataclass(frozen=True)
class ConfigField:
    """One leaf of the config, for help texts and the reference.

    Attributes:
        key: Dotted key, e.g. ``"train.epochs"``.
        type: Type name (``"int"``, ``"float"``, ``"str"``, ``"bool"``).
        default: The default value.
        doc: The docstring below the field in this module (empty if it has none).
    """

    key: str
    type: str
    default: Any
    doc: str


@functools.cache
def _docstrings() -> dict[str, dict[str, str]]:
    """``{class name: {"": class docstring, field: field docstring}}`` of this module.

    Field docstrings are the string literals right below each annotated field; Python
    keeps none of them at run time, so they are read from the source once.
    """
    try:
        tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    except OSError:  # installed without sources: help texts lose their docstrings only
        return {}
    out: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = {"": inspect.cleandoc(ast.get_docstring(node) or "")}
        for stmt, after in zip(node.body, node.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
        out[node.name] = docs
    return out


def section_doc(name: str) -> str:
    """The docstring of a config section (``"train"``), or of :class:`Config` for ``""``."""
    cls = get_type_hints(Config)[name] if name else Config
    return _docstrings().get(cls.__name__, {}).get("", "")


def config_fields(cls: type = Config, prefix: str = "") -> list[ConfigField]:
    """Every leaf of the config in declaration order, with its default and docstring.

    Args:
        cls: The dataclass to walk (the whole :class:`Config` by default).
        prefix: Dotted prefix of ``cls``'s fields.

    Returns:
        One :class:`ConfigField` per leaf, sections expanded in place.
    """
    hints = get_type_hints(cls)
    docs = _docstrings().get(cls.__name__, {})
    out: list[ConfigField] = []
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            out.extend(config_fields(typ, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        name = getattr(typ, "__name__", str(typ))
        out.append(ConfigField(prefix + f.name, name, default, docs.get(f.name, "")))
    return out


def suggest_key(key: str) -> str | None:
    """The valid config key nearest to a misspelt one, or None if none is close.

    Args:
        key: A dotted key that is not in the config, e.g. ``"train.epoch"``.

    Returns:
        The same field name in another section (``"epochs"`` -> ``"train.epochs"``),
        else the closest dotted key by :func:`difflib.get_close_matches`.
    """
    keys = [f.key for f in config_fields()]
    leaf = key.rsplit(".", 1)[-1]
    same = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if len(same) == 1:
        return same[0]
    core = [k for k in same if k.split(".", 1)[0] in ("data", "model", "train")]
    if len(core) == 1:
        # A name both a core section and a task's section have (epochs, lr): the core
        # one is what a key without its section most likely meant.
        return core[0]
    section, _, name = key.rpartition(".")
    inside = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    if section and inside:
        # A known section: compare the field names alone, so that the shared prefix
        # does not make any key of the section look close.
        close = difflib.get_close_matches(name, inside, n=1, cutoff=0.6)
        return f"{section}.{close[0]}" if close else None
    # Sections are suggested only for a top-level name ("trian" -> "train").
    sections = sorted({k.rsplit(".", 1)[0] for k in keys if "." in k}) if not section else []
    close = difflib.get_close_matches(key, keys + sections, n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_key(key: str, value: Any, known: list[str]) -> str:
    # A misspelt section ("trian: {epochs: 3}") is best named by its first full key.
    tried = [f"{key}.{k}" for k in value] if isinstance(value, dict) else []
    for cand in [*tried, key]:
        hint = suggest_key(cand)
        if hint is not None:
            return f"unknown config key {cand!r}; did you mean {hint!r}?"
    return f"unknown config key {key!r}; known here: {known} (all keys: sven config --reference)"
