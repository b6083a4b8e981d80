"""``train.compile`` (sven.engine.compiled): one compilation serves every training batch,
evaluation never compiles, a compiler error falls back with one warning. Checked on CPU
with the fixed-shape step that CUDA runs (forced here) and torch's ``eager`` backend
behind a counter: dynamo traces and guards as with Inductor, without its C++ builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sven
from sven.engine import step as step_module
from sven.engine.compiled import CompiledModel, compile_cache_dir, use_compile_cache
from tests.integration.test_train import METRIC_KEYS, _overrides
from tests.integration.test_train import store as store  # the fixture


def _run(store: str, out: Path, compiled: bool) -> tuple[sven.Trainer, dict]:
    tr = sven.Trainer(None, _overrides(store, out, f"train.compile={str(compiled).lower()}"))
    return tr, tr.fit()


@pytest.fixture
def fixed_cpu(monkeypatch):
    """CUDA's fixed-shape step and ``train.compile`` on the CPU."""
    monkeypatch.setattr("sven.engine.spec.fixed_shapes", lambda device, distributed: True)
    monkeypatch.setattr(step_module, "COMPILE_DEVICES", ("cuda", "cpu"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)


@pytest.mark.slow
def test_one_compilation_serves_training_and_evaluation_compiles_nothing(
    store, tmp_path, fixed_cpu, monkeypatch
) -> None:
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    monkeypatch.setattr(step_module, "COMPILE_BACKEND", counting)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch._dynamo.reset()
    tr = sven.Trainer(None, _overrides(store, tmp_path / "compiled", "train.compile=true"))
    after_steps: list[int] = []
    tr.hooks["after_step"].append(lambda t: after_steps.append(len(graphs)))
    summary = tr.fit()
    assert isinstance(tr.step.model, CompiledModel) and tr.step.model.failed is None
    # Every graph was compiled by the end of the first training step: the rest of the
    # first epoch, the second, both validations and test compiled nothing.
    assert after_steps[0] > 0
    assert len(graphs) == after_steps[0] == after_steps[-1]
    # Evaluation called the model itself; the compiled one gave the eager model's
    # metrics (the eager backend runs the same operations).
    _, plain = _run(store, tmp_path / "plain", compiled=False)
    assert {k: summary[k] for k in METRIC_KEYS} == {k: plain[k] for k in METRIC_KEYS}
    # The compiled kernels' folder, per machine: per torch version and device.
    cache = compile_cache_dir(torch.device("cpu"))
    assert cache == tmp_path / "cache" / "sven" / "compile" / f"torch-{torch.__version__}-cpu"
    assert cache.is_dir()


@pytest.mark.slow
def test_a_compiler_error_falls_back_to_the_model_with_one_warning(
    store, tmp_path, fixed_cpu, monkeypatch, capsys
) -> None:
    calls: list[int] = []

    def failing(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        calls.append(1)
        raise RuntimeError("no code for this graph")

    monkeypatch.setattr(step_module, "COMPILE_BACKEND", failing)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch._dynamo.reset()
    tr = sven.Trainer(None, _overrides(store, tmp_path / "failed", "train.compile=true"))
    summary = tr.fit()
    err = capsys.readouterr().err
    assert err.count("train.compile failed") == 1, err
    assert "no code for this graph" in err
    assert calls == [1]
    assert tr.step.model.failed is not None
    _, plain = _run(store, tmp_path / "plain", compiled=False)
    assert {k: summary[k] for k in METRIC_KEYS} == {k: plain[k] for k in METRIC_KEYS}


def test_the_users_inductor_cache_is_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert use_compile_cache(torch.device("cpu")) == str(tmp_path / "mine")
    assert not (tmp_path / "cache").exists()
    ours = str(tmp_path / "cache" / "sven" / "compile" / f"torch-{torch.__version__}-cpu")
    # Unset, or torch's own default (which torch writes there at its first need): ours.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    for value in ("", default_cache_dir()):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", value)
        assert use_compile_cache(torch.device("cpu")) == ours
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert use_compile_cache(torch.device("cpu")) == ours
