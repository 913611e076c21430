"""Pytest fixtures and helpers for the fake NVML library.

Import them into a conftest or test module with::

    from tests.fakenvml.fixtures import *  # noqa: F401,F403

pynvml keeps the library it loaded in a module global, so load the fake in a
*fresh process* started with :func:`fake_nvml_env`::

    env = fake_nvml_env(fake_nvml_lib, SCENARIOS / "h100_8x.scn")
    subprocess.run([sys.executable, "-m", "gpumon", ...], env=env)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.fakenvml.build import build_fake_nvml
from tests.fakenvml.scenario import SCENARIOS, Scenario

__all__ = [
    "SCENARIOS",
    "Scenario",
    "build_fake_nvml",
    "fake_nvml_env",
    "fake_nvml_lib",
    "fake_nvml_old_lib",
]


def _build_dir(tmp_path_factory: pytest.TempPathFactory, variant: str) -> Path:
    # A fixed directory under the session's base temp dir, so that importing
    # these fixtures into more than one module still compiles only once.
    return tmp_path_factory.getbasetemp() / "fakenvml" / variant


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the fake ``libnvidia-ml.so.1`` (current driver: all symbols)."""
    return build_fake_nvml(_build_dir(tmp_path_factory, "current"))


@pytest.fixture(scope="session")
def fake_nvml_old_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the old-driver variant, built with ``-DFAKE_NVML_OLD_DRIVER``."""
    return build_fake_nvml(_build_dir(tmp_path_factory, "old_driver"), old_driver=True)


def fake_nvml_env(
    lib: Path | None,
    scenario: Path | str | None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a child process that should load the fake library.

    ``lib`` is the path returned by the fixtures (its directory goes first on
    ``LD_LIBRARY_PATH``); ``None`` leaves the library off the path.
    ``scenario`` names the scenario file; ``None`` unsets FAKE_NVML_SCENARIO
    (nvmlInit then fails with DRIVER_NOT_LOADED).
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
