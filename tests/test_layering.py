"""Which part of gpumon may import which: one table, checked against every module's syntax tree.

Each row names a package of gpumon (or a module that needs limits of its own) and what it may
import: other gpumon packages or single modules, and third-party libraries, at import time or
only inside a function. Imports within one top-level package are that package's own affair;
between packages the table is the law, so a new upward arrow, a library where it does not
belong, or a package the table does not name fails here. docs/architecture.md §2 tells the
same story in prose.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gpumon

PACKAGE = Path(gpumon.__file__).resolve().parent
ROOT = PACKAGE.parent

# Modules that read clocks, touch files, sockets or processes have no place in a pure layer.
IMPURE_STDLIB = frozenset({"time", "datetime", "os", "socket", "subprocess", "threading", "io",
                           "pathlib", "random", "logging"})


@dataclass(frozen=True)
class Allowed:
    """What one row may import besides the standard library and its own package."""

    gpumon: frozenset[str] = frozenset()
    """Other gpumon packages ("wire"), or single modules ("collectors.samples"); "gpumon" is
    the top-level package itself (its version)."""
    libraries: frozenset[str] = frozenset()
    """Third-party libraries it may import at import time."""
    lazy: frozenset[str] = frozenset()
    """Third-party libraries it may import only inside a function (or for type checking), and
    which importing any of its modules never loads, through whatever it imports."""
    pure: bool = False
    """No clock, file, socket, thread or process: nothing of IMPURE_STDLIB."""


def allow(gpumon: str = "", libraries: str = "", lazy: str = "",
          pure: bool = False) -> Allowed:
    return Allowed(frozenset(gpumon.split()), frozenset(libraries.split()),
                   frozenset(lazy.split()), pure)


# Bottom to top: a row may name only packages set down before its own.
LAYERS: dict[str, Allowed] = {
    "gpumon": allow(),
    # The base of every error gpumon raises: it imports nothing, so any row may be granted it.
    "errors": allow(),
    "wire": allow("errors"),
    "client": allow("gpumon wire", lazy="torch"),
    "client.core": allow("gpumon wire", lazy="torch"),
    "client.comm": allow("gpumon wire", lazy="torch"),
    "client.watchers": allow("gpumon wire", lazy="torch"),
    # The memory watcher imports torch as it loads: the rest of the client imports it only
    # inside watch(), once the model shows torch is there.
    "client.watchers.memory": allow("gpumon wire", libraries="torch"),
    # So do the DeepSpeed watchers, which watch() imports once it holds an engine.
    "client.watchers.deepspeed": allow("gpumon wire", libraries="torch"),
    "client.watchers.deepspeed_memory": allow("gpumon wire", libraries="torch"),
    # gpumon run's hooks: torch only once the job has imported it.
    "client.autowatch": allow("gpumon wire", lazy="torch"),
    "client.integrations": allow("gpumon wire", libraries="lightning pytorch_lightning "
                                 "transformers"),
    "collectors": allow("errors wire", libraries="psutil"),
    "collectors.nvml": allow("errors wire", libraries="pynvml"),
    # The kubelet's PodResources API: gRPC and the code protoc generated from its proto.
    "collectors.podresources": allow("errors wire", libraries="grpc google"),
    "analysis": allow("wire collectors.samples collectors.gpu_fields", pure=True),
    "state": allow("wire collectors.samples collectors.sender_shares analysis"),
    "sim": allow("errors client collectors.samples collectors.gpu_fields"),
    "export": allow("gpumon errors wire collectors analysis state",
                    libraries="prometheus_client bcrypt yaml"),
    "agent": allow("gpumon errors wire collectors collectors.nvml collectors.podresources analysis "
                   "state sim export",
                   libraries="prometheus_client"),
    # The collector table, read by the agent's configuration: each collector's module imports
    # what it starts only when it starts, and knows the agent by its protocol alone.
    "agent.collectors": allow("wire collectors state"),
    "commands": allow("gpumon errors wire collectors collectors.nvml analysis state sim export "
                      "agent client.autowatch client.core.identity client.core.run_name",
                      libraries="rich"),
    # The page of a run: above the commands, for the verdict replay gpumon classify does.
    "report": allow("errors wire collectors.samples analysis commands.classify", libraries="plotly"),
    "cli": allow("gpumon commands agent agent.collectors analysis sim report", libraries="typer"),
    "testing": allow("gpumon agent", libraries="prometheus_client psutil"),
    "testing.fakenvml": allow("errors"),
}


# The client's rooms, bottom to top, and the other rooms each may import. The step core knows
# no watcher; a watcher knows the core and is handed its monitor (client/core/seam.py); the
# hall (gpumon.client and its monitor.py) puts the two together; the integrations and
# gpumon run's hooks drive a monitor from outside.
ROOMS: dict[str, frozenset[str]] = {
    "client.core": frozenset(),
    "client.comm": frozenset({"client.core"}),
    "client.watchers": frozenset({"client.core", "client.comm"}),
    "client": frozenset({"client.core", "client.comm", "client.watchers"}),
    "client.integrations": frozenset({"client", "client.core", "client.watchers"}),
    "client.autowatch": frozenset({"client", "client.core"}),
}


@dataclass(frozen=True)
class Import:
    """One imported module as a module statement names it."""

    name: str
    kind: str
    """"module" (runs when the module is imported), "lazy" (inside a function) or "typing"
    (under ``if TYPE_CHECKING:``)."""
    line: int
    names: tuple[str, ...] = ()
    """What a ``from`` import takes from the module, submodules aside (each its own Import)."""


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.is_package = is_package
        self.found: list[Import] = []
        self._kind = "module"

    def _within(self, kind: str, nodes: list[ast.stmt]) -> None:
        outer, self._kind = self._kind, kind if self._kind == "module" else self._kind
        for node in nodes:
            self.visit(node)
        self._kind = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:  # noqa: N802
        self._within("lazy", node.body)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:  # noqa: N802
        self._within("lazy", node.body)

    def visit_If(self, node: ast.If) -> None:  # noqa: N802
        test = node.test
        if isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith(
                "TYPE_CHECKING"):
            self._within("typing", node.body)
            self._within(self._kind, node.orelse)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:  # noqa: N802
        self.found += [Import(alias.name, self._kind, node.lineno) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:  # noqa: N802
        base = node.module or ""
        if node.level:
            parts = self.module.split(".")[: len(self.module.split(".")) - node.level
                                           + self.is_package]
            base = ".".join(parts + ([base] if base else []))
        # "from gpumon.client.core import step_core" names the module gpumon.client.core.step_core.
        modules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
        self.found += [Import(name, self._kind, node.lineno) for name in modules]
        taken = tuple(a.name for a in node.names if f"{base}.{a.name}" not in MODULES)
        if taken:
            self.found.append(Import(base, self._kind, node.lineno, taken))


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    # The compiled modules, by the sources setup.py names for them (they import nothing).
    for call in ast.walk(ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))):
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "Extension":
            name, sources = call.args[0], next(k.value for k in call.keywords if k.arg == "sources")
            assert isinstance(name, ast.Constant) and isinstance(sources, ast.List)
            found[name.value] = ROOT / ast.literal_eval(sources.elts[0])
    return found


MODULES = _modules()
"""Every module of gpumon by dotted name (a compiled one by its C source), to its file."""


@functools.cache
def imports_of(module: str) -> tuple[Import, ...]:
    """What a gpumon module imports, with where the import runs."""
    path = MODULES[module]
    if path.suffix != ".py":
        return ()
    visitor = _Imports(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
    return tuple(visitor.found)


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a Python file imports, wherever in the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def row_of(module: str) -> str:
    """The table's row for a gpumon module: the longest row its dotted name falls under."""
    inner = module.removeprefix("gpumon").removeprefix(".") or "gpumon"
    rows = [row for row in LAYERS if inner == row or inner.startswith(row + ".")]
    assert rows, f"{module} falls under no row of the table"
    return max(rows, key=len)


