"""The agent against the fake libnvidia-ml.so.1, loaded by the unmodified nvidia-ml-py.

Each test runs ``gpumon agent`` as a subprocess with LD_LIBRARY_PATH pointing at the fake
library and FAKE_NVML_SCENARIO at a scenario file; expectations are computed from the
same scenario file the library reads.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumon.testing.fakenvml import SCENARIOS, Scenario
from tests.helpers import (
    ROOT,
    AgentProcess,
    agent_env,
    free_port,
    http_get,
    require_tool,
    start_agent,
    start_prometheus,
    value,
    values,
    wait_for,
)

GOLDEN = Path(__file__).resolve().parent / "data" / "h100_8x.prom"
"""The whole scrape of an agent on the fake 8xH100 node, as it must read. Regenerated with
GPUMON_REWRITE_GOLDEN=1 (then read the diff before committing it)."""
VARIABLE_VALUES = re.compile(
    r"^(gpumon_collector_duration_seconds|gpumon_collector_last_success_timestamp_seconds"
    r"|gpumon_host_\w+|gpumon_agent_process_\w+)(\{.*\})? .*$")
"""Series whose values are this host's or this moment's, not the scenario's: their presence
and labels are compared, their values not."""
VARIABLE_LABELS = re.compile(
    r'\b(path|group|version|node|pod|namespace|container|slurm_job|slurm_step|user)="[^"]*"')
"""Labels naming this run's socket file, the user's group, the package's version, and whose a
process is on this host (a scenario's pid may be a live process here)."""

CLOCK_BITS = {"gpu_idle": 0x1, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
              "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40}


def run_agent(tmp_path: Path, lib: Path | None, scenario: Path | None,
              *args: str) -> AgentProcess:
    env = agent_env(lib.parent if lib else None, scenario)
    return start_agent(tmp_path, "--interval", "0.25", *args, env=env)


@pytest.fixture
def h100(tmp_path: Path, fake_nvml_lib: Path) -> Iterator[AgentProcess]:
    agent = run_agent(tmp_path, fake_nvml_lib, SCENARIOS / "h100_8x.scn")
    try:
        # GPM needs a pair of samples; the first full cycle has everything.
        wait_for(lambda: len(values(agent.metrics(), "gpumon_gpu_tensor_active_ratio")) == 8,
                 what="GPM metrics on all 8 GPUs")
        yield agent
    finally:
        assert agent.stop() == 0, agent.log()


def normalised(scrape: str) -> list[str]:
    """The scrape with only what varies from run to run replaced by a placeholder."""
    lines = []
    for line in scrape.splitlines():
        line = VARIABLE_LABELS.sub(lambda m: f'{m.group(1)}="<{m.group(1)}>"', line)
        lines.append(VARIABLE_VALUES.sub(lambda m: f"{m.group(1)}{m.group(2) or ''} <variable>", line))
    return lines


def test_golden_h100_scrape_diffed_whole(h100: AgentProcess) -> None:
    got = normalised(h100.scrape())
    if os.environ.get("GPUMON_REWRITE_GOLDEN"):
        GOLDEN.write_text("\n".join(got) + "\n")
    expected = GOLDEN.read_text().splitlines()
    diff = "\n".join(difflib.unified_diff(expected, got, str(GOLDEN), "scrape", lineterm=""))
    assert not diff, diff


def test_golden_h100_node_value_by_value(h100: AgentProcess) -> None:
    scenario = Scenario.load(SCENARIOS / "h100_8x.scn")
    m = h100.metrics()
    driver = scenario["driver_version"]
    for i in range(8):
        gpu = scenario.gpu(i)
        labels = {"gpu": str(i), "uuid": gpu["uuid"], "model": gpu["name"]}
        assert value(m, "gpumon_gpu_info", pci_bus_id=gpu["pci_bus_id"],
                     driver_version=driver, **labels) == 1
        assert value(m, "gpumon_gpu_up", **labels) == 1
        expected = {
            "gpumon_gpu_utilization_ratio": gpu.as_float("util_gpu") / 100,
            "gpumon_gpu_memory_utilization_ratio": gpu.as_float("util_memory") / 100,
            "gpumon_gpu_memory_used_bytes": gpu.as_int("memory_used"),
            "gpumon_gpu_memory_total_bytes": gpu.as_int("memory_total"),
            "gpumon_gpu_power_watts": gpu.as_int("power_mw") / 1000,            # mW -> W
            "gpumon_gpu_temperature_celsius": gpu.as_float("temperature_c"),
            "gpumon_gpu_memory_temperature_celsius": gpu.as_float("memory_temperature_c"),
            "gpumon_gpu_sm_clock_hertz": gpu.as_int("sm_clock_mhz") * 1e6,       # MHz -> Hz
            "gpumon_gpu_nvlink_transmit_bytes_total": gpu.as_int("nvlink_tx_kib") * 1024,  # KiB
            "gpumon_gpu_nvlink_receive_bytes_total": gpu.as_int("nvlink_rx_kib") * 1024,
            "gpumon_gpu_pcie_transmit_bytes_total": gpu.as_int("pcie_tx_bytes"),
            "gpumon_gpu_pcie_receive_bytes_total": gpu.as_int("pcie_rx_bytes"),
            "gpumon_gpu_sm_active_ratio": gpu.as_float("gpm_sm_util") / 100,     # % -> ratio
            "gpumon_gpu_sm_occupancy_ratio": gpu.as_float("gpm_sm_occupancy") / 100,
            "gpumon_gpu_tensor_active_ratio": gpu.as_float("gpm_tensor_util") / 100,
            "gpumon_gpu_dram_active_ratio": gpu.as_float("gpm_dram_bw_util") / 100,
        }
        for name, want in expected.items():
            assert value(m, name, **labels) == pytest.approx(want, rel=1e-9), (name, i)
        assert value(m, "gpumon_gpu_ecc_errors_total", type="corrected", **labels) == \
            gpu.as_int("ecc_corrected_volatile")
        assert value(m, "gpumon_gpu_ecc_errors_total", type="uncorrected", **labels) == \
            gpu.as_int("ecc_uncorrected_volatile")
        reasons = gpu.as_int("clock_event_reasons")
        for reason, bit in CLOCK_BITS.items():
            assert value(m, "gpumon_gpu_clock_event_active", reason=reason, **labels) == \
                (1.0 if reasons & bit else 0.0), (reason, i)
        processes = {int(pid): int(used) for pid, used in
                     (line.split()[3:5] for line in gpu.lines() if line.split()[2] == "process")}
        for pid, used in processes.items():
            assert value(m, "gpumon_gpu_process_memory_bytes", pid=str(pid), **labels) == used
        assert len(values(m, "gpumon_gpu_process_memory_bytes", gpu=str(i))) == len(processes)
    assert value(m, "gpumon_nvml_up") == 1
    assert not [k for k, v in m.items() if math.isnan(v)]


def test_promtool_check_metrics_clean_on_h100_scrape(h100: AgentProcess) -> None:
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "metrics"], input=h100.scrape(),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
        result.stdout + result.stderr


def test_real_prometheus_scrapes_scenario_values(h100: AgentProcess, tmp_path: Path) -> None:
    scenario = Scenario.load(SCENARIOS / "h100_8x.scn")
    prometheus = start_prometheus(tmp_path, [f"127.0.0.1:{h100.port}"])
    try:
        result = wait_for(lambda: prometheus.query('gpumon_gpu_power_watts{gpu="3"}'),
                          timeout=30, what="a scraped sample in Prometheus")
        assert float(result[0]["value"][1]) == scenario.gpu(3).as_int("power_mw") / 1000
        nvlink = prometheus.query('sum(gpumon_gpu_nvlink_transmit_bytes_total)')
        assert float(nvlink[0]["value"][1]) == \
            sum(scenario.gpu(i).as_int("nvlink_tx_kib") * 1024 for i in range(8))
        up = prometheus.query('up{job="gpumon"}')
        assert up[0]["value"][1] == "1"
    finally:
        prometheus.stop()


def test_not_supported_metrics_are_absent(tmp_path: Path, fake_nvml_lib: Path) -> None:
    agent = run_agent(tmp_path, fake_nvml_lib, SCENARIOS / "pcie_consumer.scn")
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_gpu_pcie_transmit_bytes_total"))
        time.sleep(0.6)  # several cycles: GPM would have had its pair by now
        m = agent.metrics()
        assert value(m, "gpumon_gpu_utilization_ratio", gpu="0") == 0.93
        assert value(m, "gpumon_gpu_clock_event_active", gpu="0", reason="sw_power_cap") == 1
        for absent in ("gpumon_gpu_nvlink_transmit_bytes_total", "gpumon_gpu_sm_active_ratio",
                       "gpumon_gpu_tensor_active_ratio", "gpumon_gpu_dram_active_ratio",
                       "gpumon_gpu_ecc_errors_total", "gpumon_gpu_memory_temperature_celsius"):
            assert values(m, absent) == [], absent
        assert "NaN" not in agent.scrape()
    finally:
        agent.stop()


def test_lost_gpu_is_down_and_others_keep_updating(tmp_path: Path, fake_nvml_lib: Path) -> None:
    agent = run_agent(tmp_path, fake_nvml_lib, SCENARIOS / "gpu_lost.scn")
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_gpu_up", gpu="2") == [0.0],
                 what="GPU 2 marked down")
        first = agent.metrics()
        time.sleep(1.0)
        second = agent.metrics()
        for gpu in ("0", "1", "3"):
            assert value(second, "gpumon_gpu_up", gpu=gpu) == 1
            assert value(second, "gpumon_gpu_nvlink_transmit_bytes_total", gpu=gpu) > \
                value(first, "gpumon_gpu_nvlink_transmit_bytes_total", gpu=gpu)
        assert values(second, "gpumon_gpu_power_watts", gpu="2") == []
        status, body = agent.json("/readyz")
        assert status == 200 and body["status"] == "degraded"
        assert "gpu lost: 2" in body["problems"]
    finally:
        assert agent.stop() == 0


