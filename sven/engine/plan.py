"""A run's plan: what it needs in GPU memory, host memory and disk, checked before any
work.

:func:`plan_run` counts, from the store's shape, the model's widths and the config, the
bytes each part of a run holds at its peak (node state, event tables, the sampler's
index, per-node indexes, evaluation tables, the model, checkpoints kept on disk),
picks the node-state tier (``state.device=auto``: the GPU when the run fits its budget,
else host memory, else files; named where the state lives: ``host`` on a CPU run,
:func:`~sven.models.names.resolve_tier`), and :meth:`Plan.check` refuses a run that does not fit,
in one line naming the numbers and the setting to change. ``sven train --dry-run``
prints the plan (:meth:`Plan.describe`) and stops.

The counts are estimates of the large items (what grows with nodes and events), not
of every small buffer; each budget keeps a margin for the rest.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sven.errors import ConfigError
from sven.models.names import resolve_tier

__all__ = ["Plan", "dry_run", "node_row_bytes", "plan_for", "plan_run"]

GB = 1e9
# What a budget of 0 leaves to everything the plan does not count.
_GPU_MARGIN = 0.95
_HOST_MARGIN = 0.90


def node_row_bytes(memory_dim: int, mail_dim: int, mailbox: int, itemsize: int) -> int:
    """Bytes of one node's state: memory, last update, the mailbox with its times and
    flags."""
    return memory_dim * itemsize + 8 + mailbox * (mail_dim * itemsize + 8 + 1)


@dataclass
class Item:
    """One part of a run and the bytes it holds where."""

    what: str
    gpu: int = 0
    host: int = 0
    disk: int = 0


@dataclass
class Plan:
    """What a run needs and where it has room.

    Attributes:
        tier: The node-state tier (``gpu``, ``host`` or ``disk``).
        items: The parts counted.
        budgets: ``gpu``, ``host``, ``disk`` -> bytes the run may use (``None``: no such
            device).
        device: The compute device's type.
        state_bytes: This rank's node state.
        disk_path: Where checkpoints go (its free space is the disk budget).
        hot_rows: The most node rows the host tier keeps copies of in GPU memory
            (``state.hot_rows``; 0 in the other tiers and without a GPU).
    """

    tier: str
    items: list[Item]
    budgets: dict[str, int | None]
    device: str
    state_bytes: int
    disk_path: Path
    notes: list[str] = field(default_factory=list)
    hot_rows: int = 0

    def total(self, where: str) -> int:
        """Bytes needed in ``gpu``, ``host`` or ``disk``."""
        return sum(getattr(i, where) for i in self.items)

    def _largest(self, where: str, k: int = 3) -> str:
        top = sorted(self.items, key=lambda i: -getattr(i, where))[:k]
        return ", ".join(f"{i.what} {_gb(getattr(i, where))}" for i in top if getattr(i, where))

    def shortfall(self) -> str | None:
        """The first budget the run exceeds, as one line, or None when it fits."""
        hints = {
            "gpu": "set state.device=host (node state in host memory) or raise state.gpu_budget_gb",
            "host": "set state.device=disk (node state in files), or raise state.host_budget_gb",
            "disk": "free space, lower train.keep_latest_k, or set out= on a larger disk",
        }
        names = {"gpu": "GPU memory", "host": "host memory", "disk": f"disk at {self.disk_path}"}
        for where in ("gpu", "host", "disk"):
            have = self.budgets.get(where)
            need = self.total(where)
            if have is None or need <= have:
                continue
            hint = hints[where]
            if where == "gpu" and self.tier != "gpu":
                hint = "raise state.gpu_budget_gb or lower train.batch_size"
            if where == "host" and self.tier == "disk":
                hint = "raise state.host_budget_gb"
            return (
                f"the run needs {_gb(need)} of {names[where]} ({self._largest(where)}) but "
                f"{_gb(have)} {'is' if where == 'disk' else 'are'} available: {hint}"
            )
        return None

    def check(self) -> None:
        """Refuses a run that does not fit a budget.

        Raises:
            ConfigError: One line: what is needed, what is available, what to change.
        """
        short = self.shortfall()
        if short is not None:
            raise ConfigError(short)

    def describe(self) -> str:
        """The plan as ``sven train --dry-run`` prints it."""
        rows = [f"node state: {self.tier} tier, {_gb(self.state_bytes)} on this rank"]
        rows.append(f"{'':30s} {'GPU':>10s} {'host':>10s} {'disk':>10s}")
        for i in self.items:
            if i.gpu or i.host or i.disk:
                rows.append(
                    f"{i.what:30s} {_cell(i.gpu):>10s} {_cell(i.host):>10s} {_cell(i.disk):>10s}"
                )
        rows.append(
            f"{'total':30s} {_cell(self.total('gpu')):>10s} {_cell(self.total('host')):>10s} "
            f"{_cell(self.total('disk')):>10s}"
        )
        rows.append(
            f"{'available':30s} {_cell(self.budgets.get('gpu')):>10s} "
            f"{_cell(self.budgets.get('host')):>10s} {_cell(self.budgets.get('disk')):>10s}"
        )
        rows.extend(self.notes)
        short = self.shortfall()
        rows.append("fits" if short is None else f"does not fit: {short}")
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        """The plan's numbers (``summary.json``'s ``plan``)."""
        return {
            "state_tier": self.tier,
            "state_bytes": self.state_bytes,
            "need": {w: self.total(w) for w in ("gpu", "host", "disk")},
            "budgets": self.budgets,
            "hot_rows_max": self.hot_rows,
        }


def _gb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GB:.2f} GB"


def _cell(n: int | None) -> str:
    return "-" if not n else f"{n / GB:.2f} GB"


def _available_host() -> int:
    """MemAvailable (Linux), else the physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _free_disk(path: Path) -> int:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _on(where: str, what: str, nbytes: int) -> Item:
    """An item of ``nbytes`` in ``where`` (gpu, host or disk)."""
    return Item(what, **{where: int(nbytes)})


