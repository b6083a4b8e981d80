"""The sections of a run's config, one keyword-only dataclass each (``data``, ``model``,
``train``, ``eval``, ``dist``, ``pipeline``, ``log``, ``nc``).

Every field is declared, typed and documented here (the string below a field is its
documentation: ``sven train --help``, ``sven config --reference`` and ``docs/config.md``
are generated from it), and checked in its section's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, get_type_hints

from sven.errors import ConfigError
from sven.models.names import MODEL_NAMES, STATE_DEVICES

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
        if self.name not in MODEL_NAMES:
            raise ConfigError(f"model.name: unknown model {self.name!r} ({', '.join(MODEL_NAMES)})")
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
    """Threads that write (and hash) a checkpoint's node state, each a 64 MiB piece at a
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
    """On CUDA, compile the model for training with ``torch.compile(model,
    dynamic=False)`` (Inductor fuses its element-wise work, forward and backward) inside
    the captured step; evaluation runs the model uncompiled, in its own captured step.
    The first training step pays the compilation, once per machine: Inductor keeps it in
    a folder per torch version and GPU model under ``~/.cache/sven/compile`` (unless
    ``TORCHINDUCTOR_CACHE_DIR`` names another), which later and resumed runs load. A
    compiler error falls back to the uncompiled step with one warning. Ignored, with a
    notice, on CPU, where the exact-size eager step runs."""
    matmul_precision: str = "high"
    """float32 matrix products on CUDA, cuBLAS's and Sven's Triton kernels' alike:
    ``high`` (the default: TF32 tensor cores, products of 10-bit-mantissa operands
    summed in float32, the matrix units' float32 mode; several times the rate on an
    H100/H200, relative error near 1e-3 per product) or ``highest`` (IEEE float32
    FMAs). float64 runs and CPU runs are unaffected. docs/performance.md has the speed
    and test AP of both."""

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
    """m: 1, 2 or 4. Each rank's share of a batch is split into m micro-batches
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
        if self.micro_batches not in ("1", "2", "4"):
            raise ConfigError(
                f"pipeline.micro_batches must be 1, 2 or 4, got {self.micro_batches!r}"
            )
        if self.staleness not in (0, 1):
            raise ConfigError(f"pipeline.staleness must be 0 or 1, got {self.staleness}")


@dataclass(kw_only=True)
class StateConfig:
    """Where node state lives (memory, mailbox, last-update times: everything sized by
    the number of nodes) and the budgets the run's plan checks before any work
    (docs/scale.md). The math is the same in every tier."""

    device: str = "auto"
    """auto, gpu, host or disk: where node state lives. gpu: GPU memory (on a run
    without a GPU an alias of host, shown as host). host: host memory; on CUDA pinned,
    read and written by the step's kernels over the host link (the step stays
    captured). disk: memory-mapped files under ``state.path``, for state larger than
    host memory (on CUDA rows are staged through host copies and the
    step runs uncaptured). auto: gpu when the run fits ``state.gpu_budget_gb``, else
    host when it fits ``state.host_budget_gb``, else disk."""
    gpu_budget_gb: float = 0.0
    """GPU memory the run may use, in GB (10^9 bytes); 0: the device's free memory at
    start less 5%. The plan counts the event tables, the sampler, node state in the
    gpu tier, per-node indexes, the model, the step and evaluation tables."""
    host_budget_gb: float = 0.0
    """Host memory the run may use, in GB; 0: the memory available at start less 10%.
    The plan counts node state in the host tier, the event tables on a CPU run and
    the transient copies of loading."""
    hot_rows: int = -1
    """With node state in host memory on CUDA: how many nodes' rows are also kept in
    GPU memory, the most active first (by their events in the whole stream), read
    there by the step and written to both (docs/scale.md, "Hot rows"). -1: every node
    with an event, as far as half of the GPU memory the plan leaves allows; 0: none;
    n: at most n."""
    path: str = ""
    """Folder of the disk tier's files; empty: ``<out>/state``. Sven's alone: a new or
    empty folder, or one Sven made (a folder holding other files is refused), locked
    while a run maps its files. They are scratch (the checkpoints hold the state), left
    for the next run to reuse; commands that write nothing (``sven eval``, predictions)
    use a temporary folder instead."""

    def __post_init__(self) -> None:
        _check_numbers(self, "state")
        self.device = self.device.lower()
        if self.device not in STATE_DEVICES:
            raise ConfigError(
                f"state.device must be one of {', '.join(STATE_DEVICES)}, got {self.device!r}"
            )
        for name in ("gpu_budget_gb", "host_budget_gb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"state.{name} must be >= 0, got {getattr(self, name)}")
        if self.hot_rows < -1:
            raise ConfigError(f"state.hot_rows must be -1 (auto), 0 or more, got {self.hot_rows}")


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
