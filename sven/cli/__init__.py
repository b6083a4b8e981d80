"""The ``sven`` command: one entry point, one subcommand per stage of the data flow.

Each stage owns its own parser (``add_parser``) and handler, so this module only
wires them together and turns expected errors into a clean message and exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence

from sven import __version__
from sven.errors import SvenError, Terminated

#: Seconds a rank whose error another rank reports waits before it exits.
QUIET_EXIT_WAIT_S = 3.0

# (subcommand, module that defines ``add_parser(subparsers)``); imported lazily so that
# a broken or heavy stage does not slow down or break the others.
_STAGES = (
    ("data", "sven.datasets.cli"),
    ("partition", "sven.partition.cli"),
    ("train", "sven.cli.train"),
    ("eval", "sven.cli.train"),
    ("predict", "sven.cli.predict"),
    ("embed", "sven.cli.predict"),
    ("config", "sven.cli.config"),
    ("plot", "sven.cli.plot"),
    ("env", "sven.cli.env"),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Builds the top-level parser.

    Args:
        command: A subcommand: only its stage's parser is built (what ``sven COMMAND
            ...`` needs, so that ``sven train`` does not import the other stages:
            plotting, ``sven env``'s package metadata, the synthetic generator). None,
            or a name no stage has, builds every subcommand (``sven --help``, and the
            usage error of a misspelt command, list them all).
    """
    parser = argparse.ArgumentParser(
        prog="sven",
        description="Train memory-based temporal GNNs on event streams, laptop to cluster.",
    )
    parser.add_argument("--version", action="version", version=f"sven {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    seen: set[str] = set()
    only = {m for name, m in _STAGES if name == command}
    for _, module in _STAGES:
        if module in seen or (only and module not in only):
            continue
        seen.add(module)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            # Only tolerate the stage module itself being absent, never a missing dependency.
            if exc.name != module:
                raise
            continue
        mod.add_parser(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv``, letting ``KEY=VALUE`` overrides and flags mix in any order.

    argparse gives a ``nargs="*"`` positional only the first run of values, so that
    ``sven train a=1 --quiet b=2`` would leave ``b=2`` unrecognised. Left-over items
    of the form ``KEY=VALUE`` are appended to ``overrides`` (keeping their order, so
    the last one still wins); anything else is an error as before.
    """
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all(
            "=" in item and not item.startswith("-") for item in extra
        ):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def waits_for_the_reporter(exc: SvenError) -> bool:
    """Whether a rank whose error ``exc`` another rank reports waits before it exits.

    torchrun stops every rank once one exits with an error: a quiet rank leaving first
    could end the reporting rank before its line is written, so under torchrun it
    leaves :data:`QUIET_EXIT_WAIT_S` later. Not for a stop with a checkpoint, whose
    exit code (75) the ranks give together, nor under srun or mpirun, whose step exit
    code a rank killed while it waits would change (``slurm/train.sbatch`` requeues
    on it).
    """
    from sven.distributed.launcher import detect_launcher
    from sven.errors import Stopped

    return not isinstance(exc, Stopped) and detect_launcher().launcher == "torchrun"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the process exit code (see :mod:`sven.errors`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The subcommand is the first argument (options of its own come after it).
    parser = build_parser(argv[0] if argv else None)
    args = parse(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        rc = args.func(args)
        # Inside the try: output still buffered for a closed pipe fails here.
        sys.stdout.flush()
    except SvenError as exc:
        if not exc.quiet:
            print(f"sven: {exc.prefix}{exc}", file=sys.stderr)
        elif waits_for_the_reporter(exc):
            time.sleep(QUIET_EXIT_WAIT_S)
        return exc.exit_code
    except BrokenPipeError:
        # The reader went away (`sven data info STORE | head`): as a tool killed by
        # SIGPIPE would, stop quietly. Output still buffered must not fail again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Terminated as exc:
        print(f"sven: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("sven: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
