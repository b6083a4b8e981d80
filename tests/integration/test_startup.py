"""Start-up (issue 22): what ``sven train`` imports, what it reports, what it refuses."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sven.cli import main
from sven.engine.startup import TRITON_MODULES
from tests.integration.test_safety import _train
from tests.integration.test_safety import store as store  # the fixture

#: Packages a CPU training run needs none of (readers, plots, the PyG baseline, the
#: scientific stack's extras, MPI launchers' bindings, TensorBoard (``log.tensorboard``
#: off), torch's compiler (no ``train.compile``), Triton, which only CUDA kernels use,
#: and the symbolic shapes of torch.fx with sympy (2.2 s of imports on the H100 machine;
#: a seed given to ``loss.backward`` imported them).
NOT_NEEDED = ("torch_geometric", "pandas", "pyarrow", "matplotlib", "sklearn", "scipy",
              "mpi4py", "tensorboard", "torch._dynamo", "torch._inductor", "triton",
              "torch.fx.experimental.symbolic_shapes", "sympy")  # fmt: skip
#: The other commands' modules (plots, `sven env`'s package metadata, the synthetic
#: generator's parser, partitioning), which `sven train` with a store does not run.
OTHER_STAGES = ("sven.cli.plot", "sven.cli.env", "sven.cli.predict", "sven.datasets.cli",
                "sven.datasets.synth", "sven.partition")  # fmt: skip
#: Whether the config's source was parsed for the help's key list (sven.config.schema).
HELP_PARSED = "sys.modules['sven.config.schema']._docstrings.cache_info().currsize"


def test_the_cli_parses_a_run_without_torch_other_stages_or_the_help_text() -> None:
    code = (
        "import json, sys\n"
        "import sven, sven.cli\n"
        "argv = ['train', 'train.epochs=1', '--quiet']\n"
        "args = sven.cli.parse(sven.cli.build_parser(argv[0]), argv)\n"
        "assert args.overrides == ['train.epochs=1'] and args.quiet, args\n"
        f"heavy = ('torch', *{NOT_NEEDED!r}, *{OTHER_STAGES!r})\n"
        f"print(json.dumps([sorted(m for m in heavy if m in sys.modules), {HELP_PARSED}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[], 0]


def test_train_imports_only_what_it_needs_and_reports_its_start_up(store, tmp_path) -> None:
    out = tmp_path / "run"
    code = (
        "import json, sys\n"
        "from sven.cli import main\n"
        f"rc = main({_train(store, out)!r})\n"
        f"heavy = (*{NOT_NEEDED!r}, *{OTHER_STAGES!r})\n"
        f"print(json.dumps([rc, sorted(m for m in heavy if m in sys.modules), {HELP_PARSED}]))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    rc, imported, help_parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rc == 0
    assert imported == []
    assert help_parsed == 0
    summary = json.loads((out / "summary.json").read_text())
    parts = {
        k: v
        for k, v in summary.items()
        if k.startswith("startup_") and k.endswith("_s") and k != "startup_s"
    }
    # Every phase up to the first step, and nothing unaccounted for but small change.
    for phase in ("imports", "store_open", "plan", "checksums", "to_device", "model", "tables",
                  "run_start", "epoch_start", "first_batches"):  # fmt: skip
        assert parts[f"startup_{phase}_s"] >= 0, phase
    # Triton is preloaded for CUDA runs only: no wait for it on CPU.
    assert "startup_preload_s" not in parts
    assert parts["startup_first_step_s"] > 0
    assert sum(parts.values()) == pytest.approx(summary["startup_s"], abs=2e-3)
    assert summary["startup_s"] < summary["wall_s"] + parts["startup_imports_s"] + 1
    assert summary["eval_events_per_s"] > 0 and summary["test_events_per_s"] > 0
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert line["val_events_per_s"] > 0 and line["events_per_s"] > 0


def _needs_triton() -> None:
    # Looked up, not imported: triton's bindings complain of leaks at this process's exit.
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")


def _python(code: str, timeout: float = 120) -> list:
    """The last line ``code`` prints (JSON), run in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_is_preloaded_for_cuda_runs_only() -> None:
    code = (
        "import json, os, sys\n"
        "from sven.engine.startup import preload_triton\n"
        "nones = [preload_triton('cpu') is None]\n"
        "os.environ['SVEN_KERNELS'] = 'reference'\n"
        "nones.append(preload_triton('cuda') is None)\n"
        "nones.append(preload_triton('cuda:1') is None)\n"
        "print(json.dumps([nones, 'triton' in sys.modules]))\n"
    )
    assert _python(code) == [[True, True, True], False]


