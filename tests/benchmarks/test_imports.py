"""The benchmarks stand on the package and its harness (gpumon.testing), never on the tests."""

from __future__ import annotations

from tests.helpers import ROOT
from tests.test_layering import imported_modules


def test_no_benchmark_imports_the_tests() -> None:
    # Hidden folders (the peers' venv, benchmarks/.peers-venv) hold other projects' code.
    scripts = sorted(p for p in (ROOT / "benchmarks").rglob("*.py")
                     if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))
    assert len(scripts) >= 15
    for path in scripts:
        names = imported_modules(path)
        assert not any(n == "tests" or n.startswith("tests.") for n in names), (path, names)
