"""The package's import graph has no cycle, and its core keeps its layers (CPU, static: nothing is
imported).

Every module of ``fusible_ops/`` is parsed with ``ast``. An import anywhere in a module counts,
inside a function too (it runs, later); one in an ``if TYPE_CHECKING:`` block does not (its
``else:`` does). ``from .pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``; the parent packages Python imports on the way are not edges (they run first, whatever
imports what).

Layers: the contracts (``fusible_ops.op``) reach nothing that reaches the fuser; the fuser reaches
none of what builds on it (C++ replay, MoE routing, the ops), which joins in through the plan
extensions it registers (:mod:`fusible_ops.fuser_extensions`).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fusible_ops"


# -- the detector ---------------------------------------------------------------------------
def _modules(root: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package) for every ``.py`` file under ``root``."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _resolve(name: str, mods) -> str:
    """``name``, or its longest prefix that is a module of the package."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name


def _imports(name: str, path: pathlib.Path, is_pkg: bool, mods, pkg: str) -> set[str]:
    """The package's modules that module ``name`` imports."""
    here = name.split(".") if is_pkg else name.split(".")[:-1]  # the package relative imports start from
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:  # (the body only runs under a type checker)
                    visit_one(stmt)
            else:
                visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == pkg:
                    out.add(_resolve(alias.name, mods))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == pkg:
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    out.add(sub if sub in mods else _resolve(module, mods))
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    out.discard(name)
    out.discard("")
    return out


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for the package at ``root``."""
    mods = _modules(root)
    return {name: _imports(name, path, is_pkg, mods, root.name) for name, (path, is_pkg) in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen, todo = set(), list(graph[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def _describe(graph, comps) -> str:
    lines = []
    for comp in comps:
        lines.append(f"import cycle of {len(comp)} modules: {', '.join(comp)}")
        for m in comp:
            lines.append(f"    {m} -> {', '.join(sorted(graph[m] & set(comp)))}")
    return "\n".join(lines)


# -- the package ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGE)


def test_package_has_no_import_cycle(graph):
    assert "fusible_ops.fuser" in graph and "fusible_ops.op" in graph  # (the walk found the package)
    comps = cycles(graph)
    assert not comps, "\n" + _describe(graph, comps)


def test_contracts_reach_nothing_that_reaches_the_fuser(graph):
    op, fuser = "fusible_ops.op", "fusible_ops.fuser"
    bad = [m for m in sorted(graph[op]) if m == fuser or fuser in reach(graph, m)]
    assert not bad, f"{op} imports {bad}, which is or reaches {fuser} (the contracts import nothing above them)"


def test_fuser_reaches_nothing_built_on_it(graph):
    reached = reach(graph, "fusible_ops.fuser")
    above = sorted(m for m in reached if m in ("fusible_ops.replay", "fusible_ops.fuser_routing")
                   or m == "fusible_ops.ops" or m.startswith("fusible_ops.ops."))
    assert not above, (f"fusible_ops.fuser reaches {above}: what builds on the fuser registers a plan extension "
                       f"(fusible_ops.fuser_extensions) instead of being imported by it")


# -- the detector itself, on tiny packages ------------------------------------------------
def _package(tmp_path: pathlib.Path, name: str, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / name
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_detector_finds_a_cycle_through_a_function_level_import(tmp_path):
    root = _package(tmp_path, "pkga", {
        "a.py": "from .b import helper\n",
        "b.py": "def helper():\n    from . import a  # at call time\n    return a\n",
        "c.py": "import pkga.a\n",
    })
    graph = import_graph(root)
    assert graph["pkga.a"] == {"pkga.b"} and graph["pkga.b"] == {"pkga.a"} and graph["pkga.c"] == {"pkga.a"}
    assert cycles(graph) == [["pkga.a", "pkga.b"]]
    assert "pkga.a, pkga.b" in _describe(graph, cycles(graph))


def test_detector_skips_type_checking_blocks(tmp_path):
    root = _package(tmp_path, "pkgb", {
        "a.py": "from .b import helper\n",
        "b.py": ("from typing import TYPE_CHECKING\nimport typing\n\n"
                 "if TYPE_CHECKING:\n    from .a import thing\n"
                 "if typing.TYPE_CHECKING:\n    from . import a\nelse:\n    from . import c\n\n"
                 "def helper():\n    pass\n"),
        "c.py": "",
    })
    graph = import_graph(root)
    assert graph["pkgb.b"] == {"pkgb.c"}  # (the else branch of a TYPE_CHECKING block counts)
    assert cycles(graph) == []


def test_detector_resolves_names_and_skips_implied_parents(tmp_path):
    root = _package(tmp_path, "pkgc", {
        "__init__.py": "from .sub import mod\nfrom .sub.mod import VALUE\n",
        "sub/__init__.py": "from . import mod\nfrom .mod import VALUE\n",
        "sub/mod.py": "import os\nimport pkgc.other.deep\nfrom .. import other\nfrom ..other import NAME\nVALUE = 1\n",
        "other/__init__.py": "NAME = 2\n",
        "other/deep.py": "",
    })
    graph = import_graph(root)
    # ``from .sub import mod``: the module sub.mod; ``from ..other import NAME``: the package other;
    # ``import pkgc.other.deep`` runs pkgc/__init__ first, but that is no edge (no cycle through it).
    assert graph["pkgc"] == {"pkgc.sub.mod"}
    assert graph["pkgc.sub"] == {"pkgc.sub.mod"}
    assert graph["pkgc.sub.mod"] == {"pkgc.other", "pkgc.other.deep"}
    assert cycles(graph) == []
    assert reach(graph, "pkgc") == {"pkgc.sub.mod", "pkgc.other", "pkgc.other.deep"}
