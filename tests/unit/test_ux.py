"""The user-facing helpers: config reference and suggestions, sven config/env/plot, TensorBoard
logging and DataFrame input."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from sven.cli import main
from sven.cli.config import config_help, config_reference
from sven.config import Config, config_fields, load_config, suggest_key
from sven.errors import ConfigError, DataError
from tests.images import assert_png

REPO = Path(__file__).resolve().parents[2]


def _leaves(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the dataclasses, walked without sven.config's helpers."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += _leaves(type(default), f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


# ----------------------------------------------------------------------- config


def test_every_field_documented_in_help_and_reference() -> None:
    keys = _leaves(Config)
    assert [f.key for f in config_fields()] == keys
    assert all(f.doc for f in config_fields()), [f.key for f in config_fields() if not f.doc]
    help_text, ref = config_help(), config_reference()
    for f in config_fields():
        assert f"  {f.key}=" in help_text
        assert f"| `{f.key}` | {f.type} |" in ref
    # The docstring, defaults and types come from the source, not a copy.
    (epochs,) = [f for f in config_fields() if f.key == "train.epochs"]
    assert (epochs.type, epochs.default) == ("int", Config().train.epochs)
    assert epochs.doc.startswith("Maximum number of epochs")
    assert "| `log.tensorboard` | bool | `false` |" in ref


def test_committed_reference_is_generated() -> None:
    committed = (REPO / "docs" / "config.md").read_text()
    assert committed == config_reference(), "run: sven config --reference > docs/config.md"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("train.epoch", "train.epochs"),
        ("epochs", "train.epochs"),  # right name, section left out
        ("model.epochs", "train.epochs"),  # right name, wrong section
        ("train.batchsize", "train.batch_size"),
        ("modle.name", "model.name"),
        ("dist.stratgy", "dist.strategy"),
    ],
)
def test_unknown_key_names_the_nearest(typed: str, meant: str) -> None:
    assert suggest_key(typed) == meant
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{typed}=3"])
    assert f"unknown config key {typed!r}; did you mean {meant!r}?" in str(err.value)


def test_unknown_key_without_a_near_one_lists_the_known() -> None:
    assert suggest_key("zzzzzz") is None
    with pytest.raises(ConfigError, match="unknown config key 'zzzzzz'; known here"):
        load_config(None, ["zzzzzz=1"])


def test_sven_config_prints_yaml_that_loads_back(tmp_path, capsys) -> None:
    argv = ["--config", str(REPO / "configs" / "jodie.yaml"), "train.epochs=7", "out=runs/j"]
    assert main(["config", *argv]) == 0
    text = capsys.readouterr().out
    printed = yaml.safe_load(text)
    assert printed["model"]["name"] == "jodie" and printed["train"]["epochs"] == 7
    (tmp_path / "c.yaml").write_text(text)
    again = load_config(tmp_path / "c.yaml")
    assert again == load_config(REPO / "configs" / "jodie.yaml", argv[2:])
    assert main(["config", "--json", "train.lr=0.01"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["lr"] == 0.01
    assert main(["config", "train.epoch=3"]) == 2
    assert "did you mean 'train.epochs'?" in capsys.readouterr().err


def test_train_help_lists_every_key(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for f in config_fields():
        assert f"  {f.key}=" in out
    assert "Global batch size B (events)." in out


# ----------------------------------------------------------------- quiet ranks


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_config_error_is_said_by_rank_0_and_the_others_leave_later(
    rank: str, capsys, monkeypatch
) -> None:
    # Under a launcher every rank finds a bad value. Rank 0 says it and leaves at once;
    # another rank says nothing and waits before it leaves, so that torchrun, which
    # ends every rank once one exits with an error, cannot end rank 0 before its line.
    import sven.cli as cli

    waits: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", waits.append)
    for var in ("SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "train.lr=abc"]) == 2
    err = capsys.readouterr().err
    said = "sven: error: train.lr: expected a number, got 'abc'" in err
    assert (said, waits) == ((True, []) if rank == "0" else (False, [cli.QUIET_EXIT_WAIT_S]))


def test_only_torchrun_ranks_wait_and_never_on_a_stop(monkeypatch) -> None:
    # A stop with a checkpoint exits 75 on every rank together; under srun a rank
    # killed while it waited would change the step's exit code, which the batch
    # script requeues on.
    import sven.cli as cli
    from sven.errors import Stopped

    for var in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert not cli.waits_for_the_reporter(ConfigError("x"))  # no launcher
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.waits_for_the_reporter(ConfigError("x"))
    assert cli.waits_for_the_reporter(DataError("x"))
    assert not cli.waits_for_the_reporter(Stopped("stopped", "SIGTERM", "ckpt"))


# -------------------------------------------------------------------------- env


def test_sven_env_reports_versions_backends_and_launch(capsys, monkeypatch) -> None:
    import torch

    for var in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["packages"]["torch"] == torch.__version__
    assert env["packages"]["numpy"] == np.__version__
    assert env["backends"]["gloo"] is True
    assert env["launch"]["launcher"] == "single" and env["launch"]["world_size"] == 1
    assert len(env["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    # The launch comes from sven.distributed's own detection.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "node7")
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torchrun (env://): rank 1 of 4" in out and "rendezvous node7:29400" in out
    monkeypatch.setenv("RANK", "9")
    assert main(["env"]) == 0
    assert "rank 9 is outside world size 4" in capsys.readouterr().out


# ------------------------------------------------------------------------- plot


def _run_folder(tmp_path: Path, ranks: int, stages: bool) -> Path:
    """A hand-built run folder: 4 epochs, with per-rank bytes and stage times."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    lines = []
    for e in range(4):
        line = {"epoch": e, "train_loss": 0.7 - 0.05 * e, "val_ap": 0.6 + 0.05 * e}
        line["val_auc"] = None if e == 0 else 0.62 + 0.04 * e  # a NaN AUC became null
        if ranks > 1:
            line["comm_bytes_exchange_per_rank"] = [(r + 1) * 2**20 for r in range(ranks)]
            line["comm_bytes_naive_per_rank"] = [(r + 1) * 5 * 2**20 for r in range(ranks)]
        if stages:
            line["stage_sample_s_per_rank"] = [1.0 + r for r in range(ranks)]
            line["stage_compute_s_per_rank"] = [2.0] * ranks
        lines.append(line)
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {"model": "tgn", "dataset": "toy", "world_size": ranks, "best_epoch": 3}
    (run / "summary.json").write_text(json.dumps({**summary, "test_ap": 0.8, "test_auc": 0.81}))
    return run


