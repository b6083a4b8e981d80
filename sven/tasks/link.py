"""Link prediction, the task a :class:`~sven.engine.trainer.Trainer` trains: its epochs
on the run loop, the best model by validation, test, and the run's summary. It takes
the built run through its public members (:class:`~sven.tasks.run.Run`).

One epoch walks the training events in time order in global batches of B
(:meth:`LinkPrediction.train_batch` queues one captured step each; nothing is read back
per batch); validation continues the node state from the end of training, test from
the end of validation ("Training semantics" in docs/design.md). The best model (by
``train.select``) is saved with the node state at the end of validation, which test
continues.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from sven.config import dump_config
from sven.datasets.identity import fingerprint
from sven.engine.checkpoint import Snapshot
from sven.engine.expect import epoch_estimate, start_hint
from sven.engine.loop import (
    RunLoop,
    TrainingState,
    end_run,
    new_progress,
    stop_from_votes,
    stop_vote,
)
from sven.engine.run_folder import finite_or_none, fmt
from sven.engine.startup import triton_cache_dir
from sven.engine.timeline import STAGES, timeline_line
from sven.errors import Diverged, SvenError
from sven.tasks.run import Run

__all__ = ["LinkPrediction", "improved"]


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


class LinkPrediction:
    """The link-prediction task of a built run, driven by the run loop.

    Args:
        tr: The run (its parts: data, model, node state, exchange, step, checkpoints,
            timeline; :class:`~sven.tasks.run.Run`).
    """

    #: The best model's node state is the one of the latest checkpoint saved just
    #: before it (the end of validation).
    best_links_latest = True

    def __init__(self, tr: Run) -> None:
        self.tr = tr
        self.cfg = tr.cfg
        self.device = tr.device
        self.where = "start"
        self._times = {"eval_s": 0.0, "eval_events": 0, "checkpoint_s": 0.0}
        self._capacities_planned = False
        self._stop = self._voted_signal if tr.spec.distributed else self._own_signal

    # -------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Trains with early stopping on validation, then evaluates the best model on
        test; returns the summary (written to ``<out>/summary.json`` by rank 0)."""
        tr, tc = self.tr, self.cfg.train
        wall0 = time.perf_counter()
        main = tr.rank == 0
        with tr.startup.phase("run_start"):
            tr.claim_out()
            if main:
                tr.out.mkdir(parents=True, exist_ok=True)
            tr.barrier("start")
            loop = RunLoop(
                self,
                tr.checkpoints,
                out=tr.out,
                epochs=tc.epochs,
                patience=tc.patience,
                checkpoint_every=tc.checkpoint_every,
                main=main,
                log=tr.log,
                on_line=tr.epoch_log.write,
                save=self._save,
                device=tr.device,
            )
            progress, start_epoch, start_batch = self._start(loop, main)
        # The first whole epoch this process runs: one resumed halfway is no measure.
        self._estimate_epoch = start_epoch + (start_batch != 0)
        progress = loop.run(progress, start_epoch, start_batch)
        tr.startup.finish()
        ck = tr.checkpoints
        t_ck = time.perf_counter()
        # The run's end waits for the commits in flight.
        missing = ck.finish()
        self._times["checkpoint_s"] += time.perf_counter() - t_ck
        best, test, test_rate = self._test(loop.best_live, progress)
        summary = self._summary(progress, best, test, test_rate, wall0)

        def say(s: dict[str, Any]) -> None:
            tr.log(
                f"test AP {fmt(s.get('test_ap'))} AUC {fmt(s.get('test_auc'))} "
                f"(inductive AP {fmt(s.get('test_ap_inductive'))}); "
                f"summary in {tr.out / 'summary.json'}"
            )

        return end_run(ck, summary, missing, out=tr.out, main=main, say=say)

    def _start(self, loop: RunLoop, main: bool) -> tuple[dict[str, Any], int, int]:
        """The progress to train from, fresh or resumed, with its epoch and batch; the
        run's config.json, and a hint of the run's length where it is long."""
        tr, tc = self.tr, self.cfg.train
        progress = new_progress(
            best_val_ap=-1.0,
            best_val_auc=-1.0,
            epoch_loss=0.0,
            epoch_batches=0,
            epoch_time=0.0,
            train_time=0.0,
            train_events=0,
        )
        start_epoch, start_batch = 0, 0
        if tc.resume:
            progress, start_epoch, start_batch = loop.resume(progress)
        if main:
            # After the resume's checks (config, store, partition): a refused resume
            # leaves the run's config.json saying what its checkpoints hold.
            dump_config(self.cfg, tr.out / "config.json")
        nb = tr.num_batches("train")
        lo, hi = tr.ranges["train"]
        per_epoch = min(
            hi, lo + (min(nb, tc.max_batches) if tc.max_batches else nb) * tc.batch_size
        )
        hint = start_hint(tr.device.type, tc.epochs - start_epoch, per_epoch - lo)
        if hint is not None and not progress["stopped"]:
            tr.log(hint)
        return progress, start_epoch, start_batch

    def _test(
        self, best_live: int | None, progress: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], float]:
        """The best model's test metrics and events/s (n/a where the best model could
        not be written and another epoch trained after it), with the best model's
        epoch."""
        best = self._best_for_test(best_live, progress)
        self.where = "test"
        if best is not None:
            test, test_rate = self._eval_split("test")
            return best, test, test_rate
        # The best model could not be written, and another epoch trained after it.
        self.tr.log(
            f"test metrics are n/a: the best model (epoch {progress['best_epoch']}) "
            "could not be written, and another epoch trained after it",
            force=True,
        )
        na: dict[str, Any] = dict.fromkeys(
            ("test_ap", "test_auc", "test_ap_pooled", "test_ap_inductive")
        )
        na["test_auc_inductive"] = None
        return {"epoch": progress["best_epoch"]}, na, float("nan")

    def _save(self, ck: Any, step: int, snap: Snapshot, **kw: Any) -> None:
        t_ck = time.perf_counter()
        self.tr.checkpoints.save(ck, step, snap, **kw)
        self._times["checkpoint_s"] += time.perf_counter() - t_ck

    def _best_for_test(
        self, best_live: int | None, progress: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The best model, live or reloaded, for test; None where it could not be
        written and another epoch trained after it."""
        ck = self.tr.checkpoints
        if best_live is not None and best_live == progress["best_epoch"]:
            # The best model and its node state at the end of validation are the live
            # state (saved unchanged just now): test continues from them without a
            # reload.
            return {"epoch": best_live}
        t_ck = time.perf_counter()
        step = ck.newest(ck.best)
        if step is not None and step == progress["best_epoch"]:
            best = self.tr.load_checkpoint(ck.best, step)
        elif ck.error_of(ck.best, progress["best_epoch"]) is not None:
            # An older best model is on disk, but it is not the best epoch's.
            return None
        elif step is None:
            raise SvenError(f"no valid best model under {ck.best.root}")
        else:
            best = self.tr.load_checkpoint(ck.best, step)
        self._times["checkpoint_s"] += time.perf_counter() - t_ck
        return best

    # ------------------------------------------------------------ epochs
    def begin_epoch(self, epoch: int, first: int, progress: dict[str, Any]) -> int:
        """Resets the node state at an epoch's start, plans the exchange's capacities
        (the first epoch this process runs), starts the progress bar, the profiler and
        the prefetch ring; returns the epoch's batch count."""
        tr, tc = self.tr, self.cfg.train
        with tr.startup.phase("epoch_start"):
            if first == 0:
                tr.memory.reset()
                tr.exchange.drop_held()
                progress.update(epoch_loss=0.0, epoch_batches=0, epoch_time=0.0)
                tr.exchange.counter.reset()
            if not self._capacities_planned:
                # The exchange's fixed sizes, from an exact replay of this epoch's batches.
                tr.step.plan_capacities(epoch)
                self._capacities_planned = True
        nb = tr.num_batches("train")
        last = nb if not tc.max_batches else min(nb, tc.max_batches)
        lo, hi = tr.ranges["train"]
        b = tc.batch_size
        self._last = last
        tr.bar = self._bar = tr.progress_bar(
            f"epoch {epoch}", min(hi, lo + last * b) - lo, min(hi, lo + first * b) - lo
        )
        if tr.profiler is not None:
            tr.profiler.fit(first, last)
        with tr.startup.phase("first_batches"):
            tr.step.start_epoch(epoch, first, last)
        self._ep_t0, self._paused = time.perf_counter(), 0.0
        tr.timeline.begin()
        return last

    def train_batch(self, epoch: int, i: int, progress: dict[str, Any]) -> None:
        """Queues the training step of batch ``i`` (nothing is read back: the loss
        accumulates on the device)."""
        tr, b = self.tr, self.cfg.train.batch_size
        lo, hi = tr.ranges["train"]
        self.where = tr.where = f"epoch {epoch} batch {i}"
        tr.ctx.set_step(progress["global_step"])
        g_lo, g_hi = lo + i * b, min(lo + (i + 1) * b, hi)
        for fn in tr.hooks["before_step"]:
            fn(tr)
        tr.timeline.lap("wait")
        prof = tr.profiler
        if prof is not None:
            prof.before(i)
        t_first = None if tr.startup.done else time.perf_counter()
        tr.step.train_batch(epoch, i, g_lo, g_hi, stop_vote(tr.signals.received, tr.world_size))
        if t_first is not None:
            tr.first_step_done(t_first, self._bar)
        if prof is not None:
            prof.after(i)
        for fn in tr.hooks["after_step"]:
            fn(tr)
        progress["epoch_batches"] += 1
        progress["train_events"] += g_hi - g_lo
        self._bar.update(g_hi - g_lo)

    def stop_requested(self) -> int:
        """The stop signal all ranks agreed on after a finished step, or 0.

        On several ranks the votes travel in the step's gradient all-reduce; on CUDA
        they are read one step late (:meth:`~sven.engine.step.StepStatus.read`), so that
        the host never waits for the step in flight: every rank still stops after the
        same step. The same read stops the run if a batch overflowed an exchange
        capacity.
        """
        return self._stop()

    def _own_signal(self) -> int:
        """One process: the signal it received, or 0."""
        return self.tr.signals.received or 0

    def _voted_signal(self) -> int:
        """P ranks: the signal the votes of the step before agree on, or 0."""
        tr = self.tr
        votes, fetch_over, push_over = tr.step.status.read()
        if fetch_over > 0 or push_over > 0:
            tr.exchange.check()
        got = stop_from_votes(votes, tr.world_size)
        # Rank 0 speaks for all: name its own signal where it had one.
        return (tr.signals.received or got) if got else 0

    def pause(self, progress: dict[str, Any]) -> dict[str, Any]:
        """Drains the queued steps for a mid-epoch checkpoint (not a stage of the
        epoch's training); returns the progress with the epoch's training time so far,
        so that a resumed run's events/s divides all its events by all their time."""
        self.tr.timeline.pause()
        self._t_save = time.perf_counter()
        self._flush_step(progress)
        so_far = self._t_save - self._ep_t0 - self._paused
        return {
            **progress,
            "epoch_time": progress["epoch_time"] + so_far,
            "train_time": progress["train_time"] + so_far,
        }

    def unpause(self) -> None:
        """Restarts the epoch's clock after a mid-epoch checkpoint."""
        self._paused += time.perf_counter() - self._t_save
        self.tr.timeline.begin()

    def end_epoch(self, epoch: int, progress: dict[str, Any]) -> dict[str, Any]:
        """Drains the epoch's steps, then validates: the epoch's metrics line."""
        tr, tc = self.tr, self.cfg.train
        self._flush_step(progress)
        tr.timeline.lap("wait")
        # Wall time of the epoch's training, device work included (the steps run
        # asynchronously; the drain waited for them), checkpoints excluded.
        dt = time.perf_counter() - self._ep_t0 - self._paused
        if tr.profiler is not None:
            tr.profiler.close()
        progress["epoch_time"] += dt
        progress["train_time"] += dt
        self._bar.close()
        lo, hi = tr.ranges["train"]
        epoch_events = min(hi, lo + self._last * tc.batch_size) - lo
        comm = tr.exchange.epoch_bytes()
        stages = self._timeline_line(dt)
        self.where = tr.where = f"epoch {epoch} validation"
        val, val_rate = self._eval_split("val")
        if epoch == self._estimate_epoch:
            took = time.perf_counter() - self._ep_t0
            note = epoch_estimate(epoch, took, tc.epochs - epoch - 1, tc.patience)
            if note is not None:
                tr.log(note)
        return {
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

    def describe(self, line: dict[str, Any]) -> str:
        """The epoch's log line."""
        return (
            f"epoch {line['epoch']}: loss {line['train_loss']:.4f} val AP "
            f"{fmt(line['val_ap'])} AUC {fmt(line['val_auc'])} "
            f"({line['events_per_s']:.0f} train events/s, "
            f"{line['val_events_per_s']:.0f} eval events/s)"
        )

    def improved(self, line: dict[str, Any], progress: dict[str, Any]) -> bool:
        """``train.select``'s rule; on improvement the best AP and AUC are recorded."""
        val = {"val_ap": line["val_ap"], "val_auc": line["val_auc"]}
        # A metric of None (not finite) never improves.
        val = {k: (math.nan if v is None else v) for k, v in val.items()}
        if not improved(self.cfg.train.select, val, progress):
            return False
        progress.update(best_val_ap=val["val_ap"], best_val_auc=val["val_auc"])
        return True

    # ------------------------------------------------------- checkpoints
    def state_dict(self, training: TrainingState) -> Snapshot:
        """The run's resumable checkpoint (:meth:`~sven.tasks.run.Run.state_dict`)."""
        return self.tr.state_dict(training)

    def load_state_dict(self, snap: Snapshot) -> None:
        """Loads a resumable checkpoint into the run's parts."""
        self.tr.load_state_dict(snap, "checkpoint")

    def best_state(self, epoch: int) -> Snapshot:
        """The best model with the node state at the end of validation, which test
        continues (no optimizer: it is not resumed from). The node state is the latest
        checkpoint's, saved just before (:attr:`best_links_latest`)."""
        tr = self.tr
        data, owner = tr.data.identity_and_owner()
        state = {
            "data": data,
            "model": tr.model.state_dict(),
            "epoch": epoch,
            "memory_phase": "val_end",
        }
        return Snapshot(state, owner=owner)

    # ----------------------------------------------------------- helpers
    def _flush_step(self, progress: dict[str, Any]) -> None:
        """Waits for the queued steps and moves the device-side loss into ``progress``.

        A write-back held for staleness 1 is committed, so that a checkpoint or an
        evaluation sees it; a batch that overflowed an exchange capacity stops the run.
        """
        progress["epoch_loss"] += self.tr.step.take_loss()
        if not math.isfinite(progress["epoch_loss"]):
            raise self._diverged(progress["epoch_loss"])

    def _diverged(self, loss: float) -> Diverged:
        """The error of a loss that turned NaN/inf, naming the last good checkpoint.

        Raised where the loss is read (checkpoints, epoch ends), before anything of
        the diverged state is saved, validated or logged: every checkpoint on disk
        was written at a finite loss. All ranks see the same summed loss.
        """
        tr = self.tr
        ck = tr.checkpoints
        step = ck.newest(ck.latest)
        kept = (
            f"the last checkpoint at a finite loss is {ck.latest.path(step)}"
            if step is not None
            else "no checkpoint was written before it"
        )
        err = Diverged(
            f"the training loss is {'NaN' if math.isnan(loss) else 'infinite'} by "
            f"{self.where}; training stopped, keeping nothing of that state ({kept}). "
            f"Lower train.lr (now {self.cfg.train.lr:g}) or check the data's features"
        )
        err.quiet = tr.rank != 0
        return err

    def _eval_split(self, split: str) -> tuple[dict[str, float], float]:
        """Evaluates ``split`` and computes its metrics; returns them and the events/s
        of the two together (the negatives drawn, the pass, the metrics)."""
        tr = self.tr
        t0 = time.perf_counter()
        metrics = tr.split_metrics(split, tr.evaluate(split))
        dt = time.perf_counter() - t0
        lo, hi = tr.ranges[split]
        self._times["eval_s"] += dt
        self._times["eval_events"] += hi - lo
        return metrics, (hi - lo) / max(dt, 1e-9)

    def _timeline_line(self, epoch_s: float) -> dict[str, Any]:
        """This epoch's per-stage times of every rank (:mod:`sven.engine.timeline`).

        The timeline's events are read once here; the totals travel as one host
        tensor (the group carries gloo for host tensors under NCCL too).
        """
        tr = self.tr
        totals = tr.timeline.epoch_totals()
        mine = torch.tensor([*(totals[s] for s in STAGES), epoch_s], dtype=torch.float64)
        if tr.world_size > 1:
            allr = [torch.zeros_like(mine) for _ in range(tr.world_size)]
            dist.all_gather(allr, mine)
            per = torch.stack(allr)
        else:
            per = mine[None]
        return timeline_line(per[:, :-1], per[:, -1])

    def _summary(
        self,
        progress: dict[str, Any],
        best: dict[str, Any],
        test: dict[str, float],
        test_rate: float,
        wall0: float,
    ) -> dict[str, Any]:
        """The run's summary: what ran on what, the best epoch's validation and its
        test, the rates and times, the plan, the pipeline and the communication."""
        tr, cfg = self.tr, self.cfg
        hist = {h["epoch"]: h for h in progress["history"]}
        best_line = hist.get(best["epoch"], {})
        times = self._times
        summary = {
            "model": cfg.model.name,
            "dataset": tr.data.dataset_name,
            "store_fingerprint": fingerprint(tr.data.events.meta),
            "world_size": tr.world_size,
            "partition": tr.data.partition_meta.get("strategy"),
            "epochs_run": len(progress["history"]),
            "best_epoch": best["epoch"],
            "val_ap": best_line.get("val_ap"),
            "val_auc": best_line.get("val_auc"),
            "eval_negatives": cfg.eval.negatives,
            "eval_mrr_negatives": tr.mrr_negatives,
            "eval_mrr_source": tr.data.mrr_source,
            **test,
            "train_events_per_s": progress["train_events"] / max(progress["train_time"], 1e-9),
            "eval_events_per_s": times["eval_events"] / max(times["eval_s"], 1e-9),
            "test_events_per_s": test_rate,
            "eval_s": times["eval_s"],
            "checkpoint_s": times["checkpoint_s"],
            **tr.startup.summary(),
            "wall_s": time.perf_counter() - wall0,
        }
        summary.update(self._run_fields())
        summary.update(self._comm_fields(hist, best_line))
        return finite_or_none(summary)

    def _run_fields(self) -> dict[str, Any]:
        """The summary's plan, checkpoint, pipeline and graph fields."""
        tr, spec = self.tr, self.tr.spec
        st = tr.step
        written = tr.checkpoints.timings
        need = tr.plan.to_dict()["need"]
        out = dict(
            state_tier=tr.memory.storage.tier,
            state_bytes=tr.plan.state_bytes,
            # Rows the host tier keeps copies of in GPU memory (state.hot_rows).
            state_hot_rows=tr.memory.hot_rows,
            plan_gpu_bytes=need["gpu"],
            plan_host_bytes=need["host"],
            plan_disk_bytes=need["disk"],
            checkpoints_written=len(written),
            # The longest a checkpoint held training up, and the longest one took to be
            # on disk (both from the start of its save).
            checkpoint_stall_max_s=max((c["stall_s"] for c in written), default=0.0),
            checkpoint_on_disk_max_s=max((c.get("on_disk_s", 0.0) for c in written), default=0.0),
            pipeline_prefetch=spec.depth,
            pipeline_micro_batches=spec.micro_batches,
            pipeline_staleness=spec.staleness,
            step_captured=any(g.captured for g in st.train_graphs),
        )
        # What the first train and eval steps cost on CUDA beyond a replay (0 on CPU).
        evals = st.evaluation.graphs()
        for name, graphs in (("train", st.train_graphs), ("eval", evals)):
            out[f"{name}_graph_warmup_s"] = sum(g.warmup_s for g in graphs)
            out[f"{name}_graph_capture_s"] = sum(g.capture_s for g in graphs)
            # Kernel variants compiled side by side before the warm-ups, and their time.
            ahead = [g.ahead for g in graphs if g.ahead is not None]
            out[f"{name}_ahead_variants"] = sum(a.variants for a in ahead)
            out[f"{name}_ahead_s"] = sum(a.dry_run_s + a.compile_s for a in ahead)
        if tr.device.type == "cuda":
            out["triton_cache_dir"] = triton_cache_dir()
        return out

    def _comm_fields(
        self, hist: dict[int, dict[str, Any]], best_line: dict[str, Any]
    ) -> dict[str, Any]:
        """The summary's communication: the exchange's capacities, the best epoch's
        bytes, and the cost model's prediction beside epoch 0's measure (P ranks)."""
        tr, out = self.tr, {}
        if tr.spec.distributed:
            caps = tr.exchange.capacities.get("train")
            if caps is not None:
                out["exchange_capacities"] = {
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
                out[key] = best_line[key]
        if tr.predicted_comm is not None:
            out.update(tr.predicted_comm)
            first = hist.get(0, {})
            if "comm_bytes_exchange_per_rank" in first:
                out["comm_bytes_measured_epoch0_per_rank"] = first["comm_bytes_exchange_per_rank"]
                out["comm_bytes_naive_measured_epoch0_per_rank"] = first[
                    "comm_bytes_naive_per_rank"
                ]
        return out
