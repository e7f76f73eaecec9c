"""The package's layout: no import cycles, subsystems import in one direction, and no
class or function grows past a size a reader takes in at once.

The layers, lowest first: ``farm.defaults`` and ``farm.wire``; the shared top-level
modules (``startup``, ``summary``, ``runtime``); ``policies``, ``engines``, ``modelrepo``,
``simulation``; ``broker`` and ``workers``; ``client``; ``ops``; ``cli`` and
``benchsuite``.  No import runs back up.

The graph is read from the source with ``ast``: every import statement counts, at module
level, inside functions and under ``if TYPE_CHECKING:`` (a type-only cycle is a cycle
too).  Imports by name at run time (``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import farm

PACKAGE = Path(farm.__file__).parent

#: Subsystems that must not import the user-facing ones (``farm.client``, ``farm.cli``).
LOWER_SUBSYSTEMS = ("farm.broker", "farm.policies", "farm.engines", "farm.modelrepo")
USER_FACING = ("farm.client", "farm.cli")
#: The shared modules at the top of the package, below every subsystem.
SHARED = ("farm.defaults", "farm.startup", "farm.summary", "farm.runtime")
#: Everything below the client: none of it imports ``farm.client``.
BELOW_CLIENT = (
    "farm.broker",
    "farm.workers",
    "farm.engines",
    "farm.policies",
    "farm.modelrepo",
    "farm.simulation",
    "farm.wire",
    *SHARED,
)
#: The only importers of ``farm.ops`` (local farms, deployment), and of ``farm.cli``.
ABOVE_OPS = ("farm.ops", "farm.cli", "farm.benchsuite")
ABOVE_CLI = ("farm.cli", "farm.__main__")
#: The most methods one class may have, and lines one function may span.
MAX_METHODS = 35
MAX_FUNCTION_LINES = 60


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int


@dataclass
class ImportGraph:
    """farm's modules and the imports between them."""

    modules: set[str]
    edges: list[Edge] = field(default_factory=list)

    def targets(self, source: str) -> set[str]:
        return {edge.target for edge in self.edges if edge.source == source}

    def where(self, source: str, target: str) -> int:
        return next(e.line for e in self.edges if (e.source, e.target) == (source, target))


def module_name(path: Path) -> str:
    """``farm/engines/engine.py`` -> ``farm.engines.engine``; a package is its folder."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, with a relative one made absolute."""
    if node.level == 0:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imported(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]
) -> set[str]:
    """The farm modules one import statement loads (``from farm.x import y``: ``farm.x.y``
    when ``y`` is a submodule, else ``farm.x``)."""
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    else:
        base = absolute_base(module, is_package, node)
        names = {
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
            for alias in node.names
        }
    return {
        enclosing_module(name, modules)
        for name in names
        if name == "farm" or name.startswith("farm.")
    }


def enclosing_module(name: str, modules: set[str]) -> str:
    """The longest prefix of a dotted name that is a module of the package."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def build_graph() -> ImportGraph:
    files = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    graph = ImportGraph(set(files))
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(node, module, path.name == "__init__.py", graph.modules):
                    if target != module:
                        graph.edges.append(Edge(module, target, node.lineno))
    return graph


def strongly_connected(graph: ImportGraph) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each sorted."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for target in graph.targets(module):
            if target not in index:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in stack:
                lowest[module] = min(lowest[module], index[target])
        if lowest[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return components


def one_cycle(graph: ImportGraph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path back to it."""
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        module = frontier.pop(0)
        for target in sorted(graph.targets(module) & set(component)):
            if target == start:
                return [*paths[module], start]
            if target not in paths:
                paths[target] = [*paths[module], target]
                frontier.append(target)
    return component


def describe(graph: ImportGraph, component: list[str]) -> str:
    """One cycle of the component, ``a -> b (a line 3) -> a (b line 9)``, and the
    component's other members."""
    cycle = one_cycle(graph, component)
    steps = [cycle[0]] + [
        f"{target} ({source} line {graph.where(source, target)})"
        for source, target in zip(cycle, cycle[1:])
    ]
    others = sorted(set(component) - set(cycle))
    return " -> ".join(steps) + (f"; also in the cycle: {', '.join(others)}" if others else "")


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(f"{package}.") for package in packages)


def imports_across(
    graph: ImportGraph, sources: tuple[str, ...], targets: tuple[str, ...]
) -> list[str]:
    """Each import from a module in ``sources`` of one in ``targets``, with its line."""
    return sorted(
        f"{e.source} line {e.line} imports {e.target}"
        for e in graph.edges
        if within(e.source, sources) and within(e.target, targets)
    )


