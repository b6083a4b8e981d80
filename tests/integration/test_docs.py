"""What the README, the user guide and docs/examples tell a user to run, run.

The README's commands are read from the README itself and run on small data (a few
thousand events, one epoch of two batches); a placeholder the test does not know, a
command that fails or a figure that is not a real image fails the test. The two
Quickstart setup commands are not rerun (they create a venv and install); the
``sven train`` that the first one ends in is.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sven.cli import main
from tests.images import BAR_BLUE, assert_png

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Small models and two batches: the commands' paths are what is tested, not learning.
TINY = [
    "train.epochs=1",
    "train.max_batches=2",
    "model.memory_dim=8",
    "model.time_dim=8",
    "model.embed_dim=8",
    "quiet=true",
]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _snap_file(path: Path, events: int = 3000, nodes: int = 60) -> Path:
    """A SNAP-format event file where each node mostly talks to two partners."""
    rng = np.random.default_rng(0)
    src = rng.integers(0, nodes, events)
    partners = rng.integers(0, nodes, (nodes, 2))
    dst = np.where(rng.random(events) < 0.8, partners[src, rng.integers(0, 2, events)], src)
    t = np.sort(rng.integers(0, 10**6, events))
    path.write_text("".join(f"{a} {b} {c}\n" for a, b, c in zip(src, dst, t)))
    return path


def _sven(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # --version and --help exit through argparse
        return int(exc.code or 0)


def test_quickstart_commands(tmp_path, monkeypatch, capsys) -> None:
    readme = (REPO / "README.md").read_text()
    setup, tests = (
        b.strip().splitlines()[-1] for b in _blocks(_section(readme, "Quickstart"), "bash")
    )
    # The two commands a fresh machine needs; their ends are what users rely on.
    assert setup.startswith("python3 -m venv .venv && ") and setup.endswith(
        " && .venv/bin/sven train"
    )
    assert tests == "bash .ci/setup.sh && .venv/bin/python -m pytest -q"
    # The first one's `sven train`: TGN on the built-in synthetic data, one CPU process.
    monkeypatch.setenv("SVEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(setup.rsplit("&&", 1)[1])[1:]
    assert argv == ["train"]
    # Small widths and evaluation batches keep the built-in data's val/test passes short.
    small = [*TINY, "train.batch_size=1000", "out=runs/default"]
    assert _sven([*argv, *small]) == 0
    assert "tgn on synth: test AP" in capsys.readouterr().out
    assert (tmp_path / "runs" / "default" / "summary.json").is_file()


def _instantiate(line: str, paths: dict[str, Path], made: set[str], tmp: Path) -> list[str]:
    """A README command line with its placeholders and optional parts filled in."""
    line = line.split("#", 1)[0].replace("[", "").replace("]", "")
    tokens = shlex.split(line)[1:]
    argv: list[str] = []
    for i, tok in enumerate(tokens):
        if tok == "...":
            continue
        if tok == "key=value":
            argv += [f"data.path={paths['STORE']}", "out=runs/x", *TINY]
            continue
        prev = tokens[i - 1] if i else ""
        if prev in ("--events", "--nodes") and tokens[:2] == ["data", "synth"]:
            tok = {"--events": "3000", "--nodes": "60"}[prev]  # small data
        elif tok in paths:
            if prev == "--out" and tok in made:
                tok = str(tmp / f"{tok.lower()}-{len(made)}")  # a second store, say
            else:
                made.add(tok)
                tok = str(paths[tok])
        elif re.fullmatch(r"[A-Z][A-Z_]+", tok):
            pytest.fail(f"README command {line.strip()!r} uses {tok}, unknown to this test")
        argv.append(tok)
    return argv


def test_readme_command_lines_run(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("matplotlib")
    readme = (REPO / "README.md").read_text()
    (block,) = _blocks(_section(readme, "Command line"), "text")
    lines = [x for x in block.splitlines() if x.startswith("sven ")]
    assert len(lines) >= 10
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    paths = {
        "RAW": _snap_file(tmp_path / "raw.txt"),
        "STORE": tmp_path / "store",
        "PART": tmp_path / "part",
        "DIR": tmp_path / "figs",
    }
    made = {"RAW"}
    for line in lines:
        argv = _instantiate(line, paths, made, tmp_path)
        rc = _sven(argv)
        captured = capsys.readouterr()
        assert rc == 0, f"{line}\n-> sven {shlex.join(argv)}: exit {rc}\n{captured.err[-2000:]}"
        if argv[0] == "plot":
            for png in map(Path, captured.out.split()):
                # One epoch draws single points; the bar charts have area to check.
                assert_png(png, colour=None if png.name == "training.png" else BAR_BLUE)
    assert (tmp_path / "figs" / "training.png").is_file()
    assert (tmp_path / "part" / "plots" / "partition.png").is_file()


def test_readme_python_block_runs(tmp_path, monkeypatch) -> None:
    readme = (REPO / "README.md").read_text()
    (code,) = _blocks(_section(readme, "Command line"), "python")
    store = tmp_path / "store"
    assert (
        _sven(["data", "convert", str(_snap_file(tmp_path / "raw.txt")), "--out", str(store)]) == 0
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    small = ", ".join(f'"{x}"' for x in [*TINY, "out=run"])
    for old, new in (("data.path=stores/uci", f"data.path={store}"), ('"train.epochs=5"', small)):
        assert old in code, f"the README's Python example changed: update this test ({old})"
        code = code.replace(old, new)
    scope: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert 0.0 <= scope["summary"]["test_ap"] <= 1.0
    assert (tmp_path / "run" / "summary.json").is_file()


def _run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", **env}
    done = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{shlex.join(cmd)}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done


def test_guide_input_format_examples_convert(tmp_path, monkeypatch) -> None:
    guide = (REPO / "docs" / "guide.md").read_text()
    blocks = _blocks(_section(guide, "Your own data"), "bash")
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        # Shell lines write the example file; the sven line runs in this process.
        for line in block.strip().splitlines():
            if line.startswith("sven "):
                assert _sven(shlex.split(line)[1:]) == 0, line
            else:
                _run(["bash", "-euc", line], tmp_path)
    for store in ("msgs", "trust", "wiki", "tgl", "pay"):
        assert (tmp_path / "scratch" / "stores" / store / "meta.json").is_file(), store
    # Everything the examples wrote is under scratch/.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch"]


@pytest.mark.parametrize("script", ["dataframe_tgn.py", "pyg_roundtrip.py"])
def test_python_examples_run(tmp_path, script: str) -> None:
    done = _run(
        [sys.executable, str(REPO / "docs" / "examples" / script)], tmp_path, OUT=str(tmp_path)
    )
    assert "test AP" in done.stdout
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.dist
def test_two_rank_example_and_its_figures(tmp_path) -> None:
    """The torchrun example on 2 gloo ranks, then `sven plot` on the real run."""
    pytest.importorskip("matplotlib")
    env = {"OUT": str(tmp_path), "SVEN": str(VENV_BIN / "sven"), "EPOCHS": "1", "MAX_BATCHES": "3"}
    done = _run(["bash", str(REPO / "docs" / "examples" / "two_ranks.sh")], REPO, **env)
    assert "launcher=torchrun backend=gloo world_size=2" in done.stderr
    pngs = [Path(p) for p in done.stdout.split() if p.endswith(".png")]
    # The run records per-rank stage times (the timeline), so their figure comes too.
    names = ["comm_per_rank.png", "partition.png", "stage_times.png", "training.png"]
    assert sorted(p.name for p in pngs) == names
    for png in pngs:
        bars = png.name in ("comm_per_rank.png", "partition.png")
        assert_png(png, colour=BAR_BLUE if bars else None)
    # The figure shows what the run measured: both byte counts, per rank.
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(line["comm_bytes_exchange_per_rank"]) == 2
    assert all(
        0 < a < b
        for a, b in zip(line["comm_bytes_exchange_per_rank"], line["comm_bytes_naive_per_rank"])
    )


def test_guide_using_a_trained_model_runs(tmp_path, monkeypatch) -> None:
    """The section's commands and Python block, in order, on the data they generate."""
    guide = (REPO / "docs" / "guide.md").read_text()
    section = _section(guide, "Using a trained model")
    bash = _blocks(section, "bash")
    (python,) = _blocks(section, "python")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    for line in bash[0].strip().splitlines():
        if line.startswith("sven "):
            argv = shlex.split(line)[1:]
            if argv[0] == "train":
                argv += TINY
            assert _sven(argv) == 0, line
        else:
            _run(["bash", "-euc", line], tmp_path)
    scratch = tmp_path / "scratch"
    scores = (scratch / "scores.csv").read_text().splitlines()
    assert scores[0] == "src,dst,t,score" and len(scores) == 4
    top = (scratch / "top.csv").read_text().splitlines()
    assert top[0] == "src,t,rank,dst,score" and len(top) == 11
    assert np.load(scratch / "emb.npy").shape == (3, 8)
    scope: dict[str, object] = {}
    exec(compile(python, "guide.md", "exec"), scope)
    assert scope["emb"].shape == (2, 8) and scope["top"].shape == (1, 5)
    # The node-classification command, on a labelled copy of the same events.
    (nc_line,) = [x for x in bash[1].strip().splitlines() if x.startswith("sven ")]
    from sven.datasets.store import TemporalEvents, write_events

    ev = TemporalEvents.load(scratch / "stores" / "synth")
    label = (np.arange(ev.num_events) % 50 == 0).astype(np.int64)
    write_events(scratch / "stores" / "wikipedia", ev.src, ev.dst, ev.t, label=label)
    argv = [*shlex.split(nc_line)[1:], *TINY, "nc.epochs=2"]
    assert _sven(argv) == 0, nc_line
    summary = json.loads((scratch / "runs" / "wiki-nc" / "summary.json").read_text())
    assert summary["task"] == "node_classification" and "test_auc" in summary
    # Everything the section wrote is under scratch/ (configs is this test's link).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs", "scratch"]
