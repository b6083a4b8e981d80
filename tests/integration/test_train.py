"""End-to-end training: outputs, CLI, re-evaluation and exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import sven
from sven.cli import main
from sven.datasets.store import write_events
from tests.conftest import interrupted_then_resumed

METRIC_KEYS = (
    "val_ap",
    "val_auc",
    "test_ap",
    "test_auc",
    "test_ap_inductive",
    "test_auc_inductive",
)

# On a GPU, checkpoints load onto the device with every tensor in them (RNG states
# included): the cuda cases catch host-only pieces. They run with ``pytest -m gpu``.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A small interaction stream with edge features: 3000 events on 60 nodes."""
    rng = np.random.default_rng(0)
    e = 3000
    src = rng.integers(0, 60, e)
    # Each node mostly talks to two fixed partners: memory helps predict them.
    partners = rng.integers(0, 60, (60, 2))
    dst = np.where(
        rng.random(e) < 0.8, partners[src, rng.integers(0, 2, e)], rng.integers(0, 60, e)
    )
    t = np.sort(rng.integers(0, 100_000, e))
    out = tmp_path_factory.mktemp("store") / "tiny"
    write_events(out, src, dst, t, edge_feat=rng.random((e, 3)).astype(np.float32), name="tiny")
    return str(out)


def _overrides(store: str, out, *extra: str) -> list[str]:
    return [
        f"data.path={store}",
        f"out={out}",
        "train.device=cpu",  # the cuda cases override it
        "quiet=true",
        "train.epochs=2",
        "train.batch_size=200",
        "model.memory_dim=16",
        "model.time_dim=8",
        "model.embed_dim=16",
        "model.num_neighbors=5",
        "train.lr=0.001",
        *extra,
    ]


@pytest.mark.parametrize("model", ["tgn", "jodie", "apan", "dyrep"])
def test_fit_writes_outputs(store: str, tmp_path, model: str) -> None:
    summary = sven.Trainer(None, _overrides(store, tmp_path, f"model.name={model}")).fit()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == pytest.approx(summary)
    for key in (
        *METRIC_KEYS,
        "model",
        "dataset",
        "world_size",
        "best_epoch",
        "train_events_per_s",
        "wall_s",
    ):
        assert key in summary
    assert summary["model"] == model and summary["dataset"] == "tiny" and summary["world_size"] == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in lines] == [0, 1]
    for x in lines:
        assert {"epoch", "train_loss", "val_ap", "val_auc", "events_per_s"} <= set(x)
    assert 0.0 <= summary["test_ap"] <= 1.0


def test_memory_model_learns_synthetic(tmp_path) -> None:
    from sven.datasets.synth import generate

    generate(tmp_path / "syn", events=20_000, nodes=300, seed=0)
    extra = (
        "train.epochs=5",
        "train.patience=0",
        "train.lr=0.003",
        "model.memory_dim=32",
        "model.embed_dim=32",
    )
    summary = sven.Trainer(None, _overrides(str(tmp_path / "syn"), tmp_path / "o", *extra)).fit()
    # Scoring at random gives 0.5; five short epochs of TGN reach ~0.68 on this stream.
    assert summary["test_ap"] > 0.62