def package_of(row: str) -> str:
    return row.split(".")[0]


def arrow_allowed(importer: str, target: str) -> bool:
    """Whether the gpumon module ``importer`` may import the gpumon module ``target``."""
    inner = target.removeprefix("gpumon").removeprefix(".") or "gpumon"
    row = row_of(importer)
    if package_of(row_of(target)) == package_of(row):
        return True
    granted = LAYERS[row].gpumon
    return (row_of(target) in granted
            or any(inner == g or inner.startswith(g + ".") for g in granted if "." in g))


def library(name: str) -> str | None:
    """The third-party library an import names, or None for gpumon and the standard library."""
    top = name.split(".")[0]
    if top in ("gpumon", "__future__") or top in sys.stdlib_module_names:
        return None
    return top


def all_imports() -> Iterator[tuple[str, Import]]:
    for module in MODULES:
        for found in imports_of(module):
            yield module, found


def at_import(module: str) -> set[str]:
    """Every module and library that importing ``module`` loads, through module-level imports."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        # Importing a.b.c runs a and a.b first.
        parts = name.split(".")
        chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        for step in chain:
            if step in seen:
                continue
            seen.add(step)
            if step in MODULES:
                todo += [i.name for i in imports_of(step) if i.kind == "module"]
    return seen


def test_the_table_names_every_package_and_nothing_else() -> None:
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    top_modules = {name for name in MODULES if name.count(".") == 1}
    expected = {name.removeprefix("gpumon.") for name in packages | top_modules if name != "gpumon"}
    assert len(expected) >= 12  # the walk found the package, not an empty path
    rows = {row for row in LAYERS if row != "gpumon"}
    assert expected - rows == set(), "packages the table does not name"
    assert {row for row in rows if f"gpumon.{row}" not in MODULES} == set(), "rows of nothing"
    granted = {g for allowed in LAYERS.values() for g in allowed.gpumon if g != "gpumon"}
    assert {g for g in granted if f"gpumon.{g}" not in MODULES} == set(), "grants of nothing"


def test_the_table_is_layered_bottom_to_top() -> None:
    # Each package may import only packages set down before it: the table has no cycle.
    order = list(dict.fromkeys(package_of(row) for row in LAYERS))
    for row, allowed in LAYERS.items():
        for granted in allowed.gpumon:
            below = package_of(row_of(f"gpumon.{granted}"))
            assert order.index(below) < order.index(package_of(row)), (row, granted)


def test_every_import_between_packages_is_in_the_table() -> None:
    arrows = [(module, i) for module, i in all_imports() if i.name.split(".")[0] == "gpumon"]
    assert len(arrows) >= 150
    upward = [f"{MODULES[m].relative_to(PACKAGE.parent)}:{i.line} imports {i.name}"
              for m, i in arrows if not arrow_allowed(m, i.name)]
    assert upward == [], "\n".join(upward)


def test_every_library_is_where_the_table_allows_it() -> None:
    misplaced = []
    for module, found in all_imports():
        name = library(found.name)
        if name is None:
            continue
        allowed = LAYERS[row_of(module)]
        ok = name in allowed.libraries or (found.kind != "module" and name in allowed.lazy)
        if not ok:
            misplaced.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{found.line} "
                             f"imports {found.name} ({found.kind})")
    assert misplaced == [], "\n".join(misplaced)


def test_lazy_libraries_are_never_loaded_by_an_import() -> None:
    checked = 0
    for module in MODULES:
        lazy = LAYERS[row_of(module)].lazy
        if not lazy:
            continue
        checked += 1
        loaded = {library(name) for name in at_import(module)} & lazy
        assert loaded == set(), (module, loaded)
    assert checked >= 10


def test_a_pure_layer_reads_no_clock_file_socket_or_process() -> None:
    pure = {row for row, allowed in LAYERS.items() if allowed.pure}
    assert pure == {"analysis"}
    impure = [f"{MODULES[m].relative_to(PACKAGE.parent)}:{i.line} imports {i.name}"
              for m, i in all_imports()
              if row_of(m) in pure and i.name.split(".")[0] in IMPURE_STDLIB]
    assert impure == [], "\n".join(impure)


def room_of(module: str) -> str:
    """The client's room a module of the client is in (the hall is "client")."""
    inner = module.removeprefix("gpumon.")
    return max((room for room in ROOMS if inner == room or inner.startswith(room + ".")), key=len)


