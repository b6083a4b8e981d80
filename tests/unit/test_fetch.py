"""``sven data fetch``: the registry, and downloads from a local mirror on 127.0.0.1.

No test reaches the internet: the mirror is an HTTP server in this process serving a
folder, plus a broken route (a truncated transfer; ``tests/mirror.py``). The real
registry entries of CollegeMsg and bitcoin-otc are checked end to end where the shared
copies of their published files are present.
"""

from __future__ import annotations

import gzip
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from sven.cli import main
from sven.datasets import FORMATS
from sven.datasets.fetch import fetch
from sven.datasets.registry import REGISTRY, Dataset, lookup, registry_table
from sven.errors import ConfigError, DataError, SvenError
from tests.mirror import serve

REPO = Path(__file__).resolve().parents[2]
# 6 events on 4 nodes, one out of time order.
TINY = b"1 2 100\n2 3 105\n3 1 110\n1 4 120\n4 2 115\n2 1 130\n"


@pytest.fixture
def mirror(tmp_path, monkeypatch) -> Iterator[tuple[str, Path, list[str]]]:
    """(base URL, served folder, requested paths) of a server on 127.0.0.1."""
    root = tmp_path / "mirror"
    root.mkdir()
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.delenv("SVEN_DATA_MIRROR", raising=False)
    monkeypatch.setenv("SVEN_CACHE", str(tmp_path / "cache"))
    with serve(root) as (base, hits):
        yield base, root, hits


def _entry(data: bytes, *, known: bool = True, **changes) -> Dataset:
    fields = dict(
        name="tiny",
        url="https://example.invalid/data/tiny.txt.gz",
        format="snap",
        events=6,
        nodes=4,
        sha256=hashlib.sha256(data).hexdigest() if known else None,
        size=len(data) if known else None,
        licence="test data",
        citation="none",
        page="https://example.invalid/",
        about="a test event",
    )
    return Dataset(**{**fields, **changes})


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# --- the registry -----------------------------------------------------------------


def test_registry_entries_are_well_formed() -> None:
    assert {"wikipedia", "reddit", "mooc", "lastfm"} <= set(REGISTRY)
    assert {"collegemsg", "bitcoin-otc", "bitcoin-alpha", "email-eu-core"} <= set(REGISTRY)
    for name, d in REGISTRY.items():
        assert d.name == name and re.fullmatch(r"[a-z0-9-]+", name), name
        assert d.url.startswith("https://") and d.page.startswith("https://"), name
        assert d.format in FORMATS, name
        assert 0 < d.nodes < d.events, name
        assert d.licence and d.citation and d.about, name
        # A hash and a size are recorded together, only for a file known byte for byte.
        assert (d.sha256 is None) == (d.size is None), name
        assert d.sha256 is None or re.fullmatch(r"[0-9a-f]{64}", d.sha256), name
    # The three hashes known here are of SNAP's files as served; JODIE's csv has none.
    known = {n for n, d in REGISTRY.items() if d.sha256}
    assert known == {"collegemsg", "bitcoin-otc"}
    assert lookup("CollegeMsg") is REGISTRY["collegemsg"]
    with pytest.raises(ConfigError, match="no dataset 'uci'; known: wikipedia, reddit"):
        lookup("uci")


def test_docs_table_is_the_registry() -> None:
    text = (REPO / "docs" / "data.md").read_text()
    assert registry_table() in text, "paste datasets.registry.registry_table() into docs/data.md"


def test_list_prints_every_dataset(capsys) -> None:
    assert main(["data", "fetch", "--list"]) == 0
    out = capsys.readouterr().out
    for d in REGISTRY.values():
        assert d.url in out and d.citation in out


# --- downloads ----------------------------------------------------------------------


