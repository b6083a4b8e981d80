"""Launcher detection from fabricated environments, host lists, ports, single-process init."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sven.distributed import collectives, launcher, process_group, rendezvous, slurm
from sven.distributed.collectives import barrier_or_die
from sven.distributed.errors import DistError
from sven.distributed.launcher import LaunchInfo, detect_launcher
from sven.distributed.native_log import native_stderr_to
from sven.distributed.process_group import init_distributed
from sven.distributed.rendezvous import host_addresses
from sven.distributed.slurm import (
    expand_hostlist,
    expand_tasks_per_node,
    slurm_node_addr,
    slurm_port,
)
from sven.errors import SvenError, first_line

# An srun task: rank 3 of 6 tasks spread 2(x3) over three nodes, on the second node.
SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "6",
    "SLURM_STEP_NUM_TASKS": "6",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
    "SLURM_JOB_NODELIST": "gpu-[01-03],login1",
    "SLURM_STEP_NODELIST": "gpu-[01-03]",
}


@pytest.fixture(autouse=True)
def _no_scontrol(monkeypatch) -> None:
    """The fabricated jobs' nodes are nowhere: their address is their name."""
    monkeypatch.setattr(
        launcher, "slurm_node_addr", lambda node, environ: (node, f"node name {node}")
    )


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("gpu-[01-02],login1", ["gpu-01", "gpu-02", "login1"]),
        ("node7", ["node7"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("c[8-10]", ["c8", "c9", "c10"]),
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
        ("a, b", ["a", "b"]),
    ],
)
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["n[1-3", "n1-3]", "n[a-b]", "n[3-1]", "n[[1]]"])
def test_expand_hostlist_rejects_malformed(spec: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(spec)


def test_unparseable_nodelist_without_scontrol_is_a_dist_error(monkeypatch) -> None:
    monkeypatch.setattr(slurm.shutil, "which", lambda _: None)
    with pytest.raises(DistError, match="n\\[1-3"):
        detect_launcher({**SRUN, "SLURM_STEP_NODELIST": "n[1-3"})


@pytest.mark.parametrize(
    ("spec", "counts"),
    [("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,3(x2)", [1, 3, 3])],
)
def test_expand_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(spec) == counts


def test_slurm_port() -> None:
    assert slurm_port(123456) == 10000 + 123456 % 20000 == 13456
    assert slurm_port("40000") == 10000
    assert all(10000 <= slurm_port(j) < 30000 for j in range(0, 100000, 997))


def test_single_when_nothing_is_set() -> None:
    info = detect_launcher({})
    assert info == LaunchInfo(launcher="single")
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (0, 1, 0, 1)


def test_torchrun() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "head",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "x",
    }
    info = detect_launcher(env)
    assert info.launcher == "torchrun"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert (info.master_addr, info.master_port, info.node_rank) == ("head", 29400, 1)


def test_torchrun_wins_over_slurm_and_mpi() -> None:
    env = {**SRUN, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "6"}
    env.update(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1234")
    info = detect_launcher(env)
    assert (info.launcher, info.rank, info.world_size) == ("torchrun", 1, 2)
    # A hand-made env:// setup without LOCAL_*: one node.
    assert (info.local_rank, info.local_world_size) == (1, 2)


def test_slurm_srun_task() -> None:
    info = detect_launcher(SRUN)
    assert info.launcher == "slurm"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 6, 1, 2)
    # The step's nodes, not the whole allocation's; master = first node, port from job id.
    assert info.nodes == ("gpu-01", "gpu-02", "gpu-03")
    assert (info.master_addr, info.master_port) == ("gpu-01", 13456)
    assert (info.node_rank, info.job_id) == (1, "123456")


