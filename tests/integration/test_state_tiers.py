"""Node state in host memory or in memory-mapped files gives the same run as node state
beside the compute: every model, 50 batches, one process and two gloo ranks; exact
resume with host state; the staged path of files on CUDA, run on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import sven
from sven.errors import ConfigError
from sven.models.memory import DenseUpdate, MemoryState
from sven.models.storage import Storage
from tests.dist.launch import run_ranks

MODELS = ("tgn", "jodie", "apan", "dyrep")
TIERS = ("host", "disk")
BATCHES = 50


def _overrides(store: str, out: Path | str, model: str, tier: str, *extra: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        f"model.name={model}",
        f"state.device={tier}",
        "quiet=true",
        "train.epochs=1",
        f"train.max_batches={BATCHES}",
        "train.batch_size=20",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=3",
        "model.mailbox_size=2",
        "model.dropout=0.1",
        "train.threads=1",
        "dist.timeout_s=120",
        *extra,
    ]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    from sven.datasets.synth import generate

    path = tmp_path_factory.mktemp("tiers") / "store"
    generate(path, events=1500, nodes=60, seed=5, edge_feat_dim=2)
    return str(path)


def _run(store: str, out: Path | str, model: str, tier: str, *extra: str) -> tuple[list, dict, str]:
    """(per-batch parameters and node state, the summary, the tier used)."""
    tr = sven.Trainer(None, _overrides(store, out, model, tier, *extra))
    records: list = []

    def record(t: sven.Trainer) -> None:
        params = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()]).clone()
        state = {k: v.clone() for k, v in t.memory.state_dict().items()}
        records.append((params, state))

    tr.add_hook("after_step", record)
    summary = tr.fit()
    return records, summary, tr.memory.storage.tier


def _same_runs(a: tuple[list, dict, str], b: tuple[list, dict, str], label: str) -> None:
    (rec_a, sum_a, _), (rec_b, sum_b, _) = a, b
    assert len(rec_a) == len(rec_b) == BATCHES, label
    for i, ((pa, sa), (pb, sb)) in enumerate(zip(rec_a, rec_b)):
        assert torch.equal(pa, pb), f"{label}: parameters differ after batch {i}"
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{label}: node state {k} differs after batch {i}"
    for k in ("val_ap", "val_auc", "test_ap", "test_auc", "test_ap_inductive"):
        assert sum_a[k] == sum_b[k], (label, k)


@pytest.mark.parametrize("model", MODELS)
def test_host_and_disk_state_equal_device_state(store, tmp_path, model: str) -> None:
    ref = _run(store, tmp_path / "gpu", model, "gpu")
    # state.device=gpu is GPU memory, or host memory (and named so) without a GPU.
    assert ref[2] == ("gpu" if torch.cuda.is_available() else "host")
    for tier in TIERS:
        got = _run(store, tmp_path / tier, model, tier)
        assert got[2] == tier
        _same_runs(ref, got, f"{model} {tier}")
    # The disk tier's rows are in files under the run (scratch, not a checkpoint).
    files = sorted(p.name for p in (tmp_path / "disk" / "state" / "rank0").iterdir())
    assert files == [
        ".sven-state",
        "last_update.bin",
        "mail.bin",
        "mail_ts.bin",
        "mail_valid.bin",
        "memory.bin",
    ]


def _rank_run(
    rank: int, world_size: int, store: str, out: str, model: str, tier: str, *extra: str
) -> dict:
    tr = sven.Trainer(None, _overrides(store, out, model, tier, "dist.strategy=hash", *extra))
    records: list = []

    def record(t: sven.Trainer) -> None:
        state = {k: v.clone() for k, v in t.memory.state_dict().items()}
        params = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()]).clone()
        records.append((params, state))

    tr.add_hook("after_step", record)
    summary = tr.fit()
    hot = tr.memory.hot_rows
    return {"records": records, "summary": summary, "tier": tr.memory.storage.tier, "hot": hot}


@pytest.mark.dist
@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_host_and_disk_state_equal_device_state(store, tmp_path, model: str) -> None:
    ref = run_ranks(_rank_run, 2, store, str(tmp_path / "gpu"), model, "gpu", timeout=300)
    for tier in TIERS:
        got = run_ranks(_rank_run, 2, store, str(tmp_path / tier), model, tier, timeout=300)
        for r in range(2):
            assert got[r]["tier"] == tier
            _same_runs(
                (ref[r]["records"], ref[r]["summary"], "gpu"),
                (got[r]["records"], got[r]["summary"], tier),
                f"{model} {tier} rank {r}",
            )


@pytest.mark.dist
def test_two_ranks_with_hot_rows_equal_device_state(store, tmp_path) -> None:
    """Each rank keeps copies of its own most active rows (shard rows, not global ids):
    the two-rank run without them, bit for bit."""
    ref = run_ranks(_rank_run, 2, store, str(tmp_path / "gpu"), "apan", "gpu", timeout=300)
    got = run_ranks(
        _rank_run, 2, store, str(tmp_path / "hot"), "apan", "host", "state.hot_rows=12",
        timeout=300,
    )  # fmt: skip
    for r in range(2):
        assert got[r]["hot"] == 12
        _same_runs(
            (ref[r]["records"], ref[r]["summary"], "gpu"),
            (got[r]["records"], got[r]["summary"], "host"),
            f"hot rows rank {r}",
        )


@pytest.mark.parametrize("model", MODELS)
def test_hot_rows_equal_host_state_without(store, tmp_path, monkeypatch, model: str) -> None:
    """Copies of the most active nodes' rows (``state.hot_rows``: 25 of the 60 nodes,
    kept beside the tables on the CPU, where a count asked for is kept too) give the
    run without them, bit for bit: read in place of the tables' rows, written through,
    and with CUDA's fixed-shape step (forced here) and the prefetch ring, rows read
    ahead and refreshed from them."""
    plain = _run(store, tmp_path / "plain", model, "host")
    hot = _run(store, tmp_path / "hot", model, "host", "state.hot_rows=25")
    _same_runs(plain, hot, f"{model} hot rows")
    assert (plain[1]["state_hot_rows"], hot[1]["state_hot_rows"]) == (0, 25)
    monkeypatch.setattr("sven.engine.spec.fixed_shapes", lambda device, distributed: True)
    ref = _ring_run(store, tmp_path / "d0", model, "host", 0)
    got = _ring_run(store, tmp_path / "d1", model, "host", 1, "state.hot_rows=25")
    assert got[2].memory.hot is not None and got[2].memory.hot.count == 25
    assert got[2].plan.hot_rows == 25
    _same_ring_runs(ref, got, f"{model} hot rows D=1")


def test_a_checkpoint_evaluated_with_hot_rows_gives_the_runs_metrics(store, tmp_path) -> None:
    """The best checkpoint's node state is loaded into the tables and the hot rows'
    copies are taken again from them: its test metrics are the run's."""
    run = tmp_path / "run"
    over = _overrides(store, run, "tgn", "host", "state.hot_rows=25", "train.max_batches=0")
    summary = sven.Trainer(None, over).fit()
    tr = sven.Trainer(None, [*over, f"out={tmp_path / 'eval'}"])
    res = tr.evaluate_checkpoint(run)
    assert tr.memory.hot is not None and tr.memory.hot.count == 25
    for key in ("test_ap", "test_auc"):
        assert res[key] == summary[key], key


