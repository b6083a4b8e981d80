"""Compatibility module: the names of :mod:`sven.distributed` under their old home.

``sven.dist`` was one module; it is now the package :mod:`sven.distributed`
(``launch``, ``liveness``, ``collectives``). Scripts and tests that import from
``sven.dist`` or run ``python -m sven.dist`` (the launch self-check: every rank joins,
all-reduces and prints one line, e.g. ``srun -n 4 python -m sven.dist``) keep working.

Every name of the three modules, private ones included, is readable here;
setting one here (``monkeypatch.setattr(sven.dist, "slurm_node_addr", fake)``) sets it
in the module that defines and uses it too, so a patch still reaches the code.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from sven.distributed import collectives as _collectives
from sven.distributed import launch as _launch
from sven.distributed import liveness as _liveness
from sven.distributed.collectives import (
    DistError,
    allreduce_sum_,
    barrier_or_die,
    broadcast_object,
    is_main,
)
from sven.distributed.launch import (
    DEFAULT_TIMEOUT_S,
    LAUNCHERS,
    NCCL_GRACE_S,
    DistContext,
    LaunchInfo,
    NativeLog,
    detect_launcher,
    existing_devices,
    expand_hostlist,
    expand_tasks_per_node,
    free_port,
    group_backend,
    host_addresses,
    init_distributed,
    main,
    native_stderr_to,
    slurm_hosts,
    slurm_node_addr,
    slurm_port,
)
from sven.distributed.liveness import Beat, Diagnosis, Liveness, heartbeat_interval, node_name

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LAUNCHERS",
    "NCCL_GRACE_S",
    "Beat",
    "Diagnosis",
    "DistContext",
    "DistError",
    "LaunchInfo",
    "Liveness",
    "NativeLog",
    "allreduce_sum_",
    "barrier_or_die",
    "broadcast_object",
    "detect_launcher",
    "existing_devices",
    "expand_hostlist",
    "expand_tasks_per_node",
    "free_port",
    "group_backend",
    "heartbeat_interval",
    "host_addresses",
    "init_distributed",
    "is_main",
    "main",
    "native_stderr_to",
    "node_name",
    "slurm_hosts",
    "slurm_node_addr",
    "slurm_port",
]

_HOMES = (_launch, _liveness, _collectives)


# Every other name too, private helpers and the modules they use (``socket``) included,
# for the tests that patch or call them through ``sven.dist``. They are copied rather
# than looked up on demand: a patch is undone by writing back what the module's own
# namespace held.
for _home in _HOMES:
    for _name, _value in vars(_home).items():
        if not _name.startswith("__"):
            globals().setdefault(_name, _value)


class _Forwarding(types.ModuleType):
    """Sets a name in every module of :mod:`sven.distributed` that holds it as well."""

    def __setattr__(self, name: str, value: Any) -> None:
        for home in _HOMES:
            if name in vars(home):
                setattr(home, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Forwarding

if __name__ == "__main__":
    sys.exit(main())
