"""The ``sven`` command: one entry point, one subcommand per stage of the data flow.

Each stage owns its own parser (``add_parser``) and handler, so this module only
wires them together and turns expected errors into a clean message and exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sven import __version__
from sven.errors import SvenError

# (subcommand, module that defines ``add_parser(subparsers)``); imported lazily so that
# a broken or heavy stage does not slow down or break the others.
_STAGES = (
    ("data", "sven.datasets.cli"),
    ("partition", "sven.partition.cli"),
    ("train", "sven.train_cli"),
    ("eval", "sven.train_cli"),
    ("config", "sven.config_cli"),
    ("plot", "sven.plot"),
    ("env", "sven.env"),
)


def build_parser() -> argparse.ArgumentParser:
    """Builds the top-level parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="sven",
        description="Train memory-based temporal GNNs on event streams, laptop to cluster.",
    )
    parser.add_argument("--version", action="version", version=f"sven {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    seen: set[str] = set()
    for _, module in _STAGES:
        if module in seen:
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


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        rc = args.func(args)
    except SvenError as exc:
        if not exc.quiet:
            print(f"sven: {exc.prefix}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("sven: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