@pytest.mark.parametrize("hot", [0, 25])
def test_resume_with_host_state_is_exact(store, tmp_path, hot: int) -> None:
    """Two epochs straight, against one epoch then a resumed second, state in host
    memory (with and without copies of 25 rows): the same metrics and node state."""

    def over(out: Path, epochs: int, *extra: str) -> list[str]:
        base = _overrides(
            store, out, "tgn", "host", "train.max_batches=0", f"state.hot_rows={hot}", *extra
        )
        return [*base, f"train.epochs={epochs}", "train.patience=0"]

    straight = sven.Trainer(None, over(tmp_path / "a", 2))
    whole = straight.fit()
    first = sven.Trainer(None, over(tmp_path / "b", 1))
    first.fit()
    resumed = sven.Trainer(None, over(tmp_path / "b", 2, "train.resume=true"))
    assert resumed.memory.storage.tier == "host"
    again = resumed.fit()
    for k in ("val_ap", "test_ap", "test_auc", "best_epoch", "epochs_run"):
        assert again[k] == whole[k], k
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [x["train_loss"] for x in lines] == [x["train_loss"] for x in ref]
    for k, v in straight.memory.state_dict().items():
        assert torch.equal(resumed.memory.state_dict()[k], v), k


def test_staged_rows_equal_direct_rows(tmp_path) -> None:
    """Files on CUDA stage each batch's rows through host copies; the same commits
    through that path (forced here on the CPU) leave the same state."""
    n, d, dm, m = 30, 4, 5, 2
    direct = MemoryState(n, d, dm, m, "cpu")
    store = Storage("disk", "cpu", folder=tmp_path / "staged")
    store.staged = True
    staged = MemoryState(n, d, dm, m, "cpu", storage=store)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p, q = 12, 9
        update = DenseUpdate(
            nodes=torch.randint(0, n + 1, (p,), generator=g),
            memory=torch.randn(p, d, generator=g),
            last_update=torch.rand(p, generator=g, dtype=torch.float64),
            key=torch.randperm(100, generator=g)[:p] - 20,
            mail_nodes=torch.randint(0, n + 1, (q,), generator=g),
            mail=torch.randn(q, dm, generator=g),
            mail_ts=torch.rand(q, generator=g, dtype=torch.float64),
            mail_key=torch.randperm(100, generator=g)[:q] - 20,
        )
        direct.commit_dense(update)
        staged.commit_dense(update)
        ids = torch.randint(0, n + 1, (7,), generator=g)
        a, b = direct.gather(ids), staged.gather(ids)
        for x, y in zip(vars(a).values(), vars(b).values()):
            assert (x is None and y is None) or torch.equal(x, y)
    for k, v in direct.state_dict().items():
        assert torch.equal(staged.state_dict()[k], v), k
    assert float(direct.memory.abs().sum()) > 0


