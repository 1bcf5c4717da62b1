"""The packages' imports run one way and never in a circle.

Layers, lowest first: the shared library ``edgespec`` (its generated ``edgespec.v1`` included);
the roles ``cache_service``, ``drafter_node`` and ``verifier_node``; the commands and the fleet
code above them, ``edgespec_cli``. A module may import its own layer or a lower one, never a
higher one, and the module graph has no cycle. Inside ``edgespec`` the subpackages are layered
the same way (``EDGESPEC_ORDER``, lowest first): the contract, the wire, the runner,
verification, models, heads, drafters, PAD (pivot-aware verification), the engine, and the client
SDK on top. Every import counts: at the top, under ``TYPE_CHECKING`` and inside functions alike
(read from the source, not by importing it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"edgespec": 0, "cache_service": 1, "drafter_node": 1, "verifier_node": 1,
          "edgespec_cli": 2}
EDGESPEC_ORDER = [("config", "jsonl_file", "v1"), ("protocol",), ("wire",), ("runner",),
                  ("verify",), ("models",), ("heads",), ("drafters",), ("pad",), ("engine",),
                  ("sdk",), ("client", "")]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    out = {}
    for top in LAYERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            out[_module_name(path)] = path
    return out


def imports_of(name: str, path: Path, known: set[str], unresolved: list[str] | None = None
               ) -> set[str]:
    """The project modules ``name`` imports anywhere in its source (``unresolved`` collects
    project names that are no module: a stale import after a move)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` names a submodule when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        # the module an import reads from must exist: ``import a.b``'s a.b, ``from a.b import
        # x``'s a.b
        read_from = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [base] if isinstance(node, ast.ImportFrom) else []
        for m in read_from:
            if unresolved is not None and m.split(".")[0] in LAYERS and m not in known:
                unresolved.append(f"{name} -> {m}")
        for t in targets:
            while t and t not in known:  # ``import a.b.c`` of a name inside a module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def _layer(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def test_no_module_imports_a_higher_layer():
    graph = import_graph()
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                    if _layer(b) > _layer(a))
    assert upward == []


def _sublayer(module: str) -> int:
    """The rank of an ``edgespec`` module's subpackage (``""``: the package itself)."""
    part = module.split(".")[1] if "." in module else ""
    for rank, names in enumerate(EDGESPEC_ORDER):
        if part in names:
            return rank
    raise AssertionError(f"{module}: edgespec.{part} has no place in EDGESPEC_ORDER")


def test_edgespec_subpackages_import_only_lower_ones():
    graph = import_graph()
    inside = {a: {b for b in deps if b.split(".")[0] == "edgespec"}
              for a, deps in graph.items() if a.split(".")[0] == "edgespec"}
    upward = sorted(f"{a} -> {b}" for a, deps in inside.items() for b in deps
                    if _sublayer(b) > _sublayer(a))
    assert upward == []
    # every module has a place, and the order is not vacuous: the engine reads the runner
    assert {_sublayer(m) for m in inside} == set(range(len(EDGESPEC_ORDER)))
    assert "edgespec.runner.target_runner" in inside["edgespec.engine.spec_engine"]


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert [" -> ".join(c) for c in cycles] == []


def test_every_project_import_names_a_module_that_exists():
    mods = project_modules()
    unresolved: list[str] = []
    for name, path in mods.items():
        imports_of(name, path, set(mods), unresolved)
    assert unresolved == []


def test_the_walker_sees_every_kind_of_import(tmp_path):
    """The checks above cannot pass by seeing nothing: imports at the top, relative ones, under
    TYPE_CHECKING and inside a function are all found in the real sources."""
    graph = import_graph()
    assert "edgespec.config" in graph["edgespec.protocol.local_store"]  # relative, at the top
    assert "edgespec.protocol.contract" in graph["cache_service.store"]  # absolute
    # inside a function (build_drafter imports the runner only for layers:L)
    assert "edgespec.runner.target_runner" in graph["edgespec.drafters"]
    assert "cache_service.metrics" in graph["cache_service.service"]  # under TYPE_CHECKING
    assert len(graph) > 60
