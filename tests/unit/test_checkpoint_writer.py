"""The checkpointer (sven.engine.checkpoint.writer): atomic folders, keep-k, fallback past
a corrupt checkpoint, digests taken while writing."""

from __future__ import annotations

import os

import torch

from sven.engine.checkpoint import Checkpointer


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
