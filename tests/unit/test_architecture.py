"""The shape of the code: small modules, no import circles, no module nothing imports.

These read the sources (``ast``), never import them: a module that fails to import still
gets its violations named. The package is what ``pyproject.toml`` installs: ``sven/``,
and ``pipeline/``, ``partition/``, ``datasets/`` as ``sven.pipeline``, ``sven.partition``,
``sven.datasets`` (``[tool.setuptools.package-dir]``).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser under its older name
    tomllib = pytest.importorskip("tomli")


ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 700


def _package_dirs() -> dict[str, Path]:
    """Dotted package name -> its folder, from pyproject's ``package-dir``."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setup["package-dir"].items()}


@functools.cache
def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its ``__init__``)."""
    dirs = _package_dirs()
    # A folder installed under a name of its own (pipeline/ as sven.pipeline) is not also
    # a subfolder of another entry.
    homes = set(dirs.values())
    out: dict[str, Path] = {}
    for name, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            if any(p in homes and p != folder for p in path.parents):
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name, *parts))] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` tests ``TYPE_CHECKING`` (or ``typing.TYPE_CHECKING``)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_nodes(tree: ast.AST, types: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, inside functions too, except under ``if TYPE_CHECKING:``
    (its ``else:`` branch runs, so it counts) unless ``types``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if not types and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of the package that importing ``name`` means: its longest known prefix."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in modules:
            return prefix
    return None


def _by_name(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The modules a module imports by name: where it calls ``importlib.import_module``,
    every string constant that is the dotted name of a module of the package (the
    subcommand table of ``sven.cli``, the Triton kernels table of ``sven.kernels``)."""
    nodes = list(ast.walk(tree))
    if not any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "import_module"
        for n in nodes
    ):
        return set()
    return {
        n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)
    } & set(modules)


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]
) -> list[str]:
    """The dotted name each alias of an import statement in ``module`` imports, in order:
    relative names made absolute, ``from pkg import sub`` the submodule where one has
    that name, else ``pkg`` (``from pkg import name``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        # Relative: from the module's package, one level up per extra dot.
        anchor = module.split(".")
        anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join([*anchor, *([base] if base else [])])
    return [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
        for alias in node.names
    ]


def _imports(module: str, path: Path, modules: dict[str, Path], types: bool = False) -> set[str]:
    """The modules of the package that ``module`` imports (itself excluded), by import
    statements and by name (:func:`_by_name`); with ``types``, for type checking too."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    found = _by_name(tree, modules) - {module}
    for node in _import_nodes(tree, types):
        for target in _targets(node, module, is_package, modules):
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


