"""Shared fixtures: the fake NVML library (built once per session with gcc), and ``agent``: one
agent per test, started as its module or test marks it (``@pytest.mark.agent``)."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumon.testing import library_agent, start_agent
from tests.helpers import RECORDING
from tests.testing.fakenvml_fixtures import fake_nvml_lib, fake_nvml_old_lib  # noqa: F401


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "agent(*args, library=False, record=False, socket='s.sock', **config): how the `agent` "
        "fixture starts its agent: a `gpumon agent` subprocess given ARGS (with record=True also "
        "`--record` to the test's recording file), or with library=True an Agent in the test's "
        "process, its socket at SOCKET under the test's directory and CONFIG its AgentConfig fields",
    )


@pytest.fixture
def agent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """The agent the test's ``agent`` marker describes, stopped after the test."""
    marker = request.node.get_closest_marker("agent")
    assert marker is not None, "the agent fixture is started as @pytest.mark.agent(...) says"
    config = dict(marker.kwargs)
    if config.pop("library", False):
        with library_agent(tmp_path / config.pop("socket", "s.sock"), **config) as node:
            yield node
        return
    args = list(marker.args)
    if config.pop("record", False):
        args += ["--record", str(tmp_path / RECORDING)]
    assert not config, f"a subprocess agent takes command-line arguments, not {config}"
    process = start_agent(tmp_path, *args)
    try:
        yield process
    finally:
        process.stop()
