"""The trainer: a run's parts built from its config, on one process or on P ranks.

:class:`Trainer` builds, in order: the process group (under a launcher), the run's
data (:class:`~sven.engine.data.Data`: store, splits, partition, event tables), the
model, this rank's node state and the exchange that reads and writes it (the whole
state on one process; vertex-owned shards on P ranks), the optimizer, the step
(:class:`~sven.engine.step.Step`, with its evaluation) and the run's checkpoints.
:meth:`Trainer.fit` trains link prediction on them (:mod:`sven.tasks.link`, on the run
loop of :mod:`sven.engine.loop`); a checkpoint is the parts' state_dicts
(:meth:`Trainer.state_dict`).

With P ranks (launched by torchrun, srun or mpirun; see :mod:`sven.distributed`), rank
r processes the events of each global batch that the partition assigns to it, reads
and writes node state through :class:`~sven.pipeline.exchange.FixedExchange`, and
normalises its loss by the global number of predictions, so that the all-reduced
gradient is the one-process gradient ("Distributed semantics" in docs/design.md).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from sven.config import Config
from sven.config.load import as_config
from sven.distributed.grads import GradBucket, Gradients, LocalGrads
from sven.engine import gcpause
from sven.engine import step as step_module
from sven.engine.checkpoint import (
    Checkpointer,
    RunCheckpoints,
    Snapshot,
    Stateful,
    find_checkpoint,
    load_node_state,
    read_state,
)
from sven.engine.comm import predict_comm
from sven.engine.data import Data, most_active
from sven.engine.evaluation import EvalResult
from sven.engine.loop import StopSignals, TrainingState
from sven.engine.optim import Optimizer
from sven.engine.plan import plan_for
from sven.engine.run_folder import prepare_out
from sven.engine.spec import RunSpec, resolve_spec
from sven.engine.startup import StartupClock, preload_triton, set_deterministic
from sven.engine.step import Step
from sven.engine.tblog import EpochLog
from sven.engine.timeline import StepProfiler, Timeline
from sven.errors import ConfigError, first_line
from sven.models import MemoryModel, MemoryState, model_from_config
from sven.models.storage import Storage
from sven.pipeline.exchange import FixedExchange
from sven.pipeline.exchange_api import Exchange, LocalExchange


class Trainer:
    """Trains and evaluates one model on one event store, on one or many ranks.

    Args:
        config: A :class:`~sven.config.Config`, a nested dict, or a path to a YAML preset.
        overrides: Dotted ``key=value`` overrides applied on top.

        startup: The start-up clock (the CLI's counts from process start).
        purpose: ``train``; ``eval`` for a trainer that only evaluates a saved model
            (``sven eval``: its first line says so), ``replay`` for one that replays a
            saved model (predictions, embeddings, node classification's encoder).
            Neither writes checkpoints, which their plan does not count.

    Example:
        >>> summary = sven.Trainer("configs/tgn.yaml", ["data.path=stores/uci"]).fit()
    """

    # Where training is, for failure messages.
    where: str = "start"
    spec: RunSpec

    @property
    def distributed(self) -> bool:
        """Whether the run spans a process group (:attr:`RunSpec.distributed`)."""
        return self.spec.distributed

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
        """Builds the run's parts, in an order every rank keeps (collectives, seeds)."""
        from sven.config.paths import command_config

        # Every path absolute (what the run records) and of the right kind, before any work.
        writes = purpose == "train"
        cfg = command_config(as_config(config, overrides), writes=writes)
        self.cfg = cfg
        self._purpose = purpose
        # Start-up phases to the first step (sven.engine.startup); the CLI's from process start.
        self.startup = clock = startup or StartupClock()
        self._start_process(cfg, clock)
        self.dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
        self.out = Path(cfg.out)
        self.epoch_log = EpochLog(self.out / "tb", cfg.log.tensorboard, main=self.rank == 0)
        # The run's parts, each owning its part of the run's state: the store first
        # (its shape), then the plan, before any work.
        self.data = Data(
            cfg,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            dtype=self.dtype,
            agree=self.agree,
            clock=clock,
            load=False,
        )
        #: What the run needs where, and the node-state tier (:mod:`sven.engine.plan`).
        with clock.phase("plan"):
            self.plan = plan_for(cfg, self.data.events, self.world_size, self.device, writes)
            self.plan.check()
        self.data.load()
        with clock.phase("model"):
            self._build_model_and_state(cfg)
        t_tables = time.perf_counter()
        #: How the run runs, decided once (:mod:`sven.engine.spec`).
        self.spec = resolve_spec(
            cfg,
            device=self.device,
            rank=self.rank,
            world_size=self.world_size,
            distributed=self.ctx.backend != "none",
            tier=self.memory.storage.tier,
            staged=self.memory.storage.staged,
            data=self.data,
            log=lambda msg: self.log(msg, force=True),
        )
        plan_group = self._build_exchange(cfg)
        self.data.attach(self.model)
        t_opt = time.perf_counter()
        # lean: without torch.optim's compiler wrappers (and their imports; sven.engine.startup),
        # unless the run compiles anyway.
        compiles = cfg.train.compile and self.device.type in step_module.COMPILE_DEVICES
        self.optimizer = Optimizer(
            self.model.parameters(), cfg.train.lr, self.device, lean=not compiles
        )
        dt_opt = time.perf_counter() - t_opt
        clock.add("optimizer", dt_opt)
        distributed = self.spec.distributed
        self.grads: Gradients = (
            GradBucket(self.model.parameters(), None, self.world_size)
            if distributed
            else LocalGrads(self.optimizer)
        )
        self._build_step(cfg, plan_group)
        self.log(self._describe_run())
        if distributed:
            self.log(self.ctx.describe())
        self.predicted_comm = (
            predict_comm(cfg, self.data, self.model, self.exchange) if distributed else None
        )
        clock.add("tables", time.perf_counter() - t_tables - dt_opt)
        if self._preload is not None:
            clock.add("preload", self._preload.join())

    def _start_process(self, cfg: Config, clock: StartupClock) -> None:
        """Threads, determinism, the process group and the device (its CUDA context)."""
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if tc.deterministic:
            # cuBLAS reads this once, at its first use in the process.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            # Without importing torch's compiler (sven.engine.startup).
            set_deterministic(True, warn_only=True)
        from sven.distributed.launcher import detect_launcher
        from sven.distributed.process_group import init_distributed

        # Under a launcher even one rank gets a process group: the P-rank step with
        # its collectives, as on many ranks (a plain process runs without one).
        launched = detect_launcher(os.environ).launcher != "single"
        # Triton imported in a thread from here to the end of the trainer's build,
        # beside CUDA's start and the store's loading (CUDA runs only).
        self._preload = preload_triton(tc.device)
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

    def _build_model_and_state(self, cfg: Config) -> None:
        """The model (seeded) and this rank's node state in the plan's tier."""
        mc, d = cfg.model, self.data
        torch.manual_seed(cfg.train.seed)
        lo, hi = d.ranges["train"]
        self.model: MemoryModel = model_from_config(
            mc,
            edge_dim=d.edge_dim,
            node_dim=d.node_dim,
            train_events=(d.events.src[lo:hi], d.events.dst[lo:hi], d.events.t[lo:hi]),
        ).to(self.device, self.dtype)
        # A command that writes nothing keeps its disk-tier scratch in a temporary
        # folder of its own (sven.models.storage), never in the recorded run's.
        state_dir = (cfg.state.path or self.out / "state") if self._purpose == "train" else None
        storage = Storage(self.plan.tier, self.device, folder=state_dir, rank=self.rank)
        self.memory = MemoryState(
            int(d.owned.numel()),
            mc.memory_dim,
            self.model.mail_dim,
            self.model.mailbox_size,
            self.device,
            self.dtype,
            time_origin=float(d.t[0]) if d.t.numel() else 0.0,
            storage=storage,
        )
        if storage.tier == "host" and self.plan.hot_rows:
            hot = most_active(d.src, d.dst, d.num_nodes, d.owned, self.plan.hot_rows)
            self.memory.keep_hot(hot)
            self.log(
                f"sven: node state: {hot.numel():,} of {self.memory.num_nodes:,} rows also kept "
                f"on {self.device.type} (the most active; state.hot_rows)"
            )

    def _build_exchange(self, cfg: Config) -> Any:
        """The exchange (local, or across the ranks); returns the process group of
        prefetched id plans (None on one process)."""
        if not self.spec.distributed:
            self.exchange: Exchange = LocalExchange(self.memory)
            return None
        from datetime import timedelta

        # Made here, in the same order on every rank: the write-back runs on a side
        # stream beside the gradient all-reduce, and prefetched id plans beside the
        # step, each on a communicator of its own (two streams must never drive one).
        timeout = timedelta(seconds=cfg.dist.timeout_s)
        ranks = list(range(self.world_size))
        push_group = dist.new_group(ranks, timeout=timeout)
        plan_group = dist.new_group(ranks, timeout=timeout)
        self.exchange = FixedExchange(
            self.data.owner,
            self.rank,
            self.world_size,
            self.memory,
            node_feat=self.data.owned_node_feat(),
            push_group=push_group,
            staleness=self.spec.staleness,
        )
        return plan_group

    def _build_step(self, cfg: Config, plan_group: Any) -> None:
        """The hooks, the timeline and profiler, the step, the stop signals and the
        checkpoints."""
        tc = cfg.train
        self.hooks: dict[str, list[Callable[[Trainer], None]]] = {
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
            spec=self.spec,
            data=self.data,
            model=self.model,
            optimizer=self.optimizer,
            memory=self.memory,
            exchange=self.exchange,
            grads=self.grads,
            plan_group=plan_group,
            timeline=self.timeline,
            log=lambda msg: self.log(msg, force=True),
            progress=self.progress_bar,
        )
        #: Evaluation passes and their metrics, on the step's parts.
        self.evaluator = self.step.evaluation
        #: The stop signals this process received while fit runs.
        self.signals = StopSignals()
        self.checkpoints = RunCheckpoints(
            self.out,
            tc.keep_latest_k,
            config=cfg,
            rank=self.rank,
            world_size=self.world_size,
            barrier=self.barrier,
            agree=self.agree,
            asynchronous=tc.checkpoint_async,
            threads=tc.checkpoint_threads,
            timeout_s=cfg.dist.timeout_s,
        )

    def add_hook(self, when: str, fn: Callable[[Trainer], None]) -> None:
        """Calls ``fn(trainer)`` before or after every training step, on every rank.

        For observing a run (tests record parameters and memory after each step, or
        interrupt one) without subclassing. An ``after_step`` hook that reads device
        tensors waits for the step to finish, which costs speed on CUDA.

        Args:
            when: "before_step" or "after_step".
            fn: The hook; exceptions propagate out of ``fit``.
        """
        if when not in self.hooks:
            raise ValueError(f"when must be one of {sorted(self.hooks)}, got {when!r}")
        self.hooks[when].append(fn)

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

    def claim_out(self) -> None:
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
                prepare_out(self.out, resume=tc.resume, overwrite=tc.overwrite, log=self.log)
            except (ConfigError, FolderBusy) as exc:
                self._release_out()
                problem = (isinstance(exc, FolderBusy), str(exc))
        problem = self.agree(problem)
        if problem is not None:
            err = (FolderBusy if problem[0] else ConfigError)(problem[1])
            err.quiet = self.rank != 0
            raise err

    def _release_out(self) -> None:
        if self._out_lock is not None:
            self._out_lock.release()
            self._out_lock = None

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a no-op on one process)."""
        if self.world_size == 1:
            return value
        from sven.distributed.collectives import broadcast_object

        return broadcast_object(value)

    def num_batches(self, split: str) -> int:
        """Number of global batches of a split at the configured batch size."""
        return self.data.num_batches(split)

    def evaluate(self, split: str) -> EvalResult:
        """Walks a split without gradients, updating node state; returns all scores
        (:meth:`~sven.engine.evaluation.Evaluation.run`)."""
        return self.evaluator.run(split)

    def split_metrics(self, split: str, res: EvalResult) -> dict[str, float]:
        """AP/AUC (mean of per-batch values, and pooled), inductive, MRR of a split
        (:meth:`~sven.engine.evaluation.Evaluation.metrics`)."""
        return self.evaluator.metrics(split, res)

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
    def barrier(self, what: str) -> None:
        """Waits for every rank (a no-op on one process); a rank that does not come is
        named in a DistError (``what``: where the run is, for the message)."""
        if self.world_size > 1:
            from sven.distributed.collectives import barrier_or_die

            barrier_or_die(self.ctx, what)

    def _parts(self) -> dict[str, Stateful]:
        """Rank 0's parts of a checkpoint besides the data identity, by the key each is
        saved under."""
        return {"model": self.model, "optimizer": self.optimizer, "evaluator": self.evaluator}

    def _rank_parts(self) -> dict[str, Stateful]:
        """This rank's small parts of a checkpoint (its node state goes apart)."""
        return {"exchange": self.exchange, "rng": _TorchRNG()}

    def state_dict(self, training: TrainingState) -> Snapshot:
        """A resumable checkpoint of this rank, assembled from the parts' state_dicts.

        Taken at a drained boundary (no step queued, no write-back in flight).

        Args:
            training: Where to resume and the loop's progress.

        Returns:
            Rank 0's state (data identity, model, optimizer, evaluator, cursor,
            progress), this rank's shard (exchange counters, RNG), its node state and
            the owner map (taken out of the data identity: the format keeps it apart).
        """
        data, owner = self.data.identity_and_owner()
        state = {"data": data, **{k: part.state_dict() for k, part in self._parts().items()}}
        shard = {k: part.state_dict() for k, part in self._rank_parts().items()}
        state.update(training.state_dict())
        return Snapshot(state, shard, node_state=self.memory.state_dict(), owner=owner)

    def load_state_dict(self, snap: Snapshot, where: str = "checkpoint") -> None:
        """Loads a checkpoint into the parts (the inverse of :meth:`state_dict`).

        A part the checkpoint lacks is left as it is: the best model's checkpoint holds
        only the data identity, the model and the node state.

        Raises:
            ConfigError: The checkpoint's ranks or partition are not this run's.
        """
        state, shard = snap.state, snap.shard
        self.data.load_state_dict(_data_state(state, snap.owner), where)
        self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.evaluator.load_state_dict(state.get("evaluator", {}))
        if snap.node_state is not None:
            self.memory.load_state_dict(snap.node_state)
        counters = shard.get("exchange", shard.get("comm"))
        if counters:
            # Kept across ranks; one process has none to restore.
            self.exchange.load_state_dict(counters)
        if "rng" in shard:
            _TorchRNG().load_state_dict(shard["rng"])

    def load_checkpoint(self, ck: Checkpointer, step: int) -> dict[str, Any]:
        """Loads checkpoint ``step`` of ``ck`` into the parts; returns rank 0's state."""
        cks, where = self.checkpoints, f"checkpoint {ck.path(step)}"
        snap = cks.load(ck, step, self.device, node_state=False)
        # The data identity first: the node state is read only for this run's vertices,
        # straight into the node state's own tensors (no second copy of it).
        self.data.load_state_dict(_data_state(snap.state), where)
        snap.node_state = cks.load_node_state(ck, step, self.memory.state_dict(), self.owned)
        # Written into the tables directly: rows read ahead before now are read again.
        self.memory.invalidate()
        self.load_state_dict(snap, where)
        return snap.state

    # ------------------------------------------------------------------ fit
    def fit(self) -> dict[str, Any]:
        """Trains link prediction with early stopping on validation, then evaluates the
        best model on test (:class:`~sven.tasks.link.LinkPrediction`).

        SIGTERM and SIGUSR1 (:data:`~sven.engine.loop.STOP_SIGNALS`) stop training after
        the step that follows them, on every rank at the same step, with a checkpoint;
        the previous handlers are back when fit returns.

        Returns:
            The summary (also written to ``<out>/summary.json`` by rank 0).

        Raises:
            Stopped: A stop signal arrived; the checkpoint is written (exit code 75).
            DistError: A rank died or hung; the message names it (exit code 4).
        """
        # Imported here: the task takes the run by its public members and imports no
        # trainer, and the trainer names the task only where it runs it.
        from sven.tasks.link import LinkPrediction

        restore = self.signals.install()
        try:
            return LinkPrediction(self).run()
        except RuntimeError as exc:
            if self.world_size == 1 or not _is_comm_failure(exc):
                raise
            from sven.distributed.collectives import DistError

            # A peer died or hung inside a collective; gloo/NCCL then raise a bare
            # RuntimeError that does not say which. The heartbeats do (sven.distributed.liveness).
            first = first_line(exc)
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
                f"rank {self.rank}: a collective failed at {self.where} ({first}); {who}. "
                "The last complete checkpoint is intact: rerun with train.resume=true",
                ranks=peers,
                what=self.where,
            ) from exc
        finally:
            if getattr(self, "bar", None) is not None:
                # A bar left open by an error would run into the error's one line.
                self.bar.close()
            # A commit still in flight (the run ends on an error) finishes or is
            # removed before the process group goes.
            self.checkpoints.close()
            try:
                self.ctx.teardown()
            finally:
                # After the teardown: a SIGTERM that srun sends once another rank has
                # exited must not kill this one halfway through.
                restore()
                self._release_out()
                self.memory.storage.release_folder()

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

    def first_step_done(self, t_step: float, bar: tqdm) -> None:
        """Ends the start-up clock at the end of the first training step (waited for)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup.add("first_step", time.perf_counter() - t_step)
        self.startup.finish()
        # The collector back on (where the command line paused it), past start-up's objects.
        gcpause.resume()
        if self.rank == 0 and not self.cfg.quiet:
            bar.write(self.startup.line(), file=sys.stderr)

    def evaluate_checkpoint(self, path: str | Path, *, other_store: bool = False) -> dict[str, Any]:
        """Re-evaluates a saved model: a run folder (its best), or a ``step-N`` folder.

        A state saved at the end of validation (the best model) continues into test,
        which reproduces the run's summary exactly. Any other state is re-played:
        memory is rebuilt by walking train and val without parameter updates, then
        test runs. A checkpoint of any number of ranks is read into this run's ranks
        (each reads the node state of the vertices it owns).

        The store must be the one the model was trained on (its fingerprint,
        :mod:`sven.datasets.identity`); ``other_store`` applies the model to another
        store of the same feature widths instead, its memory re-played from that
        store, and the result says so (``trained_on``, ``note``).

        Raises:
            SvenError: The store is another one than the model's (one line, naming
                both), unless ``other_store``.
        """
        from sven.datasets.identity import fingerprint
        from sven.engine.store_check import check_same_data

        p = find_checkpoint(path)
        state = read_state(p, self.device)
        # Before the model's weights meet this store's widths: one line, not a traceback.
        note = check_same_data(state, self.data, p, other_store=other_store)
        self.model.load_state_dict(state["model"])
        if note is not None:
            self.log(f"sven: note: {note}", force=True)
            # The saved memory is another store's: every split is re-played from here.
            state = {**state, "memory_phase": None}
        elif state.get("memory_phase") == "val_end":
            load_node_state(p, self.memory.state_dict(), self.owned, self.num_nodes)
            self.memory.invalidate()
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
            "store_fingerprint": fingerprint(self.data.events.meta),
        }
        if note is not None:
            trained_on = _data_state(state).get("store", {}).get("fingerprint")
            out.update(trained_on=trained_on, note=note)
        return {**out, **res}

    def log(self, msg: str, force: bool = False) -> None:
        """A line on rank 0's stderr, unless ``quiet`` (``force``: regardless)."""
        if self.rank == 0 and (force or not self.cfg.quiet):
            print(msg, file=sys.stderr, flush=True)


def _data_state(state: dict[str, Any], owner: torch.Tensor | None = None) -> dict[str, Any]:
    """The data part's state in a checkpoint's state, with its owner map (``owner``
    where a snapshot holds it apart); checkpoints written before the parts kept the
    owner map and world size at the top."""
    if "data" not in state:
        return {"owner": state["owner"], "world_size": int(state.get("world_size", 1))}
    return state["data"] if owner is None else {**state["data"], "owner": owner}


class _TorchRNG:
    """Torch's global RNG as a checkpoint part. Negatives, uniform sampling and dropout
    are keyed by event and batch (pipeline/negatives.py) and need no state; torch's is
    kept for user code."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Shards load onto the run's device, but torch's RNG state must be a CPU tensor
        # (on a GPU run, resume otherwise fails: "RNG state must be a torch.ByteTensor").
        torch.set_rng_state(state["torch"].cpu())


def _is_comm_failure(exc: BaseException) -> bool:
    """Whether a RuntimeError comes from a broken or timed-out collective."""
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    text = str(exc).lower()
    # gloo's wording varies with where the peer stopped: a dead peer resets the
    # connection, a hung one trips the application timeout ("... caused pair closure").
    marks = ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe", "closure")
    return any(s in text for s in marks)