def _fixed_items(
    cfg: Any, e: int, n: int, n_all: int, p: int, dims: tuple[int, int, int, int], cuda: bool
) -> list[Item]:
    """What a run holds besides node state and checkpoints: the event tables, the
    sampler's index, per-node indexes, node features, evaluation tables, the step and
    the process (``dims``: edge width, node width, a state row's bytes, itemsize)."""
    tc, mc = cfg.train, cfg.model
    edge_dim, node_dim, row, itemsize = dims
    compute = "gpu" if cuda else "host"
    items: list[Item] = []
    # The event tables on the device: ids and times widened to 64 bits, the edge
    # features, the rank of every event; the sampler's T-CSR (each event twice: id,
    # event, time) and its transient build (sorts and permutations of 2E entries).
    events = e * (8 + 8 + 8 + 8) + e * edge_dim * itemsize
    items.append(_on(compute, "event tables", events))
    sampler = 48 * e + 8 * (n_all + 1) if mc.num_neighbors else 0
    items.append(_on(compute, "sampler index", sampler + 64 * e))
    # Per-node indexes: owner, owned rows, candidates, winners; on P ranks the
    # exchange's owner/local maps and winners over every vertex.
    per_node = 8 * 4 * (n_all + 1) + (8 * 5 * (n_all + 1) if p > 1 else 0)
    items.append(_on(compute, "per-node indexes", per_node))
    if node_dim:
        items.append(_on(compute, "node features", n * node_dim * itemsize))
    # Evaluation: each of val and test holds a negatives table and its copy, and a
    # scores table, of (rows, 1 + width) for about 15% of the events each.
    width = 1 + (cfg.eval.mrr_negatives or 0) + (2 if cfg.eval.all_protocols else 0)
    items.append(_on(compute, "evaluation tables", 2 * int(0.16 * e) * (1 + width) * 3 * 8))
    # The step: its batch of B events, their negatives and sampled neighbours' rows
    # (state rows and embeddings), a few times over for the backward and the ring.
    slots = tc.batch_size * (2 + tc.num_neg) * (1 + mc.num_neighbors)
    step = slots * (row + 16 * mc.embed_dim * itemsize) * (2 + cfg.pipeline.prefetch)
    items.append(_on(compute, "step and prefetch ring", step + (64 << 20)))
    # The process itself (torch and CUDA's libraries, the Python heap).
    items.append(_on("host", "process", (3 << 30) if cuda else (1 << 30)))
    return items