def test_download_verified_converted_then_reused(mirror, monkeypatch, tmp_path, capsys) -> None:
    base, root, hits = mirror
    data = gzip.compress(TINY)
    (root / "tiny.txt.gz").write_bytes(data)
    monkeypatch.setitem(REGISTRY, "tiny", _entry(data))
    out = tmp_path / "stores" / "tiny"
    assert main(["data", "fetch", "tiny", "--mirror", base, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    cache = tmp_path / "cache"
    raw = cache / "downloads" / "tiny" / "tiny.txt.gz"
    assert f"fetch: {raw} (downloaded; sha256 {hashlib.sha256(data).hexdigest()})" in text
    assert f"wrote {out}: 6 events, 4 nodes" in text and "cite: none" in text
    assert raw.read_bytes() == data
    assert _files(cache) == ["downloads", "downloads/tiny", "downloads/tiny/tiny.txt.gz"]
    from sven.datasets.store import TemporalEvents

    ev = TemporalEvents.load(out)
    assert ev.meta["name"] == "tiny" and ev.meta["sorted_on_ingest"]
    assert ev.t.tolist() == [100, 105, 110, 115, 120, 130]
    # Downloaded once: a second store from the same file asks the mirror nothing.
    assert hits == ["/tiny.txt.gz"]
    assert main(["data", "fetch", "tiny", "--mirror", base]) == 0  # default: the cache
    assert hits == ["/tiny.txt.gz"]
    assert "(in the cache;" in capsys.readouterr().out
    assert TemporalEvents.load(cache / "stores" / "tiny").num_events == 6
    assert main(["data", "fetch", "tiny", "--mirror", base]) == 0
    assert f"fetch: reusing {cache / 'stores' / 'tiny'}" in capsys.readouterr().out
    # A cached file damaged on disk is downloaded again, and verified.
    raw.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert main(["data", "fetch", "tiny", "--mirror", base, "--download-only"]) == 0
    assert hits == ["/tiny.txt.gz"] * 2 and raw.read_bytes() == data


def test_corrupted_download_refused_with_one_line(mirror, monkeypatch, tmp_path, capsys) -> None:
    base, root, _ = mirror
    data = gzip.compress(TINY)
    (root / "tiny.txt.gz").write_bytes(data[:-5] + b"XXXXX")  # same length, other bytes
    monkeypatch.setitem(REGISTRY, "tiny", _entry(data))
    out = tmp_path / "stores" / "tiny"
    assert main(["data", "fetch", "tiny", "--mirror", base, "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"fetch: downloading {base}/tiny.txt.gz \({len(data)} bytes\)\n"
        rf"sven: error: {base}/tiny.txt.gz: sha256 [0-9a-f]{{64}} is not "
        rf"{hashlib.sha256(data).hexdigest()} of the registry; the download was deleted\n",
        err,
    ), err
    assert _files(tmp_path / "cache") == [] and not out.exists()


def test_truncated_transfer_refused_nothing_kept(mirror, monkeypatch, tmp_path, capsys) -> None:
    base, root, _ = mirror
    data = gzip.compress(TINY * 50)
    (root / "truncated").mkdir()
    (root / "tiny.txt.gz").write_bytes(data)
    monkeypatch.setitem(REGISTRY, "tiny", _entry(data, events=300))
    rc = main(["data", "fetch", "tiny", "--mirror", f"{base}/truncated", "--timeout", "20"])
    progress, err = capsys.readouterr().err.splitlines()  # the download's line, the error's
    assert rc == 1 and progress.startswith("fetch: downloading"), progress
    assert err.startswith(f"sven: error: sven data fetch tiny: download from {base}/truncated/")
    assert "nothing was kept; run the command again" in err
    assert _files(tmp_path / "cache") == []
    # The same command against an intact mirror then succeeds from nothing.
    assert main(["data", "fetch", "tiny", "--mirror", base]) == 0


def test_no_server_refused(monkeypatch, tmp_path, capsys) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("SVEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setitem(REGISTRY, "tiny", _entry(b""))
    monkeypatch.setenv("SVEN_DATA_MIRROR", f"http://127.0.0.1:{port}")
    assert main(["data", "fetch", "tiny"]) == 1
    assert "download from http://127.0.0.1:" in capsys.readouterr().err
    assert _files(tmp_path / "cache") == []


def test_trust_on_first_use(mirror, monkeypatch, tmp_path, capsys) -> None:
    base, root, _ = mirror
    data = gzip.compress(TINY)
    (root / "tiny.txt.gz").write_bytes(data)
    monkeypatch.setitem(REGISTRY, "tiny", _entry(data, known=False))
    raw = tmp_path / "cache" / "downloads" / "tiny" / "tiny.txt.gz"
    record = raw.with_name("tiny.txt.gz.sha256")
    # Downloaded alone, the file is not yet trusted: no record.
    assert main(["data", "fetch", "tiny", "--mirror", base, "--download-only"]) == 0
    assert "not yet trusted" in capsys.readouterr().out and not record.exists()
    # Converted to the published counts, its hash is recorded and said.
    assert main(["data", "fetch", "tiny", "--mirror", base]) == 0
    sha = hashlib.sha256(data).hexdigest()
    assert f"recorded this one in {record} (trust on first use)" in capsys.readouterr().out
    assert record.read_text() == f"{sha}  tiny.txt.gz\n"
    # The publisher's file changes: a fresh download is refused against the record.
    (root / "tiny.txt.gz").write_bytes(gzip.compress(TINY + b"5 6 140\n"))
    raw.unlink()
    out = tmp_path / "again"
    assert main(["data", "fetch", "tiny", "--mirror", base, "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert f"is not {sha} of {record} (recorded on first download)" in err
    assert f"(if the publisher changed the file, delete {record})" in err
    assert _files(raw.parent) == ["tiny.txt.gz.sha256"] and not out.exists()


def test_first_download_with_wrong_counts_is_not_trusted(mirror, monkeypatch, tmp_path) -> None:
    base, root, _ = mirror
    data = gzip.compress(TINY)
    (root / "tiny.txt.gz").write_bytes(data)
    entry = _entry(data, known=False, events=7)
    out = tmp_path / "store"
    with pytest.raises(DataError, match="6 events on 4 nodes, not the published 7 on 4"):
        fetch(entry, out, mirror=base)
    assert not out.exists()
    assert _files(tmp_path / "cache") == ["downloads", "downloads/tiny"]


def test_existing_out_refused_before_any_download(mirror, monkeypatch, tmp_path) -> None:
    base, root, hits = mirror
    (root / "tiny.txt.gz").write_bytes(gzip.compress(TINY))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(SvenError, match="mine"):
        fetch(_entry(gzip.compress(TINY)), out, mirror=base)
    assert hits == [] and (out / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("name", ["collegemsg", "bitcoin-otc"])
def test_real_entry_from_a_mirror_of_the_published_file(
    name, mirror, shared_data, tmp_path
) -> None:
    """The registry's hash, size, format and counts against the publisher's own file."""
    base, root, hits = mirror
    entry = REGISTRY[name]
    published = shared_data / name / entry.file
    if not published.is_file():
        pytest.skip(f"no copy of {entry.file}: `sven data fetch {name}` downloads it")
    (root / entry.file).write_bytes(published.read_bytes())
    done = fetch(entry, tmp_path / name, mirror=base)
    assert done.downloaded and done.converted and not done.trusted_now
    assert done.raw.stat().st_size == entry.size and done.sha256 == entry.sha256
    # The verified file is in the cache: a mirror without it is not even asked.
    assert fetch(entry, tmp_path / f"{name}-2", mirror=f"{base}/gone").converted
    assert hits == [f"/{entry.file}"]
