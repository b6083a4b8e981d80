"""A real SLURM cluster on localhost, and helpers to run ``sven train`` jobs.

:func:`local_cluster` starts ``munged``, ``slurmctld`` and ``slurmd`` from Debian's
``munge`` and ``slurm-wlm`` packages with a generated ``slurm.conf``:
``proctrack/linuxproc`` and ``task/none`` (no cgroups needed), every key, socket, pid
file, spool and log in one temporary folder and the daemons on free ports, so it
touches nothing of the machine's own setup and two test sessions on one host do not
meet. Client commands find it through ``SLURM_CONF`` (:attr:`Cluster.env`). The
daemons are stopped by PID on exit.

One node is this host under its own name. Several nodes (``nodes=2``) are ``n1``,
``n2``, ...: one ``slurmd -N nK`` each on its own port, all with ``NodeAddr=127.0.0.1``,
so that the node names resolve nowhere, as on clusters whose node names are not
their addresses. A node can be lost (:meth:`Cluster.lose_node`: its ``slurmd``, its
step daemons and its tasks killed at once) and brought back.

The launch helpers and fixtures below it (``slurm``, ``tiny_store``, ``reference``;
:func:`sven_env`, :func:`tiny_overrides`, ...) are shared by ``test_slurm.py``,
``test_mpi_torchrun.py`` and ``test_fault.py``, which all compare a launch against
one plain 2-rank ``torchrun`` run of the same tiny configuration.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SCRIPTS = REPO / "slurm"

# Binaries the cluster needs; a machine without them skips the slurm tests.
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")

# Metrics that two launches of one configuration must agree on exactly.
METRIC_KEYS = ("val_ap", "val_auc", "test_ap", "test_auc")
# What torch's C++ side prints with its errors (frame dumps); none of it belongs on
# the terminal, only in the run's logs/ folder.
CPP_DUMP = ("frame #", "Exception raised from")


class ClusterError(RuntimeError):
    """The local cluster did not come up; the message holds the daemons' log tails."""


def missing_binaries() -> list[str]:
    """Names of the SLURM and munge programs not found on PATH (or in /usr/sbin)."""
    return [b for b in (*DAEMONS, *CLIENTS) if _which(b) is None]