def test_xid_79_is_counted(tmp_path: Path, fake_nvml_lib: Path) -> None:
    agent = run_agent(tmp_path, fake_nvml_lib, SCENARIOS / "xid79.scn")
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_gpu_xid_errors_total", xid="79"),
                 what="XID 79")
        m = agent.metrics()
        assert value(m, "gpumon_gpu_xid_errors_total", gpu="1", xid="79") == 1
        assert values(m, "gpumon_gpu_xid_errors_total", gpu="0") == []
    finally:
        assert agent.stop() == 0


def test_hanging_nvml_call_does_not_slow_scrapes(tmp_path: Path, fake_nvml_lib: Path) -> None:
    agent = run_agent(tmp_path, fake_nvml_lib, SCENARIOS / "hang.scn")
    try:
        # Every poll of both GPUs hangs 5 s in nvmlDeviceGetPowerUsage; scrapes must not wait.
        slowest = 0.0
        for _ in range(20):
            start = time.monotonic()
            status, _ = http_get(agent.url + "/metrics", timeout=4.0)
            slowest = max(slowest, time.monotonic() - start)
            assert status == 200
            time.sleep(0.2)
        assert slowest < 2.0, f"a scrape took {slowest:.1f}s while NVML hung"
        status, body = agent.json("/readyz")
        assert "gpu not answering NVML in time: 0, 1" in body["problems"], body
        m = agent.metrics()
        # Both GPUs are marked down; the collector itself keeps its schedule.
        assert values(m, "gpumon_gpu_up") == [0.0, 0.0]
        assert values(m, "gpumon_gpu_power_watts") == []
        assert value(m, "gpumon_collector_errors_total", collector="nvml", error="timeout") == 2
        assert values(m, "gpumon_collector_last_success_timestamp_seconds", collector="nvml")
    finally:
        agent.stop()


