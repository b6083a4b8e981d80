"""SLURM's host lists, node addresses and the job's rendezvous port.

A step's nodes come as a compressed list (``node[01-03,07],gpu5``,
:func:`expand_hostlist`), its tasks per node as ``2(x3),1``
(:func:`expand_tasks_per_node`); the rendezvous is on the first node, at the address
Slurm knows it by (:func:`slurm_node_addr`: a node's name need not resolve), on a port
every task computes alone from the job id (:func:`slurm_port`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from sven.distributed.errors import DistError


def _split_top_level(spec: str) -> list[str]:
    """Splits a Slurm host list on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' at column {i}")
        elif ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("unbalanced '['")
    items.append(spec[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_host(item: str) -> list[str]:
    """Expands one host pattern; several bracket groups give their product."""
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        if "[" in item or "]" in item:
            raise ValueError(f"malformed host pattern {item!r}")
        return [item]
    prefix, body = item[: m.start()], m.group(1)
    suffixes = _expand_host(item[m.end() :])
    out = []
    for part in body.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"malformed range {part!r} in {item!r}")
        if not dash:
            values = [lo]
        else:
            if int(hi) < int(lo):
                raise ValueError(f"descending range {part!r} in {item!r}")
            # Slurm pads to the width of the lower bound: [01-10] -> 01..10, [8-10] -> 8..10.
            values = [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
        out.extend(prefix + v + s for v in values for s in suffixes)
    return out


def expand_hostlist(spec: str) -> list[str]:
    """Expands a Slurm host list such as ``"node[01-03,07],gpu5"``.

    Args:
        spec: The compressed list (``SLURM_JOB_NODELIST`` and friends).

    Returns:
        The host names in order, e.g. ``["node01", "node02", "node03", "node07", "gpu5"]``.

    Raises:
        ValueError: The list is malformed.
    """
    hosts: list[str] = []
    for item in _split_top_level(spec):
        hosts.extend(_expand_host(item))
    return hosts


def slurm_hosts(spec: str) -> list[str]:
    """Expands a Slurm host list, asking ``scontrol`` about forms the parser rejects."""
    try:
        return expand_hostlist(spec)
    except ValueError as err:
        if shutil.which("scontrol") is None:
            raise DistError(f"cannot parse SLURM node list {spec!r}: {err}") from None
        done = subprocess.run(
            ["scontrol", "show", "hostnames", spec], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not done.stdout.split():
            raise DistError(
                f"cannot parse SLURM node list {spec!r}: {err}; scontrol says: "
                f"{done.stderr.strip()}"
            ) from None
        return done.stdout.split()


def _node_aliases(environ: Mapping[str, str]) -> dict[str, str]:
    """Node name -> address from ``SLURM_NODE_ALIASES`` (``name:addr:host,...``).

    Slurm exports it where addresses are assigned at run time (cloud nodes), the one
    case where ``scontrol`` may not know them yet.
    """
    out = {}
    for item in environ.get("SLURM_NODE_ALIASES", "").split(","):
        # An IPv6 address comes in brackets: n1:[fd00::1]:n1.
        m = re.fullmatch(r"\s*([^:\s]+):(\[[^\]]+\]|[^:]+):.*", item)
        if m:
            out[m.group(1)] = m.group(2).strip("[]")
    return out


def slurm_node_addr(node: str, environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """The address that reaches a SLURM node, and where it was found.

    A node's name (what ``SLURM_JOB_NODELIST`` lists) need not resolve: clusters set
    ``NodeAddr`` where the name is not the address, and so does one machine running
    several ``slurmd -N``. Asks ``SLURM_NODE_ALIASES``, then ``scontrol show node``;
    the name itself is the answer where neither knows better.

    Args:
        node: The node's name, e.g. ``"n1"``.
        environ: The environment (for ``SLURM_NODE_ALIASES``).

    Returns:
        ``(address, source)``, e.g. ``("10.1.0.7", "NodeAddr of n1")`` or
        ``("n1", "node name n1")``.
    """
    alias = _node_aliases(environ).get(node)
    if alias:
        return alias, f"NodeAddr of {node} (SLURM_NODE_ALIASES)"
    if shutil.which("scontrol") is None:
        return node, f"node name {node} (no scontrol to ask for its NodeAddr)"
    try:
        done = subprocess.run(
            ["scontrol", "show", "node", "--oneliner", node],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return node, f"node name {node} (scontrol show node: {err})"
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", done.stdout)
    if done.returncode != 0 or m is None:
        why = (done.stderr.strip().splitlines() or ["no NodeAddr"])[-1]
        return node, f"node name {node} (scontrol show node: {why})"
    addr = m.group(1)
    # NodeAddr defaults to the name: then the name is all there is.
    return addr, f"node name {node}" if addr == node else f"NodeAddr of {node}"


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expands Slurm's tasks-per-node form, e.g. ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise DistError(f"cannot parse SLURM tasks per node {spec!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def slurm_port(job_id: int | str) -> int:
    """The rendezvous port of a SLURM job: ``10000 + job_id % 20000``.

    Every task computes it alone, and the range stays clear of the ephemeral ports
    (32768 and up) that the kernel hands out to outgoing connections.
    """
    return 10000 + int(job_id) % 20000
