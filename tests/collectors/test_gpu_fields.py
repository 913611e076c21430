"""The GPU field table: every row a GpuSample field NVML can answer, and a field added through
it (the memory temperature) reaching /metrics from the fake libnvidia-ml through the unmodified
nvidia-ml-py binding."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pynvml

from gpumon.analysis.window import GpuWindow
from gpumon.collectors.gpu_fields import GPU_FIELDS
from gpumon.collectors.samples import GpuSample
from tests.helpers import agent_env, start_agent, value, values, wait_for

NOT_FIELDS = {"index", "t", "up", "error", "clock_event_reasons", "ecc_errors_total",
              "process_memory_bytes"}
"""GpuSample's attributes that are not one scalar reading (identity, state, labelled maps)."""


def test_every_scalar_sample_field_has_one_row_and_every_row_a_field() -> None:
    names = [f.name for f in GPU_FIELDS]
    assert len(names) == len(set(names))
    sample_fields = {f.name for f in dataclasses.fields(GpuSample)} - NOT_FIELDS
    assert set(names) == sample_fields
    window_fields = {f.name for f in dataclasses.fields(GpuWindow)}
    assert {f.name for f in GPU_FIELDS if f.window} <= window_fields


def test_rows_name_real_nvml_fields_and_well_formed_families() -> None:
    metrics = [f.metric for f in GPU_FIELDS if f.metric is not None]
    assert len(metrics) == len(set(metrics))
    for row in GPU_FIELDS:
        if row.field_value:
            assert isinstance(getattr(pynvml, row.nvml), int), row.nvml
        if row.metric is not None:
            assert re.fullmatch(r"gpumon_gpu_[a-z_]+", row.metric), row.metric
            assert not row.metric.endswith("_total"), "counters are named without _total"
            assert row.help.endswith("."), row.metric
            assert row.kind in ("gauge", "counter")


SCENARIO = """\
driver_version 550.54.15
nvml_version 12.550.54.15
gpu 0 memory_temperature_c 83
gpu 1 temperature_c 40
gpu 2 memory_temperature_c 79
gpu 2 unsupported temperature
"""


def test_memory_temperature_reaches_metrics_through_the_binding(tmp_path: Path,
                                                                fake_nvml_lib: Path) -> None:
    """GPU 0 reports it, GPU 1 has no memory sensor, GPU 2's temperatures are NOT_SUPPORTED:
    a value for the first, no series (never a 0) for the others."""
    scenario = tmp_path / "memory_temperature.scn"
    scenario.write_text(SCENARIO)
    agent = start_agent(tmp_path, "--interval", "0.2",
                        env=agent_env(fake_nvml_lib.parent, scenario))
    try:
        m = wait_for(lambda: (lambda m: len(values(m, "gpumon_gpu_up")) == 3
                              and values(m, "gpumon_gpu_memory_temperature_celsius") and m)(
                                  agent.metrics()), what="a memory temperature")
        assert value(m, "gpumon_gpu_memory_temperature_celsius", gpu="0") == 83.0
        assert [g for g in ("1", "2")
                if values(m, "gpumon_gpu_memory_temperature_celsius", gpu=g)] == []
        assert value(m, "gpumon_gpu_temperature_celsius", gpu="1") == 40.0
    finally:
        assert agent.stop() == 0, agent.log()


NOT_SIMULATED = {"memory_temperature_celsius"}
"""Fields the simulator has no model of, absent from --simulate."""


def test_the_simulator_gives_every_field_it_models() -> None:
    from gpumon.sim.gpus import SimulatedSource

    source = SimulatedSource(1)
    source.sample(0.0, 0.0)
    sample = source.sample(1.0, 1.0)[0]  # rates need a previous poll
    missing = {f.name for f in GPU_FIELDS if getattr(sample, f.name) is None}
    assert missing == NOT_SIMULATED