@pytest.mark.parametrize("device", DEVICES)
def test_cli_train_and_eval_reproduce(store: str, tmp_path, capsys, device: str) -> None:
    over = _overrides(store, tmp_path, f"train.device={device}")
    assert main(["train", "--quiet", *over]) == 0
    assert "test AP" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert main(["eval", "--checkpoint", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["test_ap"] == summary["test_ap"]
    assert res["test_auc_inductive"] == summary["test_auc_inductive"]


@pytest.mark.parametrize("fixed", [False, True], ids=["exact", "fixed"])
@pytest.mark.parametrize("device", DEVICES)
def test_resume_after_interrupt_is_exact(
    store: str, tmp_path, monkeypatch, device: str, fixed: bool
) -> None:
    if fixed:
        # CUDA's fixed-shape step (its planned training slots) on any device.
        monkeypatch.setattr("sven.engine.spec.fixed_shapes", lambda device, distributed: True)
    extra = (
        "train.checkpoint_every=4",
        "model.dropout=0.1",
        "model.sampling=uniform",
        f"train.device={device}",
    )
    ref = sven.Trainer(None, _overrides(store, tmp_path / "ref", *extra)).fit()
    # Dies in epoch 2, past a checkpoint.
    resumed = interrupted_then_resumed(None, _overrides(store, tmp_path / "run", *extra), 17)
    for key in METRIC_KEYS:
        assert resumed[key] == ref[key], key
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [0, 1]


def test_bad_data_path_is_a_clean_error(tmp_path, capsys) -> None:
    assert main(["train", f"data.path={tmp_path / 'missing'}", f"out={tmp_path}"]) != 0
    assert "no event store" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["tgn", "jodie", "dyrep", "apan"])
def test_captured_step_equals_eager_step(store: str, tmp_path, model: str) -> None:
    """The CUDA-graph replay of the step computes what the eager step computes: the same
    parameters and memory after 30 batches (deterministic kernels, float32)."""
    states = {}
    for mode in ("off", "on"):
        tr = sven.Trainer(
            None,
            _overrides(
                store,
                tmp_path / mode,
                f"model.name={model}",
                "train.device=cuda",
                f"train.cuda_graph={mode}",
                "train.batch_size=50",
                "train.epochs=1",
                "model.dropout=0.1",
                "model.sampling=uniform",
            ),
        )
        seen = []

        def record(t: sven.Trainer, seen: list = seen) -> None:
            if len(seen) == 29:
                params = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
                seen.append((params.cpu(), {k: v.cpu() for k, v in t.memory.state_dict().items()}))
            else:
                seen.append(None)

        tr.add_hook("after_step", record)
        summary = tr.fit()
        assert tr.step.train_graph.captured == (mode == "on")
        states[mode] = (seen[29], summary)
    (p0, m0), s0 = states["off"]
    (p1, m1), s1 = states["on"]
    # The graph replays the same kernels in the same order: equal up to float32
    # rounding of any atomics left (none with deterministic kernels).
    torch.testing.assert_close(p0, p1, rtol=1e-5, atol=1e-6)
    for k in m0:
        torch.testing.assert_close(m0[k], m1[k], rtol=1e-5, atol=1e-6)
    assert s0["test_ap"] == pytest.approx(s1["test_ap"], abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# TGN (GRU, fused attention), JODIE (RNN), APAN (the core on its mailbox attention).
@pytest.mark.parametrize("model", ["tgn", "jodie", "apan"])
def test_fused_kernels_in_the_captured_step_train_like_the_reference(
    store: str, tmp_path, model: str, monkeypatch
) -> None:
    """The fused updater and the Triton attention core inside the captured step against
    the eager reference step: 2 epochs (22 batches of 200). Kernels and reference round
    differently in float32; Adam moves a parameter by about lr = 1e-3 a step, so the
    bound is 5 steps' worth, 5e-3, and the test AP within 0.01."""
    from sven import kernels

    results = {}
    for name, mode, graph in (
        ("reference", "reference", "off"),
        ("fused", "auto,recurrent_update=triton,temporal_attention=triton", "on"),
    ):
        monkeypatch.setenv("SVEN_KERNELS", mode)
        kernels.reset_backend()
        try:
            tr = sven.Trainer(
                None,
                _overrides(
                    store,
                    tmp_path / name,
                    f"model.name={model}",
                    "train.device=cuda",
                    f"train.cuda_graph={graph}",
                    "model.sampling=uniform",
                    # IEEE products: the kernels against the reference, not TF32's
                    # rounding (the default) carried through the training.
                    "train.matmul_precision=highest",
                ),
            )
            summary = tr.fit()
        finally:
            kernels.reset_backend()
        assert tr.step.train_graph.captured == (graph == "on")
        flat = torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()]).cpu()
        results[name] = (flat, summary)
    (p0, s0), (p1, s1) = results["reference"], results["fused"]
    torch.testing.assert_close(p0, p1, rtol=0, atol=5e-3)
    assert s0["test_ap"] == pytest.approx(s1["test_ap"], abs=0.01)


def test_train_compile_on_cpu_is_ignored_with_a_notice(store: str, tmp_path, capsys) -> None:
    """``train.compile`` acts on CUDA only: on CPU the run says so and trains exactly as
    without it."""
    summaries = []
    for flag in ("false", "true"):
        over = _overrides(store, tmp_path / flag, f"train.compile={flag}")
        summaries.append(sven.Trainer(None, over).fit())
    assert "train.compile applies on CUDA" in capsys.readouterr().err
    plain, compiled = ({k: s[k] for k in METRIC_KEYS} for s in summaries)
    assert plain == compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["tgn", "jodie"])