def test_slurm_uneven_tasks_per_node_and_job_nodelist() -> None:
    env = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP_")}
    env.update(
        SLURM_STEP_ID="2",
        SLURM_PROCID="6",
        SLURM_LOCALID="0",
        SLURM_NODEID="3",
        SLURM_NTASKS="7",
        SLURM_TASKS_PER_NODE="2(x3),1",
        SLURM_JOB_NODELIST="node[01-03,07]",
    )
    info = detect_launcher(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (6, 7, 0, 1)
    assert info.nodes == ("node01", "node02", "node03", "node07")
    assert info.master_addr == "node01"


def test_slurm_master_from_environment_overrides() -> None:
    info = detect_launcher({**SRUN, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "23456"})
    assert (info.launcher, info.master_addr, info.master_port) == ("slurm", "10.0.0.9", 23456)
    assert info.master_from == "MASTER_ADDR"


def test_slurm_master_is_the_first_nodes_address(monkeypatch) -> None:
    asked = []

    def node_addr(node: str, environ) -> tuple[str, str]:
        asked.append(node)
        return "10.1.0.7", f"NodeAddr of {node}"

    monkeypatch.setattr(launcher, "slurm_node_addr", node_addr)
    info = detect_launcher(SRUN)
    assert (info.master_addr, info.master_from, asked) == (
        "10.1.0.7",
        "NodeAddr of gpu-01",
        ["gpu-01"],
    )


def _fake_scontrol(tmp_path: Path, monkeypatch, stdout: str, rc: int = 0) -> None:
    """Puts an ``scontrol`` on PATH that prints ``stdout`` (stderr too when failing)."""
    script = tmp_path / "scontrol"
    stream = ">&2" if rc else ""
    script.write_text(f"#!/bin/sh\necho '{stdout}' {stream}\nexit {rc}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize(
    ("stdout", "rc", "expected"),
    [
        ("NodeName=n1 Arch=x86_64 NodeAddr=10.1.0.7 NodeHostName=h1 Port=0", 0,
         ("10.1.0.7", "NodeAddr of n1")),
        # NodeAddr defaults to the name.
        ("NodeName=n1 NodeAddr=n1 NodeHostName=n1", 0, ("n1", "node name n1")),
        ("Node n1 not found", 1, ("n1", "node name n1 (scontrol show node: Node n1 not found)")),
    ],
)  # fmt: skip
def test_slurm_node_addr_asks_scontrol(tmp_path, monkeypatch, stdout, rc, expected) -> None:
    _fake_scontrol(tmp_path, monkeypatch, stdout, rc)
    assert slurm_node_addr("n1", {}) == expected


def test_slurm_node_addr_prefers_aliases_and_falls_back_to_the_name(monkeypatch) -> None:
    aliases = {"SLURM_NODE_ALIASES": "c1:10.0.0.5:c1,c2:[fd00::2]:c2"}
    assert slurm_node_addr("c2", aliases) == ("fd00::2", "NodeAddr of c2 (SLURM_NODE_ALIASES)")
    monkeypatch.setattr(slurm.shutil, "which", lambda _: None)
    assert slurm_node_addr("c3", aliases) == (
        "c3",
        "node name c3 (no scontrol to ask for its NodeAddr)",
    )


def test_unresolvable_master_fails_at_once(monkeypatch) -> None:
    def no_such_host(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(process_group.socket, "getaddrinfo", no_such_host)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "12345"}
    with pytest.raises(
        DistError, match=r"rendezvous host n1:12345 \(MASTER_ADDR\) does not resolve"
    ):
        init_distributed("gloo", environ=env, device="cpu", timeout_s=5)
    assert not dist.is_initialized()


def test_host_addresses_put_interfaces_first_and_loopback_last(monkeypatch) -> None:
    monkeypatch.setattr(
        rendezvous.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0"), (3, "ib0")]
    )
    addrs = {"lo": "127.0.0.1", "eth0": "10.0.0.5", "ib0": None}
    monkeypatch.setattr(rendezvous, "_interface_ipv4", addrs.get)
    monkeypatch.setattr(rendezvous.socket, "gethostname", lambda: "h1")
    # Debian's /etc/hosts maps the host name to 127.0.1.1.
    monkeypatch.setattr(rendezvous.socket, "gethostbyname_ex", lambda h: (h, [], ["127.0.1.1"]))
    assert host_addresses() == ["10.0.0.5", "127.0.1.1", "h1", "127.0.0.1"]


def test_host_addresses_of_this_host() -> None:
    found = host_addresses()
    assert "127.0.0.1" in found and len(found) == len(set(found))


def test_native_stderr_goes_to_the_log_and_python_stderr_stays(tmp_path, capfd) -> None:
    log_path = tmp_path / "logs" / "rank1.log"
    with native_stderr_to(log_path, "rank 1 of 2") as log:
        assert not log.written()
        os.write(2, b"[W socket.cpp] frame #0: c10::Error\n")  # as torch's C++ side does
        print("sven: error: one line", file=sys.stderr)
        assert log.written()
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert err == "sven: error: one line\nafter\n"
    text = log_path.read_text()
    assert text.startswith("== ") and "rank 1 of 2\n" in text
    assert text.endswith("[W socket.cpp] frame #0: c10::Error\n")


def test_native_log_with_nothing_in_it_is_taken_back(tmp_path, capfd) -> None:
    logs = tmp_path / "logs"
    with native_stderr_to(logs / "rank0.log"):
        print("python only", file=sys.stderr)
    assert not logs.exists()
    # An existing log (an earlier start of the job) is left as it was.
    logs.mkdir()
    (logs / "rank0.log").write_text("earlier\n")
    with native_stderr_to(logs / "rank0.log"):
        pass
    assert (logs / "rank0.log").read_text() == "earlier\n"
    assert capfd.readouterr().err == "python only\n"
    # Where no log can be written, stderr stays as it was.
    (tmp_path / "file").write_text("")
    with native_stderr_to(tmp_path / "file" / "logs" / "rank0.log") as log:
        os.write(2, b"native\n")
    assert not log.written() and capfd.readouterr().err == "native\n"


@pytest.mark.parametrize(
    "env",
    [
        # The shell of `salloc -n 2`: an allocation, but no srun step.
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"},
        # An sbatch script: the batch step is not a launch of tasks.
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "batch"},
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
         "SLURM_STEP_ID": str(0xFFFFFFFB)},
        # The interactive step of salloc (LaunchParameters=use_interactive_step).
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
         "SLURM_STEP_ID": str(0xFFFFFFFA)},
    ],
)  # fmt: skip
def test_slurm_allocation_shell_is_single(env: dict[str, str]) -> None:
    assert detect_launcher(env).launcher == "single"