def test_every_room_of_the_client_is_in_the_table_bottom_to_top() -> None:
    packages = {name.removeprefix("gpumon.") for name, path in MODULES.items()
                if name.startswith("gpumon.client.") and path.name == "__init__.py"
                and name.count(".") == 2}
    assert packages == set(ROOMS) - {"client"}
    order = list(ROOMS)
    for room, below in ROOMS.items():
        assert all(order.index(other) < order.index(room) for other in below), room


def test_each_room_of_the_client_imports_only_the_rooms_below_it() -> None:
    arrows = [(m, i) for m, i in all_imports()
              if m.startswith("gpumon.client") and i.name.startswith("gpumon.client.")]
    assert len(arrows) >= 80
    assert {room_of(m) for m, _ in arrows} == set(ROOMS)  # every room seen importing
    wrong = [f"{MODULES[m].relative_to(PACKAGE.parent)}:{i.line} imports {i.name}"
             for m, i in arrows
             if room_of(i.name) != room_of(m) and room_of(i.name) not in ROOMS[room_of(m)]]
    assert wrong == [], "\n".join(wrong)


CORE = "gpumon.client.core"


def private_to_the_core(found: Import) -> bool:
    """Whether an import takes what the client's core keeps to itself: a module of it, or a name
    from one, starting with ``_``. The compiled twin (``_hook``, from setup.py) keeps the
    underscore of a C accelerator, not of a private module: it may be absent, and each of its
    importers falls back to the Python twin."""
    if found.name != CORE and not found.name.startswith(CORE + "."):
        return False
    compiled = found.name in MODULES and MODULES[found.name].suffix != ".py"
    inner = found.name.removeprefix(CORE).split(".")[1:]
    return ((not compiled and any(part.startswith("_") for part in inner))
            or any(name.startswith("_") and not name.endswith("__") for name in found.names))


