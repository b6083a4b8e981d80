"""Run configuration: nested keyword-only dataclasses, YAML presets, dotted overrides.

YAML files supply values only; every field is declared, typed and checked here, so no
untyped dict ever reaches model or trainer code. ``key=value`` overrides address fields
by dotted path (``train.batch_size=600``) and are parsed with YAML scalar rules.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from sven.errors import ConfigError


@dataclass(kw_only=True)
class DataConfig:
    """Where the events come from."""

    path: str = ""
    """Event store directory (``sven data convert`` output). Empty: the built-in
    synthetic dataset, generated once into the cache."""


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

    def __post_init__(self) -> None:
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
    resume: bool = False
    """Continue from the latest valid checkpoint under ``out``."""
    device: str = "cpu"
    """cpu, cuda, or cuda:N."""
    dtype: str = "float32"
    """float32 or float64 (exactness tests)."""
    threads: int = 0
    """torch intra-op threads on CPU (0: torch's default)."""
    deterministic: bool = True
    """Deterministic kernels (``torch.use_deterministic_algorithms``): multithreaded
    gradient accumulation is otherwise order-dependent, and reruns and resumed runs
    would drift apart in the last bits."""

    def __post_init__(self) -> None:
        for f in ("epochs", "batch_size", "num_neg", "keep_latest_k"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"train.{f} must be positive, got {getattr(self, f)}")
        for f in ("patience", "mrr_negatives", "max_batches", "checkpoint_every", "threads"):
            if getattr(self, f) < 0:
                raise ConfigError(f"train.{f} must be >= 0, got {getattr(self, f)}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr}")
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"train.dtype must be float32 or float64, got {self.dtype!r}")


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
    all_protocols: bool = True
    """Score the test split under all three negative protocols (one pass, three
    negative columns); false: only ``eval.negatives``."""

    def __post_init__(self) -> None:
        self.negatives = self.negatives.lower()
        if self.negatives not in ("random", "historical", "inductive"):
            raise ConfigError(
                f"eval.negatives must be random, historical or inductive, got {self.negatives!r}"
            )
        if self.mrr_negatives < 0:
            raise ConfigError(f"eval.mrr_negatives must be >= 0, got {self.mrr_negatives}")


@dataclass(kw_only=True)
class DistConfig:
    """Distributed execution (used when launched with more than one rank)."""

    partition: str = ""
    """Partition directory from ``sven partition``; empty: compute one at start."""
    strategy: str = "hash"
    """Strategy when computing the partition at start (hash, range, ldg, metis, minmax)."""
    balance: float = 1.05
    """Event balance factor when computing the partition at start."""
    backend: str = "auto"
    """auto (NCCL on GPUs, gloo on CPUs), nccl or gloo."""
    timeout_s: float = 600.0
    """Collective timeout; a rank that does not answer within it is named in the error."""

    def __post_init__(self) -> None:
        if self.strategy not in ("hash", "range", "ldg", "metis", "minmax"):
            raise ConfigError(f"dist.strategy: unknown strategy {self.strategy!r}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"dist.backend must be auto, nccl or gloo, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"dist.timeout_s must be positive, got {self.timeout_s}")
        if self.balance < 1.0:
            raise ConfigError(f"dist.balance must be >= 1, got {self.balance}")


@dataclass(kw_only=True)
class Config:
    """A whole run."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    out: str = "runs/default"
    """Output directory (metrics, summary, checkpoints)."""
    quiet: bool = False
    """No progress bar."""

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (JSON/YAML serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """Builds a config from a nested dict, rejecting unknown keys."""
        return _build(cls, d, "")


def _build(cls: type, d: dict[str, Any], prefix: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {d!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in names:
            raise ConfigError(f"unknown config key {prefix + key!r}; known: {sorted(names)}")
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