def test_plan_refuses_a_run_that_does_not_fit_before_any_work(store, tmp_path) -> None:
    out = tmp_path / "run"
    over = _overrides(store, out, "tgn", "gpu", "state.host_budget_gb=0.001")
    with pytest.raises(ConfigError) as err:
        sven.Trainer(None, over)
    msg = str(err.value)
    assert "\n" not in msg
    assert "GB of host memory" in msg and "0.00 GB are available" in msg
    assert "state.device=disk" in msg and "state.host_budget_gb" in msg
    assert not out.exists()


def test_auto_picks_files_when_host_memory_is_short(store, tmp_path) -> None:
    from sven.engine.plan import dry_run

    over = _overrides(store, tmp_path / "run", "tgn", "auto", "state.host_budget_gb=100")
    # Node state beside a CPU's compute is in host memory, and the plan names it so.
    assert dry_run(None, over).tier == "host"
    # The old name of that tier is accepted, and the plan shows what it resolved to.
    alias = dry_run(None, [*over, "state.device=gpu"])
    assert alias.tier == "host"
    assert "state.device=gpu is host memory on a run without a GPU: tier host" in alias.notes
    plan = dry_run(None, [*over, "state.host_budget_gb=0.0001"])
    # Everything else does not fit either: the plan says so rather than running.
    assert plan.tier == "disk" and plan.shortfall() is not None
    text = plan.describe()
    assert "node state: disk tier" in text and "does not fit" in text


