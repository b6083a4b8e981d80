"""The one file-hash helper (``sven.digest``): whole files and byte ranges."""

from __future__ import annotations

import hashlib

from sven import digest


def test_whole_file_and_ranges_match_hashlib_across_block_edges(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(digest, "_BLOCK", 7)  # 7-byte reads: every range crosses blocks
    monkeypatch.setattr(digest, "_local", type(digest._local)())  # a buffer of that size
    data = bytes(range(50))
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert digest.sha256_file(path) == hashlib.sha256(data).hexdigest()
    assert digest.sha256_range(path, 10, 33).digest() == hashlib.sha256(data[10:33]).digest()
    # A range past the end stops at the end; an empty range is the empty digest.
    assert digest.sha256_range(path, 40, 100).digest() == hashlib.sha256(data[40:]).digest()
    assert digest.sha256_range(path, 5, 5).digest() == hashlib.sha256(b"").digest()
    empty = tmp_path / "e.bin"
    empty.write_bytes(b"")
    assert digest.sha256_file(empty) == hashlib.sha256(b"").hexdigest()
