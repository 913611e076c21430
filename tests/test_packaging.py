"""The package's declared facts match its code.

Every third-party module that ``gpumon/`` imports, at module level or lazily inside a function,
is a declared dependency or an optional extra; every declared dependency is imported; the
minimum Python in ``pyproject.toml`` is what the newest standard-library module and syntax
used need, and the README, mypy and the metadata say the same; the metadata reads without
setuptools' deprecation warnings (the license an SPDX expression).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpumon"

IMPORT_DISTRIBUTIONS = {
    "pynvml": "nvidia-ml-py",
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "grpc": "grpcio",
    "google": "protobuf",
}
"""Modules whose distribution has another name; any other module is looked for under its own."""

STDLIB_SINCE = {
    "tomllib": (3, 11),
    "wsgiref.types": (3, 11),
    "zoneinfo": (3, 9),
    "graphlib": (3, 9),
}
"""Standard-library modules newer than the oldest Python anyone would declare."""

NAMES_SINCE = {
    ("enum", "StrEnum"): (3, 11),
    ("typing", "Self"): (3, 11),
    ("typing", "Never"): (3, 11),
    ("typing", "assert_never"): (3, 11),
    ("typing", "reveal_type"): (3, 11),
    ("datetime", "UTC"): (3, 11),
    ("typing", "override"): (3, 12),
    ("itertools", "batched"): (3, 12),
}
"""Names imported from standard-library modules that gained them late."""

SYNTAX_SINCE: dict[type[ast.AST], tuple[int, int]] = {ast.Match: (3, 10), ast.TryStar: (3, 11)}
"""Syntax that older interpreters cannot parse (``match``, ``except*``)."""
if sys.version_info >= (3, 12):
    SYNTAX_SINCE[ast.TypeAlias] = (3, 12)

NOT_RUNTIME_EXTRAS = {"dev"}
"""Extras for working on gpumon, not for running it: the package itself may not need them."""


@dataclass(frozen=True)
class Import:
    module: str
    """The dotted module, as written."""
    names: tuple[str, ...]
    """Names taken from it (``from module import name``), else empty."""
    where: str
    fallback_for: tuple[str, ...] = ()
    """The modules of a ``try`` body this import replaces when they are missing (an ``except
    ImportError`` handler)."""

    @property
    def top(self) -> str:
        return self.module.split(".")[0]


class ImportCollector(ast.NodeVisitor):
    """Every absolute import of one file: statements anywhere (module level, functions,
    ``TYPE_CHECKING`` blocks) and ``importlib.import_module("literal")`` calls."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.found: list[Import] = []
        self.syntax: list[tuple[type[ast.AST], int]] = []
        self._fallback_for: tuple[str, ...] = ()

    def generic_visit(self, node: ast.AST) -> None:
        if type(node) in SYNTAX_SINCE:
            self.syntax.append((type(node), getattr(node, "lineno", 0)))
        super().generic_visit(node)

    def _add(self, node: ast.stmt | ast.expr, module: str, names: tuple[str, ...]) -> None:
        self.found.append(Import(module, names, f"{self.where}:{node.lineno}", self._fallback_for))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name, ())

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node, node.module, tuple(alias.name for alias in node.names))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node, node.args[0].value, ())
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        body_modules: list[str] = []
        for stmt in node.body:
            for child in ast.walk(stmt):
                if isinstance(child, ast.Import):
                    body_modules += [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                    body_modules.append(child.module)
        for stmt in node.body + node.orelse + node.finalbody:
            self.visit(stmt)
        for handler in node.handlers:
            catches = {getattr(t, "id", "") for t in _handler_types(handler)}
            outer = self._fallback_for
            if catches & {"ImportError", "ModuleNotFoundError"}:
                self._fallback_for = tuple(body_modules)
            self.visit(handler)
            self._fallback_for = outer


def _handler_types(handler: ast.ExceptHandler) -> list[ast.expr]:
    if handler.type is None:
        return []
    return list(handler.type.elts) if isinstance(handler.type, ast.Tuple) else [handler.type]


def package_imports() -> tuple[list[Import], list[tuple[type[ast.AST], str]]]:
    imports: list[Import] = []
    syntax: list[tuple[type[ast.AST], str]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        collector = ImportCollector(where)
        collector.visit(ast.parse(path.read_text(), filename=where))
        imports += collector.found
        syntax += [(kind, f"{where}:{line}") for kind, line in collector.syntax]
    return imports, syntax


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def distribution(module: str) -> str:
    top = module.split(".")[0]
    return str(canonicalize_name(IMPORT_DISTRIBUTIONS.get(top, top)))


def is_third_party(module: str) -> bool:
    top = module.split(".")[0]
    return top != "gpumon" and top not in sys.stdlib_module_names


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = pyproject()["project"]
    core = {str(canonicalize_name(Requirement(r).name)) for r in project["dependencies"]}
    extras = {
        extra: {str(canonicalize_name(Requirement(r).name)) for r in reqs}
        for extra, reqs in project["optional-dependencies"].items()
    }
    return core, extras


def minimum_python() -> tuple[int, int]:
    spec = pyproject()["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec)
    assert match, f"requires-python = {spec!r}: expected a plain lower bound like '>=3.11'"
    return int(match[1]), int(match[2])


def test_the_collector_sees_lazy_and_fallback_imports() -> None:
    source = (
        "import os\n"
        "def f():\n"
        "    import torch.distributed as dist\n"
        "    importlib.import_module('transformers')\n"
        "try:\n"
        "    import lightning.pytorch as pl\n"
        "except ImportError:\n"
        "    import pytorch_lightning as pl\n"
        "from . import sibling\n"
    )
    collector = ImportCollector("example.py")
    collector.visit(ast.parse(source))
    found = {i.module: i.fallback_for for i in collector.found}
    assert found == {"os": (), "torch.distributed": (), "transformers": (),
                     "lightning.pytorch": (), "pytorch_lightning": ("lightning.pytorch",)}


def test_every_third_party_import_is_declared() -> None:
    core, extras = declared()
    allowed = core.union(*(reqs for extra, reqs in extras.items() if extra not in NOT_RUNTIME_EXTRAS))
    imports, _ = package_imports()
    third_party = [i for i in imports if is_third_party(i.module)]
    assert {i.top for i in third_party} >= {"pynvml", "prometheus_client", "torch"}, \
        "the collector no longer finds the imports it is meant to check"
    undeclared = [
        f"{i.where}: {i.module} (distribution {distribution(i.module)})"
        for i in third_party
        if distribution(i.module) not in allowed
        # the older name of a package tried only when a declared one is missing
        and not any(distribution(m) in allowed for m in i.fallback_for)
    ]
    assert not undeclared, (
        "imported but neither a dependency nor an optional extra in pyproject.toml:\n"
        + "\n".join(undeclared)
    )


def test_every_dependency_is_imported() -> None:
    core, _ = declared()
    imports, _ = package_imports()
    used = {distribution(i.module) for i in imports if is_third_party(i.module)}
    assert core - used == set(), f"declared dependencies gpumon never imports: {sorted(core - used)}"


def newest_python_needed() -> tuple[tuple[int, int], list[str]]:
    imports, syntax = package_imports()
    needs: list[tuple[tuple[int, int], str]] = []
    for i in imports:
        if i.top not in sys.stdlib_module_names:
            continue
        for module, since in STDLIB_SINCE.items():
            if i.module == module or i.module.startswith(module + "."):
                needs.append((since, f"{i.where}: {i.module}"))
        for name in i.names:
            if (i.module, name) in NAMES_SINCE:
                needs.append((NAMES_SINCE[i.module, name], f"{i.where}: {i.module}.{name}"))
    needs += [(SYNTAX_SINCE[kind], f"{where}: {kind.__name__}") for kind, where in syntax]
    newest = max(since for since, _ in needs)
    return newest, [why for since, why in needs if since == newest]


def test_requires_python_is_what_the_code_needs() -> None:
    newest, why = newest_python_needed()
    declared_min = minimum_python()
    assert declared_min == newest, (
        f"requires-python says >={declared_min[0]}.{declared_min[1]}, the code needs "
        f"{newest[0]}.{newest[1]} for: " + ", ".join(why)
    )


def test_the_minimum_python_is_stated_alike_everywhere() -> None:
    major, minor = minimum_python()
    assert pyproject()["tool"]["mypy"]["python_version"] == f"{major}.{minor}"
    readme = (ROOT / "README.md").read_text()
    stated = set(re.findall(r"Python ≥ (\d+\.\d+)", readme))
    assert stated == {f"{major}.{minor}"}, f"README states Python ≥ {sorted(stated)}"


def test_the_license_is_an_spdx_expression_and_the_backend_reads_it() -> None:
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    build = {Requirement(r).name: Requirement(r).specifier for r in pyproject()["build-system"]["requires"]}
    setuptools_spec: SpecifierSet = build["setuptools"]
    # license expressions arrived in setuptools 77; an older backend would reject the string
    assert "77.0" in setuptools_spec and "76.9" not in setuptools_spec


def test_the_metadata_reads_without_deprecation_warnings() -> None:
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    dist = Distribution()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(dist, str(ROOT / "pyproject.toml"))
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.metadata.python_requires == ">={}.{}".format(*minimum_python())
