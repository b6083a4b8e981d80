"""Nothing lost by a slip: overwrite rules, damaged stores and checkpoints, resume rules,
and one ``sven:`` line (never a traceback) for each mistake a new user makes.

Every store here is made by the test (a few hundred events), so each case takes
seconds.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sven.cli import build_parser, main, parse
from sven.datasets.store import write_events
from sven.engine.checkpoint import Checkpointer, _sha256

SVEN = [sys.executable, "-m", "sven"]


def _events(n: int = 400, nodes: int = 30, seed: int = 0):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, nodes, n)
    dst = (src + rng.integers(1, nodes, n)) % nodes
    t = np.sort(rng.integers(0, 10_000, n))
    return src, dst, t, rng.random((n, 2)).astype(np.float32)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    src, dst, t, feat = _events()
    path = tmp_path_factory.mktemp("safety") / "store"
    write_events(path, src, dst, t, edge_feat=feat, num_nodes=30, name="tiny")
    return path


def _train(store: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        f"data.path={store}",
        f"out={out}",
        "train.device=cpu",
        "quiet=true",
        "train.epochs=1",
        "train.batch_size=100",
        "train.threads=1",
        "model.memory_dim=8",
        "model.time_dim=4",
        "model.embed_dim=8",
        "model.num_neighbors=3",
        *extra,
    ]


def _one_line(err: str) -> str:
    """The error output: exactly one `sven:` line, no traceback."""
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("sven: "), err
    return lines[0]


# ------------------------------------------------------------- overwrite rules


def test_convert_overwrite_never_deletes_a_folder_holding_the_input(tmp_path, capsys) -> None:
    raw = tmp_path / "events.txt"
    raw.write_text("1 2 10\n2 3 11\n3 1 12\n1 3 13\n2 1 14\n3 2 15\n1 2 16\n")
    (tmp_path / "thesis.tex").write_text("years of work")
    assert main(["data", "convert", str(raw), "--out", str(tmp_path), "--overwrite"]) == 1
    assert "holds the input" in _one_line(capsys.readouterr().err)
    # An ordinary folder is not replaced either, input or not.
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("x")
    assert main(["data", "convert", str(raw), "--out", str(other), "--overwrite"]) == 1
    assert "not an event store" in _one_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.txt", "other", "thesis.tex"]
    assert (other / "a.txt").read_text() == "x"
    # A store is replaced, and the command says which.
    out = tmp_path / "st"
    assert main(["data", "convert", str(raw), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["data", "convert", str(raw), "--out", str(out), "--overwrite"]) == 0
    assert f"replaced the event store 'events' at {out} (7 events)" in capsys.readouterr().out


def test_synth_overwrite_replaces_only_a_store(tmp_path, capsys) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "keep").write_text("k")
    args = ["data", "synth", "--events", "300", "--nodes", "20", "--out", str(folder)]
    assert main([*args, "--overwrite"]) == 1
    assert "not an event store" in _one_line(capsys.readouterr().err)
    assert (folder / "keep").read_text() == "k"
    out = tmp_path / "s"
    args[-1] = str(out)
    assert main(args) == 0
    assert main([*args, "--overwrite"]) == 0
    assert f"replaced the event store 'synth' at {out}" in capsys.readouterr().out


def test_partition_checks_out_before_computing_and_refuses_too_many_parts(
    store, tmp_path, capsys
) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "n.txt").write_text("n")
    base = ["partition", str(store), "--strategy", "hash", "--parts", "2"]
    assert main([*base, "--out", str(folder)]) == 3
    # Refused before any work: no progress line precedes the error.
    assert "already exists" in _one_line(capsys.readouterr().err)
    assert main([*base, "--out", str(folder), "--overwrite"]) == 3
    assert "not a partition folder" in _one_line(capsys.readouterr().err)
    assert main([*base, "--out", str(store), "--overwrite"]) == 3
    assert "holds the input" in _one_line(capsys.readouterr().err)
    assert (folder / "n.txt").read_text() == "n"
    too_many = ["partition", str(store), "--strategy", "hash", "--parts", "31"]
    assert main([*too_many, "--out", str(tmp_path / "p")]) == 2
    assert "more than the 30 nodes" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "p").exists()


# -------------------------------------------------------------- damaged stores


def _copy_store(store: Path, to: Path) -> Path:
    to.mkdir()
    for f in store.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


@pytest.mark.parametrize("command", ["info", "train", "partition"])
def test_a_truncated_column_is_one_line_in_every_command(store, tmp_path, command, capsys) -> None:
    bad = _copy_store(store, tmp_path / "bad")
    (bad / "src.npy").write_bytes((bad / "src.npy").read_bytes()[:-5])
    part = ["partition", str(bad), "--parts", "2", "--strategy", "hash", "--out"]
    argv = {
        "info": ["data", "info", str(bad)],
        "train": _train(bad, tmp_path / "run"),
        "partition": [*part, str(tmp_path / "p")],
    }[command]
    assert main(argv) == 3
    line = _one_line(capsys.readouterr().err)
    assert f"{bad / 'src.npy'}: truncated" in line


def test_changed_bytes_are_found_by_verify_and_by_train(store, tmp_path, capsys) -> None:
    bad = _copy_store(store, tmp_path / "bad")
    raw = bytearray((bad / "edge_feat.npy").read_bytes())
    raw[-2] ^= 0x10
    (bad / "edge_feat.npy").write_bytes(bytes(raw))
    assert main(["data", "verify", str(store)]) == 0
    assert "ok (400 events, 30 nodes; 6 files match their checksums)" in capsys.readouterr().out
    assert main(["data", "verify", str(bad)]) == 3
    assert "edge_feat.npy: checksum mismatch" in _one_line(capsys.readouterr().err)
    assert main(_train(bad, tmp_path / "run")) == 3
    line = _one_line(capsys.readouterr().err)
    assert "checksum mismatch" in line and "data.verify=false" in line
    assert not (tmp_path / "run").exists()
    # data.verify=false trains anyway (the structure is intact).
    assert main(_train(bad, tmp_path / "run", "data.verify=false")) == 0


def test_split_bytes_overwritten_stop_training(store, tmp_path, capsys) -> None:
    bad = _copy_store(store, tmp_path / "bad")
    split = np.load(bad / "split.npy")
    split[:50] = 2
    np.save(bad / "split.npy", split)
    assert main(_train(bad, tmp_path / "run", "data.verify=false")) == 3
    assert "split.npy: row 0: split label 2" in _one_line(capsys.readouterr().err)


def test_empty_splits_are_reported_before_training(tmp_path, capsys) -> None:
    src, dst, _, _ = _events(60)
    st = tmp_path / "s"
    # All events at one time: every one is at or before the val quantile, so val and
    # test are empty.
    write_events(st, src, dst, np.full(60, 7), num_nodes=30)
    assert main(_train(st, tmp_path / "run")) == 3
    line = _one_line(capsys.readouterr().err)
    assert "the val split is empty" in line and not (tmp_path / "run").exists()
    raw = tmp_path / "ev.txt"
    raw.write_text("".join(f"{i % 5} {(i + 1) % 5} 3\n" for i in range(10)))
    assert main(["data", "convert", str(raw), "--out", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert "sven: warning:" in err and "the val and test splits are empty" in err
    assert main(["data", "synth", "--events", "200", "--nodes", "10", "--out",
                 str(tmp_path / "y")]) == 0  # fmt: skip
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------- out and resume


def test_train_refuses_a_non_empty_out_and_overwrites_only_a_run(store, tmp_path, capsys) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.csv").write_text("precious")
    assert main(_train(store, mine)) == 2
    assert "already holds files that are not a Sven run" in _one_line(capsys.readouterr().err)
    assert main(_train(store, mine, "train.overwrite=true")) == 2
    assert "only deletes a run folder" in _one_line(capsys.readouterr().err)
    assert (mine / "data.csv").read_text() == "precious"

    run = tmp_path / "run"
    assert main(_train(store, run)) == 0
    capsys.readouterr()
    assert main(_train(store, run, "model.name=jodie")) == 2
    assert "already holds an earlier run" in _one_line(capsys.readouterr().err)
    assert main(_train(store, run, "model.name=jodie", "train.overwrite=true", "quiet=false")) == 0
    assert f"deleted the earlier run in {run}" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["model"]["name"] == "jodie"


def test_resume_compares_configs_and_says_when_it_starts_fresh(store, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(_train(store, run, "train.resume=true", "quiet=false")) == 0
    assert f"no checkpoint under {run}, starting fresh" in capsys.readouterr().err
    # Another model's settings: stopped, naming the keys, with nothing loaded.
    argv = _train(store, run, "train.resume=true", "model.memory_dim=16", "train.lr=0.01")
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert "model.memory_dim (8 -> 16)" in line and "train.lr (0.0001 -> 0.01)" in line
    assert "train.epochs" not in line
    # More epochs, another verbosity: a legitimate resume.
    assert main(_train(store, run, "train.resume=true", "train.epochs=2", "quiet=false")) == 0
    assert "resumed from" in capsys.readouterr().err


def test_quiet_is_quiet(store, tmp_path, capsys) -> None:
    assert main(["train", "--quiet", *_train(store, tmp_path / "run")[1:]]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "test AP" in out


def test_flags_and_overrides_mix_in_any_order() -> None:
    args = parse(build_parser(), ["train", "a.b=1", "--quiet", "out=X", "--config", "c", "a.b=2"])
    assert args.quiet and args.config == "c"
    assert args.overrides == ["a.b=1", "out=X", "a.b=2"]  # the last one still wins
    args = parse(build_parser(), ["eval", "x=1", "--checkpoint", "run", "y=2", "--json"])
    assert args.overrides == ["x=1", "y=2"] and args.checkpoint == "run"
    with pytest.raises(SystemExit):
        parse(build_parser(), ["train", "a=1", "--quiet", "stray"])


@pytest.mark.parametrize(
    ("device", "words"),
    [("gpu", "must be auto, cpu, cuda or cuda:N"), ("cuda:3", "this machine has only cpu")],
)
def test_a_device_that_does_not_exist_is_exit_2(store, tmp_path, device, words, capsys) -> None:
    if device == "cuda:3":
        import torch

        if torch.cuda.device_count() > 3:
            pytest.skip("this machine has a cuda:3")
        words = "this machine has only cpu"
    assert main(_train(store, tmp_path / "run", f"train.device={device}")) == 2
    assert words in _one_line(capsys.readouterr().err)


def test_auto_is_the_default_device() -> None:
    from sven.config import load_config

    assert load_config().train.device == "auto"


# ----------------------------------------------------------------- checkpoints


def test_eval_of_a_damaged_or_foreign_checkpoint_is_one_line(store, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(_train(store, run)) == 0
    capsys.readouterr()
    best = Checkpointer(run / "best")
    step_dir = best.path(best.latest())
    state = step_dir / "state.pt"
    good = state.read_bytes()
    # A truncated checkpoint: its checksum fails.
    state.write_bytes(good[: len(good) // 2])
    assert main(["eval", "--checkpoint", str(step_dir)]) == 1
    assert "corrupt or incomplete checkpoint" in _one_line(capsys.readouterr().err)
    # A file that is no checkpoint at all.
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    assert main(["eval", "--checkpoint", str(notes)]) == 1
    assert "not a checkpoint" in _one_line(capsys.readouterr().err)
    # Intact again: eval works from the run folder.
    state.write_bytes(good)
    assert main(["eval", "--checkpoint", str(run), "--json"]) == 0
    assert "test_ap" in json.loads(capsys.readouterr().out)


class _Exploit:
    """A pickle that runs code when loaded with full pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def test_loading_a_checkpoint_never_runs_code_from_it(store, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(_train(store, run)) == 0
    capsys.readouterr()
    best = Checkpointer(run / "best")
    step_dir = best.path(best.latest())
    marker = tmp_path / "marker"
    # A hostile checkpoint with checksums that match (whoever wrote it could do that).
    with open(step_dir / "state.pt", "wb") as f:
        pickle.dump({"config": {}, "payload": _Exploit(marker)}, f, protocol=2)
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["files"]["state.pt"] = _sha256(step_dir / "state.pt")
    (step_dir / "meta.json").write_text(json.dumps(meta))
    assert main(["eval", "--checkpoint", str(step_dir)]) == 1
    assert "holds more than tensors and plain values" in _one_line(capsys.readouterr().err)
    assert not marker.exists()


# ---------------------------------------------------------------- the CLI


def test_info_into_a_closed_pipe_is_quiet(store) -> None:
    proc = subprocess.Popen(
        [*SVEN, "data", "info", str(store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # the reader is gone before the first write, as `| head` can be
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""


def test_help_imports_no_optional_or_heavy_module() -> None:
    code = (
        "import sys; sys.modules['pymetis'] = None\n"
        "from sven.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'pandas', 'pymetis') if sys.modules.get(m)]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "partition" in done.stdout and "train" in done.stdout


def test_metis_without_pymetis_is_one_line(store, tmp_path) -> None:
    code = (
        "import sys; sys.modules['pymetis'] = None\n"
        "from sven.cli import main\n"
        f"sys.exit(main(['partition', {str(store)!r}, '--parts', '2', '--strategy', 'metis',"
        f" '--out', {str(tmp_path / 'p')!r}, '--quiet']))\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 2, done.stderr
    assert "strategy metis needs pymetis" in _one_line(done.stderr)


def test_the_first_bad_line_is_reported(tmp_path, capsys) -> None:
    raw = tmp_path / "bad.txt"
    # Line 3 has a bad value, line 4 too few fields: line 3 is the first bad line.
    raw.write_text("1 2 10\n2 3 11\n5 x 12\n4 5\n1 5 14\n")
    assert main(["data", "convert", str(raw), "--out", str(tmp_path / "s")]) == 3
    assert _one_line(capsys.readouterr().err).endswith(
        "bad.txt, line 3: non-numeric destination id 'x'"
    )
    # A later column's bad value on an earlier line wins over an earlier column's.
    raw.write_text("1 2 10\n2 3 11\n5 6 x\n4 y 13\n1 5 14\n")
    assert main(["data", "convert", str(raw), "--out", str(tmp_path / "s")]) == 3
    assert "line 3: unparseable time 'x'" in _one_line(capsys.readouterr().err)


# ------------------------------------------- issue 24: nothing lost, nothing wrong
# One test per numbered item of the issue, each failing on the code before the fix.


def _partial_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


def _raw_events(path: Path, n: int) -> Path:
    """A SNAP-style text file of ``n`` events (large enough to take a while to convert)."""
    i = np.arange(n)
    rows = np.stack([i % 997, (i * 7 + 1) % 991, i], axis=1)
    path.write_text("\n".join(" ".join(map(str, r)) for r in rows.tolist()) + "\n")
    return path


def _wait_for(predicate, proc: subprocess.Popen, what: str, limit: float = 240.0) -> None:
    """Polls until ``predicate()`` holds (no timing is asserted: the limit only ends a
    hung test)."""
    import time

    end = time.monotonic() + limit
    while not predicate():
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before {what}: {err}")
        assert time.monotonic() < end, f"no {what} within {limit} s"
        time.sleep(0.02)


def test_1_convert_overwrite_keeps_a_users_file_in_the_store(tmp_path, capsys) -> None:
    raw = tmp_path / "events.txt"
    raw.write_text("1 2 10\n2 3 11\n3 1 12\n1 3 13\n2 1 14\n3 2 15\n1 2 16\n")
    out = tmp_path / "st"
    assert main(["data", "convert", str(raw), "--out", str(out)]) == 0
    (out / "notes.txt").write_text("my notes")
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert main(["data", "convert", str(raw), "--out", str(out), "--overwrite"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "notes.txt" in line and "not written by Sven" in line
    assert (out / "notes.txt").read_text() == "my notes"
    assert sorted(p.name for p in out.iterdir()) == before
    # Once the user's file is gone, the store is replaced as before.
    (out / "notes.txt").unlink()
    assert main(["data", "convert", str(raw), "--out", str(out), "--overwrite"]) == 0


def test_2_partition_overwrite_keeps_a_users_file(store, tmp_path, capsys) -> None:
    part = tmp_path / "part"
    base = ["partition", str(store), "--strategy", "hash", "--parts", "4", "--quiet"]
    assert main([*base, "--out", str(part)]) == 0
    (part / "notes.txt").write_text("my notes")
    capsys.readouterr()
    assert main([*base, "--out", str(part), "--overwrite"]) == 3
    line = _one_line(capsys.readouterr().err)
    assert "notes.txt" in line and "not written by Sven" in line
    assert (part / "notes.txt").read_text() == "my notes"
    assert (part / "owner.npy").is_file()


def test_train_overwrite_keeps_a_users_file_in_the_run_folder(store, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(_train(store, run)) == 0
    (run / "notes.txt").write_text("my notes")
    capsys.readouterr()
    assert main(_train(store, run, "train.overwrite=true")) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"out={run} holds notes.txt, not written by Sven" in line
    assert (run / "notes.txt").read_text() == "my notes" and (run / "summary.json").is_file()


def _same_size_change(store: Path, to: Path) -> Path:
    """A copy of ``store`` whose src.npy has one id changed to another valid id: the
    structure and the value checks pass, only the checksum can tell."""
    bad = _copy_store(store, to)
    src = np.load(bad / "src.npy")
    src[5] = (src[5] + 1) % 30
    size = (bad / "src.npy").stat().st_size
    np.save(bad / "src.npy", src)
    assert (bad / "src.npy").stat().st_size == size
    return bad


def test_3_partition_and_report_refuse_changed_bytes(store, tmp_path, capsys) -> None:
    bad = _same_size_change(store, tmp_path / "bad")
    base = ["--strategy", "hash", "--parts", "2", "--quiet"]
    assert main(["partition", str(bad), *base, "--out", str(tmp_path / "p")]) == 3
    assert f"{bad / 'src.npy'}: checksum mismatch" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "p").exists()
    # A partition of the intact store is not reported against the changed one.
    assert main(["partition", str(store), *base, "--out", str(tmp_path / "good")]) == 0
    capsys.readouterr()
    assert main(["partition", "report", str(bad), str(tmp_path / "good")]) == 3
    assert "checksum mismatch" in _one_line(capsys.readouterr().err)


@pytest.fixture
def running_train(store, tmp_path):
    """A `sven train` subprocess into ``tmp_path/run``, frozen (SIGSTOP) once it has
    claimed its out and started its ``metrics.jsonl`` (written after ``config.json``),
    so that it holds the folder for as long as the test needs. On a loaded machine it
    may have finished epochs before the signal lands: tests compare with what it left."""
    import signal

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [*SVEN, *_train(store, run, "train.epochs=100000", "train.patience=0")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        _wait_for(lambda: (run / "metrics.jsonl").is_file(), proc, "metrics.jsonl")
        proc.send_signal(signal.SIGSTOP)
        yield proc, run
    finally:
        proc.kill()
        proc.communicate()


def test_4_two_resumes_into_one_out_at_once(store, running_train, capsys) -> None:
    proc, run = running_train
    before = (run / "metrics.jsonl").read_text()
    assert main(_train(store, run, "train.resume=true")) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"pid {proc.pid}" in line and "in use" in line
    assert (run / "metrics.jsonl").read_text() == before  # the second run wrote nothing
    # The OS releases the lock of a process that dies: the next resume proceeds.
    proc.kill()
    proc.communicate()
    assert main(_train(store, run, "train.resume=true")) == 0
    epochs = [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0]


def test_5_overwrite_of_a_running_run_is_refused(store, running_train, capsys) -> None:
    proc, run = running_train
    before = (run / "config.json").read_text()
    assert main(_train(store, run, "train.overwrite=true", "model.name=jodie")) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"pid {proc.pid}" in line and "in use" in line
    assert (run / "config.json").read_text() == before


def test_6_a_yaml_whose_top_level_is_not_a_mapping(tmp_path, capsys) -> None:
    cfg = tmp_path / "list.yaml"
    cfg.write_text("- train\n- model\n")
    assert main(["train", "--config", str(cfg)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{cfg}: the top level must be a mapping" in line and "got a list" in line


@pytest.mark.parametrize("key", ["train.lr", "model.dropout", "dist.timeout_s"])
def test_7_nan_is_refused_for_every_float_key(store, tmp_path, key, capsys) -> None:
    assert main(_train(store, tmp_path / "run", f"{key}=nan")) == 2
    assert f"{key} must be a finite number, got nan" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_8_infinite_lr_is_refused_and_a_diverging_loss_stops_training(
    store, tmp_path, capsys
) -> None:
    assert main(_train(store, tmp_path / "inf", "train.lr=inf")) == 2
    assert "train.lr must be a finite number, got inf" in _one_line(capsys.readouterr().err)
    # A finite but absurd learning rate: the loss turns NaN after the first step.
    run = tmp_path / "run"
    argv = _train(store, run, "train.lr=1e30", "train.checkpoint_every=1", "train.epochs=2")
    assert main(argv) == 1
    line = _one_line(capsys.readouterr().err)
    assert "the training loss is NaN" in line and "epoch 0" in line
    last_good = Checkpointer(run / "checkpoints")
    assert last_good.latest() is not None and f"{last_good.path(last_good.latest())}" in line
    # No metrics line with a made-up AP, no summary, no best model of the NaN state.
    assert (run / "metrics.jsonl").read_text() == ""
    assert not (run / "summary.json").exists() and not (run / "best").exists()
    state = last_good.load(last_good.latest())
    assert all(bool(v.isfinite().all()) for v in state["model"].values())


def test_8_nan_scores_are_no_perfect_ap() -> None:
    import math

    import torch

    from sven.engine.metrics import average_precision, link_metrics, roc_auc

    nan = torch.full((4,), float("nan"))
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert math.isnan(average_precision(nan, labels)) and math.isnan(roc_auc(nan, labels))
    ap, auc = link_metrics(torch.tensor([0.9, float("nan")]), torch.tensor([0.1, 0.2]))
    assert math.isnan(ap) and math.isnan(auc)


def test_9_nan_balance_is_refused(store, tmp_path, capsys) -> None:
    assert main(_train(store, tmp_path / "run", "dist.balance=nan")) == 2
    assert "dist.balance must be a finite number, got nan" in _one_line(capsys.readouterr().err)


def test_10_report_of_a_store_given_as_the_partition(store, capsys) -> None:
    assert main(["partition", "report", str(store), str(store)]) == 3
    line = _one_line(capsys.readouterr().err)
    assert f"{store}: an event store, not a partition" in line


def _convert_in_background(raw: Path, out: Path) -> subprocess.Popen:
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [*SVEN, "data", "convert", str(raw), "--out", str(out), "--block-mb", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    mine = f".{out.name}.partial-"
    _wait_for(
        lambda: any(p.startswith(mine) for p in _partial_dirs(out.parent)), proc, "its partial"
    )
    # Frozen halfway, holding its partial folder, for as long as the test needs.
    proc.send_signal(signal.SIGSTOP)
    return proc


def test_11_sigterm_during_convert_leaves_nothing(tmp_path) -> None:
    import signal

    raw = _raw_events(tmp_path / "big.txt", 200_000)
    stores = tmp_path / "stores"
    stores.mkdir()
    proc = _convert_in_background(raw, stores / "big")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143
    line = _one_line(err.decode())
    assert "stopped by SIGTERM" in line and str(stores / "big") in line
    assert list(stores.iterdir()) == []


def test_11_a_killed_converts_partial_folder_is_swept_by_the_next_run(tmp_path, capsys) -> None:
    import signal

    raw = _raw_events(tmp_path / "big.txt", 200_000)
    stores = tmp_path / "stores"
    stores.mkdir()
    killed = _convert_in_background(raw, stores / "a")
    killed.kill()
    killed.communicate()
    left = _partial_dirs(stores)
    assert len(left) == 1 and left[0].startswith(".a.partial-")
    # The next convert into the same parent removes it, and says so.
    live = _convert_in_background(raw, stores / "b")
    try:
        live_partial = _partial_dirs(stores)
        assert len(live_partial) == 1 and live_partial[0].startswith(".b.partial-")
        # A convert in progress beside another run keeps its partial folder.
        small = tmp_path / "small.txt"
        small.write_text("1 2 10\n2 3 11\n3 1 12\n1 3 13\n2 1 14\n3 2 15\n1 2 16\n")
        assert main(["data", "convert", str(small), "--out", str(stores / "c")]) == 0
        assert "removed" not in capsys.readouterr().err
        assert _partial_dirs(stores) == live_partial
    finally:
        live.send_signal(signal.SIGTERM)
        live.send_signal(signal.SIGCONT)
        _, err = live.communicate(timeout=240)
    assert f"sven: warning: removed {stores / left[0]}, left by an interrupted run" in err.decode()
    assert live.returncode == 143 and _partial_dirs(stores) == []
    assert sorted(p.name for p in stores.iterdir()) == ["c"]


def test_11_sigterm_during_partition_leaves_nothing(tmp_path) -> None:
    import signal

    # Large enough that the partition is still running when the signal comes (the
    # store's checksums hash in parallel now, so a small one can end first).
    src, dst, t, _ = _events(2_000_000, nodes=50_000)
    big = tmp_path / "big"
    write_events(big, src, dst, t, num_nodes=50_000)
    parts = tmp_path / "parts"
    parts.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [*SVEN, "partition", str(big), "--parts", "4", "--strategy", "ldg", "--quiet"]
    proc = subprocess.Popen(
        [*argv, "--out", str(parts / "p")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    # Its lock file appears before any work; frozen there, it is stopped mid-way.
    _wait_for(lambda: (parts / ".p.sven-lock").is_file(), proc, "its lock file")
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143
    assert "stopped by SIGTERM" in _one_line(err.decode())
    assert list(parts.iterdir()) == []


def test_12_plot_without_matplotlib_is_one_line_and_writes_nothing(store, tmp_path) -> None:
    run = tmp_path / "run"
    assert main(_train(store, run)) == 0
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from sven.cli import main\n"
        f"sys.exit(main(['plot', {str(run)!r}, '--out', {str(tmp_path / 'figs')!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "sven plot needs matplotlib" in _one_line(done.stderr)
    assert not (tmp_path / "figs").exists() and not (run / "plots").exists()


# ---------------------------------------------- issue 24: also seen, fixed while there


def test_the_first_line_of_the_default_run_says_what_is_trained(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SVEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    argv = ["train", "train.device=cpu", "train.epochs=1", "train.max_batches=1",
            "train.threads=1", "model.memory_dim=8", "model.time_dim=4", "model.embed_dim=8",
            "model.num_neighbors=3", "train.batch_size=2000"]  # fmt: skip
    assert main(argv) == 0
    first = capsys.readouterr().err.splitlines()[0]
    for words in ("tgn", "the built-in synthetic dataset", str(tmp_path / "cache"), "cpu",
                  "runs/default"):  # fmt: skip
        assert words in first, first


def test_a_resumed_runs_events_per_s_counts_the_time_before_the_stop(store, tmp_path) -> None:
    import signal

    from sven.engine.trainer import Trainer
    from sven.errors import Stopped

    run = tmp_path / "run"
    argv = _train(store, run, "train.batch_size=20")[1:]
    trainer = Trainer(None, argv)
    steps = []

    def stop_at_the_third(tr) -> None:
        steps.append(1)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.add_hook("after_step", stop_at_the_third)
    with pytest.raises(Stopped):
        trainer.fit()
    ck = Checkpointer(run / "checkpoints")
    progress = ck.load(ck.latest())["progress"]
    assert progress["train_events"] == 60
    # The three steps' time is in the checkpoint, so that the resumed run's events/s
    # divides all its events by all their time.
    assert progress["train_time"] > 0 and progress["epoch_time"] > 0


def test_a_corrupt_best_model_under_eval_is_one_line(store, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(_train(store, run)) == 0
    best = Checkpointer(run / "best")
    step_dir = best.path(best.latest())
    (step_dir / "state.pt").write_bytes(b"broken")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "falling back" not in line
    assert f"no valid checkpoint under {run / 'best'}: {step_dir.name} is corrupt" in line


def test_the_tensors_only_refusal_is_a_whole_sentence(store, tmp_path) -> None:
    import torch

    run = tmp_path / "run"
    assert main(_train(store, run)) == 0
    best = Checkpointer(run / "best")
    step_dir = best.path(best.latest())
    torch.save({"config": {}, "payload": _Exploit(tmp_path / "marker")}, step_dir / "state.pt")
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["files"]["state.pt"] = _sha256(step_dir / "state.pt")
    (step_dir / "meta.json").write_text(json.dumps(meta))
    done = subprocess.run(
        [*SVEN, "eval", "--checkpoint", str(step_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    line = _one_line(done.stderr)
    assert "Warning" not in line and "\x1b" not in line
    assert line.endswith(
        "holds more than tensors and plain values (it names getattr); Sven never loads "
        "such a file, since loading it could run code from it."
    ), line
    assert not (tmp_path / "marker").exists()
