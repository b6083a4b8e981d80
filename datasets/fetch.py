"""``sven data fetch NAME``: a public dataset downloaded once, verified, converted.

The download goes through ``pooch`` (streamed into a temporary file beside its final
name, checked, then renamed; a failed transfer or a wrong checksum deletes the
temporary file, so the cache never holds a partial or unverified file). The cache:

``CACHE/downloads/NAME/FILE``
    the file as served (``CACHE`` is ``$SVEN_CACHE``, else ``~/.cache/sven``);
``CACHE/downloads/NAME/FILE.sha256``
    for a dataset whose registry entry has no sha256: the hash of the first download
    (``sha256sum`` format), written once that file has converted to the published
    event and node counts (trust on first use); later runs verify against it;
``CACHE/stores/NAME``
    the event store, when no ``--out`` is given; reused if present.

A file in the cache whose hash no longer matches is downloaded again (pooch's
"update"); a new download that does not match is refused with one line, and nothing of
it is kept. A broken transfer is refused the same way: nothing is resumed (the
publishers' files are small enough to fetch again).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from sven.datasets.registry import Dataset
from sven.errors import DataError, SvenError

__all__ = ["FetchResult", "download", "fetch", "file_sha256"]

#: Environment variable naming a mirror: ``MIRROR/FILE`` is fetched instead of the
#: publisher's URL (the registry's checksums still apply).
MIRROR_ENV = "SVEN_DATA_MIRROR"


@dataclass(frozen=True)
class FetchResult:
    """What :func:`fetch` did."""

    raw: Path
    """The verified file in the cache."""
    sha256: str
    """Its sha256."""
    downloaded: bool
    """Whether this call downloaded it (else the cache had it)."""
    trusted_now: bool
    """Whether this call recorded its hash (trust on first use)."""
    store: Path | None
    """The event store, or None with ``download_only``."""
    converted: bool
    """Whether this call wrote the store (else it was reused)."""


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _recorded(path: Path) -> str | None:
    """The hash in a ``FILE.sha256`` record, or None where there is none."""
    try:
        text = path.read_text().split()
    except FileNotFoundError:
        return None
    if not text or len(text[0]) != 64:
        raise DataError("not a sha256 record (delete it to trust the next download)", path)
    return text[0]


def download(
    entry: Dataset,
    cache: Path,
    *,
    mirror: str | None = None,
    timeout: float = 60.0,
    progress: bool | None = None,
) -> tuple[Path, str, bool]:
    """Downloads ``entry``'s file into ``cache/downloads/NAME`` once, verified.

    Args:
        entry: The registry entry.
        cache: The cache folder.
        mirror: A base URL serving the file as ``MIRROR/FILE`` (default: the
            publisher's URL, or ``$SVEN_DATA_MIRROR``).
        timeout: Seconds without data before a transfer is abandoned.
        progress: Draw a progress bar (default: when stderr is a terminal).

    Returns:
        The file, its sha256 and whether this call downloaded it.

    Raises:
        DataError: the file's sha256 is not the registry's (or the one recorded on
            first download); nothing of the download is kept.
        SvenError: the transfer failed (no connection, an HTTP error, a broken or
            truncated transfer); nothing of it is kept.
    """
    import pooch
    import requests

    folder = cache / "downloads" / entry.name
    raw = folder / entry.file
    record = folder / f"{entry.file}.sha256"
    expected = entry.sha256 or _recorded(record)
    mirror = mirror or os.environ.get(MIRROR_ENV) or None
    url = f"{mirror.rstrip('/')}/{entry.file}" if mirror else entry.url
    fresh = not raw.is_file() or (expected is not None and file_sha256(raw) != expected)
    if fresh:
        size = f" ({entry.size:,} bytes)" if entry.size else ""
        print(f"fetch: downloading {url}{size}", file=sys.stderr)
    made = not folder.exists()
    pooch.get_logger().setLevel("WARNING")  # this module says what it does itself
    show = sys.stderr.isatty() if progress is None else progress
    try:
        pooch.retrieve(
            url,
            known_hash=f"sha256:{expected}" if expected else None,
            fname=entry.file,
            path=folder,
            downloader=pooch.HTTPDownloader(progressbar=show, timeout=timeout),
        )
    except ValueError as exc:  # pooch: the new file's hash is not the expected one
        _drop_empty(folder, made)
        origin = "the registry" if entry.sha256 else f"{record} (recorded on first download)"
        got = str(exc).split(" but got ")[-1][:64] if " but got " in str(exc) else "?"
        raise DataError(
            f"{url}: sha256 {got} is not {expected} of {origin}; the download "
            "was deleted"
            + ("" if entry.sha256 else f" (if the publisher changed the file, delete {record})"),
        ) from None
    except (requests.RequestException, OSError) as exc:
        _drop_empty(folder, made)
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise SvenError(
            f"sven data fetch {entry.name}: download from {url} failed ({reason}); nothing "
            f"was kept; run the command again, or set {MIRROR_ENV} to a mirror"
        ) from None
    return raw, expected or file_sha256(raw), fresh


def _drop_empty(folder: Path, made: bool) -> None:
    """Removes the download folder this call created, where nothing is in it."""
    if made:
        try:
            folder.rmdir()
            folder.parent.rmdir()  # downloads/, where it holds nothing else
        except OSError:
            pass


def fetch(
    entry: Dataset,
    out: str | os.PathLike[str] | None = None,
    *,
    cache: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    download_only: bool = False,
    mirror: str | None = None,
    timeout: float = 60.0,
    progress: bool | None = None,
) -> FetchResult:
    """Downloads ``entry`` once, verifies it and converts it to an event store.

    Args:
        entry: The registry entry.
        out: Store folder to create (``--overwrite`` rules as ``sven data convert``);
            default ``CACHE/stores/NAME``, reused where it exists.
        cache: The cache folder (default ``$SVEN_CACHE``, else ``~/.cache/sven``).
        overwrite: Replace an existing event store at ``out``.
        download_only: Stop after the verified download.
        mirror, timeout, progress: As :func:`download`.

    Returns:
        What was done, and where.

    Raises:
        DataError: a checksum mismatch, or a file that does not convert to the
            published counts (then neither the file nor the store is kept).
        SvenError: a failed transfer.
    """
    from sven.datasets.readers import convert
    from sven.datasets.synth import cache_root
    from sven.datasets.target import check_target, is_store

    root = cache_root(cache)
    default_out = out is None
    target = root / "stores" / entry.name if default_out else Path(out)
    if not download_only and not (default_out and is_store(target)):
        check_target(target, overwrite)  # before a download, so a wrong --out costs nothing
    raw, sha, downloaded = download(entry, root, mirror=mirror, timeout=timeout, progress=progress)
    record = raw.with_name(f"{raw.name}.sha256")
    trust = entry.sha256 is None and not record.is_file()
    if download_only:  # trusted only once it converts to the published counts
        return FetchResult(raw, sha, downloaded, False, None, False)
    if default_out and is_store(target):
        return FetchResult(raw, sha, downloaded, trust, target, False)
    if default_out:
        target.parent.mkdir(parents=True, exist_ok=True)
    ev = convert(raw, target, entry.format, name=entry.name, overwrite=overwrite)
    if (ev.num_events, ev.num_nodes) != (entry.events, entry.nodes):
        shutil.rmtree(target)
        if trust:  # never trusted: drop it, so the next run downloads again
            raw.unlink()
        raise DataError(
            f"{ev.num_events:,} events on {ev.num_nodes:,} nodes, not the published "
            f"{entry.events:,} on {entry.nodes:,}: not the file the registry describes"
            + ("; it was deleted" if trust else ""),
            raw,
        )
    if trust:
        _record(record, raw, sha)
    return FetchResult(raw, sha, downloaded, trust, target, True)


def _record(record: Path, raw: Path, sha: str) -> None:
    """Writes ``sha  FILE`` (sha256sum's format) atomically."""
    tmp = record.with_name(f".{record.name}.tmp")
    tmp.write_text(f"{sha}  {raw.name}\n")
    os.replace(tmp, record)
