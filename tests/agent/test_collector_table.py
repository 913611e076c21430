"""The collector table: the flag's choices and help, the configuration's default and the agent's
start loop all come from it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpumon.agent.collectors import COLLECTORS, DEFAULTS, NAMES
from gpumon.agent.config import AgentConfig, ConfigError, load_config
from gpumon.cli import app
from gpumon.testing.agent import library_agent
from tests.helpers import wait_for
from tests.test_layering import at_import, library


def test_the_flag_and_the_config_take_the_tables_names() -> None:
    assert AgentConfig().collectors == DEFAULTS
    assert load_config({"collectors": list(NAMES)}).collectors == NAMES
    with pytest.raises(ConfigError, match="choose from " + ", ".join(NAMES)):
        load_config({"collectors": ["gpus"]})
    help_text = " ".join(CliRunner().invoke(app, ["agent", "--help"],
                                            env={"COLUMNS": "300"}).output.split())
    for entry in COLLECTORS:
        assert f"{entry.name} ({entry.help})" in help_text


def test_reading_the_table_loads_no_collector() -> None:
    # The command line reads it for every command: each start function imports what it starts
    # when it runs.
    loaded = at_import("gpumon.agent.collectors")
    assert {library(name) for name in loaded} - {None} == set()
    assert {name for name in loaded if name.startswith("gpumon.")
            and not name.startswith("gpumon.agent.collectors")} == {"gpumon.agent"}


@pytest.mark.parametrize("collectors", [("ingest",), ("host", "ingest")])
def test_the_agent_starts_the_enabled_rows_only(tmp_path: Path,
                                                collectors: tuple[str, ...]) -> None:
    with library_agent(tmp_path / "s.sock", collectors=collectors, interval=0.1) as agent:
        wait_for(lambda: agent.state.snapshot(0.0).collectors.get("housekeeping"),
                 what="a housekeeping cycle")
        running = set(agent.state.snapshot(0.0).collectors) - {"housekeeping"}
        assert running == ({"host"} & set(collectors))
        assert (agent.ingest_status() is not None) == ("ingest" in collectors)
