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
                n = sum(m.startswith(f"{tok}-") for m in made) + 2  # a second store, say
                made.add(f"{tok}-{n}")
                tok = str(tmp / f"{tok.lower()}-{n}")
            else:
                made.add(tok)
                tok = str(paths[tok])
        elif re.fullmatch(r"[A-Z][A-Z_]+", tok):
            pytest.fail(f"README command {line.strip()!r} uses {tok}, unknown to this test")
        argv.append(tok)
    return argv


def test_readme_command_lines_run(tmp_path, monkeypatch, capsys) -> None:
    import gzip
    from dataclasses import replace

    from sven.datasets.registry import REGISTRY
    from tests.mirror import serve

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
        "NAME": "tiny",
    }
    # `sven data fetch NAME`: the raw file, published on a mirror on 127.0.0.1.
    served = tmp_path / "mirror"
    served.mkdir()
    (served / "tiny.txt.gz").write_bytes(gzip.compress(paths["RAW"].read_bytes()))
    ids = np.loadtxt(paths["RAW"], dtype=np.int64)[:, :2]
    entry = replace(REGISTRY["collegemsg"], name="tiny", url="https://example.invalid/tiny.txt.gz")
    entry = replace(entry, events=len(ids), nodes=len(np.unique(ids)), sha256=None, size=None)
    monkeypatch.setitem(REGISTRY, "tiny", entry)
    monkeypatch.setenv("SVEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    made = {"RAW", "NAME"}
    with serve(served) as (base, _):
        monkeypatch.setenv("SVEN_DATA_MIRROR", base)
        _run_readme_lines(lines, paths, made, tmp_path, capsys)
    assert (tmp_path / "figs" / "training.png").is_file()
    assert (tmp_path / "part" / "plots" / "partition.png").is_file()


def _run_readme_lines(lines: list[str], paths: dict, made: set[str], tmp_path: Path, capsys):
    for line in lines:
        argv = _instantiate(line, paths, made, tmp_path)
        rc = _sven(argv)
        captured = capsys.readouterr()
        assert rc == 0, f"{line}\n-> sven {shlex.join(argv)}: exit {rc}\n{captured.err[-2000:]}"
        if argv[0] == "plot":
            for png in map(Path, captured.out.split()):
                # One epoch draws single points; the bar charts have area to check.
                assert_png(png, colour=None if png.name == "training.png" else BAR_BLUE)


def _run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", **env}
    done = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{shlex.join(cmd)}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done


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


# --- every example of README.md and docs/, in order, in one fresh folder --------------

#: TINY, with evaluation passes over real data's val/test splits in few batches.
FAST = [*TINY, "train.batch_size=1000"]
#: The order a reader meets the documents in; every other docs/*.md follows, by name.
DOC_ORDER = ["README.md", "docs/guide.md", "docs/data.md", "docs/partition.md", "docs/synthetic.md"]
#: Python blocks that list an API rather than run (names they use are not defined).
PY_LISTINGS = {
    ("docs/contracts.md", "ev = TemporalEvents.load(path)"),  # the first line, or its start
    ("docs/data.md", "from sven.datasets.readers import convert, detect_format, open_reader"),
}
#: Lines that set up the environment (a venv, system packages, the test suite).
SETUP = ("python3 -m venv", ".venv/bin/pip", "bash .ci/setup.sh", ".venv/bin/python -m pytest")
COMMANDS = ("sven", ".venv/bin/sven", "python", "python3", ".venv/bin/python", "torchrun")
SHELL = ("mkdir", "printf", "rm", "bash")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]*\b|\$[A-Z]")


def _doc_blocks() -> list[tuple[str, str, str]]:
    """(document, language, text) of every fenced block, documents in reading order."""
    rest = sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))
    out = []
    for doc in DOC_ORDER + [d for d in rest if d not in DOC_ORDER]:
        text = (REPO / doc).read_text()
        out += [(doc, m[0], m[1]) for m in re.findall(r"```(\S*)\n(.*?)```", text, re.S)]
    return out


def _lines(text: str) -> list[str]:
    """A shell block's command lines, continuation lines joined."""
    return [x.strip() for x in text.replace("\\\n", " ").splitlines() if x.strip()]


def _kind(doc: str, lang: str, text: str) -> str:
    """run, or why a block is not run: figure, output, api listing, template, benchmark."""
    if lang == "mermaid":
        return "figure"
    if lang == "python":
        listing = any((doc, text.lstrip().startswith(head)) == (d, True) for d, head in PY_LISTINGS)
        return "api listing" if listing else "run"
    heads = [x.split()[0] for x in _lines(text) if not x.startswith("#")]
    if not heads or any(w not in COMMANDS + SHELL for w in heads):
        return "output"  # printed output, a file layout, a transcript ("$ sven ...")
    lines = [shlex.join(shlex.split(x, comments=True)) for x in _lines(text)]
    if any(PLACEHOLDER.search(x) or "[" in x for x in lines):
        return "template"  # STORE, OUT, DATA, P, ...: fill in your own; or a synopsis
    if any("benchmarks/" in x or " /" in x for x in lines):
        return "benchmark"  # how a figure was measured: a script, or a folder outside
    return "run"


