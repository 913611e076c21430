"""The NVML fault matrix on the fake library: the agent keeps serving and says what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumon.testing.fakenvml import SCENARIOS
from tests.helpers import agent_env, start_agent, value, values, wait_for

ALL_GROUPS = ("memory utilization power energy temperature clocks clock_reasons ecc nvlink "
              "pcie gpm mig processes events samples")


@pytest.mark.parametrize(("init_error", "message"), [
    ("LIB_RM_VERSION_MISMATCH", "NVML initialisation failed"),
    ("NO_PERMISSION", "no permission to access the GPU device files"),
    ("DRIVER_NOT_LOADED", "the NVIDIA kernel driver is not loaded"),
])
def test_init_failures_degrade_with_the_reason(tmp_path: Path, fake_nvml_lib: Path,
                                               init_error: str, message: str) -> None:
    scenario = tmp_path / "init.scn"
    scenario.write_text(f"init_error {init_error}\n")
    agent = start_agent(tmp_path, env=agent_env(fake_nvml_lib.parent, scenario))
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_host_memory_total_bytes"))
        assert value(agent.metrics(), "gpumon_nvml_up") == 0
        status, body = agent.json("/readyz")
        assert status == 200 and body["status"] == "degraded"
        assert any(message in p for p in body["problems"]), body
    finally:
        assert agent.stop() == 0


def test_every_getter_not_supported_leaves_identity_only(tmp_path: Path,
                                                         fake_nvml_lib: Path) -> None:
    scenario = tmp_path / "bare.scn"
    scenario.write_text("gpu_count 2\n" + "".join(
        f"gpu {gpu} unsupported {group}\n" for gpu in (0, 1) for group in ALL_GROUPS.split()))
    agent = start_agent(tmp_path, "--interval", "0.25",
                        env=agent_env(fake_nvml_lib.parent, scenario))
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_collector_last_success_timestamp_seconds",
                                collector="nvml"), what="a successful NVML cycle")
        m = agent.metrics()
        assert len(values(m, "gpumon_gpu_info")) == 2
        assert values(m, "gpumon_gpu_up") == [1.0, 1.0]
        gpu_series = {name for (name, _labels) in m if name.startswith("gpumon_gpu_")}
        assert gpu_series == {"gpumon_gpu_info", "gpumon_gpu_up"}
        assert values(m, "gpumon_collector_errors_total", collector="nvml") == []
        assert "NaN" not in agent.scrape()
    finally:
        assert agent.stop() == 0


def test_event_wait_errors_are_counted_not_fatal(tmp_path: Path, fake_nvml_lib: Path) -> None:
    scenario = tmp_path / "events.scn"
    scenario.write_text((SCENARIOS / "xid79.scn").read_text()
                        + "gpu 0 unsupported events\ngpu 1 unsupported events\n")
    agent = start_agent(tmp_path, "--interval", "0.25",
                        env=agent_env(fake_nvml_lib.parent, scenario))
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_gpu_power_watts"))
        assert values(agent.metrics(), "gpumon_gpu_xid_errors_total") == []
        assert agent.process.poll() is None
    finally:
        assert agent.stop() == 0


def test_a_gpu_appearing_after_start_is_picked_up(tmp_path: Path, fake_nvml_lib: Path) -> None:
    scenario = tmp_path / "hotplug.scn"
    scenario.write_text("gpu_count 1\ngpu 0 power_mw 300000\n")
    agent = start_agent(tmp_path, "--interval", "0.2",
                        env=agent_env(fake_nvml_lib.parent, scenario))
    try:
        wait_for(lambda: len(values(agent.metrics(), "gpumon_gpu_power_watts")) == 1)
        scenario.write_text("gpu_count 2\ngpu 0 power_mw 300000\ngpu 1 power_mw 412000\n")
        m = wait_for(lambda: (lambda m: values(m, "gpumon_gpu_power_watts", gpu="1") and m)(
            agent.metrics()), timeout=30, what="the new GPU's series")
        assert value(m, "gpumon_gpu_power_watts", gpu="1") == 412.0
        assert len(values(m, "gpumon_gpu_info")) == 2
        assert "new GPU(s) found: 1" in agent.log()
    finally:
        assert agent.stop() == 0
