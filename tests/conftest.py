"""Shared fixtures: the fake NVML library (built once per session with gcc)."""

from tests.fakenvml.fixtures import fake_nvml_lib, fake_nvml_old_lib  # noqa: F401