def test_plot_run_draws_what_the_run_has(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    run = _run_folder(tmp_path, ranks=3, stages=True)
    assert main(["plot", str(run), "--out", str(tmp_path / "figs")]) == 0
    printed = capsys.readouterr().out.split()
    names = ["training.png", "comm_per_rank.png", "stage_times.png"]
    assert printed == [str(tmp_path / "figs" / n) for n in names]
    assert_png(tmp_path / "figs" / "training.png", colour="#d62728")  # the loss line
    assert_png(tmp_path / "figs" / "comm_per_rank.png", colour="#1f77b4")  # the bars
    assert_png(tmp_path / "figs" / "stage_times.png")
    # One rank, no stage keys: only the training figure, next to the run by default.
    one = _run_folder(tmp_path / "one", ranks=1, stages=False)
    assert main(["plot", str(one)]) == 0
    assert capsys.readouterr().out.split() == [str(one / "plots" / "training.png")]


def test_plot_rejects_other_folders(tmp_path, capsys) -> None:
    assert main(["plot", str(tmp_path)]) == 3
    assert "neither a run folder" in capsys.readouterr().err


def test_plot_says_how_to_install_matplotlib(tmp_path, capsys, monkeypatch) -> None:
    import sys

    run = _run_folder(tmp_path, ranks=1, stages=False)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    assert main(["plot", str(run)]) == 1
    # Sven runs from its checkout here: the hint installs the extra into it, with this
    # interpreter's pip, not another copy from a package index.
    hint = f"{sys.executable} -m pip install -e '{REPO}[plot]'"
    assert capsys.readouterr().err == f"sven: error: sven plot needs matplotlib: {hint}\n"


def test_install_hints_match_the_installation(tmp_path) -> None:
    from sven.extras import install_hint

    checkout = tmp_path / "repo"
    (checkout / "sven").mkdir(parents=True)
    (checkout / "datasets").mkdir()
    (checkout / "pyproject.toml").write_text("")
    pip = f"{sys.executable} -m pip install"
    assert install_hint("mpi", checkout / "sven") == f"{pip} -e '{checkout}[mpi]'"
    site = tmp_path / "site-packages" / "sven"
    site.mkdir(parents=True)
    assert install_hint("mpi", site) == f"{pip} 'sven[mpi]'"


# -------------------------------------------------------------------- tensorboard


def test_epoch_log_writes_scalars_per_epoch_and_rank(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sven.engine.tblog import EpochLog

    log = EpochLog(tmp_path / "tb", enabled=True)
    log.write({"epoch": 0, "train_loss": 0.5, "val_ap": None, "comm_bytes_per_rank": [3, 4]})
    log.write({"epoch": 1, "train_loss": 0.25, "val_ap": 0.75, "comm_bytes_per_rank": [5, 6]})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()

    def series(tag: str) -> list[tuple[int, float]]:
        return [(s.step, s.value) for s in acc.Scalars(tag)]

    assert series("train_loss") == [(0, 0.5), (1, 0.25)]
    assert series("val_ap") == [(1, 0.75)]
    assert series("comm_bytes_per_rank/rank1") == [(0, 4.0), (1, 6.0)]
    # Disabled, or not the main rank: nothing is written.
    EpochLog(tmp_path / "off", enabled=False).write({"epoch": 0, "train_loss": 1.0})
    EpochLog(tmp_path / "r1", enabled=True, main=False).write({"epoch": 0, "train_loss": 1.0})
    assert not (tmp_path / "off").exists() and not (tmp_path / "r1").exists()


def test_epoch_log_without_tensorboard_is_a_config_error(monkeypatch) -> None:
    import sys

    from sven.engine.tblog import EpochLog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError) as err:
        EpochLog("unused", enabled=True, main=False)
    assert str(err.value) == (
        "log.tensorboard=true needs the tensorboard package: "
        f"{sys.executable} -m pip install -e '{REPO}[tensorboard]'"
    )
    EpochLog("unused", enabled=False)  # not asked for: no error


# ---------------------------------------------------------------------- DataFrame


def test_from_dataframe_strings_datetimes_features(tmp_path) -> None:
    from sven.datasets import from_dataframe

    df = pd.DataFrame(
        {
            "who": ["b", "a", "c", "a"],
            "whom": ["a", "c", "b", "b"],
            "at": pd.to_datetime(["2024-01-02", "2024-01-01", "2024-01-03", "2024-01-04"]),
            "w": [2.0, 1.0, 3.0, 4.0],
            "y": [0, 1, 0, 1],
        }
    )
    ev = from_dataframe(df, tmp_path / "s", src="who", dst="whom", time="at", feat=["w"], label="y")
    # Sorted by time: a->c, b->a, c->b, a->b; ids by first appearance: a 0, c 1, b 2.
    np.testing.assert_array_equal(ev.src, [0, 2, 1, 0])
    np.testing.assert_array_equal(ev.dst, [1, 0, 2, 2])
    np.testing.assert_array_equal(ev.edge_feat[:, 0], [1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(ev.label, [1, 0, 0, 1])
    assert ev.t.dtype == np.int64 and ev.t[0] == 1_704_067_200  # 2024-01-01 in seconds
    assert ev.t[1] - ev.t[0] == 86_400


def test_from_dataframe_default_names_and_bad_rows(tmp_path) -> None:
    from sven.datasets import from_dataframe

    df = pd.DataFrame({"src": [3, 1, 2], "dst": [1, 2, 3], "ts": [10, 20, 30]})
    ev = from_dataframe(df, tmp_path / "ok")
    assert ev.num_events == 3 and ev.num_nodes == 3
    df.loc[1, "src"] = -1
    with pytest.raises(DataError, match="DataFrame: row 1: negative source id -1"):
        from_dataframe(df, tmp_path / "bad")
    with pytest.raises(DataError, match="no column 'user'"):
        from_dataframe(df, tmp_path / "bad", src="user")
    assert not (tmp_path / "bad").exists()


def test_trainer_logs_each_epoch_to_tensorboard(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import sven
    from sven.datasets.store import write_events

    rng = np.random.default_rng(0)
    e = 1200
    write_events(tmp_path / "s", rng.integers(0, 30, e), rng.integers(0, 30, e), np.arange(e))
    over = [f"data.path={tmp_path / 's'}", f"out={tmp_path / 'run'}", "train.epochs=2"]
    over += ["model.memory_dim=8", "model.time_dim=8", "model.embed_dim=8", "quiet=true"]
    sven.Trainer(None, [*over, "log.tensorboard=true"]).fit()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    got = [(s.step, s.value) for s in acc.Scalars("train_loss")]
    assert got == [(x["epoch"], pytest.approx(x["train_loss"], rel=1e-6)) for x in lines]


def test_a_slow_start_says_what_it_is_doing(capsys, monkeypatch) -> None:
    """The first `sven train` of a fresh environment imports torch for a minute: a word
    on stderr once the wait is noticeable, from rank 0, not with quiet; none when fast."""
    from sven.cli.train import _RANK_VARS, slow_start_notice

    for var in _RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    with slow_start_notice(False, after_s=0.0) as timer:
        timer.join()  # the wait outlasts the threshold
    assert capsys.readouterr().err == (
        "sven train: loading torch and the models (a first start in a fresh environment "
        "compiles them: up to a minute)...\n"
    )
    with slow_start_notice(False, after_s=3600.0) as timer:
        pass  # a start faster than the threshold
    timer.join()
    with slow_start_notice(True, after_s=0.0) as timer:
        assert not timer.is_alive()
    monkeypatch.setenv("RANK", "1")
    with slow_start_notice(False, after_s=0.0) as timer:
        assert not timer.is_alive()
    assert capsys.readouterr().err == ""