def _which(name: str) -> str | None:
    # Daemons live in /usr/sbin, which is not on a plain user's PATH.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def free_port() -> int:
    """A TCP port free now on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """A running local cluster.

    Attributes:
        root: Temporary folder with the config, keys, state and logs.
        conf: The ``slurm.conf`` path (exported as ``SLURM_CONF`` in :attr:`env`).
        nodes: The node names: this host's short name, or ``n1``, ``n2``, ...
        cpus: CPUs each node offers.
        env: Environment for client commands (``sbatch``, ``squeue``, ...).
        procs: Daemon name -> process, for stopping them by PID; the slurmd of node
            ``N`` is ``slurmd-N``.
    """

    root: Path
    conf: Path
    nodes: tuple[str, ...]
    cpus: int
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def node(self) -> str:
        """The first node (the only one of a single-node cluster)."""
        return self.nodes[0]

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        """Runs a client command against this cluster; returns its stdout."""
        done = subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise ClusterError(
                f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()}\n{self.logs()}"
            )
        return done.stdout

    def logs(self, chars: int = 3000) -> str:
        """The tails of the daemons' logs, for failure messages."""
        parts = []
        for name in ("munged", "slurmctld", *(f"slurmd-{n}" for n in self.nodes)):
            p = self.root / "log" / f"{name}.log"
            text = p.read_text(errors="replace") if p.exists() else "(no log)"
            parts.append(f"--- {name}.log ---\n{text[-chars:]}")
        return "\n".join(parts)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (empty once the record is purged)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        fields: dict[str, str] = {}
        for item in out.split():
            key, sep, value = item.partition("=")
            if sep:
                fields[key] = value
        return fields

    def start_daemon(self, name: str, *args: str) -> None:
        """Starts ``slurmctld`` or ``slurmd`` (with ``args``) in the foreground, by PID."""
        key = name if not args else f"{name}-{args[-1]}"
        # The child keeps its own copy of the descriptor; ours is closed below.
        with open(self.root / "log" / f"{key}.stdout", "a") as out:
            self.procs[key] = subprocess.Popen(
                [_which(name) or name, "-D", "-f", str(self.conf), *args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )

    def start_slurmd(self, node: str) -> None:
        """Starts the slurmd of ``node`` (again, after :meth:`lose_node`)."""
        self.start_daemon("slurmd", "-N", node)

    def node_states(self) -> dict[str, str]:
        """Node name -> state in ``sinfo`` (``idle``, ``alloc``, ``down*``, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def all_idle(self) -> bool:
        """Whether every node shows ``idle``."""
        states = self.node_states()
        return sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}

    def job_pids(self, job_id: str, node: str | None = None, step: str = "0") -> list[int]:
        """PIDs of the tasks of step ``step`` of ``job_id`` (on ``node`` only, if given).

        Read from the processes' environments in /proc rather than asked of
        ``scontrol listpids``, which only asks the slurmd it finds first on this host.
        The batch script and its ``srun`` are no tasks of a step: they lack
        ``SLURM_STEP_ID``.
        """
        want = {b"SLURM_JOB_ID=" + job_id.encode(), b"SLURM_STEP_ID=" + step.encode()}
        if node is not None:
            want.add(b"SLURMD_NODENAME=" + node.encode())
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = set((entry / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue  # gone, or a kernel thread
            if want <= environ:
                pids.append(int(entry.name))
        return pids

    def lose_node(self, node: str, job_id: str) -> list[int]:
        """Kills ``node`` as a power cut would: its slurmd, step daemons and tasks.

        The step daemons (``slurmstepd``) are the parents of the node's tasks. All get
        SIGKILL at once, so that nothing on the node reports the loss to anyone.

        Returns:
            The PIDs of the job's tasks that were killed.
        """
        tasks = self.job_pids(job_id, node)
        parents = set()
        for pid in tasks:
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                parents.add(int(stat.rsplit(")", 1)[1].split()[1]))
        daemon = self.procs[f"slurmd-{node}"]
        victims = [daemon.pid, *sorted(p for p in parents if p > 1), *tasks]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        daemon.wait(timeout=10)
        del self.procs[f"slurmd-{node}"]
        return tasks

    def wait_state(
        self, job_id: str, states: Sequence[str], timeout: float = 120, poll: float = 0.2
    ) -> dict[str, str]:
        """Polls until the job is in one of ``states``; returns its record."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(poll)
        raise ClusterError(
            f"job {job_id} not in {list(states)} after {timeout:g} s: {info}\n{self.logs()}"
        )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def _first_job_id(jobs: int = 32) -> int:
    """A first job id whose jobs' rendezvous ports are free now.

    train.sbatch listens on ``10000 + job_id % 20000``; every cluster starting at job
    1 would have two test sessions on one host meet on the same ports.
    """
    rng = random.Random()
    for _ in range(100):
        first = rng.randrange(1, 20000 - jobs)
        if all(_port_free(10000 + first + i) for i in range(jobs)):
            return first
    raise ClusterError(f"no {jobs} free ports in a row in 10000..29999")


def _write_conf(
    root: Path, nodes: Sequence[str], cpus: int, munge_socket: Path, slurmd_timeout: int
) -> Path:
    ctld_port = free_port()
    conf = root / "slurm.conf"
    # An empty plugstack keeps the machine's SPANK plugins (/etc/slurm) out.
    (root / "plugstack.conf").write_text("")
    if len(nodes) == 1:
        node_lines = f"NodeName={nodes[0]} NodeAddr=127.0.0.1 Port={free_port()} "
        node_lines += f"CPUs={cpus} RealMemory=1000 State=UNKNOWN\n"
    else:
        # One slurmd per node on this host (slurmd -N NAME), each on its own port; the
        # names resolve nowhere, the address is what reaches them.
        node_lines = "".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
            f"CPUs={cpus} RealMemory=1000 State=UNKNOWN\n"
            for n in nodes
        )
    host = socket.gethostname().split(".")[0]
    text = f"""\
ClusterName=sventest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also the least delay before a requeued job starts again (default 120 s).
AuthInfo=socket={munge_socket},cred_expire=5
PlugStackConfig={root}/plugstack.conf
StateSaveLocation={root}/state
# %n: the node's name, so that several slurmd on this host keep apart.
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
# Test pending jobs every second (default 60 s): a requeued job restarts promptly.
SchedulerParameters=sched_interval=1
ReturnToService=2
# Short timeouts: a test waits for all of these. SlurmdTimeout is how long a lost
# node takes to be declared down.
SlurmdTimeout={slurmd_timeout}
MessageTimeout=10
KillWait=2
InactiveLimit=0
# sbatch --wait polls every 2 s only while 2 >= MinJobAge / 2 (and records stay
# about a minute anyway: slurmctld purges once a minute).
MinJobAge=2
FirstJobId={_first_job_id()}
{node_lines}\
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
    conf.write_text(text)
    return conf


def _die_with_parent() -> None:
    """Runs in each daemon before exec: SIGTERM it when the test process dies.

    A test session killed from outside (a CI timeout) skips its ``finally``; without
    this the daemons would outlive it, holding their ports.
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _wait_for(pred, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in cluster.procs.items():
            if p.poll() is not None:
                raise ClusterError(f"{name} exited with {p.returncode}\n{cluster.logs()}")
        if pred():
            return
        time.sleep(0.2)
    raise ClusterError(f"{what} not ready after {timeout:g} s\n{cluster.logs()}")


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    # Reverse start order: slurmd, slurmctld, then munged, which the others need.
    for _name, p in reversed(list(procs.items())):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for _name, p in reversed(list(procs.items())):
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def _kill_leftover_jobs(cluster: Cluster) -> None:
    """Cancels jobs still queued or running, so no task outlives the cluster."""
    with contextlib.suppress(Exception):
        cluster.run("scancel", "--full", "--quiet", "--partition=debug", check=False)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and cluster.run("squeue", "-h", check=False).strip():
            time.sleep(0.3)


@contextlib.contextmanager
def local_cluster(
    root: Path, nodes: int = 1, startup_timeout: float = 60, slurmd_timeout: int = 30
) -> Iterator[Cluster]:
    """Starts munged, slurmctld and one slurmd per node under ``root``; stops them on exit.

    Args:
        root: An empty temporary folder (short: munge's socket path must fit 108 bytes).
        nodes: Number of nodes: 1 is this host under its own name; more are ``n1``,
            ``n2``, ... (one ``slurmd -N`` each).
        startup_timeout: Seconds to wait for every node to show ``idle``.
        slurmd_timeout: Seconds without an answer after which slurmctld declares a
            node down (``SlurmdTimeout``).

    Yields:
        The running cluster.

    Raises:
        ClusterError: A daemon died or a node did not come up; logs attached.
    """
    for sub in ("state", "spool", "run", "log", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # Only root uses this cluster: keys, state and socket stay private to it.
    os.chmod(root, 0o700)
    os.chmod(root / "munge", 0o700)
    if nodes == 1:
        names: tuple[str, ...] = (socket.gethostname().split(".")[0],)
    else:
        names = tuple(f"n{i + 1}" for i in range(nodes))
    cpus = os.cpu_count() or 1
    key = root / "munge" / "munge.key"
    # A key of our own: the machine's /etc/munge key (if any) stays untouched.
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    munge_socket = root / "munge" / "munge.socket"
    conf = _write_conf(root, names, cpus, munge_socket, slurmd_timeout)
    env = dict(os.environ)
    for name in list(env):
        # A test session started inside a SLURM job must not talk to that cluster.
        if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")):
            del env[name]
    env["SLURM_CONF"] = str(conf)
    cluster = Cluster(root=root, conf=conf, nodes=names, cpus=cpus, env=env)
    log = root / "log"
    try:
        munged = [
            _which("munged") or "munged",
            "--foreground",
            # --force: munged otherwise refuses a socket in a folder that not every
            # user may enter (ours is 0700, root's only).
            "--force",
            f"--socket={munge_socket}",
            f"--key-file={key}",
            f"--pid-file={root}/run/munged.pid",
            f"--seed-file={root}/munge/munged.seed",
            f"--log-file={log}/munged.log",
        ]
        cluster.procs["munged"] = subprocess.Popen(
            munged,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        _wait_for(munge_socket.exists, 15, "munged socket", cluster)
        cluster.start_daemon("slurmctld")
        for node in names:
            cluster.start_slurmd(node)
        _wait_for(cluster.all_idle, startup_timeout, "nodes idle in sinfo", cluster)
        yield cluster
    finally:
        if any(name.startswith("slurmd") for name in cluster.procs):
            _kill_leftover_jobs(cluster)
        _stop(cluster.procs)


# ---------------------------------------------------------------------------
# Launch helpers shared by the slurm, mpirun/torchrun and fault tests
# ---------------------------------------------------------------------------

# Variables by which a launcher tells sven.distributed who it is; a test clears them all so
# that only the launcher under test is seen.
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_LAUNCH_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC")


def sven_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment without launcher variables, with the venv's ``sven`` on PATH."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)
    }
    if base is not None and "SLURM_CONF" in base:
        env["SLURM_CONF"] = base["SLURM_CONF"]
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    # Two ranks on two shared cores: more threads only fight each other.
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def make_store(path: Path) -> Path:
    """The tiny synthetic event store of these tests (2000 events, 80 nodes)."""
    from sven.datasets.synth import generate

    generate(path, events=2000, nodes=80, seed=0)
    return path


def tiny_overrides(store: Path, *extra: str) -> list[str]:
    """One small configuration for every launch compared here.

    Deterministic across launches: no dropout, the most recent neighbours, one thread.
    Three epochs of 14 batches with a checkpoint every 3 batches leave time to
    interrupt a run after its first checkpoint and before its end.
    """
    return [
        f"data.path={store}",
        # CPU ranks under gloo (train.device=auto would pick GPUs where there are some).
        "train.device=cpu",
        "quiet=true",
        "train.epochs=3",
        "train.batch_size=100",
        "train.checkpoint_every=3",
        "train.threads=1",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=4",
        "model.dropout=0",
        "model.sampling=recent",
        *extra,
    ]


def torchrun_cmd(nproc: int = 2) -> list[str]:
    """``torchrun --nproc_per_node N`` on a free port, running ``sven`` (append args)."""
    return [
        str(VENV_BIN / "torchrun"),
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "sven.cli",
    ]


def start_rank(
    rank: int, world_size: int, port: int, args: Sequence[str], log: Path
) -> subprocess.Popen:
    """Starts ``sven ARGS`` as one rank of an env:// launch, output to ``log``.

    No launcher agent: torchrun would kill the other ranks itself when one dies, and
    hide how Sven behaves.
    """
    env = sven_env()
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    with open(log, "w") as f:
        return subprocess.Popen(
            [str(VENV_BIN / "sven"), *args], env=env, stdout=f, stderr=subprocess.STDOUT
        )


def run_checked(cmd: Sequence[str], *, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    """Runs a command; an exit other than 0 fails with its whole output."""
    kw.setdefault("env", sven_env())
    done = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, check=False, **kw
    )
    assert done.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {done.returncode}\n"
        f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-4000:]}"
    )
    return done