def test_one_hanging_gpu_delays_only_itself(tmp_path: Path, fake_nvml_lib: Path) -> None:
    scenario = tmp_path / "one_hangs.scn"
    scenario.write_text("gpu_count 4\ngpu 0 hang nvmlDeviceGetPowerUsage 3.0\n")
    agent = run_agent(tmp_path, fake_nvml_lib, scenario)
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_gpu_up", gpu="0") == [0.0],
                 what="GPU 0 marked down")
        for _ in range(8):  # two seconds of snapshots: the others stay fresh all along
            _, snap = agent.json("/api/v1/snapshot")
            gpus = {g["index"]: g for g in snap["gpus"]}
            assert gpus[0]["up"] is False and gpus[0]["error"] == "nvml_timeout"
            for index in (1, 2, 3):
                assert gpus[index]["up"] is True
                assert snap["t"] - gpus[index]["t"] < 1.0, (index, snap["t"] - gpus[index]["t"])
            time.sleep(0.25)
        m = agent.metrics()
        assert [value(m, "gpumon_gpu_up", gpu=str(i)) for i in range(4)] == [0, 1, 1, 1]
        status, body = agent.json("/readyz")
        assert "gpu not answering NVML in time: 0" in body["problems"], body
    finally:
        assert agent.stop() == 0, agent.log()