@functools.cache
def _graph(types: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (with ``types``, for type
    checking too)."""
    modules = _modules()
    return {m: _imports(m, p, modules, types) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, in order.

    Tarjan's algorithm finds the components; within each, the shortest path from its
    first module (by name) back to itself is the circle reported.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in sorted(components):
        inside, start = set(comp), comp[0]
        # Breadth-first from start: the first path that returns to start is the shortest.
        paths = [[start]]
        seen = {start}
        while paths:
            path = paths.pop(0)
            nxt = sorted(graph[path[-1]] & inside)
            if start in nxt:
                out.append([*path, start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append([*path, w])
    return out


def _entry_points(modules: dict[str, Path]) -> set[str]:
    """Modules run by name rather than imported: ``__main__`` modules (``python -m``)
    and the console script's module (``[project.scripts]``)."""
    entries = {m for m in modules if m.rsplit(".", 1)[-1] == "__main__"}
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return entries | {target.split(":", 1)[0] for target in scripts.values()}


def _unused(graph: dict[str, set[str]], entries: set[str]) -> list[str]:
    """The modules that no other module imports and that are no entry point."""
    reached = set().union(*graph.values()) | entries
    # Importing or running a submodule runs its packages' __init__ first.
    reached |= {m.rsplit(".", i)[0] for m in reached for i in range(1, m.count(".") + 1)}
    return sorted(set(graph) - reached)


# ---------------------------------------------------------------------------
# The checks' own machinery, on hand-built graphs
# ---------------------------------------------------------------------------


def test_cycles_are_found_and_named_in_order() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_unused_modules_are_found_and_packages_count_as_run_by_their_modules() -> None:
    graph = {
        "p": set(),
        "p.__main__": {"p.a"},
        "p.a": {"p.b"},
        "p.b": set(),
        "p.c": set(),
        "q": set(),
        "q.d": set(),
    }
    assert _unused(graph, {"p.__main__"}) == ["p.c", "q", "q.d"]


def test_imports_skip_type_checking_blocks_but_count_function_bodies(tmp_path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from sven.x import y\n"
        "if TYPE_CHECKING:\n"
        "    from sven.z import Z\n"
        "else:\n"
        "    import sven.w\n"
        "def f():\n"
        "    from . import v\n"
        "    from .u import thing\n"
    )
    modules = dict.fromkeys(
        ["sven.p.m", "sven.x", "sven.x.y", "sven.z", "sven.w", "sven.p", "sven.p.v", "sven.p.u"],
        src,
    )
    assert _imports("sven.p.m", src, modules) == {"sven.x.y", "sven.w", "sven.p.v", "sven.p.u"}
    # Names in a table count where the module imports by name, and only there.
    table = 'TABLE = {"a": "sven.z", "b": "sven.nowhere"}\n'
    src.write_text(f"import importlib\n{table}importlib.import_module(TABLE['a'])\n")
    assert _imports("sven.p.m", src, modules) == {"sven.z"}
    src.write_text(table)
    assert _imports("sven.p.m", src, modules) == set()


def test_package_folders_map_to_their_installed_names() -> None:
    modules = _modules()
    assert modules["sven.pipeline"] == ROOT / "pipeline" / "__init__.py"
    assert modules["sven.datasets.cli"] == ROOT / "datasets" / "cli.py"
    assert "pipeline" not in modules and "sven.cli" in modules


# ---------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------


def test_no_module_is_longer_than_700_lines() -> None:
    long = {
        f"{path.relative_to(ROOT)} ({n} lines)"
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines, split them by concern: {sorted(long)}"


def test_no_import_circle() -> None:
    circles = [" -> ".join(c) for c in _cycles(_graph())]
    assert not circles, "import circles (imports inside functions count): " + "; ".join(circles)


#: Circles through imports for type checking only, left when the rule came (issue 38):
#: the synthetic generator and its stream. None may join (link prediction and the
#: trainer were one; link prediction now takes the run as a protocol, sven.tasks.run).
TYPE_CIRCLES = {
    "sven.datasets.synth -> sven.datasets.synth_stream -> sven.datasets.synth",
}


def test_no_new_import_circle_through_types() -> None:
    circles = {" -> ".join(c) for c in _cycles(_graph(types=True))}
    assert not circles - TYPE_CIRCLES, f"import circles through types: {circles - TYPE_CIRCLES}"
    gone = TYPE_CIRCLES - circles
    assert not gone, f"circles broken, take them off TYPE_CIRCLES: {gone}"


def test_no_task_is_in_a_circle_with_the_trainer() -> None:
    """The trainer runs its tasks; a task takes the run (:class:`sven.tasks.run.Run`)
    and reaches the trainer through no chain of imports, those for types included."""
    graph = _graph(types=True)
    assert "sven.tasks.link" in graph["sven.engine.trainer"]
    reached, todo = set(), ["sven.engine.trainer"]
    while todo:
        for m in graph[todo.pop()] - reached:
            reached.add(m)
            todo.append(m)
    back = sorted(
        m for m in reached if m.startswith(TASKS) and _reaches(graph, m, "sven.engine.trainer")
    )
    assert not back, f"tasks the trainer imports that import it back: {back}"


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    """Whether ``goal`` is reachable from ``start`` in ``graph``."""
    seen, todo = {start}, [start]
    while todo:
        for m in graph[todo.pop()]:
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return False


#: Where the run's modes are read from the config: the config itself, the run's
#: description (resolved once) and the plan (which counts the prefetch ring's bytes
#: before the description exists).
MODE_READERS = ("sven.config", "sven.engine.spec", "sven.engine.plan")


def _mode_reads(tree: ast.AST) -> list[str]:
    """``<config>.pipeline`` and ``<anything>.cuda_graph`` reads, where ``<config>`` is
    a name or attribute ``cfg``/``config``."""

    def is_config(node: ast.expr) -> bool:
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        return name in ("cfg", "config")

    return sorted(
        f"{node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and (node.attr == "cuda_graph" or (node.attr == "pipeline" and is_config(node.value)))
    )


def test_mode_reads_are_found() -> None:
    tree = ast.parse("cfg.pipeline.prefetch\nself.cfg.pipeline\ntc.cuda_graph\nsven.pipeline\n")
    assert _mode_reads(tree) == ["1: .pipeline", "2: .pipeline", "3: .cuda_graph"]


def test_only_the_run_description_reads_the_modes_from_the_config() -> None:
    """The prefetch depth, micro-batches, staleness and graph mode are decided once
    (``sven.engine.spec.RunSpec``); the parts read them there."""
    found = [
        f"{m} {use}"
        for m, path in _modules().items()
        if not m.startswith(MODE_READERS)
        for use in _mode_reads(ast.parse(path.read_text()))
    ]
    assert not found, f"modes read from the config outside the run's description: {found}"


#: Keys of a run's checkpoint that are the run's to name (its parts, its progress).
RUN_KEYS = {
    "memory", "owner", "data", "model", "optimizer", "evaluator", "cursor", "progress",
    "exchange", "rng", "epoch", "memory_phase",
}  # fmt: skip


def test_the_run_checkpointer_names_no_key_of_the_run() -> None:
    """RunCheckpoints writes and reads a run's Snapshot: which part is saved under which
    key is the run's (the trainer's, a task's), never the checkpointer's."""
    path = _modules()["sven.engine.checkpoint.run"]
    found = sorted(
        f"{node.lineno}: {node.value!r}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in RUN_KEYS
    )
    assert not found, f"run keys named in sven/engine/checkpoint/run.py: {found}"


#: The tasks: what a trained or training run is used for. They use the trainer through
#: its public members only.
TASKS = ("sven.tasks",)


def _private_trainer_uses(tree: ast.AST) -> list[str]:
    """``tr._x`` / ``trainer._x`` / ``self.tr._x`` reads and calls (not dunders)."""

    def is_trainer(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in ("tr", "trainer")
        return isinstance(node, ast.Attribute) and node.attr in ("tr", "trainer")

    return sorted(
        f"{node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and is_trainer(node.value)
    )


def test_private_trainer_uses_are_found() -> None:
    tree = ast.parse("tr._log('x')\nself.tr._load(1)\ntr.log('y')\nx._bar\ntr.__class__\n")
    assert _private_trainer_uses(tree) == ["1: ._log", "2: ._load"]


def test_no_task_calls_a_private_trainer_member() -> None:
    found = [
        f"{m} {use}"
        for m, path in _modules().items()
        if m.startswith(TASKS)
        for use in _private_trainer_uses(ast.parse(path.read_text()))
    ]
    assert not found, f"tasks reaching into the trainer's private members: {found}"


def test_every_module_is_imported_or_an_entry_point() -> None:
    unused = _unused(_graph(), _entry_points(_modules()))
    assert not unused, f"modules that no module of the package imports: {unused}"


def test_entry_points_and_imports_by_name_are_seen() -> None:
    modules = _modules()
    assert {"sven.__main__", "sven.distributed.__main__", "sven.cli"} <= _entry_points(modules)
    # The subcommands, which sven.cli imports by name from its _STAGES table.
    assert {"sven.cli.train", "sven.datasets.cli"} <= _graph()["sven.cli"]


def test_no_type_ignore_for_a_union() -> None:
    """Alternatives are one interface (the exchange, the gradients), not a union whose
    members the code tells apart by silencing the type checker."""
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in _modules().values()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "type: ignore[union-attr]" in line
    ]
    assert not found, f"type: ignore[union-attr] (give the alternatives one interface): {found}"


# ---------------------------------------------------------------------------
# docs/architecture.md against the code's layout
# ---------------------------------------------------------------------------

DOC = ROOT / "docs" / "architecture.md"
_PATH = re.compile(r"\b((?:sven|pipeline|partition|datasets)/[\w/]*(?:\.py|/))")
_FILE = re.compile(r"(?<![\w/])(\w+\.py)\b")


def _doc_paths(text: str) -> set[str]:
    """Every repository path the page names (``sven/engine/step.py``, ``sven/cli/``)."""
    return set(_PATH.findall(text))


def _doc_files(text: str) -> set[str]:
    """Every bare file name the page names (``body.py`` in "step.py, body.py")."""
    return set(_FILE.findall(text))


def test_doc_path_readers_on_a_hand_written_line() -> None:
    line = "the step (`sven/engine/step.py`, body.py), `sven/cli/`, partition/x.py; a/b.py"
    assert _doc_paths(line) == {"sven/engine/step.py", "sven/cli/", "partition/x.py"}
    assert _doc_files(line) == {"body.py"}


def test_architecture_doc_names_only_what_exists() -> None:
    text = DOC.read_text()
    missing = sorted(p for p in _doc_paths(text) if not (ROOT / p).exists())
    names = {path.name for path in _modules().values()}
    unknown = sorted(f for f in _doc_files(text) if f not in names)
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    assert not unknown, f"docs/architecture.md names files no package holds: {unknown}"


def test_architecture_doc_names_every_package_and_top_module() -> None:
    text = DOC.read_text()
    folders = {
        f"{path.parent.relative_to(ROOT)}/"
        for path in _modules().values()
        if path.name == "__init__.py" and path.parent != ROOT / "sven"
    }
    tops = {p.name for p in (ROOT / "sven").glob("*.py")} - {"__init__.py", "__main__.py"}
    absent = sorted(f for f in folders if f not in text) + sorted(
        f for f in tops if f"`{f}`" not in text
    )
    assert not absent, f"docs/architecture.md leaves out: {absent}"


# ---------------------------------------------------------------------------
# Function length
# ---------------------------------------------------------------------------

MAX_FUNCTION_LINES = 80


def _function_lengths() -> dict[str, int]:
    """``module:function`` -> lines (signature to last line, docstring included)."""
    out: dict[str, int] = {}
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{module}:{node.name}"
                out[key] = max(out.get(key, 0), node.end_lineno - node.lineno + 1)
    return out


def test_no_function_is_longer_than_80_lines() -> None:
    long = sorted(
        f"{k} ({n} lines)" for k, n in _function_lengths().items() if n > MAX_FUNCTION_LINES
    )
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines, split them: {long}"


# ---------------------------------------------------------------------------
# Prose: docstrings and comments say what and why; figures live in docs/
# ---------------------------------------------------------------------------

#: What a measurement or a piece of development history looks like in prose: a rate, an
#: accuracy, a timing set against something, a speed ratio, a kernel count, the machine
#: a figure came from, a development session, a change told as before and after.
MEASUREMENT = re.compile(
    "|".join(
        [
            r"\d[\d,.]*\s?k?\s(?:train |eval )?events/s",
            r"\b(?:AP|AUC|MRR)\b\W{1,3}(?:of\s)?\d*\.\d{2,}",
            r"\b\d+ points (?:under|over|above|below)\b",
            r"\bsession \d+",
            r"\d+(?:\.\d+)?\s?(?:us|µs|ms|s)\s(?:per|a|of|against|vs\.?|versus)\s",
            r"\bin (?:about )?\d+(?:\.\d+)?\s?(?:us|µs|ms)\b",
            r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x (?:faster|slower)\b",
            r"\bcosts? \d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b",
            r"\b\d+ kernels\b",
            r"\bon an? (?:H100|H200|A100|V100)\b",
            r"\btook (?:about )?\d",
            r"\bwas \S+,? now\b",
        ]
    ),
    re.IGNORECASE,
)


def _prose(source: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every line of a docstring or other string statement, and of
    every comment."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for i, line in enumerate(ast.get_source_segment(source, node).splitlines()):
                yield node.lineno + i, line
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def _measurements(source: str) -> list[str]:
    """``"line: text"`` of each line of prose that carries a measurement."""
    found = {(n, line.strip()) for n, line in _prose(source) if MEASUREMENT.search(line)}
    return [f"{n}: {text}" for n, text in sorted(found)]


def test_measurements_in_prose_are_found() -> None:
    source = (
        '"""The step.\n\nIt ran at 189.2k train events/s; test AP 0.913 (session 5)."""\n'
        "x = 1  # about 1.8-2.2x faster than before\n"
        "def f():\n"
        '    """Was slow, 0.9 ms of a 2.3 ms step on an H200."""\n'
        "    # about 10 kernels forward; the hash in about 10 ms\n"
        "    y = '12 events/s'  # a string value is no prose\n"
        "# What a batch is: (B, d) rows, 10 ms clock ticks, a timeout of 30 s.\n"
    )
    assert _measurements(source) == [
        '3: It ran at 189.2k train events/s; test AP 0.913 (session 5)."""',
        "4: # about 1.8-2.2x faster than before",
        '6: """Was slow, 0.9 ms of a 2.3 ms step on an H200."""',
        "7: # about 10 kernels forward; the hash in about 10 ms",
    ]


def test_no_measurement_in_docstrings_or_comments() -> None:
    """Docstrings and comments of sven/, pipeline/, partition/ and datasets/ say what
    the code does and why; measurements and how they changed over time are in docs/
    (performance.md, kernels.md, accuracy.md)."""
    found = [
        f"{path.relative_to(ROOT)}:{use}"
        for module, path in _modules().items()
        for use in _measurements(path.read_text())
    ]
    assert not found, "measurements in prose, move them to docs/:\n" + "\n".join(found)
