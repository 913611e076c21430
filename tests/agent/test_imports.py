"""Every module of the package imports on its own, first, in a fresh interpreter.

The exporter reads the agent's state types while the agent's lifecycle imports the exporter;
a module that only works when something else was imported before it hides a cycle that
bites the first user importing it directly.
"""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

PROBE = """
import importlib, pkgutil, sys
import gpumon
# The framework integrations import torch and Lightning or transformers (seconds each) and
# nothing of the agent: they are left out.
names = sorted(m.name for m in pkgutil.walk_packages(gpumon.__path__, "gpumon.")
               if not m.name.startswith("gpumon.client.integrations."))
failed = []
for name in names:
    for loaded in [n for n in sys.modules if n == "gpumon" or n.startswith("gpumon.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print(len(names))
print("\\n".join(failed))
"""


def test_each_module_imports_first() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    count, *failed = result.stdout.splitlines()
    assert int(count) >= 40  # the walk found the package, not an empty path
    assert [line for line in failed if line] == []
