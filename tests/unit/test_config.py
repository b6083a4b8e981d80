"""Config parsing (sven.config): presets, overrides and their errors."""

from __future__ import annotations

import pytest

from sven.config import load_config
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


def test_select_must_be_known() -> None:
    from sven.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=r"train\.select"):
        TrainConfig(select="auc")
