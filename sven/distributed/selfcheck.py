"""The self-check of a launch, ``python -m sven.distributed``: every rank joins,
all-reduces and prints one line (e.g. ``srun -n 4 python -m sven.distributed``).
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence

import torch

from sven.distributed.collectives import allreduce_sum_, barrier_or_die
from sven.distributed.process_group import init_distributed
from sven.errors import SvenError


def main(argv: Sequence[str] | None = None) -> int:
    """Self-check of a launch: join, all-reduce, print one line per rank."""
    parser = argparse.ArgumentParser(prog="python -m sven.distributed", description=main.__doc__)
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        with init_distributed(args.backend, timeout_s=args.timeout_s, device=args.device) as ctx:
            if ctx.is_main:
                print(ctx.describe(), flush=True)
            total = allreduce_sum_(torch.full((1,), ctx.rank + 1.0, device=ctx.device))
            # A host tensor too: under NCCL it must find the group's gloo side.
            host = allreduce_sum_(torch.full((1,), ctx.rank + 1.0))
            barrier_or_die(ctx, "sven.distributed self-check")
            expected = ctx.world_size * (ctx.world_size + 1) / 2
            print(
                f"rank={ctx.rank} world_size={ctx.world_size} local_rank={ctx.local_rank} "
                f"local_world_size={ctx.local_world_size} launcher={ctx.launcher} "
                f"host={socket.gethostname()} allreduce={total.item():g}",
                flush=True,
            )
            return 0 if total.item() == host.item() == expected else 1
    except SvenError as err:
        print(f"sven.distributed: error: {err}", file=sys.stderr)
        return err.exit_code
