"""The public temporal datasets ``sven data fetch NAME`` knows: where each file is
published, what it holds, its licence and the paper to cite.

Each :class:`Dataset` names one file as its publisher serves it (``url``), the reader
format that converts it, and the event and node counts of the published dataset, which
the converted store must match. ``sha256`` and ``size`` are recorded only where they
are known to be those of the very file the URL serves; where they are not (``None``),
the first download's sha256 is recorded beside the cached file after the file has
converted to the published counts (trust on first use), and every later use verifies
against it. ``docs/data.md`` ("Public datasets by name") is this registry as a table,
kept equal to :func:`registry_table` by a test.

Not included: DyGLib's processed copies (redistributions of these same sets, no
licence of their own stated) and TGB's link datasets (served by the ``tgb`` package,
which fetches them itself; convert its csv with ``--format tgb``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REGISTRY", "Dataset", "lookup", "registry_table"]

_SNAP = "https://snap.stanford.edu/data/"
_JODIE = "https://snap.stanford.edu/jodie/"
_SNAP_TERMS = "none stated by SNAP (public research data; cite the paper)"
_JODIE_TERMS = "none stated by the JODIE authors (public research data; cite the paper)"
_JODIE_CITE = (
    "S. Kumar, X. Zhang, J. Leskovec. Predicting Dynamic Embedding Trajectory in "
    "Temporal Interaction Networks. KDD 2019."
)


@dataclass(frozen=True, kw_only=True)
class Dataset:
    """One entry of the registry."""

    name: str
    """Name on the command line (``sven data fetch NAME``) and in the store's meta."""
    url: str
    """The file as its publisher serves it."""
    format: str
    """Reader format of the file (one of ``sven.datasets.FORMATS``)."""
    events: int
    """Events of the published dataset; the converted store must have as many."""
    nodes: int
    """Nodes that take part in an event; the converted store must have as many."""
    sha256: str | None
    """sha256 of the served file, or None where it is not known (trust on first use)."""
    size: int | None
    """Bytes of the served file, or None where not known."""
    licence: str
    """The terms the publisher states."""
    citation: str
    """The paper to cite."""
    page: str
    """The publisher's page describing the dataset."""
    about: str
    """One line: what an event is."""

    @property
    def file(self) -> str:
        """The file's name, as served (the last part of ``url``)."""
        return self.url.rsplit("/", 1)[1]


def _jodie(name: str, events: int, nodes: int, about: str) -> Dataset:
    return Dataset(
        name=name,
        url=f"{_JODIE}{name}.csv",
        format="jodie",
        events=events,
        nodes=nodes,
        sha256=None,
        size=None,
        licence=_JODIE_TERMS,
        citation=_JODIE_CITE,
        page="https://snap.stanford.edu/jodie/",
        about=about,
    )


_PANZARASA = (
    "P. Panzarasa, T. Opsahl, K. M. Carley. Patterns and dynamics of users' behavior and "
    "interaction: Network analysis of an online community. JASIST 2009."
)
_KUMAR = (
    "S. Kumar, F. Spezzano, V. S. Subrahmanian, C. Faloutsos. Edge Weight Prediction in "
    "Weighted Signed Networks. ICDM 2016."
)
_PARANJAPE = "A. Paranjape, A. R. Benson, J. Leskovec. Motifs in Temporal Networks. WSDM 2017."
_RATING = "a trader rates another, -10..+10 (the rating: a 1-dim edge feature)"


def _snap(
    name: str,
    file: str,
    events: int,
    nodes: int,
    citation: str,
    page: str,
    about: str,
    *,
    sha256: str | None = None,
    size: int | None = None,
) -> Dataset:
    # SNAP's signed networks are csv, its temporal networks whitespace text.
    return Dataset(
        name=name,
        url=f"{_SNAP}{file}",
        format="snap-signed" if file.startswith("soc-sign-") else "snap",
        events=events,
        nodes=nodes,
        sha256=sha256,
        size=size,
        licence=_SNAP_TERMS,
        citation=citation,
        page=f"{_SNAP}{page}.html",
        about=about,
    )


REGISTRY: dict[str, Dataset] = {
    d.name: d
    for d in (
        _jodie(
            "wikipedia",
            157_474,
            9_227,
            "a user edits a page (172-dim LIWC edge features; label: the user is banned)",
        ),
        _jodie(
            "reddit",
            672_447,
            10_984,
            "a user posts to a subreddit (172-dim LIWC edge features; label: the user is banned)",
        ),
        _jodie(
            "mooc",
            411_749,
            7_144,
            "a student acts on a course unit (4-dim features; label: the student drops out)",
        ),
        _jodie("lastfm", 1_293_103, 1_980, "a user listens to a song (no features, no labels)"),
        _snap(
            "collegemsg",
            "CollegeMsg.txt.gz",
            59_835,
            1_899,
            _PANZARASA,
            "CollegeMsg",
            "a student sends a private message (DyGLib's UCI)",
            sha256="42b894ca71e1963fcfd9682fd9ac5efaeca4ef9a1d472f49891788ef662a5509",
            size=344_759,
        ),
        _snap(
            "bitcoin-otc",
            "soc-sign-bitcoinotc.csv.gz",
            35_592,
            5_881,
            _KUMAR,
            "soc-sign-bitcoin-otc",
            _RATING,
            sha256="4ac08248072f2d5a3f7f79c796fa4610d16249fa9ce55015f2a0c0fc06b5522d",
            size=397_182,
        ),
        _snap(
            "bitcoin-alpha",
            "soc-sign-bitcoinalpha.csv.gz",
            24_186,
            3_783,
            _KUMAR,
            "soc-sign-bitcoin-alpha",
            _RATING,
        ),
        _snap(
            "email-eu-core",
            "email-Eu-core-temporal.txt.gz",
            332_334,
            986,
            _PARANJAPE,
            "email-Eu-core-temporal",
            "an e-mail between members of a European research institution",
        ),
        _snap(
            "mathoverflow",
            "sx-mathoverflow.txt.gz",
            506_550,
            24_818,
            _PARANJAPE,
            "sx-mathoverflow",
            "a user answers or comments on another's question or answer",
        ),
    )
}


def lookup(name: str) -> Dataset:
    """The registry entry of ``name`` (case-insensitive).

    Raises:
        ConfigError: for a name the registry does not have; the message lists them.
    """
    from sven.errors import ConfigError

    entry = REGISTRY.get(name.lower())
    if entry is None:
        raise ConfigError(
            f"sven data fetch: no dataset {name!r}; known: {', '.join(REGISTRY)} "
            "(`sven data fetch --list` describes them)"
        )
    return entry


def registry_table() -> str:
    """The registry as the markdown table of ``docs/data.md``."""
    rows = [
        "| name | events | nodes | format | file (size) | sha256 | what an event is |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in REGISTRY.values():
        size = f"{d.size:,} B" if d.size is not None else "size not recorded"
        sha = f"`{d.sha256[:12]}…`" if d.sha256 else "recorded on first download"
        rows.append(
            f"| `{d.name}` | {d.events:,} | {d.nodes:,} | `{d.format}` | "
            f"[{d.file}]({d.page}) ({size}) | {sha} | {d.about} |"
        )
    return "\n".join(rows)
