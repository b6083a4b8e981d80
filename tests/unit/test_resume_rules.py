"""Which config changes a resume accepts, and which folders ``train`` may write into."""

from __future__ import annotations

import json

import pytest

from sven.config import Config, config_differences, load_config
from sven.engine.run_folder import is_run_folder, prepare_out
from sven.errors import ConfigError


def test_config_differences_ignore_what_may_change_and_fill_in_defaults() -> None:
    saved = Config().to_dict()
    cur = load_config(None, ["train.epochs=9", "quiet=true", "out=elsewhere", "train.resume=true"])
    assert config_differences(saved, cur) == []
    # How to run, not what: a requeued job may resume with the fast GPU settings.
    cur = load_config(None, ["train.compile=true", "train.matmul_precision=high"])
    assert config_differences(saved, cur) == []
    cur = load_config(None, ["model.memory_dim=16", "train.lr=0.01"])
    assert config_differences(saved, cur) == [
        "model.memory_dim (100 -> 16)",
        "train.lr (0.0001 -> 0.01)",
    ]
    # A checkpoint written before a key existed: the key takes its default.
    del saved["train"]["deterministic"]
    assert config_differences(saved, Config()) == []
    # A key this version does not know differs.
    saved["train"]["bogus"] = 1
    assert config_differences(saved, Config()) == [
        "train.bogus (1 -> '<missing>')",
        "train.deterministic ('<missing>' -> True)",
    ]


def _run_folder(path) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(Config().to_dict()))
    (path / "metrics.jsonl").write_text("")


def test_prepare_out(tmp_path) -> None:
    said: list[str] = []
    # Missing or empty: used as is, whatever the flags.
    prepare_out(tmp_path / "new", resume=False, overwrite=False, log=said.append)
    (tmp_path / "empty").mkdir()
    prepare_out(tmp_path / "empty", resume=True, overwrite=False, log=said.append)
    # Another folder: refused, even with overwrite or resume, and left alone.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "x").write_text("x")
    for resume, overwrite in ((False, False), (True, False), (False, True)):
        with pytest.raises(ConfigError):
            prepare_out(mine, resume=resume, overwrite=overwrite, log=said.append)
    assert (mine / "x").read_text() == "x" and not is_run_folder(mine)
    # A run: refused plainly, kept for resume, deleted for overwrite (and said so).
    run = tmp_path / "run"
    _run_folder(run)
    assert is_run_folder(run)
    with pytest.raises(ConfigError, match="already holds an earlier run"):
        prepare_out(run, resume=False, overwrite=False, log=said.append)
    prepare_out(run, resume=True, overwrite=False, log=said.append)
    assert run.is_dir() and said == []
    (run / "logs").mkdir()
    (run / "logs" / "rank0.log").write_text("this launch's own log")
    prepare_out(run, resume=False, overwrite=True, log=said.append)
    # Everything but this launch's per-rank logs goes.
    assert [p.name for p in run.iterdir()] == ["logs"]
    assert said == [f"train.overwrite: deleted the earlier run in {run}"]
    # A folder holding only those logs (a P-rank launch opens them first) is fresh.
    prepare_out(run, resume=False, overwrite=False, log=said.append)
    with pytest.raises(ConfigError, match="is a file"):
        prepare_out(mine / "x", resume=False, overwrite=False, log=said.append)


def test_prepare_out_ignores_the_launchs_own_logs(tmp_path) -> None:
    # Every rank of `sven train` opens <out>/logs/rank<R>.log before rank 0 checks out.
    fresh = tmp_path / "fresh"
    (fresh / "logs").mkdir(parents=True)
    (fresh / "logs" / "rank1.log").write_text("== header\n")
    prepare_out(fresh, resume=False, overwrite=False)
    prepare_out(fresh, resume=True, overwrite=False)
    # Overwriting a run keeps the logs the ranks have open, and deletes the rest.
    run = tmp_path / "run"
    _run_folder(run)
    (run / "logs").mkdir()
    (run / "logs" / "rank0.log").write_text("== header\n")
    prepare_out(run, resume=False, overwrite=True, log=lambda msg: None)
    assert [p.name for p in run.iterdir()] == ["logs"]
    assert (run / "logs" / "rank0.log").read_text() == "== header\n"