def metrics(out: Path) -> dict[str, float]:
    """The compared metrics of a finished run's ``summary.json``."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2, summary
    return {k: summary[k] for k in METRIC_KEYS}


def sbatch(
    cluster: Cluster,
    script: str,
    *args: str,
    workdir: Path,
    options: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    wait: bool = False,
    timeout: float = 300,
) -> tuple[str, int]:
    """Submits ``slurm/<script>``; returns the job id and sbatch's exit status.

    With ``wait`` sbatch returns when the job ends, with the job's exit status.
    """
    job_env = sven_env(cluster.env)
    job_env.update(env or {})
    cmd = ["sbatch", "--parsable", f"--chdir={workdir}", f"--output={workdir}/%x-%j.out"]
    cmd += [*options, *(["--wait"] if wait else []), str(SCRIPTS / script), *args]
    try:
        done = subprocess.run(
            cmd, env=job_env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        job_id = out.strip().split(";")[0]
        info = cluster.job(job_id) if job_id else {}
        if job_id:
            cluster.run("scancel", job_id, check=False)
        raise AssertionError(
            f"job {job_id or '?'} did not end within {timeout:g} s: {info}\n"
            f"{job_log(workdir, job_id) if job_id else ''}"
        ) from None
    job_id = done.stdout.strip().split(";")[0]
    if not job_id:
        raise AssertionError(f"sbatch failed ({done.returncode}): {done.stderr}\n{cluster.logs()}")
    return job_id, done.returncode


def job_log(workdir: Path, job_id: str) -> str:
    """The output file of ``job_id`` under ``workdir`` (every start appends to it)."""
    logs = list(workdir.glob(f"*-{job_id}.out"))
    return logs[0].read_text(errors="replace") if logs else "(no job log)"


def wait_for_checkpoint(cluster: Cluster, job_id: str, out: Path, timeout: float = 180) -> None:
    """Waits until the job's run folder ``out`` holds a checkpoint."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list((out / "checkpoints").glob("step-*")):
            return
        if cluster.job(job_id).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} wrote no checkpoint under {out}: {cluster.job(job_id)}")