def test_nothing_outside_the_client_core_imports_what_it_keeps_private() -> None:
    # The watchers, the hall, the integrations, gpumon run's hooks and the rest of gpumon
    # reach the core through its public modules and names, so the core can change its own.
    arrows = [(m, i) for m, i in all_imports()
              if m != CORE and not m.startswith(CORE + ".") and i.name.startswith(CORE + ".")]
    assert len(arrows) >= 20
    assert {room_of(m) for m, _ in arrows if m.startswith("gpumon.client")} == set(ROOMS) - {
        "client.core"}
    private = [f"{MODULES[m].relative_to(PACKAGE.parent)}:{i.line} imports {i.name} "
               f"{', '.join(i.names)}" for m, i in arrows if private_to_the_core(i)]
    assert private == [], "\n".join(private)


def test_the_walk_sees_what_an_import_takes_from_the_core() -> None:
    walk = _Imports("gpumon.client.watchers.x", False)
    walk.visit(ast.parse("from gpumon.client.core import _hook, seam\n"
                         "from gpumon.client.core.stall import StallWatch, _own\n"
                         "from ..core._private import Public\n"))
    assert [(i.name, i.names, private_to_the_core(i)) for i in walk.found] == [
        ("gpumon.client.core._hook", (), False), ("gpumon.client.core.seam", (), False),
        ("gpumon.client.core.stall", ("StallWatch", "_own"), True),
        ("gpumon.client.core._private", ("Public",), True)]


def import_graph() -> dict[str, list[str]]:
    """Each gpumon module to the gpumon modules it imports, by imports of any kind (at import
    time, inside a function, for type checking)."""
    return {m: sorted({i.name for i in imports_of(m) if i.name in MODULES} - {m}) for m in MODULES}


def cycles_in(graph: dict[str, list[str]]) -> list[list[str]]:
    """One path around each set of nodes that reach each other (Tarjan's strongly connected
    components), from the set's first node back to it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                cycles.append(_path_around(component, graph))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles


def _path_around(component: set[str], graph: dict[str, list[str]]) -> list[str]:
    """The shortest cycle through a component's first node, found breadth first."""
    start = min(component)
    came_from: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for target in graph[node]:
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if target in component and target not in came_from:
                came_from[target] = node
                todo.append(target)
    raise AssertionError(f"no cycle through {start}")


def test_no_module_reaches_itself_through_its_imports() -> None:
    # A cycle of module-level imports makes a module fail when it is the first one imported;
    # one closed by an import inside a function or for type checking still ties its modules
    # into one knot, where neither half can change without the other.
    graph = import_graph()
    assert sum(map(len, graph.values())) >= 300  # the walk found the imports
    cycles = cycles_in(graph)
    assert cycles == [], "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_walk_sees_a_cycle_closed_by_a_lazy_or_typing_import() -> None:
    lazy = _Imports("gpumon.a", False)
    lazy.visit(ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from gpumon import b\ndef f():\n    import gpumon.wire\n"))
    assert [(i.name, i.kind) for i in lazy.found] == [
        ("typing", "module"), ("gpumon", "typing"), ("gpumon.wire", "lazy")]
    graph = {"a": ["b"], "b": ["c", "d"], "c": ["a"], "d": [], "e": ["a", "f"], "f": ["e"]}
    assert cycles_in(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert cycles_in({"a": ["b"], "b": []}) == []


def test_the_client_loads_no_framework_and_nothing_of_the_agent() -> None:
    for entry in ("gpumon.client", "gpumon.client.integrations.wrap"):
        loaded = at_import(entry)
        assert {library(name) for name in loaded} - {None} == set(), entry
        assert {package_of(row_of(name)) for name in loaded if name.startswith("gpumon")} <= {
            "gpumon", "errors", "wire", "client"}, entry
