"""The package layout: imports run one way, the way the step flows.

    ir  <-  kernels  <-  trace, planners, memgraph (the builder), engine  <-  the compile driver  <-  cli, demo, bench

A module may import its own stage and the stages to its left; the four stages of the middle column
do not import each other. Every module of turnip is parsed (not imported), so an import hidden inside
a function counts too, and so does a module named to ``importlib.import_module``.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import tomllib
from pathlib import Path

import networkx as nx
import pytest

# imports inside functions are allowed only where they load an optional dependency
OPTIONAL_LOCAL = {
    ("turnip.bench.suite", "turnip.bench.plots"),  # matplotlib
    ("turnip.bench.__main__", "turnip.bench.plots"),  # matplotlib
    ("turnip.bench.ablation", "turnip.bench.plots"),  # matplotlib
    ("turnip.bench.multi_gpu", "turnip.bench.plots"),  # matplotlib
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
    queue = list(tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
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
    return found + dynamic_imports_of(tree, local_nodes)


def dynamic_imports_of(tree: ast.Module, local_nodes: set[int]) -> list[tuple[str, bool]]:
    """Modules a module imports by name: a module that calls importlib.import_module imports every
    turnip module its string constants name (the name may travel through a table first)."""
    calls = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "import_module"
                for n in ast.walk(tree))
    if not calls:
        return []
    return [(n.value, id(n) in local_nodes) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("turnip.")
            and is_module(n.value)]


# The stages in import order: a module of a stage may import its own stage and any stage of a lower rank.
RANKS = {"ir": 0, "kernels": 1, "trace": 2, "planners": 2, "builder": 2, "engine": 2, "compile": 3, "application": 4}
# memgraph/ holds two stages: BuildMemGraph with its checker and tools, and the compile driver above the engine
MEMGRAPH_STAGES = {
    "builder": {"builder", "schedule", "horizons", "alloc", "packing", "implied_edges", "segments", "checker",
                "occupancy"},
    "compile": {"checkpoint", "compiler", "heap", "keep_transfers", "per_device", "progress", "ranks", "remake_offloaded",
                "report"},
}


def stage_of(module: str) -> str:
    """turnip.memgraph.horizons -> "builder"; turnip.memgraph (its __init__, which exports compile) ->
    "compile"; turnip.cli, turnip.bench.suite -> "application". A module of memgraph/ missing from
    MEMGRAPH_STAGES fails here: say which stage it belongs to."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("cli", "demo", "gpt", "__main__", "bench"):
        return "application"
    if parts[1] != "memgraph":
        assert parts[1] in RANKS, f"{module}: a package of no stage; add it to RANKS"
        return parts[1]
    if len(parts) == 2:
        return "compile"
    stage = next((s for s, names in MEMGRAPH_STAGES.items() if parts[2] in names), None)
    assert stage, f"{module}: add it to MEMGRAPH_STAGES (the builder or the compile driver)"
    return stage


def against_the_flow(edges: list[tuple[str, str, bool]]) -> list[str]:
    """Each import of a stage by a stage that may not import it, as "a -> b (stage -> stage)"."""
    wrong = []
    for src, dst, _ in edges:
        a, b = stage_of(src), stage_of(dst)
        if a != b and RANKS[b] >= RANKS[a]:
            wrong.append(f"{src} -> {dst} ({a} -> {b})")
    return sorted(set(wrong))


def package_of(module: str) -> str:
    """turnip.memgraph.builder -> turnip.memgraph; turnip.demo -> turnip (the application on top)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] not in ("demo", "__main__", "gpt", "cli") else "turnip"


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


def test_imports_run_with_the_flow(import_edges):
    wrong = against_the_flow(import_edges)
    assert not wrong, "imports against the flow (ir <- kernels <- trace, planners, builder, engine <- compile <- " \
                      f"application): {wrong}"


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
    a.write_text("from turnip.memgraph.builder import build\n")
    b.write_text("def f():\n    from turnip.ir import plan\n")
    edges = [("turnip.ir.plan", t, loc) for t, loc in imports_of("turnip.ir.plan", a)]
    edges += [("turnip.memgraph.builder", t, loc) for t, loc in imports_of("turnip.memgraph.builder", b)]
    assert edges == [("turnip.ir.plan", "turnip.memgraph.builder", False), ("turnip.memgraph.builder", "turnip.ir.plan", True)]
    assert list(nx.simple_cycles(nx.DiGraph((s, d) for s, d, _ in edges)))


def test_a_planted_import_against_the_flow_is_reported(tmp_path):
    """The direction check itself: the engine importing the compile driver, statically or through
    importlib, and the planner importing the builder (two stages of one rank) are reported; the engine
    importing kernels is not."""
    engine_module = tmp_path / "engine_module.py"
    engine_module.write_text("from turnip.memgraph.compiler import compile\nfrom turnip.kernels.launch import run_vertex\n"
                             "import importlib\n\ndef f():\n    return importlib.import_module('turnip.memgraph.report')\n")
    planner_module = tmp_path / "planner_module.py"
    planner_module.write_text("from turnip.memgraph.horizons import HorizonWalk\n")
    edges = [("turnip.engine.planted", t, loc) for t, loc in imports_of("turnip.engine.planted", engine_module)]
    edges += [("turnip.planners.planted", t, loc) for t, loc in imports_of("turnip.planners.planted", planner_module)]
    assert ("turnip.memgraph.report", True) in [(t, loc) for _, t, loc in edges]
    assert against_the_flow(edges) == [
        "turnip.engine.planted -> turnip.memgraph.compiler (engine -> compile)",
        "turnip.engine.planted -> turnip.memgraph.report (engine -> compile)",
        "turnip.planners.planted -> turnip.memgraph.horizons (planners -> builder)",
    ]
