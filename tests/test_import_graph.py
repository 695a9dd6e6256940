"""The package's import graph, read with ``ast`` (issue 40's architectural rules).

Every ``import``/``from ... import`` of a package module counts, at module level and inside
functions (a function-local import closes a cycle as surely as a top-level one); relative
imports are resolved against the importing module. The rules:

(a) no import cycle among the package's modules;
(b) no private name (``_name``, dunders excepted) imported across modules, neither
    ``from pkg.x import _name`` nor ``mod._name`` on a name bound to an imported module;
(c) no ``.py`` file over ``MAX_LINES`` lines;
(d) kernel modules (``kernels``, ``ops``, ``csrc``) never import ``layers`` or ``models``.

The checker runs on pagefold and, first, on a synthetic package with one planted violation
of each rule, so a checker that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
KERNEL_PACKAGES = ("kernels", "ops", "csrc")
FORBIDDEN_FROM_KERNELS = ("layers", "models")


@dataclass
class ImportGraph:
    """Modules of one package and what each imports: ``edges[a]`` is the set of package
    modules ``a`` imports; ``private`` lists ``(module, line, what)`` cross-module private
    uses; ``lines`` each module's line count; ``files`` each module's path."""

    package: str
    edges: dict[str, set[str]] = field(default_factory=dict)
    private: list[tuple[str, int, str]] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)


def _module_name(path: Path, base: Path) -> tuple[str, bool]:
    rel = path.relative_to(base).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def _resolve_relative(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    """``from .x import y`` inside ``module``: the absolute name of ``.x``."""
    parts = module.split(".")
    if not is_pkg:
        parts = parts[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    if name:
        parts = parts + name.split(".")
    return ".".join(parts)


def _known(name: str, modules: set[str]) -> str | None:
    """The longest package module that ``name`` is or lies inside (``a.b.c`` -> ``a.b``
    when ``c`` is an attribute of module ``a.b``)."""
    while name:
        if name in modules:
            return name
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return None


def build_graph(base: Path, package: str) -> ImportGraph:
    """Read every module of ``base/package`` (``base`` holds the package directory)."""
    graph = ImportGraph(package)
    trees: dict[str, tuple[ast.Module, bool]] = {}
    for path in sorted((base / package).rglob("*.py")):
        module, is_pkg = _module_name(path, base)
        text = path.read_text()
        graph.files[module] = path
        graph.lines[module] = len(text.splitlines())
        trees[module] = (ast.parse(text, filename=str(path)), is_pkg)
    modules = set(trees)
    for module, (tree, is_pkg) in trees.items():
        deps: set[str] = set()
        # names bound to a package module in this file (``import a.b as m``, ``from a import b``)
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _known(alias.name, modules)
                    if target is None:
                        continue
                    deps.add(target)
                    if alias.asname:
                        bound[alias.asname] = target
                    else:
                        top = alias.name.split(".")[0]
                        if top in modules:
                            bound[top] = top
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    source = _resolve_relative(module, is_pkg, node.level, node.module)
                else:
                    source = node.module or ""
                source_mod = _known(source, modules)
                if source_mod is None:
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if full in modules:  # ``from pkg import submodule``
                        deps.add(full)
                        bound[alias.asname or alias.name] = full
                        continue
                    deps.add(source_mod)
                    if _is_private(alias.name) and source_mod != module:
                        graph.private.append(
                            (module, node.lineno, f"from {source} import {alias.name}"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            owner = _bound_module(node.value, bound, modules)
            if owner is not None and owner != module:
                graph.private.append((module, node.lineno, f"{owner}.{node.attr}"))
        deps.discard(module)
        graph.edges[module] = deps
    return graph


def _bound_module(node: ast.expr, bound: dict[str, str], modules: set[str]) -> str | None:
    """The package module an expression such as ``m`` or ``pkg.sub.m`` names, where its
    head is a name bound to a package module in this file; None otherwise."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    name = ".".join([bound[node.id], *reversed(parts)])
    return name if name in modules else None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def find_cycles(graph: ImportGraph) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted;
    a component is a set of modules that reach one another, i.e. one or more cycles.

    A module's edge to its own parent package is kept: ``a.b`` imports ``a``, which runs
    ``a/__init__``; if that imports ``a.b`` back, the cycle is real."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        # iterative Tarjan: the package graph is deep enough to matter for recursion
        work = [(v, iter(sorted(graph.edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.edges.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for v in sorted(graph.edges):
        if v not in index:
            visit(v)
    return sorted(out)


def one_cycle(graph: ImportGraph, component: list[str]) -> list[str]:
    """A concrete cycle inside ``component`` (breadth-first from its first module back to
    itself), for a failure message that names the import chain."""
    members = set(component)
    start = component[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def cycle_report(graph: ImportGraph) -> list[str]:
    return [" -> ".join(one_cycle(graph, comp)) + f"  (component: {', '.join(comp)})"
            for comp in find_cycles(graph)]


def private_report(graph: ImportGraph) -> list[str]:
    """One line per (module, private name): its first use."""
    seen: set[tuple[str, str]] = set()
    out = []
    for m, line, what in sorted(graph.private):
        if (m, what) not in seen:
            seen.add((m, what))
            out.append(f"{m}:{line}: {what}")
    return out


def long_files(graph: ImportGraph, limit: int = MAX_LINES) -> list[str]:
    return [f"{graph.files[m]} ({n} lines)" for m, n in sorted(graph.lines.items())
            if n > limit]


def kernel_layering(graph: ImportGraph) -> list[str]:
    kernel = tuple(f"{graph.package}.{p}" for p in KERNEL_PACKAGES)
    banned = tuple(f"{graph.package}.{p}" for p in FORBIDDEN_FROM_KERNELS)

    def under(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    return [f"{m} imports {d}" for m in sorted(graph.edges) if under(m, kernel)
            for d in sorted(graph.edges[m]) if under(d, banned)]


# -- the checker on a planted package ----------------------------------------------------

def _write(base: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


CLEAN = {
    "pkg/__init__.py": "",
    "pkg/low.py": "def f():\n    return 1\n\n\ndef _helper():\n    return 2\n",
    "pkg/mid.py": ("from pkg.low import f\nfrom . import low\n\n\n"
                   "def g():\n    return low.f() + f()\n"),
    "pkg/kernels/__init__.py": "",
    "pkg/kernels/k.py": "from pkg import low\n",
    "pkg/layers/__init__.py": "",
    "pkg/layers/l.py": "from pkg.kernels import k\n",
}


def test_checker_passes_a_clean_package(tmp_path):
    _write(tmp_path, CLEAN)
    g = build_graph(tmp_path, "pkg")
    assert g.edges["pkg.mid"] == {"pkg.low"}
    assert g.edges["pkg.layers.l"] == {"pkg.kernels.k"}
    assert cycle_report(g) == [] and private_report(g) == []
    assert long_files(g) == [] and kernel_layering(g) == []


def test_checker_finds_a_function_local_cycle(tmp_path):
    _write(tmp_path, {**CLEAN, "pkg/low.py": CLEAN["pkg/low.py"]
                      + "\n\ndef late():\n    from .mid import g\n    return g()\n"})
    report = cycle_report(build_graph(tmp_path, "pkg"))
    assert len(report) == 1
    assert "pkg.low" in report[0] and "pkg.mid" in report[0]


def test_checker_finds_a_three_module_cycle_through_a_subpackage(tmp_path):
    _write(tmp_path, {**CLEAN, "pkg/kernels/k.py": "import pkg.mid as m\n",
                      "pkg/low.py": "from pkg.kernels import k\n"})
    g = build_graph(tmp_path, "pkg")
    (comp,) = find_cycles(g)
    assert comp == ["pkg.kernels.k", "pkg.low", "pkg.mid"]
    assert cycle_report(g)[0].startswith("pkg.kernels.k -> pkg.mid -> pkg.low -> pkg.kernels.k")


def test_checker_finds_private_imports(tmp_path):
    _write(tmp_path, {**CLEAN,
                      "pkg/a.py": "from pkg.low import _helper, __version__\n",
                      "pkg/b.py": "import pkg.low as lo\n\nx = lo._helper()\ny = lo.__name__\n",
                      "pkg/c.py": "from pkg import low\n\n\ndef h():\n    return low._helper()\n",
                      "pkg/d.py": "import pkg.low\n\nz = pkg.low._helper\n"})
    found = private_report(build_graph(tmp_path, "pkg"))
    assert found == ["pkg.a:1: from pkg.low import _helper", "pkg.b:3: pkg.low._helper",
                     "pkg.c:5: pkg.low._helper", "pkg.d:3: pkg.low._helper"], found
    # a module's own private names are its business
    own = tmp_path / "own"
    _write(own, {**CLEAN, "pkg/low.py": CLEAN["pkg/low.py"] + "import pkg.low as me\n"
                 "y = me._helper\n"})
    assert private_report(build_graph(own, "pkg")) == []


def test_checker_finds_long_files(tmp_path):
    _write(tmp_path, {**CLEAN, "pkg/big.py": "x = 1\n" * (MAX_LINES + 1),
                      "pkg/edge.py": "x = 1\n" * MAX_LINES})
    assert long_files(build_graph(tmp_path, "pkg")) == [
        f"{tmp_path / 'pkg' / 'big.py'} ({MAX_LINES + 1} lines)"]


def test_checker_finds_kernels_importing_layers(tmp_path):
    _write(tmp_path, {**CLEAN, "pkg/ops/__init__.py": "",
                      "pkg/ops/o.py": "def f():\n    from ..models import m\n",
                      "pkg/models/__init__.py": "", "pkg/models/m.py": ""})
    assert kernel_layering(build_graph(tmp_path, "pkg")) == ["pkg.ops.o imports pkg.models.m"]


# -- the rules on pagefold ----------------------------------------------------------------

def _pagefold() -> ImportGraph:
    return build_graph(ROOT, "pagefold")


def test_graph_reads_pagefold():
    g = _pagefold()
    # the reader sees the engine's real imports (a broken reader would see none)
    assert "pagefold.executor.model_runner" in g.edges["pagefold.executor.runner_builder"]
    assert len(g.edges) > 100


def test_no_import_cycle():
    report = cycle_report(_pagefold())
    assert not report, "import cycles among pagefold modules:\n" + "\n".join(report)


def test_no_private_import_across_modules():
    report = private_report(_pagefold())
    assert not report, "private names used across modules:\n" + "\n".join(report)


def test_no_long_file():
    report = long_files(_pagefold())
    assert not report, f"files over {MAX_LINES} lines:\n" + "\n".join(report)


def test_kernels_do_not_import_layers_or_models():
    report = kernel_layering(_pagefold())
    assert not report, "kernel code importing layers/models:\n" + "\n".join(report)