def imports_from_outside(graph: ImportGraph, allowed: tuple[str, ...], target: str) -> list[str]:
    """Each import of ``target`` by a module not in ``allowed``, with its line."""
    return sorted(
        f"{e.source} line {e.line} imports {e.target}"
        for e in graph.edges
        if within(e.target, (target,)) and not within(e.source, allowed)
    )


def report(what: str, offenders: list[str]) -> str:
    return f"{what}:\n  " + "\n  ".join(offenders)


def source_files() -> dict[Path, ast.Module]:
    """Every module of farm, parsed."""
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def where(path: Path, node: ast.AST, name: str) -> str:
    """``farm/ops/local.py:12 LocalFarm``."""
    return f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)} {name}"


def big_classes(limit: int) -> list[str]:
    """Classes with more than ``limit`` methods (nested functions are not methods)."""
    found = []
    for path, tree in source_files().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [
                    item
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
                if len(methods) > limit:
                    found.append(f"{where(path, node, node.name)} ({len(methods)} methods)")
    return found


def long_functions(limit: int) -> list[str]:
    """Functions and methods longer than ``limit`` lines, from the ``def`` line to the
    last line inclusive (decorators not counted)."""
    found = []
    for path, tree in source_files().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{where(path, node, node.name)} ({lines} lines)")
    return found


def test_the_graph_sees_imports_at_every_level() -> None:
    """Module-level, in-function and relative forms all reach the graph."""
    graph = build_graph()
    assert "farm.engines.engine" in graph.targets("farm.engines.autoselect")
    assert "farm.defaults" in graph.targets("farm.engines.engine")
    assert "farm.policies.base" in graph.targets("farm.policies")


def test_no_module_of_farm_is_part_of_an_import_cycle() -> None:
    graph = build_graph()
    cycles = [describe(graph, component) for component in strongly_connected(graph)]
    assert not cycles, "import cycles in farm:\n  " + "\n  ".join(cycles)


def test_lower_subsystems_do_not_import_the_client_or_the_cli() -> None:
    assert imports_across(build_graph(), LOWER_SUBSYSTEMS, USER_FACING) == []


def test_only_the_cli_and_the_benchmarks_import_ops() -> None:
    offenders = imports_from_outside(build_graph(), ABOVE_OPS, "farm.ops")
    assert not offenders, report("farm.ops imported from below it", offenders)


def test_nothing_but_the_cli_imports_the_cli() -> None:
    offenders = imports_from_outside(build_graph(), ABOVE_CLI, "farm.cli")
    assert not offenders, report("farm.cli imported from outside it", offenders)


def test_nothing_below_the_client_imports_it() -> None:
    offenders = imports_across(build_graph(), BELOW_CLIENT, ("farm.client",))
    assert not offenders, report("farm.client imported from below it", offenders)


def test_the_wire_imports_nothing_of_farm_but_defaults() -> None:
    graph = build_graph()
    offenders = [
        f"{e.source} line {e.line} imports {e.target}"
        for e in graph.edges
        if within(e.source, ("farm.wire",)) and not within(e.target, ("farm.wire", "farm.defaults"))
    ]
    assert not offenders, report("farm.wire imports other subsystems", sorted(offenders))


def test_the_layer_rules_name_the_offending_import() -> None:
    graph = ImportGraph({"farm.wire.link", "farm.ops.local", "farm.cli"})
    graph.edges.append(Edge("farm.wire.link", "farm.ops.local", 7))
    assert imports_from_outside(graph, ABOVE_OPS, "farm.ops") == [
        "farm.wire.link line 7 imports farm.ops.local"
    ]


def test_no_class_has_more_than_35_methods() -> None:
    offenders = big_classes(MAX_METHODS)
    assert not offenders, report(f"classes with more than {MAX_METHODS} methods", offenders)


def test_no_function_is_longer_than_60_lines() -> None:
    offenders = long_functions(MAX_FUNCTION_LINES)
    assert not offenders, report(f"functions over {MAX_FUNCTION_LINES} lines", offenders)


def test_policies_import_nothing_from_the_broker() -> None:
    assert imports_across(build_graph(), ("farm.policies",), ("farm.broker",)) == []


def test_the_engine_leaves_auto_and_the_checks_to_the_modules_above_it() -> None:
    graph = build_graph()
    assert not graph.targets("farm.engines.engine") & {
        "farm.engines.autoselect",
        "farm.engines.modelcheck",
    }
    assert graph.targets("farm.engines.tolerances") == set()


def test_the_broker_checks_engine_choices_without_importing_the_engines() -> None:
    """A job's engine choice is a wire struct (``farm.wire.engines``) checked as it is
    decoded: nothing in the broker needs ``farm.engines``."""
    assert imports_across(build_graph(), ("farm.broker",), ("farm.engines",)) == []
