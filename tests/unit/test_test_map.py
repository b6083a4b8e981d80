"""Which test files test which module: the map in docs/testing.md, and no module untested.

A test file tests a module of the package where it

- imports it directly: ``import sven.x.y``, ``from sven.x import y``,
  ``from sven.x.y import z``;
- takes from a package a name that the package's ``__init__`` imports from the module
  (``from sven.models import TGN``, or ``kernels.backend_for`` after ``from sven import
  kernels``: re-exports, PEP 562 ones included);
- runs it: ``"-m", "sven.x"`` runs ``sven.x.__main__``, and a ``__main__`` that is a
  shim runs what it imports;
- calls it through a table of modules imported by name (``importlib``): a list headed
  by a key of the table, in a file that imports the table's module
  (``main(["predict", ...])`` calls ``sven.cli.predict``);
- or is named after it: ``test_<name>.py`` where no other module has that name,
  ``tests/kernels/test_<x>_kernel.py`` for ``sven.kernels.triton_<x>``.

A module has behaviour of its own where it defines a function or class at its top
level, other than a package's PEP 562 hooks and ``typing.Protocol`` classes. Like
tests/unit/test_architecture.py, whose readers of imports these reuse, this reads the
sources and never imports them.

The map is docs/testing.md's generated table; rewrite it with
``python -m tests.unit.test_test_map --write`` from the repository root, or print one
module's test files with ``python -m tests.unit.test_test_map sven.datasets.store``
(or its file, ``datasets/store.py``).
"""

from __future__ import annotations

import ast
import functools
import itertools
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tests.unit.test_architecture import (
    ROOT,
    _by_name,
    _import_nodes,
    _imports,
    _modules,
    _resolve,
    _targets,
)

DOC = ROOT / "docs" / "testing.md"
BEGIN = "<!-- begin generated: python -m tests.unit.test_test_map --write -->"
END = "<!-- end generated -->"
#: Module-level functions that are how a package re-exports, not behaviour of its own.
HOOKS = {"__getattr__", "__dir__"}

_READER = "a reader behind `sven.datasets.readers`: `unit/test_readers.py` converts every format"
_BY_NAME = "built by name: `unit/test_models.py` runs every model of `sven.models.MODELS`"

#: Modules with behaviour of their own that no test file tests (as read above), each
#: with why (docs/testing.md shows it). Keep it short and true: a module that gains a
#: test comes off.
UNTESTED: dict[str, str] = {
    "sven.datasets.delimited": _READER,
    "sven.datasets.dyglib_tgl": _READER,
    "sven.datasets.rawreader": _READER,
    "sven.datasets.snap_jodie": _READER,
    "sven.datasets.writer": (
        "writes every store, behind `sven.datasets.store.write_events` and"
        " `sven.datasets.readers.convert`: `unit/test_store.py`, `unit/test_readers.py`"
    ),
    "sven.models.dyrep": _BY_NAME,
    "sven.models.jodie": _BY_NAME,
    "sven.models.tgn": _BY_NAME,
}


def _is_protocol(node: ast.stmt) -> bool:
    """Whether a statement defines a ``typing.Protocol``: types only, nothing to run."""
    return isinstance(node, ast.ClassDef) and any(
        (b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)) == "Protocol"
        for b in node.bases
    )