def test_a_preload_imports_in_its_thread_in_order_then_calls_then() -> None:
    _needs_triton()
    code = (
        "import json, sys, threading\n"
        "from sven.engine.startup import TRITON_MODULES, Preload\n"
        "seen = []\n"
        "def then():\n"
        "    seen.append([threading.current_thread().name,\n"
        "                 all(m in sys.modules for m in TRITON_MODULES)])\n"
        "before = [m for m in ('triton', *TRITON_MODULES) if m in sys.modules]\n"
        "p = Preload(('triton', *TRITON_MODULES), then=then)\n"
        "waited = p.join()\n"
        "after = [m for m in ('triton', *TRITON_MODULES) if m in sys.modules]\n"
        "print(json.dumps([before, len(after), seen, p.error is None, waited >= 0]))\n"
    )
    before, after, seen, ok, waited = _python(code)
    assert before == []
    assert after == 1 + len(TRITON_MODULES)
    assert seen == [["sven-preload", True]]
    assert ok and waited


def test_a_preload_keeps_its_error_and_stops_there() -> None:
    code = (
        "import json, sys\n"
        "from sven.engine.startup import Preload\n"
        "calls = []\n"
        "p = Preload(('sven_no_such_module', 'sven.cli.plot'), then=lambda: calls.append(1))\n"
        "p.join()\n"
        "print(json.dumps([type(p.error).__name__, 'sven.cli.plot' in sys.modules, calls]))\n"
    )
    assert _python(code) == ["ModuleNotFoundError", False, []]


def test_the_cli_pauses_the_collector_to_the_first_step_then_freezes_start_up(
    store, tmp_path
) -> None:
    argv = _train(store, tmp_path / "run")
    missing = [argv[0], f"data.path={tmp_path / 'none'}", *argv[2:]]
    code = (
        "import gc, json\n"
        "import sven.engine.trainer as tr\n"
        "from sven.cli import main\n"
        "seen = []\n"
        "orig = tr.Trainer.first_step_done\n"
        "def done(self, t, bar):\n"
        "    seen.append(gc.isenabled())\n"
        "    orig(self, t, bar)\n"
        "    seen.append([gc.isenabled(), gc.get_freeze_count() > 0])\n"
        "tr.Trainer.first_step_done = done\n"
        f"rc = main({argv!r})\n"
        "after_run = gc.isenabled()\n"
        # A run that fails before its first step gives the collector back too.
        f"bad = main({missing!r})\n"
        "print(json.dumps([rc, seen, after_run, bad != 0, gc.isenabled()]))\n"
    )
    rc, seen, after_run, failed, after_failure = _python(code, timeout=300)
    assert rc == 0
    assert seen == [False, [True, True]]
    assert after_run and failed and after_failure


def test_a_library_run_leaves_the_collector_alone(store, tmp_path) -> None:
    import gc

    import sven
    from sven.engine import gcpause

    # Relative to before the run: an earlier test of this process may have run the CLI
    # in-process, whose start-up freezes what it made.
    frozen = gc.get_freeze_count()
    tr = sven.Trainer(None, _train(store, tmp_path / "run")[1:])
    tr.fit()
    assert gc.isenabled() and not gcpause.paused()
    assert gc.get_freeze_count() == frozen


@pytest.mark.gpu
def test_a_cuda_run_preloads_triton_and_says_how_long_it_waited(store, tmp_path) -> None:
    _needs_triton()
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = tmp_path / "run"
    argv = [a.replace("train.device=cpu", "train.device=cuda") for a in _train(store, out)]
    code = (
        "import json, sys\n"
        "from sven.cli import main\n"
        "from sven.engine.startup import TRITON_MODULES\n"
        f"rc = main({argv!r})\n"
        "print(json.dumps([rc, all(m in sys.modules for m in TRITON_MODULES)]))\n"
    )
    # A cold Triton cache compiles every kernel of the run.
    assert _python(code, timeout=600) == [0, True]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["startup_preload_s"] >= 0


def test_a_same_size_rewrite_keeping_mtime_and_inode_is_refused_next_run(
    store, tmp_path, capsys
) -> None:
    """Whatever an earlier run saw, the next one hashes every byte again."""
    import shutil

    bad = tmp_path / "store"
    shutil.copytree(store, bad)
    assert main(_train(bad, tmp_path / "run1")) == 0
    f = bad / "src.npy"
    st = os.stat(f)
    src = np.load(f)
    # Another valid node id, written in place: same size, name and inode; then the
    # old timestamps put back, so no (path, size, mtime, inode) key could tell.
    i = 7
    new = (int(src[i]) + 1) % 30  # a valid id: only the checksum can tell
    offset = f.stat().st_size - src.nbytes + i * src.itemsize
    with open(f, "r+b") as fh:
        fh.seek(offset)
        fh.write(np.array([new], dtype=src.dtype).tobytes())
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(f)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
    )
    capsys.readouterr()
    assert main(_train(bad, tmp_path / "run2")) == 3
    err = capsys.readouterr().err
    assert "src.npy: checksum mismatch" in err
    assert not (tmp_path / "run2").exists()