@pytest.mark.gpu
@pytest.mark.parametrize("model", MODELS)
def test_pinned_host_state_on_cuda_equals_gpu_state(store, tmp_path, model: str) -> None:
    """On CUDA the host tier's tables are pinned host memory that the captured step's
    kernels read and write directly: the same run, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def run(tier: str) -> tuple[list, dict, str]:
        over = _overrides(store, tmp_path / tier, model, tier, "train.device=cuda")
        tr = sven.Trainer(None, over)
        records: list = []

        def record(t: sven.Trainer) -> None:
            params = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
            state = {k: v.detach().cpu().clone() for k, v in t.memory.state_dict().items()}
            records.append((params.cpu().clone(), state))

        tr.add_hook("after_step", record)
        summary = tr.fit()
        if tier == "host":
            assert all(v.device.type == "cuda" for v in tr.memory.full.values())
            assert all(v.device.type == "cpu" for v in tr.memory.host.values())
            assert tr.step.train_graph.captured
        return records, summary, tr.memory.storage.tier

    _same_runs(run("gpu"), run("host"), f"{model} cuda host")


def _ring_run(
    store: str, out: Path, model: str, tier: str, depth: int, *extra: str
) -> tuple[list, dict, sven.Trainer]:
    """(parameters after each batch, on the CPU; the summary; the trainer) of a run at
    prefetch depth ``depth``."""
    over = _overrides(store, out, model, tier, f"pipeline.prefetch={depth}", *extra)
    tr = sven.Trainer(None, over)
    params: list = []

    def record(t: sven.Trainer) -> None:
        params.append(torch.cat([p.detach().reshape(-1) for p in t.model.parameters()]).cpu())

    tr.add_hook("after_step", record)
    summary = tr.fit()
    assert tr.step.depth == depth
    return params, summary, tr


def _same_ring_runs(
    a: tuple[list, dict, sven.Trainer], b: tuple[list, dict, sven.Trainer], label: str
) -> None:
    (pa, sa, ta), (pb, sb, tb) = a, b
    assert len(pa) == len(pb) > 0, label
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"{label}: parameters differ after batch {i}"
    state_b = tb.memory.state_dict()
    for k, v in ta.memory.state_dict().items():
        assert torch.equal(state_b[k].cpu(), v.cpu()), f"{label}: node state {k} differs"
    for k in ("val_ap", "val_auc", "test_ap", "test_auc", "test_ap_inductive"):
        assert sa[k] == sb[k], (label, k)


@pytest.mark.parametrize("model", MODELS)
def test_host_state_with_the_prefetch_ring_equals_depth_zero(
    store, tmp_path, monkeypatch, model: str
) -> None:
    """CUDA's fixed-shape step (forced here on the CPU) over state in host memory: the
    batches the ring builds ahead (depth 1 and 2) give depth 0's parameters after every
    batch, node state and metrics. A build reads no node state, so a batch built ahead
    cannot read a row before the step before it wrote it back."""
    monkeypatch.setattr("sven.engine.spec.fixed_shapes", lambda device, distributed: True)
    ref = _ring_run(store, tmp_path / "d0", model, "host", 0)
    assert ref[2].step.capacity == 20
    for d in (1, 2):
        got = _ring_run(store, tmp_path / f"d{d}", model, "host", d)
        _same_ring_runs(ref, got, f"{model} host D={d}")


@pytest.mark.gpu
@pytest.mark.parametrize("engine,hot", [("sm", -1), ("copy", -1), ("sm", 0), ("sm", 5000)])
def test_host_state_with_the_ring_on_cuda_equals_depth_zero_and_the_gpu_tier(
    tmp_path, monkeypatch, engine: str, hot: int
) -> None:
    """The host tier's drift with the prefetch ring on the H200 (docs/scale.md, "Host
    memory"): 10^6 nodes of pinned state, whose copy at a capture takes longer than a
    warm step, and the ring's second graph captured at the second step, kernels warm;
    the rows read ahead by the SM gather or by the host thread and the copy engine; the
    most active nodes' rows kept in GPU memory (``state.hot_rows``: every node with an
    event, none, or 5,000). Depth 1 over host state equals depth 0 over host state and
    depth 1 over GPU state, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sven.datasets.synth import generate

    monkeypatch.setenv("SVEN_READ_AHEAD", engine)
    path = tmp_path / "store"
    generate(path, events=20_000, nodes=1_000_000, seed=7, edge_feat_dim=2)
    big = (
        "train.device=cuda",
        "train.cuda_graph=on",
        "train.batch_size=200",
        "train.max_batches=30",
        "model.memory_dim=100",
        "model.time_dim=100",
        "model.embed_dim=100",
        "model.num_neighbors=10",
        "model.mailbox_size=1",
        f"state.hot_rows={hot}",
    )
    runs = {
        (tier, d): _ring_run(str(path), tmp_path / f"{tier}{d}", "tgn", tier, d, *big)
        for tier, d in (("host", 0), ("host", 1), ("gpu", 1))
    }
    for (tier, _), (_, _, tr) in runs.items():
        assert tr.memory.storage.tier == tier
        assert all(g.captured for g in tr.step.train_graphs)
    assert runs["host", 1][2].memory.storage.pinned
    assert (runs["host", 1][2].memory.copier is not None) == (engine == "copy")
    count = runs["host", 1][2].memory.hot_rows
    # Auto keeps every node with an event: of 20,000 events, far more than 5,000.
    assert count == hot if hot >= 0 else count > 5000
    _same_ring_runs(runs["host", 0], runs["host", 1], "host D=0 against host D=1")
    _same_ring_runs(runs["gpu", 1], runs["host", 1], "gpu D=1 against host D=1")


def test_a_trainer_that_only_reads_plans_no_checkpoints(store, tmp_path) -> None:
    """``sven predict``/``eval`` build a trainer that writes no checkpoint: its plan
    must not refuse a disk that has room for the store but not for a checkpoint (the
    10^8-node predict on the H200 was refused so)."""
    over = _overrides(store, tmp_path / "run", "tgn", "gpu")
    train = sven.Trainer(None, over)
    replay = sven.Trainer(None, over, purpose="replay")
    assert train.plan.total("disk") > 0
    assert replay.plan.total("disk") == 0
    assert not any("checkpoints" in i.what for i in replay.plan.items)


@pytest.mark.gpu
def test_a_pinned_table_larger_than_a_gigabyte_copies_and_captures() -> None:
    """One registration per table: a copy or fill over a table of several GB (the
    capture's warm-up clones and restores it) works, where a table registered in 1 GiB
    chunks was refused by the driver ("invalid argument") on the H200."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    st = Storage("host", dev)
    view, host = st.empty("mail", (3_000_000, 1, 200), torch.float32)  # 2.4 GB
    view.fill_(1.0)
    saved = view.clone()
    view.zero_()
    view.copy_(saved)
    torch.cuda.synchronize()
    assert float(host[-1].sum()) == 200.0 and float(host[0].sum()) == 200.0
    st.close()
