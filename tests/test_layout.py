"""The package layout: imports run one way (ir <- kernels <- planners <- memgraph; ir <- kernels <- engine).

Every module of turnip is parsed (not imported), so an import hidden inside a function counts too.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import networkx as nx
import pytest

# imports inside functions are allowed only where they load an optional dependency
OPTIONAL_LOCAL = {
    ("turnip.bench.suite", "turnip.bench.plots"),  # matplotlib
    ("turnip.bench.__main__", "turnip.bench.plots"),  # matplotlib
    ("turnip.bench.ablation", "turnip.bench.plots"),  # matplotlib
    ("turnip.bench.models.sizes", "turnip.bench.models.llama"),  # transformers
}


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, AttributeError, ValueError):  # a name inside a module, not a module
        return False


def turnip_modules() -> dict[str, Path]:
    """Every module of turnip, by name, with its source file: the packages' folders and whatever they import
    (the packages live in folders mapped by pyproject's package-dir, so no single folder holds them all)."""
    found: dict[str, Path] = {}
    queue = ["turnip"]
    while queue:
        name = queue.pop()
        if name in found or not is_module(name):
            continue
        spec = importlib.util.find_spec(name)
        if not (spec.origin or "").endswith(".py"):
            continue
        found[name] = Path(spec.origin)
        if spec.submodule_search_locations:
            queue += [info.name for info in pkgutil.iter_modules(spec.submodule_search_locations, prefix=name + ".")]
        queue += [target for target, _ in imports_of(name, found[name])] + [name.rpartition(".")[0]]
    return found


def imports_of(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported turnip module, imported inside a function) for each import statement of a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    local_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from turnip import memgraph` imports the submodule turnip.memgraph
            targets = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "turnip":
                found.append((target, id(node) in local_nodes))
    return found


def package_of(module: str) -> str:
    """turnip.memgraph.build -> turnip.memgraph; turnip.demo -> turnip (the application on top)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] not in ("demo", "__main__") else "turnip"


@pytest.fixture(scope="module")
def import_edges() -> list[tuple[str, str, bool]]:
    modules = turnip_modules()
    assert {"turnip.ir", "turnip.memgraph", "turnip.planners", "turnip.engine", "turnip.kernels"} <= set(modules)
    return [(name, target, local) for name, path in modules.items()
            for target, local in imports_of(name, path) if target != name]


def test_no_import_cycle_between_packages(import_edges):
    graph = nx.DiGraph()
    for src, dst, _ in import_edges:
        a, b = package_of(src), package_of(dst)
        if a != b and a != "turnip":  # the root package re-exports; nothing below imports it for itself
            graph.add_edge(a, b)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"packages import each other: {cycles}"


def test_no_import_cycle_between_modules(import_edges):
    graph = nx.DiGraph((src, dst) for src, dst, _ in import_edges)
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, f"modules import each other: {cycles[:5]}"


def test_contracts_are_a_leaf(import_edges):
    outside = sorted({dst for src, dst, _ in import_edges if package_of(src) == "turnip.ir"
                      and package_of(dst) != "turnip.ir"})
    assert not outside, f"turnip.ir must import nothing else of turnip, imports {outside}"


def test_function_local_imports_only_for_optional_dependencies(import_edges):
    hidden = sorted({(src, dst) for src, dst, local in import_edges if local} - OPTIONAL_LOCAL)
    assert not hidden, f"imports inside functions (move them to the top of the module): {hidden}"


def test_walker_sees_a_planted_cycle(tmp_path):
    """The walker itself: a module that imports its importer is reported."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from turnip.memgraph.build import build\n")
    b.write_text("def f():\n    from turnip.ir import plan\n")
    edges = [("turnip.ir.plan", t, loc) for t, loc in imports_of("turnip.ir.plan", a)]
    edges += [("turnip.memgraph.build", t, loc) for t, loc in imports_of("turnip.memgraph.build", b)]
    assert edges == [("turnip.ir.plan", "turnip.memgraph.build", False), ("turnip.memgraph.build", "turnip.ir.plan", True)]
    assert list(nx.simple_cycles(nx.DiGraph((s, d) for s, d, _ in edges)))
