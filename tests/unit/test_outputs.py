"""Output files (sven.outputs): refused when they exist or are an input, whole or absent,
and a folder of outputs that knows which of its files Sven wrote."""

from __future__ import annotations

import pytest

from sven.errors import ConfigError, DataError, SvenError
from sven.outputs import (
    MANIFEST,
    atomic_output,
    check_output,
    check_output_folder,
    foreign_outputs,
    record_outputs,
)


def test_check_output_refuses_before_any_work(tmp_path) -> None:
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("src,dst,t\n")
    store = tmp_path / "store"
    store.mkdir()
    out = tmp_path / "out.csv"
    assert check_output(out, overwrite=False, inputs=[pairs, store]) == out
    with pytest.raises(ConfigError, match=r"--out .*out\.txt: the name must end in \.csv"):
        check_output(tmp_path / "out.txt", overwrite=False, suffixes=(".csv",))
    # An input is never an output, --overwrite or not; nor is a path inside an input folder.
    for overwrite in (False, True):
        with pytest.raises(SvenError, match="which this command reads"):
            check_output(pairs, overwrite=overwrite, inputs=[pairs])
        with pytest.raises(SvenError, match=r"lies inside .*store, which this command reads"):
            check_output(store / "emb.npy", overwrite=overwrite, inputs=[store])
    # The same file by another name is the same input.
    (tmp_path / "alias.csv").symlink_to(pairs)
    with pytest.raises(SvenError, match="which this command reads"):
        check_output(tmp_path / "alias.csv", overwrite=True, inputs=[pairs])
    out.write_text("mine")
    with pytest.raises(SvenError, match="already exists; pass --overwrite to replace it"):
        check_output(out, overwrite=False)
    assert check_output(out, overwrite=True) == out
    with pytest.raises(SvenError, match="is a folder; give a file name"):
        check_output(store, overwrite=True)
    with pytest.raises(DataError, match="the output folder does not exist"):
        check_output(tmp_path / "none" / "x.csv", overwrite=False)
    assert pairs.read_text() == "src,dst,t\n" and out.read_text() == "mine"


def test_atomic_output_is_whole_or_absent(tmp_path) -> None:
    out = tmp_path / "x.csv"
    out.write_text("old")
    with pytest.raises(RuntimeError), atomic_output(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.csv"]
    with atomic_output(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".x.csv.tmp-")
        tmp.write_text("new")
    assert out.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["x.csv"]
    # Without overwrite, a file that appeared since the check is not replaced.
    late = tmp_path / "late.csv"
    with (
        pytest.raises(SvenError, match="appeared meanwhile"),
        atomic_output(late, overwrite=False) as tmp,
    ):
        tmp.write_text("ours")
        late.write_text("theirs")
    assert late.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.csv", "x.csv"]


def test_a_folder_of_outputs_knows_what_sven_wrote(tmp_path) -> None:
    figs = tmp_path / "figs"
    # A missing folder is fine; a file where it goes is not.
    assert check_output_folder(figs, ["a.png"], overwrite=False) == figs
    (tmp_path / "file").write_text("x")
    with pytest.raises(SvenError, match="is a file, not a folder"):
        check_output_folder(tmp_path / "file", ["a.png"], overwrite=True)
    figs.mkdir()
    (figs / "a.png").write_bytes(b"sven's")
    (figs / "b.png").write_bytes(b"the user's")
    record_outputs(figs, [figs / "a.png"])
    assert sorted(p.name for p in figs.iterdir()) == [MANIFEST, "a.png", "b.png"]
    # Sven's own file may be replaced; the user's only with overwrite.
    check_output_folder(figs, ["a.png"], overwrite=False)
    with pytest.raises(SvenError, match=r"holds b\.png, not written by Sven; pass --overwrite"):
        check_output_folder(figs, ["a.png", "b.png"], overwrite=False)
    check_output_folder(figs, ["a.png", "b.png"], overwrite=True)
    assert foreign_outputs(figs) == ["b.png"]
    # A file of Sven's changed since is the user's now; so is a folder.
    (figs / "a.png").write_bytes(b"edited")
    (figs / "sub").mkdir()
    assert foreign_outputs(figs) == ["a.png", "b.png", "sub"]
    with pytest.raises(SvenError, match=r"holds a\.png"):
        check_output_folder(figs, ["a.png"], overwrite=False)
    # The temporaries of an interrupted write are Sven's.
    (figs / "sub").rmdir()
    (figs / "a.png").write_bytes(b"sven's")
    (figs / ".a.png.tmp-123").write_bytes(b"half")
    assert foreign_outputs(figs) == ["b.png"]


def test_a_plots_folder_of_an_older_sven_holds_its_figures_by_name(tmp_path) -> None:
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "training.png").write_bytes(b"an older sven plot's")
    (plots / "notes.txt").write_text("mine")
    # In a folder Sven owns (a run's plots/) without a manifest: its figures by name.
    assert foreign_outputs(plots, legacy=True) == ["notes.txt"]
    check_output_folder(plots, ["training.png"], overwrite=False, legacy=True)
    # In a folder of the user's (sven plot --out DIR), never.
    assert foreign_outputs(plots) == ["notes.txt", "training.png"]
    with pytest.raises(SvenError, match=r"holds training\.png"):
        check_output_folder(plots, ["training.png"], overwrite=False)
    # Once a manifest is there it alone decides.
    (plots / "stage_times.png").write_bytes(b"new")
    record_outputs(plots, [plots / "stage_times.png"])
    assert foreign_outputs(plots, legacy=True) == ["notes.txt", "training.png"]