def _defined(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level by ``def`` or ``class``."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {n.name for n in tree.body if isinstance(n, kinds)}


def _has_behaviour(path: Path) -> bool:
    """Whether a module has behaviour of its own: a function or class defined at its top
    level, other than a PEP 562 hook (how a package re-exports) or a protocol."""
    tree = ast.parse(path.read_text(), str(path))
    protocols = {n.name for n in tree.body if _is_protocol(n)}
    return bool(_defined(tree) - HOOKS - protocols)


def _reexports(package: str, path: Path, modules: dict[str, Path]) -> dict[str, str]:
    """Name -> the module it comes from, for each name a package's ``__init__`` binds by
    importing it from another module of the package: at its top level, for type checking
    or in a function (a PEP 562 ``__getattr__``); names it defines itself are its own."""
    tree = ast.parse(path.read_text(), str(path))
    out: dict[str, str] = {}
    for node in _import_nodes(tree, types=True):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias, target in zip(node.names, _targets(node, package, True, modules)):
            home = _resolve(target, modules)
            if home is not None and home != package:
                out[alias.asname or alias.name] = home
    own = _defined(tree)
    return {name: home for name, home in out.items() if name not in own}


def _home(package: str, name: str, exports: dict[str, dict[str, str]]) -> str | None:
    """The module a name imported from a package comes from, through packages that
    re-export another package's names; None where the package defines it or has none."""
    seen = set()
    home = None
    while name in exports.get(package, {}) and package not in seen:
        seen.add(package)
        home = package = exports[package][name]
    return home


def _runs(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The modules a test runs as ``python -m``: a module name right after ``"-m"`` in a
    list or tuple (its ``__main__`` where it is a package). A ``__main__`` with nothing
    of its own is a shim: running it runs what it imports."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.List, ast.Tuple)):
            continue
        values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
        for flag, name in itertools.pairwise(values):
            if flag == "-m" and name in modules:
                out.add(f"{name}.__main__" if f"{name}.__main__" in modules else name)
    for m in [m for m in out if m.endswith(".__main__") and not _has_behaviour(modules[m])]:
        out |= _imports(m, modules[m], modules)
    return out


def _tables(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Module -> its tables of modules imported by name (:func:`_by_name`: the CLI's
    subcommands, the Triton kernels), as key -> module: a dict of strings, or pairs."""
    out: dict[str, dict[str, str]] = {}
    for m, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        if not _by_name(tree, modules):
            continue
        pairs = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and None not in node.keys:
                pairs += zip(node.keys, node.values)
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
                pairs.append(tuple(node.elts))
        out[m] = {
            k.value: v.value
            for k, v in pairs
            if isinstance(k, ast.Constant)
            and isinstance(k.value, str)
            and isinstance(v, ast.Constant)
            and v.value in modules
        }
    return out


def _heads(tree: ast.AST) -> set[str]:
    """The first item of every list of strings a file writes: the subcommand of an
    argument list (``main(["predict", ...])``)."""
    return {
        node.elts[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.List)
        and node.elts
        and isinstance(node.elts[0], ast.Constant)
        and isinstance(node.elts[0].value, str)
    }


@dataclass(frozen=True)
class Package:
    """What a test file is read against: the package's modules (dotted name -> file),
    its packages' re-exports (:func:`_reexports`) and its tables (:func:`_tables`)."""

    modules: dict[str, Path]
    exports: dict[str, dict[str, str]]
    tables: dict[str, dict[str, str]]

    @classmethod
    def read(cls, modules: dict[str, Path]) -> Package:
        exports = {
            m: _reexports(m, p, modules) for m, p in modules.items() if p.name == "__init__.py"
        }
        return cls(modules, exports, _tables(modules))


def _reexported(tree: ast.AST, package: Package) -> set[str]:
    """The modules of the names a file takes from a package's re-exports: imported
    from it (``from sven.models import TGN``) or read from it where it imports the
    package under a name of its own (``from sven import kernels``, ``kernels.x``)."""
    exports = package.exports
    found: set[str | None] = set()
    bound: dict[str, str] = {}  # a name the file binds to a module -> the module
    for node in _import_nodes(tree):
        for alias, target in zip(node.names, _targets(node, "", False, package.modules)):
            if isinstance(node, ast.ImportFrom):
                found.add(_home(node.module or "", alias.name, exports))
                bound[alias.asname or alias.name] = target
            elif alias.asname or "." not in alias.name:  # `import a.b` binds `a`
                bound[alias.asname or alias.name] = target
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and bound.get(node.value.id) in exports
        ):
            found.add(_home(bound[node.value.id], node.attr, exports))
    return {m for m in found if m is not None}


def modules_tested_by(path: Path, package: Package) -> set[str]:
    """The modules of ``package`` that the test file at ``path`` tests (see the
    module's doc; and where it imports a module with a table of modules imported by
    name, the modules of the keys that head its argument lists)."""
    tree = ast.parse(path.read_text(), str(path))
    found = _imports(path.stem, path, package.modules) | _runs(tree, package.modules)
    found |= _reexported(tree, package)
    heads = _heads(tree)
    for m in found & set(package.tables):
        found |= {v for k, v in package.tables[m].items() if k in heads}
    return found


def _test_files() -> list[Path]:
    """Every test file of the suite."""
    return sorted((ROOT / "tests").rglob("test_*.py"))


def _named_after(modules: dict[str, Path]) -> dict[str, str]:
    """``test_<name>.py`` -> the module of that last name, where only one has it; and
    ``test_<x>_kernel.py`` -> ``sven.kernels.triton_<x>`` (tests/kernels/' names)."""
    last = {m: m.rsplit(".", 1)[-1] for m in modules}
    counts = Counter(last.values())
    out = {f"test_{n}.py": m for m, n in last.items() if counts[n] == 1}
    for m in modules:
        if m.startswith("sven.kernels.triton_"):
            out.setdefault(f"test_{m.removeprefix('sven.kernels.triton_')}_kernel.py", m)
    return out


@functools.cache
def module_tests() -> dict[str, list[str]]:
    """Module -> the test files that test it (paths from the repository root): the one
    named after it first, then the others by path."""
    modules = _modules()
    package = Package.read(modules)
    named = _named_after(modules)
    out: dict[str, set[str]] = {m: set() for m in modules}
    first: dict[str, str] = {}
    for path in _test_files():
        rel = str(path.relative_to(ROOT))
        for m in modules_tested_by(path, package):
            out[m].add(rel)
        if path.name in named:
            out[named[path.name]].add(rel)
            first.setdefault(named[path.name], rel)
    return {
        m: sorted(files, key=lambda f, m=m: (f != first.get(m), f))
        for m, files in sorted(out.items())
    }


def table() -> str:
    """docs/testing.md's generated part: one row per module, with its file and tests
    (or why it has none)."""
    modules = _modules()
    rows = ["| module | file | test files |", "|---|---|---|"]
    for m, files in module_tests().items():
        src = modules[m].relative_to(ROOT)
        tests = ", ".join(f"`{f.removeprefix('tests/')}`" for f in files)
        if not files:
            tests = f"none: {UNTESTED[m]}" if m in UNTESTED else "none"
        rows.append(f"| `{m}` | `{src}` | {tests} |")
    return "\n".join(rows) + "\n"


def _with_table(text: str) -> str:
    """``text`` (docs/testing.md) with its generated part rewritten."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


# ---------------------------------------------------------------------------
# The reader, on hand-written files
# ---------------------------------------------------------------------------


def _package(root: Path, files: dict[str, str]) -> Package:
    """A package written under ``root`` from dotted name -> source (a name ending in
    ``.__init__`` is its package)."""
    modules = {}
    for name, source in files.items():
        path = root.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        modules[name.removesuffix(".__init__")] = path
    return Package.read(modules)


def test_a_test_file_tests_what_it_imports_reexports_and_runs(tmp_path) -> None:
    package = _package(
        tmp_path,
        {
            "p.__init__": (
                "from typing import TYPE_CHECKING\n"
                "from p.a import A\n"
                "if TYPE_CHECKING:\n"
                "    from p.b import B\n"
                "def __getattr__(name):\n"
                "    from p.c import C\n"
                "    return C\n"
                "def own():\n"
                "    pass\n"
            ),
            "p.a": "class A: ...\n",
            "p.b": "class B: ...\n",
            "p.c": "class C: ...\ndef main(): ...\n",
            "p.d": "def go(): ...\n",
            "p.e": "def e(): ...\n",
            "p.cli": (
                "import importlib\n"
                "TABLE = {'go': 'p.d', 'off': 'p.e'}\n"
                "def main(argv): importlib.import_module(TABLE[argv[0]])\n"
            ),
            "p.__main__": "from p.c import main\nmain()\n",
        },
    )
    assert package.exports["p"] == {"A": "p.a", "B": "p.b", "C": "p.c"}
    assert package.tables["p.cli"] == {"go": "p.d", "off": "p.e"}
    test = tmp_path / "test_x.py"
    # Names from the package's __init__: those it imports count for their module, its
    # own count for the package alone.
    test.write_text("from p import A, B, own\n")
    assert modules_tested_by(test, package) == {"p", "p.a", "p.b"}
    test.write_text("import p.d\nfrom p import cli as tool\ntool.main(['go', 'off'])\n")
    assert modules_tested_by(test, package) == {"p.d", "p.cli"}
    test.write_text("from p import cli\ncli.main(['go'])\nx = {'off': 1}\n")
    assert modules_tested_by(test, package) == {"p.cli", "p.d"}
    # A package imported under a name of its own, its re-exports read as attributes.
    test.write_text("import p as q\nq.C\nq.own\n")
    assert modules_tested_by(test, package) == {"p", "p.c"}
    # Run as `python -m p`: its __main__ is a shim, what it imports is run.
    test.write_text("import sys\nCMD = [sys.executable, '-m', 'p']\n")
    assert modules_tested_by(test, package) == {"p.__main__", "p.c"}


def test_behaviour_is_a_definition_of_its_own() -> None:
    assert _has_behaviour(_modules()["sven.datasets.store"])
    # Re-exports, a version string and a PEP 562 hook; a protocol; a shim.
    assert not _has_behaviour(_modules()["sven"])
    assert not _has_behaviour(_modules()["sven.tasks.run"])
    assert not _has_behaviour(_modules()["sven.__main__"])


def test_test_files_are_named_after_unique_module_names() -> None:
    named = _named_after(_modules())
    assert named["test_sampler.py"] == "sven.pipeline.sampler"
    assert named["test_events_kernel.py"] == "sven.kernels.triton_events"
    # Three modules are called store: a test file of that name tests what it imports.
    assert "test_store.py" not in named


# ---------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------


def test_testing_doc_is_generated() -> None:
    text = DOC.read_text()
    assert text == _with_table(text), "run: python -m tests.unit.test_test_map --write"


def test_every_module_with_behaviour_has_a_test() -> None:
    modules = _modules()
    untested = sorted(
        m
        for m, files in module_tests().items()
        if not files and m not in UNTESTED and _has_behaviour(modules[m])
    )
    assert not untested, f"modules no test file tests (see docs/testing.md): {untested}"
    stale = sorted(m for m in UNTESTED if m not in modules or module_tests()[m])
    assert not stale, f"tested or gone, take them off UNTESTED: {stale}"
    plain = sorted(m for m in UNTESTED if m in modules and not _has_behaviour(modules[m]))
    assert not plain, f"nothing of their own to test, take them off UNTESTED: {plain}"


def _main(argv: list[str]) -> int:
    """``--write``: rewrite docs/testing.md's table; else the test files of each module
    named (dotted, or its file from the repository root), one a line."""
    if argv == ["--write"]:
        DOC.write_text(_with_table(DOC.read_text()))
        return 0
    by_file = {str(p.relative_to(ROOT)): m for m, p in _modules().items()}
    names = [by_file.get(a, a) for a in argv]
    unknown = [a for a, m in zip(argv, names) if m not in _modules()]
    if not argv or unknown:
        print(f"not a module of the package: {unknown}" if unknown else __doc__)
        return 2
    print("\n".join(dict.fromkeys(f for m in names for f in module_tests()[m])))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
