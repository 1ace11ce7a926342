"""capture/ imports without a circle, and only capture/native/ reaches the Rust extension.

Read from the source with :mod:`ast`, not from ``sys.modules``: every ``import`` and ``from … import`` of
every module under capture/, at module level and inside functions alike (a function-level import that
closes a circle is still one: it only moves the failure to run time), except those under
``if TYPE_CHECKING:``, which never run. An edge goes to the module a statement names (``from capture.a
import b`` names capture.a, and capture.a.b too when that is a module); a relative import is resolved
first. ``importlib.import_module`` and ``__import__`` with a literal name count as imports too.

For each strongly connected component of the graph the test reports the shortest circle through each of
its modules (a circle found from two of its modules once), each step with the file and line of its import,
so the import to move is named.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Tideline's packages that must not import the extension themselves (capture/native/ excepted)
PACKAGES = ("capture", "eventstore", "tideline", "projections", "schemas", "commands")
EXTENSION = "tideline_native"
NATIVE_PACKAGE = "capture/native"
BOUNDARY = "capture/native/extension.py"  # the one module that imports it when it runs


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's module (resolved), the names it takes from it, where, and whether it runs."""

    module: str
    names: tuple[str, ...]  # from-imports: the names imported (which may be submodules)
    line: int
    typing_only: bool  # under ``if TYPE_CHECKING:``


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, module: str, is_package: bool) -> list[Import]:
    """Every import in ``path`` (the module ``module``), wherever it sits."""
    found: list[Import] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, (), node.lineno, typing_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            found.append(Import(base, tuple(a.name for a in node.names), node.lineno, typing_only))
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Name) and node.func.id == "__import__")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            )
        ):
            found.append(Import(node.args[0].value, (), node.lineno, typing_only))
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def modules_under(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Every module of ``package`` under ``root``: dotted name → (its file, whether it is a package's __init__)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


Edges = dict[str, dict[str, str]]  # module → {module it imports: "file:line" of the (first) import}


def import_graph(root: Path, package: str) -> Edges:
    """The imports among ``package``'s modules that run (those under ``if TYPE_CHECKING:`` do not)."""
    modules = modules_under(root, package)
    graph: Edges = {name: {} for name in modules}
    for name, (path, is_package) in modules.items():
        for imp in imports_of(path, name, is_package):
            if imp.typing_only:
                continue
            targets = [imp.module, *(f"{imp.module}.{n}" for n in imp.names)]
            for target in targets:
                if target in modules and target != name:
                    graph[name].setdefault(target, f"{path.relative_to(root)}:{imp.line}")
    return graph


def cycles(graph: Edges) -> list[list[str]]:
    """The shortest circle through each module of each strongly connected component of more than one module
    (Tarjan's, iterative), each circle once (starting at its first module by name)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    found: list[list[str]] = []
    for component in components:
        for member in sorted(component):
            circle = _circle(graph, component, member)[:-1]
            at = circle.index(min(circle))
            circle = circle[at:] + circle[:at] + [circle[at]]
            if circle not in found:
                found.append(circle)
    return found


def _circle(graph: Edges, component: set[str], first: str) -> list[str]:
    """A shortest path from ``first`` back to itself, within its component."""
    came_from: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in component:
                    continue
                if child == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [first, *reversed(path[:-1]), first]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle through {sorted(component)}")


def describe(graph: Edges, circle: list[str]) -> str:
    """``a → b (a.py:3) → a (b.py:9)``: each step with the import that makes it."""
    steps = [circle[0]] + [f"{b} ({graph[a][b]})" for a, b in itertools.pairwise(circle)]
    return " → ".join(steps)


def extension_importers(root: Path) -> tuple[set[str], set[str]]:
    """The files of :data:`PACKAGES` that import the extension: ``(when they run, for types only)``."""
    running: set[str] = set()
    typing_only: set[str] = set()
    for package in PACKAGES:
        for name, (path, is_package) in modules_under(root, package).items():
            for imp in imports_of(path, name, is_package):
                if imp.module.split(".")[0] == EXTENSION:
                    (typing_only if imp.typing_only else running).add(str(path.relative_to(root)))
    return running, typing_only - running


# ---------------------------------------------------------------------------- the tree


def test_capture_has_no_import_circle() -> None:
    graph = import_graph(ROOT, "capture")
    assert len(graph) > 40 and graph["capture.connector"], "the graph was read (its modules and their imports)"
    found = [describe(graph, circle) for circle in cycles(graph)]
    assert not found, "import circles in capture/ (move the function or type to where it belongs):\n" + "\n".join(found)


def test_only_capture_native_imports_the_extension() -> None:
    running, typing_only = extension_importers(ROOT)
    assert running == {BOUNDARY}, f"only {BOUNDARY} may import {EXTENSION} (the rest use its names): {running}"
    outside = {path for path in typing_only if not path.startswith(f"{NATIVE_PACKAGE}/")}
    assert not outside, f"{EXTENSION}'s types are capture/native/'s business, not {sorted(outside)}'s"


# ---------------------------------------------------------------------------- the reading itself


def test_function_level_and_relative_imports_count_type_checking_ones_do_not(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g  # lazy\n    return g\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nelse:\n    import pkg.d\n"
        "def g():\n    import importlib\n    return importlib.import_module('pkg.a')\n"
    )
    (pkg / "d.py").write_text("import os\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub": "pkg/a.py:1", "pkg.sub.b": "pkg/a.py:1"}
    assert graph["pkg.sub.b"] == {"pkg.c": "pkg/sub/b.py:2"}
    assert graph["pkg.c"] == {"pkg.d": "pkg/c.py:5", "pkg.a": "pkg/c.py:8"}
    (circle,) = cycles(graph)
    assert describe(graph, circle) == ("pkg.a → pkg.sub.b (pkg/a.py:1) → pkg.c (pkg/sub/b.py:2) → pkg.a (pkg/c.py:8)")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    assert cycles(import_graph(tmp_path, "pkg")) == []
