"""One base for gpumon's errors: every public exception class of every module derives from
GpumonError, so a caller catches them all in one clause, and keeps its builtin base."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpumon
from gpumon.agent.config import ConfigError
from gpumon.agent.recorder import RecordingError
from gpumon.errors import GpumonError

ROOT = Path(gpumon.__file__).resolve().parent.parent


def public_exception_classes() -> list[tuple[str, str, bool]]:
    """(module, class, derives from GpumonError) for every exception class a gpumon module
    defines under a public name."""
    found = []
    for module_info in pkgutil.walk_packages(gpumon.__path__, "gpumon.", onerror=_raise):
        if module_info.name.endswith(".__main__"):  # importing one runs its command
            continue
        module = importlib.import_module(module_info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__ and not name.startswith("_")):
                found.append((module.__name__, name, issubclass(obj, GpumonError)))
    return found


def _raise(name: str) -> None:
    raise ImportError(f"cannot import {name}")


def test_every_public_exception_class_derives_from_gpumon_error() -> None:
    # In a fresh interpreter: importing every module loads torch, Lightning, transformers and
    # DeepSpeed, which the tests that run after this one should not find loaded.
    walk = subprocess.run(
        [sys.executable, "-c", "import json; from tests.test_errors import "
         "public_exception_classes as f; print(json.dumps(f()))"],
        cwd=ROOT, capture_output=True, text=True, check=True)
    found = json.loads(walk.stdout.splitlines()[-1])
    assert len(found) >= 20  # the walk imported the package, not an empty path
    assert [f"{module}.{name}" for module, name, derives in found if not derives] == []


def test_an_error_is_still_its_builtin_base() -> None:
    with pytest.raises(ValueError):
        raise ConfigError("bad interval")
    error = RecordingError(13, "Permission denied", "run.jsonl")
    assert isinstance(error, OSError) and isinstance(error, GpumonError)
    assert (error.errno, error.filename) == (13, "run.jsonl")