# Fixtures: a test module imports the ``*_fixture`` functions (named so that the test
# parameters do not shadow an import) and asks for ``tiny_store``, ``reference`` or
# ``slurm``. The store and the reference are made once per session and shared by
# every module (a fixture imported into two modules would otherwise run per module).
_SHARED: dict[str, object] = {}


@pytest.fixture(scope="session", name="tiny_store")
def tiny_store_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny synthetic event store (see :func:`make_store`)."""
    if "store" not in _SHARED:
        _SHARED["store"] = make_store(tmp_path_factory.mktemp("launch") / "store")
    return _SHARED["store"]  # type: ignore[return-value]


@dataclass(frozen=True)
class Run:
    """A finished launch: its folder, compared metrics and rank 0's stderr."""

    out: Path
    metrics: dict[str, float]
    stderr: str


@pytest.fixture(scope="session", name="reference")
def reference_fixture(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One uninterrupted 2-rank ``torchrun`` run of :func:`tiny_overrides`."""
    if "reference" not in _SHARED:
        out = tmp_path_factory.mktemp("reference")
        # quiet=false: quiet=true writes nothing but errors, and the launch line is checked.
        cmd = [*torchrun_cmd(), "train", *tiny_overrides(tiny_store, f"out={out}", "quiet=false")]
        done = run_checked(cmd)
        _SHARED["reference"] = Run(out, metrics(out), done.stderr)
    return _SHARED["reference"]  # type: ignore[return-value]


@contextlib.contextmanager
def temp_cluster(nodes: int = 1, **kw) -> Iterator[Cluster]:
    """:func:`local_cluster` in a temporary folder; skips where it cannot run."""
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster runs its daemons as root (SlurmUser=root)")
    missing = missing_binaries()
    if missing:
        pytest.skip(
            f"SLURM/munge not installed (missing {', '.join(missing)}): "
            "apt-get install slurm-wlm munge, as .ci/setup.sh does"
        )
    # Under /tmp, not pytest's deep basetemp: munge's socket path must fit 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="sven-slurm-", dir="/tmp"))
    try:
        with local_cluster(root, nodes, **kw) as cluster:
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", name="slurm")
def slurm_fixture() -> Iterator[Cluster]:
    """A local single-node SLURM cluster for the session; skips where it cannot run."""
    with temp_cluster() as cluster:
        yield cluster
