"""The analysis layer stays pure: stdlib, the protocol and the sample types only."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import gpumon.analysis

ALLOWED_GPUMON = {"gpumon.wire", "gpumon.collectors.samples"}
# Modules that read clocks, touch files, sockets or processes have no place in a pure layer.
FORBIDDEN_STDLIB = {"time", "datetime", "os", "socket", "subprocess", "threading", "io",
                    "pathlib", "random", "logging"}
PACKAGE = Path(gpumon.analysis.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_analysis_imports_only_what_the_layering_allows() -> None:
    modules = sorted(PACKAGE.glob("*.py"))
    assert len(modules) >= 7
    for path in modules:
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top == "gpumon":
                assert name in ALLOWED_GPUMON or name.startswith("gpumon.analysis"), (path, name)
            else:
                assert name == "__future__" or top in sys.stdlib_module_names, (path, name)
                assert top not in FORBIDDEN_STDLIB, (path, name)
