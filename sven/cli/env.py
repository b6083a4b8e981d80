"""``sven env``: what Sven finds on this machine, for bug reports and cluster set-up.

Versions (Python, torch and its CUDA, triton, torch_geometric, mpi4py, numpy), the
``torch.distributed`` backends this torch build has (gloo, NCCL, MPI), the GPUs, and
the launch this process would join: the launcher and rank that
:func:`sven.distributed.launcher.detect_launcher` reads from the environment, the same
function ``sven train`` uses. ``sven env --json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
from importlib import metadata
from typing import Any

from sven import __version__

# Distribution names whose versions are reported; read from the installed metadata,
# so that reporting never imports (or initialises) them.
PACKAGES = ("torch", "numpy", "torch_geometric", "triton", "mpi4py", "matplotlib", "tensorboard")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Collects the report.

    Returns:
        A JSON-serialisable dict with keys ``sven``, ``python``, ``platform``,
        ``packages`` (name -> version or None), ``cuda`` (torch's CUDA version, None
        on a CPU build), ``cuda_available``, ``backends`` (``gloo``, ``nccl``, ``mpi``:
        whether torch.distributed has them), ``mpirun`` (its path or None), ``gpus``
        (``index``, ``name``, ``memory_gib``, ``capability``), ``cpus``,
        ``torch_threads`` and ``launch`` (the detected launch, or ``{"error": ...}``).
    """
    import torch
    import torch.distributed as dist

    from sven.distributed.collectives import DistError
    from sven.distributed.launcher import detect_launcher

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "index": i,
                    "name": props.name,
                    "memory_gib": round(props.total_memory / 2**30, 1),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
    available = dist.is_available()
    backends = {
        "gloo": available and dist.is_gloo_available(),
        "nccl": available and dist.is_nccl_available(),
        "mpi": available and dist.is_mpi_available(),
    }
    try:
        launch: dict[str, Any] = dataclasses.asdict(detect_launcher(os.environ))
    except DistError as exc:
        launch = {"error": str(exc)}
    return {
        "sven": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "backends": backends,
        "mpirun": shutil.which("mpirun") or shutil.which("mpiexec"),
        "gpus": gpus,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "launch": launch,
    }


def format_environment(env: dict[str, Any]) -> str:
    """The report as aligned ``key: value`` lines."""
    pk = env["packages"]

    def ver(name: str) -> str:
        return pk.get(name) or "not installed"

    cuda = env["cuda"] or "none (CPU build of torch)"
    if env["cuda"] and not env["cuda_available"]:
        cuda += " (no usable GPU)"
    gpus = [f"{g['index']}: {g['name']}, {g['memory_gib']} GiB" for g in env["gpus"]] or ["none"]
    on = [b for b, ok in env["backends"].items() if ok]
    launch = env["launch"]
    if "error" in launch:
        who = f"error: {launch['error']}"
    else:
        who = (
            f"{launch['launcher']}"
            + (f" ({launch['flavor']})" if launch["flavor"] else "")
            + f": rank {launch['rank']} of {launch['world_size']}, local rank "
            f"{launch['local_rank']} of {launch['local_world_size']}"
        )
        if launch["master_addr"]:
            who += f", rendezvous {launch['master_addr']}:{launch['master_port']}"
        if launch["job_id"]:
            who += f", job {launch['job_id']}"
    rows = [
        ("sven", env["sven"]),
        ("python", f"{env['python']} ({env['platform']})"),
        ("torch", ver("torch")),
        ("CUDA", cuda),
        ("triton", ver("triton")),
        ("torch_geometric", ver("torch_geometric")),
        ("mpi4py", ver("mpi4py")),
        ("numpy", ver("numpy")),
        ("matplotlib", ver("matplotlib") + "  (sven plot)"),
        ("tensorboard", ver("tensorboard") + "  (log.tensorboard)"),
        ("backends", ", ".join(on) or "none"),
        ("mpirun", env["mpirun"] or "not found"),
        ("CPUs", f"{env['cpus']} (torch threads {env['torch_threads']})"),
        ("GPUs", gpus[0]),
        *(("", g) for g in gpus[1:]),
        ("launch", who),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers the ``env`` subcommand."""
    p = sub.add_parser(
        "env",
        help="versions, distributed backends, GPUs and the detected launcher",
        description="Report what Sven finds here: package versions, torch.distributed "
        "backends, GPUs, and the launcher and rank this process would join with.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_env)


def _env(args: argparse.Namespace) -> int:
    env = environment()
    print(json.dumps(env, indent=2) if args.json else format_environment(env))
    return 0