def test_compiled_captured_step_trains_like_the_eager_step(store: str, tmp_path, model) -> None:
    """``train.compile=true`` on CUDA: the model compiled by Inductor inside the captured
    step trains as the eager step does. Inductor fuses and reorders reductions, so the
    float32 results differ in rounding. Adam moves a parameter by about lr = 1e-3 a step
    whatever its gradient's size, so after the 2 epochs (22 steps) a broken compilation
    is off by ~1e-2 on most parameters; rounding alone stays within 5 steps' worth, 5e-3
    (a gradient near zero may flip sign), and the test AP within 0.01."""
    results = {}
    for compiled in ("false", "true"):
        tr = sven.Trainer(
            None,
            _overrides(
                store,
                tmp_path / compiled,
                f"model.name={model}",
                "train.device=cuda",
                "train.cuda_graph=on",
                f"train.compile={compiled}",
                "model.dropout=0.1",
                # IEEE products: compiled against eager, not TF32's rounding.
                "train.matmul_precision=highest",
            ),
        )
        summary = tr.fit()
        assert tr.step.train_graph.captured
        flat = torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()]).cpu()
        results[compiled] = (flat, summary)
    (p0, s0), (p1, s1) = results["false"], results["true"]
    torch.testing.assert_close(p0, p1, rtol=0, atol=5e-3)
    assert s0["test_ap"] == pytest.approx(s1["test_ap"], abs=0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tf32_matmuls_train_like_float32(store: str, tmp_path) -> None:
    """``train.matmul_precision=high`` runs the float32 matrix products on TF32 tensor
    cores (set per CUDA run, so a later default run is back on IEEE float32) and trains
    to the same test AP within 0.02 on the tiny store."""
    was = torch.backends.cuda.matmul.allow_tf32
    try:
        aps = {}
        for prec in ("high", "highest"):
            over = _overrides(
                store, tmp_path / prec, "train.device=cuda", f"train.matmul_precision={prec}"
            )
            tr = sven.Trainer(None, over)
            assert torch.backends.cuda.matmul.allow_tf32 == (prec == "high")
            aps[prec] = tr.fit()["test_ap"]
        assert aps["high"] == pytest.approx(aps["highest"], abs=0.02)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["tgn", "apan"])
def test_fixed_step_on_cuda_is_bitwise_reproducible(store: str, tmp_path, model: str) -> None:
    """The CUDA step runs with torch's deterministic mode off (it is deterministic by
    construction, see sven.engine.step.torch_determinism_off): two runs agree bit for bit."""
    params = []
    for run in ("a", "b"):
        tr = sven.Trainer(
            None,
            _overrides(
                store,
                tmp_path / run,
                f"model.name={model}",
                "train.device=cuda",
                "train.batch_size=50",
                "model.sampling=uniform",
            ),
        )
        summary = tr.fit()
        flat = torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()]).cpu()
        params.append((flat, {k: v.cpu() for k, v in tr.memory.state_dict().items()}, summary))
    (p0, m0, s0), (p1, m1, s1) = params
    assert torch.equal(p0, p1)
    for k in m0:
        assert torch.equal(m0[k], m1[k]), k
    assert s0["test_ap"] == s1["test_ap"] and s0["val_ap"] == s1["val_ap"]


def test_evaluation_protocols_share_one_trained_model(store: str, tmp_path) -> None:
    # One epoch: the trained model cannot depend on the validation protocol, so the
    # historical run's random-negative figures must equal the random run's headline.
    one = ("model.name=jodie", "train.epochs=1")
    rand = sven.Trainer(None, _overrides(store, tmp_path / "r", *one)).fit()
    hist = sven.Trainer(
        None,
        _overrides(
            store, tmp_path / "h", *one, "eval.negatives=historical", "eval.mrr_negatives=5"
        ),
    ).fit()
    assert rand["eval_negatives"] == "random" and hist["eval_negatives"] == "historical"
    assert hist["test_randomneg_ap"] == rand["test_ap"]
    assert hist["test_randomneg_ap_inductive"] == rand["test_ap_inductive"]
    assert rand["test_historicalneg_ap"] == hist["test_ap"]
    assert rand["test_inductiveneg_ap"] == hist["test_inductiveneg_ap"]
    assert hist["eval_mrr_negatives"] == 5 and 0.0 < hist["test_mrr"] <= 1.0
    assert "test_mrr" not in rand
    # The older spelling still selects MRR.
    old = sven.Trainer(None, _overrides(store, tmp_path / "o", *one, "train.mrr_negatives=5")).fit()
    assert old["eval_mrr_negatives"] == 5 and old["test_mrr"] == hist["test_mrr"]