def test_openmpi() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    info = detect_launcher(env)
    assert (info.launcher, info.flavor) == ("mpi", "OpenMPI")
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (2, 4, 0, 2)
    # Agreed on through mpi4py at init.
    assert (info.master_addr, info.master_port) == (None, None)


@pytest.mark.parametrize("flavor", ["MPICH", "Intel MPI"])
def test_hydra_mpich_and_intel_mpi(flavor: str) -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
    if flavor == "Intel MPI":
        env["I_MPI_ROOT"] = "/opt/intel/mpi"
    info = detect_launcher({**env, "MASTER_ADDR": "h0"})
    assert info.launcher == "mpi"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (1, 3, 1, 3)
    assert (info.master_addr, info.master_port) == ("h0", 29500)


def test_pmix_alone_asks_mpi_for_the_rest(monkeypatch) -> None:
    monkeypatch.setattr(launcher, "_mpi_world", lambda: (1, 2, 1, 2))
    info = detect_launcher({"PMIX_RANK": "1"})
    assert (info.launcher, info.flavor) == ("mpi", "PMIx")
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (1, 2, 1, 2)


def test_mpirun_inside_sbatch_is_mpi() -> None:
    # mpirun in a batch script: every rank inherits the batch step's SLURM_PROCID=0.
    env = {**SRUN, "SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "3"}
    env.update(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="3")
    env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "4"
    info = detect_launcher(env)
    assert (info.launcher, info.rank, info.world_size) == ("mpi", 3, 4)


def test_srun_with_pmix_is_slurm() -> None:
    info = detect_launcher({**SRUN, "PMIX_RANK": "3"})
    assert (info.launcher, info.rank, info.world_size) == ("slurm", 3, 6)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside world size 2"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "0"}, "WORLD_SIZE is not set"),
        ({**SRUN, "SLURM_NODEID": "5"}, "SLURM_NODEID=5"),
        ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "tasks per node"),
    ],
)
def test_bad_variables_are_dist_errors(env: dict[str, str], needle: str) -> None:
    with pytest.raises(DistError, match=re.escape(needle)) as err:
        detect_launcher(env)
    assert isinstance(err.value, SvenError)