def plan_run(
    cfg: Any,
    *,
    num_events: int,
    num_nodes: int,
    edge_dim: int,
    node_dim: int,
    mail_dim: int,
    mailbox_size: int,
    world_size: int,
    device: torch.device,
    writes: bool = True,
) -> Plan:
    """The plan of a run (:class:`Plan`); ``cfg.state.device=auto`` resolved.

    Args:
        cfg: The run's config.
        num_events: E, the store's events.
        num_nodes: N, its nodes.
        edge_dim: Edge feature width.
        node_dim: Node feature width.
        mail_dim: The model's mail width.
        mailbox_size: The model's mailbox slots.
        world_size: P ranks.
        device: The compute device.
        writes: Whether the run writes checkpoints (a trainer built to evaluate or
            replay a saved model writes none).
    """
    tc, mc, sc = cfg.train, cfg.model, cfg.state
    e, p = int(num_events), max(int(world_size), 1)
    n_all = int(num_nodes)
    # A rank's rows: all of them on one process; about N / P on P ranks (the
    # partition balances events, not vertices: a margin of 10%).
    n = n_all if p == 1 else int(n_all / p * 1.1) + 1
    itemsize = 8 if tc.dtype == "float64" else 4
    row = node_row_bytes(mc.memory_dim, mail_dim, mailbox_size, itemsize)
    state = (n + 1) * row
    cuda = device.type == "cuda"
    items = _fixed_items(cfg, e, n, n_all, p, (edge_dim, node_dim, row, itemsize), cuda)
    tier = sc.device
    budgets: dict[str, int | None] = {
        "gpu": None,
        "host": int(sc.host_budget_gb * GB) or int(_available_host() * _HOST_MARGIN),
    }
    if cuda:
        free = torch.cuda.mem_get_info(device)[0]
        budgets["gpu"] = int(sc.gpu_budget_gb * GB) or int(free * _GPU_MARGIN)
    out = Path(cfg.out)
    budgets["disk"] = _free_disk(out)
    notes: list[str] = []
    if tier == "auto":
        fixed_gpu = sum(i.gpu for i in items)
        fixed_host = sum(i.host for i in items)
        if cuda and fixed_gpu + state <= budgets["gpu"]:  # type: ignore[operator]
            tier = "gpu"
        elif fixed_host + state <= budgets["host"]:  # type: ignore[operator]
            tier = "host"
        else:
            tier = "disk"
        notes.append(f"state.device=auto chose {tier}")
    elif resolve_tier(tier, device.type) != tier:
        notes.append(f"state.device={tier} is host memory on a run without a GPU: tier host")
    tier = resolve_tier(tier, device.type)
    hot = _place_state(tier, cuda, sc.hot_rows, (n, row, state), budgets["gpu"], items, notes)
    # Checkpoints: each holds the node state once (best/ links the latest's files);
    # alive at once: the kept ones, the one being written, and a best model older than
    # all of them.
    per_epoch = 1 + (
        (-(-e // tc.batch_size) - 1) // tc.checkpoint_every if tc.checkpoint_every else 0
    )
    saves = max(1, tc.epochs * per_epoch)
    kept = min(saves, tc.keep_latest_k + 2)
    if writes:
        items.append(_on("disk", f"checkpoints ({kept} at once)", kept * (state + (8 << 20))))
    return Plan(tier, items, budgets, device.type, state, out, notes, hot_rows=hot)


def _place_state(
    tier: str,
    cuda: bool,
    hot_rows: int,
    sizes: tuple[int, int, int],
    gpu_budget: int | None,
    items: list[Item],
    notes: list[str],
) -> int:
    """Adds the node state's item to ``items`` (and the hot rows' copies, where the
    host tier keeps them; a note in ``notes``); returns the most hot rows (0: none).

    Args:
        sizes: (the rank's rows n, bytes a row, the state's bytes).
    """
    n, row, state = sizes
    if tier == "gpu":
        items.append(_on("gpu", "node state", state))
        return 0
    if tier != "host":
        items.append(_on("disk", "node state (files)", state))
        return 0
    items.append(_on("host", "node state (pinned)" if cuda else "node state", state))
    # Auto keeps copies only beside a GPU; a count asked for is kept anywhere (on a CPU
    # run beside the tables, as the tests run them).
    hot = _hot_rows(hot_rows, n, row, gpu_budget, items) if cuda or hot_rows > 0 else 0
    if hot:
        # The copies, their scratch row and the (N + 1,) int32 slot table.
        where = "gpu" if cuda else "host"
        items.append(_on(where, "hot node rows (copies)", (hot + 1) * row + 4 * (n + 1)))
        notes.append(f"state.hot_rows: at most {hot:,} rows kept beside the compute")
    return hot


def _hot_rows(setting: int, n: int, row: int, budget: int | None, items: list[Item]) -> int:
    """The most rows of the host tier's hot copies: ``setting`` (``state.hot_rows``) up
    to the rank's ``n`` rows; auto (-1) as many as half of the GPU budget left by
    ``items`` holds (a second half stays for what the plan does not count)."""
    if setting >= 0:
        return min(setting, n)
    room = (budget or 0) - sum(i.gpu for i in items) - 4 * (n + 1)
    return max(0, min(n, room // 2 // row))


def plan_for(
    cfg: Any, events: Any, world_size: int, device: torch.device, writes: bool = True
) -> Plan:
    """The plan (:func:`plan_run`) of a run of ``cfg`` on an opened store: the model's
    widths from a model built on the CPU (cheap: parameters only)."""
    from sven.models import model_from_config

    mc = cfg.model
    edge_dim = 0 if events.edge_feat is None else int(events.edge_feat.shape[1])
    node_dim = 0 if events.node_feat is None else int(events.node_feat.shape[1])
    with torch.random.fork_rng(devices=[]):
        # Its initialisation draws nothing from the run's generator.
        probe = model_from_config(mc, edge_dim=edge_dim, node_dim=node_dim)
    return plan_run(
        cfg,
        num_events=int(events.num_events),
        num_nodes=int(events.num_nodes),
        edge_dim=edge_dim,
        node_dim=node_dim,
        mail_dim=probe.mail_dim,
        mailbox_size=probe.mailbox_size,
        world_size=world_size,
        device=device,
        writes=writes,
    )


def dry_run(config: Any, overrides: list[str] | None = None) -> Plan:
    """The plan of a run without running it (``sven train --dry-run``): the store is
    opened (not read), the device and the ranks are those a run would get here.

    Args:
        config: A :class:`~sven.config.Config`, or what :func:`~sven.config.load_config`
            reads (a preset's path, or None for the defaults).
        overrides: Dotted ``key=value`` overrides, where ``config`` is not a Config.
    """
    from sven.config import Config, load_config
    from sven.datasets.synth import default_dataset_shape
    from sven.distributed.launcher import detect_launcher
    from sven.distributed.process_group import _pick_device
    from sven.engine.data import Data

    cfg = config if isinstance(config, Config) else load_config(config, overrides)
    info = detect_launcher(os.environ)
    device = _pick_device(cfg.train.device, info)
    # The built-in dataset not generated yet: planned from its shape, not written.
    events = None if cfg.data.path else default_dataset_shape()
    if events is None:
        events = Data(
            cfg,
            rank=0,
            world_size=info.world_size,
            device=device,
            dtype=torch.float32,
            agree=lambda value: value,
            load=False,
        ).events
    return plan_for(cfg, events, info.world_size, device)
