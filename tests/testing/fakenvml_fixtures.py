"""Pytest fixtures for the fake NVML library (gpumon.testing.fakenvml): built once per session.

Import them into a conftest or test module with::

    from tests.testing.fakenvml_fixtures import fake_nvml_lib, fake_nvml_old_lib  # noqa: F401

pynvml keeps the library it loaded in a module global, so load the fake in a
*fresh process* started with :func:`gpumon.testing.fakenvml.fake_nvml_env`::

    env = fake_nvml_env(fake_nvml_lib, SCENARIOS / "h100_8x.scn")
    subprocess.run([sys.executable, "-m", "gpumon", ...], env=env)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumon.testing.fakenvml import SCENARIOS, Scenario, build_fake_nvml, fake_nvml_env

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
