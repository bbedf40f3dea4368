"""The package's shape, checked: imports point one way, privates stay home, modules stay small.

Every import of a kvpolicy module counts, at module level or inside a function, so that a
lazy import cannot hide a cycle. The only lazy imports of kvpolicy modules allowed are the
Triton kernels: ``triton.jit`` decides at import time whether a kernel is compiled or
interpreted, so they are imported where a Triton backend is first chosen.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvpolicy"
MAX_LINES = 600
LAZY_ALLOWED = {"kvpolicy.kernels.triton_attention", "kvpolicy.kernels.triton_quant"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


MODULES = _modules()


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path):
    """Yield ``(target module, imported name or None, lineno, inside a function)``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))]
    nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        lazy = id(node) in nested
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvpolicy"):
                    yield alias.name, None, node.lineno, lazy
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node)
            if not target.startswith("kvpolicy"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:  # "from . import module"
                    yield sub, None, node.lineno, lazy
                else:
                    yield target, alias.name, node.lineno, lazy


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for name, path in MODULES.items():
        g.add_node(name)
        for target, _, _, _ in _imports(name, path):
            if target in MODULES and target != name:
                g.add_edge(name, target)
    return g


def _without_package_inits(g: nx.DiGraph) -> nx.DiGraph:
    """A package ``__init__`` that re-exports its submodules imports them, and every
    submodule imports through its package: those edges are Python's package mechanics,
    not a dependency between stages. Drop edges into a package from its own members."""
    packages = {n for n, p in MODULES.items() if p.name == "__init__.py"}
    out = g.copy()
    for a, b in list(g.edges):
        if b in packages and a.startswith(b + "."):
            out.remove_edge(a, b)
    return out


def test_no_import_cycle_among_kvpolicy_modules():
    g = _without_package_inits(_graph())
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles)


def test_a_cycle_would_be_found():
    """The check above sees function-level imports: build one and find it."""
    g = _graph()
    g.add_edge("kvpolicy.kernels.layout", "kvpolicy.api")  # a lazy import inside kernels
    assert list(nx.simple_cycles(_without_package_inits(g)))


def test_lazy_imports_are_only_the_triton_kernels():
    lazy = [
        f"{name}:{line} imports {target}"
        for name, path in MODULES.items()
        for target, _, line, inside in _imports(name, path)
        if inside and target not in LAZY_ALLOWED
    ]
    assert not lazy, "function-level imports of kvpolicy modules: " + ", ".join(lazy)


def test_no_private_name_imported_across_modules():
    crossing = [
        f"{name}:{line} imports {target}.{imported}"
        for name, path in MODULES.items()
        for target, imported, line, _ in _imports(name, path)
        if imported and imported.startswith("_") and not imported.startswith("__")
        and target != name
    ]
    assert not crossing, ", ".join(crossing)


def test_no_private_attribute_of_another_kvpolicy_module():
    """``module._private`` through an imported kvpolicy module."""
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {}
        for target, imported, _, _ in _imports(name, path):
            if imported is None:
                aliases[target.rsplit(".", 1)[-1]] = target
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    full = f"{_resolve(name, path.name == '__init__.py', node)}.{alias.name}"
                    if full in MODULES:
                        aliases[alias.asname or alias.name] = full
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not found, ", ".join(found)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_small(name):
    lines = MODULES[name].read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES})"


def test_every_doc_reference_in_the_code_resolves():
    """Docstrings and comments cite the design notes of this repository only."""
    root = PACKAGE.parent
    missing = []
    sources = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.yaml"), *(root / "bench").glob("*.py"),
               *(root / "examples").glob("*.py")]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        if "DESIGN.md" in text:
            missing.append(f"{path.relative_to(root)} cites DESIGN.md (not in this repo)")
        for ref in set(_doc_refs(text)):
            if not (root / ref).is_file():
                missing.append(f"{path.relative_to(root)} cites {ref}")
    assert not missing, ", ".join(missing)


def _doc_refs(text: str) -> list[str]:
    return re.findall(r"\b(docs/[\w./-]+\.md)\b", text)