def test_missing_mpi4py_is_a_clear_error(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_mpi4py(name: str, *args, **kwargs):
        if name.startswith("mpi4py"):
            raise ImportError("No module named 'mpi4py'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpi4py)
    with pytest.raises(DistError, match=r"mpi4py is not installed.*MASTER_ADDR"):
        detect_launcher({"PMIX_RANK": "0"})


def test_single_process_init_makes_no_process_group() -> None:
    with init_distributed(environ={}, device="cpu") as ctx:
        assert not dist.is_initialized()
        assert (ctx.rank, ctx.world_size, ctx.launcher, ctx.backend) == (0, 1, "single", "none")
        assert ctx.is_main and not ctx.distributed
        assert ctx.describe() == "launcher=single backend=none world_size=1 device=cpu"
        barrier_or_die(ctx, "no-op")
        assert collectives.is_main()
        t = collectives.allreduce_sum_(torch.ones(2))
        assert t.tolist() == [1.0, 1.0]
        assert collectives.broadcast_object({"a": 1}) == {"a": 1}


def test_forced_group_of_one_is_created_and_destroyed(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with init_distributed("gloo", environ={}, device="cpu", force_group=True, timeout_s=10) as ctx:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert ctx.describe().startswith("launcher=single backend=gloo world_size=1 device=cpu")
        barrier_or_die(ctx, "alone", timeout_s=5)
        assert collectives.allreduce_sum_(torch.ones(1)).item() == 1.0
        assert os.environ["RANK"] == "0"
    assert not dist.is_initialized()
    assert "RANK" not in os.environ  # the env:// variables it set are put back


def test_existing_group_is_adopted_and_left_to_its_owner() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with init_distributed(environ={"RANK": "0", "WORLD_SIZE": "1"}, device="cpu") as ctx:
            assert (ctx.backend, ctx.distributed) == ("gloo", True)
        assert dist.is_initialized()
        with pytest.raises(DistError, match="launcher says rank 1 of 2"):
            init_distributed(environ={"RANK": "1", "WORLD_SIZE": "2"}, device="cpu")
    finally:
        dist.destroy_process_group()


def test_bad_backend_and_device() -> None:
    with pytest.raises(DistError, match="unknown backend"):
        init_distributed("mpi", environ={}, device="cpu")
    with pytest.raises(DistError, match="needs a CUDA device"):
        init_distributed("nccl", environ={}, device="cpu")


def test_nccl_group_also_carries_gloo_for_host_tensors(monkeypatch) -> None:
    """Under NCCL, collectives on CPU tensors (the partition arrays rank 0 broadcasts,
    object collectives) need a CPU backend in the default group: NCCL alone raises
    "No backend type associated with device type cpu". Checked without a GPU by
    recording what init_distributed asks torch for."""
    assert process_group.group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert process_group.group_backend("gloo") == "gloo"
    asked: dict = {}

    class Stop(Exception):
        pass

    def fake_init(backend, **kwargs):
        asked.update(backend=backend, **kwargs)
        raise Stop

    monkeypatch.setattr(process_group, "_pick_device", lambda device, info: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }
    saved = {k: os.environ.get(k) for k in env}
    try:
        with pytest.raises(Stop):
            init_distributed("nccl", environ=env, device="cuda")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert asked["backend"] == "cpu:gloo,cuda:nccl"
    assert asked["device_id"] == torch.device("cuda", 1)


def test_first_line_of_an_error() -> None:
    assert first_line(RuntimeError("refused\n  frame #0: c10::Error")) == "refused"
    assert first_line(ValueError("  \n")) == "ValueError"


def test_python_m_sven_distributed_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sven.distributed", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "python -m sven.distributed" in out.stdout and "--timeout-s" in out.stdout
    # One process: no group, one line per rank, exit 0.
    env = {"PATH": "/usr/bin:/bin"}
    one = subprocess.run(
        [sys.executable, "-m", "sven.distributed", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert one.returncode == 0, one.stderr
    assert "rank=0 world_size=1" in one.stdout and "allreduce=1" in one.stdout
