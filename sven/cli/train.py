"""``sven train`` and ``sven eval``: thin entry points over :class:`sven.Trainer`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sven.cli.config import KeysHelpFormatter, config_help
from sven.errors import ConfigError, Stopped, SvenError

if TYPE_CHECKING:
    from sven.config import Config


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers the ``train`` and ``eval`` subcommands."""
    p = sub.add_parser(
        "train",
        help="train a model (defaults: TGN on the built-in synthetic dataset)",
        description="Train a memory-based TGNN. Overrides are dotted key=value pairs, e.g. "
        "data.path=stores/uci model.name=jodie train.epochs=10 out=runs/uci-jodie.",
        epilog=config_help,  # type: ignore[arg-type]  # built when shown (KeysHelpFormatter)
        formatter_class=KeysHelpFormatter,
    )
    p.add_argument("--config", help="YAML preset (e.g. configs/tgn.yaml)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what the run needs in GPU memory, host memory and disk, and where "
        "node state would live (state.device), then stop; nothing is read or written",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.set_defaults(func=_train)

    e = sub.add_parser(
        "eval",
        help="re-evaluate a saved model on val/test",
        description="Scores a saved model on the store it was trained on (or, with "
        "--other-store, on another one given as data.path=...); writes nothing.",
    )
    e.add_argument(
        "--checkpoint", required=True, help="a run folder (its best model) or a step-N folder"
    )
    e.add_argument("--json", action="store_true", help="print the metrics as JSON")
    e.add_argument(
        "--other-store", action="store_true",
        help="score the model on a store other than the one it was trained on (data.path=...; "
        "same feature widths); its memory is re-played from that store, and the output says so",
    )  # fmt: skip
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    e.set_defaults(func=_eval)


#: Seconds of silent start-up after which ``sven train`` says what it is doing.
SLOW_START_S = 3.0
#: Rank variables of the launchers: a rank other than 0 keeps quiet.
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


@contextlib.contextmanager
def slow_start_notice(quiet: bool, after_s: float = SLOW_START_S) -> Iterator[threading.Timer]:
    """Within the block, a line on stderr once ``after_s`` seconds have passed.

    The first ``import torch`` of a fresh environment compiles thousands of modules
    (a minute on a small machine) before the run prints anything; a user should not
    mistake that for a hang. Said by rank 0 only, and not with ``quiet``.
    """
    rank = next((os.environ[v] for v in _RANK_VARS if v in os.environ), "0")

    def say() -> None:
        print(
            "sven train: loading torch and the models (a first start in a fresh "
            "environment compiles them: up to a minute)...",
            file=sys.stderr,
            flush=True,
        )

    timer = threading.Timer(after_s, say)
    timer.daemon = True
    if not quiet and rank == "0":
        timer.start()
    try:
        yield timer
    finally:
        timer.cancel()


def _train(args: argparse.Namespace) -> int:
    from sven.engine import gcpause

    # The collector off over the imports and the build, to the first step (gcpause).
    gcpause.pause()
    try:
        return _train_paused(args)
    finally:
        gcpause.resume()


def _train_paused(args: argparse.Namespace) -> int:
    from sven.config import load_config
    from sven.config.paths import command_config

    quiet = args.quiet or "quiet=true" in args.overrides
    with slow_start_notice(quiet):
        from sven.distributed.collectives import DistError
        from sven.distributed.launcher import detect_launcher
        from sven.distributed.liveness import node_name
        from sven.distributed.native_log import native_stderr_to
        from sven.engine.trainer import Trainer  # noqa: F401 - the rest of the long import

    overrides = list(args.overrides)
    if args.quiet:
        overrides.append("quiet=true")
    info = detect_launcher()
    try:
        # Every path the user gave resolved and checked first (nothing read or written).
        cfg = command_config(load_config(args.config, overrides), writes=not args.dry_run)
    except SvenError as err:
        # Every rank reads the same command line: one rank says it, once.
        err.quiet = info.rank != 0
        raise
    if args.dry_run:
        from sven.engine.plan import dry_run

        plan = dry_run(cfg)
        print(plan.describe())
        return 0 if plan.shortfall() is None else 2
    if info.world_size == 1:
        return _fit(cfg)
    # On several ranks, torch's C++ side writes a failed rendezvous, a dead peer or a
    # lost store to stderr with C++ frames; the terminal gets one `sven:` line instead.
    out = Path(cfg.out)
    log_path = out / "logs" / f"rank{info.rank}.log"
    header = f"{info.launcher} rank {info.rank} of {info.world_size} on node {node_name()}"
    try:
        with native_stderr_to(log_path, header) as log:
            try:
                return _fit(cfg)
            except DistError as err:
                if log.written():
                    err.args = (f"{err} (details: {log.path})",)
                raise
    except BaseException:
        # The folders this launch made for its logs, where nothing came of them (the
        # ranks start together: which of them made the folder, none can tell).
        for folder in (log_path.parent, out):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only where empty
        raise


def _fit(cfg: Config) -> int:
    from sven.engine.loop import STOP_SIGNALS
    from sven.engine.startup import StartupClock, process_age_s
    from sven.engine.trainer import Trainer

    if cfg.task == "node_classification":
        from sven.engine.run_folder import fmt
        from sven.tasks.nodeclass import NodeClassification

        summary = NodeClassification(cfg).fit()
        if summary.get("rank", 0) != 0:
            return 0
        print(
            f"{summary['model']} on {summary['dataset']}: node classification test AUC "
            f"{fmt(summary['test_auc'])} (val {fmt(summary['val_auc'])})"
        )
        return 0

    # The start-up clock counts from process start: the imports are the user's wait too.
    trainer = Trainer(cfg, startup=StartupClock(process_age_s()))
    try:
        summary = trainer.fit()
    except Stopped:
        # The checkpoint is written and fit() has put the old handlers back. A late
        # SIGTERM (srun ends the other tasks of a step with one as soon as one task
        # exits non-zero) must not turn this exit code into a death by signal.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        raise
    if trainer.rank != 0:
        return 0
    from sven.engine.run_folder import fmt

    print(
        f"{summary['model']} on {summary['dataset']}: test AP {fmt(summary['test_ap'])} "
        f"AUC {fmt(summary['test_auc'])} | inductive AP {fmt(summary['test_ap_inductive'])} "
        f"AUC {fmt(summary['test_auc_inductive'])} | "
        f"{summary['train_events_per_s']:.0f} train events/s"
    )
    return 0


def _say_fallback(given: Path, folder: Path) -> None:
    """A run folder whose ``best/`` holds no model stands for its latest checkpoint;
    a note says so before any score (the scores are not the best model's)."""
    best = given / "best"
    if best.is_dir() and best not in folder.parents:
        print(
            f"sven: note: {best} holds no model (the run stopped before its first "
            f"validation); evaluating its latest checkpoint, {folder}",
            file=sys.stderr,
            flush=True,
        )


def _eval(args: argparse.Namespace) -> int:
    from sven.config import checkpoint_fixed, load_config
    from sven.config.load import config_overrides
    from sven.config.paths import recorded_config
    from sven.distributed.launcher import detect_launcher
    from sven.engine.checkpoint import find_checkpoint, load_file
    from sven.engine.run_folder import finite_or_none
    from sven.engine.store_check import check_store_first
    from sven.engine.trainer import Trainer

    folder = find_checkpoint(args.checkpoint)
    st = load_file(folder / "state.pt")
    if not isinstance(st, dict) or not isinstance(st.get("config"), dict):
        raise SvenError(f"{folder / 'state.pt'}: not a Sven checkpoint (no config in it)")
    # The run's paths as its run meant them, from wherever this command runs.
    cfg = recorded_config(st, folder, detect_launcher().world_size)
    if cfg.task == "node_classification":
        raise SvenError(
            f"{folder} is a node-classification run: its AUCs are in its summary.json; "
            f"sven eval evaluates link prediction (its encoder: {st.get('encoder', '?')})"
        )
    overrides = [*config_overrides(cfg, []), "train.resume=false", *args.overrides]
    current = load_config(None, overrides)
    fixed = checkpoint_fixed(cfg, current)
    if fixed:
        keys = ", ".join(k.split(" ")[0] for k in fixed)
        err = ConfigError(
            f"{keys} cannot change at evaluation: the saved model {folder} has its own "
            f"({'; '.join(fixed)}); drop the override"
        )
        err.quiet = detect_launcher().rank != 0  # every rank finds it; one says it
        raise err
    if detect_launcher().rank == 0:
        _say_fallback(Path(args.checkpoint), folder)
    # The store before any work (the trainer loads, verifies and tabulates it).
    check_store_first(st, current, folder, other_store=args.other_store)
    trainer = Trainer(cfg, overrides, purpose="eval")
    try:
        res = finite_or_none(trainer.evaluate_checkpoint(folder, other_store=args.other_store))
    finally:
        # The node state's scratch (the disk tier's temporary folder) goes now.
        trainer.memory.close()
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0
