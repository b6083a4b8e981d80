"""Training and evaluation, on one process or on P ranks with vertex-owned memory.

One epoch walks the training events in time order in global batches of B; each batch
draws deterministic negatives, samples temporal neighbours, reads the memory of its
unique nodes, runs the model, steps the optimizer and commits the model's memory update.
Validation continues the memory from the end of training and test from the end of
validation ("Training semantics" in docs/design.md).

With P ranks (launched by torchrun, srun or mpirun; see :mod:`sven.dist`), rank r
processes the events of each global batch that the partition assigns to it, reads and
writes memory through :class:`~sven.pipeline.exchange.FixedExchange`, and normalises
its loss by the global number of predictions, so that the all-reduced gradient is the
one-process gradient ("Distributed semantics"). Every world size runs the one step of
:mod:`sven.engine.step`; one process without a launcher runs it with the whole memory as the
only shard and no collective.

The Trainer is an orchestrator: the epoch loop, early stopping, stop signals and the
checkpoints at drained boundaries are its own; the state belongs to the components of
:mod:`sven.engine.components` (data, model, memory shard, exchange, optimizer, evaluator) and
the checkpointer (:class:`~sven.engine.checkpoint.RunCheckpoints`), and a checkpoint is their
state_dicts (:meth:`Trainer.state_dict`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from sven.config import Config, dump_config, load_config
from sven.datasets.identity import fingerprint as _fingerprint
from sven.engine.checkpoint import (
    Checkpointer,
    RunCheckpoints,
    check_resume_config,
    find_checkpoint,
    load_file,
)
from sven.engine.components import (
    Data,
    EvalResult,
    Evaluator,
    Optimizer,
    owned_nodes,
    predict_comm,
)
from sven.engine.expect import epoch_estimate, start_hint
from sven.engine.startup import StartupClock, set_deterministic, triton_cache_dir
from sven.engine.step import Step
from sven.engine.tblog import EpochLog
from sven.engine.timeline import STAGES, StepProfiler, Timeline, timeline_line
from sven.errors import ConfigError, Diverged, Stopped, SvenError
from sven.models import MemoryModel, MemoryState, model_from_config
from sven.pipeline.exchange import FixedExchange, LocalExchange

# Signals that stop training after the current step with a checkpoint: scancel and
# preemption send SIGTERM; SLURM's --signal=USR1@N warns N seconds before the time limit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class Trainer:
    """Trains and evaluates one model on one event store, on one or many ranks.

    Args:
        config: A :class:`~sven.config.Config`, a nested dict, or a path to a YAML preset.
        overrides: Dotted ``key=value`` overrides applied on top.
        startup: The start-up clock (the CLI's counts from process start).
        purpose: ``train``, or ``eval`` for a trainer that only evaluates a saved
            model (``sven eval``): its first line says so.

    Example:
        >>> summary = sven.Trainer("configs/tgn.yaml", ["data.path=stores/uci"]).fit()
    """

    # A stop signal this process received (set by the handler fit() installs), and
    # the all-ranks vote on it from the last step's gradient all-reduce (a tensor, read
    # only after the loss's own host sync).
    _stop_signal: int | None = None
    _stop_votes: torch.Tensor | None = None
    # Where training is, for failure messages.
    _where: str = "start"

    def __init__(
        self,
        config: Config | dict | str | Path | None = None,
        overrides: list[str] | None = None,
        *,
        startup: StartupClock | None = None,
        purpose: str = "train",
    ):
        try:
            self._build(config, overrides, startup, purpose)
        except BaseException:
            # A process group made before the failure goes with it, as fit's would: the
            # rank hosting the rendezvous waits for the others to learn the verdict, and
            # no C++ thread outlives the interpreter.
            ctx = self.__dict__.get("ctx")
            if ctx is not None:
                ctx.teardown()
            raise

    def _build(
        self,
        config: Config | dict | str | Path | None,
        overrides: list[str] | None,
        startup: StartupClock | None,
        purpose: str,
    ) -> None:
        if isinstance(config, Config):
            cfg = (
                config if not overrides else load_config(None, _config_overrides(config, overrides))
            )
        elif isinstance(config, dict):
            cfg = Config.from_dict(config)
            if overrides:
                cfg = load_config(None, _config_overrides(cfg, overrides))
        else:
            cfg = load_config(config, overrides)
        self.cfg = cfg
        self._purpose = purpose
        # Start-up phases to the first training step (sven.engine.startup); the CLI's clock
        # counts from process start.
        self.startup = clock = startup or StartupClock()
        tc, mc = cfg.train, cfg.model
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if tc.deterministic:
            # cuBLAS reads this once, at its first use in the process.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            # Without importing torch's compiler (sven.engine.startup).
            set_deterministic(True, warn_only=True)
        from sven.dist import detect_launcher, init_distributed

        # Under a launcher even one rank gets a process group: the P-rank step with
        # its collectives, as on many ranks (a plain process runs without one).
        launched = detect_launcher(os.environ).launcher != "single"
        t_init = time.perf_counter()
        self.ctx = init_distributed(
            cfg.dist.backend, timeout_s=cfg.dist.timeout_s, device=tc.device,
            force_group=launched,
        )  # fmt: skip
        self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
        self.device = torch.device(self.ctx.device)
        if self.device.type == "cuda":
            # Process-wide in torch: set on every CUDA run, so that one trainer's choice
            # does not carry into the next one of the same process.
            torch.backends.cuda.matmul.allow_tf32 = tc.matmul_precision == "high"
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.device is cuda but no CUDA device is available")
        if self.device.type == "cuda":
            # CUDA's own start (the context on the device), apart from Sven's phases.
            torch.empty(1, device=self.device)
            torch.cuda.synchronize(self.device)
        clock.add(
            "cuda_init" if self.device.type == "cuda" else "init", time.perf_counter() - t_init
        )
        self.dtype = torch.float64 if tc.dtype == "float64" else torch.float32
        self.out = Path(cfg.out)
        self.epoch_log = EpochLog(self.out / "tb", cfg.log.tensorboard, main=self.rank == 0)
        # The components (sven.engine.components): each owns its part of the run's state.
        self.data = Data(
            cfg,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            dtype=self.dtype,
            agree=self._agree,
            clock=clock,
        )
        t_model = time.perf_counter()
        torch.manual_seed(tc.seed)
        d = self.data
        lo, hi = d.ranges["train"]
        self.model: MemoryModel = model_from_config(
            mc,
            edge_dim=d.edge_dim,
            node_dim=d.node_dim,
            train_events=(d.events.src[lo:hi], d.events.dst[lo:hi], d.events.t[lo:hi]),
        ).to(self.device, self.dtype)
        self.memory = MemoryState(
            int(d.owned.numel()),
            mc.memory_dim,
            self.model.mail_dim,
            self.model.mailbox_size,
            self.device,
            self.dtype,
            time_origin=float(d.t[0]) if d.t.numel() else 0.0,
        )
        clock.add("model", time.perf_counter() - t_model)
        t_tables = time.perf_counter()
        self.distributed = self.ctx.backend != "none"
        self.exchange: LocalExchange | FixedExchange
        grads = plan_group = None
        if self.distributed:
            from datetime import timedelta

            from sven.distributed.grads import GradBucket

            # Made here, in the same order on every rank: the write-back runs on a side
            # stream beside the gradient all-reduce, and prefetched id plans beside the
            # step, each on a communicator of its own (two streams must never drive one).
            timeout = timedelta(seconds=cfg.dist.timeout_s)
            ranks = list(range(self.world_size))
            push_group = dist.new_group(ranks, timeout=timeout)
            plan_group = dist.new_group(ranks, timeout=timeout)
            self.exchange = FixedExchange(
                d.owner,
                self.rank,
                self.world_size,
                self.memory,
                node_feat=d.owned_node_feat(),
                push_group=push_group,
                staleness=cfg.pipeline.staleness,
            )
        else:
            self.exchange = LocalExchange(self.memory)
        d.attach(self.model)
        t_opt = time.perf_counter()
        # lean: without torch.optim's compiler wrappers (and their imports; sven.engine.startup),
        # unless the run compiles anyway.
        compiles = tc.compile and self.device.type == "cuda"
        self.optimizer = Optimizer(self.model.parameters(), tc.lr, self.device, lean=not compiles)
        dt_opt = time.perf_counter() - t_opt
        clock.add("optimizer", dt_opt)
        if self.distributed:
            grads = GradBucket(self.model.parameters(), None, self.world_size)
        self.grads = grads
        self.evaluator = Evaluator(cfg, d, self.model)
        self._hooks: dict[str, list[Callable[[Trainer], None]]] = {
            "before_step": [],
            "after_step": [],
        }
        # Per-stage times of each epoch (sven.engine.timeline), and a trace of a few steps
        # where profile=true.
        self.timeline = Timeline(self.device)
        self.profiler: StepProfiler | None = None
        if cfg.profile:
            trace = self.out / "traces" / f"rank{self.rank}.json"
            lc = cfg.log
            self.profiler = StepProfiler(trace, self.device, lc.profile_start, lc.profile_steps)
        self.step = Step(
            cfg=cfg,
            data=d,
            model=self.model,
            optimizer=self.optimizer,
            memory=self.memory,
            exchange=self.exchange,
            grads=grads,
            plan_group=plan_group,
            timeline=self.timeline,
            log=lambda msg: self._log(msg, force=True),
            progress=self.progress_bar,
        )
        self.evaluator.fast = self.step.evaluate
        self.checkpoints = RunCheckpoints(
            self.out,
            tc.keep_latest_k,
            config=cfg,
            rank=self.rank,
            world_size=self.world_size,
            barrier=self._barrier,
            agree=self._agree,
        )
        self._log(self._describe_run())
        if self.distributed:
            self._log(self.ctx.describe())
        self.predicted_comm = (
            predict_comm(cfg, d, self.model, self.exchange) if self.distributed else None
        )
        clock.add("tables", time.perf_counter() - t_tables - dt_opt)

    def add_hook(self, when: str, fn: Callable[[Trainer], None]) -> None:
        """Calls ``fn(trainer)`` before or after every training step, on every rank.

        For observing a run (tests record parameters and memory after each step, or
        interrupt one) without subclassing. An ``after_step`` hook that reads device
        tensors waits for the step to finish, which costs speed on CUDA.

        Args:
            when: "before_step" or "after_step".
            fn: The hook; exceptions propagate out of ``fit``.
        """
        if when not in self._hooks:
            raise ValueError(f"when must be one of {sorted(self._hooks)}, got {when!r}")
        self._hooks[when].append(fn)

    def _describe_run(self) -> str:
        """The first line a run prints: what is trained, on what, where it goes."""
        d, ev = self.data, self.data.events
        counts = f"{ev.num_events:,} events, {ev.num_nodes:,} nodes"
        if self.cfg.data.path:
            data = f"{d.dataset_name} ({ev.path}: {counts})"
        else:
            data = f"the built-in synthetic dataset ({counts}; cached at {ev.path})"
        procs = "one process" if self.world_size == 1 else f"{self.world_size} ranks"
        if self._purpose == "eval":
            return (
                f"evaluating a saved {self.cfg.model.name} on {data}, on {self.device.type} "
                f"({procs}); nothing is written"
            )
        return (
            f"training {self.cfg.model.name} on {data}, on {self.device.type} ({procs}); "
            f"run folder {self.out}"
        )

    # ------------------------------------------------------------------ out
    _out_lock: Any = None

    def _claim_out(self) -> None:
        """Rank 0 locks ``out`` for this run (:func:`sven.ownership.lock_folder`) and
        checks it (see :func:`prepare_out`); every rank learns its verdict before
        anything is written, and all stop together on a refusal. The lock is held
        until fit returns (:meth:`_release_out`)."""
        from sven.ownership import FolderBusy, lock_folder

        tc = self.cfg.train
        problem = None
        if self.rank == 0:
            try:
                self._out_lock = lock_folder(self.out, "sven train")
                prepare_out(self.out, resume=tc.resume, overwrite=tc.overwrite, log=self._log)
            except (ConfigError, FolderBusy) as exc:
                self._release_out()
                problem = (isinstance(exc, FolderBusy), str(exc))
        problem = self._agree(problem)
        if problem is not None:
            err = (FolderBusy if problem[0] else ConfigError)(problem[1])
            err.quiet = self.rank != 0
            raise err

    def _release_out(self) -> None:
        if self._out_lock is not None:
            self._out_lock.release()
            self._out_lock = None

    def _agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a no-op on one process)."""
        if self.world_size == 1:
            return value
        from sven.dist import broadcast_object

        return broadcast_object(value)

    # The data component's batch builders, under the names benchmarks use.
    _event_index = property(lambda self: self.data.event_index, doc="Data.event_index")
    _batch = property(lambda self: self.data.batch, doc="Data.batch")

    def num_batches(self, split: str) -> int:
        """Number of global batches of a split at the configured batch size."""
        return self.data.num_batches(split)

    def evaluate(self, split: str) -> EvalResult:
        """Walks a split without gradients, updating memory; returns all scores
        (:meth:`Evaluator.evaluate`)."""
        return self.evaluator.evaluate(split)

    def split_metrics(self, split: str, res: EvalResult) -> dict[str, float]:
        """AP/AUC (mean of per-batch values, and pooled), inductive, MRR of a split
        (:meth:`Evaluator.split_metrics`)."""
        return self.evaluator.split_metrics(split, res)

    @property
    def mrr_negatives(self) -> int:
        """MRR negatives per event (:attr:`Data.mrr_negatives`; 0: no MRR)."""
        return self.data.mrr_negatives

    # The data component's facts that the step, the tests and the benchmarks read.
    ranges = property(lambda self: self.data.ranges, doc="Split -> [lo, hi) event range.")
    owner = property(lambda self: self.data.owner, doc="(N,) owning rank of each vertex.")
    owned = property(lambda self: self.data.owned, doc="(N_r,) vertices this rank owns.")
    num_nodes = property(lambda self: self.data.num_nodes, doc="Number of vertices N.")
    candidates = property(lambda self: self.data.candidates, doc="(C,) negatives' pool.")
    tables = property(lambda self: self.data.tables, doc="The step's event tables.")
    node_feat = property(
        lambda self: self.data.node_feat, doc="(N, d) node features of one process, or None."
    )

    # ----------------------------------------------------------- checkpoints
    def _barrier(self, what: str) -> None:
        if self.world_size > 1:
            from sven.dist import barrier_or_die

            barrier_or_die(self.ctx, what)

    def _rng_state(self) -> dict[str, Any]:
        # Negatives, uniform sampling and dropout are keyed by event and batch (see
        # pipeline/negatives.py) and need no state; torch's is kept for user code.
        return {"torch": torch.get_rng_state()}

    def _set_rng_state(self, s: dict[str, Any]) -> None:
        # Shards load onto the run's device, but torch's RNG state must be a CPU tensor
        # (on a GPU run, resume otherwise fails: "RNG state must be a torch.ByteTensor").
        torch.set_rng_state(s["torch"].cpu())

    def state_dict(
        self, epoch: int, next_batch: int, progress: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A resumable checkpoint, assembled from the components' state_dicts.

        Taken at a drained boundary (no step queued, no write-back in flight).

        Args:
            epoch: The epoch to resume in.
            next_batch: Its first batch not yet trained.
            progress: The epoch loop's counters, history and early-stopping state.

        Returns:
            Rank 0's state (data identity, model, optimizer, evaluator, cursor,
            progress) and this rank's shard (memory, exchange counters, RNG).
        """
        state = {
            "data": self.data.state_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "evaluator": self.evaluator.state_dict(),
            "cursor": {"epoch": epoch, "next_batch": next_batch},
            "progress": progress,
        }
        shard = {
            "memory": self.memory.state_dict(),
            "exchange": self.exchange.state_dict() if self.distributed else {},
            "rng": self._rng_state(),
        }
        return state, shard

    def load_state_dict(
        self, state: dict[str, Any], shard: dict[str, Any], where: str = "checkpoint"
    ) -> None:
        """Loads a checkpoint into the components (the inverse of :meth:`state_dict`).

        A part the checkpoint lacks is left as it is: the best model's checkpoint holds
        only the data identity, the model and the memory.

        Raises:
            ConfigError: The checkpoint's ranks or partition are not this run's.
        """
        self.data.load_state_dict(_data_state(state), where)
        self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.evaluator.load_state_dict(state.get("evaluator", {}))
        self.memory.load_state_dict(shard["memory"])
        counters = shard.get("exchange", shard.get("comm"))
        if self.distributed and counters:
            self.exchange.load_state_dict(counters)
        if "rng" in shard:
            self._set_rng_state(shard["rng"])

    def _load(self, ck: Checkpointer, step: int) -> dict[str, Any]:
        """Loads checkpoint ``step`` of ``ck`` into the components; returns rank 0's state."""
        state, shard = self.checkpoints.load(ck, step, self.device)
        self.load_state_dict(state, shard, f"checkpoint {ck.path(step)}")
        return state

    # ------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        """Trains with early stopping on val AP, then evaluates the best model on test.

        SIGTERM and SIGUSR1 (:data:`STOP_SIGNALS`) stop training after the step that
        follows them, on every rank at the same step, with a checkpoint; the previous
        handlers are back when fit returns.

        Returns:
            The summary (also written to ``<out>/summary.json`` by rank 0).

        Raises:
            Stopped: A stop signal arrived; the checkpoint is written (exit code 75).
            DistError: A rank died or hung; the message names it (exit code 4).
        """
        restore = self._catch_stop_signals()
        try:
            return self._fit()
        except RuntimeError as exc:
            if self.world_size == 1 or not _is_comm_failure(exc):
                raise
            from sven.dist import DistError

            # A peer died or hung inside a collective; gloo/NCCL then raise a bare
            # RuntimeError that does not say which. The heartbeats do (sven.dist).
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            diag = self.ctx.diagnose_failure()
            peers = list(diag.ranks)
            timeout = self.cfg.dist.timeout_s
            if peers:
                who = diag.reason
            elif self.world_size == 2:
                peers = [1 - self.rank]
                who = f"rank {peers[0]} died or did not answer within {timeout:.0f} s, see its log"
            else:
                who = f"another rank died or did not answer within {timeout:.0f} s, see the logs"
            raise DistError(
                f"rank {self.rank}: a collective failed at {self._where} ({first}); {who}. "
                "The last complete checkpoint is intact: rerun with train.resume=true",
                ranks=peers,
                what=self._where,
            ) from exc
        finally:
            if getattr(self, "_bar", None) is not None:
                # A bar left open by an error would run into the error's one line.
                self._bar.close()
            try:
                self.ctx.teardown()
            finally:
                # After the teardown: a SIGTERM that srun sends once another rank has
                # exited must not kill this one halfway through.
                restore()
                self._release_out()

    def _catch_stop_signals(self) -> Callable[[], None]:
        """Makes SIGTERM/SIGUSR1 set a flag; returns what puts the old handlers back.

        Only the main thread may install handlers; elsewhere (a Trainer run in a
        thread) signals keep their handlers and training cannot be stopped by them.
        """
        self._stop_signal = None
        self._stop_votes = None
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: object) -> None:
            # Only a flag: the step boundary where all ranks agree is the train loop's.
            if self._stop_signal is None:
                self._stop_signal = signum

        old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}

        def restore() -> None:
            for s, handler in old.items():
                # None: installed from C; the default is the closest we can put back.
                signal.signal(s, signal.SIG_DFL if handler is None else handler)

        return restore

    def _stop_requested(self) -> int:
        """The stop signal all ranks agreed on after a finished step, or 0.

        On several ranks the votes travel in the step's gradient all-reduce; on CUDA
        they are read one step late (:meth:`Step.status`), so that the host never
        waits for the step in flight: every rank still stops after the same step. The
        same read stops the run if a batch overflowed an exchange capacity.
        """
        if not self.distributed:
            return self._stop_signal or 0
        votes, fetch_over, push_over = self.step.status()
        if fetch_over > 0 or push_over > 0:
            self.exchange.check()
        got = _stop_from_votes(votes, self.world_size)
        # Rank 0 speaks for all: name its own signal where it had one.
        return (self._stop_signal or got) if got else 0

    def _stop(
        self,
        signum: int,
        epoch: int,
        next_batch: int,
        last: int,
        progress: dict[str, Any],
        saved: bool,
    ) -> Stopped:
        """Writes the stop checkpoint (unless this step's periodic one is it).

        Returns:
            The :class:`Stopped` to raise, which says where and what was written.
        """
        step = progress["global_step"]
        ck = self.checkpoints
        if not saved:
            ck.save(ck.latest, step, *self.state_dict(epoch, next_batch, progress))
        name = signal.Signals(signum).name
        path = ck.latest.path(step)
        return Stopped(
            f"stopped by {name} at epoch {epoch} step {step} (batch {next_batch} of {last}); "
            f"checkpoint {path}; rerun with train.resume=true",
            signal_name=name,
            checkpoint=path,
            quiet=self.rank != 0,
        )

    def _fit(self) -> dict[str, Any]:
        cfg, tc = self.cfg, self.cfg.train
        wall0 = time.perf_counter()
        main = self.rank == 0
        self._claim_out()
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
        self._barrier("start")
        progress: dict[str, Any] = {
            "history": [],
            "best_val_ap": -1.0,
            "best_val_auc": -1.0,
            "best_epoch": -1,
            "bad_epochs": 0,
            "epoch_loss": 0.0,
            "epoch_batches": 0,
            "epoch_time": 0.0,
            "train_time": 0.0,
            "train_events": 0,
            "global_step": 0,
            "stopped": False,
        }
        start_epoch, start_batch = 0, 0
        if tc.resume:
            ck = self.checkpoints
            step = ck.newest(ck.latest)
            if step is None:
                self._log(f"no checkpoint under {self.out}, starting fresh")
            else:
                st = self._load(ck.latest, step)
                progress = st["progress"]
                start_epoch, start_batch = st["cursor"]["epoch"], st["cursor"]["next_batch"]
                self._log(
                    f"resumed from {ck.latest.path(step)} "
                    f"(epoch {start_epoch}, batch {start_batch})"
                )
        if main:
            # After the resume's checks (config, store, partition): a refused resume
            # leaves the run's config.json saying what its checkpoints hold.
            dump_config(cfg, self.out / "config.json")
            # metrics.jsonl is rebuilt from the checkpointed history, so lines written
            # after the checkpoint by an interrupted run do not appear twice.
            _atomic_write_text(
                "".join(json.dumps(h) + "\n" for h in progress["history"]),
                self.out / "metrics.jsonl",
            )

        nb = self.num_batches("train")
        lo, hi = self.ranges["train"]
        b = tc.batch_size
        # The epoch whose best model is the live state (model and memory as saved).
        best_live: int | None = None
        self._times = {"eval_s": 0.0, "eval_events": 0, "checkpoint_s": 0.0}
        per_epoch = min(hi, lo + (min(nb, tc.max_batches) if tc.max_batches else nb) * b) - lo
        hint = start_hint(self.device.type, tc.epochs - start_epoch, per_epoch)
        if hint is not None and not progress["stopped"]:
            self._log(hint)
        estimated = False
        for epoch in range(start_epoch, tc.epochs):
            if progress["stopped"]:
                break
            # An epoch resumed halfway is no measure of a whole one.
            whole = start_batch == 0
            best_live = None
            if start_batch == 0:
                self.memory.reset()
                self.exchange.drop_held()
                progress.update(epoch_loss=0.0, epoch_batches=0, epoch_time=0.0)
                self.exchange.counter.reset()
            if epoch == start_epoch:
                # The exchange's fixed sizes, from an exact replay of this epoch's batches.
                self.step.plan_capacities(epoch)
            last = nb if not tc.max_batches else min(nb, tc.max_batches)
            bar = self._bar = self.progress_bar(
                f"epoch {epoch}", min(hi, lo + last * b) - lo, min(hi, lo + start_batch * b) - lo
            )
            tl, prof = self.timeline, self.profiler
            if prof is not None:
                prof.fit(start_batch, last)
            self.step.start_epoch(epoch, start_batch, last)
            ep_t0, paused = time.perf_counter(), 0.0
            tl.begin()
            for i in range(start_batch, last):
                self._where = f"epoch {epoch} batch {i}"
                self.ctx.set_step(progress["global_step"])
                g_lo, g_hi = lo + i * b, min(lo + (i + 1) * b, hi)
                for fn in self._hooks["before_step"]:
                    fn(self)
                tl.lap("wait")
                if prof is not None:
                    prof.before(i)
                t_first = None if self.startup.done else time.perf_counter()
                # Nothing is read back: the loss accumulates on the device.
                self.step.train_batch(
                    epoch, i, g_lo, g_hi, _stop_vote(self._stop_signal, self.world_size)
                )
                if t_first is not None:
                    self._first_step_done(t_first, bar)
                if prof is not None:
                    prof.after(i)
                for fn in self._hooks["after_step"]:
                    fn(self)
                progress["epoch_batches"] += 1
                progress["train_events"] += g_hi - g_lo
                progress["global_step"] += 1
                bar.update(g_hi - g_lo)
                saved = False
                stop = self._stop_requested()
                at_ckpt = (
                    tc.checkpoint_every and (i + 1) % tc.checkpoint_every == 0 and i + 1 < last
                )
                if at_ckpt or stop:
                    tl.pause()  # the checkpoint is no stage of the epoch's training
                    t_save = time.perf_counter()
                    self._flush_step(progress)
                    # The epoch's training time so far goes into the checkpoint (the
                    # epoch's end adds it to progress), so that a resumed run's events/s
                    # divides all its events by all their time.
                    so_far = t_save - ep_t0 - paused
                    snap = {
                        **progress,
                        "epoch_time": progress["epoch_time"] + so_far,
                        "train_time": progress["train_time"] + so_far,
                    }
                    if at_ckpt:
                        self.checkpoints.save(
                            self.checkpoints.latest,
                            progress["global_step"],
                            *self.state_dict(epoch, i + 1, snap),
                        )
                        saved = True
                    paused += time.perf_counter() - t_save
                    tl.begin()
                if stop:
                    bar.close()
                    raise self._stop(stop, epoch, i + 1, last, snap, saved)
            self._flush_step(progress)
            tl.lap("wait")
            # Wall time of the epoch's training, device work included (the steps run
            # asynchronously; _flush_step waited for them), checkpoints excluded.
            dt = time.perf_counter() - ep_t0 - paused
            if prof is not None:
                prof.close()
            progress["epoch_time"] += dt
            progress["train_time"] += dt
            bar.close()
            start_batch = 0
            epoch_events = min(hi, lo + last * b) - lo
            comm = self.exchange.epoch_bytes() if self.distributed else {}
            stages = self._timeline_line(dt)
            self._where = f"epoch {epoch} validation"
            val, val_rate = self._eval_split("val")
            line = {
                "epoch": epoch,
                "train_loss": progress["epoch_loss"] / max(progress["epoch_batches"], 1),
                "val_ap": val["val_ap"],
                "val_auc": val["val_auc"],
                "events_per_s": epoch_events / max(progress["epoch_time"], 1e-9),
                "val_events_per_s": val_rate,
                **{k: v for k, v in val.items() if k not in ("val_ap", "val_auc")},
                **comm,
                **stages,
            }
            line = _finite_or_none(line)
            progress["history"].append(line)
            if main:
                with open(self.out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
                self.epoch_log.write(line)
            self._log(
                f"epoch {epoch}: loss {line['train_loss']:.4f} val AP {_fmt(line['val_ap'])} "
                f"AUC {_fmt(line['val_auc'])} ({line['events_per_s']:.0f} train events/s, "
                f"{val_rate:.0f} eval events/s)"
            )
            if whole and not estimated:
                estimated = True
                left = tc.epochs - epoch - 1
                note = epoch_estimate(epoch, time.perf_counter() - ep_t0, left, tc.patience)
                if note is not None:
                    self._log(note)
            ck = self.checkpoints
            if improved(tc.select, val, progress):
                progress.update(
                    best_val_ap=val["val_ap"],
                    best_val_auc=val["val_auc"],
                    best_epoch=epoch,
                    bad_epochs=0,
                )
                # The best model with the memory at the end of validation, which test
                # continues (no optimizer: it is not resumed from).
                best_state = {
                    "data": self.data.state_dict(),
                    "model": self.model.state_dict(),
                    "epoch": epoch,
                    "memory_phase": "val_end",
                }
                t_ck = time.perf_counter()
                ck.save(ck.best, epoch, best_state, {"memory": self.memory.state_dict()})
                self._times["checkpoint_s"] += time.perf_counter() - t_ck
                # Test continues from this state, unless another epoch trains after it.
                best_live = epoch
            else:
                progress["bad_epochs"] += 1
                if tc.patience and progress["bad_epochs"] >= tc.patience:
                    progress["stopped"] = True
            progress["global_step"] += 1
            t_ck = time.perf_counter()
            ck.save(ck.latest, progress["global_step"], *self.state_dict(epoch + 1, 0, progress))
            self._times["checkpoint_s"] += time.perf_counter() - t_ck

        self.startup.finish()
        ck = self.checkpoints
        if best_live is not None and best_live == progress["best_epoch"]:
            # The best model and its memory at the end of validation are the live state
            # (saved unchanged just now): test continues from them without a reload.
            best = {"epoch": best_live}
        else:
            t_ck = time.perf_counter()
            step = ck.newest(ck.best)
            if step is None:
                raise SvenError(f"no valid best model under {ck.best.root}")
            best = self._load(ck.best, step)
            self._times["checkpoint_s"] += time.perf_counter() - t_ck
        self._where = "test"
        test, test_rate = self._eval_split("test")
        hist = {h["epoch"]: h for h in progress["history"]}
        best_line = hist.get(best["epoch"], {})
        summary = {
            "model": cfg.model.name,
            "dataset": self.data.dataset_name,
            "store_fingerprint": _fingerprint(self.data.events.meta),
            "world_size": self.world_size,
            "partition": self.data.partition_meta.get("strategy"),
            "epochs_run": len(progress["history"]),
            "best_epoch": best["epoch"],
            "val_ap": best_line.get("val_ap"),
            "val_auc": best_line.get("val_auc"),
            "eval_negatives": cfg.eval.negatives,
            "eval_mrr_negatives": self.mrr_negatives,
            "eval_mrr_source": self.data.mrr_source,
            **test,
            "train_events_per_s": progress["train_events"] / max(progress["train_time"], 1e-9),
            "eval_events_per_s": self._times["eval_events"] / max(self._times["eval_s"], 1e-9),
            "test_events_per_s": test_rate,
            "eval_s": self._times["eval_s"],
            "checkpoint_s": self._times["checkpoint_s"],
            **self.startup.summary(),
            "wall_s": time.perf_counter() - wall0,
        }
        st = self.step
        summary.update(
            pipeline_prefetch=st.depth,
            pipeline_micro_batches=st.micro_batches,
            pipeline_staleness=st.staleness,
            step_captured=any(g.captured for g in st.train_graphs),
        )
        # What the first train and eval steps cost on CUDA beyond a replay (0 on CPU).
        evals = [g for _, _, graphs in st._evals.values() for g in graphs]
        for name, graphs in (("train", st.train_graphs), ("eval", evals)):
            summary[f"{name}_graph_warmup_s"] = sum(g.warmup_s for g in graphs)
            summary[f"{name}_graph_capture_s"] = sum(g.capture_s for g in graphs)
        if self.device.type == "cuda":
            summary["triton_cache_dir"] = triton_cache_dir()
        if self.distributed:
            caps = self.exchange.capacities.get("train")
            if caps is not None:
                summary["exchange_capacities"] = {
                    "events": caps.events,
                    "fetch": caps.fetch,
                    "push": caps.push,
                }
        for key in (
            "comm_bytes",
            "comm_bytes_naive",
            "comm_bytes_max_rank",
            "comm_bytes_per_rank",
            "comm_bytes_exchange",
            "comm_bytes_grads",
            "comm_max_over_mean",
        ):
            if key in best_line:
                summary[key] = best_line[key]
        if self.predicted_comm is not None:
            summary.update(self.predicted_comm)
            first = hist.get(0, {})
            if "comm_bytes_exchange_per_rank" in first:
                summary["comm_bytes_measured_epoch0_per_rank"] = first[
                    "comm_bytes_exchange_per_rank"
                ]
                summary["comm_bytes_naive_measured_epoch0_per_rank"] = first[
                    "comm_bytes_naive_per_rank"
                ]
        summary = _finite_or_none(summary)
        if main:
            _atomic_write_text(json.dumps(summary, indent=2) + "\n", self.out / "summary.json")
        self._log(
            f"test AP {_fmt(summary['test_ap'])} AUC {_fmt(summary['test_auc'])} "
            f"(inductive AP {_fmt(summary['test_ap_inductive'])}); "
            f"summary in {self.out / 'summary.json'}"
        )
        return summary

    def progress_bar(self, desc: str, events: int, initial: int = 0) -> tqdm:
        """A progress bar over ``events`` events on rank 0 (events/s and the time left),
        disabled when quiet."""
        return tqdm(
            total=events,
            initial=initial,
            desc=desc,
            unit="ev",
            unit_scale=True,
            disable=self.cfg.quiet or self.rank != 0,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
        )

    def _first_step_done(self, t_step: float, bar: tqdm) -> None:
        """Ends the start-up clock at the end of the first training step (waited for)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup.add("first_step", time.perf_counter() - t_step)
        self.startup.finish()
        if self.rank == 0 and not self.cfg.quiet:
            bar.write(self.startup.line(), file=sys.stderr)

    def _eval_split(self, split: str) -> tuple[dict[str, float], float]:
        """Evaluates ``split`` and computes its metrics; returns them and the events/s
        of the two together (the negatives drawn, the pass, the metrics)."""
        t0 = time.perf_counter()
        metrics = self.split_metrics(split, self.evaluate(split))
        dt = time.perf_counter() - t0
        lo, hi = self.ranges[split]
        self._times["eval_s"] += dt
        self._times["eval_events"] += hi - lo
        return metrics, (hi - lo) / max(dt, 1e-9)

    def _flush_step(self, progress: dict[str, Any]) -> None:
        """Waits for the queued steps and moves the device-side loss into ``progress``.

        A write-back held for staleness 1 is committed, so that a checkpoint or an
        evaluation sees it; a batch that overflowed an exchange capacity stops the run.
        """
        progress["epoch_loss"] += self.step.take_loss()
        if not math.isfinite(progress["epoch_loss"]):
            raise self._diverged(progress["epoch_loss"])

    def _diverged(self, loss: float) -> Diverged:
        """The error of a loss that turned NaN/inf, naming the last good checkpoint.

        Raised where the loss is read (checkpoints, epoch ends), before anything of
        the diverged state is saved, validated or logged: every checkpoint on disk
        was written at a finite loss. All ranks see the same summed loss.
        """
        ck = self.checkpoints
        step = ck.newest(ck.latest)
        kept = (
            f"the last checkpoint at a finite loss is {ck.latest.path(step)}"
            if step is not None
            else "no checkpoint was written before it"
        )
        err = Diverged(
            f"the training loss is {'NaN' if math.isnan(loss) else 'infinite'} by "
            f"{self._where}; training stopped, keeping nothing of that state ({kept}). "
            f"Lower train.lr (now {self.cfg.train.lr:g}) or check the data's features"
        )
        err.quiet = self.rank != 0
        return err

    # ---------------------------------------------------------------- comm
    def _timeline_line(self, epoch_s: float) -> dict[str, Any]:
        """This epoch's per-stage times of every rank (:mod:`sven.engine.timeline`).

        The timeline's events are read once here; the totals travel as one host
        tensor (the group carries gloo for host tensors under NCCL too).
        """
        totals = self.timeline.epoch_totals()
        mine = torch.tensor([*(totals[s] for s in STAGES), epoch_s], dtype=torch.float64)
        if self.world_size > 1:
            allr = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(allr, mine)
            per = torch.stack(allr)
        else:
            per = mine[None]
        return timeline_line(per[:, :-1], per[:, -1])

    # ------------------------------------------------------------- re-eval
    def evaluate_checkpoint(self, path: str | Path, *, other_store: bool = False) -> dict[str, Any]:
        """Re-evaluates a saved model: a run folder (its best), or a ``step-N`` folder.

        A state saved at the end of validation (the best model) continues into test,
        which reproduces the run's summary exactly. Any other state is re-played:
        memory is rebuilt by walking train and val without parameter updates, then
        test runs. Shards of a P-rank checkpoint are assembled when evaluating on one
        process.

        The store must be the one the model was trained on (its fingerprint,
        :mod:`sven.datasets.identity`); ``other_store`` applies the model to another
        store of the same feature widths instead, its memory re-played from that
        store, and the result says so (``trained_on``, ``note``).

        Raises:
            SvenError: The store is another one than the model's (one line, naming
                both), unless ``other_store``.
        """
        from sven.tasks.replay import check_same_data

        p = find_checkpoint(path)
        state = load_file(p / "state.pt", self.device)
        # Before the model's weights meet this store's widths: one line, not a traceback.
        note = check_same_data(state, self.data, p, other_store=other_store)
        self.model.load_state_dict(state["model"])
        data = _data_state(state)
        ws = int(data.get("world_size", 1))
        owner = data["owner"].to(self.device)
        if note is not None:
            self._log(f"sven: note: {note}", force=True)
            # The saved memory is another store's: every split is re-played from here.
            state = {**state, "memory_phase": None}
        elif ws == self.world_size and torch.equal(owner, self.owner):
            shard = load_file(p / f"memory-rank{self.rank}.pt", self.device)
            self.memory.load_state_dict(shard["memory"])
        elif self.world_size == 1:
            full = {k: v.clone() for k, v in self.memory.state_dict().items()}
            for r in range(ws):
                shard = load_file(p / f"memory-rank{r}.pt", self.device)
                rows = owned_nodes(owner, r)
                for k, v in shard["memory"].items():
                    full[k][rows] = v
            self.memory.load_state_dict(full)
        else:
            raise SvenError(
                f"{p} holds {ws} memory shards; evaluate it on {ws} ranks or on one process"
            )
        res: dict[str, Any] = {}
        if state.get("memory_phase") != "val_end":
            self.memory.reset()
            self.evaluate("train")
            res.update(self.split_metrics("val", self.evaluate("val")))
        res.update(self.split_metrics("test", self.evaluate("test")))
        out = {
            "model": self.cfg.model.name,
            "dataset": self.data.dataset_name,
            "checkpoint": str(p),
            "store_fingerprint": _fingerprint(self.data.events.meta),
        }
        if note is not None:
            out.update(trained_on=_data_state(state).get("store", {}).get("fingerprint"), note=note)
        return {**out, **res}

    def _log(self, msg: str, force: bool = False) -> None:
        if self.rank == 0 and (force or not self.cfg.quiet):
            print(msg, file=sys.stderr, flush=True)


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a Sven run: a ``config.json`` that a trainer wrote."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and {"data", "model", "train", "out"} <= set(cfg)


#: What a run writes at the top of its folder: ``train.overwrite=true`` deletes these
#: and refuses to run where anything else is there, at any depth (the whole manifest is
#: :data:`sven.engine.runfolder.RUN_MANIFEST`). ``plots`` is ``sven plot``'s.
RUN_FILES = frozenset(
    {"config.json", "metrics.jsonl", "summary.json", "checkpoints", "best", "tb", "traces"}
    | {"logs", "plots"}
)


def prepare_out(
    out: Path, *, resume: bool, overwrite: bool, log: Callable[[str], None] = print
) -> None:
    """Checks (and with ``overwrite`` empties) the run folder before training writes.

    A missing or empty ``out`` is used as is. A non-empty one is refused unless it is
    a Sven run folder and ``resume`` (continue it) or ``overwrite`` (delete it first)
    is set, so that the checkpoints of two runs never mix. ``overwrite`` deletes only
    what a run writes (:data:`~sven.engine.runfolder.RUN_MANIFEST`, at every depth:
    checkpoints, plots, logs) and refuses before deleting anything, naming them, where
    the folder holds anything else.

    Raises:
        ConfigError: ``out`` may not be used; the message says what to do.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"out={out} is a file, not a folder")
    # On several ranks, this launch's own per-rank logs (``out/logs``, where
    # sven.dist sends torch's C++ output) are there before the trainer starts.
    content = [p for p in out.iterdir() if p.name != "logs"]
    if not content:
        return
    run = is_run_folder(out)
    if overwrite:
        if not run:
            raise ConfigError(
                f"out={out} is not empty and not a Sven run folder (no config.json of "
                "Sven's); train.overwrite=true only deletes a run folder: choose another out"
            )
        import shutil

        from sven.engine.runfolder import RUN_MANIFEST
        from sven.ownership import foreign_paths, refuse_foreign

        foreign = foreign_paths(out, RUN_MANIFEST)
        if foreign:
            raise ConfigError("out=" + refuse_foreign(out, foreign, "train.overwrite=true"))
        for p in content:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        log(f"train.overwrite: deleted the earlier run in {out}")
        return
    if resume:
        if not run:
            raise ConfigError(
                f"out={out} is not empty and not a Sven run folder: nothing to resume there"
            )
        return
    what = "an earlier run" if run else "files that are not a Sven run"
    raise ConfigError(
        f"out={out} already holds {what}; use another out, train.resume=true to continue "
        "it, or train.overwrite=true to replace it"
    )


def _data_state(state: dict[str, Any]) -> dict[str, Any]:
    """The data component's part of a checkpoint's state; checkpoints written before the
    components kept the owner map and world size at the top."""
    if "data" in state:
        return state["data"]
    return {"owner": state["owner"], "world_size": int(state.get("world_size", 1))}


# Kept under its old name (it moved to sven.engine.checkpoint with the checkpointer).
_check_resume_config = check_resume_config


def _stop_vote(signum: int | None, world_size: int) -> int:
    """This rank's term of the summed stop vote: SIGTERM 1, SIGUSR1 ``world_size + 1``.

    A sum of P such terms still says whether any rank got each signal (see
    :func:`_stop_from_votes`); exact in float32 up to P = 4095.
    """
    if signum is None:
        return 0
    return 1 if signum == signal.SIGTERM else world_size + 1


def _stop_from_votes(total: int, world_size: int) -> int:
    """The signal to report from a summed vote (SIGTERM first), or 0 for none."""
    usr1, term = divmod(total, world_size + 1)
    if term:
        return int(signal.SIGTERM)
    return int(signal.SIGUSR1) if usr1 else 0


def improved(select: str, val: dict[str, float], best: dict[str, Any]) -> bool:
    """Whether an epoch's validation improves on the best so far (``train.select``).

    Args:
        select: ``ap`` (val AP above the best) or ``ap_auc`` (val AP and val AUC both at
            or above their bests, DyGLib's rule).
        val: The epoch's ``val_ap`` and ``val_auc``.
        best: ``best_val_ap`` and ``best_val_auc`` so far (-1 before the first epoch;
            a checkpoint written before ``best_val_auc`` existed lacks it).

    Returns:
        True to keep this epoch's model and reset the patience count. A NaN metric
        never improves.
    """
    if select == "ap_auc":
        return val["val_ap"] >= best["best_val_ap"] and val["val_auc"] >= best.get(
            "best_val_auc", -1.0
        )
    return val["val_ap"] > best["best_val_ap"]


def _is_comm_failure(exc: BaseException) -> bool:
    """Whether a RuntimeError comes from a broken or timed-out collective."""
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    text = str(exc).lower()
    # gloo's wording varies with where the peer stopped: a dead peer resets the
    # connection, a hung one trips the application timeout ("... caused pair closure").
    marks = ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe", "closure")
    return any(s in text for s in marks)


def _finite_or_none(d: dict[str, Any]) -> dict[str, Any]:
    """Replaces NaN/inf floats by None: JSON has no NaN, and None reads as "undefined"
    (e.g. inductive metrics of a split without inductive events)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _config_overrides(cfg: Config, overrides: list[str]) -> list[str]:
    """Flattens a config into dotted overrides, followed by ``overrides``."""
    flat: list[str] = []

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat.append(f"{prefix}{k}={json.dumps(v)}")

    walk(cfg.to_dict(), "")
    return flat + list(overrides)


def _main_thread_only(fn: Callable[[str], None]) -> Callable[[str], None]:
    """``fn`` when called from the main thread, a no-op elsewhere."""

    def call(stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            fn(stage)

    return call