def _small(argv: list[str]) -> list[str]:
    """A documented command at test size: tiny models and two batches; big synth stores
    shrunk (the paths and the order are what is tested, not learning)."""
    if argv[:2] == ["data", "synth"] and "--events" in argv:
        i = argv.index("--events") + 1
        if float(argv[i]) > 1e5:
            argv[i] = "5000"
            j = argv.index("--nodes") + 1
            argv[j] = str(min(int(float(argv[j])), 500))
    if argv[:1] == ["train"]:
        argv = [*argv, *FAST]
        if "task=node_classification" in argv:
            argv.append("nc.epochs=2")
    return argv


def _written(argv: list[str]) -> list[str]:
    """The folders or files a command line writes (its --out or out=)."""
    outs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--out"]
    return outs + [a.removeprefix("out=") for a in argv if a.startswith("out=")]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_documented_example_runs_in_order(tmp_path, monkeypatch, capsys) -> None:
    """README.md then docs/, each block in order, in one folder as a fresh clone is.

    Real data comes from ``sven data fetch``, through a mirror on 127.0.0.1 of the
    shared copies of the published files; without them, the blocks that need a fetched
    store are skipped and the test says which command fetches it.
    """
    from tests.conftest import SHARED_DATA
    from tests.mirror import serve

    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(clone)
    monkeypatch.setenv("SVEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    served = tmp_path / "mirror"
    served.mkdir()
    for name, src in (("CollegeMsg.txt.gz", "collegemsg/CollegeMsg.txt.gz"),):
        if (SHARED_DATA / src).is_file():
            (served / name).write_bytes((SHARED_DATA / src).read_bytes())
    if (SHARED_DATA / "wikipedia" / "wikipedia.csv.gz").is_file():
        # A copy of JODIE's file without its features: the same events, so the
        # registry's counts hold and its first-download hash is recorded.
        import gzip

        raw = gzip.decompress((SHARED_DATA / "wikipedia" / "wikipedia.csv.gz").read_bytes())
        (served / "wikipedia.csv").write_bytes(raw)
    kinds: dict[str, int] = {}
    written: dict[str, str] = {}
    missing: set[str] = set()  # outputs of blocks not run for want of real data
    skipped: list[str] = []
    with serve(served) as (base, _):
        monkeypatch.setenv("SVEN_DATA_MIRROR", base)
        for doc, lang, text in _doc_blocks():
            kind = _kind(doc, lang, text)
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind != "run":
                continue
            where = f"{doc}: {text.strip().splitlines()[0][:80]}"
            if any(m in text for m in missing):
                skipped.append(where)
                missing.update(_written(shlex.split(text.replace("\\\n", " "), comments=True)))
                continue
            if lang == "python":
                code = re.sub(r'"train\.epochs=\d+"', ", ".join(f'"{x}"' for x in FAST), text)
                exec(compile(code, doc, "exec"), {})
                continue
            for line in _lines(text):
                for part in line.split(" && "):
                    if part.startswith(SETUP):
                        continue
                    words = shlex.split(part, comments=True)
                    if not words:
                        continue
                    if words[0] in SHELL:
                        _run(["bash", "-euc", part], clone)
                        continue
                    if words[:3] == [".venv/bin/python", "-m", "torch.distributed.run"]:
                        cmd = [sys.executable, *words[1:], *FAST]
                        _run(cmd, clone, SVEN_CACHE=str(tmp_path / "cache"))
                        for out in _written(words):
                            assert out not in written, f"{where}: {out} written by {written[out]}"
                            written[out] = where
                        continue
                    assert words[0] in ("sven", ".venv/bin/sven"), f"{where}: {part}"
                    argv = _small(words[1:])
                    if any(m in part for m in missing):  # a store fetched above, not here
                        missing.update(_written(argv))
                        continue
                    for out in _written(argv):
                        assert out not in written, f"{where}: {out} also written by {written[out]}"
                        written[out] = where
                    if argv[:2] == ["data", "fetch"] and not (served / _file(argv[2])).is_file():
                        skipped.append(f"{where} (`{part}` needs the internet)")
                        missing.update(_written(argv))
                        continue
                    rc = _sven(argv)
                    err = capsys.readouterr().err
                    assert rc == 0, f"{where}\n-> sven {shlex.join(argv)}: exit {rc}\n{err[-3000:]}"
    # Everything the examples wrote is under scratch/, but the Quickstart's runs/default
    # (configs is this test's link).
    assert sorted(p.name for p in clone.iterdir()) == ["configs", "runs", "scratch"]
    assert kinds["run"] >= 20, kinds
    if skipped:
        pytest.skip("needs real data; fetched by the documented commands:\n" + "\n".join(skipped))


def _file(name: str) -> str:
    from sven.datasets.registry import lookup

    return lookup(name).file
