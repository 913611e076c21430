"""The fake NVML library: a C stand-in for ``libnvidia-ml.so.1`` driven by scenario files.

The unmodified nvidia-ml-py binding loads it through ctypes, so the NVML collector, the agent
and the benchmarks run on machines without a GPU (README.md beside this file: the scenario
format and the NVML conventions it follows). pynvml keeps the library it loaded in a module
global, so the fake is loaded in a fresh process started with :func:`fake_nvml_env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from gpumon.testing.fakenvml.build import (
    BASE_FLAGS,
    LIBRARY_NAME,
    SOURCE,
    FakeNvmlBuildError,
    build_fake_nvml,
)
from gpumon.testing.fakenvml.scenario import GPM_METRICS, SCENARIOS, Scenario, gpu_defaults

__all__ = [
    "BASE_FLAGS",
    "GPM_METRICS",
    "LIBRARY_NAME",
    "SCENARIOS",
    "SOURCE",
    "FakeNvmlBuildError",
    "Scenario",
    "build_fake_nvml",
    "fake_nvml_env",
    "gpu_defaults",
]


def fake_nvml_env(
    lib: Path | None,
    scenario: Path | str | None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a child process that should load the fake library.

    ``lib`` is the library's path (its directory goes first on ``LD_LIBRARY_PATH``); ``None``
    leaves the library off the path. ``scenario`` names the scenario file; ``None`` unsets
    FAKE_NVML_SCENARIO (nvmlInit then fails with DRIVER_NOT_LOADED). ``base`` defaults to
    this process's environment.
    """
    env = dict(os.environ if base is None else base)
    if lib is not None:
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = str(Path(lib).parent) + (os.pathsep + old if old else "")
    if scenario is None:
        env.pop("FAKE_NVML_SCENARIO", None)
    else:
        env["FAKE_NVML_SCENARIO"] = str(scenario)
    return env