def test_a_gpu_lost_before_start_is_exported_down_and_retried(
        tmp_path: Path, fake_nvml_lib: Path) -> None:
    scenario = Scenario.load(SCENARIOS / "gpu_lost.scn")
    gpu = scenario.gpu(2)
    gpu["lost"] = "1"  # fell off the bus before the agent (re)started
    if "lost_after_s" in gpu:
        del gpu["lost_after_s"]
    path = tmp_path / "lost_at_start.scn"
    scenario.dump(path)
    agent = run_agent(tmp_path, fake_nvml_lib, path)
    try:
        m = wait_for(lambda: (lambda m: values(m, "gpumon_gpu_up", gpu="2") and m)(
            agent.metrics()), what="GPU 2 exported")
        assert value(m, "gpumon_gpu_up", gpu="2", uuid="", model="") == 0
        assert value(m, "gpumon_gpu_info", gpu="2", uuid="") == 1
        assert [value(m, "gpumon_gpu_up", gpu=str(i)) for i in (0, 1, 3)] == [1, 1, 1]
        status, body = agent.json("/readyz")
        assert body["status"] == "degraded" and "gpu lost: 2" in body["problems"], body
        # Back after a reset: opened at the next discovery, with its identity.
        gpu["lost"] = "0"
        scenario.dump(path)
        m = wait_for(lambda: (lambda m: values(m, "gpumon_gpu_up", gpu="2") == [1.0] and m)(
            agent.metrics()), timeout=30, what="GPU 2 back")
        assert value(m, "gpumon_gpu_up", gpu="2", uuid=gpu["uuid"]) == 1
        assert values(m, "gpumon_gpu_power_watts", gpu="2")
    finally:
        assert agent.stop() == 0, agent.log()


@pytest.mark.parametrize(
    ("scenario", "message"),
    [(None, "libnvidia-ml.so.1 not found"),
     ("driver_not_loaded.scn", "the NVIDIA kernel driver is not loaded")],
)
def test_no_nvml_serves_host_metrics_and_says_degraded(
        tmp_path: Path, fake_nvml_lib: Path, scenario: str | None, message: str) -> None:
    lib = fake_nvml_lib if scenario else None
    agent = run_agent(tmp_path, lib, SCENARIOS / scenario if scenario else None)
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_host_memory_total_bytes"))
        m = agent.metrics()
        assert value(m, "gpumon_nvml_up") == 0
        assert values(m, "gpumon_gpu_up") == []
        status, body = agent.json("/readyz")
        assert status == 200 and body["status"] == "degraded"
        assert any(message in p for p in body["problems"]), body
        assert agent.log().count(message) == 1  # said once, not every cycle
    finally:
        assert agent.stop() == 0


def test_old_driver_falls_back_to_older_symbols(tmp_path: Path, fake_nvml_old_lib: Path) -> None:
    scenario = Scenario.load(SCENARIOS / "old_driver.scn")
    agent = run_agent(tmp_path, fake_nvml_old_lib, SCENARIOS / "old_driver.scn")
    try:
        wait_for(lambda: values(agent.metrics(), "gpumon_gpu_temperature_celsius"))
        time.sleep(0.6)
        m = agent.metrics()
        gpu = scenario.gpu(0)
        assert value(m, "gpumon_gpu_temperature_celsius", gpu="0") == gpu.as_float("temperature_c")
        assert value(m, "gpumon_gpu_memory_used_bytes", gpu="0") == gpu.as_int("memory_used")
        assert values(m, "gpumon_gpu_clock_event_active", gpu="0")
        assert values(m, "gpumon_gpu_sm_active_ratio") == []  # no GPM before Hopper drivers
        assert values(m, "gpumon_gpu_process_memory_bytes", gpu="0")
        assert values(m, "gpumon_collector_errors_total", collector="nvml") == []
    finally:
        assert agent.stop() == 0, agent.log()


def run_doctor(lib: Path | None, scenario: Path | None, port: int = 9403) -> dict:
    result = subprocess.run([sys.executable, "-m", "gpumon.cli", "doctor", "--json",
                             "--port", str(port)], capture_output=True, text=True, timeout=60,
                            env=agent_env(lib.parent if lib else None, scenario), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_doctor_reports_metric_groups(fake_nvml_lib: Path) -> None:
    h100 = run_doctor(fake_nvml_lib, SCENARIOS / "h100_8x.scn")
    assert h100["nvml"]["ok"] and h100["nvml"]["gpus"] == 8 and h100["nvml"]["xid_events"]
    assert all(all(g["groups"].values()) for g in h100["gpus"]), h100["gpus"]
    consumer = run_doctor(fake_nvml_lib, SCENARIOS / "pcie_consumer.scn")
    groups = consumer["gpus"][0]["groups"]
    assert not groups["NVLink"] and not groups["GPM (SM/tensor/DRAM)"] and not groups["ECC"]
    assert groups["utilisation"] and groups["PCIe counters"]
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        missing = run_doctor(None, None, port)
    assert missing["nvml"]["ok"] is False
    assert "libnvidia-ml.so.1 not found" in missing["nvml"]["message"]
    checks = {c["check"]: c for c in missing["checks"]}
    assert checks[f"port {port}"] == {"check": f"port {port}", "ok": False, "detail": "in use"}
