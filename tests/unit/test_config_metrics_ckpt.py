"""Config parsing, metrics against sklearn, and checkpoint atomicity/fallback."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from sven.config import load_config
from sven.engine.checkpoint import Checkpointer
from sven.engine.metrics import average_precision, mrr, roc_auc
from sven.errors import ConfigError


def test_overrides_and_presets(tmp_path) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text("model:\n  name: jodie\ntrain:\n  batch_size: 300\n")
    overrides = ["train.epochs=3", "train.lr=1e-3", "out=x", "model.sampling=uniform"]
    cfg = load_config(preset, overrides)
    assert cfg.model.name == "jodie"
    assert cfg.train.batch_size == 300
    assert cfg.train.epochs == 3
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.out == "x"
    assert cfg.model.sampling == "uniform"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.nope=1", "unknown config key 'train.nope'"),
        ("model.name=gat", "unknown model 'gat'"),
        ("train.batch_size=0", "train.batch_size must be positive"),
        ("train.batch_size=abc", "train.batch_size: expected an integer"),
        ("train.resume=maybe", "train.resume: expected true/false"),
        ("epochs", "not of the form key=value"),
        ("model.attention_form=tiled", "model.attention_form must be auto, fused or factored"),
    ],
)
def test_bad_overrides(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_presets_in_repo_load() -> None:
    from pathlib import Path

    for name in ("tgn", "jodie", "apan", "dyrep"):
        cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml")
        assert cfg.model.name == name
        assert (cfg.model.memory_dim, cfg.model.time_dim, cfg.model.embed_dim) == (100, 100, 100)
        assert cfg.train.batch_size == 200 and cfg.train.lr == pytest.approx(1e-4)


def test_metrics_match_sklearn_with_ties() -> None:
    rng = np.random.default_rng(0)
    for i in range(40):
        n = int(rng.integers(2, 300))
        s = rng.integers(0, 6, n).astype(float) if i % 2 else rng.random(n)
        y = rng.integers(0, 2, n)
        if y.min() == y.max():
            continue
        assert average_precision(torch.tensor(s), torch.tensor(y)) == pytest.approx(
            average_precision_score(y, s), abs=1e-12
        )
        auc = roc_auc(torch.tensor(s), torch.tensor(y))
        assert auc == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_mrr_exact() -> None:
    pos = torch.tensor([3.0, 1.0])
    neg = torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 5.0]])
    # ranks: 1, and 1 + 2 (above) + 0.5 (tie) = 3.5
    assert mrr(pos, neg) == pytest.approx((1 + 1 / 3.5) / 2)


def test_checkpoints_atomic_keep_k_and_fallback(tmp_path, capsys) -> None:
    ck = Checkpointer(tmp_path / "checkpoints", keep_latest_k=2)
    for step in (1, 2, 3):
        ck.save(step, {"x": torch.tensor([step])})
    assert ck.steps() == [2, 3]
    assert ck.latest() == 3
    # Corrupt the newest: it is skipped with a warning in favour of the previous one.
    (ck.path(3) / "state.pt").write_bytes(b"garbage")
    # The notice is a `sven:` line on stderr, not a Python warning.
    assert ck.latest() == 2
    err = capsys.readouterr().err
    assert err.startswith("sven: warning: checkpoint ") and "corrupt or incomplete" in err
    assert ck.load(2)["x"].item() == 2
    # A partial folder without meta.json is skipped too.
    (ck.path(4)).mkdir()
    assert ck.latest() == 2
    assert "sven: warning:" in capsys.readouterr().err
    assert not any(p.name.startswith(".tmp") for p in ck.root.iterdir())


def test_select_rules_pick_different_epochs_on_one_history() -> None:
    from sven.tasks.link import improved

    # Val AP creeps up to the last epoch while val AUC peaks at epoch 1 (JODIE's shape).
    history = [(0.80, 0.85), (0.82, 0.88), (0.83, 0.87), (0.84, 0.86)]

    def kept(select: str) -> list[int]:
        best: dict[str, float] = {"best_val_ap": -1.0, "best_val_auc": -1.0}
        out = []
        for epoch, (ap, auc) in enumerate(history):
            if improved(select, {"val_ap": ap, "val_auc": auc}, best):
                best.update(best_val_ap=ap, best_val_auc=auc)
                out.append(epoch)
        return out

    assert kept("ap") == [0, 1, 2, 3]
    assert kept("ap_auc") == [0, 1]
    # Ties count as improvement under ap_auc (DyGLib's >=), not under ap; NaN never does.
    tie = {"best_val_ap": 0.8, "best_val_auc": 0.8}
    assert improved("ap_auc", {"val_ap": 0.8, "val_auc": 0.8}, tie)
    assert not improved("ap", {"val_ap": 0.8, "val_auc": 0.9}, tie)
    assert not improved("ap_auc", {"val_ap": 0.9, "val_auc": float("nan")}, tie)
    # A checkpoint from before best_val_auc existed resumes under ap_auc.
    assert improved("ap_auc", {"val_ap": 0.9, "val_auc": 0.1}, {"best_val_ap": 0.8})


def test_select_must_be_known() -> None:
    from sven.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"train\.select"):
        TrainConfig(select="auc")


def test_checkpoint_digest_is_taken_while_writing(tmp_path, monkeypatch) -> None:
    """The streamed sha256 is the file's; a torch that cannot stream falls back."""
    from sven.engine.checkpoint import _save_hashed, _sha256

    obj = {"memory": torch.randn(300, 7), "step": 3, "nested": {"ids": torch.arange(11)}}
    fp = tmp_path / "a.pt"
    assert _save_hashed(obj, fp) == _sha256(fp)
    assert torch.equal(torch.load(fp, weights_only=True)["memory"], obj["memory"])

    real_save = torch.save

    def seeking_save(o, f, *a, **k):
        if not isinstance(f, (str, os.PathLike)):
            f.seek(0)  # what a seeking writer would do: unsupported on the stream
        return real_save(o, f, *a, **k)

    monkeypatch.setattr(torch, "save", seeking_save)
    fb = tmp_path / "b.pt"
    assert _save_hashed(obj, fb) == _sha256(fb)
    assert torch.equal(torch.load(fb, weights_only=True)["nested"]["ids"], torch.arange(11))
